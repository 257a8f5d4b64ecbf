"""mAP against hand-computed cases."""
import numpy as np
import pytest

from example_rcnn.metrics import eval_map, voc_ap


def det(boxes, scores, labels):
    return dict(boxes=np.array(boxes, np.float32).reshape(-1, 4),
                scores=np.array(scores, np.float32), labels=np.array(labels))


def gt(boxes, labels, difficult=None):
    return dict(boxes=np.array(boxes, np.float32).reshape(-1, 4), labels=np.array(labels),
                difficult=np.array(difficult if difficult is not None else [0] * len(labels),
                                   bool))


A, B, C = [0, 0, 9, 9], [20, 20, 39, 39], [50, 50, 69, 59]


def test_two_images_tp_fp_tp():
    # sorted: TP (img0), FP, TP (img1); npos = 3
    # recall 1/3,1/3,2/3  precision 1,1/2,2/3
    # all-point AP = 1/3*1 + 1/3*2/3 = 5/9;  11-point = (4*1 + 3*2/3)/11 = 6/11
    gts = [gt([A, B], [1, 1]), gt([C], [1])]
    dets = [det([A, [100, 100, 110, 110]], [0.9, 0.8], [1, 1]), det([C], [0.7], [1])]
    assert eval_map(dets, gts, 2, 0.5)["mAP"] == pytest.approx(5 / 9)
    assert eval_map(dets, gts, 2, 0.5, use_07_metric=True)["mAP"] == pytest.approx(6 / 11)


def test_duplicate_detection_is_false_positive():
    # TP then duplicate FP: rec 1,1 prec 1,1/2 -> AP 1 (envelope); with a miss first:
    gts = [gt([A], [1])]
    assert eval_map([det([A, A], [0.9, 0.8], [1, 1])], gts, 2)["mAP"] == pytest.approx(1.0)
    # FP ranked above the only TP: rec 0,1 prec 0,1/2 -> AP 1/2
    dets = [det([A, B], [0.5, 0.9], [1, 1])]
    assert eval_map(dets, gts, 2)["mAP"] == pytest.approx(0.5)
    # duplicate ranked first then the real one: prec 1 then 1/2, still AP 1
    assert eval_map([det([A, A], [0.8, 0.9], [1, 1])], gts, 2)["mAP"] == pytest.approx(1.0)


def test_iou_threshold_half_vs_three_quarters():
    # pixel-inclusive: gt 10x10 = 100, det 10x5 = 50 inside -> IoU exactly 0.5
    gts = [gt([A], [1])]
    dets = [det([[0, 0, 9, 4]], [0.9], [1])]
    assert eval_map(dets, gts, 2, 0.5)["mAP"] == pytest.approx(1.0)
    assert eval_map(dets, gts, 2, 0.75)["mAP"] == pytest.approx(0.0)


def test_difficult_ignored():
    # B is difficult: the detection on it is neither TP nor FP and B is not a positive
    gts = [gt([A, B], [1, 1], [0, 1])]
    dets = [det([B, A], [0.9, 0.8], [1, 1])]
    r = eval_map(dets, gts, 2)
    assert r["npos"][1] == 1 and r["mAP"] == pytest.approx(1.0)


def test_classes_and_wrong_label():
    # class 1: found (AP 1). class 2: its only detection has class 1's label -> AP 0.
    # class 3 has no ground truth -> left out of the mean.  mAP = (1 + 0) / 2
    gts = [gt([A, B], [1, 2])]
    dets = [det([A, B], [0.9, 0.8], [1, 1])]
    r = eval_map(dets, gts, 4)
    assert r["ap"][1] == pytest.approx(2 / 2 * 1.0)   # rec 1 at prec 1 (B is FP after)
    assert r["ap"][2] == 0.0 and 3 not in r["ap"]
    assert r["mAP"] == pytest.approx(0.5)


def test_voc_ap_curve():
    # rec .5 at prec 1, rec 1 at prec .5 -> .5*1 + .5*.5
    assert voc_ap([0.5, 1.0], [1.0, 0.5]) == pytest.approx(0.75)
    # precision envelope: later higher precision lifts earlier points
    assert voc_ap([0.25, 0.5, 1.0], [0.5, 1.0, 0.75]) == pytest.approx(0.5 * 1.0 + 0.5 * 0.75)
