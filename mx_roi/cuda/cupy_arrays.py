"""CuPy arrays in the place of GPU NDArrays: the GPU path run where MXNet is a CPU build.

The only MXNet 1.9.1 GPU wheel, ``mxnet-cu112``, needs the CUDA 11.2 libraries and numpy
< 1.24; a current CUDA machine often has CuPy and a GPU but no such MXNet.  The CUDA backend
(:class:`mx_roi.cuda.backend.CudaBackend`) touches an NDArray only through its ``shape``,
``size``, ``dtype``, ``context.device_id`` and the DLPack capsules of
``to_dlpack_for_read`` / ``to_dlpack_for_write`` (:mod:`mx_roi.ndio`), so a CuPy array
with those attributes runs the very geometry, I/O, launch and kernel code a GPU NDArray
would, capsule for capsule.  What it cannot show is MXNet's side: its engine, streams,
autograd and CUDA built-ins.

Used by the self-test (``cuda`` row), the first-GPU-run checklist and the GPU kernel
benchmark when MXNet sees no GPU but CuPy does (:func:`mx_roi.gpucheck.gpu_context`).
"""
from __future__ import annotations

import numpy as np

__all__ = ["Device", "CupyNDArray"]


class Device:
    """A GPU as CuPy sees it, standing in for ``mx.gpu(device_id)``: makes arrays on it."""

    device_type = "gpu"

    def __init__(self, device_id: int = 0):
        import cupy
        self.device_id = int(device_id)
        self._cupy = cupy

    def array(self, a, dtype=None) -> "CupyNDArray":
        """A copy of host array ``a`` on this GPU (``mx.nd.array(a, ctx=...)``)."""
        a = np.asarray(a, dtype=dtype)
        with self._cupy.cuda.Device(self.device_id):
            return CupyNDArray(self._cupy.asarray(a), self)

    def zeros(self, shape, dtype=np.float32) -> "CupyNDArray":
        with self._cupy.cuda.Device(self.device_id):
            return CupyNDArray(self._cupy.zeros(tuple(shape), dtype=dtype), self)

    def __repr__(self):
        return f"cupy-gpu({self.device_id})"


class CupyNDArray:
    """The NDArray surface :mod:`mx_roi.ndio` reads, over a CuPy array ``data``."""

    def __init__(self, data, context: Device):
        self.data = data
        self.context = context

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def dtype(self):
        return np.dtype(self.data.dtype)

    def _capsule(self):
        # an unversioned capsule, as MXNet's to_dlpack_* hand out; CuPy's stream is the
        # one the kernels run on, so there is nothing to wait for
        return self.data.__dlpack__()

    def to_dlpack_for_read(self):
        return self._capsule()

    def to_dlpack_for_write(self):
        return self._capsule()

    def asnumpy(self) -> np.ndarray:
        return self.context._cupy.asnumpy(self.data)

    def __repr__(self):
        return f"<CupyNDArray {self.shape} {self.dtype} @{self.context!r}>"
