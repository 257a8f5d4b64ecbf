"""Symbolic entry points: ``mx_roi.sym.ROIAlign(data=conv, rois=rois, pooled_size=(7, 7))``."""
import mxnet as mx

from .api import populate

populate(globals(), mx.sym)
__all__ = ["ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign"]
