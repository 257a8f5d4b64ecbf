"""Which door a call of ``mx_roi.nd`` / ``mx_roi.sym`` / a Gluon block takes: the native
operator ``mx_roi_<Op>`` of the extension library, or ``Custom(op_type=<Op>)``.

The rule, in one place (:func:`choose`; docs/native_ops.md has it as a table):

* ``MX_ROI_NATIVE_OPS=0`` (or ``false``, ``off``, ``no``) -> Custom;
* a GPU context (an ``nd`` call whose data lives on a GPU) -> Custom: the native GPU path
  is not proven inside MXNet (issue 42);
* a symbol (``mx_roi.sym``, a hybridized block: the context is not known when the graph
  is built) -> Custom on an MXNet built with CUDA (``mx.runtime.Features()``: the graph
  may be bound to a GPU), native otherwise;
* the op's CPU backend (``MX_ROI_BACKEND``, unset: the op's ``cpu_backend()``) is not
  ``native`` -> Custom (``numpy`` and ``emulated-cuda`` exist to be run, and tested,
  through the Custom op);
* the library cannot be built or loaded here (no compiler, an mxnet without the
  extension API, a failed build: the reason is remembered) -> Custom;
* the library has no ``mx_roi_<Op>`` (an op without an ``MX_ROI_EXT_LAUNCHER`` section)
  -> Custom;
* else native.  ``mx.nd.Custom`` / ``mx.sym.Custom`` with ``op_type=`` stay Custom.

``import mx_roi`` loads a cached library (:func:`mx_roi.ext.load_if_cached`, about 10 ms);
a missing one is built by the first call that the rule would send to the native door
(about 40 s of g++, once per cache).

``grad_req='add'``: MXNet 1.9.1 never passes ``req`` to an extension op, which always
*writes* its input gradients (zeros for the rois).  Wherever ``add`` can reach the op --
an input that is a leaf with a gradient buffer (``nd``, while autograd records) or a
graph variable (``sym``, hybridized blocks) -- :func:`add_safe_inputs` feeds a
differentiated input through :func:`mx_roi.ext.add_safe` (an identity whose backward
honours ``req``) and the rois through ``BlockGrad`` (their zero gradient then never
overwrites an accumulated one).  An input computed by another op has an intermediate
gradient buffer, which MXNet asks to be written.
"""
from __future__ import annotations

import os
import threading

import mxnet as mx

from .. import backends, mxpatch
from ..switches import switched_off
from . import add_safe, load, load_if_cached, loaded_ops

__all__ = ["ENV", "native_enabled", "choose", "call", "native_op", "add_safe_inputs",
           "load_at_import", "describe"]

#: the switch: ``MX_ROI_NATIVE_OPS=0`` keeps every entry point on the Custom door
ENV = "MX_ROI_NATIVE_OPS"
_LOCK = threading.Lock()
_STATE = {"failed": None, "cuda_build": None}


def native_enabled() -> bool:
    """Whether ``MX_ROI_NATIVE_OPS`` allows the native door (unset: yes)."""
    return not switched_off(ENV)


def native_op(name: str) -> str:
    """The native operator's name of registered op ``name``: ``mx_roi_<name>``."""
    from ..registry import NATIVE_PREFIX
    return NATIVE_PREFIX + name


def load_at_import() -> None:
    """``import mx_roi``: load the library if it is cached; never raises (a failure is
    remembered and reported by :func:`choose` / :func:`describe`)."""
    if not native_enabled():
        return
    try:
        load_if_cached()
    except Exception as exc:  # noqa: BLE001 - never fail the import: Custom ops remain
        _STATE["failed"] = _first_line(exc)


def _first_line(exc) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _library_ops():
    """The loaded library's operators, loading (building) it first; or the reason why
    it cannot be loaded (str)."""
    ops = loaded_ops()
    if ops:
        return ops
    with _LOCK:
        if _STATE["failed"] is None:
            try:
                load()
            except Exception as exc:  # noqa: BLE001 - any failure: the Custom door, told why
                _STATE["failed"] = _first_line(exc)
        if _STATE["failed"] is not None:
            return f"the extension library is not available ({_STATE['failed']})"
    return loaded_ops()


def _mxnet_has_cuda() -> bool:
    if _STATE["cuda_build"] is None:
        _STATE["cuda_build"] = bool(mx.runtime.Features().is_enabled("CUDA"))
    return _STATE["cuda_build"]


def choose(op, F, inputs=()) -> str:
    """``''`` when a call of ``op`` (a :class:`~mx_roi.registry.RoIOp` instance) on
    ``F`` (``mx.nd`` or ``mx.sym``) with ``inputs`` takes the native door, else why it
    takes the Custom door (the rule: this module's docstring)."""
    if not native_enabled():
        return f"{ENV}={os.environ.get(ENV)}"
    if F is mx.sym:
        if _mxnet_has_cuda():
            return "a symbol on an MXNet built with CUDA may run on a GPU"
    elif inputs and getattr(getattr(inputs[0], "context", None), "device_type", "cpu") != "cpu":
        return "a GPU context (the native GPU path is opt-in)"
    backend = backends.configured_cpu_backend(op)
    if backend != "native":
        return f"the CPU backend is {backend!r}"
    ops = _library_ops()
    if isinstance(ops, str):
        return ops
    if native_op(op.name) not in ops:
        return f"the extension library has no {native_op(op.name)}"
    return ""


def describe(op) -> str:
    """``'native (mx_roi_<Op>)'`` or ``'Custom: <reason>'`` for a call of ``op`` (a
    :class:`~mx_roi.registry.RoIOp` instance) on CPU NDArrays (selftest's door row)."""
    why = choose(op, mx.nd)
    return f"native ({native_op(op.name)})" if not why else f"Custom: {why}"


def add_safe_inputs(op, F, inputs, name=None) -> list:
    """``inputs`` (in the op's ``input_names()`` order) made safe for ``grad_req='add'``
    where it can reach the native op (this module's docstring): a leaf NDArray with a
    gradient buffer while autograd records, or a graph variable, goes through
    :func:`mx_roi.ext.add_safe` when the op differentiates it, through ``BlockGrad``
    when it does not (the rois, except for an op with ``differentiates_rois``)."""
    names = op.input_names()
    out = []
    for key, x in zip(names, inputs):
        if F is mx.sym:
            reaches = x.get_children() is None  # a variable: its req is the binder's
        else:
            reaches = mx.autograd.is_recording() and x.grad is not None
        if not reaches:
            out.append(x)
        elif key != "rois" or op.differentiates_rois:
            out.append(add_safe(x, name=f"{name}_{key}_add_safe" if name else None))
        else:
            out.append(F.BlockGrad(x, **({"name": f"{name}_{key}_no_grad"} if name else {})))
    return out


def call(F, op, inputs, name=None):
    """The op's node on ``F`` through the door :func:`choose` picks: ``F.mx_roi_<Op>``
    on :func:`add_safe_inputs`, or :func:`mx_roi.mxpatch.call_custom` (the oneDNN-guarded
    ``Custom``; a native node needs no guard).  ``inputs`` in ``op.input_names()`` order,
    the parameters from ``op.param``."""
    kwargs = op.param.to_kwargs()
    extra = {"name": name} if name is not None else {}
    if choose(op, F, inputs):
        return mxpatch.call_custom(F, op.name, inputs, **kwargs, **extra)
    needed = op.input_names()
    if F is mx.sym and len(inputs) < len(needed):
        # a symbol may leave trailing inputs out (registry.RoIOp.order_inputs): MXNet makes
        # variables for a Custom node's (``<node>_<input>``), not for an extension op's
        name = mx.name.NameManager.current.get(name, native_op(op.name).lower())
        extra = {"name": name}
        inputs = list(inputs) + [mx.sym.var(f"{name}_{k}") for k in needed[len(inputs):]]
    inputs = add_safe_inputs(op, F, inputs, name)
    return getattr(F, native_op(op.name))(*inputs, **kwargs, **extra)
