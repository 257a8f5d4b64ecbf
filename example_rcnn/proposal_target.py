"""Proposal-target sampling as a Python CustomOp (op_type ``rcnn_proposal_target``).

Inputs: ``rois (N, 5)`` = (batch index, x1, y1, x2, y2) from the RPN proposal op and
``gt_boxes (B, max_gt, 5)`` = (x1, y1, x2, y2, class) padded with -1 rows.
Outputs, ``batch_rois`` per image: sampled ``rois``, ``label``, ``bbox_target`` and
``bbox_weight`` (class-specific, ``4 * num_classes`` wide, normalised by ``bbox_stds``).
Sampling is seeded from a hash of the ground truth, so the same batch always gets the same
RoIs (this is what makes ``--resume`` bit-exact).
"""
from __future__ import annotations

import ast
import zlib

import mxnet as mx
import numpy as np

from .boxes import bbox_overlaps, bbox_transform


def sample_rois(rois, gt, num_classes, batch_rois, fg_fraction, fg_thresh, bg_hi, bg_lo,
                stds, rng):
    """Sample ``batch_rois`` RoIs (N, 4) of one image against ``gt (G, 5)``."""
    if len(gt):
        rois = np.vstack([rois, gt[:, :4]])       # gt boxes are always candidates
    fg_per_image = int(round(fg_fraction * batch_rois))
    if len(gt):
        ov = bbox_overlaps(rois, gt[:, :4])
        assign = ov.argmax(axis=1)
        maxov = ov.max(axis=1)
        labels = gt[assign, 4].astype(np.int64)
    else:
        assign = np.zeros(len(rois), np.int64)
        maxov = np.zeros(len(rois))
        labels = np.zeros(len(rois), np.int64)
    fg = np.where(maxov >= fg_thresh)[0]
    n_fg = min(fg_per_image, len(fg))
    if len(fg) > n_fg:
        fg = rng.choice(fg, n_fg, replace=False)
    bg = np.where((maxov < bg_hi) & (maxov >= bg_lo))[0]
    n_bg = batch_rois - n_fg
    if len(bg) > n_bg:
        bg = rng.choice(bg, n_bg, replace=False)
    elif 0 < len(bg) < n_bg:
        bg = np.concatenate([bg, rng.choice(bg, n_bg - len(bg), replace=True)])
    keep = np.concatenate([fg, bg]).astype(np.int64)
    if len(keep) < batch_rois:                     # no background at all: repeat what we have
        pool = keep if len(keep) else np.arange(len(rois))
        keep = np.concatenate([keep, rng.choice(pool, batch_rois - len(keep), replace=True)])
    lab = labels[keep].copy()
    lab[n_fg:] = 0
    sel = rois[keep]
    targets = np.zeros((batch_rois, 4 * num_classes), np.float32)
    weights = np.zeros_like(targets)
    if len(gt) and n_fg:
        t = bbox_transform(sel[:n_fg], gt[assign[keep[:n_fg]], :4]) / np.asarray(stds, np.float32)
        for i in range(n_fg):
            c = int(lab[i])
            targets[i, 4 * c:4 * c + 4] = t[i]
            weights[i, 4 * c:4 * c + 4] = 1.0
    return sel.astype(np.float32), lab.astype(np.float32), targets, weights


class ProposalTargetOp(mx.operator.CustomOp):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, is_train, req, in_data, out_data, aux):
        p = self.p
        rois = in_data[0].asnumpy()
        gt_all = in_data[1].asnumpy()
        outs = [[], [], [], []]
        for b in range(gt_all.shape[0]):
            gt = gt_all[b][gt_all[b, :, 4] > 0]
            r = rois[rois[:, 0] == b, 1:5]
            rng = np.random.RandomState(zlib.crc32(gt.tobytes()) ^ p["seed"])
            sel, lab, tgt, w = sample_rois(r, gt, p["num_classes"], p["batch_rois"],
                                           p["fg_fraction"], p["fg_thresh"], p["bg_hi"],
                                           p["bg_lo"], p["stds"], rng)
            outs[0].append(np.hstack([np.full((len(sel), 1), b, np.float32), sel]))
            outs[1].append(lab)
            outs[2].append(tgt)
            outs[3].append(w)
        for i in range(4):
            self.assign(out_data[i], req[i], mx.nd.array(np.concatenate(outs[i])))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        for i in range(2):
            self.assign(in_grad[i], req[i], 0)


@mx.operator.register("rcnn_proposal_target")
class ProposalTargetProp(mx.operator.CustomOpProp):
    def __init__(self, num_classes, batch_rois, batch_images="0", fg_fraction="0.25",
                 fg_thresh="0.5", bg_thresh_hi="0.5", bg_thresh_lo="0.0",
                 bbox_stds="(0.1, 0.1, 0.2, 0.2)", seed="0"):
        super().__init__(need_top_grad=False)
        self.p = dict(num_classes=int(num_classes), batch_images=int(batch_images),
                      batch_rois=int(batch_rois), fg_fraction=float(fg_fraction),
                      fg_thresh=float(fg_thresh), bg_hi=float(bg_thresh_hi),
                      bg_lo=float(bg_thresh_lo), stds=tuple(ast.literal_eval(str(bbox_stds))),
                      seed=int(seed))

    def list_arguments(self):
        return ["rois", "gt_boxes"]

    def list_outputs(self):
        return ["rois_output", "label", "bbox_target", "bbox_weight"]

    def infer_shape(self, in_shape):
        n = in_shape[1][0] * self.p["batch_rois"]      # images on this device x RoIs
        c = self.p["num_classes"]
        return in_shape, [(n, 5), (n,), (n, 4 * c), (n, 4 * c)], []

    def create_operator(self, ctx, shapes, dtypes):
        return ProposalTargetOp(self.p)

    def declare_backward_dependency(self, out_grad, in_data, out_data):
        return []
