"""Make an error raised inside a custom op reach the caller with its own message, and only it.

MXNet turns an exception raised in a custom op's callback (``CustomOp.forward``,
``CustomOpProp.infer_shape``, ...) into a generic ``Check failed: ...
callbacks[kCustomOpForward] ...`` MXNetError, raised later at a synchronising call, and
its callback wrapper (``mxnet/operator.py``) prints the Python traceback to stdout.

What this module does:

* :func:`recording` (decorator of every mx_roi callback) records the exception's message
  with the callback's *kind* (``forward``, ``backward``, or a synchronous Prop callback:
  ``infer_shape``, ``create_operator``, ...) and the thread that issued the call;
* :func:`translate` (installed by :mod:`mx_roi.mxpatch` around ``mxnet.base``'s error
  constructor) turns the generic error into :class:`RoIError` (an MXNetError *and* a
  ValueError) whose message starts with the op's own message, and :func:`print_hook`
  (installed as the ``print`` of MXNet's callback wrapper) prints nothing for an mx_roi
  error (``MX_ROI_TRACEBACK=1`` prints it again; the traceback is always kept on the
  error as ``RoIError.mx_roi_traceback``).

Which record belongs to which MXNet error (the generic error carries no identity):

* Prop callbacks run synchronously on the calling thread, and MXNet raises right after
  them on that thread: their record is kept per thread (the latest one), and consumed
  by the next such error on the same thread.
* ``forward``/``backward`` run on MXNet's custom-op worker threads and their error is
  raised at a later synchronisation; MXNet names the kind (``kCustomOpForward`` /
  ``kCustomOpBackward``).  The record of that kind issued by the synchronising thread is
  taken (the latest one; an earlier one, whose error MXNet may have dropped, stays
  until it is taken or :data:`MAX_PENDING` newer ones push it out); failing that, the
  latest record of that kind from any thread (MXNet 1.9.1 may raise one thread's
  custom-op error at another thread's synchronisation; the message then says so).  Limitation: when one thread has several
  failing calls in flight before it synchronises, their messages may come out in the
  reverse order of its waits (MXNet's error names no call).  If a custom op that is not mx_roi's failed more
  recently with the same kind, the error is left as MXNet made it (it may be that op's).
* The backward of a rejected forward does not raise (see :mod:`mx_roi.registry`), so a
  failed training step produces exactly one error.
* A rejected forward does not hand its error to MXNet's callback machinery at all (which
  may give it to another op: :mod:`mx_roi.error_slot`): :func:`record_output_error`
  records it (kind ``forward-output``) and :func:`mx_roi.error_slot.fail_output` makes
  the op's own output carry a failed engine operation, whose MXNet error
  (:data:`OUTPUT_MARKER`) :func:`translate` turns into that record's message.
"""
from __future__ import annotations

import builtins
import functools
import itertools
import os
import re
import sys
import threading
import traceback

from mxnet.base import MXNetError

__all__ = ["RoIError", "recording", "translate", "print_hook", "issuer"]

#: at most this many unconsumed forward/backward records are kept (oldest dropped)
MAX_PENDING = 64

_ASYNC = {"forward": "callbacks[kCustomOpForward]", "backward": "callbacks[kCustomOpBackward]",
          "forward-output": "take operator contains indices out of bound"}
#: MXNet's message of the failed operation that carries a rejected forward's error to the
#: op's output (:func:`mx_roi.error_slot.fail_output`)
OUTPUT_MARKER = _ASYNC["forward-output"]
_SYNC_MARKERS = ("params.info->callbacks[", "custom.cc", "kCustomOp")

_lock = threading.Lock()
_seq = itertools.count()
_pending = []          # unconsumed forward/backward records, oldest first
_local = threading.local()  # .sync: latest record of a Prop callback on this thread


class RoIError(MXNetError, ValueError):
    """Invalid input to an mx_roi op, raised at the MXNet call that synchronised.

    ``mx_roi_traceback`` holds the Python traceback of the original exception (inside
    the op's callback), or ``''``."""

    mx_roi_traceback = ""


class _Record:
    __slots__ = ("seq", "kind", "issuer", "message", "traceback")

    def __init__(self, kind, issuer, message, tb):
        self.seq = next(_seq)
        self.kind, self.issuer, self.message, self.traceback = kind, issuer, message, tb


def issuer() -> int:
    """Identity of the calling thread, as stored with a record."""
    return threading.get_ident()


def _store(rec: _Record) -> None:
    if rec.kind in _ASYNC:
        with _lock:
            _pending.append(rec)
            del _pending[:-MAX_PENDING]
    else:
        _local.sync = rec


def recording(fn):
    """Decorator for op callbacks: record any exception, then let MXNet see it.

    The kind is the callback's name; a ``forward``/``backward`` record's issuer is the
    thread that created the ``CustomOp`` (``self._mx_roi_issuer``), i.e. the thread that
    made the call, not MXNet's worker thread that runs it."""
    kind = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unchanged
            who = getattr(args[0], "_mx_roi_issuer", None) if args else None
            exc._mx_roi_recorded = True
            _store(_Record(kind, who if who is not None else issuer(),
                           f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            raise
    return wrapper


def record_output_error(exc, who) -> None:
    """Record exception ``exc`` (being handled) of a rejected forward issued by thread
    ``who``, whose error reaches the caller through the op's output
    (:func:`mx_roi.error_slot.fail_output`) instead of MXNet's callback error."""
    tb = traceback.format_exc()
    _store(_Record("forward-output", who, f"{type(exc).__name__}: {exc}", tb))
    if os.environ.get("MX_ROI_TRACEBACK", "").strip() not in ("", "0"):
        # what MXNet's callback wrapper prints for a callback that raised
        builtins.print(f"Error in CustomOp.forward: {tb}")


def discard_output_error(who) -> None:
    """Drop the latest ``forward-output`` record of thread ``who`` (its error went the
    usual way after all)."""
    with _lock:
        for i in range(len(_pending) - 1, -1, -1):
            if _pending[i].kind == "forward-output" and _pending[i].issuer == who:
                del _pending[i]
                return


def _foreign(kind: str) -> None:
    """A custom op that is not ours failed in callback ``kind``: note it, so that its
    MXNet error is not given one of our messages."""
    _store(_Record(kind, None, None, ""))


def _kind_of_print(text: str):
    """Callback kind from MXNet's ``'Error in CustomOp.forward: ...'`` report."""
    head = text[len("Error in "):].split(":", 1)[0]
    return head.rsplit(".", 1)[-1] if "." in head else None


def print_hook(*args, **kwargs):
    """Stand-in for ``print`` inside ``mxnet.operator``: MXNet's callback wrapper prints
    the traceback of a failed callback from its ``except`` block.  For an mx_roi error
    (the exception being handled carries our mark) it prints nothing, unless
    ``MX_ROI_TRACEBACK=1``; other ops' failures are printed and noted."""
    text = args[0] if args and isinstance(args[0], str) else ""
    if text.startswith("Error in "):
        exc = sys.exc_info()[1]
        if exc is not None and getattr(exc, "_mx_roi_recorded", False):
            if os.environ.get("MX_ROI_TRACEBACK", "").strip() not in ("", "0"):
                builtins.print(*args, **kwargs)
            return
        kind = _kind_of_print(text)
        if kind:
            _foreign(kind)
    builtins.print(*args, **kwargs)


def _take(text: str):
    """The record matching MXNet's generic error ``text`` (consumed), or None."""
    for kind, marker in _ASYNC.items():
        if marker in text:
            return _take_async(kind)
    if any(m in text for m in _SYNC_MARKERS):
        rec = getattr(_local, "sync", None)
        _local.sync = None
        return rec if rec is not None and rec.message is not None else None
    return None


def _take_async(kind: str):
    me = issuer()
    with _lock:
        same = [r for r in _pending if r.kind == kind]
        mine = [r for r in same if r.issuer == me]
        pick = (mine or same or [None])[-1]
        if pick is None:
            return None
        if pick.message is None or any(r.message is None and r.seq > pick.seq for r in same):
            # the latest failure of this kind is not ours: leave MXNet's error as it is
            _pending[:] = [r for r in _pending if not (r.kind == kind and r.message is None)]
            return None
        _pending.remove(pick)
        return pick


def pending() -> int:
    """Number of unconsumed forward/backward records (for tests)."""
    with _lock:
        return sum(r.message is not None for r in _pending)


#: MXNet's report of a failed callback of an extension-library op (c_api.cc), followed by
#: the library's messages ("Extension Traceback:", one per line): ours is the one line
_NATIVE_ERROR = re.compile(r"Error calling (\w+) for custom operator 'mx_roi_(\w+)'\n"
                           r"Extension Traceback:\n\t\[0\] ([^\n]*)")


def _translate_native(err, text):
    """``err``, or :class:`RoIError` starting with the library's own message when ``err``
    is MXNet's report of a failed callback of one of our native ops (``mx_roi_<Op>``:
    MXNet puts its ``Traceback ... Error calling FCompute for custom operator`` lines
    first)."""
    m = _NATIVE_ERROR.search(text)
    if m is None:
        return err
    return RoIError(f"{m.group(3)}\n(raised by mx_roi's native op mx_roi_{m.group(2)}, in its "
                    f"{m.group(1)}; MXNet's report follows)\n{text}")


def translate(err):
    """MXNet's error ``err`` (from ``get_last_ffi_error``), or the :class:`RoIError` with
    our message when it is the generic error of one of our failed callbacks (installed by
    :mod:`mx_roi.mxpatch`)."""
    text = str(err)
    rec = _take(text)
    if rec is None:
        return _translate_native(err, text)
    where = "" if rec.issuer in (None, issuer()) else (
        "\n(that call was made on another thread; MXNet raised its error here)")
    how = " and carried to its output by a failed internal operation" \
        if rec.kind == "forward-output" else ""
    new = RoIError(f"{rec.message}{where}\n(raised inside an mx_roi custom op{how}; MXNet's "
                   f"report follows)\n{text}")
    new.mx_roi_traceback = rec.traceback
    return new
