"""NumPy box utilities: anchors, IoU, box encoding/decoding, NMS and RPN anchor targets.

All boxes use the classic Faster R-CNN pixel convention ``(x1, y1, x2, y2)`` inclusive, so a
box's width is ``x2 - x1 + 1``; this is the convention of ``mx.sym.contrib.(Multi)Proposal``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["generate_anchors", "shifted_anchors", "bbox_overlaps", "bbox_transform",
           "bbox_decode", "clip_boxes", "nms", "anchor_targets"]


def _whctrs(anchor):
    w = anchor[2] - anchor[0] + 1
    h = anchor[3] - anchor[1] + 1
    return w, h, anchor[0] + 0.5 * (w - 1), anchor[1] + 0.5 * (h - 1)


def _mkanchors(ws, hs, x_ctr, y_ctr):
    ws = ws[:, None]
    hs = hs[:, None]
    return np.hstack((x_ctr - 0.5 * (ws - 1), y_ctr - 0.5 * (hs - 1),
                      x_ctr + 0.5 * (ws - 1), y_ctr + 0.5 * (hs - 1)))


def generate_anchors(base_size=16, ratios=(0.5, 1, 2), scales=(8, 16, 32)):
    """Anchors of one feature-map cell, ratio-major like py-faster-rcnn and MXNet's Proposal op."""
    base = np.array([0, 0, base_size - 1, base_size - 1], dtype=np.float64)
    w, h, x, y = _whctrs(base)
    size = w * h
    ratios = np.asarray(ratios, dtype=np.float64)
    ws = np.round(np.sqrt(size / ratios))
    hs = np.round(ws * ratios)
    ratio_anchors = _mkanchors(ws, hs, x, y)
    out = []
    for anchor in ratio_anchors:
        w, h, x, y = _whctrs(anchor)
        scales_a = np.asarray(scales, dtype=np.float64)
        out.append(_mkanchors(w * scales_a, h * scales_a, x, y))
    return np.vstack(out).astype(np.float32)


def shifted_anchors(feat_h, feat_w, stride, base_anchors):
    """All anchors of a ``feat_h x feat_w`` map, ordered ``(h, w, a)``; shape ``(H*W*A, 4)``."""
    sx, sy = np.meshgrid(np.arange(feat_w) * stride, np.arange(feat_h) * stride)
    shifts = np.stack([sx.ravel(), sy.ravel(), sx.ravel(), sy.ravel()], axis=1)
    all_anchors = base_anchors[None, :, :] + shifts[:, None, :]
    return all_anchors.reshape(-1, 4).astype(np.float32)


def bbox_overlaps(boxes, query):
    """IoU matrix ``(N, K)`` between ``boxes (N, 4)`` and ``query (K, 4)``."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    query = np.asarray(query, dtype=np.float64).reshape(-1, 4)
    area_b = (boxes[:, 2] - boxes[:, 0] + 1) * (boxes[:, 3] - boxes[:, 1] + 1)
    area_q = (query[:, 2] - query[:, 0] + 1) * (query[:, 3] - query[:, 1] + 1)
    iw = np.minimum(boxes[:, None, 2], query[None, :, 2]) - \
        np.maximum(boxes[:, None, 0], query[None, :, 0]) + 1
    ih = np.minimum(boxes[:, None, 3], query[None, :, 3]) - \
        np.maximum(boxes[:, None, 1], query[None, :, 1]) + 1
    inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
    union = area_b[:, None] + area_q[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def bbox_transform(ex_rois, gt_rois):
    """Regression targets ``(dx, dy, dw, dh)`` that move ``ex_rois`` onto ``gt_rois``."""
    ex_w = ex_rois[:, 2] - ex_rois[:, 0] + 1.0
    ex_h = ex_rois[:, 3] - ex_rois[:, 1] + 1.0
    ex_x = ex_rois[:, 0] + 0.5 * (ex_w - 1.0)
    ex_y = ex_rois[:, 1] + 0.5 * (ex_h - 1.0)
    gt_w = gt_rois[:, 2] - gt_rois[:, 0] + 1.0
    gt_h = gt_rois[:, 3] - gt_rois[:, 1] + 1.0
    gt_x = gt_rois[:, 0] + 0.5 * (gt_w - 1.0)
    gt_y = gt_rois[:, 1] + 0.5 * (gt_h - 1.0)
    return np.stack([(gt_x - ex_x) / (ex_w + 1e-14), (gt_y - ex_y) / (ex_h + 1e-14),
                     np.log(gt_w / ex_w), np.log(gt_h / ex_h)], axis=1).astype(np.float32)


def bbox_decode(boxes, deltas):
    """Apply deltas ``(N, 4k)`` to ``boxes (N, 4)``; inverse of :func:`bbox_transform`."""
    if boxes.shape[0] == 0:
        return np.zeros((0, deltas.shape[1]), dtype=np.float32)
    boxes = boxes.astype(np.float64)
    w = boxes[:, 2] - boxes[:, 0] + 1.0
    h = boxes[:, 3] - boxes[:, 1] + 1.0
    x = boxes[:, 0] + 0.5 * (w - 1.0)
    y = boxes[:, 1] + 0.5 * (h - 1.0)
    dx, dy = deltas[:, 0::4], deltas[:, 1::4]
    dw = np.minimum(deltas[:, 2::4], 4.0)
    dh = np.minimum(deltas[:, 3::4], 4.0)
    px = dx * w[:, None] + x[:, None]
    py = dy * h[:, None] + y[:, None]
    pw = np.exp(dw) * w[:, None]
    ph = np.exp(dh) * h[:, None]
    out = np.zeros(deltas.shape, dtype=np.float32)
    out[:, 0::4] = px - 0.5 * (pw - 1.0)
    out[:, 1::4] = py - 0.5 * (ph - 1.0)
    out[:, 2::4] = px + 0.5 * (pw - 1.0)
    out[:, 3::4] = py + 0.5 * (ph - 1.0)
    return out


def clip_boxes(boxes, height, width):
    boxes[:, 0::4] = np.clip(boxes[:, 0::4], 0, width - 1)
    boxes[:, 1::4] = np.clip(boxes[:, 1::4], 0, height - 1)
    boxes[:, 2::4] = np.clip(boxes[:, 2::4], 0, width - 1)
    boxes[:, 3::4] = np.clip(boxes[:, 3::4], 0, height - 1)
    return boxes


def nms(dets, thresh):
    """Greedy NMS on ``dets (N, 5)`` = boxes + score; returns kept indices (by score)."""
    if len(dets) == 0:
        return []
    x1, y1, x2, y2, scores = (dets[:, i] for i in range(5))
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = scores.argsort()[::-1]
    keep = []
    while order.size > 0:
        i = order[0]
        keep.append(int(i))
        xx1 = np.maximum(x1[i], x1[order[1:]])
        yy1 = np.maximum(y1[i], y1[order[1:]])
        xx2 = np.minimum(x2[i], x2[order[1:]])
        yy2 = np.minimum(y2[i], y2[order[1:]])
        inter = np.maximum(0.0, xx2 - xx1 + 1) * np.maximum(0.0, yy2 - yy1 + 1)
        ovr = inter / (areas[i] + areas[order[1:]] - inter)
        order = order[1:][ovr <= thresh]
    return keep


def anchor_targets(gt_boxes, im_h, im_w, feat_h, feat_w, stride, base_anchors, rng,
                   batch_size=256, fg_fraction=0.5, pos_overlap=0.7, neg_overlap=0.3,
                   allowed_border=0):
    """RPN training targets for one image, laid out for the RPN heads.

    Returns ``label (A*H, W)`` with 1/0/-1 (ignore), ``bbox_target (4A, H, W)`` and
    ``bbox_weight (4A, H, W)``.
    """
    A = base_anchors.shape[0]
    anchors = shifted_anchors(feat_h, feat_w, stride, base_anchors)
    total = anchors.shape[0]
    inside = np.where((anchors[:, 0] >= -allowed_border) & (anchors[:, 1] >= -allowed_border) &
                      (anchors[:, 2] < im_w + allowed_border) &
                      (anchors[:, 3] < im_h + allowed_border))[0]
    labels = np.full(total, -1, dtype=np.float32)
    targets = np.zeros((total, 4), dtype=np.float32)
    gt = gt_boxes[:, :4] if len(gt_boxes) else np.zeros((0, 4), np.float32)
    if len(gt) and len(inside):
        ov = bbox_overlaps(anchors[inside], gt)
        argmax = ov.argmax(axis=1)
        maxov = ov[np.arange(len(inside)), argmax]
        gt_max = ov.max(axis=0)
        lab = np.full(len(inside), -1, dtype=np.float32)
        lab[maxov < neg_overlap] = 0
        best = np.where((ov == gt_max[None, :]) & (gt_max[None, :] > 0))[0]
        lab[best] = 1
        lab[maxov >= pos_overlap] = 1
        labels[inside] = lab
        targets[inside] = bbox_transform(anchors[inside], gt[argmax])
    elif len(inside):
        labels[inside] = 0
    num_fg = int(fg_fraction * batch_size)
    fg = np.where(labels == 1)[0]
    if len(fg) > num_fg:
        labels[rng.choice(fg, len(fg) - num_fg, replace=False)] = -1
    num_bg = batch_size - int((labels == 1).sum())
    bg = np.where(labels == 0)[0]
    if len(bg) > num_bg:
        labels[rng.choice(bg, len(bg) - num_bg, replace=False)] = -1
    weights = np.zeros((total, 4), dtype=np.float32)
    weights[labels == 1] = 1.0
    # (H, W, A) -> (A, H, W) for labels; (H, W, A*4) -> (A*4, H, W) for targets
    labels = labels.reshape(feat_h, feat_w, A).transpose(2, 0, 1).reshape(A * feat_h, feat_w)
    targets = targets.reshape(feat_h, feat_w, A * 4).transpose(2, 0, 1)
    weights = weights.reshape(feat_h, feat_w, A * 4).transpose(2, 0, 1)
    return labels, targets, weights
