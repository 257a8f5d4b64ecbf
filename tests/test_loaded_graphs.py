"""Graphs that reach MXNet whole -- loaded from JSON or a file, or built before ``import
mx_roi`` -- get the same oneDNN guard as graphs built through ``mx.sym``
(``mx_roi.onednn.guard_graph``, installed by ``mx_roi.mxpatch._install_graph_guard``).

The model is what a converter makes of a saved built-in model: Conv -> ``_contrib_ROIAlign``
-> Conv -> FC with the ``_contrib_ROIAlign`` node turned into ``Custom`` /
``op_type=ROIAlign``.  Every loading path runs it training-step style (record ->
backward -> read, no wait), in a child process, against the built-in graph with the same
weights and batches; without the rewrite the Gluon paths go wrong (issue 41: 4-29 of 40
steps), with it none may.
"""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

import mx_roi
from mx_roi import mxpatch, onednn
from mx_roi.registry import REGISTERED
from tests.test_onednn import CIN, H, N, NH, R, W, real_rois

C, C2 = 16, 16
POOL = dict(pooled_size=(3, 3), spatial_scale=0.25, sample_ratio=2)
WEIGHTS = ("conv1_weight", "conv2_weight", "fc_weight")
INPUTS = ("data", "rois")


# --------------------------------------------------------------------------- the model
def model(roi_node, loss=False, inputs=None):
    """Conv -> ``roi_node(y, rois)`` -> Conv -> FC ('fc'); with ``loss`` grouped as
    ``[BlockGrad(fc), MakeLoss(sum(fc**2))]`` (the executor / Module form).  ``inputs``:
    symbols for :data:`INPUTS` and :data:`WEIGHTS` (default: variables of those names)."""
    v = {k: mx.sym.var(k) for k in INPUTS + WEIGHTS} if inputs is None else inputs
    y = mx.sym.Convolution(v["data"], v["conv1_weight"], kernel=(3, 3), pad=(1, 1),
                           num_filter=C, no_bias=True, name="conv1")
    z = mx.sym.Convolution(roi_node(y, v["rois"]), v["conv2_weight"], kernel=(3, 3),
                           pad=(1, 1), num_filter=C2, no_bias=True, name="conv2")
    out = mx.sym.FullyConnected(z, v["fc_weight"], num_hidden=NH, no_bias=True, name="fc")
    if loss:
        out = mx.sym.Group([mx.sym.BlockGrad(out), mx.sym.MakeLoss(mx.sym.sum(out * out))])
    return out


def builtin_graph(loss=False):
    """The model with the built-in ``_contrib_ROIAlign`` ('pool')."""
    return model(lambda y, rois: mx.sym.contrib.ROIAlign(y, rois, name="pool", **POOL), loss)


def symbolic_graph():
    """The model built through ``mx.sym.Custom`` (guarded by ``call_custom``)."""
    return model(lambda y, rois: mx.sym.Custom(y, rois, op_type="ROIAlign", name="pool",
                                               **POOL))


#: built-in op -> our op_type of the same semantics
CONVERSIONS = {"_contrib_ROIAlign": "ROIAlign", "ROIPooling": "ROIPooling"}


def converted(text, spelling=None):
    """What a converter writes: every built-in RoI node of JSON graph ``text`` as
    ``Custom`` with our ``op_type`` (the parameters kept).  ``spelling``: the pooled_size
    text instead, put in raw as MXNet writes a control character."""
    graph = json.loads(text)
    for node in graph["nodes"]:
        if node["op"] in CONVERSIONS:
            node["attrs"] = dict(node["attrs"], op_type=CONVERSIONS[node["op"]])
            node["op"] = "Custom"
    out = json.dumps(graph)
    if spelling is not None:
        assert out.count('"pooled_size": "(3, 3)"') == 1
        out = out.replace('"pooled_size": "(3, 3)"', '"pooled_size": "%s"' % spelling)
    return out


def unguarded_load_json(text):
    """MXNet's own ``load_json`` (a symbol as it is before ``import mx_roi``)."""
    return mxpatch._ORIGINAL_LOADERS["mxnet.symbol.symbol", "load_json"](text)


def node_names(sym):
    return [n["name"] for n in json.loads(sym.tojson())["nodes"]]


def ops_of(sym):
    return [n["op"] for n in json.loads(sym.tojson())["nodes"]]


# ------------------------------------------------------- the harness (child process)
WEIGHT_SHAPES = {"conv1_weight": (C, CIN, 3, 3), "conv2_weight": (C2, C, 3, 3),
                 "fc_weight": (NH, C2 * 9)}


def _batches(steps, seed=0):
    rng = np.random.RandomState(seed)
    weights = {k: (rng.randn(*shape) * 0.1).astype(np.float32)
               for k, shape in WEIGHT_SHAPES.items()}
    batches = [(rng.randn(N, CIN, H, W).astype(np.float32), real_rois(rng))
               for _ in range(steps)]
    return weights, batches


def _executor_steps(sym, weights, batches):
    """fc output and the gradients (data, weights) per batch, through ``simple_bind``."""
    ex = sym.simple_bind(mx.cpu(), grad_req={k: "null" if k == "rois" else "write"
                                             for k in sym.list_arguments()},
                         data=(N, CIN, H, W), rois=(R, 5))
    for k, v in weights.items():
        ex.arg_dict[k][:] = v
    for x, r in batches:
        ex.arg_dict["data"][:] = x
        ex.arg_dict["rois"][:] = r
        ex.forward(is_train=True)
        ex.backward()
        yield [ex.outputs[0]] + [ex.grad_dict[k] for k in ("data",) + WEIGHTS]


def _module_steps(sym, weights, batches):
    """The same through ``Module`` (``sym`` from ``mx.model.load_checkpoint``)."""
    mod = mx.mod.Module(sym, data_names=INPUTS, label_names=None)
    mod.bind(data_shapes=[("data", (N, CIN, H, W)),
                          mx.io.DataDesc("rois", (R, 5), layout="")],  # not batched
             inputs_need_grad=True)
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in weights.items()},
                    allow_missing=False)
    ex = mod._exec_group.execs[0]
    for x, r in batches:
        mod.forward(mx.io.DataBatch([mx.nd.array(x), mx.nd.array(r)]), is_train=True)
        mod.backward()
        yield [mod.get_outputs()[0], mod.get_input_grads()[0]] + \
            [ex.grad_dict[k] for k in WEIGHTS]


def _block_steps(net, weights, batches, static):
    """The same through a Gluon block, hybridized (``static``: static_alloc/shape)."""
    params = net.collect_params()
    for k, v in weights.items():
        params[k].set_data(mx.nd.array(v))
    net.hybridize(static_alloc=static, static_shape=static)
    for x_np, r in batches:
        x = mx.nd.array(x_np)
        x.attach_grad()
        with mx.autograd.record():
            o = net(x, mx.nd.array(r))
            loss = (o * o).sum()
        loss.backward()
        yield [o, x.grad] + [params[k].grad() for k in WEIGHTS]


def _initialized(net):
    net.initialize()  # the weights are set before the first call
    return net


def _block(sym):
    return _initialized(mx.gluon.SymbolBlock(sym, [mx.sym.var(k) for k in INPUTS]))


class RawCustomNet(mx.gluon.HybridBlock):
    """The model as a Gluon block whose code calls MXNet's own ``Custom`` (as one that
    did ``from mxnet.symbol import Custom`` before ``import mx_roi``)."""

    def __init__(self):
        super().__init__(prefix="")
        for k, shape in WEIGHT_SHAPES.items():
            setattr(self, k, self.params.get(k, shape=shape))

    def hybrid_forward(self, F, data, rois, **weights):
        raw_custom = mxpatch._ORIGINAL_CUSTOM["mxnet.symbol"]
        return model(lambda y, r: raw_custom(y, r, op_type="ROIAlign", name="pool", **POOL),
                     inputs=dict(weights, data=data, rois=rois))


def loading_paths(tmp, spelling=None):
    """name -> function(weights, batches) yielding the arrays of each step, one per way a
    converted graph reaches MXNet (``spelling``: :func:`converted`'s)."""
    plain, with_loss = converted(builtin_graph().tojson(), spelling), \
        converted(builtin_graph(loss=True).tojson(), spelling)
    prefix = os.path.join(tmp, "model")
    for text, pre in ((plain, prefix), (with_loss, prefix + "-loss")):
        with open(pre + "-symbol.json", "w") as f:
            f.write(text)

    def save_params(weights, pre, tag):
        mx.nd.save(f"{pre}-0000.params", {f"{tag}{k}": mx.nd.array(v)
                                          for k, v in weights.items()})

    def imports(via):
        def run(weights, batches):
            save_params(weights, prefix, "")  # SymbolBlock.imports: bare names
            net = via(prefix + "-symbol.json", list(INPUTS), prefix + "-0000.params")
            return _block_steps(net, weights, batches, static=True)
        return run

    def checkpoint(weights, batches):
        save_params(weights, prefix + "-loss", "arg:")
        sym, _, _ = mx.model.load_checkpoint(prefix + "-loss", 0)
        return _module_steps(sym, weights, batches)

    return {
        "load_json+SymbolBlock": lambda w, b: _block_steps(_block(mx.sym.load_json(plain)),
                                                           w, b, static=False),
        "load+SymbolBlock(static)": lambda w, b: _block_steps(
            _block(mx.sym.load(prefix + "-symbol.json")), w, b, static=True),
        "SymbolBlock.imports(static)": imports(mx.gluon.SymbolBlock.imports),
        "mx_roi.gluon.imports(static)": imports(mx_roi.gluon.imports),
        "SymbolBlock(raw symbol)": lambda w, b: _block_steps(
            _block(unguarded_load_json(plain)), w, b, static=False),
        "HybridBlock(raw Custom)": lambda w, b: _block_steps(
            _initialized(RawCustomNet()), w, b, static=True),
        "simple_bind(load_json)": lambda w, b: _executor_steps(mx.sym.load_json(with_loss),
                                                               w, b),
        "simple_bind(raw symbol)": lambda w, b: _executor_steps(
            unguarded_load_json(with_loss), w, b),
        "Module(load_checkpoint)": checkpoint,
    }


def wrong_steps(steps, paths, tmp, rewrite=True, spelling=None):
    """Run each of ``paths`` (names of :func:`loading_paths`) for ``steps`` steps against
    the built-in graph; return {path: (wrong steps, largest relative error)}.
    ``rewrite=False``: the graph rewrite switched off (the hazard's control)."""
    if not rewrite:
        mxpatch.guard_symbol = lambda sym, op_types: sym
    weights, batches = _batches(steps)
    want = [[a.asnumpy() for a in arrays]
            for arrays in _executor_steps(builtin_graph(loss=True), weights, batches)]
    ways, result = loading_paths(tmp, spelling), {}
    for path in paths:
        wrong, worst = 0, 0.0
        for ref, arrays in zip(want, ways[path](weights, batches)):
            errors = [relative_error(a.asnumpy(), b) for a, b in zip(arrays, ref)]
            worst = max(worst, *errors)
            wrong += any(not e <= 1e-4 for e in errors)
        result[path] = (wrong, worst)
    return result


def relative_error(got, want):
    """max |got - want| over max |want| (inf when ``got`` is not finite)."""
    if not np.isfinite(got).all():
        return np.inf
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-6)


def run_child(steps, paths, rewrite=True, spelling=None):
    """:func:`wrong_steps` in a fresh process (an abort is caught; oneDNN on)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys, tempfile; import tests.test_loaded_graphs as t\n"
            "with tempfile.TemporaryDirectory() as tmp:\n"
            f"    r = t.wrong_steps({steps}, {list(paths)!r}, tmp, rewrite={rewrite}, "
            f"spelling={spelling!r})\n"
            "print('RESULT', json.dumps(r), flush=True)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MXNET_MKLDNN_ENABLED", "MXNET_ENGINE_TYPE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return proc, (json.loads(lines[-1][7:]) if lines else None)


# ------------------------------------------------------------------------------ tests
GLUON_PATHS = ["load_json+SymbolBlock", "load+SymbolBlock(static)",
               "SymbolBlock.imports(static)", "mx_roi.gluon.imports(static)",
               "SymbolBlock(raw symbol)", "HybridBlock(raw Custom)"]
EXECUTOR_PATHS = ["simple_bind(load_json)", "simple_bind(raw symbol)",
                  "Module(load_checkpoint)"]
#: steps per path (9 paths: 1,800 guarded steps, 12-20 s here; unguarded, 16-150 of 250
#: steps were wrong in each Gluon path)
STEPS = 200


def test_every_loading_path_trains_right():
    """Each loading path, STEPS training steps in a child process: every output and
    gradient equal to the built-in graph's (the issue: 4-29 of 40 wrong in Gluon)."""
    proc, result = run_child(STEPS, GLUON_PATHS + EXECUTOR_PATHS)
    assert proc.returncode == 0 and result, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert set(result) == set(GLUON_PATHS + EXECUTOR_PATHS)
    assert all(wrong == 0 for wrong, _ in result.values()), result


def test_every_loading_path_trains_right_with_a_control_character_in_a_parameter():
    """The converted graphs with ``pooled_size`` spelt '\\x1c(3, 3)' (str.strip's
    whitespace, which both parameter parsers read as (3, 3)), written raw as MXNet writes
    it: every path loads, guards and trains as the built-in graph (mx_roi.symbol_json;
    strict json in the guard raised JSONDecodeError on each)."""
    proc, result = run_child(40, GLUON_PATHS + EXECUTOR_PATHS, spelling="\x1c(3, 3)")
    assert proc.returncode == 0 and result, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert set(result) == set(GLUON_PATHS + EXECUTOR_PATHS)
    assert all(wrong == 0 for wrong, _ in result.values()), result


def test_the_harness_sees_the_hazard_without_the_rewrite():
    """The control: the same harness with the rewrite switched off goes wrong (or the
    process dies), so the test above can fail.  The hazard is a race: a path's count
    varies from run to run (16-150 of 250 steps, and once 0 in one path while the others
    had 2-6), so the control asks for wrong steps in at least two Gluon paths, not in
    each.  (The executor
    paths showed 0 wrong steps in 400 unguarded, as in the issue: their memory plan
    happens to keep the temporaries alive; test_every_loading_path_adds_the_guard_nodes
    covers them.)"""
    proc, result = run_child(STEPS, GLUON_PATHS, rewrite=False)
    if proc.returncode != 0 and result is None:
        return  # crashed (double free, segfault, terminate): the hazard
    assert result, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sum(wrong > 0 for wrong, _ in result.values()) >= 2, result


BUILTINS = {"ROIAlign": (mx.sym.contrib.ROIAlign, POOL),
            "ROIPooling": (mx.sym.ROIPooling, dict(pooled_size=(3, 3), spatial_scale=0.25))}


@pytest.mark.parametrize("op_type", list(BUILTINS))
def test_rewrite_equals_the_symbolic_guard(op_type):
    """The converted JSON, rewritten, is the very graph ``mx.sym.Custom`` builds (same
    nodes, names, attrs, order); the rewrite of that graph adds nothing (idempotent);
    the Custom node keeps its name."""
    builtin, params = BUILTINS[op_type]
    text = model(lambda y, rois: builtin(y, rois, name="pool", **params)).tojson()
    raw = unguarded_load_json(converted(text))
    assert ops_of(raw).count("Custom") == 1 and ops_of(raw).count("clip") == 0
    symbolic = model(lambda y, rois: mx.sym.Custom(y, rois, op_type=op_type, name="pool",
                                                   **params))
    guarded = onednn.guard_symbol(raw, REGISTERED)
    assert guarded.tojson() == symbolic.tojson()
    names = node_names(guarded)
    assert {"pool_guard_copy0", "pool_guard_in0", "pool_guard_out0"} <= set(names)
    assert "pool_guard_in1" not in names  # rois: a variable (onednn.LEAF)
    assert onednn.guard_symbol(guarded, REGISTERED) is guarded
    assert onednn.guard_symbol(symbolic, REGISTERED) is symbolic
    assert guarded.get_internals()["pool_output"].attr("op_type") == op_type


def test_chained_and_head_nodes_as_symbolic():
    """A Custom node fed by another (its guarded output) and one that is a graph head:
    the same graph as the symbolic path, output names included."""
    raw_custom = mxpatch._ORIGINAL_CUSTOM["mxnet.symbol"]

    def build(custom):
        data, rois = mx.sym.var("data"), mx.sym.var("rois")
        y = mx.sym.Convolution(data, kernel=(1, 1), num_filter=4, name="conv1")
        a = custom(y, rois, op_type="ROIAlign", name="a", **POOL)
        b = custom(a, rois, op_type="ROIPooling", pooled_size=(2, 2), spatial_scale=1.0,
                   name="b")
        return mx.sym.Group([mx.sym.Convolution(b, kernel=(1, 1), num_filter=2,
                                                name="conv2"), b])

    guarded, symbolic = onednn.guard_symbol(build(raw_custom), REGISTERED), build(mx.sym.Custom)
    assert guarded.tojson() == symbolic.tojson()
    assert guarded.list_outputs() == ["conv2_output", "b_guard_out0_output"]
    assert "b_guard_in0" in node_names(guarded)  # a's output barrier feeds b through a guard


def test_control_dependencies_follow_their_nodes():
    """A node's control dependencies name the same nodes after the guard nodes moved
    them down the node list."""
    graph = json.loads(converted(builtin_graph().tojson()))
    names = [n["name"] for n in graph["nodes"]]
    graph["nodes"][names.index("fc")]["control_deps"] = [names.index("pool"),
                                                         names.index("conv2")]
    guarded = json.loads(mx.sym.load_json(json.dumps(graph)).tojson())["nodes"]
    fc = [n for n in guarded if n["name"] == "fc"][0]
    assert [guarded[i]["name"] for i in fc["control_deps"]] == ["pool", "conv2"]


def _loaded_by_every_path(tmp_path, text=None):
    """JSON graph ``text`` (default: the converted model) as each patched loader gives it
    back (for a block: the graph it runs)."""
    text = converted(builtin_graph().tojson()) if text is None else text
    prefix = str(tmp_path / "m")
    with open(prefix + "-symbol.json", "w") as f:
        f.write(text)
    mx.nd.save(prefix + "-0000.params", {})
    block = mx.gluon.SymbolBlock.imports(prefix + "-symbol.json", list(INPUTS),
                                         allow_missing=True)
    return {
        "mx.sym.load_json": mx.sym.load_json(text),
        "mx.sym.load": mx.sym.load(prefix + "-symbol.json"),
        "mx.symbol.symbol.load_json": mx.symbol.symbol.load_json(text),
        "mx.model.load_checkpoint": mx.model.load_checkpoint(prefix, 0)[0],
        "gluon.block.load_json": mx.gluon.block.load_json(text),
        "mx.sym.np load_json": mx.symbol.numpy._symbol.load_json(text),
        "SymbolBlock.imports": block._cached_graph[1],
        "mx_roi.gluon.imports": mx_roi.gluon.imports(prefix + "-symbol.json", list(INPUTS),
                                                     allow_missing=True)._cached_graph[1],
        "SymbolBlock(raw)": _block(unguarded_load_json(text))._cached_graph[1],
    }


def test_every_loading_path_adds_the_guard_nodes(tmp_path):
    """Each path's symbol carries the guard nodes (and the executor of a raw symbol
    binds the guarded graph); loading an already guarded graph adds no second guard."""
    want = node_names(symbolic_graph())
    for path, sym in _loaded_by_every_path(tmp_path).items():
        assert node_names(sym) == want, path
    raw = unguarded_load_json(converted(builtin_graph(loss=True).tojson()))
    ex = raw.simple_bind(mx.cpu(), data=(N, CIN, H, W), rois=(R, 5))
    assert "pool_guard_in0" in node_names(ex._symbol)
    ex = raw.bind(mx.cpu(), {k: v for k, v in ex.arg_dict.items()})
    assert "pool_guard_in0" in node_names(ex._symbol)
    mod = mx.mod.Module(raw, data_names=INPUTS, label_names=None)
    mod.bind(data_shapes=[("data", (N, CIN, H, W)), mx.io.DataDesc("rois", (R, 5), layout="")])
    assert "pool_guard_in0" in node_names(mod._exec_group.execs[0]._symbol)
    twice = mx.sym.load_json(mx.sym.load_json(symbolic_graph().tojson()).tojson())
    assert node_names(twice) == want
    net = _initialized(RawCustomNet())
    net.hybridize()
    net(mx.nd.ones((N, CIN, H, W)), mx.nd.array(real_rois(np.random.RandomState(0))))
    traced = node_names(net._cached_graph[1])
    assert {"pool_guard_copy0", "pool_guard_in0", "pool_guard_out0"} <= set(traced)
    assert ops_of(net._cached_graph[1]).count("clip") == 2


def test_loaders_keep_other_graphs_and_originals():
    """A graph without our ops comes back as MXNet loads it; the patches are installed
    once and MXNet's own functions stay reachable."""
    text = builtin_graph().tojson()
    assert mx.sym.load_json(text).tojson() == unguarded_load_json(text).tojson()
    assert mx.sym.load_json.__wrapped__ is mxpatch._ORIGINAL_LOADERS["mxnet.symbol",
                                                                     "load_json"]
    before = (mx.sym.load, mx.sym.load_json, mx.sym.Symbol.simple_bind,
              mx.gluon.SymbolBlock.__init__)
    mxpatch.install(REGISTERED)
    assert (mx.sym.load, mx.sym.load_json, mx.sym.Symbol.simple_bind,
            mx.gluon.SymbolBlock.__init__) == before
    assert not getattr(mx.sym.load_json.__wrapped__, "_mx_roi_guard", False)


def test_no_guard_with_onednn_off(monkeypatch):
    text = converted(builtin_graph().tojson())
    monkeypatch.setattr(onednn, "onednn_enabled", lambda: False)
    assert ops_of(mx.sym.load_json(text)).count("clip") == 0
