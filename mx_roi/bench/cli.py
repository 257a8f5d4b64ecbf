"""Benchmark the mx_roi custom ops against MXNet's built-in RoI operators.

The options and ``main`` of ``python -m mx_roi.bench`` (the package docstring,
:mod:`mx_roi.bench`, describes the workloads and what is measured).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import mxnet as mx

from . import report, torchvision_ops
from .busy import add_busy_ratios, busy_core
from .machine import machine_info
from .memory import bench_memory, memory_child
from .overhead import bench_overhead
from .roofline import add_bounds, probe_hardware
from .small_call import DOORS_REPEAT, SMALL_REPEAT, bench_doors, bench_fixed_cost
from .threads import run_thread_settings
from .timing import bench_all, sweep
from .workloads import (ATOL, BATCH, DIRECTIONS, FEAT_H, FEAT_W, IMAGE_H, IMAGE_W, RTOL,
                        SEED, SPATIAL_SCALE, SWEEP_BOXES, Inputs, build_door_workloads,
                        build_workloads, select_workloads)

__all__ = ["main"]


def _parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mx_roi.bench", description=__doc__.split("\n")[0])
    p.add_argument("--ctx", choices=("cpu", "gpu"), default="cpu",
                   help="run on the CPU (default) or on GPU 0 (both sides; where MXNet is "
                        "a CPU build, our calls alone on CuPy arrays: bench.gpu_kernels)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs per side (median reported); default 5, 2 with --quick")
    p.add_argument("--quick", action="store_true",
                   help="reduced sizes, 2 runs, no variants/memory: seconds-long smoke run")
    p.add_argument("--variants", dest="variants", action="store_true", default=None,
                   help="also the 14x14 / 512-box variant of each workload "
                        "(default: on, off with --quick)")
    p.add_argument("--no-variants", dest="variants", action="store_false")
    p.add_argument("--memory", dest="memory", action="store_true", default=None,
                   help="peak extra RSS of one fwd+bwd per op in a fresh subprocess "
                        "(default: on, off with --quick)")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--only", default=None,
                   help="comma-separated workload keys (ROIAlign/7x7) or families (ROIAlign, "
                        "ROIAlign-max, PSROIAlign, ...) to run")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--markdown", default=None,
                   help="write the speed table of docs/benchmarks.md (Markdown; with --threads, every "
                        "setting's ratios side by side) to this file")
    p.add_argument("--plot", default=None,
                   help="PNG: median time vs number of boxes (64..2048) for ours and built-in")
    p.add_argument("--plot-boxes", default=None,
                   help="comma-separated box counts for --plot (default 64,...,2048; "
                        "16,32,64 with --quick)")
    p.add_argument("--plot-repeat", type=int, default=3, help="runs per point for --plot")
    p.add_argument("--plot-direction", choices=DIRECTIONS, default="fwd+bwd")
    p.add_argument("--step", action="store_true",
                   help="step-level benchmark: Faster R-CNN / R-FCN train steps with the "
                        "built-in op and ours (mx_roi.bench.step; --step --help for its options)")
    p.add_argument("--doors", action="store_true",
                   help="only the detector-sized workloads through the Custom door "
                        "(mx.nd.Custom) against the native door (mx.nd.mx_roi_<Op>), "
                        f"interleaved, {DOORS_REPEAT} runs each (--repeat), a verdict native "
                        "<= Custom per row; with --threads per thread setting")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread settings, each run in a child process with "
                        "both sides at that count: 'default' (the environment as it is), "
                        "'all' (every usable core), or a number N (OMP_NUM_THREADS, "
                        "MXNET_OMP_MAX_THREADS, MX_ROI_NUM_THREADS and OPENBLAS_NUM_THREADS "
                        "= N); e.g. default,1,all")
    p.add_argument("--busy", action="store_true",
                   help="time every workload a second time while another process keeps one "
                        "core busy; report busy/quiet per side")
    p.add_argument("--torchvision", dest="torchvision", action="store_true", default=None,
                   help="time torchvision.ops as a third side where it computes the same "
                        "(default: when torch and torchvision import; with --ctx gpu its "
                        "CUDA kernels, where torch sees the GPU)")
    p.add_argument("--no-torchvision", dest="torchvision", action="store_false")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--side", default="ours", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 2 if args.quick else DOORS_REPEAT if args.doors else 5
    if args.variants is None:
        args.variants = not args.quick
    if args.memory is None:
        args.memory = not args.quick
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def _load_torchvision(args, machine):
    """(Torchvision or None, why there is no column or ''); records it in ``machine``."""
    if args.torchvision is False:
        return None, ""
    tv, why = torchvision_ops.load(machine["threads"]["ours"],
                                   device_id=0 if args.ctx == "gpu" else None)
    if tv is None:
        return None, (f"not importable ({why}); no torchvision column (optional: pip install "
                      "'mx_roi[torch]', docs/installing.md)")
    if args.ctx == "gpu" and torchvision_ops.gpu_available(tv):
        return None, torchvision_ops.gpu_available(tv) + "; no torchvision column"
    machine["torchvision"] = tv.info
    return tv, ""


def _write_outputs(args, payload):
    """``--json`` (the payload) and ``--markdown`` (its tables) of one run."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report.format_markdown({"default": payload}) + "\n")


def _doors_main(args, ctx, argv) -> int:
    """``--doors``: the detector-sized workloads through both doors (small_call.bench_doors)."""
    t_start = time.perf_counter()
    machine = machine_info(args.ctx)
    print(report.format_header(machine, args), flush=True)
    workloads = select_workloads(build_door_workloads(args.quick, args.variants), args.only)
    if not workloads:
        print(f"--only {args.only!r} matches no workload", file=sys.stderr)
        return 3
    inputs = Inputs(ctx, max(w.boxes for w in workloads))
    rows = bench_doors(workloads, inputs, args.repeat)
    failures = [f"{r['key']} {r['direction']}" + (" (error)" if r["error"] else "")
                for r in rows if r["error"] or (r["check"] is not None and not r["check"]["ok"])]
    print()
    print(report.format_doors(rows))
    elapsed = time.perf_counter() - t_start
    print(f"\ntotal bench time {elapsed:.1f} s")
    if failures:
        print("ERROR: the native door and the Custom door disagree on: " + ", ".join(failures),
              file=sys.stderr)
    payload = dict(machine=machine, mode="doors",
                   config=dict(argv=list(argv), quick=args.quick, repeat=args.repeat,
                               variants=args.variants, seed=SEED, rtol=RTOL, atol=ATOL),
                   doors=rows, failures=failures, total_seconds=elapsed)
    _write_outputs(args, payload)
    return 2 if failures else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--step" in argv:  # the step-level mode has its own options
        from . import step
        return step.main([a for a in argv if a != "--step"])
    args = _parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.side, args.quick, args.ctx)))
        return 0
    if args.ctx == "gpu":
        if mx.context.num_gpus() == 0:
            from .. import gpucheck
            if gpucheck.cupy_gpu_count() > 0:  # MXNet is a CPU build: our calls alone
                from . import gpu_kernels
                return gpu_kernels.main(args)
            print("--ctx gpu: no GPU visible to MXNet (mx.context.num_gpus() == 0) or "
                  "CuPy", file=sys.stderr)
            return 3
        ctx = mx.gpu(0)
    else:
        ctx = mx.cpu()
    if args.threads:
        return run_thread_settings(args, sys.argv[1:] if argv is None else list(argv))
    if args.doors:
        return _doors_main(args, ctx, argv)
    t_start = time.perf_counter()
    machine = machine_info(args.ctx)
    tv, tv_missing = _load_torchvision(args, machine)
    if args.torchvision and tv is None:
        print(f"--torchvision: {tv_missing}", file=sys.stderr)
        return 3
    print(report.format_header(machine, args), flush=True)
    if tv_missing:
        print(f"torchvision: {tv_missing}", flush=True)
    print(flush=True)
    hw = probe_hardware(args.quick)

    workloads = build_workloads(args.quick, args.variants)
    workloads = select_workloads(workloads, args.only)
    if not workloads:
        print(f"--only {args.only!r} matches no workload", file=sys.stderr)
        return 3
    sweep_boxes = ([int(v) for v in args.plot_boxes.split(",")] if args.plot_boxes else
                   ([16, 32, 64] if args.quick else list(SWEEP_BOXES)))
    max_boxes = max([w.boxes for w in workloads] + (sweep_boxes if args.plot else [1]))
    inputs = Inputs(ctx, max_boxes)

    rows = bench_all(workloads, inputs, args.repeat, tv=tv)
    add_bounds(rows, workloads, hw)
    busy_rows = None
    if args.busy:
        with busy_core():
            busy_rows = bench_all(workloads, inputs, args.repeat, label="busy ")
        add_busy_ratios(busy_rows, rows)

    overhead = bench_overhead(inputs, workloads, args.repeat)
    fixed = bench_fixed_cost(workloads, ctx, 5 if args.quick else SMALL_REPEAT)
    if args.memory and args.ctx == "gpu":
        print("--memory measures host RSS; skipped with --ctx gpu", flush=True)
        args.memory = False
    memory = bench_memory(workloads, args.quick, args.ctx) if args.memory else None
    sweep_result = None
    if args.plot:
        sweep_result = sweep(workloads, inputs, sweep_boxes, args.plot_repeat,
                             args.plot_direction)
        report.plot(sweep_result, args.plot, args.plot_direction, machine)

    comparable = [r for r in rows if r["direction"] == "fwd+bwd" and r["ratio"] is not None
                  and not (r["check"] and r["check"]["builtin_all_zero"])]
    gm = report.geomean([r["ratio"] for r in comparable])
    gm_fwd = report.geomean([r["ratio"] for r in rows if r["direction"] == "fwd"
                      and r["ratio"] is not None
                      and not (r["check"] and r["check"]["builtin_all_zero"])])
    failures = [f"{r['key']} {r['direction']}" + (" (error)" if r.get("error") else "")
                for r in rows + (busy_rows or [])
                if r.get("error") or (r["check"] is not None and not r["check"]["ok"])]
    for key, e in (sweep_result or {}).items():
        failures += [f"{key} {args.plot_direction} ({n} boxes)" for n in e.get("failed_boxes", [])]

    print()
    print(report.format_header(machine, args))
    print()
    print(report.format_table(rows))
    print()
    print(report.format_hardware(hw))
    print(report.format_legend())
    if tv is not None:
        print(report.format_tv_summary(rows))
    if gm is not None:
        print(f"geometric mean of fwd+bwd ratios ours/builtin over {len(comparable)} "
              f"comparable workloads: {gm:.2f}" + (f"  (fwd only: {gm_fwd:.2f})" if gm_fwd else ""))
    if busy_rows is not None:
        print()
        print(report.format_busy(busy_rows))
    if overhead:
        print()
        print(report.format_overhead(overhead))
    if fixed:
        print()
        print(report.format_fixed_cost(fixed))
    if memory is not None:
        print()
        print(report.format_memory(memory))
    elapsed = time.perf_counter() - t_start
    print()
    print(f"total bench time {elapsed:.1f} s")
    if failures:
        print("ERROR: ours and the built-in disagree on: " + ", ".join(failures),
              file=sys.stderr)

    if args.json or args.markdown:
        payload = dict(machine=machine,
                       config=dict(argv=sys.argv[1:] if argv is None else list(argv),
                                   quick=args.quick, repeat=args.repeat,
                                   variants=args.variants, batch=BATCH,
                                   feature_map=[FEAT_H, FEAT_W], image=[IMAGE_H, IMAGE_W],
                                   spatial_scale=SPATIAL_SCALE, seed=SEED,
                                   rtol=RTOL, atol=ATOL),
                       results=rows, geomean_fwd_bwd_ratio=gm, geomean_fwd_ratio=gm_fwd,
                       hardware=hw, busy=busy_rows,
                       overhead=overhead, fixed_cost=fixed, memory=memory, sweep=sweep_result,
                       failures=failures,
                       total_seconds=elapsed)
    _write_outputs(args, payload)
    return 2 if failures else 0
