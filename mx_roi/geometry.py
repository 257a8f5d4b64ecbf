"""Box -> bins -> sample points: the geometry of every op, written once.

Every backend (NumPy, the CUDA kernels, their host emulation) and the pictures in
:mod:`mx_roi.viz` consume the *tables* built here; no kernel re-derives a bin or a
sample point.  A second implementation, in compiled code (``mx_roi::geo`` in
``operators/roi_common.cuh``, :mod:`mx_roi.cuda.compiled_geometry`), fills the same
tables for the host builds; tests/test_geometry_compiled.py proves the two bit-equal on
random grids of every dtype and mode, so a change here must be made there too.  Functions take an array module ``xp`` (``numpy`` or ``cupy``) so the
GPU path builds the same tables on the device.

Arithmetic follows MXNet 1.9.1's C++ kernels operation by operation, in the
*compute dtype* (float32 for float16/float32 data, float64 for float64 data), so that
a sample landing exactly on a boundary lands on the same side as in the built-in.

Shapes: ``R`` rois, ``P``/``Q`` pooled height/width, ``G`` the largest per-bin sample
count along an axis (tables are padded to it; entries past a bin's count have weight 0).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import numpy as np

__all__ = ["compute_dtype", "c_round", "batch_index", "IntBins", "SampleAxis", "SampleGrid",
           "roi_pooling_bins", "psroi_pooling_bins", "roi_align_grid", "group_index",
           "ps_channel_map",
           "bilinear_axis", "MAX_SAMPLES_PER_AXIS", "RotatedGrid", "rotated_boxes",
           "rotated_grid", "MAX_ROTATED_SAMPLES", "MAX_SAMPLES_PER_BIN",
           "adaptive_samples_per_bin", "check_samples_per_bin", "IntegralAxis", "PreciseBins",
           "precise_bins", "hat_antiderivative"]

#: Guard against boxes so large that the per-axis sample tables would not fit in memory.
MAX_SAMPLES_PER_AXIS = 1 << 22
#: Most bilinear samples of one bin that a kernel loops over (per channel): a sampling
#: ratio's square (params.MAX_SAMPLES_PER_SIDE) and an adaptive grid's ceil(h / P) *
#: ceil(w / Q), which the ops refuse beyond (check_samples_per_bin: a bin of a million
#: cells of the map; more would run for hours, as MXNet's own ROIAlign does)
MAX_SAMPLES_PER_BIN = 1 << 20


def compute_dtype(dtype) -> np.dtype:
    """float64 stays float64; float16 and float32 are computed in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def c_round(v, xp=np):
    """C ``round()``: half away from zero (``np.round`` rounds half to even)."""
    t = xp.trunc(v)
    return t + xp.where(xp.abs(v - t) >= 0.5, xp.sign(v), 0).astype(v.dtype)


def batch_index(rois, xp=np):
    """``int(rois[:, 0])`` as C truncates it; negative means a padding roi.  (R,) int32."""
    return xp.trunc(rois[:, 0]).astype(np.int32)


@dataclass
class LazyTables:
    """An op's geometry for a call whose kernels derive it from the rois: the rois (on a
    GPU :func:`mx_roi.cuda.tables.to_device` moves them) and, built by
    ``build(rois, height, width)`` on first :meth:`tables` (the NumPy backend), the
    op's NumPy tables.  ``build`` may be ``None`` where only the rois are read."""

    rois: Any
    build: Optional[Callable[..., Any]] = None
    hw: Tuple[int, int] = (0, 0)
    built: Any = None

    def tables(self):
        if self.built is None:
            self.built = self.build(self.rois, *self.hw)
        return self.built


__all__ += ["LazyTables"]


def _scale(spatial_scale, dtype):
    # MXNet stores spatial_scale as a C float, then converts it to the data type.
    return dtype.type(np.float32(spatial_scale))


@dataclass
class IntBins:
    """Integer bins of the pooling ops; ``[start, end)`` clipped to the map.

    Attributes
    ----------
    batch : (R,) int32
    hstart, hend : (R, P) int32
    wstart, wend : (R, Q) int32
    """

    batch: Any
    hstart: Any
    hend: Any
    wstart: Any
    wend: Any


def _clamp(v, lo, hi, xp):
    """``clip(v, lo, hi)`` as int32; ``minimum(maximum())`` is the same and, on small
    tables, 4x cheaper than NumPy 1.23's ``clip`` (its deprecation checks)."""
    return xp.minimum(xp.maximum(v, lo), hi).astype(np.int32)


def _int_bins(start, size, pooled, limit, xp, cdt, offset_in_float):
    """Bins ``floor(i*bin)``..``ceil((i+1)*bin)`` of ``A`` stacked axes, clipped to
    ``[0, limit]``.

    ``start``, ``size``: (A, R), ``limit``: (A, 1, 1) map lengths.  Returns ``start,
    end`` as (A, R, P) int32; row ``k`` is axis ``k`` (a contiguous (R, P) table).  The
    lower and upper edges go through one array, so a call costs the same few array
    operations for any number of axes (what dominates a small call).
    """
    k = xp.arange(pooled + 1, dtype=cdt)
    edge = k * (size / cdt.type(pooled))[..., None]         # (A, R, P+1): i*bin, (i+1)*bin
    both = xp.empty((2,) + edge.shape[:-1] + (pooled,), dtype=cdt)
    if offset_in_float:  # PSROIPooling: floor(i*bin + start), ceil((i+1)*bin + start)
        edge += start[..., None]
        xp.floor(edge[..., :-1], out=both[0])
        xp.ceil(edge[..., 1:], out=both[1])
        # clipped in floating point, before the int cast: a huge coordinate (1e30)
        # would overflow int32 (fmax/fmin: a NaN edge, from an infinite size, gives 0)
        both = xp.fmin(xp.fmax(both, cdt.type(0)), limit.astype(cdt)).astype(np.int32)
    else:  # ROIPooling: floor(i*bin) + start, ceil((i+1)*bin) + start, start an int
        xp.floor(edge[..., :-1], out=both[0])
        xp.ceil(edge[..., 1:], out=both[1])
        both = both.astype(np.int32) + start[..., None]
        both = _clamp(both, 0, limit, xp)
    return both[0], both[1]


def _axis_limits(height, width, xp):
    """(2, 1, 1) int32: the map lengths of the (y, x) axes, broadcasting against (2, R, P)."""
    return xp.asarray([[[height]], [[width]]], dtype=np.int32)


def _stacked_bins(start, size, pooled_size, height, width, xp, cdt, offset_in_float):
    """``(hstart, hend, wstart, wend)`` from (2, R) ``start``/``size`` rows (y, x)."""
    P, Q = int(pooled_size[0]), int(pooled_size[1])
    limits = _axis_limits(height, width, xp)
    if P == Q:  # both axes in one pass of array operations
        lo, hi = _int_bins(start, size, P, limits, xp, cdt, offset_in_float)
        return lo[0], hi[0], lo[1], hi[1]
    hs, he = _int_bins(start[:1], size[:1], P, limits[:1], xp, cdt, offset_in_float)
    ws, we = _int_bins(start[1:], size[1:], Q, limits[1:], xp, cdt, offset_in_float)
    return hs[0], he[0], ws[0], we[0]


def roi_pooling_bins(rois, pooled_size, spatial_scale, height, width, xp=np) -> IntBins:
    """Fast R-CNN bins: coordinates scaled then C-rounded, end inclusive (+1).

    Parameters
    ----------
    rois : (R, 5) array, (batch, x1, y1, x2, y2) in image coordinates
    """
    cdt = compute_dtype(rois.dtype)
    s = _scale(spatial_scale, cdt)
    # rows y1, x1, y2, x2 (the same elementwise operations as coordinate by coordinate)
    c = c_round(rois[:, [2, 1, 4, 3]].astype(cdt).T * s, xp).astype(np.int32)  # (4, R)
    start = c[:2]
    # Malformed (reversed) rois are forced to 1x1, as in Caffe.
    size = xp.maximum(c[2:] - start + 1, 1).astype(cdt)
    hs, he, ws, we = _stacked_bins(start, size, pooled_size, height, width, xp, cdt, False)
    return IntBins(batch_index(rois, xp), hs, he, ws, we)


def psroi_pooling_bins(rois, pooled_size, spatial_scale, height, width, xp=np) -> IntBins:
    """R-FCN bins: raw coordinates C-rounded *then* scaled, end ``round(x2)+1``, size >= 0.1."""
    cdt = compute_dtype(rois.dtype)
    s = _scale(spatial_scale, cdt)
    c = c_round(rois[:, [2, 1, 4, 3]].astype(cdt).T, xp)       # (4, R): y1, x1, y2, x2
    start = c[:2] * s
    end = (c[2:] + 1) * s
    tenth = cdt.type(0.1)  # "Force too small ROIs to be 1x1" -- in fact 0.1 (R-FCN)
    size = xp.maximum(end - start, tenth)
    hs, he, ws, we = _stacked_bins(start, size, pooled_size, height, width, xp, cdt, True)
    return IntBins(batch_index(rois, xp), hs, he, ws, we)


def group_index(pooled: int, group_size: int, xp=np, dtype=np.float32):
    """Position-sensitive group cell of each bin along one axis: ``floor(i*G/P)`` clipped
    to ``[0, G-1]``, with ``P`` bins and ``G`` group cells on that axis.

    Returns (P,) int32.  See :func:`ps_channel_map` for the input channel it selects.
    """
    cdt = np.dtype(dtype)
    i = xp.arange(pooled, dtype=cdt)
    # MXNet/R-FCN compute it in the data type: floor(static_cast<DType>(p) * G / P)
    g = xp.floor(i * cdt.type(group_size) / cdt.type(pooled)).astype(np.int32)
    return _clamp(g, 0, group_size - 1, xp)


def ps_channel_map(output_dim: int, pooled_size, group_grid, xp=np):
    """(C_out, P, Q) int32: the input channel output channel ``c`` reads at bin (p, q).

    ``(c*Gh + gh[p])*Gw + gw[q]`` with ``gh = group_index(P, Gh)``, ``gw = group_index(Q, Gw)``
    on a ``group_grid = (Gh, Gw)`` (R-FCN's rule, per axis).  With the pooled grid
    (Gh, Gw) = (P, Q) this is ``c*P*Q + p*Q + q``, the channel of
    ``contrib.ROIAlign(position_sensitive=True)``.
    """
    Gh, Gw = (int(g) for g in group_grid)
    gh = group_index(int(pooled_size[0]), Gh, xp)
    gw = group_index(int(pooled_size[1]), Gw, xp)
    c = xp.arange(output_dim, dtype=np.int32)[:, None, None]
    return ((c * Gh + gh[None, :, None]) * Gw + gw[None, None, :]).astype(np.int32)


@dataclass
class SampleAxis:
    """Bilinear sample points of the bins along one axis, and their two taps.

    Attributes
    ----------
    count : (R, P) int32   samples in each bin along this axis (>= 0)
    coord : (R, P, G)      sample coordinate in feature-map cells (for pictures)
    low, high : (R, P, G) int32   the two taps (rows or columns)
    w_low, w_high : (R, P, G)     their weights; 0 for out-of-map samples and padding
    """

    count: Any
    coord: Any
    low: Any
    high: Any
    w_low: Any
    w_high: Any

    @property
    def size(self) -> int:
        return int(self.coord.shape[2])


@dataclass
class SampleGrid:
    """All sample points of a sampling op; a sample's weight is ``wy * wx`` per tap.

    Attributes
    ----------
    batch : (R,) int32
    y, x : SampleAxis      along height (P bins) and width (Q bins)
    divisor : (R, P, Q)    what the avg mode divides a bin's sum by (>= 1)
    """

    batch: Any
    y: SampleAxis
    x: SampleAxis
    divisor: Any


def bilinear_axis(coord, limit, xp=np, valid_lo=-1.0, clamp_low=True):
    """Taps and weights of sample coordinates along one axis of length ``limit``.

    MXNet/Detectron rule: a coordinate below -1 or above ``limit`` gives weight 0, and so
    does NaN (the points of a box whose scaled size overflows float; MXNet would read at
    tap INT_MIN); otherwise it is clamped to >= 0, and one at or past ``limit-1`` snaps
    to the last cell.
    ``limit`` is an int, or an integer array broadcasting against ``coord`` (one length
    per stacked axis).  Returns ``low, high, w_low, w_high`` with the shape of ``coord``.
    """
    cdt = coord.dtype
    lim = limit.astype(cdt) if hasattr(limit, "astype") else cdt.type(limit)
    zero = cdt.type(0)
    # NaN is outside: a box whose scaled size overflows float gives inf * 0 = NaN points
    outside = ~((coord >= cdt.type(valid_lo)) & (coord <= lim))
    # (the masks are applied in place, into arrays made here: on a small call the number
    # of array operations is the cost)
    c = coord.copy()  # clamped to 0; outside: tap 0 (c is read there only for that)
    xp.copyto(c, zero, where=((coord <= 0) | outside) if clamp_low else outside)
    low = c.astype(np.int32)  # (the cast truncates toward 0)
    top = limit - 1
    last = low >= top
    xp.copyto(low, top, where=last, casting="unsafe")  # snapped to the last cell
    high = low + np.int32(1)
    xp.copyto(high, low, where=last)
    low_c = low.astype(cdt)
    xp.copyto(c, low_c, where=last)
    w_high = c - low_c
    w_low = cdt.type(1) - w_high
    xp.copyto(w_high, zero, where=outside)
    xp.copyto(w_low, zero, where=outside)
    return low, high, w_low, w_high


def adaptive_samples_per_bin(sides, spatial_scale, pooled_size, dtype, xp=np):
    """``ceil(h * s / P) * ceil(w * s / Q)`` per box, in float64: the samples per bin of an
    adaptive grid (sample_ratio <= 0) as the ops' bound estimates them (the geometry's
    own grid is in the compute dtype).  ``sides`` (R, 2) float64: each box's (h, w) in
    image units; ``s``: spatial_scale as the compute dtype of ``dtype`` holds it."""
    s = float(compute_dtype(dtype).type(np.float32(spatial_scale)))
    # (finite sides times a finite scale cannot overflow float64; an inf scale times a
    # zero side is NaN, never over the bound -- errstate only then: it costs microseconds)
    with np.errstate(invalid="ignore") if not math.isfinite(s) else contextlib.nullcontext():
        per_axis = xp.ceil(sides * s / xp.asarray(pooled_size, dtype=np.float64))
    return per_axis[:, 0] * per_axis[:, 1]


def check_samples_per_bin(name, per_bin, shown, ratio_name, xp=np):
    """ValueError naming the first box whose ``per_bin`` (R,) (adaptive_samples_per_bin)
    is over MAX_SAMPLES_PER_BIN; ``shown(r)`` gives the (width, height) the message
    prints.  The native operators raise the same text (ext_launch.h)."""
    bad = per_bin > MAX_SAMPLES_PER_BIN
    if bool(bad.any()):
        r = int(xp.argwhere(bad)[0, 0])
        w, h = shown(r)
        raise ValueError(f"{name}: rois[{r}] is a box of {w:g} x {h:g}: "
                         f"{float(per_bin[r]):.3g} samples per bin with {ratio_name} <= 0, "
                         f"more than {MAX_SAMPLES_PER_BIN}; check the box size and "
                         f"spatial_scale, or set {ratio_name}")


def _check_samples(n):
    if n > MAX_SAMPLES_PER_AXIS:
        raise ValueError(f"rois: a box needs {n} sample points along one axis (more than "
                         f"{MAX_SAMPLES_PER_AXIS}); check the coordinates and spatial_scale")


def roi_align_grid(rois, pooled_size, spatial_scale, sample_ratio, aligned, height, width,
                   xp=np) -> SampleGrid:
    """Sample points of ROIAlign (Mask R-CNN; MXNet ``contrib.ROIAlign``, Detectron).

    ``aligned`` shifts the box by half a pixel (Detectron2).  Without it a box is
    clamped to at least 1x1 cells (MXNet's backward-compatible rule); with it the size
    is used as is, so a zero-size or reversed box samples nothing (MXNet aborts there).
    ``sample_ratio <= 0`` samples ``ceil(roi_size / pooled_size)`` points per bin side.
    """
    cdt = compute_dtype(rois.dtype)
    r = rois.astype(cdt, copy=False)
    s = _scale(spatial_scale, cdt)
    # rows: y then x (the same elementwise operations as column by column)
    box = r[:, 1:5] * s                                         # (R, 4): x1, y1, x2, y2
    if aligned:
        box -= cdt.type(0.5)
    box = box.T
    start = box[1::-1]                                          # (2, R): y1, x1
    size = box[:1:-1] - start                                   # (2, R): y2 - y1, x2 - x1
    if not aligned:
        size = xp.maximum(size, cdt.type(1))
    P, Q = int(pooled_size[0]), int(pooled_size[1])
    if P == Q:  # both axes in one pass of array operations
        ay, ax = _align_axes(start, size, P, (height, width), sample_ratio, xp, cdt)
    else:
        ay, = _align_axes(start[:1], size[:1], P, (height,), sample_ratio, xp, cdt)
        ax, = _align_axes(start[1:], size[1:], Q, (width,), sample_ratio, xp, cdt)
    if sample_ratio > 0:  # every bin has sample_ratio^2 points (no product to take)
        divisor = xp.full((rois.shape[0], P, Q), sample_ratio * sample_ratio, dtype=cdt)
    else:  # a roi's counts are the same in all its bins: one product per roi
        per_roi = xp.maximum(ay.count[:, :1, None] * ax.count[:, None, :1], 1)
        divisor = xp.broadcast_to(per_roi, (rois.shape[0], P, Q)).astype(cdt)
    return SampleGrid(batch_index(rois, xp), ay, ax, divisor)


def _align_axes(start, size, pooled, limits, sample_ratio, xp, cdt):
    """ROIAlign's :class:`SampleAxis` of ``A`` stacked axes with ``pooled`` bins each.

    ``start``, ``size``: (A, R) box start and size (clamped) along each axis, in feature
    map cells; ``limits``: the A map lengths.  Axes whose padded sample counts differ are
    built one at a time (each keeps its own padding).  Returns a list of A axes.
    """
    A = start.shape[0]
    bin_size = size / cdt.type(pooled)
    if sample_ratio > 0:  # every bin: sample_ratio points (no rois: a padded 1)
        grid = None
        gmaxes = [int(sample_ratio) if size.shape[-1] else 1] * A
    else:
        grid = xp.maximum(xp.ceil(size / cdt.type(pooled)), 0).astype(np.int32)
        gmaxes = [max(int(g), 1) for g in (grid.max(axis=1).tolist() if grid.size
                                           else [0] * A)]
    if len(set(gmaxes)) > 1 and max(gmaxes) - min(gmaxes) > 8:  # one axis at a time
        return [_align_samples(start[k], bin_size[k], grid[k], gmaxes[k], pooled, limits[k],
                               xp, cdt)
                for k in range(A)]
    if A == 1:
        return [_align_samples(start[0], bin_size[0], None if grid is None else grid[0],
                               gmaxes[0], pooled, limits[0], xp, cdt)]
    axes = _align_samples(start, bin_size, grid, max(gmaxes), pooled,
                          xp.asarray(limits, dtype=np.int32).reshape(A, 1, 1, 1), xp, cdt)
    # padded to the larger count in one pass, then each axis cut to its own (a point's
    # values do not depend on the padding)
    return [ax if g == max(gmaxes) else _cut_samples(ax, g, xp) for ax, g in zip(axes, gmaxes)]


def _cut_samples(ax, g, xp) -> SampleAxis:
    """``ax`` with its sample tables cut to the first ``g`` points of each bin."""
    cut = [xp.ascontiguousarray(a[..., :g]) for a in (ax.coord, ax.low, ax.high, ax.w_low,
                                                      ax.w_high)]
    return SampleAxis(ax.count, *cut)


def _align_samples(start, bin_size, grid, gmax, pooled, limit, xp, cdt):
    """:func:`_align_axes` for one axis (``start``, ``bin_size``, ``grid`` (R,), ``limit``
    an int; returns a SampleAxis) or stacked axes sharing the padded sample count
    ``gmax`` ((A, R), ``limit`` (A, 1, 1, 1); returns a list of A).  ``grid`` None: a
    fixed sample_ratio, ``gmax`` points in every bin (no padding)."""
    _check_samples(gmax * pooled)
    padded = grid is not None
    i = xp.arange(pooled, dtype=cdt)
    # y = start + p*bin + (iy + .5) * bin / grid   (operation order as in Caffe2/MXNet)
    first = start[..., None] + i * bin_size[..., None]                    # (..., R, P)
    g = xp.arange(gmax, dtype=cdt) + cdt.type(0.5)
    step = g * bin_size[..., None, None]
    if padded:
        step /= xp.maximum(grid, 1).astype(cdt)[..., None, None]
    else:  # the same division by a scalar
        step /= cdt.type(gmax)
    if gmax <= 4:  # (..., R, P, G) a point at a time: broadcasting G <= 4 wide is slow
        coord = xp.empty(first.shape + (gmax,), dtype=cdt)
        for k in range(gmax):
            xp.add(first, step[..., k], out=coord[..., k])
    else:
        coord = first[..., None] + step                                   # (..., R, P, G)
    if padded:
        count = xp.broadcast_to(grid[..., None], grid.shape + (pooled,)).astype(np.int32)
    else:  # a fixed sample_ratio: gmax in every bin
        count = xp.full(start.shape + (pooled,), gmax, dtype=np.int32)
    low, high, w_low, w_high = bilinear_axis(coord, limit, xp)
    if padded:  # padding past a bin's count: no tap, weight 0
        # (x * 1 is x; a weight, >= 0, times 0 is +0: the bits of a where)
        live = xp.arange(gmax, dtype=np.int32) < count[..., None]
        for a in (low, high, w_low, w_high):
            xp.multiply(a, live, out=a)
    # (a fixed sample_ratio gives every bin gmax samples: no padding)
    if start.ndim == 1:
        return SampleAxis(count, coord, low, high, w_low, w_high)
    return [SampleAxis(count[k], coord[k], low[k], high[k], w_low[k], w_high[k])
            for k in range(start.shape[0])]


# --------------------------------------------------------------------------- legacy modes
# Two layers of old forks, expressed purely through the SampleGrid tables so that every
# backend (NumPy, CUDA, emulated CUDA) runs them with its generic max / avg kernel.


def _caffe_axis(start, end, pooled, limit, xp, cdt, first_tap_is_ceil) -> SampleAxis:
    """One axis of the Caffe ``ROIAlignForward`` kernel (float bins, unit-step points).

    ``first_tap_is_ceil`` puts ``ceil`` in ``low`` (the y axis: the kernel sums the taps
    top-left, top-right, bottom-left, bottom-right with ``y_top = ceil(h)``), so the generic
    kernel's ``(w1*v(yl,xl) + w2*v(yl,xh)) + w3*v(yh,xl) + w4*v(yh,xh)`` adds them in the
    kernel's order.  ``low``/``high`` are then not ordered: they are simply tap 1 and tap 2.
    """
    one, zero = cdt.type(1), cdt.type(0)
    size = (end - start) + one                     # roi_width = x2*s - x1*s + 1 (no clamp)
    bin_size = size / cdt.type(pooled)
    i = xp.arange(pooled, dtype=cdt)
    lo = i[None, :] * bin_size[:, None]
    hi = (i[None, :] + one) * bin_size[:, None]
    lim = cdt.type(limit)
    lo = xp.minimum(xp.maximum(lo + start[:, None], zero), lim).astype(cdt)
    hi = xp.minimum(xp.maximum(hi + start[:, None], zero), lim).astype(cdt)
    # for (h = hstart; h < hend; h += 1.): accumulate in the compute dtype, step by step
    # (hstart + k differs in the last bit once the sum crosses a power of two).
    coords, lives = [], []
    cur = lo
    live = cur < hi
    while bool(live.any()):
        coords.append(cur)
        lives.append(live)
        cur = (cur + one).astype(cdt)
        live = live & (cur < hi)
        _check_samples(len(coords))
    if not coords:  # every bin empty: one padding sample
        coords, lives = [lo], [xp.zeros(lo.shape, dtype=bool)]
    coord = xp.stack(coords, axis=2).astype(cdt)      # (R, P, G)
    alive = xp.stack(lives, axis=2)
    count = alive.sum(axis=2).astype(np.int32)
    fl_i = xp.floor(coord)
    ce_i = xp.ceil(coord)
    fl, ce = fl_i.astype(np.int32), ce_i.astype(np.int32)
    # weights exactly as written: (1 - w + x_left) and (1 - x_right + w)
    w_fl = ((one - coord) + fl_i).astype(cdt)
    w_ce = ((one - ce_i) + coord).astype(cdt)
    if first_tap_is_ceil:
        t1, t2, w1, w2 = ce, fl, w_ce, w_fl
    else:
        t1, t2, w1, w2 = fl, ce, w_fl, w_ce
    # a tap is used only if inside [0, limit-1]; otherwise weight 0, its index that of the
    # other tap when that one is inside (so the weight-0 read adds nothing new: a NaN
    # elsewhere on the map cannot leak in as 0 * NaN), else 0
    in1 = alive & (t1 >= 0) & (t1 <= limit - 1)
    in2 = alive & (t2 >= 0) & (t2 <= limit - 1)
    t1, t2 = (xp.where(in1, t1, xp.where(in2, t2, 0)).astype(np.int32),
              xp.where(in2, t2, xp.where(in1, t1, 0)).astype(np.int32))
    w1 = xp.where(in1, w1, zero).astype(cdt)
    w2 = xp.where(in2, w2, zero).astype(cdt)
    return SampleAxis(count, coord, t1, t2, w1, w2)


def caffe_align_grid(rois, pooled_size, spatial_scale, height, width, xp=np) -> SampleGrid:
    """Sample points of the old Caffe/MXNet-fork ``ROIAlign`` (``legacy='caffe'``, max mode).

    Kernel ``ROIAlignForward`` of caffe-faster-rcnn's ``roi_align_layer.cu`` (ported to
    MXNet by forks): float box ``x1*s .. x2*s`` with size ``x2*s - x1*s + 1`` (no clamp: a
    reversed box gives empty bins), bins ``[p*bin + start, (p+1)*bin + start)`` clipped to
    ``[0, height]``, points ``hstart, hstart+1, ...`` while ``< hend`` (sequential float
    accumulation), taps ``floor``/``ceil`` each kept only inside the map with weights
    ``1 - w + floor(w)`` and ``1 - ceil(w) + w`` -- so an integer coordinate gives both
    (identical) taps weight 1 and counts the value twice per axis.  A bin with no point is 0.

    Tables: ``y.low`` is the *ceil* row (``y_top``) and ``y.high`` the floor row, so the
    generic sample sum adds the four taps in the kernel's order; ``x.low`` is the floor
    column.  ``divisor`` = number of points (unused by the max kernel).
    """
    cdt = compute_dtype(rois.dtype)
    r = rois.astype(cdt)
    s = _scale(spatial_scale, cdt)
    x1, y1, x2, y2 = (r[:, k] * s for k in (1, 2, 3, 4))
    ay = _caffe_axis(y1, y2, pooled_size[0], height, xp, cdt, True)
    ax = _caffe_axis(x1, x2, pooled_size[1], width, xp, cdt, False)
    divisor = xp.maximum(ay.count[:, :, None] * ax.count[:, None, :], 1).astype(cdt)
    return SampleGrid(batch_index(rois, xp), ay, ax, divisor)


def _rfcn_axis(start, end, pooled, sample_num, limit, xp, cdt) -> SampleAxis:
    """One axis of R-FCN-PSROIAlign's ``PSROIAlignForward`` (interior points, clipped bins)."""
    zero = cdt.type(0)
    size = xp.maximum(end - start, cdt.type(0.1))     # "force too small ROIs": 0.1
    bin_size = size / cdt.type(pooled)
    i = xp.arange(pooled, dtype=cdt)
    last = cdt.type(limit - 1)
    lo = xp.minimum(xp.maximum(i[None, :] * bin_size[:, None] + start[:, None], zero), last)
    hi = xp.minimum(xp.maximum((i[None, :] + cdt.type(1)) * bin_size[:, None] + start[:, None],
                               zero), last)
    step = bin_size / cdt.type(sample_num + 1)
    k = xp.arange(1, sample_num + 1, dtype=cdt)
    # cur = hstart + i * sample_h, i = 1..sample_num; skipped once cur >= hend.  The kernel
    # "continue"s per point, but cur grows with i, so the kept points are a prefix: a count.
    coord = (lo[:, :, None] + k[None, None, :] * step[:, None, None]).astype(cdt)
    count = (coord < hi[:, :, None]).sum(axis=2).astype(np.int32)
    # bilinear_interpolate: outside if < -0.5 or > limit - 0.5 (never reached here: points
    # lie in [0, limit-1)), clamp <= 0 to 0, low = (int), snap at limit-1.
    low, high, w_low, w_high = bilinear_axis(coord, limit, xp, valid_lo=-0.5)
    outside = coord > cdt.type(limit - 0.5)
    g = xp.arange(sample_num, dtype=np.int32)
    live = (g[None, None, :] < count[:, :, None]) & ~outside
    return SampleAxis(count, coord,
                      xp.where(live, low, 0).astype(np.int32),
                      xp.where(live, high, 0).astype(np.int32),
                      xp.where(live, w_low, zero).astype(cdt),
                      xp.where(live, w_high, zero).astype(cdt))


def rfcn_align_grid(rois, pooled_size, spatial_scale, sample_num, height, width,
                    xp=np) -> SampleGrid:
    """Sample points of R-FCN-PSROIAlign (``legacy='rfcn'``, average mode).

    Kernel ``PSROIAlignForward`` of afantideng/R-FCN-PSROIAlign: box ``x1*s .. (x2+1)*s``,
    size at least 0.1, bins clipped to ``[0, height-1]`` (so a map one cell high gives 0),
    ``sample_num`` interior points ``hstart + i*bin/(sample_num+1)``, ``i = 1..sample_num``,
    dropped when ``>= hend``; MXNet/Detectron bilinear rule (clamp at 0, snap at the last
    cell); the sum is divided by ``sample_num**2`` whatever the number of points kept.
    """
    if int(sample_num) < 1:
        raise ValueError(f"sample_num must be >= 1, got {sample_num}")
    cdt = compute_dtype(rois.dtype)
    r = rois.astype(cdt)
    s = _scale(spatial_scale, cdt)
    one = cdt.type(1)
    x1, y1 = r[:, 1] * s, r[:, 2] * s
    x2, y2 = (r[:, 3] + one) * s, (r[:, 4] + one) * s
    n = int(sample_num)
    ay = _rfcn_axis(y1, y2, pooled_size[0], n, height, xp, cdt)
    ax = _rfcn_axis(x1, x2, pooled_size[1], n, width, xp, cdt)
    R, P, Q = ay.count.shape[0], ay.count.shape[1], ax.count.shape[1]
    divisor = xp.full((R, P, Q), n * n, dtype=cdt)
    return SampleGrid(batch_index(rois, xp), ay, ax, divisor)


__all__ += ["caffe_align_grid", "rfcn_align_grid"]


# ---- rotated boxes (RROIAlign) --------------------------------------------------------
#: Most bilinear samples of one RROIAlign bin: MAX_SAMPLES_PER_BIN (its tables clip there)
MAX_ROTATED_SAMPLES = MAX_SAMPLES_PER_BIN


@dataclass
class RotatedGrid:
    """Bilinear sample points of rotated bins: they do not split into a y and an x axis,
    so every sample of every bin has its own taps and weights.

    Attributes
    ----------
    batch : (R,) int32
    count : (R,) int32          samples of each of the roi's bins (gy * gx)
    divisor : (R,)              what a bin's sum is divided by: max(count, 1)
    y, x : (R, P, Q, G)         sample points in feature-map cells before the bilinear
                                 rule's clamp (pictures); 0 for the padding k >= count
    y_low, y_high, x_low, x_high : (R, P, Q, G) int32   the taps
    w1, w2, w3, w4 : (R, P, Q, G)   weights of taps (yl, xl), (yl, xh), (yh, xl), (yh, xh);
                                 all 0 for out-of-map samples and the padding
    """

    batch: Any
    count: Any
    divisor: Any
    y: Any
    x: Any
    y_low: Any
    y_high: Any
    x_low: Any
    x_high: Any
    w1: Any
    w2: Any
    w3: Any
    w4: Any


_LIBM = None


def _libm_cos_sin(theta):
    """cos and sin of ``theta`` (float32 or float64) as the C library gives them: ``cosf``
    / ``sinf`` for float32 (MXNet's built-in and our kernels call them; NumPy's float32 cos
    differs in 17% of the last bits, cos in double rounded to float in about 1%), ``cos`` /
    ``sin`` for float64 (NumPy's own float64 sin differs from it too)."""
    global _LIBM
    if theta.dtype == np.float64:
        values = theta.tolist()
        return (np.array([math.cos(t) for t in values], np.float64),
                np.array([math.sin(t) for t in values], np.float64))
    if _LIBM is None:
        import ctypes
        import ctypes.util
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name in ("cosf", "sinf"):
            getattr(lib, name).restype = ctypes.c_float
            getattr(lib, name).argtypes = [ctypes.c_float]
        _LIBM = lib
    values = theta.tolist()
    return (np.array([_LIBM.cosf(t) for t in values], np.float32),
            np.array([_LIBM.sinf(t) for t in values], np.float32))


def rotated_boxes(rois, spatial_scale, sampling_ratio, aligned, clockwise, pooled_size):
    """Per-roi quantities of RROIAlign in the compute dtype, MXNet's operation order
    (``rroi_align.cc``): ``(cy, cx, cos, sin, start_h, start_w, bin_h, bin_w, gy, gx)``,
    each (R,); gy, gx int64 (samples per bin side).

    rois (R, 6) = (batch, x_center, y_center, width, height, angle in degrees); MXNet
    forces a box to at least 1x1 cell; ``aligned`` (Detectron2's ROIAlignRotated) shifts
    the centre by -0.5 and does not; ``clockwise`` (mmcv's) negates the angle."""
    cdt = compute_dtype(rois.dtype)
    r = rois.astype(cdt)
    s = _scale(spatial_scale, cdt)
    off = cdt.type(0.5) if aligned else cdt.type(0)
    cx, cy = r[:, 1] * s - off, r[:, 2] * s - off
    w, h = r[:, 3] * s, r[:, 4] * s
    # MXNet: DType theta = rois[5] * M_PI / 180.0, in double
    theta = (rois[:, 5].astype(np.float64) * np.pi / 180.0).astype(cdt)
    if clockwise:
        theta = -theta
    cos, sin = _libm_cos_sin(theta)
    if not aligned:  # "force malformed ROIs to be 1 * 1"
        w, h = np.maximum(w, cdt.type(1)), np.maximum(h, cdt.type(1))
    P, Q = int(pooled_size[0]), int(pooled_size[1])
    bin_h, bin_w = h / cdt.type(P), w / cdt.type(Q)
    if sampling_ratio > 0:
        gy = np.full(r.shape[0], int(sampling_ratio), np.int64)
        gx = gy.copy()
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            # (a reversed box, aligned: no 1x1 floor, has no samples)
            gy = np.clip(np.ceil(h / cdt.type(P)), 0, MAX_ROTATED_SAMPLES).astype(np.int64)
            gx = np.clip(np.ceil(w / cdt.type(Q)), 0, MAX_ROTATED_SAMPLES).astype(np.int64)
    return cy, cx, cos, sin, -h / cdt.type(2), -w / cdt.type(2), bin_h, bin_w, gy, gx


def rotated_grid(rois, pooled_size, spatial_scale, sampling_ratio, aligned, clockwise,
                 height, width, xp=np) -> RotatedGrid:
    """RROIAlign's sample points (:class:`RotatedGrid`), in MXNet's operation order.

    Bin (p, q) of a roi holds gy x gx samples, sample (iy, ix) (k = iy * gx + ix) at box
    coordinates ``yy = start_h + p*bin_h + (iy + .5)*bin_h/gy`` (xx alike), rotated about
    the centre: ``x = xx*cos + yy*sin + cx``, ``y = yy*cos - xx*sin + cy``; then ROIAlign's
    bilinear rule (outside [-1, H] x [-1, W]: no sample, else clamped to the map).  The
    kernels derive the same points in ``operators/rroi_align.cu`` (``rotated_box``,
    ``rotated_sample``); a test proves the two equal bit for bit.  NumPy only (``xp``).
    """
    cdt = compute_dtype(rois.dtype)
    P, Q = int(pooled_size[0]), int(pooled_size[1])
    R = rois.shape[0]
    cy, cx, cos, sin, start_h, start_w, bin_h, bin_w, gy, gx = rotated_boxes(
        rois, spatial_scale, sampling_ratio, aligned, clockwise, pooled_size)
    count = gy * gx
    G = int(count.max()) if R else 0
    k = np.arange(G, dtype=np.int64)[None, :]                        # (1, G)
    valid = k < count[:, None]                                       # (R, G)
    gxs = np.maximum(gx, 1)[:, None]
    iy, ix = k // gxs, k % gxs
    half = np.float32(0.5)
    with np.errstate(divide="ignore", invalid="ignore"):  # an empty grid: padding only
        fy = ((iy.astype(np.float32) + half).astype(cdt) * bin_h[:, None]) / \
            gy[:, None].astype(cdt)
        fx = ((ix.astype(np.float32) + half).astype(cdt) * bin_w[:, None]) / \
            gx[:, None].astype(cdt)
    p = np.arange(P, dtype=cdt)[None, :, None]
    q = np.arange(Q, dtype=cdt)[None, :, None]
    yy = ((start_h[:, None, None] + p * bin_h[:, None, None]) + fy[:, None, :])[:, :, None, :]
    xx = ((start_w[:, None, None] + q * bin_w[:, None, None]) + fx[:, None, :])[:, None, :, :]
    c, s = cos[:, None, None, None], sin[:, None, None, None]
    x = (xx * c + yy * s) + cx[:, None, None, None]                  # (R, P, Q, G)
    y = (yy * c - xx * s) + cy[:, None, None, None]
    # NaN is outside (an overflowing box), as in bilinear_axis
    keep = (y >= -1) & (y <= height) & (x >= -1) & (x <= width) & valid[:, None, None, :]
    taps, weights = [], []
    for v, limit in ((y, height), (x, width)):
        v = np.where(v <= 0, cdt.type(0), v)
        lo = np.trunc(np.where(keep, v, 0)).astype(np.int32)
        top = lo >= limit - 1
        lo = np.where(top, np.int32(limit - 1), lo)
        hi = np.where(top, lo, lo + 1).astype(np.int32)
        v = np.where(top, lo.astype(cdt), v)
        lw = v - lo.astype(cdt)
        taps.append((np.where(keep, lo, 0).astype(np.int32),
                     np.where(keep, hi, 0).astype(np.int32)))
        weights.append((cdt.type(1) - lw, lw))
    (hy, ly), (hx, lx) = weights
    zero = cdt.type(0)
    w = [np.where(keep, a * b, zero) for a, b in ((hy, hx), (hy, lx), (ly, hx), (ly, lx))]
    pad = np.broadcast_to(~valid[:, None, None, :], y.shape)
    y[pad] = 0
    x[pad] = 0
    return RotatedGrid(batch_index(rois, xp), count.astype(np.int32),
                       np.maximum(count, 1).astype(cdt), y, x, taps[0][0], taps[0][1],
                       taps[1][0], taps[1][1], *w)


# ---- precise pooling (PrRoIPool) ---------------------------------------------------------
@dataclass
class IntegralAxis:
    """PrRoIPool's bins along one axis: each bin's window [lo, hi] of the bilinear surface
    and, for the map nodes it touches, the exact integral of their hat function over it.

    Attributes
    ----------
    start, count : (R, P) int32   first node and number of nodes (clipped to the map)
    weight : (R, P, K)   integral over the window of max(0, 1 - |t - node|), padding 0
    edge_lo, edge_hi : (R, P, K)   the hat values at the window's two ends (the roi
                                   gradient), padding 0
    """

    start: Any
    count: Any
    weight: Any
    edge_lo: Any
    edge_hi: Any


@dataclass
class PreciseBins:
    """PrRoIPool's geometry: ``batch`` (R,) int32, ``area`` (R,) of a bin (0: output 0),
    ``bin_size`` (R, 2) = (bh, bw), ``y`` / ``x`` :class:`IntegralAxis` over P / Q bins."""

    batch: Any
    area: Any
    bin_size: Any
    y: Any
    x: Any


def hat_antiderivative(t, cdt):
    """``F(t) = t - t|t|/2`` of ``clip(t, -1, 1)``: the integral of max(0, 1 - |u|) from 0
    to t (the compiled ``hat_integral`` uses the same operations)."""
    t = np.minimum(np.maximum(t, cdt.type(-1)), cdt.type(1))
    return t - (t * np.abs(t)) * cdt.type(0.5)


def _integral_axis(lo, size, pooled, limit, cdt) -> IntegralAxis:
    """Windows ``lo + p*size .. + size`` (lo, size (R,)) over nodes 0..limit-1."""
    p = np.arange(pooled, dtype=cdt)[None, :]
    a = lo[:, None] + size[:, None] * p                              # (R, P) window start
    b = a + size[:, None]                                            # window end
    top = cdt.type(limit - 1)
    first = np.fmin(np.fmax(np.floor(a), cdt.type(0)), top).astype(np.int32)
    last = np.fmin(np.fmax(np.ceil(b), cdt.type(0)), top).astype(np.int32)
    count = np.maximum(last - first + 1, 0).astype(np.int32)
    K = int(count.max()) if count.size else 0
    node = first[..., None] + np.arange(K, dtype=np.int32)           # (R, P, K)
    live = np.arange(K)[None, None, :] < count[..., None]
    nf = node.astype(cdt)
    u, v = a[..., None] - nf, b[..., None] - nf
    zero = cdt.type(0)
    with np.errstate(invalid="ignore", over="ignore"):
        weight = hat_antiderivative(v, cdt) - hat_antiderivative(u, cdt)
        hat = [np.maximum(cdt.type(1) - np.abs(t), zero) for t in (u, v)]
    return IntegralAxis(first, count, np.where(live, weight, zero),
                        np.where(live, hat[0], zero), np.where(live, hat[1], zero))


def precise_bins(rois, pooled_size, spatial_scale, height, width) -> PreciseBins:
    """PrRoIPool's bins (Jiang et al., ECCV 2018, as in its reference code and mmcv): the
    box scaled by ``spatial_scale`` (no half-pixel offset), a reversed box has size 0, bin
    (p, q) the window ``y1 + p*bh .. + bh`` x ``x1 + q*bw .. + bw`` with ``bh = h / P``,
    area ``bw * bh``.  The bilinear surface has the map's values at integer nodes (0
    beyond the map), so a bin's integral is ``sum_ij f_ij * wy_i * wx_j`` with the hat
    integrals of :class:`IntegralAxis`.  The kernels (``operators/prroi_pool.cu``) derive
    the same numbers; a test proves them equal bit for bit.  NumPy only."""
    cdt = compute_dtype(rois.dtype)
    r = rois.astype(cdt)
    s = _scale(spatial_scale, cdt)
    x1, y1, x2, y2 = r[:, 1] * s, r[:, 2] * s, r[:, 3] * s, r[:, 4] * s
    zero = cdt.type(0)
    h, w = np.maximum(y2 - y1, zero), np.maximum(x2 - x1, zero)
    P, Q = int(pooled_size[0]), int(pooled_size[1])
    bh, bw = h / cdt.type(P), w / cdt.type(Q)
    with np.errstate(over="ignore"):
        area = np.maximum(bw * bh, zero)
    return PreciseBins(batch_index(rois), area, np.stack([bh, bw], axis=1),
                       _integral_axis(y1, bh, P, height, cdt),
                       _integral_axis(x1, bw, Q, width, cdt))
@dataclass
class DeformableSamples:
    """Sample points of DeformablePSROIPooling (Deformable R-FCN, Dai et al. 2017).

    For roi r, offset class k, bin (p, q) and sample index s < S: the clamped coordinate
    ``y[r, k, p, q, s]`` of sample row s and ``x[r, k, p, q, s]`` of sample column s,
    and whether each lies inside ``[-0.5, H - 0.5]`` (``y_in``) / ``[-0.5, W - 0.5]``
    (``x_in``; NaN is outside): sample (i, j) is used iff ``y_in[..., i] & x_in[..., j]``.
    ``roi_h``/``roi_w`` (R,) are the box sizes (the offsets' gradient scales with them),
    ``batch`` (R,) the image (negative: a padding roi).  Compute dtype.
    """

    batch: Any
    y: Any
    x: Any
    y_in: Any
    x_in: Any
    roi_h: Any
    roi_w: Any


def deformable_part(pooled: int, part: int, cdt) -> np.ndarray:
    """Part cell of each bin: ``floor(p / pooled * part)`` in the compute dtype. (pooled,)"""
    cdt = np.dtype(cdt)
    return np.floor(np.arange(pooled).astype(cdt) / cdt.type(pooled)
                    * cdt.type(part)).astype(np.int64)


def deformable_group(pooled: int, group: int, cdt) -> np.ndarray:
    """Group cell of each bin: ``floor(p * group / pooled)`` in [0, group - 1]. (pooled,)"""
    cdt = np.dtype(cdt)
    g = np.floor(np.arange(pooled).astype(cdt) * cdt.type(group)
                 / cdt.type(pooled)).astype(np.int64)
    return np.clip(g, 0, group - 1)


def deformable_samples(rois, trans, pooled_size, part_size, sample_per_part, spatial_scale,
                       trans_std, height, width, xp=np) -> DeformableSamples:
    """Sample grid of ``contrib.DeformablePSROIPooling`` for rois (R, 5) and offsets
    ``trans`` (R, 2K, part, part), or None (``no_trans``: K = 1, no offsets).

    MXNet's CPU kernel, operation by operation in the compute dtype: corners C-rounded,
    box ``round(x1) * s - 0.5 .. (round(x2) + 1) * s - 0.5``, sizes at least 0.1,
    ``bin = size / pooled``, ``sub = bin / sample_per_part``; bin (p, q) of class k
    starts at ``q * bin_w + x_start``, then ``+ trans[r, 2k, u, v] * trans_std * roi_w``
    (part cell ``u = floor(p / pooled * part)``, ``v`` likewise; y with ``2k + 1``);
    sample j at ``start + j * sub``.  ``spatial_scale`` and ``trans_std`` are C floats.
    The compiled twin is ``operators/deformable_psroi_pooling.cu`` (``deform_*``).
    """
    cdt = compute_dtype(rois.dtype)
    r = rois.astype(cdt)
    s = _scale(spatial_scale, cdt)
    tstd = _scale(trans_std, cdt)
    half, one, least = cdt.type(0.5), cdt.type(1), cdt.type(0.1)
    P = Q = int(pooled_size)
    S, part = int(sample_per_part), int(part_size)
    sw, sh = c_round(r[:, 1], xp) * s - half, c_round(r[:, 2], xp) * s - half
    ew = (c_round(r[:, 3], xp) + one) * s - half
    eh = (c_round(r[:, 4], xp) + one) * s - half
    w, h = ew - sw, eh - sh
    roi_w = xp.where(w < least, least, w)   # std::max(size, 0.1)
    roi_h = xp.where(h < least, least, h)
    bin_h, bin_w = roi_h / cdt.type(P), roi_w / cdt.type(Q)
    sub_h, sub_w = bin_h / cdt.type(S), bin_w / cdt.type(S)
    R = r.shape[0]
    if trans is None:
        tx = ty = xp.zeros((R, 1, P, Q), cdt)
    else:
        t = trans.astype(cdt)
        u = deformable_part(P, part, cdt)[:, None]
        v = deformable_part(Q, part, cdt)[None, :]
        tx, ty = t[:, 0::2][:, :, u, v] * tstd, t[:, 1::2][:, :, u, v] * tstd   # (R, K, P, Q)

    def axis(n, bin_, start, size, offset, sub, limit, bins_last):
        idx = xp.arange(n).astype(cdt)
        pos = (idx[None, :] * bin_[:, None] + start[:, None])                     # (R, n)
        pos = pos[:, None, None, :] if bins_last else pos[:, None, :, None]
        pos = pos + offset * size[:, None, None, None]                            # (R, K, P, Q)
        v = pos[..., None] + xp.arange(S).astype(cdt) * sub[:, None, None, None, None]
        v64 = v.astype(np.float64)
        inside = (v64 >= -0.5) & (v64 <= limit - 0.5)
        c = xp.where(v < 0, cdt.type(0), v)
        c = xp.where(cdt.type(limit - 1) < c, cdt.type(limit - 1), c)
        return c, inside

    x, x_in = axis(Q, bin_w, sw, roi_w, tx, sub_w, width, True)
    y, y_in = axis(P, bin_h, sh, roi_h, ty, sub_h, height, False)
    return DeformableSamples(batch_index(rois, xp), y, x, y_in, x_in, roi_h, roi_w)


__all__ += ["DeformableSamples", "deformable_samples", "deformable_part", "deformable_group"]
