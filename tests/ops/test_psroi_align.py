"""PSROIAlign against the reference and ``mx.nd.contrib.ROIAlign(position_sensitive=True)``
(equal when the group grid is the pooled grid, square or not)."""
import mxnet as mx
import numpy as np
import pytest

from tests import reference as ref
from tests.ops.base import PositionSensitiveTester, run_builtin
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


# ---- MXNet's own test_op_roi_align, position-sensitive case ---------------------------
# tests/python/unittest/test_operator.py (apache/mxnet 1.9.x) runs contrib.ROIAlign with
# pooled_size=(3, 4), position_sensitive=True on 3*3*4 channels and compares it with a
# float32 scalar Python loop.  The same check against our op, written anew: the channels
# are passed as they are (output channel c, bin (ph, pw) reads c*PH*PW + ph*PW + pw);
# the bilinear taps are tests/reference.py's (MXNet's bilinear_interpolate).


def _ps_align_loops(data, rois, pooled_size, spatial_scale, sample_ratio, dy):
    """Forward and data gradient of position-sensitive ROIAlign (aligned=False), float32."""
    T = np.float32
    N, C, H, W = data.shape
    PH, PW = pooled_size
    O = C // (PH * PW)
    out = np.zeros((rois.shape[0], O, PH, PW), T)
    dx = np.zeros_like(data)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1, x2, y2 = roi[1:] * T(spatial_scale)
        bin_h = T(max(y2 - y1, T(1))) / T(PH)
        bin_w = T(max(x2 - x1, T(1))) / T(PW)
        gy = sample_ratio if sample_ratio > 0 else int(np.ceil(bin_h))
        gx = sample_ratio if sample_ratio > 0 else int(np.ceil(bin_w))
        count = T(gy * gx)
        for c in range(O):
            for ph in range(PH):
                for pw in range(PW):
                    ch = c * PH * PW + ph * PW + pw
                    acc = T(0)
                    for iy in range(gy):
                        y = y1 + T(ph) * bin_h + (T(iy) + T(0.5)) * bin_h / T(gy)
                        for ix in range(gx):
                            x = x1 + T(pw) * bin_w + (T(ix) + T(0.5)) * bin_w / T(gx)
                            for w, row, col in ref._bilinear(y, x, H, W, T):
                                acc += w * data[b, ch, row, col]
                                dx[b, ch, row, col] += dy[r, c, ph, pw] * w / count
                    out[r, c, ph, pw] = acc / count
    return out, dx


@pytest.mark.parametrize("entry", ["custom", "sym"])
@pytest.mark.parametrize("sample_ratio", [0, 2])
def test_mxnet_test_op_roi_align_position_sensitive_3x4(entry, sample_ratio):
    """MXNet's (3, 4) position-sensitive case: 5 images of 36 x 16 x 16 arange values, 7
    random boxes on a 224 image; forward, data gradient (garbage-prefilled buffer) and
    rois gradient within MXNet's atol=1e-3, and against the built-in itself."""
    import mx_roi
    from tests.ops.base import assert_close

    rng = np.random.default_rng(20)
    N, C_out, H, W, R, dlen = 5, 3, 16, 16, 7, 224
    pooled = (3, 4)
    C = C_out * pooled[0] * pooled[1]
    scale = H * 1.0 / dlen
    data = np.arange(N * C * H * W, dtype=np.float32).reshape(N, C, H, W)
    centre = rng.uniform(0, dlen, (R, 2))
    wh = rng.uniform(0, dlen, (R, 2))
    rois = np.concatenate([rng.integers(0, N, (R, 1)), centre - wh / 2, centre + wh / 2],
                          axis=1).astype(np.float32)
    dy = rng.uniform(-1, 1, (R, C_out) + pooled).astype(np.float32)
    params = dict(pooled_size=pooled, output_dim=C_out, spatial_scale=scale,
                  sample_ratio=sample_ratio)
    if entry == "custom":
        x, r = mx.nd.array(data), mx.nd.array(rois)
        x.attach_grad()
        r.attach_grad()
        x.grad[:] = 3.0
        r.grad[:] = 3.0
        with mx.autograd.record():
            y = mx.nd.Custom(x, r, op_type="PSROIAlign", **params)
        y.backward(mx.nd.array(dy))
        out, dx, drois = y.asnumpy(), x.grad.asnumpy(), r.grad.asnumpy()
    else:
        sym = mx_roi.sym.PSROIAlign(mx.sym.Variable("data"), mx.sym.Variable("rois"), **params)
        exe = sym.simple_bind(mx.cpu(), data=data.shape, rois=rois.shape)
        exe.arg_dict["data"][:] = data
        exe.arg_dict["rois"][:] = rois
        exe.grad_dict["data"][:] = 3.0
        exe.grad_dict["rois"][:] = 3.0
        out = exe.forward(is_train=True)[0].asnumpy()
        exe.backward(mx.nd.array(dy))
        dx, drois = exe.grad_dict["data"].asnumpy(), exe.grad_dict["rois"].asnumpy()
    want, want_dx = _ps_align_loops(data, rois, pooled, scale, sample_ratio, dy)
    assert out.shape == (R, C_out) + pooled
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-3)
    assert not drois.any()
    # and the built-in on the same inputs, at the suite's float32 tolerance
    bout, bdx = run_builtin(mx.nd.contrib.ROIAlign, data, rois,
                            dict(pooled_size=pooled, spatial_scale=scale,
                                 sample_ratio=sample_ratio, position_sensitive=True), dy)
    assert_close(out, bout, np.float32, "forward vs contrib.ROIAlign")
    assert_close(dx, bdx, np.float32, "data grad vs contrib.ROIAlign")
