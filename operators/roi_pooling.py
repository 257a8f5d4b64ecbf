"""ROIPooling: max over quantised bins (Fast R-CNN, Girshick 2015); semantics in the class
docstring."""
from __future__ import annotations

import numpy as np

from mx_roi import geometry, kernels_numpy as K
from mx_roi.params import ROIPoolingParam
from mx_roi.registry import RoIOp, register
from mx_roi.cuda.tables import int_bins_max_cells, int_bins_tables
from mx_roi.cuda.compiled_geometry import Spec


@register
class ROIPooling(RoIOp):
    """Max over quantised bins (Fast R-CNN, Girshick 2015): ``mx.nd.ROIPooling``.

    ``data`` (N, C, H, W) and ``rois`` (R, 5) = (batch index, x1, y1, x2, y2) in image
    coordinates, of one dtype (float16, float32 or float64); output (R, C, P, Q) for
    ``pooled_size`` (P, Q).

    The box corners are scaled by ``spatial_scale`` and rounded to whole cells (C
    ``round``: half away from zero; the end corner is inclusive, a reversed box is forced
    to 1 x 1 cell).  Bin ``(p, q)`` covers rows ``floor(p * bin_h)`` to
    ``ceil((p + 1) * bin_h)`` of the box (columns alike), clipped to the map, so
    neighbouring bins overlap by a row or column when the bin size is not an integer.
    Each output is the maximum over its bin's cells; the first maximum in row-major order
    wins and receives the whole gradient.  A bin clipped to nothing is empty: output 0, no
    gradient.

    NaN rule (MXNet's, on every backend): a non-empty bin starts at ``-FLT_MAX`` (also for
    float64 data) and only a strictly greater value replaces it, so NaN never wins, nor
    does ``-inf``; a bin that nothing beat outputs ``-FLT_MAX`` (``-inf`` once stored as
    float16) and passes no gradient.

    Differences from the built-in: a batch index >= N is an error naming the roi (MXNet
    silently gives 0); a negative batch index marks a padding roi (output 0, no
    gradient).  ``deterministic=True`` makes the GPU backward bit-identical run to run.
    """
    name = "ROIPooling"
    param_cls = ROIPoolingParam
    cuda_source = "roi_pooling.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section)
    native_gpu_kernels = (("roi_bins_geometry", ()),
                          ("roi_pooling_forward", ("unsigned char",)),
                          ("roi_pooling_backward_rescan", ("A",)))
    gluon_mode = "pool"
    builtin_order = ("pooled_size", "spatial_scale")                      # mx.sym.ROIPooling
    selftest_cases = (dict(pooled_size=(2, 3), spatial_scale=0.5),)
    backward_needs_data = True

    @staticmethod
    def selftest_builtin(params, data, rois):
        import mxnet as mx
        return mx.nd.ROIPooling(data, rois, pooled_size=params["pooled_size"],
                                spatial_scale=params["spatial_scale"])

    def geometry(self, rois, height, width, xp):
        p = self.param
        return geometry.roi_pooling_bins(rois, p.pooled_size, p.spatial_scale, height, width, xp)

    def geometry_spec(self):
        return Spec("pool_bins", self.param.pooled_size, self.param.spatial_scale)

    def forward_numpy(self, bins, data, keep=True, out=None):
        """Max of every bin and its argmax (``h * W + w`` in the plane, -1 if empty).

        Two-stage max with row-major tie breaking: per row the first column attaining
        the column bin's maximum, then the first row attaining the maximum of those; the
        map is clamped to >= -FLT_MAX with NaN -> -FLT_MAX first (MXNet's NaN rule), and
        a bin whose max is -FLT_MAX has argmax -1.  Returns the (R, C, P, Q) output and, with ``keep``, the (R, P, Q, C) argmax.
        """
        R = bins.batch.shape[0]
        _, C, H, W = data.shape
        P, Q = bins.hstart.shape[1], bins.wstart.shape[1]
        lowest = K.max_init(data.dtype)
        dcl = K.channels_last(data, floor=lowest)            # NaN never wins
        out = np.zeros((R, P, Q, C), dtype=data.dtype)
        arg = np.full((R, P, Q, C), -1, dtype=np.int32) if keep else None
        hlen, wlen = bins.hend - bins.hstart, bins.wend - bins.wstart
        qq, pp = np.arange(Q)[None, :, None], np.arange(P)[:, None, None]
        cc = np.arange(C)[None, None, :]
        # per roi: its window and the window-relative members of every bin, padded to
        # the roi's longest bin by repeating the last member (which changes neither the
        # max nor the first argmax)
        h_lo, h_hi = bins.hstart.min(axis=1), bins.hend.max(axis=1)
        w_lo, w_hi = bins.wstart.min(axis=1), bins.wend.max(axis=1)
        kh_all, kw_all = hlen.max(axis=1), wlen.max(axis=1)
        rows_all = _members(bins.hstart - h_lo[:, None], hlen, max(int(kh_all.max()), 1))
        cols_all = _members(bins.wstart - w_lo[:, None], wlen, max(int(kw_all.max()), 1))
        rows_all = np.minimum(rows_all, np.maximum(h_hi - h_lo - 1, 0)[:, None, None])
        cols_all = np.minimum(cols_all, np.maximum(w_hi - w_lo - 1, 0)[:, None, None])
        any_empty = (hlen <= 0).any(axis=1) | (wlen <= 0).any(axis=1)

        def run(items):
            for r in items:
                kh, kw = int(kh_all[r]), int(kw_all[r])
                if kh <= 0 or kw <= 0:
                    continue
                f = dcl[bins.batch[r], h_lo[r]:h_hi[r], w_lo[r]:w_hi[r]]      # (hh, ww, C)
                rows, cols = rows_all[r, :, :kh], cols_all[r, :, :kw]        # (P, kh), (Q, kw)
                g1 = f[:, cols]                                  # (hh, Q, kw, C)
                m1 = g1.max(axis=2)                              # (hh, Q, C)
                g2 = m1[rows]                                    # (P, kh, Q, C)
                best = g2.max(axis=1)                            # (P, Q, C)
                empty = None
                if any_empty[r]:
                    empty = ((hlen[r] <= 0)[:, None] | (wlen[r] <= 0)[None, :])[:, :, None]
                    best = np.where(empty, 0, best)
                out[r] = best
                if keep:
                    h_win = rows[pp, K.first_equal(g2, best, axis=1)]        # (P, Q, C)
                    # the first column of that row holding the max: (kw, P, Q, C) from g1
                    base = ((h_win * Q + qq) * kw) * C + cc
                    row_vals = g1.reshape(-1)[base + (np.arange(kw) * C)[:, None, None, None]]
                    w_win = cols[qq, K.first_equal(row_vals, best, axis=0)]
                    a = (h_win + h_lo[r]) * W + (w_win + w_lo[r])
                    none = best == lowest                # nothing beat -FLT_MAX
                    arg[r] = np.where(none if empty is None else none | empty, -1, a)

        K.for_chunks(list(np.flatnonzero(bins.batch >= 0)), run)
        return K.channels_first(out), arg

    def backward_numpy(self, bins, grad, data_shape, arg):
        """Each bin's gradient to its argmax, summed per roi over the roi's window."""
        N, C, H, W = data_shape
        gcl = grad.transpose(0, 2, 3, 1)                               # (R, P, Q, C) view
        cc = np.arange(C)
        h_lo, h_hi = bins.hstart.min(axis=1), bins.hend.max(axis=1)
        w_lo, w_hi = bins.wstart.min(axis=1), bins.wend.max(axis=1)

        def run(items, out):
            for r in items:
                if h_hi[r] <= h_lo[r] or w_hi[r] <= w_lo[r]:
                    continue
                win = out[bins.batch[r], h_lo[r]:h_hi[r], w_lo[r]:w_hi[r]]   # (hh, ww, C)
                a = arg[r]
                ok = a >= 0
                local = ((a // W - h_lo[r]) * win.shape[1] + (a % W - w_lo[r])) * C + cc
                win += np.bincount(local[ok], weights=gcl[r][ok],
                                   minlength=win.size).reshape(win.shape)

        items = list(np.flatnonzero(bins.batch >= 0))
        return K.channels_first(K.sum_into((N, H, W, C), grad.dtype, items, run))

    # ---- CUDA (operators/roi_pooling.cu; see mx_roi.cuda.backend) ----------------------
    def forward_cuda(self, launch, bins, data):
        """Max of every integer bin and its bin-relative argmax
        ``(h - hstart) * (wend - wstart) + (w - wstart)``, in the smallest unsigned dtype
        that fits the largest bin (:func:`~mx_roi.cuda.tables.argmax_dtype`; its maximum
        value if the bin has no winner).  The kernel instantiation follows that dtype."""
        _, C, H, W = data.shape
        R, P = bins.hstart.shape
        Q = bins.wstart.shape[1]
        out = launch.output((R, C, P, Q))
        arg, store = launch.argmax((R, C, P, Q), lambda: int_bins_max_cells(bins))
        launch.forward("roi_pooling_forward", out.size, int_bins_tables(bins), data=data,
                       C=C, H=H, W=W, out=out, argmax=arg, store_argmax=int(store))
        return out, (arg if store else None)

    def backward_cuda(self, launch, bins, grad, data_shape, arg):
        """Each bin's gradient to its argmax cell (decoded with the bin's hstart, wstart,
        wend; the kernel instantiation follows the saved argmax's dtype), or, when the
        forward kept no argmax, to the winner found again in ``launch.data``."""
        _, C, H, W = data_shape
        buf = launch.grad_buffer(data_shape, grad)
        if arg is None:
            launch.backward("roi_pooling_backward_rescan", grad.size, int_bins_tables(bins),
                            data=launch.data, grad=grad, C=C, H=H, W=W, bottom=buf)
        else:
            launch.backward("roi_pooling_backward", grad.size, int_bins_tables(bins),
                            grad=grad, argmax=arg, C=C, H=H, W=W, bottom=buf)
        return launch.grad_value(buf)


def _members(start, length, k):
    """(R, P, k) indices start..start+length-1, the last one repeated (length >= 1)."""
    i = np.minimum(np.arange(k)[None, None, :], np.maximum(length[:, :, None] - 1, 0))
    return np.maximum(start[:, :, None] + i, 0)
