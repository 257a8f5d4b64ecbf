"""The small call through both doors (the bench's fixed-cost section; ``python -m
mx_roi.ext.bench`` prints the same rows) and the detector-sized rows through both doors
(``--doors``), timed by one function, :func:`interleave`.

Fixed cost: per op configuration (the main workloads' families) a call whose own work is
negligible -- one image, a 64-channel stride-32 map of a 600x800 image (19x25), 16
proposals -- through every side, interleaved in rotating order:

* ``noop Custom``: a ``Custom`` op that does nothing (:mod:`.overhead`), the floor of the
  Custom door; ``noop native``: the extension library's ``mx_roi_noop``, the floor of the
  native door;
* ``Custom``: the op through the Custom door; ``native``: through the native door
  (:mod:`.doors`; '-' for an op whose ``mx_roi_<Op>`` is not registered);
  ``native add_safe``: the native door behind :func:`mx_roi.ext.add_safe` (the cost of
  making ``grad_req='add'`` right);
* ``built-in``: MXNet's own op, where there is one.

"Above floor" is the median of the paired differences door - its no-op (each run next to
the no-op's run: a shared machine's drift cancels in a pair, not across medians).
Targets: the Custom door's above-floor cost (issue 34: fwd <= 0.25 ms, fwd+bwd <= 0.5);
the native door's (issue 42: fwd <= 0.05, fwd+bwd <= 0.2, for the families in
:data:`NATIVE_TARGET_FAMILIES`); and the native door's whole call <= the built-in's.
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional

import numpy as np

import mxnet as mx

from . import doors
from .timing import agreement, drain, run_once
from .workloads import (DIRECTIONS, FIXED_COST_TARGET_MS, Inputs, Workload, in_layout,
                        make_rois, pooled_hw)

__all__ = ["interleave", "bench_fixed_cost", "bench_doors", "SIDES", "SMALL_REPEAT",
           "DOORS_REPEAT", "NATIVE_TARGET_MS", "NATIVE_TARGET_FAMILIES"]

#: the small call of the fixed-cost section: one image, a 64-channel stride-32 map of a
#: 600x800 image (19x25), 16 proposals -- a call where the op's own work is negligible
SMALL_CHANNELS, SMALL_HW, SMALL_BOXES, SMALL_REPEAT, SEED_SMALL = 64, (19, 25), 16, 41, 7
#: runs per side of the detector-sized rows through both doors (``--doors``)
DOORS_REPEAT = 7
#: issue 42's targets for the native door's small call above the ``mx_roi_noop`` floor (ms)
NATIVE_TARGET_MS = {"fwd": 0.05, "fwd+bwd": 0.2}
#: the op configurations those targets are set for (ROIAlign aligned 14x14 and the rest:
#: only the whole call against the built-in's)
NATIVE_TARGET_FAMILIES = ("ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign")
#: the sides of the small call, in the order of the table
SIDES = ("noop Custom", "noop native", "Custom", "native", "native add_safe", "built-in")


def interleave(fns: Dict[str, Callable], data, rois, direction: str, repeat: int,
               out_grad) -> Dict[str, dict]:
    """Time every side of ``fns`` (``name -> fn(data, rois)``) ``repeat`` times on the same
    arrays, in rotating order (run k starts with side k mod n), after one warm-up each.

    Returns ``{name: dict(runs_ms=[...], ms=median, out=warm-up output as NumPy,
    grad=its data gradient or None)}``; ``direction`` 'fwd' or 'fwd+bwd' (then ``data``
    gets a gradient attached)."""
    if direction == "fwd+bwd":
        data.attach_grad()
    res = {}
    for name, fn in fns.items():
        _, out, grad = run_once(fn, data, rois, direction, out_grad)
        res[name] = dict(runs_ms=[], out=out.asnumpy(),
                         grad=None if grad is None else grad.asnumpy())
    names = list(fns)
    for k in range(repeat):
        for name in names[k % len(names):] + names[:k % len(names)]:
            res[name]["runs_ms"].append(run_once(fns[name], data, rois, direction,
                                                 out_grad)[0] * 1e3)
    for r in res.values():
        r["ms"] = statistics.median(r["runs_ms"])
    return res


def paired_extra(runs: List[float], floor_runs: List[float]) -> float:
    """The median of the paired differences ``runs[k] - floor_runs[k]``."""
    return statistics.median(a - b for a, b in zip(runs, floor_runs))


def _builtin_fn(w: Workload, params: dict, direction: str) -> Optional[Callable]:
    """The built-in's ``fn(data, rois, *extra)`` with ``params`` (None: none here)."""
    if not w.has_builtin or direction not in w.builtin_directions:
        return None
    fn = mx
    for part in w.builtin_name.split(".")[1:]:
        fn = getattr(fn, part)
    return lambda d, r, *extra: fn(d, r, *extra, **params)


def _small_case(w: Workload):
    """(op params, built-in params, data channels, output shape) of ``w``'s small call."""
    kwargs = dict(w.ours_kwargs)
    ph, pw = pooled_hw(kwargs["pooled_size"])
    channels = SMALL_CHANNELS
    if w.extra is not None:  # deformable: output_dim * group_size^2 channels
        G = kwargs["group_size"]
        kwargs["output_dim"] = max(1, SMALL_CHANNELS // (G * G))
        channels = kwargs["output_dim"] * G * G
    elif "output_dim" in kwargs:  # position-sensitive: output_dim * P * Q channels
        kwargs["output_dim"] = max(1, SMALL_CHANNELS // (ph * pw))
        channels = kwargs["output_dim"] * ph * pw
    kwargs["spatial_scale"] = 1.0 / 32
    built = dict(w.builtin_kwargs, spatial_scale=kwargs["spatial_scale"])
    if "output_dim" in built:
        built["output_dim"] = kwargs["output_dim"]
    shape = (SMALL_BOXES, kwargs.get("output_dim", channels), ph, pw)
    return kwargs, built, channels, shape


def small_sides(w: Workload, kwargs: dict, built: dict, shape, extra_in: list,
                direction: str) -> Dict[str, Callable]:
    """The sides of ``w``'s small call in ``direction`` (:data:`SIDES` that exist here)."""
    import json
    from ..ext import add_safe
    from . import overhead  # noqa: F401  (registers the no-op Custom op)
    out_shape = json.dumps(list(shape))
    custom = doors.door(mx.nd, w.op, "custom")
    fns = {"noop Custom": lambda d, r: mx.nd.Custom(d, r, op_type="mx_roi_bench_noop",
                                                    out_shape=out_shape)}
    if not doors.native_missing("noop"):
        fns["noop native"] = lambda d, r: mx.nd.mx_roi_noop(d, r, out_shape=out_shape)
    fns["Custom"] = lambda d, r: custom(d, r, *extra_in, **kwargs)
    if not doors.native_missing(w.op):
        native = doors.door(mx.nd, w.op, "native")
        fns["native"] = lambda d, r: native(d, r, *extra_in, **kwargs)
        fns["native add_safe"] = lambda d, r: native(add_safe(d), r, *extra_in, **kwargs)
    builtin = _builtin_fn(w, built, direction)
    if builtin is not None:
        fns["built-in"] = lambda d, r: builtin(d, r, *extra_in)
    return fns


def bench_fixed_cost(workloads: List[Workload], ctx, repeat: int = SMALL_REPEAT):
    """Per op configuration (the main workloads' families) and direction: the small call
    through every side (:data:`SIDES`), interleaved; one row each with the medians
    (``ms``: side -> ms, None where the side does not exist), the runs, the costs above
    each floor and the targets checked (:func:`_targets`)."""
    rows, seen = [], set()
    rois_np = make_rois(SMALL_BOXES, batch=1, seed=SEED_SMALL)
    for w in workloads:
        family = w.key.split("/")[0]
        if family in seen:
            continue
        seen.add(family)
        kwargs, built, channels, shape = _small_case(w)
        rng = np.random.RandomState(SEED_SMALL)
        data = mx.nd.array(rng.standard_normal((1, channels) + SMALL_HW).astype(np.float32),
                           ctx=ctx)
        rois = mx.nd.array(in_layout(rois_np, w.rois_columns), ctx=ctx)
        out_grad = mx.nd.array(np.ones(shape, np.float32), ctx=ctx)
        extra_in = w.extra_inputs(rois, kwargs)
        for direction in DIRECTIONS:
            fns = small_sides(w, kwargs, built, shape, extra_in, direction)
            res = interleave(fns, data, rois, direction, repeat, out_grad)
            row = dict(key=family, op=w.op, direction=direction,
                       data_shape=list(data.shape), out_shape=list(shape),
                       ms={s: res[s]["ms"] if s in res else None for s in SIDES},
                       runs_ms={s: res[s]["runs_ms"] for s in res},
                       native_missing=doors.native_missing(w.op))
            row.update(_targets(row, family, direction))
            rows.append(row)
            drain()
    return rows


def _targets(row: dict, family: str, direction: str) -> dict:
    """The costs above each floor and the targets: ``extra_ms`` / ``met`` (Custom door
    above the no-op Custom op, issue 34), ``native_extra_ms`` / ``native_met`` (native
    door above ``mx_roi_noop``, issue 42; ``native_target_ms`` None -- and ``native_met``
    None -- for a family without that target), ``whole_met`` (native whole call <= the
    built-in's; None without either)."""
    ms, runs = row["ms"], row["runs_ms"]
    extra = paired_extra(runs["Custom"], runs["noop Custom"])
    out = dict(extra_ms=extra, target_ms=FIXED_COST_TARGET_MS[direction],
               met=extra <= FIXED_COST_TARGET_MS[direction],
               native_extra_ms=None, native_target_ms=None, native_met=None, whole_met=None)
    if ms["native"] is None or ms["noop native"] is None:
        return out
    n_extra = paired_extra(runs["native"], runs["noop native"])
    out["native_extra_ms"] = n_extra
    if family in NATIVE_TARGET_FAMILIES:
        out["native_target_ms"] = NATIVE_TARGET_MS[direction]
        out["native_met"] = n_extra <= NATIVE_TARGET_MS[direction]
    if ms["built-in"] is not None:
        out["whole_met"] = ms["native"] <= ms["built-in"]
    return out


def bench_doors(workloads: List[Workload], inputs: Inputs, repeat: int = DOORS_REPEAT):
    """The detector-sized workloads through the Custom door and the native door,
    interleaved, ``repeat`` runs each; per workload and direction a row with both
    medians, the runs, ``wins`` (runs where native <= Custom, pairing run k of each),
    ``median_ok`` (native median <= Custom median), the agreement of the warm-up outputs
    and gradients (``check``; ``bit_equal``).  An op without a native door gets a row
    with ``native_ms`` None and ``native_missing`` saying why."""
    rows = []
    for w in workloads:
        rois = inputs.rois(w.boxes, w.rois_columns, w.spread)
        out_grad = inputs.out_grad(w.out_shape)
        missing = doors.native_missing(w.op)
        kwargs = dict(w.ours_kwargs)
        extra_in = w.extra_inputs(rois)
        fns = {"Custom": (lambda f: lambda d, r: f(d, r, *extra_in, **kwargs))(
            doors.door(mx.nd, w.op, "custom"))}
        if not missing:
            fns["native"] = (lambda f: lambda d, r: f(d, r, *extra_in, **kwargs))(
                doors.door(mx.nd, w.op, "native"))
        for direction in DIRECTIONS:
            data = inputs.data(w.channels)
            row = dict(key=w.key, op=w.op, config=w.config, direction=direction,
                       native_missing=missing, custom_ms=None, native_ms=None,
                       custom_runs_ms=None, native_runs_ms=None, ratio=None, wins=None,
                       runs=repeat, median_ok=None, check=None, bit_equal=None, error=None)
            try:
                res = interleave(fns, data, rois, direction, repeat, out_grad)
            except Exception as exc:  # a broken door must not hide the other rows
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                drain()
                rows.append(row)
                continue
            c = res["Custom"]
            row.update(custom_ms=c["ms"], custom_runs_ms=c["runs_ms"])
            if "native" in res:
                n = res["native"]
                row.update(native_ms=n["ms"], native_runs_ms=n["runs_ms"],
                           ratio=n["ms"] / c["ms"],
                           wins=sum(a <= b for a, b in zip(n["runs_ms"], c["runs_ms"])),
                           median_ok=n["ms"] <= c["ms"],
                           check=agreement(n["out"], n["grad"], c["out"], c["grad"]),
                           bit_equal=bool(np.array_equal(n["out"], c["out"]) and (
                               n["grad"] is None or np.array_equal(n["grad"], c["grad"]))))
            rows.append(row)
            del data
            drain()
    return rows
