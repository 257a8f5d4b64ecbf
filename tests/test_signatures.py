"""The entry points' real signatures (``help()``, IDEs, ``inspect.signature``).

Every ``mx_roi.nd`` / ``mx_roi.sym`` function (and ``mx_roi.gluon.ops(F)``'s) and every
Gluon block constructor shows the op's inputs, then its parameters in the op's positional
order with the parameter struct's defaults -- derived from the registry, never written
by hand -- and a call made by binding that signature works.
"""
import dataclasses
import inspect
import pydoc

import mxnet as mx
import numpy as np
import pytest

import mx_roi
from mx_roi import api, gluon, opcheck
from mx_roi.registry import REGISTERED

P = inspect.Parameter
OPS = sorted(REGISTERED)


def expected_params(op_cls):
    """(name, default) of the op's parameters, read from its struct (and contrib.ROIAlign's
    ``position_sensitive``, which is no field of it)."""
    fields = {f.name: f for f in dataclasses.fields(op_cls.param_cls)}
    out = []
    for name in op_cls.positional_order():
        if name not in fields:
            assert (op_cls.name, name) == ("ROIAlign", "position_sensitive")
            out.append((name, False))
            continue
        f = fields[name]
        out.append((name, P.empty if f.default is dataclasses.MISSING else f.default))
    return out


def problem(name):
    """The op's first selftest case: its parameters and NDArray inputs by input name."""
    params = dict(REGISTERED[name].selftest_cases[0])
    op = opcheck.make_op(name, params)
    data, rois, _, extra = opcheck.problem(op, np.float32)
    arrays = [mx.nd.array(a, dtype=a.dtype) for a in (data, rois, *extra)]
    return params, op, dict(zip(REGISTERED[name].inputs, arrays))


def functions(name):
    return [getattr(mx_roi.nd, name), getattr(mx_roi.sym, name),
            getattr(gluon.ops(mx.nd), name), getattr(gluon.ops(mx.sym), name)]


@pytest.mark.parametrize("name", OPS)
def test_function_signature_is_inputs_then_positional_order_with_struct_defaults(name):
    op_cls = REGISTERED[name]
    want = ([(n, P.POSITIONAL_OR_KEYWORD, P.empty) for n in op_cls.inputs]
            + [(n, P.POSITIONAL_OR_KEYWORD, d) for n, d in expected_params(op_cls)]
            + [("name", P.KEYWORD_ONLY, None)])
    for fn in functions(name):
        got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
        assert got == want, fn


@pytest.mark.parametrize("name", OPS)
def test_block_signature_is_positional_order_with_struct_defaults(name):
    want = ([(n, P.POSITIONAL_OR_KEYWORD, d) for n, d in expected_params(REGISTERED[name])]
            + [("prefix", P.KEYWORD_ONLY, None), ("params", P.KEYWORD_ONLY, None)])
    sig = inspect.signature(getattr(gluon, name))  # a call of the class: no ``self``
    assert [(p.name, p.kind, p.default) for p in sig.parameters.values()] == want


def _bound_call(fn, sig, params, arrays, positional):
    """Call ``fn`` with the arguments bound by ``sig``: every input and required
    parameter, plus the case's optional ones; all positional (as far as the order goes)
    or all by keyword."""
    values = dict(arrays, **params)
    names = [n for n, p in sig.parameters.items()
             if n in values or (p.default is P.empty and p.kind is P.POSITIONAL_OR_KEYWORD)]
    if positional:
        last = max(i for i, n in enumerate(names))
        bound = sig.bind(*[values[n] for n in names[:last + 1]])
    else:
        bound = sig.bind(**{n: values[n] for n in names})
    return fn(*bound.args, **bound.kwargs)


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keywords"])
@pytest.mark.parametrize("name", OPS)
def test_a_call_bound_by_the_signature_works(name, positional):
    params, op, arrays = problem(name)
    data, rois = arrays["data"], arrays["rois"]
    shape = op.out_shape(data.shape, rois.shape)
    fn = getattr(mx_roi.nd, name)
    out = _bound_call(fn, inspect.signature(fn), params, arrays, positional)
    assert out.shape == shape
    want = mx.nd.Custom(*arrays.values(), op_type=name, **op.param.to_kwargs())
    np.testing.assert_array_equal(out.asnumpy(), want.asnumpy())

    sym = _bound_call(getattr(mx_roi.sym, name), inspect.signature(getattr(mx_roi.sym, name)),
                      params, {k: mx.sym.var(k) for k in arrays}, positional)
    assert sym.list_arguments() == list(arrays)

    cls = getattr(gluon, name)
    sig = inspect.signature(cls)
    block = _bound_call(cls, sig, params, {}, positional)
    assert block.param == op.param
    np.testing.assert_array_equal(block(*arrays.values()).asnumpy(), out.asnumpy())


def test_help_shows_the_parameters():
    text = pydoc.render_doc(mx_roi.nd.ROIAlign, renderer=pydoc.plaintext)
    assert ("ROIAlign(data, rois, pooled_size, spatial_scale, sample_ratio=-1, "
            "position_sensitive=False, aligned=False, pool_mode='avg', deterministic=False, "
            "legacy='', *, name=None)") in text
    assert "position_sensitive : default False\n" in text
    text = pydoc.render_doc(mx_roi.sym.DeformablePSROIPooling, renderer=pydoc.plaintext)
    assert "DeformablePSROIPooling(data, rois, trans, spatial_scale, output_dim, " \
           "group_size, pooled_size, part_size=0," in text


def test_the_signature_is_the_function_s_contract():
    """The generated function still refuses what its signature refuses."""
    x, rois = mx.nd.ones((1, 2, 4, 4)), mx.nd.array([[0, 0, 0, 3, 3]])
    with pytest.raises(TypeError, match=r"^ROIPooling\(\) takes at most 3 positional "
                                        r"parameters \(pooled_size, spatial_scale, "
                                        r"deterministic\), got 4$"):
        mx_roi.nd.ROIPooling(x, rois, 2, 1.0, False, 9)
    with pytest.raises(TypeError):
        inspect.signature(mx_roi.nd.ROIPooling).bind(x, rois, 2, 1.0, False, 9)


def test_no_trans_call_passes_none_for_trans():
    """DeformablePSROIPooling without offsets: ``trans`` (no default in the signature, as
    the inputs before the required parameters) is None."""
    params, op, arrays = problem("DeformablePSROIPooling")
    params = dict(params, no_trans=True)
    out = mx_roi.nd.DeformablePSROIPooling(arrays["data"], arrays["rois"], None, **params)
    want = mx.nd.Custom(arrays["data"], arrays["rois"], op_type="DeformablePSROIPooling",
                        **opcheck.make_op("DeformablePSROIPooling", params).param.to_kwargs())
    np.testing.assert_array_equal(out.asnumpy(), want.asnumpy())


def test_param_doc_lists_the_positional_order():
    for name, op_cls in REGISTERED.items():
        heads = [line.split(" : ")[0] for line in api.param_doc(op_cls).splitlines()
                 if not line.startswith(" ")]
        assert heads == list(op_cls.positional_order()), name


def test_roi_pooler_names_every_mode():
    doc = " ".join(gluon.roi_pooler.__doc__.split())
    for mode, name in gluon.MODES.items():
        assert f"``{mode!r}`` ({name}" in doc, mode
