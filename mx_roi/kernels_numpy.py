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
Every max mode follows MXNet's ROIPooling rule (:data:`MAX_INIT`): a non-empty bin starts
at -FLT_MAX and a value replaces it only if strictly greater, so NaN never wins.
Position-sensitive ops read, per bin, only the channels of that bin's group cell.
"""
from __future__ import annotations

import numpy as np

from .geometry import SampleAxis, SampleGrid
from .parallel import for_chunks, sum_into

__all__ = ["channels_last", "tap_matrix", "window", "separable", "indicator_matrix",
           "avg_forward", "avg_backward", "band", "ps_avg_forward", "ps_avg_backward",
           "sample_values", "max_forward", "max_backward",
           "first_equal", "for_chunks", "sum_into", "MAX_INIT", "max_init"]

# The start value of a non-empty max bin: -FLT_MAX (also for float64 data), as in MXNet's
# roi_pooling.cc/.cu.  With strict '>' a NaN, -inf or any value <= -FLT_MAX never wins: a
# bin nothing beat outputs -FLT_MAX (-inf once stored as float16) with argmax -1 and gets
# no gradient.  The kernels clamp with ``fmax(v, MAX_INIT)`` (NaN -> MAX_INIT) and then
# take a plain max, which gives the same winner as the scalar loop.
MAX_INIT = -float(np.finfo(np.float32).max)


def max_init(dtype):
    """:data:`MAX_INIT` as a scalar of ``dtype``."""
    return np.dtype(dtype).type(MAX_INIT)


def channels_last(data: np.ndarray, floor=None) -> np.ndarray:
    """(N, C, H, W) -> contiguous (N, H, W, C).

    With ``floor``, every value below it or NaN becomes ``floor`` (``np.fmax``), in the
    same single pass as the copy.
    """
    if floor is None:
        return np.ascontiguousarray(data.transpose(0, 2, 3, 1))
    out = np.empty(data.shape[:1] + data.shape[2:] + data.shape[1:2], dtype=data.dtype)
    return np.fmax(data.transpose(0, 2, 3, 1), floor, out=out)


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
    """The (batch, ay (R,P,H), ax (R,Q,W), divisor) form of a sample grid.

    When the grid's divisor is the product of the per-axis sample counts (ROIAlign's
    average), it is folded into ``ay``/``ax`` and ``divisor`` is None.  Kept on ``geo``
    (a forward's geometry is reused by its backward), so it is built once per call pair.
    """
    cached = getattr(geo, "_separable", None)
    if cached is not None and cached[0] == (height, width):
        return cached[1]
    ay, ax = tap_matrix(geo.y, height), tap_matrix(geo.x, width)
    cy = np.maximum(geo.y.count, 1).astype(ay.dtype)
    cx = np.maximum(geo.x.count, 1).astype(ax.dtype)
    if np.array_equal(cy[:, :, None] * cx[:, None, :], geo.divisor):
        sep = geo.batch, ay / cy[:, :, None], ax / cx[:, :, None], None
    else:
        sep = geo.batch, ay, ax, geo.divisor
    try:
        geo._separable = ((height, width), sep)
    except AttributeError:  # a geometry object without a __dict__: no cache
        pass
    return sep


def indicator_matrix(start, end, length: int) -> np.ndarray:
    """(R, P, length) with 1 where ``start[r,p] <= i < end[r,p]`` (integer bins)."""
    i = np.arange(length)[None, None, :]
    return (i >= start[:, :, None]) & (i < end[:, :, None])


def _windows(batch, ay, ax):
    h0, h1 = window(ay)
    w0, w1 = window(ax)
    live = np.flatnonzero((batch >= 0) & (h1 > h0) & (w1 > w0))
    # one .tolist() per table: Python ints without a NumPy scalar per element
    cols = [a[live].tolist() for a in (batch, h0, h1, w0, w1)]
    return [(r, b, slice(y0, y1), slice(x0, x1))
            for r, b, y0, y1, x0, x1 in zip(live.tolist(), *cols)]


def avg_forward(sep, data: np.ndarray, out=None):
    """Weighted average of each bin, separable in y and x.

    Parameters
    ----------
    sep : (batch (R,), ay (R, P, H), ax (R, Q, W), divisor (R, P, Q))
        see :func:`separable`; integer bins use 0/1 matrices
    data : (N, C, H, W) in the compute dtype
    out : optional (R, C, P, Q) array of data's dtype to write the result into

    Returns
    -------
    (R, C, P, Q) array (``out`` when given)
    """
    batch, ay, ax, divisor = sep
    R, P, _ = ay.shape
    Q = ax.shape[1]
    dt = data.dtype
    ay, ax = ay.astype(dt, copy=False), ax.astype(dt, copy=False)
    dcl = channels_last(data)
    C = data.shape[1]
    out = np.empty((R, C, P, Q), dtype=dt) if out is None else out
    items = _windows(batch, ay, ax)
    idle = np.ones(R, dtype=bool)
    idle[[it[0] for it in items]] = False
    out[idle] = 0                                           # padding rois, empty windows

    def run(items):
        for r, b, sy, sx in items:
            f = dcl[b, sy, sx]                                  # (hh, ww, C) view
            hh, ww = f.shape[:2]
            # (P, hh) @ (hh, ww*C) -> (P, ww*C);  per p (C, ww) @ (ww, Q) -> (C, Q),
            # written straight into out[r] seen as (P, C, Q)
            u = ay[r, :, sy] @ f.reshape(hh, ww * C)
            np.matmul(u.reshape(P, ww, C).transpose(0, 2, 1), ax[r, :, sx].T,
                      out=out[r].transpose(1, 0, 2))
            if divisor is not None:
                out[r] /= divisor[r]

    for_chunks(items, run)
    return out


def avg_backward(sep, grad: np.ndarray, data_shape):
    """Gradient of :func:`avg_forward` w.r.t. the data, (N, C, H, W)."""
    batch, ay, ax, divisor = sep
    dt = grad.dtype
    ay, ax = ay.astype(dt, copy=False), ax.astype(dt, copy=False)
    N, C, H, W = data_shape
    g = grad if divisor is None else grad / divisor[:, None, :, :].astype(dt, copy=False)
    P = g.shape[2]

    def run(items, out):
        for r, b, sy, sx in items:
            a_y, a_x = ay[r, :, sy], ax[r, :, sx]
            hh, ww = a_y.shape[1], a_x.shape[1]
            # (ww, Q) @ (P, Q, C) -> (P, ww, C);  (hh, P) @ (P, ww*C) -> (hh, ww*C).
            # g[r] seen as (P, Q, C) is a strided view that BLAS reads as a transposed
            # operand: no channels-last copy of the whole out-grad (serial, and as big
            # as the output)
            v = a_x.T @ g[r].transpose(1, 2, 0)
            out[b, sy, sx] += (a_y.T @ v.reshape(P, ww * C)).reshape(hh, ww, C)

    return channels_first(sum_into((N, H, W, C), dt, _windows(batch, ay, ax), run))


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


def _outside_mask(geo: SampleGrid, r: int):
    """(P, Gy, Q, Gx): points outside the map (both weights of an axis are 0)."""
    y, x = geo.y, geo.x
    oy = (y.w_low[r] == 0) & (y.w_high[r] == 0)                      # (P, Gy)
    ox = (x.w_low[r] == 0) & (x.w_high[r] == 0)                      # (Q, Gx)
    return oy[:, :, None, None] | ox[None, None, :, :]


def max_forward(geo: SampleGrid, data: np.ndarray, out_channels: int, need_arg: bool = True):
    """Max over each bin's bilinear samples; first sample (iy-major) wins ties.

    NaN rule of :data:`MAX_INIT`: a sample that is NaN (a NaN on any of its four taps,
    even one of weight 0, as MXNet's bilinear interpolation reads them) or <= -FLT_MAX
    never wins; a point outside the map is 0 whatever its taps hold; a bin with samples none of which wins gives -FLT_MAX and
    argmax -1, a bin without samples 0 and -1.

    Returns the (R, C, P, Q) output and the winning sample's flat index ``iy * Gx + ix``
    as an (R, P, Q, C) array (-1 where no sample won), or None without ``need_arg``.
    """
    R = geo.batch.shape[0]
    P, Q = geo.divisor.shape[1:]
    Gy, Gx = geo.y.size, geo.x.size
    dcl = channels_last(data)
    lowest = max_init(data.dtype)
    out = np.zeros((R, P, Q, out_channels), dtype=data.dtype)
    arg = np.full((R, P, Q, out_channels), -1, dtype=np.int32) if need_arg else None

    def run(items):
        for r in items:
            with np.errstate(invalid="ignore"):                    # 0 * inf taps
                v = sample_values(geo, dcl[geo.batch[r]], r)       # (P, Gy, Q, Gx, C)
            outside = _outside_mask(geo, r)
            if outside.any():
                v[outside] = 0                    # not 0 * NaN of a weight-0 tap
            np.fmax(v, lowest, out=v)                              # NaN never wins
            live = _live_mask(geo, r)
            if not live.all():
                v = np.where(live[..., None], v, -np.inf)          # below MAX_INIT
            v = v.transpose(0, 2, 1, 3, 4).reshape(P, Q, Gy * Gx, out_channels)
            best = v.max(axis=2)
            empty = np.isneginf(best)
            out[r] = np.where(empty, 0, best)
            if need_arg:
                arg[r] = np.where(empty | (best == lowest), -1, first_equal(v, best, axis=2))

    for_chunks(list(np.flatnonzero(geo.batch >= 0)), run)
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
    samples = np.arange(Gy * Gx, dtype=np.int32)[None, None, :, None]

    def run(items, out):
        for r, b, sy, sx in items:
            one_hot = (arg[r][:, :, None, :] == samples) * gcl[r][:, :, None, :]  # (P,Q,S,C)
            s = one_hot.reshape(P, Q, Gy, Gx, C).transpose(0, 2, 1, 3, 4).reshape(
                P * Gy, Q * Gx, C)
            a_y = ys[r, :, :, sy].reshape(P * Gy, -1)                     # (P*Gy, hh)
            a_x = xs[r, :, :, sx].reshape(Q * Gx, -1)                     # (Q*Gx, ww)
            hh, ww = a_y.shape[1], a_x.shape[1]
            v = a_x.T @ s                                                 # (P*Gy, ww, C)
            out[b, sy, sx] += (a_y.T @ v.reshape(P * Gy, ww * C)).reshape(hh, ww, C)

    items = _windows(geo.batch, ys.reshape(ys.shape[0], -1, H), xs.reshape(xs.shape[0], -1, W))
    return channels_first(sum_into((N, H, W, C), dt, items, run))


def first_equal(values: np.ndarray, target: np.ndarray, axis: int) -> np.ndarray:
    """Index of the first entry along ``axis`` equal to ``target`` (the max): int32.

    Much faster than ``argmax`` over a short non-last axis, with the same first-wins
    rule: the largest of ``(entry == target) * (k - i)`` marks the smallest such i.
    """
    k = values.shape[axis]
    dt = np.uint8 if k < 255 else np.int32
    shape = [1] * values.ndim
    shape[axis] = k
    rank = (k - np.arange(k)).astype(dt).reshape(shape)
    eq = values == np.expand_dims(target, axis)
    eq = eq.view(np.uint8) if dt is np.uint8 else eq.astype(dt)
    first = k - (eq * rank).max(axis=axis).astype(np.int32)
    return np.minimum(first, k - 1)           # no match (NaN) -> last entry


# ---- position-sensitive average ------------------------------------------------------
#
# Output channel o at bin (p, q) reads input channel (o*G_h + gh[p])*G_w + gw[q] (R-FCN,
# on a G_h x G_w group grid).  The input is laid out once per call as
# (N, G_h, G_w, H, W, O): then bin (p, q) of a roi
# reads the O-vectors of group cell (gh[p], gw[q]) at the cells of its y band x x band
# (the short runs with non-zero weight in the bin's rows of the separable matrices) --
# one gather of (P, Q, Ky, Kx, O) per roi, nothing a bin does not read.  The backward
# accumulates per bin row into an (N, G_h, H, W, O, G_w) buffer with plain slices (a
# bin row's band rows of its group row are contiguous there), which measured faster
# than scattering the (P, Q, Ky, Kx, O) blocks.

def band(mat: np.ndarray):
    """Compact each bin's non-zero run of ``mat`` (R, P, L): (start (R, P), w (R, P, K)).

    ``start + k`` (k < K) stays inside ``[0, L)`` and is distinct for distinct k, and
    ``w[..., k] = mat[..., start + k]``; K is the longest run (at most L).
    """
    R, P, L = mat.shape
    nz = mat != 0
    has = nz.any(axis=2)
    first = np.where(has, nz.argmax(axis=2), 0)
    last = np.where(has, L - 1 - nz[:, :, ::-1].argmax(axis=2), 0)
    k = int((last - first).max()) + 1 if mat.size else 1
    k = max(1, min(k, L))
    start = np.minimum(first, L - k)
    idx = start[:, :, None] + np.arange(k)[None, None, :]
    return start, np.take_along_axis(mat, idx, axis=2)


def _cell_layout(data, O, Gh, Gw):
    """(N, O*Gh*Gw, H, W) -> contiguous (N, Gh, Gw, H, W, O)."""
    N, _, H, W = data.shape
    return np.ascontiguousarray(data.reshape(N, O, Gh * Gw * H * W).transpose(0, 2, 1)).reshape(
        N, Gh, Gw, H, W, O)


def _ps_plan(sep, dt, gh, gw):
    """Bands and the per-roi index arrays of the (P, Q, Ky, Kx) band cells."""
    batch, ay, ax, _ = sep
    y0, wy = band(ay.astype(dt, copy=False))                         # (R, P), (R, P, Ky)
    x0, wx = band(ax.astype(dt, copy=False))                         # (R, Q), (R, Q, Kx)
    P, Ky = wy.shape[1:]
    Q, Kx = wx.shape[1:]
    gh_i = gh.reshape(P, 1, 1, 1)
    gw_i = gw.reshape(1, Q, 1, 1)
    rows = (y0[:, :, None] + np.arange(Ky)).reshape(-1, P, 1, Ky, 1)  # (R, P, 1, Ky, 1)
    cols = (x0[:, :, None] + np.arange(Kx)).reshape(-1, 1, Q, 1, Kx)  # (R, 1, Q, 1, Kx)
    return gh_i, gw_i, rows, cols, wy, wx


def ps_avg_forward(sep, data: np.ndarray, output_dim: int, group_grid, gh, gw):
    """Position-sensitive weighted average of each bin: (R, O, P, Q).

    Parameters
    ----------
    sep : (batch, ay (R, P, H), ax (R, Q, W), divisor (R, P, Q) or None)
        see :func:`separable`
    data : (N, O*Gh*Gw, H, W) in the compute dtype
    group_grid : (Gh, Gw) group cells along y and x
    gh, gw : (P,), (Q,) int  group cell of each bin row / column
    """
    batch, ay, ax, divisor = sep
    R, P, _ = ay.shape
    Q = ax.shape[1]
    O, (Gh, Gw) = output_dim, group_grid
    dt = data.dtype
    cells = _cell_layout(data, O, Gh, Gw)
    gh_i, gw_i, rows, cols, wy, wx = _ps_plan(sep, dt, gh, gw)
    out = np.zeros((R, P, Q, O), dtype=dt)

    def run(items):
        for r in items:
            v = cells[batch[r]][gh_i, gw_i, rows[r], cols[r]]       # (P, Q, Ky, Kx, O)
            v = np.einsum("pqijo,qj->pqio", v, wx[r])                # columns step
            out[r] = np.einsum("pqio,pi->pqo", v, wy[r])             # rows step

    for_chunks(list(np.flatnonzero(batch >= 0)), run)
    out = out.transpose(0, 3, 1, 2)                                  # (R, O, P, Q)
    return out if divisor is None else out / divisor[:, None, :, :].astype(dt, copy=False)


def ps_avg_backward(sep, grad: np.ndarray, data_shape, output_dim: int, group_grid, gh, gw):
    """Gradient of :func:`ps_avg_forward` w.r.t. the data, as (N, O, Gh, Gw, H, W)."""
    batch, ay, ax, divisor = sep
    R, P, H = ay.shape
    Q, W = ax.shape[1:]
    N = data_shape[0]
    O, (Gh, Gw) = output_dim, group_grid
    dt = grad.dtype
    y0, wy = band(ay.astype(dt, copy=False))
    x0, wx = band(ax.astype(dt, copy=False))
    Ky, Kx = wy.shape[2], wx.shape[2]
    g = grad if divisor is None else grad / divisor[:, None, :, :].astype(dt, copy=False)
    gq = np.ascontiguousarray(g.transpose(0, 3, 2, 1))               # (R, Q, P, O)
    ky, kx = np.arange(Ky), np.arange(Kx)
    # with one group cell per bin row/column no two bins write the same place of a roi
    unique = np.unique(gh).size == P and np.unique(gw).size == Q

    def run(items, out):
        for r in items:
            f = out[batch[r]]                                       # (Gh, H, W, O, Gw)
            rows = y0[r][:, None] + ky
            c_lo, c_hi = int(x0[r].min()), int(x0[r].max()) + Kx
            cols = x0[r][:, None] - c_lo + kx
            v = wx[r][:, :, None] * gq[r].reshape(Q, 1, P * O)       # (Q, Kx, P*O)
            u = np.zeros((P, c_hi - c_lo, O, Gw), dtype=dt)
            if unique:
                u[:, cols, :, gw[:, None]] = v.reshape(Q, Kx, P, O)
            else:
                np.add.at(u, (slice(None), cols, slice(None), gw[:, None]),
                          v.reshape(Q, Kx, P, O))
            contrib = (wy[r][:, :, None] * u.reshape(P, 1, -1)).reshape(
                P, Ky, c_hi - c_lo, O, Gw)
            if unique:  # one bin row per group row: plain slices, no fancy indexing
                for p in range(P):
                    f[gh[p], y0[r, p]:y0[r, p] + Ky, c_lo:c_hi] += contrib[p]
            else:
                np.add.at(f, (gh[:, None], rows, slice(c_lo, c_hi)), contrib)

    out = sum_into((N, Gh, H, W, O, Gw), dt, list(np.flatnonzero(batch >= 0)), run)
    # (N, G_h, H, W, O, G_w) seen as (N, O, G_h, G_w, H, W): the writer reshapes its
    # destination (a reshape here would copy)
    return out.transpose(0, 4, 1, 5, 2, 3)
