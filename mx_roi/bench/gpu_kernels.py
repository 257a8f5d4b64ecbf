"""``python -m mx_roi.bench --ctx gpu`` where MXNet is a CPU build: our GPU calls, and
torchvision's CUDA kernels where torch sees the GPU.

MXNet's CUDA built-ins need MXNet's CUDA build (``mxnet-cu112``); without it they cannot
be compared, but our side still runs: each workload of the table goes through the CUDA
backend on CuPy arrays standing in for GPU NDArrays (:mod:`mx_roi.cuda.cupy_arrays`) --
the rois checked and the geometry built on the host, the tables moved in one copy, the
kernels, the synchronisation at the end of the call, as a GPU training step makes it.

Per workload and direction (forward; backward with atomics; backward in deterministic
mode): the median wall time of synchronised calls, the GPU time of the call (CUDA events
on the stream), the bytes the call must move (:func:`mx_roi.bench.roofline.workload_work`:
each map cell read once, the output / gradient written once) over that time, and the
fraction of the device's measured copy bandwidth (a device-to-device copy, bytes read +
written) this reaches.  Every result is first checked against the native CPU kernels.

Where torch sees the GPU and torchvision has the op (:mod:`.torchvision_ops`), its CUDA
kernels are the side we compare with: checked against the same native CPU results, then
timed the same way ('fwd', 'bwd'; torchvision has no deterministic backward), with the
ratio ours / torchvision of the wall times.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

__all__ = ["copy_bandwidth", "bench_gpu_kernels", "main"]


def copy_bandwidth(mbytes: int = 512, repeat: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), best of ``repeat``."""
    import cupy
    a = cupy.ones(mbytes << 18, cupy.float32)
    b = cupy.empty_like(a)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    b[...] = a
    best = float("inf")
    for _ in range(repeat):
        start.record()
        b[...] = a
        stop.record()
        stop.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
    return 2 * a.nbytes / best


def _time(call, repeat: int):
    """``(median wall ms, median GPU ms)`` of ``call()`` (which synchronises)."""
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    call()  # warm-up: compile / load, pool
    wall, gpu = [], []
    for _ in range(repeat):
        start.record()
        t0 = time.perf_counter()
        call()
        wall.append(time.perf_counter() - t0)
        stop.record()
        stop.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(gpu)


def bench_gpu_kernels(workloads, repeat: int, device_id: int = 0, tv=None):
    """One dict per (workload, direction): ``key``, ``direction`` ('fwd', 'bwd',
    'bwd-det'), ``wall_ms``, ``gpu_ms``, ``bytes``, ``agree`` (vs the native CPU
    kernels); with ``tv`` (a :class:`~mx_roi.bench.torchvision_ops.Torchvision` on
    device ``device_id``) also ``tv_op``, ``tv_agree``, ``tv_wall_ms``, ``tv_gpu_ms`` and
    ``tv_note`` (why there is no torchvision time)."""
    import mxnet as mx
    from ..backends import get
    from ..cuda.cupy_arrays import Device
    from ..selftest import _run
    from .roofline import workload_work
    from .workloads import RTOL, ATOL, in_layout, make_data, make_out_grad, make_rois
    gpu, cuda, native = Device(device_id), get("cuda"), get("native")
    rows = []
    for w in workloads:
        op, det_op = w.op_instance(), w.op_instance(deterministic=True)
        data, rois = make_data(w.channels), in_layout(make_rois(w.boxes), w.rois_columns)
        dy = make_out_grad(op.out_shape(data.shape, rois.shape))
        x, r, g = gpu.array(data), gpu.array(rois), gpu.array(dy)
        out, dx = gpu.zeros(dy.shape), gpu.zeros(data.shape)
        ref_out, (ref_dx,) = _run(native, op, data, rois, dy, mx.cpu())
        agree = {}
        for o in (op, det_op):  # forward + backward of each mode once, against the CPU's
            saved = cuda.forward(o, "write", x, r, out, keep=True)
            cuda.backward(o, "write", g, x, r, dx, saved)
            agree[o] = bool(np.allclose(out.asnumpy(), ref_out, RTOL, ATOL) and
                            np.allclose(dx.asnumpy(), ref_dx, RTOL, ATOL))
        agree = {"fwd": agree[op], "bwd": agree[op], "bwd-det": agree[det_op]}
        work = workload_work(op, data.shape, rois)
        saved = cuda.forward(op, "write", x, r, out, keep=True)
        det_saved = cuda.forward(det_op, "write", x, r, out, keep=True)
        calls = {
            "fwd": (lambda: cuda.forward(op, "write", x, r, out, keep=True),
                    work["fwd_bytes"]),
            "bwd": (lambda: cuda.backward(op, "write", g, x, r, dx, saved),
                    work["bwd_bytes"]),
            "bwd-det": (lambda: cuda.backward(det_op, "write", g, x, r, dx, det_saved),
                        work["bwd_bytes"]),
        }
        peer = _peer(tv, w, data, rois, dy, ref_out, ref_dx) if tv else {}
        for direction, (call, nbytes) in calls.items():
            wall, gpu_ms = _time(call, repeat)
            row = dict(key=w.key, config=w.config, direction=direction,
                       wall_ms=wall, gpu_ms=gpu_ms, bytes=nbytes, agree=agree[direction])
            if tv is not None:
                row.update(tv_op=peer.get("op"), tv_agree=peer.get("agree"),
                           tv_wall_ms=None, tv_gpu_ms=None, tv_note=peer.get("note", ""))
                if "calls" in peer and direction in peer["calls"]:
                    row["tv_wall_ms"], row["tv_gpu_ms"] = _time(peer["calls"][direction],
                                                                repeat)
                elif direction == "bwd-det" and "calls" in peer:
                    row["tv_note"] = "torchvision has no deterministic backward"
            rows.append(row)
        peer.clear()
    return rows


def _peer(tv, w, data, rois, dy, ref_out, ref_dx):
    """torchvision's side of workload ``w``: ``op`` (its description), ``agree`` (its
    output and gradient against the native CPU kernels'), ``calls`` (where it agrees) and
    ``note`` (why it is not timed)."""
    from .torchvision_ops import GpuRun, counterpart, describe
    from .workloads import RTOL, ATOL
    name, kwargs, why = counterpart(w.op, w.ours_kwargs)
    if not name:
        return dict(note=why)
    peer = dict(op=describe(name, kwargs))
    try:
        run = GpuRun(tv, name, kwargs, data, rois, dy)
    except Exception as exc:  # noqa: BLE001 - its failure must not hide our rows
        return dict(peer, note=f"torchvision failed: {type(exc).__name__}: {exc}"[:160])
    fwd_ok = bool(np.allclose(run.out, ref_out, RTOL, ATOL))
    grad_ok = bool(np.allclose(run.grad, ref_dx, RTOL, ATOL))
    peer["agree"] = fwd_ok and grad_ok
    if not peer["agree"]:
        what = [d for d, ok in (("fwd", fwd_ok), ("grad", grad_ok)) if not ok]
        return dict(peer, note="torchvision semantics differ (" + ", ".join(what) + ")")
    return dict(peer, calls=run.calls)


def format_rows(rows, bandwidth: float) -> str:
    """The table; with torchvision's columns (its wall ms and ours / torchvision) where
    the rows carry them, and below it why a workload has none."""
    with_tv = any("tv_op" in r for r in rows)
    lines = [f"{'workload':<24} {'dir':<8} {'wall ms':>8} {'GPU ms':>8} {'MB moved':>9} "
             f"{'GB/s':>7} {'of copy bw':>10}  {'vs native CPU':<13}" +
             (f" {'tv wall ms':>10} {'tv GPU ms':>9} {'ours/tv':>7}" if with_tv else "")]
    why_not = {}
    for r in rows:
        gbs = r["bytes"] / (r["gpu_ms"] * 1e-3) / 1e9
        line = (f"{r['key']:<24} {r['direction']:<8} {r['wall_ms']:>8.3f} "
                f"{r['gpu_ms']:>8.3f} {r['bytes'] / 1e6:>9.1f} {gbs:>7.1f} "
                f"{100 * gbs * 1e9 / bandwidth:>9.1f}%  "
                f"{'agrees' if r['agree'] else 'DIFFERS':<13}")
        if with_tv:
            if r.get("tv_wall_ms") is not None:
                line += (f" {r['tv_wall_ms']:>10.3f} {r['tv_gpu_ms']:>9.3f} "
                         f"{r['wall_ms'] / r['tv_wall_ms']:>7.2f}")
            else:
                line += f" {'-':>10} {'-':>9} {'-':>7}"
                if r.get("tv_note"):
                    why_not.setdefault(r["tv_note"], []).append(f"{r['key']} {r['direction']}")
        lines.append(line.rstrip())
    for note, where in why_not.items():
        lines.append(f"torchvision '-': {note}: {', '.join(where)}")
    return "\n".join(lines)


def main(args) -> int:
    """The ``--ctx gpu`` run on CuPy arrays; 1 if any result differs from the CPU's."""
    import cupy
    from .workloads import build_workloads, select_workloads
    workloads = select_workloads(build_workloads(args.quick, args.variants), args.only)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    bandwidth = copy_bandwidth()
    print(f"GPU 0: {name}, CuPy {cupy.__version__}; MXNet is a CPU build: our calls on CuPy "
          "arrays (no MXNet CUDA built-ins to compare with)")
    print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    tv = None
    if args.torchvision is not False:
        from .torchvision_ops import gpu_available, load
        tv, why = load(1, device_id=0)
        why = why or gpu_available(tv)
        if why:
            tv = None
            print(f"torchvision: {why}; no torchvision columns", flush=True)
        else:
            print(f"torchvision {tv.info['torchvision']} (torch {tv.info['torch']}) on the "
                  "same GPU: the side compared with (MXNet's CUDA built-ins need "
                  "mxnet-cu112)", flush=True)
    rows = bench_gpu_kernels(workloads, args.repeat, tv=tv)
    print(format_rows(rows, bandwidth), flush=True)
    if args.json:
        import json
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(gpu=name, cupy=cupy.__version__, copy_bandwidth=bandwidth,
                           torchvision=tv.info if tv else None, rows=rows), f, indent=1)
    return 0 if all(r["agree"] for r in rows) else 1
