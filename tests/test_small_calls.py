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
    calls = []
    real = type(op).geometry
    monkeypatch.setattr(op, "geometry",
                        lambda *a, **k: calls.append(1) or real(op, *a, **k))
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
