"""What the pictures draw, read from the op's geometry tables (no matplotlib needed).

:func:`sampling_coords` calls ``op.geometry(rois, H, W, numpy)`` once and copies the
tables of the one roi into a dict of NumPy arrays; :func:`mx_roi.viz.plot_sampling`
draws *only* from that dict, and ``tests/test_viz.py`` compares it (and the drawn
artists) with :mod:`mx_roi.geometry`.  Nothing here re-implements a bin or a sample rule.

Coordinate frames
-----------------
* Pooling tables are integer cells: cell ``(h, w)`` is the unit square
  ``[w, w+1] x [h, h+1]`` in the picture.
* Sample coordinates (``SampleAxis.coord``) have pixel *centres* at integers (the
  bilinear taps of a sample at ``x`` are ``floor(x)`` and ``floor(x)+1``), so a sample
  is drawn at ``coord + PIXEL_CENTRE``: in the centre of the cell when it lands on a tap.
* ``roi_scaled = roi[1:] * spatial_scale`` is the *input* box on the map (drawn dashed,
  for reference only; every bin, cell and sample comes from the tables).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PIXEL_CENTRE", "make_op", "default_feature_shape", "sampling_coords", "to_jsonable",
           "is_align", "is_position_sensitive"]

#: A sample coordinate ``c`` (pixel centres at integers) is drawn at ``c + PIXEL_CENTRE``.
PIXEL_CENTRE = 0.5


def _registry():
    from mx_roi.registry import REGISTERED
    return dict(REGISTERED)


def make_op(op, **params):
    """An op instance from an instance, an op class or an op name (+ its parameters)."""
    if isinstance(op, str):
        table = _registry()
        lookup = {k.lower(): v for k, v in table.items()}
        if op.lower() not in lookup:
            raise ValueError(f"unknown op {op!r}; one of {', '.join(table)}")
        op = lookup[op.lower()]
    if isinstance(op, type):
        return op(op.param_cls.from_kwargs(**params))
    if params:
        raise TypeError("parameters are given either in the op instance or as keywords, not both")
    if not hasattr(op, "geometry") or not hasattr(op, "param"):
        raise TypeError(f"not an mx_roi op: {op!r}")
    return op


def is_align(op) -> bool:
    return hasattr(op.param, "sample_ratio") or hasattr(op.param, "sample_num")


def is_position_sensitive(op) -> bool:
    return hasattr(op, "channel_map")


def _roi_array(roi, columns=5, layout="(batch, x1, y1, x2, y2)") -> np.ndarray:
    """One roi of an op's layout (``columns`` values; the batch index may be left out)."""
    r = np.asarray(roi, dtype=np.float32).reshape(-1)
    if r.size == columns - 1:
        r = np.concatenate([np.zeros(1, np.float32), r])
    if r.size != columns:
        raise ValueError(f"roi must be {layout}, with or without the batch index, got {roi!r}")
    return r


def default_feature_shape(roi, spatial_scale) -> Tuple[int, int]:
    """A map just large enough to contain the (scaled) box, plus one cell."""
    r = np.asarray(roi, np.float64).reshape(-1)
    if r.size == 6:  # rotated (batch, cx, cy, w, h, angle): its circle
        reach = math.hypot(r[3], r[4]) / 2
        r = np.array([0, r[1] - reach, r[2] - reach, r[1] + reach, r[2] + reach])
    r = _roi_array(r).astype(np.float64)
    s = float(np.float32(spatial_scale))
    h = max(1, int(math.ceil(max(r[2], r[4]) * s)) + 1)
    w = max(1, int(math.ceil(max(r[1], r[3]) * s)) + 1)
    return h, w


def _bin_edges(op, rois, height, width):
    """(P, 2) and (Q, 2) bin edges of an align op, in sample coordinates.

    Read from the op's own geometry with ``sample_ratio=2``: a bin's two samples sit at
    ``lo + b/4`` and ``lo + 3b/4``, so its edges are ``s0 - (s1-s0)/2`` and
    ``s1 + (s1-s0)/2``.  (Same geometry function, only the sample count changed.)
    """
    p = op.param
    if getattr(p, "legacy", ""):
        return None, None
    probe = type(op)(dataclasses.replace(p, sample_ratio=2))
    g = probe.geometry(rois, height, width, np)
    out = []
    for axis in (g.y, g.x):
        c = axis.coord[0].astype(np.float64)
        half = (c[:, 1] - c[:, 0]) / 2.0
        out.append(np.stack([c[:, 0] - half, c[:, 1] + half], axis=1))
    return out[0], out[1]


def is_deformable(op) -> bool:
    """Whether the op's samples move with an offset input (DeformablePSROIPooling)."""
    return hasattr(op, "samples")


def _deformable_coords(op, rois, H, W, channel, trans, out):
    """The samples of a deformable op (``geometry.deformable_samples``) for output
    ``channel``: ``samples`` (S, 2) = (y, x) clamped to the map, bin-major then (i, j);
    ``sample_bin`` (S, 2); ``outside`` (S,) samples skipped (off the map); ``bin_y`` /
    ``bin_x`` (P, 2) / (Q, 2) the box's regular bins (before the offsets); ``trans``."""
    p = op.param
    P = p.pooled_size
    if not 0 <= channel < p.output_dim:
        raise ValueError(f"channel {channel} out of range: output_dim = {p.output_dim}")
    t = None
    if not p.no_trans:
        t = np.zeros((1, 2, p.part, p.part), np.float32) if trans is None else \
            np.asarray(trans, np.float32).reshape(1, -1, p.part, p.part)
    geo = op.samples(op.geometry(rois, H, W, np, *([] if t is None else [t])), H, W)
    k = channel // (p.output_dim // geo.y.shape[1])
    samples, sbin, outside = [], [], []
    for pi in range(P):
        for qi in range(P):
            for i in range(p.sample_per_part):
                for j in range(p.sample_per_part):
                    samples.append((geo.y[0, k, pi, qi, i], geo.x[0, k, pi, qi, j]))
                    sbin.append((pi, qi))
                    outside.append(not (geo.y_in[0, k, pi, qi, i] and geo.x_in[0, k, pi, qi, j]))
    out["samples"] = np.array(samples, dtype=geo.y.dtype).reshape(-1, 2)
    out["sample_bin"] = np.array(sbin, dtype=np.int64).reshape(-1, 2)
    out["outside"] = np.array(outside, dtype=bool)
    from mx_roi.geometry import c_round
    corner = c_round(rois[0, 1:3].astype(np.float32)) * np.float32(p.spatial_scale)
    start = [float(v) - 0.5 for v in corner]   # C-rounded x1 * s - 0.5 (x, y)
    size = [float(geo.roi_w[0]), float(geo.roi_h[0])]
    out["bin_x"] = np.array([(start[0] + q * size[0] / P, start[0] + (q + 1) * size[0] / P)
                             for q in range(P)])
    out["bin_y"] = np.array([(start[1] + q * size[1] / P, start[1] + (q + 1) * size[1] / P)
                             for q in range(P)])
    out["channel"] = int(channel)
    out["trans"] = None if t is None else t[0].copy()
    return out


def sampling_coords(op, feature_shape, roi, tap_sample: Optional[Sequence[int]] = None,
                    channel: int = 0, trans=None, **params) -> Dict[str, Any]:
    """Everything a picture of ``op`` on ``roi`` draws, as NumPy arrays.

    Keys (all ops): ``op``, ``feature_shape``, ``roi``, ``roi_scaled``, ``pooled_size``.
    Pooling ops: ``hstart, hend`` (P,), ``wstart, wend`` (Q,) from :class:`IntBins`;
    ``cells`` (P*Q, 4) = (hstart, hend, wstart, wend) per bin row-major; ``empty`` (P, Q).
    Align ops: ``count_y`` (P,), ``coord_y`` (P, G), ``count_x``/``coord_x`` likewise;
    ``samples`` (S, 2) = (y, x) of every live sample (bin-major, then iy, ix);
    ``sample_bin`` (S, 2); ``outside`` (S,) samples with zero weight (off the map);
    ``bin_y``/``bin_x`` (P, 2)/(Q, 2) bin edges; ``tap_sample`` (p, q, iy, ix) or None,
    ``taps`` (4, 2) int (row, col), ``tap_weights`` (4,) = wy * wx.
    Position-sensitive ops: ``channel``, ``channel_map`` (P, Q) input channel of output
    channel ``channel``, ``group_grid`` (2,) = (Gh, Gw), ``group_cell`` (P, Q) = the
    flat group cell ``gh*Gw + gw`` each bin reads (channel_map - channel*Gh*Gw).
    """
    op = make_op(op, **params)
    p = op.param
    rois = _roi_array(roi, op.rois_columns, op.rois_layout)[None]
    if feature_shape is None:
        feature_shape = default_feature_shape(rois[0], p.spatial_scale)
    H, W = (int(v) for v in feature_shape)
    out: Dict[str, Any] = {
        "op": op.name,
        "feature_shape": np.array([H, W], dtype=np.int64),
        "roi": rois[0].copy(),
        "roi_scaled": (rois[0, 1:].astype(np.float64) * float(np.float32(p.spatial_scale))),
        "pooled_size": np.array(p.pooled_size, dtype=np.int64),
    }
    if hasattr(op, "viz_coords"):
        # an op whose tables are neither IntBins nor a SampleGrid draws its own: polygons
        # ``roi_polygon`` (4, 2) and ``bin_polygons`` (P*Q, 4, 2) as (x, y) corners, and
        # optionally ``samples`` / ``outside`` / ``sample_bin`` / ``sample_index`` /
        # ``tap_sample`` / ``taps`` / ``tap_weights`` as above, or ``nodes`` (K, 2) and
        # ``node_weights`` (K,) of the bin ``node_bin`` -- all from its own geometry
        out.update(op.viz_coords(rois, H, W, tap_sample))
        corners = out["roi_polygon"]
        out["roi_scaled"] = np.array([corners[:, 0].min(), corners[:, 1].min(),
                                      corners[:, 0].max(), corners[:, 1].max()])
        return out
    if is_deformable(op):  # ``trans``: the offsets (2K, part, part) of the one roi
        out["pooled_size"] = np.array([p.pooled_size] * 2, dtype=np.int64)
        return _deformable_coords(op, rois, H, W, channel, trans, out)
    geo = op.geometry(rois, H, W, np)
    if is_align(op):
        ay, ax = geo.y, geo.x
        out["count_y"], out["coord_y"] = ay.count[0].copy(), ay.coord[0].copy()
        out["count_x"], out["coord_x"] = ax.count[0].copy(), ax.coord[0].copy()
        samples, sbin, outside, index = [], [], [], []
        P, Q = ay.count.shape[1], ax.count.shape[1]
        for pi in range(P):
            for qi in range(Q):
                for iy in range(int(ay.count[0, pi])):
                    for ix in range(int(ax.count[0, qi])):
                        samples.append((ay.coord[0, pi, iy], ax.coord[0, qi, ix]))
                        sbin.append((pi, qi))
                        index.append((pi, qi, iy, ix))
                        off_y = ay.w_low[0, pi, iy] + ay.w_high[0, pi, iy] == 0
                        off_x = ax.w_low[0, qi, ix] + ax.w_high[0, qi, ix] == 0
                        outside.append(bool(off_y or off_x))
        cdt = ay.coord.dtype
        out["samples"] = np.array(samples, dtype=cdt).reshape(-1, 2)
        out["sample_bin"] = np.array(sbin, dtype=np.int64).reshape(-1, 2)
        out["sample_index"] = np.array(index, dtype=np.int64).reshape(-1, 4)
        out["outside"] = np.array(outside, dtype=bool)
        by, bx = _bin_edges(op, rois, H, W)
        out["bin_y"], out["bin_x"] = by, bx
        if tap_sample is None and len(index):
            mid = [k for k, t in enumerate(index) if t[0] == P // 2 and t[1] == Q // 2]
            tap_sample = index[mid[0] if mid else 0]
        out["tap_sample"] = None if tap_sample is None else np.array(tap_sample, np.int64)
        if tap_sample is not None:
            pi, qi, iy, ix = (int(v) for v in tap_sample)
            if not (iy < ay.count[0, pi] and ix < ax.count[0, qi]):
                raise ValueError(f"tap_sample {tuple(tap_sample)}: bin ({pi}, {qi}) has "
                                 f"{int(ay.count[0, pi])} x {int(ax.count[0, qi])} samples")
            rows = (ay.low[0, pi, iy], ay.high[0, pi, iy])
            wys = (ay.w_low[0, pi, iy], ay.w_high[0, pi, iy])
            cols = (ax.low[0, qi, ix], ax.high[0, qi, ix])
            wxs = (ax.w_low[0, qi, ix], ax.w_high[0, qi, ix])
            out["taps"] = np.array([(r, c) for r in rows for c in cols], dtype=np.int64)
            out["tap_weights"] = np.array([wy * wx for wy in wys for wx in wxs], dtype=cdt)
    else:
        out["hstart"], out["hend"] = geo.hstart[0].copy(), geo.hend[0].copy()
        out["wstart"], out["wend"] = geo.wstart[0].copy(), geo.wend[0].copy()
        P, Q = geo.hstart.shape[1], geo.wstart.shape[1]
        out["cells"] = np.array([(geo.hstart[0, i], geo.hend[0, i], geo.wstart[0, j],
                                  geo.wend[0, j]) for i in range(P) for j in range(Q)],
                                dtype=np.int64).reshape(-1, 4)
        out["empty"] = ((geo.hend[0] <= geo.hstart[0])[:, None]
                        | (geo.wend[0] <= geo.wstart[0])[None, :])
    if is_position_sensitive(op):
        cmap = op.channel_map()
        if not 0 <= channel < cmap.shape[0]:
            raise ValueError(f"channel {channel} out of range: output_dim = {cmap.shape[0]}")
        Gh, Gw = (int(g) for g in p.group_grid)
        out["channel"] = int(channel)
        out["group_grid"] = np.array([Gh, Gw], dtype=np.int64)
        out["channel_map"] = cmap[channel].copy()
        out["group_cell"] = cmap[channel] - channel * Gh * Gw
    return out


def to_jsonable(coords: Dict[str, Any]) -> Dict[str, Any]:
    """Arrays -> nested lists (exact: float32 widens to a Python float losslessly)."""
    def conv(v):
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, np.generic):
            return v.item()
        return v
    return {k: conv(v) for k, v in sorted(coords.items())}
