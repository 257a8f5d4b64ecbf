"""Export the detector's test graph to ONNX and check it in ONNX Runtime.

MXNet 1.9.1's exporter has no translation for ``_contrib_MultiProposal`` (the RPN's
anchor decoding + NMS), so the whole test graph cannot be exported.  What is exported is
the rest of it, with the proposals as a second input::

    (data (B, 3, S, S), rois (R, 5)) -> backbone -> RoI op -> head -> (cls_prob, bbox_pred)

The proposals come from MXNet (or any RPN implementation that serves them);
``--check N`` runs the MXNet test graph on N synthetic test images, feeds its rois to the
ONNX model in ONNX Runtime and compares the raw outputs and the final detections.

    python -m example_rcnn.export_onnx --out out/rcnn --check 8
"""
from __future__ import annotations

import argparse
import json
import os

import mxnet as mx
import numpy as np

from .data import DetIter, ShapesDataset
from .evaluate import load_model, postprocess
from .symbol import _rcnn_head, backbone_symbol, feature_shape


def head_symbol(cfg):
    """The test graph from ``(data, rois)`` on: backbone, RoI op, head, softmax."""
    data, rois = mx.sym.Variable("data"), mx.sym.Variable("rois")
    feat = backbone_symbol(cfg, data)
    cls_score, bbox_pred = _rcnn_head(cfg, feat, rois, train=False)
    return mx.sym.Group([mx.sym.softmax(cls_score, axis=-1, name="cls_prob"), bbox_pred])


def _explicit_fc_flatten(sym):
    """MXNet 1.9.1's FullyConnected translation reads a *missing* ``flatten`` as False
    (MXNet's default is True): write the default into the graph before exporting."""
    graph = json.loads(sym.tojson())
    for node in graph["nodes"]:
        if node["op"] == "FullyConnected":
            node.setdefault("attrs", {}).setdefault("flatten", "True")
    return mx.sym.load_json(json.dumps(graph))


def _mean_axes_as_input():
    """MXNet 1.9.1 translates ``mean`` (R-FCN's vote) to ``ReduceMean`` with an ``axes``
    attribute, which opset 18 (onnx 1.14 exports at 19) moved to an input.  Registers,
    for opset >= 18 only, MXNet's own translation with ``axes`` moved."""
    from onnx import helper, numpy_helper
    from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
    from mxnet.onnx.mx2onnx._op_translations import _op_translations_opset13 as t13

    def convert_mean(node, **kwargs):
        out = []
        for n in t13.convert_mean(node, **kwargs):
            axes = [a for a in n.attribute if a.name == "axes"]
            if n.op_type == "ReduceMean" and axes:
                name = n.output[0] + "_axes"
                kwargs["initializer"].append(numpy_helper.from_array(
                    np.asarray(list(axes[0].ints), np.int64), name))
                attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute
                         if a.name != "axes"}
                n = helper.make_node("ReduceMean", [n.input[0], name], list(n.output),
                                     name=n.name, **attrs)
            out.append(n)
        return out

    MXNetGraph.registry_.setdefault(18, {})["mean"] = convert_mean


def export(cfg, arg_params, aux_params, path, batch_size=1):
    """Write the ONNX file of :func:`head_symbol` (dynamic number of rois); returns path."""
    _mean_axes_as_input()
    sym = _explicit_fc_flatten(head_symbol(cfg))
    params = {k: v for k, v in {**arg_params, **aux_params}.items()
              if k in set(sym.list_arguments()) | set(sym.list_auxiliary_states())}
    s = cfg.image_size
    data_shape = (batch_size, 3, s, s)
    mx.onnx.export_model(sym, params, [data_shape, (cfg.rpn_post_nms_test, 5)],
                         [np.float32, np.float32], path, dynamic=True,
                         dynamic_input_shapes=[data_shape, (None, 5)])
    return path


def compare(mod, cfg, path, n_images, seed=0):
    """MXNet test graph vs ONNX Runtime on ``n_images`` synthetic test images.

    Returns dict(max_abs_diff of cls_prob/bbox_pred, same_detections, images, detections).
    """
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3   # MXNet's exporter lists the weights as inputs too: warnings
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    it = DetIter(ShapesDataset(n_images, seed=seed + 10007), cfg, 1, feature_shape(cfg),
                 train=False)
    worst, same, ndet = 0.0, True, 0
    for i, batch in enumerate(it):
        if i >= n_images:
            break
        mod.forward(batch, is_train=False)
        rois, cls_prob, bbox_pred = [o.asnumpy() for o in mod.get_outputs()]
        o_cls, o_bbox = sess.run(None, {"data": batch.data[0].asnumpy(), "rois": rois})
        worst = max(worst, float(np.abs(o_cls - cls_prob).max()),
                    float(np.abs(o_bbox - bbox_pred).max()))
        info = it.last_records[0]["im_info"]
        a = postprocess(rois, cls_prob, bbox_pred, info, cfg)
        b = postprocess(rois, o_cls, o_bbox, info, cfg)
        ndet += len(a["labels"])
        same &= (np.array_equal(a["labels"], b["labels"])
                 and np.allclose(a["boxes"], b["boxes"], atol=1e-3)
                 and np.allclose(a["scores"], b["scores"], atol=1e-5))
    return dict(max_abs_diff=worst, same_detections=bool(same), images=n_images,
                detections=ndet)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="training output folder (train_state.json)")
    p.add_argument("--epoch", type=int, default=None)
    p.add_argument("--onnx", default=None, help="ONNX file (default: OUT/model-head.onnx)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="compare MXNet and ONNX Runtime on N synthetic test images")
    p.add_argument("--seed", type=int, default=0, help="the test split is seed + 10007")
    args = p.parse_args(argv)
    mod, cfg, _ = load_model(args.out, args.epoch)
    arg, aux = mod.get_params()
    path = args.onnx or os.path.join(args.out, "model-head.onnx")
    export(cfg, arg, aux, path)
    print("wrote", path, "(inputs: data, rois; outputs: cls_prob, bbox_pred)")
    if args.check:
        print(json.dumps(compare(mod, cfg, path, args.check, seed=args.seed)))


if __name__ == "__main__":
    main()

