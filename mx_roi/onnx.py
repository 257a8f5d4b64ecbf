"""ONNX export of ROIPooling, ROIAlign, PSROIPooling and PSROIAlign through MXNet 1.9.1's
``mx.onnx.export_model`` (the other registered ops are refused: :data:`_EMIT`).

``import mx_roi`` calls :func:`install`, which puts translations for op names ``Custom``,
``clip`` and each native operator ``mx_roi_<Op>`` (the extension library,
docs/native_ops.md) into mx2onnx's registry (``MXNetGraph.registry_``).  A native node
``mx_roi_<Op>`` is translated as the ``Custom`` node ``op_type='<Op>'`` with the same
parameters (:func:`convert_custom_ours`: one translation for both doors).  The ``Custom`` one
dispatches on the node's ``op_type``: our op types with a translation in :data:`_EMIT`
get the ONNX forms below, our others an :class:`ExportError`; any
other ``Custom`` node goes to the translation that was registered before ours (if any),
else fails as MXNet would.  ``clip`` handles only our oneDNN guard clips (below) and
passes every other clip to MXNet's translation.  Registering is a dict insertion; this
module imports ``onnx`` only when a graph is exported.

Forms (opset >= 16; every form is checked number by number against our MXNet output in
``tests/test_onnx.py``)::

    ROIAlign avg              RoiAlign(mode='avg', coordinate_transformation_mode=
                              'half_pixel' if aligned else 'output_half_pixel')
    ROIAlign max, sample_ratio > 0
                              RoiAlign(avg, output (P*G, Q*G), sampling_ratio=1): one
                              bilinear sample per cell = our sample points; MaxPool GxG
    ROIPooling                MaxRoiPool (same rounding, +1 end and bins as MXNet)
    PSROIAlign                RoiAlign over all D*Gh*Gw channels, then a constant Gather
                              of each bin's channel (costs P*Q times the op's work)
    PSROIPooling              integral image (CumSum in float64) + Gather of 4 corners

Every form zeroes padding rois (``int(batch) < 0``) and clamps their batch index to 0
before the ONNX op sees it; an index >= N (our op raises) also gives zeros, never a read
out of bounds.  What has no exact form is refused when exporting, with an
``ExportError`` naming op, parameter and why: ``legacy`` modes, ROIAlign ``pool_mode='max'``
with adaptive ``sample_ratio`` (ONNX Runtime's own max mode takes the max of the weighted
taps, not of the interpolated samples), float64 ROIPooling (MaxRoiPool is float only).
float16 graphs compute in float32 between two Casts, as our ops do.

The oneDNN guard nodes ``mx_roi`` puts around the op in graphs (``_copy`` and
``clip(x, -3e38, 3e38)``) export as ``Identity`` and ``Clip``: the same numbers as in MXNet
(finite values pass bit for bit; ±inf become ±3e38 in float32/64).  In float16 the bound
is inf, so the guard clip exports as ``Identity`` (:func:`convert_clip`; MXNet's own clip
translation writes wrong float16 bounds with onnx 1.14).
"""
from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np


__all__ = ["ExportError", "install", "convert_custom", "MIN_OPSET"]

#: RoiAlign's ``coordinate_transformation_mode`` exists from opset 16.
MIN_OPSET = 16



def _registered():
    """op_type -> op class of every registered op (the Custom nodes that are ours)."""
    from .registry import REGISTERED
    return REGISTERED


class ExportError(ValueError):
    """A node of ours that has no ONNX form with the same numbers."""


def _refuse(op_type, name, parameter, why):
    return ExportError(f"{op_type} (node '{name}'): cannot export {parameter} to ONNX: {why}")


class _Builder:
    """Collects ONNX nodes and constant initializers for one MXNet node."""

    def __init__(self, name, kwargs):
        from onnx import helper  # noqa: F401  (fail early, with ONNX's own error)
        self.name = name
        self.initializer = kwargs["initializer"]
        self.nodes: List = []
        self._n = 0

    def tmp(self, what):
        self._n += 1
        return f"{self.name}__{what}{self._n}"

    def const(self, value, dtype):
        from onnx import numpy_helper
        name = self.tmp("c")
        self.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type, inputs, out=None, **attrs):
        from onnx import helper
        out = out or self.tmp(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=self.tmp("n"), **attrs))
        return out

    def cast(self, x, dtype):
        from onnx import helper
        return self.op("Cast", [x], to=int(helper.np_dtype_to_tensor_dtype(np.dtype(dtype))))

    def slice_cols(self, x, start, end):
        return self.op("Slice", [x, self.const([start], np.int64), self.const([end], np.int64),
                                 self.const([1], np.int64)])


def _split_rois(b, data, rois):
    """(batch index clamped to [0, N-1] (R,) int64, boxes (R, 4), valid (R, 1, 1, 1) bool).

    ``valid``: ``0 <= int(batch) < N``.  Our op zeroes a padding roi (< 0) and raises for
    an index >= N; an ONNX model cannot raise, so it zeroes both (ONNX Runtime's RoiAlign
    does not check the index, MaxRoiPool rejects it)."""
    bcol = b.slice_cols(rois, 0, 1)                                  # (R, 1)
    bint = b.cast(b.op("Reshape", [bcol, b.const([-1], np.int64)]), np.int64)  # C truncation
    n = b.op("Slice", [b.op("Shape", [data]), b.const([0], np.int64), b.const([1], np.int64)])
    valid = b.op("And", [b.op("Not", [b.op("Less", [bint, b.const(0, np.int64)])]),
                         b.op("Less", [bint, n])])
    valid = b.op("Reshape", [valid, b.const([-1, 1, 1, 1], np.int64)])
    last = b.op("Sub", [n, b.const([1], np.int64)])
    clamped = b.op("Min", [b.op("Max", [bint, b.const(0, np.int64)]), last])
    return clamped, b.slice_cols(rois, 1, 5), valid


def _roi_align(b, data, rois, p, out_h, out_w, sampling_ratio):
    bidx, boxes, valid = _split_rois(b, data, rois)
    y = b.op("RoiAlign", [data, boxes, bidx], mode="avg", output_height=int(out_h),
             output_width=int(out_w), sampling_ratio=max(int(sampling_ratio), 0),  # 0: adaptive
             spatial_scale=float(p.spatial_scale),
             coordinate_transformation_mode="half_pixel" if p.aligned else "output_half_pixel")
    return y, valid


def _mask(b, y, valid, dtype, out):
    return b.op("Where", [valid, y, b.const(0, dtype)], out)


def _emit_roi_align(b, data, rois, p, cdt, out):
    P, Q = p.pooled_size
    if p.pool_mode == "avg":
        y, valid = _roi_align(b, data, rois, p, P, Q, p.sample_ratio)
        return _mask(b, y, valid, cdt, out)
    G = p.sample_ratio
    # one sample at the centre of each of the P*G x Q*G cells = our G x G points per bin
    y, valid = _roi_align(b, data, rois, p, P * G, Q * G, 1)
    y = b.op("MaxPool", [y], kernel_shape=[G, G], strides=[G, G])
    return _mask(b, y, valid, cdt, out)


def _emit_ps_align(b, data, rois, p, cdt, out):
    from .geometry import ps_channel_map
    P, Q = p.pooled_size
    y, valid = _roi_align(b, data, rois, p, P, Q, p.sample_ratio)   # (R, D*Gh*Gw, P, Q)
    chan = ps_channel_map(p.output_dim, (P, Q), p.group_grid).astype(np.int64)  # (D, P, Q)
    flat = (chan * P + np.arange(P)[None, :, None]) * Q + np.arange(Q)[None, None, :]
    y = b.op("Flatten", [y], axis=1)                                  # (R, D*Gh*Gw*P*Q)
    y = b.op("Gather", [y, b.const(flat, np.int64)], axis=1)          # (R, D, P, Q)
    return _mask(b, y, valid, cdt, out)


def _emit_roi_pooling(b, data, rois, p, cdt, out):
    bidx, boxes, valid = _split_rois(b, data, rois)
    bcol = b.op("Unsqueeze", [b.cast(bidx, np.float32), b.const([1], np.int64)])
    rois5 = b.op("Concat", [bcol, boxes], axis=1)
    y = b.op("MaxRoiPool", [data, rois5], pooled_shape=list(p.pooled_size),
             spatial_scale=float(p.spatial_scale))
    return _mask(b, y, valid, cdt, out)


def _c_round(b, x, dtype):
    """C ``round()`` (half away from zero); ONNX ``Round`` rounds half to even."""
    t = b.op("Floor", [b.op("Abs", [x])])
    half = b.cast(b.op("GreaterOrEqual", [b.op("Sub", [b.op("Abs", [x]), t]),
                                          b.const(0.5, dtype)]), dtype)
    return b.op("Mul", [b.op("Add", [t, half]), b.op("Sign", [x])])


def _emit_ps_pooling(b, data, rois, p, cdt, out):
    """Average over R-FCN's integer bins from an integral image (exact sums in float64)."""
    from .geometry import ps_channel_map
    P, Q = p.pooled_size
    ft, i64 = cdt, np.int64   # the compute dtype (geometry.compute_dtype)
    bidx, boxes, valid = _split_rois(b, data, rois)
    shape = b.op("Shape", [data])                                     # N, C, H, W
    dims = {k: b.op("Gather", [shape, b.const(k, i64)]) for k in (1, 2, 3)}
    Hf, Wf = b.cast(dims[2], ft), b.cast(dims[3], ft)
    s = b.const(np.float32(p.spatial_scale), ft)   # MXNet keeps spatial_scale as a C float
    col = {k: b.slice_cols(boxes, k, k + 1) for k in range(4)}       # (R, 1) each
    one = b.const(1, ft)
    # x1 = round(x1) * s, x2 = (round(x2) + 1) * s   (R-FCN; see geometry.psroi_pooling_bins)
    x1 = b.op("Mul", [_c_round(b, col[0], ft), s])
    y1 = b.op("Mul", [_c_round(b, col[1], ft), s])
    x2 = b.op("Mul", [b.op("Add", [_c_round(b, col[2], ft), one]), s])
    y2 = b.op("Mul", [b.op("Add", [_c_round(b, col[3], ft), one]), s])
    tenth = b.const(0.1, ft)

    def bins(start, end, pooled, limit):
        size = b.op("Max", [b.op("Sub", [end, start]), tenth])
        bin_size = b.op("Div", [size, b.const(np.float32(pooled), ft)])
        i = b.const(np.arange(pooled, dtype=ft)[None, :], ft)       # (1, pooled)
        lo = b.op("Floor", [b.op("Add", [b.op("Mul", [i, bin_size]), start])])
        hi = b.op("Ceil", [b.op("Add", [b.op("Mul", [b.op("Add", [i, one]), bin_size]),
                                         start])])
        zero = b.const(0, ft)
        lo = b.op("Min", [b.op("Max", [lo, zero]), limit])
        hi = b.op("Min", [b.op("Max", [hi, zero]), limit])
        return b.cast(lo, i64), b.cast(hi, i64)                        # (R, pooled)

    hs, he = bins(y1, y2, P, Hf)
    ws, we = bins(x1, x2, Q, Wf)
    # integral image S (N, C, H+1, W+1) in float64: S[.., h, w] = sum of data[.., :h, :w]
    d64 = b.cast(data, np.float64)
    S = b.op("CumSum", [b.op("CumSum", [d64, b.const(2, i64)]), b.const(3, i64)])
    S = b.op("Pad", [S, b.const([0, 0, 1, 1, 0, 0, 0, 0], i64)])
    Sf = b.op("Reshape", [S, b.const([-1], i64)])
    H1 = b.op("Add", [dims[2], b.const(1, i64)])
    W1 = b.op("Add", [dims[3], b.const(1, i64)])
    chan = ps_channel_map(p.output_dim, (P, Q), p.group_grid).astype(i64)  # (D, P, Q)
    # flat index ((b*C + ch)*(H+1) + h)*(W+1) + w, broadcast to (R, D, P, Q)
    bc = b.op("Add", [b.op("Mul", [b.op("Reshape", [bidx, b.const([-1, 1, 1, 1], i64)]),
                                   dims[1]]), b.const(chan[None], i64)])
    bch = b.op("Mul", [bc, H1])

    def corner(hv, wv):
        h = b.op("Reshape", [hv, b.const([-1, 1, P, 1], i64)])
        w = b.op("Reshape", [wv, b.const([-1, 1, 1, Q], i64)])
        idx = b.op("Add", [b.op("Mul", [b.op("Add", [bch, h]), W1]), w])
        return b.op("Gather", [Sf, idx], axis=0)

    total = b.op("Add", [b.op("Sub", [b.op("Sub", [corner(he, we), corner(hs, we)]),
                                      corner(he, ws)]), corner(hs, ws)])
    dh = b.op("Sub", [he, hs])
    dw = b.op("Sub", [we, ws])
    area = b.op("Mul", [b.op("Reshape", [dh, b.const([-1, 1, P, 1], i64)]),
                        b.op("Reshape", [dw, b.const([-1, 1, 1, Q], i64)])])
    empty = b.op("LessOrEqual", [area, b.const(0, i64)])
    safe = b.cast(b.op("Max", [area, b.const(1, i64)]), np.float64)
    y = b.cast(b.op("Div", [total, safe]), ft)
    y = b.op("Where", [empty, b.const(0, ft), y])
    return _mask(b, y, valid, cdt, out)


#: The ONNX translation of each op that has one; a registered op without one is refused
#: with an :class:`ExportError` naming it.
_EMIT = {"ROIAlign": _emit_roi_align, "PSROIAlign": _emit_ps_align,
         "ROIPooling": _emit_roi_pooling, "PSROIPooling": _emit_ps_pooling}


def _check(op_type, name, p, dtype, opset):
    """Raise :class:`ExportError` for what has no ONNX form with our numbers."""
    if op_type not in _EMIT:
        raise _refuse(op_type, name, "the op", "no ONNX translation is defined for it "
                      "(mx_roi.onnx._EMIT)")
    if opset < MIN_OPSET:
        raise _refuse(op_type, name, f"opset {opset}",
                      f"needs opset >= {MIN_OPSET} (RoiAlign's coordinate_transformation_mode)")
    if getattr(p, "legacy", ""):
        raise _refuse(op_type, name, f"legacy={p.legacy!r}",
                      "the legacy kernels' sample points have no ONNX operator; use legacy=''")
    if op_type == "ROIAlign" and p.pool_mode == "max" and p.sample_ratio <= 0:
        raise _refuse(op_type, name, f"pool_mode='max' with sample_ratio={p.sample_ratio}",
                      "ONNX RoiAlign's max mode takes the max of the weighted taps, not of "
                      "the interpolated samples, and an adaptive sample count per roi has no "
                      "static composite; use sample_ratio > 0")
    if dtype == np.float64 and op_type == "ROIPooling":
        raise _refuse(op_type, name, "float64 data",
                      "the ONNX form computes in float32 (MaxRoiPool is float only) while "
                      "the op computes float64 in float64")
    if dtype not in (np.float16, np.float32, np.float64):
        raise _refuse(op_type, name, f"{dtype} data", "only float16/32/64 are supported")


def convert_custom_ours(node, **kwargs):
    """Translate one of our ``Custom`` nodes, or a native node ``mx_roi_<Op>`` (the op
    type is then the node's operator name without the prefix); returns the list of ONNX
    nodes."""
    from mxnet.onnx.mx2onnx._op_translations._op_translations_opset12 import (
        get_inputs, get_input_dtypes)
    from .registry import native_op_type
    name, inputs, attrs = get_inputs(node, kwargs)
    op_type = attrs["op_type"] if node["op"] == "Custom" else native_op_type(node["op"])
    kw = {k: v for k, v in attrs.items() if k != "op_type"}
    try:
        p = _registered()[op_type].param_cls.from_kwargs(**kw)
    except ValueError as exc:
        raise ExportError(f"{op_type} (node '{name}'): {exc}") from None
    dtype = np.dtype(get_input_dtypes(node, kwargs)[0])
    from onnx.defs import onnx_opset_version
    _check(op_type, name, p, dtype, int(kwargs.get("opset_version", onnx_opset_version())))
    b = _Builder(name, kwargs)
    data, rois = inputs[:2]
    # ONNX Runtime's RoiAlign/MaxRoiPool take float/double; float16 computes in float32
    # between two casts, as our ops do (geometry.compute_dtype)
    cdt = np.float64 if dtype == np.float64 else np.float32
    if dtype == np.float16:
        data, rois = b.cast(data, np.float32), b.cast(rois, np.float32)
        y = _EMIT[op_type](b, data, rois, p, cdt, None)
        b.cast(y, np.float16)
        b.nodes[-1].output[0] = name
    else:
        _EMIT[op_type](b, data, rois, p, cdt, name)
    return b.nodes


_PREVIOUS: Dict[int, Callable] = {}
_PREVIOUS_CLIP: Dict[int, Callable] = {}


def _is_guard_clip(attrs):
    from .onednn import GUARD_BOUND as _BOUND
    try:
        return (float(attrs.get("a_min", "nan")) == -_BOUND
                and float(attrs.get("a_max", "nan")) == _BOUND)
    except ValueError:
        return False


def convert_clip(node, **kwargs):
    """mx2onnx translation of ``clip``: our oneDNN guard ``clip(x, -3e38, 3e38)`` becomes
    an exact ONNX ``Clip`` (float16: ``Identity``, the bound is inf there); any other clip
    goes to MXNet's translation.  (MXNet 1.9.1's own translation writes float16 bounds
    as their bit patterns read as numbers, e.g. ``Clip(x, 64500, 31740)``, with onnx 1.14.)"""
    attrs = node.get("attrs", {})
    if not _is_guard_clip(attrs):
        return _chain(_PREVIOUS_CLIP, "clip", node, kwargs)
    from mxnet.onnx.mx2onnx._op_translations._op_translations_opset12 import (
        get_inputs, get_input_dtypes)
    name, inputs, _ = get_inputs(node, kwargs)
    dtype = np.dtype(get_input_dtypes(node, kwargs)[0])
    b = _Builder(name, kwargs)
    if dtype == np.float16:
        b.op("Identity", [inputs[0]], name)
    else:
        lo, hi = _guard_bounds(dtype)
        b.op("Clip", [inputs[0], b.const(lo, dtype), b.const(hi, dtype)], name)
    return b.nodes


def _guard_bounds(dtype):
    """The bounds MXNet's clip really applies in ``dtype`` (its parser makes 3e38 one ulp
    larger than ``np.float32(3e38)``): measured once by clipping -inf and inf."""
    import mxnet as mx
    from .onednn import GUARD_BOUND as _BOUND
    ends = mx.nd.array([-np.inf, np.inf], dtype=dtype)
    lo, hi = mx.nd.clip(ends, -_BOUND, _BOUND).asnumpy()
    return lo, hi


def _chain(previous, op, node, kwargs):
    opset = kwargs.get("opset_version", 12)
    for version in sorted(previous, reverse=True):
        if version <= opset:
            return previous[version](node, **kwargs)
    raise AttributeError(f"No conversion function registered for op type {op} yet")


def convert_custom(node, **kwargs):
    """mx2onnx translation of op ``Custom``: ours by ``op_type``, others to the previous one."""
    op_type = node.get("attrs", {}).get("op_type")
    if op_type in _registered():
        return convert_custom_ours(node, **kwargs)
    try:
        return _chain(_PREVIOUS, "Custom", node, kwargs)
    except AttributeError:
        raise AttributeError(f"No conversion function registered for op type Custom "
                             f"(op_type={op_type!r}); mx_roi exports only its own: "
                             f"{', '.join(_registered())}") from None


convert_custom._mx_roi = True
convert_clip._mx_roi = True
convert_custom_ours._mx_roi = True


def install():
    """Register :func:`convert_custom` (``Custom``), :func:`convert_clip` (``clip``) and,
    for every registered op, :func:`convert_custom_ours` (``mx_roi_<Op>``, the native
    node) with mx2onnx, keeping the translations the first two replace for other nodes.
    Idempotent."""
    try:
        from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
    except ImportError:  # pragma: no cover - an MXNet without mx2onnx
        return
    from .registry import NATIVE_PREFIX
    registry = MXNetGraph.registry_
    for version in set(registry) | {12}:
        ops = registry.setdefault(version, {})
        for op_type in _registered():
            ops[NATIVE_PREFIX + op_type] = convert_custom_ours
    for op, mine, previous in (("Custom", convert_custom, _PREVIOUS),
                               ("clip", convert_clip, _PREVIOUS_CLIP)):
        for version, ops in registry.items():
            fn = ops.get(op)
            if fn is not None and not getattr(fn, "_mx_roi", False):
                previous[version] = fn
        for version in set(registry) | {12}:
            registry.setdefault(version, {})[op] = mine
