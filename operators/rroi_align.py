"""RROIAlign: ROIAlign over rotated boxes, with a backward; semantics in the class docstring."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from mx_roi import geometry
from mx_roi.params import ParamBase, param_field, parse_bool, pooled_size_field, \
    sample_ratio_field, spatial_scale_field
from mx_roi.registry import RoIOp, register


@dataclass(frozen=True)
class RROIAlignParam(ParamBase):
    """Parameters of ``RROIAlign`` (rotated boxes, average of bilinear samples)."""

    op_name = "RROIAlign"
    pooled_size: Tuple[int, int] = pooled_size_field()
    spatial_scale: float = spatial_scale_field()
    sampling_ratio: int = sample_ratio_field()
    aligned: bool = param_field(parse_bool, False,
                                "half-pixel offset, no 1x1 floor (Detectron2)")
    clockwise: bool = param_field(parse_bool, False, "angles clockwise (mmcv)")
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")


def _bin_values(data, grid, k):
    """The bilinear values of sample ``k`` of every bin: (R, P, Q, C), MXNet's order
    ``(w1*v1 + w2*v2) + w3*v3 + w4*v4``."""
    b = np.maximum(grid.batch, 0)[:, None, None]
    yl, yh = grid.y_low[..., k], grid.y_high[..., k]
    xl, xh = grid.x_low[..., k], grid.x_high[..., k]
    w = [getattr(grid, f"w{i}")[..., k, None] for i in (1, 2, 3, 4)]
    return ((w[0] * data[b, :, yl, xl] + w[1] * data[b, :, yl, xh])
            + w[2] * data[b, :, yh, xl]) + w[3] * data[b, :, yh, xh]


def _live(grid, k):
    """(R, P, Q, 1) mask of the bins whose sample ``k`` is a real, in-map sample."""
    # an in-map sample has a weight >= 1/4 (hy + ly = hx + lx = 1); the others none
    inside = (grid.w1[..., k] + grid.w2[..., k] + grid.w3[..., k] + grid.w4[..., k]) > 0
    return (inside & (grid.batch >= 0)[:, None, None])[..., None]


@register
class RROIAlign(RoIOp):
    """RROIAlign: ROIAlign over rotated boxes (Ma et al., "Arbitrary-Oriented Scene Text
    Detection via Rotation Proposals", 2018), with a backward.

    Semantics of ``mx.nd.contrib.RROIAlign`` (forward only in MXNet): rois (R, 6) = (batch,
    x_center, y_center, width, height, angle in degrees, counter-clockwise on the image as
    drawn with y down); the box is scaled by ``spatial_scale`` and forced to at least 1x1
    cell; each of its P x Q bins averages gy x gx bilinear samples (``sampling_ratio``, or
    ``ceil(side / pooled)`` when <= 0), rotated about the box centre; samples outside
    [-1, H] x [-1, W] count as 0 and are clamped to the map otherwise (ROIAlign's rule).
    Options beyond MXNet (its behaviour by default): ``aligned`` (Detectron2's
    ROIAlignRotated: centre shifted by -0.5 cell, no 1x1 floor, an empty grid gives 0) and
    ``clockwise`` (mmcv's: the angle negated).  The gradient is the exact gradient of this
    forward in the data (the rois get none).  A padding roi (negative batch index) gives 0;
    MXNet's built-in reads out-of-map samples as ``0 * data[0, 0]`` (NaN when that cell is
    not finite), ours skips them.

    Names and units (MXNet's): the samples per bin side are ``sampling_ratio`` here (as in
    MXNet's RROIAlign, mmcv and Detectron2), where ROIAlign and PSROIAlign say
    ``sample_ratio``; the angle is in **degrees** (MXNet, Detectron2's ROIAlignRotated),
    where mmcv's ``RoIAlignRotated`` takes **radians**: pass ``math.degrees(theta)``.
    """
    name = "RROIAlign"
    param_cls = RROIAlignParam
    cuda_source = "rroi_align.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section): the kernels
    #: read the rois themselves, so the path runs them on rroi_align_safe_rois' checked copy
    native_gpu_kernels = (("rroi_align_safe_rois", ()), ("rroi_align_forward", ()),
                          ("rroi_align_backward", ("A",)))
    gluon_mode = "ralign"
    builtin_order = ("pooled_size", "spatial_scale", "sampling_ratio")  # contrib.RROIAlign
    rois_columns = 6
    rois_layout = "(batch_index, x_center, y_center, width, height, angle_degrees)"
    selftest_cases = (
        dict(pooled_size=(2, 2), spatial_scale=0.5, sampling_ratio=-1),
        dict(pooled_size=(2, 3), spatial_scale=1.0, sampling_ratio=2, aligned=True,
             clockwise=True),
    )
    selftest_builtin_grad = False  # MXNet's RROIAlign has no backward

    @staticmethod
    def selftest_builtin(params, data, rois):
        if params.get("aligned") or params.get("clockwise"):
            return None
        import mxnet as mx
        return mx.nd.contrib.RROIAlign(data, rois, pooled_size=params["pooled_size"],
                                       spatial_scale=params["spatial_scale"],
                                       sampling_ratio=params.get("sampling_ratio", -1))

    @classmethod
    def random_rois(cls, rng, count, images, height, width, spatial_scale):
        s = spatial_scale
        return np.stack([rng.integers(0, images, count),
                         rng.uniform(-1, width + 1, count) / s,
                         rng.uniform(-1, height + 1, count) / s,
                         rng.uniform(0.5, width * 0.7, count) / s,
                         rng.uniform(0.5, height * 0.7, count) / s,
                         rng.uniform(-180, 180, count)], axis=1)

    def check_inputs(self, data_shape, data_dtype, rois, xp, compiled=None):
        super().check_inputs(data_shape, data_dtype, rois, xp, compiled)
        p = self.param
        if rois.shape[0] == 0 or p.sampling_ratio > 0:
            return
        # an adaptive grid grows with the box: refuse boxes that need more samples per bin
        # than a kernel can take in reasonable time (and the int conversion can hold)
        per_bin = geometry.adaptive_samples_per_bin(   # sides (|height|, |width|)
            xp.abs(rois[:, 4:2:-1].astype(np.float64)), p.spatial_scale, p.pooled_size,
            rois.dtype, xp)
        geometry.check_samples_per_bin(self.name, per_bin,
                                       lambda r: (float(rois[r, 3]), float(rois[r, 4])),
                                       "sampling_ratio", xp)

    def geometry(self, rois, height, width, xp):
        return geometry.LazyTables(rois, self.grid, (height, width))

    def grid(self, rois, height, width) -> geometry.RotatedGrid:
        p = self.param
        return geometry.rotated_grid(rois, p.pooled_size, p.spatial_scale, p.sampling_ratio,
                                     p.aligned, p.clockwise, height, width)

    def roofline_work(self, data_shape, rois, itemsize=4) -> dict:
        """Bytes and multiply-adds a forward / backward must spend (mx_roi.bench's bound):
        the distinct cells the live samples tap, 4 taps per sample and channel."""
        N, C, H, W = data_shape
        grid = self.grid(np.asarray(rois, np.float64), H, W)
        live = ((grid.w1 + grid.w2 + grid.w3 + grid.w4) > 0) & \
            (grid.batch >= 0)[:, None, None, None]
        b = np.broadcast_to(np.maximum(grid.batch, 0)[:, None, None, None], live.shape)[live]
        cells = np.unique(np.concatenate([(b * H + ys[live]) * W + xs[live] for ys, xs in (
            (grid.y_low, grid.x_low), (grid.y_low, grid.x_high), (grid.y_high, grid.x_low),
            (grid.y_high, grid.x_high))])).size
        ops = 4.0 * float(live.sum()) * C
        out_bytes = float(rois.shape[0] * C * live.shape[1] * live.shape[2] * itemsize)
        return dict(fwd_bytes=cells * C * itemsize + out_bytes, fwd_ops=ops,
                    bwd_bytes=out_bytes + N * C * H * W * itemsize, bwd_ops=ops)

    def viz_coords(self, rois, height, width, tap_sample=None) -> dict:
        """What :mod:`mx_roi.viz` draws for roi ``rois[0]``, from :meth:`grid`: the box and
        its bins as rotated polygons (x, y), every sample (y, x) of each bin
        (``sample_index`` = (p, q, k, 0), k = iy * gx + ix), and one sample's four taps."""
        p = self.param
        P, Q = p.pooled_size
        grid = self.grid(rois, height, width)
        cy, cx, cos, sin, sh, sw, bh, bw, _, _ = (float(v[0]) if np.ndim(v) else v for v in
                                                  geometry.rotated_boxes(
                                                      rois, p.spatial_scale, p.sampling_ratio,
                                                      p.aligned, p.clockwise, p.pooled_size))

        def corners(y0, y1, x0, x1):  # box frame -> map (x, y), MXNet's rotation
            return np.array([(xx * cos + yy * sin + cx, yy * cos - xx * sin + cy)
                             for yy, xx in ((y0, x0), (y0, x1), (y1, x1), (y1, x0))])

        bins = np.array([corners(sh + i * bh, sh + (i + 1) * bh, sw + j * bw, sw + (j + 1) * bw)
                         for i in range(P) for j in range(Q)])
        count = int(grid.count[0])
        index = [(i, j, k, 0) for i in range(P) for j in range(Q) for k in range(count)]
        samples = np.array([(grid.y[0, i, j, k], grid.x[0, i, j, k]) for i, j, k, _ in index])
        weights = [grid.w1, grid.w2, grid.w3, grid.w4]
        outside = np.array([sum(float(w[0, i, j, k]) for w in weights) == 0
                            for i, j, k, _ in index], dtype=bool)
        out = dict(roi_polygon=corners(sh, -sh, sw, -sw), bin_polygons=bins,
                   samples=samples.reshape(-1, 2),
                   sample_bin=np.array([t[:2] for t in index], np.int64).reshape(-1, 2),
                   sample_index=np.array(index, np.int64).reshape(-1, 4), outside=outside)
        if tap_sample is None and index:
            mid = [t for t in index if t[:2] == (P // 2, Q // 2)]
            tap_sample = mid[0] if mid else index[0]
        out["tap_sample"] = None if tap_sample is None else np.array(tap_sample, np.int64)
        if tap_sample is not None:
            i, j, k = (int(v) for v in tuple(tap_sample)[:3])
            if k >= count:
                raise ValueError(f"tap_sample {tuple(tap_sample)}: bins have {count} samples")
            t = (0, i, j, k)
            out["taps"] = np.array([(grid.y_low[t], grid.x_low[t]), (grid.y_low[t], grid.x_high[t]),
                                    (grid.y_high[t], grid.x_low[t]),
                                    (grid.y_high[t], grid.x_high[t])], np.int64)
            out["tap_weights"] = np.array([w[t] for w in weights])
        return out

    # ---- NumPy -------------------------------------------------------------------------
    def forward_numpy(self, geo, data, keep=True, out=None):
        grid = geo.tables()
        R, P, Q, G = grid.w1.shape
        acc = np.zeros((R, P, Q, data.shape[1]), data.dtype)
        for k in range(G):  # sample by sample: each bin's sum in the kernels' order
            np.add(acc, _bin_values(data, grid, k), out=acc, where=_live(grid, k))
        acc /= grid.divisor[:, None, None, None]
        return np.ascontiguousarray(acc.transpose(0, 3, 1, 2)), None

    def backward_numpy(self, geo, grad, data_shape, saved):
        grid = geo.tables()
        N, C, H, W = data_shape
        R, P, Q, G = grid.w1.shape
        g = (grad / grid.divisor[:, None, None, None]).transpose(0, 2, 3, 1)  # (R, P, Q, C)
        out = np.zeros((N, H * W, C), grad.dtype)
        b = np.maximum(grid.batch, 0)[:, None, None]
        for k in range(G):
            live = _live(grid, k)
            for w, yt, xt in ((grid.w1, grid.y_low, grid.x_low),
                              (grid.w2, grid.y_low, grid.x_high),
                              (grid.w3, grid.y_high, grid.x_low),
                              (grid.w4, grid.y_high, grid.x_high)):
                cell = np.broadcast_to(yt[..., k] * W + xt[..., k], b.shape[:1] + (P, Q))
                contrib = np.where(live, g * w[..., k, None], 0)
                np.add.at(out, (np.broadcast_to(b, cell.shape), cell), contrib)
        return np.ascontiguousarray(out.transpose(0, 2, 1)).reshape(data_shape)

    # ---- CUDA (operators/rroi_align.cu: the kernels derive the samples from the rois) ----
    def _kernel_args(self, geo):
        p = self.param
        return dict(rois=geo.rois, spatial_scale=p.spatial_scale, ratio=p.sampling_ratio,
                    aligned=int(p.aligned), clockwise=int(p.clockwise), P=p.pooled_size[0],
                    Q=p.pooled_size[1])

    def forward_cuda(self, launch, geo, data):
        _, C, H, W = data.shape
        R = geo.rois.shape[0]
        P, Q = self.param.pooled_size
        out = launch.output((R, C, P, Q))
        launch.forward("rroi_align_forward", out.size, data=data, C=C, H=H, W=W, out=out,
                       **self._kernel_args(geo))
        return out, None

    def backward_cuda(self, launch, geo, grad, data_shape, saved):
        _, C, H, W = data_shape
        buf = launch.grad_buffer(data_shape, grad)
        launch.backward("rroi_align_backward", grad.size, grad=grad, C=C, H=H, W=W,
                        bottom=buf, **self._kernel_args(geo))
        return launch.grad_value(buf)


def compiled_grid(op, rois, height, width, kind="emulated-cuda") -> geometry.RotatedGrid:
    """The :class:`~mx_roi.geometry.RotatedGrid` of ``op`` (an :class:`RROIAlign`) filled by
    the compiled geometry (``rroi_align_geometry`` of a host build ``kind``), for the test
    that proves it equal to :func:`mx_roi.geometry.rotated_grid`."""
    from mx_roi.cuda.backend import Launch
    rois = np.ascontiguousarray(rois)
    launch = Launch.on_host(op.cuda_source, kind, rois.dtype)
    R = rois.shape[0]
    P, Q = op.param.pooled_size
    boxes = geometry.rotated_boxes(rois, op.param.spatial_scale, op.param.sampling_ratio,
                                   op.param.aligned, op.param.clockwise, op.param.pooled_size)
    G = int((boxes[-2] * boxes[-1]).max()) if R else 0
    acc = launch.acc
    t = {name: np.zeros((R, P, Q, G), np.int32 if name.endswith(("low", "high")) else acc)
         for name in ("y", "x", "y_low", "y_high", "x_low", "x_high", "w1", "w2", "w3", "w4")}
    head = dict(batch=np.zeros(R, np.int32), count=np.zeros(R, np.int32),
                divisor=np.zeros(R, acc))
    args = {k: v for k, v in op._kernel_args(geometry.LazyTables(rois)).items()}
    launch.forward("rroi_align_geometry", R * P * Q, C=1, H=height, W=width, G=G, **args,
                   **head, **t)
    return geometry.RotatedGrid(head["batch"], head["count"], head["divisor"], t["y"], t["x"],
                                t["y_low"], t["y_high"], t["x_low"], t["x_high"], t["w1"],
                                t["w2"], t["w3"], t["w4"])
