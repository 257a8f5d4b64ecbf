"""The ``native`` backend's forward and backward as one call into the extension library.

The Custom door (``mx.nd.Custom(op_type=...)``, and every entry point while
``MX_ROI_NATIVE_OPS=0``) on the ``native`` CPU backend runs an op's call through the same
host launcher as the native operator ``mx_roi_<Op>`` (``operators/<op>.cu``'s
``MX_ROI_EXT_LAUNCHER`` section, ``mx_roi/ext/ext_launch.h``): ``mx_roi_ext_invoke`` in
the extension library (:mod:`mx_roi.ext`) takes the NDArrays' addresses, shapes and
dtypes (read with MXNet's C API, :func:`mx_roi.ndio.array_info`) and runs the roi check,
the geometry and the kernels in compiled code -- one launcher for both doors, the
torchvision/mmcv design.

The launcher decides everything that depends on values (a bad roi, a box too large for
the shape-sized tables: exact tables then) itself.  It fails only for an input the
Custom door must raise for; the caller then takes the backend's *checked* path (the rois
read, checked and turned into tables in Python, every kernel launched from Python), which
raises the Custom door's message -- so errors are the checked path's, and the bits are
the launcher's, which tests/test_library_calls.py compares with the checked path call by
call.

``MX_ROI_LIBRARY_CALLS=0`` (or ``false``, ``off``, ``no``; read per call) sends every call
to the checked path: the tests and the fuzz compare the native operators with it, an
oracle that shares no host code with the library.

What does not go through the library (the checked path runs instead): req ``add`` or
``null`` for the data (the library always writes; MXNet never tells an extension op its
req), an empty call (no rois, an empty map), an NDArray the C API cannot hand over, a dtype
the ops do not take, and every call while the library cannot be built or loaded here (no
compiler, an mxnet without the extension API: :func:`mx_roi.ext.unavailable_reason`).

The forward keeps nothing for its backward (the library's backward finds a max op's
winners again in the data, as the native operator's does): a training step's forward
returns no saved state.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

from .. import parallel
from ..ndio import Kind, array_info
from ..switches import switched_off
from . import loader
from .pointers import address

__all__ = ["LibraryCalls", "ENV", "enabled", "set_locator"]

#: the switch: ``MX_ROI_LIBRARY_CALLS=0`` runs the native backend's calls on the checked path
ENV = "MX_ROI_LIBRARY_CALLS"

#: MXNet's type flags of the dtypes the ops take
_FLAGS = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2}
_MAX_NDIM = 6
#: ``n`` ``mx_roi_ext_tensor`` (ext_main.cc): data, shape[6], ndim, dtype -- each
_TENSOR = "P6qii"
_PACKERS = {}
_PAD = [(0,) * (_MAX_NDIM - n) for n in range(_MAX_NDIM + 1)]


#: ``() -> path`` of the extension library (built if needed), raising
#: :class:`~mx_roi.cuda.loader.HostLibraryError` when it cannot be had: set by
#: :mod:`mx_roi.ext`, the layer above, which builds it
_LOCATOR = [None]


def set_locator(locate) -> None:
    """Tell the native backend where the extension library comes from (``mx_roi.ext``
    does at import)."""
    _LOCATOR[0] = locate


def enabled() -> bool:
    """Whether ``MX_ROI_LIBRARY_CALLS`` lets the native backend call the library (unset:
    yes)."""
    return not switched_off(ENV)


class LibraryCalls:
    """The extension library's launcher for one backend's calls (thread-safe: each call
    packs its own arrays; the library's launcher keeps per-thread state only)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lib = None          # the library (ctypes), once loaded
        self._handles = {}        # (native op name, parameters) -> handle
        self.calls = 0            # calls that ran in the library (tests count them)

    def library(self):
        """The loaded library, or None when it cannot be built or loaded here (the reason
        is :func:`mx_roi.ext.unavailable_reason`'s; asked again on the next call)."""
        lib = self._lib
        if lib is not None:
            return lib
        locate = _LOCATOR[0]
        if locate is None:
            return None
        try:
            path = locate()
        except loader.HostLibraryError:
            return None
        with self._lock:
            if self._lib is None:
                lib = ctypes.CDLL(path)
                lib.mx_roi_ext_invoke_handle.restype = ctypes.c_void_p
                lib.mx_roi_ext_invoke_handle.argtypes = [
                    ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                    ctypes.POINTER(ctypes.c_char_p)]
                lib.mx_roi_ext_invoke_release.restype = None
                lib.mx_roi_ext_invoke_release.argtypes = [ctypes.c_void_p]
                lib.mx_roi_ext_invoke.restype = ctypes.c_int
                lib.mx_roi_ext_invoke.argtypes = [
                    ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
                self._lib = lib
            return self._lib

    def _handle(self, lib, op):
        """The library's handle of ``op`` (its native operator and its parameters as
        MXNet hands them to that operator: ``str`` of each of ``to_kwargs``'s values), or
        0 when the library has no such operator.  Kept on ``op`` too (its parameters are
        frozen): a call then skips building the key."""
        cached = op.__dict__.get("_library_handle")
        if cached is not None and cached[0] is self:
            return cached[1]
        kwargs = op.param.to_kwargs()
        key = (op.name, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        handle = self._handles.get(key)
        if handle is None:
            keys = [k.encode() for k, _ in key[1]]
            values = [v.encode() for _, v in key[1]]
            handle = lib.mx_roi_ext_invoke_handle(
                op.native_name.encode(), len(keys),
                (ctypes.c_char_p * len(keys))(*keys), (ctypes.c_char_p * len(values))(*values))
            with self._lock:
                kept = self._handles.setdefault(key, handle or 0)
            if handle and kept != handle:  # (another thread made it first)
                lib.mx_roi_ext_invoke_release(ctypes.c_void_p(handle))
            handle = kept
        op.__dict__["_library_handle"] = (self, handle)
        return handle

    def _invoke(self, op, direction, inputs, outputs) -> bool:
        """One call of ``op``'s launcher on ``inputs`` / ``outputs`` (``(address, shape,
        dtype)`` each); True when it ran, False when the checked path must run it."""
        parallel.num_threads()  # (a bad MX_ROI_NUM_THREADS: the Custom door's ValueError)
        loader.min_items_per_thread()  # (and a bad MX_ROI_MIN_ITEMS_PER_THREAD)
        # the op's host build: the native backend's own (its checked path, and its errors
        # -- no compiler, a cache entry that must not be loaded -- raised at the first call
        # as without the library; memoised, a dict lookup after that)
        loader.get_module(op.cuda_source, Kind.NATIVE)
        lib = self.library()
        if lib is None:
            return False
        handle = self._handle(lib, op)
        if not handle:
            return False
        arrays = inputs + outputs
        values = []
        for ptr, shape, dtype in arrays:
            values += (ptr, *shape, *_PAD[len(shape)], len(shape), _FLAGS[dtype])
        # (a refused call's message is not read: the checked path raises its own)
        if lib.mx_roi_ext_invoke(handle, direction, len(inputs), len(outputs),
                                 _packer(len(arrays)).pack(*values), None, 0):
            return False
        self.calls += 1
        return True

    # ---- forward ----------------------------------------------------------------------
    def forward(self, op, req, data_nd, rois_nd, out_nd, extra=()) -> bool:
        """The forward in the library; True when done, False when the checked path must
        run it (nothing ran, or the library refused an input: the checked path raises)."""
        if req not in ("write", "inplace") or not enabled():
            return False
        inputs = _infos([data_nd, rois_nd, *extra])
        out = _infos([out_nd])
        if inputs is None or out is None or not _shapes_ok(op, inputs[0][1], inputs[1][1]) \
                or tuple(op.out_shape(inputs[0][1], inputs[1][1])) != out[0][1]:
            return False
        return self._invoke(op, 0, inputs, out)

    # ---- backward ---------------------------------------------------------------------
    def backward(self, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, rois_req="null",
                 rois_grad_nd=None, extra=(), extra_grad=()) -> bool:
        """The gradients in the library (the data's with ``req``, the rois' with
        ``rois_req`` for an op that differentiates them, ``extra_grad``'s ``(req,
        NDArray)`` for the extra inputs); True when done, False when the checked path must
        run it.  The rois' gradient with req ``null`` is not computed (a null pointer: the
        launcher skips it); an extra input's goes to a scratch array."""
        if req not in ("write", "inplace") or rois_req not in ("null", "write", "inplace") \
                or any(r not in ("null", "write", "inplace") for r, _ in extra_grad) \
                or not enabled():
            return False
        inputs = _infos([grad_nd, data_nd, rois_nd, *extra])
        # (MXNet's shapes agree; a direct call's may not, and the launcher reads the
        # out-grad and writes the gradients by the data's and the rois' shapes)
        if inputs is None or not _shapes_ok(op, inputs[1][1], inputs[2][1]) or \
                tuple(op.out_shape(inputs[1][1], inputs[2][1])) != inputs[0][1]:
            return False
        data, rois, dtype = inputs[1], inputs[2], inputs[1][2]
        outputs = [_info_like(in_grad_nd, data)]
        # the rois' gradient: none computed for req null (a null pointer)
        outputs.append((0, rois[1], dtype) if rois_req == "null" or rois_grad_nd is None
                       else _info_like(rois_grad_nd, rois))
        # an extra input's gradient: into scratch memory for req null
        keep = []  # (the scratch arrays, alive through the call)
        for i, like in enumerate(inputs[3:]):
            r, nd = extra_grad[i] if i < len(extra_grad) else ("null", None)
            if r == "null" or nd is None:
                keep.append(np.empty(like[1], dtype))
                outputs.append((address(keep[-1]), like[1], dtype))
            else:
                outputs.append(_info_like(nd, like))
        if None in outputs:
            return False
        return self._invoke(op, 1, inputs, outputs)


def _packer(n) -> struct.Struct:
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct("@" + _TENSOR * n)
    return packer


def _info_like(nd, like):
    """``nd``'s ``(address, shape, dtype)`` when it has ``like``'s shape and dtype, else
    None."""
    info = array_info(nd)
    return info if info is not None and info[1:] == like[1:] else None


def _infos(nds):
    """``[(address, shape, dtype)]`` of ``nds`` (all of one dtype the ops take), or None."""
    out = []
    for nd in nds:
        info = array_info(nd)
        if info is None or info[2] is None or len(info[1]) > _MAX_NDIM or \
                (out and info[2] != out[0][2]):
            return None
        out.append(info)
    return out


def _shapes_ok(op, shape, rshape) -> bool:
    """A 4-D map with nothing empty and (R, K) rois of the op's layout, R >= 1."""
    return len(shape) == 4 and 0 not in shape and len(rshape) == 2 and \
        rshape[0] > 0 and rshape[1] == op.rois_columns
