"""PSROIPooling (R-FCN position-sensitive average pooling) against the reference and
``mx.nd.contrib.PSROIPooling`` (square pools; the built-in has a single pooled_size)."""
import mxnet as mx
import numpy as np

from tests import reference as ref
from tests.ops.base import PositionSensitiveTester


class TestPSROIPooling(PositionSensitiveTester):
    op_type = "PSROIPooling"
    builtin = staticmethod(mx.nd.contrib.PSROIPooling)

    @classmethod
    def param_cases(cls):
        return [
            dict(pooled_size=3, output_dim=2, spatial_scale=0.0625, group_size=0),
            dict(pooled_size=(2, 2), output_dim=1, spatial_scale=1.0, group_size=2),
            dict(pooled_size=3, output_dim=1, spatial_scale=0.5, group_size=2),
            dict(pooled_size=2, output_dim=2, spatial_scale=0.25, group_size=3),
            dict(pooled_size=1, output_dim=3, spatial_scale=0.7, group_size=1),
            # rectangular group grids: the pooled grid of a non-square pool, and (gh, gw)
            # different from it (several bins per group cell, unused cells)
            dict(pooled_size=(3, 4), output_dim=2, spatial_scale=0.5, group_size=0),
            dict(pooled_size=(3, 4), output_dim=1, spatial_scale=0.25, group_size=(2, 3)),
            dict(pooled_size=2, output_dim=2, spatial_scale=1.0, group_size=(3, 1)),
        ]

    def builtin_params(self, params):
        PH, PW = self.pooled(params)
        GH, GW = self.groups(params)
        if PH != PW or GH != GW:    # the built-in takes ints only: square pool and grid
            return None
        return dict(pooled_size=PH, output_dim=params["output_dim"],
                    spatial_scale=params["spatial_scale"], group_size=GH)

    def builtin_ok(self, rois, params):
        return rois[:, 0] >= 0          # the built-in reads out of bounds for padding rois

    def reference_forward(self, data, rois, pooled_size, output_dim, spatial_scale,
                          group_size=0, deterministic=False):
        return ref.psroi_pooling_forward(data, rois, pooled_size, output_dim, spatial_scale,
                                         group_size)

    def reference_backward(self, data, rois, grad, pooled_size, output_dim, spatial_scale,
                           group_size=0, deterministic=False):
        return ref.psroi_pooling_backward(data, rois, grad, pooled_size, output_dim,
                                          spatial_scale, group_size)


def test_psroi_pooling_constant_map_per_channel():
    """On a map whose channel k is the constant k, every non-empty bin (ph, pw) of output
    channel ctop reads exactly channel (ctop * G + gh) * G + gw."""
    import mxnet as mx
    import mx_roi  # noqa: F401

    O, P = 2, 3
    x = np.broadcast_to(np.arange(O * P * P, dtype=np.float64)[None, :, None, None],
                        (1, O * P * P, 6, 6)).copy()
    rois = np.array([[0, 0, 0, 5, 5]], np.float64)
    out = mx.nd.Custom(mx.nd.array(x, dtype=np.float64), mx.nd.array(rois, dtype=np.float64),
                       op_type="PSROIPooling", pooled_size=P, output_dim=O,
                       spatial_scale=1.0).asnumpy()
    expected = np.arange(O * P * P, dtype=np.float64).reshape(1, O, P, P)
    np.testing.assert_array_equal(out, expected)
