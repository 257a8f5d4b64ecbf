"""The argmax the max kernels keep for the backward (ROIPooling, ROIAlign ``pool_mode='max'``).

It is bin-relative and stored in the smallest unsigned type that fits the call's bins
(:func:`mx_roi.cuda.tables.argmax_dtype`): ``uint8`` when no bin has more than 254
candidates (the common case: a quarter of an int32 argmax), else ``uint16`` (<= 65534),
else ``uint32``; the type's maximum value means "no winner".  ROIPooling stores
``(h - hstart) * (wend - wstart) + (w - wstart)``, ROIAlign ``iy * Gx + ix`` on the
padded Gy x Gx grid.

Each index type is forced here on the ``native`` and ``emulated-cuda`` backends (output
and gradient buffers pre-filled with garbage): forward and data gradient against the
NumPy backend and the scalar oracle of ``tests/reference.py``, native against the
emulation bit for bit, the saved argmax decoded independently against the NumPy
backend's own argmax, and the backward launched with the saved array's index type.
"""
import numpy as np
import pytest

import mxnet as mx

from mx_roi.backends import NumpyBackend
from mx_roi.cuda import loader
from mx_roi.cuda.backend import CudaBackend
from mx_roi.cuda.tables import argmax_dtype, int_bins_max_cells
from mx_roi.geometry import compute_dtype
from mx_roi.ndio import Kind
from mx_roi.registry import get_op
from tests import reference as ref

NATIVE = CudaBackend(Kind.NATIVE)
# the checked path's argmax (host tables: the exact dtype); the extension library's
# launcher keeps none (tests/test_library_calls.py compares it with the checked path)
NATIVE.library_calls = False
EMU = CudaBackend(Kind.EMULATED)
NUMPY = NumpyBackend()

U8, U16, U32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
CTYPE = {U8: "unsigned char", U16: "unsigned short", U32: "unsigned int"}

#: (rtol, atol) per dtype for gradients (summation orders differ) and the oracle
TOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}


@pytest.fixture(autouse=True)
def _threads_even_for_small_launches(monkeypatch):
    monkeypatch.setenv("MX_ROI_MIN_ITEMS_PER_THREAD", "1")
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")


# --------------------------------------------------------------------- the dtype rule
def test_argmax_dtype_thresholds():
    assert argmax_dtype(0) == U8 and argmax_dtype(1) == U8 and argmax_dtype(254) == U8
    assert argmax_dtype(255) == U16 and argmax_dtype(65534) == U16
    assert argmax_dtype(65535) == U32 and argmax_dtype(2 ** 31) == U32
    assert argmax_dtype(2 ** 32 - 2) == U32
    with pytest.raises(ValueError, match="too many"):
        argmax_dtype(2 ** 32 - 1)


def test_int_bins_max_cells_is_the_largest_bin():
    """Against a brute force over every bin, empty bins (reversed or clipped) included."""
    op = _op("ROIPooling", dict(pooled_size=(3, 4), spatial_scale=0.5))
    rng = np.random.default_rng(1)
    for trial in range(20):
        H, W = rng.integers(1, 30, 2)
        R = int(rng.integers(1, 6))
        rois = np.zeros((R, 5), np.float32)
        rois[:, 0] = rng.integers(-1, 2, R)
        rois[:, 1:3] = rng.uniform(-40, 2 * W + 40, (R, 2))
        rois[:, 3:5] = rois[:, 1:3] + rng.uniform(-20, 80, (R, 2))
        bins = op.geometry(rois, int(H), int(W), np)
        hl = np.maximum(bins.hend - bins.hstart, 0)
        wl = np.maximum(bins.wend - bins.wstart, 0)
        brute = int((hl[:, :, None] * wl[:, None, :]).max())
        assert int_bins_max_cells(bins) == brute, trial


# ------------------------------------------------------------- forcing each index type
def _op(name, params):
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**params))


#: (id, op, params, (N, C, H, W), saved argmax dtype)
CASES = [
    ("pool-7x7-uint8", "ROIPooling", dict(pooled_size=(7, 7), spatial_scale=1 / 16),
     (2, 5, 38, 50), U8),
    ("pool-1x1-uint16", "ROIPooling", dict(pooled_size=(1, 1), spatial_scale=1.0),
     (2, 3, 20, 20), U16),
    # (also the native backward's division path: more than 2^16 bin cells in one roi)
    ("pool-1x1-uint32", "ROIPooling", dict(pooled_size=(1, 1), spatial_scale=1.0),
     (1, 2, 300, 300), U32),
    ("align-7x7-uint8", "ROIAlign", dict(pooled_size=(7, 7), spatial_scale=1 / 16,
                                         sample_ratio=2, pool_mode="max"),
     (2, 5, 38, 50), U8),
    ("align-16x16-uint16", "ROIAlign", dict(pooled_size=(2, 3), spatial_scale=1.0,
                                            sample_ratio=16, aligned=True, pool_mode="max"),
     (2, 3, 20, 20), U16),
    # (also the native backward's division path: more than 2^16 sample points per bin)
    ("align-257x257-uint32", "ROIAlign", dict(pooled_size=(1, 1), spatial_scale=1.0,
                                              sample_ratio=257, pool_mode="max"),
     (1, 2, 12, 12), U32),
]


def _problem(case, dtype, seed=0):
    """Data: channel 0 a ramp growing in row-major order (every bin's winner is its last
    candidate: the largest indices, which a too small type would lose), the others with
    ties, NaN and -inf.  Rois: the whole map (the largest bins), one inside, one across
    the border (empty / partly outside bins), a padding roi (batch -1)."""
    _, name, params, (N, C, H, W), _ = case
    op = _op(name, params)
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal((N, C, H, W)) * 4) / 4          # many ties
    x[rng.random(x.shape) < 0.05] = np.nan
    x[rng.random(x.shape) < 0.03] = -np.inf
    x[:, 0] = np.arange(H * W).reshape(H, W) / (H * W)
    s = params["spatial_scale"]
    rois = np.array([[0, 0, 0, (W - 1) / s, (H - 1) / s],
                     [N - 1, 0.2 * W / s, 0.3 * H / s, 0.7 * W / s, 0.9 * H / s],
                     [N - 1, 0.6 * W / s, -0.5 * H / s, 1.4 * W / s, 0.4 * H / s],
                     [-1, 0, 0, (W - 1) / s, (H - 1) / s]])
    grad = rng.standard_normal(op.out_shape(x.shape, rois.shape))
    return op, x.astype(dtype), rois.astype(dtype), grad.astype(dtype)


def _nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def _run(backend, op, data, rois, grad):
    """Forward (keeping the argmax) + backward over garbage-filled buffers; returns the
    output, the data gradient and the saved argmax (None for NumPy's own format)."""
    out = _nd(np.full(op.out_shape(data.shape, rois.shape), np.nan, data.dtype))
    dgrad = _nd(np.full(data.shape, 1e3, data.dtype))
    x, r = _nd(data), _nd(rois)
    saved = backend.forward(op, "write", x, r, out, keep=True)
    backend.backward(op, "write", _nd(grad), x, r, dgrad, saved)
    return out.asnumpy(), dgrad.asnumpy(), getattr(saved, "value", saved)


_ORACLE = {}


def _oracle(case, dtype, data, rois, grad):
    """tests/reference.py's forward and gradient (slow: computed once per case)."""
    key = (case[0], np.dtype(dtype).name)
    if key not in _ORACLE:
        _, name, params, _, _ = case
        if name == "ROIPooling":
            p = (params["pooled_size"], params["spatial_scale"])
            _ORACLE[key] = (ref.roi_pooling_forward(data, rois, *p),
                            ref.roi_pooling_backward(data, rois, grad, *p))
        else:
            kw = dict(sample_ratio=params["sample_ratio"], aligned=params.get("aligned", False),
                      pool_mode="max")
            p = (params["pooled_size"], params["spatial_scale"])
            _ORACLE[key] = (ref.roi_align_forward(data, rois, *p, **kw),
                            ref.roi_align_backward(data, rois, grad, *p, **kw))
    return _ORACLE[key]


def _close(actual, expected, dtype, what):
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype), what
    t = TOL[np.dtype(dtype)]
    e = expected.astype(np.float64)
    atol = t * max(1.0, float(np.nanmax(np.abs(e))) if e.size else 1.0)
    np.testing.assert_allclose(actual.astype(np.float64), e, rtol=t, atol=atol, err_msg=what)


def _decoded(op, geo, arg, W):
    """The saved argmax (R, C, P, Q) as the NumPy backend's (R, P, Q, C) int: ROIPooling
    ``h * W + w`` (decoded with the bin's hstart, wstart, wend), ROIAlign ``iy * Gx + ix``;
    -1 for the sentinel."""
    none = arg == np.iinfo(arg.dtype).max
    k = arg.astype(np.int64)
    if op.name == "ROIPooling":
        hs = geo.hstart[:, None, :, None].astype(np.int64)
        ws = geo.wstart[:, None, None, :].astype(np.int64)
        wl = np.maximum(geo.wend - geo.wstart, 1)[:, None, None, :].astype(np.int64)
        k = (hs + k // wl) * W + ws + k % wl
    return np.where(none, -1, k).transpose(0, 2, 3, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16],
                         ids=["float32", "float64", "float16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_index_type_forward_and_gradient(case, dtype, launches):
    if case[4] == U32 and np.dtype(dtype) != np.float32:
        pytest.skip("the uint32 cases run once (float32): their oracle is slow")
    op, data, rois, grad = _problem(case, dtype)
    want_out, want_grad, _ = _run(NUMPY, op, data, rois, grad)
    results = {}
    for backend in (NATIVE, EMU):
        launches.clear()
        out, dgrad, arg = _run(backend, op, data, rois, grad)
        what = f"{case[0]} {np.dtype(dtype).name} {backend.name}"
        # the saved argmax: the expected index type, as many elements as the output
        assert arg.dtype == case[4] and arg.shape == out.shape, (what, arg.dtype)
        assert arg.nbytes == out.size * case[4].itemsize, what
        # forward and backward instantiated with that type (the backward: from the
        # saved array's dtype)
        kernels = [e for e in launches if "_forward" in e or "_backward" in e]
        assert len(kernels) == 2, (what, launches)
        assert all(e.endswith(f", {CTYPE[case[4]]}>") for e in kernels), (what, kernels)
        # the winners: the NumPy backend's own argmax, decoded independently
        geo = op.geometry(rois, data.shape[2], data.shape[3], np)
        _, np_arg = op.forward_numpy(geo, data.astype(compute_dtype(data.dtype)), keep=True)
        np.testing.assert_array_equal(_decoded(op, geo, arg, data.shape[3]), np_arg,
                                      err_msg=f"{what}: argmax")
        # the case reaches the top of its index type: a winner beyond the smaller type
        stored = arg[arg != np.iinfo(arg.dtype).max]
        smaller = {U8: 0, U16: 254, U32: 65534}[case[4]]
        assert stored.max() >= smaller, (what, stored.max())
        # max modes: the same candidates with the same operations -> the same values
        # (+0 and -0 may differ in a tie)
        np.testing.assert_array_equal(out, want_out, err_msg=f"{what}: forward vs numpy")
        assert not out[rois[:, 0] < 0].any(), f"{what}: padding roi"
        _close(dgrad, want_grad, dtype, f"{what}: data grad vs numpy")
        results[backend.name] = out, dgrad, arg
    (out_n, g_n, a_n), (out_e, g_e, a_e) = results["native"], results["emulated-cuda"]
    assert out_n.tobytes() == out_e.tobytes(), f"{case[0]}: forward native vs emulated"
    assert g_n.tobytes() == g_e.tobytes(), f"{case[0]}: gradient native vs emulated"
    np.testing.assert_array_equal(a_n, a_e)
    if np.dtype(dtype) != np.float16:  # the oracle computes float16 in float32 too
        ref_out, ref_grad = _oracle(case, dtype, data, rois, grad)
        np.testing.assert_array_equal(out_n, ref_out, err_msg=f"{case[0]}: forward vs oracle")
        _close(g_n, ref_grad, dtype, f"{case[0]}: data grad vs oracle")


@pytest.mark.parametrize("backend", [NATIVE, EMU], ids=["native", "emulated"])
def test_common_case_argmax_is_a_quarter_of_int32(backend):
    """7x7 bins on a 38x50 map (a detector's stride-16 feature map): every bin has at
    most 254 candidates, so the argmax is uint8 -- one byte per output element."""
    for name, params in (("ROIPooling", dict(pooled_size=(7, 7), spatial_scale=1 / 16)),
                         ("ROIAlign", dict(pooled_size=(7, 7), spatial_scale=1 / 16,
                                           sample_ratio=-1, pool_mode="max")),
                         ("ROIAlign", dict(pooled_size=(7, 7), spatial_scale=1 / 16,
                                           sample_ratio=2, pool_mode="max"))):
        op = _op(name, params)
        rng = np.random.default_rng(3)
        data = rng.standard_normal((1, 4, 38, 50)).astype(np.float32)
        rois = np.array([[0, 0, 0, 799, 607], [0, 100, 50, 400, 300], [0, 8, 8, 40, 40]],
                        np.float32)
        out = _nd(np.zeros(op.out_shape(data.shape, rois.shape), np.float32))
        saved = backend.forward(op, "write", _nd(data), _nd(rois), out, keep=True)
        assert saved.value.dtype == U8, name
        assert saved.value.nbytes == out.size


def test_inference_forward_allocates_no_argmax(launches):
    """keep=False: a one-element (uint8) dummy, nothing stored, no reduction needed."""
    case = CASES[2]                      # bins of 90000 cells: a training call needs uint32
    op, data, rois, _ = _problem(case, np.float32)
    out = _nd(np.zeros(op.out_shape(data.shape, rois.shape), np.float32))
    assert NATIVE.forward(op, "write", _nd(data), _nd(rois), out, keep=False) is None
    assert launches == ["roi_pooling_forward<float, float, unsigned char>"]
