"""The geometry tables built where the kernels run: no host copy of the rois before a launch.

On a GPU (and in the ``emulated-cuda`` build, which runs the same kernels through the same
launch glue) an op with a compiled geometry (:meth:`mx_roi.registry.RoIOp.geometry_spec`)
gets its tables from one small kernel over its rois, one thread per roi
(``roi_bins_geometry`` / ``roi_grid_geometry`` in ``operators/roi_common.cuh``).  The
kernel fills :mod:`mx_roi.geometry`'s tables with the ``mx_roi::geo`` functions (the
twin proven bit-equal by tests/test_geometry_compiled.py), checks every roi with
``mx_roi_check_rois``'s rule and records the first bad one in a two-word status in device
memory (:class:`DeviceGeometry`); a bad roi's row is marked as padding (batch -1), so
the op kernels that follow read no data for it.  The call reads the status at the one
synchronisation it has anyway (the stream sync before it returns) and then raises the
host check's message (:meth:`DeviceGeometry.raise_if_bad`).

Table sizes cannot depend on the rois (that would need a device read before the launch):

* integer bins (ROIPooling, PSROIPooling): their shapes depend on R, P, Q only; the
  argmax type of the max kernels is chosen for :func:`bin_cells`, the largest bin of a box
  inside the map (``(ceil((H + 1) / P) + 1) * (ceil((W + 1) / Q) + 1)``, at most ``H * W``):
  ``uint8`` up to 254 cells (7x7 bins on a 50x68 map: 99), as the host builds' exact
  choice mostly is; a roi with a larger bin is flagged like a grid overflow (below);
* sample grids with a fixed sample count (ROIAlign ``sample_ratio > 0``, R-FCN
  PSROIAlign): ``sample`` points per bin side, as on the host;
* adaptive ROIAlign (``sample_ratio <= 0``) and the Caffe grid: the padded count per bin
  side is :func:`grid_widths`' ``ceil((H + 1) / P) + 1`` -- enough for any box inside the
  map (memory: ``R * P * G`` entries of 3 int32 and 2 compute-dtype tables per axis, e.g.
  512 rois, 7x7 bins on a 50x68 map: 1.3 MB).  Results do not depend on the padding
  (the kernels loop over each bin's own count); a roi needing more points than that (a
  box far larger than the map) is flagged in ``status[1]`` and the call runs again on
  the host-built tables (today's path: exact widths) -- two more syncs, for such calls
  only.
"""
from __future__ import annotations

import numpy as np

from .. import geometry as G
from ..onednn import GUARD_BOUND, bounded_dtype
from .compiled_geometry import INT_BINS_MODES, MODES

__all__ = ["grid_widths", "DeviceGeometry", "build", "supported", "STATUS_BATCH_KEY"]

#: status[0]'s key offset of a batch-index error (roi_common.cuh STATUS_BATCH_KEY)
STATUS_BATCH_KEY = 1 << 62
_ALIGN = 16


def grid_widths(spec, height: int, width: int):
    """``(Gy, Gx)``: the padded sample counts per bin side of ``spec``'s sample grid on a
    ``height`` x ``width`` map, from the parameters and the map only; None for integer
    bins, or where the tables would exceed :data:`geometry.MAX_SAMPLES_PER_AXIS` (the
    call then keeps the host path, whose exact widths are smaller or whose error names
    the problem)."""
    if spec.mode in INT_BINS_MODES:
        return None
    P, Q = int(spec.pooled_size[0]), int(spec.pooled_size[1])
    if spec.mode == "rfcn_grid" or (spec.mode == "align_grid" and spec.sample > 0):
        gy = gx = int(spec.sample)
        if gy < 1:
            return None
    else:  # adaptive ROIAlign, Caffe grid: any box inside the map, with a cell to spare
        gy = -(-(int(height) + 1) // P) + 1
        gx = -(-(int(width) + 1) // Q) + 1
    if gy * P > G.MAX_SAMPLES_PER_AXIS or gx * Q > G.MAX_SAMPLES_PER_AXIS:
        return None
    return gy, gx


def bin_cells(spec, height: int, width: int) -> int:
    """The most cells per bin the integer-bin tables of a device call allow (the argmax
    type's bound): those of a box inside the map, at most the map's cells."""
    P, Q = int(spec.pooled_size[0]), int(spec.pooled_size[1])
    H, W = int(height), int(width)
    if spec.mode != "pool_bins":  # PSROIPooling averages: no argmax, no bound needed
        return H * W
    return min(H * W, (-(-(H + 1) // P) + 1) * (-(-(W + 1) // Q) + 1))


def may_overflow(spec) -> bool:
    """Whether a roi can need more sample points than :func:`grid_widths` allots."""
    return spec.mode == "caffe_grid" or (spec.mode == "align_grid" and spec.sample <= 0)


def supported(spec, height: int, width: int) -> bool:
    """Whether ``spec``'s tables can be built on the device for this map."""
    return spec is not None and (spec.mode in INT_BINS_MODES
                                 or grid_widths(spec, height, width) is not None)


class DeviceGeometry:
    """The tables of one call (``geo``: an IntBins / SampleGrid of device arrays, the
    coordinates left out) and its status word (``status``: (2,) uint64 in device memory,
    see roi_common.cuh's ``roi_status``)."""

    __slots__ = ("geo", "status", "rois", "images", "overflow_possible")

    def __init__(self, geo, status, rois, images, overflow_possible):
        self.geo, self.status, self.rois = geo, status, rois
        self.images, self.overflow_possible = images, overflow_possible

    def error(self, op, status_host, xp):
        """The ValueError of the first bad roi (``op.roi_error``: the host check's roi
        and message), or None, from the host copy of :attr:`status`; the rois are copied
        to the host for the message only when there is an error."""
        word = int(status_host[0])
        if word == 0:
            return None
        key = ~word & ((1 << 64) - 1)
        code, row = (2, key - STATUS_BATCH_KEY) if key >= STATUS_BATCH_KEY else (1, key)
        rois = self.rois if xp is np else xp.asnumpy(self.rois)
        return op.roi_error(code, row, rois, self.images)

    def raise_if_bad(self, op, status_host, xp):
        """Raise :meth:`error`'s ValueError, if any (the device check of the rois)."""
        error = self.error(op, status_host, xp)
        if error is not None:
            raise error

    @staticmethod
    def overflowed(status_host) -> bool:
        """Whether some roi needed more sample points than the tables hold."""
        return int(status_host[1]) != 0


def _carve(xp, specs, empty=None):
    """Arrays of ``specs`` ((shape, dtype), ...) over one uninitialised buffer (one
    allocation, by ``empty(shape, dtype)`` if given, else ``xp.empty``; 16-byte aligned
    offsets)."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
    buf = (empty or xp.empty)((max(total, _ALIGN),), np.uint8)
    base = getattr(buf, "data", None)
    out = []
    for (shape, dtype), o in zip(specs, offsets):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if hasattr(base, "ptr"):  # CuPy: an array over the buffer's memory
            out.append(xp.ndarray(shape, dtype, base + o) if n else xp.empty(shape, dtype))
        else:
            out.append(buf[o:o + n].view(dtype).reshape(shape))
    return out


def build(launch, spec, rois, images: int, height: int, width: int,
          empty=None) -> DeviceGeometry:
    """Queue the geometry kernel of ``spec`` over ``rois`` ((R, 5), R >= 1, the data's
    dtype, on the device of ``launch``) for ``images`` images of a ``height`` x ``width``
    map; the tables and the zeroed status, ready for the op kernels queued after it.
    ``empty(shape, dtype)``: where the tables and the status are allocated (default
    ``xp.empty``; a recorded native call passes its own)."""
    xp = launch.xp
    R = int(rois.shape[0])
    P, Q = int(spec.pooled_size[0]), int(spec.pooled_size[1])
    H, W = int(height), int(width)
    status = (empty or xp.empty)((2,), np.uint64)
    status.fill(0)
    common = dict(rois=rois, mode=MODES[spec.mode], P=P, Q=Q, H=H, W=W,
                  spatial_scale=float(np.float32(spec.spatial_scale)), N=int(images),
                  bound=float(GUARD_BOUND), use_bound=int(bounded_dtype(rois.dtype)),
                  status=status)
    i32 = np.int32
    if spec.mode in INT_BINS_MODES:
        t = _carve(xp, [((R,), i32), ((R, P), i32), ((R, P), i32), ((R, Q), i32),
                        ((R, Q), i32)], empty)
        cells = bin_cells(spec, H, W)
        launch.forward("roi_bins_geometry", R, cells=cells, batch=t[0], hstart=t[1],
                       hend=t[2], wstart=t[3], wend=t[4], **common)
        geo = G.IntBins(*t)
        geo.max_cells = cells  # the argmax type's bound (int_bins_max_cells)
        return DeviceGeometry(geo, status, rois, int(images), cells < H * W)
    gy, gx = grid_widths(spec, H, W)
    acc = launch.acc
    specs = [((R,), i32)]
    for pooled, g in ((P, gy), (Q, gx)):
        specs += [((R, pooled), i32), ((R, pooled, g), i32), ((R, pooled, g), i32),
                  ((R, pooled, g), acc), ((R, pooled, g), acc)]
    specs.append(((R, P, Q), acc))
    t = _carve(xp, specs, empty)
    names = ("batch", "y_count", "y_low", "y_high", "y_wl", "y_wh", "x_count", "x_low",
             "x_high", "x_wl", "x_wh", "divisor")
    launch.forward("roi_grid_geometry", R, sample=int(spec.sample),
                   aligned=int(bool(spec.aligned)), Gy=gy, Gx=gx,
                   **dict(zip(names, t)), **common)
    geo = G.SampleGrid(t[0], G.SampleAxis(t[1], None, *t[2:6]),
                       G.SampleAxis(t[6], None, *t[7:11]), t[11])
    return DeviceGeometry(geo, status, rois, int(images), may_overflow(spec))
