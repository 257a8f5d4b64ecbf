"""Two versions of the compiled kernels in one process, paired: ``python -m
mx_roi.bench.kernel_ab --base REV [--only KEYS] [--direction fwd|train|bwd] [--repeat N]
[--quick]``.

The ``native`` backend's kernels are built twice -- from ``operators/`` at the git
revision ``REV`` (its ``.cu`` / ``.cuh`` files, read with ``git show``) and from the
working tree -- and loaded side by side (a compiled module is keyed by its source text).
Each detector workload (:func:`mx_roi.bench.workloads.build_workloads`, without the
variants; ops with extra inputs left out) then runs through the backend ``N`` times per
side, alternating (run k starts with the base when k is even), on the checked path (not the
extension library's launcher, which is one build: both sides pay the same Python); a backward computes every gradient the
op has (PrRoIPool's rois' gradient too).  Per workload: both medians, the ratio tree /
base, and the runs where the tree's call was the faster of its pair.

For a kernel change on a noisy machine the pairing is what counts: on the 2-vCPU VM, the
same library timed in separate processes drifted by 30% from run to run, while the
paired runs of one process agreed (ROIAlign 7x7 inference forward: the tree faster in
30 of 30 pairs).  Thread count: ``MX_ROI_NUM_THREADS`` as for any native call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from typing import Dict, List

import numpy as np

DIRECTIONS = ("fwd", "train", "bwd")  # inference forward, forward keeping argmax, backward


def repo_root() -> str:
    """The git checkout this package lives in (ValueError when it is not one)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return subprocess.run(["git", "-C", here, "rev-parse", "--show-toplevel"],
                              check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise ValueError(f"kernel_ab: {here} is not a git checkout ({e})") from None


def extract_operators(rev: str, dest: str) -> List[str]:
    """Write the ``.cu`` / ``.cuh`` files of ``operators/`` at ``rev`` into ``dest``;
    returns their names.  ValueError naming ``rev`` when git does not know it."""
    root = repo_root()
    ls = subprocess.run(["git", "-C", root, "ls-tree", "--name-only", rev, "operators/"],
                        capture_output=True, text=True)
    names = [os.path.basename(p) for p in ls.stdout.split()
             if p.endswith((".cu", ".cuh"))]
    if ls.returncode != 0 or not names:
        raise ValueError(f"kernel_ab: no kernel sources at revision {rev!r} "
                         f"({ls.stderr.strip() or 'operators/ holds no .cu files'})")
    for name in names:
        text = subprocess.run(["git", "-C", root, "show", f"{rev}:operators/{name}"],
                              check=True, capture_output=True).stdout
        with open(os.path.join(dest, name), "wb") as f:
            f.write(text)
    return names


class _Side:
    """The compiled modules of one source directory (the loader's module table)."""

    def __init__(self, opdir: str):
        self.opdir = opdir
        self.modules: Dict = {}


def _use(side: _Side) -> None:
    from ..cuda import loader, source
    source._operators_dir = lambda: side.opdir
    source.read_source.cache_clear()
    loader._MODULES = side.modules


def _call(backend, op, direction, x, rois, out, grad, dgrad, saved, rgrad=None):
    """One call in ``direction``; returns the array to wait for.  A backward computes every
    gradient the op has (the rois' too where it differentiates them: ``rgrad``)."""
    if direction == "bwd":
        if rgrad is not None:
            backend.backward(op, "write", grad, x, rois, dgrad, saved, rois_req="write",
                             rois_grad_nd=rgrad)
            rgrad.wait_to_read()
        else:
            backend.backward(op, "write", grad, x, rois, dgrad, saved)
        return dgrad
    backend.forward(op, "write", x, rois, out, keep=direction == "train")
    return out


def compare(rev: str, direction: str = "fwd", repeat: int = 30, only=None,
            quick: bool = False) -> List[dict]:
    """Rows ``dict(key, direction, base_ms, tree_ms, ratio, wins, runs)`` of the paired
    comparison (see the module docstring)."""
    import mxnet as mx
    from ..cuda import loader, source
    from ..cuda.backend import CudaBackend
    from ..ndio import Kind
    from .workloads import Inputs, build_workloads, select_workloads
    if direction not in DIRECTIONS:
        raise ValueError(f"kernel_ab: direction {direction!r}; expected one of {DIRECTIONS}")
    workloads = [w for w in select_workloads(build_workloads(quick, variants=False), only)
                 if w.extra is None]
    backend = CudaBackend(Kind.NATIVE)
    backend.library_calls = False  # the checked path: the modules are looked up per call
    inputs = Inputs(mx.cpu(), max(w.boxes for w in workloads) if workloads else 1)
    saved_dir, saved_modules = source._operators_dir, loader._MODULES
    rows = []
    with tempfile.TemporaryDirectory(prefix="mx_roi_ab_") as tmp:
        extract_operators(rev, tmp)
        sides = {"base": _Side(tmp), "tree": _Side(saved_dir())}
        try:
            for w in workloads:
                op = w.op_instance()
                x, rois = inputs.data(w.channels), inputs.rois(w.boxes, w.rois_columns)
                out = mx.nd.zeros(w.out_shape)
                grad, dgrad = inputs.out_grad(w.out_shape), mx.nd.zeros(x.shape)
                rgrad = mx.nd.zeros(rois.shape) if op.differentiates_rois else None
                saved = {}
                for name, side in sides.items():  # build, warm up, keep a training forward
                    _use(side)
                    saved[name] = backend.forward(op, "write", x, rois, out, keep=True)
                    _call(backend, op, direction, x, rois, out, grad, dgrad, saved[name],
                          rgrad).wait_to_read()
                runs = {name: [] for name in sides}
                for k in range(repeat):
                    for name in (("base", "tree") if k % 2 == 0 else ("tree", "base")):
                        _use(sides[name])
                        t0 = time.perf_counter()
                        _call(backend, op, direction, x, rois, out, grad, dgrad, saved[name],
                              rgrad).wait_to_read()
                        runs[name].append((time.perf_counter() - t0) * 1e3)
                base, tree = (statistics.median(runs[n]) for n in ("base", "tree"))
                rows.append(dict(key=w.key, direction=direction, base_ms=base, tree_ms=tree,
                                 ratio=tree / base if base > 0 else float("nan"),
                                 wins=sum(t < b for t, b in zip(runs["tree"], runs["base"])),
                                 runs=repeat))
        finally:
            source._operators_dir = saved_dir
            source.read_source.cache_clear()
            loader._MODULES = saved_modules
    return rows


def format_rows(rows: List[dict], rev: str) -> str:
    lines = [f"kernels at {rev} (base) against the working tree (tree), paired in one "
             f"process; MX_ROI_NUM_THREADS={os.environ.get('MX_ROI_NUM_THREADS', '-')}",
             f"  {'workload':34s} {'dir':5s} {'base ms':>9s} {'tree ms':>9s} {'tree/base':>9s}"
             f"  tree faster"]
    for r in rows:
        lines.append(f"  {r['key']:34s} {r['direction']:5s} {r['base_ms']:9.3f} "
                     f"{r['tree_ms']:9.3f} {r['ratio']:9.2f}  {r['wins']}/{r['runs']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision of the base kernels")
    p.add_argument("--direction", default="fwd", choices=DIRECTIONS)
    p.add_argument("--repeat", type=int, default=30, help="paired runs per workload")
    p.add_argument("--only", default=None, help="workload keys or families, comma-separated")
    p.add_argument("--quick", action="store_true", help="the small workloads")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    try:
        rows = compare(args.base, args.direction, args.repeat, args.only, args.quick)
    except ValueError as e:
        p.exit(2, f"{e}\n")
    print(format_rows(rows, args.base))
    return rows


if __name__ == "__main__":
    main()
