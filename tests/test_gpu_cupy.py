"""The CUDA backend on a real GPU through CuPy arrays standing in for GPU NDArrays
(:mod:`mx_roi.cuda.cupy_arrays`): for a GPU machine whose MXNet is a CPU build.

The backend, geometry, DLPack I/O and kernels are the ones ``mx.gpu(0)`` runs; MXNet's own
side (engine, autograd, CUDA built-ins) is ``tests/test_gpu.py``'s.  Against the NumPy
backend on the CPU, bit for bit against ``emulated-cuda`` in deterministic mode, ``req``
write (outputs pre-filled with garbage) and add, zero rois, bad rois (a clear error, then
the next call works), a tensor past 2^31 elements (slow).  Skipped without CuPy and a GPU.
"""
import numpy as np
import pytest

import mxnet as mx

import mx_roi  # noqa: F401
from mx_roi import gpucheck
from mx_roi.backends import get
from mx_roi.registry import get_op
from tests.gpu_cases import CASES, DTYPES, IDS, close, problem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpucheck.cupy_gpu_count() == 0,
                                 reason="needs CuPy and a GPU")]


@pytest.fixture(scope="module")
def gpu():
    from mx_roi.cuda.cupy_arrays import Device
    return Device(0)


def op_of(name, params):
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))


def on_gpu(gpu, op, data, rois, grad, req="write", out_fill=np.nan, grad_fill=np.nan,
           keep_argmax=True, monkeypatch=None):
    """Forward + backward through the CUDA backend on CuPy arrays; the output and the
    gradient buffers start as ``out_fill`` / ``grad_fill`` (garbage: ``write`` must
    overwrite every element)."""
    cuda = get("cuda")
    x, r = gpu.array(data), gpu.array(rois)
    out = gpu.array(np.full(op.out_shape(data.shape, rois.shape), out_fill, data.dtype))
    dx = gpu.array(np.full(data.shape, grad_fill, data.dtype))
    saved = cuda.forward(op, "write", x, r, out, keep=True)
    if not keep_argmax:
        saved = None
    cuda.backward(op, req, gpu.array(grad), x, r, dx, saved)
    return out.asnumpy(), dx.asnumpy()


def on_host(backend, op, data, rois, grad):
    from mx_roi.selftest import _run
    out, (dgrad,) = _run(get(backend), op, data, rois, grad, mx.cpu())
    return out, dgrad


def _grad(op, data, rois, seed=99):
    shape = op.out_shape(data.shape, rois.shape)
    return np.random.default_rng(seed).standard_normal(shape).astype(data.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_gpu_vs_numpy(gpu, name, params, dtype):
    op = op_of(name, params)
    data, rois = problem(name, params, dtype)
    grad = _grad(op, data, rois)
    out_g, dg_g = on_gpu(gpu, op, data, rois, grad)
    out_c, dg_c = on_host("numpy", op, data, rois, grad)
    assert not np.isnan(out_g).any() and not np.isnan(dg_g).any(), "an element left unwritten"
    close(out_g, out_c, dtype, f"{name} forward gpu vs numpy")
    close(dg_g, dg_c, dtype, f"{name} data grad gpu vs numpy")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_deterministic_bits_equal_the_emulation(gpu, name, params, dtype):
    op = op_of(name, dict(params, deterministic=True))
    data, rois = problem(name, params, dtype, seed=1)
    rois = np.concatenate([rois] * 8)  # many atomics on the same cells
    grad = _grad(op, data, rois)
    out1, dg1 = on_gpu(gpu, op, data, rois, grad)
    out2, dg2 = on_gpu(gpu, op, data, rois, grad, out_fill=7, grad_fill=-3)
    assert out1.tobytes() == out2.tobytes()
    assert dg1.tobytes() == dg2.tobytes(), "deterministic=True gradients differ between runs"
    out_e, dg_e = on_host("emulated-cuda", op, data, rois, grad)
    assert out1.tobytes() == out_e.tobytes(), "forward differs from emulated-cuda"
    assert dg1.tobytes() == dg_e.tobytes(), "deterministic gradient differs from emulated-cuda"


MAX_CASES = [(i, c) for i, c in enumerate(CASES)
             if c[0] == "ROIPooling" or c[1].get("pool_mode") == "max"]


@pytest.mark.parametrize("name,params", [c for _, c in MAX_CASES],
                         ids=[IDS[i] for i, _ in MAX_CASES])
def test_rescanning_backward_equals_the_kept_argmax(gpu, name, params):
    op = op_of(name, dict(params, deterministic=True))
    data, rois = problem(name, params, np.float32, seed=5)
    grad = _grad(op, data, rois)
    _, kept = on_gpu(gpu, op, data, rois, grad)
    _, rescanned = on_gpu(gpu, op, data, rois, grad, keep_argmax=False)
    assert kept.tobytes() == rescanned.tobytes()


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_grad_req_add(gpu, name, params):
    op = op_of(name, params)
    data, rois = problem(name, params, np.float64, seed=2)
    grad = _grad(op, data, rois)
    _, once = on_gpu(gpu, op, data, rois, grad, grad_fill=0.0)
    _, added = on_gpu(gpu, op, data, rois, grad, req="add", grad_fill=1.5)
    close(added, once + 1.5, np.float64, "req=add")


def test_zero_rois_write_zeros(gpu):
    name, params = CASES[1]
    op = op_of(name, params)
    data, _ = problem(name, params, np.float32)
    rois = np.zeros((0, 5), np.float32)
    out, dg = on_gpu(gpu, op, data, rois, np.zeros((0, 3, 2, 2), np.float32))
    assert out.shape == (0, 3, 2, 2) and dg.shape == data.shape and not dg.any()


def test_bad_rois_raise_then_the_next_call_works(gpu):
    name, params = CASES[1]
    op = op_of(name, params)
    data, rois = problem(name, params, np.float32)
    grad = _grad(op, data, rois)
    bad = rois.copy()
    bad[3, 0] = 5  # batch index past N = 2
    with pytest.raises(ValueError, match=r"rois\[3\] has batch index 5 but"):
        on_gpu(gpu, op, data, bad, grad)
    bad = rois.copy()
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match=r"rois\[2\] has a NaN or infinite value"):
        on_gpu(gpu, op, data, bad, grad)
    out, dg = on_gpu(gpu, op, data, rois, grad)
    close(out, on_host("numpy", op, data, rois, grad)[0], np.float32, "after the errors")


@pytest.mark.slow
@pytest.mark.parametrize("name,params", [
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2)),
    ("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=1.0))], ids=["ROIAlign", "ROIPooling"])
def test_past_2_31_elements(gpu, name, params):
    """float16 data of 33 * 8192 * 8000 > 2^31 elements; rois reading the last channel's far
    corner see the right values (64-bit indexing), forward and backward, against the CPU
    path on a crop of that channel."""
    import cupy
    N, C, H, W = 1, 33, 8192, 8000
    op = op_of(name, params)
    rng = np.random.default_rng(4)
    corner = rng.standard_normal((1, 1, 64, 64)).astype(np.float16)
    rois = np.array([[0, W - 60, H - 60, W - 4, H - 4],
                     [0, W - 40, H - 52, W - 8, H - 12]], np.float16)
    x = gpu.zeros((N, C, H, W), np.float16)
    x.data[:, C - 1:, H - 64:, W - 64:] = cupy.asarray(corner)
    out = gpu.zeros(op.out_shape(x.shape, rois.shape), np.float16)
    dx = gpu.zeros(x.shape, np.float16)
    grad = rng.standard_normal(out.shape).astype(np.float16)
    cuda = get("cuda")
    r = gpu.array(rois)
    saved = cuda.forward(op, "write", x, r, out, keep=True)
    cuda.backward(op, "write", gpu.array(grad), x, r, dx, saved)
    crop = rois.astype(np.float64).copy()
    crop[:, [1, 3]] -= W - 64
    crop[:, [2, 4]] -= H - 64
    out_c, dg_c = on_host("numpy", op, corner, crop.astype(np.float16),
                          np.ascontiguousarray(grad[:, C - 1:C]))
    close(out.asnumpy()[:, C - 1], out_c[:, 0], np.float16, "forward past 2^31")
    close(cupy.asnumpy(dx.data[:, C - 1:, H - 64:, W - 64:]), dg_c, np.float16,
          "data grad past 2^31")


LEGACY = [("ROIAlign", dict(pooled_size=(3, 2), spatial_scale=0.5, legacy="caffe")),
          ("PSROIAlign", dict(pooled_size=2, output_dim=2, spatial_scale=0.5, legacy="rfcn",
                              sample_num=2))]
EXTREME = (1e30, -1e30, 3e3, -5.0, 0.0, 0.5, 1e-30)
BAD = {"nan": (np.nan, r"has a NaN or infinite value"),
       "inf": (np.inf, r"has a NaN or infinite value"),
       "batch": (None, r"has batch index \d+ but data holds only 2 image")}


def test_fuzz_extreme_and_bad_rois(gpu):
    """Seeded random calls on the GPU: rois with extreme but valid values (far off the map,
    reversed, zero-size, padding, fractional batch) agree with the NumPy backend; NaN, inf
    or a batch index past N raise the error naming it, in the forward and in a backward
    handed such rois, and the next call works.  (Run under compute-sanitizer memcheck on
    the H200: no invalid access.)"""
    rng = np.random.default_rng(2026)
    cases = CASES + LEGACY
    n_valid = n_bad = 0
    for i in range(120):
        name, params = cases[i % len(cases)]
        dtype = DTYPES[(i // len(cases)) % 3]
        op = op_of(name, params)
        data, rois = problem(name, params, dtype, seed=i)
        rois = rois.astype(np.float64)
        for _ in range(rng.integers(1, 4)):  # extreme values in random places
            rois[rng.integers(0, len(rois)), rng.integers(1, 5)] = rng.choice(EXTREME)
        rois[rng.integers(0, len(rois)), 0] = rng.choice([-1, 0.5, 1.9])
        if dtype == np.float16:  # (the adaptive grid of a 6e4-cell box is 15000^2
            rois = np.clip(rois, -300, 300)  # samples a bin: too big for the NumPy side)
        rois = rois.astype(dtype)
        grad = _grad(op, data, rois)
        if i % 3 == 2:  # a bad roi
            kind = list(BAD)[i % len(BAD)]
            value, message = BAD[kind]
            bad = rois.copy()
            row = int(rng.integers(0, len(bad)))
            if kind == "batch":
                bad[row, 0] = 2 + rng.integers(0, 9)
            else:
                bad[row, int(rng.integers(1, 5))] = value
            with pytest.raises(ValueError, match=message):
                on_gpu(gpu, op, data, bad, grad)
            cuda = get("cuda")  # the backward alone, handed the bad rois
            dx = gpu.zeros(data.shape, dtype)
            with pytest.raises(ValueError, match=message):
                cuda.backward(op, "write", gpu.array(grad), gpu.array(data), gpu.array(bad),
                              dx, None)
            n_bad += 1
        out_g, dg_g = on_gpu(gpu, op, data, rois, grad)
        out_c, dg_c = on_host("numpy", op, data, rois, grad)
        assert np.isfinite(out_g).all() and np.isfinite(dg_g).all(), (i, name, params)
        close(out_g, out_c, dtype, f"case {i} {name} {params} forward")
        close(dg_g, dg_c, dtype, f"case {i} {name} {params} data grad")
        n_valid += 1
    assert n_valid == 120 and n_bad == 40
