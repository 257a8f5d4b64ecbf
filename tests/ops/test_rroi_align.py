"""RROIAlign against a slow scalar float64 reference (below; it never imports mx_roi),
``mx.nd.contrib.RROIAlign`` (forward, to the last bit for float32/float64), float64
central differences (the backward), the compiled geometry against
``mx_roi.geometry.rotated_grid`` (bit for bit) and the bad-input rules through every
entry point."""
import math

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

from tests.ops.base import (RoIOpTester, assert_close, assert_native_equals_emulation,
                            assert_onnx_export_refused, make_data, run_custom)
from tests.reference import _bilinear as roi_align_taps


# ---- the oracle: MXNet's rroi_align.cc (Detectron2's aligned, mmcv's clockwise) in float64
def _bilinear(plane, y, x):
    """(value, [(row, col, weight)]) of ROIAlign's bilinear rule at (y, x), in float64
    (the taps of tests.reference's ROIAlign oracle)."""
    H, W = plane.shape[-2:]
    taps = [(a, b, w) for w, a, b in roi_align_taps(y, x, H, W, float)]
    return sum((w * plane[..., a, b] for a, b, w in taps), 0.0), taps


def _rotated_samples(roi, pooled, scale, ratio, aligned, clockwise):
    """Per bin (p, q): the sample points (y, x) and the divisor."""
    P, Q = pooled
    s = float(np.float32(scale))
    off = 0.5 if aligned else 0.0
    cx, cy = float(roi[1]) * s - off, float(roi[2]) * s - off
    w, h = float(roi[3]) * s, float(roi[4]) * s
    theta = float(roi[5]) * math.pi / 180.0 * (-1 if clockwise else 1)
    if not aligned:
        w, h = max(w, 1.0), max(h, 1.0)
    gy = ratio if ratio > 0 else max(math.ceil(h / P), 0)
    gx = ratio if ratio > 0 else max(math.ceil(w / Q), 0)
    c, sn = math.cos(theta), math.sin(theta)
    bins = {}
    for p in range(P):
        for q in range(Q):
            pts = []
            for iy in range(gy):
                yy = -h / 2 + p * h / P + (iy + 0.5) * h / P / gy
                for ix in range(gx):
                    xx = -w / 2 + q * w / Q + (ix + 0.5) * w / Q / gx
                    pts.append((yy * c - xx * sn + cy, xx * c + yy * sn + cx))
            bins[p, q] = pts, max(gy * gx, 1)
    return bins


def _live_bins(rois, pooled, scale, ratio, aligned, clockwise):
    """The bins of every roi with a batch index >= 0: (r, b, p, q, sample points, divisor)
    per bin, :func:`_rotated_samples`' points and divisor."""
    for r, roi in enumerate(rois.astype(np.float64)):
        b = int(roi[0])
        if b < 0:
            continue
        for (p, q), (pts, count) in _rotated_samples(roi, pooled, scale, ratio, aligned,
                                                     clockwise).items():
            yield r, b, p, q, pts, count


def reference_forward(data, rois, pooled_size, spatial_scale, sampling_ratio=-1,
                      aligned=False, clockwise=False):
    data = data.astype(np.float64)
    P, Q = pooled_size
    out = np.zeros((rois.shape[0], data.shape[1], P, Q))
    for r, b, p, q, pts, count in _live_bins(rois, pooled_size, spatial_scale, sampling_ratio,
                                             aligned, clockwise):
        out[r, :, p, q] = sum((_bilinear(data[b], y, x)[0] for y, x in pts),
                              np.zeros(data.shape[1])) / count
    return out


def reference_backward(data, rois, grad, pooled_size, spatial_scale, sampling_ratio=-1,
                       aligned=False, clockwise=False):
    out = np.zeros(data.shape)
    grad = grad.astype(np.float64)
    for r, b, p, q, pts, count in _live_bins(rois, pooled_size, spatial_scale, sampling_ratio,
                                             aligned, clockwise):
        for y, x in pts:
            for a, c, w in _bilinear(data[b], y, x)[1]:
                out[b, :, a, c] += grad[r, :, p, q] * w / count
    return out


# ---- rois (R, 6) ----------------------------------------------------------------------
def rotated_adversarial(rng, N, H, W, spatial_scale, n_random=4, batch=None, dtype=np.float32):
    """Rotated corner cases in image coordinates: every quadrant's angle and +-180, boxes
    partly / wholly off the map, zero, negative, sub-cell and huge sizes."""
    u = 1.0 / float(spatial_scale)
    IW, IH = W * u, H * u
    boxes = [
        (IW / 2, IH / 2, IW, IH, 0.0),                 # whole map
        (IW / 2, IH / 2, IW, IH, 90.0),
        (IW / 2, IH / 2, 2 * IW, 0.5 * IH, 180.0),
        (IW / 2, IH / 2, IW, IH, -180.0),
        (IW / 3, IH / 3, 0.6 * IW, 0.3 * IH, 45.0),
        (IW + 4 * u, IH + 3 * u, 2 * u, 3 * u, 30.0),   # wholly beyond W, H
        (-5 * u, -4 * u, 3 * u, 2 * u, -75.0),          # wholly negative
        (0.0, IH / 2, 0.8 * IW, 0.5 * IH, -60.0),       # partly off the map
        (2 * u, 2 * u, 0.0, 0.0, 20.0),                 # zero size
        (3 * u, 2 * u, -2 * u, 3 * u, 110.0),           # negative width
        (1.3 * u, 1.4 * u, 0.3 * u, 0.2 * u, 135.0),    # sub-cell
        (IW / 2, IH / 2, 6 * IW, 5 * IH, -150.0),       # huge
        (W * u, H * u, 2 * u, 2 * u, -90.0),            # centred on the far corner
        (0.5 * u, 0.5 * u, 3 * u, 1 * u, 179.9),
    ]
    for _ in range(n_random):
        boxes.append((rng.uniform(-0.2, 1.2) * IW, rng.uniform(-0.2, 1.2) * IH,
                      rng.uniform(0.1, 1.0) * IW, rng.uniform(0.1, 1.0) * IH,
                      rng.uniform(-180, 180)))
    boxes = np.asarray(boxes, np.float64)
    R = boxes.shape[0]
    b = rng.integers(0, N, R).astype(np.float64) if batch is None else np.full(R, float(batch))
    return np.concatenate([b[:, None], boxes], axis=1).astype(dtype)


def rotated_ordinary(rng, R, N, H, W, spatial_scale, dtype=np.float32):
    u = 1.0 / float(spatial_scale)
    return np.stack([rng.integers(0, N, R), rng.uniform(0, W, R) * u, rng.uniform(0, H, R) * u,
                     rng.uniform(1, 0.8 * W, R) * u, rng.uniform(1, 0.8 * H, R) * u,
                     rng.uniform(-180, 180, R)], axis=1).astype(dtype)


def random_rotated(rng, R, N, H, W, spatial_scale, dtype):
    """Parity boxes: every angle in [-180, 180], centres around and off the map, sizes
    log-uniform from a tenth of a cell to three maps."""
    u = 1.0 / float(spatial_scale)
    return np.stack([rng.integers(0, N, R), rng.uniform(-0.5, 1.5, R) * W * u,
                     rng.uniform(-0.5, 1.5, R) * H * u,
                     np.exp(rng.uniform(np.log(0.1), np.log(3 * W), R)) * u,
                     np.exp(rng.uniform(np.log(0.1), np.log(3 * H), R)) * u,
                     rng.uniform(-180, 180, R)], axis=1).astype(dtype)


class TestRROIAlign(RoIOpTester):
    op_type = "RROIAlign"
    rois_columns = 6

    @classmethod
    def param_cases(cls):
        return [
            dict(pooled_size=(2, 2), spatial_scale=0.5, sampling_ratio=-1),
            dict(pooled_size=(3, 2), spatial_scale=1.0, sampling_ratio=2, aligned=True),
            dict(pooled_size=(2, 3), spatial_scale=0.25, sampling_ratio=-1, aligned=True,
                 clockwise=True),
        ]

    def adversarial(self, rng, N, H, W, spatial_scale, n_random=4, batch=None,
                    dtype=np.float32):
        return rotated_adversarial(rng, N, H, W, spatial_scale, n_random, batch, dtype)

    def ordinary(self, rng, R, N, H, W, spatial_scale, dtype=np.float32):
        return rotated_ordinary(rng, R, N, H, W, spatial_scale, dtype)

    def numeric_rois(self, rng, N, H, W, spatial_scale, dtype):
        return np.concatenate([
            self.adversarial(rng, N, H, W, spatial_scale, dtype=dtype)[[0, 4, 7, 9, 10]],
            self.ordinary(rng, 3, N, H, W, spatial_scale, dtype)])

    def reference_forward(self, data, rois, pooled_size, spatial_scale, sampling_ratio=-1,
                          aligned=False, clockwise=False, deterministic=False):
        return reference_forward(data, rois, tuple(np.broadcast_to(pooled_size, 2)),
                                 spatial_scale, sampling_ratio, aligned, clockwise)

    def reference_backward(self, data, rois, grad, pooled_size, spatial_scale,
                           sampling_ratio=-1, aligned=False, clockwise=False,
                           deterministic=False):
        return reference_backward(data, rois, grad, tuple(np.broadcast_to(pooled_size, 2)),
                                  spatial_scale, sampling_ratio, aligned, clockwise)

    def pooled(self, params):
        ps = params["pooled_size"]
        return (int(ps), int(ps)) if np.isscalar(ps) or isinstance(ps, str) else tuple(ps)

    @pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
    def test_vs_builtin(self, case, dtype):
        """The built-in (forward only) to the bit on the tester's rois: ours with
        ``aligned=False``, and ``clockwise=True`` equal to the built-in on negated angles."""
        import mx_roi  # noqa: F401
        rng = np.random.default_rng(2)
        data, rois, _ = self.make_problem(rng, case, dtype)
        rois = np.concatenate([rois, self.ordinary(rng, 6, self.N, self.H, self.W,
                                                   case["spatial_scale"], dtype)])
        rois = rois[rois[:, 0] >= 0]
        ours = run_custom(self.op_type, data, rois, dict(case, aligned=False))[0]
        theirs_rois = rois.copy()
        if case.get("clockwise"):
            theirs_rois[:, 5] = -theirs_rois[:, 5]
        theirs = mx.nd.contrib.RROIAlign(
            mx.nd.array(data, dtype=dtype), mx.nd.array(theirs_rois, dtype=dtype),
            pooled_size=self.pooled(case), spatial_scale=case["spatial_scale"],
            sampling_ratio=case["sampling_ratio"]).asnumpy()
        assert_close(ours, theirs, dtype, f"RROIAlign vs contrib.RROIAlign {case}", exact=True)


# ---- parity with mx.nd.contrib.RROIAlign ------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("pooled_size,spatial_scale,sampling_ratio",
                         [((3, 2), 0.5, -1), ((7, 7), 0.0625, -1), ((2, 4), 1.0, 1),
                          ((3, 3), 0.25, 3)])
def test_forward_vs_builtin(dtype, pooled_size, spatial_scale, sampling_ratio):
    """Bit for bit: the same operations in the same order, cosf/sinf on float32 like the
    built-in (the ops run on the backend MX_ROI_BACKEND selects)."""
    import mx_roi  # noqa: F401
    rng = np.random.default_rng(hash((pooled_size, sampling_ratio)) % 2 ** 32)
    N, C, H, W = 2, 3, 11, 13
    x = make_data(rng, (N, C, H, W), dtype)
    rois = np.concatenate([random_rotated(rng, 160, N, H, W, spatial_scale, dtype),
                           rotated_adversarial(rng, N, H, W, spatial_scale, 0, dtype=dtype)])
    params = dict(pooled_size=pooled_size, spatial_scale=spatial_scale,
                  sampling_ratio=sampling_ratio)
    ours = mx.nd.Custom(mx.nd.array(x, dtype=dtype), mx.nd.array(rois, dtype=dtype),
                        op_type="RROIAlign", **params).asnumpy()
    theirs = mx.nd.contrib.RROIAlign(mx.nd.array(x, dtype=dtype),
                                     mx.nd.array(rois, dtype=dtype), **params).asnumpy()
    assert_close(ours, theirs, dtype, "RROIAlign vs contrib.RROIAlign", exact=True)


def test_forward_vs_builtin_float16():
    """float16: the built-in derives its sample points in half precision (a coordinate of
    20 cells is off by up to 1/128 cell), ours in float32 (as every op does): ours is within
    float16's tolerance of the float64 reference and never farther from it than the
    built-in (seen: ours 2e-3, the built-in's 0.37)."""
    import mx_roi  # noqa: F401
    rng = np.random.default_rng(3)
    x = make_data(rng, (1, 2, 9, 10), np.float16)
    rois = rotated_ordinary(rng, 30, 1, 9, 10, 0.5, np.float16)
    kw = dict(pooled_size=(2, 2), spatial_scale=0.5, sampling_ratio=2)
    ours = mx.nd.Custom(mx.nd.array(x, dtype="float16"), mx.nd.array(rois, dtype="float16"),
                        op_type="RROIAlign", **kw).asnumpy()
    theirs = mx.nd.contrib.RROIAlign(mx.nd.array(x, dtype="float16"),
                                     mx.nd.array(rois, dtype="float16"), **kw).asnumpy()
    exact = reference_forward(x, rois, (2, 2), 0.5, 2)
    assert_close(ours, exact, np.float16, "RROIAlign float16 vs reference")
    err_ours = np.abs(ours.astype(np.float64) - exact).max()
    err_theirs = np.abs(theirs.astype(np.float64) - exact).max()
    assert err_ours <= err_theirs, (err_ours, err_theirs)


# ---- the compiled geometry is mx_roi.geometry's, bit for bit ----------------------------
@pytest.mark.parametrize("kind", ["emulated-cuda", "native"])
def test_compiled_geometry_equals_numpy(kind):
    """>= 1500 random grids x every dtype x (aligned, clockwise, adaptive / fixed), P != Q,
    padding rois, empty grids: every table equal to the bit (NaN-free by construction)."""
    import mx_roi  # noqa: F401
    from mx_roi import geometry
    from mx_roi.operators.rroi_align import RROIAlign, compiled_grid
    rng = np.random.default_rng(7 if kind == "native" else 8)
    grids = 1500 if kind == "emulated-cuda" else 300
    for i in range(grids):
        dtype = (np.float16, np.float32, np.float64)[i % 3]
        H, W = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        P, Q = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        scale = float(rng.choice([1.0, 0.5, 0.25, 0.0625, 0.3]))
        params = dict(pooled_size=(P, Q), spatial_scale=scale,
                      sampling_ratio=int(rng.choice([-1, 0, 1, 2, 3])),
                      aligned=bool(i & 4), clockwise=bool(i & 8))
        rois = random_rotated(rng, int(rng.integers(0, 4)), 2, H, W, scale, dtype)
        if rois.shape[0]:
            rois[0, 0] = -1 if i % 5 == 0 else rois[0, 0]
            rois[-1, 3:5] *= rng.choice([0.0, 1.0, -1.0])
        op = RROIAlign(RROIAlign.param_cls.from_kwargs(**params))
        want = geometry.rotated_grid(rois, (P, Q), scale, params["sampling_ratio"],
                                     params["aligned"], params["clockwise"], H, W)
        got = compiled_grid(op, rois, H, W, kind)
        for name in geometry.RotatedGrid.__dataclass_fields__:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape, (i, name, a.dtype, b.dtype)
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (
                f"grid {i} {params} {np.dtype(dtype).name}: table {name} differs")


# ---- entry points and bad inputs ---------------------------------------------------------
def _inputs(dtype=np.float32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 9)).astype(dtype)
    rois = np.array([[0, 8, 6, 10, 6, 30], [1, 4, 9, 6, 12, -120], [-1, 1, 1, 2, 2, 0]], dtype)
    return x, rois


PARAMS = dict(pooled_size=(2, 3), spatial_scale=0.5, sampling_ratio=2)


def _expected(x, rois):
    return reference_forward(x, rois, (2, 3), 0.5, 2)


def test_entry_points_agree():
    """mx.nd.Custom, mx_roi.nd (the built-in's positional order), mx_roi.sym and the
    hybridized Gluon block give the reference's output; backward through each."""
    import mx_roi
    import mx_roi.gluon as G
    x, rois = _inputs()
    want = _expected(x, rois)
    X, Rr = mx.nd.array(x), mx.nd.array(rois)
    outs = [mx.nd.Custom(X, Rr, op_type="RROIAlign", **PARAMS).asnumpy(),
            mx_roi.nd.RROIAlign(X, Rr, (2, 3), 0.5, 2).asnumpy()]
    sym = mx_roi.sym.RROIAlign(mx.sym.var("data"), mx.sym.var("rois"), (2, 3), 0.5, 2)
    exe = sym.bind(mx.cpu(), {"data": X, "rois": Rr})
    outs.append(exe.forward()[0].asnumpy())
    block = G.RROIAlign((2, 3), 0.5, 2)
    block.hybridize()
    xg = X.copy()
    xg.attach_grad()
    with autograd.record():
        y = block(xg, Rr)
    y.backward(mx.nd.ones(y.shape))
    outs.append(y.asnumpy())
    for o in outs:
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xg.grad.asnumpy(),
                               reference_backward(x, rois, np.ones(y.shape), (2, 3), 0.5, 2),
                               rtol=1e-5, atol=1e-5)
    assert "RROIAlign" in mx_roi.OP_TYPES and "ralign" in G.MODES


def _nd_call(x, rois, backward=False, **params):
    X = mx.nd.array(x, dtype=x.dtype)
    X.attach_grad()
    with autograd.record():
        y = mx.nd.Custom(X, mx.nd.array(rois, dtype=rois.dtype), op_type="RROIAlign",
                         **(params or PARAMS))
    if backward:
        y.backward(mx.nd.ones(y.shape, dtype=x.dtype))
        return X.grad.asnumpy()
    return y.asnumpy()


def _gluon_call(x, rois, backward=False, **params):
    import mx_roi.gluon as G
    block = G.RROIAlign(**(params or PARAMS))
    block.hybridize()
    X = mx.nd.array(x, dtype=x.dtype)
    X.attach_grad()
    with autograd.record():
        y = block(X, mx.nd.array(rois, dtype=rois.dtype))
    if backward:
        y.backward(mx.nd.ones(y.shape, dtype=x.dtype))
        return X.grad.asnumpy()
    return y.asnumpy()


@pytest.mark.parametrize("call", [_nd_call, _gluon_call], ids=["nd", "gluon"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("bad,match", [
    ((1, 0, 2.0), r"RROIAlign: rois\[1\] has batch index 2 but data holds only 2 image"),
    ((0, 5, np.nan), r"RROIAlign: rois\[0\] has a NaN or infinite value"),
    ((2, 3, np.inf), r"RROIAlign: rois\[2\] has a NaN or infinite value"),
    ((1, 4, 3e7), r"RROIAlign: rois\[1\] is a box of 6 x 3e\+07: .* samples per bin"),
])
def test_bad_rois_then_next_call_works(call, backward, bad, match):
    import mx_roi  # noqa: F401
    x, rois = _inputs()
    r, c, v = bad
    rois[r, c] = v
    params = dict(PARAMS, sampling_ratio=-1)
    with pytest.raises(MXNetError, match=match):
        call(x, rois, backward, **params)
    x, rois = _inputs()
    np.testing.assert_allclose(call(x, rois, **PARAMS), _expected(x, rois), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 5), (3, 7), (3,)])
def test_rois_wrong_shape(shape):
    import mx_roi  # noqa: F401
    x, _ = _inputs()
    with pytest.raises(MXNetError, match=r"RROIAlign: rois must have shape \(R, 6\) = "
                                         r"\(batch_index, x_center, y_center, width, height, "
                                         r"angle_degrees\)"):
        _nd_call(x, np.zeros(shape, np.float32))
    x, rois = _inputs()
    np.testing.assert_allclose(_nd_call(x, rois), _expected(x, rois), rtol=1e-5, atol=1e-5)


def test_bad_parameters():
    import mx_roi
    x, rois = _inputs()
    for kw, match in ((dict(pooled_size=0), "pooled_size"),
                      (dict(spatial_scale=-1), "spatial_scale"),
                      (dict(sampling_ratio=1.5), "sampling_ratio"),
                      (dict(sampling_ratio=1025), "sampling_ratio.*at most 1024"),
                      (dict(clockwise="maybe"), "clockwise")):
        with pytest.raises((MXNetError, ValueError), match=f"RROIAlign: .*{match}"):
            mx_roi.nd.RROIAlign(mx.nd.array(x), mx.nd.array(rois), **dict(PARAMS, **kw))
    np.testing.assert_allclose(_nd_call(x, rois), _expected(x, rois), rtol=1e-5, atol=1e-5)


def test_onnx_export_refused(tmp_path):
    """ONNX has no rotated RoIAlign: the exporter refuses the node, naming it."""
    assert_onnx_export_refused(tmp_path, "RROIAlign", 6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_native_walk_same_bits_as_the_generic_kernels(dtype, monkeypatch):
    """The native build's 16-channel walks (forward, data gradient) give the generic
    kernels' bits (run by the emulation); 21 channels: a full and a partial pass."""
    import mx_roi  # noqa: F401
    rng = np.random.default_rng(31)
    x = make_data(rng, (2, 21, 9, 11), dtype)
    rois = rotated_adversarial(rng, 2, 9, 11, 0.5, n_random=8, dtype=dtype)
    rois[3, 0] = -1
    grad = make_data(rng, (rois.shape[0], 21, 3, 2), dtype)
    assert_native_equals_emulation(
        monkeypatch, "RROIAlign", x, rois,
        dict(pooled_size=(3, 2), spatial_scale=0.5, sampling_ratio=-1), grad, dtype,
        what=("output", "data"), rois_req="null")
