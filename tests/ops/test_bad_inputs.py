"""Invalid inputs give an MXNetError (or ValueError for bad parameters) whose message
names the problem, and the next valid call still works.

MXNet 1.9.1 crashes the interpreter when a ``CustomOpProp`` constructor raises; mx_roi's
constructor never raises (the error surfaces from the first protected callback), so bad
parameters are tested in-process like bad inputs.  (They ran in a forked child at first;
forking a process with MXNet's and mx_roi's worker threads can hang in MXNet's pre-fork
handler, which was seen once under load.)"""
import re

import numpy as np
import pytest

import mxnet as mx
from mxnet.base import MXNetError

import mx_roi  # noqa: F401

from tests import reference as ref

ERRORS = (MXNetError, ValueError, TypeError)

# op_type -> (valid params, input channels, reference forward)
OPS = {
    "ROIPooling": (dict(pooled_size=(2, 2), spatial_scale=0.5), 3,
                   lambda x, r: ref.roi_pooling_forward(x, r, (2, 2), 0.5)),
    "ROIAlign": (dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=2), 3,
                 lambda x, r: ref.roi_align_forward(x, r, (2, 2), 0.5, 2)),
    "PSROIPooling": (dict(pooled_size=2, output_dim=2, spatial_scale=0.5), 8,
                     lambda x, r: ref.psroi_pooling_forward(x, r, 2, 2, 0.5)),
    "PSROIAlign": (dict(pooled_size=2, output_dim=2, spatial_scale=0.5, sample_ratio=2), 8,
                   lambda x, r: ref.psroi_align_forward(x, r, 2, 2, 0.5, 2)),
}
op_param = pytest.mark.parametrize("op_type", list(OPS))


def _inputs(op_type, dtype=np.float32, N=2, C=None):
    params, cin, _ = OPS[op_type]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C or cin, 6, 7)).astype(dtype)
    rois = np.array([[0, 1, 1, 9, 8], [1, 0, 2, 12, 11], [1, 3, 3, 4, 5]], dtype)
    return params, x, rois


def _call(op_type, x, rois, **params):
    out = mx.nd.Custom(mx.nd.array(x, dtype=x.dtype), mx.nd.array(rois, dtype=rois.dtype),
                       op_type=op_type, **params)
    return out.asnumpy()


def _call_backward(op_type, x, rois, **params):
    from mxnet import autograd
    xd = mx.nd.array(x, dtype=x.dtype)
    xd.attach_grad()
    with autograd.record():
        out = mx.nd.Custom(xd, mx.nd.array(rois, dtype=rois.dtype), op_type=op_type, **params)
    out.backward(mx.nd.ones(out.shape, dtype=x.dtype))
    return xd.grad.asnumpy()


def _next_call_works(op_type):
    params, x, rois = _inputs(op_type)
    out = _call(op_type, x, rois, **params)
    np.testing.assert_allclose(out, OPS[op_type][2](x, rois), rtol=1e-5, atol=1e-5)
    _call_backward(op_type, x, rois, **params)


@op_param
@pytest.mark.parametrize("bad_batch", [2.0, 2.5, 7.0])
def test_batch_index_out_of_range(op_type, bad_batch):
    params, x, rois = _inputs(op_type)
    rois[1, 0] = bad_batch
    with pytest.raises(ERRORS, match="batch index"):
        _call(op_type, x, rois, **params)
    _next_call_works(op_type)


@op_param
def test_batch_index_out_of_range_backward(op_type):
    params, x, rois = _inputs(op_type)
    rois[2, 0] = 5
    with pytest.raises(ERRORS, match="batch index"):
        _call_backward(op_type, x, rois, **params)
    _next_call_works(op_type)


@op_param
@pytest.mark.parametrize("where", [0, 1, 4])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_coordinates(op_type, where, value):
    params, x, rois = _inputs(op_type)
    rois[1, where] = value
    with pytest.raises(ERRORS, match=r"(?i)nan|finite"):
        _call(op_type, x, rois, **params)
    _next_call_works(op_type)


@op_param
@pytest.mark.parametrize("shape", [(3, 4), (3, 6), (3,), (3, 5, 1)])
def test_rois_wrong_shape(op_type, shape):
    params, x, _ = _inputs(op_type)
    rois = np.zeros(shape, np.float32)
    with pytest.raises(ERRORS, match="rois"):
        _call(op_type, x, rois, **params)
    _next_call_works(op_type)


@op_param
def test_data_not_4d(op_type):
    params, x, rois = _inputs(op_type)
    with pytest.raises(ERRORS, match="data"):
        _call(op_type, x[0], rois, **params)
    _next_call_works(op_type)


@pytest.mark.parametrize("op_type", ["PSROIPooling", "PSROIAlign"])
@pytest.mark.parametrize("channels", [7, 9, 2, 18])
def test_ps_channel_count(op_type, channels):
    params, x, rois = _inputs(op_type, C=channels)
    with pytest.raises(ERRORS, match="channel"):
        _call(op_type, x, rois, **params)
    _next_call_works(op_type)


@pytest.mark.parametrize("op_type", ["PSROIPooling", "PSROIAlign"])
def test_ps_channel_count_group_size(op_type):
    """With group_size=3, output_dim=2 the data needs 18 channels, not 8."""
    params, x, rois = _inputs(op_type)
    with pytest.raises(ERRORS, match="channel"):
        _call(op_type, x, rois, **dict(params, group_size=3))
    _next_call_works(op_type)


@op_param
@pytest.mark.parametrize("dtypes", [(np.float32, np.float64), (np.float64, np.float32),
                                    (np.float16, np.float32)],
                         ids=["f32-f64", "f64-f32", "f16-f32"])
def test_dtype_mismatch(op_type, dtypes):
    params, x, rois = _inputs(op_type)
    with pytest.raises(ERRORS, match="dtype"):
        _call(op_type, x.astype(dtypes[0]), rois.astype(dtypes[1]), **params)
    _next_call_works(op_type)


BAD_PARAMS = [
    ("pooled_size", 0, "pooled_size"),
    ("pooled_size", (0, 2), "pooled_size"),
    ("pooled_size", (2, -1), "pooled_size"),
    ("pooled_size", "abc", "pooled_size"),
    ("pooled_size", (1, 2, 3), "pooled_size"),
    ("spatial_scale", "abc", "spatial_scale"),
    ("spatial_scale", 0, "spatial_scale"),
    ("spatial_scale", -0.5, "spatial_scale"),
    ("spatial_scale", "nan", "spatial_scale"),
    ("not_a_param", 1, "not_a_param"),
    ("deterministic", "maybe", "deterministic"),
]

OP_SPECIFIC_BAD_PARAMS = [
    ("ROIAlign", "pool_mode", "foo"),
    ("ROIAlign", "sample_ratio", 1.5),
    ("ROIAlign", "aligned", "sideways"),
    ("ROIAlign", "legacy", "bogus"),
    ("ROIPooling", "pool_mode", "max"),      # pool_mode is a ROIAlign parameter only
    ("ROIPooling", "sample_ratio", 2),       # ditto
    ("PSROIPooling", "output_dim", 0),
    ("PSROIPooling", "group_size", -1),
    ("PSROIAlign", "output_dim", -2),
    ("PSROIAlign", "group_size", -1),
    ("PSROIAlign", "sample_ratio", "x"),
]


def _param_cases():
    """(id, op_type, params, match) for every bad-parameter case."""
    out = []
    for op_type in OPS:
        for name, value, match in BAD_PARAMS:
            params = dict(OPS[op_type][0], **{name: value})
            out.append((f"{op_type}-{name}={value}", op_type, params, match))
        params = dict(OPS[op_type][0])
        del params["spatial_scale"]
        out.append((f"{op_type}-missing-spatial_scale", op_type, params, "spatial_scale"))
    for op_type, name, value in OP_SPECIFIC_BAD_PARAMS:
        params = dict(OPS[op_type][0], **{name: value})
        out.append((f"{op_type}-{name}={value}", op_type, params, name))
    return out


PARAM_CASES = _param_cases()


@pytest.mark.parametrize("k", range(len(PARAM_CASES)), ids=[c[0] for c in PARAM_CASES])
def test_bad_params(k):
    """A bad parameter raises MXNetError/ValueError naming it (no crash), and the next
    valid call works."""
    case_id, op_type, params, match = PARAM_CASES[k]
    _, x, rois = _inputs(op_type)
    with pytest.raises(ERRORS, match=match):
        _call(op_type, x, rois, **params)
    _next_call_works(op_type)


@op_param
def test_negative_batch_index_is_not_an_error(op_type):
    params, x, rois = _inputs(op_type)
    rois[:, 0] = [-1, 0, -3]
    out = _call(op_type, x, rois, **params)
    assert not out[0].any() and not out[2].any()


@op_param
def test_fractional_batch_index_below_n_is_valid(op_type):
    """1.9 truncates to 1 < N = 2: valid, not an error."""
    params, x, rois = _inputs(op_type)
    rois[:, 0] = [1.9, 0.5, 1.0]
    out = _call(op_type, x, rois, **params)
    np.testing.assert_allclose(out, OPS[op_type][2](x, rois), rtol=1e-5, atol=1e-5)
