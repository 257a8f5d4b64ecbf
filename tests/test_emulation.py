"""The CUDA kernels, compiled for the host (``emulated-cuda``), against the NumPy backend.

The emulation compiles the very ``operators/*.cu`` text that CuPy compiles on a GPU (with
``mx_roi/cuda/host_shim.h``), and launches it through the same checked launch call, so
these tests prove the kernels, their table reading and the argument marshalling without
a GPU.  Both backends are driven directly (``backend.forward/backward`` on NDArrays) to
cover ``req`` write/add/null; ``tests/ops`` runs the whole op suite through
``mx.nd.Custom`` with ``MX_ROI_BACKEND=emulated-cuda`` as well.
"""
import os

import mxnet as mx
import numpy as np
import pytest

import mx_roi  # noqa: F401
from mx_roi import geometry
from mx_roi.backends import NumpyBackend
from mx_roi.cuda import loader
from mx_roi.cuda import source as S
from mx_roi.cuda.backend import CudaBackend, Launch
from mx_roi.ndio import Kind
from mx_roi.registry import get_op
from tests.ops.base import adversarial_rois, make_data, random_rois

TOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-11}

CASES = [
    ("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=0.5)),
    ("ROIPooling", dict(pooled_size=(3, 3), spatial_scale=1.0)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.0625, sample_ratio=-1)),
    ("ROIAlign", dict(pooled_size=(3, 2), spatial_scale=1.0, sample_ratio=2, aligned=True)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1, aligned=True,
                      pool_mode="max")),
    ("ROIAlign", dict(pooled_size=(3, 2), spatial_scale=0.25, sample_ratio=1,
                      pool_mode="max")),
    ("PSROIPooling", dict(pooled_size=3, output_dim=2, spatial_scale=0.5)),
    ("PSROIPooling", dict(pooled_size=(2, 3), output_dim=2, spatial_scale=1.0,
                          group_size=3)),
    ("PSROIAlign", dict(pooled_size=2, output_dim=2, spatial_scale=0.5, sample_ratio=2)),
    ("PSROIAlign", dict(pooled_size=3, output_dim=1, spatial_scale=1.0, sample_ratio=-1,
                        aligned=True, group_size=2)),
]
if hasattr(geometry, "caffe_align_grid"):  # legacy tables: same kernels, other geometry
    CASES.append(("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, legacy="caffe")))
if hasattr(geometry, "rfcn_align_grid"):
    CASES.append(("PSROIAlign", dict(pooled_size=2, output_dim=2, spatial_scale=0.5,
                                     legacy="rfcn", sample_num=2)))

DTYPES = (np.float16, np.float32, np.float64)
EMU = CudaBackend(Kind.EMULATED)
REF = NumpyBackend()


def _ids(cases):
    return [f"{name}-{i}" for i, (name, _) in enumerate(cases)]


def make_op(name, params):
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**params))


def problem(op, dtype, seed=0, N=2, C=3, H=9, W=10, kind="randn"):
    rng = np.random.default_rng(seed)
    p = op.param
    cin = C if not hasattr(p, "output_dim") else p.in_channels
    data = make_data(rng, (N, cin, H, W), dtype, kind)
    rois = np.concatenate([adversarial_rois(rng, N, H, W, p.spatial_scale, dtype=dtype),
                           random_rois(rng, 5, N, H, W, p.spatial_scale, dtype)])
    rois[::7, 0] = -1  # padding rois
    out_shape = op.out_shape(data.shape, rois.shape)
    grad = make_data(rng, out_shape, dtype)
    return data, rois.astype(dtype), grad


def nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def run(backend, op, data, rois, grad, req_f="write", req_b="write", init_out=None,
        init_grad=None):
    """Forward + backward through ``backend``; returns (out, data grad) as NumPy."""
    out_shape = op.out_shape(data.shape, rois.shape)
    out = nd(init_out if init_out is not None else np.zeros(out_shape, data.dtype))
    dgrad = nd(init_grad if init_grad is not None else np.zeros(data.shape, data.dtype))
    x, r = nd(data), nd(rois)
    saved = backend.forward(op, req_f, x, r, out, keep=True)
    backend.backward(op, req_b, nd(grad), x, r, dgrad, saved)
    return out.asnumpy(), dgrad.asnumpy()


def close(a, b, dtype, exact=False, what=""):
    assert a.dtype == b.dtype == np.dtype(dtype), what
    if exact:
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        t = TOL[np.dtype(dtype)]
        scale = max(1.0, float(np.abs(b.astype(np.float64)).max()) if b.size else 1.0)
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=t,
                                   atol=t * scale, err_msg=what)


def _is_max(name, params):
    return name == "ROIPooling" or params.get("pool_mode") == "max" or \
        params.get("legacy") == "caffe"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=_ids(CASES))
def test_emulated_vs_numpy(name, params, dtype):
    op = make_op(name, params)
    for kind in ("randn", "int"):
        data, rois, grad = problem(op, dtype, kind=kind)
        out_e, g_e = run(EMU, op, data, rois, grad)
        out_n, g_n = run(REF, op, data, rois, grad)
        # max modes compute every sample with the same operations: identical values
        exact = _is_max(name, params) and np.dtype(dtype) != np.float16
        close(out_e, out_n, dtype, exact=exact, what=f"forward [{kind}]")
        close(g_e, g_n, dtype, what=f"data grad [{kind}]")
        assert out_e[rois[:, 0] < 0].sum() == 0


@pytest.mark.parametrize("name,params", CASES[::2], ids=_ids(CASES[::2]))
def test_req_add_and_null(name, params):
    dtype = np.float32
    op = make_op(name, params)
    data, rois, grad = problem(op, dtype, seed=1)
    base_out = np.full(op.out_shape(data.shape, rois.shape), 0.5, dtype)
    base_grad = np.full(data.shape, -0.25, dtype)
    out_w, g_w = run(EMU, op, data, rois, grad)
    out_a, g_a = run(EMU, op, data, rois, grad, "add", "add", base_out, base_grad)
    close(out_a, out_w + base_out, dtype, what="forward req=add")
    close(g_a, g_w + base_grad, dtype, what="backward req=add")
    out_0, g_0 = run(EMU, op, data, rois, grad, "null", "null", base_out, base_grad)
    np.testing.assert_array_equal(out_0, base_out)
    np.testing.assert_array_equal(g_0, base_grad)


@pytest.mark.parametrize("name,params", CASES[::2], ids=_ids(CASES[::2]))
def test_zero_rois_no_launch(name, params, monkeypatch):
    launched = []
    monkeypatch.setattr(Launch, "_launch", lambda self, *a: launched.append(a))
    op = make_op(name, params)
    data, _, _ = problem(op, np.float32)
    rois = np.zeros((0, 5), np.float32)
    with mx.util.np_shape(True):
        grad = np.zeros(op.out_shape(data.shape, rois.shape), np.float32)
        out, g = run(EMU, op, data, rois, grad, init_grad=np.ones(data.shape, np.float32))
    assert out.shape[0] == 0 and not g.any()
    assert launched == []


@pytest.mark.parametrize("name,params", CASES[::3], ids=_ids(CASES[::3]))
def test_deterministic_fixed_point(name, params):
    """deterministic=True accumulates in 64-bit fixed point: same bits on every run and
    the same values as the float atomics up to rounding."""
    op = make_op(name, params)
    det = make_op(name, dict(params, deterministic=True))
    for dtype in (np.float32, np.float64):
        data, rois, grad = problem(op, dtype, seed=2)
        rois = np.concatenate([rois] * 4)  # many rois hitting the same cells
        grad = np.concatenate([grad] * 4)
        _, g_float = run(EMU, op, data, rois, grad)
        out1, g1 = run(EMU, det, data, rois, grad)
        out2, g2 = run(EMU, det, data, rois, grad)
        assert g1.tobytes() == g2.tobytes() and out1.tobytes() == out2.tobytes()
        close(g1, g_float, dtype, what="fixed point vs float atomics")


def test_deterministic_uses_fixed_point_kernels(monkeypatch):
    seen = []
    real = Launch._launch
    monkeypatch.setattr(Launch, "_launch",
                        lambda self, expr, n, args: (seen.append(expr), real(self, expr, n, args)))
    op = make_op("ROIAlign", dict(pooled_size=2, spatial_scale=1.0, deterministic=True))
    data, rois, grad = problem(op, np.float16)
    run(EMU, op, data, rois, grad)
    assert "roi_align_backward_avg<__half, float, unsigned long long>" in seen
    # non-finite out-grad cannot be fixed point: falls back to float atomics
    seen.clear()
    grad[0, 0, 0, 0] = np.inf
    run(EMU, op, data, rois, grad)
    assert "roi_align_backward_avg<__half, float, float>" in seen


def test_through_custom_op(monkeypatch):
    """mx.nd.Custom picks the emulated kernels with MX_ROI_BACKEND=emulated-cuda."""
    seen = []
    real = Launch._launch
    monkeypatch.setattr(Launch, "_launch",
                        lambda self, expr, n, args: (seen.append(expr), real(self, expr, n, args)))
    monkeypatch.setenv("MX_ROI_BACKEND", "emulated-cuda")
    x = mx.nd.array(np.arange(50, dtype=np.float32).reshape(1, 2, 5, 5))
    r = mx.nd.array([[0, 0, 0, 3, 3]])
    y = mx.nd.Custom(x, r, op_type="ROIPooling", pooled_size=(2, 2), spatial_scale=1.0)
    np.testing.assert_array_equal(y.asnumpy()[0, 0], [[6, 8], [16, 18]])
    # the tables built by the device geometry kernel, as on a GPU; inference: uint8
    assert seen == ["roi_bins_geometry<float, float>",
                    "roi_pooling_forward<float, float, unsigned char>"]


# ---------------------------------------------------------------- argument checking
def _pool_args(**over):
    """Valid arguments of roi_pooling_forward<float, float, unsigned char> for a tiny
    problem."""
    a = dict(data=np.zeros((1, 1, 4, 4), np.float32), batch=np.zeros(1, np.int32),
             hstart=np.zeros((1, 2), np.int32), hend=np.full((1, 2), 2, np.int32),
             wstart=np.zeros((1, 2), np.int32), wend=np.full((1, 2), 2, np.int32),
             C=np.int32(1), H=np.int32(4), W=np.int32(4), P=np.int32(2), Q=np.int32(2),
             out=np.zeros((1, 1, 2, 2), np.float32), argmax=np.zeros((1, 1, 2, 2), np.uint8),
             store_argmax=np.int32(1), n=np.int64(4))
    a.update(over)
    return tuple(a.values())


def _kernel(expr="roi_pooling_forward<float, float, unsigned char>"):
    return loader.get_module("roi_pooling.cu", Kind.EMULATED).get(expr)


def test_valid_launch_runs():
    args = _pool_args()
    args[0][...] = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    _kernel()((1,), (32,), args)
    np.testing.assert_array_equal(args[11], [[[[5, 5], [5, 5]]]])
    # bin-relative: (h - hstart) * (wend - wstart) + (w - wstart) = 1 * 2 + 1
    np.testing.assert_array_equal(args[12], [[[[3, 3], [3, 3]]]])


@pytest.mark.parametrize("bad,match", [
    (dict(C=1), r"argument 6 \(int C\) must be a NumPy scalar"),
    (dict(n=4), r"argument 14 \(long long n\) must be a NumPy scalar"),
    (dict(C=np.int64(1)), r"int C\) must have dtype int32, got int64"),
    (dict(n=np.int32(4)), r"long long n\) must have dtype int64"),
    (dict(data=np.zeros((1, 1, 4, 4), np.float64)), r"const float\* data\) must have dtype"),
    (dict(argmax=np.zeros((1, 1, 2, 2), np.int32)),
     r"unsigned char\* argmax\) must have dtype uint8, got int32"),
    (dict(batch=np.zeros(4, np.int32)[::2]), "C-contiguous"),
    (dict(out=[0.0] * 4), r"must be a numpy.ndarray"),
    (dict(W=np.float32(4)), r"int W\) must have dtype int32"),
])
def test_argument_checker_rejects(bad, match):
    with pytest.raises(loader.KernelArgumentError, match=match):
        _kernel()((1,), (32,), _pool_args(**bad))


def test_argument_checker_counts_and_scalars_of_double():
    with pytest.raises(loader.KernelArgumentError, match="14 arguments for 15"):
        _kernel()((1,), (32,), _pool_args()[:-1])
    k = _kernel("roi_pooling_backward<float, float, float, unsigned char>")
    sig = k.signature
    assert [p.name for p in sig.params][-2:] == ["scale", "n"]
    args = [np.zeros(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.int32),
            np.ones(1, np.int32), np.zeros(1, np.int32), np.ones(1, np.int32),
            np.full(1, 255, np.uint8), np.int32(1), np.int32(1), np.int32(1), np.int32(1),
            np.int32(1), np.zeros(1, np.float32), 1.0, np.int64(1)]
    with pytest.raises(loader.KernelArgumentError, match=r"double scale\) must be a NumPy"):
        k((1,), (32,), tuple(args))
    args[13] = np.float64(1.0)
    k((1,), (32,), tuple(args))


def _launch_for(module_file="roi_pooling.cu"):
    return Launch(loader.get_module(module_file, Kind.EMULATED), np, np.float32)


def test_launch_binds_arguments_by_name():
    """Launch.forward orders keyword arguments by the parsed signature, converts read-only
    arrays and Python numbers, fills n; the written arrays reach the kernel as they are."""
    kw = dict(zip(["data", "batch", "hstart", "hend", "wstart", "wend", "C", "H", "W", "P",
                   "Q", "out", "argmax", "store_argmax", "n"], _pool_args()))
    kw["data"] = np.arange(16, dtype=np.float64).reshape(1, 1, 4, 4)   # converted (const T*)
    kw.update(C=1, H=4, W=4, P=2, Q=2)                                  # Python ints
    del kw["n"]                                                         # the launch's n
    L = _launch_for()
    tables = {k: kw.pop(k) for k in ("batch", "hstart", "hend", "wstart", "wend")}
    tables["unused_table"] = np.zeros(3)                 # tables the kernel lacks are skipped
    L.forward("roi_pooling_forward", 4, tables, **dict(reversed(list(kw.items()))))
    np.testing.assert_array_equal(kw["out"], [[[[5, 5], [5, 5]]]])
    np.testing.assert_array_equal(kw["argmax"], [[[[3, 3], [3, 3]]]])
    # the template parameter I is deduced from the argmax array's dtype
    assert L.launches == [("roi_pooling_forward<float, float, unsigned char>", 4)]
    kw["argmax"] = np.zeros((1, 1, 2, 2), np.uint16)
    L.forward("roi_pooling_forward", 4, tables, **kw)
    np.testing.assert_array_equal(kw["argmax"], [[[[3, 3], [3, 3]]]])
    assert L.launches[-1] == ("roi_pooling_forward<float, float, unsigned short>", 4)


@pytest.mark.parametrize("change,err,match", [
    (dict(extra=np.int32(1)), loader.KernelArgumentError,
     r"roi_pooling_forward<float, float, unsigned char>: no parameter\(s\) extra; "
     r"parameters: const float\* data"),
    (dict(argmax=None), loader.KernelArgumentError,
     r"roi_pooling_forward: missing argument\(s\) for argmax \(the template parameter I"),
    (dict(argmax=[0, 0, 0, 0]), loader.KernelArgumentError,
     r"cannot deduce the template parameter I from argmax"),
    (dict(C=2 ** 31), OverflowError, r"2147483648 does not fit the kernel parameter int C"),
    (dict(C=1.5), TypeError, r"int C: 1.5 is not an integer"),
    (dict(out=np.zeros((1, 1, 2, 2), np.float64)), loader.KernelArgumentError,
     r"float\* out\) must have dtype float32"),            # written arrays: never converted
])
def test_launch_binding_rejects(change, err, match):
    kw = dict(zip(["data", "batch", "hstart", "hend", "wstart", "wend", "C", "H", "W", "P",
                   "Q", "out", "argmax", "store_argmax"], _pool_args()))
    kw.update(change)
    kw = {k: v for k, v in kw.items() if v is not None}
    with pytest.raises(err, match=match):
        _launch_for().forward("roi_pooling_forward", 4, **kw)


def test_host_library_cached(tmp_path, monkeypatch):
    """The host build is cached by source hash under $MX_ROI_CACHE."""
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "_MODULES", {})
    mod = loader.get_module("psroi_pooling.cu", Kind.EMULATED)
    libs = [f for f in os.listdir(tmp_path) if f.endswith(".so")]
    assert len(libs) == 1 and libs[0].startswith("psroi_pooling-")
    code, index = loader.host_source("psroi_pooling.cu", Kind.EMULATED)
    assert len(index) == len(S.name_expressions("psroi_pooling.cu"))
    assert 'extern "C" void mx_roi_launch_0' in code
    assert mod.get("psroi_pooling_forward<__half, float>").signature.params[0].ctype == "__half"


def test_get_module_takes_one_kind(tmp_path, monkeypatch):
    """get_module(filename, kind): one ndio.Kind (or its name) per build, memoised per
    kind; the host libraries keep their file names (``<stem>-native-<key>.so`` and
    ``<stem>-<key>.so``); booleans (the former ``emulated``/``native`` flags) and
    NUMPY are refused, naming the parameter."""
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "_MODULES", {})
    emu = loader.get_module("roi_pooling.cu", Kind.EMULATED)
    assert emu.kind is Kind.EMULATED and loader.get_module("roi_pooling.cu", "emulated-cuda") is emu
    assert set(loader._MODULES) == {("roi_pooling.cu", Kind.EMULATED, -1)}
    emu_name = os.path.basename(loader.host_library_path("roi_pooling.cu", Kind.EMULATED)[0])
    nat_name = os.path.basename(loader.host_library_path("roi_pooling.cu", Kind.NATIVE)[0])
    assert emu_name.startswith("roi_pooling-") and not emu_name.startswith("roi_pooling-native-")
    assert nat_name.startswith("roi_pooling-native-") and emu_name[12:] != nat_name[19:]
    assert os.listdir(tmp_path) == [emu_name]
    for bad in (True, False, None, 1):
        with pytest.raises(TypeError, match=rf"kind: expected an mx_roi.ndio.Kind .*got {bad!r}"):
            loader.get_module("roi_pooling.cu", bad)
    with pytest.raises(ValueError, match="kind: Kind.NUMPY has no compiled kernels"):
        loader.get_module("roi_pooling.cu", Kind.NUMPY)
    with pytest.raises(ValueError, match="kind: expected an mx_roi.ndio.Kind .*'gpu'"):
        loader.get_module("roi_pooling.cu", "gpu")
    with pytest.raises(ValueError, match="kind: expected a host build .*Kind.CUDA"):
        loader.host_library_path("roi_pooling.cu", Kind.CUDA)
    assert set(loader._MODULES) == {("roi_pooling.cu", Kind.EMULATED, -1)}


def test_selftest_subprocess():
    """``python -m mx_roi.selftest`` passes here: numpy, native, emulated-cuda, the NVRTC
    compile and the native ops (extension library) are usable on a CPU machine, the GPU
    row is reported (PASS or SKIP), exit code 0."""
    import subprocess
    import sys
    env = dict(os.environ)
    env.pop("MX_ROI_BACKEND", None)
    res = subprocess.run([sys.executable, "-m", "mx_roi.selftest", "--quick"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines()
            if line.split() and line.split()[0] in
            ("numpy", "native", "emulated-cuda", "nvrtc-compile", "cuda", "native-ops")}
    assert rows["numpy"] == rows["native"] == rows["emulated-cuda"] == rows["nvrtc-compile"] \
        == rows["native-ops"] == "PASS", res.stdout
    assert rows["cuda"] in ("PASS", "SKIP"), res.stdout
    assert "OK: every usable backend passed" in res.stdout


def test_concurrent_launches_from_threads():
    """MXNet runs custom ops from several worker threads; ctypes releases the GIL, so the
    emulated launches really overlap (the shim's block/thread indices are thread-local)."""
    import threading
    k = _kernel("roi_pooling_forward<float, float, unsigned short>")  # 60x60-cell bins
    R = 300
    rng = np.random.default_rng(0)
    data = rng.standard_normal((1, 1, 64, 64)).astype(np.float32)

    def launch():
        args = _pool_args(data=data, batch=np.zeros(R, np.int32),
                          hstart=np.zeros((R, 2), np.int32), hend=np.full((R, 2), 60, np.int32),
                          wstart=np.zeros((R, 2), np.int32), wend=np.full((R, 2), 60, np.int32),
                          out=np.zeros((R, 1, 2, 2), np.float32),
                          argmax=np.zeros((R, 1, 2, 2), np.uint16), n=np.int64(R * 4),
                          H=np.int32(64), W=np.int32(64))
        k((8,), (64,), args)
        return args[11], args[12]

    ref_out, ref_arg = launch()
    assert (ref_out == data[0, 0, :60, :60].max()).all()
    results = []
    threads = [threading.Thread(target=lambda: results.append(launch())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    for out, arg in results:
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(arg, ref_arg)


# ---------------------------------------------------- the GPU branch with a fake CuPy
class _CpuCapsule:
    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


def _fake_cupy():
    """A stand-in ``cupy`` on NumPy: arrays are NumPy arrays, its toolchain checks it gets
    exactly the code/options/name expressions of :func:`mx_roi.cuda.source.module_source`
    and launches the host-compiled kernels, ``from_dlpack`` reads the DLPack capsule."""
    import contextlib
    import types

    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.ndarray = np.ndarray
    fake.log = []
    fake.views = []

    def from_dlpack(obj):
        import ctypes
        assert obj.__dlpack_device__()[0] == 2, "the backend must announce a CUDA device"
        ro = np.from_dlpack(_CpuCapsule(obj.__dlpack__()))  # NumPy < 2.1: read-only
        buf = (ctypes.c_char * ro.nbytes).from_address(ro.__array_interface__["data"][0])
        view = np.frombuffer(buf, dtype=ro.dtype).reshape(ro.shape)  # writable alias
        fake.views.append(ro)  # keeps the NDArray's memory alive
        return view

    class Toolchain:
        """Stands in for loader.CupyToolchain: "compiles" by checking it gets exactly the
        code/options/name expressions of the GPU build and binding the host-compiled
        kernels; no binary (like CUPY_CACHE_IN_MEMORY), so nothing is cached on disk."""
        ndarray, version = np.ndarray, "fake"

        def arch(self, device_id):
            return "80"

        def nvrtc_version(self):
            return "11.8"

        def compile(self, code, options, exprs, arch, device_id, scratch):
            filename = next(f for f in S.sources() if S.read_source(f) == code)
            assert (code, tuple(exprs)) == S.module_source(filename)[:2]
            assert tuple(options) == loader.cupy_options(filename) and arch == "80"
            host = loader.get_module(filename, Kind.EMULATED)
            fake.log.append(("compile", filename))
            return HostModule(host), None, {e: f"_mangled_{e}" for e in exprs}

    class HostModule:
        def __init__(self, host):
            self.host = host

        def get_function(self, mangled):
            expr = mangled[len("_mangled_"):]
            kernel = self.host.get(expr)

            def launch(grid, block, args):
                fake.log.append(("launch", expr))
                kernel._launch(grid, block, args)
            return launch

    class _Stream:
        def synchronize(self):
            fake.log.append(("sync",))

    class _Pool:  # CuPy's MemoryPool accounting, set by the tests
        cached = 0

        def total_bytes(self):
            return self.cached

        def used_bytes(self):
            return 0

        def free_all_blocks(self):
            fake.log.append(("free_all_blocks",))
            self.cached = 0

    cuda = types.SimpleNamespace(
        Device=lambda i: contextlib.nullcontext(),
        get_current_stream=lambda: _Stream(), get_device_id=lambda: 0)
    def asnumpy(a, stream=None):  # a host copy, as CuPy's (on ``stream``), then a wait
        fake.log.append(("asnumpy",))
        fake.log.append(("sync",))
        return np.array(a)

    fake.asnumpy = asnumpy
    fake.from_dlpack, fake.cuda, fake.toolchain = from_dlpack, cuda, Toolchain()
    fake.pool = _Pool()
    fake.get_default_memory_pool = lambda: fake.pool
    return fake


@pytest.mark.parametrize("name,params", CASES[:10:2], ids=_ids(CASES[:10:2]))
def test_gpu_branch_with_fake_cupy(name, params, monkeypatch):
    """The non-emulated CudaBackend path (DLPack views, the GPU module seam, req handling, stream
    sync) driven with NumPy standing in for CuPy: same results as the emulation."""
    import sys
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(loader, "_MODULES", dict(loader._MODULES))
    monkeypatch.setattr(loader, "_cupy_toolchain", lambda: fake.toolchain)
    gpu = CudaBackend(Kind.CUDA)
    op = make_op(name, params)
    for dtype in (np.float16, np.float64):
        data, rois, grad = problem(op, dtype, seed=5)
        base_out = np.full(op.out_shape(data.shape, rois.shape), 0.5, dtype)
        base_grad = np.full(data.shape, -0.25, dtype)
        for req in ("write", "add"):
            got = run(gpu, op, data, rois, grad, req, req, base_out, base_grad)
            want = run(EMU, op, data, rois, grad, req, req, base_out, base_grad)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    assert ("compile", op.cuda_source) in fake.log
    assert any(e[0] == "launch" for e in fake.log) and ("sync",) in fake.log


@pytest.mark.parametrize("name,params", CASES[1:10:4], ids=_ids(CASES[1:10:4]))
def test_cupy_array_standins_with_fake_cupy(name, params, monkeypatch):
    """CuPy arrays standing in for GPU NDArrays (mx_roi.cuda.cupy_arrays, what the GPU
    checks use where MXNet is a CPU build) carry the NDArray surface the backend reads:
    driven with NumPy standing in for CuPy, forward and backward give the emulation's
    bits, and the arrays read back unchanged."""
    import sys
    from mx_roi.cuda.cupy_arrays import CupyNDArray, Device
    from mx_roi.selftest import _run
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(loader, "_MODULES", dict(loader._MODULES))
    monkeypatch.setattr(loader, "_cupy_toolchain", lambda: fake.toolchain)
    gpu, op = Device(0), make_op(name, params)
    data, rois, grad = problem(op, np.float32, seed=6)
    x = gpu.array(data)
    assert isinstance(x, CupyNDArray) and x.context is gpu and x.context.device_id == 0
    assert (x.shape, x.size, x.dtype) == (data.shape, data.size, np.dtype(np.float32))
    np.testing.assert_array_equal(x.asnumpy(), data)
    assert gpu.zeros((2, 3), np.float16).asnumpy().dtype == np.float16
    got = _run(CudaBackend(Kind.CUDA), op, data, rois, grad, gpu)
    want = _run(EMU, op, data, rois, grad, mx.cpu())
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert ("compile", op.cuda_source) in fake.log


def test_soft_half_build_matches(tmp_path, monkeypatch):
    """Without _Float16 (older compilers; forced by -DMX_ROI_SOFT_HALF) the shim's __half is
    a 16-bit struct with bit-exact conversions: the float16 kernels give the same bits."""
    import ctypes
    import subprocess
    harness = tmp_path / "half.cpp"
    harness.write_text(
        'extern "C" void h2f(const unsigned short* h, float* f, long n) {\n'
        '  for (long i = 0; i < n; ++i) { __half x; __builtin_memcpy(&x, h + i, 2);'
        ' f[i] = __half2float(x); } }\n'
        'extern "C" void f2h(const float* f, unsigned short* h, long n) {\n'
        '  for (long i = 0; i < n; ++i) { __half x = __float2half(f[i]);'
        ' __builtin_memcpy(h + i, &x, 2); } }\n')
    lib_path = tmp_path / "half.so"
    subprocess.run([loader.host_compiler(), "-O2", "-shared", "-fPIC", "-DMX_ROI_SOFT_HALF",
                    "-include", loader.SHIM, str(harness), "-o", str(lib_path)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.h2f.argtypes = lib.f2h.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    h = np.arange(2 ** 16, dtype=np.uint16)
    f = np.zeros(h.size, np.float32)
    lib.h2f(h.ctypes.data, f.ctypes.data, h.size)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(f.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.isnan(f[nan]).all()
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x33000000, 0x38900000, 97, dtype=np.uint32),  # subnormals
                           np.arange(0x477fe000, 0x47800100, dtype=np.uint32)])      # overflow
    x = np.concatenate([bits, bits | 0x80000000]).view(np.float32)
    out = np.zeros(x.size, np.uint16)
    lib.f2h(x.ctypes.data, out.ctypes.data, x.size)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(out.view(np.float16)[nan]).all()
    # the whole kernel library built that way agrees bit for bit with the _Float16 build
    op = make_op("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, pool_mode="max"))
    data, rois, grad = problem(op, np.float16)
    native = run(EMU, op, data, rois, grad)
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path))
    monkeypatch.setenv("MX_ROI_HOST_CXXFLAGS", "-DMX_ROI_SOFT_HALF")
    monkeypatch.setattr(loader, "_MODULES", {})
    soft = run(CudaBackend(Kind.EMULATED), op, data, rois, grad)
    assert native[0].tobytes() == soft[0].tobytes() and native[1].tobytes() == soft[1].tobytes()


def test_index_paths_agree(tmp_path, monkeypatch):
    """Launches of at most 2^31 - 1 items unravel their index in 32 bits, larger ones in
    64 bits; a build with the switch lowered to 5 items (-DMX_ROI_INDEX32_LIMIT=5) runs
    every case on the 64-bit path and must give the same bits."""
    cases = [make_op(name, params) for name, params in CASES]
    want = [run(EMU, op, *problem(op, np.float32)) for op in cases]
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path))
    monkeypatch.setenv("MX_ROI_HOST_CXXFLAGS", "-DMX_ROI_INDEX32_LIMIT=5")
    monkeypatch.setattr(loader, "_MODULES", {})
    wide = CudaBackend(Kind.EMULATED)
    for op, (out, grad) in zip(cases, want):
        got_out, got_grad = run(wide, op, *problem(op, np.float32))
        assert got_out.tobytes() == out.tobytes() and got_grad.tobytes() == grad.tobytes()


@pytest.mark.parametrize("grid,block", [(1, 1), (1, 7), (3, 5), (2, 256), (64, 32)])
def test_grid_stride_covers_every_item(grid, block):
    """Any launch shape gives the same result: the grid-stride loops cover each of the n
    items exactly once (with more threads than items, the extra ones do nothing)."""
    data = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    args = _pool_args(data=data, hstart=np.array([[0, 1]], np.int32),
                      hend=np.array([[1, 4]], np.int32), wstart=np.array([[0, 2]], np.int32),
                      wend=np.array([[2, 4]], np.int32))
    _kernel()((grid,), (block,), args)
    np.testing.assert_array_equal(args[11], [[[[1, 3], [13, 15]]]])
    np.testing.assert_array_equal(args[12], [[[[1, 1], [5, 5]]]])  # bin-relative


def _inside_map(op, data, rois):
    """``rois`` with their boxes clipped to the map of ``data`` (batch index kept)."""
    scale = float(op.param.spatial_scale)
    rois = rois.copy()
    rois[:, 1::2] = np.clip(rois[:, 1::2], 0, (data.shape[3] - 1) / scale)
    rois[:, 2::2] = np.clip(rois[:, 2::2], 0, (data.shape[2] - 1) / scale)
    return rois


# ------------------------------------ GPU backward memory: direct write, pool policy
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_backward_writes_into_mxnet_gradient(deterministic, monkeypatch):
    """On the GPU path the backward adds straight into MXNet's gradient (zeroed for
    write, kept for add) when its dtype is the compute dtype: no gradient-size
    temporary; float16 and fixed point use one (and only one) bounded buffer."""
    import sys
    from mx_roi.cuda import backend as B
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(loader, "_MODULES", dict(loader._MODULES))
    monkeypatch.setattr(loader, "_cupy_toolchain", lambda: fake.toolchain)
    made = []
    real_zeroed = B._zeroed
    monkeypatch.setattr(B, "_zeroed", lambda xp, shape, dtype: (
        made.append(np.dtype(dtype)), real_zeroed(xp, shape, dtype))[1])
    gpu = CudaBackend(Kind.CUDA)
    for name, params in (CASES[0], CASES[2], CASES[4]):
        op = make_op(name, dict(params, deterministic=deterministic))
        for dtype in DTYPES:
            data, rois, grad = problem(op, dtype, seed=7)
            rois = _inside_map(op, data, rois)  # (no rerun on host tables: one buffer)
            base_out = np.full(op.out_shape(data.shape, rois.shape), 9.0, dtype)
            garbage = np.full(data.shape, 1e3, dtype)                # must be overwritten
            for req in ("write", "add"):
                made.clear()
                got = run(gpu, op, data, rois, grad, req, req, base_out, garbage)
                grad_temps = [d for d in made if d != np.dtype(np.int32)]
                want = run(EMU, op, data, rois, grad, req, req, base_out, garbage)
                np.testing.assert_array_equal(got[1], want[1], err_msg=f"{name} {req}")
                _, ref = run(REF, op, data, rois, grad, "write", "write")
                expect = ref + garbage if req == "add" else ref
                close(got[1], expect.astype(dtype), dtype, what=f"{name} {dtype} {req}")
                if deterministic and np.abs(grad).sum() > 0:
                    assert grad_temps == [np.dtype(np.uint64)], (name, dtype, req)
                elif np.dtype(dtype) == np.float16:
                    assert grad_temps == [np.dtype(np.float32)], (name, req)
                else:
                    assert grad_temps == [], (name, dtype, req, grad_temps)


def test_gpu_pool_trimmed_after_a_call(monkeypatch):
    """After a GPU call CuPy's pool gives its unused blocks back once they exceed
    POOL_KEEP_BYTES, and keeps a small cache; one stream sync per forward/backward."""
    import sys
    from mx_roi.cuda import backend as B
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(loader, "_MODULES", dict(loader._MODULES))
    monkeypatch.setattr(loader, "_cupy_toolchain", lambda: fake.toolchain)
    gpu = CudaBackend(Kind.CUDA)
    op = make_op(*CASES[2])
    data, rois, grad = problem(op, np.float32)
    rois = _inside_map(op, data, rois)  # (a box far off the map reruns a call: more waits)
    for cached, freed in ((B.POOL_KEEP_BYTES, False), (B.POOL_KEEP_BYTES + 1, True)):
        fake.log.clear()
        fake.pool.cached = cached
        run(gpu, op, data, rois, grad)
        assert (("free_all_blocks",) in fake.log) == freed
        # forward + backward (device geometry: the read of the status is the wait)
        assert fake.log.count(("sync",)) == 2, fake.log
        # the pool is trimmed only after the stream is synchronised
        if freed:
            assert fake.log.index(("sync",)) < fake.log.index(("free_all_blocks",))


# ------------------------------------------------------ deterministic bound at the edge
def test_deterministic_bound_caffe_grid_at_the_edge(monkeypatch):
    """The Caffe legacy grid gives a point on integer coordinates four taps of weight 1
    on one cell (weight sum 4): the fixed-point scale must account for it.  Out-grads
    summing to just below a power of two, all routed to one cell with weight 4, must
    stay within the 2^61 headroom (before the fix: ~2^63, the whole margin) and decode
    to exactly the float result."""
    seen = []
    real = Launch.grad_value

    def spy(self, buf):
        if self.fixed:
            seen.append((int(np.abs(buf.view(np.int64)).max()), self._spread()))
            out = real(self, buf)
            assert np.shares_memory(out, buf)     # decoded in place: no temporaries
            return out
        return real(self, buf)

    monkeypatch.setattr(Launch, "grad_value", spy)
    params = dict(pooled_size=(1, 1), spatial_scale=1.0, legacy="caffe")
    op = make_op("ROIAlign", params)
    det = make_op("ROIAlign", dict(params, deterministic=True))
    data = np.zeros((1, 1, 4, 4), np.float32)
    data[0, 0, 2, 1] = 5.0                                      # the single winner
    rois = np.array([[0, 0, 0, 3, 3]] * 3, np.float32)           # points at 0, 1, 2, 3
    grad = np.array([0.5, 0.25, np.nextafter(np.float32(0.25), np.float32(0))],
                    np.float32).reshape(3, 1, 1, 1)              # sum just below 1
    _, g_float = run(EMU, op, data, rois, grad)
    _, g_fixed = run(EMU, det, data, rois, grad)
    assert g_float[0, 0, 2, 1] == np.float32(4 * grad.astype(np.float64).sum())
    np.testing.assert_array_equal(g_fixed, g_float)
    (peak, spread), = seen
    assert spread == 4.0
    assert 2 ** 60 < peak <= 2 ** 61, peak                        # at the edge, within it


def test_spread_of_standard_grids_is_one():
    """The standard ROIAlign grid: weights of a sample sum to 1, average over count."""
    op = make_op("ROIAlign", dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=-1))
    rois = np.array([[0, 0, 0, 7, 5], [0, -9, -9, 30, 30]], np.float32)
    launch = Launch(None, np, np.float32)
    launch.geo = op.geometry(rois, 6, 7, np)
    assert launch._spread() == pytest.approx(1.0, abs=1e-6)
