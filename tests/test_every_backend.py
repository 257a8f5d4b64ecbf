"""What every backend must do with gradient buffers and bad rois, each backend named
explicitly (numpy, native, emulated-cuda; cuda on a GPU), so that one default run
reaches every backend's own store path (issue 37):

* the backward with no rois (R = 0) or only padding rois (batch index < 0), into
  gradient buffers holding garbage: ``write`` gives zeros, ``add`` leaves the buffer as
  it was, ``null`` does not touch it;
* a training step whose forward is rejected (bad rois), gradients pre-filled: ``add``
  leaves them as they were, ``write`` gives zeros (or, where MXNet skips the queued
  backward, leaves them whole -- never anything else), through ``mx.nd.Custom``,
  ``mx.sym`` and a hybridized Gluon block; and the queued backward itself, driven as
  MXNet drives it, zeroes (write), keeps (add) and leaves alone (null);
* several bad rois in one call: the message names the *first* bad row, with its index,
  for each kind of bad roi, forward and backward.

The ops, their parameters and input channels come from the registry (each op's
``selftest_cases``), so a new op is covered without editing this file.  Buffers are
pre-filled with :data:`FILL`, which is neither 0 nor 1 and exact in float16.  The
backend is picked with ``MX_ROI_BACKEND`` (in-process: MXNet asks for the backend at
every call), and each test checks that it was.
"""
from __future__ import annotations

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

import mx_roi
import mx_roi.backends
from mx_roi.registry import REGISTERED
from tests.gpu_cases import gpu_available

FILL = 7.25
DTYPES = (np.float16, np.float32, np.float64)

_GPU = [pytest.mark.gpu,
        pytest.mark.skipif(not gpu_available(), reason="needs CuPy, an MXNet GPU build "
                                                        "and a GPU")]
BACKENDS = ["numpy", "native", "emulated-cuda", pytest.param("cuda", marks=_GPU)]


def _cases():
    """(op_type, params): every registered op's selftest cases, and its first case with
    ``deterministic=True`` (the fixed-point accumulation: a store path of its own)."""
    out = []
    for name, op_cls in sorted(REGISTERED.items()):
        for params in op_cls.selftest_cases:
            out.append((name, dict(params)))
        out.append((name, dict(op_cls.selftest_cases[0], deterministic=True)))
    return out


CASES = _cases()
CASE_IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
OP_CASES = [(name, dict(op_cls.selftest_cases[0])) for name, op_cls in sorted(REGISTERED.items())]
OP_IDS = [n for n, _ in OP_CASES]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """(backend name, context): ``MX_ROI_BACKEND`` set for the test, and checks at the
    end that the ops ran on that backend and that no error record was left behind."""
    name = request.param
    monkeypatch.setenv("MX_ROI_BACKEND", "native" if name == "cuda" else name)
    chosen = []
    real = mx_roi.backends.select

    def spy(ctx, op=None):
        chosen.append(real(ctx, op))
        return chosen[-1]

    monkeypatch.setattr(mx_roi.backends, "select", spy)
    from mx_roi import errors
    pending = errors.pending()
    yield name, (mx.gpu(0) if name == "cuda" else mx.cpu())
    # every error the test provoked reached it (none left for a later call to pick up)
    assert errors.pending() == pending
    # the ops pick their backend with mx_roi.backends.select (none seen: they no longer
    # do, and this check needs another way to see the backend)
    assert chosen and set(chosen) == {name}, f"ran on {sorted(set(chosen))}, not {name}"


def _op(op_type, params):
    op_cls = REGISTERED[op_type]
    return op_cls(op_cls.param_cls.from_kwargs(**params))


def _problem(op_type, params, dtype, rois, seed=0):
    """data (2, C, 5, 6) for the op's channel rule, and a random out-grad for ``rois``."""
    op = _op(op_type, params)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((2, getattr(op.param, "in_channels", 3), 5, 6)).astype(dtype)
    rois = np.asarray(rois, dtype).reshape(-1, 5)
    out_grad = (1.0 + rng.random(op.out_shape(data.shape, rois.shape))).astype(dtype)
    return data, rois, out_grad


def _nd(a, ctx):
    return mx.nd.array(a, dtype=a.dtype, ctx=ctx)


def _filled(shape, dtype, ctx):
    return mx.nd.full(shape, FILL, dtype=dtype, ctx=ctx)


def _expect(req, got, what):
    """``got`` after a backward into a FILL-ed buffer with ``req``: zeros for write, the
    buffer unchanged for add and null (exact: no value may move)."""
    want = np.zeros_like(got) if req == "write" else np.full_like(got, FILL)
    assert got.tobytes() == want.tobytes(), (
        f"{what}, req {req!r}: expected {'zeros' if req == 'write' else 'the pre-fill'}, "
        f"got values {np.unique(got)[:6]}")


# ---- MXNet's CustomOp protocol, driven as MXNet drives it --------------------------
def _custom_op(op_type, params, data, rois, ctx):
    """The CustomOp MXNet would create for these inputs (``CustomOpProp`` with string
    kwargs -> ``list_arguments`` -> ``infer_shape`` -> ``create_operator``) and the
    output shape."""
    prop = REGISTERED[op_type].CustomOpProp(**{k: str(v) for k, v in params.items()})
    prop.list_arguments()
    _, (out_shape,), _ = prop.infer_shape([list(data.shape), list(rois.shape)])
    return prop.create_operator(ctx, [data.shape, rois.shape], [data.dtype, data.dtype]), \
        tuple(out_shape)


#: (data req, rois req) pairs: each req of each input, never the same for both (a req
#: read from the wrong input shows)
REQ_PAIRS = {"write": "add", "add": "null", "null": "write"}
#: the same under autograd, where a null input has no gradient buffer to look at
SWAPPED = {"write": "add", "add": "write"}


def _protocol_backward(op, req, data, rois, out_grad, ctx, out_shape, rois_req=None):
    """``op.backward`` into FILL-ed gradients (data ``req``, rois ``rois_req``, default
    ``REQ_PAIRS[req]``); returns (data grad, rois grad) as NumPy."""
    dg, rg = _filled(data.shape, data.dtype, ctx), _filled(rois.shape, rois.dtype, ctx)
    op.backward(req=[req, rois_req or REQ_PAIRS[req]], out_grad=[_nd(out_grad, ctx)],
                in_data=[_nd(data, ctx), _nd(rois, ctx)],
                out_data=[_filled(out_shape, data.dtype, ctx)], in_grad=[dg, rg], aux=[])
    return dg.asnumpy(), rg.asnumpy()


def _take_forward_error():
    """The message MXNet's generic error of the failed forward callback gets (the record
    it consumes), as a failed call would raise it."""
    from mx_roi import errors
    return str(errors.translate(MXNetError(
        "Check failed: reinterpret_cast<CustomOpFBFunc>(params.info->"
        "callbacks[kCustomOpForward])(...)")))


# ---------------------------------------------------- 1. R = 0 and all-padding rois
#: boxes inside and across the 5x6 map at scale 0.5 or 1, one padding row
GOOD_ROIS_LIVE = np.array([[0, 1, 1, 9, 8], [1, 0, 2, 4, 3], [-1, 3, 3, 4, 5], [1, 2, 1, 5, 4]])

ROI_SETS = {
    "R=0": np.zeros((0, 5)),
    # batch indices -1, -2 and -1.5 (truncates to -1): padding, never read
    "all-padding": np.array([[-1, 0, 0, 8, 8], [-2, 1, 1, 5, 9], [-1.5, 2, 0, 3, 4]]),
}


@pytest.mark.parametrize("op_type,params", CASES, ids=CASE_IDS)
def test_backward_without_live_rois_honours_req_over_garbage(op_type, params, backend):
    """R = 0 and all-padding rois, every dtype: through ``mx.nd.Custom`` under autograd
    (write, add) and through the op's backward as MXNet calls it (write, add, null), the
    data and rois gradients start as FILL: write -> zeros, add and null -> unchanged;
    the forward gives zeros (all padding) or an empty output (R = 0)."""
    name, ctx = backend
    for dtype in DTYPES:
        for kind, rois in ROI_SETS.items():
            data, rois, out_grad = _problem(op_type, params, dtype, rois)
            what = f"{op_type} {params} {kind} {np.dtype(dtype).name} on {name}"
            with mx.util.np_shape(True):  # zero-size arrays (R = 0)
                for req, rois_req in SWAPPED.items():
                    x, r = _nd(data, ctx), _nd(rois, ctx)
                    x.attach_grad(grad_req=req)
                    r.attach_grad(grad_req=rois_req)
                    x.grad[:] = FILL
                    r.grad[:] = FILL
                    with autograd.record():
                        y = mx.nd.Custom(x, r, op_type=op_type, **params)
                    y.backward(_nd(out_grad, ctx))
                    out = y.asnumpy()
                    assert out.shape == out_grad.shape and not out.any(), what
                    _expect(req, x.grad.asnumpy(), f"{what}: data grad (autograd)")
                    _expect(rois_req, r.grad.asnumpy(), f"{what}: rois grad (autograd)")
                op, out_shape = _custom_op(op_type, params, data, rois, ctx)
                out = _filled(out_shape, dtype, ctx)
                op.forward(is_train=True, req=["write"], in_data=[_nd(data, ctx), _nd(rois, ctx)],
                           out_data=[out], aux=[])
                assert not out.asnumpy().any(), f"{what}: forward over a FILL-ed output"
                for req in ("write", "add", "null"):
                    dg, rg = _protocol_backward(op, req, data, rois, out_grad, ctx, out_shape)
                    _expect(req, dg, f"{what}: data grad (CustomOp.backward)")
                    _expect(REQ_PAIRS[req], rg, f"{what}: rois grad (CustomOp.backward)")


TOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-13}


@pytest.mark.parametrize("op_type,params", CASES, ids=CASE_IDS)
def test_backward_with_live_rois_honours_req_over_garbage(op_type, params, backend):
    """Ordinary rois (one padding), every dtype, gradients pre-filled with FILL: write
    gives bit for bit what it gives over zeros, add gives FILL + that gradient, null
    leaves FILL (as MXNet drives the CustomOp; MXNet's own autograd never hands the op a
    null buffer it could see).  The rois gradient: zeros (write), FILL (add, null)."""
    name, ctx = backend
    for dtype in DTYPES:
        data, rois, out_grad = _problem(op_type, params, dtype, GOOD_ROIS_LIVE)
        what = f"{op_type} {params} {np.dtype(dtype).name} on {name}"
        grads = {}
        for req, fill in (("write", 0.0), ("write", FILL), ("add", FILL)):
            x, r = _nd(data, ctx), _nd(rois, ctx)
            x.attach_grad(grad_req=req)
            r.attach_grad(grad_req=SWAPPED[req] if fill else req)
            x.grad[:] = fill
            r.grad[:] = fill
            with autograd.record():
                y = mx.nd.Custom(x, r, op_type=op_type, **params)
            y.backward(_nd(out_grad, ctx))
            grads[req, fill] = x.grad.asnumpy()
            if fill:
                _expect(SWAPPED[req], r.grad.asnumpy(), f"{what}: rois grad")
        clean = grads["write", 0.0]
        assert clean.any(), f"{what}: the gradient is zero: the test checks nothing"
        assert grads["write", FILL].tobytes() == clean.tobytes(), \
            f"{what}: req write over FILL differs from req write over zeros"
        np.testing.assert_allclose(grads["add", FILL].astype(np.float64),
                                   FILL + clean.astype(np.float64), rtol=TOL[np.dtype(dtype)],
                                   atol=TOL[np.dtype(dtype)] * 8, err_msg=f"{what}: req add")
        op, out_shape = _custom_op(op_type, params, data, rois, ctx)
        op.forward(is_train=True, req=["write"], in_data=[_nd(data, ctx), _nd(rois, ctx)],
                   out_data=[_filled(out_shape, dtype, ctx)], aux=[])
        dg, rg = _protocol_backward(op, "null", data, rois, out_grad, ctx, out_shape)
        _expect("null", dg, f"{what}: data grad (CustomOp.backward)")
        _expect("write", rg, f"{what}: rois grad (CustomOp.backward)")


# ------------------------------------------------------------ 2. rejected training step
GOOD_ROIS = np.array([[0, 1, 1, 9, 8], [1, 0, 2, 12, 11], [-1, 3, 3, 4, 5], [1, 3, 3, 4, 5]])


def _bad_rois(kind):
    """GOOD_ROIS with bad rows 1 and 3 (and a padding row between them)."""
    rois = GOOD_ROIS.astype(np.float64)
    if kind == "batch":
        rois[1, 0], rois[3, 0] = 2, 9
    else:
        rois[1, 3], rois[3, 1] = np.inf, np.nan
    return rois


BAD_MESSAGE = {"batch": r"rois\[1\] has batch index 2 but data holds only 2 image",
               "non-finite": r"rois\[1\] has a NaN or infinite value"}


def _step(entry, op_type, params, x, r, out_grad, req, ctx, held):
    """One training step (record -> forward -> backward -> read, no wait) through
    ``entry`` (``nd``, ``sym`` or ``gluon-hybrid``: the block is kept in ``held`` per
    op and parameters), the data gradient pre-filled with FILL (``held["grad"]``, set
    before anything can raise); returns the output as NumPy."""
    if entry == "sym":
        sym = mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"), op_type=op_type, **params)
        exe = sym.simple_bind(ctx, data=x.shape, rois=r.shape,
                              type_dict={"data": x.dtype, "rois": r.dtype},
                              grad_req={"data": req, "rois": "null"})
        exe.arg_dict["data"][:] = x
        exe.arg_dict["rois"][:] = r
        held["grad"] = exe.grad_dict["data"]
        held["grad"][:] = FILL
        exe.forward(is_train=True)
        exe.backward(out_grad)
        return exe.outputs[0].asnumpy()
    x.attach_grad(grad_req=req)
    held["grad"] = x.grad
    x.grad[:] = FILL
    with autograd.record():
        if entry == "nd":
            y = mx.nd.Custom(x, r, op_type=op_type, **params)
        else:
            key = (op_type, str(sorted(params.items())))
            if key not in held:
                held[key] = getattr(mx_roi.gluon, op_type)(**params)
                held[key].hybridize()
            y = held[key](x, r)
    y.backward(out_grad)
    return y.asnumpy()


#: Known defect (found by this test, not fixed here): in a *graph* (``mx.sym`` +
#: ``simple_bind``, a hybridized Gluon block) with the oneDNN guard on, MXNet sometimes
#: skips the Custom node's backward after a rejected forward yet still runs the guard's
#: ``clip``/``identity`` backward over the gradient buffer the Custom node never wrote
#: (seen holding the forward's guarded copy of the data, or uninitialised values such as
#: -1.6e29 or -5e36), so the data gradient gets that memory (write) or FILL plus it
#: (add): measured 3-9 of 100 rejected hybridized steps per op and req, and in about one
#: run of this test in four through mx.sym; never with oneDNN off, never through
#: ``mx.nd.Custom`` (its guard adds no node).
GRAPH_GUARD_LEAK = ("known defect: a rejected step through a graph (mx.sym, hybridized "
                    "Gluon) with the oneDNN guard leaves stale or uninitialised memory in "
                    "the data gradient when MXNet skips the Custom backward")


@pytest.mark.parametrize("op_type,params", OP_CASES, ids=OP_IDS)
def test_rejected_training_step_leaves_the_gradient_clean(op_type, params, backend):
    """A step with bad rois (each kind) through ``mx.nd.Custom``, ``mx.sym`` and a
    hybridized Gluon block raises naming the first bad row; the data gradient, pre-filled
    with FILL, is then: add -> FILL; write -> zeros (the queued backward ran) or FILL
    (MXNet skipped it), whole, never a mix or other values.  The next good step of the
    same entry gives the plain forward's output and a finite gradient.  (Graphs with the
    oneDNN guard: see :data:`GRAPH_GUARD_LEAK`; ``mx.nd.Custom`` is held to it strictly.)"""
    from mx_roi.onednn import onednn_enabled
    name, ctx = backend
    data, good, out_grad = _problem(op_type, params, np.float32, GOOD_ROIS)
    want = mx.nd.Custom(_nd(data, ctx), _nd(good, ctx), op_type=op_type, **params).asnumpy()
    held, leaks = {}, []
    for entry in ("nd", "sym", "gluon-hybrid"):
        for kind in BAD_MESSAGE:
            for req in ("write", "add"):
                what = f"{op_type} {entry} {kind} req {req} on {name}"
                bad = _bad_rois(kind).astype(np.float32)
                with pytest.raises(MXNetError, match=rf"{op_type}: {BAD_MESSAGE[kind]}"):
                    _step(entry, op_type, params, _nd(data, ctx), _nd(bad, ctx),
                          _nd(out_grad, ctx), req, ctx, held)
                g = held["grad"].asnumpy()
                if req == "write" and not g.any():
                    continue  # the queued backward ran and zeroed it
                if entry != "nd" and onednn_enabled() and (g != FILL).any():
                    leaks.append(f"{what}: {np.unique(g)[:4]}")
                    continue
                _expect("add", g, f"{what}: data grad after the rejected step")
            out = _step(entry, op_type, params, _nd(data, ctx), _nd(good, ctx),
                        _nd(out_grad, ctx), "write", ctx, held)
            np.testing.assert_array_equal(out, want, err_msg=f"{op_type} {entry}: next step")
            assert np.isfinite(held["grad"].asnumpy()).all()
    if leaks:
        pytest.xfail(f"{GRAPH_GUARD_LEAK}: {leaks}")


@pytest.mark.parametrize("op_type,params", OP_CASES, ids=OP_IDS)
def test_queued_backward_of_a_rejected_forward(op_type, params, backend):
    """MXNet may run the queued backward of a forward that raised (timing decides): driven
    as MXNet drives it, the backward of each kind of rejected forward, into FILL-ed
    gradients, every dtype: write -> zeros, add and null -> unchanged, no error of its
    own; the forward's error is the one reported, naming the first bad row."""
    name, ctx = backend
    for dtype in DTYPES:
        for kind in BAD_MESSAGE:
            data, bad, out_grad = _problem(op_type, params, dtype, _bad_rois(kind))
            what = f"{op_type} {kind} {np.dtype(dtype).name} on {name}"
            for req in ("write", "add", "null"):
                op, out_shape = _custom_op(op_type, params, data, bad, ctx)
                with pytest.raises(ValueError, match=BAD_MESSAGE[kind]):
                    op.forward(is_train=True, req=["write"],
                               in_data=[_nd(data, ctx), _nd(bad, ctx)],
                               out_data=[_filled(out_shape, dtype, ctx)], aux=[])
                assert BAD_MESSAGE[kind].replace("\\", "") in _take_forward_error()
                dg, rg = _protocol_backward(op, req, data, bad, out_grad, ctx, out_shape)
                _expect(req, dg, f"{what}: data grad")
                _expect(REQ_PAIRS[req], rg, f"{what}: rois grad")


# ------------------------------------------------------------ 3. the first bad row
def _several_bad(kind, first):
    """Six rois with three bad rows, the first at ``first``; for non-finite values the
    later rows are bad in earlier columns (a column-wise scan would name them first)."""
    rois = np.array([[0, 1, 1, 9, 8], [-1, 0, 2, 12, 11], [1, 3, 3, 4, 5],
                     [0, 2, 2, 6, 6], [1, 0, 0, 5, 5], [0, 4, 4, 8, 8]], np.float64)
    rows = [first] + [r for r in (3, 4, 5) if r != first][:2]
    if kind == "batch":
        for r, b in zip(rows, (2, 9, 2.5)):  # 2 = N: the boundary
            rois[r, 0] = b
        return rois, rf"rois\[{first}\] has batch index 2 but data holds only 2 image"
    for r, (col, v) in zip(rows, ((4, np.inf), (1, np.nan), (0, -np.inf))):
        rois[r, col] = v
    return rois, rf"rois\[{first}\] has a NaN or infinite value"


@pytest.mark.parametrize("op_type,params", OP_CASES, ids=OP_IDS)
def test_several_bad_rois_message_names_the_first(op_type, params, backend):
    """Three bad rows of one kind: the forward (inference and training step) and the
    backward (rois made bad between the forward and the backward, so the backward's own
    check finds them; also driven as MXNet drives it) each name the first bad row by
    index, never a later one."""
    name, ctx = backend
    for kind in ("batch", "non-finite"):
        for first in (0, 2):
            bad, msg = _several_bad(kind, first)
            data, bad, out_grad = _problem(op_type, params, np.float32, bad)
            _, good, _ = _problem(op_type, params, np.float32, GOOD_ROIS[[0, 1, 3, 0, 1, 3]])
            pattern = rf"^{op_type}: {msg}"
            x, r = _nd(data, ctx), _nd(bad, ctx)
            with pytest.raises(MXNetError, match=rf"{op_type}: {msg}"):
                mx.nd.Custom(x, r, op_type=op_type, **params).asnumpy()
            x.attach_grad()
            with pytest.raises(MXNetError, match=rf"{op_type}: {msg}"):
                with autograd.record():
                    y = mx.nd.Custom(x, r, op_type=op_type, **params)
                y.backward(_nd(out_grad, ctx))
                y.asnumpy()
            # backward: a good forward, then the rois overwritten in place
            r = _nd(good, ctx)
            with autograd.record():
                y = mx.nd.Custom(x, r, op_type=op_type, **params)
            y.asnumpy()
            r[:] = _nd(bad, ctx)
            with pytest.raises(MXNetError, match=rf"{op_type}: {msg}"):
                y.backward(_nd(out_grad, ctx))
                x.grad.asnumpy()
            op, out_shape = _custom_op(op_type, params, data, good, ctx)
            op.forward(is_train=True, req=["write"], in_data=[_nd(data, ctx), _nd(good, ctx)],
                       out_data=[_filled(out_shape, np.float32, ctx)], aux=[])
            with pytest.raises(ValueError, match=pattern):
                _protocol_backward(op, "write", data, bad, out_grad, ctx, out_shape)
            from mx_roi import errors
            errors.translate(MXNetError("Check failed: params.info->"
                                        "callbacks[kCustomOpBackward](...)"))
