"""Run a kernel's per-roi loop on a few threads (NumPy and BLAS release the GIL).

MXNet's own CPU RoI kernels use OpenMP over rois; :func:`for_chunks` and
:func:`sum_into` do the same for the NumPy kernels.

Thread count (:func:`num_threads`): ``MX_ROI_NUM_THREADS``; else ``OMP_NUM_THREADS``
(its first value) when set; else the usable cores, at most 8.  1 disables threading.
It governs every pool mx_roi uses: this module's, the native kernels' and NumPy's BLAS.
While a kernel runs, NumPy's OpenBLAS is held at one thread (:func:`blas_limited`):
the kernels call many small products from several threads of their own, where
OpenBLAS's threads would only add spin-waiting (with one core busy, a BLAS-threaded
call ran 8x slower) and serialise concurrent callers.

Work split: dynamic.  Rois are cut into a few small contiguous chunks per thread, and
every thread (the caller included) takes the next chunk when it is free, so a thread
slowed by a busy core takes fewer chunks instead of stalling a fixed half.  Results do
not depend on thread timing: forwards write disjoint outputs; :func:`sum_into` adds
each chunk into its own buffer and adds the buffers in chunk order (deterministic for a
given thread count).
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

__all__ = ["num_threads", "for_chunks", "sum_into", "blas_limited", "blas_threads"]

#: below this many rois per thread, threading costs more than it saves
MIN_ROIS_PER_THREAD = 16
#: chunks per thread of a dynamic split (forward: chunks cost only a lock each)
CHUNKS_PER_THREAD = 4
#: chunks per thread of :func:`sum_into` (each costs zeroing and adding one buffer)
SUM_CHUNKS_PER_THREAD = 3
#: the default thread count's cap
MAX_DEFAULT_THREADS = 8

_pool = None
_pool_lock = threading.Lock()


def num_threads() -> int:
    env = os.environ.get("MX_ROI_NUM_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"MX_ROI_NUM_THREADS={env!r}: expected a positive integer (the "
                             "number of CPU threads of a kernel; 1 disables threading)") \
                from None
    return default_threads()


def default_threads() -> int:
    """Threads without ``MX_ROI_NUM_THREADS``: ``OMP_NUM_THREADS`` (first value) when it
    is a positive integer, else the usable cores (affinity, read once), at most 8."""
    global _cores
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    if _cores is None:
        try:
            _cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            _cores = os.cpu_count() or 1
    return max(1, min(_cores, MAX_DEFAULT_THREADS))


_cores = None


# ---- NumPy's BLAS ------------------------------------------------------------------


class _Blas:
    """ctypes handles of NumPy's bundled OpenBLAS thread setters (None if not found)."""

    _NAMES = (("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
              ("openblas_set_num_threads", "openblas_get_num_threads"))

    def __init__(self):
        self.set = self.get = None
        self.path = None
        for path in _numpy_blas_paths():
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for set_name, get_name in self._NAMES:
                if hasattr(lib, set_name) and hasattr(lib, get_name):
                    self.set, self.get = getattr(lib, set_name), getattr(lib, get_name)
                    self.set.argtypes, self.set.restype = [ctypes.c_int], None
                    self.get.argtypes, self.get.restype = [], ctypes.c_int
                    self.path = path
                    return


def _numpy_blas_paths():
    """OpenBLAS libraries NumPy loaded: mapped files next to NumPy (Linux), else the
    wheel's ``numpy.libs`` folder."""
    roots = (os.path.dirname(np.__file__), os.path.dirname(np.__file__) + ".libs")
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "openblas" in os.path.basename(path) and path.startswith(roots) \
                        and path not in found:
                    found.append(path)
    except OSError:
        pass
    for root in roots:
        found += [p for p in sorted(glob.glob(os.path.join(root, "*openblas*.so*")))
                  if p not in found]
    return found


_blas = None
_blas_lock = threading.Lock()
_blas_users = 0
_blas_saved = None


def _blas_handles() -> _Blas:
    global _blas
    if _blas is None:
        with _blas_lock:
            if _blas is None:
                _blas = _Blas()
    return _blas


def blas_threads():
    """NumPy's OpenBLAS thread count now, or None when it cannot be read."""
    b = _blas_handles()
    return int(b.get()) if b.get is not None else None


@contextmanager
def blas_limited():
    """NumPy's OpenBLAS runs single-threaded inside (process-wide, counted: the setting
    made by the first of concurrent users is restored when the last one leaves)."""
    global _blas_users, _blas_saved
    b = _blas_handles()
    if b.set is None:
        yield
        return
    with _blas_lock:
        if _blas_users == 0:
            _blas_saved = int(b.get())
            if _blas_saved != 1:
                b.set(1)
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0 and _blas_saved not in (None, 1):
                b.set(_blas_saved)


# ---- the pool ----------------------------------------------------------------------


def _executor(n):
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mx_roi")
        return _pool


def _split(items, per_thread):
    """(threads, chunks): contiguous chunks of ``items``, ``per_thread`` per thread."""
    items = list(items)
    threads = max(1, min(num_threads(), len(items) // MIN_ROIS_PER_THREAD))
    if threads == 1:
        return 1, [items]
    k = min(len(items), threads * per_thread)
    return threads, [items[i * len(items) // k:(i + 1) * len(items) // k] for i in range(k)]


def _run_dynamic(threads, tasks):
    """Run every ``task()`` on ``threads`` threads (the caller is one of them), each
    thread taking the next task when it is free; then re-raise the first error.

    The caller waits for the tasks that were taken, not for pool threads that have not
    been scheduled yet (on a busy machine that can take milliseconds): such a thread
    finds nothing left when it runs and returns at once.
    """
    tasks = list(tasks)
    cond = threading.Condition()
    state = {"next": 0, "done": 0}
    errors = []

    def worker():
        while True:
            with cond:
                if errors or state["next"] >= len(tasks):
                    return
                i = state["next"]
                state["next"] += 1
            try:
                tasks[i]()
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                errors.append(exc)
            finally:
                with cond:
                    state["done"] += 1
                    cond.notify_all()

    pool = _executor(threads - 1)
    for _ in range(threads - 1):
        pool.submit(worker)
    worker()
    with cond:
        cond.wait_for(lambda: state["done"] == state["next"])
    if errors:
        raise errors[0]


def for_chunks(items, fn) -> None:
    """Call ``fn(chunk)`` for contiguous chunks of ``items``, concurrently."""
    threads, chunks = _split(items, CHUNKS_PER_THREAD)
    with blas_limited():
        if threads == 1:
            fn(chunks[0])
            return
        _run_dynamic(threads, [lambda c=c: fn(c) for c in chunks])


def sum_into(shape, dtype, items, fn) -> np.ndarray:
    """``fn(chunk, out)`` adds each chunk's contribution into a zero ``out``; returns the sum.

    Chunk ``j`` fills its own zeroed buffer; finished buffers are added to the result in
    chunk order (``((b0 + b1) + b2) + ...``) as soon as their predecessors are in, and
    recycled, so the sum does not depend on which thread ran which chunk.
    """
    threads, chunks = _split(items, SUM_CHUNKS_PER_THREAD)
    with blas_limited():
        if threads == 1:
            out = np.zeros(shape, dtype=dtype)
            fn(chunks[0], out)
            return out
        lock = threading.Lock()
        state = {"next": 0, "acc": None}
        done, free = {}, []

        def task(j):
            with lock:
                buf = free.pop() if free else None
            if buf is None:
                buf = np.empty(shape, dtype=dtype)
            buf.fill(0)  # written here, by the thread that uses it (first-touch)
            fn(chunks[j], buf)
            with lock:  # commit every finished buffer whose predecessors are in
                done[j] = buf
                while state["next"] in done:
                    b = done.pop(state["next"])
                    if state["acc"] is None:
                        state["acc"] = b
                    else:
                        state["acc"] += b
                        free.append(b)
                    state["next"] += 1

        _run_dynamic(threads, [lambda j=j: task(j) for j in range(len(chunks))])
        return state["acc"]
