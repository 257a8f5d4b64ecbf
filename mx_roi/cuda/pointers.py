"""Data addresses of NumPy arrays for ctypes calls (the launch glue and the compiled
geometry's host entry points share it)."""
from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["address"]


def address(a: np.ndarray) -> int:
    """The data address of NumPy array ``a``: through the buffer protocol when ``a`` is
    writable (3x cheaper than ``a.ctypes.data``, which builds a helper object -- a small
    launch passes a dozen arrays), else ``a.ctypes.data``."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):  # read-only (e.g. a DLPack view), empty
        return a.ctypes.data
