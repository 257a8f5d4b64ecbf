"""Every change ``import mx_roi`` makes to MXNet, in one place.

* Error translation (:mod:`mx_roi.errors`): ``mxnet.base.get_last_ffi_error`` is wrapped
  so that the generic error of a failed custom-op callback comes out as
  :class:`~mx_roi.errors.RoIError` with the op's own message, and the ``print`` of
  ``mxnet.operator``'s callback wrapper is replaced so that an mx_roi error prints no
  traceback (``MX_ROI_TRACEBACK=1`` prints it).
* The oneDNN guard (:mod:`mx_roi.onednn`, hazard report in ``docs/ONEDNN_HAZARD.md``):
  ``mxnet.ndarray.Custom`` / ``mxnet.symbol.Custom`` are wrapped so that a plain
  ``mx.nd.Custom(..., op_type=<ours>)`` goes through :func:`call_custom` too.
* ONNX export (:mod:`mx_roi.onnx`): mx2onnx's translations of ``Custom`` and ``clip``
  are replaced by ones that know our nodes (other nodes are passed on).
* :data:`GUARD_BOUND`: the bound of the guard's ``clip``, which the ops' input
  validation and the ONNX export also know.

:func:`call_custom` is the one way mx_roi builds a ``Custom`` node (``mx_roi.nd``/``sym``,
the Gluon blocks, and users calling ``Custom`` by hand).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import mxnet as mx

__all__ = ["GUARD_BOUND", "call_custom", "install"]

#: The oneDNN guard is ``clip(x, -GUARD_BOUND, GUARD_BOUND)``.  Not +-inf, and not FLT_MAX
#: itself: MXNet's float parameter parser rejects both ("Out of range value for a_max,
#: value='inf'" / "value='3.4028234663852886e+38'").  Since the guard turns inf into this
#: bound, the ops count |x| >= GUARD_BOUND as infinite.
GUARD_BOUND = 3.0e38

#: ``F.__name__`` -> MXNet's own ``Custom`` (before :func:`install` wrapped it)
_ORIGINAL_CUSTOM = {}


def call_custom(F, op_type: str, inputs: Sequence[Any], **kwargs):
    """``F.Custom(*inputs, op_type=op_type, **kwargs)`` protected against the oneDNN
    hazard (inputs and outputs guarded, :mod:`mx_roi.onednn`).  ``F`` is ``mx.nd`` or
    ``mx.sym`` (inside ``hybrid_forward`` the ``F`` you are given); ``kwargs`` may include
    ``name``.  With oneDNN off this is exactly ``F.Custom(...)``."""
    from .onednn import guard_inputs, guard_output
    name = kwargs.get("name")
    guarded = guard_inputs(F, *inputs, name=name)
    out = _ORIGINAL_CUSTOM.get(F.__name__, F.Custom)(*guarded, op_type=op_type, **kwargs)
    if F is not mx.sym and not mx.autograd.is_recording():
        return out  # the output guard only protects a backward pass, and none will run
    return guard_output(F, out, name=name)


def install(op_types) -> None:
    """Apply every patch (idempotent); ``op_types`` is a live container of our op types
    (the registry)."""
    _install_error_translation()
    _install_custom_guard(op_types)
    from . import onnx
    onnx.install()  # mx2onnx translations of our Custom nodes (onnx itself imported lazily)


def _install_error_translation() -> None:
    import mxnet.base as base
    import mxnet.operator as operator
    from . import errors
    if getattr(operator, "print", None) is not errors.print_hook:
        operator.print = errors.print_hook
    original = base.get_last_ffi_error
    if getattr(original, "_mx_roi", False):
        return

    @functools.wraps(original)
    def get_last_ffi_error():
        return errors.translate(original())

    get_last_ffi_error._mx_roi = True
    base.get_last_ffi_error = get_last_ffi_error


def _install_custom_guard(op_types) -> None:
    """``mxnet.ndarray.Custom`` and ``mxnet.symbol.Custom`` (what ``mx.nd.Custom``,
    ``mx.sym.Custom`` and ``F.Custom`` inside ``hybrid_forward`` resolve to): a call whose
    ``op_type`` is in ``op_types`` goes through :func:`call_custom`; every other call is
    passed on untouched."""
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
