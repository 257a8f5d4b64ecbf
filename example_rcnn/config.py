"""Model/training configuration with per-backbone defaults."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Tuple

ROI_OPS = ("pool", "align", "psalign")
BACKBONES = ("tiny", "vgg16", "resnet50")


@dataclass
class Config:
    backbone: str = "tiny"
    roi_op: str = "align"
    num_classes: int = 4                       # including background
    image_size: int = 128                      # images are letterboxed to image_size^2
    feat_stride: int = 8
    anchor_scales: Tuple[float, ...] = (2, 4, 8)
    anchor_ratios: Tuple[float, ...] = (0.5, 1, 2)
    pixel_mean: Tuple[float, ...] = (123.68, 116.78, 103.94)
    pixel_std: Tuple[float, ...] = (58.0, 58.0, 58.0)
    max_gt: int = 16
    # RPN
    rpn_batch_size: int = 128
    rpn_pre_nms_train: int = 2000
    rpn_post_nms_train: int = 256
    rpn_pre_nms_test: int = 1000
    rpn_post_nms_test: int = 100
    rpn_nms_thresh: float = 0.7
    rpn_min_size: int = 8
    # R-CNN sampling
    batch_rois: int = 64                       # sampled RoIs per image
    fg_fraction: float = 0.25
    fg_thresh: float = 0.5
    bg_thresh_hi: float = 0.5
    bg_thresh_lo: float = 0.0
    bbox_stds: Tuple[float, ...] = (0.1, 0.1, 0.2, 0.2)
    # RoI operator / head
    pooled_size: int = 7
    sample_ratio: int = 2
    aligned: bool = True                       # ROIAlign/PSROIAlign half-pixel offset
    head_hidden: int = 256
    # test
    test_nms: float = 0.3
    test_score_thresh: float = 0.01
    max_per_image: int = 100

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kw = {}
        for k, v in d.items():
            if k in fields:
                kw[k] = tuple(v) if isinstance(v, list) else v
        return cls(**kw)


def default_config(backbone="tiny", roi_op="align", num_classes=4, **overrides):
    """Defaults for ``backbone``; ``overrides`` win."""
    if backbone not in BACKBONES:
        raise ValueError("backbone must be one of %s, got %r" % (BACKBONES, backbone))
    if roi_op not in ROI_OPS:
        raise ValueError("roi_op must be one of %s, got %r" % (ROI_OPS, roi_op))
    kw = dict(backbone=backbone, roi_op=roi_op, num_classes=num_classes)
    if backbone in ("vgg16", "resnet50"):
        kw.update(image_size=600, feat_stride=16, anchor_scales=(8, 16, 32), pixel_std=(1, 1, 1),
                  max_gt=64, rpn_batch_size=256, rpn_pre_nms_train=6000,
                  rpn_post_nms_train=2000, rpn_pre_nms_test=6000, rpn_post_nms_test=300,
                  rpn_min_size=16, batch_rois=128, head_hidden=4096)
        if backbone == "resnet50":
            kw.update(pooled_size=14)   # the C5 head (stride 2) brings it to 7x7
    kw.update(overrides)
    cfg = Config(**kw)
    if cfg.roi_op == "psalign" and cfg.backbone == "resnet50":
        cfg.pooled_size = 7
    return cfg
