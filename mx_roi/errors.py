"""Make an error raised inside a custom op reach the caller with its own message.

MXNet turns an exception raised in ``CustomOp.forward`` or ``CustomOpProp.infer_shape``
into a generic ``Check failed: ... callbacks[kCustomOpForward] ...`` MXNetError at the
next synchronisation, printing the Python traceback to stdout.  The ops record their
error here before MXNet swallows it, and :func:`install` wraps ``mxnet.base``'s error
constructor so that this generic error comes out as :class:`RoIError` (an MXNetError
*and* a ValueError) whose message starts with the op's own message.
"""
from __future__ import annotations

import collections
import functools
import threading

import mxnet.base as _base
from mxnet.base import MXNetError

__all__ = ["RoIError", "record", "install", "recording"]

_recent = collections.deque(maxlen=16)
_lock = threading.Lock()
_MARKERS = ("kCustomOp", "CustomOp")


class RoIError(MXNetError, ValueError):
    """Invalid input to an mx_roi op, raised at the MXNet call that synchronised."""


def record(exc: BaseException) -> None:
    """Remember ``exc``'s message for the MXNetError that MXNet is about to raise."""
    with _lock:
        _recent.append(f"{type(exc).__name__}: {exc}")


def recording(fn):
    """Decorator for op callbacks: record any exception, then let MXNet see it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged
            record(exc)
            raise
    return wrapper


def _take() -> str:
    with _lock:
        return _recent.pop() if _recent else ""


def install() -> None:
    """Wrap ``mxnet.base.get_last_ffi_error`` once (idempotent)."""
    original = _base.get_last_ffi_error
    if getattr(original, "_mx_roi", False):
        return

    @functools.wraps(original)
    def get_last_ffi_error():
        err = original()
        text = str(err)
        if any(m in text for m in _MARKERS):
            ours = _take()
            if ours:
                return RoIError(f"{ours}\n(raised inside an mx_roi custom op; MXNet's report "
                                f"follows)\n{text}")
        return err

    get_last_ffi_error._mx_roi = True
    _base.get_last_ffi_error = get_last_ffi_error
