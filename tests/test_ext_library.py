"""mx_roi's MXNet extension library (mx_roi.ext, docs/native_ops.md): mx_roi_ROIAlign
against the Custom path on the native backend bit for bit, its errors (op and problem
first, one message per error, the next call works), its parameters against params.py,
grad_req='add' (dropped by MXNet's extension dispatcher), the cache's trust rules, and a
run through MXNet's C predict API in a process that never imports mx_roi."""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mxnet as mx

import mx_roi  # noqa: F401  (registers the Custom ops)
from mx_roi import ext
from mx_roi.cuda import loader
from mx_roi.params import ROIAlignParam, ROIPoolingParam, invalid_examples
from mx_roi.params import PSROIPoolingParam  # (mx_roi_PSROIPooling's tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(bool(ext.unavailable_reason()),
                                reason="no extension library here: "
                                       + (ext.unavailable_reason() or ""))


@pytest.fixture(scope="module", autouse=True)
def native_backend():
    """The Custom path on the native backend's checked path (the kernels the library
    runs, launched from Python: ``MX_ROI_LIBRARY_CALLS=0``, else the Custom door would
    call the library's launcher too), library loaded."""
    old = {k: os.environ.get(k) for k in ("MX_ROI_BACKEND", "MX_ROI_LIBRARY_CALLS")}
    os.environ["MX_ROI_BACKEND"] = "native"
    os.environ["MX_ROI_LIBRARY_CALLS"] = "0"
    ext.load()
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _rois(R, N, rng, dtype=np.float32, size=600.0):
    xy = rng.rand(R, 4) * size
    r = np.zeros((R, 5), np.float64)
    r[:, 0] = rng.randint(0, N, R)
    r[:, 1] = np.minimum(xy[:, 0], xy[:, 2])
    r[:, 2] = np.minimum(xy[:, 1], xy[:, 3])
    r[:, 3] = np.maximum(xy[:, 0], xy[:, 2])
    r[:, 4] = np.maximum(xy[:, 1], xy[:, 3])
    return r.astype(dtype)


def _ext(data, rois, op="ROIAlign", out=None, **kw):
    return getattr(mx.nd, "mx_roi_" + op)(data, rois, out=out, **kw)


def _custom(data, rois, op="ROIAlign", out=None, **kw):
    return mx.nd.Custom(data, rois, op_type=op, out=out, **kw)


def _run(fn, data_np, rois_np, grad_np, kw, garbage, rois_grad=False):
    """Output and data gradient of one training call, every buffer MXNet hands the op
    prefilled with ``garbage`` (the output through ``out=``, the gradient buffer);
    ``rois_grad``: the rois' gradient too (after the data's)."""
    data = mx.nd.array(data_np, dtype=data_np.dtype)
    rois = mx.nd.array(rois_np, dtype=rois_np.dtype)
    grads = [data] + ([rois] if rois_grad else [])
    for x in grads:
        x.attach_grad()
        x.grad[:] = garbage
    with mx.autograd.record():
        out = fn(data, rois, **kw)
    out.backward(mx.nd.array(grad_np, dtype=grad_np.dtype))
    # an inference call into a garbage-filled output
    inf = mx.nd.full(out.shape, garbage, dtype=out.dtype)
    fn(data, rois, out=inf, **kw)
    return (out.asnumpy(), *(x.grad.asnumpy() for x in grads), inf.asnumpy())


CASES = [
    dict(pooled_size=(7, 7), spatial_scale=1 / 32.0),
    dict(pooled_size=(7, 7), spatial_scale=1 / 32.0, pool_mode="max"),
    dict(pooled_size=(14, 14), spatial_scale=1 / 32.0, aligned=True, sample_ratio=2),
    dict(pooled_size=(3, 5), spatial_scale=0.125, sample_ratio=0, aligned=True,
         pool_mode="max"),
    dict(pooled_size=(2, 2), spatial_scale=1 / 16.0, legacy="caffe"),
    dict(op="ROIPooling", pooled_size=(7, 7), spatial_scale=1 / 32.0),
    dict(op="ROIPooling", pooled_size=(3, 2), spatial_scale=0.125),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_bits_equal_custom_path(kw, dtype):
    rng = np.random.RandomState(3)
    N, C, H, W = 2, 20, 19, 25
    data = rng.standard_normal((N, C, H, W)).astype(dtype)
    rois = _rois(16, N, rng, dtype)
    rois[5, 0] = -1  # a padding roi
    P, Q = kw["pooled_size"]
    grad = rng.standard_normal((16, C, P, Q)).astype(dtype)
    ours = _run(_ext, data, rois, grad, kw, 7.0)
    theirs = _run(_custom, data, rois, grad, kw, -3.0)
    for a, b, what in zip(ours, theirs, ("output", "data gradient", "inference output")):
        assert a.dtype == b.dtype == dtype
        assert a.tobytes() == b.tobytes(), what
    assert not ours[0][5].any()  # the padding roi: zeros


@pytest.mark.parametrize("op, extra", [("ROIAlign", {}), ("PSROIAlign", dict(output_dim=2))])
def test_boxes_beyond_the_padded_tables(op, extra):
    """Adaptive sampling with boxes far larger than the map: the padded tables overflow
    (status[1]) and the exact widths are built, as on the Custom path."""
    rng = np.random.RandomState(5)
    data = rng.standard_normal((1, 8, 6, 7)).astype(np.float32)
    rois = np.array([[0, -400, -300, 900, 800], [0, 1, 1, 3, 3]], np.float32)
    kw = dict(op=op, pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=-1, **extra)
    grad = rng.standard_normal((2, extra.get("output_dim", 8), 2, 2)).astype(np.float32)
    ours, theirs = _run(_ext, data, rois, grad, kw, 1.0), _run(_custom, data, rois, grad, kw, 2.0)
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("op, channels, extra", [
    ("ROIAlign", 4, {}),
    ("PSROIAlign", 8, dict(output_dim=2)),
    ("PSROIPooling", 8, dict(output_dim=2)),
])
def test_no_rois(op, channels, extra):
    data = np.ones((1, channels, 5, 5), np.float32)
    rois = np.zeros((0, 5), np.float32)
    out_channels = extra.get("output_dim", channels)
    grad = np.zeros((0, out_channels, 2, 2), np.float32)
    kw = dict(op=op, pooled_size=2, spatial_scale=1.0, **extra)
    with mx.util.np_shape(True):  # zero-size arrays need np_shape semantics in MXNet
        ours = _run(_ext, data, rois, grad, kw, 9.0)
        theirs = _run(_custom, data, rois, grad, kw, 9.0)
    assert ours[0].shape == theirs[0].shape == (0, out_channels, 2, 2)
    assert ours[1].tobytes() == theirs[1].tobytes() == np.zeros_like(data).tobytes()


def test_rois_gradient_is_zero():
    data = mx.nd.ones((1, 4, 5, 5))
    rois = mx.nd.array([[0, 0, 0, 3, 3]])
    rois.attach_grad()
    rois.grad[:] = 5
    with mx.autograd.record():
        out = _ext(data, rois, pooled_size=2, spatial_scale=1.0)
    out.backward()
    assert not rois.grad.asnumpy().any()


def test_noop_op():
    data, rois = mx.nd.ones((1, 64, 19, 25)), mx.nd.ones((16, 5))
    data.attach_grad()
    with mx.autograd.record():
        out = mx.nd.mx_roi_noop(data, rois, out_shape="[16, 64, 7, 7]")
    out.backward()
    assert out.shape == (16, 64, 7, 7)


@pytest.mark.parametrize("switch,loaded", [("1", True), ("0", False)])
def test_import_loads_the_cached_library_unless_switched_off(switch, loaded, tmp_path):
    """``import mx_roi`` loads the library when this build is cached (it is: this module
    built it) and ``MX_ROI_NATIVE_OPS`` is not 0; never through mx.library.load (it
    would regenerate every operator function); an empty cache builds nothing at import."""
    ext.library_path()
    code = ("import sys, mxnet as mx, mxnet.library as lib\n"
            "lib.load = None  # (mx_roi must not call it)\n"
            "import mx_roi\n"
            "from mx_roi import ext\n"
            "print('LOADED', hasattr(mx.nd, 'mx_roi_ROIAlign'), "
            "hasattr(mx.sym, 'mx_roi_ROIAlign'), bool(ext.loaded_ops()))\n")
    for cache, want in ((None, loaded), (tmp_path / "empty", False)):
        env = {**os.environ, "PYTHONPATH": ROOT, "MX_ROI_NATIVE_OPS": switch}
        if cache is not None:
            env["MX_ROI_CACHE"] = str(cache)
        res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"LOADED {want} {want} {want}" in res.stdout.splitlines(), res.stdout
        if cache is not None:
            assert not list(cache.glob("mx_roi_ext-*.so"))  # nothing built at import


# ---- the extension sections leave the other builds as they were -------------------------
@pytest.mark.parametrize("filename", ext.op_sources())
def test_extension_section_changes_nothing_the_other_builds_see(filename, tmp_path):
    """The parsed kernel signatures (name expressions, launch checks) and the native and
    emulated builds' preprocessed text are those of the file without its MX_ROI_EXT_LAUNCHER
    section (a stray ``*/`` in it once closed a ``/*`` of roi_common.cuh for the
    signature parser and hid every kernel)."""
    from mx_roi.cuda import source as S
    text = S.read_source(filename)
    head, sep, _ = text.partition(f"#ifdef {ext.LAUNCHER_MACRO}")
    assert sep

    def signatures(t):
        return [m.groups() for m in S._KERNEL_RE.finditer(S._strip_comments(t))]
    assert signatures(text) == signatures(head) != []

    def preprocessed(t, name, native):
        src = tmp_path / name
        src.write_text(t)
        return subprocess.run([loader.host_compiler(), *loader._host_flags(native), "-E", "-P",
                               "-include", loader.SHIM, "-x", "c++", str(src)],
                              capture_output=True, text=True, check=True).stdout
    for native in (True, False):  # the native and the emulated-cuda builds
        assert preprocessed(text, "full.cpp", native) == preprocessed(head, "head.cpp", native)


# ---- parameters: the C++ parser against params.py ------------------------------------
def _python_parse(param_cls=ROIAlignParam, **kwargs):
    try:
        return True, ";".join(f"{k}={v}" for k, v in
                              param_cls.from_kwargs(**kwargs).to_kwargs().items())
    except ValueError as exc:
        return False, str(exc)


def _invalid_cases():
    base = dict(pooled_size="(7, 7)", spatial_scale="0.0625")
    for param_cls in (ROIAlignParam, ROIPoolingParam):
        for name in param_cls.field_names():
            for value in invalid_examples(param_cls, name):
                yield param_cls, {**base, name: str(value)}
        yield param_cls, dict(pooled_size="7")                  # missing spatial_scale
        yield param_cls, dict(spatial_scale="1")                # missing pooled_size
        yield param_cls, {**base, "bogus": "1"}                 # unknown
        yield param_cls, {**base, "spatial_scale": "1e-400"}    # 0.0 after parsing


def _invalid_values_give_the_same_messages(cases, at_least):
    """Each (param_cls, kwargs) of ``cases`` (more than ``at_least``) fails in params.py
    with a message naming the op, and the C++ parser gives that message."""
    cases = list(cases)
    assert len(cases) > at_least
    for param_cls, kwargs in cases:
        py = _python_parse(param_cls, **kwargs)
        assert py[0] is False, kwargs
        assert py[1].startswith(param_cls.op_name + ": "), py
        assert ext.parse_params(param_cls.op_name, **kwargs) == py, kwargs


def test_every_declared_invalid_value_gives_the_same_message():
    _invalid_values_give_the_same_messages(_invalid_cases(), at_least=40)


def _valid_spellings_parse_the_same(param_cls, spellings, required, seed=11, draws=300):
    """``draws`` random mixes of valid spellings (each required parameter always, every
    other one with probability 0.6): the C++ parser gives params.py's result."""
    rng = np.random.RandomState(seed)
    for _ in range(draws):
        kwargs = {k: v[rng.randint(len(v))] for k, v in spellings.items()
                  if k in required or rng.rand() < 0.6}
        py = _python_parse(param_cls, **kwargs)
        assert py[0], (kwargs, py)
        assert ext.parse_params(param_cls.op_name, **kwargs) == py, kwargs


def test_valid_values_parse_the_same():
    spellings = {
        "pooled_size": ["7", "(7, 7)", "[3,5]", "(2,)", " ( 4 , 6 ) ", "7.0", "(1e1, 2)",
                        "0x7", "14,"],
        "spatial_scale": ["0.0625", "1", "1e-3", " 0.5 ", "3.14159", "1_000.5", "6.25e-05",
                          "100000000000000000.0", ".5"],
        "sample_ratio": ["-1", "0", "2", "3.0", " 4 ", "1e1"],
        "aligned": ["True", "false", "1", "0", "yes", "OFF", " on "],
        "pool_mode": ["avg", "MAX", " max "],
        "deterministic": ["False", "true"],
        "legacy": ["", "none", "caffe", "CAFFE", "None"],
    }
    _valid_spellings_parse_the_same(ROIAlignParam, spellings,
                                    required=("pooled_size", "spatial_scale"))


# ---- errors through MXNet: in a child process (an abort must not take the run down) -------
#: each op's errors in the child: its parameters (kw) on data of ``channels`` channels, the
#: value planted in rois[1] for the 'nonfinite' case, parameters that fail to parse, and
#: (PS ops) a channel-count error: (data channels, parameters over kw) or None; optional:
#: good_rois (another layout than the default (3, 5) rois) and plants, the op's own bad
#: rois (case name, row, column, value) beside 'nonfinite' and 'batch'
ERROR_OPS = {
    # (adaptive grids, sample_ratio -1: a box too large for them, check_samples_per_bin)
    "ROIAlign": dict(kw=dict(pooled_size=(2, 2), spatial_scale=1.0), channels=8,
                     bad_value="nan", bad_param=dict(pooled_size=0), wrong_channels=None,
                     plants=[("box", 0, 3, 1e7)]),
    "PSROIAlign": dict(kw=dict(pooled_size=(2, 2), output_dim=2, spatial_scale=1.0),
                       channels=8, bad_value="nan", bad_param=dict(output_dim=0),
                       wrong_channels=(8, dict(output_dim=3)),  # 3 * 2 * 2 = 12 needed
                       plants=[("box", 0, 3, 1e7)]),
    "PSROIPooling": dict(kw=dict(pooled_size=(2, 3), output_dim=2, spatial_scale=1.0,
                                 group_size=(2, 1)), channels=4, bad_value="inf",
                         bad_param=dict(output_dim=0), wrong_channels=(5, {})),
    # rois (R, 6); an adaptive grid's box too large for the kernels (RROIAlign.check_inputs)
    "RROIAlign": dict(kw=dict(pooled_size=(2, 2), spatial_scale=1.0), channels=4,
                      bad_value="nan", bad_param=dict(sampling_ratio=1025), wrong_channels=None,
                      good_rois=[[0, 4, 4, 3, 3, 30], [1, 4, 4, 8, 8, -45], [0, 3, 4, 2, 2, 0]],
                      plants=[("box", 0, 3, 1e7)]),
    "PrRoIPool": dict(kw=dict(pooled_size=(2, 3), spatial_scale=1.0), channels=4,
                      bad_value="-inf", bad_param=dict(pooled_size=0), wrong_channels=None),
}
REPEAT = 10  # bad calls in a row: the tenth message must be as short as the first

#: the children's message(fn): the MXNetError text of fn(), or None (put before a child's
#: script: ``mx`` is its global, imported by the time message runs)
_CHILD_MESSAGE = textwrap.dedent("""
    def message(fn):
        try:
            fn()
        except mx.MXNetError as e:
            return str(e)
        return None
""")

#: argv[1]: repr(ERROR_OPS), argv[2]: REPEAT; prints {op: {what: message or output}}
_CHILD = textwrap.dedent("""
    import ast, json, sys
    import numpy as np, mxnet as mx
    import mx_roi, mx_roi.ext as ext
    ext.load()
    OPS, REPEAT = ast.literal_eval(sys.argv[1]), int(sys.argv[2])
    GOOD = mx.nd.array([[0, 1, 1, 6, 6], [1, 0, 0, 8, 8], [0, 2, 3, 4, 5]])

    def errors(op, kw, channels, bad_value, bad_param, wrong_channels, good_rois=None,
               plants=()):
        out = {}
        good = mx.nd.array(good_rois) if good_rois else GOOD
        data = mx.nd.array(np.random.RandomState(0).standard_normal((2, channels, 9, 9))
                           .astype(np.float32))
        ext_op = getattr(mx.nd, 'mx_roi_' + op)

        def call(path, d, rois, **extra):
            args = dict(kw, **extra)
            if path == 'ext':
                return lambda: ext_op(d, rois, **args).asnumpy()
            return lambda: mx.nd.Custom(d, rois, op_type=op, **args).asnumpy()

        def good_output():
            return ext_op(data, good, **kw).asnumpy().tolist()

        def bwd(rois):
            def step():
                d = data.copy(); d.attach_grad()
                with mx.autograd.record():
                    o = ext_op(d, rois, **kw)
                try:
                    o.backward()
                except mx.MXNetError:
                    pass
                return d.grad.asnumpy()
            return step

        out['good'] = good_output()
        # (name, row, column, value) planted in the good rois; an op's own after these two
        for name, row, column, value in [('nonfinite', 1, 3, bad_value),
                                         ('batch', 2, 0, 7)] + list(plants):
            rois = good.copy(); rois[row, column] = float(value)
            out[name] = [message(call('ext', data, rois)) for _ in range(REPEAT)]
            out[name + '_custom'] = message(call('custom', data, rois))
            out[name + '_backward'] = message(bwd(rois))
            out[name + '_after'] = good_output()
        out['param'] = [message(call('ext', data, good, **bad_param)) for _ in range(REPEAT)]
        out['param_after'] = good_output()
        with mx.util.np_shape(True):  # an empty map (H = 0): zeros, the rois still checked
            empty = mx.nd.zeros((2, channels, 0, 9))
            out['empty_map'] = [call(path, empty, good)().tolist() for path in ('ext', 'custom')]
            bad = good.copy(); bad[1, 3] = float(bad_value)
            out['empty_map_bad'] = [message(call(path, empty, bad)) for path in ('ext', 'custom')]
            d = empty.copy(); d.attach_grad()
            with mx.autograd.record():
                o = ext_op(d, good, **kw)
            o.backward()
            out['empty_map_grad'] = list(d.grad.shape)
        out['empty_map_after'] = good_output()
        if wrong_channels:
            c, extra = wrong_channels
            wrong = mx.nd.ones((1, c, 9, 9))
            for path in ('ext', 'custom'):
                out['channels_' + path] = message(call(path, wrong, good[:1], **extra))
            out['channels_after'] = good_output()
        return out

    print(json.dumps({op: errors(op, **spec) for op, spec in OPS.items()}))
""")


@pytest.fixture(scope="module")
def child_errors():
    """ERROR_OPS's calls, every op in one child process (one start-up)."""
    res = subprocess.run([sys.executable, "-c", _CHILD_MESSAGE + _CHILD, repr(ERROR_OPS),
                          str(REPEAT)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT, "MX_ROI_BACKEND": "native"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(ERROR_OPS)
    return got


def _own_lines(message):
    """The library's messages in an MXNetError: the '\\t[i] ...' lines of MXNet's
    'Extension Traceback'."""
    return [line[line.index("] ") + 2:] for line in message.splitlines()
            if line.startswith("\t[")]


#: (op, case): the start of the library's message, the Custom path's ValueError text
BAD_ROI_MESSAGES = {
    ("ROIAlign", "nonfinite"):
        "ROIAlign: rois[1] has a NaN or infinite value [1.0, 0.0, 0.0, nan, 8.0]",
    ("ROIAlign", "batch"): "ROIAlign: rois[2] has batch index 7 but data holds only 2 image(s)",
    ("ROIAlign", "box"): "ROIAlign: rois[0] is a box of 1e+07 x 5: 1.5e+07 samples per bin "
                         "with sample_ratio <= 0, more than 1048576; check the box size and "
                         "spatial_scale, or set sample_ratio",
    ("PSROIAlign", "box"): "PSROIAlign: rois[0] is a box of 1e+07 x 5: 1.5e+07 samples per "
                           "bin with sample_ratio <= 0, more than 1048576; check the box size "
                           "and spatial_scale, or set sample_ratio",
    ("PSROIAlign", "nonfinite"):
        "PSROIAlign: rois[1] has a NaN or infinite value [1.0, 0.0, 0.0, nan, 8.0]",
    ("PSROIAlign", "batch"):
        "PSROIAlign: rois[2] has batch index 7 but data holds only 2 image(s)",
    ("PSROIPooling", "nonfinite"): "PSROIPooling: rois[1] has a NaN or infinite value "
                                   "[1.0, 0.0, 0.0, inf, 8.0]; coordinates must be finite",
    ("PSROIPooling", "batch"):
        "PSROIPooling: rois[2] has batch index 7 but data holds only 2 image(s)",
    ("RROIAlign", "nonfinite"):
        "RROIAlign: rois[1] has a NaN or infinite value [1.0, 4.0, 4.0, nan, 8.0, -45.0]; "
        "coordinates must be finite",
    ("RROIAlign", "batch"): "RROIAlign: rois[2] has batch index 7 but data holds only 2 "
                            "image(s) (valid: 0..1; a negative index marks a padding roi)",
    ("RROIAlign", "box"): "RROIAlign: rois[0] is a box of 1e+07 x 3: 1e+07 samples per bin "
                          "with sampling_ratio <= 0, more than 1048576; check the box size and "
                          "spatial_scale, or set sampling_ratio",
    ("PrRoIPool", "nonfinite"): "PrRoIPool: rois[1] has a NaN or infinite value "
                                "[1.0, 0.0, 0.0, -inf, 8.0]; coordinates must be finite",
    ("PrRoIPool", "batch"):
        "PrRoIPool: rois[2] has batch index 7 but data holds only 2 image(s)",
}


@pytest.mark.parametrize("op, case", list(BAD_ROI_MESSAGES),
                         ids=[f"{op}-{case}" for op, case in BAD_ROI_MESSAGES])
def test_bad_roi_message_is_the_custom_paths(child_errors, op, case):
    errors = child_errors[op]
    messages = errors[case]
    first = messages[0]
    assert f"Error calling FCompute for custom operator 'mx_roi_{op}'" in first
    own = _own_lines(first)
    assert len(own) == 1 and own[0].startswith(BAD_ROI_MESSAGES[op, case]), own
    # the Custom path's ValueError text, as its message carries it
    assert "ValueError: " + own[0] + "\n" in errors[case + "_custom"], (own, errors)
    # the tenth error carries only its own message (lib_api.cc keeps a list it never clears)
    assert [_own_lines(m) for m in messages] == [own] * REPEAT
    assert len(messages[-1]) == len(first)
    assert _own_lines(errors[case + "_backward"] or "\t[0] none") == own
    assert errors[case + "_after"] == errors["good"]


@pytest.mark.parametrize("op", list(ERROR_OPS))
def test_empty_map_gives_the_custom_paths_zeros(child_errors, op):
    """An empty map (H = 0 under np_shape; the kernels once divided by it: SIGFPE, or read
    off it: SIGSEGV): the Custom path's zeros, a bad roi still refused with its message."""
    errors = child_errors[op]
    ours, theirs = errors["empty_map"]
    assert ours == theirs and np.asarray(ours).size and not np.asarray(ours).any()
    ours, theirs = errors["empty_map_bad"]
    own = _own_lines(ours)
    assert len(own) == 1 and own[0].startswith(f"{op}: rois[1] has a NaN or infinite value")
    assert "ValueError: " + own[0] + "\n" in theirs
    assert errors["empty_map_grad"] == [2, ERROR_OPS[op]["channels"], 0, 9]
    assert errors["empty_map_after"] == errors["good"]


PARAM_MESSAGES = {
    "ROIAlign": "ROIAlign: parameter 'pooled_size': expected positive value(s), got (0, 0)",
    "PSROIAlign": "PSROIAlign: parameter 'output_dim': expected positive value(s), got 0",
    "PSROIPooling": "PSROIPooling: parameter 'output_dim': expected positive value(s), got 0",
    "RROIAlign": "RROIAlign: parameter 'sampling_ratio': expected at most 1024 (samples per bin "
                 "side), got 1025",
    "PrRoIPool": "PrRoIPool: parameter 'pooled_size': expected positive value(s), got (0, 0)",
}


@pytest.mark.parametrize("op", list(PARAM_MESSAGES))
def test_parameter_error_through_mxnet(child_errors, op):
    errors = child_errors[op]
    messages = errors["param"]
    assert all(m and f"Error calling ParseAttrs for custom operator 'mx_roi_{op}'" in m
               for m in messages)
    assert [_own_lines(m) for m in messages] == [[PARAM_MESSAGES[op]]] * REPEAT
    assert errors["param_after"] == errors["good"]


#: the PS ops' channel-count message (ERROR_OPS' wrong_channels)
CHANNEL_MESSAGES = {
    "PSROIAlign": "PSROIAlign: data has 8 channels but output_dim * gh * gw = 3 * 2 * 2 = 12 "
                  "are required (group grid (gh, gw) = (2, 2), from group_size=0 and "
                  "pooled_size=(2, 2))",
    "PSROIPooling": "PSROIPooling: data has 5 channels but output_dim * gh * gw = 2 * 2 * 1 = "
                    "4 are required (group grid (gh, gw) = (2, 1), from group_size=(2, 1) and "
                    "pooled_size=(2, 3))",
}


@pytest.mark.parametrize("op", list(CHANNEL_MESSAGES))
def test_channel_count_error_through_mxnet(child_errors, op):
    errors = child_errors[op]
    assert f"Error calling InferShape for custom operator 'mx_roi_{op}'" in errors["channels_ext"]
    assert _own_lines(errors["channels_ext"]) == [CHANNEL_MESSAGES[op]]
    assert "ValueError: " + CHANNEL_MESSAGES[op] + "\n" in errors["channels_custom"], errors
    assert errors["channels_after"] == errors["good"]


# ---- grad_req='add' ---------------------------------------------------------------------
def _twice(make_input):
    """The data gradient after two backward passes with grad_req='add' (3 then 6 due)."""
    data = mx.nd.ones((1, 2, 4, 4))
    data.attach_grad(grad_req="add")
    rois = mx.nd.array([[0, 0, 0, 3, 3]])
    for _ in range(2):
        with mx.autograd.record():
            out = _ext(make_input(data), rois, pooled_size=1, spatial_scale=1.0)
        out.backward(mx.nd.ones(out.shape) * 16)
    return data.grad.asnumpy()


def test_grad_req_add_is_dropped_by_mxnet_and_the_identity_input_restores_it():
    """MXNet 1.9.1's extension dispatcher never passes req: the op overwrites.  Feeding
    the op through ``ext.add_safe`` (an identity whose backward honours req) gives the
    right sum; the day MXNet passes req on, the first assertion fails and says so."""
    once = _twice(lambda d: d) / 1  # (what one pass gives: the op overwrote)
    right = _twice(ext.add_safe)
    assert np.array_equal(right, 2 * once), "add_safe does not accumulate"
    assert right.sum() == pytest.approx(2 * 2 * 16)


def test_grad_req_add_in_a_bound_symbol():
    data, rois = mx.sym.var("data"), mx.sym.var("rois")
    for wrap, due in ((lambda s: s, 1.0), (ext.add_safe, 101.0)):
        out = mx.sym.mx_roi_ROIAlign(wrap(data), rois, pooled_size=1, spatial_scale=1.0)
        exe = out.simple_bind(mx.cpu(), data=(1, 1, 2, 2), rois=(1, 5),
                              grad_req={"data": "add", "rois": "null"})
        exe.arg_dict["data"][:] = 1
        exe.arg_dict["rois"][:] = mx.nd.array([[0, 0, 0, 1, 1]])
        exe.grad_dict["data"][:] = 100
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones((1, 1, 1, 1)) * 4)
        total = exe.grad_dict["data"].asnumpy().sum()
        if wrap is ext.add_safe:
            assert total == pytest.approx(4 * 100 + 4)
        else:  # the dropped req: the op wrote over the 100s
            assert total == pytest.approx(4)


# ---- the cache's trust rules ----------------------------------------------------------
def test_corrupt_or_planted_library_is_rebuilt_never_loaded(tmp_path, monkeypatch):
    good = ext.library_path()
    loader.get_module("roi_align.cu", "native")  # (built)
    host_lib = loader.host_library_path("roi_align.cu", "native")[0]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("MX_ROI_CACHE", str(cache))
    lib_path = ext._plan()[0]
    assert os.path.dirname(lib_path) == str(cache)
    assert os.path.basename(lib_path) == os.path.basename(good)
    built = []

    def fake_compile(path, *args):  # the real build, without the minute of g++
        built.append(path)
        shutil.copy(good, path)
        os.chmod(path, 0o755)

    monkeypatch.setattr(ext, "_compile", fake_compile)
    good_bytes = open(good, "rb").read()
    plants = {"truncated": good_bytes[:4096], "not ELF": b"garbage",
              "another build": open(host_lib, "rb").read()}
    for what, planted in plants.items():
        # a new file under the name (a loaded library's own file is never written over)
        loader.write_private(str(cache), os.path.basename(lib_path), planted, 0o755)
        built.clear()
        with pytest.warns(loader.CacheWarning):
            loader._WARNED.discard(("heal", lib_path))
            assert ext._build_checked() == lib_path
        assert built == [lib_path], what
        assert open(lib_path, "rb").read() == good_bytes
    # a group-writable library is not trusted either
    os.chmod(lib_path, 0o775)
    built.clear()
    loader._WARNED.discard(("heal", lib_path))
    with pytest.warns(loader.CacheWarning, match="writable by group or others"):
        ext._build_checked()
    assert built == [lib_path]
    # an intact one is used as it is
    built.clear()
    ext._build_checked()
    assert built == []


def test_no_compiler_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr(loader, "host_compiler", lambda: "")
    monkeypatch.setitem(ext._STATE, "path", None)
    monkeypatch.setitem(ext._STATE, "failed", None)
    assert "needs a C++ compiler" in ext.unavailable_reason()


# ---- the C predict API, no mx_roi in the process ----------------------------------------
_PREDICT = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np
    lib_mxnet, lib_ext, sym_json, params, data_path, rois_path = sys.argv[1:7]
    names = [n.encode() for n in (sys.argv[7:9] or ['data', 'rois'])]
    assert 'mx_roi' not in sys.modules
    mx = ctypes.CDLL(lib_mxnet, ctypes.RTLD_GLOBAL)
    def check(rc):
        if rc != 0:
            mx.MXGetLastError.restype = ctypes.c_char_p
            raise SystemExit(mx.MXGetLastError().decode())
    check(mx.MXLoadLib(lib_ext.encode(), 0))
    data, rois = np.load(data_path), np.load(rois_path)
    keys = (ctypes.c_char_p * 2)(*names)
    indptr = (ctypes.c_uint * 3)(0, 4, 6)
    shapes = (ctypes.c_uint * 6)(*data.shape, *rois.shape)
    blob = open(params, 'rb').read()
    handle = ctypes.c_void_p()
    check(mx.MXPredCreate(open(sym_json, 'rb').read(), blob, len(blob), 1, 0, 2, keys,
                          indptr, shapes, ctypes.byref(handle)))
    for name, a in zip(names, (data, rois)):
        a = np.ascontiguousarray(a, np.float32)
        check(mx.MXPredSetInput(handle, name, a.ctypes.data_as(ctypes.c_void_p),
                                ctypes.c_uint(a.size)))
    check(mx.MXPredForward(handle))
    shape_p, ndim = ctypes.POINTER(ctypes.c_uint)(), ctypes.c_uint()
    check(mx.MXPredGetOutputShape(handle, 0, ctypes.byref(shape_p), ctypes.byref(ndim)))
    shape = tuple(shape_p[i] for i in range(ndim.value))
    out = np.empty(shape, np.float32)
    check(mx.MXPredGetOutput(handle, 0, out.ctypes.data_as(ctypes.c_void_p),
                             ctypes.c_uint(out.size)))
    check(mx.MXPredFree(handle))
    assert 'mx_roi' not in sys.modules and 'mxnet' not in sys.modules
    print(json.dumps({'shape': shape, 'hex': out.tobytes().hex()}))
""")


def test_c_predict_api_runs_an_exported_symbol_without_mx_roi(tmp_path):
    rng = np.random.RandomState(2)
    data = rng.standard_normal((2, 16, 19, 25)).astype(np.float32)
    rois = _rois(12, 2, rng)
    kw = dict(pooled_size=(7, 7), spatial_scale=1 / 32.0, sample_ratio=2, aligned=True)
    sym = mx.sym.mx_roi_ROIAlign(mx.sym.var("data"), mx.sym.var("rois"), **kw)
    sym.save(str(tmp_path / "model-symbol.json"))
    mx.nd.save(str(tmp_path / "model.params"), {})
    np.save(tmp_path / "data.npy", data)
    np.save(tmp_path / "rois.npy", rois)
    expected = _ext(mx.nd.array(data), mx.nd.array(rois), **kw).asnumpy()
    custom = _custom(mx.nd.array(data), mx.nd.array(rois), **kw).asnumpy()
    assert expected.tobytes() == custom.tobytes()
    lib_mxnet = os.path.join(os.path.dirname(mx.__file__), "libmxnet.so")
    res = subprocess.run([sys.executable, "-c", _PREDICT, lib_mxnet, ext.library_path(),
                          str(tmp_path / "model-symbol.json"), str(tmp_path / "model.params"),
                          str(tmp_path / "data.npy"), str(tmp_path / "rois.npy")],
                         capture_output=True, text=True, cwd=str(tmp_path), timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert tuple(got["shape"]) == expected.shape
    assert bytes.fromhex(got["hex"]) == expected.tobytes()


_FRESH = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mxnet as mx
    lib_ext, prefix, data_path, rois_path = sys.argv[1:]
    mx.library.load(lib_ext, verbose=False)
    net = mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data0', 'data1'],
                                       prefix + '-0000.params')
    out = net(mx.nd.array(np.load(data_path)), mx.nd.array(np.load(rois_path))).asnumpy()
    assert 'mx_roi' not in sys.modules
    print(json.dumps({'shape': out.shape, 'hex': out.tobytes().hex()}))
""")


class _ConvHead(mx.gluon.HybridBlock):
    """Conv -> mx_roi_ROIAlign -> Conv: a model exported from Gluon with native nodes."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.conv1 = mx.gluon.nn.Conv2D(8, 3, padding=1, in_channels=6)
            self.conv2 = mx.gluon.nn.Conv2D(4, 1, in_channels=8)

    def hybrid_forward(self, F, data, rois):
        y = F.mx_roi_ROIAlign(self.conv1(data), rois, pooled_size=(3, 3),
                              spatial_scale=0.5, sample_ratio=2, aligned=True)
        return self.conv2(y)


def test_gluon_exported_model_runs_in_a_fresh_process(tmp_path):
    """A hybridized Gluon block with native nodes (a convolution before the op), exported:
    a fresh process with only ``mx.library.load`` (no ``import mx_roi``) and the C predict
    API both give the first process's output bit for bit."""
    rng = np.random.RandomState(6)
    data = rng.standard_normal((2, 6, 10, 12)).astype(np.float32)
    rois = _rois(5, 2, rng, size=20.0)
    net = _ConvHead()
    net.initialize(mx.init.Normal(0.5))
    net.hybridize()
    expected = net(mx.nd.array(data), mx.nd.array(rois)).asnumpy()
    prefix = str(tmp_path / "head")
    net.export(prefix)
    with open(prefix + "-symbol.json") as f:
        ops = [n["op"] for n in json.load(f)["nodes"]]
    assert "mx_roi_ROIAlign" in ops and "Custom" not in ops and "clip" not in ops
    np.save(tmp_path / "data.npy", data)
    np.save(tmp_path / "rois.npy", rois)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    lib_mxnet = os.path.join(os.path.dirname(mx.__file__), "libmxnet.so")
    for args in ([_FRESH, ext.library_path(), prefix],
                 [_PREDICT, lib_mxnet, ext.library_path(), prefix + "-symbol.json",
                  prefix + "-0000.params"]):
        tail = [str(tmp_path / "data.npy"), str(tmp_path / "rois.npy")]
        if args[0] is _PREDICT:
            tail += ["data0", "data1"]
        res = subprocess.run([sys.executable, "-c", *args, *tail], capture_output=True,
                             text=True, cwd=str(tmp_path), timeout=300, env=env)
        assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert tuple(got["shape"]) == expected.shape == (5, 4, 3, 3)
        assert bytes.fromhex(got["hex"]) == expected.tobytes()


def test_hybridized_gluon_block_runs_the_native_op():
    class Head(mx.gluon.HybridBlock):
        def hybrid_forward(self, F, data, rois):
            return F.mx_roi_ROIAlign(ext.add_safe(data), rois, pooled_size=(3, 3),
                                     spatial_scale=0.5, sample_ratio=2)

    rng = np.random.RandomState(4)
    data = mx.nd.array(rng.standard_normal((2, 6, 10, 12)).astype(np.float32))
    rois = mx.nd.array(_rois(5, 2, rng, size=20.0))
    expected = _custom(data, rois, pooled_size=(3, 3), spatial_scale=0.5,
                       sample_ratio=2).asnumpy()
    for static in (False, True):
        head = Head()
        head.hybridize(static_alloc=static, static_shape=static)
        for _ in range(2):
            data.attach_grad()
            with mx.autograd.record():
                out = head(data, rois)
            out.backward()
            assert out.asnumpy().tobytes() == expected.tobytes()
        assert data.grad.asnumpy().any()


# ---- mx_roi_PSROIAlign (operators/psroi_align.cu's section) -----------------------------
from mx_roi.params import PSROIAlignParam  # noqa: E402

#: (kw, output_dim * gh * gw input channels): the forward's plane-by-plane walk and its
#: channels-last one (psroi_align_forward_native), a group grid of its own, fixed and
#: adaptive sampling, aligned, legacy='rfcn'
PS_ALIGN_CASES = [
    (dict(pooled_size=(7, 7), output_dim=2, spatial_scale=1 / 32.0), 98),
    (dict(pooled_size=(3, 3), output_dim=10, spatial_scale=1 / 16.0, sample_ratio=2), 90),
    (dict(pooled_size=(3, 5), output_dim=3, spatial_scale=0.125, group_size=(2, 3),
          sample_ratio=0, aligned=True), 18),
    (dict(pooled_size=4, output_dim=4, spatial_scale=1 / 16.0, group_size=2, aligned=True), 16),
    (dict(pooled_size=(3, 3), output_dim=2, spatial_scale=1 / 16.0, legacy="rfcn",
          sample_num=3), 18),
    (dict(pooled_size=(2, 3), output_dim=9, spatial_scale=1 / 32.0, legacy="rfcn"), 54),
    # >= 8 output channels and R * Gy * Gx * 4 >= MX_ROI_PS_LANES_READS * N * H * W: the
    # forward's channels-last walk (the two cases above read too few samples for it)
    (dict(pooled_size=(3, 3), output_dim=10, spatial_scale=1 / 16.0), 90),
    (dict(pooled_size=(2, 3), output_dim=8, spatial_scale=1 / 32.0, legacy="rfcn",
          sample_num=4), 48),
]


def _pooled(kw):
    P = kw["pooled_size"]
    return (P, P) if isinstance(P, int) else P


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", PS_ALIGN_CASES,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c[0].items()))
def test_psroi_align_bits_equal_custom_path(case, dtype):
    kw, C = case
    kw = dict(kw, op="PSROIAlign")
    rng = np.random.RandomState(6)
    N, H, W = 2, 19, 25
    data = rng.standard_normal((N, C, H, W)).astype(dtype)
    # boxes on the map (a little beyond it): every bin's channel is read
    rois = _rois(16, N, rng, dtype, size=(W - 1) / kw["spatial_scale"])
    rois[5, 0] = -1  # a padding roi
    P, Q = _pooled(kw)
    grad = rng.standard_normal((16, kw["output_dim"], P, Q)).astype(dtype)
    ours = _run(_ext, data, rois, grad, kw, 7.0)
    theirs = _run(_custom, data, rois, grad, kw, -3.0)
    for a, b, what in zip(ours, theirs, ("output", "data gradient", "inference output")):
        assert a.dtype == b.dtype == dtype
        assert a.tobytes() == b.tobytes(), what
    assert ours[0].shape == (16, kw["output_dim"], P, Q)
    assert not ours[0][5].any() and ours[0].any() and ours[1].any()


def _ps_align_invalid_cases():
    base = dict(pooled_size="(7, 7)", output_dim="2", spatial_scale="0.0625")
    for name in PSROIAlignParam.field_names():
        values = invalid_examples(PSROIAlignParam, name)
        assert values, name
        for value in values:
            yield {**base, name: str(value)}
            if name == "sample_num":  # (also where it is used)
                yield {**base, name: str(value), "legacy": "rfcn"}
    for missing in base:
        yield {k: v for k, v in base.items() if k != missing}
    yield {**base, "bogus": "1"}
    yield {**base, "position_sensitive": "True"}  # contrib.ROIAlign's: not a PS parameter
    yield {**base, "spatial_scale": "1e-400"}
    # the samples along an axis (_check_axis_samples): sample_ratio, or sample_num for rfcn
    yield {**base, "pooled_size": "5000", "sample_ratio": "900"}
    yield {**base, "pooled_size": "(3, 5000)", "sample_num": "900", "legacy": "rfcn"}


def test_psroi_align_every_declared_invalid_value_gives_the_same_message():
    _invalid_values_give_the_same_messages(
        ((PSROIAlignParam, kwargs) for kwargs in _ps_align_invalid_cases()), at_least=40)


def test_psroi_align_valid_values_parse_the_same():
    spellings = {
        "pooled_size": ["7", "(7, 7)", "[3,5]", "(2,)", " ( 4 , 6 ) ", "7.0", "0x7", "14,"],
        "output_dim": ["2", " 10 ", "3.0", "1e1", "21", "2147483646"],
        "spatial_scale": ["0.0625", "1", "1e-3", " 0.5 ", "1_000.5", ".5"],
        "sample_ratio": ["-1", "0", "2", "3.0", " 4 ", "-7"],
        "aligned": ["True", "false", "1", "0", "yes", "OFF"],
        "group_size": ["0", "3", "(2, 3)", "[4,4]", "(0, 0)", "2,", " ( 1 , 7 ) ", "0x3",
                       "(2147483646, 1)"],
        "deterministic": ["False", "true"],
        "legacy": ["", "none", "rfcn", "RFCN", "None"],
        "sample_num": ["1", "2", "4.0", " 1024 "],
    }
    _valid_spellings_parse_the_same(PSROIAlignParam, spellings, seed=12,
                                    required=("pooled_size", "output_dim", "spatial_scale"))
    # at the samples-per-axis limit; legacy='rfcn' checks sample_num there, not sample_ratio
    for kwargs in (dict(pooled_size="4096", output_dim="1", spatial_scale="1", sample_ratio="1024"),
                   dict(pooled_size="(3, 5000)", output_dim="1", spatial_scale="1",
                        sample_ratio="900", legacy="rfcn", sample_num="838")):
        py = _python_parse(PSROIAlignParam, **kwargs)
        assert py[0], (kwargs, py)
        assert ext.parse_params("PSROIAlign", **kwargs) == py, kwargs


# ---- mx_roi_PSROIPooling ------------------------------------------------------------------
# (its own cases and tests: contrib.PSROIPooling's parameters, data of output_dim * gh * gw
# channels)
def _ps_channels(kw):
    """Input channels of a PSROIPooling configuration: output_dim * gh * gw."""
    p = PSROIPoolingParam.from_kwargs(**{k: v for k, v in kw.items() if k != "op"})
    return p.in_channels


PSROI_POOLING_CASES = [
    # output_dim < 8: the plane-by-plane native forward
    dict(op="PSROIPooling", pooled_size=7, output_dim=3, spatial_scale=1 / 32.0),
    # output_dim >= 8 and many reads per copied cell: the channels-last lanes forward
    dict(op="PSROIPooling", pooled_size=(7, 7), output_dim=10, spatial_scale=1 / 16.0,
         group_size=7),
    dict(op="PSROIPooling", pooled_size=(3, 5), output_dim=2, spatial_scale=1 / 16.0,
         group_size=(2, 3)),
    dict(op="PSROIPooling", pooled_size=(4, 2), output_dim=4, spatial_scale=1 / 8.0,
         group_size=1, deterministic=True),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kw", PSROI_POOLING_CASES,
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_psroi_pooling_bits_equal_custom_path(kw, dtype):
    rng = np.random.RandomState(6)
    N, C, H, W = 2, _ps_channels(kw), 19, 25
    data = rng.standard_normal((N, C, H, W)).astype(dtype)
    rois = _rois(16, N, rng, dtype, size=380.0)
    rois[5, 0] = -1  # a padding roi
    P, Q = PSROIPoolingParam.from_kwargs(**{k: v for k, v in kw.items()
                                            if k != "op"}).pooled_size
    grad = rng.standard_normal((16, kw["output_dim"], P, Q)).astype(dtype)
    ours = _run(_ext, data, rois, grad, kw, 7.0)
    theirs = _run(_custom, data, rois, grad, kw, -3.0)
    for a, b, what in zip(ours, theirs, ("output", "data gradient", "inference output")):
        assert a.dtype == b.dtype == dtype
        assert a.shape == b.shape
        assert a.tobytes() == b.tobytes(), what
    assert not ours[0][5].any()  # the padding roi: zeros
    assert ours[0].any() and ours[1].any()  # (not a comparison of zeros)


def test_psroi_pooling_large_channel_map():
    """A channel map of more than 2^22 entries (output_dim * P * Q; ext_launch.h's
    ps_channel_map, kept per thread for the last grid): the same bits."""
    rng = np.random.RandomState(8)
    kw = dict(op="PSROIPooling", pooled_size=64, output_dim=1025, spatial_scale=1.0,
              group_size=1)
    assert 1025 * 64 * 64 > 2 ** 22
    data = rng.standard_normal((1, 1025, 4, 5)).astype(np.float32)
    rois = np.array([[0, 0, 0, 3, 2], [-1, 0, 0, 1, 1]], np.float32)
    grad = rng.standard_normal((2, 1025, 64, 64)).astype(np.float32)
    ours = _run(_ext, data, rois, grad, kw, 7.0)
    theirs = _run(_custom, data, rois, grad, kw, -3.0)
    for a, b, what in zip(ours, theirs, ("output", "data gradient", "inference output")):
        assert a.tobytes() == b.tobytes(), what
    assert ours[0][0].any() and ours[1].any()


def _psroi_pooling_invalid_cases():
    base = dict(pooled_size="(7, 7)", output_dim="2", spatial_scale="0.0625")
    for name in PSROIPoolingParam.field_names():
        for value in invalid_examples(PSROIPoolingParam, name):
            yield {**base, name: str(value)}
    for missing in ("pooled_size", "output_dim", "spatial_scale"):
        yield {k: v for k, v in base.items() if k != missing}
    yield {k: v for k, v in base.items() if k == "spatial_scale"}  # two missing
    yield {**base, "bogus": "1"}                                    # unknown
    yield {**base, "sample_ratio": "2"}                             # PSROIAlign's, not ours
    yield {**base, "spatial_scale": "1e-400"}                       # 0.0 after parsing
    yield {**base, "group_size": "(0, 0, 0)"}
    yield {**base, "group_size": "(-3, 3)"}
    yield {**base, "group_size": "(2147483646, 0)"}                 # at the bound, then 0
    yield {**base, "output_dim": "2147483647"}                      # one past the bound


def test_psroi_pooling_every_declared_invalid_value_gives_the_same_message():
    _invalid_values_give_the_same_messages(
        ((PSROIPoolingParam, kwargs) for kwargs in _psroi_pooling_invalid_cases()), at_least=25)


def test_psroi_pooling_valid_values_parse_the_same():
    spellings = {
        "pooled_size": ["7", "(7, 7)", "[3,5]", "(2,)", " ( 4 , 6 ) ", "7.0", "0x7", "14,",
                        "2147483646"],
        "output_dim": ["1", "21", " 8 ", "2.0", "1e1", "2147483646"],
        "spatial_scale": ["0.0625", "1", "1e-3", " 0.5 ", "1_000.5", "6.25e-05", ".5"],
        "group_size": ["0", "(0, 0)", "7", "(3, 4)", "[2,2]", "(1,)", " 3 ", "0x3",
                       "2147483646"],
        "deterministic": ["False", "true", "1", "off"],
    }
    _valid_spellings_parse_the_same(PSROIPoolingParam, spellings, seed=12,
                                    required=("pooled_size", "output_dim", "spatial_scale"))


# ---- mx_roi_DeformablePSROIPooling (operators/deformable_psroi_pooling.cu's section) ------
# The one op with a third input (trans, absent with no_trans=True: ext_launch.h's
# ExtraInput): every input's gradient compared, trans's and the rois' (zeros) included.
from mx_roi.operators.deformable_psroi_pooling import DeformablePSROIPoolingParam  # noqa: E402

DEFORM = "DeformablePSROIPooling"


def _deform_inputs(kw, R, dtype, rng, N=2, H=13, W=17, extra_channels=0):
    """data (N, output_dim * group_size^2 + extra_channels, H, W), rois (R, 5) on the map
    (rois[R // 3] padding when R >= 3) and, unless no_trans, trans (R, 2K, part, part)
    with K = kw['_K']; NumPy arrays of ``dtype``."""
    p = DeformablePSROIPoolingParam.from_kwargs(**_deform_params(kw))
    data = rng.standard_normal((N, p.in_channels + extra_channels, H, W)).astype(dtype)
    rois = _rois(R, N, rng, dtype, size=(W - 1) / p.spatial_scale)
    if R >= 3:
        rois[R // 3, 0] = -1  # a padding roi
    if p.no_trans:
        return [data, rois]
    trans = rng.uniform(-1.5, 1.5, (R, 2 * kw["_K"], p.part, p.part)).astype(dtype)
    return [data, rois, trans]


def _deform_params(kw):
    return {k: v for k, v in kw.items() if not k.startswith("_")}


def _ext_op(*inputs, out=None, **kw):
    return mx.nd.mx_roi_DeformablePSROIPooling(*inputs, out=out, **kw)


def _custom_op(*inputs, out=None, **kw):
    return mx.nd.Custom(*inputs, op_type=DEFORM, out=out, **kw)


def _run_inputs(fn, arrays, grad_np, kw, garbage):
    """Output, every input's gradient (data, rois, trans) and an inference output of one
    training call, every buffer MXNet hands the op prefilled with ``garbage``."""
    inputs = [mx.nd.array(a, dtype=a.dtype) for a in arrays]
    for x in inputs:
        x.attach_grad()
        x.grad[:] = garbage
    with mx.autograd.record():
        out = fn(*inputs, **kw)
    out.backward(mx.nd.array(grad_np, dtype=grad_np.dtype))
    inf = mx.nd.full(out.shape, garbage, dtype=out.dtype)
    fn(*inputs, out=inf, **kw)
    return [out.asnumpy(), inf.asnumpy()] + [x.grad.asnumpy() for x in inputs]


#: parameters (and _K, the offset classes; _C, data channels beyond output_dim * G^2): the
#: offsets' gradient fused into the data pass (K = output_dim, part = pooled) or by its own
#: kernel (K = 1; K = 2 with part != pooled), no_trans, the default part and samples, more
#: data channels than read
DEFORM_CASES = [
    dict(spatial_scale=1 / 8.0, output_dim=4, group_size=3, pooled_size=3, sample_per_part=2,
         trans_std=0.1, _K=4),
    dict(spatial_scale=0.25, output_dim=6, group_size=2, pooled_size=4, part_size=2,
         sample_per_part=3, trans_std=0.2, _K=1, _C=3),
    dict(spatial_scale=0.5, output_dim=4, group_size=1, pooled_size=2, part_size=3,
         trans_std=0.3, deterministic=True, _K=2),
    dict(spatial_scale=1 / 4.0, output_dim=10, group_size=2, pooled_size=5, sample_per_part=2,
         trans_std=0.05, _K=10),
    dict(spatial_scale=1 / 8.0, output_dim=3, group_size=2, pooled_size=3, sample_per_part=2,
         no_trans=True),
    dict(spatial_scale=0.5, output_dim=2, group_size=3, pooled_size=7, part_size=4,
         trans_std=0.1, no_trans=True, _C=1),
]
_DEFORM_WHAT = ("output", "inference output", "data gradient", "rois gradient",
                "trans gradient")


def _deform_compare(kw, arrays, dtype, R):
    p = DeformablePSROIPoolingParam.from_kwargs(**_deform_params(kw))
    grad = np.random.RandomState(9).standard_normal(
        (R, p.output_dim, p.pooled_size, p.pooled_size)).astype(dtype)
    ours = _run_inputs(_ext_op, arrays, grad, _deform_params(kw), 7.0)
    theirs = _run_inputs(_custom_op, arrays, grad, _deform_params(kw), -3.0)
    assert len(ours) == len(theirs) == 2 + (2 if p.no_trans else 3)
    for a, b, what in zip(ours, theirs, _DEFORM_WHAT):
        assert a.dtype == b.dtype == dtype, what
        assert a.shape == b.shape, what
        assert a.tobytes() == b.tobytes(), what
    assert not ours[3].any()  # the rois' gradient: zeros
    return ours


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kw", DEFORM_CASES,
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_deformable_bits_equal_custom_path(kw, dtype):
    rng = np.random.RandomState(6)
    R = 16
    arrays = _deform_inputs(kw, R, dtype, rng, extra_channels=kw.get("_C", 0))
    ours = _deform_compare(kw, arrays, dtype, R)
    pad = R // 3
    assert not ours[0][pad].any() and ours[0].any() and ours[2].any()  # not zeros only
    if not kw.get("no_trans"):
        assert ours[4].any() and not ours[4][pad].any()


@pytest.mark.parametrize("no_trans", [False, True])
def test_deformable_no_rois(no_trans):
    kw = dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=2, trans_std=0.1,
              no_trans=no_trans, _K=1)
    arrays = _deform_inputs(kw, 0, np.float32, np.random.RandomState(1))
    with mx.util.np_shape(True):  # zero-size arrays need np_shape semantics in MXNet
        ours = _deform_compare(kw, arrays, np.float32, 0)
    assert ours[0].shape == (0, 2, 2, 2)
    assert not ours[2].any()  # the data gradient: zeros over the garbage


def test_deformable_offsets_at_the_guard_bound():
    """trans just below onednn.GUARD_BOUND (float16: its largest finite value) is taken,
    as on the Custom path (the samples land off the map: zeros); at the bound, or inf for
    float16, it is refused (test_deformable_errors)."""
    from mx_roi.onednn import GUARD_BOUND
    kw = dict(spatial_scale=0.5, output_dim=2, group_size=1, pooled_size=2, trans_std=0.1,
              _K=1)
    for dtype in (np.float32, np.float64, np.float16):
        arrays = _deform_inputs(kw, 4, dtype, np.random.RandomState(2))
        if dtype == np.float16:
            edge = np.finfo(np.float16).max
        else:
            edge = np.nextafter(dtype(GUARD_BOUND), dtype(0))
        arrays[2][1, 0, 0, 1] = edge
        arrays[2][2, 1, 1, 0] = -edge
        _deform_compare(kw, arrays, dtype, 4)


def test_deformable_inputs_follow_no_trans():
    """Two inputs with no_trans=True, three without (the Custom op's input_names); MXNet
    itself refuses another count, and the next call works."""
    kw = dict(spatial_scale=0.5, output_dim=2, group_size=1, pooled_size=2)
    for no_trans, names in ((True, ["data", "rois"]), (False, ["data", "rois", "trans"])):
        sym = mx.sym.mx_roi_DeformablePSROIPooling(*map(mx.sym.var, names), no_trans=no_trans,
                                                   **kw)
        custom = mx.sym.Custom(*map(mx.sym.var, names), op_type=DEFORM, no_trans=no_trans, **kw)
        assert sym.list_arguments() == custom.list_arguments() == names
        assert sym.list_outputs()[0].endswith("_output") and len(sym.list_outputs()) == 1
    data, rois = mx.nd.ones((1, 2, 5, 5)), mx.nd.array([[0, 0, 0, 3, 3]])
    trans = mx.nd.zeros((1, 2, 2, 2))
    with pytest.raises(mx.MXNetError, match="expects 2 inputs, but got 3"):
        _ext_op(data, rois, trans, no_trans=True, **kw).asnumpy()
    with pytest.raises(mx.MXNetError, match="expects 3 inputs, but got 2"):
        _ext_op(data, rois, **kw).asnumpy()
    assert _ext_op(data, rois, trans, **kw).asnumpy().tobytes() == \
        _custom_op(data, rois, trans, **kw).asnumpy().tobytes()


# -- errors, in a child process: each case's message on both paths, forward (REPEAT times)
# and backward, then a good call
#: name -> (what is changed in the good call, the start of the library's message, the
#: callback MXNet names); the child builds each case from its name
DEFORM_ERRORS = {
    "rois_nan": ("DeformablePSROIPooling: rois[1] has a NaN or infinite value "
                 "[1.0, 0.0, 0.0, nan, 8.0]; coordinates must be finite", "FCompute"),
    "rois_batch": ("DeformablePSROIPooling: rois[2] has batch index 7 but data holds only 2 "
                   "image(s) (valid: 0..1; a negative index marks a padding roi)", "FCompute"),
    "trans_nan": ("DeformablePSROIPooling: trans[1, 3, 0, 1] is nan; offsets must be finite",
                  "FCompute"),
    "trans_bound": ("DeformablePSROIPooling: trans[2, 0, 1, 1] is -3.0000000054977558e+38; "
                    "offsets must be finite", "FCompute"),
    "trans_bound64": ("DeformablePSROIPooling: trans[0, 2, 0, 0] is 3e+38; offsets must be "
                      "finite", "FCompute"),
    "trans_inf16": ("DeformablePSROIPooling: trans[2, 1, 1, 0] is -inf; offsets must be "
                    "finite", "FCompute"),
    "trans_rows": ("DeformablePSROIPooling: trans must have shape (R, 2 * K, part_size, "
                   "part_size) = (3, 2 * K, 2, 2) with K >= 1 offset classes, got "
                   "(2, 4, 2, 2)", "InferShape"),
    "trans_odd": ("DeformablePSROIPooling: trans must have shape (R, 2 * K, part_size, "
                  "part_size) = (3, 2 * K, 2, 2) with K >= 1 offset classes, got (3, 3, 2, 2)",
                  "InferShape"),
    "trans_classes": ("DeformablePSROIPooling: trans has K = 3 offset classes (shape "
                      "(3, 6, 2, 2)) but output_dim = 4 is not a multiple of K", "InferShape"),
    "trans_dtype": ("DeformablePSROIPooling: data and trans must have the same dtype, got data "
                    "float32 and trans float64", "InferType"),
    "channels": ("DeformablePSROIPooling: data has 15 channels but output_dim * group_size^2 "
                 "= 4 * 2^2 = 16 are required", "InferShape"),
    "param": ("DeformablePSROIPooling: parameter 'part_size': expected 0 (= pooled_size) or a "
              "positive int, got -1", "ParseAttrs"),
    # (an empty map, no memory: the plane is checked before the empty map's zeros)
    "plane": ("DeformablePSROIPooling: a feature map of 65536x32768 has 2^31 or more "
              "elements per channel, more than the CUDA kernels index", "FCompute"),
    "rois_nan_no_trans": ("DeformablePSROIPooling: rois[1] has a NaN or infinite value "
                          "[1.0, 0.0, 0.0, nan, 8.0]; coordinates must be finite", "FCompute"),
}

#: argv[1]: the case names, argv[2]: REPEAT; prints {case: {what: message or output}}
_DEFORM_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, mxnet as mx
    import mx_roi, mx_roi.ext as ext
    from mx_roi.onednn import GUARD_BOUND
    ext.load()
    CASES, REPEAT = json.loads(sys.argv[1]), int(sys.argv[2])
    KW = dict(spatial_scale=1.0, output_dim=4, group_size=2, pooled_size=3, part_size=2,
              trans_std=0.1)
    GOOD_ROIS = np.array([[0, 1, 1, 6, 6], [1, 0, 0, 8, 8], [0, 2, 3, 4, 5]])

    def inputs(case):
        '''(arrays, parameters) of a case: the good call with one thing changed'''
        dtype = {'trans_bound64': 'float64', 'trans_inf16': 'float16'}.get(case, 'float32')
        rng = np.random.RandomState(0)
        data = rng.standard_normal((2, 15 if case == 'channels' else 16, 9, 9)).astype(dtype)
        rois = GOOD_ROIS.astype(dtype)
        trans = rng.uniform(-1, 1, (3, 4, 2, 2)).astype(dtype)
        if case == 'plane':  # no images: the rois are padding
            data = np.zeros((0, 16, 1 << 16, 1 << 15), dtype)
            rois[:, 0] = -1
        kw = dict(KW)
        if case.startswith('rois_nan'):
            rois[1, 3] = np.nan
        elif case == 'rois_batch':
            rois[2, 0] = 7
        elif case == 'trans_nan':
            trans[1, 3, 0, 1] = np.nan
        elif case == 'trans_bound':  # exactly the bound (in float32), then just below
            trans[2, 0, 1, 1] = -np.float32(GUARD_BOUND)
        elif case == 'trans_bound64':
            trans[0, 2, 0, 0] = GUARD_BOUND
        elif case == 'trans_inf16':
            trans[2, 1, 1, 0] = -np.inf
        elif case == 'trans_rows':
            trans = trans[:2]
        elif case == 'trans_odd':
            trans = trans[:, :3]
        elif case == 'trans_classes':
            trans = np.zeros((3, 6, 2, 2), dtype)
        elif case == 'trans_dtype':
            trans = trans.astype('float64')
        elif case == 'param':
            kw['part_size'] = -1
        if case.endswith('no_trans'):
            kw['no_trans'] = True
        arrays = [data, rois] + ([] if kw.get('no_trans') else [trans])
        return [mx.nd.array(a, dtype=a.dtype) for a in arrays], kw

    def zero_size(fn):  # ('plane': zero-size arrays need np_shape semantics in MXNet)
        def run():
            with mx.util.np_shape(True):
                return fn()
        return run

    def call(path, case):
        def run():
            arrays, kw = inputs(case)
            if path == 'ext':
                return mx.nd.mx_roi_DeformablePSROIPooling(*arrays, **kw).asnumpy()
            return mx.nd.Custom(*arrays, op_type='DeformablePSROIPooling', **kw).asnumpy()
        return run

    def backward(case):
        def step():
            arrays, kw = inputs(case)
            for a in arrays:
                a.attach_grad()
            with mx.autograd.record():
                o = mx.nd.mx_roi_DeformablePSROIPooling(*arrays, **kw)
            try:
                o.backward()
            except mx.MXNetError:
                pass
            return [a.grad.asnumpy() for a in arrays]
        return step

    def good():
        arrays, kw = inputs('good')
        return mx.nd.mx_roi_DeformablePSROIPooling(*arrays, **kw).asnumpy().tolist()

    out = {'good': good()}
    for case in CASES:
        wrap = zero_size if case == 'plane' else (lambda fn: fn)
        out[case] = dict(ext=[message(wrap(call('ext', case))) for _ in range(REPEAT)],
                         custom=message(wrap(call('custom', case))),
                         backward=message(wrap(backward(case))), after=good())
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def deform_errors():
    res = subprocess.run([sys.executable, "-c", _CHILD_MESSAGE + _DEFORM_CHILD,
                          json.dumps(list(DEFORM_ERRORS)),
                          str(REPEAT)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT, "MX_ROI_BACKEND": "native"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(DEFORM_ERRORS))
def test_deformable_errors(deform_errors, case):
    """The library's one message starts with the op and the problem and is the Custom
    path's text; the tenth is as short as the first; the backward (when the forward ran)
    says the same; the next good call works."""
    expected, callback = DEFORM_ERRORS[case]
    got = deform_errors[case]
    first = got["ext"][0]
    assert first and f"Error calling {callback} for custom operator 'mx_roi_{DEFORM}'" in first
    own = _own_lines(first)
    assert len(own) == 1 and own[0].startswith(expected), own
    if case != "param":  # (the Custom op's constructor keeps it for list_arguments)
        assert "Error: " + own[0] + "\n" in got["custom"], (own, got["custom"])
    assert [_own_lines(m) for m in got["ext"]] == [own] * REPEAT
    assert len(got["ext"][-1]) == len(first)
    assert _own_lines(got["backward"] or "\t[0] none") == own
    assert got["after"] == deform_errors["good"]


# -- parameters: the C++ parser against DeformablePSROIPoolingParam
def _deform_invalid_cases():
    base = dict(spatial_scale="0.0625", output_dim="2", group_size="2", pooled_size="7")
    for name in DeformablePSROIPoolingParam.field_names():
        values = invalid_examples(DeformablePSROIPoolingParam, name)
        assert values, name
        for value in values:
            yield {**base, name: str(value)}
    for missing in base:
        yield {k: v for k, v in base.items() if k != missing}
    yield {"spatial_scale": "1"}                                  # three missing
    yield {**base, "bogus": "1"}
    yield {**base, "spatial_scale": "1e-400"}                     # 0.0 after parsing
    yield {**base, "trans_std": "-1e-300"}
    yield {**base, "pooled_size": "46341"}
    yield {**base, "part_size": "32768"}
    yield {**base, "output_dim": "2147483647"}                    # one past the bound


def test_deformable_every_declared_invalid_value_gives_the_same_message():
    _invalid_values_give_the_same_messages(
        ((DeformablePSROIPoolingParam, kwargs) for kwargs in _deform_invalid_cases()),
        at_least=30)


def test_deformable_valid_values_parse_the_same():
    spellings = {
        "spatial_scale": ["0.0625", "1", "1e-3", " 0.5 ", "1_000.5", ".5"],
        "output_dim": ["2", " 10 ", "3.0", "1e1", "2147483646"],
        "group_size": ["1", "7", " 3 ", "2.0", "1_0", "2147483646"],
        "pooled_size": ["7", " 3 ", "1e1", "46340"],
        "part_size": ["0", "4", "32767", " 2.0 "],
        "sample_per_part": ["1", "4", "1024"],
        "trans_std": ["0", "0.1", "-0.0", "1e-3", " 2 "],
        "no_trans": ["True", "false", "1", "0", "yes", "OFF"],
        "deterministic": ["False", "true"],
    }
    _valid_spellings_parse_the_same(DeformablePSROIPoolingParam, spellings, seed=13,
                                    required=("spatial_scale", "output_dim", "group_size",
                                              "pooled_size"))


# ---- ops whose kernels read the rois themselves: mx_roi_RROIAlign, mx_roi_PrRoIPool -------
# (rroi_align.cu's and prroi_pool.cu's sections).  One table of op configurations drives
# the bit parity, the empty call and the parameter parity: an op added here is covered by
# each (ROI_OPS' rois_grad: the rois get a gradient of their own, compared too).
from mx_roi.operators.prroi_pool import PrRoIPoolParam  # noqa: E402
from mx_roi.operators.rroi_align import RROIAlignParam  # noqa: E402
from mx_roi.registry import get_op  # noqa: E402


def _rotated_edge_rois(dtype):
    """RROIAlign rois off and across the map (19 x 25 cells at scale 1/8: 152 x 200 image
    pixels): centred beyond each side, a box wider than the map, a thin one, a padding one."""
    return np.array([[0, -40, -40, 60, 30, 15], [1, 260, 80, 50, 50, 90],
                     [0, 100, 76, 400, 300, -30], [1, 100, 76, 2, 0.5, 45],
                     [-1, 50, 50, 40, 40, 0], [0, 0, 0, 0, 0, 0]], dtype)


def _precise_edge_rois(dtype):
    """PrRoIPool rois off and across the map (19 x 25 cells at scale 1/8): beyond the top
    left, across the whole map and past it, a reversed box (area 0), a degenerate one, a
    padding one."""
    return np.array([[0, -80, -60, 20, 30], [1, -30, -20, 260, 200],
                     [0, 120, 90, 40, 30], [1, 50, 50, 50, 90],
                     [-2, 10, 10, 90, 90], [0, 190, 140, 230, 170]], dtype)


#: op -> its configurations (parameters over (P, Q) = pooled_size), the rois off the map,
#: whether the rois get a gradient
ROI_OPS = {
    "RROIAlign": dict(edge_rois=_rotated_edge_rois, rois_grad=False, cases=[
        dict(pooled_size=(2, 2), spatial_scale=1 / 8.0),                     # adaptive grid
        dict(pooled_size=(3, 4), spatial_scale=1 / 8.0, sampling_ratio=2, aligned=True,
             clockwise=True),
        dict(pooled_size=(7, 7), spatial_scale=1 / 8.0, sampling_ratio=0, aligned=True),
        dict(pooled_size=(2, 3), spatial_scale=1 / 8.0, sampling_ratio=1, deterministic=True),
    ]),
    "PrRoIPool": dict(edge_rois=_precise_edge_rois, rois_grad=True, cases=[
        dict(pooled_size=(2, 2), spatial_scale=1 / 8.0),
        dict(pooled_size=(7, 7), spatial_scale=1 / 8.0),
        dict(pooled_size=(3, 5), spatial_scale=1 / 8.0, deterministic=True),
        # R * C * P * Q >= 2^17: the native rois' gradient on two threads (one roi each)
        dict(pooled_size=(20, 20), spatial_scale=1 / 8.0),
    ]),
}
ROI_OP_CASES = [(op, kw) for op, spec in ROI_OPS.items() for kw in spec["cases"]]


def _roi_op_problem(op, dtype, seed=6):
    """data (2, 20, 19, 25) (16 + 4 channels: the lanes walks and their tail), 16 random
    rois (rois[5] padding) and the op's rois off the map, all in ``dtype``."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((2, 20, 19, 25)).astype(dtype)
    rois = get_op(op).random_rois(rng, 16, 2, 19, 25, 1 / 8.0)
    rois[5, 0] = -1
    return data, np.concatenate([rois.astype(dtype), ROI_OPS[op]["edge_rois"](dtype)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("op, kw", ROI_OP_CASES,
                         ids=[f"{op}-" + "-".join(f"{k}={v}" for k, v in kw.items())
                              for op, kw in ROI_OP_CASES])
def test_roi_reading_ops_bits_equal_custom_path(op, kw, dtype):
    data, rois = _roi_op_problem(op, dtype)
    P, Q = kw["pooled_size"]
    grad = np.random.default_rng(7).standard_normal((len(rois), 20, P, Q)).astype(dtype)
    kw = dict(kw, op=op)
    ours = _run(_ext, data, rois, grad, kw, 7.0, rois_grad=True)
    theirs = _run(_custom, data, rois, grad, kw, -3.0, rois_grad=True)
    for a, b, what in zip(ours, theirs, ("output", "data gradient", "rois gradient",
                                         "inference output")):
        assert a.dtype == b.dtype == dtype
        assert a.shape == b.shape
        assert a.tobytes() == b.tobytes(), what
    out, data_grad, rois_grad, _ = ours
    padding = rois[:, 0] < 0
    assert not out[padding].any() and not rois_grad[padding].any()  # padding rois: zeros
    assert out.any() and data_grad.any()  # (not a comparison of zeros)
    assert rois_grad.any() == ROI_OPS[op]["rois_grad"]
    assert not rois_grad[:, 0].any()  # the batch index gets no gradient


@pytest.mark.parametrize("op", list(ROI_OPS))
def test_roi_reading_ops_without_rois(op):
    columns = get_op(op).rois_columns
    data = np.ones((1, 4, 5, 5), np.float32)
    rois = np.zeros((0, columns), np.float32)
    grad = np.zeros((0, 4, 2, 2), np.float32)
    kw = dict(op=op, pooled_size=2, spatial_scale=1.0)
    with mx.util.np_shape(True):  # zero-size arrays need np_shape semantics in MXNet
        ours = _run(_ext, data, rois, grad, kw, 9.0, rois_grad=True)
        theirs = _run(_custom, data, rois, grad, kw, 9.0, rois_grad=True)
    assert ours[0].shape == theirs[0].shape == (0, 4, 2, 2)
    assert ours[2].shape == theirs[2].shape == (0, columns)
    assert ours[1].tobytes() == theirs[1].tobytes() == np.zeros_like(data).tobytes()


def test_rotated_rois_of_five_columns_are_refused_and_the_next_call_works():
    data = mx.nd.ones((1, 4, 5, 5))
    with pytest.raises(mx.MXNetError) as info:
        _ext(data, mx.nd.array([[0, 1, 1, 3, 3]]), op="RROIAlign", pooled_size=2,
             spatial_scale=1.0).asnumpy()
    assert "RROIAlign: rois must have shape (R, 6) = (batch_index, x_center, y_center, " \
           "width, height, angle_degrees), got (1, 5)" in str(info.value)
    rois = mx.nd.array([[0, 2, 2, 3, 3, 30]])
    out = _ext(data, rois, op="RROIAlign", pooled_size=2, spatial_scale=1.0).asnumpy()
    assert out.tobytes() == _custom(data, rois, op="RROIAlign", pooled_size=2,
                                    spatial_scale=1.0).asnumpy().tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rotated_box_size_bound_is_exact(dtype):
    """An adaptive grid's box of exactly geometry.MAX_ROTATED_SAMPLES = 1024 * 1024 samples
    per bin runs (and matches the Custom path); one more column of samples is refused with
    the Custom path's message, and the next call works."""
    data = mx.nd.array(np.random.default_rng(3).standard_normal((1, 2, 6, 7)), dtype=dtype)
    kw = dict(op="RROIAlign", pooled_size=1, spatial_scale=1.0, aligned=True)
    at = mx.nd.array([[0, 3, 3, 1024, 1024, 30], [0, 2, 2, 3, 3, 0]], dtype=dtype)
    ours = _ext(data, at, **kw).asnumpy()
    assert ours.tobytes() == _custom(data, at, **kw).asnumpy().tobytes() and ours.any()
    beyond = mx.nd.array([[0, 3, 3, 2, 2, 0], [0, 3, 3, 1025, 1024, 30]], dtype=dtype)
    with pytest.raises(mx.MXNetError) as info:
        _ext(data, beyond, **kw).asnumpy()
    assert _own_lines(str(info.value)) == [
        "RROIAlign: rois[1] is a box of 1025 x 1024: 1.05e+06 samples per bin with "
        "sampling_ratio <= 0, more than 1048576; check the box size and spatial_scale, or "
        "set sampling_ratio"]
    with pytest.raises(mx.MXNetError, match=r"ValueError: RROIAlign: rois\[1\] is a box of "
                                            r"1025 x 1024: 1\.05e\+06 samples per bin"):
        _custom(data, beyond, **kw).asnumpy()
    assert _ext(data, at, **kw).asnumpy().tobytes() == ours.tobytes()


def test_precise_rois_gradient_add_through_add_safe():
    """PrRoIPool's rois get a gradient, and MXNet drops their grad_req='add' as the
    data's: two passes through ext.add_safe accumulate twice the Custom path's one pass;
    without it the op overwrote (one pass)."""
    rng = np.random.default_rng(8)
    data = mx.nd.array(rng.standard_normal((1, 3, 9, 9)), dtype=np.float64)
    rois_np = np.array([[0, 1.5, 2.25, 6.5, 7.75], [0, 0.5, 0.5, 3.0, 8.5]])
    kw = dict(op="PrRoIPool", pooled_size=(2, 3), spatial_scale=1.0)
    grad = mx.nd.array(rng.standard_normal((2, 3, 2, 3)), dtype=np.float64)

    def rois_grad(fn, wrap, passes):
        rois = mx.nd.array(rois_np, dtype=np.float64)
        rois.attach_grad(grad_req="add")
        rois.grad[:] = 0
        for _ in range(passes):
            with mx.autograd.record():
                out = fn(data, wrap(rois), **kw)
            out.backward(grad)
        return rois.grad.asnumpy()

    once = rois_grad(_custom, lambda r: r, 1)
    assert once[:, 1:].all()
    assert np.array_equal(rois_grad(_ext, ext.add_safe, 2), 2 * once)
    assert np.array_equal(rois_grad(_ext, lambda r: r, 2), once)  # MXNet dropped 'add'


# ---- the parameter parity of every op with a section -------------------------------------
#: param class -> (a valid base, spellings of every field, the op's own invalid kwargs)
PARAM_PARITY = {
    RROIAlignParam: (
        dict(pooled_size="(7, 7)", spatial_scale="0.0625"),
        {"pooled_size": ["7", "(7, 7)", "[3,5]", "(2,)", " ( 4 , 6 ) ", "7.0", "0x7", "14,",
                         "2147483646"],
         "spatial_scale": ["0.0625", "1", "1e-3", " 0.5 ", "1_000.5", "6.25e-05", ".5"],
         "sampling_ratio": ["-1", "0", "2", "3.0", " 4 ", "1e1", "1024", "-2147483648"],
         "aligned": ["True", "false", "1", "0", "yes", "OFF", " on "],
         "clockwise": ["False", "true", "1", "off"],
         "deterministic": ["False", "true"]},
        [dict(sample_ratio="2"),  # ROIAlign's name: unknown here
         dict(sampling_ratio="1025"), dict(sampling_ratio="-2147483649"),
         dict(pooled_size="(2147483647, 2)")]),
    PrRoIPoolParam: (
        dict(pooled_size="(7, 7)", spatial_scale="0.0625"),
        {"pooled_size": ["7", "(7, 7)", "[3,5]", "(2,)", " ( 4 , 6 ) ", "7.0", "0x7", "14,",
                         "2147483646"],
         "spatial_scale": ["0.0625", "1", "1e-3", " 0.5 ", "1_000.5", "6.25e-05", ".5"],
         "deterministic": ["False", "true", "1", "off"]},
        [dict(sampling_ratio="2"), dict(pooled_size="(0, 3)")]),
}
#: the ops whose parsers the tests above compare with params.py, each in its own tests
PARITY_ELSEWHERE = {"ROIAlign", "ROIPooling", "PSROIAlign", "PSROIPooling",
                    "DeformablePSROIPooling"}


def test_every_op_with_a_section_has_a_parameter_parity_test():
    from mx_roi.registry import REGISTERED
    with_section = {name for name, cls in REGISTERED.items()
                    if cls.cuda_source in ext.op_sources()}
    covered = PARITY_ELSEWHERE | {cls.op_name for cls in PARAM_PARITY}
    assert with_section - covered == set()
    assert {"RROIAlign", "PrRoIPool"} <= with_section


def _table_invalid_cases(param_cls):
    base, _, own = PARAM_PARITY[param_cls]
    for name in param_cls.field_names():
        for value in invalid_examples(param_cls, name):
            yield param_cls, {**base, name: str(value)}
    for missing in base:
        yield param_cls, {k: v for k, v in base.items() if k != missing}
    yield param_cls, {**base, "bogus": "1"}
    yield param_cls, {**base, "spatial_scale": "1e-400"}  # 0.0 after parsing
    for kwargs in own:
        yield param_cls, {**base, **kwargs}


@pytest.mark.parametrize("param_cls", list(PARAM_PARITY), ids=lambda c: c.op_name)
def test_table_ops_invalid_values_give_the_same_messages(param_cls):
    _invalid_values_give_the_same_messages(_table_invalid_cases(param_cls), at_least=15)


@pytest.mark.parametrize("param_cls", list(PARAM_PARITY), ids=lambda c: c.op_name)
def test_table_ops_valid_values_parse_the_same(param_cls):
    base, spellings, _ = PARAM_PARITY[param_cls]
    assert sorted(spellings) == sorted(param_cls.field_names())  # every field spelt
    _valid_spellings_parse_the_same(param_cls, spellings, seed=13, required=tuple(base))
