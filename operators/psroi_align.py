"""PSROIAlign: position-sensitive ROIAlign (average of bilinear samples per bin); semantics
in the class docstring."""
from __future__ import annotations

from mx_roi import geometry, kernels_numpy as K
from mx_roi.params import PSROIAlignParam
from mx_roi.registry import register
from mx_roi.cuda.tables import sample_grid_tables
from mx_roi.cuda.compiled_geometry import Spec

from .psroi_pooling import PositionSensitive


@register
class PSROIAlign(PositionSensitive):
    """Position-sensitive ROIAlign: the average of bilinear samples per bin, each bin on its
    own score map: ``mx.nd.contrib.ROIAlign(..., position_sensitive=True)``.

    ``data`` (N, output_dim * Gh * Gw, H, W) and ``rois`` (R, 5) = (batch index, x1, y1,
    x2, y2), of one dtype; output (R, output_dim, P, Q) for ``pooled_size`` (P, Q).

    The samples are ROIAlign's (``sample_ratio``, ``aligned``); the channel rule is
    PSROIPooling's: output channel ``c`` at bin ``(p, q)`` reads input channel
    ``(c * Gh + floor(p * Gh / P)) * Gw + floor(q * Gw / Q)``.  ``group_size=0`` is the
    built-in's grid, the pooled grid (channel ``c * P * Q + p * Q + q``); an int G or
    ``(gh, gw)`` gives any other group grid.

    ``legacy='rfcn'`` reproduces the forward of the R-FCN-PSROIAlign layer (box
    ``x1 * s .. (x2 + 1) * s``, ``sample_num`` x ``sample_num`` interior points per bin,
    bins clipped to ``[0, H - 1] x [0, W - 1]``, the sum divided by ``sample_num ** 2``
    even when points were dropped), with the true gradient of that forward.

    Differences from the built-in: any group grid, padding rois (a negative batch index:
    output 0, no gradient), and errors naming the roi or the channel count.
    """
    name = "PSROIAlign"
    param_cls = PSROIAlignParam
    cuda_source = "psroi_align.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section)
    native_gpu_kernels = (("roi_grid_geometry", ()), ("roi_adaptive_bound", ()),
                          ("ps_channel_map_fill", ()), ("psroi_align_forward", ()),
                          ("psroi_align_backward", ("A",)))
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
