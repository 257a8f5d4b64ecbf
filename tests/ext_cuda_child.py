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
           (("data", 1 << 16), ("rois", 1 << 10), ("out", 1 << 16), ("ws", 1 << 20))}
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


def forward(dtype="float32", stream=STREAM, R=R, ws=None, channels=C, **kw):
    args = dict(spatial_scale=0.5, sample_ratio=-1, aligned=False, pool_mode="avg")
    args.update(kw)
    bytes_ = cuda.roi_align_workspace(dtype, R, P, H, W, args["sample_ratio"],
                                      args.get("caffe", False)) if ws is None else ws
    return lambda: cuda.roi_align_forward(dtype, ptr["data"], ptr["rois"], ptr["out"],
                                          (N, channels, H, W), R, P, workspace=ptr["ws"],
                                          workspace_bytes=bytes_, stream=stream, **args)


def status_ptr(stream_steps):
    """The status word's device address: the channel's cuMemAlloc_v2."""
    line = next(x for x in stream_steps["log"] if x.startswith("cuMemAlloc_v2"))
    return int(line.split()[2], 16)


def plant(address, word0, word1=0):
    """What the geometry kernel would leave in the status word for a bad roi."""
    (ctypes.c_uint64 * 2).from_address(address)[:] = [word0, word1]


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
step("other_stream", forward(stream=OTHER_STREAM))
plant(status, ~0 & (2 ** 64 - 1))               # rois[0] bad on STREAM ...
step("bad_rois0", forward())
step("other_stream_again", forward(stream=OTHER_STREAM))  # ... not OTHER_STREAM's error
step("report_rois0", forward())
step("max", forward(pool_mode="max", sample_ratio=2, aligned=True))
step("caffe", forward(caffe=True, sample_ratio=3, aligned=True))
step("float16", forward("float16"))
step("float64", forward("float64"))
step("no_rois", forward(R=0))
step("small_workspace", forward(ws=cuda.roi_align_workspace("float32", R, P, H, W) - 1))
step("many_items", forward(R=2000))
step("grid_cap", forward(R=2000, channels=200))
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


def fcompute(fp, attrs, stream, R_=R):
    """_opCallFCompute(fp) on (data, rois) -> out, all "gpu" tensors; (rc, last message)."""
    keys = (ctypes.c_char_p * len(attrs))(*[k.encode() for k in attrs])
    vals = (ctypes.c_char_p * len(attrs))(*[str(v).encode() for v in attrs.values()])
    P_, Q_ = attrs["pooled_size"]
    shapes = [(ctypes.c_int64 * 4)(N, C, H, W), (ctypes.c_int64 * 2)(R_, 5),
              (ctypes.c_int64 * 4)(R_, C, P_, Q_)]
    inshapes = (ctypes.POINTER(ctypes.c_int64) * 2)(
        ctypes.cast(shapes[0], ctypes.POINTER(ctypes.c_int64)),
        ctypes.cast(shapes[1], ctypes.POINTER(ctypes.c_int64)))
    outshapes = (ctypes.POINTER(ctypes.c_int64) * 1)(
        ctypes.cast(shapes[2], ctypes.POINTER(ctypes.c_int64)))
    two, one = (lambda t, *v: (t * 2)(*v)), (lambda t, *v: (t * 1)(*v))
    rc = extlib._opCallFCompute(
        V(fp), keys, vals, len(attrs), inshapes, two(ctypes.c_int, 4, 2),
        two(V, ptr["data"], ptr["rois"]), two(ctypes.c_int, 0, 0), two(ctypes.c_size_t, 0, 0),
        two(ctypes.c_char_p, b"gpu", b"gpu"), two(ctypes.c_int, 0, 0), 2, outshapes,
        one(ctypes.c_int, 4), one(V, ptr["out"]), one(ctypes.c_int, 0), one(ctypes.c_size_t, 0),
        one(ctypes.c_char_p, b"gpu"), one(ctypes.c_int, 0), 1, V(), V(), gpu_malloc, V(),
        V(stream), V(), V(), two(ctypes.c_int, 0, 0), one(ctypes.c_int, 0), two(V), one(V),
        two(V), one(V), two(ctypes.c_int64), one(ctypes.c_int64), two(ctypes.c_int64),
        one(ctypes.c_int64), V(), V())
    msg = ctypes.c_char_p()
    n = extlib._msgSize()
    if n:
        extlib._msgGet(n - 1, ctypes.byref(msg))
    return rc, (msg.value.decode() if n else None)


MX_STREAM = 0x5300
fns = op_functions(b"mx_roi_ROIAlign")
ATTRS = {"pooled_size": (P, P), "spatial_scale": 0.5, "sample_ratio": 2, "aligned": True,
         "pool_mode": "max"}


def mx_step(name, attrs, stream=MX_STREAM):
    fake.fake_clear()
    fake.fake_set_ready(1)
    rc, msg = fcompute(fns[("forward", "gpu")], attrs, stream)
    steps[name] = {"log": fake.fake_log().decode().splitlines(), "rc": rc,
                   "error": msg if rc != 1 else None}  # lib_api: MX_SUCCESS 1, MX_FAIL 0


mx_step("mx_not_enabled", ATTRS)
err = ctypes.create_string_buffer(1024)
assert extlib.mx_roi_ext_set_gpu_launcher(cuda.library_path().encode(), err, len(err)) == 0
mx_step("mx_forward", ATTRS)
mx_ws = gpu_allocs[-1].ctypes.data if gpu_allocs else 0
mx_ws_sizes = [a.size for a in gpu_allocs]
mx_step("mx_bad_param", dict(ATTRS, pool_mode="median"))
print(json.dumps({"steps": steps, "ptr": ptr, "status": status,
                  "image": fake.fake_image().decode(), "arch": cuda.ptx_arch(),
                  "mx_contexts": sorted("/".join(k) for k in fns), "mx_ws": mx_ws,
                  "mx_ws_sizes": mx_ws_sizes}))
sys.stdout.flush()
