"""Per-call overheads (issue 18): a training forward keeps its geometry for the backward.

The backward reuses the forward's geometry tables (and the NumPy kernels' separable
matrices) only when its rois and map size are the forward's; otherwise it rebuilds
everything, argmax included, from its own inputs.
"""
import mxnet as mx
import numpy as np
import pytest

import mx_roi  # noqa: F401  (registers the ops)
from mx_roi import backends, kernels_numpy as K, registry
from mx_roi.saved import keep_for_backward, unpack_saved

CPU_BACKENDS = ["numpy", "native"]
OPS = [("ROIAlign", dict(pooled_size="(3, 2)", spatial_scale="0.5", sample_ratio="2")),
       ("ROIAlign", dict(pooled_size="(2, 2)", spatial_scale="0.5", pool_mode="max")),
       ("ROIPooling", dict(pooled_size="(2, 3)", spatial_scale="0.5")),
       ("PSROIPooling", dict(pooled_size="(2, 2)", output_dim="3", group_size="2",
                             spatial_scale="0.5")),
       ("PSROIAlign", dict(pooled_size="(2, 2)", output_dim="3", spatial_scale="0.5",
                           sample_ratio="2"))]


def _op(name, kwargs):
    cls = registry.get_op(name)
    return cls(cls.param_cls.from_kwargs(**kwargs))


def _inputs(op, seed=0):
    rng = np.random.RandomState(seed)
    channels = 12
    data = rng.standard_normal((2, channels, 9, 11)).astype(np.float32)
    rois = np.array([[0, 1, 2, 15, 14], [1, 0, 0, 20, 17], [0, 6, 3, 9, 12],
                     [1, 3.5, 2.2, 11.7, 16.1]], np.float32)
    grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(np.float32)
    return data, rois, grad


def _nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def _fresh(backend, op, data, rois, grad):
    """Backward without a forward's saved state (rebuilds everything)."""
    dgrad = _nd(np.full(data.shape, 7.0, np.float32))  # garbage: write must overwrite
    backend.backward(op, "write", _nd(grad), _nd(data), _nd(rois), dgrad, None)
    return dgrad.asnumpy()


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
@pytest.mark.parametrize("name,kwargs", OPS)
def test_geometry_built_once_per_training_step(backend_name, name, kwargs, monkeypatch):
    if backend_name == "native" and not backends.native_available(_op(name, kwargs).cuda_source):
        pytest.skip("no C++ compiler for the native backend")
    op = _op(name, kwargs)
    data, rois, grad = _inputs(op)
    backend = backends.get(backend_name)
    # the checked path (the extension library builds its tables in compiled code
    # inside its one call, forward and backward: tests/test_library_calls.py)
    monkeypatch.setattr(backend, "library_calls", False, raising=False)
    calls = []
    real = type(op).geometry
    monkeypatch.setattr(op, "geometry",
                        lambda *a, **k: calls.append(1) or real(op, *a, **k))
    # the host builds fill the tables from the compiled geometry: its builds count too
    from mx_roi.cuda.compiled_geometry import CompiledGeometry
    real_build = CompiledGeometry.build
    monkeypatch.setattr(CompiledGeometry, "build",
                        lambda self, *a, **k: calls.append(1) or real_build(self, *a, **k))
    taps = []
    real_tap = K.tap_matrix
    monkeypatch.setattr(K, "tap_matrix", lambda *a, **k: taps.append(1) or real_tap(*a, **k))
    out = _nd(np.full(op.out_shape(data.shape, rois.shape), 5.0, np.float32))
    x, r = _nd(data), _nd(rois)
    saved = backend.forward(op, "write", x, r, out, keep=True)
    dgrad = _nd(np.full(data.shape, 7.0, np.float32))
    taps_fwd = len(taps)
    backend.backward(op, "write", _nd(grad), x, r, dgrad, saved)
    assert len(calls) == 1, "the backward rebuilt the forward's geometry"
    if backend_name == "numpy" and name == "ROIAlign" and "pool_mode" not in kwargs:
        assert taps_fwd == 2 and len(taps) == 2, "separable matrices rebuilt"
    monkeypatch.undo()
    np.testing.assert_array_equal(dgrad.asnumpy(), _fresh(backend, op, data, rois, grad))


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
@pytest.mark.parametrize("name,kwargs", OPS)
def test_other_rois_in_backward_rebuild_everything(backend_name, name, kwargs):
    if backend_name == "native" and not backends.native_available(_op(name, kwargs).cuda_source):
        pytest.skip("no C++ compiler for the native backend")
    op = _op(name, kwargs)
    data, rois, grad = _inputs(op)
    backend = backends.get(backend_name)
    out = _nd(np.zeros(op.out_shape(data.shape, rois.shape), np.float32))
    x = _nd(data)
    saved = backend.forward(op, "write", x, _nd(rois), out, keep=True)
    moved = rois.copy()
    moved[:, 1:] = moved[:, 1:] * 0.5 + 1.0
    dgrad = _nd(np.full(data.shape, 7.0, np.float32))
    backend.backward(op, "write", _nd(grad), x, _nd(moved), dgrad, saved)
    np.testing.assert_array_equal(dgrad.asnumpy(), _fresh(backend, op, data, moved, grad))


def test_unpack_saved_rules():
    rois = np.array([[0, 1, 2, 3, 4]], np.float32)
    s = keep_for_backward("arg", rois, (5, 6), "geo")
    rois[0, 1] = 9  # the forward's copy is unaffected by later writes
    assert unpack_saved(s, np.array([[0, 1, 2, 3, 4]], np.float32), (5, 6)) == (
        "arg", "geo")
    assert unpack_saved(s, rois, (5, 6)) == (None, None)
    assert unpack_saved(s, np.array([[0, 1, 2, 3, 4]], np.float32), (5, 7)) == (
        None, None)
    assert unpack_saved(s, np.array([[0, 1, 2, 3, 4]], np.float64), (5, 6)) == (
        None, None)
    assert unpack_saved("plain", rois, (5, 6)) == ("plain", None)
    assert unpack_saved(None, rois, (5, 6)) == (None, None)


# ---- small calls: no helper thread, per-parameter tables built once -------------------

SMALL_CASES = [("ROIAlign", dict(pooled_size="(7, 7)", spatial_scale="0.0625",
                                 sample_ratio="2")),
               ("ROIAlign", dict(pooled_size="(7, 7)", spatial_scale="0.0625",
                                 sample_ratio="2", pool_mode="max")),
               ("ROIPooling", dict(pooled_size="(7, 7)", spatial_scale="0.0625")),
               ("PSROIPooling", dict(pooled_size="(7, 7)", output_dim="16", group_size="2",
                                     spatial_scale="0.0625")),
               ("PSROIAlign", dict(pooled_size="(7, 7)", output_dim="16", group_size="2",
                                   spatial_scale="0.0625", sample_ratio="2"))]


def _small_inputs(op):
    """Issue 18's small call: 1 image, 64 channels, 19x25 map, 16 boxes."""
    rng = np.random.RandomState(3)
    data = rng.standard_normal((1, 64, 19, 25)).astype(np.float32)
    xy = np.sort(rng.uniform(0, 390, (16, 2, 2)), axis=1)        # x1 <= x2, y1 <= y2
    rois = np.zeros((16, 5), np.float32)
    rois[:, 1:] = np.stack([xy[:, 0, 0], xy[:, 0, 1] * 0.75, xy[:, 1, 0], xy[:, 1, 1] * 0.75], 1)
    grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(np.float32)
    return data, rois, grad


@pytest.mark.parametrize("name,kwargs", SMALL_CASES)
def test_small_call_starts_no_helper_thread(name, kwargs, monkeypatch):
    """A small call of the NumPy kernels runs on the calling thread: the pool is never
    asked for a thread (starting or waking one costs more than 16 rois of work)."""
    from mx_roi import parallel
    op = _op(name, kwargs)
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")

    def no_pool(n):
        raise AssertionError(f"a small call asked the pool for {n} thread(s)")

    monkeypatch.setattr(parallel, "_executor", no_pool)
    data, rois, grad = _small_inputs(op)
    backend = backends.get("numpy")
    out = _nd(np.full(op.out_shape(data.shape, rois.shape), 5.0, np.float32))
    x, r = _nd(data), _nd(rois)
    saved = backend.forward(op, "write", x, r, out, keep=True)
    dgrad = _nd(np.full(data.shape, 7.0, np.float32))
    backend.backward(op, "write", _nd(grad), x, r, dgrad, saved)
    assert np.isfinite(out.asnumpy()).all() and np.isfinite(dgrad.asnumpy()).all()
    assert np.abs(dgrad.asnumpy()).sum() > 0


def test_position_sensitive_tables_built_once_per_parameters(monkeypatch):
    """The PS ops' channel map and group cells depend only on the parameters: built once
    per parameter set, shared by every op instance (MXNet makes one per call), and
    read-only so that no kernel can change them for the next call."""
    from mx_roi import geometry
    ps = pytest.importorskip("mx_roi.operators.psroi_pooling")
    monkeypatch.setattr(ps, "_HOST_TABLES", {})
    built = []
    real = geometry.ps_channel_map
    monkeypatch.setattr(geometry, "ps_channel_map", lambda *a, **k: built.append(1) or
                        real(*a, **k))
    kwargs = dict(pooled_size="(3, 3)", output_dim="2", spatial_scale="0.5")
    maps = [_op(name, kwargs).channel_map() for name in ("PSROIPooling", "PSROIPooling")]
    assert len(built) == 1
    np.testing.assert_array_equal(maps[0], real(2, (3, 3), (3, 3)))
    with pytest.raises(ValueError, match="read-only"):
        maps[1][0, 0, 0] = 5
    args = _op("PSROIPooling", kwargs).group_args()
    np.testing.assert_array_equal(args[2], geometry.group_index(3, 3))
    other = _op("PSROIPooling", dict(kwargs, output_dim="3")).channel_map()
    assert len(built) == 2 and other.shape == (3, 3, 3)
