"""Where an op's kernels run: NumPy, the CUDA kernels natively on the CPU, on a GPU, or emulated.

A backend moves MXNet NDArrays in and out of its array type, validates the inputs,
builds the op's geometry tables once per call and calls the op's kernels
(``forward_numpy``/``backward_numpy`` or the CUDA launchers).  Selection:

* a GPU context -> ``cuda`` (CuPy raw kernels);
* a CPU context -> ``MX_ROI_BACKEND`` if set: ``numpy``, ``native`` (the CUDA sources
  compiled for the host with ``-O3``, multi-threaded over channels) or ``emulated-cuda``
  (the same sources run serially as a GPU would, through the same launch glue);
* unset or ``auto``: each op's :attr:`~mx_roi.registry.RoIOp.cpu_backend`, the faster of
  the two on the benchmark (``python -m mx_roi.bench``): ``native`` for every op today
  (ROIAlign's average used NumPy/BLAS for training until its native backward took 16
  channels per tap).  ``native`` needs a C++ compiler at first use (the library is
  cached); without one, or if the build fails, the op falls back to ``numpy`` with a
  warning, once.
"""
from __future__ import annotations

import math
import os
import threading
import warnings

import numpy as np

from .geometry import compute_dtype
from .ndio import Kind, read_numpy, writable_numpy, write_numpy
from .saved import keep_for_backward, unpack_saved

__all__ = ["select", "get", "NumpyBackend", "native_available", "configured_cpu_backend"]

_CPU_CHOICES = ("auto",) + tuple(k.value for k in Kind if k.on_host)


def select(ctx, op=None) -> str:
    """Backend name for an MXNet context (string like ``'cpu(0)'`` or a Context) and op."""
    device = getattr(ctx, "device_type", str(ctx))
    if str(device).startswith("gpu"):
        return "cuda"
    choice = configured_cpu_backend(op)
    if choice == "native" and _env_choice() == "auto" and not native_available(op.cuda_source):
        return "numpy"
    return choice


def _env_choice() -> str:
    choice = os.environ.get("MX_ROI_BACKEND", "auto").strip().lower() or "auto"
    if choice not in _CPU_CHOICES:
        raise ValueError(f"MX_ROI_BACKEND={choice!r}: expected one of "
                         + ", ".join(repr(c) for c in _CPU_CHOICES))
    return choice


def configured_cpu_backend(op=None) -> str:
    """The CPU backend ``MX_ROI_BACKEND`` names, or unset / ``auto`` the op's
    :meth:`~mx_roi.registry.RoIOp.cpu_backend` (``'numpy'`` without an op), before any
    check that the native build is available (:func:`select` falls back to ``numpy``
    there; the native door's choice, :mod:`mx_roi.ext.door`, needs no host build)."""
    choice = _env_choice()
    if choice != "auto":
        return choice
    return op.cpu_backend() if op is not None else "numpy"


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
                loader.get_module(cuda_source, Kind.NATIVE)
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
    """The backend of that name (a :class:`~mx_roi.ndio.Kind` value), made once."""
    if name not in _INSTANCES:
        kind = Kind(name)
        if kind is Kind.NUMPY:
            _INSTANCES[name] = NumpyBackend()
        else:
            from .cuda.backend import CudaBackend
            _INSTANCES[name] = CudaBackend(kind)
    return _INSTANCES[name]


class NumpyBackend:
    """Runs ``op.forward_numpy``/``op.backward_numpy`` on NumPy arrays in the compute dtype."""

    name = "numpy"
    kind = Kind.NUMPY

    def forward(self, op, req, data_nd, rois_nd, out_nd, keep=False, extra=()):
        data, rois = read_numpy(data_nd), read_numpy(rois_nd)
        op.check_inputs(data.shape, data.dtype, rois, np)
        extra = [read_numpy(nd) for nd in extra]
        op.check_extra_inputs(data.shape, data.dtype, rois, extra, np)
        if req == "null":
            return None
        if rois.shape[0] == 0:
            return None
        if data.size == 0:  # an empty map (H or W = 0 under np_shape): zeros
            write_numpy(out_nd, req, np.zeros(out_nd.shape, out_nd.dtype))
            return None
        geo = op.geometry(rois, data.shape[2], data.shape[3], np, *extra)
        cdt = compute_dtype(data.dtype)
        # a kernel may write its result straight into MXNet's buffer (one pass, and the
        # buffer's first-touch page faults are paid once); it returns that buffer then
        target = writable_numpy(out_nd) if req in ("write", "inplace") and \
            out_nd.dtype == cdt else None
        out, saved = op.forward_numpy(geo, data.astype(cdt, copy=False), keep=keep, out=target)
        if out is not target:
            write_numpy(out_nd, req, out)
        return keep_for_backward(saved, rois, data.shape[2:], geo) if keep else None

    def backward(self, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved,
                 rois_req="null", rois_grad_nd=None, extra=(), extra_grad=()):
        """The data gradient (``req``); for an op that differentiates its rois, the rois'
        gradient (``rois_req``, into ``rois_grad_nd``); ``extra``: the op's extra inputs,
        ``extra_grad``: ``(req, gradient NDArray)`` of each (stored from a backward that
        returns a tuple, else zeros)."""
        extra_needed = any(r != "null" for r, _ in extra_grad)
        if req == "null" and rois_req == "null" and not extra_needed:
            return
        shape = tuple(data_nd.shape)
        cdt = compute_dtype(data_nd.dtype)
        rois = read_numpy(rois_nd)
        # validated again here: the backward never indexes with rois it has not checked
        op.check_inputs(shape, data_nd.dtype, rois, np)
        extra = [read_numpy(nd) for nd in extra]
        op.check_extra_inputs(shape, data_nd.dtype, rois, extra, np)
        if rois.shape[0] == 0 or math.prod(shape) == 0:
            store_grads(in_grad_nd, req, np.zeros(shape, cdt), extra_grad, (), write_numpy)
            write_numpy(rois_grad_nd, rois_req, np.zeros(rois.shape, cdt))
            return
        saved, geo = unpack_saved(saved, rois, shape[2:])
        if geo is None or extra:  # extra inputs are read again: their geometry too
            geo = op.geometry(rois, shape[2], shape[3], np, *extra)
        grad = read_numpy(grad_nd).astype(cdt, copy=False)
        data = None
        if rois_req != "null" or (saved is None and op.backward_needs_data):
            data = read_numpy(data_nd).astype(cdt, copy=False)
        if req != "null" or extra_needed:
            if saved is None and op.backward_needs_data:
                _, saved = op.forward_numpy(geo, data)
            result = op.backward_numpy(geo, grad, shape, saved)
            grads = result if isinstance(result, tuple) else (result,)
            store_grads(in_grad_nd, req, grads[0], extra_grad, grads[1:], write_numpy)
        if rois_req != "null":
            write_numpy(rois_grad_nd, rois_req,
                        op.rois_backward_numpy(geo, grad, data, rois.astype(cdt, copy=False)))


def store_grads(in_grad_nd, req, value, extra_grad, extra_values, write) -> None:
    """Store the data gradient ``value`` and each extra input's (``extra_values``, in
    ``extra_grad``'s order, missing or None = zeros) honouring each ``req`` through
    ``write(nd, req, value)``; ``'null'`` stores nothing, ``'add'`` adds."""
    if req != "null":
        write(in_grad_nd, req, value)
    for i, (r, nd) in enumerate(extra_grad):
        v = extra_values[i] if i < len(extra_values) else None
        if r == "null" or (v is None and r == "add"):
            continue
        write(nd, r, np.zeros(nd.shape, compute_dtype(nd.dtype)) if v is None else v)
