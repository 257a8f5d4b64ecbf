"""Where a step's time goes: one step under ``mx.profiler`` per side, and timers inside
mx_roi's callbacks (the Custom door's: kernel, geometry, input checks; the native door's:
its forward and backward callbacks, timed by the library)."""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, Optional

from .doors import NATIVE_PREFIX
from .step_model import BUILTIN_OPS, GUARD_OPS, StepConfig, run_step

__all__ = ["Timers", "TIMERS", "instrument", "parse_aggregate", "profile_side"]


# --------------------------------------------------------------------------- profiling


class Timers:
    """Wall time of mx_roi's callback pieces (kernel, geometry, checks; a native
    call into the extension library whole: library_fwd / library_bwd), by name."""

    def __init__(self):
        self.ms: Dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, owner, attr, key):
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_step_timed", False):
            return

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self.lock:
                    self.ms[key] = self.ms.get(key, 0.0) + 1e3 * (time.perf_counter() - t0)
        timed._step_timed = True
        setattr(owner, attr, timed)


TIMERS = Timers()


def instrument(op_name: str) -> Timers:
    """Wrap ``op_name``'s kernels, geometry and checks and the backends' callbacks in
    :data:`TIMERS` (once; idempotent)."""
    from .. import backends
    from ..registry import get_op
    timers = TIMERS
    cls = get_op(op_name)
    for attr in ("forward_numpy", "forward_cuda"):
        timers.wrap(cls, attr, "kernel_fwd")
    for attr in ("backward_numpy", "backward_cuda"):
        timers.wrap(cls, attr, "kernel_bwd")
    timers.wrap(cls, "geometry", "geometry")
    from ..cuda.compiled_geometry import CompiledGeometry  # the host builds' geometry
    timers.wrap(CompiledGeometry, "build", "geometry")
    timers.wrap(cls, "check_inputs", "check_inputs")
    # the native backend's calls into the extension library: checks, geometry and kernels
    # in one compiled call per direction (mx_roi.cuda.library_calls), timed whole
    from ..cuda.library_calls import LibraryCalls
    timers.wrap(LibraryCalls, "forward", "library_fwd")
    timers.wrap(LibraryCalls, "backward", "library_bwd")
    for name in ("numpy", "native"):
        try:
            backend = type(backends.get(name))
        except Exception:  # noqa: BLE001 - no native build: that backend is not used
            continue
        timers.wrap(backend, "forward", "callback_fwd")
        timers.wrap(backend, "backward", "callback_bwd")
    return timers


def parse_aggregate(text: str) -> Dict[str, Dict[str, float]]:
    """``mx.profiler.dumps()`` aggregate table -> {domain: {name: total ms}}."""
    out: Dict[str, Dict[str, float]] = {}
    domain, lines = None, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("=====") and i > 0:
            domain = lines[i - 1].strip()
            out.setdefault(domain, {})
            continue
        parts = line.split()
        if domain is None or len(parts) < 6 or parts[0] in ("Name", "----"):
            continue
        try:
            nums = [float(v) for v in parts[-5:]]
        except ValueError:
            continue
        name = " ".join(parts[:-5])
        if domain != "Device Storage":
            out[domain][name] = out[domain].get(name, 0.0) + nums[1]
    return out


def profile_side(mx, exe, side: str, cfg: StepConfig, timers: Optional[Timers]) -> dict:
    mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                           filename=os.devnull if os.name != "nt" else "NUL")
    if timers is not None:
        timers.ms.clear()
    if side == "native":
        from .. import ext
        ext.callback_timing(True)
    mx.profiler.set_state("run")
    wall = run_step(exe)
    mx.profiler.set_state("stop")
    if side == "native":
        inside = ext.callback_times()
        ext.callback_timing(False)
    table = parse_aggregate(mx.profiler.dumps(reset=True))
    ops = table.get("operator", {})
    custom = table.get("Custom Operator", {})
    total_ops = sum(ops.values()) + sum(v for k, v in custom.items() if k.endswith("pure_python"))
    res = dict(wall_ms=1e3 * wall, operators_ms=total_ops)
    if side == "builtin":
        res["op_ms"] = sum(ops.get(n, 0.0) for n in BUILTIN_OPS[cfg.op])
        res["op_entries"] = {n: ops[n] for n in BUILTIN_OPS[cfg.op] if n in ops}
    elif side == "native":  # the extension op and its backward, as MXNet operators
        res["op_entries"] = {k: v for k, v in ops.items() if NATIVE_PREFIX + cfg.op in k}
        res["op_ms"] = sum(res["op_entries"].values())
        res["guard_ms"] = sum(ops.get(n, 0.0) for n in GUARD_OPS)
        res["guard_entries"] = {n: ops[n] for n in GUARD_OPS if n in ops}
        # the library's callbacks (mx_roi.ext.callback_times): the rest of op_ms is
        # MXNet's (dispatch; oneDNN-layout inputs copied into fresh memory first)
        res["callback_ms"] = dict(fwd=inside["fwd_ms"], bwd=inside["bwd_ms"])
        res["mxnet_ms"] = res["op_ms"] - inside["fwd_ms"] - inside["bwd_ms"]
    else:
        py = {k: v for k, v in custom.items() if cfg.op in k}
        res["op_ms"] = sum(v for k, v in py.items() if k.endswith("pure_python"))
        res["op_entries"] = py
        res["guard_ms"] = sum(ops.get(n, 0.0) for n in GUARD_OPS)
        res["guard_entries"] = {n: ops[n] for n in GUARD_OPS if n in ops}
        res["callback_ms"] = dict(timers.ms) if timers is not None else {}
    res["op_share"] = res["op_ms"] / res["wall_ms"] if res["wall_ms"] else None
    return res


