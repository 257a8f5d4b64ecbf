"""The four RoI operators, one module (and one ``.cu`` kernel file) each.

Importing this package registers them with MXNet (``mx.nd.Custom(op_type=...)``).
"""
from .roi_pooling import ROIPooling
from .roi_align import ROIAlign
from .psroi_pooling import PSROIPooling
from .psroi_align import PSROIAlign

ALL_OPS = (ROIPooling, ROIAlign, PSROIPooling, PSROIAlign)

__all__ = ["ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign", "ALL_OPS"]
