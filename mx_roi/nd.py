"""Imperative entry points: ``mx_roi.nd.ROIAlign(data, rois, pooled_size=(7, 7), ...)``."""
import mxnet as mx

from .api import populate
from .registry import REGISTERED

populate(globals(), mx.nd)
__all__ = list(REGISTERED)
