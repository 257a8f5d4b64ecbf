"""The group grid of the position-sensitive ops: ``group_size`` 0 (the pooled grid, square
or not), an int (square) or ``(gh, gw)``; its parsing, validation, channel rule and the
channel-count error, through every entry point."""
import re

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd
from mxnet.base import MXNetError

import mx_roi
from mx_roi.params import PSROIAlignParam, PSROIPoolingParam

from tests import reference as ref

PS_OPS = {
    "PSROIPooling": (PSROIPoolingParam, dict(output_dim=3, spatial_scale=0.5),
                     lambda x, r, **p: ref.psroi_pooling_forward(x, r, **p)),
    "PSROIAlign": (PSROIAlignParam, dict(output_dim=3, spatial_scale=0.5, sample_ratio=2),
                   lambda x, r, **p: ref.psroi_align_forward(x, r, **p)),
}
ps_op = pytest.mark.parametrize("op_type", list(PS_OPS))
ERRORS = (MXNetError, ValueError)
ROIS = np.array([[0, 1, 1, 9, 8], [1, 0, 2, 12, 11], [1, 3, 3, 4, 5], [-1, 0, 0, 5, 5]],
                np.float32)


def _data(channels, N=2, H=6, W=7, seed=0):
    return np.random.default_rng(seed).standard_normal((N, channels, H, W)).astype(np.float32)


# ---- parsing ------------------------------------------------------------------------
@ps_op
@pytest.mark.parametrize("spelling, pooled, grid", [
    (0, (3, 4), (3, 4)), ("0", (3, 4), (3, 4)), ("(0, 0)", (2, 5), (2, 5)),
    (2, (3, 4), (2, 2)), ("2", (3, 4), (2, 2)), ("(2,)", (3, 4), (2, 2)),
    ((2, 3), (3, 4), (2, 3)), ("(2, 3)", (3, 4), (2, 3)), ("[1,4]", 3, (1, 4)),
    ("(3, 4)", (3, 4), (3, 4)),
])
def test_group_size_spellings(op_type, spelling, pooled, grid):
    """MXNet hands kwargs over as strings: "(2, 3)" is a (gh, gw) grid, an int stays square
    and 0 is the pooled grid whatever its shape."""
    param_cls, base, _ = PS_OPS[op_type]
    p = param_cls.from_kwargs(**base, pooled_size=str(pooled), group_size=spelling)
    assert p.group_grid == grid
    assert p.in_channels == 3 * grid[0] * grid[1]
    # to_kwargs round-trips through the strings Custom carries
    assert param_cls.from_kwargs(**p.to_kwargs()) == p


@ps_op
@pytest.mark.parametrize("value, shown", [
    (-1, "-1"), ("(0, 3)", r"\(0, 3\)"), ((2, -1), r"\(2, -1\)"), ("(1, 2, 3)", r"'\(1, 2, 3\)'"),
    ("abc", "'abc'"), (1.5, "1.5"), ("(2, 0)", r"\(2, 0\)"),
])
def test_bad_group_size_names_op_parameter_and_value(op_type, value, shown):
    param_cls, base, _ = PS_OPS[op_type]
    with pytest.raises(ValueError, match=rf"^{op_type}: parameter 'group_size': expected 0 "
                                         rf"\(= the pooled grid\), a positive int or a "
                                         rf"\(gh, gw\) pair of positive ints, got {shown}$"):
        param_cls.from_kwargs(**base, pooled_size=(3, 4), group_size=value)


@ps_op
def test_bad_group_size_through_custom_then_next_call_works(op_type):
    _, base, reference = PS_OPS[op_type]
    x = _data(3 * 12)
    with pytest.raises(ERRORS, match=r"group_size.*got \(0, 4\)"):
        mx.nd.Custom(mx.nd.array(x), mx.nd.array(ROIS), op_type=op_type, **base,
                     pooled_size="(3, 4)", group_size="(0, 4)").asnumpy()
    out = mx.nd.Custom(mx.nd.array(x), mx.nd.array(ROIS), op_type=op_type, **base,
                       pooled_size="(3, 4)").asnumpy()
    np.testing.assert_allclose(out, reference(x, ROIS, **base, pooled_size=(3, 4)),
                               rtol=1e-5, atol=1e-5)


# ---- the channel rule -----------------------------------------------------------------
@ps_op
@pytest.mark.parametrize("pooled, group", [((3, 4), 0), ((3, 4), (2, 3)), ((2, 2), (1, 3)),
                                           ((4, 2), 2), ((1, 5), (3, 2))])
def test_channel_map_reads_the_group_cell_of_each_bin(op_type, pooled, group):
    """On a map whose channel k is the constant k, every non-empty bin (p, q) of output
    channel c reads exactly channel (c*GH + floor(p*GH/P))*GW + floor(q*GW/Q)."""
    _, base, _ = PS_OPS[op_type]
    P, Q = pooled
    GH, GW = (P, Q) if group == 0 else ((group, group) if isinstance(group, int) else group)
    O = base["output_dim"]
    x = np.broadcast_to(np.arange(O * GH * GW, dtype=np.float64)[None, :, None, None],
                        (1, O * GH * GW, 6, 6)).copy()
    rois = np.array([[0, 0, 0, 11, 11]], np.float64)
    out = mx.nd.Custom(mx.nd.array(x, dtype=np.float64), mx.nd.array(rois, dtype=np.float64),
                       op_type=op_type, **base, pooled_size=pooled, group_size=group).asnumpy()
    c, p, q = np.meshgrid(np.arange(O), np.arange(P), np.arange(Q), indexing="ij")
    want = (c * GH + (p * GH) // P) * GW + (q * GW) // Q
    # channels differ by 1: 1e-9 (bilinear weights summing to 1 up to rounding) is exact
    np.testing.assert_allclose(out[0], want, rtol=0, atol=1e-9)
    if group == 0:      # the pooled grid: contrib.ROIAlign(position_sensitive=True)'s rule
        np.testing.assert_array_equal(want, c * P * Q + p * Q + q)


def _expect_channel_error(op_type, channels, need, gh, gw):
    return re.escape(f"{op_type}: data has {channels} channels but output_dim * gh * gw = "
                     f"3 * {gh} * {gw} = {need} are required")


def _call_entry(entry, op_type, x, rois, **params):
    """Forward + backward through one public entry point; returns (out, data grad)."""
    xd, rd = mx.nd.array(x), mx.nd.array(rois)
    if entry == "custom":
        xd.attach_grad()
        xd.grad[:] = 7.0                      # garbage: 'write' must overwrite it
        with autograd.record():
            y = mx.nd.Custom(xd, rd, op_type=op_type, **params)
        y.backward(mx.nd.ones(y.shape))
        return y.asnumpy(), xd.grad.asnumpy()
    if entry == "nd":
        xd.attach_grad()
        xd.grad[:] = 7.0
        with autograd.record():
            y = getattr(mx_roi.nd, op_type)(xd, rd, **params)
        y.backward(mx.nd.ones(y.shape))
        return y.asnumpy(), xd.grad.asnumpy()
    if entry == "sym":
        sym = getattr(mx_roi.sym, op_type)(mx.sym.Variable("data"), mx.sym.Variable("rois"),
                                          **params)
        exe = sym.simple_bind(mx.cpu(), data=x.shape, rois=rois.shape,
                              grad_req={"data": "write", "rois": "null"})
        exe.arg_dict["data"][:] = x
        exe.arg_dict["rois"][:] = rois
        exe.grad_dict["data"][:] = 7.0
        y = exe.forward(is_train=True)[0]
        exe.backward(mx.nd.ones(y.shape))
        return y.asnumpy(), exe.grad_dict["data"].asnumpy()
    if entry == "gluon":
        block = getattr(mx_roi.gluon, op_type)(**params)
        block.hybridize()
        xd.attach_grad()
        xd.grad[:] = 7.0
        with autograd.record():
            y = block(xd, rd)
        y.backward(mx.nd.ones(y.shape))
        return y.asnumpy(), xd.grad.asnumpy()
    raise ValueError(entry)


ENTRIES = ("custom", "nd", "sym", "gluon")


@ps_op
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("pooled, group, gh, gw", [((3, 4), 0, 3, 4), ((3, 4), (2, 3), 2, 3),
                                                   ((3, 4), 2, 2, 2)])
def test_channel_count_error_names_gh_gw(op_type, entry, pooled, group, gh, gw):
    """Wrong channel count: a clear error with the expected output_dim * gh * gw, through
    every entry point; the next call (right channels) works and matches the reference."""
    _, base, reference = PS_OPS[op_type]
    params = dict(base, pooled_size=pooled, group_size=group)
    need = 3 * gh * gw
    bad = 3 * 3 * 3 if need != 27 else 30
    errors = RuntimeError if entry == "sym" else ERRORS     # simple_bind's infer_shape
    with pytest.raises(errors, match=_expect_channel_error(op_type, bad, need, gh, gw)):
        _call_entry(entry, op_type, _data(bad), ROIS, **params)
    x = _data(need, seed=1)
    out, grad = _call_entry(entry, op_type, x, ROIS, **params)
    np.testing.assert_allclose(out, reference(x, ROIS, **params), rtol=1e-5, atol=1e-5)
    assert not (grad == 7.0).any()


@ps_op
@pytest.mark.parametrize("entry", ENTRIES)
def test_rect_grid_forward_backward_every_entry(op_type, entry):
    """(gh, gw) != (P, Q) through every entry point: forward and data gradient against the
    scalar reference (the gradient buffer starts as garbage)."""
    _, base, _ = PS_OPS[op_type]
    params = dict(base, pooled_size=(3, 4), group_size=(2, 3))
    x = _data(3 * 2 * 3, seed=2)
    out, grad = _call_entry(entry, op_type, x, ROIS, **params)
    bwd = ref.psroi_pooling_backward if op_type == "PSROIPooling" else ref.psroi_align_backward
    fwd = ref.psroi_pooling_forward if op_type == "PSROIPooling" else ref.psroi_align_forward
    np.testing.assert_allclose(out, fwd(x, ROIS, **params), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, bwd(x, ROIS, np.ones_like(out), **params),
                               rtol=1e-5, atol=1e-5)
