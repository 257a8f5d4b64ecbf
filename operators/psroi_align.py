"""PSROIAlign: position-sensitive ROIAlign (average of bilinear samples per bin).

Semantics of ``mx.nd.contrib.ROIAlign(..., position_sensitive=True)``, whose group grid
is the pooled grid (``group_size=0``, square or not: input channel ``c*P*Q + p*Q + q``),
generalised to any group grid ``(Gh, Gw)`` the way PSROIPooling does it: output channel
``c`` at bin (p, q) reads input channel ``(c*Gh + floor(p*Gh/P))*Gw + floor(q*Gw/Q)``.
The gradient is the true gradient of this forward (the R-FCN-PSROIAlign layer's
backward is not).
"""
from __future__ import annotations

from mx_roi import geometry, kernels_numpy as K
from mx_roi.params import PSROIAlignParam
from mx_roi.registry import register
from mx_roi.cuda.tables import sample_grid_tables
from mx_roi.cuda.compiled_geometry import Spec

from .psroi_pooling import PositionSensitive


@register
class PSROIAlign(PositionSensitive):
    name = "PSROIAlign"
    param_cls = PSROIAlignParam
    cuda_source = "psroi_align.cu"
    gluon_mode = "psalign"
    selftest_cases = (dict(pooled_size=2, output_dim=2, spatial_scale=0.5, sample_ratio=2),)
    kernel_tables = staticmethod(sample_grid_tables)

    def geometry(self, rois, height, width, xp):
        p = self.param
        if p.legacy == "rfcn":
            return geometry.rfcn_align_grid(rois, p.pooled_size, p.spatial_scale, p.sample_num,
                                            height, width, xp)
        return geometry.roi_align_grid(rois, p.pooled_size, p.spatial_scale, p.sample_ratio,
                                       p.aligned, height, width, xp)

    def geometry_spec(self):
        p = self.param
        if p.legacy == "rfcn":
            return Spec("rfcn_grid", p.pooled_size, p.spatial_scale, p.sample_num)
        return Spec("align_grid", p.pooled_size, p.spatial_scale, p.sample_ratio, p.aligned)

    def forward_numpy(self, geo, data, keep=True, out=None):
        sep = K.separable(geo, data.shape[2], data.shape[3])
        return K.ps_avg_forward(sep, data, *self.group_args()), None

    def backward_numpy(self, geo, grad, data_shape, saved):
        sep = K.separable(geo, data_shape[2], data_shape[3])
        return K.ps_avg_backward(sep, grad, data_shape, *self.group_args())
