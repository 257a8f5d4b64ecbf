"""The ``native`` CPU backend: the CUDA kernels compiled for the host with ``-O3``,
multi-threaded over output channels.

* every thread owns whole output channels (hence whole input-gradient planes), so the
  forward and the backward must be bit-identical for any ``MX_ROI_NUM_THREADS``, and
  agree with the NumPy backend (bit-exact for the max modes);
* outputs and input gradients are written straight into MXNet's memory for req
  write/inplace: stale values there must be overwritten, req add must add;
* selection (``MX_ROI_BACKEND``, each op's ``cpu_backend``) and the fallback to NumPy
  when no compiler is available;
* degenerate roi sets: none at all, and only padding rois.

The backends are driven directly (``backend.forward/backward`` on NDArrays) and through
the public MXNet path (``mx_roi.nd.<Op>`` / ``mx.nd.Custom`` with autograd).
"""
import os
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

import mx_roi
from mx_roi import backends, parallel
from mx_roi.backends import NumpyBackend
from mx_roi.cuda import loader
from mx_roi.cuda.backend import CudaBackend, Launch
from mx_roi.ndio import Kind
from mx_roi.registry import get_op
from tests.conftest import op_kernels
from tests.ops.base import adversarial_rois, make_data, random_rois

@pytest.fixture(autouse=True)
def _threads_even_for_small_launches(monkeypatch):
    """The test problems are small; without this every launch would run on one thread
    (loader.min_items_per_thread, which the extension library's launcher reads too) and
    the thread-count tests would test nothing."""
    monkeypatch.setenv("MX_ROI_MIN_ITEMS_PER_THREAD", "1")


NATIVE = CudaBackend(Kind.NATIVE)
EMU = CudaBackend(Kind.EMULATED)
REF = NumpyBackend()


def use_variant_build(monkeypatch, cache, flags):
    """Run the native backend's kernels as built with the extra compiler ``flags`` (a
    lowered threshold, another vector width; built into ``cache``): on its checked path,
    whose launches use the host build of each op's kernels.  Its default path calls the
    extension library (mx_roi.cuda.library_calls), loaded once per process with the
    default flags: a variant flag would change nothing that the test runs."""
    monkeypatch.setenv("MX_ROI_CACHE", str(cache))
    monkeypatch.setenv("MX_ROI_HOST_CXXFLAGS", flags)
    monkeypatch.setattr(loader, "_MODULES", {})
    monkeypatch.setattr(NATIVE, "library_calls", False)

#: (rtol, atol) per dtype for native vs NumPy where the summation order differs;
#: atol is scaled by max(1, max |expected|)
TOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}

CASES = [
    ("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=0.5)),
    ("ROIPooling", dict(pooled_size=(3, 3), spatial_scale=1.0)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1)),
    ("ROIAlign", dict(pooled_size=(3, 2), spatial_scale=1.0, sample_ratio=2, aligned=True)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1, aligned=True,
                      pool_mode="max")),
    ("ROIAlign", dict(pooled_size=(3, 2), spatial_scale=0.25, sample_ratio=2,
                      pool_mode="max")),
    ("PSROIPooling", dict(pooled_size=4, output_dim=3, spatial_scale=0.5, group_size=2)),
    ("PSROIPooling", dict(pooled_size=3, output_dim=2, spatial_scale=1.0)),
    ("PSROIPooling", dict(pooled_size=2, output_dim=2, spatial_scale=1.0, group_size=3)),
    ("PSROIAlign", dict(pooled_size=4, output_dim=3, spatial_scale=0.5, sample_ratio=2,
                        group_size=2)),
    ("PSROIAlign", dict(pooled_size=3, output_dim=2, spatial_scale=1.0, sample_ratio=-1,
                        aligned=True)),
]

#: one case per op kind for the slower MXNet-path tests
MX_CASES = [CASES[0], CASES[2], CASES[4], CASES[6], CASES[9]]

C_BASE = 5  # channels of the non position-sensitive problems


def _ids(cases):
    return [f"{name}-{i}" for i, (name, _) in enumerate(cases)]


def make_op(name, params):
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**params))


def is_max(name, params):
    return name == "ROIPooling" or params.get("pool_mode") == "max"


def in_channels(op):
    p = op.param
    return p.in_channels if hasattr(p, "output_dim") else C_BASE


def problem(op, dtype, kind="randn", seed=0, N=2, H=9, W=10):
    """Data of ``kind``, adversarial + random rois (every 5th a padding roi) and an
    out-grad."""
    rng = np.random.default_rng(seed)
    s = op.param.spatial_scale
    data = make_data(rng, (N, in_channels(op), H, W), dtype, kind)
    rois = np.concatenate([adversarial_rois(rng, N, H, W, s, dtype=np.float64),
                           random_rois(rng, 6, N, H, W, s, np.float64)])
    rois[::5, 0] = -1  # padding rois
    rois = rois.astype(dtype)
    grad = make_data(rng, op.out_shape(data.shape, rois.shape), dtype)
    return data, rois, grad


def nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def run(backend, op, data, rois, grad, req_f="write", req_b="write", init_out=None,
        init_grad=None):
    """Forward (keeping what the backward needs) + backward through ``backend``;
    returns (out, data grad) as NumPy arrays."""
    out_shape = op.out_shape(data.shape, rois.shape)
    out = nd(init_out if init_out is not None else np.zeros(out_shape, data.dtype))
    dgrad = nd(init_grad if init_grad is not None else np.zeros(data.shape, data.dtype))
    x, r = nd(data), nd(rois)
    saved = backend.forward(op, req_f, x, r, out, keep=True)
    backend.backward(op, req_b, nd(grad), x, r, dgrad, saved)
    return out.asnumpy(), dgrad.asnumpy()


def run_inference(backend, op, data, rois, init_out=None):
    """Forward only, keeping nothing for a backward (an inference call: the max ops
    store no argmax); returns the output as a NumPy array."""
    out_shape = op.out_shape(data.shape, rois.shape)
    out = nd(init_out if init_out is not None else np.zeros(out_shape, data.dtype))
    backend.forward(op, "write", nd(data), nd(rois), out, keep=False)
    return out.asnumpy()


def close(actual, expected, dtype, what="", tol=None):
    assert actual.shape == expected.shape, what
    assert actual.dtype == np.dtype(dtype), what
    t = tol if tol is not None else TOL[np.dtype(dtype)]
    e = expected.astype(np.float64)
    atol = t * max(1.0, float(np.abs(e).max()) if e.size else 1.0)
    np.testing.assert_allclose(actual.astype(np.float64), e, rtol=t, atol=atol, err_msg=what)


def identical(actual, expected, what="", bits=True):
    """Bit-identical (``bits``), or equal values (+0.0 == -0.0: the backends may pick
    either zero of a max over ties of +0 and -0)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    differ = actual.tobytes() != expected.tobytes() if bits else \
        not np.array_equal(actual, expected)
    if differ:
        bad = np.argwhere(actual != expected)
        first = tuple(bad[0]) if bad.size else "(bit pattern only)"
        detail = f"; first at {first}: {actual[first]!r} vs {expected[first]!r}" \
            if bad.size else ""
        raise AssertionError(f"{what}: {len(bad)} of {actual.size} elements differ{detail}")


# ------------------------------------------------------------ 1. threads and NumPy
@pytest.mark.parametrize("channels", (40, 70))
@pytest.mark.parametrize("name,params", [CASES[0], CASES[3], CASES[5], CASES[6]],
                         ids=_ids([CASES[0], CASES[3], CASES[5], CASES[6]]))
def test_sixteen_channel_blocks_any_thread_count(name, params, channels, monkeypatch):
    """With at least 16 channels per thread a launch splits the channels into whole
    16-channel units (the lanes kernels' width; the last unit partial): forward and
    gradient bit-identical for every thread count, and to the serial emulation where
    the native kernel keeps its summation order (not the position-sensitive backward:
    there, close to it)."""
    op = make_op(name, params)
    rng = np.random.RandomState(channels)
    if hasattr(op.param, "output_dim"):  # position-sensitive: output_dim * G * G inputs
        op = make_op(name, dict(params, output_dim=channels))
        c_in = op.param.in_channels
    else:
        c_in = channels
    data = rng.standard_normal((2, c_in, 9, 10)).astype(np.float32)
    rois = np.array([[0, 1, 2, 15, 14], [1, 0, 0, 19, 17], [0, 6, 3, 9, 12],
                     [1, 3.5, 2.2, 11.7, 16.1], [-1, 0, 0, 5, 5]], np.float32)
    grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(np.float32)
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "1")
    out_e, g_e = run(EMU, op, data, rois, grad)
    out_1, g_1 = run(NATIVE, op, data, rois, grad)
    identical(out_1, out_e, f"{name} C={channels}: forward, native vs emulated")
    if hasattr(op.param, "output_dim"):
        close(g_1, g_e, np.float32, f"{name} C={channels}: data grad, native vs emulated")
    else:
        identical(g_1, g_e, f"{name} C={channels}: data grad, native vs emulated")
    for t in (2, 3, 5):
        monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
        out, g = run(NATIVE, op, data, rois, grad)
        identical(out, out_1, f"{name} C={channels}: forward, {t} threads vs 1")
        identical(g, g_1, f"{name} C={channels}: data grad, {t} threads vs 1")


@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("name,params", CASES, ids=_ids(CASES))
def test_thread_counts_bit_identical_and_match_numpy(name, params, dtype, monkeypatch):
    op = make_op(name, params)
    c_out = op.out_channels(in_channels(op))
    thread_counts = (1, 2, 3, c_out + 3)  # the last: more threads than channels
    kinds = ("randn", "relu", "int")
    for kind in kinds:
        data, rois, grad = problem(op, dtype, kind)
        what = f"{name} {params} {np.dtype(dtype).name} [{kind}]"
        results = {}
        for t in thread_counts:
            monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
            results[t] = run(NATIVE, op, data, rois, grad)
        out1, g1 = results[1]
        for t in thread_counts[1:]:
            identical(results[t][0], out1, f"{what}: forward, {t} threads vs 1")
            identical(results[t][1], g1, f"{what}: data grad, {t} threads vs 1")

        monkeypatch.setenv("MX_ROI_NUM_THREADS", "1")
        out_n, g_n = run(REF, op, data, rois, grad)
        # max modes evaluate every candidate with the same operations (and the same
        # first-maximum tie rule: the relu/int maps are full of ties); an integer-bin
        # average of small integers is exact whatever the summation order
        if is_max(name, params) or (name == "PSROIPooling" and kind == "int"):
            identical(out1, out_n, f"{what}: forward native vs numpy", bits=False)
        else:
            close(out1, out_n, dtype, f"{what}: forward native vs numpy")
        close(g1, g_n, dtype, f"{what}: data grad native vs numpy")
        assert not out1[rois[:, 0] < 0].any(), f"{what}: padding rois must give 0"
        # same kernel text as the serial GPU emulation: the forward is the same
        # computation element by element (no fast-math, no contraction)
        out_e, g_e = run(EMU, op, data, rois, grad)
        identical(out1, out_e, f"{what}: forward native vs emulated-cuda")
        close(g1, g_e, dtype, f"{what}: data grad native vs emulated-cuda")


@pytest.mark.parametrize("name,params", CASES[::2], ids=_ids(CASES[::2]))
def test_float16_direct(name, params, monkeypatch):
    """float16 data: the kernels compute in float32; compared with the NumPy backend on
    the same float16 inputs, and over thread counts (bit-identical)."""
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float16, "randn", seed=5)
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "1")
    out1, g1 = run(NATIVE, op, data, rois, grad)
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "4")
    out4, g4 = run(NATIVE, op, data, rois, grad)
    identical(out4, out1, "float16 forward, 4 threads vs 1")
    identical(g4, g1, "float16 data grad, 4 threads vs 1")
    out_n, g_n = run(REF, op, data, rois, grad)
    close(out1, out_n, np.float16, "float16 forward native vs numpy")
    close(g1, g_n, np.float16, "float16 data grad native vs numpy")


def test_launcher_reads_thread_count_per_launch(monkeypatch):
    """The native backend's checked path asks :func:`mx_roi.parallel.num_threads` at
    every launch (the extension library's launcher reads the same variables per launch in
    C++: tests/test_library_calls.py)."""
    monkeypatch.setattr(NATIVE, "library_calls", False)
    calls = []
    real = parallel.num_threads

    def spy():
        calls.append(1)
        return 3

    monkeypatch.setattr(parallel, "num_threads", spy)
    monkeypatch.setattr(loader, "_MODULES", {})  # fresh kernels pick up the spy
    op = make_op(*CASES[0])
    data, rois, grad = problem(op, np.float32, "relu")
    out, g = run(NATIVE, op, data, rois, grad)
    assert len(calls) == 2, "one forward and one backward launch, each reading the count"
    monkeypatch.setattr(parallel, "num_threads", real)
    out_n, g_n = run(REF, op, data, rois, grad)
    identical(out, out_n, "forward", bits=False)
    close(g, g_n, np.float32, "data grad")


@pytest.mark.parametrize("name,params", CASES[::2], ids=_ids(CASES[::2]))
def test_req_write_overwrites_stale_memory_and_add_adds(name, params, monkeypatch):
    """The native backend fills MXNet's output / input-gradient memory itself for req
    write/inplace: stale contents (NaN) must not survive, padding rois included; req add
    adds to the existing values; req null leaves them."""
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    dtype = np.float32
    op = make_op(name, params)
    data, rois, grad = problem(op, dtype, "relu", seed=1)
    out_shape = op.out_shape(data.shape, rois.shape)
    out_w, g_w = run(NATIVE, op, data, rois, grad)
    for req in ("write", "inplace"):
        out_s, g_s = run(NATIVE, op, data, rois, grad, req, req,
                         np.full(out_shape, np.nan, dtype), np.full(data.shape, np.nan, dtype))
        identical(out_s, out_w, f"forward req={req} over stale memory")
        identical(g_s, g_w, f"backward req={req} over stale memory")
    base_out = np.full(out_shape, 0.5, dtype)
    base_grad = np.full(data.shape, -0.25, dtype)
    out_a, g_a = run(NATIVE, op, data, rois, grad, "add", "add", base_out, base_grad)
    identical(out_a, out_w + base_out, "forward req=add")
    identical(g_a, g_w + base_grad, "backward req=add")
    out_0, g_0 = run(NATIVE, op, data, rois, grad, "null", "null", base_out, base_grad)
    identical(out_0, base_out, "forward req=null")
    identical(g_0, base_grad, "backward req=null")


def test_write_is_zero_copy(monkeypatch):
    """req write: the forward kernel's output buffer *is* MXNet's output memory, and the
    gradient accumulator is MXNet's gradient memory (same dtype as the compute dtype)."""
    targets = []
    real_output, real_grad_buffer = Launch.output, Launch.grad_buffer

    def output(self, shape):
        buf = real_output(self, shape)
        targets.append(("out", self.out_target is not None and buf is self.out_target))
        return buf

    def grad_buffer(self, shape, grad):
        buf = real_grad_buffer(self, shape, grad)
        targets.append(("grad", self.grad_target is not None and buf is self.grad_target))
        return buf

    monkeypatch.setattr(Launch, "output", output)
    monkeypatch.setattr(Launch, "grad_buffer", grad_buffer)
    op = make_op(*CASES[6])  # PSROIPooling
    data, rois, grad = problem(op, np.float32)
    # the checked path's buffers (the extension library's launcher writes MXNet's memory
    # itself: tests/test_library_calls.py)
    monkeypatch.setattr(NATIVE, "library_calls", False)
    run(NATIVE, op, data, rois, grad)
    assert targets == [("out", True), ("grad", True)]
    targets.clear()
    run(NATIVE, op, data, rois, grad, "add", "add")
    assert targets == [("out", False), ("grad", False)]


@pytest.mark.parametrize("name,params", CASES[::3], ids=_ids(CASES[::3]))
def test_deterministic_flag_uses_float_accumulation(name, params, launches, monkeypatch):
    """deterministic=True: the native build is deterministic anyway and keeps the float
    accumulators (no fixed point), so the results equal those without the flag."""
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "2")
    op = make_op(name, params)
    det = make_op(name, dict(params, deterministic=True))
    data, rois, grad = problem(op, np.float32, "relu", seed=3)
    out, g = run(NATIVE, op, data, rois, grad)
    launches.clear()
    out_d, g_d = run(NATIVE, det, data, rois, grad)
    kernels = op_kernels(launches)
    assert len(kernels) == 2 and "unsigned long long" not in kernels[1], launches
    identical(out_d, out, "deterministic forward")
    identical(g_d, g, "deterministic data grad")


@pytest.mark.parametrize("name,params", [CASES[0], CASES[5]], ids=_ids([CASES[0], CASES[5]]))
def test_backward_without_saved_argmax(name, params):
    """A backward whose forward kept nothing (inference-mode forward) recomputes the
    argmax on native; same gradient."""
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float64, "relu", seed=4)
    out, g = run(NATIVE, op, data, rois, grad)
    x, r = nd(data), nd(rois)
    o = nd(np.zeros(out.shape, data.dtype))
    assert NATIVE.forward(op, "write", x, r, o, keep=False) is None
    dg = nd(np.full(data.shape, np.nan, data.dtype))
    NATIVE.backward(op, "write", nd(grad), x, r, dg, None)
    identical(o.asnumpy(), out, "forward keep=False")
    identical(dg.asnumpy(), g, "backward recomputing the argmax")


# ------------------------------------------------------------ 2. the real MXNet path
def mx_run(name, params, data, rois, grad, grad_req="write", init_grad=None, passes=1):
    """``mx_roi.nd.<name>`` under autograd; returns (out, data grad, rois grad)."""
    fn = getattr(mx_roi.nd, name)
    x, r = nd(data), nd(rois)
    x.attach_grad(grad_req=grad_req)
    r.attach_grad()
    if init_grad is not None:
        x.grad[:] = nd(init_grad)
    for _ in range(passes):
        with autograd.record():
            y = fn(x, r, **params)
        y.backward(nd(grad))
    return y.asnumpy(), x.grad.asnumpy(), r.grad.asnumpy()


@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("name,params", MX_CASES, ids=_ids(MX_CASES))
def test_mxnet_path_write_and_add(name, params, dtype, monkeypatch, launches):
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "3")
    op = make_op(name, params)
    data, rois, grad = problem(op, dtype, "relu", seed=2)
    monkeypatch.setenv("MX_ROI_BACKEND", "numpy")
    out_n, g_n, _ = mx_run(name, params, data, rois, grad)
    assert launches == [], "the numpy backend launches no kernels"

    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    # write, over a stale gradient
    stale = np.full(data.shape, 7.0, dtype)
    out, g, rg = mx_run(name, params, data, rois, grad, "write", init_grad=stale)
    assert launches, "MX_ROI_BACKEND=native must run the native kernels"
    assert all(e.startswith(op.cuda_source[:-3] + "_") for e in op_kernels(launches))
    if is_max(name, params):
        identical(out, out_n, "forward native vs numpy (mxnet path)", bits=False)
    else:
        close(out, out_n, dtype, "forward native vs numpy (mxnet path)")
    close(g, g_n, dtype, "data grad req=write native vs numpy (mxnet path)")
    assert not rg.any(), "rois get no gradient"
    # forward only, no autograd
    y = getattr(mx_roi.nd, name)(nd(data), nd(rois), **params).asnumpy()
    identical(y, out, "forward without autograd vs with")
    # add: accumulates into the existing gradient, twice
    base = make_data(np.random.default_rng(9), data.shape, dtype)
    _, g_add, _ = mx_run(name, params, data, rois, grad, "add", init_grad=base, passes=2)
    close(g_add, base + 2 * g_n.astype(dtype), dtype, "data grad req=add (2 passes)")


@pytest.mark.parametrize("name,params", MX_CASES, ids=_ids(MX_CASES))
def test_mxnet_path_custom_float16(name, params, monkeypatch, launches):
    """float16 through ``mx.nd.Custom`` on native, against the float32 computation of the
    same (float16-representable) inputs."""
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float16, "randn", seed=3)
    out16, g16, _ = mx_run(name, params, data, rois, grad)
    assert launches and all("__half" in e for e in launches)
    assert out16.dtype == g16.dtype == np.float16
    monkeypatch.setenv("MX_ROI_BACKEND", "numpy")
    f32 = [a.astype(np.float32) for a in (data, rois, grad)]
    out32, g32, _ = mx_run(name, params, *f32)
    close(out16, out32.astype(np.float16), np.float16, "float16 forward vs float32", 2e-2)
    close(g16, g32.astype(np.float16), np.float16, "float16 data grad vs float32", 2e-2)
    # also via mx.nd.Custom directly (the op_type spelling)
    y = mx.nd.Custom(nd(data), nd(rois), op_type=name, **params).asnumpy()
    close(y, out16, np.float16, "mx.nd.Custom vs mx_roi.nd", 1e-3)


# ------------------------------------------------------------ 3. selection
SELECT = [
    ("ROIPooling", dict(pooled_size=2, spatial_scale=1.0), "native"),
    ("ROIAlign", dict(pooled_size=2, spatial_scale=1.0), "native"),
    ("ROIAlign", dict(pooled_size=2, spatial_scale=1.0, pool_mode="max"), "native"),
    ("PSROIPooling", dict(pooled_size=2, output_dim=2, spatial_scale=1.0), "native"),
    ("PSROIAlign", dict(pooled_size=2, output_dim=2, spatial_scale=1.0), "native"),
]


@pytest.mark.parametrize("name,params,expected", SELECT,
                         ids=[f"{n}-{p.get('pool_mode', '')}" for n, p, _ in SELECT])
def test_select(name, params, expected, monkeypatch):
    op = make_op(name, params)
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    assert backends.select(mx.cpu(), op) == expected
    assert backends.select("cpu(0)", op) == expected
    for auto in ("auto", "AUTO", " auto ", ""):
        monkeypatch.setenv("MX_ROI_BACKEND", auto)
        assert backends.select(mx.cpu(), op) == expected, repr(auto)
    for choice in ("numpy", "native", "emulated-cuda"):
        monkeypatch.setenv("MX_ROI_BACKEND", choice)
        assert backends.select(mx.cpu(), op) == choice
        monkeypatch.setenv("MX_ROI_BACKEND", f" {choice.upper()} ")
        assert backends.select(mx.cpu(), op) == choice
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    assert backends.select(mx.gpu(0), op) == "cuda"
    assert backends.select("gpu(0)", op) == "cuda"
    for bad in ("cuda", "gpu", "natve", "onednn"):
        monkeypatch.setenv("MX_ROI_BACKEND", bad)
        with pytest.raises(ValueError, match="MX_ROI_BACKEND"):
            backends.select(mx.cpu(), op)


def test_backend_instances():
    assert backends.get("native").name == "native"
    assert backends.get("native") is backends.get("native")
    assert backends.get("emulated-cuda").name == "emulated-cuda"
    assert backends.get("numpy").name == "numpy"


def test_native_available_with_compiler():
    for name in ("ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign"):
        assert backends.native_available(get_op(name).cuda_source)


def test_create_operator_selects_native_under_auto(monkeypatch, launches):
    """Unset MX_ROI_BACKEND: every op runs the native kernels, ROIAlign's average for a
    training call too (forward and backward)."""
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    x = nd(np.arange(50, dtype=np.float32).reshape(1, 2, 5, 5))
    r = nd(np.array([[0, 0, 0, 3, 3]], np.float32))
    y = mx_roi.nd.ROIPooling(x, r, pooled_size=(2, 2), spatial_scale=1.0).asnumpy()
    np.testing.assert_array_equal(y[0, 0], [[6, 8], [16, 18]])
    assert op_kernels(launches) == ["roi_pooling_forward<float, float, unsigned char>"]
    launches.clear()
    mx_roi.nd.ROIAlign(x, r, pooled_size=(2, 2), spatial_scale=1.0).wait_to_read()
    assert op_kernels(launches) == ["roi_align_forward_avg<float, float>"]
    launches.clear()
    x.attach_grad()
    with autograd.record():
        y = mx_roi.nd.ROIAlign(x, r, pooled_size=(2, 2), spatial_scale=1.0)
    y.backward()
    x.grad.wait_to_read()
    assert op_kernels(launches) == ["roi_align_forward_avg<float, float>",
                        "roi_align_backward_avg<float, float, float>"]
    launches.clear()
    mx_roi.nd.ROIAlign(x, r, pooled_size=(2, 2), spatial_scale=1.0,
                       pool_mode="max").wait_to_read()
    assert op_kernels(launches) == ["roi_align_forward_max<float, float, unsigned char>"]


# ------------------------------------------------------------ 4. fallback to NumPy
@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler-c++"))
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backends, "_NATIVE_OK", {})
    monkeypatch.setattr(loader, "_MODULES", {})
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    # the Custom door: these tests are about its host build's fallback (this process has
    # the extension library loaded already, which needs no compiler to run)
    monkeypatch.setenv("MX_ROI_NATIVE_OPS", "0")
    assert loader.host_compiler() == ""
    return tmp_path


def test_fallback_without_compiler(no_compiler, launches):
    src = get_op("ROIPooling").cuda_source
    with pytest.warns(RuntimeWarning, match="using the NumPy kernels") as rec:
        assert backends.native_available(src) is False
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert src in msg and "compiler" in msg
    # remembered: no second warning, no second attempt
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.native_available(src) is False
        op = make_op("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=0.5))
        assert backends.select(mx.cpu(), op) == "numpy"
    assert backends._NATIVE_OK == {src: False}
    # nothing was built into the fresh cache
    cache = no_compiler / "cache"
    assert not cache.exists() or not list(cache.glob("*.so"))

    # the op still works (NumPy kernels) and matches an explicit numpy run
    data, rois, grad = problem(op, np.float32, "relu", seed=4)
    out, g, _ = mx_run("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=0.5),
                       data, rois, grad)
    assert launches == [], "fell back to NumPy: no kernel launches"
    out_n, g_n = run(REF, op, data, rois, grad)
    identical(out, out_n, "fallback forward")
    identical(g, g_n, "fallback data grad")


def test_fallback_warns_once_per_source_through_the_op(no_compiler, launches):
    """The first op of a kind created under auto triggers the (single) warning."""
    params = dict(pooled_size=2, output_dim=2, spatial_scale=1.0)
    op = make_op("PSROIPooling", params)
    data, rois, grad = problem(op, np.float64, "int", seed=6)
    with pytest.warns(RuntimeWarning, match="psroi_pooling.cu"):
        assert backends.select(mx.cpu(), op) == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, g, _ = mx_run("PSROIPooling", params, data, rois, grad)
    assert launches == []
    out_n, g_n = run(REF, op, data, rois, grad)
    identical(out, out_n, "fallback forward")
    identical(g, g_n, "fallback data grad")


def test_explicit_native_without_compiler_errors(no_compiler, monkeypatch):
    """MX_ROI_BACKEND=native is honoured literally: no compiler is an error naming it,
    raised at the call (not a crash, not a silent fallback)."""
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    x = nd(np.ones((1, 2, 5, 5), np.float32))
    r = nd(np.array([[0, 0, 0, 3, 3]], np.float32))
    with pytest.raises(mx.base.MXNetError, match="compiler"):
        mx_roi.nd.ROIPooling(x, r, pooled_size=(2, 2), spatial_scale=1.0).asnumpy()


# ------------------------------------------------------------ 5. degenerate roi sets
@pytest.mark.parametrize("name,params", CASES, ids=_ids(CASES))
def test_zero_rois(name, params, launches):
    op = make_op(name, params)
    data, _, _ = problem(op, np.float32)
    rois = np.zeros((0, 5), np.float32)
    with mx.util.np_shape(True):
        grad = np.zeros(op.out_shape(data.shape, rois.shape), np.float32)
        ones = np.ones(data.shape, np.float32)
        out, g = run(NATIVE, op, data, rois, grad, init_grad=ones)
        assert out.shape == op.out_shape(data.shape, rois.shape) and out.shape[0] == 0
        assert g.shape == data.shape and not g.any(), "req write: zero gradient"
        _, g_add = run(NATIVE, op, data, rois, grad, "add", "add", init_grad=ones)
        identical(g_add, ones, "req add with no rois leaves the gradient")
    assert launches == []


@pytest.mark.parametrize("dtype", (np.float16, np.float32, np.float64),
                         ids=("float16", "float32", "float64"))
@pytest.mark.parametrize("name,params", CASES, ids=_ids(CASES))
def test_all_padding_rois(name, params, dtype, monkeypatch):
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "3")
    op = make_op(name, params)
    data, rois, grad = problem(op, dtype, "relu", seed=7)
    rois[:, 0] = -1
    out_shape = op.out_shape(data.shape, rois.shape)
    out, g = run(NATIVE, op, data, rois, grad, init_out=np.full(out_shape, np.nan, dtype),
                 init_grad=np.full(data.shape, np.nan, dtype))
    assert out.shape == out_shape and out.dtype == np.dtype(dtype)
    identical(out, np.zeros(out_shape, dtype), "all-padding forward")
    identical(g, np.zeros(data.shape, dtype), "all-padding data grad")


@pytest.mark.parametrize("name,params", MX_CASES, ids=_ids(MX_CASES))
def test_all_padding_rois_mxnet_path(name, params, monkeypatch, launches):
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float32, "randn", seed=8)
    rois[:, 0] = -1.0
    rois[1::2, 0] = -3.0
    out, g, rg = mx_run(name, params, data, rois, grad,
                        init_grad=np.full(data.shape, 5.0, np.float32))
    assert launches, "native kernels ran"
    assert out.shape == op.out_shape(data.shape, rois.shape)
    assert not out.any() and not g.any() and not rg.any()


def test_unusable_cache_dir_falls_back_to_the_temp_dir(monkeypatch):
    """A cache folder that cannot be created (read-only home, bad MX_ROI_CACHE) must not
    cost the native kernels: the builds go to a per-user folder in the temp dir."""
    import tempfile
    monkeypatch.setenv("MX_ROI_CACHE", "/proc/mx_roi_cannot_exist/cache")
    d = loader.cache_dir()
    assert d.startswith(tempfile.gettempdir()) and os.path.isdir(d)
    assert os.access(d, os.W_OK)


def test_native_threads_skips_threads_for_small_launches(monkeypatch):
    monkeypatch.setenv("MX_ROI_MIN_ITEMS_PER_THREAD", "1000")
    assert loader.native_threads(0, 4) == 1
    assert loader.native_threads(999, 4) == 1
    assert loader.native_threads(2500, 4) == 2
    assert loader.native_threads(10 ** 9, 4) == 4
    assert loader.native_threads(10 ** 9, 1) == 1


# ------------------------------------------------- inference: no argmax is stored
@pytest.mark.parametrize("name,params", [CASES[0], CASES[5]], ids=["ROIPooling", "ROIAlign-max"])
@pytest.mark.parametrize("backend", [NATIVE, EMU], ids=["native", "emulated"])
def test_inference_forward_stores_no_argmax(backend, name, params, monkeypatch):
    """An inference forward (nothing kept for a backward) passes store_argmax=0 and a
    one-element argmax; a training forward stores the full argmax; the outputs agree
    bit for bit, and the training forward's argmax routes the gradient as before."""
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float32, seed=3)
    # (native: its checked path, whose launches Python sees)
    monkeypatch.setattr(backend, "library_calls", False, raising=False)
    seen = []
    real = Launch.bind

    def spy(self, sig, n, tables, args):
        if "argmax" in args:  # the max kernels (not emulated-cuda's device geometry kernel)
            seen.append({k: args[k] for k in ("argmax", "store_argmax")})
        return real(self, sig, n, tables, args)

    monkeypatch.setattr(Launch, "bind", spy)
    shape = op.out_shape(data.shape, rois.shape)
    out_inf, out_train = nd(np.full(shape, 9.0, np.float32)), nd(np.full(shape, 9.0, np.float32))
    assert backend.forward(op, "write", nd(data), nd(rois), out_inf, keep=False) is None
    inference, seen[:] = list(seen), []
    saved = backend.forward(op, "write", nd(data), nd(rois), out_train, keep=True)
    # (emulated-cuda: a box wider than the device tables' widths reruns a call once)
    assert inference and all(s["store_argmax"] == 0 and s["argmax"].size == 1
                             for s in inference)
    assert seen and all(s["store_argmax"] == 1 and s["argmax"].shape == shape for s in seen)
    identical(out_inf.asnumpy(), out_train.asnumpy(), "inference vs training output")
    monkeypatch.undo()
    dgrad = nd(np.full(data.shape, 7.0, np.float32))
    backend.backward(op, "write", nd(grad), nd(data), nd(rois), dgrad, saved)
    _, want = run(REF, op, data, rois, grad)
    close(dgrad.asnumpy(), want, np.float32, "gradient through the training argmax")


# ------------------------------------------------ the native launch's helper threads
def _launch_child(threads, op_name, params, channels, source):
    """The start of a child process's script: ``forward()`` runs one native forward of
    ``op_name`` (parameters ``params``, a Python argument list) on a fixed 3-roi problem
    with ``channels`` channels on ``threads`` threads."""
    return f"""
import os, time, numpy as np
from mx_roi import registry
from mx_roi.cuda import loader
from mx_roi.cuda.backend import Launch
from mx_roi.ndio import Kind
os.environ["MX_ROI_MIN_ITEMS_PER_THREAD"] = "1"
os.environ["MX_ROI_NUM_THREADS"] = "{threads}"
cls = registry.get_op("{op_name}")
op = cls(cls.param_cls.from_kwargs({params}))
rng = np.random.default_rng(0)
data = rng.standard_normal((2, {channels}, 12, 13)).astype(np.float32)
rois = np.array([[0, 0, 0, 11, 10], [1, 2, 3, 9, 12], [0, 5, 1, 6, 2]], np.float32)
geo = op.geometry(rois, 12, 13, np)
mod = loader.get_module("{source}", Kind.NATIVE)

def forward():
    L = Launch(mod, np, np.float32)
    return op.forward_cuda(L, geo, data)[0].copy()
"""


def _run_child(script, tmp_path):
    """Run ``script`` in a fresh interpreter (the kernel cache shared); its stdout lines."""
    import subprocess
    import sys
    env = dict(os.environ, MX_ROI_CACHE=os.environ.get("MX_ROI_CACHE", str(tmp_path)))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip().splitlines()


POOL_CHILD = _launch_child(3, "ROIPooling", 'pooled_size="(3, 3)", spatial_scale="1"', 24,
                           "roi_pooling.cu") + r"""
def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
want = forward()
after_one = threads()
for _ in range(50):
    assert np.array_equal(forward(), want)
print("helpers", after_one - before, threads() - after_one)
pid = os.fork()
if pid == 0:  # the child has none of the parent's helper threads
    ok = all(np.array_equal(forward(), want) for _ in range(20))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_native_helpers_are_kept_and_survive_fork(tmp_path):
    """A multi-threaded native launch starts its helper threads once (later launches
    reuse them: 50 launches, no new thread), and a forked child -- which has none of
    them -- still computes the same result instead of waiting forever."""
    lines = _run_child(POOL_CHILD, tmp_path)
    assert lines[-2:] == ["helpers 2 0", "child 0"], lines


AFFINITY_CHILD = _launch_child(2, "ROIAlign", 'pooled_size="(3, 3)", spatial_scale="1", '
                               'sample_ratio="2"', 40, "roi_align.cu") + r"""
def helpers():
    found = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "mx_roi helper":
                found.append(int(tid))
    return found

cpus = sorted(os.sched_getaffinity(0))
want = forward()  # starts the helper, with this thread's CPUs
deadline = time.time() + 10
while not helpers() and time.time() < deadline:  # it names itself once it runs: on a
    time.sleep(0.01)  # loaded machine that can be after the caller finished the launch
(helper,) = helpers()
print("cpus", len(cpus))
for cpu in cpus[:3]:
    os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 = the calling thread)
    expect = set(cpus) - {cpu} if len(cpus) > 1 else set(cpus)
    deadline = time.time() + 10
    while True:  # the helper may pick a launch up after the caller finished it
        assert np.array_equal(forward(), want)
        got = os.sched_getaffinity(helper)
        if got == expect or time.time() > deadline:
            break
        time.sleep(0.01)
    print("caller on", cpu, "helper kept off", sorted(set(cpus) - got))
"""


def test_native_helper_keeps_off_the_callers_cpu(tmp_path):
    """A native launch's helper ("mx_roi helper" in /proc) moves off the CPU its caller
    runs on, within the CPUs it started with: with no idle core Linux would otherwise
    wake it on the caller's CPU, and the two would share one core (a launch as slow as
    on one thread).  The caller pinned to each CPU in turn: the helper's affinity is all
    the others (on a single allowed CPU it stays as it was), results unchanged."""
    lines = _run_child(AFFINITY_CHILD, tmp_path)
    n = int(lines[0].split()[1])
    cpus = sorted(os.sched_getaffinity(0))
    assert n == len(cpus)
    expect = [f"caller on {c} helper kept off {[c] if n > 1 else []}" for c in cpus[:3]]
    assert lines[1:] == expect, lines


def _lane_case(rng, channels, ties):
    """(data, rois) for the lanes tests: 1-3 images up to 19x19, NaN and -inf cells (many
    ties when ``ties``), rois inside, across and off the map, some skipped (batch -1)."""
    N, H, W = rng.randint(1, 4), rng.randint(1, 20), rng.randint(1, 20)
    x = rng.randn(N, channels, H, W)
    if ties:
        x = np.round(x * 4) / 4
    x[rng.rand(*x.shape) < (0.1 if ties else 0.05)] = np.nan
    x[rng.rand(*x.shape) < (0.05 if ties else 0.03)] = -np.inf
    R = rng.randint(1, 12)
    rois = np.zeros((R, 5))
    rois[:, 0] = rng.randint(-1, N, R)
    rois[:, 1:3] = rng.uniform(-20, W * 16 + 20, (R, 2))
    rois[:, 3:5] = rois[:, 1:3] + rng.uniform(-10, 300, (R, 2))
    return x, rois


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_roi_pooling_channel_lanes_match_the_emulation(dtype, monkeypatch):
    """The native ROIPooling forward scans channels-last in lanes of 16 channels (a
    training forward a pass at a time with its argmax, an inference forward up to
    max_group passes a cell): bit for bit the emulated GPU kernel's output and gradient
    (hence its argmax) and its inference output, for channel counts around the lane width
    and groups of one to four passes and past them (70: 4 + 1), NaN / -inf / ties in the
    bins, skipped rois (batch -1), empty bins, several images, 1 and 3 threads."""
    rng = np.random.RandomState(5)
    widths = (1, 5, 15, 16, 17, 33, 50, 64, 70)
    for trial in range(len(widths) + 3):
        x, rois = _lane_case(rng, widths[trial % len(widths)], ties=True)
        R, C = rois.shape[0], x.shape[1]
        pooled = (rng.randint(1, 8), rng.randint(1, 8))
        og = rng.randn(R, C, *pooled)
        results = []
        for backend, threads in (("emulated-cuda", "1"), ("native", "1"), ("native", "3")):
            monkeypatch.setenv("MX_ROI_BACKEND", backend)
            monkeypatch.setenv("MX_ROI_NUM_THREADS", threads)
            d = mx.nd.array(x, dtype=dtype)
            r = mx.nd.array(rois, dtype=dtype)
            d.attach_grad()
            with autograd.record():
                o = mx.nd.Custom(d, r, op_type="ROIPooling", pooled_size=pooled,
                                 spatial_scale=0.0625)
            o.backward(mx.nd.array(og, dtype=dtype))
            inference = mx.nd.Custom(d, r, op_type="ROIPooling", pooled_size=pooled,
                                     spatial_scale=0.0625)
            results.append((o.asnumpy(), d.grad.asnumpy(), inference.asnumpy()))
        for out, grad, inf in results[1:]:
            np.testing.assert_array_equal(out, results[0][0])
            np.testing.assert_array_equal(grad, results[0][1])
            np.testing.assert_array_equal(inf, results[0][2])


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sample_ratio", [2, -1])
def test_roi_align_forward_is_mxnets_to_the_last_bit(aligned, sample_ratio, monkeypatch):
    """Unset MX_ROI_BACKEND: the ROIAlign average runs the native lanes kernel, which
    performs MXNet's operations in MXNet's order -- bit for bit its output, in an inference
    and a training forward (the NumPy backend's BLAS form is not: ~1e-7 apart); the
    gradient agrees to float32 rounding (MXNet divides ``g * w`` by the count, we
    multiply ``g / count`` by ``w``)."""
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    rng = np.random.RandomState(3)
    x = mx.nd.array(rng.randn(2, 37, 23, 31).astype(np.float32))
    rois = np.zeros((40, 5), np.float32)
    rois[:, 0] = rng.randint(0, 2, 40)
    rois[:, 1:3] = rng.uniform(-10, 480, (40, 2))
    rois[:, 3:5] = rois[:, 1:3] + rng.uniform(0, 250, (40, 2))
    r = mx.nd.array(rois)
    kw = dict(pooled_size=(7, 5), spatial_scale=1 / 16, sample_ratio=sample_ratio,
              aligned=aligned)
    want = mx.nd.contrib.ROIAlign(x, r, **kw).asnumpy()
    np.testing.assert_array_equal(mx_roi.nd.ROIAlign(x, r, **kw).asnumpy(), want)
    og = mx.nd.array(rng.randn(*want.shape).astype(np.float32))
    grads = []
    for fn in (mx_roi.nd.ROIAlign, mx.nd.contrib.ROIAlign):
        x.attach_grad()
        with autograd.record():
            out = fn(x, r, **kw)
        out.backward(og)
        grads.append(x.grad.asnumpy())
        if fn is mx_roi.nd.ROIAlign:
            np.testing.assert_array_equal(out.asnumpy(), want)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def _lanes_vs_emulation(x, rois, kw, og, req, dtype, monkeypatch):
    """(output, data gradient) of a recorded ROIAlign call on the emulation (1 thread)
    and native (1 and 3 threads); the gradient buffer starts at 7 (req write: garbage;
    add: values to keep)."""
    results = []
    for backend, threads in (("emulated-cuda", "1"), ("native", "1"), ("native", "3")):
        monkeypatch.setenv("MX_ROI_BACKEND", backend)
        monkeypatch.setenv("MX_ROI_NUM_THREADS", threads)
        d = mx.nd.array(x, dtype=dtype)
        d.attach_grad(grad_req=req)
        d.grad[:] = 7.0
        with autograd.record():
            o = mx.nd.Custom(d, mx.nd.array(rois, dtype=dtype), op_type="ROIAlign", **kw)
        o.backward(mx.nd.array(og, dtype=dtype))
        results.append((o.asnumpy(), d.grad.asnumpy()))
    return results


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_roi_align_average_lanes_match_the_emulation(dtype, monkeypatch):
    """The native ROIAlign average forward (16 channels per pass) and backward (16
    channels per tap, accumulated channels-last) are bit for bit the emulated GPU kernels:
    channel counts around the lane width, NaN / -inf taps and out-grads, skipped rois,
    adaptive and fixed sampling, 1 and 3 threads; the gradient buffer starts as garbage
    (req write) and holds values to keep (req add)."""
    rng = np.random.RandomState(6)
    for trial in range(8):
        x, rois = _lane_case(rng, (1, 15, 16, 17, 33, 5, 16, 40)[trial], ties=False)
        kw = dict(pooled_size=(rng.randint(1, 6), rng.randint(1, 6)), spatial_scale=0.0625,
                  sample_ratio=int(rng.choice([-1, 1, 2])), aligned=bool(trial % 2))
        og = rng.randn(rois.shape[0], x.shape[1], *kw["pooled_size"])
        og[rng.rand(*og.shape) < 0.02] = np.nan
        req = "add" if trial % 3 == 2 else "write"
        results = _lanes_vs_emulation(x, rois, kw, og, req, dtype, monkeypatch)
        for out, grad in results[1:]:
            np.testing.assert_array_equal(out, results[0][0])
            np.testing.assert_array_equal(grad, results[0][1])
        assert not np.isnan(results[0][1]).all() and (results[0][1] != 7.0).any()

@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_roi_align_max_lanes_match_the_emulation(dtype, monkeypatch):
    """The native max ROIAlign forward (16 channels per sample) and backward (each lane's
    winner to its four taps, accumulated channels-last) are bit for bit the emulated GPU
    kernels: NaN / -inf taps, +-inf and NaN out-grads (a zero-weight tap of a winning
    sample -- outside the map, snapped at the border -- gets inf * 0 = NaN, as on a GPU),
    channel counts around the lane width, skipped rois, adaptive and fixed sampling, 1
    and 3 threads.  req add: native adds its zero-start sums to the buffer, the emulation
    adds each contribution to it in turn: equal to rounding."""
    rng = np.random.RandomState(8)
    for trial in range(8):
        x, rois = _lane_case(rng, (1, 15, 16, 17, 33, 5, 16, 40)[trial], ties=bool(trial % 2))
        kw = dict(pooled_size=(rng.randint(1, 6), rng.randint(1, 6)), spatial_scale=0.0625,
                  sample_ratio=int(rng.choice([-1, 1, 2])), aligned=bool(trial % 3 == 1),
                  pool_mode="max")
        og = rng.randn(rois.shape[0], x.shape[1], *kw["pooled_size"])
        og[rng.rand(*og.shape) < 0.05] = np.inf
        og[rng.rand(*og.shape) < 0.03] = -np.inf
        og[rng.rand(*og.shape) < 0.02] = np.nan
        req = "add" if trial % 3 == 2 else "write"
        results = _lanes_vs_emulation(x, rois, kw, og, req, dtype, monkeypatch)
        for out, grad in results[1:]:
            np.testing.assert_array_equal(out, results[0][0])
            if req == "write":
                np.testing.assert_array_equal(grad, results[0][1])
            else:
                np.testing.assert_allclose(grad, results[0][1], rtol=2e-3 if dtype ==
                                           "float16" else 1e-6, atol=1e-6)
        np.testing.assert_array_equal(results[2][1], results[1][1])  # 3 threads vs 1
        assert (results[0][1] != 7.0).any()


def test_ps_align_forward_past_the_tap_limit_takes_the_item_loop(tmp_path, monkeypatch):
    """PSROIAlign's native forward holds a bin's samples for all its channels only up to
    MX_ROI_PS_MAX_TAPS (2^16) of them; past that (a huge adaptive grid) it computes them
    item by item.  A build with the limit lowered to 4 runs both paths on small problems
    (3 x 3 samples per bin: the item loop; 2 x 2: the bin walk): the same bits as the
    emulation, on 1 and 3 threads."""
    rng = np.random.default_rng(5)
    data = rng.standard_normal((2, 12, 9, 11)).astype(np.float32)
    rois = np.array([[0, -2, -3, 8, 7], [1, 1, 1, 6, 7], [-1, 0, 0, 3, 3]], np.float32)
    use_variant_build(monkeypatch, tmp_path, "-DMX_ROI_PS_MAX_TAPS=4")
    for ratio in (3, 2):
        op = make_op("PSROIAlign", dict(pooled_size=2, output_dim=3, spatial_scale=1.0,
                                        sample_ratio=ratio))
        grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(np.float32)
        want, _ = run(EMU, op, data, rois, grad)
        for t in (1, 3):
            monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
            got, _ = run(NATIVE, op, data, rois, grad)
            identical(got, want, f"sample_ratio={ratio}, {t} threads")


#: the position-sensitive forwards' threshold of the channels-last walk (reads per cell)
PS_WALK_FLAG = {"PSROIAlign": "MX_ROI_PS_LANES_READS", "PSROIPooling": "MX_ROI_PSP_LANES_READS"}


def _ps_walk_kwargs(name, trial, P, C, group):
    kw = dict(pooled_size=P, output_dim=C, spatial_scale=0.0625, group_size=group)
    if name == "PSROIAlign":
        kw.update(sample_ratio=(-1, 2, 3, 2, 2)[trial], aligned=trial == 3)
        if trial == 4:  # the R-FCN-PSROIAlign layer's sample grid, same kernels
            kw.update(legacy="rfcn", sample_num=3)
            del kw["aligned"]
    return kw


@pytest.fixture(scope="module")
def variant_cache(tmp_path_factory):
    """One cache for the builds with changed thresholds (their flags are in the key):
    the tests' parameter sets that share flags build each library once."""
    return tmp_path_factory.mktemp("variant-builds")


def _ps_forward_builds_agree(monkeypatch, cache, name, dtype, channels, flag_sets):
    """The position-sensitive forward ``name`` built with each of ``flag_sets``, on
    problems of each output-channel count in ``channels`` (group grids other than the
    pooled one, adaptive and fixed samples, aligned boxes, legacy='rfcn' samples, rois
    off the map (empty bins) and skipped ones, NaN and infinite cells, few and many rois,
    the output pre-filled with garbage), on 1 and 3 threads: the emulation's bits every
    time."""
    rng = np.random.RandomState(11)
    cases = []
    for trial, C in enumerate(channels):
        group = ((0, 0), (2, 3), (0, 0), (1, 1), (0, 0))[trial % 5]
        x, rois = _lane_case(rng, 1, ties=False)
        P = (3, 2) if trial % 2 else (2, 2)
        gh, gw = group if group != (0, 0) else P
        x = rng.randn(x.shape[0], C * gh * gw, x.shape[2], x.shape[3])
        x[rng.rand(*x.shape) < 0.03] = np.nan
        x[rng.rand(*x.shape) < 0.02] = np.inf
        x[rng.rand(*x.shape) < 0.02] = -np.inf
        many = np.tile(rois, (40, 1))  # many reads per cell: the copy at the default
        many[:, 1:] += rng.uniform(-8, 8, many[:, 1:].shape)
        kw = _ps_walk_kwargs(name, trial % 5, P, C, group)
        cases += [(kw, x.astype(dtype), rois.astype(dtype)),
                  (kw, x.astype(dtype), many.astype(dtype))]
    for flags in flag_sets:
        use_variant_build(monkeypatch, cache, flags)
        for kw, x, rois in cases:
            op = make_op(name, kw)
            grad = np.ones(op.out_shape(x.shape, rois.shape), dtype)
            garbage = np.full(grad.shape, 7, dtype)
            monkeypatch.setenv("MX_ROI_NUM_THREADS", "1")
            want, _ = run(EMU, op, x, rois, grad)
            for t in (1, 3):
                monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
                got, _ = run(NATIVE, op, x, rois, grad, init_out=garbage)
                where = f"{flags or 'default'}, {kw}, {len(rois)} rois, {t} threads"
                # the same bits, but for which NaN's payload a sum of two NaNs keeps (the
                # compiler may swap an addition's operands)
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), where)
                identical(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want),
                          where)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("name", ["PSROIAlign", "PSROIPooling"])
def test_ps_forward_lanes_and_plane_walk(variant_cache, monkeypatch, name, dtype):
    """With at least 8 output channels and enough reads per input cell (PSROIAlign:
    MX_ROI_PS_LANES_READS = 0.5 sample taps; PSROIPooling: MX_ROI_PSP_LANES_READS = 0.05
    cells, both per cell a bin's copy costs), the position-sensitive native forwards copy
    each bin's planes channels-last (one walk, ps_forward_channels_last) and take a roi's
    bin for 8 channels at a time; else they walk plane by plane.  Builds with the
    threshold at 0 (every call with 8+ channels copies), the default and 1e30 (never; and
    the plane walk's prefetch hints on for any map size: MX_ROI_HINT_MIN_BYTES=0) run
    both on the same problems -- 8, 9, 10 and 21 channels (a partial last pass) -- with
    the emulation's bits (_ps_forward_builds_agree)."""
    flag = PS_WALK_FLAG[name]
    _ps_forward_builds_agree(monkeypatch, variant_cache, name, dtype, (8, 9, 21, 8, 10),
                             (f"-D{flag}=0", "", f"-D{flag}=1e30 -DMX_ROI_HINT_MIN_BYTES=0"))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_ps_align_forward_direct_and_taps_plane_walks(variant_cache, monkeypatch, dtype):
    """PSROIAlign's plane-by-plane forward takes each sample straight from the tables
    with at most MX_ROI_PS_DIRECT_CHANNELS (2) output channels, else builds each bin's
    taps once for its channels.  Builds with the bound at -1 (always the taps), the
    default, and 30 (direct for every count here, past the channels-last walk's 8) run
    both on the same problems -- 1, 2, 3 and 9 channels -- with the emulation's bits
    (_ps_forward_builds_agree)."""
    _ps_forward_builds_agree(monkeypatch, variant_cache, "PSROIAlign", dtype, (1, 2, 3, 1, 9),
                             ("-DMX_ROI_PS_DIRECT_CHANNELS=-1", "",
                              "-DMX_ROI_PS_DIRECT_CHANNELS=30"))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("name", ["PSROIAlign", "PSROIPooling"])
def test_ps_small_and_large_map_walks(variant_cache, monkeypatch, name, dtype):
    """The position-sensitive backwards (and PSROIPooling's forward, in the output's
    order) walk a map whose image takes at most MX_ROI_HINT_MIN_BYTES roi by roi -- the
    backward in the flat index's order (ps_items_by_roi) -- and a larger one bin by bin
    with prefetch hints.  The default build (every map here is small) and one with
    MX_ROI_HINT_MIN_BYTES=0 (every map large) on the same problems -- 1, 2, 3, 7 and 9
    output channels, group grids other than the pooled one, PSROIAlign's adaptive and
    fixed samples, aligned boxes and legacy='rfcn' grid, empty and skipped rois, NaN and
    infinite cells, output and gradient pre-filled with garbage -- on 1 and 3 threads:
    the forward is the emulation's bits in both builds; the backward is too on the
    roi-by-roi walk (the emulation's order), and on the bin-by-bin walk wherever each
    gradient cell takes its adds in the same order (the pooled grid as group grid; close
    to it otherwise)."""
    rng = np.random.RandomState(5)
    cases = []
    for trial, C in enumerate((1, 2, 3, 7, 9)):
        group = ((0, 0), (2, 3), (1, 1), (0, 0), (2, 2))[trial]
        x, rois = _lane_case(rng, 1, ties=False)
        P = (3, 2) if trial % 2 else (2, 2)
        gh, gw = group if group != (0, 0) else P
        x = rng.randn(x.shape[0], C * gh * gw, x.shape[2], x.shape[3])
        x[rng.rand(*x.shape) < 0.03] = np.nan
        x[rng.rand(*x.shape) < 0.02] = -np.inf
        kw = _ps_walk_kwargs(name, trial, P, C, group)
        cases.append((kw, group == (0, 0), x.astype(dtype), rois.astype(dtype)))
    for flags, small in (("", True), ("-DMX_ROI_HINT_MIN_BYTES=0", False)):
        use_variant_build(monkeypatch, variant_cache, flags)
        for kw, pooled_grid, x, rois in cases:
            op = make_op(name, kw)
            grad = rng.randn(*op.out_shape(x.shape, rois.shape)).astype(dtype)
            monkeypatch.setenv("MX_ROI_NUM_THREADS", "1")
            want, want_g = run(EMU, op, x, rois, grad)
            for t in (1, 3):
                monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
                got, got_g = run(NATIVE, op, x, rois, grad,
                                 init_out=np.full(want.shape, 7, dtype),
                                 init_grad=np.full(x.shape, -3, dtype))
                where = f"{flags or 'default'}, {kw}, {len(rois)} rois, {t} threads"
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), where)
                identical(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want),
                          "forward: " + where)
                np.testing.assert_array_equal(np.isnan(got_g), np.isnan(want_g), where)
                g, w = np.where(np.isnan(got_g), 0, got_g), np.where(np.isnan(want_g), 0, want_g)
                if small or pooled_grid:
                    identical(g, w, "backward: " + where)
                else:
                    close(g, w, dtype, "backward: " + where)


@pytest.mark.parametrize("mode,vec", [("avg", ""), ("max-argmax", ""), ("max-rescan", ""),
                                      ("max-argmax", " -DMX_ROI_MAX_VEC_SAMPLES=0"),
                                      ("max-rescan", " -DMX_ROI_MAX_VEC_SAMPLES=0"),
                                      ("avg", " -DMX_ROI_ADD_TILED_LANES=1000000"),
                                      ("max-rescan", " -DMX_ROI_ADD_TILED_LANES=1000000")])
def test_align_backward_roi_sample_table_and_direct_paths(variant_cache, monkeypatch, mode,
                                                          vec):
    """The native ROIAlign backwards read a roi's samples once into a table of block
    offsets (CellTaps) when it has at most MX_ROI_ROI_SAMPLE_TABLE (2^14) of them -- the
    average backward only with more than one group of 16-channel passes (4 in the AVX
    build, 1 with SSE) --, else directly (max: per lane).  A build with the limit lowered
    to 16 runs both (2x2 bins x 2x2 samples: the table; 3x3 samples: direct; 70 channels:
    five passes, a group of four and one more), aligned and not, adaptive bins of fewer
    samples than the padded grid (the table's row stride), max with the kept argmax and
    rescanning, on 1 and 3 threads: the emulation's bits.  The max backwards add a pass's
    bin as vectors per winning sample (WinnerLanes); built with MX_ROI_MAX_VEC_SAMPLES=0
    they take the scalar walk per lane, tested the same way.  GradBlock::add_to moves a
    block of 70 channels (80 lanes) to the planes in tiles; MX_ROI_ADD_TILED_LANES=10^6
    runs its plane-by-plane loop (a 16-lane block's) instead."""
    from mx_roi.cuda import backend as cuda_backend
    rng = np.random.default_rng(8)
    data = rng.standard_normal((2, 70, 9, 11)).astype(np.float32)
    rois = np.array([[0, -2, -3, 8, 7], [1, 1, 1, 6, 7], [-1, 0, 0, 3, 3], [1, 2, 0, 9, 5]],
                    np.float32)
    # adaptive: 2x2, 1x1, 1x2 and 2x1 samples per bin on one padded 2x2 grid
    small = np.array([[0, 0, 0, 3, 3], [1, 1, 1, 2, 2], [0, 4, 2, 7, 4], [1, 1, 0, 2, 3]],
                     np.float32)
    use_variant_build(monkeypatch, variant_cache, "-DMX_ROI_ROI_SAMPLE_TABLE=16" + vec)
    if mode == "max-rescan":
        monkeypatch.setattr(cuda_backend, "ARGMAX_KEEP_MAX_ELEMENTS", 0)
    for ratio, aligned, boxes in ((2, False, rois), (3, False, rois), (2, True, rois),
                                  (-1, False, small)):
        op = make_op("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0,
                                      sample_ratio=ratio, aligned=aligned,
                                      pool_mode=mode[:3]))
        grad = rng.standard_normal(op.out_shape(data.shape, boxes.shape)).astype(np.float32)
        want = run(EMU, op, data, boxes, grad)
        for t in (1, 3):
            monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
            got = run(NATIVE, op, data, boxes, grad)
            where = f"sample_ratio={ratio}, aligned={aligned}, {t} threads"
            identical(got[0], want[0], "forward, " + where)
            identical(got[1], want[1], "gradient, " + where)


# ------------------------------------------------------------ vector width of the lanes
def test_native_isa_flags_from_cpuinfo(tmp_path, monkeypatch):
    """-mavx2 exactly where the cpuinfo flags list avx2 on x86-64; nothing for a CPU
    with only other AVX flags, an unreadable cpuinfo or another architecture; the flags
    are part of the native library's name (an AVX2 build is never loaded by a process
    that did not find AVX2)."""
    def cpuinfo(flags):
        path = tmp_path / f"cpuinfo-{len(flags)}"
        path.write_text("processor\t: 0\nmodel name\t: some avx2 cpu\n"
                        f"flags\t\t: {' '.join(flags)}\n\nprocessor\t: 1\n")
        return str(path)
    monkeypatch.setattr(loader.platform, "machine", lambda: "x86_64")
    assert loader.native_isa_flags(cpuinfo(["fpu", "sse2", "avx", "avx2", "fma"])) == \
        ("-mavx2",)
    assert loader.native_isa_flags(cpuinfo(["fpu", "sse2", "avx", "avx512f"])) == ()
    assert loader.native_isa_flags(cpuinfo(["fpu", "sse2", "avx2x"])) == ()
    assert loader.native_isa_flags(str(tmp_path / "missing")) == ()
    monkeypatch.setattr(loader.platform, "machine", lambda: "aarch64")
    assert loader.native_isa_flags(cpuinfo(["fp", "asimd", "avx2"])) == ()
    monkeypatch.delenv("MX_ROI_HOST_CXXFLAGS", raising=False)
    names = set()
    for isa in ((), ("-mavx2",)):
        monkeypatch.setattr(loader, "native_isa_flags", lambda isa=isa: isa)
        assert ("-mavx2" in loader._host_flags(True)) == bool(isa)
        assert "-mavx2" not in loader._host_flags(False)  # the emulation: never
        names.add(loader.host_library_path("roi_align.cu", Kind.NATIVE)[0])
    assert len(names) == 2


def _float_vector_widths():
    """(extra flags, lane vector width) of the builds to check: the 4-wide SSE lanes
    always, the 8-wide AVX lanes (the default build) where this CPU has AVX2."""
    widths = [("-mno-avx", 4)]
    if loader.native_isa_flags():
        widths.append(("", 8))
    return widths


def test_float_lanes_bits_at_both_vector_widths(variant_cache, monkeypatch):
    """The float lanes are 8-wide vectors in a build for AVX and 4-wide otherwise, with
    the same operations per lane: both builds give the emulation's bits -- ROIPooling
    (training and inference forward: the latter scans without an argmax),
    average and max ROIAlign (forward and backward), PSROIAlign's and PSROIPooling's
    channels-last walks, and RROIAlign and PrRoIPool where the staged outputs' and
    out-grads' tiles run (15 bins, staged 12 at a time) --
    for channel counts around the widths, NaN / -inf cells, skipped rois, 1 and 3
    threads, over garbage-filled outputs; each library reports the width it was built
    with."""
    rng = np.random.RandomState(21)
    cases = []
    for trial, channels in enumerate((5, 8, 17, 33, 61)):
        x, rois = _lane_case(rng, channels, ties=bool(trial % 2))
        pooled = (rng.randint(1, 5), rng.randint(1, 5))
        for name, kw in (("ROIPooling", dict(pooled_size=pooled, spatial_scale=0.0625)),
                         ("ROIAlign", dict(pooled_size=pooled, spatial_scale=0.0625,
                                           sample_ratio=int(rng.choice([-1, 2])),
                                           aligned=bool(trial % 2))),
                         ("ROIAlign", dict(pooled_size=pooled, spatial_scale=0.0625,
                                           sample_ratio=2, pool_mode="max"))):
            cases.append((make_op(name, kw), x.astype(np.float32), rois.astype(np.float32)))
        if channels in (17, 61):
            # 15 bins: the staged outputs' tiles (8 x 8 or 4 x 4) and their leftovers in
            # bins and channels, for every forward that stages (LaneWalk::each_group_staged)
            big = dict(pooled_size=(3, 5), spatial_scale=0.0625)
            rot = np.concatenate([rois[:, :1], (rois[:, 1:3] + rois[:, 3:5]) / 2,
                                  np.abs(rois[:, 3:5] - rois[:, 1:3]),
                                  rng.uniform(-180, 180, (len(rois), 1))], axis=1)
            for name, kw, r in (("ROIPooling", big, rois),
                                ("ROIAlign", dict(big, sample_ratio=2), rois),
                                ("ROIAlign", dict(big, sample_ratio=2, pool_mode="max"), rois),
                                ("RROIAlign", dict(big, sampling_ratio=2), rot),
                                ("PrRoIPool", big, rois)):
                cases.append((make_op(name, kw), x.astype(np.float32), r.astype(np.float32)))
        xp = rng.randn(x.shape[0], channels * 4, x.shape[2], x.shape[3]).astype(np.float32)
        xp[rng.rand(*xp.shape) < 0.03] = -np.inf
        for ps in (make_op("PSROIAlign", dict(pooled_size=(2, 2), output_dim=channels,
                                              spatial_scale=0.0625, sample_ratio=2)),
                   make_op("PSROIPooling", dict(pooled_size=(2, 2), output_dim=channels,
                                                spatial_scale=0.0625))):
            cases.append((ps, xp, rois.astype(np.float32)))
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "1")
    wants = []
    for op, x, rois in cases:
        grad = rng.randn(*op.out_shape(x.shape, rois.shape)).astype(np.float32)
        wants.append((grad, run(EMU, op, x, rois, grad)))
    for flags, width in _float_vector_widths():
        # every position-sensitive call with 8+ channels takes the channels-last walk; the
        # staged bins go in chunks of 12 (15 bins: a chunk with a tile and leftovers, then
        # one of leftovers only)
        use_variant_build(monkeypatch, variant_cache, flags + " -DMX_ROI_PS_LANES_READS=0"
                          " -DMX_ROI_PSP_LANES_READS=0 -DMX_ROI_STAGED_BINS=12")
        for src in ("roi_pooling.cu", "roi_align.cu", "psroi_align.cu", "psroi_pooling.cu",
                    "rroi_align.cu", "prroi_pool.cu"):
            lib = loader.get_module(src, Kind.NATIVE, 0)._lib
            assert loader.float_vector_width(lib) == width, (src, flags)
        for (op, x, rois), (grad, want) in zip(cases, wants):
            for t in (1, 3):
                monkeypatch.setenv("MX_ROI_NUM_THREADS", str(t))
                got = run(NATIVE, op, x, rois, grad,
                          init_out=np.full(want[0].shape, 7, np.float32),
                          init_grad=np.full(want[1].shape, 7, np.float32))
                where = f"{op.name} {op.param}, width {width}, {t} threads"
                if op.name == "PrRoIPool":
                    # where a data NaN meets an inf * 0 NaN, PrRoIPool's lanes and its
                    # generic loop keep different ones (an add's operands, as the compiler
                    # orders them): the same values and NaN cells, NaN sign bits may differ
                    np.testing.assert_array_equal(got[0], want[0], "forward, " + where)
                else:
                    identical(got[0], want[0], "forward, " + where)
                identical(got[1], want[1], "gradient, " + where)
                if op.name == "ROIPooling" or op.param.to_kwargs().get("pool_mode") == "max":
                    # the inference forward's scan keeps no argmax (MaxValueLanes)
                    identical(run_inference(NATIVE, op, x, rois,
                                            init_out=np.full(want[0].shape, 7, np.float32)),
                              want[0], "inference forward, " + where)
