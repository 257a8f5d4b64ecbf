"""Symbolic entry points: ``mx_roi.sym.ROIAlign(data=conv, rois=rois, pooled_size=(7, 7))``."""
import mxnet as mx

from .api import populate
from .registry import REGISTERED

populate(globals(), mx.sym)
__all__ = list(REGISTERED)
