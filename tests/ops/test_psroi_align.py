"""PSROIAlign against the reference and ``mx.nd.contrib.ROIAlign(position_sensitive=True)``
(equal when the group grid is the pooled grid, square or not)."""
import mxnet as mx
import numpy as np

from tests import reference as ref
from tests.ops.base import PositionSensitiveTester
from tests.ops.test_roi_align import positive_size


class TestPSROIAlign(PositionSensitiveTester):
    op_type = "PSROIAlign"
    builtin = staticmethod(mx.nd.contrib.ROIAlign)

    @classmethod
    def param_cases(cls):
        return [
            dict(pooled_size=3, output_dim=2, spatial_scale=0.0625, sample_ratio=-1,
                 aligned=False, group_size=0),
            dict(pooled_size=(2, 2), output_dim=1, spatial_scale=1.0, sample_ratio=2,
                 aligned=True, group_size=2),
            dict(pooled_size=3, output_dim=1, spatial_scale=0.5, sample_ratio=1,
                 aligned=False, group_size=2),
            dict(pooled_size=2, output_dim=2, spatial_scale=0.25, sample_ratio=-1,
                 aligned=True, group_size=0),
            dict(pooled_size=2, output_dim=1, spatial_scale=0.7, sample_ratio=3,
                 aligned=False, group_size=3),
            # the pooled grid of a non-square pool: contrib.ROIAlign(position_sensitive=True)
            dict(pooled_size=(3, 4), output_dim=3, spatial_scale=0.5, sample_ratio=2,
                 aligned=False, group_size=0),
            dict(pooled_size=(2, 3), output_dim=2, spatial_scale=0.25, sample_ratio=-1,
                 aligned=True, group_size=0),
            # (gh, gw) different from (P, Q): reference only
            dict(pooled_size=(3, 4), output_dim=1, spatial_scale=0.7, sample_ratio=1,
                 aligned=False, group_size=(2, 3)),
            dict(pooled_size=2, output_dim=2, spatial_scale=1.0, sample_ratio=-1,
                 aligned=True, group_size=(1, 3)),
        ]

    def reference_forward(self, data, rois, pooled_size, output_dim, spatial_scale,
                          sample_ratio=-1, aligned=False, group_size=0, deterministic=False,
                          legacy="", sample_num=2):
        assert legacy == ""
        return ref.psroi_align_forward(data, rois, pooled_size, output_dim, spatial_scale,
                                       sample_ratio, aligned, group_size)

    def reference_backward(self, data, rois, grad, pooled_size, output_dim, spatial_scale,
                           sample_ratio=-1, aligned=False, group_size=0, deterministic=False,
                           legacy="", sample_num=2):
        assert legacy == ""
        return ref.psroi_align_backward(data, rois, grad, pooled_size, output_dim,
                                        spatial_scale, sample_ratio, aligned, group_size)

    def builtin_params(self, params):
        PH, PW = self.pooled(params)
        if self.groups(params) != (PH, PW):     # the built-in's group grid is the pool
            return None
        return dict(pooled_size=(PH, PW), spatial_scale=params["spatial_scale"],
                    sample_ratio=params["sample_ratio"], aligned=params["aligned"],
                    position_sensitive=True)

    def builtin_ok(self, rois, params):
        ok = rois[:, 0] >= 0
        if params["aligned"]:
            ok &= positive_size(rois, params["spatial_scale"], True)
        return ok
