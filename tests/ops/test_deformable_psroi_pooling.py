"""DeformablePSROIPooling against ``mx.nd.contrib.DeformablePSROIPooling`` (the oracle:
MXNet's CPU op, never our code), through every entry point, on the backend the suite
runs (``MX_ROI_BACKEND``).  float32/64: outputs and both gradients bit-equal; float16:
ours computes in float32 (the built-in in half precision, op by op), so it equals the
float32 op on the same inputs rounded to float16, bit for bit."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

import mx_roi
from tests.ops.base import CTX

OP = "DeformablePSROIPooling"
GARBAGE = 7.25  # gradient buffers start here: write must overwrite, add must add

# (params, offset classes K); every case has rois off the map, tiny, reversed and huge
CASES = [
    # R-FCN head: per-class offsets (K = output_dim), part_size != pooled_size
    (dict(spatial_scale=0.5, output_dim=3, group_size=3, pooled_size=3, part_size=2,
          sample_per_part=2, trans_std=0.3), 3),
    # class-agnostic offsets (K = 1), group_size 1 (deformable RoI pooling), 4 samples
    (dict(spatial_scale=0.25, output_dim=4, group_size=1, pooled_size=2, part_size=3,
          sample_per_part=4, trans_std=0.9), 1),
    # K = 2 classes of 2 channels, group grid != pooled grid, big offsets (off the map)
    (dict(spatial_scale=1.0, output_dim=4, group_size=2, pooled_size=3, part_size=0,
          sample_per_part=3, trans_std=1.0), 2),
    # no_trans: inputs data, rois only (the offset branch of Deformable-ConvNets)
    (dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=2, sample_per_part=2,
          no_trans=True), 0),
    # defaults: part_size 0, one sample, trans_std 0
    (dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=2), 1),
    # Deformable R-FCN's scores: one class per channel, part = pooled (the data gradient's
    # pass writes the offsets' gradient too)
    (dict(spatial_scale=0.5, output_dim=2, group_size=3, pooled_size=3, sample_per_part=2,
          trans_std=0.4), 2),
]
IDS = ["rfcn-K3-part2", "agnostic-K1", "K2-offmap", "no_trans", "defaults", "rfcn-fused"]


def problem(params, K, dtype, seed=0, N=2, H=7, W=9, R=None, rng=None):
    rng = rng or np.random.default_rng(seed)
    D, G = params["output_dim"], params["group_size"]
    s = params["spatial_scale"]
    x = rng.standard_normal((N, D * G * G, H, W)).astype(dtype)
    boxes = [(-30, -20, -2, -1), (0, 0, W / s, H / s), (3, 4, 3, 4), (9, 8, 2, 1),
             (-50, -40, 3 * W / s, 3 * H / s), (W / s - 1, H / s - 1, W / s + 9, H / s + 3)]
    n_rand = 6 if R is None else max(R - len(boxes), 0)
    for _ in range(n_rand):
        x1, y1 = rng.uniform(-0.3 * W / s, W / s), rng.uniform(-0.3 * H / s, H / s)
        boxes.append((x1, y1, x1 + rng.uniform(0, 0.8 * W / s), y1 + rng.uniform(0, H / s)))
    boxes = np.array(boxes[:R] if R is not None else boxes, np.float64)
    rois = np.concatenate([rng.integers(0, N, (len(boxes), 1)), boxes], 1).astype(dtype)
    part = params.get("part_size") or params["pooled_size"]
    P = params["pooled_size"]
    trans = rng.uniform(-1.5, 1.5, (len(rois), 2 * K, part, part)).astype(dtype) if K else None
    grad = rng.standard_normal((len(rois), D, P, P)).astype(dtype)
    return x, rois, trans, grad


def run(fn, params, x, rois, trans, grad, req="write"):
    """``(out, data grad, trans grad or None, rois grad)`` of ``fn`` (an mx.nd function
    taking data, rois[, trans]) with gradient buffers pre-filled with garbage; ours on the
    suite's context (``MX_ROI_TEST_CTX``), the built-in on the CPU."""
    ctx = mx.cpu() if fn is builtin else CTX
    ins = [mx.nd.array(a, dtype=a.dtype, ctx=ctx) for a in (x, rois) + ((trans,) if trans is not None
                                                               else ())]
    for a in ins:
        a.attach_grad(grad_req=req)
        a.grad[:] = GARBAGE
    with autograd.record():
        y = fn(*ins, **params)
    y.backward(mx.nd.array(grad, dtype=grad.dtype, ctx=ctx))
    g = [a.grad.asnumpy() for a in ins]
    return y.asnumpy(), g[0], (g[2] if trans is not None else None), g[1]


def builtin(*args, **params):
    params = {k: v for k, v in params.items() if k != "deterministic"}
    return mx.nd.contrib.DeformablePSROIPooling(*args, **params)


def custom(*args, **params):
    return mx.nd.Custom(*args, op_type=OP, **params)


def assert_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    np.testing.assert_array_equal(a, b, err_msg=what)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("entry", ["nd", "custom"])
def test_bit_equal_to_builtin(case, dtype, entry):
    params, K = case
    x, rois, trans, grad = problem(params, K, dtype)
    fn = mx_roi.nd.DeformablePSROIPooling if entry == "nd" else custom
    got, want = run(fn, params, x, rois, trans, grad), run(builtin, params, x, rois, trans,
                                                           grad)
    for name, a, b in zip(("output", "data grad", "trans grad", "rois grad"), got, want):
        if b is not None:
            assert_bits(a, b, name)
    assert np.abs(got[0]).max() > 0 and np.abs(got[1]).max() > 0
    if trans is not None and params.get("trans_std", 0) > 0:
        assert np.abs(got[2]).max() > 0


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:4], ids=IDS[:2] + IDS[3:4])
def test_float16_is_float32_rounded(case):
    params, K = case
    x, rois, trans, grad = problem(params, K, np.float16)
    got = run(mx_roi.nd.DeformablePSROIPooling, params, x, rois, trans, grad)
    up = [None if a is None else a.astype(np.float32) for a in (x, rois, trans, grad)]
    want = run(mx_roi.nd.DeformablePSROIPooling, params, *up)
    for name, a, b in zip(("output", "data grad", "trans grad"), got, want):
        if b is not None:
            assert_bits(a, b.astype(np.float16), name)
    ref = run(builtin, params, x, rois, trans, grad)  # MXNet's half arithmetic: close only
    np.testing.assert_allclose(got[0].astype(np.float32), ref[0].astype(np.float32),
                               atol=0.05, rtol=0.05)


def test_grad_req_add_adds():
    params, K = CASES[0]
    x, rois, trans, grad = problem(params, K, np.float64)
    got = run(mx_roi.nd.DeformablePSROIPooling, params, x, rois, trans, grad, req="add")
    want = run(builtin, params, x, rois, trans, grad, req="write")
    np.testing.assert_allclose(got[1], want[1] + GARBAGE, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[2], want[2] + GARBAGE, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got[3], np.full(rois.shape, GARBAGE))


@pytest.mark.parametrize("no_trans", [False, True])
def test_padding_rois_and_no_rois(no_trans):
    params, K = CASES[3] if no_trans else CASES[0]
    x, rois, trans, grad = problem(params, K, np.float32)
    padded = rois.copy()
    padded[::3, 0] = -1
    got = run(mx_roi.nd.DeformablePSROIPooling, params, x, padded, trans, grad)
    keep = padded[:, 0] >= 0
    want = run(builtin, params, x, rois[keep], None if trans is None else trans[keep],
               grad[keep])
    assert_bits(got[0][keep], want[0], "output")
    assert not got[0][~keep].any()
    assert_bits(got[1], want[1], "data grad")
    if trans is not None:
        assert_bits(got[2][keep], want[2], "trans grad")
        assert not got[2][~keep].any()
    # R = 0: an empty output, zero gradients (written over the garbage)
    with mx.util.np_shape(True):  # zero-size arrays need NumPy shape semantics
        empty = run(mx_roi.nd.DeformablePSROIPooling, params, x, rois[:0],
                    None if trans is None else trans[:0], grad[:0])
    assert empty[0].shape == (0,) + grad.shape[1:]
    assert not empty[1].any()


def test_gluon_block_and_sym():
    params, K = CASES[2]
    x, rois, trans, grad = problem(params, K, np.float32)
    want = run(builtin, params, x, rois, trans, grad)
    block = mx_roi.gluon.DeformablePSROIPooling(**params)
    block.hybridize()
    got = run(lambda *a, **kw: block(*a), {}, x, rois, trans, grad)
    for name, a, b in zip(("output", "data grad", "trans grad"), got, want):
        assert_bits(a, b, name)
    # positional parameters in the built-in's order, after the three inputs
    order = [params[k] for k in ("spatial_scale", "output_dim", "group_size", "pooled_size",
                                 "part_size", "sample_per_part", "trans_std")]
    y = mx_roi.nd.DeformablePSROIPooling(*(mx.nd.array(a) for a in (x, rois, trans)), *order)
    assert_bits(y.asnumpy(), want[0], "positional")
    s = mx_roi.sym.DeformablePSROIPooling(mx.sym.var("data"), mx.sym.var("rois"),
                                          mx.sym.var("trans"), **params)
    assert s.list_arguments() == ["data", "rois", "trans"]
    assert mx_roi.sym.DeformablePSROIPooling(mx.sym.var("d"), mx.sym.var("r"),
                                             **CASES[3][0]).list_arguments() == ["d", "r"]


def deformable_rfcn(impl, num_classes=3, channels=8):
    """Deformable-ConvNets' R-FCN head (resnet_v1_101_rfcn_dcn / fpn_dcn style): an offset
    branch (DeformablePSROIPooling with no_trans=True -> FullyConnected -> reshape to
    (R, 2, 3, 3)) feeding the deformable position-sensitive pooling of the scores, and a
    class-agnostic deformable RoI pooling (group_size 1) of the features."""
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    feat = mx.sym.relu(mx.sym.Convolution(data, num_filter=channels, kernel=(3, 3),
                                          pad=(1, 1), name="conv"))
    cls = mx.sym.Convolution(feat, num_filter=num_classes * 9, kernel=(1, 1), name="cls")
    pool = impl.DeformablePSROIPooling(data=feat, rois=rois, group_size=1, pooled_size=3,
                                       sample_per_part=2, no_trans=True, part_size=3,
                                       output_dim=channels, spatial_scale=0.25, name="pool0")
    offset = mx.sym.reshape(mx.sym.FullyConnected(pool, num_hidden=3 * 3 * 2, name="off"),
                            shape=(-1, 2, 3, 3))
    feat_pool = impl.DeformablePSROIPooling(data=feat, rois=rois, trans=offset, group_size=1,
                                            pooled_size=3, sample_per_part=2, part_size=3,
                                            output_dim=channels, spatial_scale=0.25,
                                            trans_std=0.1, name="dpool")
    cls_offset_t = mx.sym.Convolution(feat, num_filter=2 * 9 * num_classes, kernel=(1, 1),
                                      name="cls_offset_t")
    cls_offset = impl.DeformablePSROIPooling(data=cls_offset_t, rois=rois, group_size=3,
                                             pooled_size=3, sample_per_part=2, no_trans=True,
                                             part_size=3, output_dim=2 * num_classes,
                                             spatial_scale=0.25, name="cls_offset")
    scores = impl.DeformablePSROIPooling(data=cls, rois=rois, trans=cls_offset, group_size=3,
                                         pooled_size=3, sample_per_part=2, no_trans=False,
                                         trans_std=0.1, output_dim=num_classes,
                                         spatial_scale=0.25, part_size=3, name="scores")
    return mx.sym.Group([mx.sym.mean(scores, axis=(2, 3)), mx.sym.sum(feat_pool)])


def test_deformable_rfcn_symbol_with_ours_swapped_in():
    """The same symbol built with mx.contrib.sym and with mx_roi.sym (ours swapped in by
    name): the same outputs and the same gradients of every weight after the shared
    feature map, bit for bit; the feature map feeds four nodes whose gradients MXNet sums
    in an order that depends on the graph (ours has guard nodes, and a Custom backward
    runs on its own thread), so the gradients before it (conv, data) agree to float32
    rounding (measured: <= 2e-6)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 10, 12)).astype(np.float32)
    rois = np.array([[0, 2, 3, 30, 25], [1, -8, -4, 20, 44], [1, 10, 12, 14, 13],
                     [0, 40, 30, 70, 60]], np.float32)
    outs = []
    for impl in (mx.contrib.sym, mx_roi.sym):
        sym = deformable_rfcn(impl)
        arg_shapes, _, _ = sym.infer_shape(data=x.shape, rois=rois.shape)
        args = {}
        for name, shape in zip(sym.list_arguments(), arg_shapes):
            if name == "data":
                args[name] = mx.nd.array(x)
            elif name == "rois":
                args[name] = mx.nd.array(rois)
            else:
                r = np.random.default_rng(abs(hash(name)) % 2 ** 32)
                args[name] = mx.nd.array(r.standard_normal(shape).astype(np.float32) * 0.3)
        grads = {k: mx.nd.full(v.shape, GARBAGE) for k, v in args.items() if k != "rois"}
        ex = sym.bind(mx.cpu(), args, args_grad=grads)
        ys = ex.forward(is_train=True)
        ex.backward([mx.nd.ones(y.shape) for y in ys])
        outs.append(([y.asnumpy() for y in ys], {k: g.asnumpy() for k, g in grads.items()}))
    (ya, ga), (yb, gb) = outs
    for a, b in zip(ya, yb):
        assert_bits(a, b, "output")
    assert set(ga) == set(gb)
    for k in ga:
        if k in ("data", "conv_weight", "conv_bias"):
            np.testing.assert_allclose(gb[k], ga[k], rtol=1e-5, atol=1e-5,
                                       err_msg=f"gradient of {k}")
        else:
            assert_bits(gb[k], ga[k], f"gradient of {k}")
    assert np.abs(ga["off_weight"]).max() > 0  # the offsets' gradient reached the FC


def test_mixed_two_and_three_input_ops_keep_every_backward():
    """MXNet 1.9.1 applies the last recorded Custom node's dependency list to every
    Custom backward: 2-input ops (PSROIPooling, ROIAlign) and this 3-input op recorded in
    any order, imperatively and in one graph, each give the built-in's gradients."""
    rng = np.random.default_rng(5)
    params, K = CASES[0]
    x, rois, trans, grad = problem(params, K, np.float32)
    ps = dict(spatial_scale=0.5, output_dim=3, pooled_size=3, group_size=3)
    al = dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=2)

    def step(lib):
        ins = [mx.nd.array(a) for a in (x, rois, trans)]
        for a in ins:
            a.attach_grad()
        with autograd.record():
            a = lib["ps"](ins[0], ins[1], **ps)
            b = lib["deform"](ins[0], ins[1], ins[2], **params)
            c = lib["align"](ins[0], ins[1], **al)
            loss = (a * 2).sum() + (b * 3).sum() + c.sum()
        loss.backward()
        return [g.grad.asnumpy() for g in (ins[0], ins[2])]

    ours = dict(ps=mx_roi.nd.PSROIPooling, deform=mx_roi.nd.DeformablePSROIPooling,
                align=mx_roi.nd.ROIAlign)
    theirs = dict(ps=mx.nd.contrib.PSROIPooling, deform=builtin, align=mx.nd.contrib.ROIAlign)
    want = step(theirs)
    for _ in range(3):
        got = step(ours)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert_bits(got[1], want[1], "trans grad")
    # one graph with all three, then the 2-input ops again imperatively
    d, r, t = mx.sym.var("data"), mx.sym.var("rois"), mx.sym.var("trans")
    sym = mx.sym.Group([mx_roi.sym.PSROIPooling(d, r, **ps),
                        mx_roi.sym.DeformablePSROIPooling(d, r, t, **params),
                        mx_roi.sym.ROIAlign(d, r, **al)])
    args = {"data": mx.nd.array(x), "rois": mx.nd.array(rois), "trans": mx.nd.array(trans)}
    grads = {"data": mx.nd.zeros(x.shape), "trans": mx.nd.zeros(trans.shape)}
    ex = sym.bind(mx.cpu(), args, args_grad=grads, grad_req={"data": "write",
                                                               "rois": "null",
                                                               "trans": "write"})
    ys = ex.forward(is_train=True)
    ex.backward([mx.nd.full(y.shape, w) for y, w in zip(ys, (2, 3, 1))])
    np.testing.assert_allclose(grads["data"].asnumpy(), want[0], rtol=1e-5, atol=1e-5)
    assert_bits(grads["trans"].asnumpy(), want[1], "trans grad (graph)")
    got = step(ours)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    del rng


# ---- bad inputs: a clear error naming the op and the problem, the next call works -------
def _good():
    params, K = CASES[0]
    return params, problem(params, K, np.float32)


BAD = [
    ("trans rows", lambda x, r, t, p: (x, r, t[:-1], p),
     r"DeformablePSROIPooling: trans must have shape \(R, 2 \* K, part_size, part_size\) = "
     r"\(12, 2 \* K, 2, 2\) with K >= 1 offset classes, got \(11, 6, 2, 2\)"),
    ("trans part", lambda x, r, t, p: (x, r, np.zeros((12, 6, 3, 3), np.float32), p),
     r"trans must have shape .* got \(12, 6, 3, 3\)"),
    ("trans odd", lambda x, r, t, p: (x, r, np.zeros((12, 5, 2, 2), np.float32), p),
     r"trans must have shape .* got \(12, 5, 2, 2\)"),
    ("classes", lambda x, r, t, p: (x, r, np.zeros((12, 4, 2, 2), np.float32), p),
     r"trans has K = 2 offset classes \(shape \(12, 4, 2, 2\)\) but output_dim = 3 is not a "
     r"multiple of K"),
    ("trans nan", lambda x, r, t, p: (x, r, np.where(np.arange(t.size).reshape(t.shape) == 9,
                                                     np.nan, t).astype(np.float32), p),
     r"DeformablePSROIPooling: trans\[0, 2, 0, 1\] is nan; offsets must be finite"),
    ("channels", lambda x, r, t, p: (x[:, :-1], r, t, p),
     r"DeformablePSROIPooling: data has 26 channels but output_dim \* group_size\^2 = "
     r"3 \* 3\^2 = 27 are required"),
    ("batch", lambda x, r, t, p: (x, np.where(np.arange(r.size).reshape(r.shape) == 5, 2,
                                              r).astype(np.float32), t, p),
     r"DeformablePSROIPooling: rois\[1\] has batch index 2 but data holds only 2 image"),
    ("rois nan", lambda x, r, t, p: (x, np.where(np.arange(r.size).reshape(r.shape) == 13,
                                                 np.inf, r).astype(np.float32), t, p),
     r"DeformablePSROIPooling: rois\[2\] has a NaN or infinite value"),
]


@pytest.mark.parametrize("entry", ["nd", "sym", "gluon"])
@pytest.mark.parametrize("what,make,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(what, make, match, entry):
    params, (x, rois, trans, grad) = _good()
    bx, br, bt, bp = make(x, rois, trans, params)
    with pytest.raises((MXNetError, ValueError), match=match):
        if entry == "nd":
            run(mx_roi.nd.DeformablePSROIPooling, bp, bx, br, bt, grad)
        elif entry == "gluon":
            block = mx_roi.gluon.DeformablePSROIPooling(**bp)
            block.hybridize()
            run(lambda *a, **kw: block(*a), {}, bx, br, bt, grad)
        else:
            s = mx_roi.sym.DeformablePSROIPooling(mx.sym.var("d"), mx.sym.var("r"),
                                                  mx.sym.var("t"), **bp)
            ex = s.bind(mx.cpu(), {"d": mx.nd.array(bx), "r": mx.nd.array(br),
                                   "t": mx.nd.array(bt)})
            ex.forward()[0].asnumpy()
    # the next call works and gives the built-in's numbers
    got = run(mx_roi.nd.DeformablePSROIPooling, params, x, rois, trans, grad)
    assert_bits(got[0], run(builtin, params, x, rois, trans, grad)[0], "next call")


def test_bad_parameters_and_input_counts():
    params, (x, rois, trans, grad) = _good()
    X, Rr, T = mx.nd.array(x), mx.nd.array(rois), mx.nd.array(trans)
    for bad, match in ((dict(group_size=0), r"parameter 'group_size': expected positive"),
                       (dict(trans_std=-0.1), r"parameter 'trans_std': expected a value >= 0"),
                       (dict(part_size=-1), r"parameter 'part_size'"),
                       (dict(sample_per_part=0), r"parameter 'sample_per_part'"),
                       (dict(pooled_size="(3, 2)"), r"parameter 'pooled_size': expected an "
                                                    r"integer")):
        with pytest.raises(ValueError, match="DeformablePSROIPooling: " + match):
            mx_roi.nd.DeformablePSROIPooling(X, Rr, T, **dict(params, **bad))
        with pytest.raises(MXNetError, match=match):  # the plain Custom call: same words
            mx.nd.Custom(X, Rr, T, op_type=OP, **dict(params, **bad)).asnumpy()
    with pytest.raises(TypeError, match=r"needs input\(s\) 'trans' with these parameters"):
        mx_roi.nd.DeformablePSROIPooling(X, Rr, **params)
    with pytest.raises(TypeError, match=r"input\(s\) 'trans' not taken with these "):
        mx_roi.nd.DeformablePSROIPooling(X, Rr, T, **dict(params, no_trans=True))
    with pytest.raises(TypeError, match=r"^DeformablePSROIPooling\(\) needs input\(s\) "
                                        r"'trans' with these parameters"):
        mx_roi.gluon.DeformablePSROIPooling(**params)(X, Rr)  # the block: the same words
    np.testing.assert_array_equal(
        mx_roi.nd.DeformablePSROIPooling(X, Rr, T, **params).asnumpy(),
        builtin(X, Rr, T, **params).asnumpy())


def test_rejected_forward_backward_is_safe():
    """MXNet runs the queued backward of a rejected forward: zeros, no second error; the
    training steps after it are right (bad trans and bad rois alternating)."""
    params, (x, rois, trans, grad) = _good()
    want = run(builtin, params, x, rois, trans, grad)
    for i in range(12):
        t, r = trans.copy(), rois.copy()
        if i % 3 == 1:
            t[1, 0, 0, 0] = np.inf
            with pytest.raises(MXNetError, match=r"trans\[1, 0, 0, 0\] is inf"):
                run(mx_roi.nd.DeformablePSROIPooling, params, x, r, t, grad)
        elif i % 3 == 2:
            r[3, 0] = 9
            with pytest.raises(MXNetError, match=r"rois\[3\] has batch index 9"):
                run(mx_roi.nd.DeformablePSROIPooling, params, x, r, t, grad)
        else:
            got = run(mx_roi.nd.DeformablePSROIPooling, params, x, r, t, grad)
            for a, b in zip(got[:3], want[:3]):
                assert_bits(a, b, f"step {i}")
    from mx_roi import errors
    assert errors.pending() == 0


def test_onnx_export_is_refused(tmp_path):
    pytest.importorskip("onnx")
    from mx_roi.onnx import ExportError
    params, K = CASES[3]
    s = mx_roi.sym.DeformablePSROIPooling(mx.sym.var("data"), mx.sym.var("rois"), **params)
    with pytest.raises(ExportError, match=r"DeformablePSROIPooling \(node '\w+'\): cannot "
                                          r"export the op to ONNX: no ONNX translation"):
        mx.onnx.export_model(s, {}, [(1, 8, 5, 5), (3, 5)], [np.float32, np.float32],
                             str(tmp_path / "x.onnx"))
