"""Where an op's kernels run: NumPy, the CUDA kernels natively on the CPU, on a GPU, or emulated.

A backend moves MXNet NDArrays in and out of its array type, validates the inputs,
builds the op's geometry tables once per call and calls the op's kernels
(``forward_numpy``/``backward_numpy`` or the CUDA launchers).  Selection:

* a GPU context -> ``cuda`` (CuPy raw kernels);
* a CPU context -> ``MX_ROI_BACKEND`` if set: ``numpy``, ``native`` (the CUDA sources
  compiled for the host with ``-O3``, multi-threaded over channels) or ``emulated-cuda``
  (the same sources run serially as a GPU would, through the same launch glue);
* unset or ``auto``: each op's :attr:`~mx_roi.registry.RoIOp.cpu_backend`, the faster of
  the two on the benchmark (``python -m mx_roi.bench``): ``native`` for ROIPooling and
  the position-sensitive ops, ``numpy`` (BLAS) for ROIAlign.  ``native`` needs a C++
  compiler at first use (the library is cached); without one, or if the build fails, the
  op falls back to ``numpy`` with a warning, once.
"""
from __future__ import annotations

import ctypes
import os
import threading
import warnings

import mxnet as mx
import numpy as np

from .geometry import compute_dtype

__all__ = ["select", "get", "write_numpy", "NumpyBackend", "BACKEND_NAMES", "native_available",
           "Saved", "keep_for_backward", "unpack_saved"]

BACKEND_NAMES = ("numpy", "native", "emulated-cuda", "cuda")
_CPU_CHOICES = ("auto", "numpy", "native", "emulated-cuda")


def select(ctx, op=None) -> str:
    """Backend name for an MXNet context (string like ``'cpu(0)'`` or a Context) and op."""
    device = getattr(ctx, "device_type", str(ctx))
    if str(device).startswith("gpu"):
        return "cuda"
    choice = os.environ.get("MX_ROI_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _CPU_CHOICES:
        raise ValueError(f"MX_ROI_BACKEND={choice!r}: expected one of "
                         + ", ".join(repr(c) for c in _CPU_CHOICES))
    if choice != "auto":
        return choice
    preferred = op.cpu_backend() if op is not None else "numpy"
    if preferred == "native" and not native_available(op.cuda_source):
        return "numpy"
    return preferred


_NATIVE_OK = {}
_NATIVE_LOCK = threading.Lock()


def native_available(cuda_source: str) -> bool:
    """Whether the native host build of ``cuda_source`` exists or can be built (once per
    process; a failure is reported with one warning and remembered)."""
    with _NATIVE_LOCK:
        ok = _NATIVE_OK.get(cuda_source)
        if ok is None:
            from .cuda import loader
            try:
                loader.get_module(cuda_source, True, native=True)
                ok = True
            except Exception as exc:  # noqa: BLE001 - no compiler, failed build: fall back
                warnings.warn(f"mx_roi: the native CPU kernels of {cuda_source} are not "
                              f"available ({str(exc).splitlines()[0]}); using the NumPy "
                              "kernels instead", RuntimeWarning, stacklevel=2)
                ok = False
            _NATIVE_OK[cuda_source] = ok
        return ok


_INSTANCES = {}


def get(name: str):
    if name not in _INSTANCES:
        if name == "numpy":
            _INSTANCES[name] = NumpyBackend()
        else:
            from .cuda.backend import CudaBackend  # imported lazily: needs a compiler or CuPy
            _INSTANCES[name] = CudaBackend(emulated=(name == "emulated-cuda"),
                                           native=(name == "native"))
    return _INSTANCES[name]


class _Capsule:
    """Adapter giving ``np.from_dlpack`` the protocol object it expects (NumPy < 1.25)."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def read_numpy(nd) -> np.ndarray:
    """A read-only NumPy view of a CPU NDArray's memory, without a copy (DLPack).

    ``to_dlpack_for_read`` waits for pending writes and converts a oneDNN-layout
    array to the default layout first; the view keeps the NDArray alive.
    """
    if nd.size == 0:
        return np.zeros(nd.shape, dtype=nd.dtype)
    return np.from_dlpack(_Capsule(nd.to_dlpack_for_read()))


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
    ro = np.from_dlpack(_Capsule(nd.to_dlpack_for_read()))
    if ro.size == 0:
        return np.zeros(ro.shape, dtype=ro.dtype)
    buf = (ctypes.c_byte * ro.nbytes).from_address(ro.__array_interface__["data"][0])
    return np.frombuffer(buf, dtype=ro.dtype).reshape(ro.shape)


def write_numpy(dst, req: str, value: np.ndarray) -> None:
    """Store ``value`` into NDArray ``dst`` according to ``req`` (write/inplace/add/null).

    Written straight into ``dst``'s memory: one (possibly strided, possibly
    down-casting) pass, no temporary.
    """
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


class Saved:
    """What a training forward keeps for its backward: the op's own value (e.g. an
    argmax, or None), and the call's rois (a copy), map size and geometry tables, which
    the backward reuses instead of rebuilding them when its rois are the same."""

    __slots__ = ("value", "rois", "hw", "geo")

    def __init__(self, value, rois, hw, geo):
        self.value, self.rois, self.hw, self.geo = value, rois, hw, geo


def keep_for_backward(value, rois, hw, geo) -> Saved:
    return Saved(value, rois.copy(), tuple(int(v) for v in hw), geo)


def unpack_saved(saved, rois, hw, xp=np):
    """``(value, geometry or None)`` for a backward with ``rois`` on an ``hw`` map.

    If the rois or the map size differ from the forward's, neither is reused (an argmax
    of other rois would route the gradient wrongly): ``(None, None)``.
    """
    if not isinstance(saved, Saved):
        return saved, None
    same = (saved.hw == tuple(int(v) for v in hw) and saved.rois.shape == rois.shape
            and saved.rois.dtype == rois.dtype and bool(xp.array_equal(saved.rois, rois)))
    return (saved.value, saved.geo) if same else (None, None)


class NumpyBackend:
    """Runs ``op.forward_numpy``/``op.backward_numpy`` on NumPy arrays in the compute dtype."""

    name = "numpy"

    def forward(self, op, req, data_nd, rois_nd, out_nd, keep=False):
        data, rois = read_numpy(data_nd), read_numpy(rois_nd)
        op.check_inputs(data.shape, data.dtype, rois, np)
        if req == "null":
            return None
        if rois.shape[0] == 0:
            return None
        geo = op.geometry(rois, data.shape[2], data.shape[3], np)
        cdt = compute_dtype(data.dtype)
        # a kernel may write its result straight into MXNet's buffer (one pass, and the
        # buffer's first-touch page faults are paid once); it returns that buffer then
        target = writable_numpy(out_nd) if req in ("write", "inplace") and \
            out_nd.dtype == cdt else None
        out, saved = op.forward_numpy(geo, data.astype(cdt, copy=False), keep=keep, out=target)
        if out is not target:
            write_numpy(out_nd, req, out)
        return keep_for_backward(saved, rois, data.shape[2:], geo) if keep else None

    def backward(self, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved):
        if req == "null":
            return
        shape = in_grad_nd.shape
        cdt = compute_dtype(in_grad_nd.dtype)
        rois = read_numpy(rois_nd)
        if rois.shape[0] == 0:
            write_numpy(in_grad_nd, req, np.zeros(shape, cdt))
            return
        saved, geo = unpack_saved(saved, rois, shape[2:])
        if geo is None:
            geo = op.geometry(rois, shape[2], shape[3], np)
        grad = read_numpy(grad_nd).astype(cdt, copy=False)
        if saved is None and op.backward_needs_data:
            data = read_numpy(data_nd).astype(cdt, copy=False)
            _, saved = op.forward_numpy(geo, data)
        write_numpy(in_grad_nd, req, op.backward_numpy(geo, grad, shape, saved))
