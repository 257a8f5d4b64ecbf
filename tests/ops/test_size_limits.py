"""Sizes MXNet cannot hold are refused with the op's own message (issue 41, item 3).

* Every integer parameter of every registered op is bounded (``param_field(bounds=...)``):
  a size by ``MAX_ELEMENTS`` (or, for DeformablePSROIPooling's square grids, the side of
  a square of that many), a sampling ratio by ``MAX_SAMPLES_PER_SIDE``; the limit is
  accepted (and runs), one past it refused: checked here to be among the field's
  declared invalid values, which ``test_bad_inputs.py`` feeds through every entry
  point.
* An output of more than ``MAX_ELEMENTS`` = 2^31 - 2 elements (MXNet 1.9.1 allocates an
  array only if ``size < 2^31 - 1``) is refused at shape inference
  (``RoIOp.check_out_size``, from the registry's ``infer_shape``), naming the op, the
  output shape and the parameters to reduce: exactly at the edge through ``sym``'s
  ``infer_shape`` (no allocation), past it through every entry point.  An empty
  dimension counts as 1 there (an empty call with parameters no call could use).
* ``mx.nd.Custom`` / ``mx.sym.Custom`` with an input the parameters do not take, or
  without one they need, say what ``mx_roi.nd`` says.
"""
import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import mx_roi
import mx_roi.gluon
from mx_roi.errors import RoIError
from mx_roi.params import MAX_ELEMENTS, invalid_examples
from mx_roi.registry import REGISTERED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

assert MAX_ELEMENTS == 2 ** 31 - 2  # MXNet 1.9.1: CHECK_LT(size, (int64_t{1} << 31) - 1)


# ---- the parameters' bounds ---------------------------------------------------------

def _int_fields():
    """(op_type, field) for every integer (or integer pair) field of every registered op."""
    return [(name, f) for name, op_cls in sorted(REGISTERED.items())
            for f in dataclasses.fields(op_cls.param_cls) if "int" in str(f.type)]


def _valid(op_type):
    return dict(REGISTERED[op_type].selftest_cases[0])


@pytest.mark.parametrize("op_type,f", _int_fields(),
                         ids=[f"{o}-{f.name}" for o, f in _int_fields()])
def test_every_int_parameter_is_bounded_and_declares_its_edges(op_type, f):
    """Each integer field has bounds within MXNet's int range, accepts each bound itself
    and declares the value just past it (and 2^31) as invalid, so the per-field test
    feeds them through every entry point."""
    assert f.metadata.get("bounds"), f"{op_type}.{f.name}: no bounds (param_field(bounds=))"
    low, high, why = f.metadata["bounds"]
    assert high is not None and high <= MAX_ELEMENTS and why
    assert low is None or low >= -2 ** 31
    param_cls = REGISTERED[op_type].param_cls
    declared = invalid_examples(param_cls, f.name)
    pair = "Tuple" in str(f.type)
    assert high + 1 in declared and 2 ** 31 in declared
    if pair:
        assert (2, high + 1) in declared
    if low is not None:
        assert low - 1 in declared
    # a fixed sample_ratio bounds pooled_size further (the next test): adaptive here
    base = {k: v for k, v in _valid(op_type).items()
            if not (f.name == "pooled_size" and k == "sample_ratio")}
    for edge in [high] + ([low] if low is not None else []):
        value = getattr(param_cls.from_kwargs(**dict(base, **{f.name: edge})), f.name)
        assert value == ((edge, edge) if pair else edge)
        # as MXNet passes it: a string
        param_cls.from_kwargs(**{k: str(v) for k, v in dict(base, **{f.name: edge}).items()})
    with pytest.raises(ValueError, match=rf"^{op_type}: parameter '{f.name}': expected at "
                                         rf"most {high} \({re.escape(why)}\), got "):
        param_cls.from_kwargs(**dict(base, **{f.name: high + 1}))


def test_sampling_ratio_bound_keeps_adaptive_values():
    """<= 0 means adaptive: -1025 is as valid as -1 (RROIAlign's old square-based bound
    refused it as 'at most 1024')."""
    for op_type, name in (("RROIAlign", "sampling_ratio"), ("ROIAlign", "sample_ratio"),
                          ("PSROIAlign", "sample_ratio")):
        cls = REGISTERED[op_type].param_cls
        assert getattr(cls.from_kwargs(**dict(_valid(op_type), **{name: -1025})), name) == -1025


@pytest.mark.parametrize("op_type,name,extra", [
    ("ROIAlign", "sample_ratio", {}), ("PSROIAlign", "sample_ratio", dict(output_dim=1)),
    ("PSROIAlign", "sample_num", dict(output_dim=1, legacy="rfcn"))])
def test_fixed_sampling_ratio_times_pooled_size_is_bounded(op_type, name, extra):
    """A fixed ratio puts ratio * P samples along an axis of P bins: at most
    geometry.MAX_SAMPLES_PER_AXIS (2^22), refused naming the parameter (the sample tables
    refused it later with 'rois: a box needs ... sample points', blaming the rois)."""
    from mx_roi import geometry
    assert geometry.MAX_SAMPLES_PER_AXIS == 4096 * 1024
    cls = REGISTERED[op_type].param_cls
    for pooled, ratio in (((4096, 2), 1024), ((2, 4096), 1024), ((4097, 2), 1023)):
        cls.from_kwargs(pooled_size=pooled, spatial_scale=1.0, **{name: ratio}, **extra)
    for pooled in ((4097, 2), (3, 4097)):
        with pytest.raises(ValueError, match=rf"^{op_type}: parameter '{name}': expected at "
                           rf"most 1023 with pooled_size {re.escape(str(pooled))} \(4194304 "
                           rf"sample points along an axis\), got 1024$"):
            cls.from_kwargs(pooled_size=pooled, spatial_scale=1.0, **{name: 1024}, **extra)
    if op_type == "ROIAlign":  # the Caffe grid ignores sample_ratio
        cls.from_kwargs(pooled_size=(4097, 2), spatial_scale=1.0, sample_ratio=1024,
                        legacy="caffe")


def _high(op_type, name):
    return {f.name: f for f in dataclasses.fields(REGISTERED[op_type].param_cls)}[name] \
        .metadata["bounds"][1]


def _at_limit(op_type):
    """Parameters of ``op_type`` with every integer one at its bound (PSROIAlign's
    sample_num: legacy='rfcn' only), the channel rules kept."""
    top = functools.partial(_high, op_type)
    cases = {
        "ROIPooling": lambda: dict(pooled_size=(1, top("pooled_size")), spatial_scale=1.0),
        "ROIAlign": lambda: dict(pooled_size=(top("pooled_size"), 1), spatial_scale=1.0,
                                 sample_ratio=-2 ** 31),
        "PSROIPooling": lambda: dict(pooled_size=(1, top("pooled_size")), spatial_scale=1.0,
                                     output_dim=1, group_size=(1, top("group_size"))),
        "PSROIAlign": lambda: dict(pooled_size=(1, 1), spatial_scale=1.0,
                                   output_dim=top("output_dim"), group_size=1,
                                   sample_ratio=top("sample_ratio")),
        "RROIAlign": lambda: dict(pooled_size=(1, top("pooled_size")), spatial_scale=1.0,
                                  sampling_ratio=top("sampling_ratio")),
        "PrRoIPool": lambda: dict(pooled_size=(top("pooled_size"), 1), spatial_scale=1.0),
        "DeformablePSROIPooling": lambda: dict(
            spatial_scale=1.0, output_dim=1, group_size=1, pooled_size=top("pooled_size"),
            part_size=top("part_size"), sample_per_part=top("sample_per_part")),
    }
    return cases[op_type]()


_LIMIT_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a huge table: MemoryError
import mxnet as mx, mx_roi
from mxnet import autograd
mx.util.set_np_shape(True)
op, kw = sys.argv[1], json.loads(sys.argv[2])
cls = mx_roi.registry.REGISTERED[op]
C = cls.param_cls.from_kwargs(**kw).in_channels if hasattr(cls.param_cls, "in_channels") \
    else 1
x = mx.nd.ones((0 if C > 8 else 1, C, 4, 4))
x.attach_grad()
x.grad[:] = 7.0  # garbage: the backward (req write) must zero it
p = cls.param_cls.from_kwargs(**kw)
extra = [mx.nd.zeros((0, 2, p.part, p.part))] if len(cls(p).input_names()) > 2 else []
with autograd.record():
    y = mx.nd.Custom(x, mx.nd.zeros((0, cls.rois_columns)), *extra, op_type=op, **kw)
y.backward()
print(json.dumps([list(y.shape), float(x.grad.sum().asscalar())]))
"""


@pytest.mark.parametrize("op_type", sorted(REGISTERED))
def test_size_parameters_at_their_limit_run(op_type):
    """The bounds themselves are usable: with no rois (R = 0) every op takes its integer
    parameters at their bounds (an output dimension of 2^31 - 2) forward and backward, in
    a child process whose address space is 8 GiB (a table sized by a parameter instead of
    by the output would fail it)."""
    kw = _at_limit(op_type)
    # every integer parameter is set (PSROIAlign's sample_num: legacy='rfcn' only)
    assert {f.name for o, f in _int_fields() if o == op_type} - {"sample_num"} <= set(kw)
    proc = subprocess.run([sys.executable, "-c", _LIMIT_CHILD, op_type, json.dumps(kw)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shape, grad_sum = json.loads(proc.stdout.strip().splitlines()[-1])
    assert shape[0] == 0 and max(shape) == max(_high(op_type, "pooled_size"), kw.get(
        "output_dim", 1)) and grad_sum == 0


# ---- the output's size --------------------------------------------------------------

def _exact(op_type, n):
    """(params, data shape, rois count, extra input shapes) of an output of exactly ``n``
    elements, ``n`` even: two rois, one channel, the rest in one pooled side (or
    DeformablePSROIPooling's output_dim).  (2^31 - 1 is a prime: an output of that many
    elements needs a pooled side of 2^31 - 1, which the parameter's bound refuses.)"""
    side = n // 2
    assert 2 * side == n
    if op_type == "DeformablePSROIPooling":  # (R, output_dim, P, P): output_dim carries it
        params = dict(spatial_scale=1.0, output_dim=side, group_size=1, pooled_size=1)
        return params, (1, side, 1, 1), 2, [(2, 2, 1, 1)]
    params = dict(pooled_size=(1, side), spatial_scale=1.0)
    if "output_dim" in REGISTERED[op_type].param_cls.field_names():
        params.update(output_dim=1, group_size=1)
    return params, (1, 1, 4, 4), 2, []


def _size_message(op_type, shape, empty=False):
    size = int(np.prod([max(d, 1) for d in shape], dtype=object))
    channels = "output_dim" if "output_dim" in REGISTERED[op_type].param_cls.field_names() \
        else "data channels"
    has = r"would have \(empty or unknown dimensions at 1\)" if empty else "has"
    return (rf"{op_type}: output shape {re.escape(str(tuple(shape)))} \(rois, {channels}, "
            rf"pooled_size\) {has} {size} elements, more than 2147483646 \(2\^31 - 2, the "
            rf"most elements of an MXNet array\): reduce pooled_size")


def _sym(op_type, params):
    names = REGISTERED[op_type](REGISTERED[op_type].param_cls.from_kwargs(**params)) \
        .input_names()
    return getattr(mx_roi.sym, op_type)(*[mx.sym.var(n) for n in names], **params), names


@pytest.mark.parametrize("op_type", sorted(REGISTERED))
def test_output_size_edge_at_shape_inference(op_type):
    """2^31 - 2 elements infer (the largest array MXNet allocates); 2^31 (the next even
    count: see :func:`_exact`) are refused with the op's message, through mx_roi.sym and
    mx.sym.Custom's infer_shape (nothing is allocated)."""
    for n, ok in ((MAX_ELEMENTS, True), (MAX_ELEMENTS + 2, False)):
        params, data, R, extra = _exact(op_type, n)
        sym, names = _sym(op_type, params)
        plain = mx.sym.Custom(*[mx.sym.var(k) for k in names], op_type=op_type, **params)
        shapes = dict(zip(names, [data, (R, REGISTERED[op_type].rois_columns)] + extra))
        for s in (sym, plain):
            if ok:
                _, (out,), _ = s.infer_shape(**shapes)
                assert int(np.prod(out, dtype=object)) == n, out
            else:
                want = (R, n // 2, 1, 1) if op_type.startswith("Deform") else (R, 1, 1, n // 2)
                with _refused_at_inference(s, _size_message(op_type, want)):
                    s.infer_shape(**shapes)


@pytest.mark.parametrize("op_type", sorted(REGISTERED))
def test_output_size_rule_edges(op_type):
    """The rule itself (``RoIOp.check_out_size``) at its edge, 2^31 - 2 elements passing,
    2^31 - 1 refused, and with empty dimensions counted as 1: an empty call whose
    parameters no call could use is refused (through infer_shape too: no rois)."""
    cls = REGISTERED[op_type]
    op = cls(cls.param_cls.from_kwargs(**cls.selftest_cases[0]))
    for shape in [(1, 1, 1, MAX_ELEMENTS), (2, 1, 1, MAX_ELEMENTS // 2),
                  (0, 1, 1, MAX_ELEMENTS), (1, 0, MAX_ELEMENTS, 1), (0, 0, 46340, 46340),
                  (-1, 1, 46340, 46340)]:
        op.check_out_size(shape)
    with pytest.raises(ValueError, match="^" + _size_message(op_type, (1, 1, 1, 2 ** 31 - 1))):
        op.check_out_size((1, 1, 1, 2 ** 31 - 1))
    with pytest.raises(ValueError, match="^" + _size_message(op_type, (0, 1, 46341, 46341),
                                                           empty=True)):
        op.check_out_size((0, 1, 46341, 46341))
    if op_type != "DeformablePSROIPooling":  # its square grid: 46341 refused by the bound
        params = dict(pooled_size=(46341, 46341), spatial_scale=1.0)
        if "output_dim" in cls.param_cls.field_names():
            params.update(output_dim=1, group_size=1)
        sym, _ = _sym(op_type, params)
        # no rois (np_shape), and an unknown roi count (a 0 without np_shape: -1 in there)
        for np_shape, rows in ((True, 0), (False, -1)):
            with mx.util.np_shape(np_shape), _refused_at_inference(sym, _size_message(
                    op_type, (rows, 1, 46341, 46341), empty=True)):
                sym.infer_shape(data=(1, 1, 4, 4), rois=(0, cls.rois_columns))


def _refused_at_inference(symbol, message):
    """The error of ``symbol``'s shape inference: the Custom door's RoIError
    (``ValueError: <message>``), or on the native door (``mx_roi_<Op>`` nodes,
    mx_roi.ext.door) MXNet's error carrying the library's line ``[0] <message>``, the
    same text."""
    if '"op": "mx_roi_' in symbol.tojson():
        return pytest.raises(mx.base.MXNetError, match=r"(?m)^\s*\[0\] " + message)
    return pytest.raises(RoIError, match="^ValueError: " + message)


def _refused(op_type):
    """(params, shape of the refused output) for one roi on a small map: 46341^2 >
    2^31 - 2 bins of one channel; DeformablePSROIPooling at its largest pooled_size with
    two output channels."""
    if op_type == "DeformablePSROIPooling":
        return dict(spatial_scale=1.0, output_dim=2, group_size=1, pooled_size=46340,
                    part_size=1), (1, 2, 46340, 46340)
    params = dict(pooled_size=(46341, 46341), spatial_scale=1.0)
    if "output_dim" in REGISTERED[op_type].param_cls.field_names():
        params.update(output_dim=1, group_size=1)
    return params, (1, 1, 46341, 46341)


def _small_inputs(op_type, params):
    cls = REGISTERED[op_type]
    op = cls(cls.param_cls.from_kwargs(**params))
    x = np.random.default_rng(0).standard_normal(
        (1, getattr(op.param, "in_channels", 1), 4, 5)).astype(np.float32)
    rois = cls.random_rois(np.random.default_rng(1), 1, 1, 4, 5, 1.0).astype(np.float32)
    return [mx.nd.array(a) for a in [x, rois] + op.example_extra_inputs(
        np.random.default_rng(2), x.shape, rois)]


_ENTRIES = ("mx.nd.Custom", "mx_roi.nd", "gluon", "gluon-hybrid", "sym-bind")


def _run(entry, op_type, params, inputs, train):
    """One call of ``op_type`` through ``entry``, read back."""
    if entry == "sym-bind":
        sym, names = _sym(op_type, params)
        exe = sym.simple_bind(mx.cpu(), **{k: a.shape for k, a in zip(names, inputs)})
        return exe.forward(is_train=train, **dict(zip(names, inputs)))[0].asnumpy()
    with autograd.record() if train else contextlib.nullcontext():
        if entry == "mx.nd.Custom":
            y = mx.nd.Custom(*inputs, op_type=op_type, **params)
        elif entry == "mx_roi.nd":
            y = getattr(mx_roi.nd, op_type)(*inputs, **params)
        else:
            block = getattr(mx_roi.gluon, op_type)(**params)
            if entry == "gluon-hybrid":
                block.hybridize()
            y = block(*inputs)
    return y.asnumpy()


@pytest.mark.parametrize("train", [False, True], ids=["predict", "train"])
@pytest.mark.parametrize("op_type", sorted(REGISTERED))
def test_too_large_output_refused_through_every_entry_point(op_type, train):
    """An output past MXNet's largest array is refused at shape inference with the op's
    message (not MXNet's 'larger than 2^31 elements' or 'Failed to allocate CPU
    Memory'), through every entry point, and the next good call works.

    Each entry point gets its own spatial_scale: the imperative ones share a cached
    graph per parameter set, and a second identical failing call of such a graph is the
    repeated-error issue, handled (and tested) on its own."""
    params, shape = _refused(op_type)
    good = dict(REGISTERED[op_type].selftest_cases[0])
    want = _size_message(op_type, shape)
    for k, entry in enumerate(_ENTRIES):
        kw = dict(params, spatial_scale=1.0 / (k + 2) + 0.01 * train)
        inputs = _small_inputs(op_type, kw)
        with pytest.raises((RoIError, RuntimeError), match=want):
            _run(entry, op_type, kw, inputs, train)
        out = _run(entry, op_type, good, _small_inputs(op_type, good), train)
        assert np.isfinite(out).all()


# ---- DeformablePSROIPooling's optional input through Custom ---------------------------

_DEFORM = dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=2, part_size=2)
_NEEDS = (r"^DeformablePSROIPooling\(\) needs input\(s\) 'trans' with these parameters "
          r"\(inputs: data, rois, trans\)$")
_NOT_TAKEN = (r"^DeformablePSROIPooling\(\): input\(s\) 'trans' not taken with these "
              r"parameters \(inputs: data, rois\)$")


def test_custom_with_trans_missing_or_extra_says_what_mx_roi_nd_says():
    """mx.nd.Custom / mx.sym.Custom: trans missing with no_trans=False, or given with
    no_trans=True: mx_roi.nd's TypeError (not MXNet's 'expects 3 inputs, but got 2'),
    and the next good call works.  A symbol may leave trans out: MXNet makes a variable
    for it, as mx_roi.sym does."""
    data, rois, trans = _small_inputs("DeformablePSROIPooling", _DEFORM)
    no_trans = dict(_DEFORM, no_trans=True)
    cases = [(lambda: mx.nd.Custom(data, rois, op_type="DeformablePSROIPooling", **_DEFORM),
              _NEEDS),
             (lambda: mx.nd.Custom(data, rois, trans, op_type="DeformablePSROIPooling",
                                   **no_trans), _NOT_TAKEN),
             (lambda: mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"),
                                    mx.sym.var("trans"), op_type="DeformablePSROIPooling",
                                    **no_trans), _NOT_TAKEN),
             (lambda: mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"),
                                    trans=mx.sym.var("trans"),
                                    op_type="DeformablePSROIPooling", **no_trans),
              _NOT_TAKEN),
             (lambda: mx_roi.nd.DeformablePSROIPooling(data, rois, **_DEFORM), _NEEDS),
             (lambda: mx_roi.nd.DeformablePSROIPooling(data, rois, trans, **no_trans),
              _NOT_TAKEN),
             (lambda: mx_roi.sym.DeformablePSROIPooling(
                 mx.sym.var("data"), mx.sym.var("rois"), mx.sym.var("trans"), **no_trans),
              _NOT_TAKEN)]
    want = mx.nd.contrib.DeformablePSROIPooling(data, rois, trans, **_DEFORM).asnumpy()
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
        out = mx.nd.Custom(data, rois, trans, op_type="DeformablePSROIPooling", **_DEFORM)
        np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-6)
    # a symbol without trans: MXNet's variable, as through mx_roi.sym
    plain = mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"),
                          op_type="DeformablePSROIPooling", name="d", **_DEFORM)
    ours = mx_roi.sym.DeformablePSROIPooling(mx.sym.var("data"), mx.sym.var("rois"),
                                            name="d", **_DEFORM)
    assert plain.list_arguments() == ours.list_arguments() == ["data", "rois", "d_trans"]


@pytest.mark.parametrize("F", [mx.nd, mx.sym], ids=["nd", "sym"])
def test_custom_with_too_many_inputs_names_the_op(F):
    data, rois = _small_inputs("ROIAlign", dict(pooled_size=2, spatial_scale=1.0))
    args = [data, rois, data] if F is mx.nd else [mx.sym.var(n) for n in "abc"]
    with pytest.raises(TypeError, match=r"^ROIAlign\(\): takes at most 2 inputs \(data, "
                                        r"rois\), got 3$"):
        F.Custom(*args, op_type="ROIAlign", pooled_size=2, spatial_scale=1.0)


def test_custom_with_bad_parameters_still_reports_them():
    """Parameters that do not parse leave the input check to MXNet's call, which raises
    the parameter's error (from the op's list_arguments)."""
    data, rois, trans = _small_inputs("DeformablePSROIPooling", _DEFORM)
    with pytest.raises(RoIError, match=r"DeformablePSROIPooling: parameter 'pooled_size': "
                                       r"expected at most 46340 "):
        mx.nd.Custom(data, rois, op_type="DeformablePSROIPooling",
                     **dict(_DEFORM, pooled_size=2 ** 31)).asnumpy()
