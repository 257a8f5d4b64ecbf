"""Every change ``import mx_roi`` makes to MXNet, in one place.

* Error translation (:mod:`mx_roi.errors`): ``mxnet.base.get_last_ffi_error`` is wrapped
  so that the generic error of a failed custom-op callback comes out as
  :class:`~mx_roi.errors.RoIError` with the op's own message, and the ``print`` of
  ``mxnet.operator``'s callback wrapper is replaced so that an mx_roi error prints no
  traceback (``MX_ROI_TRACEBACK=1`` prints it).
* The oneDNN guard (:mod:`mx_roi.onednn`, hazard report in ``docs/ONEDNN_HAZARD.md``):
  ``mxnet.ndarray.Custom`` / ``mxnet.symbol.Custom`` are wrapped so that a plain
  ``mx.nd.Custom(..., op_type=<ours>)`` goes through :func:`call_custom` too; and
  ``gluon.HybridBlock._call_cached_op`` is wrapped so that a hybridized block whose graph
  feeds one of our nodes straight from a variable makes its inputs plain first
  (:func:`plain_block_inputs`; graph variables get no guard node), and drops the block's
  ``CachedOp`` when its call raised (MXNet leaves it broken after a failed shape
  inference, :func:`_cached_op`).
* ``mx.library.load`` regenerates MXNet's operator functions, ``Custom`` among them: the
  ``Custom`` wrapper is installed again after every load (:func:`_install_library_load_hook`).
* ONNX export (:mod:`mx_roi.onnx`): mx2onnx's translations of ``Custom`` and ``clip``
  are replaced by ones that know our nodes (other nodes are passed on).
* The oneDNN guard of graphs that arrive whole (JSON, a file, a checkpoint, a symbol
  built before ``import mx_roi``): the same guard nodes
  (:func:`mx_roi.onednn.guard_symbol`) where a graph is loaded (``mx.sym.load`` /
  ``load_json``) and where any graph reaches MXNet's execution (``Symbol.bind`` /
  ``simple_bind``, hence ``Module``; the ``SymbolBlock`` constructor, hence
  ``SymbolBlock.imports``; the graph of every hybridized block):
  :func:`_install_graph_guard`.
* :data:`GUARD_BOUND` (defined in :mod:`mx_roi.onednn`, re-exported here): the bound of
  the guard's ``clip``, which the ops' input validation and the ONNX export also know.

:func:`call_custom` is the one way mx_roi builds a ``Custom`` node (``mx_roi.nd``/``sym``,
the Gluon blocks, and users calling ``Custom`` by hand).
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Any, Sequence

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError

from . import errors, onnx, symbol_json
from .onednn import (GUARD_BOUND, bounded_dtype, guard_inputs, guard_output, guard_symbol,
                     onednn_enabled)

__all__ = ["GUARD_BOUND", "call_custom", "install"]



#: ``F.__name__`` -> MXNet's own ``Custom`` (before :func:`install` wrapped it)
_ORIGINAL_CUSTOM = {}


def call_custom(F, op_type: str, inputs: Sequence[Any], **kwargs):
    """``F.Custom(*inputs, op_type=op_type, **kwargs)`` protected against the oneDNN
    hazard (inputs and outputs guarded, :mod:`mx_roi.onednn`).  ``F`` is ``mx.nd`` or
    ``mx.sym`` (inside ``hybrid_forward`` the ``F`` you are given); ``kwargs`` may include
    ``name``.  With oneDNN off no guard is added.  ``inputs`` are the op's, in order
    (``mx_roi.nd``/``sym`` and the Gluon blocks order them with
    :meth:`~mx_roi.registry.RoIOp.order_inputs`, a plain ``F.Custom`` call is checked by
    its wrapper, :func:`_install_custom_guard`).

    An imperative call of one of our ops usually runs as a cached graph
    (:func:`_cached_call`): the same ``Custom`` node at a lower per-call cost."""
    name = kwargs.get("name")
    guarded = guard_inputs(F, *inputs, name=name)
    if F is not mx.sym:
        out = _cached_call(op_type, guarded, kwargs)
        if out is not None:
            return out
    out = _ORIGINAL_CUSTOM.get(F.__name__, F.Custom)(*guarded, op_type=op_type, **kwargs)
    if F is not mx.sym and not mx.autograd.is_recording():
        return out  # the output guard only protects a backward pass, and none will run
    return guard_output(F, out, name=name)


#: largest output (bytes) of an imperative training call that runs as a cached graph: its
#: output guard is then a ``slice_axis`` node, a copy of the output, which costs less
#: than the per-call overhead it saves only for small outputs; a larger output keeps
#: ``mx.nd.Custom`` and the copy-free slice view (:func:`mx_roi.onednn.plain_grad_view`)
CACHED_GUARD_MAX_BYTES = 1 << 20
#: cached graphs kept per thread (one per op type, parameter set and guard)
CACHED_MAX = 64

_CACHED = threading.local()


def _cached_call(op_type, inputs, kwargs):
    """Our op ``op_type`` on NDArrays ``inputs`` through a cached graph (``CachedOp``:
    ``Custom``, and while autograd records with oneDNN on, the output guard
    ``slice_axis``), or None where the plain ``mx.nd.Custom`` path is to be taken;
    TypeError naming the op for a wrong number of inputs.

    ``mx.nd.Custom`` creates and queries the op's Python ``CustomOpProp`` on every call
    (parameter parsing, argument lists, shape and type inference, each a callback), and
    the imperative output guard then runs more Python after the op's callback has
    started, competing with it for the GIL; a ``CachedOp`` builds the graph once and
    runs a call from C++ (measured on a small call, fwd+bwd: about 0.3-0.6 ms less).
    MXNet 1.9.1 keeps the backward dependency list of the last recorded ``Custom`` node
    process-wide (``mxnet.operator._registry.result_deps``); a recorded imperative call
    sets it, so this path sets it to our op's list too."""
    from .registry import REGISTERED
    op_cls = REGISTERED.get(op_type)
    if op_cls is None or "out" in kwargs or \
            not all(isinstance(a, mx.nd.NDArray) for a in inputs):
        return None
    params = {k: v for k, v in kwargs.items() if k != "name"}
    try:
        op = op_cls(op_cls.param_cls.from_kwargs(**params))
    except Exception:  # noqa: BLE001 - the plain path reports it
        return None
    names = op.input_names()
    if len(inputs) != len(names):
        return None  # named inputs: the plain path (call_custom checked the count)
    recording = mx.autograd.is_recording()
    guard = recording and onednn_enabled()
    if guard:
        try:  # the output's size, for the choice of guard
            shape = op.out_shape(inputs[0].shape, inputs[1].shape)
        except Exception:  # noqa: BLE001 - the plain path reports it
            return None
        if math.prod(shape) * np.dtype(inputs[0].dtype).itemsize > CACHED_GUARD_MAX_BYTES:
            return None
    cop = _cached_op(op_cls, params, guard)
    if cop is None:
        return None
    try:
        out = cop(*inputs)
    except MXNetError:
        _CACHED.ops.pop(_cache_key(op_cls, params, guard), None)  # see _cached_op
        raise
    if recording:
        _set_backward_dependency(op_cls, len(names))
    return out


def _cache_key(op_cls, params, guard):
    return op_cls.name, tuple(sorted((k, str(v)) for k, v in params.items())), guard


def _cached_op(op_cls, params, guard):
    """The calling thread's ``CachedOp`` for these parameters (made on first use; None if
    the graph cannot be built -- the plain path then raises the error).

    One whose call raised is dropped by :func:`_cached_call`: MXNet 1.9.1's ``CachedOp``
    keeps the input shapes (dtypes) of a failed shape (type) inference without its
    result, so its next call with those inputs skips the inference and raises MXNet's
    ``Graph attr dependency shape is required by pass MXPlanMemory`` (``Cannot find
    attribute dtype in the graph``) instead of the op's message."""
    cache = getattr(_CACHED, "ops", None)
    if cache is None:
        cache = _CACHED.ops = {}
    key = _cache_key(op_cls, params, guard)
    cop = cache.get(key)
    if cop is None:
        try:
            names = op_cls(op_cls.param_cls.from_kwargs(**params)).input_names()
            node = _ORIGINAL_CUSTOM["mxnet.symbol"](*(mx.sym.var(n) for n in names),
                                                    op_type=op_cls.name, **params)
            if guard:  # a fresh plain-layout gradient for the node's backward
                node = mx.sym.slice_axis(node, axis=0, begin=0, end=None)
            cop = mx.nd.CachedOp(node)
        except Exception:  # noqa: BLE001
            return None
        if len(cache) >= CACHED_MAX:
            cache.clear()
        cache[key] = cop
    return cop


_DEPS = {}


def _set_backward_dependency(op_cls, n_in=2) -> None:
    """Set MXNet's process-wide backward dependency set (which the backward callback of
    *any* ``Custom`` node reads) to the op's declared list, in the numbering of the
    backward callback's arrays: output gradients, inputs, outputs (ours: {0, 1, 2, 3} with
    ``n_in`` = 2 inputs, {0, ..., 4} with 3).
    A recorded ``mx.nd.Custom`` call sets it when it records its node; a cached graph
    declared it only when it was built, and another op may have replaced it since."""
    deps = _DEPS.get((op_cls.name, n_in))
    if deps is None:
        n_out = 1
        prop = op_cls.CustomOpProp.__new__(op_cls.CustomOpProp)
        deps = _DEPS[op_cls.name, n_in] = frozenset(prop.declare_backward_dependency(
            list(range(n_out)), list(range(n_out, n_out + n_in)),
            list(range(n_out + n_in, n_out + n_in + n_out))))
    import mxnet.operator as operator
    operator._registry.result_deps = set(deps)


def install(op_types) -> None:
    """Apply every patch (idempotent); ``op_types`` is a live container of our op types
    (the registry)."""
    _install_error_translation()
    _install_custom_guard(op_types)
    _install_block_input_guard(op_types)
    _install_graph_guard(op_types)
    _install_library_load_hook(op_types)
    onnx.install()  # mx2onnx translations of our Custom nodes (onnx itself imported lazily)


def _install_error_translation() -> None:
    import mxnet.base as base
    import mxnet.operator as operator
    if getattr(operator, "print", None) is not errors.print_hook:
        operator.print = errors.print_hook
    original = base.get_last_ffi_error
    if getattr(original, "_mx_roi", False):
        return

    @functools.wraps(original)
    def get_last_ffi_error():
        return errors.translate(original())

    get_last_ffi_error._mx_roi = True
    base.get_last_ffi_error = get_last_ffi_error


def _install_custom_guard(op_types) -> None:
    """``mxnet.ndarray.Custom`` and ``mxnet.symbol.Custom`` (what ``mx.nd.Custom``,
    ``mx.sym.Custom`` and ``F.Custom`` inside ``hybrid_forward`` resolve to): a call whose
    ``op_type`` is in ``op_types`` goes through :func:`call_custom`; every other call is
    passed on untouched."""
    import mxnet.ndarray as nd_module
    import mxnet.symbol as sym_module
    for F in (nd_module, sym_module):
        original = F.Custom
        if getattr(original, "_mx_roi_guard", False):
            continue
        _ORIGINAL_CUSTOM[F.__name__] = original

        def custom(*args, _original=original, _F=F, **kwargs):
            if kwargs.get("op_type") in op_types and kwargs.get("out") is None:
                kwargs.pop("out", None)
                _check_custom_inputs(_F, kwargs["op_type"], args, kwargs)
                return call_custom(_F, kwargs.pop("op_type"), list(args), **kwargs)
            return _original(*args, **kwargs)

        custom.__name__, custom.__doc__ = original.__name__, original.__doc__
        custom._mx_roi_guard = True
        F.Custom = custom


def _check_custom_inputs(F, op_type, args, kwargs) -> None:
    """The inputs of ``F.Custom(*args, op_type=op_type, **kwargs)`` against the op's for its
    parameters (:meth:`mx_roi.registry.RoIOp.order_inputs`: mx_roi.nd's TypeError, not
    MXNet's count); parameters that do not parse are left to the call (MXNet raises their
    error from the op's ``list_arguments``)."""
    from .registry import REGISTERED, RoIOp
    op_cls = REGISTERED[op_type]
    names = op_cls.inputs
    op_cls.check_input_count(len(args))  # before any parameter is parsed
    arrays = (mx.nd.NDArray, mx.sym.Symbol)
    named = {k: v for k, v in kwargs.items() if isinstance(v, arrays)}
    if len(args) == len(names) and not named and op_cls.input_names is RoIOp.input_names:
        return  # every input given, to an op that takes all of them whatever its parameters
    params = {k: v for k, v in kwargs.items()
              if k not in ("op_type", "name", "attr") and k not in named}
    try:
        op = op_cls(op_cls.param_cls.from_kwargs(**params))
    except Exception:  # noqa: BLE001 - the call reports it
        return
    op.order_inputs(dict(zip(names, args), **named), symbolic=F is mx.sym)


def _reads_a_variable(graph, op_types) -> bool:
    """Whether the symbol ``graph`` has a ``Custom`` node of one of ``op_types`` with an
    input straight from a variable (which :func:`mx_roi.onednn.guard_inputs` leaves
    unguarded)."""
    nodes = symbol_json.parse(graph.tojson())["nodes"]
    return any(n["op"] == "Custom" and n.get("attrs", {}).get("op_type") in op_types and
               any(nodes[i[0]]["op"] == "null" for i in n["inputs"]) for n in nodes)


def plain_block_inputs(block, args, op_types):
    """The input guard of a hybridized block whose graph feeds one of our ``Custom`` nodes
    from a variable: each NDArray argument made plain in place
    (:func:`mx_roi.onednn.plain_nd`; a graph variable gets no guard node, see
    :data:`mx_roi.onednn.LEAF`).  Decided once per cached graph; other blocks pass."""
    graph = getattr(block, "_cached_graph", ())
    if not graph or not onednn_enabled():
        return
    seen = block.__dict__.get("_mx_roi_reads_leaf")
    if seen is None or seen[0] is not graph:
        seen = block.__dict__["_mx_roi_reads_leaf"] = (graph, _reads_a_variable(graph[1],
                                                                                op_types))
    if seen[1]:
        from .onednn import plain_nd
        stack = list(args)
        while stack:
            a = stack.pop()
            if isinstance(a, (list, tuple)):
                stack.extend(a)
            elif isinstance(a, mx.nd.NDArray):
                plain_nd(a)


def _install_block_input_guard(op_types) -> None:
    """``HybridBlock._call_cached_op`` (every call of a hybridized block, ``SymbolBlock``
    included): :func:`plain_block_inputs` before the cached graph runs; a fresh
    ``CachedOp`` after a call that raised."""
    from mxnet.gluon import HybridBlock
    original = HybridBlock._call_cached_op
    if getattr(original, "_mx_roi_guard", False):
        return

    @functools.wraps(original)
    def _call_cached_op(self, *args):
        if self._cached_op is None:
            self._build_cache(*args)
        plain_block_inputs(self, args, op_types)
        try:
            return original(self, *args)
        except MXNetError:
            # MXNet's CachedOp is left broken by a failed shape inference (see
            # _cached_op): the next call builds a fresh one and raises the same error
            self._cached_op = None
            raise

    _call_cached_op._mx_roi_guard = True
    HybridBlock._call_cached_op = _call_cached_op


#: (module, attribute) -> MXNet's own function before :func:`_install_graph_guard`
_ORIGINAL_LOADERS = {}

#: the loaders of MXNet 1.9.1 that make a Symbol from JSON text or a JSON file, by module
#: (``mx.model.load_checkpoint`` and ``SymbolBlock.imports`` call ``mxnet.symbol.load``;
#: ``HybridBlock.load`` the name ``load_json`` in ``mxnet.gluon.block``)
_LOADERS = (("mxnet.symbol.symbol", ("load", "load_json")),
            ("mxnet.symbol", ("load", "load_json")),
            ("mxnet.symbol.numpy._symbol", ("load", "load_json")),
            ("mxnet.gluon.block", ("load_json",)))


def _install_graph_guard(op_types) -> None:
    """Graphs that arrive whole get the oneDNN guard of their ``Custom`` nodes of
    ``op_types`` (:func:`mx_roi.onednn.guard_symbol`; idempotent, a no-op with oneDNN
    off): the symbol loaders (:data:`_LOADERS`) return the guarded symbol;
    ``Symbol.bind`` / ``simple_bind`` (every executor: ``Module``, ``BucketingModule``,
    ``Symbol.eval``) bind the guarded symbol; the ``SymbolBlock`` constructor keeps the
    guarded graph, and so does ``HybridBlock._get_graph`` (the graph a hybridized block's
    ``CachedOp`` is built from, traced or imported: e.g. a ``Custom`` name imported from
    ``mxnet.symbol`` before ``import mx_roi``).  The originals stay reachable: :data:`_ORIGINAL_LOADERS`, and each
    wrapper's ``__wrapped__``."""
    import importlib
    from mxnet.gluon import HybridBlock, SymbolBlock
    for module_name, names in _LOADERS:
        module = importlib.import_module(module_name)
        for attr in names:
            original = getattr(module, attr)
            if getattr(original, "_mx_roi_guard", False):
                continue
            _ORIGINAL_LOADERS[module_name, attr] = original

            @functools.wraps(original)
            def load(*args, _original=original, **kwargs):
                return guard_symbol(_original(*args, **kwargs), op_types)

            load._mx_roi_guard = True
            setattr(module, attr, load)

    for attr in ("bind", "simple_bind"):
        original = getattr(mx.sym.Symbol, attr)
        if getattr(original, "_mx_roi_guard", False):
            continue

        @functools.wraps(original)
        def bind(self, *args, _original=original, **kwargs):
            return _original(guard_symbol(self, op_types), *args, **kwargs)

        bind._mx_roi_guard = True
        setattr(mx.sym.Symbol, attr, bind)

    def guard_cached_graph(block):
        inputs, out = block._cached_graph
        guarded = guard_symbol(out, op_types)
        if guarded is not out:
            block._cached_graph = inputs, guarded

    original_init = SymbolBlock.__init__
    if not getattr(original_init, "_mx_roi_guard", False):
        @functools.wraps(original_init)
        def __init__(self, outputs, inputs, params=None):
            original_init(self, outputs, inputs, params)
            guard_cached_graph(self)

        __init__._mx_roi_guard = True
        SymbolBlock.__init__ = __init__

    original_get_graph = HybridBlock._get_graph
    if not getattr(original_get_graph, "_mx_roi_guard", False):
        @functools.wraps(original_get_graph)
        def _get_graph(self, *args):
            original_get_graph(self, *args)
            guard_cached_graph(self)
            return self._cached_graph

        _get_graph._mx_roi_guard = True
        HybridBlock._get_graph = _get_graph


def _install_library_load_hook(op_types) -> None:
    """``mx.library.load`` (any extension library, mx_roi's own included) regenerates
    every operator function of ``mx.nd`` / ``mx.sym``, ``Custom`` among them, which
    would drop :func:`_install_custom_guard`'s wrapper (and with it the oneDNN guard and
    our messages for plain ``mx.nd.Custom`` calls): the wrapper is installed again after
    each load, and the two modules' own ``__name__``, ``__file__``, ... (which MXNet
    overwrites with those of ``mxnet.ndarray.op`` / ``mxnet.symbol.op``) are put back."""
    import mxnet.library as library
    original = library.load
    if getattr(original, "_mx_roi_guard", False):
        return

    @functools.wraps(original)
    def load(*args, **kwargs):
        # MXNet 1.9.1 copies every name of mxnet.ndarray.op / mxnet.symbol.op into
        # mxnet.ndarray / mxnet.symbol, dunders included: mx.nd.__name__ would become
        # 'mxnet.ndarray.op' (and __file__, __spec__ ... those of the op module)
        import sys
        modules = [sys.modules[m] for m in ("mxnet.ndarray", "mxnet.symbol")]
        dunders = [{k: v for k, v in vars(m).items() if k.startswith("__") and k.endswith("__")}
                   for m in modules]
        try:
            return original(*args, **kwargs)
        finally:
            for m, saved in zip(modules, dunders):
                for k, v in saved.items():
                    setattr(m, k, v)
            _install_custom_guard(op_types)

    load._mx_roi_guard = True
    library.load = load
