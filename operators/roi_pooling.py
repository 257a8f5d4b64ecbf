"""ROIPooling: max over quantised bins (Fast R-CNN, Girshick 2015).

Semantics of ``mx.nd.ROIPooling``: box corners scaled and C-rounded (half away from
zero), end inclusive, ``floor``/``ceil`` bins clipped to the map, an empty bin gives 0,
the first maximum in row-major order wins and receives the whole gradient.
Differences from the built-in: a batch index >= N is an error (MXNet silently gives 0),
a negative batch index marks a padding roi (output 0, no gradient).
"""
from __future__ import annotations

import numpy as np

from mx_roi import geometry, kernels_numpy as K
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

    def forward_numpy(self, bins, data, keep=True, out=None):
        """Max of every bin and its argmax (``h * W + w`` in the plane, -1 if empty).

        Two-stage max with row-major tie breaking: per row the first column attaining
        the column bin's maximum, then the first row attaining the maximum of those.
        Returns the (R, C, P, Q) output and, with ``keep``, the (R, P, Q, C) argmax.
        """
        R = bins.batch.shape[0]
        _, C, H, W = data.shape
        P, Q = bins.hstart.shape[1], bins.wstart.shape[1]
        dcl = K.channels_last(data)
        out = np.zeros((R, P, Q, C), dtype=data.dtype)
        arg = np.full((R, P, Q, C), -1, dtype=np.int32) if keep else None
        hlen, wlen = bins.hend - bins.hstart, bins.wend - bins.wstart
        qq, pp = np.arange(Q)[None, :, None], np.arange(P)[:, None, None]
        cc = np.arange(C)[None, None, :]

        def run(items):
            for r in items:
                kh, kw = int(hlen[r].max()), int(wlen[r].max())
                if kh <= 0 or kw <= 0:
                    continue
                h_lo, h_hi = int(bins.hstart[r].min()), int(bins.hend[r].max())
                w_lo, w_hi = int(bins.wstart[r].min()), int(bins.wend[r].max())
                f = dcl[bins.batch[r], h_lo:h_hi, w_lo:w_hi]                  # (hh, ww, C)
                # padded bin members; a short bin repeats its last member, which changes
                # neither the max nor the first argmax
                cols = _members(bins.wstart[r] - w_lo, wlen[r], kw, w_hi - w_lo)  # (Q, kw)
                rows = _members(bins.hstart[r] - h_lo, hlen[r], kh, h_hi - h_lo)  # (P, kh)
                g1 = f[:, cols]                                  # (hh, Q, kw, C)
                m1 = g1.max(axis=2)                              # (hh, Q, C)
                g2 = m1[rows]                                    # (P, kh, Q, C)
                best = g2.max(axis=1)                            # (P, Q, C)
                empty = ((hlen[r] <= 0)[:, None] | (wlen[r] <= 0)[None, :])[:, :, None]
                out[r] = np.where(empty, 0, best)
                if keep:
                    h_win = rows[pp, K.first_equal(g2, best, axis=1)]        # (P, Q, C)
                    # the first column of that row holding the max: kw flat gathers from g1
                    flat, base = g1.reshape(-1), ((h_win * Q + qq) * kw) * C + cc
                    col = np.zeros(best.shape, dtype=np.int32)
                    for i in range(kw - 1, -1, -1):
                        np.copyto(col, i, where=flat[base + i * C] == best)
                    w_win = cols[qq, col]
                    arg[r] = np.where(empty, -1, (h_win + h_lo) * W + (w_win + w_lo))

        K.for_chunks(list(np.flatnonzero(bins.batch >= 0)), run)
        return K.channels_first(out), arg

    def backward_numpy(self, bins, grad, data_shape, arg):
        """Each bin's gradient to its argmax, summed per roi over the roi's window."""
        N, C, H, W = data_shape
        gcl = grad.transpose(0, 2, 3, 1)                               # (R, P, Q, C) view
        cc = np.arange(C)

        def run(items, out):
            for r in items:
                b = bins.batch[r]
                h_lo, h_hi = int(bins.hstart[r].min()), int(bins.hend[r].max())
                w_lo, w_hi = int(bins.wstart[r].min()), int(bins.wend[r].max())
                if h_hi <= h_lo or w_hi <= w_lo:
                    continue
                a = arg[r]
                ok = a >= 0
                ww = w_hi - w_lo
                local = ((a // W - h_lo) * ww + (a % W - w_lo)) * C + cc
                acc = np.bincount(local[ok], weights=gcl[r][ok],
                                  minlength=(h_hi - h_lo) * ww * C)
                out[b, h_lo:h_hi, w_lo:w_hi] += acc.reshape(h_hi - h_lo, ww, C)

        items = list(np.flatnonzero(bins.batch >= 0))
        return K.channels_first(K.sum_into((N, H, W, C), grad.dtype, items, run))

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


def _members(start, length, k, limit):
    """(P, k) indices start..start+length-1, the last repeated; clipped to [0, limit-1]."""
    i = np.minimum(np.arange(k)[None, :], np.maximum(length[:, None] - 1, 0))
    return np.clip(start[:, None] + i, 0, limit - 1)
