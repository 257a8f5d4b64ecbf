"""Imperative entry points: ``mx_roi.nd.ROIAlign(data, rois, pooled_size=(7, 7), ...)``."""
import mxnet as mx

from .api import populate

populate(globals(), mx.nd)
__all__ = ["ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign"]
