"""``python -m mx_roi.viz.regenerate docs``: write the pictures of docs/semantics.md into ``docs/`` (``make pictures``).

The pictures use fixed rois and parameters (:data:`FIGURES`) and are written
deterministically: Agg backend, fonts bundled with matplotlib, fixed ``svg.hashsalt``, no
``Software`` / date metadata.  Each PNG carries the coordinates it draws (the dict of
:func:`mx_roi.viz.sampling_coords`, per panel, as JSON) in a ``tEXt`` chunk named
``mx_roi:coords``, so ``tests/test_viz.py`` can check a committed picture against the
geometry tables without trusting the pixels, and the matplotlib version it was made with
(``mx_roi:matplotlib``): PNG bytes are only comparable between equal versions.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import zlib
from typing import Any, Dict, List

COORDS_KEY = "mx_roi:coords"
VERSION_KEY = "mx_roi:matplotlib"
DPI = 100

# One feature map and one box for the four per-op pictures: 1/8 scale, 10 x 14 cells.
_SHAPE = (10, 14)
_ROI = (0, 18.5, 10.2, 92.3, 66.9)

#: file name -> panels; a panel is (title-less) keyword arguments of plot_sampling.
FIGURES: Dict[str, List[Dict[str, Any]]] = {
    "roi_pooling.png": [dict(op="ROIPooling", feature_shape=_SHAPE, roi=_ROI,
                             pooled_size=3, spatial_scale=0.125)],
    "roi_align.png": [dict(op="ROIAlign", feature_shape=_SHAPE, roi=_ROI, pooled_size=3,
                           spatial_scale=0.125, sample_ratio=-1, tap_sample=(1, 1, 2, 1))],
    "psroi_pooling.png": [
        dict(op="PSROIPooling", feature_shape=_SHAPE, roi=_ROI, pooled_size=3, output_dim=2,
             spatial_scale=0.125, channel=1),
        # a rectangular (gh, gw) = (2, 3) group grid under a 3 x 4 pool
        dict(op="PSROIPooling", feature_shape=_SHAPE, roi=_ROI, pooled_size=(3, 4),
             group_size=(2, 3), output_dim=2, spatial_scale=0.125, channel=1)],
    "psroi_align.png": [
        dict(op="PSROIAlign", feature_shape=_SHAPE, roi=_ROI, pooled_size=4, group_size=2,
             output_dim=2, sample_ratio=2, spatial_scale=0.125, channel=1,
             tap_sample=(1, 2, 1, 0)),
        # contrib.ROIAlign(position_sensitive=True) on a 3 x 4 pool: the pooled grid
        dict(op="PSROIAlign", feature_shape=_SHAPE, roi=_ROI, pooled_size=(3, 4),
             output_dim=2, sample_ratio=2, spatial_scale=0.125, channel=1,
             tap_sample=(1, 2, 1, 0))],
    "roi_align_aligned.png": [
        dict(op="ROIAlign", feature_shape=(6, 7), roi=(0, 8, 8, 40, 32), pooled_size=2,
             spatial_scale=0.125, sample_ratio=2, aligned=False, tap_sample=(0, 0, 0, 0)),
        dict(op="ROIAlign", feature_shape=(6, 7), roi=(0, 8, 8, 40, 32), pooled_size=2,
             spatial_scale=0.125, sample_ratio=2, aligned=True, tap_sample=(0, 0, 0, 0))],
    # a rotated box (MXNet's RROIAlign, and with Detectron2's / mmcv's options)
    "rroi_align.png": [
        dict(op="RROIAlign", feature_shape=_SHAPE, roi=(0, 55.4, 38.5, 70.0, 40.0, 30.0),
             pooled_size=3, spatial_scale=0.125, sampling_ratio=2, tap_sample=(1, 1, 3, 0)),
        dict(op="RROIAlign", feature_shape=_SHAPE, roi=(0, 55.4, 38.5, 70.0, 40.0, 30.0),
             pooled_size=3, spatial_scale=0.125, sampling_ratio=2, aligned=True,
             clockwise=True, tap_sample=(1, 1, 3, 0))],
    "prroi_pool.png": [dict(op="PrRoIPool", feature_shape=_SHAPE, roi=_ROI, pooled_size=3,
                            spatial_scale=0.125, tap_sample=(1, 1, 0, 0))],
    # offsets: the left column's bins pushed left past the map's edge, the others down
    "deformable_psroi_pooling.png": [
        dict(op="DeformablePSROIPooling", feature_shape=_SHAPE, roi=_ROI, pooled_size=3,
             part_size=3, sample_per_part=2, trans_std=0.5, group_size=1, output_dim=1,
             spatial_scale=0.125,
             trans=[[[-0.9, 0.1, 0.0], [-0.9, 0.1, 0.0], [-0.9, 0.1, 0.0]],
                    [[0.0, 0.3, 0.6], [0.0, 0.3, 0.6], [0.0, 0.3, 0.6]]]),
        dict(op="DeformablePSROIPooling", feature_shape=_SHAPE, roi=_ROI, pooled_size=3,
             sample_per_part=2, group_size=1, output_dim=1, spatial_scale=0.125,
             no_trans=True)],
    "edge_cases.png": [
        dict(op="ROIPooling", feature_shape=(6, 8), roi=(0, 36, 20, 90, 60), pooled_size=3,
             spatial_scale=0.125),
        dict(op="ROIAlign", feature_shape=(6, 8), roi=(0, 36, 20, 90, 60), pooled_size=3,
             spatial_scale=0.125, sample_ratio=2, aligned=True, tap_sample=(1, 1, 0, 1))],
}


def _strip(coords):
    from ._coords import to_jsonable
    return to_jsonable({k: v for k, v in coords.items() if k not in ("ax", "figure")})


def render(name: str):
    """(figure, [jsonable coords per panel]) of one entry of :data:`FIGURES`."""
    import matplotlib
    from ._plot import RC, new_figure, plot_sampling
    panels = FIGURES[name]
    with matplotlib.rc_context(RC):
        fig, axes = new_figure(ncols=len(panels))
        coords = []
        for ax, spec in zip(axes, panels):
            spec = dict(spec)
            c = plot_sampling(spec.pop("op"), spec.pop("feature_shape"), spec.pop("roi"), ax=ax,
                              **spec)
            coords.append(_strip(c))
        fig.tight_layout()
    return fig, coords


def regenerate(outdir: str, names=None) -> Dict[str, list]:
    """Write the pictures into ``outdir``; returns {file name: coords per panel}."""
    import matplotlib
    from ._plot import RC
    os.makedirs(outdir, exist_ok=True)
    written = {}
    for name in (names or FIGURES):
        fig, coords = render(name)
        meta = {"Software": None, COORDS_KEY: json.dumps(coords, sort_keys=True,
                                                          separators=(",", ":")),
                VERSION_KEY: matplotlib.__version__}
        with matplotlib.rc_context(RC):
            fig.savefig(os.path.join(outdir, name), dpi=DPI, metadata=meta, bbox_inches="tight",
                        pad_inches=0.1)
        written[name] = coords
    return written


def read_png_text(path: str) -> Dict[str, str]:
    """The ``tEXt``/``zTXt``/``iTXt`` chunks of a PNG (stdlib only)."""
    out = {}
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"tEXt":
            key, _, val = body.partition(b"\0")
            out[key.decode("latin-1")] = val.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _tkey, _, text = rest.partition(b"\0")
            out[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode(
                "utf-8")
        elif kind == b"IEND":
            break
    return out


def read_coords(path: str):
    """The coordinates a picture written by :func:`regenerate` draws (per panel)."""
    return json.loads(read_png_text(path)[COORDS_KEY])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mx_roi.viz.regenerate",
                                 description="write the docs/ pictures of the four ops")
    ap.add_argument("outdir", nargs="?", default="docs")
    ap.add_argument("--only", nargs="*", choices=sorted(FIGURES), default=None)
    args = ap.parse_args(argv)
    for name in regenerate(args.outdir, args.only):
        print(os.path.join(args.outdir, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
