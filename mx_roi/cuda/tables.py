"""Geometry tables (mx_roi.geometry) as kernel arguments, by the kernels' parameter names.

The kernels read the tables exactly as :mod:`mx_roi.geometry` builds them (no geometry
is re-derived on the device).  These helpers only name them: ``Launch.forward``/
``backward`` (:mod:`mx_roi.cuda.backend`) binds each to the kernel parameter of that name
(tables a kernel does not take are left out) and fixes layout and dtype.
"""
from __future__ import annotations

__all__ = ["sample_grid_tables", "int_bins_tables"]


def sample_grid_tables(geo) -> dict:
    """A SampleGrid as ``batch``, ``y_count``, ``y_low``, ``y_high``, ``y_wl``, ``y_wh``,
    ``x_*`` (same), ``divisor`` and its sizes ``P``, ``Q`` and ``Gy``, ``Gx`` (the padded
    sample counts per bin side)."""
    _, P, Q = geo.divisor.shape
    tables = {"batch": geo.batch, "divisor": geo.divisor, "P": P, "Q": Q,
              "Gy": geo.y.low.shape[2], "Gx": geo.x.low.shape[2]}
    for prefix, axis in (("y", geo.y), ("x", geo.x)):
        tables.update({f"{prefix}_count": axis.count, f"{prefix}_low": axis.low,
                       f"{prefix}_high": axis.high, f"{prefix}_wl": axis.w_low,
                       f"{prefix}_wh": axis.w_high})
    return tables


def int_bins_tables(bins) -> dict:
    """IntBins as ``batch``, ``hstart``, ``hend``, ``wstart``, ``wend`` and the pooled grid
    ``P``, ``Q``."""
    return {"batch": bins.batch, "hstart": bins.hstart, "hend": bins.hend,
            "wstart": bins.wstart, "wend": bins.wend, "P": bins.hstart.shape[1],
            "Q": bins.wstart.shape[1]}
