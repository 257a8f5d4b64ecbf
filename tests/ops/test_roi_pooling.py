"""ROIPooling (Fast R-CNN max pooling over quantised bins) against the reference and
``mx.nd.ROIPooling``."""
import mxnet as mx
import numpy as np

from tests import reference as ref
from tests.ops.base import RoIOpTester


class TestROIPooling(RoIOpTester):
    op_type = "ROIPooling"
    builtin = staticmethod(mx.nd.ROIPooling)
    exact_forward = True
    data_kinds = ("randn", "relu", "int", "neg")

    @classmethod
    def param_cases(cls):
        return [
            dict(pooled_size=(2, 2), spatial_scale=0.0625),
            dict(pooled_size=(3, 3), spatial_scale=1.0),
            dict(pooled_size=(1, 1), spatial_scale=0.5),
            dict(pooled_size=(4, 3), spatial_scale=0.7),
        ]

    def reference_forward(self, data, rois, pooled_size, spatial_scale, deterministic=False):
        return ref.roi_pooling_forward(data, rois, pooled_size, spatial_scale)

    def reference_backward(self, data, rois, grad, pooled_size, spatial_scale,
                           deterministic=False):
        return ref.roi_pooling_backward(data, rois, grad, pooled_size, spatial_scale)

    def builtin_params(self, params):
        return dict(pooled_size=params["pooled_size"], spatial_scale=params["spatial_scale"])


def test_roi_pooling_docstring_example():
    """The worked example of MXNet's ROIPooling documentation."""
    import mx_roi  # noqa: F401

    x = mx.nd.arange(48).reshape((1, 1, 8, 6))
    y = mx.nd.array([[0, 0, 0, 4, 4]])
    out = mx.nd.Custom(x, y, op_type="ROIPooling", pooled_size=(2, 2), spatial_scale=1.0)
    np.testing.assert_array_equal(out.asnumpy(), [[[[14, 16], [26, 28]]]])
    out = mx.nd.Custom(x, y, op_type="ROIPooling", pooled_size=(2, 2), spatial_scale=0.7)
    np.testing.assert_array_equal(out.asnumpy(), [[[[7, 9], [19, 21]]]])


def test_roi_pooling_half_rounds_away_from_zero():
    """x * scale == 0.5 rounds to 1 and -0.5 to -1 (C round, not banker's rounding)."""
    import mx_roi  # noqa: F401

    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    # x1 = 8 * (1/16) = 0.5 -> 1 ; x2 = 40/16 = 2.5 -> 3 ; y = -8/16 = -0.5 -> -1 .. 24/16 -> 2
    rois = np.array([[0, 8, -8, 40, 24]], np.float32)
    out = mx.nd.Custom(mx.nd.array(x), mx.nd.array(rois), op_type="ROIPooling",
                       pooled_size=(1, 1), spatial_scale=0.0625).asnumpy()
    # bins: w in [1, 3], h in [0, 2] -> max = x[2, 3] = 11
    np.testing.assert_array_equal(out, [[[[11]]]])
    np.testing.assert_array_equal(out, ref.roi_pooling_forward(x, rois, (1, 1), 0.0625))


def test_roi_pooling_first_max_wins_gradient():
    """With ties the whole gradient goes to the first maximum in row-major order."""
    import mx_roi  # noqa: F401
    from mxnet import autograd

    x = mx.nd.array(np.ones((1, 1, 3, 3), np.float32))
    x.attach_grad()
    rois = mx.nd.array([[0, 0, 0, 2, 2]])
    with autograd.record():
        y = mx.nd.Custom(x, rois, op_type="ROIPooling", pooled_size=(1, 1), spatial_scale=1.0)
    y.backward(mx.nd.array([[[[5.0]]]]))
    expected = np.zeros((1, 1, 3, 3), np.float32)
    expected[0, 0, 0, 0] = 5
    np.testing.assert_array_equal(x.grad.asnumpy(), expected)
