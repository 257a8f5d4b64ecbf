"""Peak extra resident memory of one fwd+bwd, ours and the built-in, each in a fresh
subprocess (``python -m mx_roi.bench --memory-child KEY --side SIDE``)."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from typing import Dict, List

import numpy as np

import mxnet as mx

from .timing import run_once
from .workloads import Inputs, Workload, build_workloads

__all__ = ["memory_child", "bench_memory", "mb"]

def _proc_status_bytes() -> Dict[str, int]:
    """VmRSS / VmHWM (peak RSS) of this process in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(key: str, side: str, quick: bool, ctx_name: str) -> dict:
    """In a fresh process: peak RSS growth of one fwd+bwd of ``side`` for workload ``key``."""
    w = {w.key: w for w in build_workloads(quick, True)}[key]
    ctx = mx.gpu(0) if ctx_name == "gpu" else mx.cpu()
    fn = w.ours() if side == "ours" else w.builtin()
    inputs = Inputs(ctx, w.boxes)
    data = inputs.data(w.channels)
    data.attach_grad()
    rois = inputs.rois(w.boxes, w.rois_columns)
    shape = w.out_shape
    out_grad = inputs.out_grad(shape)
    # warm up the code path with 2 boxes so imports/JIT/first allocations are not counted
    small = inputs.rois(2, w.rois_columns)
    run_once(fn, data, small, "fwd+bwd", inputs.out_grad((2,) + shape[1:]))
    mx.nd.waitall()
    if _reset_peak_rss():  # peak RSS now == current RSS: the delta is this fwd+bwd's peak
        method = "VmHWM after clear_refs"
        base = _proc_status_bytes()["VmRSS"]
        run_once(fn, data, rois, "fwd+bwd", out_grad)
        mx.nd.waitall()
        peak = _proc_status_bytes()["VmHWM"]
    else:  # ru_maxrss is a high-water mark since start: misses peaks below the import's
        method = "ru_maxrss (lower bound)"
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        run_once(fn, data, rois, "fwd+bwd", out_grad)
        mx.nd.waitall()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out_bytes = int(np.prod(shape)) * 4
    grad_bytes = int(np.prod(data.shape)) * 4
    return dict(key=key, side=side, extra_bytes=max(peak - base, 0), out_bytes=out_bytes,
                grad_bytes=grad_bytes, baseline_rss_bytes=base, method=method)


def bench_memory(workloads: List[Workload], quick: bool, ctx_name: str):
    rows = []
    for w in workloads:
        entry = {"key": w.key, "config": w.config}
        for side in ("ours", "builtin"):
            if side == "builtin" and w.builtin("fwd+bwd") is None:
                entry[side] = None
                continue
            cmd = [sys.executable, "-m", "mx_roi.bench", "--memory-child", w.key,
                   "--side", side, "--ctx", ctx_name] + (["--quick"] if quick else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not line:
                entry[side] = None
                entry[side + "_error"] = (proc.stderr or proc.stdout)[-500:]
                continue
            res = json.loads(line[-1])
            entry[side] = res["extra_bytes"]
            entry["out_bytes"], entry["grad_bytes"] = res["out_bytes"], res["grad_bytes"]
            entry["method"] = res["method"]
        print(f"  memory {w.key:<22} ours {mb(entry.get('ours'))}, "
              f"builtin {mb(entry.get('builtin'))}", flush=True)
        rows.append(entry)
    return rows


def mb(v):
    """``v`` bytes as MB, '-' for None."""
    return "-" if v is None else f"{v / 2**20:.1f} MB"

