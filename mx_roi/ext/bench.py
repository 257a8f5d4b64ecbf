"""The small call through the extension library against the Custom path, interleaved in
one process: ``python -m mx_roi.ext.bench [--repeat N] [--json]``.

The fixed-cost section's small call (mx_roi.bench.overhead: one image, a 64-channel 19x25
map, 16 boxes, spatial_scale 1/32; the PS ops on output_dim * 7 * 7 = 49 channels, as
there), forward and forward+backward, median of ``N`` runs of each side taken in turn:
the two no-op floors (``Custom`` and ``mx_roi_noop``), ROIAlign 7x7, aligned 14x14,
ROIPooling 7x7, PSROIPooling 7x7 and PSROIAlign 7x7 as ``mx_roi_<Op>``, as
``mx_roi_<Op>`` behind :func:`mx_roi.ext.add_safe`, as the Custom op on the ``native``
backend, and the built-in (``mx.nd.contrib.ROIAlign``, ``mx.nd.ROIPooling``,
``mx.nd.contrib.PSROIPooling``, ``mx.nd.contrib.ROIAlign(position_sensitive=True)``).
``--markdown`` prints the table with the command, commit and machine (docs/native_ops.md
holds its latest run); "above floor" is ``mx_roi_<Op>`` minus ``mx_roi_noop``, issue
42's targets <= 0.05 ms forward and <= 0.2 ms forward+backward."""
from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np

import mxnet as mx


def sides(op, kw, shape):
    """``{name: fn(data, rois)}`` of one configuration of ``op``."""
    from . import add_safe
    out_shape = json.dumps(list(shape))
    built = {k: v for k, v in kw.items() if k in ("pooled_size", "spatial_scale",
                                                  "sample_ratio", "aligned")}
    native = getattr(mx.nd, "mx_roi_" + op)
    builtin = BUILTINS[op]
    if op == "PSROIPooling":
        built = {k: kw[k] for k in ("pooled_size", "spatial_scale", "output_dim",
                                    "group_size")}
    elif op == "PSROIAlign":
        built = dict(built, position_sensitive=True)
    return {
        "noop Custom": lambda d, r: mx.nd.Custom(d, r, op_type="mx_roi_bench_noop",
                                                 out_shape=out_shape),
        "noop ext": lambda d, r: mx.nd.mx_roi_noop(d, r, out_shape=out_shape),
        "ext": lambda d, r: native(d, r, **kw),
        "ext add_safe": lambda d, r: native(add_safe(d), r, **kw),
        "Custom native": lambda d, r: mx.nd.Custom(d, r, op_type=op, **kw),
        "built-in": lambda d, r: builtin(d, r, **built),
    }


#: the built-in of each op, as the bench's workloads call it
BUILTINS = {"ROIAlign": lambda d, r, **k: mx.nd.contrib.ROIAlign(d, r, **k),
            "ROIPooling": lambda d, r, **k: mx.nd.ROIPooling(d, r, **k),
            "PSROIPooling": lambda d, r, **k: mx.nd.contrib.PSROIPooling(d, r, **k),
            "PSROIAlign": lambda d, r, **k: mx.nd.contrib.ROIAlign(d, r, **k)}

_S = 1 / 32.0
#: (op, label, parameters, data channels)
CONFIGS = (
    ("ROIAlign", "ROIAlign 7x7", dict(pooled_size=(7, 7), spatial_scale=_S), None),
    ("ROIAlign", "ROIAlign aligned 14x14",
     dict(pooled_size=(14, 14), spatial_scale=_S, aligned=True, sample_ratio=2), None),
    ("ROIPooling", "ROIPooling 7x7", dict(pooled_size=(7, 7), spatial_scale=_S), None),
    ("PSROIPooling", "PSROIPooling 7x7",
     dict(pooled_size=7, spatial_scale=_S, output_dim=1, group_size=7), 49),
    ("PSROIAlign", "PSROIAlign 7x7",
     dict(pooled_size=(7, 7), spatial_scale=_S, output_dim=1, sample_ratio=2), 49))


def measure(repeat: int):
    from ..bench import overhead  # noqa: F401  (registers mx_roi_bench_noop)
    from ..bench.overhead import SEED_SMALL, SMALL_BOXES, SMALL_CHANNELS, SMALL_HW
    from ..bench.timing import run_once
    from ..bench.workloads import make_rois
    from . import load
    load()
    rng = np.random.RandomState(SEED_SMALL)
    rois = mx.nd.array(make_rois(SMALL_BOXES, batch=1, seed=SEED_SMALL))
    rows = []
    for op, label, kw, channels in CONFIGS:
        channels = channels or SMALL_CHANNELS
        data = mx.nd.array(rng.standard_normal((1, channels) + SMALL_HW).astype(np.float32))
        pooled = kw["pooled_size"]
        pooled = tuple(pooled) if isinstance(pooled, tuple) else (pooled, pooled)
        shape = (SMALL_BOXES, kw.get("output_dim", channels)) + pooled
        out_grad = mx.nd.ones(shape)
        fns = sides(op, kw, shape)
        for direction in ("fwd", "fwd+bwd"):
            data.attach_grad()
            times = {name: [] for name in fns}
            for name, fn in fns.items():  # warm-up
                run_once(fn, data, rois, direction, out_grad)
            names = list(fns)
            for k in range(repeat):
                for name in names[k % len(names):] + names[:k % len(names)]:
                    times[name].append(run_once(fns[name], data, rois, direction,
                                                out_grad)[0] * 1e3)
            rows.append(dict(config=label, direction=direction,
                             ms={n: statistics.median(t) for n, t in times.items()}))
    return rows


TARGETS = {"fwd": 0.05, "fwd+bwd": 0.2}


def markdown(rows, repeat: int) -> str:
    """The rows as a Markdown table, headed by the command, the commit and the machine."""
    from ..bench.machine import machine_info
    m = machine_info("cpu")
    names = list(rows[0]["ms"])
    lines = [f"`python -m mx_roi.ext.bench --repeat {repeat} --markdown` at git {m['git']}, "
             f"{m['date']}, {m['cpu']} ({m['cpu_count']} logical cores), load "
             f"{m['loadavg']}; ms, medians of interleaved runs, default threads.", "",
             "| call | dir | " + " | ".join(names) + " | above floor | target |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        above = r["ms"]["ext"] - r["ms"]["noop ext"]
        target = TARGETS[r["direction"]]
        lines.append(f"| {r['config']} | {r['direction']} | "
                     + " | ".join(f"{r['ms'][n]:.3f}" for n in names)
                     + f" | {above:.3f} | {'<=' if above <= target else '>'} {target} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=41)
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("MX_ROI_BACKEND", "native")
    rows = measure(args.repeat)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    if args.markdown:
        print(markdown(rows, args.repeat))
        return
    names = list(rows[0]["ms"])
    print(f"{'config':24s} {'dir':8s} " + " ".join(f"{n:>14s}" for n in names))
    for r in rows:
        print(f"{r['config']:24s} {r['direction']:8s} "
              + " ".join(f"{r['ms'][n]:14.3f}" for n in names))


if __name__ == "__main__":
    main()
