"""Protection for Python custom ops against the oneDNN (MKLDNN) layout hazard of MXNet 1.9.1.

A ``Custom`` node fed by a oneDNN operator (or whose output feeds one, for the backward)
can be handed memory MXNet has already freed.  The guard: every array input and output
of the node goes through ``clip(x, -B, B)`` (B = :data:`GUARD_BOUND`),
which always computes into a fresh plain-layout buffer (a graph input that is a variable
is made plain before the graph runs instead: :data:`LEAF`); imperative inputs are
reordered to the plain layout in place (:func:`plain_nd`) and an imperative output is a
recorded slice view whose backward writes a fresh plain gradient
(:func:`plain_grad_view`).  The measurements, the mechanism and the cost are in
``docs/ONEDNN_HAZARD.md``.  :func:`mx_roi.call_custom`
(:mod:`mx_roi.mxpatch`) applies the guard; ``import mx_roi`` makes plain
``mx.nd.Custom``/``mx.sym.Custom`` calls of our ops use it too.
"""
from __future__ import annotations

import json
import os
from typing import Any

import ctypes

import numpy as np

import mxnet as mx
from mxnet.base import _LIB, check_call

#: The oneDNN guard is ``clip(x, -GUARD_BOUND, GUARD_BOUND)``.  Not +-inf, and not FLT_MAX
#: itself: MXNet's float parameter parser rejects both ("Out of range value for a_max,
#: value='inf'" / "value='3.4028234663852886e+38'").  Since the guard turns inf into this
#: bound, the ops count ``|x| >= GUARD_BOUND`` as infinite (the registry's input check and
#: the ONNX export read it from here).
GUARD_BOUND = 3.0e38
_BOUND = GUARD_BOUND


def bounded_dtype(dtype) -> bool:
    """Whether ``dtype`` holds :data:`GUARD_BOUND` (float32, float64): there |x| >=
    GUARD_BOUND counts as infinite (float16: only inf and NaN are)."""
    held = _BOUNDED.get(dtype)
    if held is None:
        held = _BOUNDED[np.dtype(dtype)] = GUARD_BOUND <= float(np.finfo(dtype).max)
    return held


_BOUNDED = {}

__all__ = ["onednn_build", "onednn_enabled", "barrier", "guard_inputs", "guard_output",
           "plain_grad_view", "GUARD_BOUND", "bounded_dtype"]

_BUILD = None  # cached: does the loaded libmxnet have oneDNN compiled in?


def onednn_build() -> bool:
    """True when the loaded MXNet library was built with oneDNN (MKLDNN)."""
    global _BUILD
    if _BUILD is None:
        try:
            feats = mx.runtime.Features()
            _BUILD = any(name in feats and feats.is_enabled(name)
                         for name in ("MKLDNN", "ONEDNN"))
        except Exception:  # pragma: no cover - very old / unusual builds
            _BUILD = False
    return _BUILD


def _env_off(value: str) -> bool:
    return value.strip().lower() in ("0", "false", "off", "no")


_OFF_AT_IMPORT = _env_off(os.environ.get("MXNET_MKLDNN_ENABLED", "1"))


def onednn_enabled() -> bool:
    """True when oneDNN operators may be active: built in, and not disabled by
    ``MXNET_MKLDNN_ENABLED=0``.  MXNet reads that variable once, when its first operator
    runs, which we cannot observe; so it counts as "off" only if it was off when this
    module was imported and still is now (errs on the side of guarding)."""
    if not onednn_build():
        return False
    return not (_OFF_AT_IMPORT and _env_off(os.environ.get("MXNET_MKLDNN_ENABLED", "1")))


def barrier(F, x, name=None):
    """``clip(x, -3e38, 3e38)``: the same values in a fresh plain-layout array, with a
    plain-layout gradient in the backward.  Always applied (no oneDNN check)."""
    if name is not None and F is mx.sym:
        return F.clip(x, -_BOUND, _BOUND, name=name)
    return F.clip(x, -_BOUND, _BOUND)


def plain_nd(a):
    """Imperative input guard: ``a`` itself, converted *in place* to the plain layout.

    ``wait_to_read`` waits for ``a`` to be computed; ``MXNDArrayGetData`` then, when a
    oneDNN operator left it in a blocked layout, reorders its storage to the default
    layout in place (``NDArray::Reorder2Default``).  ``custom.cc`` then has no temporary
    to make (and free too early): the Custom node reads ``a``'s own memory, which lives
    as long as ``a``.  Costs
    a wait (the imperative call is synchronous here anyway) and, only for a blocked
    array, one reorder -- no copy of a plain array (``clip`` cost 12 ms for a
    2x1029x38x50 map on the 2-core test machine)."""
    if isinstance(a, mx.nd.NDArray) and a.size:
        a.wait_to_read()
        ptr = ctypes.c_void_p()
        check_call(_LIB.MXNDArrayGetData(a.handle, ctypes.byref(ptr)))
    return a


def _is_array(x: Any) -> bool:
    return isinstance(x, (mx.nd.NDArray, mx.sym.Symbol))


#: operators whose outputs are plain arrays of their own (no oneDNN implementation, never
#: in place): a graph input coming straight from one needs no guard -- e.g. the rois from
#: a proposal-target ``Custom`` op or from ``MultiProposal``
PLAIN_PRODUCERS = frozenset({"Custom", "_contrib_Proposal", "_contrib_MultiProposal"})


#: the "operator" of a graph variable.  A variable feeds the ``Custom`` node unguarded: an
#: executor's argument arrays are written by copies (plain layout), and a hybridized
#: block's inputs are made plain in place before its cached graph runs
#: (:func:`mx_roi.mxpatch.plain_block_inputs`).  Guard nodes there would put backward
#: operators between the ``Custom`` node's backward and the variable's gradient, and
#: those run on the unwritten gradient buffer when MXNet skips the ``Custom`` backward
#: after a rejected forward (``docs/ONEDNN_HAZARD.md``, "A rejected step in a graph").
LEAF = "null"


def _producer(s) -> str:
    """Operator of the node producing single-output symbol ``s`` (``'null'``: a variable,
    ``''``: unknown)."""
    if s.get_children() is None:
        return "null"
    if len(s.list_outputs()) != 1:
        return ""
    graph = json.loads(s.tojson())
    return graph["nodes"][graph["heads"][0][0]]["op"]


def guard_inputs(F, *arrays, name=None):
    """Return ``arrays`` (as a tuple) made safe to feed a ``Custom`` node.

    Imperatively (``F`` is ``mx.nd``) each array is :func:`plain_nd` (made plain in place,
    no copy); in graphs it passes through ``identity`` and :func:`barrier`, unless it is
    a variable (:data:`LEAF`) or the output of an operator in :data:`PLAIN_PRODUCERS`.
    Non-array items (``None``, numbers) pass through.  With ``name`` (symbolic mode) the guard nodes
    are called ``{name}_guard_copy{i}`` / ``{name}_guard_in{i}``.  A no-op when oneDNN is
    off."""
    if not onednn_enabled():
        return tuple(arrays)
    # MXNet 1.9.1's clip backward ignores grad_req='add' (it overwrites): an identity in
    # front of the clip takes the gradient of a leaf input and accumulates it correctly
    def guarded(i, a):
        if F is not mx.sym:
            return plain_nd(a)
        producer = _producer(a)
        if producer in PLAIN_PRODUCERS or producer == LEAF:
            return a
        if name is None:
            return barrier(F, F.identity(a))
        return barrier(F, F.identity(a, name=f"{name}_guard_copy{i}"), f"{name}_guard_in{i}")

    return tuple(guarded(i, a) if _is_array(a) else a for i, a in enumerate(arrays))


def guard_output(F, out, name=None):
    """Return the output(s) of a ``Custom`` node made safe for the backward pass: in
    graphs through :func:`barrier`, imperatively as :func:`plain_grad_view`.

    Accepts an NDArray, a list/tuple of NDArrays (multi-output ``mx.nd.Custom``), a
    Symbol (single or grouped multi-output ``mx.sym.Custom``).  With ``name`` (symbolic
    mode) the guard nodes are called ``{name}_guard_out{i}`` (the Custom node itself keeps
    its own name, so ``get_internals()[name + '_output']`` still finds it).  A no-op when
    oneDNN is off."""
    if not onednn_enabled() or out is None:
        return out
    def nm(i):
        return None if name is None else f"{name}_guard_out{i}"
    if isinstance(out, (list, tuple)):
        return type(out)((plain_grad_view(o) if isinstance(o, mx.nd.NDArray)
                          else barrier(F, o, nm(i))) if _is_array(o) else o
                         for i, o in enumerate(out))
    if isinstance(out, mx.sym.Symbol):
        n = len(out.list_outputs())
        if n > 1:
            return mx.sym.Group([barrier(F, out[i], nm(i)) for i in range(n)])
        return barrier(F, out, nm(0))
    if isinstance(out, mx.nd.NDArray):
        return plain_grad_view(out)
    return out


def plain_grad_view(a):
    """Imperative output guard: ``a[0:len(a)]``, a recorded ``slice`` whose forward is a
    view of ``a`` (no copy, no new buffer) and whose backward ``_backward_slice`` is a
    plain ``FCompute`` kernel writing a fresh plain-layout gradient -- all the backward of
    the ``Custom`` node needs (``docs/ONEDNN_HAZARD.md``).  An empty array (nothing to
    slice) goes through :func:`barrier`."""
    if a.ndim == 0 or a.shape[0] == 0:
        return barrier(mx.nd, a)
    return a[0:a.shape[0]]
