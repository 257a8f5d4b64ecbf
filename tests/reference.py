"""Slow, independent scalar references for the four RoI operators.

Written from the operator descriptions (MXNet 1.9.1 built-in semantics), never from
``mx_roi``: this module must not import ``mx_roi``.  Every function loops over rois and
bins in plain Python; the only vectorisation is over channels, which performs the very
same elementwise IEEE operations in the same order for each channel.

Arithmetic happens in a *compute dtype* (float32 for float16/float32 inputs, float64 for
float64 inputs) with NumPy scalars, following the C operation order of MXNet's kernels,
so float32 results match MXNet to the last bit or close to it.  float16 inputs are
computed in float32 and the result is cast back to float16.

Backward functions accumulate the true gradient of the same loops (``weight * grad_out``)
into a zeros array of the compute dtype, in the loop order of the forward.

Each ``*_forward`` returns ``out`` (input dtype); each ``*_backward`` returns
``grad_data`` (input dtype).  The gradient with respect to ``rois`` is always zero.

Max modes (ROIPooling, ROIAlign ``pool_mode='max'``) follow MXNet's ROIPooling loop: a
non-empty bin starts at -FLT_MAX with no argmax, and a value replaces the running max
only if strictly greater -- so NaN, -inf and values <= -FLT_MAX never win, and a bin
nothing beat outputs -FLT_MAX and passes no gradient.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = [
    "compute_dtype", "c_round", "c_trunc",
    "roi_pooling_forward", "roi_pooling_backward",
    "roi_align_forward", "roi_align_backward",
    "psroi_pooling_forward", "psroi_pooling_backward",
    "psroi_align_forward", "psroi_align_backward",
]


FLT_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------- helpers
def compute_dtype(dtype):
    """float64 for float64 inputs, float32 otherwise (float16 and float32)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def c_round(x):
    """C ``round()``: half away from zero, exact (no ``x + 0.5`` rounding error).

    Returns a Python float holding an integer value.
    """
    x = float(x)
    a = abs(x)
    f = math.floor(a)
    r = f + 1.0 if a - f >= 0.5 else float(f)
    return math.copysign(r, x) if r != 0 else 0.0


def c_trunc(x):
    """C ``static_cast<int>(x)``: truncation toward zero."""
    return int(x)


def _size2(pooled_size):
    if isinstance(pooled_size, (tuple, list)):
        if len(pooled_size) == 1:
            return int(pooled_size[0]), int(pooled_size[0])
        return int(pooled_size[0]), int(pooled_size[1])
    return int(pooled_size), int(pooled_size)


def _prepare(data, rois, spatial_scale):
    data = np.asarray(data)
    rois = np.asarray(rois)
    assert data.ndim == 4, data.shape
    assert rois.ndim == 2 and rois.shape[1] == 5, rois.shape
    T = compute_dtype(data.dtype)
    # spatial_scale is a C ``float`` parameter in MXNet.
    scale = T(np.float32(spatial_scale))
    return data.astype(T), rois.astype(T), T, scale


def _batch_index(roi_value):
    """``int roi_batch_ind = rois[n, 0]`` (truncation toward zero)."""
    return c_trunc(roi_value)


# --------------------------------------------------------------------------- ROIPooling
def _roi_pooling_argmax(data, rois, pooled_size, spatial_scale):
    x, r, T, scale = _prepare(data, rois, spatial_scale)
    N, C, H, W = x.shape
    PH, PW = _size2(pooled_size)
    R = r.shape[0]
    out = np.zeros((R, C, PH, PW), T)
    # argmax[n, c, i, j] = flat h * W + w index in the map of batch b, or -1
    argmax = np.full((R, C, PH, PW), -1, np.int64)
    batches = np.full((R,), -1, np.int64)
    for n in range(R):
        b = _batch_index(r[n, 0])
        if b < 0:
            continue
        assert b < N, "batch index out of range"
        batches[n] = b
        start_w = int(c_round(r[n, 1] * scale))
        start_h = int(c_round(r[n, 2] * scale))
        end_w = int(c_round(r[n, 3] * scale))
        end_h = int(c_round(r[n, 4] * scale))
        roi_h = max(end_h - start_h + 1, 1)
        roi_w = max(end_w - start_w + 1, 1)
        bin_h = T(roi_h) / T(PH)
        bin_w = T(roi_w) / T(PW)
        for i in range(PH):
            hstart = int(math.floor(T(i) * bin_h))
            hend = int(math.ceil(T(i + 1) * bin_h))
            hstart = min(max(hstart + start_h, 0), H)
            hend = min(max(hend + start_h, 0), H)
            for j in range(PW):
                wstart = int(math.floor(T(j) * bin_w))
                wend = int(math.ceil(T(j + 1) * bin_w))
                wstart = min(max(wstart + start_w, 0), W)
                wend = min(max(wend + start_w, 0), W)
                if hend <= hstart or wend <= wstart:
                    continue  # empty bin: 0, no gradient
                for c in range(C):
                    best = T(-FLT_MAX)
                    best_idx = -1
                    for h in range(hstart, hend):
                        for w in range(wstart, wend):
                            v = x[b, c, h, w]
                            if v > best:  # strict: first max wins, NaN never
                                best = v
                                best_idx = h * W + w
                    out[n, c, i, j] = best
                    argmax[n, c, i, j] = best_idx
    return out, argmax, batches


def roi_pooling_forward(data, rois, pooled_size, spatial_scale):
    out, _, _ = _roi_pooling_argmax(data, rois, pooled_size, spatial_scale)
    return out.astype(np.asarray(data).dtype)


def roi_pooling_backward(data, rois, grad_out, pooled_size, spatial_scale):
    data = np.asarray(data)
    _, argmax, batches = _roi_pooling_argmax(data, rois, pooled_size, spatial_scale)
    T = compute_dtype(data.dtype)
    g = np.asarray(grad_out).astype(T)
    N, C, H, W = data.shape
    grad = np.zeros((N, C, H * W), T)
    R, _, PH, PW = argmax.shape
    for n in range(R):
        b = batches[n]
        if b < 0:
            continue
        for c in range(C):
            for i in range(PH):
                for j in range(PW):
                    k = argmax[n, c, i, j]
                    if k >= 0:
                        grad[b, c, k] += g[n, c, i, j]
    return grad.reshape(N, C, H, W).astype(data.dtype)


# --------------------------------------------------------------------------- ROIAlign geometry
def _bilinear(y, x, H, W, T):
    """Bilinear taps of one sample: list of (weight, h, w) (4 taps) or [] if outside."""
    if y < -1.0 or y > H or x < -1.0 or x > W:
        return []
    if y <= 0:
        y = T(0)
    if x <= 0:
        x = T(0)
    y_low = c_trunc(y)
    x_low = c_trunc(x)
    if y_low >= H - 1:
        y_low = y_high = H - 1
        y = T(y_low)
    else:
        y_high = y_low + 1
    if x_low >= W - 1:
        x_low = x_high = W - 1
        x = T(x_low)
    else:
        x_high = x_low + 1
    ly = y - T(y_low)
    lx = x - T(x_low)
    hy = T(1) - ly
    hx = T(1) - lx
    return [(hy * hx, y_low, x_low), (hy * lx, y_low, x_high),
            (ly * hx, y_high, x_low), (ly * lx, y_high, x_high)]


def _align_bins(roi, scale, PH, PW, H, W, sample_ratio, aligned, T):
    """Per bin (i, j): (count, [taps of sample 0, taps of sample 1, ...]).

    Samples are in iy-major, ix-minor order; an out-of-map sample has no taps (value 0).
    ``count`` is grid_h * grid_w, or 0 when the grid is empty.
    """
    offset = T(0.5) if aligned else T(0)
    start_w = roi[1] * scale - offset
    start_h = roi[2] * scale - offset
    end_w = roi[3] * scale - offset
    end_h = roi[4] * scale - offset
    roi_w = end_w - start_w
    roi_h = end_h - start_h
    if not aligned:
        roi_w = max(roi_w, T(1))
        roi_h = max(roi_h, T(1))
    bin_h = roi_h / T(PH)
    bin_w = roi_w / T(PW)
    grid_h = int(sample_ratio) if sample_ratio > 0 else int(math.ceil(roi_h / T(PH)))
    grid_w = int(sample_ratio) if sample_ratio > 0 else int(math.ceil(roi_w / T(PW)))
    bins = {}
    for i in range(PH):
        for j in range(PW):
            samples = []
            if grid_h > 0 and grid_w > 0:
                for iy in range(grid_h):
                    y = start_h + T(i) * bin_h + T(iy + 0.5) * bin_h / T(grid_h)
                    for ix in range(grid_w):
                        x = start_w + T(j) * bin_w + T(ix + 0.5) * bin_w / T(grid_w)
                        samples.append(_bilinear(y, x, H, W, T))
                count = grid_h * grid_w
            else:
                count = 0
            bins[i, j] = (count, samples)
    return bins


def _sample_value(plane, taps, T, C):
    """w1*v1 + w2*v2 + w3*v3 + w4*v4 (left to right) for all channels of ``plane``."""
    if not taps:
        return np.zeros((C,), T)
    (w1, h1, x1), (w2, h2, x2), (w3, h3, x3), (w4, h4, x4) = taps
    return ((w1 * plane[:, h1, x1] + w2 * plane[:, h2, x2])
            + w3 * plane[:, h3, x3]) + w4 * plane[:, h4, x4]


# --------------------------------------------------------------------------- ROIAlign
def _roi_align_impl(data, rois, pooled_size, spatial_scale, sample_ratio, aligned, pool_mode,
                    grad_out=None):
    data = np.asarray(data)
    x, r, T, scale = _prepare(data, rois, spatial_scale)
    N, C, H, W = x.shape
    PH, PW = _size2(pooled_size)
    R = r.shape[0]
    out = np.zeros((R, C, PH, PW), T)
    grad = np.zeros((N, C, H, W), T)
    g = None if grad_out is None else np.asarray(grad_out).astype(T)
    if pool_mode not in ("avg", "max"):
        raise ValueError(pool_mode)
    for n in range(R):
        b = _batch_index(r[n, 0])
        if b < 0:
            continue
        assert b < N, "batch index out of range"
        plane = x[b]
        bins = _align_bins(r[n], scale, PH, PW, H, W, int(sample_ratio), bool(aligned), T)
        for (i, j), (count, samples) in bins.items():
            if count == 0 or not samples:
                continue
            if pool_mode == "avg":
                acc = np.zeros((C,), T)
                for taps in samples:
                    acc = acc + _sample_value(plane, taps, T, C)
                out[n, :, i, j] = acc / T(count)
                if g is not None:
                    gb = g[n, :, i, j]
                    for taps in samples:
                        for w, hh, ww in taps:
                            grad[b, :, hh, ww] += gb * w / T(count)
            else:
                best = np.full((C,), -FLT_MAX, T)
                best_k = np.full((C,), -1, np.int64)
                for k, taps in enumerate(samples):
                    v = _sample_value(plane, taps, T, C)
                    better = v > best  # strict: first sample wins ties, NaN never
                    best = np.where(better, v, best)
                    best_k = np.where(better, k, best_k)
                out[n, :, i, j] = best
                if g is not None:
                    gb = g[n, :, i, j]
                    for c in range(C):
                        if best_k[c] < 0:
                            continue
                        for w, hh, ww in samples[best_k[c]]:
                            grad[b, c, hh, ww] += gb[c] * w
    if grad_out is None:
        return out.astype(data.dtype)
    return grad.astype(data.dtype)


def roi_align_forward(data, rois, pooled_size, spatial_scale, sample_ratio=-1, aligned=False,
                      pool_mode="avg"):
    return _roi_align_impl(data, rois, pooled_size, spatial_scale, sample_ratio, aligned,
                           pool_mode)


def roi_align_backward(data, rois, grad_out, pooled_size, spatial_scale, sample_ratio=-1,
                       aligned=False, pool_mode="avg"):
    return _roi_align_impl(data, rois, pooled_size, spatial_scale, sample_ratio, aligned,
                           pool_mode, grad_out=grad_out)


# --------------------------------------------------------------------------- PS helpers
def _group_channel(ctop, i, j, GH, GW, PH, PW):
    """Input channel of output channel ``ctop`` at bin (i, j) on a GH x GW group grid.

    Per axis the R-FCN rule ``floor(i * G / P)`` clipped to ``[0, G - 1]`` (integer
    arithmetic here); with the pooled grid (GH, GW) = (PH, PW) this is
    ``ctop*PH*PW + i*PW + j``, the channel of ``ROIAlign(position_sensitive=True)``.
    """
    gh = min(max((i * GH) // PH, 0), GH - 1)
    gw = min(max((j * GW) // PW, 0), GW - 1)
    return (ctop * GH + gh) * GW + gw


def _groups(pooled_size, group_size):
    """(PH, PW, GH, GW): ``group_size`` 0 means the pooled grid, an int a square grid,
    a pair ``(GH, GW)`` a rectangular one."""
    PH, PW = _size2(pooled_size)
    if isinstance(group_size, (tuple, list)):
        GH, GW = _size2(group_size)
    else:
        GH = GW = int(group_size)
    if GH == 0 and GW == 0:
        GH, GW = PH, PW
    assert GH > 0 and GW > 0, f"bad group_size {group_size!r}"
    return PH, PW, GH, GW


# --------------------------------------------------------------------------- PSROIPooling
def _ps_setup(data, rois, pooled_size, output_dim, spatial_scale, group_size, grad_out):
    """The start of both position-sensitive references: ``(x, r, T, scale, (H, W), (PH, PW,
    GH, GW), O, out, grad, g, live)`` -- the inputs in the compute type, the pooled and
    group grids, output_dim, zeroed output and input gradient, the out-grad (or None) and
    ``live``, the ``(n, b)`` of every non-padding roi and its batch index."""
    x, r, T, scale = _prepare(np.asarray(data), rois, spatial_scale)
    N, Cin, H, W = x.shape
    PH, PW, GH, GW = _groups(pooled_size, group_size)
    O = int(output_dim)
    assert Cin == O * GH * GW, "channels must be output_dim * GH * GW"
    out = np.zeros((r.shape[0], O, PH, PW), T)
    grad = np.zeros((N, Cin, H, W), T)
    g = None if grad_out is None else np.asarray(grad_out).astype(T)
    live = []
    for n in range(r.shape[0]):
        b = _batch_index(r[n, 0])
        if b >= 0:
            assert b < N, "batch index out of range"
            live.append((n, b))
    return x, r, T, scale, (H, W), (PH, PW, GH, GW), O, out, grad, g, live


def _ps_result(data, out, grad, grad_out):
    """The output (forward) or the input gradient (``grad_out`` given) in data's dtype."""
    return (out if grad_out is None else grad).astype(np.asarray(data).dtype)


def _psroi_pooling_impl(data, rois, pooled_size, output_dim, spatial_scale, group_size,
                        grad_out=None):
    x, r, T, scale, (H, W), (PH, PW, GH, GW), O, out, grad, g, live = _ps_setup(
        data, rois, pooled_size, output_dim, spatial_scale, group_size, grad_out)
    for n, b in live:
        # round the RAW coordinate, then scale
        start_w = T(c_round(r[n, 1])) * scale
        start_h = T(c_round(r[n, 2])) * scale
        end_w = T(c_round(r[n, 3]) + 1.0) * scale
        end_h = T(c_round(r[n, 4]) + 1.0) * scale
        roi_w = max(end_w - start_w, T(0.1))
        roi_h = max(end_h - start_h, T(0.1))
        bin_h = roi_h / T(PH)
        bin_w = roi_w / T(PW)
        for i in range(PH):
            hstart = int(math.floor(T(i) * bin_h + start_h))
            hend = int(math.ceil(T(i + 1) * bin_h + start_h))
            hstart = min(max(hstart, 0), H)
            hend = min(max(hend, 0), H)
            for j in range(PW):
                wstart = int(math.floor(T(j) * bin_w + start_w))
                wend = int(math.ceil(T(j + 1) * bin_w + start_w))
                wstart = min(max(wstart, 0), W)
                wend = min(max(wend, 0), W)
                if hend <= hstart or wend <= wstart:
                    continue
                area = T((hend - hstart) * (wend - wstart))
                for ctop in range(O):
                    c = _group_channel(ctop, i, j, GH, GW, PH, PW)
                    if g is None:
                        s = T(0)
                        for h in range(hstart, hend):
                            for w in range(wstart, wend):
                                s = s + x[b, c, h, w]
                        out[n, ctop, i, j] = s / area
                    else:
                        d = g[n, ctop, i, j] / area
                        for h in range(hstart, hend):
                            for w in range(wstart, wend):
                                grad[b, c, h, w] += d
    return _ps_result(data, out, grad, grad_out)


def psroi_pooling_forward(data, rois, pooled_size, output_dim, spatial_scale, group_size=0):
    return _psroi_pooling_impl(data, rois, pooled_size, output_dim, spatial_scale, group_size)


def psroi_pooling_backward(data, rois, grad_out, pooled_size, output_dim, spatial_scale,
                           group_size=0):
    return _psroi_pooling_impl(data, rois, pooled_size, output_dim, spatial_scale, group_size,
                               grad_out=grad_out)


# --------------------------------------------------------------------------- PSROIAlign
def _psroi_align_impl(data, rois, pooled_size, output_dim, spatial_scale, sample_ratio,
                      aligned, group_size, grad_out=None):
    x, r, T, scale, (H, W), (PH, PW, GH, GW), O, out, grad, g, live = _ps_setup(
        data, rois, pooled_size, output_dim, spatial_scale, group_size, grad_out)
    for n, b in live:
        bins = _align_bins(r[n], scale, PH, PW, H, W, int(sample_ratio), bool(aligned), T)
        for (i, j), (count, samples) in bins.items():
            if count == 0 or not samples:
                continue
            chans = [_group_channel(ctop, i, j, GH, GW, PH, PW) for ctop in range(O)]
            plane = x[b][chans]  # (O, H, W): channel ctop reads input channel chans[ctop]
            acc = np.zeros((O,), T)
            for taps in samples:
                acc = acc + _sample_value(plane, taps, T, O)
            out[n, :, i, j] = acc / T(count)
            if g is not None:
                gb = g[n, :, i, j]
                for taps in samples:
                    for w, hh, ww in taps:
                        # distinct ctop -> distinct channels, so fancy-index += is safe
                        grad[b, chans, hh, ww] += gb * w / T(count)
    return _ps_result(data, out, grad, grad_out)


def psroi_align_forward(data, rois, pooled_size, output_dim, spatial_scale, sample_ratio=-1,
                        aligned=False, group_size=0):
    return _psroi_align_impl(data, rois, pooled_size, output_dim, spatial_scale, sample_ratio,
                             aligned, group_size)


def psroi_align_backward(data, rois, grad_out, pooled_size, output_dim, spatial_scale,
                         sample_ratio=-1, aligned=False, group_size=0):
    return _psroi_align_impl(data, rois, pooled_size, output_dim, spatial_scale, sample_ratio,
                             aligned, group_size, grad_out=grad_out)
