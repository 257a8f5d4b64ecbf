"""The benchmark's inputs and workloads: seeded data / proposals / out-grads and the table
of op configurations, each ours against its MXNet built-in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

import mxnet as mx

import mx_roi

__all__ = ["Workload", "build_workloads", "build_door_workloads", "pooled_hw", "offsets",
           "select_workloads", "make_rois", "make_data", "make_out_grad", "Inputs", "in_layout",
           "spread_rois", "BEYOND_SPREAD"]

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


def in_layout(rois: np.ndarray, columns: int, seed: int = SEED) -> np.ndarray:
    """The proposals ``rois`` (R, 5) in an op's roi layout: as they are (5 columns), or
    for rotated boxes (6) as (batch, x_center, y_center, width, height, angle), the same
    boxes turned by seeded angles uniform in [-90, 90) degrees."""
    if columns == 5:
        return rois
    if columns != 6:
        raise ValueError(f"no bench proposals with {columns} columns")
    angle = np.random.RandomState(seed + 3000).uniform(-90, 90, size=max(len(rois), 1))
    b, x1, y1, x2, y2 = rois.T
    return np.stack([b, (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1,
                     angle[:len(rois)]], axis=1).astype(rois.dtype)


#: how far (pixels, at most, per side) :func:`spread_rois` moves the sides of the proposals
#: of a ``beyond`` workload out: up to 10 feature cells at stride 16
BEYOND_SPREAD = 160.0


def spread_rois(rois: np.ndarray, spread: float, seed: int = SEED) -> np.ndarray:
    """``rois`` (R, 5) with every side moved out by a seeded amount uniform in [0,
    ``spread``) pixels: boxes reaching beyond the image and the map (unclipped proposals,
    jittered ground truth), where an adaptive ROIAlign needs more sample points than a
    box inside the map; ``spread`` 0: ``rois`` unchanged."""
    if not spread:
        return rois
    out = rois.copy()
    move = np.random.RandomState(seed + 4000).uniform(0, spread, (max(len(rois), 1), 4))
    out[:, 1:3] -= move[:len(rois), :2]
    out[:, 3:5] += move[:len(rois), 2:]
    return out.astype(rois.dtype)


def make_data(channels: int, seed: int = SEED) -> np.ndarray:
    rng = np.random.RandomState(seed + 1000 + channels)
    return rng.standard_normal((BATCH, channels, FEAT_H, FEAT_W)).astype(np.float32)


def make_out_grad(shape, seed: int = SEED) -> np.ndarray:
    rng = np.random.RandomState(seed + 2000)
    return rng.standard_normal(shape).astype(np.float32)


#: the targets of issue 34 for a small call's cost above a no-op Custom call with the same
#: shapes (the fixed-cost section, mx_roi.bench.overhead): fwd, fwd+bwd (ms)
FIXED_COST_TARGET_MS = {"fwd": 0.25, "fwd+bwd": 0.5}


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
    #: columns of the op's rois (the proposals go through :func:`in_layout`)
    rois_columns: int = 5
    #: the directions the built-in can run (MXNet's RROIAlign has no backward)
    builtin_directions: tuple = DIRECTIONS
    #: an op with extra inputs (e.g. DeformablePSROIPooling's trans): ``extra(rois,
    #: params)`` -> the seeded NDArrays that follow data and rois (gradients attached: a
    #: training call asks for them), the same for ours and the built-in
    extra: Optional[Callable] = None
    #: proposals moved out beyond the image by up to this many pixels per side
    #: (:func:`spread_rois`; 0: the proposals as they are, inside the image)
    spread: float = 0.0

    def extra_inputs(self, rois, params=None) -> list:
        if self.extra is None:
            return []
        return list(self.extra(rois, self.ours_kwargs if params is None else params))

    @property
    def has_builtin(self) -> bool:
        return self.builtin_name is not None

    def ours(self) -> Callable:
        fn = getattr(mx_roi.nd, self.op)
        kwargs = dict(self.ours_kwargs)
        return lambda data, rois: fn(data, rois, *self.extra_inputs(rois), **kwargs)

    def builtin(self, direction: Optional[str] = None) -> Optional[Callable]:
        """The built-in's call (None: none, or none for ``direction``)."""
        if self.builtin_name is None or (direction is not None
                                         and direction not in self.builtin_directions):
            return None
        fn = mx
        for part in self.builtin_name.split(".")[1:]:
            fn = getattr(fn, part)
        kwargs = dict(self.builtin_kwargs)
        return lambda data, rois: fn(data, rois, *self.extra_inputs(rois), **kwargs)

    @property
    def out_shape(self):
        """Our output's shape ``(R, C_out, PH, PW)``."""
        ph, pw = pooled_hw(self.ours_kwargs["pooled_size"])
        return (self.boxes, self.ours_kwargs.get("output_dim", self.channels), ph, pw)

    def op_instance(self, **overrides):
        """Our op definition (:class:`mx_roi.registry.RoIOp`) with this workload's params
        (and ``overrides``, e.g. ``deterministic=True``)."""
        from .. import registry
        cls = registry.get_op(self.op)
        params = {**self.ours_kwargs, **overrides}
        return cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))


def pooled_hw(pooled_size):
    """``(PH, PW)`` of a ``pooled_size`` parameter (an int: a square pool)."""
    return (pooled_size, pooled_size) if isinstance(pooled_size, int) else tuple(pooled_size)


_OFFSETS = {}


def offsets(per_class: bool, seed: int = SEED):
    """``extra`` of a DeformablePSROIPooling workload: trans (R, 2K, part, part) with K =
    output_dim (``per_class``) or 1, uniform in [-1, 1] (with trans_std 0.1: offsets up to
    a tenth of the box), made once per context and shape, its gradient attached."""
    def make(rois, params):
        classes = params["output_dim"] if per_class else 1
        part = params.get("part_size") or params["pooled_size"]
        key = (str(rois.context), rois.shape[0], classes, part)
        if key not in _OFFSETS:
            rng = np.random.RandomState(seed + 3000)
            t = mx.nd.array(rng.uniform(-1, 1, (rois.shape[0], 2 * classes, part, part)),
                            ctx=rois.context)
            t.attach_grad()
            _OFFSETS[key] = t
        return [_OFFSETS[key]]
    return make


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
    # Deformable R-FCN (Deformable-ConvNets): per-class offsets of the position-sensitive
    # scores, and the class-agnostic deformable RoI pooling of 256 channels (its FPN head)
    dp = dict(spatial_scale=s, pooled_size=7, part_size=7, sample_per_part=4, trans_std=0.1)
    rfcn = dict(dp, output_dim=classes, group_size=7)
    out.append(Workload("DeformablePSROIPooling/7x7", "DeformablePSROIPooling",
                        f"{classes} cls, 7x7, {boxes} boxes, C={classes * 49}, per-class "
                        "offsets, 4x4 samples", classes * 49, boxes, rfcn,
                        "mx.nd.contrib.DeformablePSROIPooling", rfcn,
                        extra=offsets(True)))
    agnostic = dict(dp, output_dim=channels, group_size=1)
    out.append(Workload("DeformablePSROIPooling-agnostic/7x7", "DeformablePSROIPooling",
                        f"7x7, {big_boxes} boxes, C={channels}, group_size=1, shared offsets, "
                        "4x4 samples", channels, big_boxes, agnostic,
                        "mx.nd.contrib.DeformablePSROIPooling", agnostic,
                        extra=offsets(False)))
    if variants:
        add(14, big_boxes, suffix="-big")
    for size, nboxes, suffix in ((7, boxes, ""),) + (((14, big_boxes, "-big"),) if variants
                                                      else ()):
        p = (size, size)
        out.append(Workload(f"RROIAlign/{size}x{size}{suffix}", "RROIAlign",
                            f"{size}x{size}, {nboxes} rotated boxes, sampling_ratio=2",
                            channels, nboxes,
                            dict(pooled_size=p, spatial_scale=s, sampling_ratio=2),
                            "mx.nd.contrib.RROIAlign",
                            dict(pooled_size=p, spatial_scale=s, sampling_ratio=2),
                            note="built-in: forward only", rois_columns=6,
                            builtin_directions=("fwd",)))
        out.append(Workload(f"PrRoIPool/{size}x{size}{suffix}", "PrRoIPool",
                            f"{size}x{size}, {nboxes} boxes", channels, nboxes,
                            dict(pooled_size=p, spatial_scale=s), None,
                            note="no built-in (mmcv's PrRoIPool)"))
    return out


def build_door_workloads(quick: bool = False, variants: bool = True) -> List[Workload]:
    """``--doors``' workloads: :func:`build_workloads`' and the sample-grid rows whose
    tables the two doors size differently from the shapes (the main table keeps its rows):
    ROIAlign and PSROIAlign with adaptive sampling (``sample_ratio=0``: a bin's samples
    from the box's size, in tables padded to the map's size), and ROIAlign with boxes
    reaching beyond the map (:data:`BEYOND_SPREAD`: samples outside it count as zero),
    with a fixed and an adaptive sample grid.  issue 42's target: native <= Custom on
    every row."""
    out = build_workloads(quick, variants)
    channels, boxes, classes = (32, 32, 4) if quick else (256, 256, 21)
    s, p = SPATIAL_SCALE, (14, 14)
    tag = f"14x14, {boxes} boxes"
    for key, ratio, spread, note in (
            ("ROIAlign-adaptive/14x14", 0, 0.0, "sample_ratio=0"),
            ("ROIAlign-beyond/14x14", 2, BEYOND_SPREAD, "sample_ratio=2, boxes beyond the map"),
            ("ROIAlign-adaptive-beyond/14x14", 0, BEYOND_SPREAD,
             "sample_ratio=0, boxes beyond the map")):
        out.append(Workload(key, "ROIAlign", f"{tag}, {note}", channels, boxes,
                            dict(pooled_size=p, spatial_scale=s, sample_ratio=ratio),
                            None, note="--doors only", spread=spread))
    ps_channels = classes * 49
    out.append(Workload("PSROIAlign-adaptive/7x7", "PSROIAlign",
                        f"{classes} cls, 7x7, {boxes} boxes, C={ps_channels}, sample_ratio=0",
                        ps_channels, boxes,
                        dict(pooled_size=(7, 7), output_dim=classes, spatial_scale=s,
                             sample_ratio=0), None, note="--doors only"))
    return out


def select_workloads(workloads: List[Workload], only: Optional[str]) -> List[Workload]:
    """The workloads ``--only`` names: comma-separated keys (``ROIAlign/7x7``) or families
    (``ROIAlign``, ``ROIAlign-max``, ...); all of them without ``only``."""
    if not only:
        return list(workloads)
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    return [w for w in workloads if any(s in (w.key, w.key.split("/")[0]) for s in wanted)]


class Inputs:
    """Seeded inputs on a context, shared by ours and the built-in (identical arrays)."""

    def __init__(self, ctx, max_boxes):
        self.ctx = ctx
        self.rois_np = make_rois(max_boxes)
        self._data = {}

    def data_np(self, channels) -> np.ndarray:
        """The seeded data ``(BATCH, channels, FEAT_H, FEAT_W)`` as NumPy (cached)."""
        if channels not in self._data:
            self._data[channels] = make_data(channels)
        return self._data[channels]

    def data(self, channels):
        return mx.nd.array(self.data_np(channels), ctx=self.ctx)

    def rois(self, count, columns: int = 5, spread: float = 0.0):
        """The first ``count`` proposals, in the layout of an op with ``columns``, their
        sides moved out by up to ``spread`` pixels (:func:`spread_rois`)."""
        rois = spread_rois(self.rois_np[:count], spread)
        return mx.nd.array(in_layout(rois, columns), ctx=self.ctx)

    def out_grad(self, shape):
        return mx.nd.array(make_out_grad(shape), ctx=self.ctx)

