"""The default door (mx_roi.ext.door): ``mx_roi.nd`` / ``sym`` / Gluon take the native op
``mx_roi_<Op>`` where the rule allows, and ``grad_req='add'`` stays right on every entry
point although MXNet 1.9.1 never passes ``req`` to an extension op.

Every ``add`` case pre-fills the gradients (7.25) and runs two backward passes: the data
gradient must equal ``(7.25 + g) + g`` in float32 exactly and the rois gradient stay 7.25,
where ``g`` is one ``write`` pass's gradient; every ``write`` case pre-fills 100 (garbage)
and must end at ``g``.  The same runs on the Custom door (``MX_ROI_NATIVE_OPS=0``) give
the same bits.  :func:`test_add_is_lost_without_the_protection` removes the protection
(``door_module.add_safe_inputs``) and sees the MXNet fact: the accumulated gradient overwritten.
"""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd
from mxnet.gluon import HybridBlock

import mx_roi
from mx_roi import ext
from mx_roi.ext import door as door_module

SHAPE = (2, 4, 9, 11)
ROIS = np.array([[0, 1, 1, 7, 6], [1, 0, 2, 10, 8], [-1, 0, 0, 3, 3]], np.float32)
PARAMS = {"ROIAlign": dict(pooled_size=(2, 3), spatial_scale=1.0, sample_ratio=2),
          "ROIPooling": dict(pooled_size=(2, 3), spatial_scale=1.0)}
PREFILL_ADD, PREFILL_WRITE = 7.25, 100.0
rng = np.random.default_rng(7)
DATA = rng.standard_normal(SHAPE).astype(np.float32)
OUT_GRAD = rng.standard_normal((3, 4, 2, 3)).astype(np.float32)

pytestmark = pytest.mark.skipif(ext.unavailable_reason() != "",
                                 reason="the extension library cannot be built here")


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    """The native door needs the op's CPU backend to be ``native`` (the default)."""


def _fill(grad, value):
    grad[:] = value


def _leaf_inputs_run(call, req, prefill, passes):
    """``call(x, r)`` on leaf NDArrays with gradient buffers (``req``, pre-filled)."""
    x, r = mx.nd.array(DATA), mx.nd.array(ROIS)
    x.attach_grad(grad_req=req)
    r.attach_grad(grad_req=req)
    _fill(x.grad, prefill)
    _fill(r.grad, prefill)
    for _ in range(passes):
        with autograd.record():
            y = call(x, r)
        y.backward(mx.nd.array(OUT_GRAD))
    return x.grad.asnumpy(), r.grad.asnumpy()


def nd_entry(op, req, prefill, passes):
    return _leaf_inputs_run(lambda x, r: getattr(mx_roi.nd, op)(x, r, **PARAMS[op]),
                            req, prefill, passes)


def _bind_entry(op, req, prefill, passes, as_dict):
    s = getattr(mx_roi.sym, op)(mx.sym.var("data"), mx.sym.var("rois"), **PARAMS[op])
    reqs = {"data": req, "rois": req} if as_dict else req
    exe = s.simple_bind(mx.cpu(), data=SHAPE, rois=ROIS.shape, grad_req=reqs)
    exe.arg_dict["data"][:] = DATA
    exe.arg_dict["rois"][:] = ROIS
    _fill(exe.grad_dict["data"], prefill)
    _fill(exe.grad_dict["rois"], prefill)
    for _ in range(passes):
        exe.forward(is_train=True)
        exe.backward(mx.nd.array(OUT_GRAD))
    return exe.grad_dict["data"].asnumpy(), exe.grad_dict["rois"].asnumpy()


def bind_entry(op, req, prefill, passes):
    return _bind_entry(op, req, prefill, passes, as_dict=False)


def bind_dict_entry(op, req, prefill, passes):
    return _bind_entry(op, req, prefill, passes, as_dict=True)


def module_entry(op, req, prefill, passes):
    """The feature map is a parameter of the Module (``grad_req`` applies to it), the
    rois its data input (``inputs_need_grad``)."""
    s = getattr(mx_roi.sym, op)(mx.sym.var("feat", shape=SHAPE, dtype="float32"), mx.sym.var("rois"),
                                **PARAMS[op])
    mod = mx.mod.Module(s, data_names=["rois"], label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("rois", ROIS.shape)], inputs_need_grad=True, grad_req=req)
    mod.init_params(arg_params={"feat": mx.nd.array(DATA)})
    grads = mod._exec_group.execs[0].grad_dict
    _fill(grads["feat"], prefill)
    _fill(grads["rois"], prefill)
    batch = mx.io.DataBatch([mx.nd.array(ROIS)])
    for _ in range(passes):
        mod.forward(batch, is_train=True)
        mod.backward([mx.nd.array(OUT_GRAD)])
    return grads["feat"].asnumpy(), grads["rois"].asnumpy()


def _gluon_inputs_entry(op, req, prefill, passes, hybridize):
    block = getattr(mx_roi.gluon, op)(**PARAMS[op])
    if hybridize:
        block.hybridize()
    return _leaf_inputs_run(block, req, prefill, passes)


def gluon_entry(op, req, prefill, passes):
    return _gluon_inputs_entry(op, req, prefill, passes, hybridize=False)


def gluon_hybrid_entry(op, req, prefill, passes):
    return _gluon_inputs_entry(op, req, prefill, passes, hybridize=True)


class _FeatureNet(HybridBlock):
    """The feature map as a Parameter of the block (its ``grad_req``), fed straight into
    the op."""

    def __init__(self, op, req):
        super().__init__()
        with self.name_scope():
            self.feat = self.params.get("feat", shape=SHAPE, grad_req=req)
            self.pool = getattr(mx_roi.gluon, op)(**PARAMS[op])

    def hybrid_forward(self, F, rois, feat):  # pylint: disable=arguments-differ
        return self.pool(feat, rois)


def _gluon_param_entry(op, req, prefill, passes, hybridize):
    net = _FeatureNet(op, req)
    net.initialize()
    net.feat.set_data(mx.nd.array(DATA))
    if hybridize:
        net.hybridize()
    r = mx.nd.array(ROIS)
    r.attach_grad(grad_req=req)
    _fill(net.feat.grad(), prefill)
    _fill(r.grad, prefill)
    for _ in range(passes):
        with autograd.record():
            y = net(r)
        y.backward(mx.nd.array(OUT_GRAD))
    return net.feat.grad().asnumpy(), r.grad.asnumpy()


def gluon_param_entry(op, req, prefill, passes):
    return _gluon_param_entry(op, req, prefill, passes, hybridize=False)


def gluon_param_hybrid_entry(op, req, prefill, passes):
    return _gluon_param_entry(op, req, prefill, passes, hybridize=True)


ENTRIES = [nd_entry, bind_entry, bind_dict_entry, module_entry, gluon_entry,
           gluon_hybrid_entry, gluon_param_entry, gluon_param_hybrid_entry]


def single_gradient(entry, op):
    """One ``write`` pass over a garbage-filled gradient: ``(data grad, rois grad)``."""
    return entry(op, "write", PREFILL_WRITE, 1)


@pytest.mark.parametrize("op", list(PARAMS))
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_add_accumulates_and_write_overwrites(entry, op, door):
    g, g_rois = single_gradient(entry, op)
    assert np.abs(g).sum() > 0 and np.array_equal(g_rois, np.zeros_like(g_rois))
    added, added_rois = entry(op, "add", PREFILL_ADD, 2)
    want = (np.float32(PREFILL_ADD) + g) + g  # MXNet's two in-place adds, in float32
    np.testing.assert_array_equal(added, want)
    np.testing.assert_array_equal(added_rois, np.full_like(g_rois, PREFILL_ADD))
    written, written_rois = entry(op, "write", PREFILL_WRITE, 2)
    np.testing.assert_array_equal(written, g)
    np.testing.assert_array_equal(written_rois, g_rois)


@pytest.mark.parametrize("op", list(PARAMS))
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_both_doors_give_the_same_bits(entry, op, monkeypatch):
    monkeypatch.delenv(door_module.ENV, raising=False)
    native = entry(op, "add", PREFILL_ADD, 2)
    monkeypatch.setenv(door_module.ENV, "0")
    monkeypatch.setenv("MX_ROI_LIBRARY_CALLS", "0")  # (the checked path: not the library)
    custom = entry(op, "add", PREFILL_ADD, 2)
    for a, b in zip(native, custom):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_add_is_lost_without_the_protection(entry, monkeypatch):
    """The planted bug: no add_safe / BlockGrad.  MXNet then hands the op the
    accumulating buffer and the op writes it (the prefill and the first pass are lost)."""
    monkeypatch.delenv(door_module.ENV, raising=False)
    monkeypatch.setattr(door_module, "add_safe_inputs", lambda op, F, inputs, name=None: inputs)
    g, _ = single_gradient(entry, "ROIAlign")
    added, added_rois = entry("ROIAlign", "add", PREFILL_ADD, 2)
    np.testing.assert_array_equal(added, g)  # written, not added
    np.testing.assert_array_equal(added_rois, np.zeros_like(added_rois))


# ---- which door --------------------------------------------------------------------------

def _op(name, **kw):
    cls = mx_roi.registry.REGISTERED[name]
    return cls(cls.param_cls.from_kwargs(**dict(PARAMS.get(name, {}), **kw)))


def _nodes(symbol):
    return [n["op"] for n in json.loads(symbol.tojson())["nodes"]]


def test_the_rule(monkeypatch):
    monkeypatch.delenv(door_module.ENV, raising=False)
    x = mx.nd.array(DATA)
    assert door_module.choose(_op("ROIAlign"), mx.nd, [x]) == ""
    assert door_module.choose(_op("ROIAlign"), mx.sym) == ""  # the CPU wheel has no CUDA
    for backend in ("numpy", "emulated-cuda"):
        monkeypatch.setenv("MX_ROI_BACKEND", backend)
        assert door_module.choose(_op("ROIAlign"), mx.nd, [x]) == f"the CPU backend is '{backend}'"
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    assert door_module.choose(_op("ROIAlign"), mx.nd, [x]) == ""
    monkeypatch.setenv(door_module.ENV, "0")
    assert door_module.choose(_op("ROIAlign"), mx.nd, [x]) == "MX_ROI_NATIVE_OPS=0"
    monkeypatch.delenv(door_module.ENV)

    class FakeGpuArray:
        context = mx.Context("gpu", 0)
    assert door_module.choose(_op("ROIAlign"), mx.nd, [FakeGpuArray()]) == \
        "a GPU context (the native GPU path is opt-in)"
    monkeypatch.setitem(door_module._STATE, "cuda_build", True)
    assert door_module.choose(_op("ROIAlign"), mx.sym) == \
        "a symbol on an MXNet built with CUDA may run on a GPU"


def test_ops_without_a_section_keep_custom_by_the_registered_names(monkeypatch):
    monkeypatch.delenv(door_module.ENV, raising=False)
    for name in mx_roi.OP_TYPES:
        has = door_module.native_op(name) in ext.loaded_ops()
        s = getattr(mx_roi.sym, name)(mx.sym.var("data"), mx.sym.var("rois"),
                                      **_sym_params(name))
        assert (door_module.native_op(name) in _nodes(s)) == has, (name, _nodes(s))
        assert ("Custom" in _nodes(s)) == (not has), (name, _nodes(s))
    assert {"mx_roi_ROIAlign", "mx_roi_ROIPooling", "mx_roi_PSROIPooling",
            "mx_roi_PSROIAlign"} <= ext.loaded_ops()
    monkeypatch.setattr(ext, "_STATE", dict(ext._STATE, ops=frozenset({"mx_roi_noop"})))
    s = mx_roi.sym.ROIAlign(mx.sym.var("data"), mx.sym.var("rois"), **PARAMS["ROIAlign"])
    assert "Custom" in _nodes(s) and "mx_roi_ROIAlign" not in _nodes(s)


def _sym_params(name):
    return dict(mx_roi.registry.REGISTERED[name].selftest_cases[0])


def test_add_protection_only_where_add_can_reach(monkeypatch):
    """A variable / a leaf with a gradient gets add_safe (data) and BlockGrad (rois); an
    input computed by another op gets nothing (no copy)."""
    monkeypatch.delenv(door_module.ENV, raising=False)
    p = PARAMS["ROIAlign"]
    leaf = mx_roi.sym.ROIAlign(mx.sym.var("data"), mx.sym.var("rois"), name="pool", **p)
    assert _nodes(leaf) == ["null", "_copy", "null", "BlockGrad", "mx_roi_ROIAlign"]
    assert leaf.get_internals().list_outputs()[1] == "pool_data_add_safe_output"
    inner = mx_roi.sym.ROIAlign(mx.sym.relu(mx.sym.var("data")), mx.sym.var("rois") * 1,
                                **p)
    assert _nodes(inner) == ["null", "relu", "null", "_mul_scalar", "mx_roi_ROIAlign"]
    x, r = mx.nd.array(DATA), mx.nd.array(ROIS)
    calls = []
    real = mx.nd.mx_roi_ROIAlign
    monkeypatch.setattr(mx.nd, "mx_roi_ROIAlign",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    mx_roi.nd.ROIAlign(x, r, **p)  # not recording: nothing to protect
    assert calls[-1][0] is x and calls[-1][1] is r
    x.attach_grad()
    with autograd.record():
        mx_roi.nd.ROIAlign(x, r, **p)
    assert calls[-1][0] is not x and calls[-1][1] is r  # rois have no gradient buffer
    with autograd.record():
        y = x * 1
        mx_roi.nd.ROIAlign(y, r, **p)
    assert calls[-1][0] is y


def test_custom_stays_custom(monkeypatch):
    monkeypatch.delenv(door_module.ENV, raising=False)
    s = mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"), op_type="ROIAlign",
                      pooled_size=(2, 2), spatial_scale=1.0)
    assert "Custom" in _nodes(s) and "mx_roi_ROIAlign" not in _nodes(s)


def test_native_nodes_have_no_onednn_guard(monkeypatch):
    monkeypatch.delenv(door_module.ENV, raising=False)
    s = mx_roi.sym.ROIAlign(mx.sym.relu(mx.sym.var("data")), mx.sym.relu(mx.sym.var("rois")),
                            **PARAMS["ROIAlign"])
    assert _nodes(s) == ["null", "relu", "null", "relu", "mx_roi_ROIAlign"]


# ---- errors on the native door -----------------------------------------------------------

BAD_ROIS = np.array([[0, 1, 1, 7, 6], [2, 0, 2, 10, 8]], np.float32)  # batch index 2 of 2
BAD_LINE = ("[0] ROIAlign: rois[1] has batch index 2 but data holds only 2 image(s) "
            "(valid: 0..1; a negative index marks a padding roi)")


def _nd_call(rois, train):
    x = mx.nd.array(DATA)
    x.attach_grad()
    with autograd.record(train_mode=train):
        y = mx_roi.nd.ROIAlign(x, mx.nd.array(rois), **PARAMS["ROIAlign"])
    if train:
        y.backward(mx.nd.ones_like(y))
    return y.asnumpy()


_BLOCKS = {}


def _hybrid_call(rois, train):
    """One hybridized block per door, kept across the bad calls (its cached graph)."""
    block = _BLOCKS.get(door_module.native_enabled())
    if block is None:
        block = _BLOCKS[door_module.native_enabled()] = mx_roi.gluon.ROIAlign(
            **PARAMS["ROIAlign"])
        block.hybridize()
    x = mx.nd.array(DATA)
    x.attach_grad()
    with autograd.record(train_mode=train):
        y = block(x, mx.nd.array(rois))
    if train:
        y.backward(mx.nd.ones_like(y))
    return y.asnumpy()


def _bind_call(rois, train):
    s = mx_roi.sym.ROIAlign(mx.sym.var("data"), mx.sym.var("rois"), **PARAMS["ROIAlign"])
    exe = s.simple_bind(mx.cpu(), data=SHAPE, rois=rois.shape)
    exe.arg_dict["data"][:] = DATA
    exe.arg_dict["rois"][:] = rois
    out = exe.forward(is_train=train)[0]
    if train:
        exe.backward(mx.nd.ones_like(out))
    return out.asnumpy()


@pytest.mark.parametrize("train", [False, True], ids=["forward", "training-step"])
@pytest.mark.parametrize("call", [_nd_call, _hybrid_call, _bind_call],
                         ids=lambda c: c.__name__)
def test_native_door_bad_call_repeated_then_a_good_one(call, train, monkeypatch):
    """Ten bad calls through the native door: each an MXNetError naming the native op
    and carrying the op's one line (the Custom path's text), the same every time; then
    a good call gives the Custom door's bits."""
    monkeypatch.delenv(door_module.ENV, raising=False)
    assert door_module.choose(_op("ROIAlign"), mx.sym) == ""
    for _ in range(10):
        with pytest.raises(mx.base.MXNetError) as info:
            call(BAD_ROIS, train)
        lines = [x.strip() for x in str(info.value).splitlines()]
        assert [x for x in lines if x.startswith("[")] == [BAD_LINE], lines
        assert "for custom operator 'mx_roi_ROIAlign'" in str(info.value)
    good = call(ROIS, train)
    monkeypatch.setenv(door_module.ENV, "0")
    np.testing.assert_array_equal(good, call(ROIS, train))


@pytest.mark.parametrize("addto", ["0", "1"])
def test_an_input_computed_by_another_op_needs_no_protection(addto, monkeypatch):
    """A conv output feeding the op and a second consumer: its gradient is an
    intermediate buffer that MXNet sums (with ``MXNET_EXEC_ENABLE_ADDTO=1`` in place);
    no add_safe there, and both doors give the same weight and data gradients."""
    monkeypatch.setenv("MXNET_EXEC_ENABLE_ADDTO", addto)
    w = np.random.default_rng(3).standard_normal((4, 4, 3, 3)).astype(np.float32)

    def grads():
        d, r, wv = mx.sym.var("data"), mx.sym.var("rois"), mx.sym.var("w")
        conv = mx.sym.Convolution(d, wv, num_filter=4, kernel=(3, 3), pad=(1, 1),
                                  no_bias=True)
        pooled = mx_roi.sym.ROIAlign(conv, r, **PARAMS["ROIAlign"])
        if door_module.native_enabled():  # (the Custom door adds its oneDNN guard)
            assert _nodes(pooled) == ["null", "null", "Convolution", "null", "BlockGrad",
                                      "mx_roi_ROIAlign"]  # (rois: a variable)
        out = mx.sym.Group([mx.sym.sum(pooled), mx.sym.sum(conv * 2)])
        exe = out.simple_bind(mx.cpu(), data=SHAPE, rois=ROIS.shape, w=w.shape)
        exe.arg_dict["data"][:] = DATA
        exe.arg_dict["rois"][:] = ROIS
        exe.arg_dict["w"][:] = w
        exe.forward(is_train=True)
        exe.backward([mx.nd.ones(1), mx.nd.ones(1)])
        x = mx.nd.array(DATA)
        x.attach_grad()
        with autograd.record():
            c = mx.nd.Convolution(x, mx.nd.array(w), num_filter=4, kernel=(3, 3),
                                  pad=(1, 1), no_bias=True)
            y = mx_roi.nd.ROIAlign(c, mx.nd.array(ROIS), **PARAMS["ROIAlign"]).sum() + \
                (c * 2).sum()
        y.backward()
        return exe.grad_dict["w"].asnumpy(), exe.grad_dict["data"].asnumpy(), \
            x.grad.asnumpy()

    monkeypatch.delenv(door_module.ENV, raising=False)
    native = grads()
    monkeypatch.setenv(door_module.ENV, "0")
    custom = grads()
    for a, b in zip(native, custom):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
