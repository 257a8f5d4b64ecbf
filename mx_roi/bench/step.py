"""Step-level benchmark: a detector's train step with MXNet's built-in RoI op and with ours.

Run as ``python -m mx_roi.bench --step`` (or ``python -m mx_roi.bench.step``).  Op-level
ratios do not reach the user; the training step does.  For every configuration three
executors are bound from the *same* graph: with the built-in op (``mx.sym.ROIPooling`` /
``mx.sym.contrib.ROIAlign`` / ``mx.sym.contrib.PSROIPooling``), with ours through the
Custom door (``mx.sym.Custom``, with the oneDNN guard; "ours") and with ours through the
native door (``mx.sym.mx_roi_<Op>``, :mod:`.doors`; "native", where the extension
library registers the op), given the same weights, and stepped forward+backward in
rotating order; the least-disturbed (minimum) step time of each side is reported with
the ratios ours / built-in and native / ours and the verdict native no slower than ours.
Before timing, the first step's outputs (losses) and every parameter gradient of each
mx_roi side are compared with the built-in's (``check``); a mismatch makes the run exit
with status 2.

Models (2 images 224x320, fixed seeded proposals fed as an input, so both sides pool the
same boxes; no optimizer update, so every step does the same work):

* ``frcnn-*``: Faster R-CNN C4: a ResNet bottleneck body to stride 16, the RoI op, one
  stride-2 bottleneck unit as the head (ResNet's stage 5), global average pool, class
  scores + box deltas, softmax and smooth-L1 losses;
* ``rfcn-*``: R-FCN: the same body, a 1x1 conv, position-sensitive class (21 x 7 x 7) and
  box (8 x 7 x 7) maps, two PSROIPooling ops, average voting, the same losses.

``--model lite`` (default) uses narrow layers (C4: 256 channels) so a step takes about a
second on 2 cores; ``--model resnet50`` builds the body and head from
``example_rcnn.symbol`` (MXNet example/rcnn's ResNet-50 layers, 1024 channels at C4: about
8 s a step on 2 cores), where the RoI op's share of the step is much smaller.

Thread settings (each in its own child process, since OpenMP reads its variables once):
``default`` (``OMP_NUM_THREADS`` and ``MX_ROI_NUM_THREADS`` unset: MXNet's OpenMP and our
pools choose) and ``equal`` (both set to the CPU count).

Where the time goes: one more step per side runs under ``mx.profiler``
(``profile_all``, ``aggregate_stats``; operator bulking off so every operator is listed).
The built-in op appears as its operator (``ROIPooling``, ``_backward_ROIPooling``); our
op appears in the profiler's ``Custom Operator`` domain as ``ROIPooling::pure_python``
and ``_backward_ROIPooling::pure_python`` (the Python callbacks on MXNet's custom-op
thread), and its oneDNN guard as ``_copy``/``clip``/``_backward_clip`` operators.  Inside
the callbacks our own timers split kernel, geometry, input checks and the rest (NumPy
views, ``req`` handling).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Dict, List

from .doors import native_missing
from .step_model import (CONFIGS, IMAGES, QUICK_CONFIGS, SIDES, StepConfig, bind,
                         build_symbol, compare_sides, graph_ops, load_params, param_values,
                         run_step)
from .step_profile import instrument, profile_side

__all__ = ["main", "run_setting", "StepConfig", "CONFIGS", "QUICK_CONFIGS", "build_symbol"]

# --------------------------------------------------------------------------- one setting


def run_setting(configs: List[StepConfig], steps: int, model: str, profile: bool) -> dict:
    """All configurations in this process (its thread environment): timings, checks, profile."""
    os.environ.setdefault("MXNET_EXEC_BULK_EXEC_TRAIN", "1")
    import mxnet as mx
    import mx_roi  # noqa: F401  (registers the ops, installs the guard)
    from .machine import machine_info
    results = []
    for cfg in configs:
        missing = native_missing(cfg.op)
        sides = [s for s in SIDES if s != "native" or not missing]
        syms = {side: build_symbol(cfg, side, model) for side in sides}
        exes = {side: bind(s, cfg) for side, s in syms.items()}
        params = param_values(exes["builtin"])
        for exe in exes.values():
            load_params(exe, params)
        for side in sides:
            run_step(exes[side])
        check = compare_sides(exes)
        native_check = None if missing else compare_sides(exes, "native")
        graph = dict(same=graph_ops(syms["ours"]) == graph_ops(syms["builtin"]),
                     nodes={s: len(json.loads(v.tojson())["nodes"]) for s, v in syms.items()},
                     params_equal=sorted(exes["ours"].arg_dict) ==
                     sorted(exes["builtin"].arg_dict))
        runs: Dict[str, List[float]] = {s: [] for s in sides}
        for i in range(steps):
            # rotating order (ours, builtin, native; builtin, native, ours; ...)
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                runs[side].append(1e3 * run_step(exes[side]))
        del exes
        best = {s: min(v) for s, v in runs.items()}
        row = dict(config=asdict(cfg), name=cfg.name, op=cfg.op, rois=cfg.rois,
                   ours_ms=best["ours"], builtin_ms=best["builtin"],
                   ratio=best["ours"] / best["builtin"],
                   median_ratio=statistics.median(runs["ours"]) /
                   statistics.median(runs["builtin"]),
                   builtin_spread=max(runs["builtin"]) / min(runs["builtin"]) - 1,
                   ours_runs_ms=runs["ours"], builtin_runs_ms=runs["builtin"],
                   check=check, graph=graph,
                   native=_native_row(runs, missing, native_check, syms))
        if profile:
            # bulk execution merges operators into one profiler entry: off for this pass
            os.environ["MXNET_EXEC_BULK_EXEC_TRAIN"] = "0"
            try:
                pexes = {side: bind(s, cfg) for side, s in syms.items()}
                for exe in pexes.values():
                    load_params(exe, params)
                    run_step(exe)
                timers = instrument(cfg.op)
                row["profile"] = {side: profile_side(mx, pexes[side], side, cfg,
                                                      timers if side == "ours" else None)
                                  for side in ("builtin", "ours", "native") if side in pexes}
                del pexes
            finally:
                os.environ["MXNET_EXEC_BULK_EXEC_TRAIN"] = "1"
        results.append(row)
    return dict(machine=machine_info("cpu"), results=results)


def _native_row(runs, missing: str, check, syms) -> dict:
    """The native door's column of a step row: its least-disturbed step, native / ours
    (the Custom door) on the min and on the median steps, the verdict ``no_slower``
    (min native <= min ours), its first-step check against the built-in and whether its
    graph is the same apart from the RoI node; ``missing`` says why there is none."""
    if missing:
        return dict(missing=missing, ms=None, runs_ms=None, ratio=None, median_ratio=None,
                    no_slower=None, check=None, graph_same=None)
    ms, ours = min(runs["native"]), min(runs["ours"])
    return dict(missing="", ms=ms, runs_ms=runs["native"], ratio=ms / ours,
                median_ratio=statistics.median(runs["native"]) /
                statistics.median(runs["ours"]),
                no_slower=ms <= ours, check=check,
                graph_same=graph_ops(syms["native"]) == graph_ops(syms["builtin"]))


# --------------------------------------------------------------------------- driver

THREAD_SETTINGS = ("default", "equal")


#: glibc's tunable that backs malloc's large allocations with transparent huge pages
#: (glibc >= 2.35; older ones ignore it): ``--hugetlb``
HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"


def _child_env(setting: str, hugetlb: bool = False) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MX_ROI_NUM_THREADS"):
        env.pop(k, None)
    if setting == "equal":
        n = str(os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = env["MX_ROI_NUM_THREADS"] = n
    if hugetlb:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"),
                                                      HUGETLB_TUNABLE) if t)
    from .machine import CHECKOUT as root
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_child(setting: str, args) -> dict:
    cmd = [sys.executable, "-m", "mx_roi.bench.step", "--child", "--configs",
           ",".join(c.name for c in args.config_list), "--steps", str(args.steps),
           "--model", args.model] + (["--quick"] if args.quick else []) + \
        ([] if args.profile else ["--no-profile"])
    proc = subprocess.run(cmd, env=_child_env(setting, args.hugetlb), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"step benchmark child ({setting}) failed with status "
                           f"{proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt_ms(v):
    return "-" if v is None else (f"{v:8.1f}" if v < 1e4 else f"{v:8.0f}")


def _report(settings: List[dict]) -> List[str]:
    lines = []
    for s in settings:
        m = s["machine"]
        lines.append(f"\n== threads: {s['threads']} ({s['env_note']}); load average "
                     f"{m.get('loadavg')}")
        lines.append(f"{'config':<20} {'rois':>5} {'ours ms':>8} {'builtin':>8} {'ours/bi':>7} "
                     f"{'median':>6} {'spread':>6} {'op%bi':>6} {'op%ours':>7} {'guard%':>6} "
                     f"{'native':>8} {'nat/ours':>8} {'median':>6} {'nat<=ours':>9} "
                     f"{'op%nat':>6}  check")
        for r in s["results"]:
            p = r.get("profile") or {}
            bi, ou = p.get("builtin", {}), p.get("ours", {})

            def pct(d, key):
                v, w = d.get(key), d.get("wall_ms")
                return f"{100 * v / w:5.1f}%" if v is not None and w else "    -"
            n = r["native"]
            ok = "ok" if _row_ok(r) else "MISMATCH"
            verdict = "-" if n["no_slower"] is None else "yes" if n["no_slower"] else "NO"
            lines.append(f"{r['name']:<20} {r['rois']:>5} {_fmt_ms(r['ours_ms'])} "
                         f"{_fmt_ms(r['builtin_ms'])} {r['ratio']:7.3f} {r['median_ratio']:6.3f} "
                         f"{100 * r['builtin_spread']:5.0f}% {pct(bi, 'op_ms'):>6} "
                         f"{pct(ou, 'op_ms'):>7} {pct(ou, 'guard_ms'):>6} "
                         f"{_fmt_ms(n['ms'])} {_fmt_ratio(n['ratio'], 8)} "
                         f"{_fmt_ratio(n['median_ratio'], 6)} {verdict:>9} "
                         f"{pct(p.get('native', {}), 'op_ms'):>6}  {ok} "
                         f"(rel err {r['check']['max_rel_err']:.1e}"
                         + (f", native {n['check']['max_rel_err']:.1e})" if n["check"] else ")")
                         + (f" [{n['missing']}]" if n["missing"] else ""))
        for r in s["results"]:
            p = r.get("profile")
            if not p:
                continue
            bi, ou = p["builtin"], p["ours"]
            cb = ou.get("callback_ms", {})
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cb.items()))
            lines.append(f"  {r['name']}: profiled step builtin {bi['wall_ms']:.0f} ms "
                         f"(op {bi['op_ms']:.1f}: " + ", ".join(
                             f"{k} {v:.1f}" for k, v in bi["op_entries"].items()) +
                         f"); ours {ou['wall_ms']:.0f} ms (Custom " + ", ".join(
                             f"{k} {v:.1f}" for k, v in ou["op_entries"].items()) +
                         f"; guard {ou['guard_ms']:.1f}: " + ", ".join(
                             f"{k} {v:.1f}" for k, v in ou["guard_entries"].items()) +
                         f"; inside the callbacks: {parts})")
            na = p.get("native")
            if na:
                lines.append(f"  {r['name']}: profiled step native {na['wall_ms']:.0f} ms (op "
                             f"{na['op_ms']:.1f}: " + ", ".join(
                                 f"{k} {v:.1f}" for k, v in na["op_entries"].items()) +
                             f"; guard {na['guard_ms']:.1f}; inside the callbacks: fwd "
                             f"{na['callback_ms']['fwd']:.1f}, bwd {na['callback_ms']['bwd']:.1f}"
                             f"; MXNet's share {na['mxnet_ms']:.1f})")
    lines.append("\nours/bi: least-disturbed (min) step time, ours / built-in (< 1: ours is "
                 "faster); median: the same for the median steps; spread: the built-in's "
                 "slowest / fastest step - 1 (the machine's noise: a ratio closer to 1 than "
                 "this says nothing); op%: the RoI op's share of a profiled step (forward + backward; "
                 "ours: the Custom op's Python callbacks), guard%: oneDNN guard "
                 "(_copy/clip/_backward_clip) share; ours = the Custom door (mx.sym.Custom), "
                 "native = the native door (mx.sym.mx_roi_<Op>): nat/ours its min (median) "
                 "step / ours's, nat<=ours the verdict on the min steps, op%nat its "
                 "operators' share (MXNet's share: the operators' time outside the "
                 "library's callbacks -- MXNet's dispatch, and its copy of each "
                 "oneDNN-layout input, e.g. a convolution's gradient, into fresh memory); "
                 "all times in ms.")
    return lines


def _fmt_ratio(v, width):
    return f"{'-':>{width}}" if v is None else f"{v:{width}.3f}"


def _row_ok(r) -> bool:
    """Both mx_roi sides computed the built-in's step on the same graph (the native side
    where it ran)."""
    n = r["native"]
    return bool(r["check"]["ok"] and r["graph"]["same"] and
                (n["missing"] or (n["check"]["ok"] and n["graph_same"])))


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m mx_roi.bench --step",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny models (64x96 images, 16 rois per image), 2 steps, default "
                        "threads only: a few seconds")
    p.add_argument("--configs", default=None,
                   help="comma-separated configuration names (default: all): " +
                        ", ".join(c.name for c in CONFIGS))
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per side (min reported); default 5, 2 with --quick")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread settings: default (OMP_NUM_THREADS and "
                        "MX_ROI_NUM_THREADS unset), equal (both = CPU count); default both, "
                        "'default' with --quick")
    p.add_argument("--model", choices=("lite", "resnet50", "quick"), default="lite",
                   help="lite: narrow ResNet layers (C4 256 channels); resnet50: "
                        "example_rcnn.symbol's ResNet-50 C4 body and stage-5 head")
    p.add_argument("--hugetlb", action="store_true",
                   help="run the steps with GLIBC_TUNABLES=" + HUGETLB_TUNABLE + " (glibc >= "
                        "2.35 backs large allocations with transparent huge pages: MXNet "
                        "1.9.1 mallocs every CPU array, and a large fresh one page-faults)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the profiled step")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    pool = QUICK_CONFIGS if args.quick else CONFIGS
    names = [c.name for c in pool]
    if args.configs:
        wanted = [s.strip() for s in args.configs.split(",") if s.strip()]
        bad = [w for w in wanted if w not in names]
        if bad:
            p.error(f"unknown configuration(s) {bad}; choose from {names}")
        args.config_list = [c for c in pool if c.name in wanted]
    else:
        args.config_list = list(pool)
    if args.steps is None:
        args.steps = 2 if args.quick else 5
    if args.steps < 1:
        p.error("--steps must be >= 1")
    threads = args.threads or ("default" if args.quick else ",".join(THREAD_SETTINGS))
    args.thread_list = [t.strip() for t in threads.split(",") if t.strip()]
    if not args.thread_list or any(t not in THREAD_SETTINGS for t in args.thread_list):
        p.error(f"--threads: expected some of {THREAD_SETTINGS}, got {threads!r}")
    if args.quick:
        args.model = "quick"
    return args


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(run_setting(args.config_list, args.steps, args.model, args.profile)))
        return 0
    t0 = time.perf_counter()
    settings = []
    for t in args.thread_list:
        res = _run_child(t, args)
        n = os.cpu_count()
        res.update(threads=t, env_note=("OMP_NUM_THREADS, MX_ROI_NUM_THREADS unset" if
                                        t == "default" else
                                        f"OMP_NUM_THREADS=MX_ROI_NUM_THREADS={n}"))
        settings.append(res)
    print(f"step benchmark: model {args.model}, {IMAGES} images, {args.steps} interleaved "
          "steps per side (forward+backward, no update), min reported" +
          (f"; every side with GLIBC_TUNABLES={HUGETLB_TUNABLE}" if args.hugetlb else ""))
    print("\n".join(_report(settings)))
    failures = [f"{s['threads']}:{r['name']}" for s in settings for r in s["results"]
                if not _row_ok(r)]
    slower = [f"{s['threads']}:{r['name']}" for s in settings for r in s["results"]
              if r["native"]["no_slower"] is False]
    judged = [r for s in settings for r in s["results"] if r["native"]["no_slower"] is not None]
    print(f"\nnative no slower than Custom (min steps) in {len(judged) - len(slower)} of "
          f"{len(judged)} rows" + (f"; slower: {', '.join(slower)}" if slower else ""))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mode="step", model=args.model, steps=args.steps, quick=args.quick,
                           hugetlb=args.hugetlb,
                           settings=settings, failures=failures), f, indent=1)
    if failures:
        print("MISMATCH between ours (Custom or native door) and the built-in: "
              + ", ".join(failures),
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
