"""The op cases and the parity run shared by :mod:`mx_roi.selftest` and :mod:`mx_roi.gpucheck`.

Below both (each imports this module, neither imports the other's helpers): every
registered op's ``selftest_cases`` (:data:`CASES`), a small adversarial problem per case
(:func:`problem`), one forward + backward through a backend (:func:`run`) and the
tolerance check (:func:`assert_close`).
"""
from __future__ import annotations

import numpy as np

__all__ = ["CASES", "TOL", "make_op", "problem", "rescan_variants", "as_array", "run",
           "grad_names", "assert_close", "assert_close_grads"]


def _cases():
    """``((op name, params), ...)``: every registered op's ``selftest_cases``."""
    from .registry import REGISTERED
    return tuple((name, dict(params)) for name, op in REGISTERED.items()
                 for params in op.selftest_cases)


CASES = _cases()
TOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-9}


def make_op(name, params):
    """An instance of the registered op ``name`` with the parameters ``params`` (a dict)."""
    from .registry import get_op
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**params))


def problem(op, dtype, seed=0, N=2, H=9, W=11):
    """``(data (N, C, H, W), rois (8, K), out_grad, extra)`` of ``dtype`` for ``op`` (K:
    the op's ``rois_columns``; ``extra``: its extra inputs, e.g. offsets): random boxes,
    some partly off the map, the first a padding roi (batch index -1)."""
    rng = np.random.default_rng(seed)
    p = op.param
    cin = p.in_channels if hasattr(p, "output_dim") else 3
    data = rng.standard_normal((N, cin, H, W)).astype(dtype)
    rois = type(op).random_rois(rng, 8, N, H, W, p.spatial_scale)
    rois[0, 0] = -1  # a padding roi
    rois = rois.astype(dtype)
    grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(dtype)
    extra = [np.asarray(a, dtype) for a in op.example_extra_inputs(rng, data.shape, rois)]
    return data, rois, grad, extra


def rescan_variants(name, params):
    """How the backward of op ``name`` is checked: ``(False,)``, or for a max mode
    ``(False, True)`` -- with the forward's argmax and with none kept, the backward
    rescanning the data as a large training call's does
    (:data:`mx_roi.cuda.backend.ARGMAX_KEEP_MAX_ELEMENTS`)."""
    return (False, True) if make_op(name, params).backward_needs_data else (False,)


def as_array(a, ctx):
    """``a`` as an array on ``ctx``: an MXNet context, or a GPU that CuPy arrays stand in
    for (:class:`mx_roi.cuda.cupy_arrays.Device`, where MXNet is a CPU build)."""
    a = np.asarray(a)
    if hasattr(ctx, "array"):
        return ctx.array(a)
    import mxnet as mx
    return mx.nd.array(a, ctx=ctx, dtype=a.dtype)


def run(backend, op, data, rois, grad, ctx, rescan=False, extra=()):
    """One forward (req ``write``) and backward of ``op`` through ``backend`` on ``ctx``;
    returns ``(output, gradients)`` as NumPy arrays: the data gradient, each extra
    input's, then the rois' for an op that differentiates them (:func:`grad_names`).
    ``rescan``: keep no argmax, so a max mode's backward rescans the data."""
    from .cuda import backend as cuda_backend
    x, r = as_array(data, ctx), as_array(rois, ctx)
    ex = [as_array(a, ctx) for a in extra]
    out = as_array(np.zeros(op.out_shape(data.shape, rois.shape), data.dtype), ctx)
    dg = as_array(np.zeros(data.shape, data.dtype), ctx)
    eg = [as_array(np.zeros(a.shape, a.dtype), ctx) for a in extra]
    rg = as_array(np.zeros(rois.shape, rois.dtype), ctx) if op.differentiates_rois else None
    keep_max = cuda_backend.ARGMAX_KEEP_MAX_ELEMENTS
    if rescan:  # (the checks run on one thread)
        cuda_backend.ARGMAX_KEEP_MAX_ELEMENTS = 0
    try:
        saved = backend.forward(op, "write", x, r, out, keep=True, extra=ex)
        backend.backward(op, "write", as_array(grad, ctx), x, r, dg, saved,
                         "write" if rg is not None else "null", rg, extra=ex,
                         extra_grad=[("write", g) for g in eg])
    finally:
        cuda_backend.ARGMAX_KEEP_MAX_ELEMENTS = keep_max
    return out.asnumpy(), [g.asnumpy() for g in [dg] + eg + ([rg] if rg is not None else [])]


def grad_names(op):
    """What :func:`run`'s gradients are: ``('data', extra inputs..., ['rois'])``."""
    return ("data",) + tuple(op.input_names()[2:]) + (("rois",) if op.differentiates_rois
                                                         else ())


def assert_close_grads(g1, g2, dtype, what, op):
    """:func:`assert_close` on each pair of gradients (``g2`` may stop early: a built-in
    without the rois' gradient)."""
    for name, a, b in zip(grad_names(op), g1, g2):
        assert_close(a, b, dtype, f"{what} {name} grad")


def assert_close(a, b, dtype, what):
    """Raise ``AssertionError`` naming ``what`` unless ``a`` is within :data:`TOL` of ``b``
    (relative to ``max(1, |b|)``)."""
    t = TOL[np.dtype(dtype)]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    err = float(np.abs(a64 - b64).max()) if a.size else 0.0
    lim = t * max(1.0, float(np.abs(b64).max()) if b.size else 1.0)
    if not err <= lim:
        raise AssertionError(f"{what}: max abs difference {err:.3g} > {lim:.3g}")
