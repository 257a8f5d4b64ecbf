"""Run a kernel's per-roi loop on a few threads (NumPy and BLAS release the GIL).

MXNet's own CPU RoI kernels use OpenMP over rois; :func:`for_chunks` and
:func:`sum_into` do the same for the NumPy kernels.  Rois are split into contiguous
chunks in a fixed way, so results do not depend on thread timing: forwards write
disjoint outputs, and backwards accumulate each chunk into its own buffer and add the
buffers in chunk order (deterministic).  ``MX_ROI_NUM_THREADS`` sets the thread count
(default: the CPU count, at most 8; 1 disables threading).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["num_threads", "for_chunks", "sum_into"]

#: below this many rois per thread, threading costs more than it saves
MIN_ROIS_PER_THREAD = 16

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
    return max(1, min(os.cpu_count() or 1, 8))


def _executor(n):
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mx_roi")
        return _pool


def _chunks(items, n):
    items = list(items)
    n = max(1, min(n, len(items) // MIN_ROIS_PER_THREAD))
    return [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]


def for_chunks(items, fn) -> None:
    """Call ``fn(chunk)`` for contiguous chunks of ``items``, concurrently."""
    chunks = _chunks(items, num_threads())
    if len(chunks) == 1:
        fn(chunks[0])
        return
    futures = [_executor(len(chunks)).submit(fn, c) for c in chunks[1:]]
    fn(chunks[0])
    for f in futures:
        f.result()


def sum_into(shape, dtype, items, fn) -> np.ndarray:
    """``fn(chunk, out)`` adds each chunk's contribution into a zero ``out``; returns the sum."""
    chunks = _chunks(items, num_threads())
    outs = [np.zeros(shape, dtype=dtype) for _ in chunks]
    if len(chunks) == 1:
        fn(chunks[0], outs[0])
        return outs[0]
    futures = [_executor(len(chunks)).submit(fn, c, o) for c, o in zip(chunks[1:], outs[1:])]
    fn(chunks[0], outs[0])
    for f in futures:
        f.result()
    for o in outs[1:]:
        outs[0] += o
    return outs[0]

