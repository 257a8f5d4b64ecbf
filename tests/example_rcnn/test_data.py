"""Synthetic dataset, anchors and the Pascal VOC loader (on a tiny tree written here)."""
import os

import numpy as np
import pytest
from PIL import Image

from example_rcnn.boxes import bbox_decode, bbox_transform, generate_anchors
from example_rcnn.config import default_config
from example_rcnn.data import DetIter, ShapesDataset, VOCDataset
from example_rcnn.symbol import feature_shape


def test_shapes_deterministic_and_boxes_exact():
    a, b = ShapesDataset(8, seed=3), ShapesDataset(8, seed=3)
    for i in range(8):
        ra, rb = a.get(i), b.get(i)
        assert np.array_equal(ra["image"], rb["image"])
        assert np.array_equal(ra["boxes"], rb["boxes"])
        assert len(ra["boxes"]) >= 1 and set(ra["labels"]) <= {1, 2, 3}
        s = a.image_size
        assert (ra["boxes"] >= 0).all() and (ra["boxes"] <= s - 1).all()
    assert not np.array_equal(ShapesDataset(2, seed=4).get(0)["image"], a.get(0)["image"])


def test_anchors_match_classic_faster_rcnn():
    # py-faster-rcnn's famous first anchor for base 16, ratios (.5,1,2), scales (8,16,32)
    anchors = generate_anchors(16, (0.5, 1, 2), (8, 16, 32))
    assert anchors.shape == (9, 4)
    np.testing.assert_allclose(anchors[0], [-84, -40, 99, 55])
    np.testing.assert_allclose(anchors[4], [-120, -120, 135, 135])


def test_bbox_transform_roundtrip():
    rng = np.random.RandomState(0)
    xy = rng.uniform(0, 50, (20, 2))
    ex = np.hstack([xy, xy + rng.uniform(10, 40, (20, 2))])
    gt = ex + rng.uniform(-4, 4, ex.shape)
    np.testing.assert_allclose(bbox_decode(ex, bbox_transform(ex, gt)), gt, atol=1e-3)


def test_iterator_train_batch():
    cfg = default_config("tiny", "align")
    it = DetIter(ShapesDataset(8), cfg, 2, feature_shape(cfg), train=True, seed=0)
    batch = next(iter(it))
    assert [d.shape for d in batch.data] == [d.shape for d in it.provide_data]
    assert [d.shape for d in batch.label] == [d.shape for d in it.provide_label]
    lab = batch.label[0].asnumpy()
    assert (lab == 1).sum() > 0 and (lab == 0).sum() > 0
    it2 = DetIter(ShapesDataset(8), cfg, 2, feature_shape(cfg), train=True, seed=0)
    it.set_epoch(1)
    it2.set_epoch(1)
    assert np.array_equal(next(iter(it)).label[0].asnumpy(), next(iter(it2)).label[0].asnumpy())


def write_voc(root, n=4, size=(96, 80)):
    """Tiny VOC tree: 'cat'/'dog' boxes (1-based coords), one difficult object."""
    for d in ("Annotations", "JPEGImages", os.path.join("ImageSets", "Main")):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    ids = []
    for i in range(n):
        iid = "%06d" % (i + 1)
        ids.append(iid)
        w, h = size
        img = np.full((h, w, 3), 90, np.uint8)
        objs = [("cat", (11, 21, 40, 60), 0), ("dog", (51, 11, 90, 40), 1 if i == 0 else 0)]
        for _, (x1, y1, x2, y2), _ in objs:
            img[y1 - 1:y2, x1 - 1:x2] = (200, 60, 60)
        Image.fromarray(img).save(os.path.join(root, "JPEGImages", iid + ".jpg"))
        xml = ["<annotation><filename>%s.jpg</filename>" % iid,
               "<size><width>%d</width><height>%d</height><depth>3</depth></size>" % (w, h)]
        for name, (x1, y1, x2, y2), diff in objs:
            xml.append("<object><name>%s</name><difficult>%d</difficult><bndbox><xmin>%d</xmin>"
                       "<ymin>%d</ymin><xmax>%d</xmax><ymax>%d</ymax></bndbox></object>"
                       % (name, diff, x1, y1, x2, y2))
        xml.append("</annotation>")
        with open(os.path.join(root, "Annotations", iid + ".xml"), "w") as f:
            f.write("\n".join(xml))
    for split in ("trainval", "test"):
        with open(os.path.join(root, "ImageSets", "Main", split + ".txt"), "w") as f:
            f.write("\n".join(ids) + "\n")
    return ids


def test_voc_loader(tmp_path):
    root = str(tmp_path / "VOC")
    write_voc(root)
    ds = VOCDataset(root, "trainval", classes=["dog", "cat"])
    assert len(ds) == 4 and ds.classes == ("dog", "cat")
    rec = ds.get(0)
    assert rec["image"].shape == (80, 96, 3) and rec["id"] == "000001"
    np.testing.assert_array_equal(rec["boxes"], [[10, 20, 39, 59], [50, 10, 89, 39]])
    np.testing.assert_array_equal(rec["labels"], [2, 1])
    np.testing.assert_array_equal(rec["difficult"], [False, True])
    assert not ds.get(1)["difficult"].any()
    # default: the 20 VOC classes
    full = VOCDataset(root, "test")
    assert full.get(0)["labels"].tolist() == [8, 12]


def test_voc_training_step(tmp_path):
    from example_rcnn import train as tr
    root = str(tmp_path / "VOC")
    write_voc(root)
    out = str(tmp_path / "run")
    s = tr.train(tr.parse_args(["--dataset", "voc", "--voc-root", root, "--voc-classes",
                                "dog,cat", "--epochs", "1", "--batch-size", "2", "--out", out,
                                "--no-progress", "--image-size", "96"]))
    assert s["config"].num_classes == 3 and len(s["history"]) == 2
    assert all(np.isfinite(v) for h in s["history"] for k, v in h.items() if k != "epoch")
    assert os.path.exists(os.path.join(out, "model-0001.params"))
    from example_rcnn import evaluate as ev
    res = ev.evaluate(tr.parse_args(["--dataset", "voc", "--voc-root", root, "--voc-classes",
                                     "dog,cat", "--out", out]), draw=2)
    assert res["images"] == 4 and 0.0 <= res["map75"] <= res["map50"] <= 1.0
    assert set(res["ap50"]) == {"dog", "cat"}
    assert os.path.exists(res["detections_png"]) and os.path.exists(res["loss_png"])
