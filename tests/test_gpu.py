"""The CUDA backend on a real GPU (``mx.gpu(0)``): against the CPU path and MXNet's CUDA
built-ins, forward and backward, every dtype, deterministic mode and a tensor past 2^31
elements.  Skipped without CuPy, an MXNet GPU build or a GPU (the CPU-only proof is
``tests/test_emulation.py`` + ``tests/test_cuda_compile.py``).
"""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import mx_roi  # noqa: F401
from tests.gpu_cases import CASES, DTYPES, IDS, close, gpu_available, problem
from tests.ops.base import random_rois




pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(),
                                 reason="needs CuPy, an MXNet GPU build and a GPU")]

def run(ctx, name, params, data, rois, grad=None, grad_req="write", passes=1):
    x = mx.nd.array(data, ctx=ctx, dtype=data.dtype)
    r = mx.nd.array(rois, ctx=ctx, dtype=rois.dtype)
    x.attach_grad(grad_req=grad_req)
    for _ in range(passes):
        with autograd.record():
            y = mx.nd.Custom(x, r, op_type=name, **params)
        if grad is None:
            grad = np.random.default_rng(99).standard_normal(y.shape).astype(data.dtype)
        y.backward(mx.nd.array(grad, ctx=ctx, dtype=data.dtype))
    return y.asnumpy(), x.grad.asnumpy(), grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_gpu_vs_cpu(name, params, dtype):
    data, rois = problem(name, params, dtype)
    out_g, dg_g, grad = run(mx.gpu(0), name, params, data, rois)
    out_c, dg_c, _ = run(mx.cpu(), name, params, data, rois, grad)
    exact = (name == "ROIPooling" or params.get("pool_mode") == "max") and dtype != np.float16
    close(out_g, out_c, dtype, f"{name} forward gpu vs cpu", exact=exact)
    close(dg_g, dg_c, dtype, f"{name} data grad gpu vs cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_deterministic_bits(name, params, dtype):
    params = dict(params, deterministic=True)
    data, rois = problem(name, params, dtype, seed=1)
    rois = np.concatenate([rois] * 8)  # many atomics on the same cells
    out1, dg1, grad = run(mx.gpu(0), name, params, data, rois)
    out2, dg2, _ = run(mx.gpu(0), name, params, data, rois, grad)
    assert out1.tobytes() == out2.tobytes()
    assert dg1.tobytes() == dg2.tobytes(), "deterministic=True gradients differ between runs"
    _, dg_c, _ = run(mx.cpu(), name, params, data, rois, grad)
    close(dg1, dg_c, dtype, f"{name} deterministic grad vs cpu")


@pytest.mark.parametrize("name,params", CASES[::2], ids=IDS[::2])
def test_grad_req_add(name, params):
    data, rois = problem(name, params, np.float32, seed=2)
    _, once, grad = run(mx.gpu(0), name, params, data, rois)
    _, twice, _ = run(mx.gpu(0), name, params, data, rois, grad, grad_req="add", passes=2)
    close(twice, 2 * once, np.float32, "grad_req=add")


def test_zero_rois():
    data, _ = problem("ROIAlign", CASES[1][1], np.float32)
    with mx.util.np_shape(True):
        out, dg, _ = run(mx.gpu(0), "ROIAlign", CASES[1][1], data, np.zeros((0, 5), np.float32))
    assert out.shape[0] == 0 and not dg.any()


def _builtin(name, params, x, r):
    if name == "ROIPooling":
        return mx.nd.ROIPooling(x, r, pooled_size=params["pooled_size"],
                                spatial_scale=params["spatial_scale"])
    if name == "ROIAlign":
        return mx.nd.contrib.ROIAlign(x, r, pooled_size=params["pooled_size"],
                                      spatial_scale=params["spatial_scale"],
                                      sample_ratio=params["sample_ratio"],
                                      aligned=params.get("aligned", False))
    return mx.nd.contrib.PSROIPooling(x, r, pooled_size=params["pooled_size"],
                                      output_dim=params["output_dim"],
                                      spatial_scale=params["spatial_scale"])


@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] != "PSROIAlign"
                                         and c[1].get("pool_mode", "avg") == "avg"])
def test_vs_builtin_cuda(name, params, dtype):
    """Against MXNet's CUDA built-ins on ordinary boxes (no padding rois)."""
    rng = np.random.default_rng(3)
    data, _ = problem(name, params, dtype)
    rois = random_rois(rng, 12, 2, 9, 10, params["spatial_scale"], dtype)
    out, dg, grad = run(mx.gpu(0), name, params, data, rois)
    x = mx.nd.array(data, ctx=mx.gpu(0), dtype=dtype)
    x.attach_grad()
    with autograd.record():
        y = _builtin(name, params, x, mx.nd.array(rois, ctx=mx.gpu(0), dtype=dtype))
    y.backward(mx.nd.array(grad, ctx=mx.gpu(0), dtype=dtype))
    close(out, y.asnumpy(), dtype, f"{name} forward vs CUDA built-in")
    close(dg, x.grad.asnumpy(), dtype, f"{name} data grad vs CUDA built-in")


@pytest.mark.slow
@pytest.mark.parametrize("name,params", [
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2)),
    ("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=1.0))], ids=["ROIAlign", "ROIPooling"])
def test_past_2_31_elements(name, params):
    """float16 data of 33 * 8192 * 8000 > 2^31 elements: rois reading the last channel's
    far corner must see the right values (64-bit indexing), forward and backward.  The
    expected values come from the CPU path on that channel alone (the ops are per channel)."""
    N, C, H, W = 1, 33, 8192, 8000
    assert N * C * H * W > 2 ** 31
    rng = np.random.default_rng(4)
    corner = rng.standard_normal((1, 1, 64, 64)).astype(np.float16)
    # spatial_scale 1: float16 coordinates near 8000 are multiples of 4, all exact here
    rois = np.array([[0, W - 60, H - 60, W - 4, H - 4],
                     [0, W - 40, H - 52, W - 8, H - 12]], np.float16)
    x = mx.nd.zeros((N, C, H, W), ctx=mx.gpu(0), dtype=np.float16)
    x[:, C - 1:, H - 64:, W - 64:] = mx.nd.array(corner, ctx=mx.gpu(0), dtype=np.float16)
    x.attach_grad()
    with autograd.record():
        y = mx.nd.Custom(x, mx.nd.array(rois, ctx=mx.gpu(0), dtype=np.float16), op_type=name,
                         **params)
    grad = rng.standard_normal(y.shape).astype(np.float16)
    y.backward(mx.nd.array(grad, ctx=mx.gpu(0), dtype=np.float16))
    out_last = y.asnumpy()[:, C - 1]
    g_last = x.grad[:, C - 1:, H - 64:, W - 64:].asnumpy()
    # CPU reference on a (1, 1, 64, 64) crop: shift the boxes into the crop
    crop = rois.astype(np.float64).copy()
    crop[:, [1, 3]] -= W - 64
    crop[:, [2, 4]] -= H - 64
    out_c, dg_c, _ = run(mx.cpu(), name, params, corner, crop.astype(np.float16),
                         grad[:, C - 1:C])
    close(out_last, out_c[:, 0], np.float16, "forward past 2^31")
    close(g_last, dg_c, np.float16, "data grad past 2^31")
