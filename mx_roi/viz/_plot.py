"""Drawing (matplotlib is imported inside the functions, never at import time)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from ._coords import (PIXEL_CENTRE, is_align, is_deformable, is_position_sensitive, make_op,
                      sampling_coords)

__all__ = ["plot_sampling", "plot_aligned_comparison", "new_figure", "RC"]

#: rcParams used for every picture (fonts bundled with matplotlib; stable SVG ids).
RC = {"font.family": "DejaVu Sans", "font.size": 9, "svg.hashsalt": "mx_roi",
      "path.simplify": False, "axes.titlesize": 10}

_BIN_COLOURS = ("#1f77b4", "#ff7f0e")        # checkerboard of bins
_MAP_FILL = "#f4f4f4"


def new_figure(ncols=1, size=(6.0, 5.0)):
    """A Figure on an Agg canvas (no pyplot, no GUI backend) and its Axes."""
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = Figure(figsize=(size[0] * ncols, size[1]))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, k + 1) for k in range(ncols)]
    return fig, axes


def _group_colour(cell, group_grid):
    import matplotlib
    cell, cells = int(cell), int(np.prod(group_grid))
    if cells <= 10:
        return matplotlib.colormaps["tab10"](cell)
    # tab20 pairs a strong and a pale shade: the 10 strong ones first, then the pale ones
    k = cell % 20
    return matplotlib.colormaps["tab20"](2 * k if k < 10 else 2 * (k - 10) + 1)


def _title(op) -> str:
    p = op.param
    if is_deformable(op):
        import textwrap
        text = (f"pooled_size={p.pooled_size}, part_size={p.part_size}, sample_per_part="
                f"{p.sample_per_part}, trans_std={p.trans_std:g}, group_size={p.group_size}, "
                f"output_dim={p.output_dim}, spatial_scale={p.spatial_scale:g}")
        return op.name + "\n" + "\n".join(textwrap.wrap(text, 58))
    parts = [f"pooled_size={tuple(p.pooled_size)}", f"spatial_scale={p.spatial_scale:g}"]
    if hasattr(p, "sample_ratio"):
        parts.append(f"sample_ratio={p.sample_ratio}")
    if hasattr(p, "sampling_ratio"):
        parts.append(f"sampling_ratio={p.sampling_ratio}")
    if hasattr(p, "aligned"):
        parts.append(f"aligned={p.aligned}")
    if getattr(p, "clockwise", False):
        parts.append("clockwise=True")
    if getattr(p, "pool_mode", "avg") == "max":
        parts.append("pool_mode='max'")
    if is_position_sensitive(op):
        gh, gw = p.group_grid
        grid = f"{gh}" if gh == gw else f"({gh}, {gw})"
        parts.append(f"output_dim={p.output_dim}, group_size={grid}")
    import textwrap
    return op.name + "\n" + "\n".join(textwrap.wrap(", ".join(parts), 58))


def _draw_map(ax, c):
    from matplotlib.patches import Rectangle
    H, W = (int(v) for v in c["feature_shape"])
    ax.add_patch(Rectangle((0, 0), W, H, facecolor=_MAP_FILL, edgecolor="black", lw=1.0,
                           zorder=0, gid="feature_map"))
    if H <= 200 and W <= 200:
        ax.vlines(np.arange(1, W), 0, H, colors="#bbbbbb", lw=0.5, zorder=1)
        ax.hlines(np.arange(1, H), 0, W, colors="#bbbbbb", lw=0.5, zorder=1)


def _draw_roi(ax, c):
    from matplotlib.patches import Rectangle
    x1, y1, x2, y2 = c["roi_scaled"]
    ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, ls="--", lw=1.5,
                           edgecolor="black", zorder=6, gid="roi_scaled",
                           label="roi × spatial_scale (input)"))


def _draw_pooling(ax, op, c):
    from matplotlib.patches import Rectangle
    P, Q = (int(v) for v in c["pooled_size"])
    ps = is_position_sensitive(op)
    first = True
    for k, (h0, h1, w0, w1) in enumerate(c["cells"]):
        p, q = divmod(k, Q)
        if c["empty"][p, q]:
            continue
        if ps:
            colour = _group_colour(c["group_cell"][p, q], c["group_grid"])
        else:
            colour = _BIN_COLOURS[(p + q) % 2]
        ax.add_patch(Rectangle((w0, h0), w1 - w0, h1 - h0, facecolor=colour, alpha=0.22,
                               edgecolor=colour, lw=1.6, zorder=3, gid=f"cells_{p}_{q}",
                               label="quantised cells of a bin" if first else None))
        first = False
        label = f"ch {c['channel_map'][p, q]}" if ps else f"{p},{q}"
        ax.text((w0 + w1) / 2, (h0 + h1) / 2, label, ha="center", va="center", fontsize=8,
                zorder=8, color="black" if not ps else colour, fontweight="bold" if ps else None,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.7))
    n_empty = int(c["empty"].sum())
    if n_empty:
        ax.text(0.01, 0.01, f"{n_empty} empty bin(s) -> output 0", transform=ax.transAxes,
                fontsize=8, color="firebrick", va="bottom")


def _draw_align(ax, op, c):
    from matplotlib.patches import Rectangle
    P, Q = (int(v) for v in c["pooled_size"])
    ps = is_position_sensitive(op)
    by, bx = c["bin_y"], c["bin_x"]
    if by is not None:
        first = True
        for p in range(P):
            for q in range(Q):
                y0, y1 = by[p] + PIXEL_CENTRE
                x0, x1 = bx[q] + PIXEL_CENTRE
                if ps:
                    colour = _group_colour(c["group_cell"][p, q], c["group_grid"])
                    ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=colour,
                                           alpha=0.18, edgecolor="none", zorder=2))
                    ax.text((x0 + x1) / 2, y0 + 0.02 * (y1 - y0), f"ch {c['channel_map'][p, q]}",
                            ha="center", va="top", fontsize=8, color=colour, zorder=8,
                            fontweight="bold",
                            bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none",
                                      alpha=0.7))
                ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False,
                                       edgecolor="tab:blue", lw=1.2, zorder=4,
                                       gid=f"bin_{p}_{q}", label="bins" if first else None))
                first = False
    inside = ~c["outside"]
    if ps:
        colours = [_group_colour(c["group_cell"][p, q], c["group_grid"])
                   for p, q in c["sample_bin"][inside]]
    else:
        colours = "tab:blue"
    s = _scatter_samples(ax, c, colours)
    if c.get("tap_sample") is not None:
        p, q, iy, ix = (int(v) for v in c["tap_sample"])
        taps = c["taps"] + PIXEL_CENTRE
        sy, sx = _tap_lines(ax, c, s, taps, f"4 taps of sample {(p, q, iy, ix)}")
        seen = {}
        for (ty, tx), wgt in zip(taps, c["tap_weights"]):
            key = (float(ty), float(tx))
            seen[key] = seen.get(key, 0.0) + float(wgt)
        for (ty, tx), wgt in seen.items():
            right, below = tx >= sx, ty >= sy      # put the label away from the sample
            ax.text(tx + (0.12 if right else -0.12), ty + (0.12 if below else -0.12),
                    f"{wgt:.2f}", fontsize=7, color="crimson", zorder=10,
                    ha="left" if right else "right", va="top" if below else "bottom",
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
        ax.scatter([sx], [sy], s=30, c="crimson", zorder=9, gid="tap_sample")


def _draw_polygons(ax, op, c):
    """An op's own bins (``viz_coords``): polygons, then its samples and the taps of one,
    or the weights of one bin's map nodes."""
    from matplotlib.patches import Polygon
    P, Q = (int(v) for v in c["pooled_size"])
    ax.add_patch(Polygon(np.asarray(c["roi_polygon"]) + PIXEL_CENTRE, closed=True, fill=False,
                         ls="--", lw=1.5, edgecolor="black", zorder=6, gid="roi_scaled",
                         label="roi × spatial_scale (input)"))
    for k, corners in enumerate(np.asarray(c["bin_polygons"], dtype=np.float64)):
        p, q = divmod(k, Q)
        ax.add_patch(Polygon(corners + PIXEL_CENTRE, closed=True, fill=False,
                             edgecolor="tab:blue", lw=1.2, zorder=4, gid=f"bin_{p}_{q}",
                             label="bins" if k == 0 else None))
    if "samples" in c:
        _draw_samples(ax, c, "tab:blue")
    if "nodes" in c:
        nodes = np.asarray(c["nodes"], dtype=np.float64) + PIXEL_CENTRE
        w = np.asarray(c["node_weights"], dtype=np.float64)
        size = 400 * w / max(float(w.max()), 1e-12) if w.size else w
        ax.scatter(nodes[:, 1], nodes[:, 0], s=size, marker="s", c="crimson", alpha=0.45,
                   edgecolors="crimson", zorder=7, gid="nodes",
                   label=f"map nodes of bin {tuple(int(v) for v in c['node_bin'])}: area ∝ weight")
        for (ty, tx), wgt in zip(nodes, w):
            ax.text(tx, ty, f"{wgt:.2f}", fontsize=6, ha="center", va="center", zorder=10)


def _scatter_samples(ax, c, colours):
    """Sample points (off-map ones as crosses); returns them, (y, x) per row."""
    s = np.asarray(c["samples"], dtype=np.float64)
    inside = ~np.asarray(c["outside"], dtype=bool)
    ax.scatter(s[inside, 1] + PIXEL_CENTRE, s[inside, 0] + PIXEL_CENTRE, s=14, c=colours,
               edgecolors="black", linewidths=0.4, zorder=7, gid="samples",
               label="bilinear sample points")
    if (~inside).any():
        ax.scatter(s[~inside, 1] + PIXEL_CENTRE, s[~inside, 0] + PIXEL_CENTRE, s=22,
                   marker="x", c="firebrick", zorder=7, gid="samples_outside",
                   label="off the map: weight 0")
    return s


def _tap_lines(ax, c, s, taps, label):
    """Lines from sample ``tap_sample`` (of the points ``s``) to its four ``taps`` (drawn
    coordinates, (y, x) per row) and the taps as squares; returns the sample's (y, x)."""
    k = int(np.flatnonzero((c["sample_index"] == c["tap_sample"]).all(axis=1))[0])
    sy, sx = s[k] + PIXEL_CENTRE
    for ty, tx in taps:
        ax.plot([sx, tx], [sy, ty], color="crimson", lw=0.8, zorder=8)
    ax.scatter(taps[:, 1], taps[:, 0], s=40, marker="s", facecolors="none",
               edgecolors="crimson", linewidths=1.2, zorder=9, gid="taps", label=label)
    return sy, sx


def _draw_samples(ax, c, colours):
    """Sample points (off-map ones as crosses) and the four taps of ``tap_sample``."""
    s = _scatter_samples(ax, c, colours)
    if c.get("tap_sample") is not None and "taps" in c:
        sy, sx = _tap_lines(ax, c, s, np.asarray(c["taps"], dtype=np.float64) + PIXEL_CENTRE,
                            f"4 taps of sample {tuple(int(v) for v in c['tap_sample'])}")
        ax.scatter([sx], [sy], s=30, c="crimson", zorder=9, gid="tap_sample")
def _draw_deformable(ax, op, c):
    """The box's regular bins (dashed) and each bin's samples after its offset, in the
    bin's colour; skipped samples (off the map) hollow."""
    from matplotlib.patches import Rectangle
    P, Q = (int(v) for v in c["pooled_size"])
    by, bx = c["bin_y"], c["bin_x"]
    first = True
    for p in range(P):
        for q in range(Q):
            y0, y1 = by[p] + PIXEL_CENTRE
            x0, x1 = bx[q] + PIXEL_CENTRE
            ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ls=":",
                                   edgecolor="tab:blue", lw=1.0, zorder=4, gid=f"bin_{p}_{q}",
                                   label="bins before the offsets" if first else None))
            first = False
    s = np.asarray(c["samples"], dtype=np.float64) + PIXEL_CENTRE
    colours = [_group_colour(p * Q + q, (P, Q)) for p, q in c["sample_bin"]]
    inside = ~c["outside"]
    if inside.any():
        ax.scatter(s[inside, 1], s[inside, 0], s=14, c=[colours[i] for i in np.flatnonzero(inside)],
                   zorder=7, gid="samples", label="samples after the offsets (clamped)")
    if (~inside).any():
        ax.scatter(s[~inside, 1], s[~inside, 0], s=14, facecolors="none",
                   edgecolors=[colours[i] for i in np.flatnonzero(~inside)], zorder=7,
                   gid="samples_outside", label="skipped: off the map")


def _limits(ax, c):
    H, W = (int(v) for v in c["feature_shape"])
    xs = [0.0, float(W)]
    ys = [0.0, float(H)]
    x1, y1, x2, y2 = c["roi_scaled"]
    xs += [x1, x2]
    ys += [y1, y2]
    if "samples" in c and len(c["samples"]):
        ys += list(c["samples"][:, 0] + PIXEL_CENTRE)
        xs += list(c["samples"][:, 1] + PIXEL_CENTRE)
    if "roi_polygon" in c:
        xs += list(np.asarray(c["roi_polygon"])[:, 0] + PIXEL_CENTRE)
        ys += list(np.asarray(c["roi_polygon"])[:, 1] + PIXEL_CENTRE)
    pad = 0.4
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.set_ylim(max(ys) + pad, min(ys) - pad)    # image convention: row 0 at the top
    ax.set_aspect("equal")


def _ticks(ax, c):
    H, W = (int(v) for v in c["feature_shape"])
    step_w = max(1, int(np.ceil(W / 16)))
    step_h = max(1, int(np.ceil(H / 16)))
    ax.set_xticks(np.arange(0, W, step_w) + 0.5, [str(v) for v in range(0, W, step_w)])
    ax.set_yticks(np.arange(0, H, step_h) + 0.5, [str(v) for v in range(0, H, step_h)])
    ax.tick_params(length=0, labelsize=7)
    ax.set_xlabel("feature-map column")
    ax.set_ylabel("feature-map row")


def plot_sampling(op, feature_shape, roi, ax=None, *, tap_sample: Optional[Sequence[int]] = None,
                  channel: int = 0, legend: bool = True, trans=None,
                  **params) -> Dict[str, Any]:
    """Draw where ``op`` reads the feature map for one ``roi``.

    Parameters
    ----------
    op : op instance (``mx_roi.ROIAlign(param)``), op class, or op name ("ROIAlign");
        with a class or a name the op parameters are given as keywords (``**params``,
        e.g. ``pooled_size=7, spatial_scale=0.0625``).
    feature_shape : (H, W) of the feature map, or None for one just containing the box.
    roi : (batch, x1, y1, x2, y2) or (x1, y1, x2, y2) in image coordinates.
    ax : matplotlib Axes to draw into; None makes a new Agg figure.
    tap_sample : (p, q, iy, ix), the sample of an align op whose 4 taps are drawn
        (default: the first sample of the middle bin).
    channel : output channel whose input channels the PS ops label.
    trans : DeformablePSROIPooling: the roi's offsets (2K, part, part) (default zeros).

    Returns
    -------
    dict of NumPy arrays: what was drawn, copied from ``op.geometry(...)`` (see
    :func:`mx_roi.viz.sampling_coords`), plus ``"ax"`` and ``"figure"``.  The same dict is
    attached to the Axes as ``ax.mx_roi_coords``.

    Picture frame: cell (h, w) is the unit square [w, w+1] x [h, h+1]; a sample
    coordinate ``c`` (pixel centres at integers, as in the tables) is drawn at ``c + 0.5``.
    """
    op = make_op(op, **params)
    c = sampling_coords(op, feature_shape, roi, tap_sample=tap_sample, channel=channel,
                        trans=trans)
    if ax is None:
        fig, (ax,) = new_figure()
    _draw_map(ax, c)
    if "bin_polygons" in c:
        _draw_polygons(ax, op, c)
    elif is_deformable(op):
        _draw_roi(ax, c)
        _draw_deformable(ax, op, c)
    elif is_align(op):
        _draw_roi(ax, c)
        _draw_align(ax, op, c)
    else:
        _draw_roi(ax, c)
        _draw_pooling(ax, op, c)
    _limits(ax, c)
    _ticks(ax, c)
    ax.set_title(_title(op))
    if legend:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7,
                  frameon=False)
    c["ax"] = ax
    c["figure"] = ax.figure
    ax.mx_roi_coords = c
    return c


def plot_aligned_comparison(op, feature_shape, roi, axes=None, **params):
    """``aligned=False`` and ``aligned=True`` side by side (ROIAlign or PSROIAlign).

    ``op`` as in :func:`plot_sampling` (an instance's own ``aligned`` is overridden).
    Returns ``{False: coords, True: coords}``; ``result["figure"]`` is the figure.
    """
    import dataclasses
    base = make_op(op, **params)
    if not hasattr(base.param, "aligned"):
        raise ValueError(f"{base.name} has no 'aligned' parameter")
    if axes is None:
        fig, axes = new_figure(ncols=2)
    out: Dict[Any, Any] = {}
    for ax, aligned in zip(axes, (False, True)):
        one = type(base)(dataclasses.replace(base.param, aligned=aligned))
        out[aligned] = plot_sampling(one, feature_shape, roi, ax=ax)
    out["figure"] = axes[0].figure
    return out
