"""``--threads``: the whole bench once per thread setting, each in a child process with
both sides at that count, and the ratios side by side."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

from .machine import usable_cores
from .report import format_doors_summary, format_markdown, format_thread_summary

__all__ = ["thread_env", "run_thread_settings"]



def thread_env(setting: str, env=None) -> dict:
    """The environment of a child run at thread ``setting`` ('default', 'all' or N)."""
    env = dict(os.environ if env is None else env)
    if setting == "default":
        return env
    n = usable_cores() if setting == "all" else int(setting)
    if n < 1:
        raise ValueError(f"--threads: {setting!r} is not a positive thread count")
    for key in ("OMP_NUM_THREADS", "MXNET_OMP_MAX_THREADS", "MX_ROI_NUM_THREADS",
                "OPENBLAS_NUM_THREADS"):
        env[key] = str(n)
    return env


def _child_argv(argv) -> List[str]:
    """``argv`` without --threads / --json / --plot / --markdown (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--threads", "--json", "--plot", "--markdown"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def run_thread_settings(args, argv) -> int:
    """Run the bench once per thread setting in a child process; print a side-by-side
    summary of the ratios (ours / built-in) and the thread counts of both sides."""
    import tempfile
    settings = [s.strip() for s in args.threads.split(",") if s.strip()]
    for s in settings:
        if s not in ("default", "all") and not s.isdigit():
            print(f"--threads: {s!r} is not 'default', 'all' or a positive number",
                  file=sys.stderr)
            return 3
        if s.isdigit() and int(s) < 1:
            print(f"--threads: {s!r} is not a positive thread count", file=sys.stderr)
            return 3
    runs, status = {}, 0
    with tempfile.TemporaryDirectory(prefix="mx_roi_bench_") as tmp:
        for s in settings:
            path = os.path.join(tmp, f"{len(runs)}.json")
            print(f"===== threads: {s} =====", flush=True)
            proc = subprocess.run([sys.executable, "-m", "mx_roi.bench"]
                                  + _child_argv(argv) + ["--json", path],
                                  env=thread_env(s))
            status = max(status, proc.returncode)
            if os.path.exists(path):
                with open(path) as f:
                    runs[s] = json.load(f)
            else:
                runs[s] = None
                status = max(status, 2)
    print()
    print(format_doors_summary(runs) if getattr(args, "doors", False) else format_thread_summary(runs))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(runs) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads_runs=runs, settings=settings), f, indent=1)
    return status

