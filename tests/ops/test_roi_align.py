"""ROIAlign (avg and max) against the reference and ``mx.nd.contrib.ROIAlign``."""
import mxnet as mx
import numpy as np

from tests import reference as ref
from tests.ops.base import RoIOpTester


def positive_size(rois, spatial_scale, aligned):
    """Mask of rois with a positive size in the compute dtype (the built-in aborts the
    process on the others when aligned=True)."""
    T = ref.compute_dtype(rois.dtype)
    r = rois.astype(T)
    s = T(np.float32(spatial_scale))
    off = T(0.5) if aligned else T(0)
    w = (r[:, 3] * s - off) - (r[:, 1] * s - off)
    h = (r[:, 4] * s - off) - (r[:, 2] * s - off)
    return (w > 0) & (h > 0)


class TestROIAlign(RoIOpTester):
    op_type = "ROIAlign"
    builtin = staticmethod(mx.nd.contrib.ROIAlign)

    @classmethod
    def param_cases(cls):
        return [
            dict(pooled_size=(2, 2), spatial_scale=0.0625, sample_ratio=-1, aligned=False,
                 pool_mode="avg"),
            dict(pooled_size=(3, 3), spatial_scale=1.0, sample_ratio=2, aligned=True,
                 pool_mode="avg"),
            dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1, aligned=True,
                 pool_mode="max"),
            dict(pooled_size=(3, 2), spatial_scale=0.25, sample_ratio=1, aligned=False,
                 pool_mode="max"),
            dict(pooled_size=(2, 2), spatial_scale=0.7, sample_ratio=3, aligned=False,
                 pool_mode="avg"),
            dict(pooled_size=(1, 1), spatial_scale=1.0, sample_ratio=-1, aligned=False,
                 pool_mode="max"),
        ]

    def reference_forward(self, data, rois, pooled_size, spatial_scale, sample_ratio=-1,
                          aligned=False, pool_mode="avg", deterministic=False, legacy=""):
        assert legacy == ""
        return ref.roi_align_forward(data, rois, pooled_size, spatial_scale, sample_ratio,
                                     aligned, pool_mode)

    def reference_backward(self, data, rois, grad, pooled_size, spatial_scale,
                           sample_ratio=-1, aligned=False, pool_mode="avg",
                           deterministic=False, legacy=""):
        assert legacy == ""
        return ref.roi_align_backward(data, rois, grad, pooled_size, spatial_scale,
                                      sample_ratio, aligned, pool_mode)

    def builtin_params(self, params):
        if params.get("pool_mode", "avg") != "avg":
            return None
        return dict(pooled_size=params["pooled_size"], spatial_scale=params["spatial_scale"],
                    sample_ratio=params["sample_ratio"], aligned=params["aligned"])

    def builtin_ok(self, rois, params):
        ok = rois[:, 0] >= 0
        if params["aligned"]:
            ok &= positive_size(rois, params["spatial_scale"], True)
        return ok


def test_roi_align_default_params():
    """sample_ratio, aligned and pool_mode are optional (-1, False, 'avg')."""
    import mx_roi  # noqa: F401

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 6, 7)).astype(np.float32)
    rois = np.array([[0, 1.0, 1.5, 5.2, 4.9], [0, 0, 0, 6, 5]], np.float32)
    out = mx.nd.Custom(mx.nd.array(x), mx.nd.array(rois), op_type="ROIAlign",
                       pooled_size=(2, 2), spatial_scale=1.0).asnumpy()
    np.testing.assert_allclose(out, ref.roi_align_forward(x, rois, (2, 2), 1.0),
                               rtol=1e-5, atol=1e-6)


def test_roi_align_aligned_zero_size_box():
    """aligned=True with a zero-size box (where MXNet's built-in aborts): empty grid,
    zero output and no gradient; with sample_ratio > 0 all samples sit on one point."""
    import mx_roi  # noqa: F401
    from mxnet import autograd

    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, 5, 5))
    rois = np.array([[0, 2.0, 2.0, 2.0, 2.0], [0, 3.0, 1.0, 1.0, 3.0]])
    for sr in (-1, 2):
        xd = mx.nd.array(x, dtype=np.float64)
        xd.attach_grad()
        with autograd.record():
            y = mx.nd.Custom(xd, mx.nd.array(rois, dtype=np.float64), op_type="ROIAlign",
                             pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=sr,
                             aligned=True)
        g = np.ones((2, 1, 2, 2))
        y.backward(mx.nd.array(g, dtype=np.float64))
        np.testing.assert_allclose(
            y.asnumpy(), ref.roi_align_forward(x, rois, (2, 2), 1.0, sr, True), atol=1e-12)
        np.testing.assert_allclose(
            xd.grad.asnumpy(), ref.roi_align_backward(x, rois, g, (2, 2), 1.0, sr, True),
            atol=1e-12)
        if sr == -1:
            assert not y.asnumpy().any() and not xd.grad.asnumpy().any()
