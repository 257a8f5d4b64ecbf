"""Child process of tests/test_ext_cuda.py: drives the native GPU launcher
(mx_roi.ext.cuda) against the stand-in libcuda.so.1 (tests/fake_libcuda.c, found through
LD_LIBRARY_PATH) and prints one JSON object: per step, the driver calls it made and the
error it raised.  The "device pointers" are host buffers (the stand-in runs no kernel)."""
import ctypes
import json
import sys

import numpy as np

from mx_roi.ext import cuda

fake = ctypes.CDLL("libcuda.so.1")  # the stand-in (the launcher opens the same by soname)
fake.fake_log.restype = ctypes.c_char_p
fake.fake_image.restype = ctypes.c_char_p

STREAM, OTHER_STREAM = 0x5100, 0x5200
N, C, H, W, R, P = 2, 3, 19, 25, 4, 7
buffers = {name: np.full(n, 0xCD, np.uint8) for name, n in
           (("data", 1 << 18), ("rois", 1 << 10), ("out", 1 << 16), ("ws", 1 << 20),
            ("grad", 1 << 16), ("in_grad", 1 << 18), ("rois_grad", 1 << 10),
            ("trans", 1 << 17), ("trans_grad", 1 << 17))}
ptr = {k: v.ctypes.data for k, v in buffers.items()}
steps = {}


def step(name, call, ready=True):
    fake.fake_clear()
    fake.fake_set_ready(int(ready))
    error = None
    try:
        call()
    except cuda.CudaLaunchError as exc:
        error = str(exc)
    steps[name] = {"log": fake.fake_log().decode().splitlines(), "error": error}


def forward(dtype="float32", stream=STREAM, R=R, ws=None, channels=C, pooled=P, **kw):
    args = dict(spatial_scale=0.5, sample_ratio=-1, aligned=False, pool_mode="avg")
    args.update(kw)
    bytes_ = cuda.roi_align_workspace(dtype, R, pooled, H, W, args["sample_ratio"],
                                      args.get("caffe", False)) if ws is None else ws
    return lambda: cuda.roi_align_forward(dtype, ptr["data"], ptr["rois"], ptr["out"],
                                          (N, channels, H, W), R, pooled, workspace=ptr["ws"],
                                          workspace_bytes=bytes_, stream=stream, **args)


def backward(dtype="float32", stream=STREAM, R=R, rois_grad=True, ws=None, **kw):
    args = dict(spatial_scale=0.5, sample_ratio=-1, aligned=False, pool_mode="avg")
    args.update(kw)
    bytes_ = cuda.roi_align_backward_workspace(dtype, (N, C, H, W), R, P, args["sample_ratio"],
                                               args.get("caffe", False)) if ws is None else ws
    return lambda: cuda.roi_align_backward(
        dtype, ptr["grad"], ptr["data"], ptr["rois"], ptr["in_grad"], (N, C, H, W), R, P,
        workspace=ptr["ws"], workspace_bytes=bytes_, stream=stream,
        rois_grad=ptr["rois_grad"] if rois_grad else 0, **args)


def status_ptr(stream_steps):
    """The status word's device address: the channel's cuMemAlloc_v2."""
    line = next(x for x in stream_steps["log"] if x.startswith("cuMemAlloc_v2"))
    return int(line.split()[2], 16)


def plant(address, word0, word1=0, trans=None):
    """What the geometry kernel would leave in the status word for a bad roi (and
    ``trans``: (r, channel, u, v, value), what deformable_trans_status leaves in words
    2..4 for a bad offset)."""
    words = [0, 0, 0]
    if trans:
        r, c, u, v, value = trans
        words = [r + 1, c << 32 | u << 16 | v, int(np.float64(value).view(np.uint64))]
    (ctypes.c_uint64 * 5).from_address(address)[:] = [word0, word1] + words


def dtype_steps(tag, make):
    """An op's first steps on STREAM: ``{tag}_first`` (the float32 forward, which makes the
    op's channel), the forward in float64 and float16, then the backward in each dtype
    (``{tag}_bwd``, ``_bwd_f64``, ``_bwd_f16``); ``make(direction, dtype)`` gives a call.
    Returns the channel's status word."""
    step(f"{tag}_first", make("forward", "float32"))
    for name, direction, dtype in (("fwd_f64", "forward", "float64"),
                                   ("fwd_f16", "forward", "float16"),
                                   ("bwd", "backward", "float32"),
                                   ("bwd_f64", "backward", "float64"),
                                   ("bwd_f16", "backward", "float16")):
        step(f"{tag}_{name}", make(direction, dtype))
    return status_ptr(steps[f"{tag}_first"])


step("first", forward())
status = status_ptr(steps["first"])
step("second", forward())
# each plant stands for the geometry kernel of the call that follows it finding a bad roi
plant(status, ~3 & (2 ** 64 - 1))               # rois[3] non-finite (roi_status's key 3)
step("bad", forward())
step("busy", forward(), ready=False)            # the bad call still running: no check
step("reported", forward())                     # ...finished: this call reports it
step("after_report", forward())
plant(status, ~((1 << 62) + 1) & (2 ** 64 - 1))  # rois[1]'s batch index out of range
step("bad_batch", forward())
step("check_wait", lambda: cuda.check("ROIAlign", STREAM, wait=True), ready=False)
plant(status, 0, 1)                             # a box the tables could not hold
step("bad_overflow", forward())
step("check_overflow", lambda: cuda.check("ROIAlign", STREAM, wait=False))
step("check_clean", lambda: cuda.check("ROIAlign", STREAM, wait=False))
plant(status, 0, 3)                             # a box over the samples-per-bin bound
step("bad_bound", forward())
step("check_bound", lambda: cuda.check("ROIAlign", STREAM, wait=False))
step("other_stream", forward(stream=OTHER_STREAM))
plant(status, ~0 & (2 ** 64 - 1))               # rois[0] bad on STREAM ...
step("bad_rois0", forward())
step("other_stream_again", forward(stream=OTHER_STREAM))  # ... not OTHER_STREAM's error
step("report_rois0", forward())
step("max", forward(pool_mode="max", sample_ratio=2, aligned=True))
step("caffe", forward(caffe=True, sample_ratio=3, aligned=True))
step("float16", forward("float16"))
step("rect", forward(pooled=(P, 5)))            # a 7 x 5 pool (P and Q each in its place)
step("float64", forward("float64"))
step("no_rois", forward(R=0))
step("small_workspace", forward(ws=cuda.roi_align_workspace("float32", R, P, H, W) - 1))
step("many_items", forward(R=2000))
step("grid_cap", forward(R=2000, channels=200))
# ---- the backward ----
step("bwd_avg", backward())
step("bwd_max", backward(pool_mode="max", sample_ratio=2, aligned=True))
step("bwd_caffe", backward(caffe=True, sample_ratio=3, aligned=True, rois_grad=False))
step("bwd_float64", backward("float64"))
step("bwd_float16", backward("float16"))
step("bwd_no_rois", backward(R=0))
step("bwd_no_rois_float16", backward("float16", R=0))
step("bwd_small_workspace", backward("float16", ws=cuda.roi_align_backward_workspace(
    "float16", (N, C, H, W), R, P) - 1))
plant(status, ~2 & (2 ** 64 - 1))               # the backward's geometry finds rois[2] bad
step("bwd_bad", backward())                     # ... and raises nothing
step("bwd_bad_busy", backward(), ready=False)   # nor does the next backward (none asks)
step("bwd_bad_reported", forward())             # the next forward reports it
# ---- ROIPooling (its own channel on the same stream) ----
def pool(direction="forward", dtype="float32", R=R, ws=None, hw=(H, W)):
    shape = (N, C) + hw
    bytes_ = cuda.roi_pooling_workspace(dtype, shape, R, P,
                                        direction == "backward") if ws is None else ws
    common = dict(workspace=ptr["ws"], workspace_bytes=bytes_, stream=STREAM)
    if direction == "forward":
        return lambda: cuda.roi_pooling_forward(dtype, ptr["data"], ptr["rois"], ptr["out"],
                                                shape, R, P, 0.5, **common)
    return lambda: cuda.roi_pooling_backward(dtype, ptr["grad"], ptr["data"], ptr["rois"],
                                             ptr["in_grad"], shape, R, P, 0.5,
                                             rois_grad=ptr["rois_grad"], **common)


pool_status = dtype_steps("pool", pool)
step("pool_tiny_map", pool(hw=(1, 2)))           # bins' cell bound: the map's 2 cells
plant(pool_status, ~1 & (2 ** 64 - 1))          # the backward's geometry finds rois[1] bad
step("pool_bad_bwd", pool("backward"))
step("pool_reported", pool())
step("pool_no_rois", pool(R=0))
step("pool_small_workspace", pool(ws=cuda.roi_pooling_workspace("float32", (N, C, H, W), R,
                                                                P) - 1))
# ---- the position-sensitive ops (a channel each; output_dim 2 on a 2 x 3 group grid) ----
PS_D, PS_GROUP, PS_CIN = 2, (2, 3), 12


def ps(op, direction="forward", dtype="float32", R=R, ws=None, channels=PS_CIN, **grid):
    shape = (N, channels, H, W)
    back = direction == "backward"
    if op == "PSROIPooling":
        need = cuda.psroi_pooling_workspace(dtype, shape, R, P, PS_D, back)
        fwd, bwd, grid = cuda.psroi_pooling_forward, cuda.psroi_pooling_backward, {}
    else:
        grid = dict(dict(sample_ratio=-1, aligned=False, legacy="", sample_num=2), **grid)
        need = cuda.psroi_align_workspace(dtype, shape, R, P, PS_D, grid["sample_ratio"],
                                          grid["legacy"], grid["sample_num"], back)
        fwd, bwd = cuda.psroi_align_forward, cuda.psroi_align_backward
    common = dict(group_size=PS_GROUP, workspace=ptr["ws"],
                  workspace_bytes=need if ws is None else ws, stream=STREAM, **grid)
    if not back:
        return lambda: fwd(dtype, ptr["data"], ptr["rois"], ptr["out"], shape, R, P, PS_D, 0.5,
                           **common)
    return lambda: bwd(dtype, ptr["grad"], ptr["rois"], ptr["in_grad"], shape, R, P, PS_D,
                       0.5, rois_grad=ptr["rois_grad"], **common)


ps_status = {}
for op, tag in (("PSROIPooling", "psp"), ("PSROIAlign", "psa")):
    ps_status[op] = dtype_steps(tag, lambda direction, dtype, op=op: ps(op, direction, dtype))
    plant(ps_status[op], ~3 & (2 ** 64 - 1))     # the backward's geometry finds rois[3] bad
    step(f"{tag}_bad_bwd", ps(op, "backward"))
    step(f"{tag}_reported", ps(op))
    step(f"{tag}_no_rois", ps(op, R=0))
    step(f"{tag}_bwd_no_rois", ps(op, "backward", R=0))
    step(f"{tag}_channels", ps(op, channels=PS_CIN + 1))
    step(f"{tag}_bwd_channels", ps(op, "backward", channels=PS_CIN - 1))
    step(f"{tag}_small_workspace", ps(op, ws=(cuda.psroi_pooling_workspace(
        "float32", (N, PS_CIN, H, W), R, P, PS_D) if op == "PSROIPooling" else
        cuda.psroi_align_workspace("float32", (N, PS_CIN, H, W), R, P, PS_D)) - 1))
step("psa_fixed", ps("PSROIAlign", sample_ratio=2, aligned=True))
step("psa_rfcn", ps("PSROIAlign", legacy="rfcn", sample_num=3))
step("psa_bwd_rfcn", ps("PSROIAlign", "backward", legacy="rfcn", sample_num=3))
step("psa_bwd_fixed_f16", ps("PSROIAlign", "backward", "float16", sample_ratio=2,
                             aligned=True))
# ---- RROIAlign (its kernels read the rois: the checked copy first) ----
def rroi(direction="forward", dtype="float32", R=R, ws=None, **kw):
    shape = (N, C, H, W)
    back = direction == "backward"
    need = cuda.rroi_align_workspace(dtype, shape, R, back)
    common = dict(workspace=ptr["ws"], workspace_bytes=need if ws is None else ws,
                  stream=STREAM, **kw)
    if not back:
        return lambda: cuda.rroi_align_forward(dtype, ptr["data"], ptr["rois"], ptr["out"],
                                               shape, R, P, 0.5, **common)
    return lambda: cuda.rroi_align_backward(dtype, ptr["grad"], ptr["rois"], ptr["in_grad"],
                                            shape, R, P, 0.5, rois_grad=ptr["rois_grad"],
                                            **common)


rra_status = dtype_steps("rra", rroi)
step("rra_fixed", rroi(sampling_ratio=2, aligned=True, clockwise=True))
step("rra_bwd_fixed_f64", rroi("backward", "float64", sampling_ratio=3, clockwise=True))
plant(rra_status, 0, 2)                         # a box over the samples-per-bin bound
step("rra_bad_bwd", rroi("backward"))
step("rra_reported", rroi())
step("rra_no_rois", rroi(R=0))
step("rra_bwd_no_rois", rroi("backward", R=0))
step("rra_small_workspace", rroi(ws=cuda.rroi_align_workspace("float32", (N, C, H, W), R)
                                 - 1))
# ---- PrRoIPool (the checked copy first; the backward writes the rois' gradient too) ----
def prroi(direction="forward", dtype="float32", R=R, ws=None, rois_grad=True):
    shape = (N, C, H, W)
    back = direction == "backward"
    need = cuda.prroi_pool_workspace(dtype, shape, R, back)
    common = dict(workspace=ptr["ws"], workspace_bytes=need if ws is None else ws,
                  stream=STREAM)
    if not back:
        return lambda: cuda.prroi_pool_forward(dtype, ptr["data"], ptr["rois"], ptr["out"],
                                               shape, R, P, 0.5, **common)
    return lambda: cuda.prroi_pool_backward(
        dtype, ptr["grad"], ptr["data"], ptr["rois"], ptr["in_grad"], shape, R, P, 0.5,
        rois_grad=ptr["rois_grad"] if rois_grad else 0, **common)


prp_status = dtype_steps("prp", prroi)
step("prp_bwd_no_rois_grad", prroi("backward", rois_grad=False))
plant(prp_status, ~((1 << 62) + 2) & (2 ** 64 - 1))  # rois[2]'s batch index out of range
step("prp_bad_bwd", prroi("backward"))
step("prp_reported", prroi())
step("prp_no_rois", prroi(R=0))
step("prp_bwd_no_rois", prroi("backward", R=0))
step("prp_small_workspace", prroi("backward", "float16", ws=cuda.prroi_pool_workspace(
    "float16", (N, C, H, W), R, True) - 1))
# ---- DeformablePSROIPooling (the checked rois and the offsets' device check first) ----
DP = dict(output_dim=2, group_size=2, pooled_size=P, part_size=3, sample_per_part=2,
          trans_std=0.1, spatial_scale=0.5)
DP_CIN, DP_K = 8, 2                             # output_dim * group_size^2; offset classes


def deform(direction="forward", dtype="float32", R=R, ws=None, trans=True, K=DP_K,
           channels=DP_CIN, hw=(H, W), trans_grad=True, **kw):
    shape = (N, channels) + hw
    args = dict(DP, **kw)
    back = direction == "backward"
    part = args["part_size"] or args["pooled_size"]
    need = cuda.deformable_psroi_pooling_workspace(dtype, shape, R, K if trans else 0, part,
                                                   back)
    common = dict(workspace=ptr["ws"], workspace_bytes=need if ws is None else ws,
                  stream=STREAM, **args)
    t = ptr["trans"] if trans else 0
    if not back:
        return lambda: cuda.deformable_psroi_pooling_forward(
            dtype, ptr["data"], ptr["rois"], t, ptr["out"], shape, R, K, **common)
    return lambda: cuda.deformable_psroi_pooling_backward(
        dtype, ptr["grad"], ptr["data"], ptr["rois"], t, ptr["in_grad"], shape, R, K,
        rois_grad=ptr["rois_grad"], trans_grad=ptr["trans_grad"] if trans_grad else 0,
        **common)


dp_status = dtype_steps("dp", deform)
step("dp_no_trans", deform(trans=False))
step("dp_bwd_no_trans", deform("backward", trans=False))
step("dp_bwd_no_trans_grad", deform("backward", trans_grad=False))
# the offsets' gradient fused into the data gradient's pass (K = output_dim, part = pooled
# and distinct part cells in the compute type): 7 both; 26 float32 only, 29 float64 only
for size in (7, 26, 29):
    for dt in ("float32", "float64", "float16"):
        step(f"dp_bwd_fuse{size}_{dt}", deform("backward", dt, K=2, pooled_size=size,
                                               part_size=0))
plant(dp_status, 0, 0, (3, 1, 2, 0, 3.1e38))    # the offsets' check finds trans[3, 1, 2, 0]
step("dp_bad_trans", deform("backward"))
step("dp_trans_reported", deform())
plant(dp_status, 0, 0, (0, 3, 0, 2, float("nan")))
step("dp_bad_trans_busy", deform(), ready=False)
step("dp_trans_nan_reported", deform())
plant(dp_status, ~1 & (2 ** 64 - 1), 0, (2, 0, 1, 1, float("-inf")))  # a roi and an offset
step("dp_roi_first", deform())
step("dp_after_roi", deform())
step("dp_no_rois", deform(R=0))
step("dp_bwd_no_rois", deform("backward", R=0))
step("dp_channels", deform(channels=DP_CIN - 1))
step("dp_bwd_channels", deform("backward", channels=DP_CIN - 1))
step("dp_bad_K", deform(K=3))
step("dp_bad_params", deform(sample_per_part=0))
step("dp_huge_plane", deform(hw=(1 << 16, 1 << 15), ws=1 << 20))
step("dp_empty_map", deform(hw=(0, W)))
step("dp_bwd_empty_map", deform("backward", hw=(0, W)))
step("dp_small_workspace", deform("backward", "float16", ws=cuda.deformable_psroi_pooling_workspace(
    "float16", (N, DP_CIN, H, W), R, DP_K, 3, True) - 1))
fake.fake_set_context(0)
step("no_context", forward())
fake.fake_set_context(1)

# ---- the extension op's "gpu" forward, called as MXNet calls it (lib_api.cc) -------------
from mx_roi import ext  # noqa: E402

V = ctypes.c_void_p
extlib = ctypes.CDLL(ext.library_path())


def op_functions(name):
    """{(direction, ctx): function pointer} of the extension op ``name`` (_opRegGet)."""
    for i in range(extlib._opRegSize()):
        got, sg = ctypes.c_char_p(), ctypes.c_int()
        fctx, bctx, cctx = (ctypes.POINTER(ctypes.c_char_p)() for _ in range(3))
        ffp, bfp, cfp = (ctypes.POINTER(V)() for _ in range(3))
        fn, bn, cn = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        rest = [V() for _ in range(5)]
        extlib._opRegGet(i, ctypes.byref(got), ctypes.byref(sg), ctypes.byref(fctx),
                         ctypes.byref(ffp), ctypes.byref(fn), ctypes.byref(bctx),
                         ctypes.byref(bfp), ctypes.byref(bn), ctypes.byref(cctx),
                         ctypes.byref(cfp), ctypes.byref(cn), *map(ctypes.byref, rest))
        if got.value == name:
            return {**{("forward", fctx[k].decode()): ffp[k] for k in range(fn.value)},
                    **{("backward", bctx[k].decode()): bfp[k] for k in range(bn.value)}}
    raise KeyError(name)


GPU_MALLOC = ctypes.CFUNCTYPE(V, V, ctypes.c_int)
gpu_allocs = []


@GPU_MALLOC
def gpu_malloc(state, size):
    """MXNet's temporary workspace (host memory standing in; garbage-filled)."""
    gpu_allocs.append(np.full(size, 0xAB, np.uint8))
    return gpu_allocs[-1].ctypes.data


def fcompute(fp, attrs, stream, direction="forward", R_=R, dtype=0, channels=(C, C),
             columns=5, extra=None, extra_dtype=None):
    """_opCallFCompute(fp), all "gpu" tensors of MXNet dtype code ``dtype``: the forward on
    (data, rois) -> out, the backward on (out-grad, data, rois) -> (data's gradient, rois'
    gradient), as MXNet hands them to a stateless op; ``channels``: the data's and the
    output's; ``extra``: a third input's shape (DeformablePSROIPooling's trans: an input
    after the rois and its gradient after theirs), of ``extra_dtype`` where given;
    (rc, last message)."""
    keys = (ctypes.c_char_p * len(attrs))(*[k.encode() for k in attrs])
    vals = (ctypes.c_char_p * len(attrs))(*[str(v).encode() for v in attrs.values()])
    pooled = attrs["pooled_size"]
    P_, Q_ = (pooled, pooled) if isinstance(pooled, int) else pooled
    (Cd, Co) = channels
    data, rois, out = ((N, Cd, H, W), ptr["data"]), ((R_, columns), ptr["rois"]), \
        ((R_, Co, P_, Q_), ptr["out"])
    if direction == "forward":
        ins, outs = [data, rois], [out]
    else:
        ins = [((R_, Co, P_, Q_), ptr["grad"]), data, rois]
        outs = [((N, Cd, H, W), ptr["in_grad"]), ((R_, columns), ptr["rois_grad"])]
    kinds = [dtype] * len(ins)
    if extra is not None:
        ins.append((extra, ptr["trans"]))
        kinds.append(dtype if extra_dtype is None else extra_dtype)
        if direction == "backward":
            outs.append((extra, ptr["trans_grad"]))

    def arrays(tensors, codes):
        shapes = [(ctypes.c_int64 * len(s))(*s) for s, _ in tensors]
        n = len(tensors)
        return (shapes, (ctypes.POINTER(ctypes.c_int64) * n)(
                    *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]),
                (ctypes.c_int * n)(*[len(s) for s, _ in tensors]),
                (V * n)(*[p for _, p in tensors]), (ctypes.c_int * n)(*codes),
                (ctypes.c_size_t * n)(), (ctypes.c_char_p * n)(*[b"gpu"] * n),
                (ctypes.c_int * n)())
    i, o = arrays(ins, kinds), arrays(outs, [dtype] * len(outs))
    ni, no = len(ins), len(outs)
    rc = extlib._opCallFCompute(
        V(fp), keys, vals, len(attrs), *i[1:], ni, *o[1:], no, V(), V(), gpu_malloc, V(),
        V(stream), V(), V(), (ctypes.c_int * ni)(), (ctypes.c_int * no)(), (V * ni)(),
        (V * no)(), (V * ni)(), (V * no)(), (ctypes.c_int64 * ni)(), (ctypes.c_int64 * no)(),
        (ctypes.c_int64 * ni)(), (ctypes.c_int64 * no)(), V(), V())
    msg = ctypes.c_char_p()
    n = extlib._msgSize()
    if n:
        extlib._msgGet(n - 1, ctypes.byref(msg))
    return rc, (msg.value.decode() if n else None)


MX_STREAM = 0x5300
fns = op_functions(b"mx_roi_ROIAlign")
mx_contexts = sorted("/".join(k) for k in fns)
ATTRS = {"pooled_size": (P, P), "spatial_scale": 0.5, "sample_ratio": 2, "aligned": True,
         "pool_mode": "max"}


def mx_step(name, attrs, stream=MX_STREAM, direction="forward", dtype=0, channels=(C, C),
            columns=5, **extra):
    fake.fake_clear()
    fake.fake_set_ready(1)
    allocs = len(gpu_allocs)
    rc, msg = fcompute(fns[(direction, "gpu")], attrs, stream, direction, dtype=dtype,
                       channels=channels, columns=columns, **extra)
    steps[name] = {"log": fake.fake_log().decode().splitlines(), "rc": rc,
                   "error": msg if rc != 1 else None,  # lib_api: MX_SUCCESS 1, MX_FAIL 0
                   # MXNet's workspace of the call (its address and size), if it asked
                   "ws": [(a.ctypes.data, a.size) for a in gpu_allocs[allocs:]]}


mx_step("mx_not_enabled", ATTRS)
mx_step("mx_backward_not_enabled", ATTRS, direction="backward")
err = ctypes.create_string_buffer(1024)
assert extlib.mx_roi_ext_set_gpu_launcher(cuda.library_path().encode(), err, len(err)) == 0
mx_step("mx_forward", ATTRS)
mx_step("mx_bad_param", dict(ATTRS, pool_mode="median"))
mx_step("mx_backward", ATTRS, direction="backward")
mx_step("mx_backward_bad_param", dict(ATTRS, sample_ratio="two"), direction="backward")
mx_step("mx_backward_deterministic", dict(ATTRS, deterministic=True), direction="backward")
mx_step("mx_backward_float16", ATTRS, direction="backward", dtype=2)  # (MXDType kFloat16)
fns = op_functions(b"mx_roi_ROIPooling")
POOL_ATTRS = {"pooled_size": (P, P), "spatial_scale": 0.5}
mx_step("mx_pool_forward", POOL_ATTRS)
mx_step("mx_pool_backward", POOL_ATTRS, direction="backward")
pool_contexts = sorted("/".join(k) for k in fns)
PS_ATTRS = {"pooled_size": (P, P), "spatial_scale": 0.5, "output_dim": PS_D,
            "group_size": PS_GROUP}
ps_contexts = {}
for op, tag, extra in (("PSROIPooling", "psp", {}),
                       ("PSROIAlign", "psa", {"sample_ratio": 2, "aligned": True})):
    fns = op_functions(f"mx_roi_{op}".encode())
    ps_contexts[op] = sorted("/".join(k) for k in fns)
    attrs = dict(PS_ATTRS, **extra)
    mx_step(f"mx_{tag}_forward", attrs, channels=(PS_CIN, PS_D))
    mx_step(f"mx_{tag}_backward", attrs, direction="backward", channels=(PS_CIN, PS_D))
    mx_step(f"mx_{tag}_backward_f16", attrs, direction="backward", dtype=2,
            channels=(PS_CIN, PS_D))
    mx_step(f"mx_{tag}_deterministic", dict(attrs, deterministic=True), direction="backward",
            channels=(PS_CIN, PS_D))
fns = op_functions(b"mx_roi_RROIAlign")
ps_contexts["RROIAlign"] = sorted("/".join(k) for k in fns)
RROI_ATTRS = {"pooled_size": (P, P), "spatial_scale": 0.5, "sampling_ratio": 2,
              "clockwise": True}
mx_step("mx_rra_forward", RROI_ATTRS, columns=6)
mx_step("mx_rra_backward", RROI_ATTRS, direction="backward", columns=6)
mx_step("mx_rra_backward_f16", RROI_ATTRS, direction="backward", dtype=2, columns=6)
mx_step("mx_rra_deterministic", dict(RROI_ATTRS, deterministic=True), direction="backward",
        columns=6)
fns = op_functions(b"mx_roi_PrRoIPool")
ps_contexts["PrRoIPool"] = sorted("/".join(k) for k in fns)
PRROI_ATTRS = {"pooled_size": (P, P), "spatial_scale": 0.5}
mx_step("mx_prp_forward", PRROI_ATTRS)
mx_step("mx_prp_backward", PRROI_ATTRS, direction="backward")
mx_step("mx_prp_backward_f16", PRROI_ATTRS, direction="backward", dtype=2)
fns = op_functions(b"mx_roi_DeformablePSROIPooling")
ps_contexts["DeformablePSROIPooling"] = sorted("/".join(k) for k in fns)
DP_ATTRS = {"pooled_size": P, "spatial_scale": 0.5, "output_dim": 2, "group_size": 2,
            "part_size": 3, "sample_per_part": 2, "trans_std": 0.1}
DP_TRANS = (R, 2 * DP_K, 3, 3)
mx_step("mx_dp_forward", DP_ATTRS, channels=(DP_CIN, 2), extra=DP_TRANS)
mx_step("mx_dp_backward", DP_ATTRS, direction="backward", channels=(DP_CIN, 2),
        extra=DP_TRANS)
mx_step("mx_dp_backward_f16", DP_ATTRS, direction="backward", dtype=2, channels=(DP_CIN, 2),
        extra=DP_TRANS)
mx_step("mx_dp_no_trans", dict(DP_ATTRS, no_trans=True), channels=(DP_CIN, 2))
mx_step("mx_dp_bwd_no_trans", dict(DP_ATTRS, no_trans=True), direction="backward",
        channels=(DP_CIN, 2))
mx_step("mx_dp_trans_shape", DP_ATTRS, channels=(DP_CIN, 2), extra=(R, 4, 3, 2))
mx_step("mx_dp_trans_missing", DP_ATTRS, channels=(DP_CIN, 2))  # (a C caller's two inputs)
mx_step("mx_dp_trans_dtype", DP_ATTRS, channels=(DP_CIN, 2), extra=DP_TRANS, extra_dtype=1)
mx_step("mx_dp_deterministic", dict(DP_ATTRS, deterministic=True), direction="backward",
        channels=(DP_CIN, 2), extra=DP_TRANS)
print(json.dumps({"steps": steps, "ptr": ptr, "status": status,
                  "image": fake.fake_image().decode(), "arch": cuda.ptx_arch(),
                  "mx_contexts": mx_contexts, "pool_contexts": pool_contexts,
                  "ps_contexts": ps_contexts}))
sys.stdout.flush()
