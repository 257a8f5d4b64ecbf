"""Shared machinery of the op test suite (torchvision ``RoIOpTester`` style).

Each op test module subclasses :class:`RoIOpTester` and provides

* ``op_type``: the ``mx.nd.Custom`` op_type string,
* ``param_cases()``: a list of parameter dicts (pytest parametrizes ``case`` over them),
* ``reference_forward`` / ``reference_backward``: the scalar oracles of ``tests.reference``,
* ``builtin``: the MXNet built-in equivalent (or ``None``) and ``builtin_ok`` (which
  inputs the built-in can be trusted with),
* ``in_channels(params, c)``: the input channel count for ``c`` "base" channels.

The ops are only ever reached through the public MXNet API: ``import mx_roi`` and
``mx.nd.Custom(data, rois, op_type=..., **params)``.  The backend is never chosen here:
``MX_ROI_BACKEND=emulated-cuda`` runs the same suite through the emulated CUDA kernels,
and ``MX_ROI_TEST_CTX=gpu`` puts the op inputs on ``mx.gpu(0)`` (references stay on
the host).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

DTYPES = (np.float16, np.float32, np.float64)
DTYPE_IDS = ("float16", "float32", "float64")

# (rtol, atol) per dtype; atol is scaled by max(1, max |expected|).
TOL = {
    np.dtype(np.float16): (1e-2, 1e-2),
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float64): (1e-10, 1e-10),
}

#: context the op inputs live on (MX_ROI_TEST_CTX=gpu -> mx.gpu(0))
CTX = mx.gpu(0) if os.environ.get("MX_ROI_TEST_CTX", "cpu").lower().startswith("gpu") \
    else mx.cpu()

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
dtype_param_32_64 = pytest.mark.parametrize("dtype", DTYPES[1:], ids=DTYPE_IDS[1:])


# --------------------------------------------------------------------------- data
def make_data(rng, shape, dtype, kind="randn"):
    """Feature maps.  ``randn``: distinct values; ``relu``: many exact zeros (ties);
    ``int``: small integers (ties everywhere); ``neg``: all strictly negative."""
    if kind == "randn":
        x = rng.standard_normal(shape)
    elif kind == "relu":
        x = np.maximum(rng.standard_normal(shape), 0.0)
    elif kind == "int":
        x = rng.integers(-2, 3, size=shape).astype(np.float64)
    elif kind == "neg":
        x = -1.0 - rng.random(shape)
    elif kind == "distinct":
        # well separated distinct values: safe for finite differences through max/argmax
        n = int(np.prod(shape))
        x = (rng.permutation(n).reshape(shape) - n / 2.0) * 0.1
    else:
        raise ValueError(kind)
    return x.astype(dtype)


def adversarial_rois(rng, N, H, W, spatial_scale, n_random=4, batch=None, dtype=np.float32):
    """RoIs (R, 5) in image coordinates designed to hit the corner cases.

    Boxes outside the map, partly outside, zero-size, reversed (x2 < x1), sub-cell,
    coordinates landing exactly on .5 after scaling (x = 8 at scale 1/16), raw .5
    coordinates (PSROIPooling rounds the raw coordinate), edges exactly on W / H,
    whole-map boxes, plus ``n_random`` random boxes.  Batch indices are uniform in
    [0, N) unless ``batch`` is given.
    """
    s = float(spatial_scale)
    IW, IH = W / s, H / s

    def u(v):  # feature-map units -> image units
        return v / s

    boxes = [
        (0.0, 0.0, IW - 1, IH - 1),                        # whole map
        (u(-3), u(-2), IW + u(2), IH + u(3)),               # larger than the map
        (IW + u(1), IH + u(1), IW + u(5), IH + u(4)),       # entirely beyond W, H
        (u(-6), u(-5), u(-2), u(-1)),                       # entirely negative
        (u(-1.5), 0.5 * IH, 0.5 * IW, IH + u(1.5)),         # partly outside
        (u(2), u(1), u(2), u(1)),                           # zero size
        (0.6 * IW, 0.7 * IH, 0.2 * IW, 0.1 * IH),           # reversed
        (u(1.2), u(1.3), u(1.6), u(1.5)),                   # sub-cell
        (u(0.5), u(1.5), u(2.5), u(3.5)),                   # exactly .5 after scaling
        (u(-0.5), u(-0.5), u(W - 0.5), u(H - 0.5)),         # -.5 / .5 edges
        (IW - u(1), IH - u(1), IW, IH),                     # far edge exactly at W, H
        (u(1), 0.0, u(3), u(H - 1)),                        # integer aligned
        (2.5, 1.5, 6.5, 5.5),                               # raw .5 coordinates
        (u(W - 1), u(0.25), u(W - 1), u(H - 1)),            # zero width at last column
    ]
    for _ in range(n_random):
        x1 = rng.uniform(-0.2 * IW, 1.1 * IW)
        y1 = rng.uniform(-0.2 * IH, 1.1 * IH)
        boxes.append((x1, y1, x1 + rng.uniform(0, 0.8 * IW), y1 + rng.uniform(0, 0.8 * IH)))
    boxes = np.asarray(boxes, np.float64)
    R = boxes.shape[0]
    if batch is None:
        bidx = rng.integers(0, N, size=R).astype(np.float64)
    else:
        bidx = np.full((R,), float(batch))
    return np.concatenate([bidx[:, None], boxes], axis=1).astype(dtype)


def random_rois(rng, R, N, H, W, spatial_scale, dtype=np.float32):
    """Ordinary, non-degenerate boxes (positive size, mostly inside the map)."""
    s = float(spatial_scale)
    IW, IH = W / s, H / s
    x1 = rng.uniform(-0.1 * IW, 0.8 * IW, R)
    y1 = rng.uniform(-0.1 * IH, 0.8 * IH, R)
    x2 = x1 + rng.uniform(1.0 / s, 0.7 * IW, R)
    y2 = y1 + rng.uniform(1.0 / s, 0.7 * IH, R)
    b = rng.integers(0, N, size=R)
    return np.stack([b, x1, y1, x2, y2], axis=1).astype(dtype)


# --------------------------------------------------------------------------- running
def run_custom(op_type, data, rois, params, grad=None, data_req="write", rois_req="write",
               passes=1, grad_fill=None):
    """Forward (and backward with ``grad``) through ``mx.nd.Custom``.

    Returns ``(out, data_grad, rois_grad)`` as NumPy arrays (grads are ``None`` when no
    backward was run or the req was ``null``).  ``passes`` > 1 repeats forward+backward
    (for ``grad_req='add'``); ``grad_fill`` pre-fills both gradient buffers (garbage that
    ``write`` must overwrite).
    """
    import mx_roi  # noqa: F401  (registers the op types)

    x = mx.nd.array(data, dtype=data.dtype, ctx=CTX)
    r = mx.nd.array(rois, dtype=rois.dtype, ctx=CTX)
    if grad is None:
        y = mx.nd.Custom(x, r, op_type=op_type, **params)
        return y.asnumpy(), None, None
    x.attach_grad(grad_req=data_req)
    r.attach_grad(grad_req=rois_req)
    if grad_fill is not None:
        x.grad[:] = grad_fill
        r.grad[:] = grad_fill
    for _ in range(passes):
        with autograd.record():
            y = mx.nd.Custom(x, r, op_type=op_type, **params)
        y.backward(mx.nd.array(grad, dtype=data.dtype, ctx=CTX))
    out = y.asnumpy()
    dg = None if data_req == "null" else x.grad.asnumpy()
    rg = None if rois_req == "null" else r.grad.asnumpy()
    return out, dg, rg


def assert_native_equals_emulation(monkeypatch, op_type, data, rois, params, grad, dtype,
                                   what=("output", "data", "rois"), **kw):
    """The native build's walks give the generic kernels' bits (run by the emulation):
    :func:`run_custom` under each backend, its first ``len(what)`` results equal to the bit.
    """
    got = {}
    for kind in ("native", "emulated-cuda"):
        monkeypatch.setenv("MX_ROI_BACKEND", kind)
        got[kind] = run_custom(op_type, data, rois, params, grad=grad, **kw)
    for a, b, name in zip(got["native"][:len(what)], got["emulated-cuda"][:len(what)], what):
        assert_close(a, b, dtype, f"native vs emulation: {name}", exact=True)


def assert_onnx_export_refused(tmp_path, op_type, rois_columns):
    """The ONNX exporter refuses an ``op_type`` node (pooled (2, 2), scale 0.5), naming it."""
    import mx_roi
    from mx_roi.onnx import ExportError
    sym = getattr(mx_roi.sym, op_type)(mx.sym.var("data"), mx.sym.var("rois"), (2, 2), 0.5)
    with pytest.raises(ExportError, match=rf"{op_type}.*no ONNX translation"):
        mx.onnx.export_model(sym, {}, [(1, 3, 8, 9), (2, rois_columns)],
                             [np.float32, np.float32], str(tmp_path / "m.onnx"))


def run_builtin(fn, data, rois, params, grad):
    x = mx.nd.array(data, dtype=data.dtype, ctx=CTX)
    r = mx.nd.array(rois, dtype=rois.dtype, ctx=CTX)
    x.attach_grad()
    with autograd.record():
        y = fn(x, r, **params)
    y.backward(mx.nd.array(grad, dtype=data.dtype, ctx=CTX))
    return y.asnumpy(), x.grad.asnumpy()


def assert_close(actual, expected, dtype, what="", exact=False, tol_scale=1.0):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype} != {np.dtype(dtype)}"
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    if exact:
        bad = ~((a == e) | (np.isnan(a) & np.isnan(e)))
        if bad.any():
            idx = tuple(np.argwhere(bad)[0])
            raise AssertionError(f"{what}: {bad.sum()} of {a.size} elements differ (exact "
                                 f"comparison); first at {idx}: got {a[idx]!r}, "
                                 f"expected {e[idx]!r}")
        return
    rtol, atol = TOL[np.dtype(dtype)]
    atol = atol * tol_scale * max(1.0, float(np.abs(e).max()) if e.size else 1.0)
    np.testing.assert_allclose(a, e, rtol=rtol * tol_scale, atol=atol, err_msg=what)


def case_id(params):
    parts = []
    for k, v in params.items():
        if isinstance(v, tuple):
            v = "x".join(str(i) for i in v)
        parts.append(f"{k}={v}")
    return ",".join(parts)


# --------------------------------------------------------------------------- the tester
class RoIOpTester:
    """Base class: subclasses are collected by pytest (``Test*``), this one is not."""

    op_type: str = ""
    builtin = None            # callable(data_nd, rois_nd, **builtin_params) or None
    exact_forward = False     # ROIPooling: bit-exact forward for float32/float64
    exact_backward = False
    N, C, H, W = 2, 3, 9, 10  # default problem size (C is the "base" channel count)
    data_kinds = ("randn", "relu", "int")
    rois_columns = 5          # columns of a roi row

    # ---- the op's rois (an op with another roi layout overrides these)
    def adversarial(self, rng, N, H, W, spatial_scale, n_random=4, batch=None,
                    dtype=np.float32):
        """Corner-case rois of the op's layout (:func:`adversarial_rois`)."""
        return adversarial_rois(rng, N, H, W, spatial_scale, n_random, batch, dtype)

    def ordinary(self, rng, R, N, H, W, spatial_scale, dtype=np.float32):
        """Ordinary rois of the op's layout (:func:`random_rois`)."""
        return random_rois(rng, R, N, H, W, spatial_scale, dtype)

    def numeric_rois(self, rng, N, H, W, spatial_scale, dtype):
        """A few rois of every kind for the finite-difference check."""
        return np.concatenate([
            self.adversarial(rng, N, H, W, spatial_scale, n_random=2,
                             dtype=dtype)[[0, 4, 7, 8, 9, 12, 15]],
            self.ordinary(rng, 2, N, H, W, spatial_scale, dtype)])

    def check_rois_grad(self, rg, data, rois, grad, params, dtype, what=""):
        """The rois' gradient: zero (an op that differentiates its rois overrides it)."""
        assert rg.shape == rois.shape
        assert not rg.any(), f"{self.op_type}: rois gradient must be zero"

    # ---- to be provided by subclasses
    @classmethod
    def param_cases(cls):
        raise NotImplementedError

    def reference_forward(self, data, rois, **params):
        raise NotImplementedError

    def reference_backward(self, data, rois, grad, **params):
        raise NotImplementedError

    def in_channels(self, params, c):
        return c

    def out_channels(self, params, c):
        return c

    def builtin_params(self, params):
        return None  # None: the built-in cannot express these params

    def builtin_ok(self, rois, params):
        """Boolean mask of the rois the built-in handles like the op must."""
        return rois[:, 0] >= 0

    def pooled(self, params):
        ps = params["pooled_size"]
        return (ps, ps) if isinstance(ps, int) else tuple(ps)

    # ---- helpers
    def make_problem(self, rng, params, dtype, kind="randn", rois=None, N=None, H=None,
                     W=None, C=None):
        N = N or self.N
        H = H or self.H
        W = W or self.W
        C = C or self.C
        cin = self.in_channels(params, C)
        data = make_data(rng, (N, cin, H, W), dtype, kind)
        if rois is None:
            rois = self.adversarial(rng, N, H, W, params["spatial_scale"], dtype=dtype)
        rois = np.asarray(rois).astype(dtype)
        PH, PW = self.pooled(params)
        grad = make_data(rng, (rois.shape[0], self.out_channels(params, C), PH, PW), dtype)
        return data, rois, grad

    def check_forward(self, data, rois, params, dtype, what=""):
        out, _, _ = run_custom(self.op_type, data, rois, params)
        ref = self.reference_forward(data, rois, **params)
        exact = self.exact_forward and np.dtype(dtype) != np.float16
        assert_close(out, ref, dtype, f"{self.op_type} forward {what} {params}", exact=exact)
        return out

    def check_forward_backward(self, data, rois, grad, params, dtype, what="", **kw):
        out, dg, rg = run_custom(self.op_type, data, rois, params, grad=grad, **kw)
        ref = self.reference_forward(data, rois, **params)
        exact = self.exact_forward and np.dtype(dtype) != np.float16
        assert_close(out, ref, dtype, f"{self.op_type} forward {what} {params}", exact=exact)
        if dg is not None:
            gref = self.reference_backward(data, rois, grad, **params)
            exact = self.exact_backward and np.dtype(dtype) != np.float16
            assert_close(dg, gref, dtype, f"{self.op_type} data grad {what} {params}",
                         exact=exact)
        if rg is not None:
            self.check_rois_grad(rg, data, rois, grad, params, dtype, what)
        return out, dg, rg

    # ---- the tests
    @dtype_param
    def test_forward_vs_reference(self, case, dtype):
        rng = np.random.default_rng(0)
        for kind in self.data_kinds:
            data, rois, _ = self.make_problem(rng, case, dtype, kind)
            self.check_forward(data, rois, case, dtype, what=f"[{kind} data]")

    @dtype_param
    def test_backward_vs_reference(self, case, dtype):
        rng = np.random.default_rng(1)
        for kind in self.data_kinds:
            data, rois, grad = self.make_problem(rng, case, dtype, kind)
            self.check_forward_backward(data, rois, grad, case, dtype, what=f"[{kind} data]")

    @dtype_param_32_64
    def test_vs_builtin(self, case, dtype):
        """Forward and data gradient against MXNet's built-in op (float16 is excluded:
        the built-ins compute their geometry in half precision)."""
        bparams = self.builtin_params(case)
        if self.builtin is None or bparams is None:
            pytest.skip(f"no MXNet built-in equivalent of {self.op_type} with {case}")
        rng = np.random.default_rng(2)
        for kind in ("randn", "int"):
            data, rois, grad = self.make_problem(rng, case, dtype, kind)
            rand = self.ordinary(rng, 6, self.N, self.H, self.W, case["spatial_scale"], dtype)
            rois = np.concatenate([rois, rand]).astype(dtype)
            rois = rois[self.builtin_ok(rois, case)]
            PH, PW = self.pooled(case)
            grad = make_data(rng, (rois.shape[0], self.out_channels(case, self.C), PH, PW),
                             dtype)
            out, dg, _ = run_custom(self.op_type, data, rois, case, grad=grad)
            bout, bdg = run_builtin(type(self).builtin, data, rois, bparams, grad)
            exact = self.exact_forward
            assert_close(out, bout, dtype, f"{self.op_type} forward vs built-in [{kind}]",
                         exact=exact)
            assert_close(dg, bdg, dtype, f"{self.op_type} data grad vs built-in [{kind}]")

    @dtype_param
    def test_rois_gradient_is_zero(self, dtype):
        case = self.param_cases()[0]
        rng = np.random.default_rng(3)
        data, rois, grad = self.make_problem(rng, case, dtype)
        _, dg, rg = run_custom(self.op_type, data, rois, case, grad=grad, grad_fill=7)
        assert rg is not None and rg.shape == rois.shape and rg.dtype == np.dtype(dtype)
        assert not rg.any(), "rois gradient must be zero (write over the buffer's garbage)"
        _, dg_clean, _ = run_custom(self.op_type, data, rois, case, grad=grad)
        np.testing.assert_array_equal(dg, dg_clean)  # and the data gradient overwritten

    def test_numeric_gradient(self, case):
        """Central finite differences in float64 on a small problem (the ops are
        (piecewise) linear in the data; well separated distinct values keep max/argmax
        stable).  Checks every element with a nonzero analytic gradient (up to 48), a
        sample of elements with zero gradient, and three random directions."""
        rng = np.random.default_rng(4)
        dtype = np.float64
        N, H, W, C = 2, 5, 6, 1
        data = make_data(rng, (N, self.in_channels(case, C), H, W), dtype, "distinct")
        rois = self.numeric_rois(rng, N, H, W, case["spatial_scale"], dtype)
        PH, PW = self.pooled(case)
        grad = rng.standard_normal((rois.shape[0], self.out_channels(case, C), PH, PW))
        _, dg, _ = run_custom(self.op_type, data, rois, case, grad=grad)
        assert dg.any(), "analytic gradient is identically zero"

        def loss(x):
            return float((run_custom(self.op_type, x, rois, case)[0] * grad).sum())

        eps = 1e-4
        flat_dg = dg.reshape(-1)
        nonzero = np.flatnonzero(flat_dg)
        zero = np.flatnonzero(flat_dg == 0)
        picks = np.concatenate([
            rng.choice(nonzero, size=min(48, nonzero.size), replace=False),
            rng.choice(zero, size=min(16, zero.size), replace=False)]).astype(int)
        for k in picks:
            e = np.zeros(data.size)
            e[k] = eps
            e = e.reshape(data.shape)
            numeric = (loss(data + e) - loss(data - e)) / (2 * eps)
            assert abs(numeric - flat_dg[k]) <= 1e-6 + 1e-6 * abs(numeric), (
                f"{self.op_type} d loss / d data.flat[{k}] "
                f"(index {np.unravel_index(k, data.shape)}): analytic {flat_dg[k]!r}, "
                f"numeric {numeric!r}")
        for _ in range(3):
            v = rng.standard_normal(data.shape)
            numeric = (loss(data + eps * v) - loss(data - eps * v)) / (2 * eps)
            analytic = float((dg * v).sum())
            assert abs(numeric - analytic) <= 1e-6 + 1e-6 * abs(numeric), (
                f"{self.op_type} directional derivative: analytic {analytic!r}, "
                f"numeric {numeric!r}")

    @dtype_param
    def test_zero_rois_forward(self, dtype):
        """R = 0 -> output (0, C, PH, PW).  Zero-size arrays need MXNet's NumPy shape
        semantics (in legacy semantics a 0 dim means "unknown")."""
        case = self.param_cases()[0]
        rng = np.random.default_rng(5)
        data, _, _ = self.make_problem(rng, case, dtype)
        PH, PW = self.pooled(case)
        cout = self.out_channels(case, self.C)
        with mx.util.np_shape(True):
            out, _, _ = run_custom(self.op_type, data, np.zeros((0, self.rois_columns), dtype),
                                   case)
        assert out.shape == (0, cout, PH, PW) and out.dtype == np.dtype(dtype)

    @dtype_param
    def test_zero_rois_backward(self, dtype):
        case = self.param_cases()[0]
        rng = np.random.default_rng(5)
        data, _, _ = self.make_problem(rng, case, dtype)
        PH, PW = self.pooled(case)
        cout = self.out_channels(case, self.C)
        grad = np.zeros((0, cout, PH, PW), dtype)
        with mx.util.np_shape(True):  # over garbage: write must still zero
            out, dg, rg = run_custom(self.op_type, data,
                                     np.zeros((0, self.rois_columns), dtype), case,
                                     grad=grad, grad_fill=7.25)
        assert out.shape == (0, cout, PH, PW) and out.dtype == np.dtype(dtype)
        assert dg.shape == data.shape and not dg.any()
        assert rg.shape == (0, self.rois_columns)

    @dtype_param
    def test_grad_req_add(self, dtype):
        case = self.param_cases()[0]
        rng = np.random.default_rng(6)
        data, rois, grad = self.make_problem(rng, case, dtype)
        _, dg, rg = run_custom(self.op_type, data, rois, case, grad=grad, data_req="add",
                               rois_req="add", passes=2)
        gref = self.reference_backward(data, rois, grad, **case)
        twice = (gref.astype(np.float64) * 2).astype(dtype)
        assert_close(dg, twice, dtype, f"{self.op_type} grad_req='add' twice", tol_scale=2)
        self.check_rois_grad_add(rg, data, rois, grad, case, dtype)

    def check_rois_grad_add(self, rg, data, rois, grad, params, dtype):
        """The rois' gradient after two passes with grad_req='add' (zero by default)."""
        assert not rg.any()

    @dtype_param
    def test_grad_req_null(self, dtype):
        case = self.param_cases()[0]
        rng = np.random.default_rng(7)
        data, rois, grad = self.make_problem(rng, case, dtype)
        # rois null, data write
        _, dg, rg = run_custom(self.op_type, data, rois, case, grad=grad, rois_req="null")
        assert rg is None
        assert_close(dg, self.reference_backward(data, rois, grad, **case), dtype,
                     f"{self.op_type} data grad with rois grad_req='null'")
        # data null, rois write: no crash, rois grad zero
        out, dg, rg = run_custom(self.op_type, data, rois, case, grad=grad, data_req="null")
        assert dg is None
        self.check_rois_grad(rg, data, rois, grad, case, dtype, "[data grad_req='null']")
        assert_close(out, self.reference_forward(data, rois, **case), dtype,
                     f"{self.op_type} forward with data grad_req='null'")

    @dtype_param
    def test_batch_index_greater_than_zero(self, dtype):
        case = self.param_cases()[0]
        rng = np.random.default_rng(8)
        N = 3
        rois = self.adversarial(rng, N, self.H, self.W, case["spatial_scale"], batch=2,
                                dtype=dtype)
        data, rois, grad = self.make_problem(rng, case, dtype, rois=rois, N=N)
        _, dg, _ = self.check_forward_backward(data, rois, grad, case, dtype, "[batch 2]")
        assert not dg[:2].any(), "gradient leaked into images the rois do not index"
        # mixed batches
        rois[:, 0] = np.arange(rois.shape[0]) % N
        self.check_forward_backward(data, rois, grad, case, dtype, "[mixed batches]")

    @dtype_param
    def test_negative_batch_index(self, dtype):
        case = self.param_cases()[0]
        rng = np.random.default_rng(9)
        data, rois, grad = self.make_problem(rng, case, dtype)
        neg = np.arange(rois.shape[0]) % 3 == 0
        rois[neg, 0] = -1
        out, dg, _ = self.check_forward_backward(data, rois, grad, case, dtype, "[batch -1]")
        assert not out[neg].any(), "rois with batch index -1 must give zero output"
        rois[:, 0] = -1
        out, dg, rg = run_custom(self.op_type, data, rois, case, grad=grad, grad_fill=7.25)
        assert not out.any() and not dg.any() and not rg.any()

    @dtype_param_32_64
    def test_fractional_batch_index_truncates(self, dtype):
        """``int(rois[r, 0])`` truncates toward zero: 1.7 -> 1, -0.5 -> 0 (not padding)."""
        case = self.param_cases()[0]
        rng = np.random.default_rng(10)
        data, rois, grad = self.make_problem(rng, case, dtype)
        rois[0::2, 0] = 1.7
        rois[1::2, 0] = -0.5
        self.check_forward_backward(data, rois, grad, case, dtype, "[fractional batch]")

    @dtype_param
    def test_non_square_pool(self, dtype):
        rng = np.random.default_rng(11)
        for case in self.non_square_cases():
            data, rois, grad = self.make_problem(rng, case, dtype, "relu")
            out, _, _ = self.check_forward_backward(data, rois, grad, case, dtype,
                                                    "[non-square]")
            assert out.shape[2:] == tuple(case["pooled_size"])

    def non_square_cases(self):
        base = dict(self.param_cases()[0])
        return [dict(base, pooled_size=(2, 3)), dict(base, pooled_size=(3, 1))]

    def test_pooled_size_spellings(self):
        """pooled_size as a tuple, a list-like string, an int and an int string."""
        case = dict(self.param_cases()[0])
        P = 2
        outs = []
        for spelling in ((P, P), f"({P}, {P})", P, str(P), [P, P]):
            params = dict(case, pooled_size=spelling)
            if "group_size" in params and params["group_size"]:
                params["group_size"] = P
            p = dict(params, pooled_size=(P, P))
            data, rois, _ = self.make_problem(np.random.default_rng(12), p, np.float32)
            out, _, _ = run_custom(self.op_type, data, rois, params)
            assert out.shape[2:] == (P, P), spelling
            outs.append(out)
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])

    def test_deterministic_flag(self):
        case = dict(self.param_cases()[0])
        rng = np.random.default_rng(13)
        data, rois, grad = self.make_problem(rng, case, np.float32)
        a = run_custom(self.op_type, data, rois, dict(case, deterministic=True), grad=grad)
        b = run_custom(self.op_type, data, rois, dict(case, deterministic=False), grad=grad)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-5)
        self.check_forward_backward(data, rois, grad, dict(case, deterministic=True),
                                    np.float32, "[deterministic=True]")

    def test_inputs_not_modified(self):
        """Forward and backward leave data, rois and the output gradient untouched."""
        import mx_roi  # noqa: F401

        case = dict(self.param_cases()[0])
        rng = np.random.default_rng(15)
        data, rois, grad = self.make_problem(rng, case, np.float32, "relu")
        x = mx.nd.array(data, ctx=CTX)
        r = mx.nd.array(rois, ctx=CTX)
        g = mx.nd.array(grad, ctx=CTX)
        x.attach_grad()
        with autograd.record():
            y = mx.nd.Custom(x, r, op_type=self.op_type, **case)
        y.backward(g)
        mx.nd.waitall()
        np.testing.assert_array_equal(x.asnumpy(), data)
        np.testing.assert_array_equal(r.asnumpy(), rois)
        np.testing.assert_array_equal(g.asnumpy(), grad)

    @dtype_param_32_64
    def test_many_rois(self, dtype):
        """Many random rois of all kinds in one call (vectorisation across rois)."""
        case = dict(self.param_cases()[0])
        rng = np.random.default_rng(16)
        N = 3
        rois = np.concatenate(
            [self.adversarial(rng, N, self.H, self.W, case["spatial_scale"], n_random=20,
                              dtype=dtype),
             self.ordinary(rng, 30, N, self.H, self.W, case["spatial_scale"], dtype)])
        rois[rng.random(rois.shape[0]) < 0.1, 0] = -1
        data, rois, grad = self.make_problem(rng, case, dtype, "randn", rois=rois, N=N)
        self.check_forward_backward(data, rois, grad, case, dtype, "[many rois]")

    def test_symbolic_api(self):
        """The op also works inside a symbol graph (mx.sym.Custom + simple_bind)."""
        import mx_roi  # noqa: F401

        case = dict(self.param_cases()[0])
        rng = np.random.default_rng(14)
        data, rois, grad = self.make_problem(rng, case, np.float32)
        sym = mx.sym.Custom(mx.sym.Variable("data"), mx.sym.Variable("rois"),
                            op_type=self.op_type, **case)
        exe = sym.simple_bind(CTX, data=data.shape, rois=rois.shape,
                              grad_req={"data": "write", "rois": "null"})
        exe.arg_dict["data"][:] = data
        exe.arg_dict["rois"][:] = rois
        out = exe.forward(is_train=True)[0].asnumpy()
        exe.backward(mx.nd.array(grad, ctx=CTX))
        assert_close(out, self.reference_forward(data, rois, **case), np.float32,
                     "symbolic forward", exact=self.exact_forward)
        assert_close(exe.grad_dict["data"].asnumpy(),
                     self.reference_backward(data, rois, grad, **case), np.float32,
                     "symbolic data grad")


class PositionSensitiveTester(RoIOpTester):
    """Channel rules shared by the PSROIPooling and PSROIAlign testers."""

    def groups(self, params):
        """(GH, GW): ``group_size`` 0 = the pooled grid, an int = square, or a pair."""
        g = params.get("group_size", 0)
        GH, GW = (int(g), int(g)) if isinstance(g, int) else tuple(g)
        return self.pooled(params) if (GH, GW) == (0, 0) else (GH, GW)

    def in_channels(self, params, c):
        GH, GW = self.groups(params)
        return params["output_dim"] * GH * GW

    def out_channels(self, params, c):
        return params["output_dim"]

    def non_square_cases(self):
        base = dict(self.param_cases()[0])
        return [dict(base, pooled_size=(2, 3), group_size=2),
                dict(base, pooled_size=(3, 1), group_size=1),
                dict(base, pooled_size=(1, 4), group_size=3),
                dict(base, pooled_size=(2, 3), group_size=0),         # the pooled grid
                dict(base, pooled_size=(3, 4), group_size=(2, 3)),    # (gh, gw) != (P, Q)
                dict(base, pooled_size=(2, 2), group_size=(1, 3))]
