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
from mx_roi.registry import REGISTERED

from tests.fuzz_child import OPS as _FUZZ_OPS
from tests.ops import test_prroi_pool as _prroi, test_rroi_align as _rroi


def _deformable_builtin(x, rois, trans):
    return mx.nd.contrib.DeformablePSROIPooling(
        mx.nd.array(x), mx.nd.array(rois), mx.nd.array(trans),
        **{k: v for k, v in OPS["DeformablePSROIPooling"][0].items()}).asnumpy()


#: op_type -> (valid params, input channels, reference forward(data, rois, *extra)): the
#: fuzz child's four, and the newer ops with their scalar oracles (tests/ops) or, where
#: MXNet's built-in has the same semantics on valid inputs, the built-in
OPS = dict(_FUZZ_OPS, **{
    "RROIAlign": (dict(pooled_size=(2, 2), spatial_scale=0.5, sampling_ratio=2), 3,
                  lambda x, r: _rroi.reference_forward(x, r, (2, 2), 0.5, 2)),
    "PrRoIPool": (dict(pooled_size=(2, 2), spatial_scale=0.5), 3,
                  lambda x, r: _prroi.reference_forward(x, r, (2, 2), 0.5)),
    "DeformablePSROIPooling": (dict(spatial_scale=0.5, output_dim=2, group_size=2,
                                    pooled_size=2, part_size=2, sample_per_part=2,
                                    trans_std=0.2), 8, _deformable_builtin),
})

ERRORS = (MXNetError, ValueError, TypeError)

op_param = pytest.mark.parametrize("op_type", list(OPS))

#: three rois (batch 0, 1, 1) on the 6 x 7 maps of :func:`_inputs`, (R, 5) ops' layout
_ROIS5 = np.array([[0, 1, 1, 9, 8], [1, 0, 2, 12, 11], [1, 3, 3, 4, 5]])


def _rois(op_type, params, dtype=np.float32):
    """:data:`_ROIS5` in the op's layout: as they are for an (R, 5) op, else the op's own
    random boxes (``random_rois``) with the same batch indices."""
    op_cls = REGISTERED[op_type]
    if op_cls.rois_columns == 5:
        return _ROIS5.astype(dtype)
    rois = op_cls.random_rois(np.random.default_rng(0), 3, 2, 6, 7,
                              float(params["spatial_scale"]))
    rois[:, 0] = _ROIS5[:, 0]
    return rois.astype(dtype)


def _inputs(op_type, dtype=np.float32, N=2, C=None):
    params, cin, _ = OPS[op_type]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C or cin, 6, 7)).astype(dtype)
    return params, x, _rois(op_type, params, dtype)


def _extra(op_type, x, rois, params):
    """The op's extra inputs (``example_extra_inputs``, seeded) for ``params``, or for
    its valid parameters where ``params`` are bad (their error comes first)."""
    op_cls = REGISTERED[op_type]
    try:
        param = op_cls.param_cls.from_kwargs(**params)
    except ValueError:
        param = op_cls.param_cls.from_kwargs(**OPS[op_type][0])
    return op_cls(param).example_extra_inputs(np.random.default_rng(1), x.shape, rois)


def _nd_inputs(op_type, x, rois, params):
    return [mx.nd.array(a, dtype=a.dtype) for a in [x, rois] + _extra(op_type, x, rois, params)]


def _call(op_type, x, rois, **params):
    out = mx.nd.Custom(*_nd_inputs(op_type, x, rois, params), op_type=op_type, **params)
    return out.asnumpy()


def _call_backward(op_type, x, rois, **params):
    from mxnet import autograd
    xd, *others = _nd_inputs(op_type, x, rois, params)
    xd.attach_grad()
    with autograd.record():
        out = mx.nd.Custom(xd, *others, op_type=op_type, **params)
    out.backward(mx.nd.ones(out.shape, dtype=x.dtype))
    return xd.grad.asnumpy()


def _reference(op_type, x, rois):
    return OPS[op_type][2](x, rois, *_extra(op_type, x, rois, OPS[op_type][0]))


def _next_call_works(op_type):
    params, x, rois = _inputs(op_type)
    out = _call(op_type, x, rois, **params)
    np.testing.assert_allclose(out, _reference(op_type, x, rois), rtol=1e-5, atol=1e-5)
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
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_coordinates(op_type, value):
    """A non-finite value in any column of the op's layout (the batch index too)."""
    for where in range(REGISTERED[op_type].rois_columns):
        params, x, rois = _inputs(op_type)
        rois[1, where] = value
        with pytest.raises(ERRORS, match=rf"{op_type}: rois\[1\] has a NaN or infinite value"):
            _call(op_type, x, rois, **params)
    _next_call_works(op_type)


@op_param
@pytest.mark.parametrize("shape", [(3, -1), (3, 1), (3,), (3, 0, 1)],
                         ids=["K-1", "K+1", "rank1", "rank3"])
def test_rois_wrong_shape(op_type, shape):
    """(R, K - 1), (R, K + 1), (R,), (R, K, 1) for the op's K = rois_columns."""
    params, x, _ = _inputs(op_type)
    k = REGISTERED[op_type].rois_columns
    rois = np.zeros(tuple(k + d if i == 1 else d for i, d in enumerate(shape)), np.float32)
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
    ("PSROIAlign", "legacy", "caffe"),       # another op's legacy kernel
    ("ROIAlign", "legacy", "rfcn"),
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
    np.testing.assert_allclose(out, _reference(op_type, x, rois), rtol=1e-5, atol=1e-5)


# ---- issue 12: backward of a rejected forward, empty maps, error attribution ----------

def _train_step(op_type, x, rois, **params):
    """record -> backward -> read, no wait in between (a training step)."""
    from mxnet import autograd
    xd, *others = _nd_inputs(op_type, x, rois, params)
    xd.attach_grad()
    xd.grad[:] = 7.0  # garbage: write must overwrite
    with autograd.record():
        out = mx.nd.Custom(xd, *others, op_type=op_type, **params)
    out.backward(mx.nd.ones(out.shape, dtype=x.dtype))
    return out.asnumpy(), xd.grad.asnumpy()


@op_param
def test_rejected_forward_backward_is_safe_and_steps_keep_their_errors(op_type):
    """MXNet runs the queued backward after the forward raised: it must neither touch
    memory with the rejected rois nor raise a second error; each bad step gets its own
    message, each good step the right numbers."""
    params, x, rois = _inputs(op_type)
    want = _reference(op_type, x, rois)
    for i in range(30):
        bad = rois.copy()
        if i % 3 == 1:
            bad[1, 0] = 7 + i  # batch index >= N
            with pytest.raises(MXNetError, match=rf"batch index {7 + i} but data holds"):
                _train_step(op_type, x, bad, **params)
        elif i % 3 == 2:
            bad[2, 1 + i % 4] = np.nan
            with pytest.raises(MXNetError, match=r"rois\[2\] has a NaN or infinite"):
                _train_step(op_type, x, bad, **params)
        else:
            out, _ = _train_step(op_type, x, rois, **params)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    from mx_roi import errors
    assert errors.pending() == 0


@op_param
def test_backward_validates_rois_itself(op_type):
    """The backends' backward re-validates: called directly with bad rois it raises
    (never reads out of range)."""
    import mx_roi.backends as B
    from mx_roi.registry import get_op
    params, x, rois = _inputs(op_type)
    op = get_op(op_type)(get_op(op_type).param_cls.from_kwargs(
        **{k: str(v) for k, v in params.items()}))
    rois[0, 0] = 5
    R = rois.shape[0]
    out_shape = op.out_shape(x.shape, rois.shape)
    assert out_shape[0] == R
    extra = [mx.nd.array(a) for a in _extra(op_type, x, rois, params)]
    for name in ("numpy", "native", "emulated-cuda"):
        grad, rois_grad = mx.nd.zeros(x.shape), mx.nd.zeros(rois.shape)
        extra_grad = [("write", mx.nd.zeros(a.shape)) for a in extra]
        with pytest.raises(ValueError, match="batch index 5 but data holds only 2"):
            B.get(name).backward(op, "write", mx.nd.ones(out_shape), mx.nd.array(x),
                                 mx.nd.array(rois), grad, None,
                                 "write" if op.differentiates_rois else "null", rois_grad,
                                 extra=extra, extra_grad=extra_grad)


EMPTY_CASES = [(op, dict(OPS[op][0]), OPS[op][1]) for op in OPS] + \
    [("ROIAlign", dict(OPS["ROIAlign"][0], pool_mode="max"), 3)]


@pytest.mark.parametrize("op_type,params,channels", EMPTY_CASES,
                         ids=[f"{c[0]}-{c[1].get('pool_mode', '')}" for c in EMPTY_CASES])
@pytest.mark.parametrize("hw", [(0, 5), (4, 0)])
def test_empty_feature_map_gives_zeros(op_type, params, channels, hw):
    """H or W = 0 (possible under np_shape): zeros out, zero (empty) gradient, via nd and
    sym, with garbage-prefilled buffers."""
    from mxnet import autograd
    shape = (2, channels) + hw
    rois_np = _rois(op_type, params)[:2]
    extra_np = _extra(op_type, np.ones(shape), rois_np, params)
    rois = mx.nd.array(rois_np)
    with mx.util.np_shape(True):
        x = mx.nd.ones(shape)
        x.attach_grad()
        with autograd.record():
            y = mx.nd.Custom(x, rois, *[mx.nd.array(a) for a in extra_np], op_type=op_type,
                             **params)
        y.backward(mx.nd.ones(y.shape))
        assert y.shape[0] == 2 and np.all(y.asnumpy() == 0)
        assert x.grad.shape == shape
        names = REGISTERED[op_type].CustomOpProp(**params).list_arguments()
        sym = mx.sym.Custom(*[mx.sym.var(n) for n in names], op_type=op_type, **params)
        exe = sym.simple_bind(mx.cpu(), data=shape, rois=rois_np.shape,
                              **{n: a.shape for n, a in zip(names[2:], extra_np)})
        exe.outputs[0][:] = 5.0
        exe.arg_dict["rois"][:] = rois
        for n, a in zip(names[2:], extra_np):
            exe.arg_dict[n][:] = a
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones(exe.outputs[0].shape))
        out = exe.outputs[0].asnumpy()
        assert np.all(out == 0), out


def test_errors_across_threads_name_their_own_call():
    """Interleaved good and bad calls on several threads.  MXNet 1.9.1 may raise one
    thread's custom-op error at another thread's synchronisation; whatever thread it
    reaches, each error carries the message of a distinct bad call (never a message
    used twice, never one of a call that did not fail), says so when the call was made
    on another thread, and good calls that return give the right numbers.  MXNet keeps
    one custom-op error at a time and may drop some of concurrent failures (measured
    ~15% here): such a bad call returns an all-NaN output, never numbers."""
    import collections
    import threading
    params, x, rois = _inputs("ROIAlign")
    want = OPS["ROIAlign"][2](x, rois)
    lock = threading.Lock()
    issued, seen, wrong = collections.Counter(), collections.Counter(), []

    def worker(t):
        for i in range(20):
            bad = rois.copy()
            bad[0, 0] = 10 + 100 * t + i
            use = bad if i % 2 else rois
            if i % 2:
                with lock:
                    issued[int(bad[0, 0])] += 1
            try:
                out = _call("ROIAlign", x, use, **params)
                if not i % 2 and not np.allclose(out, want, rtol=1e-5, atol=1e-5):
                    wrong.append((t, i, "wrong numbers"))
                if i % 2 and not np.isnan(out).all():  # an error MXNet dropped: NaN
                    wrong.append((t, i, "bad call returned numbers"))
            except MXNetError as exc:
                head = str(exc).splitlines()
                m = re.search(r"batch index (\d+) but data holds", head[0])
                if not m:
                    wrong.append((t, i, head[0]))
                    continue
                k = int(m.group(1))
                with lock:
                    seen[k] += 1
                other = (k - 10) // 100 != t
                if other != ("made on another thread" in head[1]):
                    wrong.append((t, i, "thread note", head[:2]))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads)
    assert not wrong, wrong
    assert all(v == 1 for v in seen.values()) and set(seen) <= set(issued), (seen, issued)


def test_rejected_call_prints_nothing_but_keeps_the_traceback(capfd, monkeypatch):
    params, x, rois = _inputs("PSROIAlign")
    rois[0, 0] = 9
    with pytest.raises(MXNetError, match="batch index 9") as info:
        _call("PSROIAlign", x, rois, **params)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "Error in CustomOp" not in captured.out + captured.err
    # where the rois were found bad: the host check, or (GPU, emulated-cuda) the read of
    # the device check's status
    tb = info.value.mx_roi_traceback
    assert "check_inputs" in tb or "raise_if_bad" in tb, tb
    monkeypatch.setenv("MX_ROI_TRACEBACK", "1")
    with pytest.raises(MXNetError, match="batch index 9"):
        _call("PSROIAlign", x, rois, **params)
    assert "Error in CustomOp.forward" in capfd.readouterr().out


def test_foreign_custom_op_error_gets_no_mx_roi_message():
    """An error of another custom op is left as MXNet made it, even with one of our
    records pending (a record whose error MXNet never raised)."""
    from mx_roi import errors

    class _Boom(mx.operator.CustomOp):
        def forward(self, is_train, req, in_data, out_data, aux):
            raise RuntimeError("boom from a foreign op")

    @mx.operator.register("_mx_roi_test_boom")
    class _BoomProp(mx.operator.CustomOpProp):
        def create_operator(self, ctx, shapes, dtypes):
            return _Boom()

    params, x, rois = _inputs("ROIPooling")
    rois[0, 0] = 4
    with pytest.raises(MXNetError, match="batch index 4"):
        _call("ROIPooling", x, rois, **params)
    # a stale record of ours: simulate one whose error MXNet dropped
    errors._store(errors._Record("forward", errors.issuer(), "ValueError: stale", ""))
    with pytest.raises(MXNetError) as info:
        mx.nd.Custom(mx.nd.ones(3), op_type="_mx_roi_test_boom").asnumpy()
    assert "stale" not in str(info.value) and not isinstance(info.value, errors.RoIError)
    errors._pending.clear()
    _next_call_works("ROIPooling")


@pytest.mark.parametrize("var,value,match", [
    ("MX_ROI_BACKEND", "nativ", r"MX_ROI_BACKEND='nativ': expected one of 'auto', 'numpy'"),
    ("MX_ROI_NUM_THREADS", "abc", r"MX_ROI_NUM_THREADS='abc': expected a positive integer"),
])
@op_param
def test_bad_environment_variables(op_type, var, value, match, monkeypatch):
    params, x, rois = _inputs(op_type)
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    monkeypatch.setenv(var, value)
    with pytest.raises(MXNetError, match=match):
        _call(op_type, x, rois, **params)
    monkeypatch.delenv(var)
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    _next_call_works(op_type)


# ---- issue 37: every parameter of every registered op, from the parameter structs -----

def _registered_fields():
    """(op_type, field) for every field of every registered op's parameter struct."""
    import dataclasses
    from mx_roi.registry import REGISTERED
    return [(name, f.name) for name, op_cls in sorted(REGISTERED.items())
            for f in dataclasses.fields(op_cls.param_cls)]


def _valid_params_and_inputs(op_type):
    """The op's first selftest case (registry) and small inputs it accepts."""
    from mx_roi.registry import REGISTERED
    op_cls = REGISTERED[op_type]
    params = dict(op_cls.selftest_cases[0])
    param = op_cls.param_cls.from_kwargs(**params)
    channels = getattr(param, "in_channels", 3)
    x = np.random.default_rng(0).standard_normal((2, channels, 6, 7)).astype(np.float32)
    rois = _rois(op_type, params)
    rois[2, 0] = -1  # a padding roi
    return params, x, rois


@pytest.mark.parametrize("op_type,field", _registered_fields(),
                         ids=[f"{o}-{f}" for o, f in _registered_fields()])
def test_every_parameter_rejects_its_declared_bad_values(op_type, field):
    """Each value a field declares invalid (its parser's ill-formed spellings and its own
    out-of-domain values: ``mx_roi.params.invalid_examples``) is refused with the op's
    and the parameter's name, through ``mx.nd.Custom`` (strings through MXNet's
    ``CustomOpProp``), ``mx_roi.nd`` and ``mx_roi.sym`` (Python values) and a Gluon
    block's constructor;
    the next valid call works.  A field that declares no bad value fails here: every
    parameter must have a tested bad value."""
    from mx_roi.params import invalid_examples
    from mx_roi.registry import REGISTERED
    import mx_roi.gluon
    import mx_roi.sym
    bad_values = invalid_examples(REGISTERED[op_type].param_cls, field)
    assert bad_values, (f"{op_type}.{field}: no declared bad value (give its parser a "
                        "`invalid` tuple or its param_field an `invalid=` one)")
    params, x, rois = _valid_params_and_inputs(op_type)
    inputs = _nd_inputs(op_type, x, rois, params)  # with the valid call's extra inputs
    names = REGISTERED[op_type].CustomOpProp(**params).list_arguments()
    named = rf"{op_type}: parameter '{field}': expected "
    for value in bad_values:
        kwargs = dict(params, **{field: value})
        with pytest.raises(ERRORS, match=named):
            mx.nd.Custom(*inputs, op_type=op_type, **kwargs).asnumpy()
        with pytest.raises(ValueError, match=named):
            getattr(mx_roi.nd, op_type)(*inputs, **kwargs)
        with pytest.raises(ValueError, match=named):
            getattr(mx_roi.sym, op_type)(*[mx.sym.var(n) for n in names], **kwargs)
        with pytest.raises(ValueError, match=named):
            getattr(mx_roi.gluon, op_type)(**kwargs)
    out = _call(op_type, x, rois, **params)
    assert out.shape[0] == rois.shape[0] and np.isfinite(out).all()


@pytest.mark.parametrize("op_type", sorted(OPS))
def test_every_required_parameter_missing_is_named(op_type):
    import dataclasses
    from mx_roi.registry import REGISTERED
    params, x, rois = _valid_params_and_inputs(op_type)
    required = [f.name for f in dataclasses.fields(REGISTERED[op_type].param_cls)
                if f.default is dataclasses.MISSING]
    assert required, op_type
    for name in required:
        kwargs = {k: v for k, v in params.items() if k != name}
        with pytest.raises(ERRORS, match=rf"{op_type}: missing required parameter\(s\) "
                                         rf"'{name}'"):
            _call(op_type, x, rois, **kwargs)


def test_registered_ops_are_the_tested_ops():
    """The per-field test reads the registry; OPS (the hand-written valid cases of the
    other tests here) must not fall behind it."""
    from mx_roi.registry import REGISTERED
    assert set(OPS) == set(REGISTERED)
def test_rejected_forward_error_travels_with_its_output():
    """A rejected forward's error is recorded and carried by its own output (not by
    MXNet's process-wide callback error, which another op's completion may take:
    mx_roi.error_slot): pending until the output is read, raised there once with the
    op's message, nothing left for waitall; a foreign take(mode='raise') error -- the
    operation that carries ours -- stays MXNet's own."""
    from mx_roi import errors
    from mxnet import autograd
    params, x, rois = _inputs("PSROIPooling")
    rois[1, 4] = np.nan
    xd = mx.nd.array(x)
    xd.attach_grad()
    with autograd.record():
        out = mx.nd.Custom(xd, mx.nd.array(rois), op_type="PSROIPooling", **params)
    out.backward(mx.nd.ones(out.shape))
    import time
    deadline = time.monotonic() + 10
    while not errors._pending and time.monotonic() < deadline:  # the callback runs later
        time.sleep(0.001)
    assert [r.kind for r in errors._pending] == ["forward-output"]
    with pytest.raises(errors.RoIError, match=r"^ValueError: PSROIPooling: rois\[1\] has a "
                       r"NaN or infinite value \[1\.0, 0\.0, 2\.0, 12\.0, nan\]; coordinates "
                       r"must be finite\n\(raised inside an mx_roi custom op and carried to "
                       r"its output by a failed internal operation; MXNet's report follows\)"):
        out.asnumpy()
    assert errors.pending() == 0
    assert np.isfinite(xd.grad.asnumpy()).all()  # one error per step: not again here
    mx.nd.waitall()
    with pytest.raises(MXNetError, match=errors.OUTPUT_MARKER) as info:
        mx.nd.take(mx.nd.zeros(2), mx.nd.array([5]), mode="raise").asnumpy()
    assert not isinstance(info.value, errors.RoIError)
    _next_call_works("PSROIPooling")


def test_failing_callback_waits_for_the_completions_of_others():
    """error_slot.fail (the raise path) returns only once no other mx_roi callback runs
    and every noted completion has run: here none is queued, so it returns at once
    having waited on each noted array, and forgets them."""
    import threading
    from mx_roi import error_slot
    arrays = [mx.nd.zeros(3) for _ in range(2)]
    done = []
    a, b = error_slot.enter(), error_slot.enter()
    error_slot.succeed(a, arrays[0])

    def failing():
        done.append(error_slot.fail(b))

    th = threading.Thread(target=failing)
    c = error_slot.enter()  # still running: the failing callback waits for it
    th.start()
    th.join(0.3)
    assert th.is_alive() and not done
    error_slot.succeed(c, arrays[1])
    th.join(10)
    assert done and done[0] >= 2 and not error_slot._noted and not error_slot._running


@pytest.mark.parametrize("door", ["native", "custom"])
def test_rejected_forward_under_naive_engine_raises_its_error(door):
    """Under MXNET_ENGINE_TYPE=NaiveEngine (operations run at once) a rejected forward
    raises the usual way, at the call, with its own message; the next call works.  On
    the native door (where this backend takes it, mx_roi.ext.door) the first line is the
    library's message, MXNet's report naming the native op after it."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import numpy as np, mxnet as mx, mx_roi\n"
        "from mx_roi import errors\n"
        "x = mx.nd.ones((1, 8, 6, 7))\n"
        "r = mx.nd.array([[0, 1, 1, 4, np.nan]])\n"
        "try:\n"
        "    mx_roi.nd.PSROIPooling(x, r, 1.0, 2, 2).asnumpy()\n"
        "except errors.RoIError as e:\n"
        "    print('RAISED', str(e).splitlines()[0])\n"
        "    print('REPORT', \"Error calling FCompute for custom operator 'mx_roi_\" in str(e))\n"
        "except mx.base.MXNetError as e:\n"
        "    print('NATIVE', *[x.strip() for x in str(e).splitlines()], sep='\\n')\n"
        "r = mx.nd.array([[0, 1, 1, 4, 4]])\n"
        "print('NEXT', float(mx_roi.nd.PSROIPooling(x, r, 1.0, 2, 2).sum().asscalar()))\n"
        "print('PENDING', errors.pending())\n")
    env = dict(os.environ, MXNET_ENGINE_TYPE="NaiveEngine", MX_ROI_NATIVE_OPS=str(
               int(door == "native")), PYTHONPATH=root + os.pathsep + os.environ.get(
               "PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    message = ("PSROIPooling: rois[0] has a NaN or infinite value [0.0, 1.0, 1.0, 4.0, "
               "nan]; coordinates must be finite")
    native = os.environ.get("MX_ROI_BACKEND", "native") == "native" and door == "native"
    if native:  # RoIError, the library's line first, MXNet's report after it
        assert f"RAISED {message}" in lines and "REPORT True" in lines, proc.stdout
    else:
        assert f"RAISED ValueError: {message}" in lines and "REPORT False" in lines, \
            proc.stdout
    assert "NEXT 8.0" in lines and "PENDING 0" in lines, proc.stdout
