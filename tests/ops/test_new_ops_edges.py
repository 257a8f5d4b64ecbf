"""Edges of the issue-35 ops (RROIAlign, DeformablePSROIPooling, PrRoIPool) and of the
issue-34 host pieces (``ndio.array_info`` / ``zero_host``) that the broader suites let
hand-planted bugs slip past (issue 41 item 4): the native walks' per-thread caches across
calls, exact bounds of the adaptive grid and of the parameters, fixed ``sampling_ratio=1``,
samples exactly on the map border, the shape and dtype rules of rois and trans, the fused
offsets' gradient, deterministic mode on the emulated GPU kernels, the NumPy backend
against the compiled kernels in float64, and the raw memory helpers on every dtype.  Each
test names the planted bug it was seen to fail on."""
import numpy as np
import pytest

import mxnet as mx
from mxnet.base import MXNetError

import mx_roi
from mx_roi import geometry, ndio
from tests.ops.base import make_data, run_custom
from tests.ops.test_prroi_pool import reference_backward as prroi_backward, \
    reference_forward as prroi_forward
from tests.ops.test_rroi_align import reference_backward as rroi_backward, \
    reference_forward as rroi_forward

GARBAGE = 7.25


def _close(got, want, what, tol=1e-5):
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol,
                               err_msg=what)


def _rroi_check(x, rois, what, **params):
    P = tuple(params["pooled_size"])
    grad = np.random.default_rng(3).standard_normal((rois.shape[0], x.shape[1]) + P)
    out, dg, _ = run_custom("RROIAlign", x, rois, params, grad=grad.astype(x.dtype),
                            grad_fill=GARBAGE)
    args = (P, params["spatial_scale"], params.get("sampling_ratio", -1),
            params.get("aligned", False), params.get("clockwise", False))
    _close(out, rroi_forward(x, rois, *args), f"RROIAlign output {what}")
    _close(dg, rroi_backward(x, rois, grad, *args), f"RROIAlign data gradient {what}")


# ---- RROIAlign ---------------------------------------------------------------------
def test_rroi_calls_with_the_same_rois_and_another_scale_or_width():
    """The native walk keeps a launch's samples per thread, keyed by the rois' bytes and
    every parameter; a call that changes only ``spatial_scale`` or only the map's width
    must not reuse them (planted: the scale or W left out of the key)."""
    rng = np.random.default_rng(0)
    rois = np.array([[0, 6.0, 5.0, 7.0, 4.0, 30.0], [0, 3.0, 4.0, 5.0, 3.0, -60.0]],
                    np.float32)
    for scale, W in ((1.0, 9), (0.5, 9), (1.0, 9), (1.0, 12), (1.0, 9)):
        x = make_data(rng, (1, 3, 8, W), np.float32)
        _rroi_check(x, rois, f"scale {scale}, W {W}", pooled_size=(2, 3),
                    spatial_scale=scale, sampling_ratio=2)


def test_rroi_sampling_ratio_one():
    """``sampling_ratio=1``: one sample per bin, not the adaptive grid (planted: ratio
    > 1 taken as fixed)."""
    rng = np.random.default_rng(1)
    x = make_data(rng, (1, 2, 9, 10), np.float64)
    rois = np.array([[0, 5.0, 4.0, 8.0, 6.0, 25.0], [0, 4.0, 5.0, 6.0, 7.0, 100.0]])
    _rroi_check(x, rois, "sampling_ratio=1", pooled_size=(2, 2), spatial_scale=1.0,
                sampling_ratio=1)


def test_rroi_sampling_ratio_bound_is_inclusive():
    """1024 samples per bin side (2^20 per bin) is allowed, 1025 refused (planted: the
    bound made exclusive)."""
    from mx_roi.operators.rroi_align import RROIAlignParam
    side = int(geometry.MAX_ROTATED_SAMPLES ** 0.5)
    assert RROIAlignParam.from_kwargs(pooled_size=(1, 1), spatial_scale=1.0,
                                      sampling_ratio=side).sampling_ratio == side
    with pytest.raises(ValueError, match="'sampling_ratio': expected at most 1024"):
        RROIAlignParam.from_kwargs(pooled_size=(1, 1), spatial_scale=1.0,
                                   sampling_ratio=side + 1)


def test_rroi_adaptive_grid_bound_is_exact_and_per_axis():
    """With ``sampling_ratio <= 0`` a box needing exactly 2^20 samples per bin runs, one
    cell more is refused naming the roi; pooled (1, 3) makes ceil(h / P) * ceil(w / Q)
    differ from the transposed ceil(h / Q) * ceil(w / P) (planted: ``>=`` for ``>``, P and
    Q swapped)."""
    from mx_roi.operators.rroi_align import RROIAlign, RROIAlignParam
    x = np.ones((1, 1, 4, 4), np.float32)
    ok = np.array([[0, 2.0, 2.0, 3072.0, 1024.0, 0.0]], np.float32)   # 1024 * 1024
    # (the check alone: a forward of 2^20 samples a bin is slow on the NumPy backend)
    op = RROIAlign(RROIAlignParam.from_kwargs(pooled_size=(1, 3), spatial_scale=1.0))
    op.check_inputs(x.shape, x.dtype, ok, np)
    bad = np.array([[0, 2.0, 2.0, 3.0, 3.0, 0.0], [0, 2.0, 2.0, 3073.0, 1024.0, 0.0]],
                   np.float32)                                         # 1025 * 1024
    with pytest.raises((MXNetError, ValueError), match=r"RROIAlign: rois\[1\] is a box of "
                       r"3073 x 1024: 1\.05e\+06 samples per bin"):
        mx_roi.nd.RROIAlign(mx.nd.array(x), mx.nd.array(bad), (1, 3), 1.0, -1).asnumpy()


# ---- PrRoIPool ---------------------------------------------------------------------
def test_prroi_consecutive_single_roi_calls():
    """The native forward keeps one roi's bins per thread; a new call with another box at
    the same roi index must not read the last call's (planted: the per-call reset
    dropped)."""
    rng = np.random.default_rng(2)
    x = make_data(rng, (1, 3, 7, 8), np.float32)
    for box in ((1.0, 1.0, 5.0, 4.0), (0.5, 2.0, 6.5, 6.0), (1.0, 1.0, 5.0, 4.0)):
        rois = np.array([(0,) + box], np.float32)
        grad = rng.standard_normal((1, 3, 2, 2)).astype(np.float32)
        out, dg, _ = run_custom("PrRoIPool", x, rois, dict(pooled_size=(2, 2),
                                                           spatial_scale=1.0),
                                grad=grad, grad_fill=GARBAGE, rois_req="null")
        _close(out, prroi_forward(x, rois, (2, 2), 1.0), f"PrRoIPool output {box}")
        _close(dg, prroi_backward(x, rois, grad, (2, 2), 1.0), f"PrRoIPool gradient {box}")


# ---- ndio: the raw memory helpers --------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_array_info_gives_address_shape_and_dtype(dtype):
    a = mx.nd.array(np.arange(2 * 3 * 5).reshape(2, 3, 5), dtype=dtype)
    addr, shape, dt = ndio.array_info(a)
    assert shape == (2, 3, 5) and dt == np.dtype(dtype) and addr
    assert ndio.array_info(mx.nd.ones((4,), dtype=dtype))[1] == (4,)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "uint8"])
def test_zero_host_zeroes_every_element_and_nothing_else(dtype):
    """All of the array, in its own dtype's bytes (planted: a fixed element size; the
    untaken-dtype fallback dropped), and not the array next to it."""
    whole = mx.nd.full((2, 3, 5), 3, dtype=dtype)
    part = whole[1]                      # a view into the second half
    ndio.zero_host(part)
    got = whole.asnumpy()
    assert (got[1] == 0).all() and (got[0] == 3).all()
    one = mx.nd.full((7,), 5, dtype=dtype)
    ndio.zero_host(one)
    assert (one.asnumpy() == 0).all()


# ---- DeformablePSROIPooling --------------------------------------------------------
def test_deformable_samples_exactly_on_the_map_border():
    """Samples exactly at -0.5 and at W - 0.5 / H - 0.5 count (MXNet: ``w < -0.5 || w >
    width - 0.5`` is outside): boxes whose first sample lands on each border, against the
    built-in bit for bit (planted: either comparison made strict)."""
    from tests.ops.test_deformable_psroi_pooling import assert_bits, builtin, run
    H, W = 5, 6
    params = dict(spatial_scale=1.0, output_dim=2, group_size=1, pooled_size=2,
                  sample_per_part=2, no_trans=True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, H, W))
    rois = np.array([[0, 0, 0, 3, 2],          # first samples at x = -0.5, y = -0.5
                     [0, W, 1, W + 3, 3],      # first column of samples at x = W - 0.5
                     [0, 1, H, 4, H + 2],      # first row at y = H - 0.5
                     [0, W, H, W + 1, H + 1]], np.float64)
    grad = rng.standard_normal((4, 2, 2, 2))
    got, want = run(mx_roi.nd.DeformablePSROIPooling, params, x, rois, None, grad), \
        run(builtin, params, x, rois, None, grad)
    for name, a, b in zip(("output", "data grad"), got[:2], want[:2]):
        assert_bits(a, b, name)
    assert (got[0][1:] != 0).any(axis=(1, 2, 3)).all()   # every border roi reads the map


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_deformable_trans_at_the_guard_bound_is_refused(dtype):
    """An offset of +-GUARD_BOUND is what the oneDNN guard makes of an infinite one: refused
    like inf (planted: only NaN / inf checked), and the next call works."""
    from mx_roi.onednn import GUARD_BOUND
    from tests.ops.test_deformable_psroi_pooling import CASES, builtin, problem
    params, K = CASES[0]
    x, rois, trans, _ = problem(params, K, dtype)
    t = trans.copy()
    t[2, 1, 0, 1] = -GUARD_BOUND
    X, R = mx.nd.array(x, dtype=dtype), mx.nd.array(rois, dtype=dtype)
    with pytest.raises((MXNetError, ValueError), match=r"DeformablePSROIPooling: "
                       r"trans\[2, 1, 0, 1\] is -3(\.0+\d*)?e\+38; offsets must be finite"):
        mx_roi.nd.DeformablePSROIPooling(X, R, mx.nd.array(t, dtype=dtype),
                                         **params).asnumpy()
    T = mx.nd.array(trans, dtype=dtype)
    np.testing.assert_array_equal(mx_roi.nd.DeformablePSROIPooling(X, R, T, **params).asnumpy(),
                                  builtin(X, R, T, **params).asnumpy())


@pytest.mark.parametrize("cols", [4, 6])
def test_deformable_rois_need_exactly_five_columns(cols):
    """rois (R, 4) and (R, 6) are refused by the shape rule, naming the op and the shape
    (planted: only too few columns refused)."""
    x = np.zeros((1, 2, 4, 4), np.float32)
    rois = np.zeros((3, cols), np.float32)
    with pytest.raises((MXNetError, ValueError), match=r"DeformablePSROIPooling: rois must "
                       rf"have shape \(R, 5\) = \(batch_index, x1, y1, x2, y2\), got \(3, "
                       rf"{cols}\)"):
        mx_roi.nd.DeformablePSROIPooling(mx.nd.array(x), mx.nd.array(rois), spatial_scale=0.5,
                                         output_dim=2, group_size=1, pooled_size=2,
                                         no_trans=True).asnumpy()


# ---- the NumPy backend and the compiled kernels, float64, a scale float32 cannot hold --
def _float64_case(op_type, rng):
    x = make_data(rng, (2, 8, 9, 11), np.float64)
    if op_type == "RROIAlign":
        rois = np.array([[0, 30.0, 40.0, 50.0, 30.0, 33.0], [1, 60.0, 20.0, 40.0, 70.0, -120.0],
                         [1, 10.0, 80.0, 90.0, 20.0, 179.0]])
        return x, rois, [], dict(pooled_size=(2, 3), spatial_scale=0.1, sampling_ratio=-1)
    rois = np.array([[0, 12.0, 7.0, 75.0, 61.0], [1, -9.0, 22.0, 44.0, 95.0],
                     [1, 33.0, 3.0, 119.0, 40.0]])
    if op_type == "PrRoIPool":
        return x, rois, [], dict(pooled_size=(3, 2), spatial_scale=0.1)
    trans = rng.uniform(-1, 1, (3, 4, 2, 2))
    return x, rois, [trans], dict(spatial_scale=0.1, output_dim=2, group_size=2,
                                  pooled_size=3, part_size=2, sample_per_part=2,
                                  trans_std=0.3)


@pytest.mark.parametrize("op_type", ["RROIAlign", "PrRoIPool", "DeformablePSROIPooling"])
def test_numpy_backend_equals_the_compiled_kernels_in_float64(op_type, monkeypatch):
    """Both implementations of each op round ``spatial_scale`` (and ``trans_std``) to
    float32 first, as MXNet does: with scale 0.1 the outputs and every gradient agree to
    float64 rounding, where an unrounded scale is ~1e-9 off (planted: PrRoIPool's NumPy
    rois gradient scaled by the float64 value)."""
    from mxnet import autograd
    rng = np.random.default_rng(5)
    x, rois, extra, params = _float64_case(op_type, rng)
    results, chosen, real = {}, [], mx_roi.backends.select
    monkeypatch.setattr(mx_roi.backends, "select",
                        lambda ctx, op=None: chosen.append(real(ctx, op)) or chosen[-1])
    for kind in ("numpy", "native"):
        monkeypatch.setenv("MX_ROI_BACKEND", kind)
        del chosen[:]
        ins = [mx.nd.array(a, dtype=np.float64) for a in [x, rois] + extra]
        for a in ins:
            a.attach_grad()
        with autograd.record():
            y = mx.nd.Custom(*ins, op_type=op_type, **params)
        y.backward(mx.nd.array(np.linspace(-1, 1, y.size).reshape(y.shape), dtype=np.float64))
        results[kind] = [y.asnumpy()] + [a.grad.asnumpy() for a in ins]
        assert chosen and set(chosen) == {kind}, f"ran on {sorted(set(chosen))}, not {kind}"
    for name, a, b in zip(("output", "data grad", "rois grad", "trans grad"),
                          results["numpy"], results["native"]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * max(1, np.abs(b).max()),
                                   err_msg=f"{op_type} {name}: numpy vs native")
    assert np.abs(results["native"][0]).max() > 0


def test_deformable_part_finer_than_the_bins_with_one_class_per_channel():
    """K = output_dim and part_size > pooled_size: each bin has its own part cell, yet
    some cells belong to no bin, so the offsets' gradient is not the fused pass's (which
    writes only the cells of bins): every untouched cell must be exactly 0, as the
    built-in's, for every call (planted: the fusion test without ``part == pooled``)."""
    from tests.ops.test_deformable_psroi_pooling import assert_bits, builtin, problem, run
    params = dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=2, part_size=5,
                  sample_per_part=2, trans_std=0.4)
    for seed in range(3):
        x, rois, trans, grad = problem(params, 2, np.float32, seed=seed)
        got = run(mx_roi.nd.DeformablePSROIPooling, params, x, rois, trans, grad)
        want = run(builtin, params, x, rois, trans, grad)
        for name, a, b in zip(("output", "data grad", "trans grad"), got, want):
            assert_bits(a, b, f"{name}, seed {seed}")


def test_deformable_deterministic_backward_on_the_emulated_gpu_kernels(monkeypatch):
    """``deterministic=True`` takes the fixed-point accumulation of the GPU kernels (run
    here by the emulation; the native build ignores the flag): both gradients equal the
    built-in's to float32 rounding, and two runs give the same bits (planted: the
    fixed-point scale of one tap halved)."""
    from tests.ops.test_deformable_psroi_pooling import CASES, builtin, problem, run
    monkeypatch.setenv("MX_ROI_BACKEND", "emulated-cuda")
    for params, K in (CASES[0], CASES[5]):
        x, rois, trans, grad = problem(params, K, np.float32)
        det = dict(params, deterministic=True)
        got = run(mx_roi.nd.DeformablePSROIPooling, det, x, rois, trans, grad)
        again = run(mx_roi.nd.DeformablePSROIPooling, det, x, rois, trans, grad)
        want = run(builtin, params, x, rois, trans, grad)
        for name, a, b, c in zip(("output", "data grad", "trans grad"), got, again, want):
            np.testing.assert_array_equal(a, b, err_msg=f"deterministic {name}: two runs")
            np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5 * max(1, np.abs(c).max()),
                                       err_msg=f"deterministic {name}")


def test_deformable_trans_of_another_dtype_is_refused():
    """trans float64 with float32 data (or the reverse) is refused naming both dtypes, not
    read as the data's type: by MXNet's type inference (the registry's ``infer_type``) and
    by the op's own input check, which a call that skips the inference meets (planted:
    only a narrower trans refused by the op's check)."""
    from mx_roi.operators.deformable_psroi_pooling import DeformablePSROIPooling as Op, \
        DeformablePSROIPoolingParam
    from tests.ops.test_deformable_psroi_pooling import CASES, problem
    params, K = CASES[0]
    x, rois, trans, _ = problem(params, K, np.float32)
    op = Op(DeformablePSROIPoolingParam.from_kwargs(**params))
    for xd, td in ((np.float32, np.float64), (np.float64, np.float32)):
        match = (r"DeformablePSROIPooling: data and trans must have the same dtype, got data "
                 rf"{np.dtype(xd).name} and trans {np.dtype(td).name}")
        with pytest.raises(TypeError, match=match):
            op.check_extra_inputs(x.shape, np.dtype(xd), rois.astype(xd), [trans.astype(td)],
                                  np)
        with pytest.raises((MXNetError, TypeError), match=match):
            mx.nd.Custom(mx.nd.array(x, dtype=xd), mx.nd.array(rois, dtype=xd),
                         mx.nd.array(trans, dtype=td), op_type="DeformablePSROIPooling",
                         **params).asnumpy()


def test_rroi_fixed_sampling_ratio_takes_any_box_size():
    """The adaptive grid's size bound does not apply to a fixed ``sampling_ratio`` (1
    included): a box 10^7 cells wide runs and equals the reference (planted: the check
    skipped only for ratios > 1)."""
    rng = np.random.default_rng(6)
    x = make_data(rng, (1, 2, 6, 7), np.float64)
    rois = np.array([[0, 3.0, 3.0, 1e7, 2e7, 10.0], [0, 3.0, 2.0, 4.0, 3.0, 0.0]])
    _rroi_check(x, rois, "huge box, sampling_ratio=1", pooled_size=(2, 2),
                spatial_scale=1.0, sampling_ratio=1)


@pytest.mark.parametrize("last", [1, 3])
def test_deformable_trans_last_axis_must_be_part_size(last):
    """trans (R, 2K, part, part') with part' != part is refused by the shape rule, not read
    with the wrong stride (planted: only the third axis compared)."""
    from tests.ops.test_deformable_psroi_pooling import CASES, problem
    params, K = CASES[0]                                   # part_size 2, R 12, K 3
    x, rois, trans, _ = problem(params, K, np.float32)
    bad = np.zeros((12, 6, 2, last), np.float32)
    with pytest.raises((MXNetError, ValueError), match=r"DeformablePSROIPooling: trans must "
                       rf"have shape .* got \(12, 6, 2, {last}\)"):
        mx_roi.nd.DeformablePSROIPooling(mx.nd.array(x), mx.nd.array(rois), mx.nd.array(bad),
                                         **params).asnumpy()


@pytest.mark.parametrize("rows, ratio", [(2, 2), (4, 1)])
def test_rroi_large_pool_keeps_no_tables_and_gives_the_same_bits(rows, ratio, monkeypatch):
    """A (600, 600) pool: 2 rois of 360,000 bins x 4 samples (one roi over the kept-tap
    bound, MX_ROI_ROTATED_CACHE) and 4 rois of 360,001 bin starts (the launch over it)
    take the native walk's direct path, which derives a bin's samples again per pass:
    output and data gradient bit-equal to emulated-cuda's generic loop (planted: a sample
    skipped or taken twice in the direct loop)."""
    from mxnet import autograd
    rng = np.random.default_rng(11)
    x = make_data(rng, (1, 3, 8, 9), np.float32)
    rois = np.array([[0, 4.0, 4.0, 6.0, 5.0, 30.0], [0, 3.0, 5.0, 4.0, 3.0, -60.0],
                     [0, 5.0, 3.0, 3.0, 6.0, 90.0], [0, 4.5, 4.0, 8.0, 7.0, 10.0]][:rows],
                    np.float32)
    params = dict(pooled_size=(600, 600), spatial_scale=1.0, sampling_ratio=ratio)
    results = {}
    for kind in ("native", "emulated-cuda"):
        monkeypatch.setenv("MX_ROI_BACKEND", kind)
        xs = mx.nd.array(x)
        xs.attach_grad()
        with autograd.record():
            y = mx.nd.Custom(xs, mx.nd.array(rois), op_type="RROIAlign", **params)
        y.backward(mx.nd.array(np.linspace(-1, 1, y.size, dtype=np.float32).reshape(y.shape)))
        results[kind] = (y.asnumpy(), xs.grad.asnumpy())
    for a, b, what in zip(results["native"], results["emulated-cuda"], ("output", "gradient")):
        assert a.tobytes() == b.tobytes(), what
    assert np.abs(results["native"][0]).max() > 0


_LARGE_ROTATED_POOL = """
import resource, sys
import numpy as np, mxnet as mx, mx_roi
from mx_roi import ext
x = mx.nd.array(np.random.default_rng(0).random((1, 1, 6, 7), dtype=np.float32))
x.attach_grad()
rois = mx.nd.array([[0, 3, 3, 4, 4, 30]])
kw = dict(pooled_size=(3000, 3000), spatial_scale=1.0, sampling_ratio=2)
call = (lambda: mx.nd.mx_roi_RROIAlign(x, rois, **kw)) if sys.argv[1] == 'native' else \\
    (lambda: mx.nd.Custom(x, rois, op_type='RROIAlign', **kw))
if sys.argv[1] == 'native':
    ext.load()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with mx.autograd.record():
    y = call()
y.backward()
x.grad.wait_to_read()
print('GROWTH_MB', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.parametrize("door", ["native", "custom"])
def test_rroi_large_pool_memory_stays_near_the_output(door):
    """RROIAlign (3000, 3000) over one roi, a training step in a child process on the
    native backend, through either door: the process grows by about its 36 MB output,
    out-grad and gradient, not by kept sample tables (before: 9M bin starts and 36M taps
    per thread, gigabytes; a fuzz child was killed by the OOM killer)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if door == "native":
        from mx_roi import ext
        if ext.unavailable_reason():
            pytest.skip(ext.unavailable_reason())
    res = subprocess.run([sys.executable, "-c", _LARGE_ROTATED_POOL, door],
                         capture_output=True, text=True, cwd=root, timeout=600,
                         env={**os.environ, "PYTHONPATH": root, "MX_ROI_BACKEND": "native"})
    assert res.returncode == 0, res.stderr[-2000:]
    growth = float(res.stdout.split("GROWTH_MB")[1])
    assert growth < 400, growth
