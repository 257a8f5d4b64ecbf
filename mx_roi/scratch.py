"""Reused host memory for large per-call scratch arrays (e.g. the max ops' argmax).

An array of more than :data:`MIN_BYTES` comes from fresh ``mmap`` pages in every call
(glibc's mmap threshold tops out at 32 MiB); the first write to each page then costs a
page fault and the kernel's zeroing -- measured on the 2-vCPU test machine: 60 ms to
fill a fresh 411 MB array against 31 ms for one already touched, i.e. a ROIPooling
14x14 / 512-roi training forward paid twice for its argmax.  :func:`empty` hands out
such arrays from a few kept buffers instead; a buffer goes back when its array is
garbage collected (nobody can still see it then).  CuPy arrays have CuPy's pool.
"""
from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import List

import numpy as np

__all__ = ["empty", "advise_huge_pages", "MIN_BYTES", "MAX_KEPT", "HUGE_MIN_BYTES"]

#: arrays smaller than this come from ``np.empty`` (the heap reuses their memory already)
MIN_BYTES = 32 << 20
#: at most this many idle buffers are kept
MAX_KEPT = 2

_LOCK = threading.Lock()
_IDLE: List[np.ndarray] = []  # raw uint8 buffers, most recently returned last


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous NumPy array, from a kept buffer when large."""
    dtype = np.dtype(dtype)
    # (math.prod: np.prod costs more than a small call's kernel argument binding)
    nbytes = dtype.itemsize * math.prod(int(d) for d in shape)
    if nbytes < MIN_BYTES:
        return np.empty(shape, dtype)
    raw = None
    with _LOCK:
        # the smallest idle buffer that fits without wasting more than half of it
        fits = [b for b in _IDLE if nbytes <= b.nbytes <= 2 * nbytes]
        if fits:
            raw = min(fits, key=lambda b: b.nbytes)
            # by identity (list.remove would compare arrays by value: a NumPy error)
            del _IDLE[next(i for i, b in enumerate(_IDLE) if b is raw)]
    if raw is None:
        raw = np.empty(nbytes, np.uint8)
        advise_huge_pages(raw)
    lease = _Lease(raw, tuple(int(d) for d in shape), dtype)
    weakref.finalize(lease, _give_back, raw)
    return np.asarray(lease)


class _Lease:
    """The base object of a handed-out array.  NumPy makes every view of an array
    point at the first base that is not an ndarray, i.e. this one, so it lives exactly
    as long as some array can still see the buffer (a view of a plain slice of ``raw``
    would skip the slice and keep only ``raw`` alive)."""

    __slots__ = ("raw", "__array_interface__", "__weakref__")

    def __init__(self, raw, shape, dtype):
        self.raw = raw
        self.__array_interface__ = dict(shape=shape, typestr=dtype.str,
                                        descr=dtype.descr, data=(raw.ctypes.data, False),
                                        version=3)


def _give_back(raw: np.ndarray) -> None:
    with _LOCK:
        _IDLE.append(raw)
        del _IDLE[:-MAX_KEPT]


def idle_bytes() -> int:
    """Bytes held by idle buffers (for tests and memory reports)."""
    with _LOCK:
        return sum(b.nbytes for b in _IDLE)


#: buffers at least this large are advised onto transparent huge pages
HUGE_MIN_BYTES = 8 << 20
_HUGE = 2 << 20          # x86-64 PMD page
_MADV_HUGEPAGE = 14      # <sys/mman.h>
_madvise = None


def advise_huge_pages(a: np.ndarray) -> bool:
    """Ask the kernel to back the 2 MiB-aligned interior of large host array ``a`` with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``; needs THP ``enabled`` =
    ``madvise`` or ``always``).  For memory about to be written for the first time --
    MXNet's fresh output buffer, a new scratch buffer -- the first touch then costs one
    fault per 2 MiB instead of one per 4 KiB: ROIPooling 14x14 / 512 boxes, a 103 MB
    output, 26,000 faults fewer, inference forward 85 -> 50 ms on the 2-vCPU test VM.
    Only the VMA flags change (no data, no size: pages fully inside ``a`` only), so it is
    harmless on memory already touched, and any failure is ignored.  Returns whether
    the call was made and succeeded."""
    if a.nbytes < HUGE_MIN_BYTES or not a.flags.c_contiguous:
        return False
    return advise_huge_pages_at(a.ctypes.data, a.nbytes)


def advise_huge_pages_at(addr: int, nbytes: int) -> bool:
    """:func:`advise_huge_pages` for the ``nbytes`` of memory at address ``addr`` (e.g.
    MXNet's output memory, known by its address)."""
    global _madvise
    if nbytes < HUGE_MIN_BYTES or not addr:
        return False
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):  # not Linux / no libc symbol
            _madvise = False
    if not _madvise:
        return False
    start, end = (addr + _HUGE - 1) & ~(_HUGE - 1), (addr + nbytes) & ~(_HUGE - 1)
    return end > start and _madvise(start, end - start, _MADV_HUGEPAGE) == 0
