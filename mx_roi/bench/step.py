"""Step-level benchmark: a detector's train step with MXNet's built-in RoI op and with ours.

Run as ``python -m mx_roi.bench --step`` (or ``python -m mx_roi.bench.step``).  Op-level
ratios do not reach the user; the training step does.  For every configuration two
executors are bound from the *same* graph, once with the built-in op
(``mx.sym.ROIPooling`` / ``mx.sym.contrib.ROIAlign`` / ``mx.sym.contrib.PSROIPooling``)
and once with the drop-in from :mod:`mx_roi.sym` (``Custom`` + the oneDNN guard), given
the same weights, and stepped forward+backward alternately (ours, built-in, built-in,
ours, ...); the least-disturbed (minimum) step time of each side is reported with the
ratio ours / built-in.  Before timing, the first step's outputs (losses) and every
parameter gradient of the two sides are compared (``check``); a mismatch makes the run
exit with status 2.

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
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import numpy as np

__all__ = ["main", "StepConfig", "CONFIGS", "QUICK_CONFIGS", "build_symbol"]

NUM_CLASSES = 21
IMAGES = 2
SEED = 0


@dataclass(frozen=True)
class StepConfig:
    """One benchmarked train step."""

    name: str
    kind: str              # 'frcnn' | 'rfcn'
    op: str                # mx_roi op name
    pooled: int
    rois_per_image: int
    image_hw: tuple = (224, 320)
    sample_ratio: int = 2  # ROIAlign only

    @property
    def rois(self) -> int:
        return IMAGES * self.rois_per_image


CONFIGS = [
    StepConfig("frcnn-pool14", "frcnn", "ROIPooling", 14, 128),
    StepConfig("frcnn-pool7", "frcnn", "ROIPooling", 7, 128),
    StepConfig("frcnn-align14", "frcnn", "ROIAlign", 14, 128),
    StepConfig("frcnn-pool14-heavy", "frcnn", "ROIPooling", 14, 512),
    StepConfig("rfcn-pspool7", "rfcn", "PSROIPooling", 7, 150),
]
QUICK_CONFIGS = [
    StepConfig("frcnn-pool7", "frcnn", "ROIPooling", 7, 16, image_hw=(64, 96)),
    StepConfig("rfcn-pspool7", "rfcn", "PSROIPooling", 7, 16, image_hw=(64, 96)),
]

#: channel widths: stem, (units, out channels, stride) per body stage, head unit out, R-FCN conv
WIDTHS = {
    "lite": dict(stem=32, stages=[(1, 64, 1), (1, 128, 2), (1, 256, 2)], head=512, rfcn=256),
    "quick": dict(stem=8, stages=[(1, 16, 1), (1, 32, 2), (1, 32, 2)], head=64, rfcn=32),
}
BUILTIN_OPS = {"ROIPooling": ("ROIPooling", "_backward_ROIPooling"),
               "ROIAlign": ("_contrib_ROIAlign", "_backward_ROIAlign"),
               "PSROIPooling": ("_contrib_PSROIPooling", "_backward__contrib_PSROIPooling")}
GUARD_OPS = ("_copy", "_backward_copy", "clip", "_backward_clip")


# --------------------------------------------------------------------------- graphs


def _roi_op(mx, side, cfg, data, rois, name, output_dim=None):
    """The RoI node: the built-in (``side == 'builtin'``) or mx_roi's drop-in."""
    import mx_roi
    k, scale = (cfg.pooled, cfg.pooled), 1.0 / 16
    if cfg.op == "ROIPooling":
        f = mx.sym.ROIPooling if side == "builtin" else mx_roi.sym.ROIPooling
        return f(data=data, rois=rois, pooled_size=k, spatial_scale=scale, name=name)
    if cfg.op == "ROIAlign":
        f = mx.sym.contrib.ROIAlign if side == "builtin" else mx_roi.sym.ROIAlign
        return f(data=data, rois=rois, pooled_size=k, spatial_scale=scale,
                 sample_ratio=cfg.sample_ratio, name=name)
    if cfg.op == "PSROIPooling":
        f = mx.sym.contrib.PSROIPooling if side == "builtin" else mx_roi.sym.PSROIPooling
        return f(data=data, rois=rois, spatial_scale=scale, output_dim=output_dim,
                 pooled_size=cfg.pooled, group_size=cfg.pooled, name=name)
    raise ValueError(f"unknown op {cfg.op!r}")


def _bn(mx, x, name):
    # frozen BatchNorm, as MXNet's example/rcnn ResNet
    return mx.sym.BatchNorm(x, fix_gamma=False, eps=2e-5, use_global_stats=True, name=name)


def _unit(mx, x, out, stride, name):
    """Pre-activation bottleneck unit (MXNet's ResNet), projection shortcut."""
    a = mx.sym.Activation(_bn(mx, x, name + "_bn1"), act_type="relu")
    c = mx.sym.Convolution(a, num_filter=out // 4, kernel=(1, 1), no_bias=True,
                           name=name + "_conv1")
    c = mx.sym.Activation(_bn(mx, c, name + "_bn2"), act_type="relu")
    c = mx.sym.Convolution(c, num_filter=out // 4, kernel=(3, 3), pad=(1, 1),
                           stride=(stride, stride), no_bias=True, name=name + "_conv2")
    c = mx.sym.Activation(_bn(mx, c, name + "_bn3"), act_type="relu")
    c = mx.sym.Convolution(c, num_filter=out, kernel=(1, 1), no_bias=True, name=name + "_conv3")
    sc = mx.sym.Convolution(a, num_filter=out, kernel=(1, 1), stride=(stride, stride),
                            no_bias=True, name=name + "_sc")
    return c + sc


def _body(mx, data, model):
    if model == "resnet50":
        from example_rcnn.symbol import resnet50_c4_backbone
        return resnet50_c4_backbone(data), 1024
    w = WIDTHS[model]
    x = mx.sym.Convolution(data, num_filter=w["stem"], kernel=(7, 7), stride=(2, 2),
                           pad=(3, 3), no_bias=True, name="conv0")
    x = mx.sym.Activation(_bn(mx, x, "bn0"), act_type="relu")
    x = mx.sym.Pooling(x, kernel=(3, 3), stride=(2, 2), pad=(1, 1), pool_type="max")
    for s, (units, out, stride) in enumerate(w["stages"], 1):
        for u in range(units):
            x = _unit(mx, x, out, stride if u == 0 else 1, f"stage{s}_unit{u + 1}")
    return x, w["stages"][-1][1]


def _head(mx, roi_feat, model):
    if model == "resnet50":
        from example_rcnn.symbol import resnet50_c5_head
        return resnet50_c5_head(roi_feat)
    x = _unit(mx, roi_feat, WIDTHS[model]["head"], 2, "stage4_unit1")
    x = mx.sym.Activation(_bn(mx, x, "bn1"), act_type="relu")
    return mx.sym.Pooling(x, kernel=(7, 7), global_pool=True, pool_type="avg")


def build_symbol(cfg: StepConfig, side: str, model: str = "lite"):
    """The train-step symbol of ``cfg`` with the built-in op or ours.

    Inputs ``data (2, 3, H, W)``, ``rois (R, 5)``, ``label (R,)``, ``bbox_target`` and
    ``bbox_weight``; outputs the class probabilities and the box loss."""
    import mxnet as mx
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    label = mx.sym.var("label")
    bbox_target, bbox_weight = mx.sym.var("bbox_target"), mx.sym.var("bbox_weight")
    feat, channels = _body(mx, data, model)
    if cfg.kind == "frcnn":
        top = mx.sym.flatten(_head(mx, _roi_op(mx, side, cfg, feat, rois, "roi_pool"), model))
        cls_score = mx.sym.FullyConnected(top, num_hidden=NUM_CLASSES, name="cls_score")
        bbox_pred = mx.sym.FullyConnected(top, num_hidden=4 * NUM_CLASSES, name="bbox_pred")
    elif cfg.kind == "rfcn":
        # Deformable-ConvNets' R-FCN: class maps (C x k x k) and class-agnostic box maps
        # (8 x k x k), each pooled by PSROIPooling and averaged over the k x k bins
        k2 = cfg.pooled * cfg.pooled
        mid = 512 if model == "resnet50" else WIDTHS[model]["rfcn"]
        x = mx.sym.Convolution(feat, num_filter=mid, kernel=(1, 1), name="rfcn_conv")
        x = mx.sym.Activation(x, act_type="relu")
        cls_map = mx.sym.Convolution(x, num_filter=NUM_CLASSES * k2, kernel=(1, 1),
                                     name="rfcn_cls")
        box_map = mx.sym.Convolution(x, num_filter=8 * k2, kernel=(1, 1), name="rfcn_bbox")
        cls_ps = _roi_op(mx, side, cfg, cls_map, rois, "psroi_cls", output_dim=NUM_CLASSES)
        box_ps = _roi_op(mx, side, cfg, box_map, rois, "psroi_bbox", output_dim=8)
        cls_score = mx.sym.mean(cls_ps, axis=(2, 3))
        bbox_pred = mx.sym.tile(mx.sym.mean(box_ps, axis=(2, 3)),
                                reps=(1, NUM_CLASSES // 2 + 1))
        bbox_pred = mx.sym.slice_axis(bbox_pred, axis=1, begin=0, end=4 * NUM_CLASSES)
    else:
        raise ValueError(f"unknown kind {cfg.kind!r}")
    del channels
    cls_prob = mx.sym.SoftmaxOutput(cls_score, label=label, normalization="batch",
                                    name="cls_prob")
    bbox_loss = mx.sym.MakeLoss(bbox_weight * mx.sym.smooth_l1(bbox_pred - bbox_target,
                                                                 scalar=1.0),
                                grad_scale=1.0 / cfg.rois, name="bbox_loss")
    return mx.sym.Group([cls_prob, bbox_loss])


INPUTS = ("data", "rois", "label", "bbox_target", "bbox_weight")


def _input_values(cfg: StepConfig) -> Dict[str, np.ndarray]:
    from .workloads import make_rois
    rng = np.random.RandomState(SEED)
    h, w = cfg.image_hw
    return dict(
        data=rng.standard_normal((IMAGES, 3, h, w)).astype(np.float32),
        rois=make_rois(cfg.rois, batch=IMAGES, seed=SEED, image_hw=(h, w)),
        label=rng.randint(0, NUM_CLASSES, size=cfg.rois).astype(np.float32),
        bbox_target=rng.standard_normal((cfg.rois, 4 * NUM_CLASSES)).astype(np.float32),
        bbox_weight=(rng.uniform(size=(cfg.rois, 4 * NUM_CLASSES)) < 0.3).astype(np.float32))


def _param_values(exe) -> Dict[str, np.ndarray]:
    """Seeded weights: He-normal convs / FCs, zero biases, identity frozen BatchNorm."""
    rng = np.random.RandomState(SEED + 1)
    vals = {}
    for name in sorted(exe.arg_dict):
        if name in INPUTS:
            continue
        shape = exe.arg_dict[name].shape
        if name.endswith("_weight"):
            vals[name] = (rng.standard_normal(shape) *
                          np.sqrt(2.0 / max(1, int(np.prod(shape[1:]))))).astype(np.float32)
        elif name.endswith("_gamma"):
            vals[name] = np.ones(shape, np.float32)
        else:
            vals[name] = np.zeros(shape, np.float32)
    for name in sorted(exe.aux_dict):
        shape = exe.aux_dict[name].shape
        vals[name] = (np.ones if name.endswith("_var") else np.zeros)(shape, np.float32)
    return vals


def _bind(sym, cfg: StepConfig):
    import mxnet as mx
    values = _input_values(cfg)
    shapes = {k: v.shape for k, v in values.items()}
    grad_req = {n: ("null" if n in INPUTS else "write") for n in sym.list_arguments()}
    exe = sym.simple_bind(mx.cpu(), grad_req=grad_req, **shapes)
    for k, v in values.items():
        exe.arg_dict[k][:] = v
    return exe


def _load_params(exe, params):
    for k, v in params.items():
        (exe.arg_dict.get(k) if k in exe.arg_dict else exe.aux_dict[k])[:] = v


def _graph_ops(sym) -> List[str]:
    """The operators of ``sym`` without the RoI op and the oneDNN guard, in graph order."""
    skip = set(GUARD_OPS) | {"Custom", "null"} | {v[0] for v in BUILTIN_OPS.values()}
    return [n["op"] for n in json.loads(sym.tojson())["nodes"] if n["op"] not in skip]


def _step(exe):
    import mxnet as mx
    t0 = time.perf_counter()
    exe.forward(is_train=True)
    exe.backward()
    mx.nd.waitall()
    return time.perf_counter() - t0


def _compare(exes) -> dict:
    """First-step check: outputs and every parameter gradient, ours against the built-in."""
    worst, ok, where = 0.0, True, None
    pairs = [(f"output{i}", a, b) for i, (a, b) in
             enumerate(zip(exes["ours"].outputs, exes["builtin"].outputs))]
    pairs += [(f"grad:{k}", exes["ours"].grad_dict[k], g)
              for k, g in sorted(exes["builtin"].grad_dict.items()) if g is not None]
    for name, a, b in pairs:
        a, b = a.asnumpy().astype(np.float64), b.asnumpy().astype(np.float64)
        scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-12)
        err = float(np.abs(a - b).max()) / scale if b.size else 0.0
        if not np.all(np.isfinite(a)) or err > 1e-3:
            ok = False
            where = where or name
        if err > worst:
            worst = err
    losses = {side: float(np.sum(exe.outputs[1].asnumpy())) for side, exe in exes.items()}
    return dict(ok=ok, max_rel_err=worst, first_bad=where, compared=len(pairs), losses=losses)


# --------------------------------------------------------------------------- profiling


class _Timers:
    """Wall time of mx_roi's callback pieces (kernel, geometry, checks), by name."""

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


_TIMERS = _Timers()


def _instrument(op_name: str) -> _Timers:
    """Wrap ``op_name``'s kernels, geometry and checks and the backends' callbacks in
    :data:`_TIMERS` (once; idempotent)."""
    from .. import backends
    from ..registry import get_op
    timers = _TIMERS
    cls = get_op(op_name)
    for attr in ("forward_numpy", "forward_cuda"):
        timers.wrap(cls, attr, "kernel_fwd")
    for attr in ("backward_numpy", "backward_cuda"):
        timers.wrap(cls, attr, "kernel_bwd")
    timers.wrap(cls, "geometry", "geometry")
    timers.wrap(cls, "check_inputs", "check_inputs")
    for name in ("numpy", "native"):
        try:
            backend = type(backends.get(name))
        except Exception:  # noqa: BLE001 - no native build: that backend is not used
            continue
        timers.wrap(backend, "forward", "callback_fwd")
        timers.wrap(backend, "backward", "callback_bwd")
    return timers


def _parse_aggregate(text: str) -> Dict[str, Dict[str, float]]:
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


def _profile_side(mx, exe, side: str, cfg: StepConfig, timers: Optional[_Timers]) -> dict:
    mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                           filename=os.devnull if os.name != "nt" else "NUL")
    if timers is not None:
        timers.ms.clear()
    mx.profiler.set_state("run")
    wall = _step(exe)
    mx.profiler.set_state("stop")
    table = _parse_aggregate(mx.profiler.dumps(reset=True))
    ops = table.get("operator", {})
    custom = table.get("Custom Operator", {})
    total_ops = sum(ops.values()) + sum(v for k, v in custom.items() if k.endswith("pure_python"))
    res = dict(wall_ms=1e3 * wall, operators_ms=total_ops)
    if side == "builtin":
        res["op_ms"] = sum(ops.get(n, 0.0) for n in BUILTIN_OPS[cfg.op])
        res["op_entries"] = {n: ops[n] for n in BUILTIN_OPS[cfg.op] if n in ops}
    else:
        py = {k: v for k, v in custom.items() if cfg.op in k}
        res["op_ms"] = sum(v for k, v in py.items() if k.endswith("pure_python"))
        res["op_entries"] = py
        res["guard_ms"] = sum(ops.get(n, 0.0) for n in GUARD_OPS)
        res["guard_entries"] = {n: ops[n] for n in GUARD_OPS if n in ops}
        res["callback_ms"] = dict(timers.ms) if timers is not None else {}
    res["op_share"] = res["op_ms"] / res["wall_ms"] if res["wall_ms"] else None
    return res


# --------------------------------------------------------------------------- one setting


def run_setting(configs: List[StepConfig], steps: int, model: str, profile: bool) -> dict:
    """All configurations in this process (its thread environment): timings, checks, profile."""
    os.environ.setdefault("MXNET_EXEC_BULK_EXEC_TRAIN", "1")
    import mxnet as mx
    import mx_roi  # noqa: F401  (registers the ops, installs the guard)
    from .machine import machine_info
    results = []
    for cfg in configs:
        syms = {side: build_symbol(cfg, side, model) for side in ("ours", "builtin")}
        exes = {side: _bind(s, cfg) for side, s in syms.items()}
        params = _param_values(exes["builtin"])
        for exe in exes.values():
            _load_params(exe, params)
        for side in ("ours", "builtin"):
            _step(exes[side])
        check = _compare(exes)
        graph = dict(same=_graph_ops(syms["ours"]) == _graph_ops(syms["builtin"]),
                     nodes={s: len(json.loads(v.tojson())["nodes"]) for s, v in syms.items()},
                     params_equal=sorted(exes["ours"].arg_dict) ==
                     sorted(exes["builtin"].arg_dict))
        runs: Dict[str, List[float]] = {"ours": [], "builtin": []}
        for i in range(steps):
            order = ("ours", "builtin") if i % 2 == 0 else ("builtin", "ours")
            for side in order:
                runs[side].append(1e3 * _step(exes[side]))
        del exes
        best = {s: min(v) for s, v in runs.items()}
        row = dict(config=asdict(cfg), name=cfg.name, op=cfg.op, rois=cfg.rois,
                   ours_ms=best["ours"], builtin_ms=best["builtin"],
                   ratio=best["ours"] / best["builtin"],
                   ours_runs_ms=runs["ours"], builtin_runs_ms=runs["builtin"],
                   check=check, graph=graph)
        if profile:
            # bulk execution merges operators into one profiler entry: off for this pass
            os.environ["MXNET_EXEC_BULK_EXEC_TRAIN"] = "0"
            try:
                pexes = {side: _bind(s, cfg) for side, s in syms.items()}
                for exe in pexes.values():
                    _load_params(exe, params)
                    _step(exe)
                timers = _instrument(cfg.op)
                row["profile"] = {side: _profile_side(mx, pexes[side], side, cfg,
                                                      timers if side == "ours" else None)
                                  for side in ("builtin", "ours")}
                del pexes
            finally:
                os.environ["MXNET_EXEC_BULK_EXEC_TRAIN"] = "1"
        results.append(row)
    return dict(machine=machine_info("cpu"), results=results)


# --------------------------------------------------------------------------- driver

THREAD_SETTINGS = ("default", "equal")


def _child_env(setting: str) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MX_ROI_NUM_THREADS"):
        env.pop(k, None)
    if setting == "equal":
        n = str(os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = env["MX_ROI_NUM_THREADS"] = n
    from .machine import CHECKOUT as root
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_child(setting: str, args) -> dict:
    cmd = [sys.executable, "-m", "mx_roi.bench.step", "--child", "--configs",
           ",".join(c.name for c in args.config_list), "--steps", str(args.steps),
           "--model", args.model] + (["--quick"] if args.quick else []) + \
        ([] if args.profile else ["--no-profile"])
    proc = subprocess.run(cmd, env=_child_env(setting), capture_output=True, text=True)
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
                     f"{'op%bi':>6} {'op%ours':>7} {'guard%':>6}  check")
        for r in s["results"]:
            p = r.get("profile") or {}
            bi, ou = p.get("builtin", {}), p.get("ours", {})

            def pct(d, key):
                v, w = d.get(key), d.get("wall_ms")
                return f"{100 * v / w:5.1f}%" if v is not None and w else "    -"
            ok = "ok" if r["check"]["ok"] and r["graph"]["same"] else "MISMATCH"
            lines.append(f"{r['name']:<20} {r['rois']:>5} {_fmt_ms(r['ours_ms'])} "
                         f"{_fmt_ms(r['builtin_ms'])} {r['ratio']:7.3f} {pct(bi, 'op_ms'):>6} "
                         f"{pct(ou, 'op_ms'):>7} {pct(ou, 'guard_ms'):>6}  {ok} "
                         f"(rel err {r['check']['max_rel_err']:.1e})")
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
    lines.append("\nours/bi: least-disturbed (min) step time, ours / built-in (< 1: ours is "
                 "faster); op%: the RoI op's share of a profiled step (forward + backward; "
                 "ours: the Custom op's Python callbacks), guard%: oneDNN guard "
                 "(_copy/clip/_backward_clip) share; all times in ms.")
    return lines


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
          "steps per side (forward+backward, no update), min reported")
    print("\n".join(_report(settings)))
    failures = [f"{s['threads']}:{r['name']}" for s in settings for r in s["results"]
                if not (r["check"]["ok"] and r["graph"]["same"])]
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mode="step", model=args.model, steps=args.steps, quick=args.quick,
                           settings=settings, failures=failures), f, indent=1)
    if failures:
        print("MISMATCH between ours and the built-in: " + ", ".join(failures),
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
