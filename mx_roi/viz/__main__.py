"""``python -m mx_roi.viz``: draw where one op samples the feature map for one roi.

Example::

    python -m mx_roi.viz --op ROIAlign --roi 0,10.3,6.2,90.1,61.7 \\
        --spatial-scale 0.0625 --pooled-size 7 -o roialign.png
"""
from __future__ import annotations

import argparse
import sys


def _floats(text):
    try:
        return [float(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def _ints(text):
    vals = _floats(text)
    if any(v != int(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in vals]


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m mx_roi.viz", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--op", required=True,
                    help="ROIPooling, ROIAlign, PSROIPooling, PSROIAlign, RROIAlign or PrRoIPool "
                         "(case-insensitive)")
    ap.add_argument("--roi", required=True, type=_floats,
                    help="batch,x1,y1,x2,y2 (or x1,y1,x2,y2) in image coordinates; "
                         "RROIAlign: batch,x_center,y_center,width,height,angle_degrees")
    ap.add_argument("--spatial-scale", type=float, required=True)
    ap.add_argument("--pooled-size", type=_ints, required=True, help="P or P,Q")
    ap.add_argument("--feature-shape", type=_ints, default=None,
                    help="H,W of the feature map (default: just large enough for the box)")
    ap.add_argument("--sample-ratio", type=int, default=None,
                    help="align ops: samples per bin side, <= 0 adaptive (op default -1; "
                         "RROIAlign's sampling_ratio)")
    ap.add_argument("--aligned", action="store_true", help="align ops: half-pixel offset")
    ap.add_argument("--clockwise", action="store_true", help="RROIAlign: angles clockwise")
    ap.add_argument("--compare-aligned", action="store_true",
                    help="align ops: draw aligned=False and aligned=True side by side")
    ap.add_argument("--pool-mode", choices=("avg", "max"), default=None, help="ROIAlign only")
    ap.add_argument("--output-dim", type=int, default=None, help="PS ops (default 1)")
    ap.add_argument("--group-size", type=_ints, default=None,
                    help="PS ops: G or Gh,Gw group grid (0 = the pooled grid)")
    ap.add_argument("--channel", type=int, default=0, help="PS ops: output channel to label")
    ap.add_argument("--tap-sample", type=_ints, default=None,
                    help="align ops: p,q,iy,ix of the sample whose 4 taps are drawn")
    ap.add_argument("--dpi", type=int, default=110)
    ap.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    from . import _plot
    from ._coords import make_op
    ps = args.pooled_size
    params = {"pooled_size": tuple(ps) if len(ps) > 1 else ps[0],
              "spatial_scale": args.spatial_scale}
    opname = args.op.lower()
    if opname.startswith("ps"):
        params["output_dim"] = args.output_dim if args.output_dim is not None else 1
        if args.group_size is not None:
            gs = args.group_size
            params["group_size"] = tuple(gs) if len(gs) > 1 else gs[0]
    elif args.output_dim is not None or args.group_size is not None:
        build_parser().error("--output-dim/--group-size are for PSROIPooling/PSROIAlign")
    if opname.endswith("align"):
        if args.sample_ratio is not None:
            params["sampling_ratio" if opname == "rroialign" else "sample_ratio"] = \
                args.sample_ratio
        if args.clockwise:
            params["clockwise"] = True
        params["aligned"] = args.aligned
        if args.pool_mode is not None:
            params["pool_mode"] = args.pool_mode
    elif args.sample_ratio is not None or args.aligned or args.compare_aligned:
        build_parser().error("--sample-ratio/--aligned/--compare-aligned are for the align ops")
    try:
        op = make_op(args.op, **params)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shape = tuple(args.feature_shape) if args.feature_shape else None
    import matplotlib
    with matplotlib.rc_context(_plot.RC):
        if args.compare_aligned:
            res = _plot.plot_aligned_comparison(op, shape, args.roi)
            fig = res["figure"]
        else:
            res = _plot.plot_sampling(op, shape, args.roi, tap_sample=args.tap_sample,
                                      channel=args.channel)
            fig = res["figure"]
        fig.savefig(args.output, dpi=args.dpi, bbox_inches="tight")
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
