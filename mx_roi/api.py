"""Generate the ``mx_roi.nd.*`` and ``mx_roi.sym.*`` functions from the op registry.

Each function has the built-in's calling convention (``data``, ``rois``, then the op's
parameters by name), validates the parameters through the op's struct (a bad value
fails here, naming the parameter) and builds the op's node through
:func:`mx_roi.ext.door.call`: the native operator ``mx_roi_<Op>`` where the door rule
allows it, else ``F.Custom(..., op_type=...)`` through :func:`mx_roi.mxpatch.call_custom`,
which protects the node from the oneDNN hazard.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings

import mxnet as mx

from .ext import door
from .registry import REGISTERED

__all__ = ["make_function", "populate", "bind_params", "parse_params", "signature",
           "param_table", "param_parameters", "param_doc", "BUILTIN_ONLY"]

_FALSE = (False, "False", "false", "0", 0)

#: parameters of a built-in's positional order that are not fields of the op's struct:
#: name -> (default, type, meaning).  ``contrib.ROIAlign``'s ``position_sensitive``,
#: accepted when false (:func:`parse_params`)
BUILTIN_ONLY = {
    "position_sensitive": (False, "bool", "contrib.ROIAlign's; only False is accepted "
                                          "(True: use PSROIAlign, with output_dim)"),
}


def param_table(op_cls) -> list:
    """``[(name, default, type, meaning), ...]`` of the op's parameters in its positional
    order (:meth:`~mx_roi.registry.RoIOp.positional_order`): its struct's fields
    (``inspect.Parameter.empty`` for a required one's default; the type as annotated) and
    any :data:`BUILTIN_ONLY` parameter of that order.  The one source of every entry
    point's signature, its docstring and the API reference's parameter table."""
    fields = {f.name: f for f in dataclasses.fields(op_cls.param_cls)}
    rows = []
    for name in op_cls.positional_order():
        if name in fields:
            f = fields[name]
            default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
            rows.append((name, default, f.type, f.metadata.get("doc", "")))
        else:
            rows.append((name, *BUILTIN_ONLY[name]))
    return rows


def param_parameters(op_cls) -> list:
    """The op's parameters as :class:`inspect.Parameter` s (:func:`param_table`)."""
    P = inspect.Parameter
    return [P(name, P.POSITIONAL_OR_KEYWORD, default=default)
            for name, default, _, _ in param_table(op_cls)]


def param_doc(op_cls) -> str:
    """NumPy-style lines of the op's parameters (:func:`param_table`)."""
    return "\n".join(
        f"{name} : {'required' if default is inspect.Parameter.empty else f'default {default!r}'}"
        f"\n    {meaning}" for name, default, _, meaning in param_table(op_cls))


def signature(op_cls) -> inspect.Signature:
    """``fn(data, rois, [extra inputs,] <params in positional order>, *, name=None)``: the
    signature of the op's ``mx_roi.nd`` / ``mx_roi.sym`` function (:func:`make_function`).
    The inputs have no default: an input the parameters drop (DeformablePSROIPooling's
    ``trans`` with ``no_trans=True``) is passed as ``None`` or left out by name."""
    P = inspect.Parameter
    return inspect.Signature([P(n, P.POSITIONAL_OR_KEYWORD) for n in op_cls.inputs]
                             + param_parameters(op_cls)
                             + [P("name", P.KEYWORD_ONLY, default=None)])


def _name_args(op_cls, order, args, kwargs) -> dict:
    """``kwargs`` plus ``args`` named by ``order``; TypeError for too many / duplicates."""
    if len(args) > len(order):
        raise TypeError(f"{op_cls.name}() takes at most {len(order)} positional parameters "
                        f"({', '.join(order)}), got {len(args)}")
    named = dict(kwargs)
    for key, value in zip(order, args):
        if key in named:
            raise TypeError(f"{op_cls.name}() got multiple values for parameter '{key}'")
        named[key] = value
    return named


def parse_params(op_cls, kwargs: dict):
    """The op's parameter struct from keyword parameters (ValueError naming a bad one).

    ``position_sensitive`` (a parameter of ``contrib.ROIAlign``, in its positional order)
    is accepted when false; true points to PSROIAlign."""
    kwargs = dict(kwargs)
    if kwargs.pop("position_sensitive", False) not in _FALSE:
        raise ValueError(f"{op_cls.name}: parameter 'position_sensitive': use PSROIAlign "
                         "(with output_dim) instead of ROIAlign(position_sensitive=True)")
    return op_cls.param_cls.from_kwargs(**kwargs)


def _keyword_form(op_cls, named: dict, args_names) -> str:
    return f"{op_cls.name}(" + ", ".join(f"{k}={named[k]!r}" for k in args_names) + ")"


def bind_params(op_cls, args, kwargs, old_order=None, stacklevel=2):
    """The parameter struct of a call with positional ``args`` and keyword ``kwargs``.

    ``args`` are named by ``op_cls.positional_order()`` (the built-in's order).  With
    ``old_order`` (a positional order the entry point used to take), a call that is only
    valid in the old order is mapped with a ``DeprecationWarning`` showing the keyword
    form; a call valid in both orders with different meanings raises ``TypeError``
    (never silently one of them); a call valid in neither raises the built-in order's
    error (naming the parameter).
    """
    order = op_cls.positional_order()
    if not old_order or not args or tuple(old_order[:len(args)]) == order[:len(args)]:
        return parse_params(op_cls, _name_args(op_cls, order, args, kwargs))
    try:
        param = parse_params(op_cls, _name_args(op_cls, order, args, kwargs))
    except (TypeError, ValueError) as exc:
        new_error = exc
        param = None
    try:
        old_named = _name_args(op_cls, old_order, args, kwargs)
        old_param = parse_params(op_cls, old_named)
    except (TypeError, ValueError):
        old_param = None
    if old_param is None or old_param == param:
        if param is None:
            raise new_error
        return param
    old_names = tuple(old_order[:len(args)])
    if param is None:
        warnings.warn(
            f"{op_cls.name}(): positional parameters in the parameter struct's order "
            f"({', '.join(old_order)}) are deprecated; the positional order is now the "
            f"built-in's ({', '.join(order)}). Pass them by name: "
            f"{_keyword_form(op_cls, old_named, old_names)}",
            DeprecationWarning, stacklevel=stacklevel + 1)
        return old_param
    new_named = _name_args(op_cls, order, args, kwargs)
    raise TypeError(
        f"{op_cls.name}(): ambiguous positional parameters {args!r}: in the built-in's "
        f"order they read {_keyword_form(op_cls, new_named, order[:len(args)])}, in the "
        f"old (parameter struct) order {_keyword_form(op_cls, old_named, old_names)}; "
        "pass them by name")


def make_function(F, op_cls):
    """``F`` is ``mx.nd`` or ``mx.sym``; returns ``fn(data, rois, [extra inputs,] *params,
    name=None, **kw)`` (the inputs: ``op_cls.inputs``)."""
    # the built-in's positional order (RoIOp.positional_order), so that
    # ``mx_roi.nd.ROIAlign(x, rois, (7, 7), 1. / 16)`` reads like ``mx.nd.contrib.ROIAlign``
    order = op_cls.positional_order()

    names = tuple(op_cls.inputs)  # positional first: the inputs, as the built-in's

    def fn(*args, name=None, **kwargs):
        given = dict(zip(names, args))
        for key in names:
            if key in kwargs:
                if key in given:
                    raise TypeError(f"{op_cls.name}() got multiple values for input '{key}'")
                given[key] = kwargs.pop(key)
        param = bind_params(op_cls, args[len(names):], kwargs)
        op = op_cls(param)
        return door.call(F, op, _inputs(F, op, given), name=name)

    fn.__name__ = fn.__qualname__ = op_cls.name
    fn.__signature__ = signature(op_cls)
    fn.__doc__ = (f"{op_cls.name} on ``{F.__name__}`` through ``mx_roi_{op_cls.name}`` "
                  f"or ``Custom(op_type='{op_cls.name}')`` (mx_roi.ext.door).\n\n"
                  f"{inspect.cleandoc(op_cls.__doc__ or '')}\n\n"
                  f"Positional parameters after {', '.join(names)}: {', '.join(order)}.\n\n"
                  "Parameters\n----------\ndata : (N, C, H, W)\n"
                  f"rois : (R, {op_cls.rois_columns}) {op_cls.rois_layout}\n"
                  + "".join(f"{n} : see above\n" for n in names[2:])
                  + f"{param_doc(op_cls)}\nname : str, optional\n    the node's name\n")
    return fn


def _inputs(F, op, given) -> list:
    """The inputs of the call in the op's ``input_names()`` order
    (:meth:`~mx_roi.registry.RoIOp.order_inputs`); both ``data`` and ``rois`` given."""
    if given.get("data") is None or given.get("rois") is None:
        raise TypeError(f"{op.name}() needs both 'data' and 'rois'")
    return op.order_inputs(given, symbolic=F is mx.sym)


def populate(namespace: dict, F) -> None:
    """Fill a module namespace with one function per registered op."""
    for name, op_cls in REGISTERED.items():
        namespace[name] = make_function(F, op_cls)
