"""The compiled geometry: :mod:`mx_roi.geometry`'s tables filled by the C++ twin in
``operators/roi_common.cuh`` (namespace ``mx_roi::geo``), and the roi check in C.

Every op's host library (``native`` and ``emulated-cuda`` builds) exports
``mx_roi_geometry_counts`` / ``mx_roi_geometry_fill`` (the tables of an :class:`IntBins` or
:class:`SampleGrid`, roi by roi, in ``geometry.py``'s dtype and operation order),
``mx_roi_group_index`` and ``mx_roi_check_rois``.  The two implementations are proven
bit-equal by ``tests/test_geometry_compiled.py``; the backends of the host builds use
this one (a few microseconds instead of the NumPy builder's dozens of array operations).

An op opts in with :meth:`mx_roi.registry.RoIOp.geometry_spec` (a :class:`Spec`); an op
without one keeps ``op.geometry`` (NumPy) on every backend.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .. import geometry as G
from .pointers import address as _address

__all__ = ["Spec", "MODES", "CompiledGeometry", "INT_BINS_MODES", "align_samples_problem"]

#: the geometry of a Spec -> mx_roi::geo::Mode
MODES = {"pool_bins": 0, "ps_pool_bins": 1, "align_grid": 2, "caffe_grid": 3, "rfcn_grid": 4}
INT_BINS_MODES = ("pool_bins", "ps_pool_bins")
#: the rois' dtype -> the entry points' dtype code
_DTYPE_CODES = {np.dtype(np.float16): 0, np.dtype(np.float32): 1, np.dtype(np.float64): 2}


@dataclass(frozen=True)
class Spec:
    """Which geometry an op's call has (its parameters only; the rois and map come later).

    ``mode``: a key of :data:`MODES` -- ``pool_bins`` (:func:`geometry.roi_pooling_bins`),
    ``ps_pool_bins`` (:func:`geometry.psroi_pooling_bins`), ``align_grid``
    (:func:`geometry.roi_align_grid`: ``sample`` = sample_ratio, ``aligned``),
    ``caffe_grid`` (:func:`geometry.caffe_align_grid`), ``rfcn_grid``
    (:func:`geometry.rfcn_align_grid`: ``sample`` = sample_num)."""

    mode: str
    pooled_size: Tuple[int, int]
    spatial_scale: float
    sample: int = 0
    aligned: bool = False


def align_samples_problem(gy: int, gx: int, P: int, Q: int) -> int:
    """The sample count :func:`geometry.roi_align_grid` reports as too many (0 if none),
    from the padded counts ``gy``, ``gx``: the axes are built (and checked) together
    when P == Q and the counts differ by at most 8, else y first, then x."""
    limit = G.MAX_SAMPLES_PER_AXIS
    if P == Q and abs(gy - gx) <= 8:
        n = max(gy, gx) * P
        return n if n > limit else 0
    for n in (gy * P, gx * Q):
        if n > limit:
            return n
    return 0


class CompiledGeometry:
    """The geometry entry points of one host library (``ctypes.CDLL``)."""

    def __init__(self, lib):
        self._counts = lib.mx_roi_geometry_counts
        self._counts.restype = ctypes.c_int
        self._counts.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
        self._fill = lib.mx_roi_geometry_fill
        self._fill.restype = ctypes.c_int
        self._fill.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                               ctypes.c_int, ctypes.c_void_p]
        self._group = lib.mx_roi_group_index
        self._group.restype = None
        self._group.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._check = lib.mx_roi_check_rois
        self._check.restype = ctypes.c_int
        self._check.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                                ctypes.c_longlong, ctypes.c_double, ctypes.c_int,
                                ctypes.c_void_p]

    def build(self, spec: Spec, rois: np.ndarray, height: int, width: int):
        """The IntBins / SampleGrid of ``geometry.py`` for ``spec`` on (R, 5) ``rois``
        (any of the three dtypes) over a ``height`` x ``width`` map; raises the same
        ValueError as ``geometry.py`` for a box needing too many sample points."""
        rois = _rows(rois)
        code = _DTYPE_CODES[rois.dtype]
        mode = MODES[spec.mode]
        R = int(rois.shape[0])
        P, Q = int(spec.pooled_size[0]), int(spec.pooled_size[1])
        H, W = int(height), int(width)
        scale = float(np.float32(spec.spatial_scale))
        sample, aligned = int(spec.sample), int(bool(spec.aligned))
        ptr = _address(rois)
        if spec.mode in INT_BINS_MODES:
            tables = [np.empty(R, np.int32), np.empty((R, P), np.int32),
                      np.empty((R, P), np.int32), np.empty((R, Q), np.int32),
                      np.empty((R, Q), np.int32)]
            self._run(mode, code, ptr, R, P, Q, H, W, sample, aligned, scale, 0, 0, tables)
            return G.IntBins(*tables)
        if spec.mode == "rfcn_grid" and sample < 1:
            raise ValueError(f"sample_num must be >= 1, got {sample}")
        counts = (ctypes.c_int * 2)()  # per call: MXNet runs ops on several threads
        self._counts(mode, code, ptr, R, P, Q, H, W, sample, aligned, scale, counts)
        gy, gx = int(counts[0]), int(counts[1])
        if spec.mode == "align_grid":
            n = align_samples_problem(gy, gx, P, Q)
            if n:
                G._check_samples(n)
        elif spec.mode == "caffe_grid" and max(gy, gx) > G.MAX_SAMPLES_PER_AXIS:
            G._check_samples(G.MAX_SAMPLES_PER_AXIS + 1)
        cdt = G.compute_dtype(rois.dtype)
        tables = [np.empty(R, np.int32)]
        for pooled, g in ((P, gy), (Q, gx)):
            tables += [np.empty((R, pooled), np.int32), np.empty((R, pooled, g), cdt),
                       np.empty((R, pooled, g), np.int32), np.empty((R, pooled, g), np.int32),
                       np.empty((R, pooled, g), cdt), np.empty((R, pooled, g), cdt)]
        tables.append(np.empty((R, P, Q), cdt))
        self._run(mode, code, ptr, R, P, Q, H, W, sample, aligned, scale, gy, gx, tables)
        return G.SampleGrid(tables[0], G.SampleAxis(*tables[1:7]), G.SampleAxis(*tables[7:13]),
                            tables[13])

    def _run(self, mode, code, ptr, R, P, Q, H, W, sample, aligned, scale, gy, gx, tables):
        slots = (ctypes.c_void_p * len(tables))(*[_address(t) for t in tables])
        rc = self._fill(mode, code, ptr, R, P, Q, H, W, sample, aligned, scale, gy, gx, slots)
        if rc:  # pragma: no cover - a dtype code the library does not know
            raise ValueError(f"mx_roi_geometry_fill: error {rc}")

    def group_index(self, pooled: int, group: int) -> np.ndarray:
        """:func:`geometry.group_index` (P,) int32 from the compiled twin."""
        out = np.empty(int(pooled), np.int32)
        self._group(int(pooled), int(group), out.ctypes.data)
        return out

    def check(self, rois: np.ndarray, images: int, bound: float, use_bound: bool):
        """``(code, row)``: the first bad roi -- code 1 a NaN or infinite value (|x| >=
        ``bound`` where ``use_bound``), 2 a batch index >= ``images`` -- or ``(0, -1)``."""
        rois = _rows(rois)
        row = ctypes.c_longlong(-1)
        rc = self._check(_DTYPE_CODES[rois.dtype], _address(rois), int(rois.shape[0]),
                         int(images), float(bound), int(bool(use_bound)), ctypes.byref(row))
        return (rc, int(row.value)) if rc else (0, -1)


def _rows(rois: np.ndarray) -> np.ndarray:
    """``rois`` as the compiled code reads them: C-contiguous (R, 5) of a known dtype (a
    ValueError otherwise: the compiled code must never read past an array)."""
    if rois.ndim != 2 or rois.shape[1] != 5 or rois.dtype not in _DTYPE_CODES:
        raise ValueError(f"rois must be an (R, 5) float16/32/64 array, got {rois.shape} "
                         f"{rois.dtype}")
    return rois if rois.flags.c_contiguous else np.ascontiguousarray(rois)
