"""``python -m mx_roi.selftest``: which backends are usable here, and do they agree?

For every backend this prints one row of a table -- usable or not (and why), the parity
checks it ran and PASS/FAIL -- and exits 0 when every *usable* backend passed (a missing
GPU is reported, not a failure):

* ``numpy``          always usable; ROIPooling and ROIAlign against MXNet's built-ins;
* ``native``         needs a C++ compiler (g++): the CUDA kernels compiled for the host
                     with -O3 and run on threads (the default CPU kernels of ROIPooling,
                     the PS ops and max ROIAlign), every op against the NumPy backend, and
                     ROIPooling and ROIAlign against MXNet's built-ins;
* ``emulated-cuda``  needs a C++ compiler (g++): the CUDA kernels compiled for the host,
                     every op (and max mode) against the NumPy backend, forward + backward
                     (the max modes' backward also with no argmax kept: the rescan);
* ``nvrtc-compile``  needs libnvrtc (``nvidia-cuda-nvrtc-cu11``): every kernel source and
                     instantiation compiled to PTX (default compute_70; ``--archs``);
* ``native-ops``     needs g++ and MXNet's extension API (in the 1.9.1 wheel): the ops
                     built as native MXNet operators (:mod:`mx_roi.ext`) against the
                     ``native`` backend's checked path, bit for bit, and which door
                     ``mx_roi.nd`` / ``sym`` / Gluon take per op and why
                     (:mod:`mx_roi.ext.door`; skipped: every op runs as a Custom op,
                     with the reason);
* ``cuda``           needs CuPy and a GPU: the kernels on ``mx.gpu(0)`` against the NumPy
                     backend on the CPU, and the built-ins on the GPU; where MXNet is a
                     CPU build, the kernels on CuPy arrays standing in for GPU NDArrays
                     (:mod:`mx_roi.cuda.cupy_arrays`) and no built-ins;
* ``native-gpu``     the native GPU path's launcher (:mod:`mx_roi.ext.cuda`, opt-in; needs
                     g++ and NVRTC to build): built, and with CuPy and a GPU ROIAlign's
                     forward launched through it on CuPy memory and a CuPy stream, bit for
                     bit against ``emulated-cuda`` (skipped without a GPU, saying whether
                     the launcher builds).

Below the table, the GPU setup: driver, MXNet GPU build, CuPy, the NVRTC library CuPy
loads, ``cuda_fp16.h`` -- each OK or MISSING with the command that fixes it
(:mod:`mx_roi.gpucheck`).  A CPU-only machine passes with these missing.

Options: ``--archs 70,80,90`` (NVRTC architectures), ``--quick`` (float32 only),
``--gpu`` (also the first-GPU-run checklist of docs/gpu.md: host parts here, GPU-only
steps SKIP with their reason without a GPU), ``--require-gpu`` (exit 1 unless the GPU
setup is complete and no GPU step was skipped: for the first run on a GPU machine).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np

from .opcheck import CASES, TOL, rescan_variants  # noqa: F401  (re-exported)
from .opcheck import as_array as _nd, assert_close as _close, make_op as _op  # noqa: F401
from .opcheck import assert_close_grads as _close_grads  # noqa: F401
from .opcheck import problem as _problem, run as _run  # noqa: F401
from .registry import NATIVE_PREFIX

__all__ = ["main", "run_checks"]


class Skip(Exception):
    """The backend is not usable on this machine (not a failure)."""


def _dtypes(quick):
    return (np.float32,) if quick else (np.float16, np.float32, np.float64)


def _builtin_checks(backend, ctx, dtype=np.float32):
    """Forward + data gradient against MXNet's built-ins (each op's ``selftest_builtin``:
    ROIPooling, ROIAlign avg)."""
    import mxnet as mx
    from mxnet import autograd
    n = 0
    for name, params in CASES:
        op = _op(name, params)
        data, rois, grad, extra = _problem(op, dtype, seed=1)
        keep = rois[:, 0] >= 0  # the built-ins read out of bounds for padding rois
        rois, grad = rois[keep], grad[keep]
        extra = [a[keep] for a in extra]  # (per-roi extra inputs)
        x = mx.nd.array(data, ctx=ctx, dtype=dtype)
        ex = [mx.nd.array(a, ctx=ctx, dtype=dtype) for a in extra]
        for a in [x] + ex:
            a.attach_grad()
        with autograd.record():
            y = type(op).selftest_builtin(params, x, mx.nd.array(rois, ctx=ctx, dtype=dtype),
                                          *ex)
        if y is None:  # MXNet has no equivalent
            continue
        out, grads = _run(backend, op, data, rois, grad, ctx, extra=extra)
        _close(out, y.asnumpy(), dtype, f"{name} forward vs built-in on {ctx}")
        if type(op).selftest_builtin_grad:  # (a built-in without a backward: forward only)
            y.backward(mx.nd.array(grad, ctx=ctx, dtype=dtype))
            _close_grads(grads, [a.grad.asnumpy() for a in [x] + ex], dtype,
                         f"{name} vs built-in on {ctx}", op)
        n += 1
    return n


def check_numpy(quick=False):
    import mxnet as mx
    from .backends import get
    n = _builtin_checks(get("numpy"), mx.cpu())
    return f"{n} ops vs MXNet built-ins (forward + grad)"


def check_native(quick=False):
    import mxnet as mx
    from .backends import get
    detail = check_emulated(quick, "native")
    return f"{detail}, {_builtin_checks(get('native'), mx.cpu())} ops vs MXNet built-ins"


def check_emulated(quick=False, backend="emulated-cuda"):
    import mxnet as mx
    from .backends import get
    from .cuda.loader import host_compiler
    if not host_compiler():
        raise Skip("no C++ compiler (g++ or $CXX)")
    emu, ref = get(backend), get("numpy")
    n = 0
    for dtype in _dtypes(quick):
        for name, params in CASES:
            op = _op(name, params)
            data, rois, grad, extra = _problem(op, dtype)
            o2, g2 = _run(ref, op, data, rois, grad, mx.cpu(), extra=extra)
            for rescan in rescan_variants(name, params):
                o1, g1 = _run(emu, op, data, rois, grad, mx.cpu(), rescan, extra=extra)
                what = f"{name} {params} {np.dtype(dtype).name}" + (" rescan" if rescan else "")
                _close(o1, o2, dtype, f"{what} forward")
                _close_grads(g1, g2, dtype, what, op)
                n += 1
    return f"{n} op x dtype cases vs numpy (forward + grad; max modes also rescanning)"


def check_nvrtc(quick=False, archs=(70,)):
    from .cuda import nvrtc
    from .cuda import source as S
    if not nvrtc.find_library():
        raise Skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu11)")
    from concurrent.futures import ThreadPoolExecutor
    jobs = [(f, a) for a in archs for f in S.sources()]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # NVRTC releases the GIL
        n = sum(len(r.lowered) for r in pool.map(lambda j: nvrtc.compile_source(*j), jobs))
    v = nvrtc.version()
    return (f"NVRTC {v[0]}.{v[1]}: {n} instantiations of {len(S.sources())} sources for "
            + ",".join(f"compute_{a}" for a in archs))


def check_cuda(quick=False):
    import mxnet as mx
    from . import gpucheck
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError, or CUDA libraries missing
        raise Skip(f"CuPy not importable ({type(e).__name__}: {e})".splitlines()[0][:120])
    try:
        gpu = gpucheck.gpu_context(0)
    except RuntimeError as e:
        raise Skip(str(e))
    from .backends import get
    cuda, ref = get("cuda"), get("numpy")
    n = 0
    for dtype in _dtypes(quick):
        for name, params in CASES:
            for det in (False, True):
                op = _op(name, dict(params, deterministic=det))
                data, rois, grad, extra = _problem(op, dtype)
                o2, g2 = _run(ref, op, data, rois, grad, mx.cpu(), extra=extra)
                for rescan in rescan_variants(name, params):
                    o1, g1 = _run(cuda, op, data, rois, grad, gpu, rescan, extra=extra)
                    what = (f"{name} {params} {np.dtype(dtype).name} deterministic={det}"
                            + (" rescan" if rescan else ""))
                    _close(o1, o2, dtype, f"{what} forward")
                    _close_grads(g1, g2, dtype, what, op)
                    n += 1
    if gpucheck.is_standin(gpu):
        return (f"{n} checks vs the CPU path on CuPy arrays ({gpucheck.STANDIN_NOTE}); "
                "the GPU built-ins need MXNet's CUDA build")
    n += _builtin_checks(cuda, gpu)
    return f"{n} checks vs the CPU path and the GPU built-ins"


def check_extension(quick=False):
    """The extension library's native ops (``mx.nd.mx_roi_<Op>``, :mod:`mx_roi.ext`)
    against the ``native`` backend's checked path (its kernels launched from Python, not
    through the library's launcher, which that backend calls otherwise): forward and data
    gradient bit-equal."""
    import mxnet as mx
    from mxnet import autograd
    from . import ext
    from .cuda.backend import CudaBackend
    from .ndio import Kind
    why = ext.unavailable_reason()
    if why:
        raise Skip(f"{why}; the ops run as Custom ops")
    ext.load()
    checked = CudaBackend(Kind.NATIVE)
    checked.library_calls = False
    n, names = 0, set()
    for dtype in _dtypes(quick):
        for name, params in CASES:
            native = getattr(mx.nd, f"{NATIVE_PREFIX}{name}", None)
            if native is None:
                continue
            op = _op(name, params)
            data, rois, grad, extra = _problem(op, dtype, seed=2)
            out, grads = _run(checked, op, data, rois, grad, mx.cpu(), extra=extra)
            x = mx.nd.array(data, dtype=dtype)
            x.attach_grad()
            with autograd.record():
                y = native(x, mx.nd.array(rois, dtype=dtype),
                           *(mx.nd.array(a, dtype=dtype) for a in extra), **params)
            y.backward(mx.nd.array(grad, dtype=dtype))
            what = f"{NATIVE_PREFIX}{name} {params} {np.dtype(dtype).name}"
            if not (np.array_equal(y.asnumpy(), out, equal_nan=True) and
                    np.array_equal(x.grad.asnumpy(), grads[0], equal_nan=True)):
                raise AssertionError(f"{what}: not bit-equal to the checked path (native)")
            n, names = n + 1, names | {name}
    return (f"{n} checks of {', '.join(sorted(names))} vs the checked path, bit-equal; "
            f"{door_summary()}")


def check_native_gpu(quick=False):
    """The native GPU path's launcher library (:mod:`mx_roi.ext.cuda`): built here, then
    with CuPy and a GPU, ROIAlign's forward (every dtype unless ``quick``, the op's
    selftest cases) launched through it on CuPy memory and a stream, bit-equal to
    ``emulated-cuda``, its status word checked (``check(wait=True)``)."""
    from . import gpucheck
    from .cuda import loader, nvrtc
    from .ext import cuda as ext_cuda
    if not loader.host_compiler():
        raise Skip("no C++ compiler (g++) to build the launcher")
    try:
        nvrtc.version()
    except nvrtc.NvrtcError as e:
        raise Skip(f"no NVRTC to build the launcher's PTX ({e})".splitlines()[0][:120])
    ext_cuda.library_path()  # (a build failure here is a FAIL)
    built = (f"the launcher builds ({len(ext_cuda.gpu_ops())} ops, PTX "
             f"compute_{ext_cuda.ptx_arch()}; opt-in: mx_roi.ext.cuda.enable())")
    if gpucheck.cupy_gpu_count() == 0:
        raise Skip(f"no GPU for CuPy; {built}")
    import cupy
    import mxnet as mx
    from .backends import get
    n = 0
    for dtype in _dtypes(quick):
        for name, params in CASES:
            if name != "ROIAlign":
                continue
            op = _op(name, params)
            p = op.param
            data, rois, grad, _ = _problem(op, dtype)
            want, _ = _run(get("emulated-cuda"), op, data, rois, grad, mx.cpu())
            caffe = p.legacy == "caffe"
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                x, r = cupy.asarray(data), cupy.asarray(rois)
                out = cupy.full(op.out_shape(data.shape, rois.shape), np.nan, dtype)
                ws = cupy.empty(max(ext_cuda.roi_align_workspace(
                    dtype, rois.shape[0], p.pooled_size, data.shape[2], data.shape[3],
                    p.sample_ratio, caffe), 16), cupy.uint8)
                stream.synchronize()
                ext_cuda.roi_align_forward(dtype, x.data.ptr, r.data.ptr, out.data.ptr,
                                           data.shape, rois.shape[0], p.pooled_size,
                                           p.spatial_scale, p.sample_ratio, p.aligned,
                                           p.pool_mode, caffe, ws.data.ptr, ws.nbytes,
                                           stream.ptr)
            ext_cuda.check("ROIAlign", stream.ptr, wait=True)
            got = cupy.asnumpy(out)
            if not np.array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8)):
                raise AssertionError(f"native GPU ROIAlign {params} {np.dtype(dtype).name}: "
                                     "not bit-equal to emulated-cuda")
            n += 1
    return f"{built}; {n} ROIAlign forwards through it on the GPU, bit-equal to emulated-cuda"


def door_summary() -> str:
    """Which door ``mx_roi.nd`` / ``sym`` / Gluon take on the CPU here, per op, and why
    (:mod:`mx_roi.ext.door`): ``'door: native for A, B; Custom for C, D (reason)'``, the
    ops in ``mx_roi.OP_TYPES`` order (an op-specific reason names ``mx_roi_<Op>``)."""
    from .ext import door
    from .registry import REGISTERED
    first = {}
    for name, params in CASES:
        first.setdefault(name, params)
    groups = {}
    for name in REGISTERED:
        what = door.describe(_op(name, first[name]))
        key = "native" if what.startswith("native") else \
            what[len("Custom: "):].replace(door.native_op(name), door.native_op("<Op>"))
        groups.setdefault(key, []).append(name)
    parts = [f"native for {', '.join(groups.pop('native'))}"] if "native" in groups else []
    parts += [f"Custom for {', '.join(ops)} ({why})" for why, ops in groups.items()]
    return "door: " + "; ".join(parts)


def run_checks(quick=False, archs=(70,)):
    """``[(backend, status, seconds, detail)]`` with status PASS, FAIL or SKIP."""
    rows = []
    for name, fn, kw in (("numpy", check_numpy, {}), ("native", check_native, {}),
                         ("emulated-cuda", check_emulated, {}),
                         ("nvrtc-compile", check_nvrtc, {"archs": archs}),
                         ("cuda", check_cuda, {}),
                         ("native-ops", check_extension, {}),
                         ("native-gpu", check_native_gpu, {})):
        t0 = time.perf_counter()
        try:
            detail = fn(quick=quick, **kw)
            status = "PASS"
        except Skip as e:
            status, detail = "SKIP", f"not usable here: {e}"
        except Exception as e:  # report and go on with the other backends
            status = "FAIL"
            detail = f"{type(e).__name__}: {e}".strip().splitlines()
            detail = " | ".join(detail[:3])
            traceback.print_exc(file=sys.stderr)
        rows.append((name, status, time.perf_counter() - t0, detail))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mx_roi.selftest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="float32 only")
    ap.add_argument("--archs", default="70", help="NVRTC architectures, e.g. 70,80,90")
    ap.add_argument("--gpu", action="store_true", help="run the first-GPU-run checklist")
    ap.add_argument("--require-gpu", action="store_true",
                    help="fail unless the GPU setup is complete and every GPU step ran")
    ap.add_argument("--gpu-kernels", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import mx_roi  # noqa: F401  (registers the ops)
    from . import gpucheck
    if args.gpu_kernels:  # the child compute-sanitizer watches
        return gpucheck.gpu_kernels_main()
    archs = tuple(int(a) for a in args.archs.split(",") if a.strip())

    rows = run_checks(quick=args.quick, archs=archs)
    print(f"mx_roi {mx_roi.__version__} selftest")
    print(f"{'backend':<15} {'result':<6} {'time':>7}  detail")
    print("-" * 79)
    for name, status, secs, detail in rows:
        print(f"{name:<15} {status:<6} {secs:>6.1f}s  {detail}")
    failed = [r[0] for r in rows if r[1] == "FAIL"]
    usable = [r[0] for r in rows if r[1] != "SKIP"]

    pieces = gpucheck.diagnose()
    print("-" * 79)
    print("GPU setup (docs/installing.md, 'What a GPU machine needs')")
    for p in pieces:
        print(f"  {p.name:<8} {'OK' if p.ok else 'MISSING':<8} {p.detail}")
        if not p.ok:
            print(f"  {'':<8} {'fix:':<8} {p.fix}")
    missing = [p.name for p in pieces if not p.ok]
    skipped_gpu = []
    if args.gpu:
        steps = gpucheck.checklist(pieces)
        print("-" * 79)
        print("GPU checklist (docs/gpu.md, 'The first-run checklist')")
        for st in steps:
            print(f"  {st.name:<25} {st.where:<5} {st.status:<5} {st.detail}")
        failed += [f"{st.name} ({st.where})" for st in steps if st.status == "FAIL"]
        skipped_gpu = [st.name for st in steps if st.status == "SKIP"]
    print("-" * 79)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    if args.require_gpu and (missing or skipped_gpu or not args.gpu):
        why = (f"GPU setup missing: {', '.join(missing)}" if missing else
               f"GPU steps skipped: {', '.join(skipped_gpu)}" if skipped_gpu else
               "--require-gpu needs --gpu")
        print(f"FAILED (--require-gpu): {why}")
        return 1
    if missing == ["mxnet"] and "cuda" in usable:  # the kernels ran on CuPy arrays
        tail = "; " + gpucheck.standin_reason(pieces)
    elif missing:
        tail = f"; GPU setup incomplete ({', '.join(missing)}), the GPU path is not usable here"
    else:
        tail = ""
    print(f"OK: every usable backend passed ({', '.join(usable)}){tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
