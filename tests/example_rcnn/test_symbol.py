"""Symbols for every RoI op and backbone; shapes; one training step; pretrained loading."""
import json

import mxnet as mx
import numpy as np
import pytest

from example_rcnn import roi_ops
from tests.conftest import roi_nodes
from example_rcnn import train as tr
from example_rcnn.config import BACKBONES, ROI_OPS, default_config
from example_rcnn.data import DetIter, ShapesDataset
from example_rcnn.symbol import feature_shape, get_test_symbol, get_train_symbol


RoI_TYPES = ("ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign")


def shapes_for(cfg, batch):
    h, w = feature_shape(cfg)
    a = len(cfg.anchor_scales) * len(cfg.anchor_ratios)
    s = cfg.image_size
    return dict(data=(batch, 3, s, s), im_info=(batch, 3), gt_boxes=(batch, cfg.max_gt, 5),
                rpn_label=(batch, a * h, w), rpn_bbox_target=(batch, 4 * a, h, w),
                rpn_bbox_weight=(batch, 4 * a, h, w))


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("roi_op", ROI_OPS)
def test_symbols_infer_shapes(backbone, roi_op, door):
    cfg = default_config(backbone, roi_op, num_classes=5,
                         image_size=128 if backbone == "tiny" else 224)
    shapes = shapes_for(cfg, 2)
    _, out, _ = get_train_symbol(cfg, 2).infer_shape(**shapes)
    r = 2 * cfg.batch_rois
    assert out[2:] == [(r, 5), (r, 20), (r,)]
    _, out, _ = get_test_symbol(cfg).infer_shape(data=shapes["data"], im_info=(2, 3))
    n = 2 * cfg.rpn_post_nms_test
    assert out == [(n, 5), (n, 5), (n, 20)]
    # the RoI operator appears exactly once (an mx_roi op through either door -- a Custom
    # node or a native one, tests/conftest.roi_nodes --, or a built-in fallback)
    nodes = json.loads(get_train_symbol(cfg, 2).tojson())["nodes"]
    builtin = [n for n in nodes if n["op"] in ("ROIPooling", "_contrib_ROIAlign")]
    ours = {t: roi_nodes(nodes, t) for t in RoI_TYPES}
    assert len(builtin) + sum(map(len, ours.values())) == 1, (builtin, ours)
    if roi_ops.BACKEND == "mx_roi":
        expected = {"pool": "ROIPooling", "align": "ROIAlign", "psalign": "PSROIAlign"}[roi_op]
        assert len(ours[expected]) == 1
        native = [n["op"] for n in nodes if n["op"].startswith("mx_roi_")]
        assert native == ([] if door == "custom" else [f"mx_roi_{expected}"]), native


@pytest.mark.parametrize("roi_op", ROI_OPS)
def test_one_training_step_finite(roi_op):
    cfg = default_config("tiny", roi_op)
    it = DetIter(ShapesDataset(4), cfg, 2, feature_shape(cfg), train=True)
    mod = mx.mod.Module(get_train_symbol(cfg, 2), data_names=tr.DATA_NAMES,
                        label_names=tr.LABEL_NAMES, context=mx.cpu())
    mod.bind(it.provide_data, it.provide_label)
    mx.random.seed(0)
    from example_rcnn.symbol import initializer
    mod.init_params(initializer())
    mod.init_optimizer(optimizer="adam", optimizer_params=dict(learning_rate=1e-3))
    before = mod.get_params()[0]["tconv1_weight"].asnumpy().copy()
    batch = next(iter(it))
    mod.forward_backward(batch)
    mod.update()
    terms = tr.loss_terms(mod.get_outputs(), batch, cfg, 2)
    assert all(np.isfinite(v) for v in terms.values()), terms
    assert terms["rpn_cls"] > 0 and terms["rcnn_cls"] > 0
    after = mod.get_params()[0]["tconv1_weight"].asnumpy()
    assert not np.array_equal(before, after)


def test_pretrained_params_load_by_name(tmp_path):
    cfg = default_config("tiny", "align")
    sym = get_train_symbol(cfg, 2)
    shapes = shapes_for(cfg, 2)
    arg_shapes, _, _ = sym.infer_shape(**shapes)
    given = {"arg:" + n: mx.nd.ones(s) * 0.5 for n, s in zip(sym.list_arguments(), arg_shapes)
             if n.startswith("tconv")}
    given["arg:unknown_weight"] = mx.nd.ones((3,))
    given["arg:tconv1_bias"] = mx.nd.ones((7,))     # wrong shape: skipped
    path = str(tmp_path / "backbone.params")
    mx.nd.save(path, given)
    arg, aux = tr.filter_params(sym, shapes, *tr.load_param_file(path))
    assert "unknown_weight" not in arg and "tconv1_bias" not in arg
    assert "tconv1_weight" in arg and "tconv5_weight" in arg
    out = str(tmp_path / "run")
    s = tr.train(tr.parse_args(["--pretrained", path, "--num-images", "2", "--batch-size", "2",
                                "--epochs", "1", "--lr", "0", "--wd", "0", "--out", out,
                                "--no-progress"]))
    loaded = mx.nd.load(out + "/model-0001.params")
    np.testing.assert_allclose(loaded["arg:tconv3_weight"].asnumpy(), 0.5)
