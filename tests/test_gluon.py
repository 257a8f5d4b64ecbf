"""mx_roi.gluon: op blocks, MultiScaleROIAlign, roi_pooler, export/import, fp16/AMP, training."""
from __future__ import annotations

import copy
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import mx_roi
import mx_roi.gluon as G
from tests.conftest import roi_nodes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign")

# per op: (block kwargs, input channels)
CASES = {
    "ROIPooling": (dict(pooled_size=(2, 3), spatial_scale=0.5), 4),
    "ROIAlign": (dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2), 4),
    "PSROIPooling": (dict(pooled_size=2, output_dim=3, spatial_scale=0.5), 12),
    "PSROIAlign": (dict(pooled_size=2, output_dim=3, spatial_scale=0.5, sample_ratio=2), 12),
}
# a second, different parameterisation of each op
CASES2 = {
    "ROIPooling": dict(pooled_size=3, spatial_scale=0.25),
    "ROIAlign": dict(pooled_size=3, spatial_scale=0.25, aligned=True),
    "PSROIPooling": dict(pooled_size=2, output_dim=3, spatial_scale=0.25),
    "PSROIAlign": dict(pooled_size=2, output_dim=3, spatial_scale=0.25, aligned=True),
}
op_param = pytest.mark.parametrize("op", OPS)


def inputs(op, dtype="float32", seed=0, n=2, size=12):
    rng = np.random.RandomState(seed)
    channels = CASES[op][1]
    data = rng.randn(n, channels, size, size)
    rois = np.array([[0, 1.3, 2.1, 14.7, 19.2],
                     [1, 0.0, 0.0, 23.0, 23.0],
                     [0, 6.5, 3.2, 9.9, 12.4],
                     [-1, 1.0, 1.0, 5.0, 5.0],      # padding roi
                     [1, 10.2, 4.4, 21.7, 8.9]])
    return mx.nd.array(data, dtype=dtype), mx.nd.array(rois, dtype=dtype)


def block(op, **extra):
    return getattr(G, op)(**CASES[op][0], **extra)


def forward_backward(net, *args, seed=1):
    """Output and d(sum(out * w))/d(args[0]) (w fixed random)."""
    x = args[0].copy()
    x.attach_grad()
    with autograd.record():
        out = net(x, *args[1:])
        w = mx.nd.array(np.random.RandomState(seed).randn(*out.shape), dtype=out.dtype)
        loss = (out * w).sum()
    loss.backward()
    return out.asnumpy(), x.grad.asnumpy()


# ------------------------------------------------------------------ the four op blocks
def test_blocks_generated_from_registry():
    for name in mx_roi.registry.REGISTERED:
        cls = getattr(G, name)
        assert issubclass(cls, G.RoIBlock) and issubclass(cls, gluon.HybridBlock)
        assert cls.op_cls is mx_roi.registry.REGISTERED[name]
        assert cls.__module__ == "mx_roi.gluon" and cls.__qualname__ == name
    assert set(OPS) <= set(G.__all__)


@op_param
def test_block_matches_nd_function(op):
    data, rois = inputs(op)
    out = block(op)(data, rois)
    ref = getattr(mx_roi.nd, op)(data, rois, **CASES[op][0])
    np.testing.assert_array_equal(out.asnumpy(), ref.asnumpy())
    assert out.asnumpy()[3].max() == 0 and out.asnumpy()[3].min() == 0  # padding roi


def test_every_custom_node_goes_through_the_guard(monkeypatch, door):
    """Blocks, ops(F) and MultiScaleROIAlign build their nodes only via
    mx_roi.ext.door.call, which builds Custom nodes only via mx_roi.mxpatch.call_custom
    (the oneDNN guard), never bare F.Custom; on the native door (these four ops have a
    native op) no Custom node at all."""
    from mx_roi.ext import door as door_module
    calls, customs = [], []
    original, original_call = mx_roi.mxpatch.call_custom, door_module.call

    def spy(F, op_type, inputs, **kwargs):
        customs.append((F.__name__, op_type))
        return original(F, op_type, inputs, **kwargs)

    def spy_call(F, op, inputs, name=None):
        calls.append((F.__name__, op.name))
        return original_call(F, op, inputs, name=name)

    monkeypatch.setattr(mx_roi.mxpatch, "call_custom", spy)
    monkeypatch.setattr(door_module, "call", spy_call)
    for op in OPS:
        data, rois = inputs(op)
        b = block(op)
        b(data, rois)
        b.hybridize()
        b(data, rois)
        assert calls[-2:] == [("mxnet.ndarray", op), ("mxnet.symbol", op)]
    G.ops(mx.nd).ROIPooling(data, rois, 2, 0.5)
    assert calls[-1] == ("mxnet.ndarray", "ROIPooling")
    assert customs == (calls if door == "custom" else [])
    calls.clear()
    customs.clear()
    m = G.MultiScaleROIAlign(2, strides=STRIDES)
    m.hybridize()
    m(pyramid(), mx.nd.array(pyramid_rois(count=4)))
    assert customs == (calls if door == "custom" else [])
    assert calls == [("mxnet.symbol", "ROIAlign")] * len(STRIDES)


@op_param
def test_positional_parameters_and_param_struct(op):
    kwargs = CASES[op][0]
    cls = getattr(G, op)
    order = cls.op_cls.positional_order()  # the built-in's order, then the other fields
    assert list(inspect.signature(cls).parameters)[:len(order)] == list(order)
    args = [kwargs[n] for n in order[:max(order.index(n) for n in kwargs) + 1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # the built-in order never warns
        b = cls(*args)
    assert b.param == cls.op_cls.param_cls.from_kwargs(**kwargs)
    assert b.op_type == op and b.op_kwargs() == b.param.to_kwargs()
    with pytest.raises(TypeError, match="multiple values for parameter 'spatial_scale'"):
        cls(*args, spatial_scale=1.0)
    with pytest.raises(TypeError, match=rf"takes at most {len(order)} positional"):
        cls(*([1] * (len(order) + 1)))


# per op: positional parameters in the built-in's order (after data, rois) and the
# built-in called with the same positional arguments (None: MXNet has no such op)
BUILTIN_POSITIONAL = {
    "ROIPooling": (((2, 3), 0.5), mx.nd.ROIPooling),
    # contrib.ROIAlign(data, rois, pooled_size, spatial_scale, sample_ratio,
    #                  position_sensitive, aligned)
    "ROIAlign": (((2, 3), 0.5, 2, False, True), mx.nd.contrib.ROIAlign),
    # contrib.PSROIPooling(data, rois, spatial_scale, output_dim, pooled_size, group_size)
    "PSROIPooling": ((0.5, 3, 2, 2), mx.nd.contrib.PSROIPooling),
    # no built-in of its own: contrib.ROIAlign(position_sensitive=True), checked below
    "PSROIAlign": ((2, 3, 0.5, 2), None),
}


@op_param
def test_block_positional_builtin_order_matches_nd_and_builtin(op):
    args, builtin = BUILTIN_POSITIONAL[op]
    data, rois = inputs(op)
    rois = mx.nd.array(rois.asnumpy()[[0, 1, 2, 4]])   # no padding roi (built-ins differ)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = getattr(G, op)(*args)
    out = b(data, rois).asnumpy()
    b.hybridize()
    np.testing.assert_array_equal(b(data, rois).asnumpy(), out)
    np.testing.assert_array_equal(getattr(mx_roi.nd, op)(data, rois, *args).asnumpy(), out)
    np.testing.assert_array_equal(G.ops(mx.nd).__getattr__(op)(data, rois, *args).asnumpy(),
                                  out)
    if builtin is None:  # PSROIAlign(pooled_size, output_dim, spatial_scale, sample_ratio)
        pooled, _, scale, ratio = args
        ref = mx.nd.contrib.ROIAlign(data, rois, (pooled, pooled), scale, ratio,
                                     True).asnumpy()
    else:
        ref = builtin(data, rois, *args).asnumpy()
    assert np.abs(out).max() > 0
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


# old (parameter struct order) positional calls that cannot be read in the built-in order
# -> the same parameters by name
OLD_ORDER_CALLS = [
    ("PSROIPooling", (2, 3, 0.5), {}, dict(pooled_size=2, output_dim=3, spatial_scale=0.5)),
    ("PSROIPooling", ((2, 2), 3), dict(spatial_scale=0.5),
     dict(pooled_size=(2, 2), output_dim=3)),
    ("ROIAlign", ((2, 3), 0.5, 2, True), {},
     dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2, aligned=True)),
    ("ROIAlign", ((2, 3), 0.5, 2, False, "max"), {},
     dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2, aligned=False,
          pool_mode="max")),
]


@pytest.mark.parametrize("op, args, kwargs, named", OLD_ORDER_CALLS)
def test_block_old_positional_order_warns_and_maps(op, args, kwargs, named):
    keyword = ", ".join(f"{k}={v!r}" for k, v in named.items())
    with pytest.warns(DeprecationWarning,
                      match=rf"^{op}\(\): positional parameters in the parameter struct's "
                            rf"order .* are deprecated; the positional order is now the "
                            rf"built-in's \(.*\)\. Pass them by name: "
                            rf"{re.escape(f'{op}({keyword})')}$") as record:
        b = getattr(G, op)(*args, **kwargs)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    expected = getattr(G, op)(**named, **kwargs)
    assert b.param == expected.param
    data, rois = inputs(op)
    np.testing.assert_array_equal(b(data, rois).asnumpy(), expected(data, rois).asnumpy())


def test_block_positional_same_in_both_orders_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = G.PSROIPooling(2, 3, 2)       # spatial_scale = pooled_size = 2 either way
        a = G.ROIAlign(2, 0.5, 2, False)  # position_sensitive=False / aligned=False
    assert b.param == G.PSROIPooling(spatial_scale=2, output_dim=3, pooled_size=2).param
    assert a.param == G.ROIAlign(2, 0.5, sample_ratio=2).param


def test_block_positional_ambiguous_or_invalid_raises_naming_the_parameters():
    # valid in both orders with different meanings: refused, never guessed
    with pytest.raises(TypeError, match=re.escape(
            "PSROIPooling(): ambiguous positional parameters (2, 3, 1.0): in the built-in's "
            "order they read PSROIPooling(spatial_scale=2, output_dim=3, pooled_size=1.0), in "
            "the old (parameter struct) order PSROIPooling(pooled_size=2, output_dim=3, "
            "spatial_scale=1.0); pass them by name")):
        G.PSROIPooling(2, 3, 1.0)
    # valid in neither order: the built-in order's error, naming the parameter
    with pytest.raises(ValueError, match=re.escape(
            "PSROIPooling: parameter 'pooled_size': expected an int or a (height, width) "
            "tuple, got 0.25")):
        G.PSROIPooling(0.5, 3, 0.25)
    with pytest.raises(TypeError, match="multiple values for parameter 'spatial_scale'"):
        G.PSROIPooling(0.5, 3, 2, spatial_scale=1.0)
    with pytest.raises(ValueError, match="parameter 'position_sensitive': use PSROIAlign"):
        G.ROIAlign(2, 0.5, 2, True, True)   # old order: pool_mode=True is invalid too
    assert G.PSROIPooling(0.5, 3, 2).param.spatial_scale == 0.5   # the next call works
    # mx_roi.nd / ops(F) never had the old order: no mapping there
    data, rois = inputs("PSROIPooling")
    with pytest.raises(ValueError, match="parameter 'spatial_scale': expected a number"):
        mx_roi.nd.PSROIPooling(data, rois, (2, 2), 3, 0.5)


@op_param
def test_bad_parameter_fails_at_construction(op):
    kwargs = dict(CASES[op][0])
    with pytest.raises(ValueError, match="spatial_scale"):
        getattr(G, op)(**{**kwargs, "spatial_scale": -0.5})
    with pytest.raises(ValueError, match="pooled_size"):
        getattr(G, op)(**{**kwargs, "pooled_size": (0, 2)})
    with pytest.raises(ValueError, match="no_such_param"):
        getattr(G, op)(**kwargs, no_such_param=1)
    with pytest.raises(ValueError, match="missing required"):
        getattr(G, op)(pooled_size=2)
    if op.startswith("PS"):
        with pytest.raises(ValueError, match="output_dim"):
            getattr(G, op)(pooled_size=2, spatial_scale=1.0)
    if op == "ROIAlign":
        with pytest.raises(ValueError, match="pool_mode"):
            G.ROIAlign(2, 1.0, pool_mode="median")


@op_param
def test_repr_like_gluon_layers(op):
    b = block(op)
    text = repr(b)
    assert text.startswith(f"{op}(pooled_size=")
    for name in b.param.field_names():
        assert f"{name}=" in text
    assert "spatial_scale=0.5" in text
    if op == "ROIAlign":
        assert text == ("ROIAlign(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2, "
                        "aligned=False, pool_mode='avg', deterministic=False, legacy='')")
    # inside a container, like Gluon's own layers
    seq = gluon.nn.HybridSequential()
    seq.add(b)
    assert text in repr(seq)


@op_param
def test_hybridized_equals_imperative(op):
    data, rois = inputs(op)
    b = block(op)
    out0, grad0 = forward_backward(b, data, rois)
    b.hybridize()
    out1, grad1 = forward_backward(b, data, rois)
    out2, grad2 = forward_backward(b, data, rois)  # cached op reused
    np.testing.assert_array_equal(out0, out1)
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_allclose(grad0, grad1, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(grad1, grad2)
    assert np.abs(grad0).sum() > 0


@op_param
def test_pickle_and_deepcopy(op):
    data, rois = inputs(op)
    b = block(op, prefix="pooler_")
    ref = b(data, rois).asnumpy()
    b.hybridize(static_alloc=True)
    b(data, rois)  # builds a CachedOp, which itself cannot be pickled
    for clone in (pickle.loads(pickle.dumps(b)), copy.deepcopy(b), copy.copy(b)):
        assert type(clone) is type(b) and clone is not b
        assert clone.param == b.param and clone.prefix == "pooler_"
        assert clone._active and dict(clone._flags)["static_alloc"] is True
        assert repr(clone) == repr(b)
        np.testing.assert_array_equal(clone(data, rois).asnumpy(), ref)


@op_param
def test_export_json_nodes(op, tmp_path, door):
    data, rois = inputs(op)
    b = block(op)
    b.hybridize()
    b(data, rois)
    b.export(str(tmp_path / "blk"))
    graph = json.loads((tmp_path / "blk-symbol.json").read_text())
    assert [n["op"] for n in graph["nodes"]].count(
        "Custom" if door == "custom" else f"mx_roi_{op}") == 1
    assert roi_nodes(graph["nodes"], op) == [b.param.to_kwargs()]
    assert [n["name"] for n in graph["nodes"] if n["op"] == "null"] == ["data0", "data1"]


def test_two_parameterisations_of_each_op_in_one_graph(tmp_path, door):
    class Two(gluon.HybridBlock):
        def __init__(self, op):
            super().__init__()
            with self.name_scope():
                self.a = block(op)
                self.b = getattr(G, op)(**CASES2[op])

        def hybrid_forward(self, F, x, rois):
            return F.concat(F.flatten(self.a(x, rois)), F.flatten(self.b(x, rois)), dim=1)

    for op in OPS:
        data, rois = inputs(op)
        net = Two(op)
        out0, grad0 = forward_backward(net, data, rois)
        with autograd.record():  # a training forward, as in forward_backward
            ref = np.concatenate([
                getattr(mx_roi.nd, op)(data, rois, **CASES[op][0]).asnumpy().reshape(5, -1),
                getattr(mx_roi.nd, op)(data, rois, **CASES2[op]).asnumpy().reshape(5, -1)], 1)
        np.testing.assert_array_equal(out0, ref)
        net.hybridize()
        out1, grad1 = forward_backward(net, data, rois)
        np.testing.assert_array_equal(out1, ref)
        np.testing.assert_allclose(grad1, grad0, rtol=1e-6, atol=1e-6)
        net.export(str(tmp_path / op))
        nodes = json.loads((tmp_path / f"{op}-symbol.json").read_text())["nodes"]
        kw = roi_nodes(nodes, op)
        assert len(kw) == 2
        key = lambda d: sorted(d.items())  # noqa: E731
        assert sorted(map(key, kw)) == sorted(map(key, (net.a.param.to_kwargs(),
                                                        net.b.param.to_kwargs())))


@pytest.mark.parametrize("second", [dict(op="ROIAlign", pool_mode="max"),
                                    dict(op="ROIPooling")], ids=["align_max", "roipooling"])
def test_graph_mixing_backward_dependencies(second):
    """Ops of one graph with different modes share MXNet's process-wide dependency list."""
    data, rois = inputs("ROIAlign")
    second = dict(second)
    other = getattr(G, second.pop("op"))(pooled_size=2, spatial_scale=0.5, **second)
    avg = G.ROIAlign(pooled_size=2, spatial_scale=0.5)
    forward_backward(lambda x, r: avg(x, r) + other(x, r), data, rois)


# ------------------------------------------------------------------ roi_pooler factory
def test_roi_pooler_factory():
    expected = {"pool": G.ROIPooling, "align": G.ROIAlign, "pspool": G.PSROIPooling,
                "psalign": G.PSROIAlign}
    for mode, cls in expected.items():
        extra = {"output_dim": 3} if mode.startswith("ps") else {}
        b = G.roi_pooler(mode, (7, 7), 1. / 16, **extra)
        assert type(b) is cls
        assert b.param.pooled_size == (7, 7) and b.param.spatial_scale == 0.0625
    b = G.roi_pooler("Align", 14, 0.25, sample_ratio=2, aligned=True, prefix="rpool_")
    assert b.param.sample_ratio == 2 and b.param.aligned and b.prefix == "rpool_"
    assert type(G.roi_pooler("ROIPooling", 7, 0.5)) is G.ROIPooling
    with pytest.raises(ValueError, match="mode"):
        G.roi_pooler("bilinear", 7, 0.5)
    with pytest.raises(ValueError, match="output_dim"):
        G.roi_pooler("psalign", 7, 0.5)
    with pytest.raises(ValueError, match="sample_ratio"):
        G.roi_pooler("align", 7, 0.5, sample_ratio="two")


def test_ops_F_drop_in_with_builtin_positional_order(door):
    rng = np.random.RandomState(0)
    data = mx.nd.array(rng.randn(2, 8, 12, 12))
    rois = mx.nd.array([[0, 1.3, 2.1, 14.7, 19.2], [1, 0.0, 0.0, 23.0, 23.0]])
    # the same positional call as the built-in gives the built-in's result
    np.testing.assert_allclose(G.ops(mx.nd).ROIPooling(data, rois, (2, 3), 0.5).asnumpy(),
                               mx.nd.ROIPooling(data, rois, (2, 3), 0.5).asnumpy(), 1e-6, 1e-6)
    np.testing.assert_allclose(
        G.ops(mx.nd).ROIAlign(data, rois, (2, 3), 0.5, 2).asnumpy(),
        mx.nd.contrib.ROIAlign(data, rois, (2, 3), 0.5, 2).asnumpy(), 1e-5, 1e-5)
    np.testing.assert_array_equal(  # PSROIPooling(data, rois, spatial_scale, output_dim, ...)
        G.ops(mx.nd).PSROIPooling(data, rois, 0.5, 2, 2).asnumpy(),
        mx_roi.nd.PSROIPooling(data, rois, pooled_size=2, output_dim=2,
                               spatial_scale=0.5).asnumpy())
    with pytest.raises(ValueError, match="position_sensitive"):
        G.ops(mx.nd).ROIAlign(data, rois, 2, 0.5, 2, True)
    with pytest.raises(AttributeError, match="NoSuchOp"):
        G.ops(mx.nd).NoSuchOp

    class Head(gluon.HybridBlock):  # F-agnostic: works imperative and hybridized
        def hybrid_forward(self, F, x, r):
            return G.ops(F).ROIAlign(x, r, (2, 2), 0.5, sample_ratio=2)

    head = Head()
    ref = head(data, rois).asnumpy()
    head.hybridize()
    np.testing.assert_array_equal(head(data, rois).asnumpy(), ref)
    sym = G.ops(mx.sym).ROIAlign(mx.sym.var("d"), mx.sym.var("r"), 2, 0.5, name="pool")
    node = sym.get_internals()["pool_output"]          # behind the oneDNN output guard
    assert roi_nodes(json.loads(node.tojson())["nodes"], "ROIAlign")[0]["pooled_size"] == \
        "(2, 2)"


# ------------------------------------------------------------------ MultiScaleROIAlign
STRIDES = (4, 8, 16, 32)
IMAGE = 512


def pyramid(seed=0, channels=3, n=2, dtype="float32"):
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.randn(n, channels, IMAGE // s, IMAGE // s), dtype=dtype)
            for s in STRIDES]


def numpy_levels(rois, k_min=2, k_max=5, canonical=224.0, k0=4):
    w = np.maximum(rois[:, 3] - rois[:, 1], 0)
    h = np.maximum(rois[:, 4] - rois[:, 2], 0)
    with np.errstate(divide="ignore"):
        k = np.floor(k0 + np.log2(np.sqrt(w * h) / canonical) + 1e-6)
    return (np.clip(k, k_min, k_max) - k_min).astype(int)


def pyramid_rois(seed=0, count=40):
    """Boxes over all levels (sizes 8..700, away from level boundaries) plus exact ones."""
    rng = np.random.RandomState(seed)
    rows = []
    while len(rows) < count:
        s = np.exp(rng.uniform(np.log(8), np.log(700)))
        aspect = np.exp(rng.uniform(-0.7, 0.7))
        w, h = s * np.sqrt(aspect), s / np.sqrt(aspect)
        t = 4 + np.log2(np.sqrt(w * h) / 224)
        if abs(t - np.round(t)) < 1e-3:
            continue
        x1, y1 = rng.uniform(-20, IMAGE - w / 2), rng.uniform(-20, IMAGE - h / 2)
        rows.append([rng.randint(2), x1, y1, x1 + w, y1 + h])
    exact = [[0, 10, 10, 10 + s, 10 + s] for s in (56, 112, 224, 448)]
    rows = exact + rows + [[-1, 0, 0, 100, 100], [1, 5, 5, 5, 5]]  # padding, empty box
    return np.array(rows, dtype=np.float64)


def test_multiscale_level_assignment():
    m = G.MultiScaleROIAlign(2, strides=STRIDES)
    assert m.level_range == (2, 5)
    rois = pyramid_rois()
    got = m.assign_levels(mx.nd, mx.nd.array(rois)).asnumpy().ravel()
    np.testing.assert_array_equal(got, numpy_levels(rois))
    # exact sizes: 56 -> k=2, 112 -> 3, 224 -> k0=4, 448 -> 5 (eps keeps boundaries up)
    np.testing.assert_array_equal(got[:4], [0, 1, 2, 3])
    assert set(got) == {0, 1, 2, 3}
    # k_min = log2(min stride): with strides (8, 16, 32) level 3 is feature 0
    m3 = G.MultiScaleROIAlign(2, strides=(8, 16, 32), canonical_size=112, canonical_level=3)
    boxes = mx.nd.array([[0, 0, 0, 50, 50], [0, 0, 0, 112, 112], [0, 0, 0, 230, 230],
                         [0, 0, 0, 2000, 2000]])
    np.testing.assert_array_equal(m3.assign_levels(mx.nd, boxes).asnumpy().ravel(),
                                  [0, 0, 1, 2])


@pytest.mark.parametrize("mode", ["align", "pool"])
def test_multiscale_matches_pool_everywhere_and_select(mode):
    feats = pyramid()
    rois_np = pyramid_rois()
    rois = mx.nd.array(rois_np)
    op_kwargs = {"sample_ratio": 2} if mode == "align" else {}
    m = G.MultiScaleROIAlign((3, 2), strides=STRIDES, mode=mode, **op_kwargs)
    fn = mx_roi.nd.ROIAlign if mode == "align" else mx_roi.nd.ROIPooling
    levels = numpy_levels(rois_np)

    def reference(fs, r):  # every roi at every level, then select
        outs = [fn(f, r, pooled_size=(3, 2), spatial_scale=1.0 / s, **op_kwargs)
                for f, s in zip(fs, STRIDES)]
        mask = [mx.nd.array((levels == i).astype(np.float32)).reshape((-1, 1, 1, 1))
                for i in range(len(fs))]
        return mx.nd.add_n(*[mx.nd.broadcast_mul(o, k) for o, k in zip(outs, mask)])

    def run(net):
        fs = [f.copy() for f in feats]
        for f in fs:
            f.attach_grad()
        with autograd.record():
            out = net(fs, rois)
            w = mx.nd.array(np.random.RandomState(3).randn(*out.shape))
            loss = (out * w).sum()
        loss.backward()
        return out.asnumpy(), [f.grad.asnumpy() for f in fs]

    ref_out, ref_grads = run(reference)
    assert ref_out.shape == (len(rois_np), 3, 3, 2)
    for hybrid in (False, True):
        if hybrid:
            m.hybridize()
        out, grads = run(m)
        np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
        for g, rg in zip(grads, ref_grads):
            np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-5)
            assert np.abs(g).sum() > 0  # gradient reaches every level's map
    # each roi only at its own level: compare roi by roi with the op on that map
    for i in (0, 1, 2, 3, 10, 20):
        single = fn(feats[levels[i]], rois[i:i + 1], pooled_size=(3, 2),
                    spatial_scale=1.0 / STRIDES[levels[i]], **op_kwargs).asnumpy()
        np.testing.assert_allclose(out[i:i + 1], single, rtol=1e-6, atol=1e-6)
    assert np.all(out[-2] == 0)  # padding roi stays padding


def test_multiscale_export_pickle_and_errors(tmp_path, door):
    feats, rois = pyramid(), mx.nd.array(pyramid_rois(count=8))
    m = G.MultiScaleROIAlign(2, strides=STRIDES, sample_ratio=2, aligned=True)
    ref = m(feats, rois).asnumpy()
    assert "MultiScaleROIAlign(mode='align'" in repr(m) and "aligned=True" in repr(m)
    m.hybridize()
    np.testing.assert_array_equal(m(feats, rois).asnumpy(), ref)
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert clone.strides == STRIDES and clone._active
        np.testing.assert_array_equal(clone(feats, rois).asnumpy(), ref)
    m.export(str(tmp_path / "ms"))
    nodes = json.loads((tmp_path / "ms-symbol.json").read_text())["nodes"]
    scales = sorted(float(a["spatial_scale"]) for a in roi_nodes(nodes, "ROIAlign"))
    assert scales == sorted(1.0 / s for s in STRIDES)
    assert "Concat" not in {n["op"] for n in nodes}  # see the oneDNN note in the module
    with pytest.raises(ValueError, match="strides"):
        G.MultiScaleROIAlign(2, strides=(4, 16))
    with pytest.raises(ValueError, match="strides"):
        G.MultiScaleROIAlign(2, strides=(3, 6))
    with pytest.raises(ValueError, match="spatial_scale"):
        G.MultiScaleROIAlign(2, spatial_scale=0.5)
    with pytest.raises(ValueError, match="mode"):
        G.MultiScaleROIAlign(2, mode="nearest")
    with pytest.raises(ValueError, match="sample_ratio"):
        G.MultiScaleROIAlign(2, sample_ratio="x")
    with pytest.raises(ValueError, match="feature map"):
        G.MultiScaleROIAlign(2, strides=STRIDES)(feats[:3], rois)


def test_multiscale_float16():
    feats, rois = pyramid(dtype="float16"), mx.nd.array(pyramid_rois(count=12), dtype="float16")
    m = G.MultiScaleROIAlign(2, strides=STRIDES, sample_ratio=2)
    m.cast("float16")
    m.hybridize()
    out = m(feats, rois)
    assert out.dtype == np.float16
    ref = G.MultiScaleROIAlign(2, strides=STRIDES, sample_ratio=2)(
        [f.astype("float32") for f in feats], rois.astype("float32"))
    np.testing.assert_allclose(out.asnumpy(), ref.asnumpy(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ export / import
_FRESH = textwrap.dedent("""
    import sys, numpy as np, mxnet as mx
    how, folder = sys.argv[1], sys.argv[2]
    saved = np.load(folder + '/io.npz')
    if how == 'bare':
        try:
            mx.gluon.SymbolBlock.imports(folder + '/ROIAlign-symbol.json', ['data0', 'data1'],
                                         folder + '/ROIAlign-0000.params')
        except mx.base.MXNetError as exc:
            print('BARE-ERROR', str(exc).strip().splitlines()[-1])
        assert 'mx_roi' not in sys.modules
        sys.exit(0)
    import mx_roi.gluon
    names = [n[:-len('-symbol.json')] for n in sorted(__import__('os').listdir(folder))
             if n.endswith('-symbol.json')]
    for name in names:
        nin = int(saved[name + ':n'])
        inputs = [mx.nd.array(saved[f'{name}:in{i}'], dtype=saved[f'{name}:in{i}'].dtype)
                  for i in range(nin)]
        args = (folder + f'/{name}-symbol.json', [f'data{i}' for i in range(nin)],
                folder + f'/{name}-0000.params')
        if how == 'helper':
            net = mx_roi.gluon.imports(*args, ctx=mx.cpu())
        else:
            net = mx.gluon.SymbolBlock.imports(*args)
        out = net(*inputs).asnumpy()
        assert np.array_equal(out, saved[name + ':out']), name
        print('OK', name)
""")


class _ConvNet(gluon.HybridBlock):
    def __init__(self, op, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv = gluon.nn.Conv2D(CASES[op][1], 3, padding=1)
            self.roi = block(op)
            self.fc = gluon.nn.Dense(3)

    def hybrid_forward(self, F, x, rois):
        return self.fc(F.relu(self.roi(self.conv(x), rois)))


@pytest.fixture(scope="module", params=["native", "custom"])
def exported(request, tmp_path_factory):
    """Every block (plain, inside a conv net, MultiScale) exported with inputs/outputs,
    from each door (a graph of native nodes, a graph of Custom nodes)."""
    return _export(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def exported_custom(tmp_path_factory):
    """:func:`exported`'s graphs of Custom nodes: what MXNet and check_symbol_json say
    about a graph's *Custom* op_types (a graph of native nodes names no op_type)."""
    return _export(tmp_path_factory, "custom")


def _export(tmp_path_factory, door):
    from mx_roi.ext import door as door_module
    folder = tmp_path_factory.mktemp(f"exported_{door}")
    saved = {}
    before = os.environ.get(door_module.ENV)
    os.environ[door_module.ENV] = "0" if door == "custom" else "1"
    try:
        _export_all(folder, saved)
    finally:
        if before is None:
            del os.environ[door_module.ENV]
        else:
            os.environ[door_module.ENV] = before
    graph = json.loads((folder / "ROIAlign-symbol.json").read_text())
    assert ("Custom" if door == "custom" else "mx_roi_ROIAlign") in \
        [n["op"] for n in graph["nodes"]]
    return folder


def _export_all(folder, saved):

    def save(name, net, *args):
        net.hybridize()
        out = net(*args)
        net.export(str(folder / name))
        flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
        saved[name + ":n"] = np.array(len(flat))
        for i, a in enumerate(flat):
            saved[f"{name}:in{i}"] = a.asnumpy()
        saved[name + ":out"] = out.asnumpy()

    for op in OPS:
        data, rois = inputs(op)
        save(op, block(op), data, rois)
        net = _ConvNet(op)
        net.initialize(mx.init.Xavier())
        save(op + "_convnet", net, data[:, :3], rois)
    save("MultiScale", G.MultiScaleROIAlign(2, strides=STRIDES, sample_ratio=2),
         pyramid(channels=2), mx.nd.array(pyramid_rois(count=10)))
    np.savez(str(folder / "io.npz"), **saved)


def _fresh(how, folder):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _FRESH, how, str(folder)], capture_output=True,
                         text=True, env=env, cwd=str(folder), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_import_in_fresh_process_with_helper(exported):
    out = _fresh("helper", exported)
    assert out.count("OK") == 9, out


def test_import_in_fresh_process_with_symbolblock_after_import_mx_roi(exported):
    out = _fresh("plain", exported)
    assert out.count("OK") == 9, out


def test_bare_load_without_mx_roi_names_the_op(exported_custom):
    """What MXNet 1.9.1 says when the graph is loaded without ``import mx_roi``."""
    out = _fresh("bare", exported_custom)
    assert "BARE-ERROR" in out and "Cannot find custom operator ROIAlign" in out, out


def test_imports_helper_reports_unregistered_custom_ops(exported_custom, tmp_path,
                                                       monkeypatch):
    exported = exported_custom
    text = (exported / "ROIAlign-symbol.json").read_text().replace('"ROIAlign"', '"NoSuchOp"')
    (tmp_path / "x-symbol.json").write_text(text)
    with pytest.raises(RuntimeError, match="NoSuchOp.*not registered"):
        G.imports(str(tmp_path / "x-symbol.json"), ["data0", "data1"])
    assert G.check_symbol_json(str(exported / "ROIAlign_convnet-symbol.json")) == ["ROIAlign"]
    # an mx_roi op that is not registered (as in a process without `import mx_roi`)
    monkeypatch.setattr(G, "_custom_registered", lambda *a: False)
    with pytest.raises(RuntimeError, match="import mx_roi"):
        G.check_symbol_json(str(exported / "ROIAlign-symbol.json"))


# ------------------------------------------------------------------ mixed precision
@op_param
def test_cast_float16(op, door):
    data, rois = inputs(op, dtype="float32")
    b = block(op)
    ref = b(data, rois).asnumpy()
    b.cast("float16")
    for hybrid in (False, True):
        if hybrid:
            b.hybridize()
        out, grad = forward_backward(b, data.astype("float16"), rois.astype("float16"))
        assert out.dtype == np.float16 and grad.dtype == np.float16
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    # rois must be cast too (both doors: the same words, ext_launch.h's check_dtypes)
    message = f"{op}: data and rois must have the same dtype"
    with pytest.raises(mx.base.MXNetError, match=message):
        b(data.astype("float16"), rois).wait_to_read()


def test_amp_casts_custom_nodes_to_float32(door):
    """Custom is in AMP's FP32_FUNCS, and mx_roi.ext puts the native ops there too: AMP
    runs our ops in float32 between casts."""
    from mxnet.contrib import amp
    for target in ("float16", "bfloat16"):
        fp32 = amp.list_fp32_ops(getattr(amp.amp, target, target))
        assert "Custom" in fp32 and "mx_roi_ROIAlign" in fp32
        d, r = mx.sym.var("data"), mx.sym.var("rois")
        conv = mx.sym.Convolution(d, num_filter=4, kernel=(3, 3), pad=(1, 1), name="conv")
        pooled = mx_roi.sym.ROIAlign(conv, r, pooled_size=2, spatial_scale=0.5, name="roi")
        fc = mx.sym.FullyConnected(pooled, num_hidden=3, name="fc")
        low = amp.convert_symbol(fc, target_dtype=target, data_names=["data", "rois"])
        nodes = json.loads(low.tojson(remove_amp_cast=False))["nodes"]
        byname = {n["name"]: n for n in nodes}
        roi = byname["roi"]
        assert roi_nodes([roi], "ROIAlign")
        def source(node, i=0):  # input i of node, looking through the oneDNN guards
            src = nodes[node["inputs"][i][0]]
            while src["op"] in ("clip", "_copy") and "_guard_" in src["name"] or \
                    src["op"] == "BlockGrad" and src["name"] == "roi_rois_no_grad":
                src = nodes[src["inputs"][0][0]]
            return src

        src = source(roi)
        assert src["op"] == "amp_cast" and src["attrs"]["dtype"] == "float32"
        rois_src = source(roi, 1)
        if rois_src["op"] == "amp_cast":
            rois_src = source(rois_src)
        assert rois_src["name"] == "rois"
        fc_in = nodes[byname["fc"]["inputs"][0][0]]
        assert fc_in["op"] == "amp_cast" and fc_in["attrs"]["dtype"] == target
        assert source(fc_in)["name"] == "roi"
        assert byname["conv"]["inputs"] and nodes[byname["conv"]["inputs"][0][0]]["op"] == \
            "amp_cast"


def test_amp_convert_hybrid_block_runs():
    from mxnet.contrib import amp
    op = "ROIAlign"
    data, rois = inputs(op)
    b = block(op)
    b.hybridize()
    ref = b(data, rois).asnumpy()
    low = amp.convert_hybrid_block(b, target_dtype="float16", ctx=mx.cpu())
    np.testing.assert_array_equal(low(data, rois).asnumpy(), ref)


# ------------------------------------------------------------------ training
@op_param
def test_trainer_loop_loss_decreases(op):
    mx.random.seed(0)
    rng = np.random.RandomState(0)
    data, rois = inputs(op)
    data = data[:, :3]
    target = mx.nd.array(rng.randn(rois.shape[0], 3))
    net = _ConvNet(op)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.02})
    l2 = gluon.loss.L2Loss()
    losses = []
    for _ in range(6):
        with autograd.record():
            loss = l2(net(data, rois), target)
        loss.backward()
        trainer.step(data.shape[0])
        losses.append(float(loss.mean().asscalar()))
    assert losses[-1] < losses[0] * 0.9, losses
    assert np.abs(net.conv.weight.grad().asnumpy()).sum() > 0
