"""NDArray I/O of every backend: MXNet NDArrays to and from NumPy / CuPy arrays (DLPack).

* :class:`Kind` -- where an op's kernels run, and so how its arrays move:
  ``numpy`` and ``native`` read and write MXNet's CPU memory through zero-copy NumPy
  views, ``emulated-cuda`` copies through NumPy as a host stand-in for GPU memory, and
  ``cuda`` reads and writes GPU memory through zero-copy CuPy views.
* :func:`read` / :func:`write` / :func:`writable` for a kind; the NumPy and CuPy
  functions under them; one DLPack protocol adapter for both devices.

``to_dlpack_for_read`` waits for pending writes (and converts a oneDNN-layout array to
the default layout first); ``to_dlpack_for_write`` waits for pending reads and writes.
"""
from __future__ import annotations

import ctypes
import enum
import math
import threading

import numpy as np

__all__ = ["Kind", "DLPackCapsule", "read", "write", "writable", "xp_of", "read_numpy",
           "writable_numpy", "write_numpy", "read_cupy", "writable_cupy", "array_info",
           "zero_host"]

_KDLCPU, _KDLCUDA = 1, 2


class Kind(enum.Enum):
    """A backend kind (its value is the ``MX_ROI_BACKEND`` name)."""

    NUMPY = "numpy"
    NATIVE = "native"            # the CUDA sources compiled for the host, threaded
    EMULATED = "emulated-cuda"   # the same, run serially as a GPU would
    CUDA = "cuda"                # CuPy raw kernels on a GPU

    @property
    def on_host(self) -> bool:
        """Whether the kernels run on the CPU (NumPy arrays)."""
        return self is not Kind.CUDA


class DLPackCapsule:
    """Protocol wrapper (``__dlpack__``/``__dlpack_device__``) around MXNet's bare capsule,
    for ``np.from_dlpack`` (NumPy < 1.25 wants the protocol) and ``cupy.from_dlpack``
    versions that no longer take a bare capsule."""

    def __init__(self, capsule, device=(_KDLCPU, 0)):
        self._capsule = capsule
        self._device = (int(device[0]), int(device[1]))

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        # the array API's full signature (CuPy 13 passes max_version/copy); MXNet's
        # capsule is unversioned (allowed for any max_version), on its device, no copy
        if copy:
            raise BufferError("an MXNet DLPack capsule cannot be copied by its producer")
        if dl_device is not None and tuple(dl_device) != self._device:
            where = ("the CPU" if self._device[0] == _KDLCPU else
                     f"DLPack device {self._device}")
            raise BufferError(f"the NDArray lives on {where}, not DLPack device "
                              f"{tuple(dl_device)}")
        return self._capsule

    def __dlpack_device__(self):
        return self._device


# ---- NumPy (CPU NDArrays) ------------------------------------------------------------
def read_numpy(nd) -> np.ndarray:
    """A read-only NumPy view of a CPU NDArray's memory, without a copy (the view keeps
    the NDArray alive)."""
    if nd.size == 0:
        return np.zeros(nd.shape, dtype=nd.dtype)
    return np.from_dlpack(DLPackCapsule(nd.to_dlpack_for_read()))


def writable_numpy(nd) -> np.ndarray:
    """A writable NumPy view of a CPU NDArray's memory (DLPack), no copy.

    NumPy marks arrays imported through DLPack read-only; the view is rebuilt over the
    same address.  The NDArray (an op's output or input gradient) outlives the call.
    The capsule is taken ``for_read`` (waits for pending writes, no engine round trip
    when there are none): ``for_write`` would also wait for pending reads, which costs
    an engine round trip every call (~1 ms on a loaded 2-core machine) and buys nothing
    here -- inside a Custom callback MXNet's engine has already ordered this op after
    every reader of the array's memory, and the arrays it hands over are private.
    """
    ro = np.from_dlpack(DLPackCapsule(nd.to_dlpack_for_read()))
    if ro.size == 0:
        return np.zeros(ro.shape, dtype=ro.dtype)
    buf = (ctypes.c_byte * ro.nbytes).from_address(ro.__array_interface__["data"][0])
    return np.frombuffer(buf, dtype=ro.dtype).reshape(ro.shape)


def write_numpy(dst, req: str, value: np.ndarray) -> None:
    """Store ``value`` into CPU NDArray ``dst`` according to ``req`` (write/inplace/add/
    null), straight into its memory: one (possibly strided, possibly down-casting) pass,
    no temporary."""
    if req == "null" or dst.size == 0:
        return
    view = writable_numpy(dst)
    if value.shape != view.shape:  # e.g. (N, O, G, G, H, W) for (N, O*G*G, H, W)
        view = view.reshape(value.shape)
    if req == "add":  # in the destination's dtype, as MXNet's own kAddTo does
        view += np.asarray(value).astype(view.dtype, copy=False)
    elif req in ("write", "inplace"):
        np.copyto(view, value, casting="unsafe")
    else:
        raise ValueError(f"unknown req {req!r}")


# ---- addresses (CPU NDArrays): MXNet's C API ------------------------------------------
_MX_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.float16)}
_info_cells = {}  # OS thread id -> the C API's output cells (MXNet's worker threads
# are not Python threads: a callback's threading.local values die with it)


def array_info(nd):
    """``(address, shape, dtype)`` of CPU NDArray ``nd`` (dtype None for a type the ops do
    not take), after its pending writes: ``MXNDArrayWaitToRead`` (a no-op inside an op's
    callback, whose arrays MXNet has completed), ``MXNDArrayGetData`` (which first brings
    a oneDNN-layout array to the default layout), shape and dtype -- four C calls, about
    2 us, where a DLPack view costs 5-20 us."""
    from mxnet.base import _LIB  # (imported here: ndio imports nothing of MXNet at load)
    ident = threading.get_ident()
    cells = _info_cells.get(ident)
    if cells is None:
        cells = _info_cells[ident] = (ctypes.c_void_p(), ctypes.c_int(),
                                      ctypes.POINTER(ctypes.c_int)(), ctypes.c_int())
    ptr, ndim, shape, dtype = cells
    h = nd.handle
    if _LIB.MXNDArrayWaitToRead(h) or _LIB.MXNDArrayGetData(h, ctypes.byref(ptr)) or \
            _LIB.MXNDArrayGetShapeEx(h, ctypes.byref(ndim), ctypes.byref(shape)) or \
            _LIB.MXNDArrayGetDType(h, ctypes.byref(dtype)):
        return None
    n = ndim.value
    return ptr.value or 0, (tuple(shape[:n]) if n > 0 else ()), _MX_DTYPES.get(dtype.value)


def zero_host(nd) -> None:
    """Zeros into all of CPU NDArray ``nd``'s memory (one ``memset``; no engine op, no
    DLPack view)."""
    info = array_info(nd)
    if info is None or info[2] is None:  # (a dtype the ops do not take: through a view)
        writable_numpy(nd).fill(0)
        return
    addr, shape, dtype = info
    n = math.prod(shape) * dtype.itemsize
    if n and addr:
        ctypes.memset(addr, 0, n)


# ---- CuPy (GPU NDArrays) -------------------------------------------------------------
def _cupy_view(capsule, nd):
    import cupy
    if nd.size == 0:
        return cupy.zeros(nd.shape, dtype=nd.dtype)
    return cupy.from_dlpack(DLPackCapsule(capsule, (_KDLCUDA, nd.context.device_id)))


def read_cupy(nd):
    """A CuPy array sharing the memory of GPU NDArray ``nd`` (no copy), for reading."""
    return _cupy_view(nd.to_dlpack_for_read(), nd)


def writable_cupy(nd):
    """A CuPy array sharing the memory of GPU NDArray ``nd`` (no copy), for writing."""
    return _cupy_view(nd.to_dlpack_for_write(), nd)


# ---- by kind -------------------------------------------------------------------------
def xp_of(kind: Kind):
    """The array module of ``kind``: numpy on the host, cupy on a GPU."""
    if kind.on_host:
        return np
    import cupy
    return cupy


def read(kind: Kind, nd):
    """``nd`` as an array of ``kind``: a NumPy view (numpy, native), a NumPy copy
    (emulated-cuda) or a CuPy view (cuda)."""
    if kind is Kind.CUDA:
        return read_cupy(nd)
    if kind is Kind.EMULATED:
        return nd.asnumpy()
    return read_numpy(nd)


def writable(kind: Kind, nd):
    """MXNet's memory of ``nd`` for the kernels to write: a NumPy view (numpy, native),
    a CuPy view (cuda); ``emulated-cuda`` gets a host copy (written back with
    :func:`write`)."""
    if kind is Kind.CUDA:
        return writable_cupy(nd)
    if kind is Kind.EMULATED:
        return nd.asnumpy()
    return writable_numpy(nd)


def write(kind: Kind, nd, req: str, value) -> None:
    """Store ``value`` into ``nd`` honouring ``req`` (write/inplace, add, null)."""
    if req == "null":
        return
    if req not in ("write", "inplace", "add"):
        raise ValueError(f"unknown req {req!r}")
    if kind.on_host:
        write_numpy(nd, req, value)
        return
    dst = writable_cupy(nd)
    if req == "add":  # in the destination's dtype, as MXNet's kAddTo does
        dst += value.astype(dst.dtype, copy=False)
    else:
        dst[...] = value
