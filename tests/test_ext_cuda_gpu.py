"""The native GPU path's launcher (mx_roi.ext.cuda) on a real GPU: CuPy-allocated memory,
a CuPy stream, the launch function through ctypes -- no MXNet GPU code (which cannot run
on Hopper; docs/gpu.md).  Skipped without CuPy and a GPU; **never run yet** (written
without a GPU; tests/test_ext_cuda.py proves the calls against a stand-in libcuda).

ROIAlign's forward, bit for bit against ``emulated-cuda`` (both compiled with
``--fmad=false``; the launcher's PTX without CuPy's ``-ftz=true``, which this data's
float32 values never reach), every dtype and mode, the output pre-filled with NaN,
padding rois, R = 0; the status-word rule on the device: a bad roi's call raises nothing,
its row is zeros, the next call after the stream has finished raises the bad roi's error,
and the call after that works.

ROIAlign's backward (every dtype), every mode, against ``emulated-cuda``'s gradient
(the max modes rescanning, as the launcher does): equal to rounding, not bit for bit --
the GPU's atomic adds meet in any order -- over a gradient pre-filled with NaN; the rois'
gradient zeros; a bad roi raises nothing in the backward and is reported by the next
forward.  ROIPooling's, PSROIPooling's, PSROIAlign's, RROIAlign's, PrRoIPool's and
DeformablePSROIPooling's forward bit for bit and their backward to rounding (PrRoIPool:
the rois' gradient too; DeformablePSROIPooling: the offsets', fused or not), every dtype
(RROIAlign: a NaN roi reported by the next call; DeformablePSROIPooling: a NaN offset)."""
import numpy as np
import pytest

import mxnet as mx

from mx_roi import gpucheck
from mx_roi.backends import get
from mx_roi.opcheck import run as host_run
from mx_roi.registry import get_op

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpucheck.cupy_gpu_count() == 0,
                                 reason="needs CuPy and a GPU")]

N, C, H, W, P = 2, 5, 19, 25, 7
PARAMS = {
    "avg": dict(pooled_size=(P, P), spatial_scale=0.5, sample_ratio=-1, aligned=False),
    "avg_aligned_2": dict(pooled_size=(P, P), spatial_scale=0.5, sample_ratio=2, aligned=True),
    "max": dict(pooled_size=(P, P), spatial_scale=0.5, sample_ratio=-1, pool_mode="max"),
    "caffe": dict(pooled_size=(P, P), spatial_scale=0.5, legacy="caffe"),
}


def problem(dtype, R=6, seed=0):
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((N, C, H, W)).astype(dtype)
    x1, y1 = rng.uniform(0, 40, R), rng.uniform(0, 30, R)
    rois = np.stack([rng.integers(0, N, R), x1, y1, x1 + rng.uniform(1, 20, R),
                     y1 + rng.uniform(1, 16, R)], 1).astype(dtype)
    if R > 2:
        rois[2, 0] = -1  # a padding roi: zeros
    return data, rois


def native_gpu(data, rois, params, stream):
    """ROIAlign's forward through the launcher on ``stream``; (output, the CuPy output)."""
    import cupy
    from mx_roi.ext import cuda
    R = rois.shape[0]
    caffe = params.get("legacy") == "caffe"
    sample = params.get("sample_ratio", -1)
    with stream:
        x, r = cupy.asarray(data), cupy.asarray(rois)
        out = cupy.full((R, C, P, P), np.nan, data.dtype)
        nbytes = cuda.roi_align_workspace(data.dtype, R, P, H, W, sample, caffe)
        ws = cupy.empty(max(nbytes, 16), cupy.uint8)
        stream.synchronize()  # the inputs are in place; the launch itself waits for nothing
        cuda.roi_align_forward(data.dtype, x.data.ptr, r.data.ptr, out.data.ptr, data.shape,
                               R, P, params["spatial_scale"], sample,
                               params.get("aligned", False), params.get("pool_mode", "avg"),
                               caffe, ws.data.ptr, ws.nbytes, stream.ptr)
    return out, (x, r, ws)


def expect_emulation(op, data, rois, out_grad, out, grads, rescan=False, extra=()):
    """The launcher's ``out`` bit for bit and its ``grads`` (CuPy arrays: the data's, each
    ``extra`` input's, then the rois' where the op has one) to rounding -- the atomic adds
    meet in any order -- against ``emulated-cuda`` on the host."""
    import cupy
    want_out, want_grads = host_run(get("emulated-cuda"), op, data, rois, out_grad, mx.cpu(),
                                    rescan=rescan, extra=extra)
    np.testing.assert_array_equal(cupy.asnumpy(out).view(np.uint8),
                                  np.asarray(want_out).view(np.uint8))
    tol = {np.float32: 1e-5, np.float64: 1e-12, np.float16: 2e-3}[np.dtype(data.dtype).type]
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64),
                                   np.asarray(want).astype(np.float64), rtol=tol, atol=tol)


def op_of(params):
    cls = get_op("ROIAlign")
    return cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_forward_bits_equal_emulation(dtype, mode):
    import cupy
    params = PARAMS[mode]
    data, rois = problem(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    out, keep = native_gpu(data, rois, params, stream)
    stream.synchronize()
    op = op_of(params)
    grad = np.ones(op.out_shape(data.shape, rois.shape), dtype)
    want, _ = host_run(get("emulated-cuda"), op, data, rois, grad, mx.cpu())
    got = cupy.asnumpy(out)
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))
    assert not np.any(got[2])  # the padding roi


def test_no_rois_launches_nothing():
    import cupy
    data, rois = problem(np.float32, R=0)
    stream = cupy.cuda.Stream(non_blocking=True)
    out, _ = native_gpu(data, rois, PARAMS["avg"], stream)
    stream.synchronize()
    assert out.shape == (0, C, P, P)


def test_bad_roi_reported_by_the_next_call_then_gone():
    import cupy
    from mx_roi.ext import cuda
    stream = cupy.cuda.Stream(non_blocking=True)
    data, rois = problem(np.float32)
    bad = rois.copy()
    bad[1, 3] = np.nan
    out, keep = native_gpu(data, bad, PARAMS["avg"], stream)  # no error: nothing waited
    stream.synchronize()
    got = cupy.asnumpy(out)
    assert not np.any(got[1])  # the bad roi was padding
    with pytest.raises(cuda.CudaLaunchError, match=r"^ROIAlign: rois\[1\] has a NaN or "
                                                   r"infinite value; coordinates must be finite"):
        native_gpu(data, rois, PARAMS["avg"], stream)
    out, keep = native_gpu(data, rois, PARAMS["avg"], stream)  # reported once: works again
    stream.synchronize()
    op = op_of(PARAMS["avg"])
    want, _ = host_run(get("emulated-cuda"), op, data, rois,
                       np.ones(op.out_shape(data.shape, rois.shape), np.float32), mx.cpu())
    np.testing.assert_array_equal(cupy.asnumpy(out), np.asarray(want))


def test_bad_batch_index_reported_by_check_wait():
    import cupy
    from mx_roi.ext import cuda
    stream = cupy.cuda.Stream(non_blocking=True)
    data, rois = problem(np.float64)
    rois[4, 0] = N  # one past the last image
    kept = native_gpu(data, rois, PARAMS["max"], stream)  # noqa: F841 (alive until checked)
    with pytest.raises(cuda.CudaLaunchError, match=r"^ROIAlign: rois\[4\] has a batch index "
                                                   r"beyond the images of data"):
        cuda.check("ROIAlign", stream.ptr, wait=True)
    cuda.check("ROIAlign", stream.ptr, wait=True)  # nothing left to report


def native_gpu_backward(data, rois, out_grad, params, stream):
    """ROIAlign's backward through the launcher on ``stream``; (data gradient, rois
    gradient, the CuPy arrays to keep alive)."""
    import cupy
    from mx_roi.ext import cuda
    R = rois.shape[0]
    caffe = params.get("legacy") == "caffe"
    sample = params.get("sample_ratio", -1)
    with stream:
        x, r, g = cupy.asarray(data), cupy.asarray(rois), cupy.asarray(out_grad)
        dx = cupy.full(data.shape, np.nan, data.dtype)
        dr = cupy.full(rois.shape, np.nan, rois.dtype)
        nbytes = cuda.roi_align_backward_workspace(data.dtype, data.shape, R, P, sample, caffe)
        ws = cupy.empty(max(nbytes, 16), cupy.uint8)
        stream.synchronize()
        cuda.roi_align_backward(data.dtype, g.data.ptr, x.data.ptr, r.data.ptr, dx.data.ptr,
                                data.shape, R, P, params["spatial_scale"], sample,
                                params.get("aligned", False), params.get("pool_mode", "avg"),
                                caffe, ws.data.ptr, ws.nbytes, stream.ptr, dr.data.ptr)
    return dx, dr, (x, r, g, ws)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_backward_matches_emulation(dtype, mode):
    import cupy
    params = PARAMS[mode]
    data, rois = problem(dtype)
    op = op_of(params)
    out_grad = np.random.default_rng(1).standard_normal(
        op.out_shape(data.shape, rois.shape)).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    dx, dr, keep = native_gpu_backward(data, rois, out_grad, params, stream)
    stream.synchronize()
    _, (want,) = host_run(get("emulated-cuda"), op, data, rois, out_grad, mx.cpu(),
                          rescan=True)
    tol = {np.float32: 1e-5, np.float64: 1e-12, np.float16: 2e-3}[dtype]
    np.testing.assert_allclose(cupy.asnumpy(dx).astype(np.float64), want.astype(np.float64),
                               rtol=tol, atol=tol)
    assert not np.any(cupy.asnumpy(dr))


def test_backward_bad_roi_raises_nothing_then_the_forward_reports_it():
    import cupy
    from mx_roi.ext import cuda
    stream = cupy.cuda.Stream(non_blocking=True)
    data, rois = problem(np.float32)
    bad = rois.copy()
    bad[3, 2] = np.inf
    op = op_of(PARAMS["avg"])
    out_grad = np.ones(op.out_shape(data.shape, rois.shape), np.float32)
    dx, dr, keep = native_gpu_backward(data, bad, out_grad, PARAMS["avg"], stream)
    stream.synchronize()
    assert np.all(np.isfinite(cupy.asnumpy(dx)))  # the bad roi gave no gradient
    with pytest.raises(cuda.CudaLaunchError, match=r"^ROIAlign: rois\[3\] has a NaN or "
                                                   r"infinite value; coordinates must be finite"):
        native_gpu(data, rois, PARAMS["avg"], stream)


# ---- ROIPooling (its own native GPU section) ----------------------------------------------
POOL = dict(pooled_size=(P, P), spatial_scale=0.5)


def native_gpu_pooling(data, rois, stream, out_grad=None):
    """ROIPooling's forward (or, with ``out_grad``, its backward) through the launcher on
    ``stream``: (output or data gradient, the CuPy arrays to keep alive)."""
    import cupy
    from mx_roi.ext import cuda
    R = rois.shape[0]
    backward = out_grad is not None
    with stream:
        x, r = cupy.asarray(data), cupy.asarray(rois)
        nbytes = cuda.roi_pooling_workspace(data.dtype, data.shape, R, P, backward)
        ws = cupy.empty(max(nbytes, 16), cupy.uint8)
        if backward:
            g = cupy.asarray(out_grad)
            res = cupy.full(data.shape, np.nan, data.dtype)
        else:
            g = None
            res = cupy.full((R, C, P, P), np.nan, data.dtype)
        stream.synchronize()
        if backward:
            cuda.roi_pooling_backward(data.dtype, g.data.ptr, x.data.ptr, r.data.ptr,
                                      res.data.ptr, data.shape, R, P, POOL["spatial_scale"],
                                      ws.data.ptr, ws.nbytes, stream.ptr)
        else:
            cuda.roi_pooling_forward(data.dtype, x.data.ptr, r.data.ptr, res.data.ptr,
                                     data.shape, R, P, POOL["spatial_scale"], ws.data.ptr,
                                     ws.nbytes, stream.ptr)
    return res, (x, r, g, ws)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_roi_pooling_forward_bits_and_backward_match_emulation(dtype):
    """The forward bit for bit (a max: no rounding), the backward equal to rounding (the
    atomic adds meet in any order), both against ``emulated-cuda`` rescanning."""
    import cupy
    cls = get_op("ROIPooling")
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in POOL.items()}))
    data, rois = problem(dtype)
    out_grad = np.random.default_rng(2).standard_normal(
        op.out_shape(data.shape, rois.shape)).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    out, keep = native_gpu_pooling(data, rois, stream)
    dx, keep2 = native_gpu_pooling(data, rois, stream, out_grad)
    stream.synchronize()
    expect_emulation(op, data, rois, out_grad, out, [dx], rescan=True)


# ---- the position-sensitive ops (their own native GPU sections) ---------------------------
PS_BASE = dict(pooled_size=(3, 3), spatial_scale=0.5, output_dim=2, group_size=(2, 3))
PS_GPU = {  # case -> (op, parameters); data of output_dim * 2 * 3 = 12 channels
    "PSROIPooling": ("PSROIPooling", PS_BASE),
    "PSROIAlign": ("PSROIAlign", dict(PS_BASE, sample_ratio=-1)),
    "PSROIAlign-aligned-2": ("PSROIAlign", dict(PS_BASE, sample_ratio=2, aligned=True)),
    "PSROIAlign-rfcn": ("PSROIAlign", dict(PS_BASE, legacy="rfcn", sample_num=3)),
}


def native_gpu_ps(name, params, data, rois, stream, out_grad=None):
    """A position-sensitive op's forward (or, with ``out_grad``, its backward) through the
    launcher on ``stream``: (output or data gradient, the CuPy arrays to keep alive)."""
    import cupy
    from mx_roi.ext import cuda
    R = rois.shape[0]
    backward = out_grad is not None
    kw = dict(params)
    pooled, D, scale = kw.pop("pooled_size"), kw.pop("output_dim"), kw.pop("spatial_scale")
    if name == "PSROIPooling":
        nbytes = cuda.psroi_pooling_workspace(data.dtype, data.shape, R, pooled, D, backward)
        fwd, bwd = cuda.psroi_pooling_forward, cuda.psroi_pooling_backward
    else:
        nbytes = cuda.psroi_align_workspace(data.dtype, data.shape, R, pooled, D,
                                            kw.get("sample_ratio", -1), kw.get("legacy", ""),
                                            kw.get("sample_num", 2), backward)
        fwd, bwd = cuda.psroi_align_forward, cuda.psroi_align_backward
    with stream:
        x, r = cupy.asarray(data), cupy.asarray(rois)
        ws = cupy.empty(max(nbytes, 16), cupy.uint8)
        g = cupy.asarray(out_grad) if backward else None
        res = cupy.full(data.shape if backward else (R, D) + tuple(pooled), np.nan, data.dtype)
        stream.synchronize()
        common = dict(workspace=ws.data.ptr, workspace_bytes=ws.nbytes, stream=stream.ptr,
                      **kw)
        if backward:
            bwd(data.dtype, g.data.ptr, r.data.ptr, res.data.ptr, data.shape, R, pooled, D,
                scale, **common)
        else:
            fwd(data.dtype, x.data.ptr, r.data.ptr, res.data.ptr, data.shape, R, pooled, D,
                scale, **common)
    return res, (x, r, g, ws)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", sorted(PS_GPU))
def test_position_sensitive_forward_bits_and_backward_match_emulation(case, dtype):
    """PSROIPooling's and PSROIAlign's forward bit for bit (each bin's sum in the
    kernel's order), the backward equal to rounding (atomic adds), against
    ``emulated-cuda``; the channel map made on the device; padding rois."""
    import cupy
    name, params = PS_GPU[case]
    cls = get_op(name)
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))
    _, rois = problem(dtype)
    data = np.random.default_rng(3).standard_normal((N, 12, H, W)).astype(dtype)
    out_grad = np.random.default_rng(4).standard_normal(
        op.out_shape(data.shape, rois.shape)).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    out, keep = native_gpu_ps(name, params, data, rois, stream)
    dx, keep2 = native_gpu_ps(name, params, data, rois, stream, out_grad)
    stream.synchronize()
    expect_emulation(op, data, rois, out_grad, out, [dx])


# ---- RROIAlign (its kernels read the rois: the checked copy first) ------------------------
RROI_GPU = {
    "adaptive": dict(pooled_size=(3, 3), spatial_scale=0.5, sampling_ratio=-1),
    "fixed-aligned-clockwise": dict(pooled_size=(3, 3), spatial_scale=0.5, sampling_ratio=2,
                                    aligned=True, clockwise=True),
}


def rotated(dtype, R=6):
    """(R, 6) rotated boxes from problem()'s, a padding roi at 2."""
    _, r = problem(np.float64, R)
    angle = np.random.default_rng(5).uniform(-180, 180, R)
    return np.stack([r[:, 0], (r[:, 1] + r[:, 3]) / 2, (r[:, 2] + r[:, 4]) / 2,
                     r[:, 3] - r[:, 1], r[:, 4] - r[:, 2], angle], 1).astype(dtype)


def native_gpu_rroi(params, data, rois, stream, out_grad=None):
    import cupy
    from mx_roi.ext import cuda
    R = rois.shape[0]
    backward = out_grad is not None
    kw = dict(params)
    pooled, scale = kw.pop("pooled_size"), kw.pop("spatial_scale")
    with stream:
        x, r = cupy.asarray(data), cupy.asarray(rois)
        ws = cupy.empty(max(cuda.rroi_align_workspace(data.dtype, data.shape, R, backward),
                            16), cupy.uint8)
        g = cupy.asarray(out_grad) if backward else None
        res = cupy.full(data.shape if backward else (R, data.shape[1]) + tuple(pooled),
                        np.nan, data.dtype)
        stream.synchronize()
        common = dict(workspace=ws.data.ptr, workspace_bytes=ws.nbytes, stream=stream.ptr,
                      **kw)
        if backward:
            cuda.rroi_align_backward(data.dtype, g.data.ptr, r.data.ptr, res.data.ptr,
                                     data.shape, R, pooled, scale, **common)
        else:
            cuda.rroi_align_forward(data.dtype, x.data.ptr, r.data.ptr, res.data.ptr,
                                    data.shape, R, pooled, scale, **common)
    return res, (x, r, g, ws)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", sorted(RROI_GPU))
def test_rroi_align_forward_bits_and_backward_match_emulation(case, dtype):
    """RROIAlign's forward bit for bit and backward to rounding against ``emulated-cuda``
    (on the checked copy of the rois); a NaN roi's call gives zeros for it, raises
    nothing, and the next call on the stream reports it."""
    import cupy
    from mx_roi.ext import cuda
    params = RROI_GPU[case]
    cls = get_op("RROIAlign")
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))
    data, _ = problem(dtype)
    rois = rotated(dtype)
    out_grad = np.random.default_rng(6).standard_normal(
        op.out_shape(data.shape, rois.shape)).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    out, keep = native_gpu_rroi(params, data, rois, stream)
    dx, keep2 = native_gpu_rroi(params, data, rois, stream, out_grad)
    stream.synchronize()
    expect_emulation(op, data, rois, out_grad, out, [dx])
    bad = rois.copy()
    bad[3, 2] = np.nan
    out, keep3 = native_gpu_rroi(params, data, bad, stream)  # raises nothing
    stream.synchronize()
    assert not cupy.asnumpy(out)[3].any()
    with pytest.raises(cuda.CudaLaunchError, match=r"^RROIAlign: rois\[3\] has a NaN"):
        native_gpu_rroi(params, data, rois, stream)
    native_gpu_rroi(params, data, rois, stream)  # the call after the report works
    stream.synchronize()


# ---- PrRoIPool (the checked copy first; the rois' gradient too) ---------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_prroi_pool_forward_bits_and_gradients_match_emulation(dtype):
    """PrRoIPool's forward bit for bit, its data gradient and rois' gradient (each roi's
    one thread: bit for bit too, but compared to rounding as the data's) against
    ``emulated-cuda``."""
    import cupy
    from mx_roi.ext import cuda
    params = dict(pooled_size=(3, 3), spatial_scale=0.5)
    cls = get_op("PrRoIPool")
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))
    data, rois = problem(dtype)
    R = rois.shape[0]
    out_grad = np.random.default_rng(7).standard_normal(
        op.out_shape(data.shape, rois.shape)).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, r, g = cupy.asarray(data), cupy.asarray(rois), cupy.asarray(out_grad)
        out = cupy.full(op.out_shape(data.shape, rois.shape), np.nan, dtype)
        dx = cupy.full(data.shape, np.nan, dtype)
        drois = cupy.full(rois.shape, np.nan, dtype)
        ws = cupy.empty(max(cuda.prroi_pool_workspace(dtype, data.shape, R, True), 16),
                        cupy.uint8)
        stream.synchronize()
        common = dict(workspace=ws.data.ptr, workspace_bytes=ws.nbytes, stream=stream.ptr)
        cuda.prroi_pool_forward(dtype, x.data.ptr, r.data.ptr, out.data.ptr, data.shape, R,
                                (3, 3), 0.5, **common)
        cuda.prroi_pool_backward(dtype, g.data.ptr, x.data.ptr, r.data.ptr, dx.data.ptr,
                                 data.shape, R, (3, 3), 0.5, rois_grad=drois.data.ptr,
                                 **common)
    stream.synchronize()
    expect_emulation(op, data, rois, out_grad, out, [dx, drois])


# ---- DeformablePSROIPooling (the checked rois and the offsets' device check first) --------
DEFORM = {
    "separate": (dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=3,
                      part_size=2, sample_per_part=2, trans_std=0.2), 1),
    "fused": (dict(spatial_scale=0.5, output_dim=2, group_size=1, pooled_size=3,
                   sample_per_part=2, trans_std=0.1), 2),
    "no_trans": (dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=3,
                      no_trans=True), 0),
}


def native_gpu_deform(params, K, data, rois, trans, stream, out_grad=None):
    """DeformablePSROIPooling's forward (and with ``out_grad`` backward) through the
    launcher on ``stream``; (out, data gradient, offsets' gradient or None)."""
    import cupy
    from mx_roi.ext import cuda
    R, P = rois.shape[0], params["pooled_size"]
    part = params.get("part_size", 0) or P
    args = {k: v for k, v in params.items() if k != "no_trans"}
    with stream:
        x, r = cupy.asarray(data), cupy.asarray(rois)
        t = cupy.asarray(trans) if trans is not None else None
        out = cupy.full((R, params["output_dim"], P, P), np.nan, data.dtype)
        dx = cupy.full(data.shape, np.nan, data.dtype)
        dt = cupy.full(trans.shape, np.nan, data.dtype) if trans is not None else None
        ws = cupy.empty(max(cuda.deformable_psroi_pooling_workspace(
            data.dtype, data.shape, R, K, part, True), 16), cupy.uint8)
        stream.synchronize()
        common = dict(workspace=ws.data.ptr, workspace_bytes=ws.nbytes, stream=stream.ptr,
                      **args)
        tp = t.data.ptr if t is not None else 0
        cuda.deformable_psroi_pooling_forward(data.dtype, x.data.ptr, r.data.ptr, tp,
                                              out.data.ptr, data.shape, R, K, **common)
        if out_grad is not None:
            g = cupy.asarray(out_grad)
            cuda.deformable_psroi_pooling_backward(
                data.dtype, g.data.ptr, x.data.ptr, r.data.ptr, tp, dx.data.ptr, data.shape,
                R, K, trans_grad=dt.data.ptr if dt is not None else 0, **common)
    stream.synchronize()
    return out, dx, dt


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", sorted(DEFORM))
def test_deformable_forward_bits_and_gradients_match_emulation(case, dtype):
    """DeformablePSROIPooling's forward bit for bit, its data gradient and offsets'
    gradient (fused into the data pass or not) to rounding, against ``emulated-cuda``."""
    import cupy
    params, K = DEFORM[case]
    cls = get_op("DeformablePSROIPooling")
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))
    rng = np.random.default_rng(5)
    data = rng.standard_normal((N, op.param.in_channels, H, W)).astype(dtype)
    _, rois = problem(dtype)
    part = op.param.part
    trans = rng.uniform(-1, 1, (rois.shape[0], 2 * K, part, part)).astype(dtype) if K else None
    out_grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    out, dx, dt = native_gpu_deform(params, K, data, rois, trans, stream, out_grad)
    expect_emulation(op, data, rois, out_grad, out, [dx] + ([dt] if K else []),
                     extra=[trans] if K else [])


def test_deformable_nan_offset_reported_by_the_next_call():
    """A NaN offset: the call runs (its bin pools nothing), the next call after the
    stream finished raises check_extra_inputs' element and value, the one after works."""
    import cupy
    from mx_roi.ext import cuda
    params, K = DEFORM["separate"]
    rng = np.random.default_rng(6)
    data = rng.standard_normal((N, 8, H, W)).astype(np.float32)
    _, rois = problem(np.float32)
    trans = rng.uniform(-1, 1, (rois.shape[0], 2, 2, 2)).astype(np.float32)
    bad = trans.copy()
    bad[4, 1, 0, 1] = np.nan
    stream = cupy.cuda.Stream(non_blocking=True)
    native_gpu_deform(params, K, data, rois, bad, stream)
    with pytest.raises(cuda.CudaLaunchError, match=r"^DeformablePSROIPooling: trans\[4, 1, "
                                                   r"0, 1\] is nan; offsets must be finite"):
        native_gpu_deform(params, K, data, rois, trans, stream)
    out, _, _ = native_gpu_deform(params, K, data, rois, trans, stream)
    cls = get_op("DeformablePSROIPooling")
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))
    want, _ = host_run(get("emulated-cuda"), op, data, rois,
                       np.ones(op.out_shape(data.shape, rois.shape), np.float32), mx.cpu(),
                       extra=[trans])
    np.testing.assert_array_equal(cupy.asnumpy(out), np.asarray(want))
