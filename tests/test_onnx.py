"""ONNX export (mx_roi.onnx): ONNX Runtime gives our numbers, or the export refuses.

Every exportable op/mode is exported with ``mx.onnx.export_model`` with one number of rois
and run in ONNX Runtime with another (the adversarial boxes of the op tests, padding rois
and a fractional negative batch index), then compared with our MXNet forward.  Every
combination without an exact ONNX form must fail at export time, naming op, parameter
and why.
"""
from __future__ import annotations

import numpy as np
import pytest

import mxnet as mx
import onnxruntime as ort

import mx_roi
from mx_roi.onnx import ExportError
from tests.ops.base import adversarial_rois, make_data, random_rois

TOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-10}


def _sym(op_type, params, entry):
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    if entry == "custom":
        return mx.sym.Custom(data, rois, op_type=op_type, **params)
    if entry == "native":  # the native node mx_roi_<Op> (the extension library)
        _load_native()
        return getattr(mx.sym, "mx_roi_" + op_type)(data, rois, **params)
    if entry == "gluon":  # a hybridized block called on symbols: its graph
        block = getattr(mx_roi.gluon, op_type)(**params)
        block.hybridize()
        return block(data, rois)
    return getattr(mx_roi.sym, op_type)(data=data, rois=rois, **params)


def _load_native():
    from mx_roi import ext
    if ext.unavailable_reason():
        pytest.skip("no extension library here: " + ext.unavailable_reason())
    ext.load()


def export(sym, path, data_shape, dtype, params=None, rois_rows=3):
    """Export with ``rois_rows`` rois and a dynamic roi count; returns the session."""
    mx.onnx.export_model(sym, params or {}, [data_shape, (rois_rows, 5)], [dtype, dtype],
                         str(path), dynamic=True,
                         dynamic_input_shapes=[data_shape, (None, 5)])
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run_onnx(sess, data, rois):
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {names[0]: data, names[1]: rois})[0]


def ours(op_type, data, rois, params):
    x = mx.nd.array(data, dtype=data.dtype)
    r = mx.nd.array(rois, dtype=rois.dtype)
    return mx.nd.Custom(x, r, op_type=op_type, **params).asnumpy()


def problem(seed, op_type, params, dtype, kind="randn", N=2, H=9, W=11):
    rng = np.random.default_rng(seed)
    c = 3
    if op_type.startswith("PS"):
        g = params.get("group_size") or params["pooled_size"]
        gh, gw = (g, g) if isinstance(g, int) else g
        c = params["output_dim"] * gh * gw
    data = make_data(rng, (N, c, H, W), dtype, kind)
    s = params["spatial_scale"]
    rois = np.concatenate([adversarial_rois(rng, N, H, W, s, dtype=dtype),
                           random_rois(rng, 5, N, H, W, s, dtype=dtype)])
    rois[3, 0] = -1.0      # padding roi
    rois[7, 0] = -0.5      # truncates to batch 0: a real roi
    rois[-1, 0] = -2.0     # padding
    return data, rois


def check(tmp_path, op_type, params, dtype=np.float32, entry="custom", kinds=("randn", "int"),
          size=(9, 11), seed=0):
    """Export once (3 rois), run on every data kind with ~23 rois; returns the max diff."""
    dtype = np.dtype(dtype)
    worst = 0.0
    sess = None
    for i, kind in enumerate(kinds):
        data, rois = problem(seed + i, op_type, params, dtype, kind, H=size[0], W=size[1])
        if sess is None:
            sess = export(_sym(op_type, params, entry), tmp_path / "m.onnx", data.shape, dtype)
        want = ours(op_type, data, rois, params)
        got = run_onnx(sess, data, rois)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.all(got[np.trunc(rois[:, 0].astype(np.float64)) < 0] == 0)
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        tol = TOL[dtype] * max(1.0, float(np.abs(want).max()))
        assert diff.max() <= tol, (op_type, params, kind, float(diff.max()),
                                   np.argwhere(diff > tol)[:5])
        worst = max(worst, float(diff.max()))
    return worst


ALIGN = [dict(pooled_size=(2, 2), spatial_scale=0.0625, sample_ratio=-1, aligned=False),
         dict(pooled_size=(3, 2), spatial_scale=0.5, sample_ratio=-1, aligned=True),
         dict(pooled_size=(3, 3), spatial_scale=1.0, sample_ratio=2, aligned=True),
         dict(pooled_size=(2, 3), spatial_scale=0.25, sample_ratio=1, aligned=False),
         dict(pooled_size=(2, 2), spatial_scale=0.7, sample_ratio=3, aligned=False,
              deterministic=True)]
ALIGN_MAX = [dict(pooled_size=(3, 2), spatial_scale=0.5, sample_ratio=2, pool_mode="max"),
             dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=1, aligned=True,
                  pool_mode="max"),
             dict(pooled_size=(2, 3), spatial_scale=0.0625, sample_ratio=3, pool_mode="max")]
POOL = [dict(pooled_size=(2, 2), spatial_scale=0.0625), dict(pooled_size=(3, 2),
                                                              spatial_scale=0.5),
        dict(pooled_size=(1, 1), spatial_scale=1.0, deterministic=True)]
PSALIGN = [dict(pooled_size=(3, 3), output_dim=2, spatial_scale=0.5, sample_ratio=-1),
           dict(pooled_size=(3, 2), output_dim=2, group_size=2, spatial_scale=0.0625,
                sample_ratio=2, aligned=True),
           dict(pooled_size=(2, 2), output_dim=3, group_size=3, spatial_scale=1.0,
                sample_ratio=-1, aligned=True),
           # rectangular group grids: the pooled grid (as contrib.ROIAlign), and (gh, gw)
           dict(pooled_size=(3, 4), output_dim=2, spatial_scale=0.5, sample_ratio=2),
           dict(pooled_size=(3, 4), output_dim=2, group_size=(2, 3), spatial_scale=0.5,
                sample_ratio=-1)]
PSPOOL = [dict(pooled_size=(3, 3), output_dim=2, spatial_scale=0.5),
          dict(pooled_size=(3, 2), output_dim=2, group_size=2, spatial_scale=0.0625),
          dict(pooled_size=(2, 2), output_dim=3, group_size=3, spatial_scale=1.0),
          dict(pooled_size=(3, 4), output_dim=2, group_size=(2, 3), spatial_scale=0.5)]
CASES = ([("ROIAlign", p) for p in ALIGN + ALIGN_MAX] + [("ROIPooling", p) for p in POOL]
         + [("PSROIAlign", p) for p in PSALIGN] + [("PSROIPooling", p) for p in PSPOOL])


def _id(case):
    op, p = case
    return op + "-" + "-".join(f"{k}={v}" for k, v in p.items() if k != "deterministic")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_parity_float32(tmp_path, case):
    check(tmp_path, *case)


@pytest.mark.parametrize("op_type,params", [("ROIAlign", ALIGN[1]), ("ROIAlign", ALIGN_MAX[0]),
                                            ("ROIPooling", POOL[1]), ("PSROIAlign", PSALIGN[1]),
                                            ("PSROIPooling", PSPOOL[0])])
@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_parity_other_dtypes(tmp_path, op_type, params, dtype):
    if op_type == "ROIPooling" and dtype == np.float64:
        with pytest.raises(ExportError, match=r"ROIPooling \(node '.*'\): cannot export "
                                              r"float64 data to ONNX: .*MaxRoiPool is float"):
            check(tmp_path, op_type, params, dtype)
        return
    check(tmp_path, op_type, params, dtype, kinds=("randn",))


@pytest.mark.parametrize("op_type,params", [("ROIAlign", ALIGN[2]), ("ROIPooling", POOL[0]),
                                            ("PSROIAlign", PSALIGN[0]),
                                            ("PSROIPooling", PSPOOL[1])])
@pytest.mark.parametrize("entry", ["mx_roi.sym", "gluon"])
def test_guarded_entry_points(tmp_path, op_type, params, entry):
    """mx_roi.sym and Gluon put the oneDNN guard nodes around the op; they export too."""
    check(tmp_path, op_type, params, entry=entry, kinds=("randn",))


NATIVE_CASES = [("ROIAlign", ALIGN[1]), ("ROIAlign", ALIGN_MAX[0]), ("ROIPooling", POOL[1]),
                ("PSROIAlign", PSALIGN[4]), ("PSROIPooling", PSPOOL[3])]


@pytest.mark.parametrize("case", NATIVE_CASES, ids=[_id(c) for c in NATIVE_CASES])
def test_native_nodes_export_as_custom_nodes(tmp_path, case):
    """A native node ``mx_roi_<Op>`` exports through the Custom node's translation: ONNX
    Runtime gives our numbers, and the ONNX graph is the Custom node's, node for node and
    constant for constant (an unguarded Custom node: the guard's Clip aside)."""
    import onnx
    op_type, params = case
    check(tmp_path, op_type, params, entry="native")
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    graphs = []
    raw_custom = mx_roi.mxpatch._ORIGINAL_CUSTOM["mxnet.symbol"]  # (no guard clip)
    for sym in (raw_custom(data, rois, op_type=op_type, name="roi", **params),
                getattr(mx.sym, "mx_roi_" + op_type)(data, rois, name="roi", **params)):
        path = tmp_path / "g.onnx"
        export(sym, path, (2, 12, 9, 11) if op_type.startswith("PS") else (2, 3, 9, 11),
               np.float32)
        graph = onnx.load(str(path)).graph
        graphs.append(([n.SerializeToString() for n in graph.node],
                       [i.SerializeToString() for i in graph.initializer]))
    assert len(graphs[0][0]) > 5
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_native_nodes_other_dtypes(tmp_path, dtype):
    check(tmp_path, "ROIAlign", ALIGN[1], dtype, entry="native", kinds=("randn",))
    check(tmp_path, "PSROIPooling", PSPOOL[0], dtype, entry="native", kinds=("randn",))


def test_hybridized_gluon_block_exported_files(tmp_path):
    """A hybridized Gluon block exported to json/params files, then to ONNX."""
    class Head(mx.gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.align = mx_roi.gluon.ROIAlign(pooled_size=(3, 3), spatial_scale=0.5,
                                                   sample_ratio=2, aligned=True)
                self.psroi = mx_roi.gluon.PSROIPooling(spatial_scale=0.5, output_dim=1,
                                                       pooled_size=3)

        def hybrid_forward(self, F, x, rois):
            return F.concat(self.align(x, rois), self.psroi(x, rois), dim=1)

    data, rois = problem(3, "PSROIPooling", PSPOOL[0], np.float32)
    data = data[:, :9]
    net = Head()
    net.initialize()
    net.hybridize()
    want = net(mx.nd.array(data), mx.nd.array(rois)).asnumpy()
    prefix = str(tmp_path / "head")
    net.export(prefix)
    mx.onnx.export_model(prefix + "-symbol.json", prefix + "-0000.params",
                         [data.shape, (4, 5)], [np.float32, np.float32],
                         str(tmp_path / "head.onnx"), dynamic=True,
                         dynamic_input_shapes=[data.shape, (None, 5)])
    sess = ort.InferenceSession(str(tmp_path / "head.onnx"),
                                providers=["CPUExecutionProvider"])
    got = run_onnx(sess, data, rois)
    assert got.shape == want.shape == (len(rois), 10, 3, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [("ROIAlign", ALIGN[0]), ("ROIAlign", ALIGN_MAX[0]),
                                  ("ROIPooling", POOL[0]), ("PSROIAlign", PSALIGN[0]),
                                  ("PSROIPooling", PSPOOL[0])], ids=lambda c: c[0])
def test_zero_rois_and_out_of_range_batch(tmp_path, case):
    """R = 0 gives (0, C, P, Q); a batch index >= N (our op raises; a model cannot) gives
    zeros in ONNX Runtime instead of an out-of-bounds read, the other rois unchanged."""
    op_type, params = case
    data, rois = problem(0, op_type, params, np.float32)
    sess = export(_sym(op_type, params, "custom"), tmp_path / "m.onnx", data.shape,
                  np.float32)
    empty = run_onnx(sess, data, rois[:0])
    assert empty.shape == (0,) + ours(op_type, data, rois[:1], params).shape[1:]
    bad = rois[:6].copy()
    bad[1, 0], bad[4, 0] = 2.0, 7.5          # N = 2
    got = run_onnx(sess, data, bad)
    assert np.all(got[[1, 4]] == 0)
    keep = [0, 2, 3, 5]
    np.testing.assert_allclose(got[keep], ours(op_type, data, bad[keep], params),
                               rtol=1e-5, atol=1e-5)


def random_case(rng):
    """A random exportable (op_type, params, data kind, (H, W))."""
    op = str(rng.choice(["ROIAlign", "ROIAlign-max", "ROIPooling", "PSROIAlign",
                         "PSROIPooling"]))
    p = dict(pooled_size=(int(rng.integers(1, 8)), int(rng.integers(1, 8))),
             spatial_scale=float(rng.choice([2.0, 1.0, 0.7, 0.5, 0.25, 0.0625, 1 / 32])))
    if op.startswith("ROIAlign"):
        p.update(sample_ratio=int(rng.integers(-1, 4)), aligned=bool(rng.integers(0, 2)))
        if op == "ROIAlign-max":
            p.update(pool_mode="max", sample_ratio=int(rng.integers(1, 4)))
    if op.startswith("PS"):
        p.update(output_dim=int(rng.integers(1, 3)), group_size=int(rng.integers(1, 4)))
        if op == "PSROIAlign":
            p.update(sample_ratio=int(rng.integers(-1, 4)), aligned=bool(rng.integers(0, 2)))
    kind = str(rng.choice(["randn", "int", "relu", "neg"]))
    return op.split("-")[0], p, kind, (int(rng.integers(2, 20)), int(rng.integers(2, 20)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(60))
def test_parity_random_configurations(tmp_path, seed):
    op_type, params, kind, size = random_case(np.random.default_rng(seed))
    check(tmp_path, op_type, params, kinds=(kind,), size=size, seed=seed)


# ------------------------------------------------------------------- refused combinations
REFUSED = [
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2, pool_mode="max",
                      legacy="caffe"), r"ROIAlign \(node '\w+'\): cannot export "
                                       r"legacy='caffe' to ONNX: the legacy kernels"),
    ("PSROIAlign", dict(pooled_size=(2, 2), output_dim=1, spatial_scale=1.0, legacy="rfcn"),
     r"PSROIAlign \(node '\w+'\): cannot export legacy='rfcn' to ONNX: the legacy kernels"),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=-1,
                      pool_mode="max"),
     r"ROIAlign \(node '\w+'\): cannot export pool_mode='max' with sample_ratio=-1 to ONNX: "
     r"ONNX RoiAlign's max mode takes the max of the weighted taps"),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=0,
                      pool_mode="max"),
     r"cannot export pool_mode='max' with sample_ratio=0 to ONNX"),
]


@pytest.mark.parametrize("op_type,params,match", REFUSED,
                         ids=["align-caffe", "psalign-rfcn", "align-max-adaptive",
                              "align-max-zero"])
@pytest.mark.parametrize("entry", ["custom", "mx_roi.sym", "gluon", "native"])
def test_refused_at_export_time(tmp_path, op_type, params, match, entry):
    sym = _sym(op_type, params, entry)
    with pytest.raises(ExportError, match=match):
        export(sym, tmp_path / "x.onnx", (1, 4, 5, 5), np.float32)
    assert not (tmp_path / "x.onnx").exists()
    # the next export works
    ok = dict(params, legacy="") if "legacy" in params else dict(params, sample_ratio=2)
    if op_type == "PSROIAlign":
        ok = dict(pooled_size=(2, 2), output_dim=1, spatial_scale=1.0)
    export(_sym(op_type, ok, entry), tmp_path / "y.onnx", (1, 4, 5, 5), np.float32)


def test_old_opset_is_refused():
    from mx_roi.onnx import _check
    from mx_roi.params import ROIAlignParam
    p = ROIAlignParam.from_kwargs(pooled_size=2, spatial_scale=1)
    with pytest.raises(ExportError, match=r"ROIAlign \(node 'n'\): cannot export opset 13 to "
                                          r"ONNX: needs opset >= 16"):
        _check("ROIAlign", "n", p, np.dtype(np.float32), 13)


# ------------------------------------------------------------------- registration
def test_other_custom_op_types_are_not_taken_over(tmp_path, monkeypatch):
    """One slot for op 'Custom': other op_types go to the translation registered before."""
    import mx_roi.onnx as mo

    class Foreign(mx.operator.CustomOp):
        def forward(self, is_train, req, in_data, out_data, aux):
            self.assign(out_data[0], req[0], in_data[0] * 2)

    @mx.operator.register("mx_roi_test_foreign")
    class ForeignProp(mx.operator.CustomOpProp):
        def list_arguments(self):
            return ["data"]

        def infer_shape(self, in_shape):
            return in_shape, in_shape, []

        def create_operator(self, ctx, shapes, dtypes):
            return Foreign()

    sym = mx.sym.Custom(mx.sym.var("data"), op_type="mx_roi_test_foreign")
    with pytest.raises(AttributeError, match=r"No conversion function registered for op type "
                                             r"Custom \(op_type='mx_roi_test_foreign'\)"):
        mx.onnx.export_model(sym, {}, [(2, 3)], [np.float32], str(tmp_path / "f.onnx"))

    calls = []

    def previous(node, **kwargs):
        from onnx import helper
        calls.append(node["attrs"]["op_type"])
        name = node["name"]
        inp = kwargs["outputs_lookup"][node["inputs"][0][0]][0].name
        kwargs["initializer"].append(helper.make_tensor(name + "_two", 1, (), [2.0]))
        return [helper.make_node("Mul", [inp, name + "_two"], [name], name=name)]

    monkeypatch.setitem(mo._PREVIOUS, 12, previous)
    sess = export_plain(sym, tmp_path / "g.onnx")
    assert calls == ["mx_roi_test_foreign"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(sess.run(None, {"data": x})[0], 2 * x)
    mo.install()  # idempotent: still ours, and still chaining
    from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
    assert all(ops["Custom"] is mo.convert_custom for ops in MXNetGraph.registry_.values())
    assert all(ops["mx_roi_" + op] is mo.convert_custom_ours
               for ops in MXNetGraph.registry_.values() for op in mx_roi.OP_TYPES)


def export_plain(sym, path):
    mx.onnx.export_model(sym, {}, [(2, 3)], [np.float32], str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
def test_guard_clip_exports_with_mxnet_numbers(tmp_path, dtype):
    """The oneDNN guard clip(x, -3e38, 3e38) gives MXNet's numbers, inf included; an
    ordinary clip still goes to MXNet's own translation (whose float16 bounds are wrong
    with onnx 1.14, hence float32 only)."""
    from mx_roi.onednn import barrier
    x = mx.sym.var("data")
    outs = [barrier(mx.sym, x)] + ([mx.sym.clip(x, -1.5, 2.0)] if dtype == np.float32 else [])
    sym = mx.sym.Group(outs)
    mx.onnx.export_model(sym, {}, [(2, 3)], [dtype], str(tmp_path / "c.onnx"))
    sess = ort.InferenceSession(str(tmp_path / "c.onnx"), providers=["CPUExecutionProvider"])
    v = np.array([[np.inf, -np.inf, 1.0], [-3.0, 2.5, np.nan]], dtype=dtype)
    exe = sym.bind(mx.cpu(), {"data": mx.nd.array(v, dtype=dtype)})
    want = [o.asnumpy() for o in exe.forward()]
    got = sess.run(None, {"data": v})
    if dtype == np.float32:
        assert np.isfinite(want[0][0, 0]) and want[0][0, 0] > 2.9e38
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------- MXNet's own export tests
# The idea of apache/mxnet v1.9.x tests/python-pytest/onnx/test_operators.py
# (test_onnx_export_contrib_ROIAlign): a hybridized block, 5 images, 128x128, these rois
# (a padding roi, a reversed box, a 1x1 box), every pooled size x scale x sample ratio.
MX_ROIS = np.array([[-1, 0, 0, 0, 0], [0, 0, 0, 63, 63], [1, 34, 52, 25, 85],
                    [2, 50, 50, 100, 100], [3, 0, 0, 127, 127], [4, 12, 84, 22, 94],
                    [0, 0, 0, 1, 1]], dtype=np.float32)


def _mx_style(tmp_path, op_type, params, seed):
    data = np.random.default_rng(seed).uniform(0, 1, (5, 3, 128, 128)).astype(np.float32)
    sess = export(_sym(op_type, params, "custom"), tmp_path / "m.onnx", data.shape,
                  np.float32, rois_rows=len(MX_ROIS))
    got = run_onnx(sess, data, MX_ROIS)
    want = ours(op_type, data, MX_ROIS, params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[0] == 0)


@pytest.mark.parametrize("pooled_size", [(1, 1), (3, 3), (14, 14), (5, 7)])
@pytest.mark.parametrize("spatial_scale", [1, 0.5, 0.0625])
@pytest.mark.parametrize("sample_ratio", [1, 2, 3, 5])
def test_mxnet_export_test_roi_align(tmp_path, pooled_size, spatial_scale, sample_ratio):
    for aligned in (False, True):
        _mx_style(tmp_path, "ROIAlign", dict(pooled_size=pooled_size,
                                             spatial_scale=spatial_scale,
                                             sample_ratio=sample_ratio, aligned=aligned), 0)


@pytest.mark.parametrize("pooled_size", [(1, 1), (3, 3), (14, 14), (5, 7)])
@pytest.mark.parametrize("spatial_scale", [1, 0.5, 0.0625])
def test_mxnet_export_test_roi_pooling(tmp_path, pooled_size, spatial_scale):
    _mx_style(tmp_path, "ROIPooling", dict(pooled_size=pooled_size,
                                           spatial_scale=spatial_scale), 1)


def test_mxnet_builtin_roialign_export_differs():
    """Why our translation exists: MXNet 1.9.1's own _contrib_ROIAlign translation leaves
    coordinate_transformation_mode at opset 16's default (half_pixel) -- other numbers."""
    import tempfile
    data = np.random.default_rng(2).uniform(0, 1, (5, 3, 32, 32)).astype(np.float32)
    rois = MX_ROIS[1:] / 4
    sym = mx.sym.contrib.ROIAlign(mx.sym.var("data"), mx.sym.var("rois"), pooled_size=(3, 3),
                                  spatial_scale=1.0, sample_ratio=2)
    with tempfile.TemporaryDirectory() as d:
        sess = export(sym, d + "/b.onnx", data.shape, np.float32, rois_rows=len(rois))
        got = run_onnx(sess, data, rois)
    want = ours("ROIAlign", data, rois, dict(pooled_size=(3, 3), spatial_scale=1.0,
                                             sample_ratio=2))
    assert np.abs(got - want).max() > 0.01


# ------------------------------------------------------------------- end to end: the example
@pytest.mark.parametrize("roi_op", ["pool", "align", "psalign"])
def test_example_rcnn_head_exports_with_same_detections(tmp_path, roi_op):
    """The example's test graph (tiny backbone, untrained weights) from (data, rois) on,
    in ONNX Runtime, with MXNet's own proposals: the same raw outputs and detections."""
    from example_rcnn.config import default_config
    from example_rcnn.export_onnx import compare, export
    from example_rcnn.symbol import get_test_symbol, initializer
    cfg = default_config("tiny", roi_op)
    s = cfg.image_size
    mod = mx.mod.Module(get_test_symbol(cfg), data_names=("data", "im_info"),
                        label_names=None, context=mx.cpu())
    mod.bind(data_shapes=[("data", (1, 3, s, s)), ("im_info", (1, 3))], for_training=False)
    mx.random.seed(3)
    mod.init_params(initializer())
    arg, aux = mod.get_params()
    path = export(cfg, arg, aux, str(tmp_path / "head.onnx"))
    res = compare(mod, cfg, path, n_images=2)
    assert res["detections"] > 0
    assert res["same_detections"], res
    assert res["max_abs_diff"] < 1e-4, res


@pytest.mark.parametrize("opset", [15, 16, "newest"])
def test_opset_boundary(tmp_path, opset, monkeypatch):
    """MIN_OPSET (16, RoiAlign's coordinate_transformation_mode) is the first opset
    exported -- with our numbers in ONNX Runtime, as is the newest one onnx knows --
    and opset 15 is refused at export time, naming the op, the node and why.
    (``export_model`` takes the opset from ``onnx.defs.onnx_opset_version()``.)"""
    import onnx.defs
    from mx_roi.onnx import MIN_OPSET
    assert MIN_OPSET == 16
    version = onnx.defs.onnx_opset_version() if opset == "newest" else opset
    monkeypatch.setattr(onnx.defs, "onnx_opset_version", lambda: version)
    params = dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2, aligned=True)
    data, rois = problem(0, "ROIAlign", params, np.dtype(np.float32))
    sym = mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"), op_type="ROIAlign",
                        name="pool", **params)
    path = tmp_path / "o.onnx"

    def export_at():
        mx.onnx.export_model(sym, {}, [data.shape, rois.shape], [np.float32, np.float32],
                             str(path))

    if version < 16:
        with pytest.raises(ExportError, match=r"^ROIAlign \(node 'pool'\): cannot export "
                                              r"opset 15 to ONNX: needs opset >= 16 "):
            export_at()
        assert not path.exists()
        return
    export_at()
    import onnx
    assert onnx.load(str(path)).opset_import[0].version == version
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(run_onnx(sess, data, rois), ours("ROIAlign", data, rois, params),
                               rtol=1e-5, atol=1e-5)


def test_chained_translations_pick_the_newest_version_not_above_the_opset():
    """A node that is not ours goes to the replaced translation registered for the
    highest opset <= the export's (the export's own included); none: MXNet's error."""
    import mx_roi.onnx as mo
    table = {12: lambda node, **kw: 12, 16: lambda node, **kw: 16}
    assert [mo._chain(table, "clip", {}, {"opset_version": v}) for v in (12, 15, 16, 19)] \
        == [12, 12, 16, 16]
    assert mo._chain(table, "clip", {}, {}) == 12  # (mx2onnx's default: 12)
    with pytest.raises(AttributeError, match=r"^No conversion function registered for op "
                                             r"type clip yet$"):
        mo._chain(table, "clip", {}, {"opset_version": 11})
