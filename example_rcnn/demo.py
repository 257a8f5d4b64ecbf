"""``python -m example_rcnn.demo`` (``make demo``): a few minutes on two CPU cores.

Trains the tiny-backbone Faster R-CNN on the embedded synthetic shapes dataset with
ROIPooling and with ROIAlign from the same seed, evaluates both (mAP@0.5 / mAP@0.75 on
held-out images), prints the comparison table and writes PNGs (detections, loss curves)
under ``./out/demo`` (``--out`` to change).
"""
from __future__ import annotations

import argparse
import os
import time

from .compare import compare, format_table

DEMO_TRAIN_ARGS = ["--num-images", "384", "--num-test-images", "64", "--epochs", "3",
                   "--batch-size", "2", "--lr", "1e-3", "--seed", "0"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join("out", "demo"))
    p.add_argument("--ops", default="pool,align")
    p.add_argument("--progress", action="store_true", help="show tqdm bars")
    args = p.parse_args(argv)
    t0 = time.time()
    train_args = DEMO_TRAIN_ARGS + ([] if args.progress else ["--no-progress"])
    rows, loss_png = compare(args.ops.split(","), train_args, args.out)
    print("\nFaster R-CNN (tiny backbone) on synthetic shapes, %s images, %s epochs, seed 0:"
          % (DEMO_TRAIN_ARGS[1], DEMO_TRAIN_ARGS[5]))
    print(format_table(rows))
    print("\nPNGs:")
    print("  loss curves (all ops): %s" % os.path.abspath(loss_png))
    for r in rows:
        print("  detections (%s): %s" % (r["roi_op"], os.path.abspath(r["detections_png"])))
        print("  loss curves (%s): %s" % (r["roi_op"], os.path.abspath(r["loss_png"])))
    print("demo finished in %.0fs" % (time.time() - t0))


if __name__ == "__main__":
    main()
