"""Symbol API: conv -> mx_roi.sym.<op> -> FC -> loss, with simple_bind and mx.mod.Module."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mxnet as mx

import mx_roi
from tests.conftest import roi_nodes

OPS = ("ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign")
N, H, W, CLASSES = 2, 12, 12, 4
# per op: (parameters, conv channels)
CASES = {
    "ROIPooling": (dict(pooled_size=(3, 2), spatial_scale=0.5), 6),
    "ROIAlign": (dict(pooled_size=(3, 2), spatial_scale=0.5, sample_ratio=2), 6),
    "PSROIPooling": (dict(pooled_size=2, output_dim=3, spatial_scale=0.5), 12),
    "PSROIAlign": (dict(pooled_size=2, output_dim=3, spatial_scale=0.5, sample_ratio=2), 12),
}
ROIS = np.array([[0, 1.0, 2.0, 18.0, 20.0],
                 [1, 0.0, 0.0, 23.0, 23.0],
                 [0, 6.5, 3.2, 11.9, 14.4],
                 [1, 10.2, 4.4, 21.7, 8.9],
                 [-1, 0.0, 0.0, 4.0, 4.0]])   # padding roi
R = len(ROIS)
op_param = pytest.mark.parametrize("op", OPS)


def network(op, **params):
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    conv = mx.sym.Convolution(data, num_filter=CASES[op][1], kernel=(3, 3), pad=(1, 1),
                              name="conv")
    relu = mx.sym.Activation(conv, act_type="relu", name="relu")
    pooled = getattr(mx_roi.sym, op)(data=relu, rois=rois, name="pool",
                                     **(params or CASES[op][0]))
    fc = mx.sym.FullyConnected(pooled, num_hidden=CLASSES, name="fc")
    return mx.sym.SoftmaxOutput(fc, name="softmax")


def feed(seed=0):
    rng = np.random.RandomState(seed)
    return {"data": mx.nd.array(rng.randn(N, 3, H, W)), "rois": mx.nd.array(ROIS),
            "softmax_label": mx.nd.array(rng.randint(0, CLASSES, R))}


def init_args(sym, seed=1):
    shapes, _, _ = sym.infer_shape(data=(N, 3, H, W), rois=(R, 5), softmax_label=(R,))
    rng = np.random.RandomState(seed)
    return {name: mx.nd.array(rng.randn(*shape) * 0.3) for name, shape in
            zip(sym.list_arguments(), shapes) if name not in ("data", "rois", "softmax_label")}


@op_param
def test_graph_shapes_and_json(op, door):
    sym = network(op)
    assert sym.list_arguments() == ["data", "conv_weight", "conv_bias", "rois", "fc_weight",
                                    "fc_bias", "softmax_label"]
    _, out_shapes, _ = sym.get_internals()["pool_output"].infer_shape(data=(N, 3, H, W),
                                                                      rois=(R, 5))
    ph, pw = mx_roi.registry.REGISTERED[op].param_cls.from_kwargs(**CASES[op][0]).pooled_size
    channels = CASES[op][0].get("output_dim", CASES[op][1])
    assert out_shapes == [(R, channels, ph, pw)]
    node = [n for n in json.loads(sym.tojson())["nodes"] if n["name"] == "pool"][0]
    assert node["op"] == ("Custom" if door == "custom" else f"mx_roi_{op}")
    assert roi_nodes([node], op) == [mx_roi.registry.REGISTERED[op].param_cls.from_kwargs(
        **CASES[op][0]).to_kwargs()]


@op_param
def test_simple_bind_forward_backward_reaches_conv(op):
    sym = network(op)
    args = init_args(sym)
    exe = sym.simple_bind(mx.cpu(), data=(N, 3, H, W), rois=(R, 5), softmax_label=(R,),
                          grad_req={"data": "write", "rois": "null", "softmax_label": "null",
                                    "conv_weight": "write", "conv_bias": "write",
                                    "fc_weight": "write", "fc_bias": "write"})
    for name, value in {**args, **feed()}.items():
        exe.arg_dict[name][:] = value
    out = exe.forward(is_train=True)[0].asnumpy()
    assert out.shape == (R, CLASSES) and np.allclose(out.sum(axis=1), 1, atol=1e-5)
    exe.backward()
    for name in ("conv_weight", "conv_bias", "fc_weight", "data"):
        grad = exe.grad_dict[name].asnumpy()
        assert np.isfinite(grad).all() and np.abs(grad).sum() > 0, name
    # the gradient reaching conv matches a finite difference of the loss
    check_conv_gradient(sym, exe, args)


def check_conv_gradient(sym, exe, args, eps=1e-5):
    """Directional derivative of sum(-log p[label]) along a random conv_weight direction,
    by central differences of the same graph bound in float64."""
    labels = feed()["softmax_label"].asnumpy().astype(int)
    direction = np.random.RandomState(7).randn(*args["conv_weight"].shape)
    base = {k: v.astype("float64") for k, v in {**feed(), **args}.items()}

    def loss(weight):
        e = sym.bind(mx.cpu(), {**base, "conv_weight": mx.nd.array(weight, dtype="float64")})
        p = e.forward(is_train=False)[0].asnumpy()
        return -np.log(p[np.arange(R), labels]).sum()

    w0 = args["conv_weight"].asnumpy().astype(np.float64)
    numeric = (loss(w0 + eps * direction) - loss(w0 - eps * direction)) / (2 * eps)
    analytic = float((exe.grad_dict["conv_weight"].asnumpy() * direction).sum())
    assert abs(numeric - analytic) <= 1e-3 * max(1.0, abs(numeric)), (numeric, analytic)


@op_param
def test_module_forward_backward_update(op):
    sym = network(op)
    args = init_args(sym)
    mod = mx.mod.Module(sym, data_names=("data", "rois"), label_names=("softmax_label",),
                        context=mx.cpu())
    # rois and labels have R rows, not N: a layout without 'N' keeps Module from slicing
    mod.bind(data_shapes=[mx.io.DataDesc("data", (N, 3, H, W), layout="NCHW"),
                          mx.io.DataDesc("rois", (R, 5), layout="RC")],
             label_shapes=[mx.io.DataDesc("softmax_label", (R,), layout="R")],
             for_training=True)
    mod.init_params(arg_params=args, allow_missing=False)
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    f = feed()
    batch = mx.io.DataBatch(data=[f["data"], f["rois"]], label=[f["softmax_label"]])
    labels = f["softmax_label"].asnumpy().astype(int)
    losses = []
    for step in range(4):
        mod.forward(batch, is_train=True)
        p = mod.get_outputs()[0].asnumpy()
        losses.append(-np.log(p[np.arange(R), labels]).sum())
        mod.backward()
        grads = dict(zip(mod._exec_group.param_names, mod._exec_group.grad_arrays))
        conv_grad = grads["conv_weight"][0].asnumpy()
        assert np.isfinite(conv_grad).all() and np.abs(conv_grad).sum() > 0
        if step == 0:  # same gradient as the simple_bind executor
            exe = sym.simple_bind(mx.cpu(), data=(N, 3, H, W), rois=(R, 5),
                                  softmax_label=(R,), grad_req="write")
            for name, value in {**args, **f}.items():
                exe.arg_dict[name][:] = value
            exe.forward(is_train=True)
            exe.backward()
            np.testing.assert_allclose(conv_grad, exe.grad_dict["conv_weight"].asnumpy(),
                                       rtol=1e-5, atol=1e-6)
        mod.update()
    assert losses[-1] < losses[0], losses


def test_two_parameterisations_in_one_symbol_graph():
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    conv = mx.sym.Convolution(data, num_filter=6, kernel=(3, 3), pad=(1, 1), name="conv")
    a = mx_roi.sym.ROIAlign(conv, rois, pooled_size=2, spatial_scale=0.5, name="a")
    b = mx_roi.sym.ROIAlign(conv, rois, pooled_size=(3, 1), spatial_scale=0.25, aligned=True,
                            name="b")
    out = mx.sym.Group([a, b])
    exe = out.simple_bind(mx.cpu(), data=(N, 3, H, W), rois=(R, 5))
    f = feed()
    exe.arg_dict["data"][:] = f["data"]
    exe.arg_dict["rois"][:] = f["rois"]
    exe.arg_dict["conv_weight"][:] = mx.nd.array(np.random.RandomState(2).randn(6, 3, 3, 3))
    exe.arg_dict["conv_bias"][:] = 0
    oa, ob = [o.asnumpy() for o in exe.forward(is_train=True)]
    feat = mx.nd.Convolution(f["data"], exe.arg_dict["conv_weight"], exe.arg_dict["conv_bias"],
                             num_filter=6, kernel=(3, 3), pad=(1, 1))
    np.testing.assert_allclose(oa, mx_roi.nd.ROIAlign(feat, f["rois"], pooled_size=2,
                                                      spatial_scale=0.5).asnumpy(), 1e-5, 1e-5)
    np.testing.assert_allclose(ob, mx_roi.nd.ROIAlign(feat, f["rois"], pooled_size=(3, 1),
                                                      spatial_scale=0.25, aligned=True).asnumpy(),
                               1e-5, 1e-5)
    exe.backward([mx.nd.ones_like(exe.outputs[0]), mx.nd.ones_like(exe.outputs[1])])
    assert np.abs(exe.grad_dict["conv_weight"].asnumpy()).sum() > 0
    attrs = {n["name"]: roi_nodes([n], "ROIAlign")[0]
             for n in json.loads(out.tojson())["nodes"] if roi_nodes([n], "ROIAlign")}
    assert attrs["a"]["pooled_size"] == "(2, 2)" and attrs["b"]["pooled_size"] == "(3, 1)"
    assert attrs["b"]["aligned"] == "True" and attrs["a"]["aligned"] == "False"


@op_param
def test_symbol_json_round_trip(op):
    sym = network(op)
    args = init_args(sym)
    loaded = mx.sym.load_json(sym.tojson())
    outs = []
    for s in (sym, loaded):
        exe = s.bind(mx.cpu(), {**feed(), **args})
        outs.append(exe.forward()[0].asnumpy())
    np.testing.assert_array_equal(outs[0], outs[1])


def test_bad_parameter_fails_when_the_symbol_is_built():
    with pytest.raises(ValueError, match="spatial_scale"):
        mx_roi.sym.ROIAlign(mx.sym.var("d"), mx.sym.var("r"), pooled_size=2, spatial_scale=0)
    with pytest.raises(TypeError, match="rois"):
        mx_roi.sym.ROIAlign(mx.sym.var("d"), pooled_size=2, spatial_scale=1)
