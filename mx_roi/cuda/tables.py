"""Geometry tables (mx_roi.geometry) as kernel arguments: contiguous, exact dtypes.

The kernels read the tables exactly as :mod:`mx_roi.geometry` builds them (no geometry
is re-derived on the device); these helpers only fix layout and dtype.
"""
from __future__ import annotations

__all__ = ["sample_grid_args", "int_bins_args"]


def sample_grid_args(launch, geo, with_count=True, with_divisor=True):
    """``batch, y_count, y_low, y_high, y_wl, y_wh, x_count, ..., divisor`` of a SampleGrid
    (counts/divisor left out on request) and the padded sample counts ``(Gy, Gx)``."""
    L = launch
    args = [L.ints(geo.batch)]
    for axis in (geo.y, geo.x):
        if with_count:
            args.append(L.ints(axis.count))
        args += [L.ints(axis.low), L.ints(axis.high), L.reals(axis.w_low), L.reals(axis.w_high)]
    if with_divisor:
        args.append(L.reals(geo.divisor))
    return args, (L.i32(geo.y.low.shape[2]), L.i32(geo.x.low.shape[2]))


def int_bins_args(launch, bins):
    """``batch, hstart, hend, wstart, wend`` of IntBins as int32 arrays."""
    L = launch
    return [L.ints(bins.batch)], [L.ints(bins.hstart), L.ints(bins.hend), L.ints(bins.wstart),
                                  L.ints(bins.wend)]
