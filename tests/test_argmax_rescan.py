"""A max op's backward without a kept argmax (the ``*_rescan`` kernels).

Past :data:`~mx_roi.cuda.backend.ARGMAX_KEEP_MAX_ELEMENTS` output elements a training
forward of ROIPooling / max ROIAlign keeps no argmax, and the backward finds every bin's
winner again in the data.  The threshold is lowered here so small problems take that
path; the gradient must be the kept-argmax gradient bit for bit (same winners, same sums
in the same order), for each kernel build, dtype and ``req``.
"""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mx_roi.cuda import backend as B
from mx_roi.cuda import loader
from mx_roi.cuda.backend import CudaBackend, Launch
from mx_roi.ndio import Kind
from mx_roi.registry import get_op
from tests.ops.base import adversarial_rois, make_data

CASES = [
    ("ROIPooling", dict(pooled_size=(3, 2), spatial_scale=0.5)),
    ("ROIAlign", dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2, pool_mode="max")),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=-1, aligned=True,
                      pool_mode="max")),
    ("ROIAlign", dict(pooled_size=(3, 3), spatial_scale=0.5, legacy="caffe")),
]
IDS = ["ROIPooling", "max", "max-aligned-adaptive", "caffe"]
BACKENDS = {"native": CudaBackend(Kind.NATIVE), "emulated": CudaBackend(Kind.EMULATED)}
# the checked path's kept / rescanned argmax; the extension library's launcher always
# rescans (tests/test_library_calls.py compares it with the checked path)
BACKENDS["native"].library_calls = False
RESCAN = {"ROIPooling": "roi_pooling_backward_rescan",
          "ROIAlign": "roi_align_backward_max_rescan"}


@pytest.fixture(autouse=True)
def _threads_even_for_small_launches(monkeypatch):
    monkeypatch.setenv("MX_ROI_MIN_ITEMS_PER_THREAD", "1")


def make_op(name, params):
    cls = get_op(name)
    return cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))


def problem(op, dtype, seed, channels=18):
    """18 channels (a 16-lane pass and a partial one), ties, NaN and -inf cells, rois
    inside, across and off the map, padding rois."""
    rng = np.random.default_rng(seed)
    N, H, W = 2, 9, 11
    data = make_data(rng, (N, channels, H, W), dtype)
    data = (np.round(data * 2) / 2).astype(dtype)  # ties
    data[rng.random(data.shape) < 0.05] = np.nan
    data[rng.random(data.shape) < 0.03] = -np.inf
    rois = adversarial_rois(rng, N, H, W, op.param.spatial_scale, n_random=6, dtype=dtype)
    grad = make_data(rng, op.out_shape(data.shape, rois.shape), dtype)
    return data, rois, grad


def nd(a):
    return mx.nd.array(a, dtype=a.dtype)


def train(backend, op, data, rois, grad, req, init, launched=None):
    """Training forward + backward; (output, kept value, data gradient); the kernels
    launched are appended to ``launched``."""
    out = nd(np.full(op.out_shape(data.shape, rois.shape), 7.0, data.dtype))
    x, r = nd(data), nd(rois)
    real = Launch._launch

    def spy(self, expr, n, args):
        if launched is not None:
            launched.append(expr.split("<")[0])
        return real(self, expr, n, args)

    Launch._launch = spy
    try:
        saved = backend.forward(op, "write", x, r, out, keep=True)
        dgrad = nd(init.copy())
        backend.backward(op, req, nd(grad), x, r, dgrad, saved)
    finally:
        Launch._launch = real
    return out.asnumpy(), getattr(saved, "value", saved), dgrad.asnumpy()


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
@pytest.mark.parametrize("kind", ["native", "emulated"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_rescan_backward_is_the_kept_argmax_backward(name, params, kind, dtype, monkeypatch):
    backend = BACKENDS[kind]
    op = make_op(name, params)
    data, rois, grad = problem(op, dtype, seed=len(name) + np.dtype(dtype).itemsize)
    for req in ("write", "add"):
        init = np.full(data.shape, 0.25 if req == "add" else np.nan, dtype)
        monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", grad.size)
        kept_calls = []
        out_kept, arg, want = train(backend, op, data, rois, grad, req, init, kept_calls)
        assert arg is not None and arg.size == grad.size  # at the threshold: kept
        assert RESCAN[name] not in kept_calls
        monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", grad.size - 1)
        calls = []
        out, arg, got = train(backend, op, data, rois, grad, req, init, calls)
        what = f"{kind} {np.dtype(dtype).name} req={req}"
        assert arg is None, what  # nothing kept ...
        # the forward, then the rescan backward (emulated-cuda: each after the device
        # geometry kernel, and again on host tables where a box needs wider ones)
        ops = [c for c in calls if not c.endswith("_geometry")]
        k = ops.index(RESCAN[name])
        assert set(ops[k:]) == {RESCAN[name]} and len(set(ops[:k])) == 1 and \
            "forward" in ops[0], (what, calls)
        assert np.array_equal(bits(out), bits(out_kept)), what
        assert np.array_equal(bits(got), bits(want)), what  # ... the same gradient
        assert np.count_nonzero(want != init) > 10, what  # (winners exist)


@pytest.mark.parametrize("name,params", CASES[:2], ids=IDS[:2])
@pytest.mark.parametrize("threads", [1, 3])
def test_rescan_native_every_thread_count_and_partial_pass(name, params, threads, monkeypatch):
    """40 channels (two full 16-lane passes and a partial one per thread block): native
    rescan == kept argmax == emulation, on 1 and 3 threads."""
    monkeypatch.setenv("MX_ROI_NUM_THREADS", str(threads))
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float32, seed=threads, channels=40)
    init = np.full(data.shape, np.nan, np.float32)
    monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", grad.size)
    _, _, want = train(BACKENDS["emulated"], op, data, rois, grad, "write", init)
    monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", 0)
    _, arg, got = train(BACKENDS["native"], op, data, rois, grad, "write", init)
    assert arg is None
    assert np.array_equal(bits(got), bits(want))


def test_rescan_deterministic_fixed_point_emulation(monkeypatch):
    """The deterministic (fixed-point) accumulation with the rescan kernel: the kept
    argmax's result."""
    params = dict(CASES[1][1], deterministic=True)
    op = make_op("ROIAlign", params)
    data, rois, grad = problem(op, np.float32, seed=5)
    init = np.zeros(data.shape, np.float32)
    _, _, want = train(BACKENDS["emulated"], op, data, rois, grad, "write", init)
    monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", 0)
    calls = []
    _, _, got = train(BACKENDS["emulated"], op, data, rois, grad, "write", init, calls)
    assert calls[-1] == RESCAN["ROIAlign"]
    assert np.array_equal(bits(got), bits(want))


def test_inference_forward_stores_nothing_and_small_training_calls_keep_the_argmax():
    op = make_op(*CASES[0])
    data, rois, grad = problem(op, np.float32, seed=3)
    out = nd(np.zeros(grad.shape, np.float32))
    assert BACKENDS["native"].forward(op, "write", nd(data), nd(rois), out, keep=False) is None
    saved = BACKENDS["native"].forward(op, "write", nd(data), nd(rois), out, keep=True)
    assert saved.value is not None and saved.value.dtype == np.uint8
    assert grad.size <= B.ARGMAX_KEEP_MAX_ELEMENTS < 14 * 14 * 512 * 256  # bench's large call


@pytest.mark.parametrize("name,params", CASES[:2], ids=IDS[:2])
def test_rescan_through_mxnet_training_steps(name, params, monkeypatch):
    """mx.nd + autograd, grad_req add, two steps: the rescan path's outputs and gradient
    are the kept path's, bit for bit."""
    import mx_roi
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float32, seed=11)

    def steps():
        x, r, g = nd(data), nd(rois), nd(grad)
        x.attach_grad(grad_req="add")
        x.grad[:] = 0.5
        outs = []
        for _ in range(2):
            with autograd.record():
                y = getattr(mx_roi.nd, name)(x, r, **params)
            y.backward(g)
            outs.append(y.asnumpy())
        return outs, x.grad.asnumpy()

    want_outs, want = steps()
    monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", 0)
    outs, got = steps()
    for a, b in zip(outs, want_outs):
        assert np.array_equal(bits(a), bits(b))
    assert np.array_equal(bits(got), bits(want))
