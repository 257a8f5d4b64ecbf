"""NumPy kernels shared by the ops: they consume the tables of :mod:`mx_roi.geometry`.

Layout: the feature map is turned channels-last once per call, (N, H, W, C), so that a
roi's window ``F[b, h0:h1, w0:w1, :]`` is a strided 2-D view (hh, ww*C) that BLAS reads
without a copy, and every gather pulls whole contiguous channel vectors.

Bilinear average pooling is separable: for one roi the pooled map of every channel is
``Ay @ F @ Ax.T`` with small interpolation matrices ``Ay`` (P, H) and ``Ax`` (Q, W)
holding each bin's summed tap weights, so a roi costs two small BLAS products over its
window; the backward is the transpose, added into the window.  Max modes evaluate
every sample point exactly as the scalar kernels do (same operation order, so ties
break the same way) and route the gradient to the four taps of the winning sample.
Position-sensitive ops read, per bin, only the channels of that bin's group cell.
"""
from __future__ import annotations

import numpy as np

from .geometry import SampleAxis, SampleGrid

__all__ = ["channels_last", "tap_matrix", "window", "separable", "indicator_matrix",
           "avg_forward", "avg_backward", "sample_values", "max_forward", "max_backward",
           "first_equal"]


def channels_last(data: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> contiguous (N, H, W, C)."""
    return np.ascontiguousarray(data.transpose(0, 2, 3, 1))


def channels_first(data_cl: np.ndarray) -> np.ndarray:
    """(..., H, W, C) view back as (..., C, H, W) (no copy)."""
    return np.moveaxis(data_cl, -1, -3)


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


def separable(geo: SampleGrid, height: int, width: int):
    """The (batch, ay (R,P,H), ax (R,Q,W), divisor (R,P,Q)) form of a sample grid."""
    return geo.batch, tap_matrix(geo.y, height), tap_matrix(geo.x, width), geo.divisor


def indicator_matrix(start, end, length: int) -> np.ndarray:
    """(R, P, length) with 1 where ``start[r,p] <= i < end[r,p]`` (integer bins)."""
    i = np.arange(length)[None, None, :]
    return (i >= start[:, :, None]) & (i < end[:, :, None])


def _windows(batch, ay, ax):
    h0, h1 = window(ay)
    w0, w1 = window(ax)
    live = (batch >= 0) & (h1 > h0) & (w1 > w0)
    return [(r, int(batch[r]), slice(int(h0[r]), int(h1[r])), slice(int(w0[r]), int(w1[r])))
            for r in np.flatnonzero(live)]


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
    (R, C_out, P, Q) array (possibly a non-contiguous view)
    """
    batch, ay, ax, divisor = sep
    R, P, _ = ay.shape
    Q = ax.shape[1]
    dt = data.dtype
    ay, ax = ay.astype(dt, copy=False), ax.astype(dt, copy=False)
    dcl = channels_last(data)
    out = np.zeros((R, P, Q, out_channels), dtype=dt)
    if channel_map is not None:
        gsel = _group_selector(channel_map)
    for r, b, sy, sx in _windows(batch, ay, ax):
        f = dcl[b, sy, sx]                                      # (hh, ww, C) view
        hh, ww = f.shape[:2]
        if channel_map is None:
            # (P, hh) @ (hh, ww*C) -> (P, ww*C);  (Q, ww) @ (P, ww, C) -> (P, Q, C)
            u = ay[r, :, sy] @ f.reshape(hh, ww * f.shape[2])
            out[r] = ax[r, :, sx] @ u.reshape(P, ww, -1)
        else:
            out[r] = _ps_bins(f, gsel, ay[r, :, sy], ax[r, :, sx])
    out /= divisor[:, :, :, None].astype(dt, copy=False)
    return channels_first(out)


def _group_selector(channel_map):
    """Split a (C_out, P, Q) channel map into per-bin channel lists: (P, Q, C_out)."""
    return np.ascontiguousarray(channel_map.transpose(1, 2, 0))


def _ps_bins(f, gsel, ay, ax):
    """Position-sensitive bins of one roi: (P, Q, C_out).

    ``f`` (hh, ww, C_in) window, ``gsel`` (P, Q, C_out) input channel per output bin.
    Row step over the window's rows per bin row p, then each bin picks its channels.
    """
    P, Q, _ = gsel.shape
    hh, ww, cin = f.shape
    rows = ay @ f.reshape(hh, ww * cin)                  # (P, ww*C_in)
    rows = rows.reshape(P, ww, cin)
    p = np.arange(P)[:, None, None]
    picked = rows[p, :, gsel]                            # (P, Q, C_out, ww)
    return np.einsum("pqcw,qw->pqc", picked, ax)


def avg_backward(sep, grad: np.ndarray, data_shape, channel_map=None):
    """Gradient of :func:`avg_forward` w.r.t. the data, (N, C, H, W)."""
    batch, ay, ax, divisor = sep
    dt = grad.dtype
    ay, ax = ay.astype(dt, copy=False), ax.astype(dt, copy=False)
    N, C, H, W = data_shape
    g = grad / divisor[:, None, :, :].astype(dt, copy=False)
    gcl = np.ascontiguousarray(g.transpose(0, 2, 3, 1))           # (R, P, Q, C_out)
    out = np.zeros((N, H, W, C), dtype=dt)
    P = gcl.shape[1]
    if channel_map is not None:
        gsel = _group_selector(channel_map)
    for r, b, sy, sx in _windows(batch, ay, ax):
        a_y, a_x = ay[r, :, sy], ax[r, :, sx]
        hh, ww = a_y.shape[1], a_x.shape[1]
        if channel_map is None:
            # (ww, Q) @ (P, Q, C) -> (P, ww, C);  (hh, P) @ (P, ww*C) -> (hh, ww*C)
            v = a_x.T @ gcl[r]
        else:
            v = _ps_rows_grad(gcl[r], gsel, a_x, C)
        out[b, sy, sx] += (a_y.T @ v.reshape(P, ww * C)).reshape(hh, ww, C)
    return channels_first(out)


def _ps_rows_grad(g, gsel, ax, cin):
    """Transpose of the column/channel step of :func:`_ps_bins`: (P, ww, C_in)."""
    P, Q, cout = gsel.shape
    ww = ax.shape[1]
    v = np.zeros((P, ww, cin), dtype=g.dtype)
    contrib = g[:, :, :, None] * ax[None, :, None, :]              # (P, Q, C_out, ww)
    p = np.broadcast_to(np.arange(P)[:, None, None], gsel.shape)
    if _unique_per_row(gsel):
        v[p, :, gsel] += contrib
    else:  # group_size < pooled_size: several bins of a row read one channel
        np.add.at(v, (p, slice(None), gsel), contrib)
    return v


def _unique_per_row(gsel):
    P = gsel.shape[0]
    flat = gsel.reshape(P, -1)
    return all(np.unique(flat[i]).size == flat.shape[1] for i in range(P))


def sample_values(geo: SampleGrid, dcl_b: np.ndarray, r: int):
    """Every sample point of roi ``r``: (P, Gy, Q, Gx, C) values, scalar-kernel order.

    value = w1*v(y_low,x_low) + w2*v(y_low,x_high) + w3*v(y_high,x_low) + w4*v(y_high,x_high)
    with w1 = wy_low*wx_low etc. (MXNet/Caffe2 order); out-of-map samples are 0.
    ``dcl_b`` is one image channels-last, (H, W, C).
    """
    y, x = geo.y, geo.x
    yl, yh = y.low[r][:, :, None, None], y.high[r][:, :, None, None]
    xl, xh = x.low[r][None, None], x.high[r][None, None]
    wyl, wyh = y.w_low[r][:, :, None, None, None], y.w_high[r][:, :, None, None, None]
    wxl, wxh = x.w_low[r][None, None, :, :, None], x.w_high[r][None, None, :, :, None]
    w1, w2, w3, w4 = wyl * wxl, wyl * wxh, wyh * wxl, wyh * wxh
    f = dcl_b
    return (w1 * f[yl, xl] + w2 * f[yl, xh]) + w3 * f[yh, xl] + w4 * f[yh, xh]


def _live_mask(geo: SampleGrid, r: int):
    gy = np.arange(geo.y.size)[None, :] < geo.y.count[r][:, None]   # (P, Gy)
    gx = np.arange(geo.x.size)[None, :] < geo.x.count[r][:, None]   # (Q, Gx)
    return gy[:, :, None, None] & gx[None, None, :, :]               # (P, Gy, Q, Gx)


def max_forward(geo: SampleGrid, data: np.ndarray, out_channels: int, need_arg: bool = True):
    """Max over each bin's bilinear samples; first sample (iy-major) wins ties.

    Returns the (R, C, P, Q) output and the winning sample's flat index ``iy * Gx + ix``
    as an (R, P, Q, C) array (-1 where a bin has no samples), or None without
    ``need_arg``.
    """
    R = geo.batch.shape[0]
    P, Q = geo.divisor.shape[1:]
    Gy, Gx = geo.y.size, geo.x.size
    dcl = channels_last(data)
    out = np.zeros((R, P, Q, out_channels), dtype=data.dtype)
    arg = np.full((R, P, Q, out_channels), -1, dtype=np.int32) if need_arg else None
    for r in np.flatnonzero(geo.batch >= 0):
        v = sample_values(geo, dcl[geo.batch[r]], r)               # (P, Gy, Q, Gx, C)
        live = _live_mask(geo, r)
        if not live.all():
            v = np.where(live[..., None], v, -np.inf)
        v = v.transpose(0, 2, 1, 3, 4).reshape(P, Q, Gy * Gx, out_channels)
        best = v.max(axis=2)
        empty = np.isneginf(best)
        out[r] = np.where(empty, 0, best)
        if need_arg:
            arg[r] = np.where(empty, -1, first_equal(v, best, axis=2))
    return channels_first(out), arg


def max_backward(geo: SampleGrid, grad: np.ndarray, data_shape, arg: np.ndarray):
    """Gradient of :func:`max_forward`: each bin's gradient to its winning sample's taps.

    Per roi the gradient is placed on its winning sample (a one-hot over the bin's
    samples) and spread to the taps with the per-sample interpolation matrices, the
    transpose of evaluating every sample: ``Ys.T @ S @ Xs`` over the roi's window.
    """
    N, C, H, W = data_shape
    P, Q = geo.divisor.shape[1:]
    Gy, Gx = geo.y.size, geo.x.size
    dt = grad.dtype
    ys = tap_matrix(geo.y, H, per_sample=True).astype(dt, copy=False)   # (R, P, Gy, H)
    xs = tap_matrix(geo.x, W, per_sample=True).astype(dt, copy=False)   # (R, Q, Gx, W)
    gcl = np.ascontiguousarray(grad.transpose(0, 2, 3, 1))              # (R, P, Q, C)
    out = np.zeros((N, H, W, C), dtype=dt)
    samples = np.arange(Gy * Gx, dtype=np.int32)[None, None, :, None]
    for r, b, sy, sx in _windows(geo.batch, ys.reshape(ys.shape[0], -1, H),
                                 xs.reshape(xs.shape[0], -1, W)):
        one_hot = (arg[r][:, :, None, :] == samples) * gcl[r][:, :, None, :]  # (P,Q,S,C)
        s = one_hot.reshape(P, Q, Gy, Gx, C).transpose(0, 2, 1, 3, 4).reshape(P * Gy, Q * Gx, C)
        a_y = ys[r, :, :, sy].reshape(P * Gy, -1)                         # (P*Gy, hh)
        a_x = xs[r, :, :, sx].reshape(Q * Gx, -1)                         # (Q*Gx, ww)
        hh, ww = a_y.shape[1], a_x.shape[1]
        v = a_x.T @ s                                                     # (P*Gy, ww, C)
        out[b, sy, sx] += (a_y.T @ v.reshape(P * Gy, ww * C)).reshape(hh, ww, C)
    return channels_first(out)


def first_equal(values: np.ndarray, target: np.ndarray, axis: int) -> np.ndarray:
    """Index of the first entry along ``axis`` equal to ``target`` (the max): int32.

    Faster than ``argmax`` over a short non-last axis, and the same first-wins rule.
    """
    k = values.shape[axis]
    idx = np.zeros(target.shape, dtype=np.int32)
    lead = (slice(None),) * (axis % values.ndim)
    for i in range(k - 1, 0, -1):
        np.copyto(idx, i, where=values[lead + (i,)] == target)
    np.copyto(idx, 0, where=values[lead + (0,)] == target)
    return idx
