"""Protection for Python custom ops against the oneDNN (MKLDNN) layout hazard of MXNet 1.9.1.

The hazard
----------
In the pip CPU build of MXNet 1.9.1 (oneDNN on by default), a ``Custom`` node whose
inputs come straight from a oneDNN operator (``Convolution``, and in the backward pass
the data-gradient of a ``Convolution`` that consumes the custom op's output) can hand the
Python ``CustomOp`` memory that MXNet has already freed.  Symptoms seen here, with a toy
crop op in Conv -> Custom -> [Conv ->] FC graphs: forward outputs and gradients that are
wrong in a few percent of the iterations (relative errors from 0.05 to 1e38, inf), and in
bigger models (GluonCV Faster R-CNN) crashes: ``terminate called without an active
exception``, segfaults, ``double free``.  ``MXNET_MKLDNN_ENABLED=0`` or
``MXNET_ENGINE_TYPE=NaiveEngine`` make it disappear.

The mechanism (as measured; see ``tests/test_onednn.py``)
--------------------------------------------------------
oneDNN operators may leave their output in a *blocked* memory layout (e.g. nChw16c)
instead of MXNet's plain NCHW.  ``Custom`` is dispatched as ``FComputeEx``, so MXNet gives
it such arrays as they are.  Before handing an array to Python, ``custom.cc`` has to turn
a blocked array into a plain one, and does so into a *temporary* NDArray.  The Python
``forward``/``backward`` runs later, asynchronously, on the custom-op worker thread; by
then that temporary may already be released, so ``in_data[0].asnumpy()`` (or
``out_grad[0].asnumpy()``) reads freed heap memory.  Evidence: with a static-alloc
hybridized block the data pointer the op sees changes every iteration (a fresh temporary)
instead of being the block's static buffer, and the corrupted iterations have exactly the
first 32 bytes of the buffer replaced by glibc free-list pointers (values like 4.2e31 and
4.58e-41, the halves of a 0x7f.. address).  Most of the time the freed block has not
been reused yet, hence *mostly* correct results; when it has, anything can happen.

Which arrays are affected:

* forward ``in_data`` produced by a oneDNN op (Convolution, also BatchNorm/Activation/
  Pooling... that keep the blocked layout);
* backward ``out_grad`` produced by the backward of a oneDNN op that consumes the custom
  op's output (e.g. a Convolution head after ROIAlign, as in Faster R-CNN's ResNet
  stage-5 head).

Inserting a layout-preserving or in-place op does *not* help: ``x * 1.0``, ``identity``
(``_copy``), ``Cast``, ``BlockGrad`` and ``reshape`` were all measured still broken,
because MXNet runs them in place (or with a oneDNN ``FComputeEx``) so their result shares
the blocked buffer.  Guarding only the inputs also leaves the backward broken.

The fix
-------
Every array input of the ``Custom`` node and every output of it is passed through
``clip(x, -B, B)`` with B = 3e38 (just under the largest finite float32, 3.4028e38).  ``clip`` has no oneDNN implementation, is computed by a plain
``FCompute`` kernel into a fresh plain-layout buffer, and neither it nor its backward
``_backward_clip`` runs in place.  So the custom op's forward inputs are plain arrays MXNet
owns for the whole call, and the gradient arriving at the custom op's backward is the
plain output of ``_backward_clip``, not an alias of a oneDNN buffer.  Values with
|x| <= 3e38 (and NaN) are unchanged bit for bit and their gradients pass through
unchanged; the only changes: +-inf (and |x| > 3e38) become +-3e38 with zero gradient, a
NaN input gets a zero gradient.  (float16: the bound rounds to inf, so clip is exact.)  Measured on 10 configurations (``mx.nd`` + autograd, ``mx.sym`` +
``simple_bind``, Gluon, Gluon hybridized, hybridized with ``static_alloc``; FC head and
Conv+FC head) x 2 runs x 100 iterations: 0 bad iterations with the guard, against
1-37 bad iterations per 100 without it.  Cost: one elementwise pass per guarded array in
the forward and one in the backward (about 4-10 ms fwd+bwd for a 2x256x50x50 feature map
on the 2-core test machine, vs. ~570 ms for one 3x3 256->256 convolution fwd+bwd on it).

Imperative calls (``mx.nd``) guard their inputs more cheaply: :func:`plain_nd` waits for
the array and has MXNet reorder a blocked array to the plain layout *in place*
(``MXNDArrayGetData``), so ``custom.cc`` makes no temporary and the op reads the array's
own memory.  A plain array is not copied at all (``clip`` of a 2x1029x38x50 R-FCN score
map took 12 ms on the 2-core machine, as long as MXNet's whole PSROIAlign).  The same
tests pass with it, and fail without any input guard.  Graphs (``mx.sym``, hybridized
Gluon) cannot do this -- nothing runs at graph-building time -- and keep ``clip``.

When oneDNN is off (build without it, or ``MXNET_MKLDNN_ENABLED=0``) the helpers return
their arguments unchanged and cost nothing.

About ``MXNET_MKLDNN_ENABLED``: MXNet reads it once, lazily, when the first operator
runs.  Setting ``os.environ['MXNET_MKLDNN_ENABLED'] = '0'`` after ``import mxnet`` but
before the first operator still takes effect (measured: the unguarded toy graph became
correct and MXNet logs "MXNET_MKLDNN_ENABLED flag is off"); set after an operator has run
it has no effect at all.  It is not used here: it turns oneDNN off for the whole process
(and makes MXNet print a "Storage type fallback detected" warning for every oneDNN-capable
operator).  Because of the once-only read, :func:`onednn_enabled` only reports "off" when
the variable said off both when this module was imported and now; in every doubtful case
the (cheap) guard stays on.

What to do when calling ``mx.sym.Custom`` / ``mx.nd.Custom`` by hand
--------------------------------------------------------------------
Use :func:`call_custom` instead of ``F.Custom``::

    from mx_roi.onednn import call_custom
    out = call_custom(mx.sym, 'ROIAlign', [data, rois], pooled_size=(7, 7),
                      spatial_scale=0.0625)

or wrap by hand: ``F.Custom(*guard_inputs(F, data, rois), op_type=...)`` and pass the
result through :func:`guard_output`.  Both sides are needed: the input guard protects the
forward, the output guard protects the backward.  Inputs must be floating-point arrays
(``clip`` to +-3e38 is not an identity for integer dtypes).  ``F`` is ``mx.nd`` or
``mx.sym`` (inside a Gluon ``hybrid_forward`` pass the ``F`` you are given).
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import ctypes

import mxnet as mx
from mxnet.base import _LIB, check_call

__all__ = ["onednn_build", "onednn_enabled", "barrier", "guard_inputs", "guard_output",
           "call_custom", "install"]

_BUILD = None  # cached: does the loaded libmxnet have oneDNN compiled in?
# Not +-inf, and not FLT_MAX itself: MXNet's float parameter parser rejects both
# ("Out of range value for a_max, value='inf'" / "value='3.4028234663852886e+38'").
_BOUND = 3.0e38


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
    the output of an operator in :data:`PLAIN_PRODUCERS`.  Non-array
    items (``None``, numbers) pass through.  With ``name`` (symbolic mode) the guard nodes
    are called ``{name}_guard_copy{i}`` / ``{name}_guard_in{i}``.  A no-op when oneDNN is
    off."""
    if not onednn_enabled():
        return tuple(arrays)
    # MXNet 1.9.1's clip backward ignores grad_req='add' (it overwrites): an identity in
    # front of the clip takes the gradient of a leaf input and accumulates it correctly
    def guarded(i, a):
        if F is not mx.sym:
            return plain_nd(a)
        if _producer(a) in PLAIN_PRODUCERS:
            return a
        if name is None:
            return barrier(F, F.identity(a))
        return barrier(F, F.identity(a, name=f"{name}_guard_copy{i}"), f"{name}_guard_in{i}")

    return tuple(guarded(i, a) if _is_array(a) else a for i, a in enumerate(arrays))


def guard_output(F, out, name=None):
    """Return the output(s) of a ``Custom`` node made safe for the backward pass.

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
        return type(out)(barrier(F, o, nm(i)) if _is_array(o) else o
                         for i, o in enumerate(out))
    if isinstance(out, mx.sym.Symbol):
        n = len(out.list_outputs())
        if n > 1:
            return mx.sym.Group([barrier(F, out[i], nm(i)) for i in range(n)])
        return barrier(F, out, nm(0))
    if isinstance(out, mx.nd.NDArray):
        return barrier(F, out)
    return out


def call_custom(F, op_type: str, inputs: Sequence[Any], **kwargs):
    """``F.Custom(*inputs, op_type=op_type, **kwargs)`` protected against the oneDNN
    hazard (inputs and outputs guarded).  ``kwargs`` may include ``name``.  With oneDNN
    off this is exactly ``F.Custom(...)``."""
    name = kwargs.get("name")
    guarded = guard_inputs(F, *inputs, name=name)
    out = _ORIGINAL_CUSTOM.get(F.__name__, F.Custom)(*guarded, op_type=op_type, **kwargs)
    if F is not mx.sym and not mx.autograd.is_recording():
        return out  # the output guard only protects a backward pass, and none will run
    return guard_output(F, out, name=name)


_ORIGINAL_CUSTOM = {}


def install(op_types) -> None:
    """Guard plain ``mx.nd.Custom`` / ``mx.sym.Custom`` calls of our ops too.

    ``import mx_roi`` wraps ``mxnet.ndarray.Custom`` and ``mxnet.symbol.Custom`` (what
    ``mx.nd.Custom``, ``mx.sym.Custom`` and ``F.Custom`` inside ``hybrid_forward`` resolve
    to): a call whose ``op_type`` is in ``op_types`` (a live container, the registry) goes
    through :func:`call_custom`; every other call is passed on untouched.  Idempotent.
    """
    import mxnet.ndarray as nd_module
    import mxnet.symbol as sym_module
    for F in (nd_module, sym_module):
        original = F.Custom
        if getattr(original, "_mx_roi_guard", False):
            continue
        _ORIGINAL_CUSTOM[F.__name__] = original

        def custom(*args, _original=original, _F=F, **kwargs):
            if kwargs.get("op_type") in op_types and kwargs.get("out") is None:
                kwargs.pop("out", None)
                return call_custom(_F, kwargs.pop("op_type"), list(args), **kwargs)
            return _original(*args, **kwargs)

        custom.__name__, custom.__doc__ = original.__name__, original.__doc__
        custom._mx_roi_guard = True
        F.Custom = custom
