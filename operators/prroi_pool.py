"""PrRoIPool: precise RoI pooling (IoU-Net); semantics in the class docstring."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from mx_roi import geometry
from mx_roi.params import ParamBase, param_field, parse_bool, pooled_size_field, \
    spatial_scale_field
from mx_roi.registry import RoIOp, register


@dataclass(frozen=True)
class PrRoIPoolParam(ParamBase):
    """Parameters of ``PrRoIPool`` (mmcv's ``output_size`` is ``pooled_size``)."""

    op_name = "PrRoIPool"
    pooled_size: Tuple[int, int] = pooled_size_field()
    spatial_scale: float = spatial_scale_field()
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")


def _dense(axis, length, values="weight"):
    """An axis' per-node values as a dense (R, P, length) matrix (0 off the bin)."""
    R, P, K = axis.weight.shape
    out = np.zeros((R, P, length + 1), axis.weight.dtype)   # column ``length``: padding
    node = axis.start[..., None] + np.arange(K, dtype=np.int32)
    node = np.where(np.arange(K) < axis.count[..., None], node, length)
    np.put_along_axis(out, node, getattr(axis, values), axis=2)
    return out[..., :length]


def _form(my, data, mx_, batch):
    """``sum_ij my[r, p, i] * data[b_r, c, i, j] * mx[r, q, j]``: (R, C, P, Q)."""
    R, P, H = my.shape
    out = np.zeros((R, data.shape[1], P, mx_.shape[1]), data.dtype)
    for b in np.unique(batch[batch >= 0]):
        sel = np.flatnonzero(batch == b)
        t = np.einsum("rph,chw->rcpw", my[sel], data[b])
        out[sel] = np.einsum("rcpw,rqw->rcpq", t, mx_[sel])
    return out


@register
class PrRoIPool(RoIOp):
    """PrRoIPool: precise RoI pooling (Jiang et al., "Acquisition of Localization Confidence
    for Accurate Object Detection", ECCV 2018 -- IoU-Net), mmcv's ``PrRoIPool``.

    Each bin is the exact integral of the bilinear interpolation surface of the map over
    the bin, divided by the bin's area: no sampling, no quantisation, and the output is
    differentiable in the box coordinates.  Coordinates as in the original implementation
    and mmcv: rois (R, 5) = (batch, x1, y1, x2, y2), the box scaled by ``spatial_scale``
    with no half-pixel offset, a reversed box has size 0; the surface takes the map's
    values at integer nodes and 0 beyond the map; a bin of zero area gives 0 (and no
    gradient).  Gradients: the data and the rois (columns x1, y1, x2, y2; the batch index
    gets 0); a padding roi (negative batch index) gives 0 and no gradient.
    """
    name = "PrRoIPool"
    param_cls = PrRoIPoolParam
    cuda_source = "prroi_pool.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section): the kernels
    #: read the rois themselves, so the path runs them on roi_safe_copy's checked copy
    native_gpu_kernels = (("roi_safe_copy", ()), ("prroi_pool_forward", ()),
                          ("prroi_pool_rois_backward", ()), ("prroi_pool_backward", ("A",)))
    gluon_mode = "prpool"
    builtin_order = ("pooled_size", "spatial_scale")   # mmcv's PrRoIPool(output_size, scale)
    differentiates_rois = True
    selftest_cases = (dict(pooled_size=(2, 2), spatial_scale=0.5),
                      dict(pooled_size=(3, 2), spatial_scale=1.0))

    def geometry(self, rois, height, width, xp):
        return geometry.LazyTables(rois, self.bins, (height, width))

    def bins(self, rois, height, width) -> geometry.PreciseBins:
        p = self.param
        return geometry.precise_bins(rois, p.pooled_size, p.spatial_scale, height, width)

    def roofline_work(self, data_shape, rois, itemsize=4) -> dict:
        """Bytes and multiply-adds (mx_roi.bench's bound): the cells the bins cover, one
        multiply-add per covered node and channel (forward and data gradient)."""
        N, C, H, W = data_shape
        bins = self.geometry(np.asarray(rois, np.float64), H, W, np).tables()
        live = (bins.batch >= 0) & (bins.area > 0)
        ny, nx = bins.y.count[live].astype(np.float64), bins.x.count[live].astype(np.float64)
        ops = float((ny.sum(axis=1) * nx.sum(axis=1)).sum()) * C
        cells = 0
        for b in range(N):
            sel = live & (bins.batch == b)
            if sel.any():
                rows = _dense(bins.y, H)[sel].any(axis=1)        # (Rb, H)
                cols = _dense(bins.x, W)[sel].any(axis=1)
                cells += int((rows[:, :, None] & cols[:, None, :]).any(axis=0).sum())
        P, Q = self.param.pooled_size
        out_bytes = float(rois.shape[0] * C * P * Q * itemsize)
        return dict(fwd_bytes=cells * C * itemsize + out_bytes, fwd_ops=ops,
                    bwd_bytes=out_bytes + N * C * H * W * itemsize, bwd_ops=ops)

    def viz_coords(self, rois, height, width, tap_sample=None) -> dict:
        """What :mod:`mx_roi.viz` draws for roi ``rois[0]``, from the NumPy tables: the box
        and its bins' windows (x, y corners; the surface's nodes at integer coordinates),
        and for bin ``tap_sample[:2]`` (default the middle one) the weight of each map node
        in its output, ``wy_i * wx_j / area``."""
        bins = self.geometry(rois, height, width, np).tables()
        P, Q = self.param.pooled_size
        s = float(np.float32(self.param.spatial_scale))
        x1, y1 = float(rois[0, 1]) * s, float(rois[0, 2]) * s
        bh, bw = (float(v) for v in bins.bin_size[0])

        def rect(ya, yb, xa, xb):
            return np.array([(xa, ya), (xb, ya), (xb, yb), (xa, yb)])

        polys = np.array([rect(y1 + i * bh, y1 + (i + 1) * bh, x1 + j * bw, x1 + (j + 1) * bw)
                          for i in range(P) for j in range(Q)])
        i, j = (int(v) for v in (tuple(tap_sample)[:2] if tap_sample is not None
                                 else (P // 2, Q // 2)))
        area = float(bins.area[0])
        ny, nx = int(bins.y.count[0, i]), int(bins.x.count[0, j])
        nodes, weights = [], []
        for a in range(ny):
            for b in range(nx):
                w = float(bins.y.weight[0, i, a]) * float(bins.x.weight[0, j, b])
                if w > 0 and area > 0:
                    nodes.append((int(bins.y.start[0, i]) + a, int(bins.x.start[0, j]) + b))
                    weights.append(w / area)
        return dict(roi_polygon=rect(y1, y1 + P * bh, x1, x1 + Q * bw), bin_polygons=polys,
                    node_bin=np.array([i, j], np.int64),
                    nodes=np.array(nodes, np.int64).reshape(-1, 2),
                    node_weights=np.array(weights))

    # ---- NumPy -------------------------------------------------------------------------
    def _norm(self, bins):
        """1 / area per roi, 0 for a bin of zero area and a padding roi: (R, 1, 1, 1)."""
        live = (bins.area > 0) & (bins.batch >= 0)
        return np.where(live, 1 / np.where(live, bins.area, 1), 0)[:, None, None, None]

    def forward_numpy(self, geo, data, keep=True, out=None):
        bins = geo.tables()
        H, W = data.shape[2:]
        res = _form(_dense(bins.y, H), data, _dense(bins.x, W), bins.batch) * self._norm(bins)
        return res.astype(data.dtype, copy=False), None

    def backward_numpy(self, geo, grad, data_shape, saved):
        bins = geo.tables()
        N, C, H, W = data_shape
        g = grad * self._norm(bins)
        my, mx_ = _dense(bins.y, H), _dense(bins.x, W)
        out = np.zeros(data_shape, grad.dtype)
        for b in np.unique(bins.batch[bins.batch >= 0]):
            sel = np.flatnonzero(bins.batch == b)
            t = np.einsum("rcpq,rqw->rcpw", g[sel], mx_[sel])
            out[b] += np.einsum("rph,rcpw->chw", my[sel], t)
        return out

    def rois_backward_numpy(self, geo, grad, data, rois):
        bins = geo.tables()
        H, W = data.shape[2:]
        P, Q = self.param.pooled_size
        cdt = grad.dtype
        norm = self._norm(bins)
        my, mx_ = _dense(bins.y, H), _dense(bins.x, W)
        # I and the edge integrals of every bin (R, C, P, Q), each over the bin's area
        o = _form(my, data, mx_, bins.batch) * norm
        ey1, ey2 = (_form(_dense(bins.y, H, e), data, mx_, bins.batch) * norm
                    for e in ("edge_lo", "edge_hi"))
        ex1, ex2 = (_form(my, data, _dense(bins.x, W, e), bins.batch) * norm
                    for e in ("edge_lo", "edge_hi"))
        bh, bw = bins.bin_size[:, 0], bins.bin_size[:, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            ay = np.where(norm[:, 0, 0, 0] > 0, 1 / (P * bh), 0)[:, None, None, None]
            ax = np.where(norm[:, 0, 0, 0] > 0, 1 / (Q * bw), 0)[:, None, None, None]
        fp = (np.arange(P, dtype=cdt) / cdt.type(P))[None, None, :, None]
        fp1 = (np.arange(1, P + 1, dtype=cdt) / cdt.type(P))[None, None, :, None]
        fq = (np.arange(Q, dtype=cdt) / cdt.type(Q))[None, None, None, :]
        fq1 = (np.arange(1, Q + 1, dtype=cdt) / cdt.type(Q))[None, None, None, :]
        d_ys = -ey1 * (1 - fp) + ey2 * (1 - fp1) + o * ay
        d_ye = -ey1 * fp + ey2 * fp1 - o * ay
        d_xs = -ex1 * (1 - fq) + ex2 * (1 - fq1) + o * ax
        d_xe = -ex1 * fq + ex2 * fq1 - o * ax
        s = cdt.type(np.float32(self.param.spatial_scale))
        out = np.zeros(rois.shape, cdt)
        for col, d in ((1, d_xs), (2, d_ys), (3, d_xe), (4, d_ye)):
            out[:, col] = (grad * d).sum(axis=(1, 2, 3)) * s
        return out

    # ---- CUDA (operators/prroi_pool.cu: the kernels derive the bins from the rois) -------
    def _args(self, geo):
        P, Q = self.param.pooled_size
        return dict(rois=geo.rois, spatial_scale=self.param.spatial_scale, P=P, Q=Q)

    def forward_cuda(self, launch, geo, data):
        _, C, H, W = data.shape
        P, Q = self.param.pooled_size
        out = launch.output((geo.rois.shape[0], C, P, Q))
        launch.forward("prroi_pool_forward", out.size, data=data, C=C, H=H, W=W, out=out,
                       **self._args(geo))
        return out, None

    def backward_cuda(self, launch, geo, grad, data_shape, saved):
        _, C, H, W = data_shape
        buf = launch.grad_buffer(data_shape, grad)
        launch.backward("prroi_pool_backward", grad.size, grad=grad, C=C, H=H, W=W,
                        bottom=buf, **self._args(geo))
        return launch.grad_value(buf)

    def rois_backward_cuda(self, launch, geo, grad, data, rois):
        _, C, H, W = data.shape
        R = rois.shape[0]
        out = launch.empty((R, 5), launch.acc)
        out.fill(0)
        launch.forward("prroi_pool_rois_backward", R, grad=grad, data=data, channels=C, H=H,
                       W=W, C=R, rois_grad=out, **self._args(geo))
        return out


def compiled_bins(op, rois, height, width, kind="emulated-cuda") -> geometry.PreciseBins:
    """The :class:`~mx_roi.geometry.PreciseBins` of ``op`` (a :class:`PrRoIPool`) filled by
    the compiled geometry (``prroi_pool_geometry`` of a host build ``kind``), for the test
    that proves it equal to :func:`mx_roi.geometry.precise_bins`."""
    from mx_roi.cuda.backend import Launch
    rois = np.ascontiguousarray(rois)
    launch = Launch.on_host(op.cuda_source, kind, rois.dtype)
    R = rois.shape[0]
    P, Q = op.param.pooled_size
    want = geometry.precise_bins(rois, (P, Q), op.param.spatial_scale, height, width)
    Ky, Kx = want.y.weight.shape[2], want.x.weight.shape[2]  # (the padding width only)
    acc = launch.acc
    t = dict(batch=np.zeros(R, np.int32), area=np.zeros(R, acc),
             bin_size=np.zeros((R, 2), acc))
    for a, n, K in (("y", P, Ky), ("x", Q, Kx)):
        t.update({f"{a}_start": np.zeros((R, n), np.int32),
                  f"{a}_count": np.zeros((R, n), np.int32)})
        t.update({f"{a}_{k}": np.zeros((R, n, K), acc)
                  for k in ("weight", "edge_lo", "edge_hi")})
    launch.forward("prroi_pool_geometry", R, C=R, H=height, W=width, Ky=Ky, Kx=Kx,
                   **op._args(geometry.LazyTables(rois)), **t)
    axes = [geometry.IntegralAxis(t[f"{a}_start"], t[f"{a}_count"], t[f"{a}_weight"],
                                  t[f"{a}_edge_lo"], t[f"{a}_edge_hi"]) for a in "yx"]
    return geometry.PreciseBins(t["batch"], t["area"], t["bin_size"], *axes)
