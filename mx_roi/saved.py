"""What a training forward keeps for its backward, shared by every backend.

The backward of a training step runs on the same rois as its forward; reusing the
forward's geometry tables (and, for the max modes, its argmax) spares rebuilding them.
They are reused only when the backward's rois and map size equal the forward's.
"""
from __future__ import annotations

import numpy as np

__all__ = ["Saved", "keep_for_backward", "unpack_saved"]


class Saved:
    """What a training forward keeps for its backward: the op's own value (e.g. an
    argmax, or None), and the call's rois (a copy), map size and geometry tables, which
    the backward reuses instead of rebuilding them when its rois are the same."""

    __slots__ = ("value", "rois", "hw", "geo")

    def __init__(self, value, rois, hw, geo):
        self.value, self.rois, self.hw, self.geo = value, rois, hw, geo


def keep_for_backward(value, rois, hw, geo) -> Saved:
    return Saved(value, rois.copy(), tuple(int(v) for v in hw), geo)


def unpack_saved(saved, rois, hw, xp=np):
    """``(value, geometry or None)`` for a backward with ``rois`` on an ``hw`` map.

    If the rois or the map size differ from the forward's, neither is reused (an argmax
    of other rois would route the gradient wrongly): ``(None, None)``.
    """
    if not isinstance(saved, Saved):
        return saved, None
    same = (saved.hw == tuple(int(v) for v in hw) and saved.rois.shape == rois.shape
            and saved.rois.dtype == rois.dtype and bool(xp.array_equal(saved.rois, rois)))
    return (saved.value, saved.geo) if same else (None, None)
