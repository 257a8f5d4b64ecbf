"""First-principles lower bounds for the benchmark workloads (``python -m mx_roi.bench``).

A workload cannot run faster than the larger of

* ``bytes / bandwidth``: the bytes that must move -- the input cells some bin reads
  (each once: the union over the rois of every image, per channel group for the
  position-sensitive ops), the output written, and for the backward the out-grad read
  and the whole data gradient written;
* ``ops / rate``: the multiply-adds that must happen -- per roi and channel the fewer of
  the two standard evaluation orders over the non-zero taps (every tap of every bin
  once; or separable: rows first over the roi's used columns, then columns), for max
  modes one comparison per bin cell (ROIPooling) or four per sample (ROIAlign max); the
  backward of an average repeats the forward's count, a max backward routes one value
  per bin,

at this machine's bandwidth (a large ``np.copyto`` split over the threads) and
multiply-add rate (a float32 ``matmul`` on NumPy's BLAS with the same threads),
measured by :func:`probe`.  ``fraction reached = bound / measured time``.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .. import kernels_numpy as K
from .. import parallel
from ..geometry import IntBins
from .workloads import BATCH, FEAT_H, FEAT_W, in_layout, make_rois

__all__ = ["probe", "workload_work", "bound_ms", "probe_hardware", "add_bounds"]


def probe(threads: int, mbytes: int = 64, repeat: int = 5) -> dict:
    """Measured copy bandwidth (bytes/s, read + write counted) and float32 multiply-add
    rate (FMA/s) on ``threads`` threads; best of ``repeat``."""
    threads = max(1, int(threads))
    n = mbytes * (1 << 20) // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    dst.fill(0)
    cuts = [i * n // threads for i in range(threads + 1)]

    def part(i):
        np.copyto(dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]])

    best = float("inf")
    for _ in range(repeat):
        workers = [threading.Thread(target=part, args=(i,)) for i in range(1, threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        part(0)
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    bandwidth = 2 * src.nbytes / best
    src = dst = None  # free both 64 MB buffers before the matmul probe

    m = 768
    a = np.random.RandomState(0).standard_normal((m, m)).astype(np.float32)
    blas = parallel._blas_handles()
    saved = parallel.blas_threads()
    if blas.set is not None:
        blas.set(threads)
    try:
        a @ a  # warm-up (BLAS threads start)
        best_mm = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ a
            best_mm = min(best_mm, time.perf_counter() - t0)
    finally:
        if blas.set is not None and saved is not None:
            blas.set(saved)
    return dict(threads=threads, bandwidth=bandwidth, fma_rate=m ** 3 / best_mm,
                blas_threads_set=blas.set is not None)


def _used(geo, H, W):
    """(batch (R,), rows (R, P, H) bool, cols (R, Q, W) bool, per-bin sample counts or None)."""
    if isinstance(geo, IntBins):
        return (geo.batch, K.indicator_matrix(geo.hstart, geo.hend, H),
                K.indicator_matrix(geo.wstart, geo.wend, W), None)
    return (geo.batch, K.tap_matrix(geo.y, H) != 0, K.tap_matrix(geo.x, W) != 0,
            (geo.y.count, geo.x.count))


def _cells_read(batch, rows, cols, n_images):
    """Distinct map cells read: union over the rois of each image of rows x cols."""
    total = 0
    ry, cx = rows.any(axis=1), cols.any(axis=1)               # (R, H), (R, W)
    for b in range(n_images):
        sel = batch == b
        if sel.any():
            total += int((ry[sel][:, :, None] & cx[sel][:, None, :]).any(axis=0).sum())
    return total


def workload_work(op, data_shape, rois: np.ndarray, itemsize: int = 4) -> dict:
    """Bytes and multiply-adds one forward and one backward must spend.

    ``op`` is an mx_roi op definition (:class:`mx_roi.registry.RoIOp`), ``data_shape``
    (N, C, H, W), ``rois`` (R, 5); an op with a ``roofline_work(data_shape, rois,
    itemsize)`` method answers for itself.  Returns ``fwd_bytes``, ``fwd_ops``, ``bwd_bytes``,
    ``bwd_ops``.
    """
    if hasattr(op, "roofline_work"):  # an op whose tables _used cannot read
        return op.roofline_work(data_shape, rois, itemsize)
    N, C, H, W = data_shape
    geo = op.geometry(rois.astype(np.float64), H, W, np)
    batch, rows, cols, counts = _used(geo, H, W)
    live = batch >= 0
    batch, rows, cols = batch[live], rows[live], cols[live]
    R, P, Q = rows.shape[0], rows.shape[1], cols.shape[1]
    ps = hasattr(op, "group_args")
    if ps:
        O, (Gh, Gw), gh, gw = op.group_args()
        cout = O
        cells = 0
        for i in range(Gh):
            for j in range(Gw):
                cells += _cells_read(batch, rows[:, gh == i], cols[:, gw == j], N)
        in_bytes = cells * O * itemsize
    else:
        cout = C
        in_bytes = _cells_read(batch, rows, cols, N) * C * itemsize
    ny = rows.sum(axis=2).astype(np.float64)                   # (R, P) taps per bin row
    nx = cols.sum(axis=2).astype(np.float64)                   # (R, Q)
    out_elems = R * cout * P * Q
    is_max = getattr(op, "is_max", False) or type(op).__name__ == "ROIPooling"
    if type(op).__name__ == "ROIPooling":
        fwd_ops = float((ny.sum(axis=1) * nx.sum(axis=1)).sum()) * cout   # bin areas
        bwd_ops = float(out_elems)
    elif is_max:  # ROIAlign max: 4 taps per sample
        cy, cx = counts
        cy, cx = cy[live].astype(np.float64), cx[live].astype(np.float64)
        fwd_ops = 4.0 * float((cy.sum(axis=1) * cx.sum(axis=1)).sum()) * cout
        bwd_ops = 4.0 * out_elems
    else:
        direct = ny.sum(axis=1) * nx.sum(axis=1)
        if ps:
            per_roi = direct
        else:
            used_y, used_x = rows.any(axis=1).sum(axis=1), cols.any(axis=1).sum(axis=1)
            rows_first = ny.sum(axis=1) * used_x + P * nx.sum(axis=1)
            cols_first = nx.sum(axis=1) * used_y + Q * ny.sum(axis=1)
            per_roi = np.minimum(direct, np.minimum(rows_first, cols_first))
        fwd_ops = float(per_roi.sum()) * cout
        bwd_ops = fwd_ops
    total_rois = rois.shape[0]
    out_bytes = total_rois * cout * P * Q * itemsize
    return dict(fwd_bytes=float(in_bytes + out_bytes), fwd_ops=fwd_ops,
                bwd_bytes=float(out_bytes + N * C * H * W * itemsize), bwd_ops=bwd_ops)


def bound_ms(work: dict, direction: str, machine: dict):
    """(lower bound in ms, 'mem' or 'fma') for ``direction`` 'fwd' or 'fwd+bwd'."""
    nbytes, ops = work["fwd_bytes"], work["fwd_ops"]
    if direction != "fwd":
        nbytes, ops = nbytes + work["bwd_bytes"], ops + work["bwd_ops"]
    t_mem = nbytes / machine["bandwidth"]
    t_fma = ops / machine["fma_rate"]
    return 1e3 * max(t_mem, t_fma), ("mem" if t_mem >= t_fma else "fma")


def probe_hardware(quick: bool) -> dict:
    """:func:`probe` on mx_roi's thread count (smaller and fewer with ``quick``)."""
    return probe(parallel.num_threads(), mbytes=16 if quick else 128,
                 repeat=2 if quick else 5)


def add_bounds(rows, workloads, hw: dict) -> None:
    """Each row gains ``bound_ms`` (the lower bound at the probed bandwidth / multiply-add
    rate), ``bound_by`` ('mem' or 'fma'), ``work`` and ``reached`` (bound / ours)."""
    work = {}
    for w in workloads:
        try:
            work[w.key] = workload_work(w.op_instance(), (BATCH, w.channels, FEAT_H, FEAT_W),
                                        in_layout(make_rois(w.boxes), w.rois_columns))
        except Exception:  # a bound is a report, never a reason to fail the bench
            work[w.key] = None
    for r in rows:
        wk = work.get(r["key"])
        if wk is None:
            r.update(bound_ms=None, bound_by=None, reached=None, work=None)
            continue
        ms, by = bound_ms(wk, r["direction"], hw)
        r.update(bound_ms=ms, bound_by=by, work=wk,
                 reached=(ms / r["ours_ms"]) if r.get("ours_ms") else None)
