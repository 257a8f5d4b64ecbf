"""Datasets and the training/evaluation iterator.

* :class:`ShapesDataset` -- the embedded default: synthetic rectangles, ellipses and triangles of
  several sizes and colours on textured backgrounds, with exact boxes, generated on the fly and
  fully determined by ``seed`` (image ``i`` only depends on ``(seed, i)``).
* :class:`VOCDataset` -- a Pascal VOC style tree (``Annotations/*.xml``, ``JPEGImages/*.jpg``,
  ``ImageSets/Main/<set>.txt``).
* :class:`DetIter` -- an ``mx.io.DataIter`` that letterboxes images to a fixed square size and,
  for training, computes the RPN anchor targets in NumPy (as MXNet's example/rcnn does).
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
import zlib

import mxnet as mx
import numpy as np
from PIL import Image, ImageDraw

from .boxes import anchor_targets, generate_anchors

SHAPE_CLASSES = ("rectangle", "ellipse", "triangle")
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")


class ShapesDataset:
    """Synthetic shapes; ``get(i)`` returns ``dict(image=HxWx3 uint8, boxes, labels, difficult)``.

    ``labels`` are 1-based class ids into :attr:`classes` (0 is background).
    """

    def __init__(self, num_images=256, seed=0, image_size=128, max_objects=4,
                 min_size=16, max_size=56):
        self.num_images = int(num_images)
        self.seed = int(seed)
        self.image_size = int(image_size)
        self.max_objects = int(max_objects)
        self.min_size = int(min_size)
        self.max_size = int(max_size)
        self.classes = SHAPE_CLASSES

    def __len__(self):
        return self.num_images

    def _background(self, rng):
        s = self.image_size
        # low-frequency blotches + oriented stripes + pixel noise
        coarse = rng.uniform(0, 1, size=(5, 5, 3))
        img = np.asarray(Image.fromarray((coarse * 255).astype(np.uint8)).resize(
            (s, s), Image.BILINEAR), dtype=np.float32) * rng.uniform(0.2, 0.5)
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float32)
        theta = rng.uniform(0, np.pi)
        period = rng.uniform(4, 16)
        stripes = np.sin((xx * np.cos(theta) + yy * np.sin(theta)) * 2 * np.pi / period)
        img += (stripes * rng.uniform(5, 25))[:, :, None]
        img += rng.uniform(40, 110, size=3)[None, None, :]
        img += rng.normal(0, 8, size=img.shape)
        return img

    def get(self, index):
        if not 0 <= index < self.num_images:
            raise IndexError(index)
        rng = np.random.RandomState((self.seed * 1000003 + index * 7919) % (2 ** 31 - 1))
        s = self.image_size
        img = self._background(rng)
        canvas = Image.new("RGB", (s, s))
        mask_img = Image.new("L", (s, s), 0)
        draw = ImageDraw.Draw(canvas)
        mdraw = ImageDraw.Draw(mask_img)
        boxes, labels = [], []
        for _ in range(rng.randint(1, self.max_objects + 1)):
            for _attempt in range(20):
                area = rng.uniform(self.min_size, self.max_size) ** 2
                aspect = np.exp(rng.uniform(np.log(0.5), np.log(2.0)))
                w = int(np.clip(round(np.sqrt(area * aspect)), self.min_size * 0.7, s - 2))
                h = int(np.clip(round(np.sqrt(area / aspect)), self.min_size * 0.7, s - 2))
                x1 = rng.randint(0, s - w)
                y1 = rng.randint(0, s - h)
                box = np.array([x1, y1, x1 + w - 1, y1 + h - 1], dtype=np.float32)
                if boxes:
                    from .boxes import bbox_overlaps
                    if bbox_overlaps(box[None], np.array(boxes)).max() > 0.05:
                        continue
                cls = rng.randint(1, len(self.classes) + 1)
                color = tuple(int(c) for c in rng.randint(150, 256, size=3) *
                              (rng.uniform(size=3) < 0.7))
                if max(color) < 150:
                    color = (255, int(color[1]), int(color[2]))
                xy = [int(box[0]), int(box[1]), int(box[2]), int(box[3])]
                name = self.classes[cls - 1]
                if name == "rectangle":
                    draw.rectangle(xy, fill=color)
                    mdraw.rectangle(xy, fill=255)
                elif name == "ellipse":
                    draw.ellipse(xy, fill=color)
                    mdraw.ellipse(xy, fill=255)
                else:
                    apex = rng.randint(xy[0], xy[2] + 1)
                    if rng.uniform() < 0.5:   # pointing up or down
                        pts = [(xy[0], xy[3]), (xy[2], xy[3]), (apex, xy[1])]
                    else:
                        pts = [(xy[0], xy[1]), (xy[2], xy[1]), (apex, xy[3])]
                    draw.polygon(pts, fill=color)
                    mdraw.polygon(pts, fill=255)
                boxes.append(box)
                labels.append(cls)
                break
        mask = np.asarray(mask_img, dtype=np.float32)[:, :, None] / 255.0
        shapes = np.asarray(canvas, dtype=np.float32)
        shade = rng.uniform(0.85, 1.0)
        img = img * (1 - mask) + shapes * shade * mask + rng.normal(0, 4, size=img.shape) * mask
        image = np.clip(img, 0, 255).astype(np.uint8)
        return dict(image=image, boxes=np.array(boxes, dtype=np.float32).reshape(-1, 4),
                    labels=np.array(labels, dtype=np.int32),
                    difficult=np.zeros(len(labels), dtype=bool), id="shapes_%d_%d" % (self.seed, index))


class VOCDataset:
    """Pascal VOC layout under ``root``: ``Annotations``, ``JPEGImages``, ``ImageSets/Main``.

    Boxes are converted from VOC's 1-based to 0-based inclusive pixel coordinates.
    ``classes=None`` uses the 20 VOC classes.
    """

    def __init__(self, root, image_set="trainval", classes=None, use_difficult=False):
        self.root = root
        self.image_set = image_set
        self.classes = tuple(classes) if classes else VOC_CLASSES
        self.use_difficult = use_difficult
        list_file = os.path.join(root, "ImageSets", "Main", image_set + ".txt")
        with open(list_file, encoding="utf-8") as f:
            self.ids = [line.strip().split()[0] for line in f if line.strip()]
        self._cache = {}

    def __len__(self):
        return len(self.ids)

    def annotation(self, index):
        if index in self._cache:
            return self._cache[index]
        image_id = self.ids[index]
        tree = ET.parse(os.path.join(self.root, "Annotations", image_id + ".xml"))
        boxes, labels, difficult = [], [], []
        for obj in tree.findall("object"):
            name = obj.find("name").text.strip()
            if name not in self.classes:
                continue
            diff_node = obj.find("difficult")
            diff = diff_node is not None and int(diff_node.text) == 1
            if diff and not self.use_difficult:
                # kept (flagged) so evaluation can ignore it, like the VOC devkit
                pass
            bb = obj.find("bndbox")
            box = [float(bb.find(k).text) - 1 for k in ("xmin", "ymin", "xmax", "ymax")]
            boxes.append(box)
            labels.append(self.classes.index(name) + 1)
            difficult.append(diff)
        ann = dict(boxes=np.array(boxes, dtype=np.float32).reshape(-1, 4),
                   labels=np.array(labels, dtype=np.int32),
                   difficult=np.array(difficult, dtype=bool), id=image_id)
        self._cache[index] = ann
        return ann

    def get(self, index):
        ann = dict(self.annotation(index))
        path = os.path.join(self.root, "JPEGImages", ann["id"] + ".jpg")
        ann["image"] = np.asarray(Image.open(path).convert("RGB"), dtype=np.uint8)
        return ann


def letterbox(image, size):
    """Resize so the longer side is ``size`` and pad bottom/right; returns (img, scale)."""
    h, w = image.shape[:2]
    scale = size / float(max(h, w))
    nh, nw = max(1, int(round(h * scale))), max(1, int(round(w * scale)))
    if (nh, nw) != (h, w):
        image = np.asarray(Image.fromarray(image).resize((nw, nh), Image.BILINEAR))
    out = np.zeros((size, size, 3), dtype=np.uint8)
    out[:nh, :nw] = image
    return out, scale, nh, nw


class DetIter(mx.io.DataIter):
    """Fixed-size batches of ``data``, ``im_info``, ``gt_boxes`` (+ RPN labels when training).

    The visiting order of epoch ``e`` is ``RandomState(seed + e)``'s permutation, so an
    iterator rebuilt at epoch ``e`` (``--resume``) yields exactly the same batches.
    ``part_index``/``num_parts`` select a disjoint shard (one per distributed worker).
    """

    def __init__(self, dataset, cfg, batch_size, feat_shape, train=True, shuffle=None, seed=0,
                 part_index=0, num_parts=1):
        super().__init__(batch_size)
        self.dataset = dataset
        self.cfg = cfg
        self.train = train
        self.shuffle = train if shuffle is None else shuffle
        self.seed = int(seed)
        self.feat_h, self.feat_w = feat_shape
        self.indices = np.arange(len(dataset))[part_index::num_parts]
        self.base_anchors = generate_anchors(cfg.feat_stride, cfg.anchor_ratios, cfg.anchor_scales)
        self.num_anchors = len(self.base_anchors)
        self.epoch = 0
        self.cursor = 0
        self.order = self.indices
        s, A = cfg.image_size, self.num_anchors
        self.provide_data = [mx.io.DataDesc("data", (batch_size, 3, s, s)),
                             mx.io.DataDesc("im_info", (batch_size, 3)),
                             mx.io.DataDesc("gt_boxes", (batch_size, cfg.max_gt, 5))]
        if not train:   # the test symbol takes no gt; records stay in ``last_records``
            self.provide_data = self.provide_data[:2]
        if train:
            self.provide_label = [
                mx.io.DataDesc("rpn_label", (batch_size, A * self.feat_h, self.feat_w)),
                mx.io.DataDesc("rpn_bbox_target", (batch_size, 4 * A, self.feat_h, self.feat_w)),
                mx.io.DataDesc("rpn_bbox_weight", (batch_size, 4 * A, self.feat_h, self.feat_w))]
        else:
            self.provide_label = []
        self.reset()

    def __len__(self):
        if self.train:
            return len(self.indices) // self.batch_size
        return (len(self.indices) + self.batch_size - 1) // self.batch_size

    def set_epoch(self, epoch):
        self.epoch = int(epoch)
        self.reset()

    def reset(self):
        self.cursor = 0
        if self.shuffle:
            perm = np.random.RandomState(self.seed + self.epoch).permutation(len(self.indices))
            self.order = self.indices[perm]
        else:
            self.order = self.indices

    def load_record(self, idx):
        """Letterboxed record: image (S,S,3) uint8, scaled boxes, labels, im_info, ..."""
        rec = self.dataset.get(int(idx))
        image, scale, nh, nw = letterbox(rec["image"], self.cfg.image_size)
        rec = dict(rec)
        rec["orig_image"] = rec["image"]
        rec["image"] = image
        rec["scale"] = scale
        rec["boxes_scaled"] = rec["boxes"] * scale
        rec["im_info"] = np.array([nh, nw, scale], dtype=np.float32)
        return rec

    def normalize(self, image):
        x = (image.astype(np.float32) - np.array(self.cfg.pixel_mean, np.float32)) / \
            np.array(self.cfg.pixel_std, np.float32)
        return x.transpose(2, 0, 1)

    def next(self):
        if self.cursor >= len(self) * self.batch_size:
            raise StopIteration
        ids = self.order[self.cursor:self.cursor + self.batch_size]
        pad = self.batch_size - len(ids)
        if pad:
            ids = np.concatenate([ids, np.repeat(ids[-1:], pad)])
        self.cursor += self.batch_size
        cfg, B = self.cfg, self.batch_size
        data = np.zeros((B, 3, cfg.image_size, cfg.image_size), np.float32)
        im_info = np.zeros((B, 3), np.float32)
        gt = np.full((B, cfg.max_gt, 5), -1, np.float32)
        labels = []
        self.last_records = []
        for b, idx in enumerate(ids):
            rec = self.load_record(idx)
            self.last_records.append(rec)
            data[b] = self.normalize(rec["image"])
            im_info[b] = rec["im_info"]
            keep = ~rec["difficult"] if self.train else np.ones(len(rec["labels"]), bool)
            boxes = rec["boxes_scaled"][keep][:cfg.max_gt]
            n = len(boxes)
            gt[b, :n, :4] = boxes
            gt[b, :n, 4] = rec["labels"][keep][:cfg.max_gt]
            if self.train:
                rng = np.random.RandomState(
                    zlib.crc32(np.array([self.seed, self.epoch, int(idx)], np.int64).tobytes()))
                labels.append(anchor_targets(
                    gt[b, :n], im_info[b, 0], im_info[b, 1], self.feat_h, self.feat_w,
                    cfg.feat_stride, self.base_anchors, rng, batch_size=cfg.rpn_batch_size))
        label = []
        if self.train:
            label = [mx.nd.array(np.stack([l[i] for l in labels])) for i in range(3)]
        arrays = [mx.nd.array(data), mx.nd.array(im_info), mx.nd.array(gt)]
        return mx.io.DataBatch(data=arrays[:len(self.provide_data)],
                               label=label, pad=pad, index=ids,
                               provide_data=self.provide_data, provide_label=self.provide_label)
