"""Legacy compatibility modes (issue 8): ROIAlign(legacy='caffe'), PSROIAlign(legacy='rfcn').

Forward against scalar transcriptions of the forks' CUDA kernels (tests/legacy_reference.py),
backward against the true gradient of those forwards and against float64 finite
differences.  Everything goes through ``mx.nd.Custom`` on the CPU context, so the backend
is whatever ``MX_ROI_BACKEND`` selects (numpy, emulated-cuda); only the table-invariant
tests call :mod:`mx_roi.geometry` directly.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

import mx_roi  # noqa: F401  (registers the op types)
from mx_roi import geometry
from tests import legacy_reference as lref

# ------------------------------------------------------------------------------- helpers


def run(op_type, data, rois, params, grad=None):
    """Forward (and backward with ``grad``) through mx.nd.Custom; NumPy arrays back."""
    x = mx.nd.array(data, dtype=data.dtype)
    r = mx.nd.array(rois, dtype=rois.dtype)
    if grad is None:
        return mx.nd.Custom(x, r, op_type=op_type, **params).asnumpy(), None
    x.attach_grad()
    with autograd.record():
        y = mx.nd.Custom(x, r, op_type=op_type, **params)
    y.backward(mx.nd.array(grad, dtype=data.dtype))
    return y.asnumpy(), x.grad.asnumpy()


def numeric_grad(op_type, data, rois, params, weights, eps=1e-6):
    """Central differences of sum(out * weights) w.r.t. every data element (float64)."""
    x = data.copy()
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for k in range(flat.size):
        v = flat[k]
        flat[k] = v + eps
        fp = float((run(op_type, x, rois, params)[0] * weights).sum())
        flat[k] = v - eps
        fm = float((run(op_type, x, rois, params)[0] * weights).sum())
        flat[k] = v
        gflat[k] = (fp - fm) / (2 * eps)
    return g


def exact(actual, expected, what):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    bad = actual.astype(np.float64) != expected.astype(np.float64)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.size} differ, first at {i}: "
                             f"{actual[i]!r} != {expected[i]!r}")


TOL = {np.float16: (2e-3, 2e-3), np.float32: (2e-5, 2e-5), np.float64: (1e-12, 1e-12)}


def close(actual, expected, dtype, what):
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype), what
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.abs(expected.astype(np.float64)).max()))
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                               rtol=rtol, atol=atol * scale, err_msg=what)


# A float32 box start whose "h += 1." accumulation differs from start + k (k = 2, 3).
ACCUM_START = np.float32(0.0120276045)

# (batch, x1, y1, x2, y2) in map cells (spatial_scale 1); scaled for other scales.
CAFFE_ROIS = [
    [0, 1.3, 2.7, 6.1, 5.0],        # generic fractional box
    [1, -3.2, -2.5, 4.4, 3.3],      # partly outside (top-left)
    [0, 5.5, 3.0, 12.0, 9.5],       # partly outside (bottom-right): ceil taps at H / W
    [0, 2.0, 1.0, 6.0, 5.0],        # integer coordinates: both taps weight 1 (counted twice)
    [1, 0.0, 0.0, 8.0, 6.0],        # the whole map, integer points on the last row/column
    [1, 6.0, 5.0, 2.0, 1.0],        # reversed: every bin empty -> 0
    [0, 20.0, 20.0, 30.0, 30.0],    # fully outside: clipped to the edge, empty -> 0
    [0, 3.3, 3.3, 3.3, 3.3],        # a point: size 1
    [0, 0.5, 0.25, 1.0, 0.75],      # smaller than a cell (bins with no point)
    [-1, 1.0, 1.0, 4.0, 4.0],       # padding roi -> 0
    [0, ACCUM_START, 1.5, 8.5, 4.0],  # float accumulation of the points
]

RFCN_ROIS = [
    [0, 1.3, 2.7, 6.1, 5.0],
    [1, -3.2, -2.5, 4.4, 3.3],      # partly outside (top-left): bins clipped at 0
    [0, 5.5, 3.0, 12.0, 9.5],       # partly outside (bottom-right): clipped at H-1 / W-1
    [0, 1.0, 1.0, 9.0, 9.0],        # size 9, bins 3, step 1: integer sample points
    [1, 0.0, 0.0, 5.0, 5.0],        # integer box
    [1, 6.0, 5.0, 2.0, 1.0],        # reversed: size 0.1
    [0, 3.0, 3.0, 2.0, 2.0],        # x2 = x1 - 1: size 0 -> 0.1
    [0, 20.0, 20.0, 30.0, 30.0],    # fully outside -> 0
    [0, 0.4, 6.2, 9.7, 6.9],        # thin: points skipped (>= hend)
    [-1, 1.0, 1.0, 4.0, 4.0],       # padding roi -> 0
]


def scaled(rois, spatial_scale, dtype):
    r = np.array(rois, dtype=np.float64)
    r[:, 1:] /= spatial_scale
    return r.astype(dtype)


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


CAFFE_CASES = [dict(pooled_size=(2, 2), spatial_scale=1.0),
               dict(pooled_size=(3, 2), spatial_scale=0.0625),
               dict(pooled_size=(2, 3), spatial_scale=0.5),
               dict(pooled_size=(1, 1), spatial_scale=1.0)]


def caffe_id(c):
    return f"p{c['pooled_size'][0]}x{c['pooled_size'][1]}-s{c['spatial_scale']}"


def rfcn_id(c):
    return f"p{c['pooled_size'][0]}-s{c['spatial_scale']}-n{c['sample_num']}"


def caffe_params(case):
    return dict(legacy="caffe", pooled_size=case["pooled_size"],
                spatial_scale=case["spatial_scale"])


# ------------------------------------------------------------------------------- Caffe ROIAlign
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", CAFFE_CASES, ids=lambda c: caffe_id(c))
def test_caffe_forward_matches_kernel(case, dtype):
    rng = np.random.default_rng(1)
    data = rand(rng, (2, 3, 7, 9), dtype)
    rois = scaled(CAFFE_ROIS, case["spatial_scale"], dtype)
    out, _ = run("ROIAlign", data, rois, caffe_params(case))
    expected = lref.caffe_roi_align_forward(data, rois, case["pooled_size"],
                                            case["spatial_scale"])
    # max of identically computed sample values: bit-exact
    exact(out, expected, f"caffe forward {case} {np.dtype(dtype).name}")


def test_caffe_integer_points_count_twice():
    """An integer point has floor == ceil with both weights 1: value 4*v (2*v per axis)."""
    data = np.arange(1 * 1 * 5 * 6, dtype=np.float32).reshape(1, 1, 5, 6)
    rois = np.array([[0, 2, 1, 2, 1]], np.float32)   # one point (2, 1): size 1, bin 1
    out, grad = run("ROIAlign", data, rois, dict(legacy="caffe", pooled_size=(1, 1),
                                                 spatial_scale=1.0),
                    grad=np.ones((1, 1, 1, 1), np.float32))
    assert out[0, 0, 0, 0] == 4 * data[0, 0, 1, 2]
    expected = np.zeros_like(data)
    expected[0, 0, 1, 2] = 4
    exact(grad, expected, "gradient at an integer point")


def test_caffe_float_accumulation():
    """Points are hstart, hstart+1, ... accumulated in float32, not hstart + k."""
    rois = np.array([[0, ACCUM_START, 1.5, 8.5, 4.0]], np.float32)
    geo = geometry.caffe_align_grid(rois, (1, 1), 1.0, 7, 10)
    n = int(geo.x.count[0, 0])
    coords = geo.x.coord[0, 0, :n]
    seq, c = [], ACCUM_START
    for _ in range(n):
        seq.append(c)
        c = np.float32(c + np.float32(1))
    direct = ACCUM_START + np.arange(n, dtype=np.float32)
    assert n == 10
    exact(coords, np.array(seq, np.float32), "sequential points")
    assert (coords != direct).any(), "the test box no longer exercises the accumulation"


@pytest.mark.parametrize("case", CAFFE_CASES[:3], ids=lambda c: caffe_id(c))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_caffe_backward_true_gradient(case, dtype):
    rng = np.random.default_rng(2)
    data = rand(rng, (2, 3, 7, 9), dtype)
    rois = scaled(CAFFE_ROIS, case["spatial_scale"], dtype)
    g = rand(rng, (len(CAFFE_ROIS), 3) + case["pooled_size"], dtype)
    _, grad = run("ROIAlign", data, rois, caffe_params(case), grad=g)
    expected = lref.caffe_roi_align_backward(data, rois, g, case["pooled_size"],
                                             case["spatial_scale"])
    close(grad, expected, dtype, f"caffe backward {case}")


def test_caffe_numeric_gradient():
    rng = np.random.default_rng(3)
    data = rand(rng, (1, 2, 6, 7), np.float64)
    rois = np.array([[0, 0.6, 0.3, 4.9, 4.2],      # fractional points
                     [0, 1.0, 2.0, 5.0, 5.0],      # integer points
                     [0, -2.2, 3.1, 3.4, 8.8],     # partly outside, ceil taps past the edge
                     [0, 4.5, 0.0, 9.0, 2.0]], np.float64)
    params = dict(legacy="caffe", pooled_size=(2, 2), spatial_scale=1.0)
    eps = 1e-6
    margin = lref.caffe_roi_align_margin(data, rois, (2, 2), 1.0)
    assert margin.min() > 1e3 * eps, "near-tie: max not differentiable here, change the seed"
    w = rand(rng, (4, 2, 2, 2), np.float64)
    _, grad = run("ROIAlign", data, rois, params, grad=w)
    num = numeric_grad("ROIAlign", data, rois, params, w, eps)
    np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-7)
    assert np.abs(grad).max() > 0


# ------------------------------------------------------------------------------- R-FCN PSROIAlign
RFCN_CASES = [dict(pooled_size=(3, 3), output_dim=2, spatial_scale=1.0, sample_num=2),
              dict(pooled_size=(3, 3), output_dim=2, spatial_scale=0.0625, sample_num=2),
              dict(pooled_size=(2, 2), output_dim=3, spatial_scale=0.5, sample_num=3),
              dict(pooled_size=(2, 2), output_dim=1, spatial_scale=1.0, sample_num=1)]


def rfcn_params(case):
    return dict(legacy="rfcn", **case)


def rfcn_channels(case):
    return case["output_dim"] * case["pooled_size"][0] ** 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", RFCN_CASES,
                         ids=lambda c: rfcn_id(c))
def test_rfcn_forward_matches_kernel(case, dtype):
    rng = np.random.default_rng(4)
    data = rand(rng, (2, rfcn_channels(case), 8, 10), dtype)
    rois = scaled(RFCN_ROIS, case["spatial_scale"], dtype)
    out, _ = run("PSROIAlign", data, rois, rfcn_params(case))
    expected = lref.rfcn_psroi_align_forward(data, rois, case["pooled_size"],
                                             case["output_dim"], case["spatial_scale"],
                                             case["sample_num"])
    # the average is summed in another order (separable): equal up to rounding
    close(out, expected, dtype, f"rfcn forward {case}")


def test_rfcn_quirks():
    """Division by sample_num**2 even when points are skipped; a one-row map gives 0."""
    data = np.ones((1, 1, 6, 6), np.float32)
    params = dict(legacy="rfcn", pooled_size=(1, 1), output_dim=1, spatial_scale=1.0,
                  sample_num=2)
    # y: [1, 2) step 1/3 -> 2 points; x: [1, 1.6) (size 0.6) step 0.2 -> 1.2, 1.4: 2 points
    out, _ = run("PSROIAlign", data, np.array([[0, 1, 1, 0.6, 1]], np.float32), params)
    np.testing.assert_allclose(out.ravel(), [1.0], rtol=1e-6)
    # x: [1, 5) clipped from [1, 6), points 2.67, 4.33 kept; y: [4, 5) clipped
    # from [4, 6): points 4.67 kept, 5.33 skipped -> 2 of 4 points -> 0.5
    out, _ = run("PSROIAlign", data, np.array([[0, 1, 4, 5, 5]], np.float32), params)
    np.testing.assert_allclose(out.ravel(), [0.5], rtol=1e-6)
    out, _ = run("PSROIAlign", np.ones((1, 1, 1, 6), np.float32),
                 np.array([[0, 0, 0, 5, 0]], np.float32), params)
    assert out.ravel()[0] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", RFCN_CASES[:3],
                         ids=lambda c: rfcn_id(c))
def test_rfcn_backward_true_gradient(case, dtype):
    rng = np.random.default_rng(5)
    data = rand(rng, (2, rfcn_channels(case), 8, 10), dtype)
    rois = scaled(RFCN_ROIS, case["spatial_scale"], dtype)
    g = rand(rng, (len(RFCN_ROIS), case["output_dim"]) + case["pooled_size"], dtype)
    _, grad = run("PSROIAlign", data, rois, rfcn_params(case), grad=g)
    expected = lref.rfcn_psroi_align_backward(data, rois, g, case["pooled_size"],
                                              case["output_dim"], case["spatial_scale"],
                                              case["sample_num"])
    close(grad, expected, dtype, f"rfcn backward {case}")


def test_rfcn_numeric_gradient():
    rng = np.random.default_rng(6)
    data = rand(rng, (1, 4, 6, 7), np.float64)      # output_dim 1, 2x2 groups
    rois = np.array([[0, 0.6, 0.3, 4.9, 4.2],
                     [0, 1.0, 1.0, 4.0, 4.0],        # integer sample points (step 1)
                     [0, -2.2, 3.1, 3.4, 8.8]], np.float64)
    params = dict(legacy="rfcn", pooled_size=(2, 2), output_dim=1, spatial_scale=1.0,
                  sample_num=2)
    w = rand(rng, (3, 1, 2, 2), np.float64)
    _, grad = run("PSROIAlign", data, rois, params, grad=w)
    num = numeric_grad("PSROIAlign", data, rois, params, w)
    np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-7)
    assert np.abs(grad).max() > 0


# ------------------------------------------------------------------------------- tables
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_legacy_tables_are_well_formed(dtype):
    """What the generic (CUDA) kernels rely on: counts within the table, taps inside the
    map, zero weights past each bin's count."""
    H, W = 7, 9
    for geo in (geometry.caffe_align_grid(scaled(CAFFE_ROIS, 0.5, dtype), (3, 2), 0.5, H, W),
                geometry.rfcn_align_grid(scaled(RFCN_ROIS, 0.5, dtype), (3, 2), 0.5, 2, H, W)):
        assert geo.divisor.shape == (len(geo.batch), 3, 2)
        assert (geo.divisor >= 1).all()
        for axis, limit in ((geo.y, H), (geo.x, W)):
            assert axis.count.dtype == np.int32 and axis.low.dtype == np.int32
            assert ((axis.count >= 0) & (axis.count <= axis.size)).all()
            for t in (axis.low, axis.high):
                assert ((t >= 0) & (t < limit)).all()
            for wt in (axis.w_low, axis.w_high):
                assert wt.dtype == np.dtype(dtype)
            pad = np.arange(axis.size)[None, None, :] >= axis.count[:, :, None]
            assert (axis.w_low[pad] == 0).all() and (axis.w_high[pad] == 0).all()


def test_modern_mode_unchanged():
    rng = np.random.default_rng(7)
    data = rand(rng, (2, 3, 7, 9), np.float32)
    rois = scaled(CAFFE_ROIS[:5], 1.0, np.float32)
    base = dict(pooled_size=(2, 2), spatial_scale=1.0)
    a, _ = run("ROIAlign", data, rois, base)
    b, _ = run("ROIAlign", data, rois, dict(base, legacy=""))
    c, _ = run("ROIAlign", data, rois, dict(base, legacy="caffe"))
    exact(a, b, "legacy='' is the default")
    assert not np.array_equal(a, c)
