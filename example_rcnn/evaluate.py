"""Evaluate a checkpoint: ``python -m example_rcnn.evaluate --out out/rcnn [--epoch N]``.

Prints VOC-style mAP at IoU 0.5 and 0.75 (own implementation, :mod:`example_rcnn.metrics`),
writes ``detections.png`` (predicted boxes on a few test images), ``loss_curves.png`` (training
loss terms) and ``eval.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

import mxnet as mx
import numpy as np

from .boxes import bbox_decode, clip_boxes, nms
from .config import Config
from .data import DetIter
from .metrics import eval_map
from .symbol import feature_shape, get_test_symbol
from .train import PREFIX, add_common_args, latest_epoch, load_param_file, make_dataset, parse_ctx


def load_model(out_dir, epoch=None, ctx=None, batch_size=1):
    """Test-mode Module for checkpoint ``epoch`` (default: the last one written) in ``out_dir``."""
    with open(os.path.join(out_dir, "train_state.json")) as f:
        state = json.load(f)
    cfg = Config.from_dict(state["config"])
    # the epoch the last training run finished (stale files of an older, longer run are ignored)
    epoch = epoch or state.get("epoch") or latest_epoch(out_dir)
    arg, aux = load_param_file(os.path.join(out_dir, "%s-%04d.params" % (PREFIX, epoch)))
    mod = mx.mod.Module(get_test_symbol(cfg), data_names=("data", "im_info"), label_names=None,
                        context=ctx or [mx.cpu()])
    s = cfg.image_size
    mod.bind(data_shapes=[("data", (batch_size, 3, s, s)), ("im_info", (batch_size, 3))],
             for_training=False)
    mod.set_params(arg, aux, allow_missing=False, allow_extra=True)
    return mod, cfg, state


def postprocess(rois, cls_prob, bbox_pred, im_info, cfg):
    """One image's raw outputs -> dict(boxes, scores, labels) in original-image pixels."""
    stds = np.tile(np.asarray(cfg.bbox_stds, np.float32), cfg.num_classes)
    boxes = bbox_decode(rois[:, 1:5], bbox_pred * stds)
    boxes = clip_boxes(boxes, im_info[0], im_info[1]) / im_info[2]
    out_b, out_s, out_l = [], [], []
    for c in range(1, cfg.num_classes):
        scores = cls_prob[:, c]
        keep = np.where(scores > cfg.test_score_thresh)[0]
        if not len(keep):
            continue
        dets = np.hstack([boxes[keep, 4 * c:4 * c + 4], scores[keep, None]])
        k = nms(dets, cfg.test_nms)
        out_b.append(dets[k, :4])
        out_s.append(dets[k, 4])
        out_l.append(np.full(len(k), c, np.int32))
    if not out_b:
        return dict(boxes=np.zeros((0, 4), np.float32), scores=np.zeros(0, np.float32),
                    labels=np.zeros(0, np.int32))
    b, s, l = np.concatenate(out_b), np.concatenate(out_s), np.concatenate(out_l)
    order = np.argsort(-s, kind="stable")[:cfg.max_per_image]
    return dict(boxes=b[order], scores=s[order], labels=l[order])


def predict(mod, cfg, dataset, batch_size=1, limit=None):
    """Run the detector over ``dataset``; returns (detections, ground_truths, records)."""
    it = DetIter(dataset, cfg, batch_size, feature_shape(cfg), train=False)
    dets, gts, recs = [], [], []
    n = len(dataset) if limit is None else min(limit, len(dataset))
    for batch in it:
        mod.forward(batch, is_train=False)
        rois, cls_prob, bbox_pred = [o.asnumpy() for o in mod.get_outputs()]
        per = rois.shape[0] // batch_size
        for b in range(batch_size - batch.pad):
            rec = it.last_records[b]
            sl = slice(b * per, (b + 1) * per)
            dets.append(postprocess(rois[sl], cls_prob[sl], bbox_pred[sl], rec["im_info"], cfg))
            gts.append(dict(boxes=rec["boxes"], labels=rec["labels"],
                            difficult=rec["difficult"]))
            recs.append(dict(image=rec["orig_image"], id=rec["id"]))
            if len(dets) >= n:
                return dets, gts, recs
    return dets, gts, recs


COLORS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
          (145, 30, 180), (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 190)]


def draw_detections(recs, dets, classes, path, score_thresh=0.5, cols=4, scale=2):
    """Grid PNG of images with predicted boxes (score >= ``score_thresh``)."""
    from PIL import Image, ImageDraw
    tiles = []
    for rec, det in zip(recs, dets):
        img = Image.fromarray(rec["image"])
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
        d = ImageDraw.Draw(img)
        for box, s, l in zip(det["boxes"], det["scores"], det["labels"]):
            if s < score_thresh:
                continue
            color = COLORS[(int(l) - 1) % len(COLORS)]
            d.rectangle([float(v) * scale for v in box], outline=color, width=2)
            d.text((float(box[0]) * scale + 2, float(box[1]) * scale + 1),
                   "%s %.2f" % (classes[int(l) - 1], s), fill=color)
        tiles.append(img)
    if not tiles:
        return None
    w = max(t.width for t in tiles)
    h = max(t.height for t in tiles)
    rows = (len(tiles) + cols - 1) // cols
    grid = Image.new("RGB", (w * min(cols, len(tiles)), h * rows), (255, 255, 255))
    for i, t in enumerate(tiles):
        grid.paste(t, ((i % cols) * w, (i // cols) * h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    grid.save(path)
    return path


def plot_losses(histories, path, smooth=10):
    """PNG of the loss terms per iteration; ``histories`` = {label: history list}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ("rpn_cls", "rpn_bbox", "rcnn_cls", "rcnn_bbox")
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for label, hist in histories.items():
        for ax, name in zip(axes, names):
            y = np.array([h[name] for h in hist], dtype=np.float64)
            if len(y) >= smooth:
                y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
            ax.plot(np.arange(len(y)), y, label=label)
    for ax, name in zip(axes, names):
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def evaluate(args, epoch=None, draw=8, plots=True):
    """Evaluate ``args.out``'s checkpoint; returns dict(map50, map75, ...)."""
    mod, cfg, state = load_model(args.out, epoch, parse_ctx(args.ctx), batch_size=1)
    for k in ("dataset", "num_images", "num_test_images", "seed", "voc_root", "voc_classes"):
        if getattr(args, k, None) is None and k in state["args"]:
            setattr(args, k, state["args"][k])
    dataset = make_dataset(args, "test")
    dets, gts, recs = predict(mod, cfg, dataset)
    r50 = eval_map(dets, gts, cfg.num_classes, 0.5)
    r75 = eval_map(dets, gts, cfg.num_classes, 0.75)
    result = dict(map50=r50["mAP"], map75=r75["mAP"], images=len(dets),
                  ap50={dataset.classes[c - 1]: v for c, v in r50["ap"].items()},
                  ap75={dataset.classes[c - 1]: v for c, v in r75["ap"].items()},
                  train_time=state.get("train_time"), roi_op=cfg.roi_op, backbone=cfg.backbone)
    if plots:
        result["detections_png"] = draw_detections(
            recs[:draw], dets[:draw], dataset.classes, os.path.join(args.out, "detections.png"))
        result["loss_png"] = plot_losses({cfg.roi_op: state["history"]},
                                         os.path.join(args.out, "loss_curves.png"))
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--voc-test-set", default="test")
    p.add_argument("--epoch", type=int, default=None, help="checkpoint epoch (default: latest)")
    p.add_argument("--draw", type=int, default=8, help="images in detections.png")
    # dataset options default to what the checkpoint was trained with
    for a in ("dataset", "num_images", "num_test_images", "seed"):
        p.set_defaults(**{a: None})
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    r = evaluate(args, args.epoch, draw=args.draw)
    print("%s/%s on %d images: mAP@0.5 = %.4f   mAP@0.75 = %.4f" % (
        r["backbone"], r["roi_op"], r["images"], r["map50"], r["map75"]))
    for name, v in r["ap50"].items():
        print("  AP@0.5 %-12s %.4f   AP@0.75 %.4f" % (name, v, r["ap75"].get(name, 0.0)))
    print("detections: %s\nloss curves: %s" % (r["detections_png"], r["loss_png"]))


if __name__ == "__main__":
    main()
