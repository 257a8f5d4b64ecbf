"""Gluon blocks for the mx_roi operators.

* :class:`ROIPooling`, :class:`ROIAlign`, :class:`PSROIPooling`, :class:`PSROIAlign`,
  :class:`RROIAlign`, :class:`DeformablePSROIPooling`, :class:`PrRoIPool`:
  one ``HybridBlock`` per registered op, generated from :data:`mx_roi.registry.REGISTERED`.
  The constructor takes the op's parameters (by name, or positionally in the built-in's
  order like :mod:`mx_roi.nd`: ``op_cls.positional_order()``; its signature says so,
  with the struct's defaults) and validates them through
  the op's parameter struct, so a bad value fails when the block is built, with a
  ``ValueError`` naming the parameter.  The old positional order (the struct's fields,
  different for PSROIPooling and ROIAlign) is still mapped, with a ``DeprecationWarning``,
  where the values cannot be read in the new order; a call valid in both orders with
  different meanings raises ``TypeError`` asking for names.
  ``block(data, rois)`` (an op with more inputs: ``block(data, rois, trans)``, its
  ``input_names()``) builds the op's node through :func:`mx_roi.ext.door.call` (the
  native operator ``mx_roi_<Op>``, or ``Custom(data, rois, ..., op_type=...)`` through
  :func:`mx_roi.call_custom`, the oneDNN guard), imperatively or symbolically.
* :class:`MultiScaleROIAlign`: FPN level assignment + pooling of every RoI at its level
  only, hybridizable.
* :func:`roi_pooler`: a GluonCV-style factory ``roi_pooler('align', (7, 7), 1. / 16)``.
* :func:`ops`: ``ops(F).ROIAlign(x, rois, (7, 7), 1. / 16)`` inside ``hybrid_forward``,
  with the built-ins' positional parameter order.
* :func:`imports`: ``SymbolBlock.imports`` that makes sure the ops are registered (and
  the extension library loaded for native nodes ``mx_roi_<Op>``), and explains graphs
  that need custom or native ops this process does not have.

Blocks pickle and deepcopy by their constructor parameters (plus prefix and hybridize
flags); a cached graph is rebuilt on the next call.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import mxnet as mx
from mxnet.gluon import HybridBlock, SymbolBlock

from . import _version, api, symbol_json
from .ext import door
from .registry import NATIVE_PREFIX, REGISTERED, native_op_type

__all__ = ["RoIBlock", "MultiScaleROIAlign", "roi_pooler", "ops", "imports",
           "check_symbol_json", "MODES"] + list(REGISTERED)

#: ``roi_pooler``/``MultiScaleROIAlign`` modes -> op_type (each op's ``gluon_mode``).
MODES = {op.gluon_mode: name for name, op in REGISTERED.items() if op.gluon_mode}


def _hybrid_state(block):
    return (bool(block._active), dict(block._flags)) if block._active else (False, {})


def _rebuild(cls, kwargs, prefix, hybrid):
    """Unpickling: construct ``cls(**kwargs, prefix=prefix)`` and restore hybridize()."""
    block = cls(prefix=prefix, **kwargs)
    active, flags = hybrid
    if active:
        block.hybridize(True, **flags)
    return block


def _format_value(value):
    return repr(value) if isinstance(value, str) else str(value)


class RoIBlock(HybridBlock):
    """Base of the generated op blocks; ``op_cls`` is the op definition (registry)."""

    op_cls = None

    def __init__(self, *args, prefix=None, params=None, **kwargs):
        if self.op_cls is None:
            raise TypeError("RoIBlock is abstract; use mx_roi.gluon.ROIAlign etc.")
        # positional: the built-in's order (op_cls.positional_order()), as mx_roi.nd/sym;
        # the old order (the struct's fields) still works where it cannot be misread,
        # with a DeprecationWarning
        param = api.bind_params(self.op_cls, args, kwargs, stacklevel=2,
                                old_order=self.op_cls.param_cls.field_names())
        super().__init__(prefix=prefix, params=params)
        self._param = param

    @property
    def op_type(self) -> str:
        return self.op_cls.name

    @property
    def param(self):
        """The validated parameter struct (frozen dataclass)."""
        return self._param

    def op_kwargs(self) -> dict:
        """The parameters as the strings the ``Custom`` node carries."""
        return self._param.to_kwargs()

    def hybrid_forward(self, F, data, rois, *extra):  # pylint: disable=arguments-differ
        given = [data, rois, *extra]
        self.op_cls.check_input_count(len(given))
        # every input the parameters take, also in a graph (no variable made for one left out)
        op = self.op_cls(self._param)
        return door.call(F, op, op.order_inputs(dict(zip(self.op_cls.inputs, given))))

    def __repr__(self):
        fields = ", ".join(f"{f.name}={_format_value(getattr(self._param, f.name))}"
                           for f in dataclasses.fields(self._param))
        return f"{self.__class__.__name__}({fields})"

    def __reduce__(self):
        kwargs = {f.name: getattr(self._param, f.name) for f in dataclasses.fields(self._param)}
        return (_rebuild, (self.__class__, kwargs, self.prefix, _hybrid_state(self)))


def _make_block(op_cls):
    """One ``HybridBlock`` subclass for a registered op; the class's signature (what
    ``inspect.signature``, ``help()`` and IDEs show for a call of it) is
    :func:`mx_roi.api.param_parameters` (the positional order, the struct's defaults)."""
    order = op_cls.positional_order()  # the built-in's order, then the other fields
    P = inspect.Parameter
    sig = inspect.Signature(
        api.param_parameters(op_cls)
        + [P("prefix", P.KEYWORD_ONLY, default=None), P("params", P.KEYWORD_ONLY, default=None)])
    inputs = ", ".join(op_cls.inputs)
    doc = (f"Gluon block for ``{op_cls.name}`` (``Custom(op_type='{op_cls.name}')``).\n\n"
           f"{inspect.cleandoc(op_cls.__doc__ or '')}\n\nCall as ``block({inputs})`` with data "
           f"(N, C, H, W) and rois (R, {op_cls.rois_columns}) = {op_cls.rois_layout} of the same "
           "dtype; "
           "a negative batch index marks a padding roi (output 0).\n\n"
           f"Positional parameters: {', '.join(order)} (the built-in's order, as "
           "``mx_roi.nd``).\n\n"
           f"Parameters\n----------\n{api.param_doc(op_cls)}\n")
    cls = type(op_cls.name, (RoIBlock,), {"op_cls": op_cls, "__module__": __name__,
                                         "__doc__": doc})
    cls.__qualname__ = op_cls.name
    cls.__signature__ = sig
    return cls


for _name, _op in REGISTERED.items():
    globals()[_name] = _make_block(_op)
del _name, _op


def _block_class(mode: str):
    key = str(mode).strip().lower()
    if key in MODES:
        return globals()[MODES[key]]
    if str(mode) in REGISTERED:
        return globals()[str(mode)]
    raise ValueError(f"parameter 'mode': expected one of {', '.join(map(repr, MODES))}, "
                     f"got {mode!r}")


def roi_pooler(mode, pooled_size, spatial_scale, **kwargs) -> RoIBlock:
    """GluonCV-style factory: ``roi_pooler('align', (7, 7), 1. / 16, sample_ratio=2)``.

    ``mode`` is a key of :data:`MODES` (each op's ``gluon_mode``): ``'pool'``
    (ROIPooling), ``'align'`` (ROIAlign), ``'pspool'`` (PSROIPooling, needs
    ``output_dim``), ``'psalign'`` (PSROIAlign, needs ``output_dim``), ``'ralign'``
    (RROIAlign), ``'deformpool'`` (DeformablePSROIPooling) or ``'prpool'`` (PrRoIPool), or
    an op's name; other keyword arguments are the op's parameters (or ``prefix``).
    """
    return _block_class(mode)(pooled_size=pooled_size, spatial_scale=spatial_scale, **kwargs)


class _Ops:
    """``ops(F).ROIAlign(data, rois, pooled_size, spatial_scale, ...)``: see :func:`ops`."""

    def __init__(self, F):
        self._F = F

    def __getattr__(self, name):
        if name not in REGISTERED:
            raise AttributeError(f"mx_roi.gluon.ops(F) has no operator {name!r}; "
                                 f"available: {', '.join(REGISTERED)}")
        return api.make_function(self._F, REGISTERED[name])


def ops(F):
    """Drop-in for ``F.ROIPooling`` / ``F.contrib.ROIAlign`` / ``F.contrib.PSROIPooling``
    inside ``hybrid_forward``: ``mx_roi.gluon.ops(F).ROIAlign(x, rois, (7, 7), 1. / 16,
    sample_ratio=2)`` takes the built-in's positional parameter order and works for
    ``F = mx.nd`` and ``F = mx.sym``."""
    return _Ops(F)


class MultiScaleROIAlign(HybridBlock):
    """Pool each RoI from one level of a feature pyramid (FPN, Lin et al. 2017, eq. 1).

    A RoI of width ``w = x2 - x1`` and height ``h = y2 - y1`` (image coordinates) goes to
    level ``k = floor(canonical_level + log2(sqrt(w * h) / canonical_size) + eps)``,
    clamped to the available levels; level ``k`` is the feature map of stride ``2**k``,
    i.e. ``features[k - log2(strides[0])]``, pooled with ``spatial_scale = 1 / stride``.

    Call as ``block(features, rois)`` with ``features`` a list of (N, C, H_i, W_i) maps
    in the order of ``strides`` and ``rois`` (R, 5).  The output (R, C_out, P, Q) is in
    the rois' order.  Every level's op sees all R rois, those of other levels with batch
    index -1 (padding: output 0, no gradient, no work), and the outputs are summed, so
    the block hybridizes and exports as one static graph.

    Parameters
    ----------
    pooled_size : int or (h, w)
    strides : sequence of int
        The maps' strides, consecutive powers of two, e.g. (4, 8, 16, 32).
    mode : 'align' (default) | 'pool' | 'psalign' | 'pspool'
    canonical_size : float, default 224 (``s0`` of the FPN paper)
    canonical_level : int, default 4 (``k0``)
    eps : float, default 1e-6, added before the floor so that a box exactly at a level's
        boundary size is not pushed down by rounding in log2
    **op_kwargs : the op's other parameters (sample_ratio, aligned, output_dim, ...)
    """

    def __init__(self, pooled_size, strides=(4, 8, 16, 32), mode="align", canonical_size=224,
                 canonical_level=4, eps=1e-6, prefix=None, params=None, **op_kwargs):
        cls = _block_class(mode)
        strides = tuple(int(s) for s in strides)
        if not strides:
            raise ValueError("parameter 'strides': expected at least one stride, got ()")
        k_min = math.log2(strides[0]) if strides[0] > 0 else -1
        expected = tuple(2 ** (int(k_min) + i) for i in range(len(strides)))
        if k_min != int(k_min) or k_min < 0 or strides != expected:
            raise ValueError(f"parameter 'strides': expected consecutive powers of two such "
                             f"as (4, 8, 16, 32), got {strides}")
        if "spatial_scale" in op_kwargs:
            raise ValueError("parameter 'spatial_scale': set by 'strides' (1 / stride), "
                             "do not pass it")
        canonical_size = float(canonical_size)
        if not (canonical_size > 0 and math.isfinite(canonical_size)):
            raise ValueError(f"parameter 'canonical_size': expected a positive number, got "
                             f"{canonical_size!r}")
        if int(canonical_level) != canonical_level:
            raise ValueError(f"parameter 'canonical_level': expected an integer, got "
                             f"{canonical_level!r}")
        super().__init__(prefix=prefix, params=params)
        self._mode = str(mode).strip().lower()
        self._strides = strides
        self._k_min = int(k_min)
        self._k_max = int(k_min) + len(strides) - 1
        self._canonical_size = canonical_size
        self._canonical_level = int(canonical_level)
        self._eps = float(eps)
        self._op_kwargs = dict(op_kwargs)
        self._pooled_size = pooled_size
        with self.name_scope():
            self.levels = []
            for i, stride in enumerate(strides):
                blk = cls(pooled_size=pooled_size, spatial_scale=1.0 / stride,
                          prefix=f"level{self._k_min + i}_", **op_kwargs)
                self.register_child(blk, f"level{self._k_min + i}")
                self.levels.append(blk)

    @property
    def strides(self):
        return self._strides

    @property
    def level_range(self):
        """(k_min, k_max): the FPN levels of the first and last feature map."""
        return self._k_min, self._k_max

    def assign_levels(self, F, rois):
        """(R, 1) float32 level index 0..L-1 (feature index) of each roi."""
        r = F.cast(F.BlockGrad(rois), dtype="float32")
        w = F.relu(F.slice_axis(r, axis=1, begin=3, end=4) - F.slice_axis(r, axis=1, begin=1, end=2))
        h = F.relu(F.slice_axis(r, axis=1, begin=4, end=5) - F.slice_axis(r, axis=1, begin=2, end=3))
        # log2(sqrt(w*h)) = (log2(w) + log2(h)) / 2 would be exact too; w*h fits float32.
        k = F.floor(self._canonical_level + F.log2(F.sqrt(w * h) / self._canonical_size)
                    + self._eps)
        return F.clip(k, self._k_min, self._k_max) - self._k_min

    def hybrid_forward(self, F, features, rois):  # pylint: disable=arguments-differ
        if not isinstance(features, (list, tuple)):
            features = [features]
        if len(features) != len(self._strides):
            raise ValueError(f"MultiScaleROIAlign: got {len(features)} feature map(s) for "
                             f"{len(self._strides)} strides {self._strides}")
        if len(features) == 1:
            return self.levels[0](features[0], rois)
        level = self.assign_levels(F, rois)
        # rois_i = rois with batch index -1 where the roi is not at level i.  Built with
        # where() over the whole (R, 5) array rather than concat(batch_i, coords): a oneDNN
        # concat output read by a Custom op can be garbage in MXNet 1.9.1 (see docs).
        column = F.broadcast_like(F.reshape(F.arange(5), shape=(1, 5)), rois)  # 0..4 per row
        pad = F.ones_like(rois) * -1
        outs = []
        for i, (blk, feat) in enumerate(zip(self.levels, features)):
            keep = F.broadcast_add(column, level == i)  # > 0 except batch col of other levels
            outs.append(blk(feat, F.where(keep, rois, pad)))
        return F.add_n(*outs)

    def __repr__(self):
        extra = "".join(f", {k}={_format_value(v)}" for k, v in self._op_kwargs.items())
        return (f"{self.__class__.__name__}(mode={self._mode!r}, pooled_size="
                f"{self.levels[0].param.pooled_size}, strides={self._strides}, "
                f"canonical_size={self._canonical_size:g}, canonical_level="
                f"{self._canonical_level}{extra})")

    def __reduce__(self):
        kwargs = dict(pooled_size=self._pooled_size, strides=self._strides, mode=self._mode,
                      canonical_size=self._canonical_size,
                      canonical_level=self._canonical_level, eps=self._eps, **self._op_kwargs)
        return (_rebuild, (self.__class__, kwargs, self.prefix, _hybrid_state(self)))


# ---- loading exported graphs ------------------------------------------------------------

def check_symbol_json(symbol_file) -> list:
    """The custom and native operators an exported graph (``*-symbol.json``) uses: each
    ``Custom`` node's op_type and each native node's operator name (``mx_roi_<Op>``, the
    extension library: :mod:`mx_roi.ext`), in the order of first use.

    Raises ``RuntimeError`` naming those this process cannot run, instead of MXNet's
    ``Cannot find custom operator ...`` / ``Cannot find operator ...`` from deep inside
    the loader: ``Custom`` op_types no ``CustomOpProp`` is registered for (telling to
    ``import mx_roi`` for ours), native nodes whose library is not loaded (telling how to
    load it, or why it cannot be built here).
    """
    graph = symbol_json.load(symbol_file)
    nodes = {}
    for node in graph.get("nodes", []):
        if node.get("op") == "Custom":
            attrs = node.get("attrs", node.get("attr", node.get("param", {}))) or {}
            op_type = attrs.get("op_type")
            if op_type and op_type not in nodes:
                nodes[op_type] = (attrs, len(node.get("inputs", [])))
        elif str(node.get("op", "")).startswith(NATIVE_PREFIX):
            nodes.setdefault(node["op"], None)
    customs = {t: v for t, v in nodes.items() if v is not None}
    missing = [t for t, (attrs, n) in customs.items() if not _custom_registered(t, attrs, n)]
    if missing:
        ours = [t for t in missing if t in REGISTERED]
        hint = ("run `import mx_roi` before loading it (it registers " + ", ".join(ours) + ")"
                if ours else "import the package that registers them before loading it")
        raise RuntimeError(f"{symbol_file}: the graph uses custom operator(s) "
                           f"{', '.join(missing)} that are not registered in this process; "
                           f"{hint}")
    known = set(_loaded_operators())
    missing = [t for t, v in nodes.items() if v is None and t not in known]
    if missing:
        raise RuntimeError(f"{symbol_file}: the graph uses native operator(s) "
                           f"{', '.join(missing)} that are not loaded in this process; "
                           f"{_native_hint(missing, known)}")
    return list(nodes)


def _loaded_operators():
    """Every operator name MXNet knows in this process (built-in and loaded)."""
    return mx.operator.get_all_registered_operators()


def _native_hint(missing, known) -> str:
    """What to do about native operators ``missing`` that MXNet does not know (``known``:
    the operators it does know)."""
    from . import ext
    foreign = [t for t in missing if native_op_type(t) is None]
    if foreign:
        return (f"{', '.join(foreign)}: not the native operator of an mx_roi op (mx_roi "
                f"{_version.__version__}'s ops: {', '.join(REGISTERED)})")
    if any(op.startswith(NATIVE_PREFIX) for op in known):
        return (f"mx_roi's extension library is loaded but has no such operator: this "
                f"mx_roi ({_version.__version__}) has no native door for "
                f"{', '.join(native_op_type(t) for t in missing)} yet")
    why = ext.unavailable_reason()
    if why:
        return f"mx_roi's extension library, which holds them, cannot be built here: {why}"
    return ("load mx_roi's extension library first: mx_roi.ext.load() "
            "(or mx.library.load(mx_roi.ext.library_path())); mx_roi.gluon.imports does it")


def _custom_registered(op_type: str, attrs: dict, num_inputs: int) -> bool:
    """Whether MXNet knows a CustomOpProp for ``op_type`` (MXNet has no query for it)."""
    if op_type in REGISTERED:
        return True
    inputs = [mx.sym.var(f"in{i}") for i in range(max(num_inputs, 1))]
    kwargs = {k: v for k, v in attrs.items() if not k.startswith("__")}
    try:
        mx.sym.Custom(*inputs, **kwargs)
    except mx.base.MXNetError as exc:
        return "Cannot find custom operator" not in str(exc)
    return True


def imports(symbol_file, input_names, param_file=None, ctx=None, **kwargs):
    """``SymbolBlock.imports`` for graphs with mx_roi ops.

    The ops are registered already (importing this module imports the package
    :mod:`mx_roi` first, which registers them); a graph with native nodes
    (``mx_roi_<Op>``) gets the extension library loaded (:func:`mx_roi.ext.load`).  This
    checks that every ``Custom`` op_type and native operator of the graph is available
    (:func:`check_symbol_json`: a clear error otherwise) and loads the block.
    """
    from . import ext
    natives = [n for n in symbol_json.load(symbol_file).get("nodes", [])
               if native_op_type(str(n.get("op", ""))) is not None]
    if natives and not ext.unavailable_reason():
        ext.load()
    check_symbol_json(symbol_file)
    return SymbolBlock.imports(symbol_file, input_names, param_file=param_file, ctx=ctx,
                               **kwargs)
