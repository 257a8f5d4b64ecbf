"""Generate the ``mx_roi.nd.*`` and ``mx_roi.sym.*`` functions from the op registry.

Each function has the built-in's calling convention (``data``, ``rois``, then the op's
parameters by name), validates the parameters through the op's struct (a bad value
fails here, naming the parameter) and builds ``F.Custom(..., op_type=...)`` through
:func:`mx_roi.mxpatch.call_custom`, which protects the node from the oneDNN hazard.
"""
from __future__ import annotations

import dataclasses

from . import mxpatch
from .registry import REGISTERED

__all__ = ["make_function", "populate"]


def make_function(F, op_cls):
    """``F`` is ``mx.nd`` or ``mx.sym``; returns ``fn(data, rois, *params, name=None, **kw)``."""
    fields = dataclasses.fields(op_cls.param_cls)
    # the built-in's positional order (RoIOp.builtin_order), so that
    # ``mx_roi.nd.ROIAlign(x, rois, (7, 7), 1. / 16)`` reads like ``mx.nd.contrib.ROIAlign``
    order = op_cls.positional_order()

    def fn(data=None, rois=None, *args, name=None, **kwargs):
        if len(args) > len(order):
            raise TypeError(f"{op_cls.name}() takes at most {len(order)} positional "
                            f"parameters after data, rois ({', '.join(order)})")
        for key, value in zip(order, args):
            if key in kwargs:
                raise TypeError(f"{op_cls.name}() got multiple values for '{key}'")
            kwargs[key] = value
        if kwargs.pop("position_sensitive", False) not in (False, "False", "0", 0):
            raise ValueError(f"{op_cls.name}: parameter 'position_sensitive': use PSROIAlign "
                             "(with output_dim) instead of ROIAlign(position_sensitive=True)")
        if data is None or rois is None:
            raise TypeError(f"{op_cls.name}() needs both 'data' and 'rois'")
        param = op_cls.param_cls.from_kwargs(**kwargs)
        extra = {"name": name} if name is not None else {}
        return mxpatch.call_custom(F, op_cls.name, [data, rois], **param.to_kwargs(), **extra)

    fn.__name__ = fn.__qualname__ = op_cls.name
    params = "\n".join(f"{f.name} : default {f.default!r}. {f.metadata.get('doc', '')}"
                       if f.default is not dataclasses.MISSING else
                       f"{f.name} : required. {f.metadata.get('doc', '')}" for f in fields)
    fn.__doc__ = (f"{op_cls.name} on ``{F.__name__}`` through ``Custom(op_type="
                  f"'{op_cls.name}')``.\n\n{(op_cls.__doc__ or '').strip()}\n\n"
                  f"Positional parameters after data, rois: {', '.join(order)}.\n\n"
                  "Parameters\n----------\ndata : (N, C, H, W)\nrois : (R, 5) "
                  f"(batch_index, x1, y1, x2, y2)\n{params}\n")
    return fn


def populate(namespace: dict, F) -> None:
    """Fill a module namespace with one function per registered op."""
    for name, op_cls in REGISTERED.items():
        namespace[name] = make_function(F, op_cls)
