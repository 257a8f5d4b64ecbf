"""Protection for Python custom ops against the oneDNN (MKLDNN) layout hazard of MXNet 1.9.1.

A ``Custom`` node fed by a oneDNN operator (or whose output feeds one, for the backward)
can be handed memory MXNet has already freed.  The guard: every array input and output
of the node goes through ``clip(x, -B, B)`` (B = :data:`GUARD_BOUND`),
which always computes into a fresh plain-layout buffer (a graph input that is a variable
is made plain before the graph runs instead: :data:`LEAF`); imperative inputs are
reordered to the plain layout in place (:func:`plain_nd`) and an imperative output is a
recorded slice view whose backward writes a fresh plain gradient
(:func:`plain_grad_view`).  The measurements, the mechanism and the cost are in
``docs/ONEDNN_HAZARD.md``.  :func:`mx_roi.call_custom`
(:mod:`mx_roi.mxpatch`) applies the guard; ``import mx_roi`` makes plain
``mx.nd.Custom``/``mx.sym.Custom`` calls of our ops use it too.
"""
from __future__ import annotations

import functools
from typing import Any

import ctypes

import numpy as np

import mxnet as mx
from mxnet.base import _LIB, SymbolHandle, c_str, check_call

from . import symbol_json
from .switches import switched_off

#: The oneDNN guard is ``clip(x, -GUARD_BOUND, GUARD_BOUND)``.  Not +-inf, and not FLT_MAX
#: itself: MXNet's float parameter parser rejects both ("Out of range value for a_max,
#: value='inf'" / "value='3.4028234663852886e+38'").  Since the guard turns inf into this
#: bound, the ops count ``|x| >= GUARD_BOUND`` as infinite (the registry's input check and
#: the ONNX export read it from here).
GUARD_BOUND = 3.0e38
_BOUND = GUARD_BOUND


def bounded_dtype(dtype) -> bool:
    """Whether ``dtype`` holds :data:`GUARD_BOUND` (float32, float64): there |x| >=
    GUARD_BOUND counts as infinite (float16: only inf and NaN are)."""
    held = _BOUNDED.get(dtype)
    if held is None:
        held = _BOUNDED[np.dtype(dtype)] = GUARD_BOUND <= float(np.finfo(dtype).max)
    return held


_BOUNDED = {}

__all__ = ["onednn_build", "onednn_enabled", "barrier", "guard_inputs", "guard_output",
           "plain_grad_view", "GUARD_BOUND", "bounded_dtype", "guard_node_names",
           "input_needs_guard", "guard_graph", "guard_symbol"]

_BUILD = None  # cached: does the loaded libmxnet have oneDNN compiled in?


def onednn_build() -> bool:
    """True when the loaded MXNet library was built with oneDNN (MKLDNN)."""
    global _BUILD
    if _BUILD is None:
        try:
            feats = mx.runtime.Features()
            _BUILD = any(name in feats and feats.is_enabled(name)
                         for name in ("MKLDNN", "ONEDNN"))
        except Exception:  # pragma: no cover - very old / unusual builds
            _BUILD = False
    return _BUILD


_OFF_AT_IMPORT = switched_off("MXNET_MKLDNN_ENABLED")


def onednn_enabled() -> bool:
    """True when oneDNN operators may be active: built in, and not disabled by
    ``MXNET_MKLDNN_ENABLED=0``.  MXNet reads that variable once, when its first operator
    runs, which we cannot observe; so it counts as "off" only if it was off when this
    module was imported and still is now (errs on the side of guarding)."""
    if not onednn_build():
        return False
    return not (_OFF_AT_IMPORT and switched_off("MXNET_MKLDNN_ENABLED"))


def barrier(F, x, name=None):
    """``clip(x, -3e38, 3e38)``: the same values in a fresh plain-layout array, with a
    plain-layout gradient in the backward.  Always applied (no oneDNN check)."""
    if name is not None and F is mx.sym:
        return F.clip(x, -_BOUND, _BOUND, name=name)
    return F.clip(x, -_BOUND, _BOUND)


def plain_nd(a):
    """Imperative input guard: ``a`` itself, converted *in place* to the plain layout.

    ``wait_to_read`` waits for ``a`` to be computed; ``MXNDArrayGetData`` then, when a
    oneDNN operator left it in a blocked layout, reorders its storage to the default
    layout in place (``NDArray::Reorder2Default``).  ``custom.cc`` then has no temporary
    to make (and free too early): the Custom node reads ``a``'s own memory, which lives
    as long as ``a``.  Costs
    a wait (the imperative call is synchronous here anyway) and, only for a blocked
    array, one reorder -- no copy of a plain array (``clip`` cost 12 ms for a
    2x1029x38x50 map on the 2-core test machine)."""
    if isinstance(a, mx.nd.NDArray) and a.size:
        a.wait_to_read()
        ptr = ctypes.c_void_p()
        check_call(_LIB.MXNDArrayGetData(a.handle, ctypes.byref(ptr)))
    return a


def _is_array(x: Any) -> bool:
    return isinstance(x, (mx.nd.NDArray, mx.sym.Symbol))


#: operators whose outputs are plain arrays of their own (no oneDNN implementation, never
#: in place): a graph input coming straight from one needs no guard -- e.g. the rois from
#: a proposal-target ``Custom`` op or from ``MultiProposal``
PLAIN_PRODUCERS = frozenset({"Custom", "_contrib_Proposal", "_contrib_MultiProposal"})


#: the "operator" of a graph variable.  A variable feeds the ``Custom`` node unguarded: an
#: executor's argument arrays are written by copies (plain layout), and a hybridized
#: block's inputs are made plain in place before its cached graph runs
#: (:func:`mx_roi.mxpatch.plain_block_inputs`).  Guard nodes there would put backward
#: operators between the ``Custom`` node's backward and the variable's gradient, and
#: those run on the unwritten gradient buffer when MXNet skips the ``Custom`` backward
#: after a rejected forward (``docs/ONEDNN_HAZARD.md``, "A rejected step in a graph").
LEAF = "null"


# ------------------------------------------------------------ the guard as graph nodes
# One truth for the symbolic path (guard_inputs/guard_output) and the rewrite of a
# graph that arrives as JSON (guard_graph): the same decision, the same names, the same
# nodes (guard_graph copies op and attrs from the symbols barrier() builds).

def guard_node_names(name: str, i: int) -> tuple:
    """Names of the guard nodes around input/output ``i`` of the ``Custom`` node ``name``:
    ``({name}_guard_copy{i}, {name}_guard_in{i}, {name}_guard_out{i})``."""
    return f"{name}_guard_copy{i}", f"{name}_guard_in{i}", f"{name}_guard_out{i}"


def _is_barrier(node: dict) -> bool:
    """Whether JSON graph node ``node`` is a guard ``clip`` (:func:`barrier`)."""
    attrs = node.get("attrs", {})
    try:
        return node["op"] == "clip" and float(attrs["a_min"]) == -_BOUND and \
            float(attrs["a_max"]) == _BOUND
    except (KeyError, ValueError):
        return False


def input_needs_guard(nodes, entry) -> bool:
    """Whether the array ``entry`` (``[node id, output, version]`` in the JSON node list
    ``nodes``) needs the input guard in front of a ``Custom`` node: not when it is a
    variable (:data:`LEAF`), the output of a :data:`PLAIN_PRODUCERS` operator, or
    already an input guard (a :func:`barrier` of an ``identity``)."""
    producer = nodes[entry[0]]
    if producer["op"] == LEAF or producer["op"] in PLAIN_PRODUCERS:
        return False
    return not (_is_barrier(producer) and
                nodes[producer["inputs"][0][0]]["op"] == "_copy")


def _symbol_needs_guard(s) -> bool:
    """:func:`input_needs_guard` for symbol ``s`` (a multi-output symbol: guarded)."""
    if s.get_children() is None:
        return False  # a variable, without serialising it
    graph = symbol_json.parse(s.tojson())
    return len(graph["heads"]) != 1 or input_needs_guard(graph["nodes"], graph["heads"][0])


def guard_inputs(F, *arrays, name=None):
    """Return ``arrays`` (as a tuple) made safe to feed a ``Custom`` node.

    Imperatively (``F`` is ``mx.nd``) each array is :func:`plain_nd` (made plain in place,
    no copy); in graphs it passes through ``identity`` and :func:`barrier`, unless
    :func:`input_needs_guard` says not (a variable, :data:`LEAF`; the output of an
    operator in :data:`PLAIN_PRODUCERS`; an input guard already).
    Non-array items (``None``, numbers) pass through.  With ``name`` (symbolic mode) the guard nodes
    are called ``{name}_guard_copy{i}`` / ``{name}_guard_in{i}``.  A no-op when oneDNN is
    off."""
    if not onednn_enabled():
        return tuple(arrays)
    # MXNet 1.9.1's clip backward ignores grad_req='add' (it overwrites): an identity in
    # front of the clip takes the gradient of a leaf input and accumulates it correctly
    def guarded(i, a):
        if F is not mx.sym:
            return plain_nd(a)
        if not _symbol_needs_guard(a):
            return a
        if name is None:
            return barrier(F, F.identity(a))
        copy, clip, _ = guard_node_names(name, i)
        return barrier(F, F.identity(a, name=copy), clip)

    return tuple(guarded(i, a) if _is_array(a) else a for i, a in enumerate(arrays))


def guard_output(F, out, name=None):
    """Return the output(s) of a ``Custom`` node made safe for the backward pass: in
    graphs through :func:`barrier`, imperatively as :func:`plain_grad_view`.

    Accepts an NDArray, a list/tuple of NDArrays (multi-output ``mx.nd.Custom``), a
    Symbol (single or grouped multi-output ``mx.sym.Custom``).  With ``name`` (symbolic
    mode) the guard nodes are called ``{name}_guard_out{i}`` (the Custom node itself keeps
    its own name, so ``get_internals()[name + '_output']`` still finds it).  A no-op when
    oneDNN is off."""
    if not onednn_enabled() or out is None:
        return out
    def nm(i):
        return None if name is None else guard_node_names(name, i)[2]
    if isinstance(out, (list, tuple)):
        return type(out)((plain_grad_view(o) if isinstance(o, mx.nd.NDArray)
                          else barrier(F, o, nm(i))) if _is_array(o) else o
                         for i, o in enumerate(out))
    if isinstance(out, mx.sym.Symbol):
        n = len(out.list_outputs())
        if n > 1:
            return mx.sym.Group([barrier(F, out[i], nm(i)) for i in range(n)])
        return barrier(F, out, nm(0))
    if isinstance(out, mx.nd.NDArray):
        return plain_grad_view(out)
    return out


def plain_grad_view(a):
    """Imperative output guard: ``a[0:len(a)]``, a recorded ``slice`` whose forward is a
    view of ``a`` (no copy, no new buffer) and whose backward ``_backward_slice`` is a
    plain ``FCompute`` kernel writing a fresh plain-layout gradient -- all the backward of
    the ``Custom`` node needs (``docs/ONEDNN_HAZARD.md``).  An empty array (nothing to
    slice) goes through :func:`barrier`."""
    if a.ndim == 0 or a.shape[0] == 0:
        return barrier(mx.nd, a)
    return a[0:a.shape[0]]


# ------------------------------------------------------- graphs that arrive as JSON
@functools.lru_cache(maxsize=None)
def _guard_node_templates() -> tuple:
    """(identity node, clip node) of the input guard as :func:`guard_inputs` builds them,
    as JSON node dicts without name and inputs (op and attrs: one truth)."""
    x = mx.sym.var("x")
    nodes = symbol_json.parse(barrier(mx.sym, mx.sym.identity(x, name="c"), "b").tojson())["nodes"]
    return tuple({k: v for k, v in n.items() if k not in ("name", "inputs")}
                 for n in nodes[1:])


def guard_graph(graph: dict, op_types):
    """The JSON graph ``graph`` (``Symbol.tojson()`` parsed) with every ``Custom`` node of
    ``op_types`` guarded as :func:`guard_inputs` / :func:`guard_output` guard a node
    built through ``mx.sym`` -- the same nodes with the same names, so that the graph
    of a model equals the one its symbolic construction gives -- or None when nothing is
    to be added (no such node, or every one guarded already: the rewrite is idempotent).

    Nodes are visited in the graph's (topological) order, each input decided by
    :func:`input_needs_guard` on the graph as rewritten so far (as the symbolic path
    decides on the symbol built so far).  An output counts as guarded when a
    :func:`barrier` reads it; otherwise a barrier ``{name}_guard_out{k}`` is added and every
    consumer and graph head of that output reads the barrier instead.  The ``Custom``
    node keeps its name (``get_internals()[name + '_output']`` still finds it).  Nodes
    inside a control-flow operator's subgraph (``_foreach``, ``_while_loop``, ``_cond``)
    are not visited."""
    nodes = graph["nodes"]
    ours = {i for i, n in enumerate(nodes)
            if n["op"] == "Custom" and n.get("attrs", {}).get("op_type") in op_types}
    if not ours:
        return None
    read = {}  # (node, output) of ours -> its readers in the original graph
    for n in nodes:
        for e in n["inputs"]:
            if e[0] in ours:
                read.setdefault((e[0], e[1]), []).append(n)
    for e in graph["heads"]:
        if e[0] in ours:
            read.setdefault((e[0], e[1]), [])
    copy_t, clip_t = _guard_node_templates()
    out, moved = [], {}  # moved: (old id, output) -> [new id, output]

    def add(template, name, entry):
        out.append(dict(template, name=name, inputs=[entry]))
        return [len(out) - 1, 0, 0]

    def remap(e):
        return moved.get((e[0], e[1]), [new_id[e[0]], e[1]])[:2] + list(e[2:])

    new_id, added = {}, False
    for i, n in enumerate(nodes):
        n = dict(n, inputs=[remap(e) for e in n["inputs"]])
        if "control_deps" in n:
            n["control_deps"] = [new_id[c] for c in n["control_deps"]]
        if i in ours:
            for j, e in enumerate(n["inputs"]):
                if input_needs_guard(out, e):
                    copy, clip, _ = guard_node_names(n["name"], j)
                    n["inputs"][j] = add(clip_t, clip, add(copy_t, copy, e))
                    added = True
        new_id[i] = len(out)
        out.append(n)
        if i in ours:
            for (src, k), readers in sorted(read.items()):
                if src == i and not any(_is_barrier(r) for r in readers):
                    moved[i, k] = add(clip_t, guard_node_names(n["name"], k)[2],
                                      [new_id[i], k, 0])[:2]
                    added = True
    if not added:
        return None
    rewritten = {k: v for k, v in graph.items() if k != "node_row_ptr"}  # optional
    rewritten.update(nodes=out, heads=[remap(e) for e in graph["heads"]],
                     arg_nodes=[new_id[a] for a in graph["arg_nodes"]])
    return rewritten


def guard_symbol(sym, op_types):
    """``sym`` with :func:`guard_graph` applied: a new symbol of the same class, or ``sym``
    itself when nothing is to be added or oneDNN is off."""
    if not onednn_enabled():
        return sym
    text = sym.tojson()
    if '"Custom"' not in text:
        return sym
    graph = guard_graph(symbol_json.parse(text), op_types)
    if graph is None:
        return sym
    handle = SymbolHandle()
    check_call(_LIB.MXSymbolCreateFromJSON(c_str(symbol_json.dump(graph)), ctypes.byref(handle)))
    return type(sym)(handle)
