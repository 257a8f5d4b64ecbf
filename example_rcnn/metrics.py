"""VOC-style average precision (own implementation, no devkit).

``voc_ap`` computes the area under the interpolated precision/recall curve ("all points",
VOC2010+), or the 11-point VOC2007 variant with ``use_07_metric=True``.
``eval_map`` matches detections to ground truth per class in descending score order: a
detection is a true positive when its IoU (pixel-inclusive, like the devkit) with the best
unmatched ground truth box is >= ``iou_thresh``; a detection matching a ``difficult`` box is
neither TP nor FP; difficult boxes don't count as positives.  mAP averages the classes that
have at least one (non-difficult) ground truth box.
"""
from __future__ import annotations

import numpy as np

from .boxes import bbox_overlaps


def voc_ap(rec, prec, use_07_metric=False):
    rec = np.asarray(rec, dtype=np.float64)
    prec = np.asarray(prec, dtype=np.float64)
    if use_07_metric:
        ap = 0.0
        for t in np.arange(0.0, 1.1, 0.1):
            p = prec[rec >= t].max() if np.any(rec >= t) else 0.0
            ap += p / 11.0
        return float(ap)
    mrec = np.concatenate(([0.0], rec, [1.0]))
    mpre = np.concatenate(([0.0], prec, [0.0]))
    for i in range(len(mpre) - 2, -1, -1):
        mpre[i] = max(mpre[i], mpre[i + 1])
    idx = np.where(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[idx + 1] - mrec[idx]) * mpre[idx + 1]))


def eval_map(detections, ground_truths, num_classes, iou_thresh=0.5, use_07_metric=False):
    """mAP over classes ``1..num_classes-1``.

    ``detections[i]`` = dict(boxes (n,4), scores (n,), labels (n,)) for image ``i``;
    ``ground_truths[i]`` = dict(boxes (m,4), labels (m,), difficult (m,) optional).
    Returns ``dict(mAP=float, ap={class: float}, npos={class: int})``.
    """
    aps, npos_all = {}, {}
    for c in range(1, num_classes):
        gts = {}
        npos = 0
        for i, gt in enumerate(ground_truths):
            mask = np.asarray(gt["labels"]) == c
            boxes = np.asarray(gt["boxes"], dtype=np.float64).reshape(-1, 4)[mask]
            diff = np.asarray(gt.get("difficult", np.zeros(len(mask), bool)), bool)[mask]
            gts[i] = (boxes, diff, np.zeros(len(boxes), bool))
            npos += int((~diff).sum())
        recs = []
        for i, det in enumerate(detections):
            mask = np.asarray(det["labels"]) == c
            for box, score in zip(np.asarray(det["boxes"]).reshape(-1, 4)[mask],
                                  np.asarray(det["scores"])[mask]):
                recs.append((float(score), i, box))
        npos_all[c] = npos
        if npos == 0:
            continue
        recs.sort(key=lambda r: -r[0])       # stable: ties keep image order
        tp = np.zeros(len(recs))
        fp = np.zeros(len(recs))
        for d, (_, i, box) in enumerate(recs):
            boxes, diff, used = gts.get(i, (np.zeros((0, 4)), np.zeros(0, bool), np.zeros(0, bool)))
            if len(boxes):
                ov = bbox_overlaps(box[None], boxes)[0]
                j = int(ov.argmax())
                if ov[j] >= iou_thresh:
                    if diff[j]:
                        continue
                    if not used[j]:
                        used[j] = True
                        tp[d] = 1
                    else:
                        fp[d] = 1
                    continue
            fp[d] = 1
        tp = np.cumsum(tp)
        fp = np.cumsum(fp)
        rec = tp / npos
        prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        aps[c] = voc_ap(rec, prec, use_07_metric) if len(recs) else 0.0
    m = float(np.mean(list(aps.values()))) if aps else 0.0
    return dict(mAP=m, ap=aps, npos=npos_all)
