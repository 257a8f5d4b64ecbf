"""Slow scalar references of the two legacy kernels, transcribed from their CUDA source.

* :func:`caffe_roi_align_forward` / ``_backward``: ``ROIAlignForward`` of the Caffe
  ``roi_align_layer.cu`` (caffe-faster-rcnn fork; ported to MXNet forks), write-up
  ``shared/seeds/001_9bef3f6470cc461b.txt``.
* :func:`rfcn_psroi_align_forward` / ``_backward``: ``PSROIAlignForward`` (with its
  ``bilinear_interpolate``) of afantideng/R-FCN-PSROIAlign, write-up
  ``shared/seeds/000_5a617c1fac8fb662.txt``.

This module must never import ``mx_roi``.  Each output element is computed as one CUDA
thread would compute it, with NumPy scalars of the kernel's ``Dtype`` (float32 for
float16/float32 inputs, float64 for float64), statement by statement; the only
vectorisation is over channels (the same IEEE operations for every channel).  Quirks are
kept: Caffe's float loop ``h += 1.``, its ``floor``/``ceil`` taps (both of weight 1 on an
integer coordinate), ``-FLT_MAX`` start and strict ``>``; R-FCN's clip to ``[0, H-1]``,
the skipped points and the division by ``sample_num**2``, and even its stale ``val`` when
``bilinear_interpolate`` returns early (unreachable: points lie inside the clipped bin).

The backwards are the *true* gradients of these forwards (the published backwards are
not): Caffe's goes to the in-map taps of the winning point of each bin with their
weights; R-FCN's to every kept point's taps, weight / ``sample_num**2``.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["caffe_roi_align_forward", "caffe_roi_align_backward", "caffe_roi_align_margin",
           "caffe_points", "rfcn_psroi_align_forward", "rfcn_psroi_align_backward"]

FLT_MAX = float(np.finfo(np.float32).max)


def _dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _size2(pooled_size):
    if isinstance(pooled_size, (tuple, list)):
        return (int(pooled_size[0]), int(pooled_size[-1]))
    return int(pooled_size), int(pooled_size)


def _prepare(data, rois, spatial_scale):
    T = _dtype(data.dtype)
    x = np.asarray(data).astype(T)
    r = np.asarray(rois).astype(T)
    s = T(np.float32(spatial_scale))  # a C float parameter, converted to Dtype
    return T, x, r, s


# --------------------------------------------------------------------------- Caffe ROIAlign
def caffe_points(roi, s, ph, pw, H, W, PH, PW, T):
    """The sample points of bin (ph, pw) as the kernel visits them.

    Returns ``(is_empty, [(h, w, taps), ...])`` with ``taps`` the in-map taps in the
    kernel's order (top-left, top-right, bottom-left, bottom-right) as ``(weight, y, x)``.
    """
    roi_start_w = roi[1] * s
    roi_start_h = roi[2] * s
    roi_end_w = roi[3] * s
    roi_end_h = roi[4] * s
    roi_width = roi_end_w - roi_start_w + T(1)
    roi_height = roi_end_h - roi_start_h + T(1)
    bin_size_h = roi_height / T(PH)
    bin_size_w = roi_width / T(PW)
    hstart = T(ph) * bin_size_h
    wstart = T(pw) * bin_size_w
    hend = T(ph + 1) * bin_size_h
    wend = T(pw + 1) * bin_size_w
    # min(max(x + start, 0.), (float)height): exact in any precision, stored back as Dtype
    hstart = T(min(max(hstart + roi_start_h, T(0)), T(H)))
    hend = T(min(max(hend + roi_start_h, T(0)), T(H)))
    wstart = T(min(max(wstart + roi_start_w, T(0)), T(W)))
    wend = T(min(max(wend + roi_start_w, T(0)), T(W)))
    is_empty = bool(hend <= hstart) or bool(wend <= wstart)
    points = []
    h = hstart
    while h < hend:
        w = wstart
        while w < wend:
            x_left = math.floor(w)
            x_right = math.ceil(w)
            y_bottom = math.floor(h)
            y_top = math.ceil(h)
            tl = 0 <= x_left <= W - 1 and 0 <= y_top <= H - 1
            tr = 0 <= x_right <= W - 1 and 0 <= y_top <= H - 1
            bl = 0 <= x_left <= W - 1 and 0 <= y_bottom <= H - 1
            br = 0 <= x_right <= W - 1 and 0 <= y_bottom <= H - 1
            wl = T(1) - w + T(x_left)          # (1 - w + x_left)
            wr = T(1 - x_right) + w            # (1 - x_right + w): int part first
            wt = T(1 - y_top) + h              # (1 - y_top + h)
            wb = T(1) - h + T(y_bottom)        # (1 - h + y_bottom)
            taps = []
            if tl:
                taps.append((wl * wt, y_top, x_left))
            if tr:
                taps.append((wr * wt, y_top, x_right))
            if bl:
                taps.append((wl * wb, y_bottom, x_left))
            if br:
                taps.append((wr * wb, y_bottom, x_right))
            points.append((h, w, taps))
            w = T(w + T(1))                    # w += 1. in Dtype
        h = T(h + T(1))
    return is_empty, points


def _caffe_value(plane, taps, T, C):
    val = np.zeros((C,), T)
    for wt, y, x in taps:
        val = val + wt * plane[:, y, x]        # val += (wx * wy) * v
    return val


def _caffe_impl(data, rois, pooled_size, spatial_scale, grad_out=None):
    T, x, r, s = _prepare(data, rois, spatial_scale)
    N, C, H, W = x.shape
    PH, PW = _size2(pooled_size)
    R = r.shape[0]
    out = np.zeros((R, C, PH, PW), T)
    margin = np.full((R, C, PH, PW), np.inf)
    grad = np.zeros((N, C, H, W), T)
    g = None if grad_out is None else np.asarray(grad_out).astype(T)
    for n in range(R):
        b = int(r[n, 0])
        if b < 0:
            continue
        plane = x[b]
        for ph in range(PH):
            for pw in range(PW):
                is_empty, points = caffe_points(r[n], s, ph, pw, H, W, PH, PW, T)
                maxval = np.full((C,), 0 if is_empty else -FLT_MAX, T)
                arg = np.full((C,), -1)
                second = np.full((C,), -np.inf)
                for k, (_, _, taps) in enumerate(points):
                    val = _caffe_value(plane, taps, T, C)
                    better = val > maxval
                    second = np.where(better, np.maximum(second, maxval.astype(np.float64)),
                                      np.maximum(second, val.astype(np.float64)))
                    maxval = np.where(better, val, maxval)
                    arg = np.where(better, k, arg)
                out[n, :, ph, pw] = maxval
                if len(points) > 1:
                    margin[n, :, ph, pw] = maxval.astype(np.float64) - second
                if g is not None:
                    for c in range(C):
                        if arg[c] < 0:
                            continue
                        for wt, y, xx in points[arg[c]][2]:
                            grad[b, c, y, xx] += wt * g[n, c, ph, pw]
    return out, grad, margin


def caffe_roi_align_forward(data, rois, pooled_size, spatial_scale):
    """(R, C, PH, PW) output of the Caffe ``ROIAlignForward`` kernel (input dtype)."""
    return _caffe_impl(data, rois, pooled_size, spatial_scale)[0].astype(np.asarray(data).dtype)


def caffe_roi_align_backward(data, rois, grad_out, pooled_size, spatial_scale):
    """True gradient of :func:`caffe_roi_align_forward` w.r.t. the data (input dtype)."""
    return _caffe_impl(data, rois, pooled_size, spatial_scale, grad_out)[1].astype(
        np.asarray(data).dtype)


def caffe_roi_align_margin(data, rois, pooled_size, spatial_scale):
    """Per output element, best minus runner-up point value (inf with < 2 points): where
    it is small the max is (nearly) non-differentiable."""
    return _caffe_impl(data, rois, pooled_size, spatial_scale)[2]


# --------------------------------------------------------------------------- R-FCN PSROIAlign
def _rfcn_bilinear(plane, H, W, h, w, val, T):
    """``bilinear_interpolate``: returns the new ``val`` (unchanged when it returns early)
    and the taps ``[(weight, y, x)]`` (w1..w4 order)."""
    if h < -0.5 or h > H - 0.5 or w < -0.5 or w > W - 0.5:
        return val, []
    if h <= 0:
        h = T(0)
    if w <= 0:
        w = T(0)
    h_low = int(h)
    w_low = int(w)
    if w_low >= W - 1:
        w_low = w_high = W - 1
        w = T(w_low)
    else:
        w_high = w_low + 1
    if h_low >= H - 1:
        h_high = h_low = H - 1
        h = T(h_low)
    else:
        h_high = h_low + 1
    l_dh = h - T(h_low)
    l_dw = w - T(w_low)
    h_dh = T(1) - l_dh
    h_dw = T(1) - l_dw
    u1 = plane[:, h_low, w_low]
    u2 = plane[:, h_low, w_high]
    u3 = plane[:, h_high, w_low]
    u4 = plane[:, h_high, w_high]
    w1, w2, w3, w4 = h_dh * h_dw, h_dh * l_dw, l_dh * h_dw, l_dh * l_dw
    val = ((w1 * u1 + w2 * u2) + w3 * u3) + w4 * u4
    taps = [(w1, h_low, w_low), (w2, h_low, w_high), (w3, h_high, w_low), (w4, h_high, w_high)]
    return val, taps


def _rfcn_impl(data, rois, pooled_size, output_dim, spatial_scale, sample_num, group_size=0,
               grad_out=None):
    T, x, r, s = _prepare(data, rois, spatial_scale)
    N, C, H, W = x.shape
    PH, PW = _size2(pooled_size)
    G = int(group_size) or PH
    n_s = int(sample_num)
    R = r.shape[0]
    out = np.zeros((R, output_dim, PH, PW), T)
    grad = np.zeros((N, C, H, W), T)
    g = None if grad_out is None else np.asarray(grad_out).astype(T)
    for n in range(R):
        roi = r[n]
        b = int(roi[0])
        if b < 0:
            continue
        roi_start_w = roi[1] * s
        roi_start_h = roi[2] * s
        roi_end_w = T(roi[3] + T(1)) * s       # static_cast<Dtype>(x2 + 1.) * scale
        roi_end_h = T(roi[4] + T(1)) * s
        roi_width = max(roi_end_w - roi_start_w, T(0.1))
        roi_height = max(roi_end_h - roi_start_h, T(0.1))
        bin_size_h = roi_height / T(PH)
        bin_size_w = roi_width / T(PW)
        for ph in range(PH):
            for pw in range(PW):
                hstart = T(ph) * bin_size_h
                wstart = T(pw) * bin_size_w
                hend = T(ph + 1) * bin_size_h
                wend = T(pw + 1) * bin_size_w
                hstart = min(max(hstart + roi_start_h, T(0)), T(H - 1))
                hend = min(max(hend + roi_start_h, T(0)), T(H - 1))
                wstart = min(max(wstart + roi_start_w, T(0)), T(W - 1))
                wend = min(max(wend + roi_start_w, T(0)), T(W - 1))
                is_empty = bool(hend <= hstart) or bool(wend <= wstart)
                # the R-FCN layer has group_size == pooled_size: gh = ph, gw = pw
                gh = min(ph * G // PH, G - 1)
                gw = min(pw * G // PW, G - 1)
                chans = [(ctop * G + gh) * G + gw for ctop in range(output_dim)]
                plane = x[b][chans]
                sample_h = bin_size_h / T(n_s + 1)
                sample_w = bin_size_w / T(n_s + 1)
                val = np.zeros((output_dim,), T)
                out_sum = np.zeros((output_dim,), T)
                kept = []
                for i in range(1, n_s + 1):
                    for j in range(1, n_s + 1):
                        cur_h = hstart + T(i) * sample_h
                        cur_w = wstart + T(j) * sample_w
                        if cur_h >= hend or cur_w >= wend:
                            continue
                        val, taps = _rfcn_bilinear(plane, H, W, cur_h, cur_w, val, T)
                        out_sum = out_sum + val
                        kept.append(taps)
                div = T(n_s * n_s)
                out[n, :, ph, pw] = 0 if is_empty else out_sum / div
                if g is not None and not is_empty:
                    gb = g[n, :, ph, pw] / div
                    for taps in kept:
                        for wt, y, xx in taps:
                            grad[b, chans, y, xx] += wt * gb
    return out, grad


def rfcn_psroi_align_forward(data, rois, pooled_size, output_dim, spatial_scale, sample_num,
                             group_size=0):
    """(R, output_dim, PH, PW) output of R-FCN-PSROIAlign's ``PSROIAlignForward``."""
    return _rfcn_impl(data, rois, pooled_size, output_dim, spatial_scale, sample_num,
                      group_size)[0].astype(np.asarray(data).dtype)


def rfcn_psroi_align_backward(data, rois, grad_out, pooled_size, output_dim, spatial_scale,
                              sample_num, group_size=0):
    """True gradient of :func:`rfcn_psroi_align_forward` w.r.t. the data."""
    return _rfcn_impl(data, rois, pooled_size, output_dim, spatial_scale, sample_num,
                      group_size, grad_out)[1].astype(np.asarray(data).dtype)
