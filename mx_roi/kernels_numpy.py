"""NumPy kernels shared by the ops: they consume the tables of :mod:`mx_roi.geometry`.

Bilinear average pooling is separable: for one roi the pooled map of every channel is
``Ay @ F @ Ax.T`` with small interpolation matrices ``Ay`` (P, H) and ``Ax`` (Q, W)
holding each bin's summed tap weights, so a roi costs two small BLAS products over its
window of the map; the backward is the transpose, added into the window.  Max modes
evaluate every sample point exactly as the scalar kernels do (same operation order, so
ties break the same way) and route the gradient to the four taps of the winning sample.
"""
from __future__ import annotations

import numpy as np

from .geometry import SampleAxis, SampleGrid

__all__ = ["tap_matrix", "window", "separable", "indicator_matrix", "avg_forward", "avg_backward", "sample_values",
           "max_forward", "max_backward", "scatter_taps"]


def tap_matrix(axis: SampleAxis, length: int, per_sample: bool = False) -> np.ndarray:
    """Dense tap weights of one axis.

    Returns (R, P, length) summed over each bin's samples, or with ``per_sample``
    (R, P, G, length) with one row per sample point.
    """
    R, P, G = axis.low.shape
    rows = R * P * G if per_sample else R * P
    base = np.arange(rows, dtype=np.int64).reshape((R, P, G) if per_sample else (R, P, 1))
    base = np.broadcast_to(base, (R, P, G)) * length
    idx = np.concatenate([(base + axis.low).ravel(), (base + axis.high).ravel()])
    w = np.concatenate([axis.w_low.ravel(), axis.w_high.ravel()])
    m = np.bincount(idx, weights=w, minlength=rows * length).astype(axis.w_low.dtype)
    return m.reshape((R, P, G, length) if per_sample else (R, P, length))


def window(mat: np.ndarray):
    """Per roi, the [start, stop) range of map positions with a non-zero weight.

    ``mat`` is (R, ..., L); returns two (R,) int arrays (empty range -> 0, 0).
    """
    used = (mat != 0).reshape(mat.shape[0], -1, mat.shape[-1]).any(axis=1)
    any_used = used.any(axis=1)
    first = np.where(any_used, used.argmax(axis=1), 0)
    last = np.where(any_used, mat.shape[-1] - used[:, ::-1].argmax(axis=1), 0)
    return first, last


def _channel_rows(data_b, channels):
    return data_b if channels is None else data_b[channels]


def separable(geo: SampleGrid, height: int, width: int):
    """The (batch, ay (R,P,H), ax (R,Q,W), divisor (R,P,Q)) form of a sample grid."""
    return geo.batch, tap_matrix(geo.y, height), tap_matrix(geo.x, width), geo.divisor


def indicator_matrix(start, end, length: int) -> np.ndarray:
    """(R, P, length) with 1 where ``start[r,p] <= i < end[r,p]`` (integer bins)."""
    i = np.arange(length)[None, None, :]
    return ((i >= start[:, :, None]) & (i < end[:, :, None]))


def avg_forward(sep, data: np.ndarray, out_channels: int, channel_map=None):
    """Weighted average of each bin, separable in y and x.

    Parameters
    ----------
    sep : (batch (R,), ay (R, P, H), ax (R, Q, W), divisor (R, P, Q))
        see :func:`separable`; integer bins use 0/1 matrices
    data : (N, C, H, W) in the compute dtype
    out_channels : int
    channel_map : None, or (C_out, P, Q) int array of the input channel each output
        bin reads (position-sensitive ops)

    Returns
    -------
    (R, C_out, P, Q) array
    """
    batch, ay, ax, divisor = sep
    R, P, _ = ay.shape
    Q = ax.shape[1]
    ay, ax = ay.astype(data.dtype, copy=False), ax.astype(data.dtype, copy=False)
    h0, h1 = window(ay)
    w0, w1 = window(ax)
    out = np.zeros((R, out_channels, P, Q), dtype=data.dtype)
    for r in range(R):
        b = batch[r]
        if b < 0 or h1[r] <= h0[r] or w1[r] <= w0[r]:
            continue
        sy, sx = slice(h0[r], h1[r]), slice(w0[r], w1[r])
        f = data[b, :, sy, sx]
        if channel_map is None:
            # (C, h, w) @ (w, Q) -> (C, h, Q);  (P, h) @ (C, h, Q) -> (C, P, Q)
            out[r] = ay[r, :, sy] @ (f @ ax[r, :, sx].T)
        else:
            out[r] = _ps_bins(f, channel_map, ay[r, :, sy], ax[r, :, sx])
    out /= divisor[:, None, :, :].astype(data.dtype, copy=False)
    return out


def _ps_bins(f, channel_map, ay, ax):
    """Position-sensitive bins: output (c, p, q) reads input channel channel_map[c, p, q]."""
    C, P, Q = channel_map.shape
    # rows: sum_h ay[p,h] f[ch,h,w] for the channel each (c,p,q) reads -> (C, P, Q, w)
    fsel = f[channel_map]                       # (C, P, Q, h, w)
    rows = np.einsum("ph,cpqhw->cpqw", ay, fsel)
    return np.einsum("cpqw,qw->cpq", rows, ax)


def avg_backward(sep, grad: np.ndarray, data_shape, channel_map=None):
    """Gradient of :func:`avg_forward` w.r.t. the data, (N, C, H, W)."""
    batch, ay, ax, divisor = sep
    ay, ax = ay.astype(grad.dtype, copy=False), ax.astype(grad.dtype, copy=False)
    h0, h1 = window(ay)
    w0, w1 = window(ax)
    g = grad / divisor[:, None, :, :].astype(grad.dtype, copy=False)
    out = np.zeros(data_shape, dtype=grad.dtype)
    for r in range(batch.shape[0]):
        b = batch[r]
        if b < 0 or h1[r] <= h0[r] or w1[r] <= w0[r]:
            continue
        sy, sx = slice(h0[r], h1[r]), slice(w0[r], w1[r])
        a_y, a_x = ay[r, :, sy], ax[r, :, sx]
        if channel_map is None:
            # (h, P) @ (C, P, Q) @ (Q, w) -> (C, h, w)
            out[b, :, sy, sx] += (a_y.T @ g[r]) @ a_x
        else:
            contrib = g[r][:, :, :, None, None] * (a_y[None, :, None, :, None]
                                                   * a_x[None, None, :, None, :])
            _add_channels(out[b, :, sy, sx], channel_map, contrib)
    return out


def _add_channels(dst, channel_map, contrib):
    """dst[channel_map[c,p,q]] += contrib[c,p,q] for every (c, p, q) (channels may repeat)."""
    C, P, Q = channel_map.shape
    flat = channel_map.reshape(-1)
    vals = contrib.reshape(C * P * Q, *contrib.shape[3:])
    order = np.argsort(flat, kind="stable")
    flat, vals = flat[order], vals[order]
    starts = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    sums = np.add.reduceat(vals, starts, axis=0)
    dst[flat[starts]] += sums


def sample_values(geo: SampleGrid, data: np.ndarray, r: int, channels=None):
    """Every sample point of roi ``r``: (C, P, Gy, Q, Gx) values, scalar-kernel order.

    value = w1*v(y_low,x_low) + w2*v(y_low,x_high) + w3*v(y_high,x_low) + w4*v(y_high,x_high)
    with w1 = wy_low*wx_low etc. (MXNet/Caffe2 order); out-of-map samples are 0.
    """
    f = data[geo.batch[r]] if channels is None else data[geo.batch[r]][channels]
    y, x = geo.y, geo.x
    yl, yh = y.low[r][:, :, None, None], y.high[r][:, :, None, None]
    xl, xh = x.low[r][None, None], x.high[r][None, None]
    wyl, wyh = y.w_low[r][:, :, None, None], y.w_high[r][:, :, None, None]
    wxl, wxh = x.w_low[r][None, None], x.w_high[r][None, None]
    w1, w2, w3, w4 = wyl * wxl, wyl * wxh, wyh * wxl, wyh * wxh
    return (w1 * f[:, yl, xl] + w2 * f[:, yl, xh]) + w3 * f[:, yh, xl] + w4 * f[:, yh, xh]


def _live_mask(geo: SampleGrid, r: int):
    gy = np.arange(geo.y.size)[None, :] < geo.y.count[r][:, None]   # (P, Gy)
    gx = np.arange(geo.x.size)[None, :] < geo.x.count[r][:, None]   # (Q, Gx)
    return gy[:, :, None, None] & gx[None, None, :, :]               # (P, Gy, Q, Gx)


def max_forward(geo: SampleGrid, data: np.ndarray, out_channels: int):
    """Max over each bin's bilinear samples; first sample (iy-major) wins ties.

    Returns the (R, C, P, Q) output and the winning sample's (R, C, P, Q) flat index
    ``iy * Gx + ix`` (-1 where a bin has no samples).
    """
    R = geo.batch.shape[0]
    P, Q = geo.divisor.shape[1:]
    Gy, Gx = geo.y.size, geo.x.size
    out = np.zeros((R, out_channels, P, Q), dtype=data.dtype)
    arg = np.full((R, out_channels, P, Q), -1, dtype=np.int64)
    for r in range(R):
        if geo.batch[r] < 0:
            continue
        v = sample_values(geo, data, r)                        # (C, P, Gy, Q, Gx)
        live = _live_mask(geo, r)
        v = np.where(live[None], v, -np.inf).transpose(0, 1, 3, 2, 4).reshape(
            out_channels, P, Q, Gy * Gx)
        a = v.argmax(axis=3)
        best = np.take_along_axis(v, a[..., None], axis=3)[..., 0]
        empty = ~np.isfinite(best) & (best < 0)
        out[r] = np.where(empty, 0, best)
        arg[r] = np.where(empty, -1, a)
    return out, arg


def scatter_taps(geo: SampleGrid, r: int, sample_index, grad_r, dst):
    """Add ``grad_r`` (C, P, Q) to the 4 taps of the chosen sample of each bin of roi r.

    ``sample_index`` (C, P, Q) holds ``iy * Gx + ix`` or -1 (nothing); ``dst`` (C, H, W).
    """
    C, P, Q = sample_index.shape
    H, W = dst.shape[1:]
    Gx = geo.x.size
    ok = sample_index >= 0
    iy, ix = np.where(ok, sample_index // Gx, 0), np.where(ok, sample_index % Gx, 0)
    p = np.arange(P)[None, :, None]
    q = np.arange(Q)[None, None, :]
    y, x = geo.y, geo.x
    yl, yh = y.low[r][p, iy], y.high[r][p, iy]
    xl, xh = x.low[r][q, ix], x.high[r][q, ix]
    wyl, wyh = y.w_low[r][p, iy], y.w_high[r][p, iy]
    wxl, wxh = x.w_low[r][q, ix], x.w_high[r][q, ix]
    g = np.where(ok, grad_r, 0)
    c = np.broadcast_to(np.arange(C)[:, None, None], (C, P, Q))
    base = c.astype(np.int64) * (H * W)
    idx = np.concatenate([(base + yy * W + xx).ravel() for yy, xx in
                          ((yl, xl), (yl, xh), (yh, xl), (yh, xh))])
    vals = np.concatenate([(g * (wy * wx)).ravel() for wy, wx in
                           ((wyl, wxl), (wyl, wxh), (wyh, wxl), (wyh, wxh))])
    dst += np.bincount(idx, weights=vals, minlength=C * H * W).reshape(C, H, W).astype(dst.dtype)


def max_backward(geo: SampleGrid, grad: np.ndarray, data_shape, arg: np.ndarray):
    """Gradient of :func:`max_forward`: each bin's gradient to its winning sample's taps."""
    out = np.zeros(data_shape, dtype=grad.dtype)
    for r in range(geo.batch.shape[0]):
        b = geo.batch[r]
        if b < 0:
            continue
        scatter_taps(geo, r, arg[r], grad[r], out[b])
    return out
