"""The small call through both doors, alone: ``python -m mx_roi.ext.bench [--repeat N]
[--quick] [--json] [--markdown]``.

A thin entry to the fixed-cost section of ``python -m mx_roi.bench``
(:func:`mx_roi.bench.small_call.bench_fixed_cost`: one measuring function for both):
per op configuration of the bench's main workloads (one image, a 64-channel 19x25 map,
16 boxes, spatial_scale 1/32; the PS ops on output_dim * 7 * 7 = 49 channels), forward
and forward+backward, medians of ``N`` interleaved runs of each side -- the two no-op
floors (a no-op ``Custom`` op and the extension library's ``mx_roi_noop``), the op
through the Custom door, through the native door (``mx_roi_<Op>``, '-' where the
library has none), the native door behind :func:`mx_roi.ext.add_safe`, and the
built-in -- with the cost above each floor and issue 42's targets checked (<= 0.05 ms
forward and <= 0.2 ms forward+backward above ``mx_roi_noop``; the whole native call no
slower than the built-in's).  ``--markdown`` prints the table headed by the command,
commit and machine (docs/native_ops.md holds its latest run).  The Custom door runs on
the ``native`` backend unless ``MX_ROI_BACKEND`` says otherwise, so both doors run the
same kernels."""
from __future__ import annotations

import argparse
import json
import os


def measure(repeat: int, quick: bool = False):
    """The fixed-cost rows (:func:`mx_roi.bench.small_call.bench_fixed_cost`) of the
    bench's main workloads (no variants)."""
    import mxnet as mx
    from ..bench.small_call import bench_fixed_cost
    from ..bench.workloads import build_workloads
    return bench_fixed_cost(build_workloads(quick, variants=False), mx.cpu(), repeat)


def markdown(rows, repeat: int) -> str:
    """The rows as a Markdown table, headed by the command, the commit and the machine."""
    from ..bench.machine import machine_info
    from ..bench.report import fixed_cost_legend, format_fixed_cost_markdown
    m = machine_info("cpu")
    cores = f"{m['cpu_count']} logical cores"
    if m["cpu_affinity"] and m["cpu_affinity"] < (m["cpu_count"] or 0):
        cores += f", the process pinned to {m['cpu_affinity']} of them"
    lines = [f"`python -m mx_roi.ext.bench --repeat {repeat} --markdown` at git {m['git']}, "
             f"{m['date']}, {m['cpu']} ({cores}), load "
             f"{m['loadavg']}; default threads; {fixed_cost_legend()}.", ""]
    return "\n".join(lines + format_fixed_cost_markdown(rows))


def main(argv=None):
    from ..bench.small_call import SMALL_REPEAT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=None,
                   help=f"interleaved runs per side (default {SMALL_REPEAT}, 5 with --quick)")
    p.add_argument("--quick", action="store_true", help="5 runs per side")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    repeat = args.repeat or (5 if args.quick else SMALL_REPEAT)
    if repeat < 1:
        p.error("--repeat must be >= 1")
    os.environ.setdefault("MX_ROI_BACKEND", "native")
    rows = measure(repeat, args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.markdown:
        print(markdown(rows, repeat))
    else:
        from ..bench.report import format_fixed_cost
        print(format_fixed_cost(rows))


if __name__ == "__main__":
    main()
