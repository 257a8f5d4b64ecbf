"""The imperative call as a cached graph (mx_roi.mxpatch._cached_call, issue 18).

A small imperative call of our ops runs as a ``CachedOp`` (``Custom``, and while autograd
records with oneDNN on, the ``slice_axis`` output guard); a large recorded one keeps
``mx.nd.Custom`` and the copy-free slice view.  Both must give the same outputs and
gradients as each other, and mixing them -- and foreign ``Custom`` ops -- in one recorded
step must not break a backward (MXNet 1.9.1 applies the last recorded ``Custom`` node's
dependency list to every ``Custom`` backward).
"""
import mxnet as mx
import numpy as np
import pytest

import mx_roi
from mx_roi import mxpatch, onednn

CASES = [("ROIPooling", dict(pooled_size=(3, 2), spatial_scale=0.5)),
         ("ROIAlign", dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2)),
         ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, pool_mode="max")),
         ("PSROIPooling", dict(pooled_size=2, output_dim=3, spatial_scale=0.5)),
         ("PSROIAlign", dict(pooled_size=(2, 2), output_dim=3, spatial_scale=0.5,
                             sample_ratio=2))]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]


@pytest.fixture(autouse=True)
def _custom_door(custom_door):
    """Pinned to the Custom door: the cached graph under test is the Custom door's
    imperative path (``mxpatch._cached_call``); a native call has no such graph."""

ROIS = np.array([[0, 1, 2, 15, 14], [1, 0, 0, 20, 17], [0, 6, 3, 9, 12],
                 [1, 3.5, 2.2, 11.7, 16.1]], np.float32)


def _inputs(seed=0, channels=12):
    rng = np.random.RandomState(seed)
    return rng.standard_normal((2, channels, 9, 11)).astype(np.float32)


def _step(name, kwargs, data_np, grad_req="write", seed=1):
    """One recorded fwd+bwd through mx_roi.nd: (output, data gradient).  With
    grad_req='add' the gradient buffer starts at 5 and gets two backward passes."""
    data = mx.nd.array(data_np)
    data.attach_grad(grad_req=grad_req)
    if grad_req == "add":
        data.grad[:] = 5
    rois = mx.nd.array(ROIS)
    passes = 2 if grad_req == "add" else 1
    for _ in range(passes):
        with mx.autograd.record():
            out = getattr(mx_roi.nd, name)(data, rois, **kwargs)
        head = mx.nd.array(np.random.RandomState(seed).standard_normal(out.shape))
        out.backward(head)
    return out.asnumpy(), data.grad.asnumpy()


@pytest.fixture
def cached_calls(monkeypatch):
    """Counts the calls that ran as a cached graph."""
    calls = []
    real = mxpatch._cached_op

    def spy(op_cls, params, guard):
        cop = real(op_cls, params, guard)
        calls.append((op_cls.name, guard, cop is not None))
        return cop
    monkeypatch.setattr(mxpatch, "_cached_op", spy)
    return calls


@pytest.mark.parametrize("grad_req", ["write", "add"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_cached_and_plain_calls_agree(name, kwargs, grad_req, cached_calls, monkeypatch):
    data = _inputs()
    out_c, grad_c = _step(name, kwargs, data, grad_req)
    assert cached_calls and all(ok for _, _, ok in cached_calls)
    assert all(guard == onednn.onednn_enabled() for _, guard, _ in cached_calls)
    # no output is small enough now: the plain mx.nd.Custom path with the slice view
    monkeypatch.setattr(mxpatch, "CACHED_GUARD_MAX_BYTES", 0)
    n = len(cached_calls)
    out_p, grad_p = _step(name, kwargs, data, grad_req)
    assert len(cached_calls) == n or not onednn.onednn_enabled()
    np.testing.assert_array_equal(out_c, out_p)
    np.testing.assert_array_equal(grad_c, grad_p)
    # and not recording: the forward alone, cached
    plain = getattr(mx_roi.nd, name)(mx.nd.array(data), mx.nd.array(ROIS), **kwargs)
    np.testing.assert_array_equal(plain.asnumpy(), out_c)


def test_large_recorded_output_keeps_the_slice_view(monkeypatch, cached_calls):
    if not onednn.onednn_enabled():
        pytest.skip("the output guard exists only with oneDNN on")
    name, kwargs = CASES[0]
    data = _inputs()
    nbytes = 4 * 12 * 3 * 2 * 4  # (R, C, P, Q) float32
    monkeypatch.setattr(mxpatch, "CACHED_GUARD_MAX_BYTES", nbytes - 1)  # one byte short
    _step(name, kwargs, data)
    assert cached_calls == []
    monkeypatch.setattr(mxpatch, "CACHED_GUARD_MAX_BYTES", nbytes)      # fits exactly
    _step(name, kwargs, data)
    assert [c[:2] for c in cached_calls] == [(name, True)]


# a foreign Custom op that declares a different backward dependency list
FOREIGN = "mx_roi_test_cached_foreign"


class _Scale(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], in_data[0] * 2)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        self.assign(in_grad[0], req[0], out_grad[0] * 2)


@mx.operator.register(FOREIGN)
class _ScaleProp(mx.operator.CustomOpProp):
    def __init__(self):
        super().__init__(need_top_grad=True)

    def list_arguments(self):
        return ["data"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def declare_backward_dependency(self, out_grad, in_data, out_data):
        return [out_grad[0]]

    def create_operator(self, ctx, shapes, dtypes):
        return _Scale()


# (not "foreign", "cached": the list our record leaves names an input the foreign op
# did not declare, and MXNet fails its backward -- on the plain path as well, as before
# the cached call existed; MXNet 1.9.1 has one list for every Custom op)
SEQUENCES = [("cached", "plain"), ("plain", "cached"), ("cached", "foreign"),
             ("cached", "plain", "foreign")]


@pytest.mark.parametrize("sequence", SEQUENCES, ids=["-".join(s) for s in SEQUENCES])
def test_mixed_paths_and_foreign_ops_in_one_step(sequence, monkeypatch):
    """Cached calls, plain calls (the big-output path) and a foreign Custom op recorded
    in one step, in several orders: every backward runs and each gradient is the one
    its call gives alone.  (A cached node is handed only its declared arrays: a
    dependency list left by a later record that names one it lacks broke it.)"""
    data_np = _inputs(3)
    cases = {"cached": CASES[1], "plain": CASES[0]}
    alone = {kind: _step(*cases[kind], data_np)[1] for kind in cases}
    real = mxpatch.CACHED_GUARD_MAX_BYTES
    rois = mx.nd.array(ROIS)
    arrays = {kind: mx.nd.array(data_np) for kind in sequence}
    x = arrays.get("foreign")
    if x is not None:
        x = arrays["foreign"] = mx.nd.array(np.ones((3, 4), np.float32))
    for a in arrays.values():
        a.attach_grad()
    outs = []
    with mx.autograd.record():
        for kind in sequence:
            if kind == "foreign":
                outs.append(mx.nd.Custom(x, op_type=FOREIGN))
                continue
            monkeypatch.setattr(mxpatch, "CACHED_GUARD_MAX_BYTES",
                                real if kind == "cached" else 0)
            name, kwargs = cases[kind]
            outs.append(getattr(mx_roi.nd, name)(arrays[kind], rois, **kwargs))
    heads = [mx.nd.ones(o.shape) if kind == "foreign" else
             mx.nd.array(np.random.RandomState(1).standard_normal(o.shape))
             for kind, o in zip(sequence, outs)]
    mx.autograd.backward(outs, heads)
    mx.nd.waitall()
    for kind in sequence:
        got = arrays[kind].grad.asnumpy()
        want = np.full((3, 4), 2.0, np.float32) if kind == "foreign" else alone[kind]
        np.testing.assert_array_equal(got, want)


def test_cached_call_leaves_the_dependency_list_a_plain_call_leaves(monkeypatch):
    """What a recorded call leaves in MXNet's process-wide backward dependency list
    (read by every Custom node's backward) is the same on both paths -- also when the
    cached graph exists already (only its first recorded call declares the list)."""
    import mxnet.operator as operator
    data, rois = mx.nd.array(_inputs()), mx.nd.array(ROIS)
    with mx.autograd.record():  # the cached graph, made and declared
        mx_roi.nd.ROIAlign(data, rois, (2, 2), 0.5).wait_to_read()
    left = {}
    for path, limit in (("cached", mxpatch.CACHED_GUARD_MAX_BYTES), ("plain", 0)):
        monkeypatch.setattr(mxpatch, "CACHED_GUARD_MAX_BYTES", limit)
        if path == "plain":
            monkeypatch.setattr(mxpatch, "_cached_call", lambda *a: None)
        with mx.autograd.record():
            mx.nd.Custom(mx.nd.ones((2, 2)), op_type=FOREIGN)  # leaves its own list
            mx_roi.nd.ROIAlign(data, rois, (2, 2), 0.5).wait_to_read()
        left[path] = set(operator._registry.result_deps)
    assert left["cached"] == left["plain"] == {0, 1, 2, 3}


@pytest.mark.parametrize("imperative", ["cached", "plain"])
def test_hybridized_block_after_imperative_calls(imperative, monkeypatch):
    """A hybridized block's Custom node (a graph node: only declared arrays) and
    imperative recorded calls of ours (cached, or plain ``mx.nd.Custom``, whose record
    leaves the dependency list in another numbering) in the same step: each gradient is
    the one its call gives alone."""
    if imperative == "plain":
        monkeypatch.setattr(mxpatch, "CACHED_GUARD_MAX_BYTES", 0)
        monkeypatch.setattr(mxpatch, "_cached_call", lambda *a: None)
    data_np = _inputs(4)
    block = mx_roi.gluon.ROIAlign(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=2)
    block.hybridize()
    rois = mx.nd.array(ROIS)

    def grads(parts):
        arrays = [mx.nd.array(data_np) for _ in parts]
        for a in arrays:
            a.attach_grad()
        with mx.autograd.record():
            outs = [f(a) for f, a in zip(parts, arrays)]
        mx.autograd.backward(outs, [mx.nd.ones(o.shape) for o in outs])
        return [a.grad.asnumpy() for a in arrays]

    parts = [lambda a: block(a, rois),
             lambda a: mx_roi.nd.ROIPooling(a, rois, (2, 2), 0.5),
             lambda a: mx_roi.nd.PSROIPooling(a, rois, output_dim=3, pooled_size=2,
                                              spatial_scale=0.5)]
    mixed = grads(parts)
    for part, g in zip(parts, mixed):
        np.testing.assert_array_equal(g, grads([part])[0])


def test_cache_is_per_thread_and_bounded(monkeypatch):
    import threading
    monkeypatch.setattr(mxpatch, "CACHED_MAX", 3)
    data, rois = mx.nd.array(_inputs()), mx.nd.array(ROIS)
    for scale in (0.5, 0.25, 0.125, 0.0625, 0.03125):
        mx_roi.nd.ROIPooling(data, rois, (2, 2), scale).wait_to_read()
    assert 1 <= len(mxpatch._CACHED.ops) <= 3
    seen = []

    def other():
        mx_roi.nd.ROIPooling(data, rois, (2, 2), 0.5).wait_to_read()
        seen.append(len(mxpatch._CACHED.ops))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [1]


def test_json_params_of_a_plain_custom_call_are_cached_too(cached_calls):
    """``mx.nd.Custom(op_type='ROIPooling', ...)`` with string parameters (the patched
    Custom) takes the same path and gives the function's result."""
    data, rois = mx.nd.array(_inputs()), mx.nd.array(ROIS)
    a = mx.nd.Custom(data, rois, op_type="ROIPooling", pooled_size="(2, 2)",
                     spatial_scale="0.5")
    b = mx_roi.nd.ROIPooling(data, rois, (2, 2), 0.5)
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    assert len(cached_calls) == 2
