"""The train steps of ``python -m mx_roi.bench --step``: configurations, the Faster R-CNN
C4 / R-FCN graphs with the built-in RoI op or ours, seeded inputs and weights, binding,
one timed step and the first-step comparison of the two sides."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from .doors import NATIVE_PREFIX

__all__ = ["StepConfig", "CONFIGS", "QUICK_CONFIGS", "SIDES", "build_symbol", "bind", "param_values",
           "load_params", "graph_ops", "run_step", "compare_sides"]

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


#: the sides of a step: MXNet's built-in RoI op, ours through the Custom door, ours
#: through the native door (:mod:`mx_roi.bench.doors`)
SIDES = ("ours", "builtin", "native")
BUILTIN_SYMS = {"ROIPooling": "ROIPooling", "ROIAlign": "contrib.ROIAlign",
                "PSROIPooling": "contrib.PSROIPooling"}


def _roi_op(mx, side, cfg, data, rois, name, output_dim=None):
    """The RoI node: the built-in (``side == 'builtin'``), or mx_roi's op through the
    Custom door (``'ours'``) or the native door (``'native'``)."""
    from .doors import door
    if cfg.op not in BUILTIN_SYMS:
        raise ValueError(f"unknown op {cfg.op!r}")
    if side == "builtin":
        f = mx.sym
        for part in BUILTIN_SYMS[cfg.op].split("."):
            f = getattr(f, part)
        fn = lambda *inputs, **kw: f(*inputs, **kw)  # noqa: E731
    else:
        fn = door(mx.sym, cfg.op, {"ours": "custom", "native": "native"}[side])
    k, scale = (cfg.pooled, cfg.pooled), 1.0 / 16
    if cfg.op == "ROIPooling":
        return fn(data, rois, pooled_size=k, spatial_scale=scale, name=name)
    if cfg.op == "ROIAlign":
        return fn(data, rois, pooled_size=k, spatial_scale=scale,
                  sample_ratio=cfg.sample_ratio, name=name)
    return fn(data, rois, spatial_scale=scale, output_dim=output_dim,
              pooled_size=cfg.pooled, group_size=cfg.pooled, name=name)


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


def _example_symbol():
    """``example_rcnn.symbol`` (the example is not installed: it runs from a checkout)."""
    try:
        from example_rcnn import symbol
    except ModuleNotFoundError as exc:
        raise SystemExit("--model resnet50 takes its layers from the example "
                         "(example_rcnn/symbol.py), which is not installed with mx_roi: "
                         "run the bench from a checkout of the repository") from exc
    return symbol


def _body(mx, data, model):
    if model == "resnet50":
        return _example_symbol().resnet50_c4_backbone(data), 1024
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
        return _example_symbol().resnet50_c5_head(roi_feat)
    x = _unit(mx, roi_feat, WIDTHS[model]["head"], 2, "stage4_unit1")
    x = mx.sym.Activation(_bn(mx, x, "bn1"), act_type="relu")
    return mx.sym.Pooling(x, kernel=(7, 7), global_pool=True, pool_type="avg")


def build_symbol(cfg: StepConfig, side: str, model: str = "lite"):
    """The train-step symbol of ``cfg`` with the RoI node of ``side`` (:data:`SIDES`).

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


def input_values(cfg: StepConfig) -> Dict[str, np.ndarray]:
    from .workloads import make_rois
    rng = np.random.RandomState(SEED)
    h, w = cfg.image_hw
    return dict(
        data=rng.standard_normal((IMAGES, 3, h, w)).astype(np.float32),
        rois=make_rois(cfg.rois, batch=IMAGES, seed=SEED, image_hw=(h, w)),
        label=rng.randint(0, NUM_CLASSES, size=cfg.rois).astype(np.float32),
        bbox_target=rng.standard_normal((cfg.rois, 4 * NUM_CLASSES)).astype(np.float32),
        bbox_weight=(rng.uniform(size=(cfg.rois, 4 * NUM_CLASSES)) < 0.3).astype(np.float32))


def param_values(exe) -> Dict[str, np.ndarray]:
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


def bind(sym, cfg: StepConfig):
    import mxnet as mx
    values = input_values(cfg)
    shapes = {k: v.shape for k, v in values.items()}
    grad_req = {n: ("null" if n in INPUTS else "write") for n in sym.list_arguments()}
    exe = sym.simple_bind(mx.cpu(), grad_req=grad_req, **shapes)
    for k, v in values.items():
        exe.arg_dict[k][:] = v
    return exe


def load_params(exe, params):
    for k, v in params.items():
        (exe.arg_dict.get(k) if k in exe.arg_dict else exe.aux_dict[k])[:] = v


def graph_ops(sym) -> List[str]:
    """The operators of ``sym`` without the RoI op and the oneDNN guard, in graph order."""
    skip = set(GUARD_OPS) | {"Custom", "null"} | {v[0] for v in BUILTIN_OPS.values()}
    return [n["op"] for n in json.loads(sym.tojson())["nodes"]
            if n["op"] not in skip and not n["op"].startswith(NATIVE_PREFIX)]


def run_step(exe):
    import mxnet as mx
    t0 = time.perf_counter()
    exe.forward(is_train=True)
    exe.backward()
    mx.nd.waitall()
    return time.perf_counter() - t0


def compare_sides(exes, side: str = "ours") -> dict:
    """First-step check: outputs and every parameter gradient, ``side`` against the
    built-in."""
    worst, ok, where = 0.0, True, None
    pairs = [(f"output{i}", a, b) for i, (a, b) in
             enumerate(zip(exes[side].outputs, exes["builtin"].outputs))]
    pairs += [(f"grad:{k}", exes[side].grad_dict[k], g)
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
    losses = {s: float(np.sum(exes[s].outputs[1].asnumpy())) for s in (side, "builtin")}
    return dict(ok=ok, max_rel_err=worst, first_bad=where, compared=len(pairs), losses=losses)

