"""One NaN rule for every max mode, on every CPU backend (issue 20, item 1).

The rule (MXNet's ``roi_pooling.cc``/``.cu``): a non-empty bin starts at -FLT_MAX with
argmax -1 and a value replaces the running max only if strictly greater.  So NaN, -inf
and values <= -FLT_MAX never win; a bin nothing beat outputs -FLT_MAX (-inf in float16)
and passes no gradient; an empty bin outputs 0.  ROIAlign ``pool_mode='max'`` (and the
Caffe legacy grid) applies it to the bilinear samples: a sample with a NaN on any tap is
NaN; a point outside the map is 0.  The position-sensitive ops have no max mode.

Expected values come from :func:`rule_max` below (the rule written as a loop), from
``tests/reference.py`` / ``tests/legacy_reference.py`` (which never import mx_roi) and,
for ROIPooling, from ``mx.nd.ROIPooling`` itself.
"""
from __future__ import annotations

import itertools

import mxnet as mx
import numpy as np
import pytest

import mx_roi  # noqa: F401  (registers the ops)
from mx_roi.backends import NumpyBackend
from mx_roi.cuda.backend import CudaBackend
from mx_roi.ndio import Kind
from mx_roi.registry import get_op
from tests import legacy_reference as LR
from tests import reference as REF

FLT_MAX = float(np.finfo(np.float32).max)
BACKENDS = {"numpy": NumpyBackend(), "native": CudaBackend(Kind.NATIVE),
            "emulated-cuda": CudaBackend(Kind.EMULATED)}
ALIGN_MAX = [
    dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2, pool_mode="max"),
    dict(pooled_size=(1, 1), spatial_scale=1.0, sample_ratio=-1, aligned=True,
         pool_mode="max"),
    dict(pooled_size=(2, 2), spatial_scale=1.0, legacy="caffe"),
]


def make_op(name, params):
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**params))


def nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def run(backend, op, data, rois, grad):
    """Forward + backward through ``backend`` into garbage-filled buffers."""
    out = nd(np.full(op.out_shape(data.shape, rois.shape), 7.0, data.dtype))
    dgrad = nd(np.full(data.shape, -3.0, data.dtype))
    x, r = nd(data), nd(rois)
    saved = backend.forward(op, "write", x, r, out, keep=True)
    backend.backward(op, "write", nd(grad), x, r, dgrad, saved)
    return out.asnumpy(), dgrad.asnumpy()


def all_backends(name, params, data, rois, grad):
    """{backend: (out, dgrad)}; asserts every backend gives the same forward bits and the
    same gradient (to the last bits where the summation order differs: BLAS vs loops)."""
    op = make_op(name, params)
    res = {b: run(be, op, data, rois, grad) for b, be in BACKENDS.items()}
    out0, g0 = res["numpy"]
    for b, (o, g) in res.items():
        what = f"{name} {params} {b}"
        np.testing.assert_array_equal(o, out0, err_msg=f"forward {what}")
        np.testing.assert_array_equal(g != 0, g0 != 0, err_msg=f"gradient support {what}")
        np.testing.assert_allclose(g, g0, rtol=1e-6, atol=0, err_msg=f"gradient {what}")
    return out0, g0


def rule_max(values):
    """The documented rule over values in scan order: (max, index of the winner or -1)."""
    best, arg = np.float32(-FLT_MAX), -1
    for k, v in enumerate(values):
        if v > best:
            best, arg = v, k
    return best, arg


# ---- ROIPooling: a 4x4 map, one bin covering it (row-major scan order) ----------------
WHOLE = np.array([[0, 0, 0, 3, 3]], np.float32)


def pooling_case(values):
    data = np.asarray(values, np.float32).reshape(1, 1, 4, 4)
    grad = np.array([[[[2.5]]]], np.float32)
    return data, grad


def check_pooling(values, builtin=True):
    data, grad = pooling_case(values)
    params = dict(pooled_size=(1, 1), spatial_scale=1.0)
    out, dgrad = all_backends("ROIPooling", params, data, WHOLE, grad)
    best, arg = rule_max(data.ravel())
    np.testing.assert_array_equal(out.ravel(), [best])
    expect = np.zeros(16, np.float32)
    if arg >= 0:
        expect[arg] = 2.5
    np.testing.assert_array_equal(dgrad.ravel(), expect)
    np.testing.assert_array_equal(out, REF.roi_pooling_forward(data, WHOLE, (1, 1), 1.0))
    np.testing.assert_array_equal(dgrad,
                                  REF.roi_pooling_backward(data, WHOLE, grad, (1, 1), 1.0))
    if builtin:
        bo, bg = builtin_pooling(data, WHOLE, grad, (1, 1))
        np.testing.assert_array_equal(out, bo)
        np.testing.assert_array_equal(dgrad, bg)
    return out, dgrad


def builtin_pooling(data, rois, grad, pooled):
    x = nd(data)
    x.attach_grad()
    with mx.autograd.record():
        y = mx.nd.ROIPooling(x, nd(rois), pooled_size=pooled, spatial_scale=1.0)
    y.backward(nd(grad))
    return y.asnumpy(), x.grad.asnumpy()


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("pos", range(16))
def test_pooling_one_nan_every_position(pos, order):
    v = np.arange(16, dtype=np.float32)
    if order == "descending":
        v = v[::-1].copy()
    v[pos] = np.nan
    out, dgrad = check_pooling(v)
    assert not np.isnan(out).any()           # NaN never wins, wherever it sits
    assert dgrad.sum() == 2.5


def test_pooling_several_nans_inf_and_all_nan():
    rng = np.random.default_rng(0)
    for k in (2, 5, 15):
        for _ in range(3):
            v = rng.standard_normal(16).astype(np.float32)
            v[rng.choice(16, k, replace=False)] = np.nan
            check_pooling(v)
    out, dgrad = check_pooling(np.full(16, np.nan))
    np.testing.assert_array_equal(out.ravel(), [-FLT_MAX])   # nothing beat -FLT_MAX
    assert not dgrad.any()
    out, dgrad = check_pooling(np.full(16, -np.inf))
    np.testing.assert_array_equal(out.ravel(), [-FLT_MAX])
    assert not dgrad.any()
    v = np.full(16, np.nan, np.float32)
    v[[3, 9]] = -np.inf
    v[12] = -FLT_MAX                          # equal to the start value: does not win
    out, dgrad = check_pooling(v)
    np.testing.assert_array_equal(out.ravel(), [-FLT_MAX])
    assert not dgrad.any()
    for pos_inf, pos_nan in [(0, 5), (7, 2), (15, 0)]:
        v = np.arange(16, dtype=np.float32)
        v[pos_inf], v[pos_nan] = np.inf, np.nan
        out, dgrad = check_pooling(v)
        assert out.ravel()[0] == np.inf and dgrad.ravel()[pos_inf] == 2.5
    v = np.full(16, np.inf, np.float32)
    v[0] = np.nan
    out, dgrad = check_pooling(v)             # first +inf wins the tie
    assert dgrad.ravel()[1] == 2.5 and dgrad.sum() == 2.5


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_pooling_dtypes_match_builtin(dtype):
    """float16: -FLT_MAX stored is -inf; float64: values below -FLT_MAX never win."""
    params = dict(pooled_size=(2, 2), spatial_scale=1.0)
    rois = np.array([[0, 0, 0, 3, 3]], dtype)
    grad = np.arange(1, 5, dtype=dtype).reshape(1, 1, 2, 2)
    data = np.arange(16, dtype=np.float64).reshape(1, 1, 4, 4)
    data[0, 0, 0, :2] = np.nan                       # bin (0, 0): NaN, 1 ... 5
    data[0, 0, :2, 2:] = np.nan                      # bin (0, 1): all NaN
    data[0, 0, 2:, :2] = -np.inf                     # bin (1, 0): all -inf
    if dtype == np.float64:
        data[0, 0, 2:, 2:] = [[-1e300, -1e39], [np.nan, -1e300]]   # bin (1, 1): below
    data = data.astype(dtype)
    out, dgrad = all_backends("ROIPooling", params, data, rois, grad)
    bo, bg = builtin_pooling(data, rois, grad, (2, 2))
    np.testing.assert_array_equal(out, bo)
    np.testing.assert_array_equal(dgrad, bg)
    low = dtype(-np.inf) if dtype == np.float16 else dtype(-FLT_MAX)
    assert out[0, 0, 0, 1] == low and out[0, 0, 1, 0] == low
    if dtype == np.float64:
        assert out[0, 0, 1, 1] == low


def test_pooling_empty_bin_is_zero_next_to_nan_bins():
    # a roi past the map: some bins clip to nothing (0, no gradient), the others all NaN
    data = np.full((1, 1, 4, 4), np.nan, np.float32)
    rois = np.array([[0, 2, 2, 9, 9]], np.float32)
    grad = np.ones((1, 1, 3, 3), np.float32)
    out, dgrad = all_backends("ROIPooling", dict(pooled_size=(3, 3), spatial_scale=1.0),
                              data, rois, grad)
    assert set(np.unique(out)) == {np.float32(0), np.float32(-FLT_MAX)}
    assert (out == 0).any() and not dgrad.any()
    bo, _ = builtin_pooling(data, rois, grad, (3, 3))
    np.testing.assert_array_equal(out, bo)


# ---- ROIAlign max and the Caffe legacy grid ---------------------------------------------
def align_problem(values, rois=None, C=2):
    plane = np.asarray(values, np.float32).reshape(4, 4)
    data = np.stack([plane, plane[::-1, ::-1]])[:C].reshape(1, C, 4, 4)  # 2 scan orders
    if rois is None:
        rois = np.array([[0, 0.3, 0.2, 2.9, 3.0], [0, -1.5, -1.2, 2.0, 1.5]], np.float32)
    return np.ascontiguousarray(data), rois


def align_reference(params, data, rois, grad):
    if params.get("legacy") == "caffe":
        return (LR.caffe_roi_align_forward(data, rois, params["pooled_size"], 1.0),
                LR.caffe_roi_align_backward(data, rois, grad, params["pooled_size"], 1.0))
    kw = dict(sample_ratio=params["sample_ratio"], aligned=params.get("aligned", False),
              pool_mode="max")
    return (REF.roi_align_forward(data, rois, params["pooled_size"], 1.0, **kw),
            REF.roi_align_backward(data, rois, grad, params["pooled_size"], 1.0, **kw))


def check_align(params, values, rois=None):
    data, rois = align_problem(values, rois)
    op = make_op("ROIAlign", params)
    rng = np.random.default_rng(1)
    grad = rng.uniform(0.5, 1.5, op.out_shape(data.shape, rois.shape)).astype(np.float32)
    out, dgrad = all_backends("ROIAlign", params, data, rois, grad)
    ro, rg = align_reference(params, data, rois, grad)
    np.testing.assert_allclose(out, ro, rtol=1e-6, atol=0, err_msg=str(params))
    np.testing.assert_allclose(dgrad, rg, rtol=1e-5, atol=1e-6, err_msg=str(params))
    assert not np.isnan(out).any() and not np.isnan(dgrad).any()
    return out, dgrad


@pytest.mark.parametrize("params", ALIGN_MAX, ids=["max", "max-aligned", "caffe"])
def test_align_max_one_nan_every_position(params):
    for pos in range(16):
        v = np.arange(16, dtype=np.float32) * 0.5 - 3
        v[pos] = np.nan
        check_align(params, v)


@pytest.mark.parametrize("params", ALIGN_MAX, ids=["max", "max-aligned", "caffe"])
def test_align_max_nans_infs_all_nan(params):
    rng = np.random.default_rng(2)
    for k in (2, 6, 12):
        v = rng.standard_normal(16).astype(np.float32)
        v[rng.choice(16, k, replace=False)] = np.nan
        check_align(params, v)
    out, dgrad = check_align(params, np.full(16, np.nan))
    # bins with points give -FLT_MAX unless an outside point (0) is among them
    assert set(np.unique(out)) <= {np.float32(-FLT_MAX), np.float32(0)}
    assert (out == np.float32(-FLT_MAX)).any() and not dgrad.any()
    out, dgrad = check_align(params, np.full(16, -np.inf))
    assert (out == np.float32(-FLT_MAX)).any() and not dgrad.any()
    v = np.full(16, np.nan, np.float32)
    v[5] = np.inf
    check_align(params, v)
    v = np.arange(16, dtype=np.float32)
    v[[0, 15]] = -np.inf
    v[[6, 9]] = np.inf
    check_align(params, v)


def test_align_max_outside_point_is_zero_next_to_nan():
    """An outside point names taps with weight 0; a NaN there does not make it NaN."""
    params = ALIGN_MAX[0]
    v = np.full(16, -5.0, np.float32)
    v[0] = np.nan
    rois = np.array([[0, -3.5, -3.5, -1.5, -1.5]], np.float32)  # every point outside
    out, dgrad = check_align(params, v, rois)
    assert (out == 0).all() and not dgrad.any()


def test_ps_ops_have_no_max_mode():
    for name in ("PSROIPooling", "PSROIAlign"):
        fields = get_op(name).param_cls.__dataclass_fields__
        assert "pool_mode" not in fields, name


def test_entry_point_parity_with_builtin(monkeypatch):
    """Through mx.nd.Custom with each CPU backend selected by MX_ROI_BACKEND."""
    v = np.arange(16, dtype=np.float32)
    v[[0, 6]] = np.nan
    data, grad = pooling_case(v)
    bo, bg = builtin_pooling(data, WHOLE, grad, (1, 1))
    for name in BACKENDS:
        monkeypatch.setenv("MX_ROI_BACKEND", name)
        x = nd(data)
        x.attach_grad()
        with mx.autograd.record():
            y = mx.nd.Custom(x, nd(WHOLE), op_type="ROIPooling", pooled_size=(1, 1),
                             spatial_scale=1.0)
        y.backward(nd(grad))
        np.testing.assert_array_equal(y.asnumpy(), bo, err_msg=name)
        np.testing.assert_array_equal(x.grad.asnumpy(), bg, err_msg=name)
    assert list(itertools.chain(bo.ravel())) == [15.0]
