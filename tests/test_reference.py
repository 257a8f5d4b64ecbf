"""The scalar references of ``tests/reference.py`` against MXNet 1.9.1's built-in ops.

Forward and data gradient (autograd) of ``mx.nd.ROIPooling`` and
``mx.nd.contrib.ROIAlign`` (with and without ``position_sensitive``) on random and
adversarial inputs, float32 and float64.  Only inputs the built-ins handle like the
specification are used: batch indices in [0, N) (ROIPooling zeroes out-of-range ones,
ROIAlign only zeroes one element for a negative index), and positive-size boxes with
aligned=True (the built-in aborts the process on the others).
``mx.nd.contrib.PSROIPooling`` has no CPU implementation in MXNet 1.9.1, so the
PSROIPooling reference is checked by the op tests' hand-computed cases only.
This module does not import mx_roi.
"""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from tests import reference as ref
from tests.ops.base import adversarial_rois, make_data, random_rois

DTYPES = [np.float32, np.float64]


def _builtin(fn, data, rois, grad, **params):
    x = mx.nd.array(data, dtype=data.dtype)
    r = mx.nd.array(rois, dtype=data.dtype)
    x.attach_grad()
    with autograd.record():
        y = fn(x, r, **params)
    y.backward(mx.nd.array(grad, dtype=data.dtype))
    return y.asnumpy(), x.grad.asnumpy()


def _positive(rois, scale, aligned):
    T = ref.compute_dtype(rois.dtype)
    r = rois.astype(T)
    s = T(np.float32(scale))
    off = T(0.5) if aligned else T(0)
    return (((r[:, 3] * s - off) - (r[:, 1] * s - off)) > 0) & \
        (((r[:, 4] * s - off) - (r[:, 2] * s - off)) > 0)


def _problem(rng, dtype, C, scale, kind, PH, PW, N=2, H=9, W=11):
    data = make_data(rng, (N, C, H, W), dtype, kind)
    rois = np.concatenate([adversarial_rois(rng, N, H, W, scale, dtype=dtype),
                           random_rois(rng, 8, N, H, W, scale, dtype)])
    return data, rois


def _assert(actual, expected, dtype, what, exact=False):
    if exact:
        np.testing.assert_array_equal(actual, expected, err_msg=what)
    else:
        tol = 1e-6 if dtype == np.float32 else 1e-13
        np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.0625, 0.7])
@pytest.mark.parametrize("kind", ["randn", "relu", "int", "neg"])
def test_roi_pooling_reference_vs_builtin(dtype, scale, kind):
    rng = np.random.default_rng(0)
    for PH, PW in [(2, 2), (3, 2), (1, 4)]:
        data, rois = _problem(rng, dtype, 3, scale, kind, PH, PW)
        grad = make_data(rng, (rois.shape[0], 3, PH, PW), dtype)
        out, dg = _builtin(mx.nd.ROIPooling, data, rois, grad, pooled_size=(PH, PW),
                           spatial_scale=scale)
        what = f"ROIPooling {PH}x{PW} scale={scale} {kind}"
        _assert(ref.roi_pooling_forward(data, rois, (PH, PW), scale), out, dtype, what, True)
        _assert(ref.roi_pooling_backward(data, rois, grad, (PH, PW), scale), dg, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sample_ratio", [-1, 1, 2])
@pytest.mark.parametrize("position_sensitive", [False, True])
def test_roi_align_reference_vs_builtin(dtype, aligned, sample_ratio, position_sensitive):
    rng = np.random.default_rng(1)
    O = 2
    for scale in (1.0, 0.0625, 0.7):
        for PH, PW in ([(2, 2), (3, 3)] if position_sensitive else [(2, 2), (3, 2), (1, 3)]):
            C = O * PH * PW if position_sensitive else 3
            data, rois = _problem(rng, dtype, C, scale, "randn", PH, PW)
            if aligned:
                rois = rois[_positive(rois, scale, True)]
            cout = O if position_sensitive else C
            grad = make_data(rng, (rois.shape[0], cout, PH, PW), dtype)
            out, dg = _builtin(mx.nd.contrib.ROIAlign, data, rois, grad, pooled_size=(PH, PW),
                               spatial_scale=scale, sample_ratio=sample_ratio,
                               aligned=aligned, position_sensitive=position_sensitive)
            what = f"ROIAlign {PH}x{PW} scale={scale} ps={position_sensitive}"
            if position_sensitive:
                rout = ref.psroi_align_forward(data, rois, (PH, PW), O, scale, sample_ratio,
                                               aligned, PH)
                rdg = ref.psroi_align_backward(data, rois, grad, (PH, PW), O, scale,
                                               sample_ratio, aligned, PH)
            else:
                rout = ref.roi_align_forward(data, rois, (PH, PW), scale, sample_ratio,
                                             aligned)
                rdg = ref.roi_align_backward(data, rois, grad, (PH, PW), scale, sample_ratio,
                                             aligned)
            _assert(rout, out, dtype, what)
            _assert(rdg, dg, dtype, what)


def test_c_round():
    assert ref.c_round(0.5) == 1 and ref.c_round(-0.5) == -1
    assert ref.c_round(1.5) == 2 and ref.c_round(2.5) == 3 and ref.c_round(-2.5) == -3
    assert ref.c_round(0.49999997) == 0 and ref.c_round(0.49999999999999994) == 0
    assert ref.c_round(np.float32(2.4999998)) == 2
    assert ref.c_round(-0.2) == 0 and ref.c_round(7.0) == 7


def test_psroi_pooling_reference_hand_computed():
    """A 1-roi, 2x2-bin case worked by hand: roi (0, 0.4, 1.6, 3.5, 4.49) at scale 0.5:
    rounded raw coords x 0..4(+1)=5, y 2..4(+1)=5 -> start (0, 1), end (2.5, 2.5);
    bins of 1.25 x 0.75: h [1,2), [1,3) ... checked against a direct sum."""
    O, P = 1, 2
    rng = np.random.default_rng(2)
    data = rng.standard_normal((1, O * P * P, 4, 4))
    rois = np.array([[0, 0.4, 1.6, 3.5, 4.49]])
    out = ref.psroi_pooling_forward(data, rois, P, O, 0.5)
    start_w, start_h = 0.0 * 0.5, 2.0 * 0.5
    end_w, end_h = (4 + 1) * 0.5, (4 + 1) * 0.5
    bw, bh = (end_w - start_w) / P, (end_h - start_h) / P
    expected = np.zeros((1, O, P, P))
    for i in range(P):
        for j in range(P):
            hs, he = int(np.floor(i * bh + start_h)), int(np.ceil((i + 1) * bh + start_h))
            ws, we = int(np.floor(j * bw + start_w)), int(np.ceil((j + 1) * bw + start_w))
            hs, he = min(max(hs, 0), 4), min(max(he, 0), 4)
            ws, we = min(max(ws, 0), 4), min(max(we, 0), 4)
            expected[0, 0, i, j] = data[0, i * P + j, hs:he, ws:we].mean()
    np.testing.assert_allclose(out, expected, rtol=1e-12)
