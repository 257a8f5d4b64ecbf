"""Keep a failed callback's error with the call that failed (MXNet 1.9.1's error slot).

How MXNet 1.9.1 delivers a custom-op callback's error (``src/operator/custom/
custom-inl.h``, ``CustomOperator::Push``): a worker thread runs the callback; when it
fails, the error goes into *one process-wide slot* (``exception_``); the worker then
pushes a completion (``CustomOperatorWait``, an engine op reading the arrays it handed
to the callback), and each completion, when the engine runs it, takes whatever error is
in the slot (``Throw()``), then any error marked on its arrays (``Engine::Throw(var)``),
and fails its own op's outputs with it.  So a callback's error lands on the op whose
completion *runs* first after the failure, not necessarily the one that failed: in
training steps (record -> backward -> read, no wait) a valid call's completion waiting
in the engine's queue (behind other layers' work, or the previous step's backward)
took a rejected forward's error onto an array nobody reads, and the rejected output
came back as NaN with no error (and the valid call raised the wrong error, or a later
``waitall`` did).

Two measures:

* A rejected forward does not fail its callback at all (:func:`fail_output`): it marks
  its output array with a failed engine operation, which only its own completion
  checks, and returns; the error is recorded for the translation
  (:func:`mx_roi.errors.record_output_error`).  Nothing else can take it.
* A callback that must raise anyway (a backward that rejects its inputs; a forward
  under ``NaiveEngine`` or with no output to mark) first waits (:func:`fail`) until no
  other mx_roi callback is running and the completions of all that succeeded have run
  (each succeeded callback notes, :func:`succeed`, MXNet's own view of its rois: a
  non-owning copy with its own engine variable, read by its completion; a write-wait on
  it is ordered after that completion).  The slot then holds no competitor's error and
  the failing op's completion, pushed right after and ready at once, is normally the
  next to run.  Not covered there: a callback that starts after that wait and completes
  within the few hundred microseconds before the error goes in, and custom ops that are
  not mx_roi's (not tracked).

Every mx_roi forward/backward callback calls :func:`enter`, then :func:`succeed`, or on
rejection :func:`fail_output` or :func:`fail`.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading

__all__ = ["enter", "succeed", "fail", "fail_output", "MAX_NOTED", "WAIT_S"]

#: completions remembered (oldest forgotten first; a completion is pushed the moment its
#: callback returns and runs within the engine's next few operations, so only the most
#: recent can still be waiting)
MAX_NOTED = 64
#: longest wait (s) of a failing callback for the others running with it (a safety net:
#: they never wait for it, so they return)
WAIT_S = 10.0

_cond = threading.Condition()
_noted = collections.deque(maxlen=MAX_NOTED)
_running = set()
_tokens = itertools.count()


def enter() -> int:
    """Note that an mx_roi forward/backward callback starts; returns its token."""
    token = next(_tokens)
    with _cond:
        _running.add(token)
    return token


def succeed(token: int, nd) -> None:
    """The callback ``token`` returns successfully; ``nd``: one of the NDArrays MXNet
    handed to it (its completion reads it)."""
    with _cond:
        _noted.append(nd)
        _running.discard(token)
        _cond.notify_all()


def fail(token: int) -> int:
    """The callback ``token`` is about to raise: wait until no other mx_roi callback is
    running and the completions of every noted callback have run -- again, until none
    ran meanwhile (a completion that runs can start the next callback: a valid step's
    backward waits for its forward's completion).  Returns how many completions were
    waited on."""
    from mxnet.base import _LIB
    waited = 0
    with _cond:
        _running.discard(token)
        _cond.notify_all()
    while True:
        with _cond:
            _cond.wait_for(lambda: not _running, timeout=WAIT_S)
            pending = list(_noted)
            _noted.clear()
        if not pending:
            return waited
        for nd in pending:
            # MXNDArrayWaitToWrite: an empty write on the array's variable, ordered after
            # the completion that reads it.  Called directly (not check_call): a failure
            # here must not go through the error translation, which would consume a
            # record.
            _LIB.MXNDArrayWaitToWrite(nd.handle)
        waited += len(pending)


def fail_output(token: int, out) -> bool:
    """The forward ``token`` rejected its inputs: make its output NDArray ``out`` (the
    array MXNet handed to the callback) carry a failed engine operation instead of
    raising, so that the error reaches the op's own outputs whatever else completes
    meanwhile.  The caller then returns normally, having recorded its error
    (:func:`mx_roi.errors.record_output_error`).  False where this is not possible
    (``MXNET_ENGINE_TYPE=NaiveEngine`` runs operations at once, so the failure would
    raise here; there custom ops run synchronously and nothing can take their error):
    the caller then raises as usual.

    How: ``take(mode='raise')`` with an index out of range fails when the engine runs it
    (``errors.OUTPUT_MARKER``); MXNet marks every array that operation writes, and every
    operation reading a marked array fails with the same error and marks its own outputs
    -- here a broadcast into ``out``.  The op's completion checks its arrays for such a
    mark (``Engine::Throw(var)`` in ``CustomOperator::Push``) and fails the op's real
    outputs with it.  ``out``'s memory is left as it is (the caller fills it with NaN)."""
    import mxnet as mx
    if os.environ.get("MXNET_ENGINE_TYPE", "") == "NaiveEngine":
        return False
    with _cond:
        _running.discard(token)
        _cond.notify_all()
    cpu = mx.cpu()
    marked = mx.nd.take(mx.nd.zeros((1,), ctx=cpu, dtype=out.dtype),
                        mx.nd.full((1,), 2, ctx=cpu, dtype=out.dtype), mode="raise")
    if out.context != cpu:
        marked = marked.as_in_context(out.context)
    mx.nd.broadcast_to(marked.reshape((1,) * out.ndim), shape=out.shape, out=out)
    return True
