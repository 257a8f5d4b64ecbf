"""ROIPooling: max over quantised bins (Fast R-CNN, Girshick 2015).

Semantics of ``mx.nd.ROIPooling``: box corners scaled and C-rounded (half away from
zero), end inclusive, ``floor``/``ceil`` bins clipped to the map, an empty bin gives 0,
the first maximum in row-major order wins and receives the whole gradient.
Differences from the built-in: a batch index >= N is an error (MXNet silently gives 0),
a negative batch index marks a padding roi (output 0, no gradient).
"""
from __future__ import annotations

import numpy as np

from mx_roi import geometry
from mx_roi.params import ROIPoolingParam
from mx_roi.registry import RoIOp, register
from mx_roi.cuda.tables import int_bins_args


@register
class ROIPooling(RoIOp):
    name = "ROIPooling"
    param_cls = ROIPoolingParam
    cuda_source = "roi_pooling.cu"
    backward_needs_data = True

    def geometry(self, rois, height, width, xp):
        p = self.param
        return geometry.roi_pooling_bins(rois, p.pooled_size, p.spatial_scale, height, width, xp)

    def forward_numpy(self, bins, data):
        """Max of every bin and its argmax (``h * W + w`` in the plane, -1 if empty).

        Two-stage max with row-major tie breaking: per row the first column attaining
        the bin's column maximum, then the first row attaining the maximum of those.
        """
        R = bins.batch.shape[0]
        _, C, H, W = data.shape
        P, Q = bins.hstart.shape[1], bins.wstart.shape[1]
        out = np.zeros((R, C, P, Q), dtype=data.dtype)
        arg = np.full((R, C, P, Q), -1, dtype=np.int64)
        hlen = bins.hend - bins.hstart
        wlen = bins.wend - bins.wstart
        for r in range(R):
            b = bins.batch[r]
            if b < 0:
                continue
            kh, kw = int(hlen[r].max()), int(wlen[r].max())
            if kh <= 0 or kw <= 0:
                continue
            h_lo, h_hi = int(bins.hstart[r].min()), int(bins.hend[r].max())
            w_lo, w_hi = int(bins.wstart[r].min()), int(bins.wend[r].max())
            f = data[b, :, h_lo:h_hi, w_lo:w_hi]                        # (C, h, w)
            # stage 1: per row, max over each column bin -> (C, h, Q)
            cols = bins.wstart[r][:, None] - w_lo + np.arange(kw)[None, :]  # (Q, kw)
            col_ok = np.arange(kw)[None, :] < wlen[r][:, None]
            v1 = np.where(col_ok, f[:, :, np.minimum(cols, f.shape[2] - 1)], -np.inf)
            a1 = v1.argmax(axis=3)                                       # (C, h, Q)
            m1 = np.take_along_axis(v1, a1[..., None], axis=3)[..., 0]
            # stage 2: over each row bin -> (C, P, Q)
            rows = bins.hstart[r][:, None] - h_lo + np.arange(kh)[None, :]  # (P, kh)
            row_ok = np.arange(kh)[None, :] < hlen[r][:, None]
            rows_c = np.minimum(rows, f.shape[1] - 1)
            v2 = np.where(row_ok[None, :, :, None], m1[:, rows_c, :], -np.inf)  # (C,P,kh,Q)
            a2 = v2.argmax(axis=2)                                       # (C, P, Q)
            best = np.take_along_axis(v2, a2[:, :, None, :], axis=2)[:, :, 0, :]
            h_win = np.take_along_axis(np.broadcast_to(rows_c[None, :, :, None], v2.shape),
                                       a2[:, :, None, :], axis=2)[:, :, 0, :]
            w_col = np.take_along_axis(a1[:, rows_c, :], a2[:, :, None, :], axis=2)[:, :, 0, :]
            w_win = cols[np.arange(Q)[None, None, :], w_col]
            empty = ((hlen[r] <= 0)[:, None] | (wlen[r] <= 0)[None, :])[None]
            out[r] = np.where(empty, 0, best)
            arg[r] = np.where(empty, -1, (h_win + h_lo) * W + (w_win + w_lo))
        return out, arg

    def backward_numpy(self, bins, grad, data_shape, arg):
        """Each bin's gradient to its argmax, summed over rois in a fixed order."""
        N, C, H, W = data_shape
        R = bins.batch.shape[0]
        ok = (arg >= 0) & (bins.batch >= 0)[:, None, None, None]
        plane = (bins.batch[:, None].astype(np.int64) * C + np.arange(C)[None, :]) * (H * W)
        idx = (plane[:, :, None, None] + arg)[ok]
        total = np.bincount(idx, weights=grad[ok].astype(np.float64), minlength=N * C * H * W)
        del R
        return total.reshape(data_shape).astype(grad.dtype)

    # ---- CUDA (operators/roi_pooling.cu; see mx_roi.cuda.backend) ----------------------
    def forward_cuda(self, launch, bins, data):
        """Max of every integer bin and its argmax ``h * W + w`` (int32, -1 if empty)."""
        L = launch
        data = L.elements(data)
        _, C, H, W = data.shape
        R, P = bins.hstart.shape
        Q = bins.wstart.shape[1]
        out = L.empty((R, C, P, Q))
        arg = L.empty((R, C, P, Q), np.int32)
        n = out.size
        (batch,), edges = int_bins_args(L, bins)
        L.forward("roi_pooling_forward", n, data, batch, *edges,
                  *[L.i32(v) for v in (C, H, W, P, Q)], out, arg, L.i64(n))
        return out, arg

    def backward_cuda(self, launch, bins, grad, data_shape, arg):
        L = launch
        grad = L.elements(grad)
        _, C, H, W = data_shape
        R, P = bins.hstart.shape
        Q = bins.wstart.shape[1]
        n = grad.size
        (batch,), _ = int_bins_args(L, bins)
        buf = L.grad_buffer(data_shape, grad)
        L.backward("roi_pooling_backward", n, grad, batch,
                   L.xp.ascontiguousarray(arg, dtype=np.int32),
                   *[L.i32(v) for v in (C, H, W, P, Q)], buf, L.scale, L.i64(n))
        return L.grad_value(buf)
