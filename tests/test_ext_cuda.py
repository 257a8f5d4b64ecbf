"""The native GPU path's launcher (mx_roi/ext/ext_cuda.h, mx_roi.ext.cuda) without a GPU:
its driver-API calls recorded by a stand-in ``libcuda.so.1`` (tests/fake_libcuda.c),
driven by tests/ext_cuda_child.py in a child process (``LD_LIBRARY_PATH`` finds the
stand-in, so a real driver in this process is never touched).

What it proves: every call goes to the caller's stream; a valid call has no host wait and
makes exactly the expected calls; each launch's argument list has the PTX entry's count
and types, and its values are those the CuPy path's device geometry and ``forward_cuda``
bind (the tables' layout in the workspace included); grid and block sizes as
``loader.launch_config``; the status-word rule of docs/gpu.md, step by step; the
extension op's "gpu" forward as MXNet calls it (lib_api.cc's ``_opCallFCompute``: opt-in,
MXNet's stream and workspace).  Not proven
here: that the kernels compute the right numbers on a GPU (tests/test_ext_cuda_gpu.py,
marked gpu; never run yet)."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import types

import numpy as np
import pytest

from mx_roi.cuda import device_geometry, nvrtc
from mx_roi.cuda import source as S
from mx_roi.ndio import Kind
from mx_roi.onednn import GUARD_BOUND, bounded_dtype
from mx_roi.registry import get_op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAM, OTHER_STREAM, MX_STREAM = 0x5100, 0x5200, 0x5300
N, C, H, W, R, P = 2, 3, 19, 25, 4, 7
SYNC = {"cuCtxSynchronize", "cuStreamSynchronize", "cuStreamQuery", "cuMemcpyDtoH_v2",
        "cuMemcpy", "cuMemcpyAsync", "cuMemFree_v2", "cuMemAllocHost_v2",
        "cuDeviceSynchronize", "cuEventSynchronize"}
WHERE = (" (found on the GPU by the device check of an earlier call of this op on this "
         "stream, which treated the roi as padding: its output rows are zeros; the native "
         "GPU path reports a bad roi at the next call after that call has finished)")


def _nvrtc_ok():
    try:
        nvrtc.version()
        return True
    except nvrtc.NvrtcError:
        return False


pytestmark = pytest.mark.skipif(not (shutil.which("g++") and shutil.which("cc")
                                     and shutil.which("c++filt") and _nvrtc_ok()),
                                reason="needs g++, cc, c++filt and NVRTC (the wheel)")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The child's JSON: {steps: {name: {log, error}}, ptr, status, image, arch}."""
    tmp = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(tmp / "libcuda.so.1"), os.path.join(ROOT, "tests", "fake_libcuda.c")],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp), PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "ext_cuda_child.py")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def calls(step):
    return [line.split()[0] for line in step["log"]]


def launches(step):
    return [line for line in step["log"] if line.startswith("cuLaunchKernel")]


# ---- the PTX entries: parameter types, and the name expression of each lowered name ----
def ptx_params(image):
    """{lowered name: [PTX parameter type, ...]}"""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", image):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


def expression_of(lowered):
    """``roi_align_forward_max<float, float, unsigned char>`` of a mangled name."""
    text = subprocess.run(["c++filt", lowered], capture_output=True, text=True).stdout.strip()
    m = re.match(r"void (\w+<.*?>)\(", text)
    assert m, text
    return m.group(1)


def decode(slot_hex, ptx_type, param):
    """The value of an 8-byte slot as the PTX parameter's width reads it, signed as the
    kernel's declaration says (PTX spells every 32-bit integer .u32)."""
    raw = struct.pack("<Q", int(slot_hex, 16))
    if not param.pointer and param.ctype in ("int", "long long"):
        return int.from_bytes(raw[:4 if ptx_type.endswith("32") else 8], "little", signed=True)
    if ptx_type in ("u64", "s64", "b64"):
        return int.from_bytes(raw, "little")
    if ptx_type in ("u32", "b32"):
        return struct.unpack("<I", raw[:4])[0]
    if ptx_type == "s32":
        return struct.unpack("<i", raw[:4])[0]
    if ptx_type == "f32":
        return struct.unpack("<f", raw[:4])[0]
    if ptx_type == "f64":
        return struct.unpack("<d", raw)[0]
    raise AssertionError(f"unexpected PTX parameter type {ptx_type}")


def parse_launch(line, ptx):
    """(expression, grid, block, shared, stream, {parameter name: value}) of a log line."""
    f = line.split()
    lowered, grid, block = f[1], tuple(map(int, f[3:6])), tuple(map(int, f[7:10]))
    shared, stream, extra = int(f[11]), int(f[13], 16), int(f[15])
    assert f[16] == "args" and extra == 0
    slots = f[17:]
    types_ = ptx[lowered]
    expr = expression_of(lowered)
    if expr.startswith("store_float_as<"):  # ext_cuda_cast.cu (not an op source)
        sig = types.SimpleNamespace(params=[
            types.SimpleNamespace(name=n, pointer=n != "n", ctype=c)
            for n, c in (("src", "float"), ("dst", "__half"), ("n", "long long"))])
    else:
        sig = S.instantiate(source_of(expr), expr)
    # the launcher's argument count = the PTX entry's = the kernel's declaration's
    assert len(slots) == len(types_) == len(sig.params), (expr, len(slots), len(types_))
    values = {p.name: decode(s, t, p) for p, s, t in zip(sig.params, slots, types_)}
    return expr, grid, block, shared, stream, values


#: a launched kernel's source by its name's start (any other: roi_align.cu)
SOURCE_OF = (("psroi_pooling", "psroi_pooling.cu"), ("psroi_align", "psroi_align.cu"),
             ("rroi_align", "rroi_align.cu"), ("prroi_pool", "prroi_pool.cu"),
             ("roi_pooling", "roi_pooling.cu"), ("roi_bins", "roi_pooling.cu"),
             ("deformable", "deformable_psroi_pooling.cu"))


def source_of(kernel):
    """The op source of a kernel (or expression); the geometry, check and channel-map
    kernels are in every source (roi_common.cuh): roi_align.cu's."""
    return next((f for k, f in SOURCE_OF if kernel.startswith(k)), "roi_align.cu")


# ---- what the CuPy path binds for the same call (device_geometry.build, forward_cuda) ----
class Recorder:
    """A stand-in for mx_roi.cuda.backend.Launch over NumPy, as the emulated build's (the
    CUDA path's code: the tables and the channel map made where the kernels run): records
    each launch's arguments by name."""

    xp = np
    module = types.SimpleNamespace(kind=Kind.EMULATED)

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.acc = np.float64 if self.dtype == np.float64 else np.float32
        self.calls = []
        self.made = []

    def empty(self, shape, dtype=None):
        self.made.append(np.empty(shape, dtype or self.dtype))
        return self.made[-1]

    def forward(self, kernel, n, tables=None, **args):
        self.calls.append((kernel, int(n), dict(tables or {}, **args)))

    def output(self, shape):
        return np.empty(shape, self.dtype)

    def argmax(self, shape, max_candidates):
        return np.empty((1,), np.uint8), False  # (no argmax kept, as the launcher)

    def backward(self, kernel, n, tables=None, **args):
        # Launch.bind adds the grad_buffer's scale (1.0 unless fixed point) when not given
        self.calls.append((kernel, int(n), dict(tables or {}, scale=np.float64(1.0), **args)))

    def grad_buffer(self, shape, grad):  # req write into MXNet's gradient (backend.Launch)
        self.bottom = np.zeros(shape, self.acc)
        return self.bottom

    def grad_value(self, buf):
        return buf


def python_binding(dtype, R_, C_, params, direction="forward", op_name="ROIAlign", hw=(H, W)):
    """[(kernel, n, {name: value or ('ws', offset) / role})] of the CuPy path's call (the
    backward: _backward_device's, req write) on an ``hw`` map, and the bytes of the
    launcher's workspace before float16's accumulator: the tables, then (position-
    sensitive ops) the channel map, which the CuPy path makes once per parameters and the
    launcher per call (the cache is emptied here: the CuPy path's first call)."""
    from mx_roi.operators import psroi_pooling
    cls = get_op(op_name)
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()}))
    rois = np.zeros((R_, op.rois_columns), dtype)
    data = np.zeros((N, C_) + hw, dtype)
    bufs = []

    def empty(shape, dt):
        bufs.append(np.empty(shape, dt))
        return bufs[-1]

    rec = Recorder(dtype)
    psroi_pooling._DEVICE_MAPS.clear()
    if op.geometry_spec() is None:  # kernels that read the rois: the launcher's checked copy
        status, table = np.empty(2, np.uint64), np.empty(rois.shape, dtype)
        common = dict(rois=rois, N=N, bound=GUARD_BOUND,
                      use_bound=int(bounded_dtype(rois.dtype)), safe=table, status=status)
        if op_name == "RROIAlign":  # (with its samples-per-bin bound)
            rec.forward("rroi_align_safe_rois", R_,
                        spatial_scale=float(np.float32(params["spatial_scale"])),
                        ratio=op.param.sampling_ratio, P=op.param.pooled_size[0],
                        Q=op.param.pooled_size[1], **common)
        else:
            rec.forward("roi_safe_copy", R_, columns=op.rois_columns, **common)
        dev = types.SimpleNamespace(geo=types.SimpleNamespace(rois=table))
    else:
        spec = op.geometry_spec()
        dev = device_geometry.build(rec, spec, rois, N, *hw, empty=empty)
        status, table = bufs[0], bufs[1]
        if spec.mode == "align_grid" and spec.sample <= 0:  # the launcher's own bound check
            rec.forward("roi_adaptive_bound", R_, rois=rois,
                        spatial_scale=float(np.float32(params["spatial_scale"])),
                        P=spec.pooled_size[0], Q=spec.pooled_size[1],
                        batch=rec.calls[-1][2]["batch"], status=status)
    base, end = table.ctypes.data, table.ctypes.data + table.nbytes
    roles = {id(rois): "rois", id(data): "data", id(status): "status"}
    if direction == "forward":
        out, _ = op.forward_cuda(rec, dev.geo, data)
        roles[id(out)] = "out"
    used, rois_acc = -(-table.nbytes // 16) * 16, None
    if direction == "backward":
        rec.data = data
        grad = np.zeros(op.out_shape(data.shape, rois.shape), dtype)
        roles[id(grad)] = "grad"
        if op.differentiates_rois:  # first, as the Custom path: the rois' gradient
            rgrad = op.rois_backward_cuda(rec, dev.geo, grad, data, rois)
            rec.made = [m for m in rec.made if m is not rgrad]
            if dtype == "float16":  # a float32 result after the copy, then stored
                roles[id(rgrad)], rois_acc = ("ws", used), used
                used += -(-rgrad.size * 4 // 16) * 16
            else:
                roles[id(rgrad)] = "rois_grad"
        op.backward_cuda(rec, dev.geo, grad, data.shape, None)
    for made in rec.made:  # the channel map: after the tables in the launcher's workspace
        roles[id(made)] = ("ws", used)
        used += -(-made.nbytes // 16) * 16
    if direction == "backward":
        # float16: a float32 temporary, which the launcher keeps after the rest
        roles[id(rec.bottom)] = ("ws", used) if dtype == "float16" else "in_grad"
    result = _named(rec, roles, base, end)
    stores = [] if rois_acc is None else [(rois_acc, R_ * 5, "rois_grad")]
    return result, used, stores


def _named(rec, roles, base=None, end=None):
    """rec's launches with each array argument named by ``roles`` (or its workspace offset
    from ``base``; else "other")."""
    result = []
    for kernel, n, args in rec.calls:
        named = {}
        for k, v in args.items():
            if isinstance(v, np.ndarray):
                if id(v) in roles:
                    named[k] = roles[id(v)]
                elif base is not None and base <= v.ctypes.data < end:
                    named[k] = ("ws", v.ctypes.data - base)
                else:
                    named[k] = "other"
            else:
                named[k] = v
        result.append((kernel, n, named))
    return result


DP = dict(output_dim=2, group_size=2, pooled_size=P, part_size=3, sample_per_part=2,
          trans_std=0.1, spatial_scale=0.5)
DP_CIN, DP_K = 8, 2  # the child's data channels (output_dim * group_size^2) and classes


def deformable_binding(dtype, params, direction="forward", K=DP_K, trans=True):
    """DeformablePSROIPooling's launches as the native path must make them: its own checks
    -- roi_safe_copy into the workspace, then (with offsets) deformable_trans_check into
    the scratch after it and deformable_trans_status into the status words -- then what
    the CuPy path's forward_cuda / backward_cuda bind on the checked rois (req write; a
    zero stand-in: the scratch; float16: the offsets' float32 gradient after the scratch,
    stored before the data's).  (launches, workspace bytes before the data's float16
    accumulator, [(offset, size, target) of the stores before the data's])."""
    from mx_roi.operators.deformable_psroi_pooling import DeformableCall
    cls = get_op("DeformablePSROIPooling")
    op = cls(cls.param_cls.from_kwargs(**{k: str(v) for k, v in params.items()},
                                       no_trans=str(not trans)))
    part = op.param.part
    rois, data = np.zeros((R, 5), dtype), np.zeros((N, DP_CIN, H, W), dtype)
    tr = np.zeros((R, 2 * K, part, part), dtype) if trans else None
    safe, status, first = np.empty_like(rois), np.empty(5, np.uint64), np.empty(2, np.uint64)
    scratch = -(-rois.nbytes // 16) * 16
    roles = {id(rois): "rois", id(data): "data", id(safe): ("ws", 0), id(status): "status",
             id(first): ("ws", scratch), id(tr): "trans"}
    rec = Recorder(dtype)
    bounds = dict(bound=GUARD_BOUND, use_bound=int(bounded_dtype(dtype)))
    rec.forward("roi_safe_copy", R, rois=rois, columns=5, N=N, safe=safe, status=status,
                **bounds)
    if trans:
        rec.forward("deformable_trans_check", tr.size, trans=tr, first=first, **bounds)
        rec.forward("deformable_trans_status", 1, trans=tr, first=first, channels=2 * K,
                    part=part, status=status)
    call = DeformableCall(safe, tr)
    used, stores = scratch + 16, []
    if direction == "forward":
        out, _ = op.forward_cuda(rec, call, data)
        roles[id(out)] = "out"
    else:
        rec.data = data
        grad = np.zeros(op.out_shape(data.shape, rois.shape), dtype)
        roles[id(grad)] = "grad"
        op.backward_cuda(rec, call, grad, data.shape, None)
        for made in rec.made:  # the offsets' gradient (a (1,) stand-in without offsets)
            if not trans:
                roles[id(made)] = ("ws", scratch)
            elif dtype == "float16":
                roles[id(made)] = ("ws", used)
                stores.append((used, made.size, "trans_grad"))
                used += -(-made.size * 4 // 16) * 16
            else:
                roles[id(made)] = "trans_grad"
        roles[id(rec.bottom)] = ("ws", used) if dtype == "float16" else "in_grad"
    result = _named(rec, roles)
    for _, _, named in result:  # the CuPy path's zero stand-ins for absent offsets / data
        for k, v in named.items():
            if v == "other":
                named[k] = ("ws", scratch)
    return result, used, stores


def c_binding(values, run, ws_bytes, ws, status):
    ptr = run["ptr"]
    roles = {ptr["rois"]: "rois", ptr["data"]: "data", ptr["out"]: "out", status: "status",
             ptr["grad"]: "grad", ptr["in_grad"]: "in_grad", ptr["rois_grad"]: "rois_grad",
             ptr["trans"]: "trans", ptr["trans_grad"]: "trans_grad"}
    named = {}
    for k, v in values.items():
        if k in ("rois", "data", "out", "status", "argmax", "grad", "bottom",
                 "channel_map", "safe", "rois_grad", "trans", "trans_grad",
                 "first") or k in TABLES:
            if v in roles:
                named[k] = roles[v]
            elif ws <= v < ws + ws_bytes:
                named[k] = ("ws", v - ws)
            else:
                named[k] = hex(v)
        else:
            named[k] = v
    return named


TABLES = ("batch", "y_count", "y_low", "y_high", "y_wl", "y_wh", "x_count", "x_low", "x_high",
          "x_wl", "x_wh", "divisor", "hstart", "hend", "wstart", "wend")
BASE = dict(pooled_size=(P, P), spatial_scale=0.5, sample_ratio=-1, aligned=False)
CASES = {  # child step -> (dtype, R, C, ROIAlign parameters)
    "first": ("float32", R, C, BASE),
    "max": ("float32", R, C, dict(BASE, sample_ratio=2, aligned=True, pool_mode="max")),
    "caffe": ("float32", R, C, dict(BASE, sample_ratio=3, aligned=True, legacy="caffe")),
    "float16": ("float16", R, C, BASE),
    "rect": ("float32", R, C, dict(BASE, pooled_size=(P, 5))),
    "float64": ("float64", R, C, BASE),
    "many_items": ("float32", 2000, C, BASE),
    "grid_cap": ("float32", 2000, 200, BASE),
    # the extension op's "gpu" forward, called as MXNet calls it (MXNet's workspace)
    "mx_forward": ("float32", R, C, dict(BASE, sample_ratio=2, aligned=True, pool_mode="max")),
}


BACKWARD_CASES = {  # child step -> (dtype, R, C, ROIAlign parameters)
    "bwd_avg": ("float32", R, C, BASE),
    "bwd_max": ("float32", R, C, dict(BASE, sample_ratio=2, aligned=True, pool_mode="max")),
    "bwd_caffe": ("float32", R, C, dict(BASE, sample_ratio=3, aligned=True, legacy="caffe")),
    "bwd_float64": ("float64", R, C, BASE),
    "bwd_float16": ("float16", R, C, BASE),
    "bwd_bad": ("float32", R, C, BASE),
    # the extension op's "gpu" backward, called as MXNet calls it
    "mx_backward": ("float32", R, C, dict(BASE, sample_ratio=2, aligned=True, pool_mode="max")),
    "mx_backward_float16": ("float16", R, C,
                            dict(BASE, sample_ratio=2, aligned=True, pool_mode="max")),
}


def adaptive(params):
    """Whether an align grid is adaptive (sample_ratio <= 0, not a legacy grid): the
    launcher then checks the samples-per-bin bound on the device (roi_adaptive_bound,
    after the geometry)."""
    return params.get("sample_ratio", -1) <= 0 and not params.get("legacy")


def _check_launches(run, step, direction, dtype, R_, C_, params, op_name="ROIAlign",
                    first=None, hw=(H, W), binding=None):
    """Each launch binds, parameter by parameter, what the CuPy path's device geometry and
    the op's forward_cuda / backward_cuda bind (table pointers at the same workspace
    offsets, the status word, scalars of the same value and width); grid and block as
    launch_config; every launch on the caller's stream.  ``first``: the step that made
    the channel (its status word); ``binding``: python_binding's answer made otherwise."""
    expected, ws_bytes, early = binding or python_binding(dtype, R_, C_, params, direction,
                                                          op_name, hw)
    ptx = ptx_params(run["image"])
    log = run["steps"][step]["log"]
    got = [parse_launch(line, ptx) for line in launches(run["steps"][step])]
    launches_of = list(got)
    # a channel's status word: allocated by its first call (MXNet's stream: mx_forward's)
    first = first or ("mx_forward" if step.startswith("mx_") else None)
    own = [x for x in log + (run["steps"][first]["log"] if first else [])
           if x.startswith("cuMemAlloc_v2")]
    status = int(own[0].split()[2], 16) if own else run["status"]
    ws = run["steps"][step]["ws"][0][0] if step.startswith("mx_") else run["ptr"]["ws"]
    want_stream = MX_STREAM if step.startswith("mx_") else STREAM
    if direction == "backward" and dtype == "float16":  # the accumulator after the tables
        size = N * C_ * hw[0] * hw[1]
        stores = [g for g in got if g[0].startswith("store_float_as<")]
        got = [g for g in got if not g[0].startswith("store_float_as<")]
        assert got and stores[-1] == launches_of[len(launches_of) - 1]
        _check_store_to_half(run, stores[-1], ws + ws_bytes, size, want_stream)
        # another gradient's float32 result (PrRoIPool's rois', the offsets'), stored first
        assert len(stores) == 1 + len(early)
        for store, (offset, count, target) in zip(stores, early):
            _check_store_to_half(run, store, ws + offset, count, want_stream, target)
        ws_bytes += -(-size * 4 // 16) * 16
    assert [g[0].split("<")[0] for g in got] == [e[0] for e in expected]
    t = {"float32": "float, float", "float64": "double, double", "float16": "__half, float"}
    for (expr, grid, block, shared, stream, values), (kernel, n, want) in zip(got, expected):
        assert expr.startswith(f"{kernel}<{t[dtype]}")
        if "O" in S.kernel_signatures(source_of(kernel))[kernel][0]:  # O: the accumulator
            assert expr == f"{kernel}<{t[dtype]}, {t[dtype].split(', ')[1]}>"
        assert stream == want_stream and shared == 0 and block == (256, 1, 1)
        assert grid == (max(1, min(-(-n // 256), 65535)), 1, 1)
        named = c_binding(values, run, ws_bytes, ws, status)
        assert named["n"] == n
        for k, v in named.items():
            if k == "n":
                continue
            if k == "argmax":  # never written (store_argmax 0): any device address
                assert named["store_argmax"] == want["store_argmax"] == 0
                continue
            w = want[k]
            if isinstance(w, (float, np.floating)):
                assert v == pytest.approx(float(np.float32(w)) if k == "spatial_scale"
                                          else float(w), rel=0, abs=0), k
            else:
                assert v == (int(w) if isinstance(w, (bool, np.integer)) else w), (step, k)
    return got


def _check_store_to_half(run, launch, acc, size, stream, target="in_grad"):
    """The float16 backward's last launch: store_float_as<__half> (ext_cuda_cast.cu) of
    the float32 accumulator at ``acc`` into MXNet's gradient (``target``), ``size``
    elements."""
    expr, grid, block, shared, got_stream, values = launch
    assert expr == "store_float_as<__half>"
    assert values == {"src": acc, "dst": run["ptr"][target], "n": size}
    assert got_stream == stream and shared == 0 and block == (256, 1, 1)
    assert grid == (max(1, min(-(-size // 256), 65535)), 1, 1)


@pytest.mark.parametrize("step", sorted(CASES))
def test_launch_arguments_are_the_cupy_paths(run, step):
    _check_launches(run, step, "forward", *CASES[step])


@pytest.mark.parametrize("step", sorted(BACKWARD_CASES))
def test_backward_launch_arguments_are_the_cupy_paths(run, step):
    """The backward's launches bind what the CuPy path's _backward_device binds (req
    write: the accumulator O is the gradient's own dtype, ``bottom`` MXNet's gradient,
    ``scale`` 1.0; the max modes rescan ``data``: no argmax is kept)."""
    dtype, R_, C_, params = BACKWARD_CASES[step]
    got = _check_launches(run, step, "backward", *BACKWARD_CASES[step])
    assert len(got) == 2 + adaptive(params)


POOL = dict(pooled_size=(P, P), spatial_scale=0.5)
POOL_CASES = {  # child step -> (direction, dtype); ROIPooling on the stand-in driver
    "pool_first": ("forward", "float32"), "pool_fwd_f64": ("forward", "float64"),
    "pool_fwd_f16": ("forward", "float16"), "pool_bwd": ("backward", "float32"),
    "pool_bwd_f64": ("backward", "float64"), "pool_bwd_f16": ("backward", "float16"),
    "mx_pool_forward": ("forward", "float32"), "mx_pool_backward": ("backward", "float32"),
    "pool_tiny_map": ("forward", "float32"),  # (1 x 2: bin_cells is the map's 2 cells)
}


@pytest.mark.parametrize("step", sorted(POOL_CASES))
def test_roi_pooling_launch_arguments_are_the_cupy_paths(run, step):
    """ROIPooling on the native GPU path (its own files: roi_pooling.cu's section): each
    launch binds what the CuPy path's device-built integer bins and forward_cuda /
    backward_cuda bind (no argmax kept: the backward rescans the data), the tables at the
    same workspace offsets, ``cells`` as device_geometry.bin_cells; float16's backward
    accumulates in float32 after the tables, then the store."""
    direction, dtype = POOL_CASES[step]
    got = _check_launches(run, step, direction, dtype, R, C, POOL, "ROIPooling",
                          "mx_pool_forward" if step.startswith("mx_") else "pool_first",
                          (1, 2) if step == "pool_tiny_map" else (H, W))
    assert len(got) == 2


def test_roi_pooling_status_zeroing_and_workspace(run):
    """ROIPooling's channel is its own (a status word of its own on the stream); a bad
    roi found by a backward is raised by the next forward; the backward zeroes the
    gradients first; no roi: nothing launched; a short workspace refused before anything
    is queued."""
    from mx_roi.ext import cuda
    s, p = run["steps"], run["ptr"]
    word = int(next(x for x in s["pool_first"]["log"] if x.startswith("cuMemAlloc_v2"))
               .split()[2], 16)
    assert word != run["status"]
    assert s["pool_bad_bwd"]["error"] is None and len(launches(s["pool_bad_bwd"])) == 2
    assert s["pool_reported"]["error"] == ("ROIPooling: rois[1] has a NaN or infinite value; "
                                           "coordinates must be finite" + WHERE)
    assert s["pool_reported"]["log"] == ["cuCtxGetCurrent", "cuEventQuery e7 ready",
                                         f"cuMemsetD8Async {word:x} 0 40 stream {STREAM:x}"]
    log = s["pool_bwd"]["log"]
    first_launch = next(i for i, x in enumerate(log) if x.startswith("cuLaunchKernel"))
    assert [x for x in log[:first_launch] if x.startswith("cuMemsetD8Async")] == [
        f"cuMemsetD8Async {p['in_grad']:x} 0 {N * C * H * W * 4} stream {STREAM:x}",
        f"cuMemsetD8Async {p['rois_grad']:x} 0 {R * 5 * 4} stream {STREAM:x}"]
    # (after the report: nothing recorded since, so nothing to ask either)
    assert calls(s["pool_no_rois"]) == ["cuCtxGetCurrent"]
    need = cuda.roi_pooling_workspace("float32", (N, C, H, W), R, P)
    assert s["pool_small_workspace"]["error"] == (
        f"ROIPooling: the workspace holds {need - 1} bytes but the call needs {need}")
    assert not launches(s["pool_small_workspace"])
    assert run["pool_contexts"] == ["backward/cpu", "backward/gpu", "forward/cpu",
                                    "forward/gpu"]
    assert s["mx_pool_forward"]["rc"] == 1 and s["mx_pool_backward"]["rc"] == 1
    assert [x["ws"][0][1] for x in (s["mx_pool_forward"], s["mx_pool_backward"])] == [
        cuda.roi_pooling_workspace("float32", (N, C, H, W), R, P),
        cuda.roi_pooling_workspace("float32", (N, C, H, W), R, P, backward=True)]


PS_D, PS_GROUP, PS_CIN = 2, (2, 3), 12  # (ext_cuda_child.py's)
PS = dict(pooled_size=(P, P), spatial_scale=0.5, output_dim=PS_D, group_size=PS_GROUP)
PS_ALIGN = dict(PS, sample_ratio=-1)
PS_CASES = {  # child step -> (op, direction, dtype, parameters)
    **{f"{tag}_{step}": (op, direction, dtype, params)
       for op, tag, params in (("PSROIPooling", "psp", PS), ("PSROIAlign", "psa", PS_ALIGN))
       for step, direction, dtype in (
           ("first", "forward", "float32"), ("fwd_f64", "forward", "float64"),
           ("fwd_f16", "forward", "float16"), ("bwd", "backward", "float32"),
           ("bwd_f64", "backward", "float64"), ("bwd_f16", "backward", "float16"))},
    "psa_fixed": ("PSROIAlign", "forward", "float32", dict(PS, sample_ratio=2, aligned=True)),
    "psa_rfcn": ("PSROIAlign", "forward", "float32", dict(PS, legacy="rfcn", sample_num=3)),
    "psa_bwd_rfcn": ("PSROIAlign", "backward", "float32",
                     dict(PS, legacy="rfcn", sample_num=3)),
    "psa_bwd_fixed_f16": ("PSROIAlign", "backward", "float16",
                          dict(PS, sample_ratio=2, aligned=True)),
    "mx_psp_forward": ("PSROIPooling", "forward", "float32", PS),
    "mx_psp_backward": ("PSROIPooling", "backward", "float32", PS),
    "mx_psp_backward_f16": ("PSROIPooling", "backward", "float16", PS),
    "mx_psa_forward": ("PSROIAlign", "forward", "float32", dict(PS, sample_ratio=2,
                                                                aligned=True)),
    "mx_psa_backward": ("PSROIAlign", "backward", "float32", dict(PS, sample_ratio=2,
                                                                  aligned=True)),
    "mx_psa_backward_f16": ("PSROIAlign", "backward", "float16", dict(PS, sample_ratio=2,
                                                                      aligned=True)),
}


@pytest.mark.parametrize("step", sorted(PS_CASES))
def test_position_sensitive_launch_arguments_are_the_cupy_paths(run, step):
    """PSROIPooling and PSROIAlign on the native GPU path (their own files' sections): the
    geometry kernel, then the channel map filled on the device (ps_channel_map_fill, into
    the workspace after the tables: nothing copied from the host), then the op kernel,
    each binding what the CuPy path's device geometry and PositionSensitive.forward_cuda
    / backward_cuda bind (output_dim 2 on a 2 x 3 group grid: 12 data channels; adaptive,
    fixed and aligned, and R-FCN samples); float16's backward accumulates in float32 after
    the map, then the store."""
    op, direction, dtype, params = PS_CASES[step]
    tag = step.split("_")[1] if step.startswith("mx_") else step.split("_")[0]
    got = _check_launches(run, step, direction, dtype, R, PS_CIN, params, op,
                          f"mx_{tag}_forward" if step.startswith("mx_") else f"{tag}_first")
    names = [g[0].split("<")[0] for g in got]
    bound = op == "PSROIAlign" and adaptive(params)
    assert names[:2 + bound] == ["roi_grid_geometry" if op == "PSROIAlign" else
                                 "roi_bins_geometry"] + ["roi_adaptive_bound"] * bound + [
                                     "ps_channel_map_fill"]


def test_position_sensitive_status_channels_and_workspace(run):
    """Each position-sensitive op has its own channel on the stream; a bad roi found by
    its backward's geometry is raised by its next forward; a call whose data has other
    than output_dim * Gh * Gw channels is refused by name before anything is queued (the
    kernels would read past the data); no roi: nothing launched (the backward zeroes the
    gradient); a short workspace refused; the extension ops have "gpu" callbacks, take
    MXNet's workspace of the entries' size, and refuse deterministic=True."""
    from mx_roi.ext import cuda
    s = run["steps"]
    words = {int(next(x for x in s[f"{tag}_first"]["log"] if x.startswith("cuMemAlloc_v2"))
                  .split()[2], 16) for tag in ("psp", "psa")}
    assert len(words) == 2 and run["status"] not in words
    shape = (N, PS_CIN, H, W)
    for op, tag in (("PSROIPooling", "psp"), ("PSROIAlign", "psa")):
        assert s[f"{tag}_bad_bwd"]["error"] is None and len(launches(s[f"{tag}_bad_bwd"])) == (
            3 if op == "PSROIPooling" else 4)  # (PSROIAlign's adaptive grid: its bound check)
        assert s[f"{tag}_reported"]["error"] == (f"{op}: rois[3] has a NaN or infinite value; "
                                                 "coordinates must be finite" + WHERE)
        assert not launches(s[f"{tag}_reported"])
        assert calls(s[f"{tag}_no_rois"]) == ["cuCtxGetCurrent"]
        assert s[f"{tag}_bwd_no_rois"]["log"] == [
            "cuCtxGetCurrent",
            f"cuMemsetD8Async {run['ptr']['in_grad']:x} 0 {N * PS_CIN * H * W * 4} "
            f"stream {STREAM:x}"]
        for k, have in ((f"{tag}_channels", PS_CIN + 1), (f"{tag}_bwd_channels", PS_CIN - 1)):
            assert s[k]["error"] == (f"{op}: data has {have} channels but output_dim * gh * "
                                     f"gw = 2 * 2 * 3 = 12 are required")
            assert s[k]["log"] == ["cuCtxGetCurrent"], k
        if op == "PSROIPooling":
            need = cuda.psroi_pooling_workspace("float32", shape, R, P, PS_D)
            ws = [cuda.psroi_pooling_workspace("float32", shape, R, P, PS_D),
                  cuda.psroi_pooling_workspace("float32", shape, R, P, PS_D, True),
                  cuda.psroi_pooling_workspace("float16", shape, R, P, PS_D, True)]
        else:
            need = cuda.psroi_align_workspace("float32", shape, R, P, PS_D)
            ws = [cuda.psroi_align_workspace("float32", shape, R, P, PS_D, 2),
                  cuda.psroi_align_workspace("float32", shape, R, P, PS_D, 2, backward=True),
                  cuda.psroi_align_workspace("float16", shape, R, P, PS_D, 2, backward=True)]
        assert s[f"{tag}_small_workspace"]["error"] == (
            f"{op}: the workspace holds {need - 1} bytes but the call needs {need}")
        assert not launches(s[f"{tag}_small_workspace"])
        assert run["ps_contexts"][op] == ["backward/cpu", "backward/gpu", "forward/cpu",
                                          "forward/gpu"]
        mx = [s[f"mx_{tag}_{k}"] for k in ("forward", "backward", "backward_f16")]
        assert [x["rc"] for x in mx] == [1, 1, 1]
        assert [x["ws"][0][1] for x in mx] == ws
        det = s[f"mx_{tag}_deterministic"]
        assert det["rc"] == 0 and det["log"] == [] and det["error"] == (
            f"{op}: deterministic=True: the native GPU path has no deterministic backward "
            "yet; use the Custom door on GPU contexts for it")


RROI = dict(pooled_size=(P, P), spatial_scale=0.5, sampling_ratio=-1)
RROI_FIXED = dict(RROI, sampling_ratio=2, aligned=True, clockwise=True)
RROI_CASES = {  # child step -> (direction, dtype, parameters)
    "rra_first": ("forward", "float32", RROI), "rra_fwd_f64": ("forward", "float64", RROI),
    "rra_fwd_f16": ("forward", "float16", RROI), "rra_fixed": ("forward", "float32", RROI_FIXED),
    "rra_bwd": ("backward", "float32", RROI), "rra_bwd_f64": ("backward", "float64", RROI),
    "rra_bwd_f16": ("backward", "float16", RROI),
    "rra_bwd_fixed_f64": ("backward", "float64", dict(RROI, sampling_ratio=3, clockwise=True)),
    "mx_rra_forward": ("forward", "float32", dict(RROI_FIXED, aligned=False)),
    "mx_rra_backward": ("backward", "float32", dict(RROI_FIXED, aligned=False)),
    "mx_rra_backward_f16": ("backward", "float16", dict(RROI_FIXED, aligned=False)),
}


@pytest.mark.parametrize("step", sorted(RROI_CASES))
def test_rroi_align_launch_arguments_are_the_cupy_paths(run, step):
    """RROIAlign on the native GPU path: its kernels read the rois themselves, so the first
    launch is rroi_align_safe_rois (the rois, the roi check's bound, the status word, the
    checked copy at the workspace's start), then the op kernel binding what the CuPy path's
    forward_cuda / backward_cuda bind, its ``rois`` the checked copy; float16's backward
    accumulates in float32 after the copy, then the store."""
    direction, dtype, params = RROI_CASES[step]
    got = _check_launches(run, step, direction, dtype, R, C, params, "RROIAlign",
                          "mx_rra_forward" if step.startswith("mx_") else "rra_first")
    assert [g[0].split("<")[0] for g in got][:2] == [
        "rroi_align_safe_rois", f"rroi_align_{direction}"]


def test_rroi_align_status_and_workspace(run):
    """RROIAlign's own channel: a box over the samples-per-bin bound found by a backward
    (status word 1 = 2) is raised by the next forward with its own message; no roi:
    nothing launched; a short workspace refused; the extension op's "gpu" callbacks take
    MXNet's workspace of the entries' size and refuse deterministic=True."""
    from mx_roi.ext import cuda
    s = run["steps"]
    assert s["rra_bad_bwd"]["error"] is None and len(launches(s["rra_bad_bwd"])) == 2
    assert s["rra_reported"]["error"] == (
        "RROIAlign: rois: a box needs more than 1048576 samples per bin with sampling_ratio "
        "<= 0; check the box size and spatial_scale, or set sampling_ratio" + WHERE)
    assert not launches(s["rra_reported"])
    log = s["rra_bwd"]["log"]
    first_launch = next(i for i, x in enumerate(log) if x.startswith("cuLaunchKernel"))
    assert [x for x in log[:first_launch] if x.startswith("cuMemsetD8Async")] == [
        f"cuMemsetD8Async {run['ptr']['in_grad']:x} 0 {N * C * H * W * 4} stream {STREAM:x}",
        f"cuMemsetD8Async {run['ptr']['rois_grad']:x} 0 {R * 6 * 4} stream {STREAM:x}"]
    assert calls(s["rra_no_rois"]) == ["cuCtxGetCurrent"]
    assert s["rra_bwd_no_rois"]["log"] == [
        "cuCtxGetCurrent",
        f"cuMemsetD8Async {run['ptr']['in_grad']:x} 0 {N * C * H * W * 4} stream {STREAM:x}"]
    shape = (N, C, H, W)
    need = cuda.rroi_align_workspace("float32", shape, R)
    assert need == -(-R * 6 * 4 // 16) * 16
    assert s["rra_small_workspace"]["error"] == (
        f"RROIAlign: the workspace holds {need - 1} bytes but the call needs {need}")
    assert not launches(s["rra_small_workspace"])
    assert run["ps_contexts"]["RROIAlign"] == ["backward/cpu", "backward/gpu", "forward/cpu",
                                               "forward/gpu"]
    mx = [s[f"mx_rra_{k}"] for k in ("forward", "backward", "backward_f16")]
    assert [x["rc"] for x in mx] == [1, 1, 1]
    assert [x["ws"][0][1] for x in mx] == [
        need, cuda.rroi_align_workspace("float32", shape, R, True),
        cuda.rroi_align_workspace("float16", shape, R, True)]
    det = s["mx_rra_deterministic"]
    assert det["rc"] == 0 and det["log"] == [] and det["error"] == (
        "RROIAlign: deterministic=True: the native GPU path has no deterministic backward "
        "yet; use the Custom door on GPU contexts for it")


PRROI = dict(pooled_size=(P, P), spatial_scale=0.5)
PRROI_CASES = {  # child step -> (direction, dtype)
    "prp_first": ("forward", "float32"), "prp_fwd_f64": ("forward", "float64"),
    "prp_fwd_f16": ("forward", "float16"), "prp_bwd": ("backward", "float32"),
    "prp_bwd_f64": ("backward", "float64"), "prp_bwd_f16": ("backward", "float16"),
    "mx_prp_forward": ("forward", "float32"), "mx_prp_backward": ("backward", "float32"),
    "mx_prp_backward_f16": ("backward", "float16"),
}


@pytest.mark.parametrize("step", sorted(PRROI_CASES))
def test_prroi_pool_launch_arguments_are_the_cupy_paths(run, step):
    """PrRoIPool on the native GPU path: roi_safe_copy (the rois checked into the
    workspace: its kernels read the rois themselves), then the op kernels on the copy as
    the CuPy path binds them -- the backward in the Custom path's order, the rois'
    gradient (prroi_pool_rois_backward into MXNet's rois gradient; float16: a float32
    result after the copy, then stored) before the data gradient."""
    direction, dtype = PRROI_CASES[step]
    got = _check_launches(run, step, direction, dtype, R, C, PRROI, "PrRoIPool",
                          "mx_prp_forward" if step.startswith("mx_") else "prp_first")
    want = ["roi_safe_copy", "prroi_pool_forward"] if direction == "forward" else [
        "roi_safe_copy", "prroi_pool_rois_backward", "prroi_pool_backward"]
    assert [g[0].split("<")[0] for g in got] == want


def test_prroi_pool_status_rois_gradient_and_workspace(run):
    """PrRoIPool's own channel (a bad batch index found by a backward raised by the next
    forward); without a rois gradient pointer the backward skips its kernel; no roi:
    nothing launched, the data gradient zeroed; a short float16 backward workspace
    refused; MXNet's workspace of the entries' size."""
    from mx_roi.ext import cuda
    s, shape = run["steps"], (N, C, H, W)
    assert s["prp_bad_bwd"]["error"] is None and len(launches(s["prp_bad_bwd"])) == 3
    assert s["prp_reported"]["error"] == (
        "PrRoIPool: rois[2] has a batch index beyond the images of data (valid: 0..N-1; a "
        "negative index marks a padding roi)" + WHERE)
    assert not launches(s["prp_reported"])
    assert [x.split()[1].split("I")[0] for x in launches(s["prp_bwd_no_rois_grad"])] == [
        "_Z13roi_safe_copy", "_Z19prroi_pool_backward"]
    assert calls(s["prp_no_rois"]) == ["cuCtxGetCurrent"]
    assert s["prp_bwd_no_rois"]["log"] == [
        "cuCtxGetCurrent",
        f"cuMemsetD8Async {run['ptr']['in_grad']:x} 0 {N * C * H * W * 4} stream {STREAM:x}"]
    need = cuda.prroi_pool_workspace("float16", shape, R, True)
    assert need == 48 + 80 + -(-N * C * H * W * 4 // 16) * 16  # copy, rois' result, data's
    assert s["prp_small_workspace"]["error"] == (
        f"PrRoIPool: the workspace holds {need - 1} bytes but the call needs {need}")
    assert not launches(s["prp_small_workspace"])
    assert run["ps_contexts"]["PrRoIPool"] == ["backward/cpu", "backward/gpu", "forward/cpu",
                                               "forward/gpu"]
    mx = [s[f"mx_prp_{k}"] for k in ("forward", "backward", "backward_f16")]
    assert [x["rc"] for x in mx] == [1, 1, 1]
    assert [x["ws"][0][1] for x in mx] == [
        cuda.prroi_pool_workspace("float32", shape, R),
        cuda.prroi_pool_workspace("float32", shape, R, True), need]


DP_CASES = {  # child step -> (direction, dtype, parameters, K, offsets)
    "dp_first": ("forward", "float32", DP, DP_K, True),
    "dp_fwd_f64": ("forward", "float64", DP, DP_K, True),
    "dp_fwd_f16": ("forward", "float16", DP, DP_K, True),
    "dp_no_trans": ("forward", "float32", DP, DP_K, False),
    "dp_bwd": ("backward", "float32", DP, DP_K, True),
    "dp_bwd_f64": ("backward", "float64", DP, DP_K, True),
    "dp_bwd_f16": ("backward", "float16", DP, DP_K, True),
    "dp_bwd_no_trans": ("backward", "float32", DP, DP_K, False),
    **{f"dp_bwd_fuse{size}_{dt}": ("backward", dt, dict(DP, pooled_size=size, part_size=0),
                                   2, True)
       for size in (7, 26, 29) for dt in ("float32", "float64", "float16")},
    "mx_dp_forward": ("forward", "float32", DP, DP_K, True),
    "mx_dp_backward": ("backward", "float32", DP, DP_K, True),
    "mx_dp_backward_f16": ("backward", "float16", DP, DP_K, True),
    "mx_dp_no_trans": ("forward", "float32", DP, DP_K, False),
    "mx_dp_bwd_no_trans": ("backward", "float32", DP, DP_K, False),
}


@pytest.mark.parametrize("step", sorted(DP_CASES))
def test_deformable_launch_arguments_are_the_cupy_paths(run, step):
    """DeformablePSROIPooling on the native GPU path: roi_safe_copy, with offsets their
    device check (deformable_trans_check into the scratch word after the copy,
    deformable_trans_status into the channel's status words), then the op kernels as the
    CuPy path binds them on the checked rois; the backward's offsets' gradient fused into
    the data gradient's pass exactly where the CuPy path fuses it (``_fused``: pooled 26
    in float32 and float16's float32, 29 in float64), else
    deformable_psroi_pooling_backward_trans; float16 through float32 results, the
    offsets' stored first."""
    direction, dtype, params, K, trans = DP_CASES[step]
    binding = deformable_binding(dtype, params, direction, K, trans)
    got = _check_launches(run, step, direction, dtype, R, DP_CIN, params,
                          first="mx_dp_forward" if step.startswith("mx_") else "dp_first",
                          binding=binding)
    names = [g[0].split("<")[0] for g in got if not g[0].startswith("store_float_as")]
    fused = {"dp_bwd_fuse7_float32", "dp_bwd_fuse7_float64", "dp_bwd_fuse7_float16",
             "dp_bwd_fuse26_float32", "dp_bwd_fuse26_float16", "dp_bwd_fuse29_float64"}
    want = ["roi_safe_copy"] + (["deformable_trans_check", "deformable_trans_status"]
                                if trans else [])
    if direction == "forward":
        want.append("deformable_psroi_pooling_forward")
    else:
        want.append("deformable_psroi_pooling_backward")
        if trans and step not in fused:
            want.append("deformable_psroi_pooling_backward_trans")
    assert names == want


def test_deformable_status_offsets_and_workspace(run):
    """DeformablePSROIPooling's own channel: a bad offset found by a backward's device
    check (status words 2..4) raised by the next forward once that call has finished --
    the element and value as check_extra_inputs names them (3.1e+38, nan) --, nothing
    launched by the reporting call, the five words reset; a bad roi is reported before a
    bad offset of the same calls (the Custom door's order), and the report clears both.
    Refused before anything is queued: too few data channels, K not dividing output_dim,
    a plane over 2^31 elements, a non-positive parameter, a short workspace.  No roi: nothing launched (the backward
    zeroes the data gradient); an empty map: the checks, then zeros.  Without an offsets'
    gradient pointer the backward skips it.  MXNet's callbacks check trans's presence,
    shape and dtype first and take the workspace of the entries' size."""
    from mx_roi.ext import cuda
    s, p = run["steps"], run["ptr"]
    status = next(int(x.split()[2], 16) for x in s["dp_first"]["log"]
                  if x.startswith("cuMemAlloc_v2"))
    reset = f"cuMemsetD8Async {status:x} 0 40 stream {STREAM:x}"
    tail = ("; offsets must be finite (found on the GPU by the device check of an earlier "
            "call of this op on this stream, which ran with the offsets as given: a bin "
            "whose offset is not finite pools no sample (0); the native GPU path reports a "
            "bad offset at the next call after that call has finished)")
    assert s["dp_bad_trans"]["error"] is None and len(launches(s["dp_bad_trans"])) == 5
    assert s["dp_trans_reported"]["error"] == (
        "DeformablePSROIPooling: trans[3, 1, 2, 0] is 3.1e+38" + tail)
    assert s["dp_trans_reported"]["log"] == ["cuCtxGetCurrent", "cuEventQuery e7 ready", reset]
    assert s["dp_bad_trans_busy"]["error"] is None
    assert s["dp_trans_nan_reported"]["error"] == (
        "DeformablePSROIPooling: trans[0, 3, 0, 2] is nan" + tail)
    assert s["dp_after_roi"]["error"] == (
        "DeformablePSROIPooling: rois[1] has a NaN or infinite value; coordinates must be "
        "finite" + WHERE)
    assert s["dp_after_roi"]["log"][-1] == reset
    assert s["dp_no_rois"]["error"] is None and not launches(s["dp_no_rois"])
    assert s["dp_bwd_no_rois"]["log"] == [
        "cuCtxGetCurrent",
        f"cuMemsetD8Async {p['in_grad']:x} 0 {N * DP_CIN * H * W * 4} stream {STREAM:x}"]
    channels = ("DeformablePSROIPooling: data has 7 channels but output_dim * group_size^2 "
                "= 2 * 2^2 = 8 are required")
    refused = {"dp_channels": channels, "dp_bwd_channels": channels,
               "dp_bad_K": "DeformablePSROIPooling: trans has K = 3 offset classes but "
                           "output_dim = 2 is not a multiple of K",
               "dp_huge_plane": "DeformablePSROIPooling: a feature map of 65536x32768 has "
                                "2^31 or more elements per channel, more than the CUDA "
                                "kernels index",
               "dp_bad_params": "DeformablePSROIPooling: output_dim, group_size, "
                                "pooled_size, part and sample_per_part must be positive"}
    need = cuda.deformable_psroi_pooling_workspace("float16", (N, DP_CIN, H, W), R, DP_K, 3,
                                                   True)
    # the checked copy (4 x 5 halves: 48), the scratch (16), the offsets' float32
    # gradient (4 x 4 x 3 x 3), the data's float32 accumulator
    assert need == 48 + 16 + 576 + N * DP_CIN * H * W * 4
    refused["dp_small_workspace"] = (f"DeformablePSROIPooling: the workspace holds "
                                     f"{need - 1} bytes but the call needs {need}")
    for step, message in refused.items():
        assert s[step]["error"] == message, step
        assert not launches(s[step]) and not [x for x in s[step]["log"]
                                              if x.startswith("cuMemset")], step
    item = R * DP["output_dim"] * P * P * 4
    assert [x.split("<")[0].split()[1][:30] for x in launches(s["dp_empty_map"])] == [
        x.split()[1][:30] for x in launches(s["dp_first"])[:3]]
    assert f"cuMemsetD8Async {p['out']:x} 0 {item} stream {STREAM:x}" in s["dp_empty_map"]["log"]
    assert len(launches(s["dp_bwd_empty_map"])) == 3 and (
        f"cuMemsetD8Async {p['trans_grad']:x} 0 {R * 4 * 9 * 4} stream {STREAM:x}"
        in s["dp_bwd_empty_map"]["log"])
    got = [parse_launch(x, ptx_params(run["image"])) for x in
           launches(s["dp_bwd_no_trans_grad"])]
    assert [g[0].split("<")[0] for g in got] == [
        "roi_safe_copy", "deformable_trans_check", "deformable_trans_status",
        "deformable_psroi_pooling_backward"]
    scratch = p["ws"] + 80  # after the float32 copy (4 x 5 x 4 bytes)
    assert got[-1][5]["fuse_trans"] == 0 and got[-1][5]["trans_grad"] == scratch
    assert run["ps_contexts"]["DeformablePSROIPooling"] == [
        "backward/cpu", "backward/gpu", "forward/cpu", "forward/gpu"]
    mx = [s[f"mx_dp_{k}"] for k in ("forward", "backward", "backward_f16")]
    assert [x["rc"] for x in mx] == [1, 1, 1]
    assert [x["ws"][0][1] for x in mx] == [
        cuda.deformable_psroi_pooling_workspace("float32", (N, DP_CIN, H, W), R, DP_K, 3),
        cuda.deformable_psroi_pooling_workspace("float32", (N, DP_CIN, H, W), R, DP_K, 3,
                                                True), need]
    for step, message in (
            ("mx_dp_trans_shape", "DeformablePSROIPooling: trans must have shape (R, 2 * K, "
                                  "part_size, part_size) = (4, 2 * K, 3, 3) with K >= 1 "
                                  "offset classes, got (4, 4, 3, 2)"),
            ("mx_dp_trans_dtype", "DeformablePSROIPooling: data and trans must have the "
                                  "same dtype, got data float32 and trans float64"),
            ("mx_dp_trans_missing", "DeformablePSROIPooling: the trans input is missing"),
            ("mx_dp_deterministic", "DeformablePSROIPooling: deterministic=True: the native "
                                    "GPU path has no deterministic backward yet; use the "
                                    "Custom door on GPU contexts for it")):
        assert s[step]["rc"] == 0 and s[step]["log"] == [] and s[step]["error"] == message


def test_backward_zeroes_the_gradients_first(run):
    """Before any launch, on the caller's stream: the accumulator's bytes zeroed (req
    write; the kernels add into it) -- MXNet's data gradient, or for float16 the float32
    accumulator after the tables in the workspace --, then the rois' gradient (ROIAlign
    does not differentiate its rois; none when no pointer is given); no wait of any
    kind.  With no roi: the gradients zeroed, nothing launched."""
    from mx_roi.ext import cuda
    s, p = run["steps"], run["ptr"]
    size = N * C * H * W
    item = {"float32": 4, "float64": 8, "float16": 2}
    for step, dtype, rois_grad in (("bwd_avg", "float32", True), ("bwd_max", "float32", True),
                                   ("bwd_caffe", "float32", False),
                                   ("bwd_float64", "float64", True),
                                   ("bwd_float16", "float16", True)):
        log = s[step]["log"]
        first_launch = next(i for i, x in enumerate(log) if x.startswith("cuLaunchKernel"))
        sets = [x for x in log[:first_launch] if x.startswith("cuMemsetD8Async")]
        if dtype == "float16":
            acc = p["ws"] + cuda.roi_align_workspace("float16", R, P, H, W)
            want = [f"cuMemsetD8Async {acc:x} 0 {size * 4} stream {STREAM:x}"]
        else:
            want = [f"cuMemsetD8Async {p['in_grad']:x} 0 {size * item[dtype]} "
                    f"stream {STREAM:x}"]
        if rois_grad:
            want.append(f"cuMemsetD8Async {p['rois_grad']:x} 0 {R * 5 * item[dtype]} "
                        f"stream {STREAM:x}")
        assert sets == want, step
        assert calls(s[step])[-2:] == ["cuMemcpyDtoHAsync_v2", "cuEventRecord"], step
    for step, dtype in (("bwd_no_rois", "float32"), ("bwd_no_rois_float16", "float16")):
        assert s[step]["log"] == ["cuCtxGetCurrent",
                                  f"cuMemsetD8Async {p['in_grad']:x} 0 {size * item[dtype]} "
                                  f"stream {STREAM:x}"]


def test_backward_leaves_a_bad_roi_to_the_next_forward(run):
    """A backward must succeed (MXNet runs it even after its forward failed): a bad roi
    found by its geometry kernel (treated as padding) is not raised by it, nor by a later
    backward; the next forward on the stream reports it, launches nothing and queues the
    word's reset.  A workspace too small for the tables and float16's accumulator is
    refused before anything is queued."""
    s, status = run["steps"], run["status"]
    assert s["bwd_bad"]["error"] is None and len(launches(s["bwd_bad"])) == 3
    assert s["bwd_bad_busy"]["error"] is None and "cuEventQuery" not in calls(s["bwd_bad_busy"])
    assert s["bwd_bad_reported"]["error"] == ("ROIAlign: rois[2] has a NaN or infinite value; "
                                              "coordinates must be finite" + WHERE)
    assert s["bwd_bad_reported"]["log"] == [
        "cuCtxGetCurrent", "cuEventQuery e7 ready",
        f"cuMemsetD8Async {status:x} 0 40 stream {STREAM:x}"]
    from mx_roi.ext import cuda
    need = cuda.roi_align_backward_workspace("float16", (N, C, H, W), R, P)
    assert s["bwd_small_workspace"]["error"] == (
        f"ROIAlign: the workspace holds {need - 1} bytes but the call's tables and "
        f"accumulator need {need}")
    assert not launches(s["bwd_small_workspace"])
    assert not [x for x in s["bwd_small_workspace"]["log"] if x.startswith("cuMemset")]


def test_grid_is_capped(run):
    expr, grid, *_ = parse_launch(launches(run["steps"]["grid_cap"])[-1],
                                  ptx_params(run["image"]))
    assert grid == (65535, 1, 1)  # 2000 * 200 * 49 items: the grid-stride loops take the rest


def test_valid_calls_make_exactly_these_driver_calls(run):
    steps = run["steps"]
    assert calls(steps["first"]) == [  # (adaptive: the geometry, its bound, the op kernel)
        "cuInit", "cuCtxGetCurrent", "cuMemAlloc_v2", "cuMemHostAlloc", "cuEventCreate",
        "cuMemsetD8Async", "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel",
        "cuModuleGetFunction", "cuLaunchKernel", "cuModuleGetFunction", "cuLaunchKernel",
        "cuMemcpyDtoHAsync_v2", "cuEventRecord"]
    assert calls(steps["second"]) == [
        "cuCtxGetCurrent", "cuEventQuery", "cuLaunchKernel", "cuLaunchKernel",
        "cuLaunchKernel", "cuMemcpyDtoHAsync_v2", "cuEventRecord"]
    status = run["status"]
    first = steps["first"]["log"]
    assert f"cuMemsetD8Async {status:x} 0 40 stream {STREAM:x}" in first
    assert any(line.startswith(f"cuMemcpyDtoHAsync_v2 ") and f" {status:x} 40 stream "
               f"{STREAM:x}" in line for line in first)
    for name, step in steps.items():
        if step["error"] is None:  # every valid call: no wait of any kind
            assert not SYNC & set(calls(step)), name
        for line in step["log"]:
            if " stream " in line:
                want = OTHER_STREAM if name.startswith("other_stream") else \
                    MX_STREAM if name.startswith("mx_") else STREAM
                assert line.endswith(f"stream {want:x}") or f"stream {want:x} " in line, line


def test_one_module_load_and_the_ptx_image(run):
    loads = [line.split()[3] for s in run["steps"].values() for line in s["log"]
             if line.startswith("cuModuleLoadData")]
    # one module per image and context (roi_align.cu's; the cast kernel's at the first
    # float16 backward; roi_pooling.cu's, psroi_pooling.cu's, psroi_align.cu's,
    # rroi_align.cu's, prroi_pool.cu's, deformable_psroi_pooling.cu's), one function lookup
    # per kernel and module, of kernels the run launched
    assert len(loads) == len(set(loads)) == 8
    lookups = [tuple(line.split()[1:4:2]) for s in run["steps"].values() for line in s["log"]
               if line.startswith("cuModuleGetFunction")]
    assert len(lookups) == len(set(lookups))
    launched = {line.split()[1] for s in run["steps"].values() for line in launches(s)}
    assert {name for name, _ in lookups} == launched and {m for _, m in lookups} == set(loads)
    image = run["image"]  # (every image)
    assert image.count(f".target sm_{run['arch']}") == 8 and run["arch"] == min(
        a for a in nvrtc.supported_archs() if a >= 52)
    from mx_roi.ext import cuda
    entries = re.findall(r"\.entry\s+(\w+)", image)  # (each image's own)
    assert sorted(expression_of(n) for n in entries) == sorted(
        sum((cuda.kernel_expressions(f) for f in cuda.gpu_ops()), ())
        + cuda.OWN_KERNELS["ext_cuda_cast.cu"])


def test_status_word_rule(run):
    s = run["steps"]
    status = run["status"]
    reset = f"cuMemsetD8Async {status:x} 0 40 stream {STREAM:x}"
    # the bad call and a call while it still runs: no error, no wait, kernels queued
    assert s["bad"]["error"] is None and s["busy"]["error"] is None
    assert "cuEventQuery e7 busy" in s["busy"]["log"] and len(launches(s["busy"])) == 3
    # the first call once it has finished reports it, launches nothing, queues the reset
    assert s["reported"]["error"] == ("ROIAlign: rois[3] has a NaN or infinite value; "
                                      "coordinates must be finite" + WHERE)
    assert s["reported"]["log"] == ["cuCtxGetCurrent", "cuEventQuery e7 ready", reset]
    assert s["after_report"]["error"] is None and len(launches(s["after_report"])) == 3
    # check(wait=True): the one host wait (cuEventSynchronize), then the report
    assert s["check_wait"]["error"] == (
        "ROIAlign: rois[1] has a batch index beyond the images of data (valid: 0..N-1; a "
        "negative index marks a padding roi)" + WHERE)
    assert s["check_wait"]["log"] == ["cuCtxGetCurrent", "cuEventSynchronize e7", reset]
    assert s["check_overflow"]["error"] == (
        "ROIAlign: rois: a box needs more sample points per bin side than the device "
        "tables hold (a box far larger than the feature map); check the coordinates and "
        "spatial_scale, or run such boxes through the Custom door" + WHERE)
    assert s["check_clean"]["error"] is None and s["check_clean"]["log"] == ["cuCtxGetCurrent"]
    # the adaptive grid's samples-per-bin bound (roi_adaptive_bound: word 1 = 3), in
    # ROIAlign's parameter name (RROIAlign's word 1 = 2 names sampling_ratio)
    assert s["check_bound"]["error"] == (
        "ROIAlign: rois: a box needs more than 1048576 samples per bin with sample_ratio <= "
        "0; check the box size and spatial_scale, or set sample_ratio" + WHERE)
    # channels are per stream: stream A's bad roi is not stream B's error
    assert s["other_stream"]["error"] is None and s["other_stream_again"]["error"] is None
    assert "cuMemAlloc_v2" in calls(s["other_stream"])  # a status word of its own
    assert s["report_rois0"]["error"].startswith("ROIAlign: rois[0] has a NaN or infinite")
    assert s["max"]["error"] is None  # reported once, then gone


def test_errors_before_any_launch(run):
    s = run["steps"]
    assert s["no_rois"]["error"] is None
    assert calls(s["no_rois"]) == ["cuCtxGetCurrent", "cuEventQuery"]
    from mx_roi.ext import cuda
    need = cuda.roi_align_workspace("float32", R, P, H, W)
    assert s["small_workspace"]["error"] == (f"ROIAlign: the workspace holds {need - 1} bytes "
                                             f"but the call's tables need {need}")
    assert not launches(s["small_workspace"])
    assert s["no_context"]["error"] == ("ROIAlign: the native GPU path needs a current CUDA "
                                        "context on this thread")


def test_workspace_is_the_device_paths_table_block():
    from mx_roi.ext import cuda
    for dtype, R_, params in (("float32", 4, BASE), ("float16", 1, BASE),
                              ("float64", 33, dict(BASE, sample_ratio=2)),
                              ("float32", 5, dict(BASE, legacy="caffe", pool_mode="avg"))):
        _, nbytes, _ = python_binding(dtype, R_, C, params)
        assert cuda.roi_align_workspace(dtype, R_, P, H, W, params["sample_ratio"],
                                        params.get("legacy") == "caffe") == nbytes
    assert cuda.roi_align_workspace("float32", 0, P, H, W) == 0
    with pytest.raises(cuda.CudaLaunchError, match=r"^ROIAlign: data must be float16, "
                                                   r"float32 or float64 \(MXNet dtype code 3\)"):
        cuda._raise(*_workspace_raw(3))


def _workspace_raw(dtype_code):
    import ctypes
    from mx_roi.ext import cuda
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    rc = cuda._lib().mx_roi_ext_cuda_roi_align_workspace(dtype_code, 4, P, P, H, W, -1, 0,
                                                         ctypes.byref(out), err, len(err))
    return rc, err


def test_without_a_driver_the_call_says_so():
    import ctypes
    from mx_roi.ext import cuda
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(cuda.CudaLaunchError, match=r"^ROIAlign: the native GPU path "
                           r"cannot run: no NVIDIA driver: libcuda.so.1 not loadable"):
            cuda.roi_align_forward("float32", 1, 2, 3, (N, C, H, W), R, P, 0.5)
    else:  # pragma: no cover (a machine with a driver)
        pytest.skip("a driver is installed here")


def test_extension_ops_gpu_forward_as_mxnet_calls_it(run):
    """mx_roi_ROIAlign's "gpu" forward through lib_api.cc's _opCallFCompute (the call
    MXNet's CUDA build makes): opt-in (a clear error until the launcher is handed over),
    then the launcher on MXNet's stream with one workspace from MXNet's allocator; a bad
    parameter fails before any driver call.  The same for the "gpu" backward."""
    s = run["steps"]
    assert run["mx_contexts"] == ["backward/cpu", "backward/gpu", "forward/cpu", "forward/gpu"]
    for step in ("mx_not_enabled", "mx_backward_not_enabled"):
        assert s[step]["rc"] == 0 and s[step]["log"] == []
        assert s[step]["error"] == (
            "ROIAlign: the native GPU path is opt-in and not enabled in this process: call "
            "mx_roi.ext.cuda.enable() first, or use the Custom door on GPU contexts")
    assert s["mx_backward"]["rc"] == 1 and s["mx_backward"]["error"] is None
    assert len(launches(s["mx_backward"])) == 2  # (arguments: the backward arguments test)
    p = run["ptr"]
    assert [x for x in s["mx_backward"]["log"] if x.startswith("cuMemsetD8Async")] == [
        f"cuMemsetD8Async {p['in_grad']:x} 0 {N * C * H * W * 4} stream {MX_STREAM:x}",
        f"cuMemsetD8Async {p['rois_grad']:x} 0 {R * 5 * 4} stream {MX_STREAM:x}"]
    assert s["mx_backward_bad_param"]["rc"] == 0 and s["mx_backward_bad_param"]["log"] == []
    assert s["mx_backward_bad_param"]["error"].startswith(
        "ROIAlign: parameter 'sample_ratio': ")
    # the fixed-point backward is the CuPy path's alone: refused, nothing queued
    assert s["mx_backward_deterministic"]["rc"] == 0
    assert s["mx_backward_deterministic"]["log"] == []
    assert s["mx_backward_deterministic"]["error"] == (
        "ROIAlign: deterministic=True: the native GPU path has no deterministic backward "
        "yet; use the Custom door on GPU contexts for it")
    assert s["mx_forward"]["rc"] == 1 and s["mx_forward"]["error"] is None
    assert len(launches(s["mx_forward"])) == 2  # (arguments: the launch-arguments test)
    from mx_roi.ext import cuda
    assert [s[k]["ws"][0][1] for k in ("mx_forward", "mx_backward", "mx_backward_float16")] \
        == [cuda.roi_align_workspace("float32", R, P, H, W, 2),
            cuda.roi_align_backward_workspace("float32", (N, C, H, W), R, P, 2),
            cuda.roi_align_backward_workspace("float16", (N, C, H, W), R, P, 2)]
    assert s["mx_backward_float16"]["rc"] == 1 and len(launches(s["mx_backward_float16"])) == 3
    assert s["mx_bad_param"]["rc"] == 0 and s["mx_bad_param"]["log"] == []
    assert s["mx_bad_param"]["error"] == ("ROIAlign: parameter 'pool_mode': expected one of "
                                          "'avg', 'max', got 'median'")


def test_an_ops_gpu_entries_live_in_its_own_files(monkeypatch):
    """The launcher library gathers each op's native GPU section (its .cu file's
    ``MX_ROI_EXT_CUDA_LAUNCHER`` block) and the kernels its .py declares; the shared part
    (ext_cuda_ops.cc) names no op.  An op declaring kernels without a section is refused
    by name."""
    from mx_roi.ext import ExtLibraryError, cuda
    cls = get_op("ROIAlign")
    assert cuda.gpu_ops() == {
        get_op(n).cuda_source: get_op(n).native_gpu_kernels
        for n in ("ROIAlign", "ROIPooling", "PSROIPooling", "PSROIAlign", "RROIAlign",
                  "PrRoIPool", "DeformablePSROIPooling")}
    text = cuda.section("roi_align.cu")
    assert text.startswith("#ifdef MX_ROI_EXT_CUDA_LAUNCHER\n")
    assert text.endswith("#endif  // MX_ROI_EXT_CUDA_LAUNCHER\n")
    for entry in ("mx_roi_ext_cuda_roi_align_workspace", "mx_roi_ext_cuda_roi_align_forward",
                  "mx_roi_ext_cuda_roi_align_backward_workspace",
                  "mx_roi_ext_cuda_roi_align_backward"):
        assert f"int {entry}(" in text
    with open(os.path.join(ROOT, "mx_roi", "ext", "ext_cuda_ops.cc")) as f:
        shared = f.read()
    for name in ("roi_align", "roialign", "roi_pooling", "roipooling"):
        assert name not in shared.lower()
    assert cuda.image_name("roi_align.cu") == "ROI_ALIGN_IMAGE"
    read = S.read_source
    monkeypatch.setattr(S, "read_source", lambda f: read(f).replace(
        "#ifdef MX_ROI_EXT_CUDA_LAUNCHER", "#ifdef SOMETHING_ELSE")
        if f == "deformable_psroi_pooling.cu" else read(f))
    with pytest.raises(ExtLibraryError, match=r"^DeformablePSROIPooling declares "
                                              r"native_gpu_kernels but "
                                              r"deformable_psroi_pooling.cu has no "
                                              r"MX_ROI_EXT_CUDA_LAUNCHER section$"):
        cuda.gpu_ops()
