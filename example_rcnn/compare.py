"""Pool vs align: ``python -m example_rcnn.compare [--ops pool,align] [train args]``.

Trains the same model once per RoI operator, from the same seed on the same (embedded by
default) dataset, evaluates each on the held-out split and prints a table of mAP@0.5,
mAP@0.75 and training time.  Any ``example_rcnn.train`` option can be passed (e.g.
``--epochs 6 --num-images 384``); each run writes into ``<out>/<op>/``.

Train time is wall-clock seconds of the training loop; CPU time (all threads of this process)
is given too because wall time on a shared machine depends on the other load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import evaluate as ev
from . import train as tr


def format_table(rows):
    lines = ["| RoI op  | mAP@0.5 | mAP@0.75 | train time (s) | train CPU time (s) |",
             "|---------|---------|----------|----------------|--------------------|"]
    for r in rows:
        lines.append("| %-7s | %7.4f | %8.4f | %14.1f | %18.1f |" % (
            r["roi_op"], r["map50"], r["map75"], r["train_time"], r.get("cpu_time", 0.0)))
    return "\n".join(lines)


def compare(ops, train_argv, out_root, log=print):
    """Train+evaluate each op in ``ops``; returns (rows, loss_png)."""
    rows, histories = [], {}
    for op in ops:
        out = os.path.join(out_root, op)
        args = tr.parse_args(list(train_argv) + ["--roi-op", op, "--out", out])
        log("== training --roi-op %s (seed %d) -> %s" % (op, args.seed, out))
        t0 = time.time()
        summary = tr.train(args)
        wall = time.time() - t0
        res = ev.evaluate(tr.parse_args(list(train_argv) + ["--roi-op", op, "--out", out]))
        res["train_time"] = summary["train_time"]
        res["cpu_time"] = summary["cpu_time"]
        res["wall_time"] = wall
        log("   %s: mAP@0.5 %.4f  mAP@0.75 %.4f  train %.1fs" % (
            op, res["map50"], res["map75"], summary["train_time"]))
        rows.append(res)
        histories[op] = summary["history"]
    loss_png = ev.plot_losses(histories, os.path.join(out_root, "loss_curves_compare.png"))
    with open(os.path.join(out_root, "compare.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_root, "compare.md"), "w") as f:
        f.write(format_table(rows) + "\n")
    return rows, loss_png


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--ops", default="pool,align", help="comma separated RoI ops to compare")
    p.add_argument("--out", default="out/compare")
    own, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        p.print_help()
        print("\nother options are passed to example_rcnn.train:")
        tr.parse_args(["--help"])
    ops = [o.strip() for o in own.ops.split(",") if o.strip()]
    rows, loss_png = compare(ops, rest + ["--no-progress"] if "--no-progress" not in rest
                             else rest, own.out)
    print(format_table(rows))
    print("loss curves: %s" % loss_png)
    for r in rows:
        print("detections (%s): %s" % (r["roi_op"], r["detections_png"]))


if __name__ == "__main__":
    main()
