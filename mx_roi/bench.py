"""Benchmark the mx_roi custom ops against MXNet's built-in RoI operators.

Run as ``python -m mx_roi.bench`` (``--help`` for the options).  For every workload the
custom op ("ours") and the MXNet built-in run in the *same* process on the *same*
NDArrays, interleaved (ours, builtin, ours, builtin, ...), synchronised with
``wait_to_read``/``mx.nd.waitall`` outside the timed op; the table shows the medians and
the ratio ours/builtin (< 1: ours is faster).  Before any timing counts, the forward
outputs (and, for fwd+bwd, the input gradients) of both sides are compared with
``np.allclose`` on the benchmark inputs; a mismatch is flagged in the table and makes
the run exit with status 2, so a fast-but-wrong kernel cannot hide behind a good ratio.

Workloads (issue 6): data (N=2, C=256, 38x50) - a 600x800 image at stride 16 -,
256 seeded random proposals inside the image, median of ``--repeat`` (5) runs:

* ROIPooling 7x7                      vs ``mx.nd.ROIPooling``
* ROIAlign 7x7, sample_ratio=2        vs ``mx.nd.contrib.ROIAlign``
* ROIAlign 14x14, aligned=True        vs ``mx.nd.contrib.ROIAlign(aligned=True)``
* ROIAlign 7x7, pool_mode='max'       no built-in: absolute time only
* PSROIPooling 21 classes, 7x7        vs ``mx.nd.contrib.PSROIPooling``
* PSROIAlign 21 classes, 7x7          vs ``mx.nd.contrib.ROIAlign(position_sensitive=True)``

plus, with ``--variants`` (on by default in a full run), a 14x14 / 512-box variant of
each.  Each in ``fwd`` and ``fwd+bwd`` (autograd: ``attach_grad`` on data, ``record``,
``backward`` with a fixed seeded out-grad, ``wait_to_read`` on the gradient).

Also reported: the cost of the ``Custom`` call itself (two trivial custom ops registered
here with the same shapes: one that does nothing, one that only moves the inputs to
NumPy and writes a zero output / gradient, the floor of any NumPy-backed custom op),
the peak extra resident memory of one fwd+bwd (``ru_maxrss`` delta in a fresh
subprocess per op and side; ``--memory``) and, with ``--plot out.png``, time against
the number of boxes (64 ... 2048) for ours and the built-in.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

import mxnet as mx

import mx_roi

__all__ = ["main", "Workload", "build_workloads", "make_rois", "machine_info"]

IMAGE_H, IMAGE_W, STRIDE = 600, 800, 16
FEAT_H, FEAT_W = IMAGE_H // STRIDE + 1, IMAGE_W // STRIDE  # 38 x 50, as a VGG/ResNet C4 map
SPATIAL_SCALE = 1.0 / STRIDE
BATCH = 2
SEED = 0
DIRECTIONS = ("fwd", "fwd+bwd")
SWEEP_BOXES = (64, 128, 256, 512, 1024, 2048)
RTOL, ATOL = 1e-4, 1e-4

# --------------------------------------------------------------------------- inputs


def make_rois(count: int, batch: int = BATCH, seed: int = SEED,
              image_hw=(IMAGE_H, IMAGE_W)) -> np.ndarray:
    """``count`` realistic proposals (batch_index, x1, y1, x2, y2) inside the image.

    Sizes are log-uniform from 16 to ~2/3 of the image side, aspect ratios log-uniform
    in [1/3, 3] (RPN anchors span 1:2..2:1 plus regression), centres uniform; boxes are
    clipped to the image as a proposal layer does.  The set for ``count`` boxes is a
    prefix of the set for more boxes, so sweeps grow one workload.
    """
    rng = np.random.RandomState(seed)
    img_h, img_w = image_hw
    n = max(count, 1)
    idx = rng.randint(0, batch, size=n)
    scale = np.exp(rng.uniform(np.log(16.0), np.log(min(img_h, img_w) * 0.66), size=n))
    aspect = np.exp(rng.uniform(np.log(1 / 3.0), np.log(3.0), size=n))  # h / w
    w = scale / np.sqrt(aspect)
    h = scale * np.sqrt(aspect)
    cx = rng.uniform(0, img_w - 1, size=n)
    cy = rng.uniform(0, img_h - 1, size=n)
    x1 = np.clip(cx - w / 2, 0, img_w - 2)
    y1 = np.clip(cy - h / 2, 0, img_h - 2)
    x2 = np.clip(np.maximum(cx + w / 2, x1 + 1), 0, img_w - 1)
    y2 = np.clip(np.maximum(cy + h / 2, y1 + 1), 0, img_h - 1)
    rois = np.stack([idx, x1, y1, x2, y2], axis=1).astype(np.float32)
    return rois[:count]


def make_data(channels: int, seed: int = SEED) -> np.ndarray:
    rng = np.random.RandomState(seed + 1000 + channels)
    return rng.standard_normal((BATCH, channels, FEAT_H, FEAT_W)).astype(np.float32)


def make_out_grad(shape, seed: int = SEED) -> np.ndarray:
    rng = np.random.RandomState(seed + 2000)
    return rng.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """One row pair of the table: an op configuration, ours against the built-in."""

    key: str                    # stable id, e.g. "ROIAlign/7x7"
    op: str                     # mx_roi op name
    config: str                 # human description
    channels: int
    boxes: int
    ours_kwargs: Dict
    builtin_name: Optional[str]  # e.g. "mx.nd.contrib.ROIAlign"; None: no built-in
    builtin_kwargs: Dict = field(default_factory=dict)
    note: str = ""

    @property
    def has_builtin(self) -> bool:
        return self.builtin_name is not None

    def ours(self) -> Callable:
        fn = getattr(mx_roi.nd, self.op)
        kwargs = dict(self.ours_kwargs)
        return lambda data, rois: fn(data, rois, **kwargs)

    def builtin(self) -> Optional[Callable]:
        if self.builtin_name is None:
            return None
        fn = mx
        for part in self.builtin_name.split(".")[1:]:
            fn = getattr(fn, part)
        kwargs = dict(self.builtin_kwargs)
        return lambda data, rois: fn(data, rois, **kwargs)


def build_workloads(quick: bool = False, variants: bool = True) -> List[Workload]:
    """The issue-6 workloads; ``quick`` shrinks channels/boxes for a seconds-long run."""
    if quick:
        channels, boxes, classes = 32, 32, 4
        big_boxes = 64
    else:
        channels, boxes, classes = 256, 256, 21
        big_boxes = 512
    s = SPATIAL_SCALE
    out: List[Workload] = []

    def add(size, nboxes, suffix=""):
        p = (size, size)
        tag = f"{size}x{size}, {nboxes} boxes"
        out.append(Workload(f"ROIPooling/{size}x{size}{suffix}", "ROIPooling", tag, channels,
                            nboxes, dict(pooled_size=p, spatial_scale=s),
                            "mx.nd.ROIPooling", dict(pooled_size=p, spatial_scale=s)))
        out.append(Workload(f"ROIAlign/{size}x{size}{suffix}", "ROIAlign",
                            f"{tag}, sample_ratio=2", channels, nboxes,
                            dict(pooled_size=p, spatial_scale=s, sample_ratio=2),
                            "mx.nd.contrib.ROIAlign",
                            dict(pooled_size=p, spatial_scale=s, sample_ratio=2)))
        if size == 7:  # the 14x14 aligned workload; its variant is the 512-box one
            ap, atag = (14, 14), f"14x14, {nboxes} boxes"
        else:
            ap, atag = p, tag
        out.append(Workload(f"ROIAlign-aligned/{ap[0]}x{ap[1]}{suffix}", "ROIAlign",
                            f"{atag}, aligned=True, sample_ratio=2", channels, nboxes,
                            dict(pooled_size=ap, spatial_scale=s, sample_ratio=2, aligned=True),
                            "mx.nd.contrib.ROIAlign",
                            dict(pooled_size=ap, spatial_scale=s, sample_ratio=2, aligned=True)))
        out.append(Workload(f"ROIAlign-max/{size}x{size}{suffix}", "ROIAlign",
                            f"{tag}, pool_mode='max', sample_ratio=2", channels, nboxes,
                            dict(pooled_size=p, spatial_scale=s, sample_ratio=2,
                                 pool_mode="max"),
                            None, note="no built-in"))
        ps_channels = classes * size * size
        pstag = f"{classes} cls, {size}x{size}, {nboxes} boxes, C={ps_channels}"
        out.append(Workload(f"PSROIPooling/{size}x{size}{suffix}", "PSROIPooling", pstag,
                            ps_channels, nboxes,
                            dict(pooled_size=p, output_dim=classes, group_size=size,
                                 spatial_scale=s),
                            "mx.nd.contrib.PSROIPooling",
                            dict(pooled_size=size, output_dim=classes, group_size=size,
                                 spatial_scale=s)))
        out.append(Workload(f"PSROIAlign/{size}x{size}{suffix}", "PSROIAlign",
                            pstag + ", sample_ratio=2", ps_channels, nboxes,
                            dict(pooled_size=p, output_dim=classes, spatial_scale=s,
                                 sample_ratio=2),
                            "mx.nd.contrib.ROIAlign",
                            dict(pooled_size=p, spatial_scale=s, sample_ratio=2,
                                 position_sensitive=True)))

    add(7, boxes)
    if variants:
        add(14, big_boxes, suffix="-big")
    return out


# --------------------------------------------------------------------------- overhead ops


class _NoopOp(mx.operator.CustomOp):
    """Does nothing: the cost of the Custom call (dispatch, thread hop, callbacks)."""

    def forward(self, is_train, req, in_data, out_data, aux):
        pass

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        pass


class _NumpyIOOp(mx.operator.CustomOp):
    """Moves the inputs to NumPy and writes zeros: the floor of a NumPy-backed op."""

    def forward(self, is_train, req, in_data, out_data, aux):
        in_data[0].asnumpy()
        in_data[1].asnumpy()
        out_data[0][:] = np.zeros(out_data[0].shape, np.float32)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        out_grad[0].asnumpy()
        in_data[1].asnumpy()
        in_grad[0][:] = np.zeros(in_grad[0].shape, np.float32)
        in_grad[1][:] = 0


def _overhead_prop(op_cls):
    class _Prop(mx.operator.CustomOpProp):
        def __init__(self, out_shape):
            super().__init__(need_top_grad=True)
            self.out_shape = tuple(int(v) for v in json.loads(out_shape))

        def list_arguments(self):
            return ["data", "rois"]

        def list_outputs(self):
            return ["output"]

        def infer_shape(self, in_shape):
            return in_shape, [self.out_shape], []

        def declare_backward_dependency(self, out_grad, in_data, out_data):
            return [out_grad[0], in_data[1]]

        def create_operator(self, ctx, shapes, dtypes):
            return op_cls()

    return _Prop


OVERHEAD_OPS = {"mx_roi_bench_noop": (_NoopOp, "Custom call, no-op"),
                "mx_roi_bench_numpy_io": (_NumpyIOOp, "Custom call + NumPy I/O, zeros out")}
for _name, (_cls, _) in OVERHEAD_OPS.items():
    mx.operator.register(_name)(_overhead_prop(_cls))


# --------------------------------------------------------------------------- timing


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
    """(ok, max abs diff, max |b|) with the bench tolerance."""
    if a.shape != b.shape:
        return False, float("inf"), float(np.abs(b).max()) if b.size else 0.0
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    ok = bool(np.allclose(a, b, rtol=RTOL, atol=ATOL))
    return ok, diff, float(np.abs(b).max()) if b.size else 0.0


def bench_pair(ours, builtin, data, rois, direction, repeat, out_grad):
    """Interleaved ours/builtin timing; returns a result dict (times in ms)."""
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
        ok, diff, scale = compare(out_o, out_b)
        check = {"fwd_ok": ok, "fwd_max_abs_diff": diff, "fwd_max_abs": scale}
        if grad_o is not None:
            gok, gdiff, gscale = compare(grad_o, grad_b)
            check.update(grad_ok=gok, grad_max_abs_diff=gdiff, grad_max_abs=gscale)
        check["builtin_all_zero"] = bool(not np.any(out_b)) or (
            grad_b is not None and not np.any(grad_b))
        check["ok"] = bool(check["fwd_ok"] and check.get("grad_ok", True))
        res["check"] = check
    ours_t, builtin_t = [], []
    for _ in range(repeat):
        ours_t.append(run_once(ours, data, rois, direction, out_grad)[0] * 1e3)
        if builtin is not None:
            builtin_t.append(run_once(builtin, data, rois, direction, out_grad)[0] * 1e3)
    res["ours_runs_ms"] = ours_t
    res["builtin_runs_ms"] = builtin_t or None
    res["ours_ms"] = statistics.median(ours_t)
    res["builtin_ms"] = statistics.median(builtin_t) if builtin_t else None
    res["ratio"] = (res["ours_ms"] / res["builtin_ms"]) if builtin_t else None
    return res


class Inputs:
    """Seeded inputs on a context, shared by ours and the built-in (identical arrays)."""

    def __init__(self, ctx, max_boxes):
        self.ctx = ctx
        self.rois_np = make_rois(max_boxes)
        self._data = {}

    def data(self, channels):
        if channels not in self._data:
            self._data[channels] = make_data(channels)
        return mx.nd.array(self._data[channels], ctx=self.ctx)

    def rois(self, count):
        return mx.nd.array(self.rois_np[:count], ctx=self.ctx)

    def out_grad(self, shape):
        return mx.nd.array(make_out_grad(shape), ctx=self.ctx)


def _out_shape(w: Workload):
    ph, pw = w.ours_kwargs["pooled_size"]
    cout = w.ours_kwargs.get("output_dim", w.channels)
    return (w.boxes, cout, ph, pw)


def bench_workload(w: Workload, inputs: Inputs, repeat: int, directions=DIRECTIONS):
    rows = []
    rois = inputs.rois(w.boxes)
    out_grad = inputs.out_grad(_out_shape(w))
    for direction in directions:
        data = inputs.data(w.channels)  # fresh array per direction, same values
        try:
            res = bench_pair(w.ours(), w.builtin(), data, rois, direction, repeat, out_grad)
        except Exception as exc:  # a broken op must not hide the others' results
            res = dict(check=None, ours_runs_ms=None, builtin_runs_ms=None, ours_ms=None,
                       builtin_ms=None, ratio=None,
                       error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            _drain()
        res.update(key=w.key, op=w.op, config=w.config, direction=direction,
                   backend=_backend_of(w, inputs),
                   boxes=w.boxes, channels=w.channels, builtin=w.builtin_name,
                   ours_kwargs={k: (list(v) if isinstance(v, tuple) else v)
                                for k, v in w.ours_kwargs.items()},
                   note=_note(w, res))
        rows.append(res)
        del data
        _drain()
    return rows


def _backend_of(w: Workload, inputs) -> str:
    """The mx_roi backend our side runs on (``mx_roi.backends.select``)."""
    from . import backends, registry
    cls = registry.get_op(w.op)
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in w.ours_kwargs.items()}))
    try:
        return backends.select(inputs.ctx, op)
    except Exception as exc:  # e.g. a bad MX_ROI_BACKEND: the run itself reports it
        return f"? ({type(exc).__name__})"


def _drain():
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
    return "; ".join(notes)


def bench_overhead(inputs: Inputs, workloads: List[Workload], repeat: int):
    """Time the trivial custom ops with the shapes of each distinct main workload."""
    rows, seen = [], set()
    for w in workloads:
        shape = _out_shape(w)
        sig = (w.channels, shape)
        if sig in seen or w.key.endswith("-big"):
            continue
        seen.add(sig)
        rois = inputs.rois(w.boxes)
        out_grad = inputs.out_grad(shape)
        for op_type, (_, label) in OVERHEAD_OPS.items():
            def fn(data, rois, _t=op_type, _s=json.dumps(list(shape))):
                return mx.nd.Custom(data, rois, op_type=_t, out_shape=_s)
            for direction in DIRECTIONS:
                data = inputs.data(w.channels)
                res = bench_pair(fn, None, data, rois, direction, repeat, out_grad)
                rows.append(dict(op_type=op_type, label=label, direction=direction,
                                 data_shape=list(data.shape), out_shape=list(shape),
                                 ms=res["ours_ms"], runs_ms=res["ours_runs_ms"]))
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
            rois = inputs.rois(n)
            out_grad = inputs.out_grad(_out_shape(ww))
            data = inputs.data(w.channels)
            try:
                res = bench_pair(ww.ours(), ww.builtin(), data, rois, direction, repeat,
                                 out_grad)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                entry.setdefault("failed_boxes", []).append(n)
                _drain()
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


def plot(sweep_result, path, direction, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(sweep_result)
    cols = min(3, len(keys))
    rows = int(math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        e = sweep_result[key]
        ax.plot(e["boxes"], e["ours_ms"], "o-", label="mx_roi (Custom)")
        if e["builtin"] and all(v is not None for v in e["builtin_ms"]):
            ax.plot(e["boxes"], e["builtin_ms"], "s--", label=e["builtin"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(e["boxes"])
        ax.set_xticklabels([str(b) for b in e["boxes"]])
        ax.set_title(f"{key} ({direction})", fontsize=10)
        ax.set_xlabel("number of boxes")
        ax.set_ylabel("median time [ms]")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"mx_roi vs MXNet built-in, {machine.get('ctx')}, {machine.get('cpu')}, "
                 f"mxnet {machine.get('mxnet')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- memory


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
    rois = inputs.rois(w.boxes)
    shape = _out_shape(w)
    out_grad = inputs.out_grad(shape)
    # warm up the code path with 2 boxes so imports/JIT/first allocations are not counted
    small = inputs.rois(2)
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
            if side == "builtin" and not w.has_builtin:
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
        print(f"  memory {w.key:<22} ours {_mb(entry.get('ours'))}, "
              f"builtin {_mb(entry.get('builtin'))}", flush=True)
        rows.append(entry)
    return rows


def _mb(v):
    return "-" if v is None else f"{v / 2**20:.1f} MB"


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_names() -> List[str]:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    except Exception:
        return []


def machine_info(ctx_name: str) -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        features = sorted(f.name for f in mx.runtime.Features().values() if f.enabled)
    except Exception:
        features = []
    env_keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "MKL_DYNAMIC", "KMP_AFFINITY", "OMP_PROC_BIND", "MX_ROI_BACKEND",
                "MX_ROI_NUM_THREADS")
    env = {k: os.environ[k] for k in env_keys if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("MXNET_")})
    try:
        num_gpus = mx.context.num_gpus()
    except Exception:
        num_gpus = 0
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=_cpu_model(), cpu_count=os.cpu_count(), cpu_affinity=affinity,
        platform=platform.platform(), python=platform.python_version(),
        mxnet=mx.__version__, numpy=np.__version__, mx_roi=getattr(mx_roi, "__version__", "?"),
        mxnet_features=features, env=env, ctx=ctx_name, num_gpus=num_gpus,
        gpus=_gpu_names() if ctx_name == "gpu" else [], loadavg=_loadavg(),
        git=_git_commit(), threads=thread_info())


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mxnet_omp_threads(env=None) -> int:
    """The OpenMP threads MXNet's CPU operators use (its engine's rule, src/engine/openmp.cc):
    ``MXNET_OMP_MAX_THREADS`` if set, else ``OMP_NUM_THREADS`` if set, else half the
    usable logical cores on x86 (its comment: hyper-threading; all of them elsewhere)."""
    env = os.environ if env is None else env
    for key in ("MXNET_OMP_MAX_THREADS", "OMP_NUM_THREADS"):
        v = env.get(key, "").split(",")[0].strip()
        if v:
            try:
                return max(1, int(v))
            except ValueError:
                pass
    cores = usable_cores()
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return max(1, cores // 2 if x86 else cores)


def thread_info() -> dict:
    """Both sides' thread counts in this process."""
    from . import parallel
    return dict(mxnet=mxnet_omp_threads(), ours=parallel.num_threads(),
                ours_blas_in_kernels=1 if parallel._blas_handles().set is not None else None,
                numpy_blas=parallel.blas_threads())


def _git_commit() -> Optional[str]:
    """The mx_roi checkout's commit (``+dirty`` with local changes), if it is a git tree."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, timeout=10,
                              capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "mx_roi"], cwd=root, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def _loadavg():
    try:
        return [float(f"{v:.2f}") for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def format_header(m: dict, args) -> str:
    env = ", ".join(f"{k}={v}" for k, v in sorted(m["env"].items())) or "(none set)"
    feats = [f for f in m["mxnet_features"] if f in
             ("MKLDNN", "OPENMP", "BLAS_OPEN", "BLAS_MKL", "BLAS_ATLAS", "BLAS_APPLE",
              "CUDA", "CUDNN", "NCCL", "INT64_TENSOR_SIZE")]
    lines = [
        f"mx_roi.bench  {m['date']}  ctx={m['ctx']}"
        + (f" ({', '.join(m['gpus'])})" if m["gpus"] else ""),
        f"CPU: {m['cpu']}, {m['cpu_count']} logical cores ({m['cpu_affinity']} usable); "
        f"{m['platform']}; load average at start {m['loadavg']}",
        f"python {m['python']}, mxnet {m['mxnet']} ({', '.join(feats)}), numpy {m['numpy']}, "
        f"mx_roi {m['mx_roi']} (git {m['git'] or '?'})",
        f"thread/env settings: {env}",
        f"threads: MXNet built-ins {m['threads']['mxnet']} (OpenMP), mx_roi "
        f"{m['threads']['ours']} (its pool and native kernels; NumPy's BLAS held at "
        f"{m['threads']['ours_blas_in_kernels'] or '?'} inside mx_roi kernels, "
        f"{m['threads']['numpy_blas'] or '?'} outside)",
        f"workload: data ({BATCH}, C, {FEAT_H}, {FEAT_W}) float32 = {IMAGE_H}x{IMAGE_W} image "
        f"at stride {STRIDE}; seeded random proposals; median of {args.repeat} interleaved "
        f"runs (ours, builtin, ...) after 1 warm-up each"
        + ("; QUICK (reduced sizes)" if args.quick else ""),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- output


def format_table(rows) -> str:
    head = (f"{'op':<13} {'config':<52} {'dir':<8} {'kernels':<7} {'ours ms':>10} "
            f"{'builtin ms':>11} {'ours/bi':>8} {'bound ms':>9} {'reached':>8}  {'check':<5} "
            "note")
    lines = [head, "-" * len(head)]
    for r in rows:
        bi = f"{r['builtin_ms']:.2f}" if r["builtin_ms"] is not None else "-"
        ours = f"{r['ours_ms']:.2f}" if r["ours_ms"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        bound = (f"{r['bound_ms']:.2f}{r['bound_by'][0]}" if r.get("bound_ms") is not None
                 else "-")
        reached = f"{100 * r['reached']:.0f}%" if r.get("reached") is not None else "-"
        check = ("ERROR" if r.get("error") else "-" if r["check"] is None
                 else "ok" if r["check"]["ok"] else "FAIL")
        lines.append(f"{r['op']:<13} {r['config']:<52} {r['direction']:<8} "
                     f"{r.get('backend', '?'):<7} {ours:>10} {bi:>11} {ratio:>8} {bound:>9} "
                     f"{reached:>8}  {check:<5} {r['note']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- bounds


def add_bounds(rows, workloads: List[Workload], hw: dict) -> None:
    """Each row gains ``bound_ms`` (the :mod:`mx_roi.roofline` lower bound at the probed
    bandwidth / multiply-add rate), ``bound_by`` ('mem' or 'fma') and ``reached``
    (bound / ours)."""
    from . import registry, roofline
    work = {}
    for w in workloads:
        cls = registry.get_op(w.op)
        op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in w.ours_kwargs.items()}))
        try:
            work[w.key] = roofline.workload_work(op, (BATCH, w.channels, FEAT_H, FEAT_W),
                                                 make_rois(w.boxes))
        except Exception:  # a bound is a report, never a reason to fail the bench
            work[w.key] = None
    for r in rows:
        wk = work.get(r["key"])
        if wk is None:
            r.update(bound_ms=None, bound_by=None, reached=None, work=None)
            continue
        ms, by = roofline.bound_ms(wk, r["direction"], hw)
        r.update(bound_ms=ms, bound_by=by, work=wk,
                 reached=(ms / r["ours_ms"]) if r.get("ours_ms") else None)


def probe_hardware(quick: bool) -> dict:
    from . import parallel, roofline
    return roofline.probe(parallel.num_threads(), mbytes=16 if quick else 128,
                          repeat=2 if quick else 5)


def format_hardware(hw: dict) -> str:
    return (f"bound = max(bytes that must move / {hw['bandwidth'] / 1e9:.1f} GB/s copy "
            f"bandwidth, multiply-adds / {hw['fma_rate'] / 1e9:.1f} GFMA/s float32 matmul), "
            f"both measured here on {hw['threads']} thread(s) (mx_roi.roofline); m/f = "
            "memory/multiply-add bound; reached = bound / ours")


def geomean(values) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def bench_all(workloads: List[Workload], inputs: Inputs, repeat: int, label: str = ""):
    rows = []
    for w in workloads:
        new = bench_workload(w, inputs, repeat)
        for r in new:
            bi = f"{r['builtin_ms']:.2f} ms" if r["builtin_ms"] is not None else "-"
            ours = f"{r['ours_ms']:9.2f} ms" if r["ours_ms"] is not None else "ERROR"
            print(f"  {label}{w.key:<26} {r['direction']:<8} ours {ours}, builtin {bi}"
                  + (f"  {r['error']}" if r.get("error") else ""), flush=True)
        rows.extend(new)
    return rows


# --------------------------------------------------------------------------- busy core

#: the competing process: one Python thread spinning (one core's worth of work)
SPINNER = "import time\nwhile True:\n    pass\n"


class busy_core:
    """Context manager: another process keeps one core busy while inside."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SPINNER],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)  # let it get scheduled
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        return False


def add_busy_ratios(busy_rows, quiet_rows) -> None:
    """Busy rows gain ``ours_busy_over_quiet``, ``builtin_busy_over_quiet``, ``quiet_ratio``."""
    quiet = {(r["key"], r["direction"]): r for r in quiet_rows}
    for r in busy_rows:
        q = quiet.get((r["key"], r["direction"]), {})

        def rel(a, b):
            return a / b if a is not None and b else None
        r.update(ours_busy_over_quiet=rel(r.get("ours_ms"), q.get("ours_ms")),
                 builtin_busy_over_quiet=rel(r.get("builtin_ms"), q.get("builtin_ms")),
                 quiet_ratio=q.get("ratio"))


def format_busy(busy_rows) -> str:
    def f(v, spec=".2f"):
        return format(v, spec) if v is not None else "-"
    head = (f"{'workload':<27} {'dir':<8} {'ours ms':>9} {'bi ms':>9} {'ours busy/quiet':>16} "
            f"{'bi busy/quiet':>14} {'ours/bi busy':>13} {'ours/bi quiet':>14}")
    lines = ["One core kept busy by another process (a spinning Python process), same "
             "workloads:", head, "-" * len(head)]
    for r in busy_rows:
        lines.append(f"{r['key']:<27} {r['direction']:<8} {f(r.get('ours_ms')):>9} "
                     f"{f(r.get('builtin_ms')):>9} {f(r.get('ours_busy_over_quiet')):>16} "
                     f"{f(r.get('builtin_busy_over_quiet')):>14} {f(r.get('ratio')):>13} "
                     f"{f(r.get('quiet_ratio')):>14}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- thread settings


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
    """``argv`` without --threads / --json / --plot (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--threads", "--json", "--plot"):
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
    print(format_thread_summary(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads_runs=runs, settings=settings), f, indent=1)
    return status


def format_thread_summary(runs) -> str:
    settings = list(runs)
    lines = ["Ratios ours / built-in per thread setting (MXNet threads / mx_roi threads):"]
    head = f"{'workload':<27} {'dir':<8}" + "".join(
        f" {s + ' ' + _threads_tag(runs[s]):>16}" for s in settings)
    lines += [head, "-" * len(head)]
    table = {}
    for s in settings:
        for r in (runs[s] or {}).get("results", []):
            table.setdefault((r["key"], r["direction"]), {})[s] = r.get("ratio")
    for (key, direction), by in table.items():
        lines.append(f"{key:<27} {direction:<8}" + "".join(
            f" {'-' if by.get(s) is None else format(by[s], '.2f'):>16}"
            for s in settings))
    for direction in DIRECTIONS:
        cells = []
        for s in settings:
            vals = [r["ratio"] for r in (runs[s] or {}).get("results", [])
                    if r["direction"] == direction and r.get("ratio")]
            cells.append(f"{max(vals):.2f}/{geomean(vals):.2f}" if vals else "-")
        lines.append(f"{'worst/geomean':<27} {direction:<8}" + "".join(
            f" {c:>16}" for c in cells))
    return "\n".join(lines)


def _threads_tag(run) -> str:
    t = ((run or {}).get("machine") or {}).get("threads") or {}
    return f"({t.get('mxnet', '?')}/{t.get('ours', '?')})"


def _parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m mx_roi.bench", description=__doc__.split("\n")[0])
    p.add_argument("--ctx", choices=("cpu", "gpu"), default="cpu",
                   help="run on the CPU (default) or on GPU 0 (both sides)")
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
    p.add_argument("--plot", default=None,
                   help="PNG: median time vs number of boxes (64..2048) for ours and built-in")
    p.add_argument("--plot-boxes", default=None,
                   help="comma-separated box counts for --plot (default 64,...,2048; "
                        "16,32,64 with --quick)")
    p.add_argument("--plot-repeat", type=int, default=3, help="runs per point for --plot")
    p.add_argument("--plot-direction", choices=DIRECTIONS, default="fwd+bwd")
    p.add_argument("--step", action="store_true",
                   help="step-level benchmark: Faster R-CNN / R-FCN train steps with the "
                        "built-in op and ours (mx_roi.bench_step; --step --help for its options)")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread settings, each run in a child process with "
                        "both sides at that count: 'default' (the environment as it is), "
                        "'all' (every usable core), or a number N (OMP_NUM_THREADS, "
                        "MXNET_OMP_MAX_THREADS, MX_ROI_NUM_THREADS and OPENBLAS_NUM_THREADS "
                        "= N); e.g. default,1,all")
    p.add_argument("--busy", action="store_true",
                   help="time every workload a second time while another process keeps one "
                        "core busy; report busy/quiet per side")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--side", default="ours", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    if args.variants is None:
        args.variants = not args.quick
    if args.memory is None:
        args.memory = not args.quick
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--step" in argv:  # the step-level mode has its own options
        from . import bench_step
        return bench_step.main([a for a in argv if a != "--step"])
    args = _parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.side, args.quick, args.ctx)))
        return 0
    if args.ctx == "gpu":
        if mx.context.num_gpus() == 0:
            print("--ctx gpu: no GPU visible to MXNet (mx.context.num_gpus() == 0)",
                  file=sys.stderr)
            return 3
        ctx = mx.gpu(0)
    else:
        ctx = mx.cpu()
    if args.threads:
        return run_thread_settings(args, sys.argv[1:] if argv is None else list(argv))
    t_start = time.perf_counter()
    machine = machine_info(args.ctx)
    print(format_header(machine, args), flush=True)
    print(flush=True)
    hw = probe_hardware(args.quick)

    workloads = build_workloads(args.quick, args.variants)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        workloads = [w for w in workloads
                     if any(s in (w.key, w.key.split("/")[0]) for s in wanted)]
        if not workloads:
            print(f"--only {args.only!r} matches no workload", file=sys.stderr)
            return 3
    sweep_boxes = ([int(v) for v in args.plot_boxes.split(",")] if args.plot_boxes else
                   ([16, 32, 64] if args.quick else list(SWEEP_BOXES)))
    max_boxes = max([w.boxes for w in workloads] + (sweep_boxes if args.plot else [1]))
    inputs = Inputs(ctx, max_boxes)

    rows = bench_all(workloads, inputs, args.repeat)
    add_bounds(rows, workloads, hw)
    busy_rows = None
    if args.busy:
        with busy_core():
            busy_rows = bench_all(workloads, inputs, args.repeat, label="busy ")
        add_busy_ratios(busy_rows, rows)

    overhead = bench_overhead(inputs, workloads, args.repeat)
    if args.memory and args.ctx == "gpu":
        print("--memory measures host RSS; skipped with --ctx gpu", flush=True)
        args.memory = False
    memory = bench_memory(workloads, args.quick, args.ctx) if args.memory else None
    sweep_result = None
    if args.plot:
        sweep_result = sweep(workloads, inputs, sweep_boxes, args.plot_repeat,
                             args.plot_direction)
        plot(sweep_result, args.plot, args.plot_direction, machine)

    comparable = [r for r in rows if r["direction"] == "fwd+bwd" and r["ratio"] is not None
                  and not (r["check"] and r["check"]["builtin_all_zero"])]
    gm = geomean([r["ratio"] for r in comparable])
    gm_fwd = geomean([r["ratio"] for r in rows if r["direction"] == "fwd"
                      and r["ratio"] is not None
                      and not (r["check"] and r["check"]["builtin_all_zero"])])
    failures = [f"{r['key']} {r['direction']}" + (" (error)" if r.get("error") else "")
                for r in rows + (busy_rows or [])
                if r.get("error") or (r["check"] is not None and not r["check"]["ok"])]
    for key, e in (sweep_result or {}).items():
        failures += [f"{key} {args.plot_direction} ({n} boxes)" for n in e.get("failed_boxes", [])]

    print()
    print(format_header(machine, args))
    print()
    print(format_table(rows))
    print()
    print(format_hardware(hw))
    print("ratio = ours / builtin median time (< 1: mx_roi faster); check = np.allclose(ours, "
          f"builtin, rtol={RTOL:g}, atol={ATOL:g}) on the benchmark inputs: forward output "
          "(fwd) and also the data gradient (fwd+bwd); kernels = the mx_roi backend our side "
          "ran on (native: the CUDA kernels compiled for the host, on threads; numpy: NumPy/"
          "BLAS; MX_ROI_BACKEND overrides the per-op default)")
    if gm is not None:
        print(f"geometric mean of fwd+bwd ratios ours/builtin over {len(comparable)} "
              f"comparable workloads: {gm:.2f}" + (f"  (fwd only: {gm_fwd:.2f})" if gm_fwd else ""))
    if busy_rows is not None:
        print()
        print(format_busy(busy_rows))
    if overhead:
        print()
        print("Custom-op overhead (trivial custom ops with the same input/output shapes):")
        for o in overhead:
            print(f"  {o['label']:<38} data {tuple(o['data_shape'])} -> out "
                  f"{tuple(o['out_shape'])}  {o['direction']:<8} {o['ms']:8.3f} ms")
    if memory is not None:
        print()
        methods = sorted({m["method"] for m in memory if m.get("method")})
        print("Peak extra RSS of one fwd+bwd: fresh process per op and side, 2-box warm-up, "
              f"then peak RSS - RSS before ({', '.join(methods) or '?'}); includes MXNet's "
              "pooled allocator. out+grad = bytes of the output + the data gradient:")
        print(f"  {'workload':<27} {'ours':>10} {'builtin':>10} {'out+grad':>10} "
              f"{'ours/(out+grad)':>16}")
        for m in memory:
            need = (m.get("out_bytes") or 0) + (m.get("grad_bytes") or 0)
            rel = f"{m['ours'] / need:.2f}" if m.get("ours") is not None and need else "-"
            print(f"  {m['key']:<27} {_mb(m.get('ours')):>10} {_mb(m.get('builtin')):>10} "
                  f"{_mb(need):>10} {rel:>16}"
                  + ("  (ours failed: see JSON)" if m.get("ours_error") else "")
                  + ("  (builtin failed: see JSON)" if m.get("builtin_error") else ""))
    elapsed = time.perf_counter() - t_start
    print()
    print(f"total bench time {elapsed:.1f} s")
    if failures:
        print("ERROR: ours and the built-in disagree on: " + ", ".join(failures),
              file=sys.stderr)

    if args.json:
        payload = dict(machine=machine,
                       config=dict(argv=sys.argv[1:] if argv is None else list(argv),
                                   quick=args.quick, repeat=args.repeat,
                                   variants=args.variants, batch=BATCH,
                                   feature_map=[FEAT_H, FEAT_W], image=[IMAGE_H, IMAGE_W],
                                   spatial_scale=SPATIAL_SCALE, seed=SEED,
                                   rtol=RTOL, atol=ATOL),
                       results=rows, geomean_fwd_bwd_ratio=gm, geomean_fwd_ratio=gm_fwd,
                       hardware=hw, busy=busy_rows,
                       overhead=overhead, memory=memory, sweep=sweep_result,
                       failures=failures,
                       total_seconds=elapsed)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
