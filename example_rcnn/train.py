"""Train Faster R-CNN: ``python -m example_rcnn.train [--roi-op pool|align|psalign] ...``.

Checkpoints go to ``--out`` after every epoch (``model-symbol.json``, ``model-NNNN.params``,
``model-NNNN.states`` with the optimizer *and* its counters/schedule, ``train_state.json`` with
the epoch, config and loss history).  ``--resume`` continues from the latest one and produces
exactly the parameters an uninterrupted run would have (batch order, anchor and RoI sampling
are functions of (seed, epoch, image) only).
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import sys
import time

import mxnet as mx
import numpy as np

from .config import BACKBONES, ROI_OPS, Config, default_config
from .data import DetIter, ShapesDataset, VOCDataset
from .symbol import feature_shape, get_train_symbol, initializer

DATA_NAMES = ("data", "im_info", "gt_boxes")
LABEL_NAMES = ("rpn_label", "rpn_bbox_target", "rpn_bbox_weight")
LOSS_NAMES = ("rpn_cls", "rpn_bbox", "rcnn_cls", "rcnn_bbox")
PREFIX = "model"


def add_common_args(p):
    p.add_argument("--backbone", default="tiny", choices=BACKBONES)
    p.add_argument("--roi-op", default="align", choices=ROI_OPS)
    p.add_argument("--dataset", default="shapes", choices=("shapes", "voc"))
    p.add_argument("--voc-root", default=None, help="VOC tree (Annotations, JPEGImages, ...)")
    p.add_argument("--voc-classes", default=None, help="comma separated; default: the 20 VOC")
    p.add_argument("--num-images", type=int, default=384, help="synthetic training images")
    p.add_argument("--num-test-images", type=int, default=96, help="synthetic test images")
    p.add_argument("--image-size", type=int, default=None, help="letterbox size (per backbone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/rcnn", help="checkpoint/output directory")
    p.add_argument("--ctx", default="cpu", help="cpu, gpu:0 or gpu:0,1")
    p.add_argument("--batch-size", type=int, default=4, help="images per iteration per worker")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_args(p)
    p.add_argument("--voc-train-set", default="trainval")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr-steps", default="", help="epochs after which lr *= 0.1, e.g. '4,6'")
    p.add_argument("--kvstore", default="local", help="local | device | dist_sync")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--pretrained", default=None, help=".params with backbone weights (by name)")
    p.add_argument("--max-iters", type=int, default=0, help="stop each epoch after N iters")
    p.add_argument("--threads", type=int, default=0, help="OMP threads (0: leave as is)")
    return p.parse_args(argv)


def parse_ctx(text):
    text = text.strip().lower()
    if text == "cpu":
        return [mx.cpu()]
    m = re.fullmatch(r"gpu:([\d,]+)", text)
    if not m:
        raise ValueError("--ctx must be cpu or gpu:0[,1,...], got %r" % text)
    return [mx.gpu(int(i)) for i in m.group(1).split(",") if i != ""]


def make_config(args, num_classes):
    overrides = {}
    if getattr(args, "image_size", None):
        overrides["image_size"] = args.image_size
    return default_config(args.backbone, args.roi_op, num_classes=num_classes, **overrides)


def make_dataset(args, split):
    """``split`` is 'train' or 'test'."""
    if args.dataset == "shapes":
        if split == "train":
            return ShapesDataset(args.num_images, seed=args.seed)
        return ShapesDataset(args.num_test_images, seed=args.seed + 10007)
    if not args.voc_root:
        raise SystemExit("--dataset voc needs --voc-root")
    classes = args.voc_classes.split(",") if args.voc_classes else None
    image_set = args.voc_train_set if split == "train" else getattr(args, "voc_test_set", "test")
    return VOCDataset(args.voc_root, image_set, classes=classes)


def load_param_file(path):
    """``.params`` -> (arg_params, aux_params); accepts 'arg:'/'aux:' prefixed or plain names."""
    loaded = mx.nd.load(path)
    args, auxs = {}, {}
    for k, v in loaded.items():
        if k.startswith("aux:"):
            auxs[k[4:]] = v
        elif k.startswith("arg:"):
            args[k[4:]] = v
        elif "moving_" in k or "running_" in k:
            auxs[k] = v
        else:
            args[k] = v
    return args, auxs


def filter_params(sym, shapes, arg_params, aux_params):
    """Keep the pretrained arrays whose name and shape match ``sym``; log the rest."""
    arg_shapes, _, aux_shapes = sym.infer_shape(**shapes)
    want_arg = dict(zip(sym.list_arguments(), arg_shapes))
    want_aux = dict(zip(sym.list_auxiliary_states(), aux_shapes))
    out = []
    for given, want in ((arg_params, want_arg), (aux_params, want_aux)):
        keep = {k: v for k, v in given.items() if k in want and tuple(v.shape) == tuple(want[k])}
        skipped = sorted(set(given) - set(keep))
        if skipped:
            logging.info("pretrained: skipped %d arrays (unknown name or shape): %s",
                         len(skipped), ", ".join(skipped[:8]))
        out.append(keep)
    logging.info("pretrained: loaded %d arg + %d aux arrays", len(out[0]), len(out[1]))
    return out


def latest_epoch(out_dir):
    eps = [int(m.group(1)) for f in glob.glob(os.path.join(out_dir, PREFIX + "-*.params"))
           for m in [re.search(r"-(\d{4})\.params$", f)] if m]
    return max(eps) if eps else 0


def _updater(mod):
    if mod._updater is not None:
        return mod._updater
    kv = mod._kvstore
    return getattr(kv, "_updater", None) if kv is not None else None


def save_checkpoint(mod, out_dir, epoch, state, save_states=True):
    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, PREFIX)
    arg, aux = mod.get_params()
    mod._symbol.save(prefix + "-symbol.json")
    mx.nd.save("%s-%04d.params" % (prefix, epoch),
               {**{"arg:" + k: v for k, v in arg.items()},
                **{"aux:" + k: v for k, v in aux.items()}})
    upd = _updater(mod)
    if save_states and upd is not None:
        with open("%s-%04d.states" % (prefix, epoch), "wb") as f:
            f.write(upd.get_states(dump_optimizer=True))
    with open(os.path.join(out_dir, "train_state.json"), "w") as f:
        json.dump(state, f)


def loss_terms(outputs, batch, cfg, images):
    rpn_prob, rpn_bbox, cls_prob, bbox_loss, label = [o.asnumpy() for o in outputs]
    rpn_label = batch.label[0].asnumpy().astype(np.int64)
    valid = rpn_label >= 0
    b, h, w = np.nonzero(valid)
    p = rpn_prob[b, rpn_label[valid], h, w]
    rpn_cls = float(-np.log(np.maximum(p, 1e-12)).mean()) if len(p) else 0.0
    label = label.astype(np.int64)
    rcnn_cls = float(-np.log(np.maximum(cls_prob[np.arange(len(label)), label], 1e-12)).mean())
    return dict(rpn_cls=rpn_cls, rpn_bbox=float(rpn_bbox.sum()) / (images * cfg.rpn_batch_size),
                rcnn_cls=rcnn_cls, rcnn_bbox=float(bbox_loss.sum()) / len(label))


def train(args):
    """Train with parsed ``args``; returns a summary dict (config, history, time, out dir)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    ctx = parse_ctx(args.ctx)
    dist = "dist" in args.kvstore
    kv = mx.kv.create(args.kvstore) if (dist or len(ctx) > 1) else None
    rank, nworkers = (kv.rank, kv.num_workers) if dist else (0, 1)

    dataset = make_dataset(args, "train")
    cfg = make_config(args, num_classes=len(dataset.classes) + 1)
    if args.batch_size % len(ctx):
        raise SystemExit("--batch-size must be a multiple of the number of devices")
    per_dev = args.batch_size // len(ctx)
    feat = feature_shape(cfg)
    it = DetIter(dataset, cfg, args.batch_size, feat, train=True, seed=args.seed,
                 part_index=rank, num_parts=nworkers)
    if len(it) == 0:
        raise SystemExit("dataset shard has fewer images than --batch-size")
    sym = get_train_symbol(cfg, per_dev, seed=args.seed)
    mod = mx.mod.Module(sym, data_names=DATA_NAMES, label_names=LABEL_NAMES, context=ctx)
    mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label, for_training=True)

    begin_epoch, history = 0, []
    arg_params = aux_params = None
    if args.resume and latest_epoch(args.out):
        begin_epoch = latest_epoch(args.out)
        arg_params, aux_params = load_param_file(
            os.path.join(args.out, "%s-%04d.params" % (PREFIX, begin_epoch)))
        with open(os.path.join(args.out, "train_state.json")) as f:
            history = json.load(f).get("history", [])
        logging.info("resuming after epoch %d from %s", begin_epoch, args.out)
    elif args.pretrained:
        shapes = {d.name: d.shape for d in it.provide_data + it.provide_label}
        arg_params, aux_params = filter_params(sym, shapes, *load_param_file(args.pretrained))
    mod.init_params(initializer(), arg_params=arg_params, aux_params=aux_params,
                    allow_missing=not args.resume or begin_epoch == 0, force_init=True)

    # every worker must run the same number of synchronous steps
    iters_per_epoch = (len(dataset) // nworkers) // args.batch_size
    if args.max_iters:
        iters_per_epoch = min(iters_per_epoch, args.max_iters)
    steps = [int(s) * iters_per_epoch for s in args.lr_steps.split(",") if s.strip()]
    opt_params = dict(learning_rate=args.lr, wd=args.wd,
                      rescale_grad=1.0 / (len(ctx) * nworkers), clip_gradient=5.0)
    if steps:
        opt_params["lr_scheduler"] = mx.lr_scheduler.MultiFactorScheduler(steps, 0.1)
    if args.optimizer == "sgd":
        opt_params["momentum"] = args.momentum
    mod.init_optimizer(kvstore=kv if kv is not None else "local", optimizer=args.optimizer,
                       optimizer_params=opt_params)
    states_file = os.path.join(args.out, "%s-%04d.states" % (PREFIX, begin_epoch))
    if begin_epoch and os.path.exists(states_file) and not dist:
        upd = _updater(mod)
        with open(states_file, "rb") as f:
            upd.set_states(f.read())
        mod._optimizer = upd.optimizer
        if mod._kvstore is not None and mod._update_on_kvstore:
            mod._kvstore._updater.optimizer = upd.optimizer
        upd.optimizer.param_dict = {}

    progress = not args.no_progress and rank == 0
    if progress:
        from tqdm import tqdm
    t_start = time.time()
    train_time = cpu_time = 0.0
    for epoch in range(begin_epoch, args.epochs):
        it.set_epoch(epoch)
        bar = tqdm(total=iters_per_epoch, desc="epoch %d/%d" % (epoch + 1, args.epochs),
                   dynamic_ncols=True, file=sys.stdout) if progress else None
        t_epoch = time.time()
        c_epoch = time.process_time()
        sums = dict.fromkeys(LOSS_NAMES, 0.0)
        for i, batch in enumerate(it):
            if i >= iters_per_epoch:
                break
            mod.forward_backward(batch)
            mod.update()
            terms = loss_terms(mod.get_outputs(), batch, cfg, args.batch_size)
            for k in LOSS_NAMES:
                sums[k] += terms[k]
            history.append(dict(epoch=epoch, iter=i, **terms))
            if bar is not None:
                speed = (i + 1) * args.batch_size * nworkers / (time.time() - t_epoch)
                bar.set_postfix_str(" ".join("%s=%.3f" % (k, sums[k] / (i + 1))
                                             for k in LOSS_NAMES) + " %.1f img/s" % speed)
                bar.update(1)
        if bar is not None:
            bar.close()
        mx.nd.waitall()
        train_time += time.time() - t_epoch
        cpu_time += time.process_time() - c_epoch
        state = dict(epoch=epoch + 1, config=json.loads(cfg.to_json()), history=history,
                     args=vars(args), train_time=train_time, cpu_time=cpu_time, rank=rank, num_workers=nworkers)
        if rank == 0:
            save_checkpoint(mod, args.out, epoch + 1, state, save_states=not dist)
        logging.info("epoch %d: %s (%.1fs)", epoch + 1,
                     " ".join("%s=%.4f" % (k, v / max(1, iters_per_epoch))
                              for k, v in sums.items()), time.time() - t_epoch)
    if dist:   # every worker writes what it ended with, to check they agree
        arg, aux = mod.get_params()
        os.makedirs(args.out, exist_ok=True)
        mx.nd.save(os.path.join(args.out, "worker%d-final.params" % rank), arg)
        kv._barrier()
    return dict(config=cfg, history=history, train_time=train_time, cpu_time=cpu_time,
                out=args.out,
                wall_time=time.time() - t_start, epochs=args.epochs)


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
