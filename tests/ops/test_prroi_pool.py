"""PrRoIPool against a slow float64 reference written from the paper's formula (below; it
never imports mx_roi): per unit cell of the map the exact integral of the bilinear patch
over its intersection with the bin, the map's values at the cell corners (0 beyond the
map); the rois' gradient against central differences of that reference, both gradients
against central differences of the op itself; the compiled geometry against
``mx_roi.geometry.precise_bins`` bit for bit; the bad-input rules."""
import math

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

from tests.ops.base import (RoIOpTester, assert_native_equals_emulation,
                            assert_onnx_export_refused, make_data, random_rois, run_custom)


# ---- the oracle (Jiang et al., ECCV 2018, eq. for PrPool) ---------------------------------
def _node(plane, i, j):
    H, W = plane.shape[-2:]
    return plane[..., i, j] if 0 <= i < H and 0 <= j < W else 0.0


def _lin(a, b):
    """Integrals of (1 - u) and of u over [a, b] (u within a unit cell)."""
    return (b - a) - (b * b - a * a) / 2, (b * b - a * a) / 2


def _bin_terms(roi, P, Q, scale):
    """Per bin (p, q): the window (y1, y2, x1, x2) and its area (mmcv's coordinates)."""
    s = float(np.float32(scale))
    x1, y1, x2, y2 = (float(v) * s for v in roi[1:5])
    bh, bw = max(y2 - y1, 0.0) / P, max(x2 - x1, 0.0) / Q
    for p in range(P):
        for q in range(Q):
            ya = y1 + p * bh
            xa = x1 + q * bw
            yield p, q, (ya, ya + bh, xa, xa + bw), bh * bw


def _live_bins(rois, P, Q, scale):
    """The bins of area > 0 of every roi with a batch index >= 0: (r, b, p, q, window,
    area) per bin, :func:`_bin_terms`' window and area."""
    for r, roi in enumerate(rois.astype(np.float64)):
        b = int(roi[0])
        if b < 0:
            continue
        for p, q, win, area in _bin_terms(roi, P, Q, scale):
            if area > 0:
                yield r, b, p, q, win, area


def _cells(y1, y2, x1, x2):
    """Unit cells (i, j) meeting the window and the window's part in each, cell-relative."""
    for i in range(math.floor(y1), math.ceil(y2)):
        a, b = max(y1, i) - i, min(y2, i + 1) - i
        if b <= a:
            continue
        for j in range(math.floor(x1), math.ceil(x2)):
            c, d = max(x1, j) - j, min(x2, j + 1) - j
            if d > c:
                yield i, j, _lin(a, b), _lin(c, d)


def reference_forward(data, rois, pooled_size, spatial_scale):
    data = data.astype(np.float64)
    P, Q = pooled_size
    out = np.zeros((rois.shape[0], data.shape[1], P, Q))
    for r, b, p, q, win, area in _live_bins(rois, P, Q, spatial_scale):
        acc = np.zeros(data.shape[1])
        for i, j, (ly0, ly1), (lx0, lx1) in _cells(*win):
            acc += (_node(data[b], i, j) * ly0 * lx0 + _node(data[b], i, j + 1) * ly0 * lx1
                    + _node(data[b], i + 1, j) * ly1 * lx0
                    + _node(data[b], i + 1, j + 1) * ly1 * lx1)
        out[r, :, p, q] = acc / area
    return out


def reference_backward(data, rois, grad, pooled_size, spatial_scale):
    P, Q = pooled_size
    H, W = data.shape[2:]
    out = np.zeros(data.shape)
    for r, b, p, q, win, area in _live_bins(rois, P, Q, spatial_scale):
        g = grad[r, :, p, q].astype(np.float64) / area
        for i, j, (ly0, ly1), (lx0, lx1) in _cells(*win):
            for di, dj, w in ((0, 0, ly0 * lx0), (0, 1, ly0 * lx1), (1, 0, ly1 * lx0),
                              (1, 1, ly1 * lx1)):
                if 0 <= i + di < H and 0 <= j + dj < W:
                    out[b, :, i + di, j + dj] += g * w
    return out


def reference_rois_grad(data, rois, grad, pooled_size, spatial_scale, eps=1e-6):
    """Central differences of the reference in each coordinate (float64); 0 for padding
    rois and boxes whose bins have no area (not differentiable there)."""
    out = np.zeros(rois.shape)
    s = float(np.float32(spatial_scale))
    for r in range(rois.shape[0]):
        roi = rois[r:r + 1].astype(np.float64)
        if int(roi[0, 0]) < 0 or roi[0, 3] - roi[0, 1] <= 0 or roi[0, 4] - roi[0, 2] <= 0:
            continue
        for k in range(1, 5):
            step = eps / s
            hi, lo = roi.copy(), roi.copy()
            hi[0, k] += step
            lo[0, k] -= step
            diff = (reference_forward(data, hi, pooled_size, spatial_scale)
                    - reference_forward(data, lo, pooled_size, spatial_scale))
            out[r, k] = float((diff[0] * grad[r]).sum()) / (2 * step)
    return out


#: the rois' gradient involves differences of edge integrals: looser than the outputs
ROIS_TOL = {np.dtype(np.float16): 5e-2, np.dtype(np.float32): 2e-3,
            np.dtype(np.float64): 1e-6}


def check_rois_gradient(rg, data, rois, grad, pooled_size, spatial_scale, dtype, what=""):
    want = reference_rois_grad(data, rois, grad, pooled_size, spatial_scale)
    scale = max(1.0, float(np.abs(want).max()))
    tol = ROIS_TOL[np.dtype(dtype)]
    np.testing.assert_allclose(rg.astype(np.float64), want, rtol=tol, atol=tol * scale,
                               err_msg=f"PrRoIPool rois gradient {what}")


class TestPrRoIPool(RoIOpTester):
    op_type = "PrRoIPool"

    @classmethod
    def param_cases(cls):
        return [dict(pooled_size=(2, 2), spatial_scale=0.5),
                dict(pooled_size=(3, 2), spatial_scale=1.0),
                dict(pooled_size=(2, 3), spatial_scale=0.25)]

    def reference_forward(self, data, rois, pooled_size, spatial_scale, deterministic=False):
        return reference_forward(data, rois, self.pooled(dict(pooled_size=pooled_size)),
                                 spatial_scale)

    def reference_backward(self, data, rois, grad, pooled_size, spatial_scale,
                           deterministic=False):
        return reference_backward(data, rois, grad, self.pooled(dict(pooled_size=pooled_size)),
                                  spatial_scale)

    def pooled(self, params):
        ps = params["pooled_size"]
        return (int(ps), int(ps)) if np.isscalar(ps) or isinstance(ps, str) else tuple(ps)

    def check_rois_grad(self, rg, data, rois, grad, params, dtype, what=""):
        assert rg.shape == rois.shape and rg.dtype == np.dtype(dtype)
        assert not rg[:, 0].any(), "the batch index has no gradient"
        assert not rg[np.trunc(rois[:, 0]) < 0].any(), "a padding roi has no gradient"
        check_rois_gradient(rg, data, rois, grad, self.pooled(params), params["spatial_scale"],
                            dtype, what)

    @pytest.mark.parametrize("dtype", [np.float64], ids=["float64"])
    def test_vs_builtin(self, case, dtype):
        """MXNet has no precise pooling; its ROIAlign averages bilinear samples at bin
        midpoints, a midpoint rule of the same integral: with 48 x 48 samples per bin it
        agrees to ~1e-3 on boxes of at least a cell inside [0, H-1] x [0, W-1] (no clamp)."""
        import mx_roi  # noqa: F401
        rng = np.random.default_rng(2)
        s = case["spatial_scale"]
        R = 8
        y1 = rng.uniform(0, self.H - 3, R)
        x1 = rng.uniform(0, self.W - 3, R)
        rois = np.stack([rng.integers(0, self.N, R), x1 / s, y1 / s,
                         np.minimum(x1 + rng.uniform(1, 6, R), self.W - 1) / s,
                         np.minimum(y1 + rng.uniform(1, 6, R), self.H - 1) / s], axis=1)
        data = make_data(rng, (self.N, self.C, self.H, self.W), dtype)
        ours = run_custom(self.op_type, data, rois.astype(dtype), case)[0]
        theirs = mx.nd.contrib.ROIAlign(mx.nd.array(data, dtype=dtype),
                                        mx.nd.array(rois, dtype=dtype),
                                        pooled_size=self.pooled(case), spatial_scale=s,
                                        sample_ratio=48).asnumpy()
        np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=2e-3)

    def check_rois_grad_add(self, rg, data, rois, grad, params, dtype):
        want = reference_rois_grad(data, rois, grad, self.pooled(params),
                                   params["spatial_scale"]) * 2
        tol = ROIS_TOL[np.dtype(dtype)] * 2
        np.testing.assert_allclose(rg.astype(np.float64), want, rtol=tol,
                                   atol=tol * max(1.0, float(np.abs(want).max())))

    @pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
    def test_rois_gradient_is_zero(self, dtype):
        """(PrRoIPool differentiates its rois: the gradient written over the buffer's
        garbage is the true one, the batch index's and padding rois' zero.)"""
        case = self.param_cases()[0]
        rng = np.random.default_rng(3)
        data, rois, grad = self.make_problem(rng, case, dtype)
        rois[::4, 0] = -1
        _, dg, rg = run_custom(self.op_type, data, rois, case, grad=grad, grad_fill=7)
        self.check_rois_grad(rg, data, rois, grad, case, dtype)
        _, dg_clean, _ = run_custom(self.op_type, data, rois, case, grad=grad)
        np.testing.assert_array_equal(dg, dg_clean)


def test_gradients_vs_central_differences_of_the_op():
    """Both gradients of the op in float64 against central differences of its own forward
    (the roi coordinates and the data), on boxes of every kind."""
    import mx_roi  # noqa: F401
    rng = np.random.default_rng(20)
    N, C, H, W = 2, 2, 6, 7
    data = make_data(rng, (N, C, H, W), np.float64)
    rois = np.concatenate([np.array([[0, 1.3, 0.7, 9.9, 8.2], [1, -3.1, 2.2, 4.4, 15.7],
                                     [1, 10.1, 9.3, 16.6, 13.9], [0, 5.2, 5.2, 5.9, 6.1]]),
                           random_rois(rng, 3, N, H, W, 0.5, np.float64)])
    params = dict(pooled_size=(2, 3), spatial_scale=0.5)
    grad = rng.standard_normal((rois.shape[0], C, 2, 3))
    _, dg, rg = run_custom("PrRoIPool", data, rois, params, grad=grad)

    def loss(x, r):
        return float((run_custom("PrRoIPool", x, r, params)[0] * grad).sum())

    eps = 1e-5
    for k in range(rois.shape[0]):
        for col in range(1, 5):
            e = np.zeros(rois.shape)
            e[k, col] = eps
            numeric = (loss(data, rois + e) - loss(data, rois - e)) / (2 * eps)
            assert abs(numeric - rg[k, col]) <= 1e-6 + 1e-6 * abs(numeric), (k, col, numeric,
                                                                           rg[k, col])
    for _ in range(3):
        v = rng.standard_normal(data.shape)
        numeric = (loss(data + eps * v, rois) - loss(data - eps * v, rois)) / (2 * eps)
        assert abs(numeric - float((dg * v).sum())) <= 1e-6 + 1e-6 * abs(numeric)


def test_constant_map_pools_to_the_constant():
    """The integral of a constant surface over any bin inside the map is the constant
    times the area: every such bin gives exactly the constant (a property of the paper's
    formula that sampled pooling only approximates), and its coordinates get no gradient."""
    import mx_roi  # noqa: F401
    data = np.full((1, 2, 8, 9), 3.0)
    rois = np.array([[0, 0.3, 1.1, 7.6, 6.9], [0, 2.0, 2.0, 3.0, 2.5]])
    out, _, rg = run_custom("PrRoIPool", data, rois, dict(pooled_size=(3, 2), spatial_scale=1.0),
                            grad=np.ones((2, 2, 3, 2)))
    np.testing.assert_allclose(out, 3.0, rtol=1e-12)
    np.testing.assert_allclose(rg, 0.0, atol=1e-10)


# ---- the compiled geometry is mx_roi.geometry's, bit for bit ----------------------------
@pytest.mark.parametrize("kind", ["emulated-cuda", "native"])
def test_compiled_geometry_equals_numpy(kind):
    """>= 1500 random grids x every dtype, P != Q, reversed / zero-size / off-map / huge
    boxes, padding rois: every table equal to the bit."""
    import mx_roi  # noqa: F401
    from mx_roi import geometry
    from mx_roi.operators.prroi_pool import PrRoIPool, compiled_bins
    from tests.ops.base import adversarial_rois
    rng = np.random.default_rng(11 if kind == "native" else 12)
    grids = 1500 if kind == "emulated-cuda" else 300
    for i in range(grids):
        dtype = (np.float16, np.float32, np.float64)[i % 3]
        H, W = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        P, Q = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        scale = float(rng.choice([1.0, 0.5, 0.25, 0.0625, 0.3]))
        if i % 7 == 0:
            rois = adversarial_rois(rng, 2, H, W, scale, n_random=0, dtype=dtype)
        else:
            R = int(rng.integers(0, 4))
            x1, y1 = rng.uniform(-0.3, 1.1, R) * W / scale, rng.uniform(-0.3, 1.1, R) * H / scale
            rois = np.stack([rng.integers(0, 2, R), x1, y1,
                             x1 + rng.uniform(-0.2, 1.5, R) * W / scale,
                             y1 + rng.uniform(-0.2, 1.5, R) * H / scale], axis=1).astype(dtype)
        if rois.shape[0] and i % 5 == 0:
            rois[0, 0] = -1
        op = PrRoIPool(PrRoIPool.param_cls.from_kwargs(pooled_size=(P, Q), spatial_scale=scale))
        want = geometry.precise_bins(rois, (P, Q), scale, H, W)
        got = compiled_bins(op, rois, H, W, kind)
        for name in ("batch", "area", "bin_size"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (
                f"grid {i} P,Q={P},{Q} {np.dtype(dtype).name}: {name} differs")
        for axis in ("y", "x"):
            for name in geometry.IntegralAxis.__dataclass_fields__:
                a, b = getattr(getattr(got, axis), name), getattr(getattr(want, axis), name)
                assert a.dtype == b.dtype and a.shape == b.shape, (i, axis, name)
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (
                    f"grid {i} P,Q={P},{Q} {np.dtype(dtype).name}: {axis}.{name} differs")


# ---- entry points and bad inputs ---------------------------------------------------------
def _inputs(dtype=np.float32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 9)).astype(dtype)
    rois = np.array([[0, 1, 2, 12, 10], [1, 4, 3, 15, 14], [-1, 1, 1, 2, 2]], dtype)
    return x, rois


PARAMS = dict(pooled_size=(2, 3), spatial_scale=0.5)


def test_entry_points_agree():
    """mx.nd.Custom, mx_roi.nd (mmcv's order: output size, scale), mx_roi.sym and the
    hybridized Gluon block agree with the reference; both gradients through Gluon."""
    import mx_roi
    import mx_roi.gluon as G
    x, rois = _inputs(np.float64)
    want = reference_forward(x, rois, (2, 3), 0.5)
    X, Rr = mx.nd.array(x, dtype="float64"), mx.nd.array(rois, dtype="float64")
    outs = [mx.nd.Custom(X, Rr, op_type="PrRoIPool", **PARAMS).asnumpy(),
            mx_roi.nd.PrRoIPool(X, Rr, (2, 3), 0.5).asnumpy()]
    sym = mx_roi.sym.PrRoIPool(mx.sym.var("data"), mx.sym.var("rois"), (2, 3), 0.5)
    exe = sym.bind(mx.cpu(), {"data": X, "rois": Rr})
    outs.append(exe.forward()[0].asnumpy())
    block = G.PrRoIPool((2, 3), 0.5)
    block.hybridize()
    xg, rg = X.copy(), Rr.copy()
    xg.attach_grad()
    rg.attach_grad()
    with autograd.record():
        y = block(xg, rg)
    g = np.random.default_rng(1).standard_normal(y.shape)
    y.backward(mx.nd.array(g, dtype="float64"))
    for o in outs:
        np.testing.assert_allclose(o, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(xg.grad.asnumpy(), reference_backward(x, rois, g, (2, 3), 0.5),
                               rtol=1e-10, atol=1e-12)
    check_rois_gradient(rg.grad.asnumpy(), x, rois, g, (2, 3), 0.5, np.float64, "gluon")
    assert "PrRoIPool" in mx_roi.OP_TYPES and "prpool" in G.MODES


def _call(x, rois, backward=False, gluon=False):
    import mx_roi.gluon as G
    X = mx.nd.array(x, dtype=x.dtype)
    Rr = mx.nd.array(rois, dtype=rois.dtype)
    X.attach_grad()
    Rr.attach_grad()
    block = None
    if gluon:
        block = G.PrRoIPool(**PARAMS)
        block.hybridize()
    with autograd.record():
        y = block(X, Rr) if gluon else mx.nd.Custom(X, Rr, op_type="PrRoIPool", **PARAMS)
    if backward:
        y.backward(mx.nd.ones(y.shape, dtype=x.dtype))
        return X.grad.asnumpy(), Rr.grad.asnumpy()
    return y.asnumpy()


@pytest.mark.parametrize("gluon", [False, True], ids=["nd", "gluon"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("bad,match", [
    ((1, 0, 2.0), r"PrRoIPool: rois\[1\] has batch index 2 but data holds only 2 image"),
    ((0, 3, np.nan), r"PrRoIPool: rois\[0\] has a NaN or infinite value"),
    ((2, 4, -np.inf), r"PrRoIPool: rois\[2\] has a NaN or infinite value"),
])
def test_bad_rois_then_next_call_works(gluon, backward, bad, match):
    """Clear errors, forward and backward (the queued backward of a rejected forward runs
    safely: both gradients zero), and the next call works."""
    import mx_roi  # noqa: F401
    x, rois = _inputs()
    r, c, v = bad
    rois[r, c] = v
    with pytest.raises(MXNetError, match=match):
        _call(x, rois, backward, gluon)
    x, rois = _inputs()
    np.testing.assert_allclose(_call(x, rois, gluon=gluon),
                               reference_forward(x, rois, (2, 3), 0.5), rtol=1e-5, atol=1e-5)
    dg, rg = _call(x, rois, True, gluon)
    assert np.isfinite(dg).all() and np.isfinite(rg).all()


@pytest.mark.parametrize("shape", [(3, 6), (3, 4), (3,)])
def test_rois_wrong_shape(shape):
    import mx_roi  # noqa: F401
    x, _ = _inputs()
    with pytest.raises(MXNetError, match=r"PrRoIPool: rois must have shape \(R, 5\) = "
                                         r"\(batch_index, x1, y1, x2, y2\)"):
        _call(x, np.zeros(shape, np.float32))


def test_onnx_export_refused(tmp_path):
    """ONNX has no precise RoI pooling: the exporter refuses the node, naming it."""
    assert_onnx_export_refused(tmp_path, "PrRoIPool", 5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("channels", [21, 37])
def test_native_walk_same_bits_as_the_generic_kernels(dtype, channels, monkeypatch):
    """The native build's 16-channel walks (forward, data gradient, rois' gradient) give
    the generic kernels' bits (run by the emulation); 21 channels: a full and a partial
    pass, 37: three.  The out-grad is 0 in some channels, whose maps hold infinite cells,
    and in a whole pass of one bin: the rois' gradient skips a channel whose out-grad is 0,
    as the generic loop does (counting it would add 0 * inf = NaN)."""
    import mx_roi  # noqa: F401
    rng = np.random.default_rng(30 + channels)
    x = make_data(rng, (2, channels, 9, 11), dtype)
    rois = np.concatenate([random_rois(rng, 12, 2, 9, 11, 0.5, dtype),
                           np.array([[-1, 1, 1, 5, 5], [1, 6, 6, 2, 9]], dtype)])
    grad = make_data(rng, (rois.shape[0], channels, 3, 2), dtype)
    silent = np.flatnonzero(rng.random(channels) < 0.3)
    grad[:, silent] = 0
    x[:, silent, ::2, ::3] = np.inf
    grad[0, :16, 1, 1] = 0
    assert_native_equals_emulation(monkeypatch, "PrRoIPool", x, rois,
                                   dict(pooled_size=(3, 2), spatial_scale=0.5), grad, dtype)


_TRAINING_STEPS = r"""
import sys
import numpy as np
import mxnet as mx
from mxnet import autograd
import mx_roi.gluon as G
op, steps = sys.argv[1], int(sys.argv[2])
if op == "RROIAlign":
    block = G.RROIAlign((2, 2), 0.5, 2)
    good = np.array([[0, 8, 6, 10, 6, 30], [1, 4, 9, 6, 12, -120]], np.float32)
else:
    block = G.PrRoIPool((2, 2), 0.5)
    good = np.array([[0, 1, 2, 12, 10], [1, 4, 3, 15, 14]], np.float32)
block.hybridize()
x = mx.nd.array(np.random.default_rng(0).standard_normal((2, 3, 8, 9)).astype(np.float32))
x.attach_grad()
first, raised = None, 0
for i in range(steps):
    r = good.copy()
    bad = i % 2 == 1
    if bad:
        r[1, 1 + i % 4] = np.nan
    try:
        with autograd.record():
            y = block(x, mx.nd.array(r))
        y.backward()
        out, g = y.asnumpy(), x.grad.asnumpy()
    except mx.base.MXNetError as e:
        assert bad and "NaN or infinite" in str(e), (i, str(e)[:300])
        raised += 1
        continue
    assert not bad, f"step {i}: a NaN roi passed, output {out.ravel()[:4]}"
    if first is None:
        first = out, g
    assert np.array_equal(out, first[0]) and np.array_equal(g, first[1]), f"step {i}"
print(raised)
"""


@pytest.mark.parametrize("op", ["RROIAlign", "PrRoIPool"])
def test_training_steps_with_bad_rois_in_a_child_process(op):
    """Hybridized Gluon training steps (record -> backward -> read, no wait), a NaN roi
    every other step, 120 steps in a child process: every bad step raises, every good one
    gives the same output and gradient, nothing aborts."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _TRAINING_STEPS, op, "120"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "60", proc.stdout
