"""The geometry built on the device (mx_roi.cuda.device_geometry): host synchronisations
and host<->device copies of one GPU call, counted without a GPU, and the emulation's bits
on device-built tables against host-built ones.

The CUDA backend runs with a counting stand-in for ``cupy`` (tests/test_emulation.py's
NumPy-backed fake, its kernels the host-compiled ones) whose arrays are a NumPy subclass
(:class:`DeviceArray`): anything the backend hands a kernel that is not already one was
uploaded (``h2d``); every ``asnumpy`` is a copy to the host (``d2h``) followed by a wait,
and every ``Stream.synchronize`` a wait (``sync``).  A forward on device-built geometry
(mx_roi.cuda.device_geometry) must copy nothing either way before its last launch, wait
once, read back only its 16-byte status word in that wait, and give the emulation's bits;
a bad roi must raise the host check's message from that one wait.
"""
import sys

import numpy as np
import pytest

from mx_roi.cuda import loader
from mx_roi.cuda.backend import CudaBackend
from mx_roi.mxpatch import GUARD_BOUND
from mx_roi.ndio import Kind
from mx_roi.registry import get_op
from tests.test_emulation import CASES, EMU, _fake_cupy, _ids, make_op, nd, problem, run


class DeviceArray(np.ndarray):
    """A NumPy array playing device memory."""


def _dev(a):
    return a if isinstance(a, DeviceArray) else np.asarray(a).view(DeviceArray)


def _counting_cupy():
    fake = _fake_cupy()
    log = fake.log
    fake.ndarray = DeviceArray
    from_dlpack = fake.from_dlpack
    fake.from_dlpack = lambda obj: from_dlpack(obj).view(DeviceArray)

    def made(fn):
        return lambda *a, **k: _dev(fn(*a, **k))

    for name in ("empty", "zeros", "full", "empty_like", "zeros_like", "arange"):
        setattr(fake, name, made(getattr(np, name)))

    def upload(fn):
        def to_device(a, *args, **kwargs):
            if not isinstance(a, DeviceArray):
                log.append(("h2d", int(np.asarray(a).nbytes)))
            return _dev(fn(a, *args, **kwargs))
        return to_device

    fake.asarray = upload(np.asarray)
    fake.array = upload(np.array)
    fake.ascontiguousarray = upload(np.ascontiguousarray)

    def asnumpy(a, stream=None):
        log.append(("d2h", int(a.nbytes)))
        log.append(("sync",))  # CuPy's copy to the host waits for it (blocking)
        return np.array(a).view(np.ndarray)

    fake.asnumpy = asnumpy
    return fake


@pytest.fixture
def fake(monkeypatch):
    f = _counting_cupy()
    monkeypatch.setitem(sys.modules, "cupy", f)
    monkeypatch.setattr(loader, "_MODULES", dict(loader._MODULES))
    monkeypatch.setattr(loader, "_cupy_toolchain", lambda: f.toolchain)
    monkeypatch.setattr(sys.modules[get_op("PSROIPooling").__module__], "_DEVICE_MAPS", {})
    return f


def _forward(gpu, op, data, rois, keep=False):
    """One forward through ``gpu`` (CPU NDArrays, read through the backend's DLPack
    views as GPU memory); returns the output (host), pre-filled with garbage."""
    out = nd(np.full(op.out_shape(data.shape, rois.shape), 7.25, data.dtype))
    gpu.forward(op, "write", nd(data), nd(rois), out, keep=keep)
    return out.asnumpy()


def _inside(op, data, rois, grad):
    """The problem with its boxes clipped to the map (a detector's boxes lie inside the
    image; the adversarial ones far outside take the host path: the test below)."""
    scale = float(op.param.spatial_scale)
    rois = rois.copy()
    rois[:, 1::2] = np.clip(rois[:, 1::2], 0, (data.shape[3] - 1) / scale)
    rois[:, 2::2] = np.clip(rois[:, 2::2], 0, (data.shape[2] - 1) / scale)
    return data, rois, grad


def _events(log):
    """The log's sync / copy events and launches, in order."""
    return [e for e in log if e[0] in ("sync", "d2h", "h2d", "launch")]


@pytest.mark.parametrize("name,params", CASES[:10], ids=_ids(CASES[:10]))
def test_forward_one_sync_no_copy_before_launch(fake, name, params, monkeypatch):
    op = make_op(name, params)
    data, rois, grad = _inside(op, *problem(op, np.float32, seed=3))
    gpu = CudaBackend(Kind.CUDA)
    _forward(gpu, op, data, rois)  # compile, first-call caches
    for keep in (False, True):
        fake.log.clear()
        got = _forward(gpu, op, data, rois, keep=keep)
        ev = _events(fake.log)
        launches = [i for i, e in enumerate(ev) if e[0] == "launch"]
        assert launches and ev[launches[0]][1].startswith("roi_"), ev
        assert ev[launches[0]][1].split("<")[0] in ("roi_bins_geometry", "roi_grid_geometry")
        before = [e for e in ev[:launches[-1]] if e[0] != "launch"]
        assert before == [], f"{name}: host waits/copies before the launch: {before}"
        after = ev[launches[-1] + 1:]
        assert after == [("d2h", 16), ("sync",)], f"{name}: after the launches: {after}"
    want = _host_path(op, data, rois, grad, monkeypatch)[0]
    assert got.tobytes() == want.tobytes()


def _host_path(op, data, rois, grad, monkeypatch):
    """The emulation on host-built tables (the path before the device geometry)."""
    monkeypatch.setattr(CudaBackend, "device_geometry", False)
    try:
        return run(EMU, op, data, rois, grad)
    finally:
        monkeypatch.setattr(CudaBackend, "device_geometry", True)


@pytest.mark.parametrize("bad", ["nan", "guard", "batch"])
@pytest.mark.parametrize("name,params", [
    ("ROIAlign", dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2)),
    ("ROIPooling", dict(pooled_size=(2, 2), spatial_scale=0.5))], ids=["grid", "bins"])
def test_bad_roi_raises_after_the_one_sync(fake, bad, name, params, monkeypatch):
    op = make_op(name, params)
    data, rois, grad = _inside(op, *problem(op, np.float32, seed=4))
    rois = np.concatenate([rois, rois, rois])
    if bad in ("nan", "guard"):
        # the oneDNN guard's clip value counts as infinite (mx_roi.mxpatch.GUARD_BOUND)
        rois[4, 3] = np.nan if bad == "nan" else GUARD_BOUND
        rois[2, 0] = 9.0  # a batch error on an earlier row: the NaN row is named first
    else:
        rois[5, 0] = data.shape[0]
        rois[7, 0] = 99.0
    gpu = CudaBackend(Kind.CUDA)
    with pytest.raises(ValueError) as want:
        _host_path(op, data, rois, grad, monkeypatch)
    fake.log.clear()
    out = nd(np.full(op.out_shape(data.shape, rois.shape), 7.25, data.dtype))
    with pytest.raises(ValueError) as got:
        gpu.forward(op, "write", nd(data), nd(rois), out)
    assert str(got.value) == str(want.value)
    # the bad rows were padding to the kernels (no data read with them), the others ran
    out = out.asnumpy()
    bad_rows = ~(np.abs(rois) < GUARD_BOUND).all(axis=1) | (rois[:, 0] >= data.shape[0])
    assert (out[bad_rows] == 0).all() and (out[~bad_rows] != 7.25).all()
    ev = _events(fake.log)
    last = max(i for i, e in enumerate(ev) if e[0] == "launch")
    # the status read is the one wait; then the rois come back for the message only
    assert ev[last + 1:] == [("d2h", 16), ("sync",), ("d2h", rois.nbytes), ("sync",)], ev
    # the next call works
    fake.log.clear()
    good = np.nan_to_num(rois)
    good[:, 0] = 0
    good = _inside(op, data, good, None)[1]
    assert _forward(gpu, op, data, good).tobytes() == \
        _host_path(op, data, good, grad, monkeypatch)[0].tobytes()


@pytest.mark.parametrize("name,params", [
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, legacy="caffe")),
    ("ROIPooling", dict(pooled_size=(2, 2), spatial_scale=0.5))], ids=["adaptive", "caffe",
                                                                      "pool"])
def test_box_beyond_the_widths_runs_again_on_host_tables(fake, name, params, monkeypatch):
    """A box much larger than the map needs more sample points than the shape-derived
    widths hold (adaptive ROIAlign, Caffe grid) or has bins larger than the argmax type
    was chosen for (ROIPooling); the call runs again on the host-built tables (same
    bits)."""
    op = make_op(name, params)
    data, rois, grad = _inside(op, *problem(op, np.float32, seed=8))
    rois[0, 1:] = [-500.0, -400.0, 900.0, 700.0]
    gpu = CudaBackend(Kind.CUDA)
    fake.log.clear()
    got = _forward(gpu, op, data, rois)
    assert got.tobytes() == _host_path(op, data, rois, grad, monkeypatch)[0].tobytes()
    assert sum(e == ("sync",) for e in fake.log) == 3  # status, the rois' copy, the rerun


@pytest.mark.parametrize("name,params", CASES, ids=_ids(CASES))
def test_device_tables_give_the_host_tables_bits(name, params, monkeypatch):
    """emulated-cuda on device-built tables (the GPU's path) against the same kernels on
    host-built tables: forward and backward byte-equal, every dtype, adversarial rois
    (boxes far off the map take the host path again) and rois inside the map."""
    op = make_op(name, params)
    for dtype in (np.float16, np.float32, np.float64):
        problems = [problem(op, dtype, seed=11)]
        problems.append(_inside(op, *problem(op, dtype, seed=12)))
        for data, rois, grad in problems:
            garbage_out = np.full(op.out_shape(data.shape, rois.shape), -3.5, dtype)
            garbage_grad = np.full(data.shape, 2.75, dtype)
            monkeypatch.setattr(CudaBackend, "device_geometry", False)
            want = run(EMU, op, data, rois, grad, init_out=garbage_out, init_grad=garbage_grad)
            monkeypatch.setattr(CudaBackend, "device_geometry", True)
            got = run(EMU, op, data, rois, grad, init_out=garbage_out, init_grad=garbage_grad)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), (name, dtype)


@pytest.mark.parametrize("name,params", [CASES[0], CASES[4]], ids=["pool", "align-max"])
def test_backward_reads_both_rois_in_one_copy(fake, name, params, monkeypatch):
    """The backward still checks its rois on the host (left for a device backward): the
    rois a device-path forward kept on the device come back with the backward's own in
    one copy and one wait before its launches; then the stream sync.  Same bits as the
    host-table path, the forward's argmax reused."""
    op = make_op(name, params)
    data, rois, grad = _inside(op, *problem(op, np.float32, seed=9))
    gpu = CudaBackend(Kind.CUDA)
    run(gpu, op, data, rois, grad)  # compile, first-call caches
    x, r, g = nd(data), nd(rois), nd(grad)
    out = nd(np.full(op.out_shape(data.shape, rois.shape), 7.25, data.dtype))
    dx = nd(np.full(data.shape, -1.5, data.dtype))
    saved = gpu.forward(op, "write", x, r, out, keep=True)
    fake.log.clear()
    gpu.backward(op, "write", g, x, r, dx, saved)
    ev = _events(fake.log)
    first = min(i for i, e in enumerate(ev) if e[0] == "launch")
    last = max(i for i, e in enumerate(ev) if e[0] == "launch")
    assert ev[:first] == [("d2h", 2 * rois.nbytes), ("sync",)], ev
    assert "rescan" not in " ".join(e[1] for e in ev if e[0] == "launch")
    assert ev[last + 1:] == [("sync",)], ev
    want = _host_path(op, data, rois, grad, monkeypatch)
    assert out.asnumpy().tobytes() == want[0].tobytes()
    assert dx.asnumpy().tobytes() == want[1].tobytes()


@pytest.mark.parametrize("name,params,keep", [
    ("ROIAlign", dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=-1), True),
    ("PSROIPooling", dict(pooled_size=3, output_dim=2, spatial_scale=0.5), True),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, pool_mode="max"), False),
    ("ROIPooling", dict(pooled_size=(2, 2), spatial_scale=0.5), False)],
    ids=["align-avg", "ps-pool", "align-max-rescan", "pool-rescan"])
@pytest.mark.parametrize("req", ["write", "add"])
def test_backward_without_argmax_one_sync_no_copy_before_launch(fake, name, params, keep, req,
                                                               monkeypatch):
    """A backward that needs no argmax (average ops; max ops whose forward kept none: the
    rescan kernels) builds its tables on the device too: nothing copied or waited for
    before its launches, the status read as its one wait, the host-table path's bits
    (req add: where no roi can need wider tables -- fixed widths -- else the host path)."""
    op = make_op(name, params)
    data, rois, grad = _inside(op, *problem(op, np.float32, seed=13))
    gpu = CudaBackend(Kind.CUDA)
    x, r, g = nd(data), nd(rois), nd(grad)
    init = np.full(data.shape, 0.5 if req == "add" else -7.5, data.dtype)
    out = nd(np.zeros(op.out_shape(data.shape, rois.shape), data.dtype))
    saved = gpu.forward(op, "write", x, r, out, keep=True)
    if not keep:
        saved = None  # (as a large call's forward keeps no argmax)
    dx = nd(init)
    fake.log.clear()
    gpu.backward(op, req, g, x, r, dx, saved)
    ev = _events(fake.log)
    # adaptive widths (the ROIAlign cases), bins bounded by the map (ROIPooling): req add
    # keeps the host path, which starts with the rois' copy
    host_path = req == "add" and name in ("ROIAlign", "ROIPooling")
    first = min(i for i, e in enumerate(ev) if e[0] == "launch")
    last = max(i for i, e in enumerate(ev) if e[0] == "launch")
    if host_path:
        kept = 2 if keep else 1  # (with the rois the forward kept, in the same copy)
        assert ev[:2] == [("d2h", kept * rois.nbytes), ("sync",)], ev
    else:
        assert ev[first][1].split("<")[0].endswith("_geometry"), ev
        assert [e for e in ev[:last] if e[0] != "launch"] == [], ev
        assert ev[last + 1:] == [("d2h", 16), ("sync",)], ev
    monkeypatch.setattr(CudaBackend, "device_geometry", False)
    want = nd(init)
    EMU.backward(op, req, g, x, r, want, None if not keep else EMU.forward(
        op, "write", x, r, nd(np.zeros(out.shape, data.dtype)), keep=True))
    assert dx.asnumpy().tobytes() == want.asnumpy().tobytes()


def test_backward_bad_roi_raises_after_the_one_sync(fake, monkeypatch):
    op = make_op("ROIAlign", dict(pooled_size=(2, 3), spatial_scale=0.5, sample_ratio=2))
    data, rois, grad = _inside(op, *problem(op, np.float32, seed=14))
    rois[3, 2] = np.inf
    monkeypatch.setattr(CudaBackend, "device_geometry", False)
    with pytest.raises(ValueError) as want:
        EMU.backward(op, "write", nd(grad), nd(data), nd(rois), nd(data.copy()), None)
    monkeypatch.setattr(CudaBackend, "device_geometry", True)
    gpu = CudaBackend(Kind.CUDA)
    fake.log.clear()
    with pytest.raises(ValueError) as got:
        gpu.backward(op, "write", nd(grad), nd(data), nd(rois), nd(data.copy()), None)
    assert str(got.value) == str(want.value)
    ev = _events(fake.log)
    last = max(i for i, e in enumerate(ev) if e[0] == "launch")
    assert [e for e in ev[:last] if e[0] != "launch"] == [], ev
    assert ev[last + 1:] == [("d2h", 16), ("sync",), ("d2h", rois.nbytes), ("sync",)], ev
