"""The two front doors of an mx_roi op as the bench calls them, in one place (adapt here
when mx_roi's default door or its switch changes):

* ``custom``: the Python ``Custom`` op, ``F.Custom(*inputs, op_type=<Op>, **params)``
  (through mx_roi's wrapper of ``Custom``: the oneDNN guard, the cached call);
* ``native``: the extension library's operator ``F.mx_roi_<Op>(*inputs, **params)``
  (:mod:`mx_roi.ext`), where the library is built and loaded and registers that op.

``F`` is ``mx.nd`` or ``mx.sym``.  Ops without a native section have no native door
(:func:`native_missing` says why); the bench then shows '-' for that door."""
from __future__ import annotations

from typing import Callable

import mxnet as mx

__all__ = ["DOORS", "door", "native_missing", "NATIVE_PREFIX"]

DOORS = ("custom", "native")
from ..registry import NATIVE_PREFIX  # the extension library's names: ``mx_roi_<Op>``


def _load_reason() -> str:
    """'' once the extension library is loaded into MXNet, else why it cannot be."""
    from .. import ext
    try:
        ext.load()
    except Exception as exc:  # noqa: BLE001 - ExtLibraryError, or mxnet refusing it
        return f"extension library unavailable ({str(exc).splitlines()[0][:160]})"
    return ""


def native_missing(op: str) -> str:
    """'' when ``mx_roi_<op>`` is registered with MXNet (the library loaded), else why not."""
    why = _load_reason()
    if why:
        return why
    if not hasattr(mx.nd, NATIVE_PREFIX + op):
        return f"no native op {NATIVE_PREFIX}{op} in the extension library"
    return ""


def door(F, op: str, which: str) -> Callable:
    """``fn(*inputs, **params)``: ``op`` through door ``which`` ('custom' or 'native') of
    ``F`` (``mx.nd`` / ``mx.sym``).  ValueError naming the op when that door is missing."""
    if which == "custom":
        return lambda *inputs, **params: F.Custom(*inputs, op_type=op, **params)
    if which == "native":
        why = native_missing(op)
        if why:
            raise ValueError(f"{op}: {why}")
        return getattr(F, NATIVE_PREFIX + op)
    raise ValueError(f"{op}: unknown door {which!r}; expected one of {DOORS}")
