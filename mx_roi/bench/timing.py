"""Timing: one synchronised run, ours and the built-in interleaved on the same arrays, the
agreement check before any timing counts, every workload in both directions, and the
sweep over the number of boxes (``--plot``)."""
from __future__ import annotations

import statistics
import time
from typing import List

import numpy as np

import mxnet as mx

from . import torchvision_ops
from .workloads import ATOL, DIRECTIONS, RTOL, Inputs, Workload, make_out_grad

__all__ = ["run_once", "compare", "bench_pair", "bench_workload", "bench_all", "sweep", "drain"]



def run_once(fn, data, rois, direction, out_grad):
    """One synchronised run; returns (seconds, output, input gradient or None)."""
    mx.nd.waitall()
    if direction == "fwd":
        t0 = time.perf_counter()
        out = fn(data, rois)
        out.wait_to_read()
        elapsed = time.perf_counter() - t0
        mx.nd.waitall()
        return elapsed, out, None
    t0 = time.perf_counter()
    with mx.autograd.record():
        out = fn(data, rois)
    out.backward(out_grad)
    data.grad.wait_to_read()
    elapsed = time.perf_counter() - t0
    mx.nd.waitall()
    return elapsed, out, data.grad


def compare(a: np.ndarray, b: np.ndarray):
    """(ok, max abs diff, max |b|) with the bench tolerance.  Infinite or NaN values
    (e.g. the uninitialised output of the fixed-cost section's no-op op) give a NaN or
    infinite difference, and no RuntimeWarning."""
    if a.shape != b.shape:
        return False, float("inf"), float(np.abs(b).max()) if b.size else 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        diff = float(np.abs(a - b).max()) if a.size else 0.0
        ok = bool(np.allclose(a, b, rtol=RTOL, atol=ATOL))
    return ok, diff, float(np.abs(b).max()) if b.size else 0.0


def agreement(out_o, grad_o, out_b, grad_b) -> dict:
    """:func:`compare` of our output (and data gradient, when ``grad_o`` is given) with
    another side's: ``fwd_ok``, ``fwd_max_abs_diff``, ``fwd_max_abs``, ``grad_*``, ``ok``."""
    ok, diff, scale = compare(out_o, out_b)
    check = {"fwd_ok": ok, "fwd_max_abs_diff": diff, "fwd_max_abs": scale}
    if grad_o is not None:
        gok, gdiff, gscale = compare(grad_o, grad_b)
        check.update(grad_ok=gok, grad_max_abs_diff=gdiff, grad_max_abs=gscale)
    check["ok"] = bool(check["fwd_ok"] and check.get("grad_ok", True))
    return check


def bench_pair(ours, builtin, data, rois, direction, repeat, out_grad, peer=None):
    """Interleaved ours/builtin timing; returns a result dict (times in ms).

    ``peer`` (optional): ``peer(direction) -> (seconds, output, gradient)`` on its own
    copies of the inputs (torchvision); checked against ours first and timed, interleaved
    as a third side, only where it agrees (``tv_*`` keys)."""
    if direction == "fwd+bwd":
        data.attach_grad()
    # warm-up (one of each), also the outputs checked for agreement
    _, out_o, grad_o = run_once(ours, data, rois, direction, out_grad)
    out_o = out_o.asnumpy()
    grad_o = grad_o.asnumpy() if grad_o is not None else None
    res = {"check": None}
    if builtin is not None:
        _, out_b, grad_b = run_once(builtin, data, rois, direction, out_grad)
        out_b = out_b.asnumpy()
        grad_b = grad_b.asnumpy() if grad_b is not None else None
        check = agreement(out_o, grad_o, out_b, grad_b)
        check["builtin_all_zero"] = bool(not np.any(out_b)) or (
            grad_b is not None and not np.any(grad_b))
        res["check"] = check
    if peer is not None:
        try:
            _, out_p, grad_p = peer(direction)
            res["tv_check"] = agreement(out_o, grad_o, out_p, grad_p)
        except Exception as exc:  # a failing peer costs its column, never our row
            res["tv_check"] = None
            res["tv_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if not (res["tv_check"] or {}).get("ok"):
            peer = None
    ours_t, builtin_t, peer_t = [], [], []
    for _ in range(repeat):
        ours_t.append(run_once(ours, data, rois, direction, out_grad)[0] * 1e3)
        if builtin is not None:
            builtin_t.append(run_once(builtin, data, rois, direction, out_grad)[0] * 1e3)
        if peer is not None:
            peer_t.append(peer(direction)[0] * 1e3)
    res["ours_runs_ms"] = ours_t
    res["builtin_runs_ms"] = builtin_t or None
    res["ours_ms"] = statistics.median(ours_t)
    res["builtin_ms"] = statistics.median(builtin_t) if builtin_t else None
    res["ratio"] = (res["ours_ms"] / res["builtin_ms"]) if builtin_t else None
    if peer_t:
        res.update(tv_runs_ms=peer_t, tv_ms=statistics.median(peer_t))
        res["tv_ratio"] = res["ours_ms"] / res["tv_ms"]
    return res


def bench_workload(w: Workload, inputs: Inputs, repeat: int, directions=DIRECTIONS,
                   tv=None):
    """Both directions of ``w``: one row each; with ``tv`` (a
    :class:`~mx_roi.bench.torchvision_ops.Torchvision`) also its column."""
    rows = []
    rois = inputs.rois(w.boxes, w.rois_columns)
    out_grad = inputs.out_grad(w.out_shape)
    peer, tv_fields = None, {}
    if tv is not None:
        name, kwargs, why = torchvision_ops.counterpart(w.op, w.ours_kwargs)
        tv_fields = dict(tv_op=torchvision_ops.describe(name, kwargs) if name else None,
                         tv_ms=None, tv_runs_ms=None, tv_ratio=None, tv_check=None,
                         tv_note=why)
        if name:
            peer = tv.runner(name, kwargs, inputs.data_np(w.channels), inputs.rois_np[:w.boxes],
                             make_out_grad(w.out_shape))
    for direction in directions:
        data = inputs.data(w.channels)  # fresh array per direction, same values
        try:
            res = bench_pair(w.ours(), w.builtin(direction), data, rois, direction, repeat,
                             out_grad, peer)
        except Exception as exc:  # a broken op must not hide the others' results
            res = dict(check=None, ours_runs_ms=None, builtin_runs_ms=None, ours_ms=None,
                       builtin_ms=None, ratio=None,
                       error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            drain()
        res = {**tv_fields, **res}
        res.update(key=w.key, op=w.op, config=w.config, direction=direction,
                   backend=_backend_of(w, inputs),
                   boxes=w.boxes, channels=w.channels, builtin=w.builtin_name,
                   ours_kwargs={k: (list(v) if isinstance(v, tuple) else v)
                                for k, v in w.ours_kwargs.items()},
                   note=_note(w, res))
        rows.append(res)
        del data
        drain()
    return rows


def _backend_of(w: Workload, inputs) -> str:
    """The mx_roi backend our side runs on (``mx_roi.backends.select``)."""
    from .. import backends
    try:
        return backends.select(inputs.ctx, w.op_instance())
    except Exception as exc:  # e.g. a bad MX_ROI_BACKEND: the run itself reports it
        return f"? ({type(exc).__name__})"


def drain():
    """``mx.nd.waitall`` that swallows an error left over from a failed op."""
    try:
        mx.nd.waitall()
    except Exception:
        pass


def _note(w: Workload, res) -> str:
    notes = [w.note] if w.note else []
    if res.get("error"):
        notes.append("ERROR " + res["error"][:120])
    check = res.get("check")
    if check is not None:
        if check["builtin_all_zero"]:
            notes.append("BUILT-IN IS A STUB (all-zero output/grad), ratio meaningless")
        if not check["fwd_ok"]:
            notes.append(f"FORWARD MISMATCH max|diff|={check['fwd_max_abs_diff']:.3g}")
        if not check.get("grad_ok", True):
            notes.append(f"GRAD MISMATCH max|diff|={check['grad_max_abs_diff']:.3g}")
    notes += _tv_notes(res)
    return "; ".join(notes)


def _tv_notes(res) -> List[str]:
    """Why the torchvision column is '-' for this row (nothing when it is filled)."""
    if res.get("tv_ms") is not None or "tv_op" not in res:
        return []
    if res.get("tv_error"):
        return ["torchvision failed: " + res["tv_error"][:120]]
    check = res.get("tv_check")
    if check is None:
        return [res["tv_note"]] if res.get("tv_note") else []
    what = [f"fwd max|diff|={check['fwd_max_abs_diff']:.3g}"] if not check["fwd_ok"] else []
    if not check.get("grad_ok", True):
        what.append(f"grad max|diff|={check['grad_max_abs_diff']:.3g}")
    return ["torchvision semantics differ (" + ", ".join(what) + ")"]



def bench_all(workloads: List[Workload], inputs: Inputs, repeat: int, label: str = "",
              tv=None):
    rows = []
    for w in workloads:
        new = bench_workload(w, inputs, repeat, tv=tv)
        for r in new:
            bi = f"{r['builtin_ms']:.2f} ms" if r["builtin_ms"] is not None else "-"
            ours = f"{r['ours_ms']:9.2f} ms" if r["ours_ms"] is not None else "ERROR"
            tvs = "" if "tv_op" not in r else (
                f", torchvision {r['tv_ms']:.2f} ms" if r.get("tv_ms") is not None
                else ", torchvision -")
            print(f"  {label}{w.key:<26} {r['direction']:<8} ours {ours}, builtin {bi}{tvs}"
                  + (f"  {r['error']}" if r.get("error") else ""), flush=True)
        rows.extend(new)
    return rows


def sweep(workloads: List[Workload], inputs: Inputs, boxes_list, repeat, direction):
    """Time vs number of boxes for the main 7x7 workloads (one row per op family)."""
    result = {}
    for w in workloads:
        if w.key.endswith("-big") or w.key.startswith("ROIAlign-aligned"):
            continue
        entry = {"boxes": [], "ours_ms": [], "builtin_ms": [], "builtin": w.builtin_name,
                 "config": w.config.split(",")[0], "op": w.op}
        for n in boxes_list:
            ww = Workload(**{**w.__dict__, "boxes": n})
            rois = inputs.rois(n, w.rois_columns)
            out_grad = inputs.out_grad(ww.out_shape)
            data = inputs.data(w.channels)
            try:
                res = bench_pair(ww.ours(), ww.builtin(direction), data, rois, direction, repeat,
                                 out_grad)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                entry.setdefault("failed_boxes", []).append(n)
                drain()
                print(f"  sweep {w.key:<22} {n:>5} boxes: ERROR {entry['error']}", flush=True)
                break
            entry["boxes"].append(n)
            entry["ours_ms"].append(res["ours_ms"])
            entry["builtin_ms"].append(res["builtin_ms"])
            if res["check"] is not None and not res["check"]["ok"]:
                entry.setdefault("failed_boxes", []).append(n)
            print(f"  sweep {w.key:<22} {n:>5} boxes: ours {res['ours_ms']:9.2f} ms"
                  + (f", builtin {res['builtin_ms']:9.2f} ms" if res["builtin_ms"] else ""),
                  flush=True)
        result[w.key] = entry
    return result

