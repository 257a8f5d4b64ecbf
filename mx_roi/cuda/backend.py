"""The ``cuda``, ``native`` and ``emulated-cuda`` backends: the ops' CUDA kernels, on a GPU,
compiled for the host as fast multi-threaded CPU code, or emulated serially on the host.

Flow of one call (``forward`` or ``backward``), identical for all three:

1. inputs -> arrays: on a GPU the MXNet NDArrays are handed to CuPy *without copies*
   through DLPack (``NDArray.to_dlpack_for_read`` -> ``cupy.from_dlpack``; outputs through
   ``to_dlpack_for_write``); ``native`` reads NumPy views through DLPack and lets the
   kernels write straight into MXNet's output / input-gradient memory (req write/inplace:
   ``Launch.out_target`` / ``grad_target``); the emulation copies through NumPy
   (``asnumpy``, ``dst[:] = value``);
2. ``op.check_inputs(shape, dtype, rois, xp)`` exactly like the NumPy backend;
3. the op's geometry tables, once: ``op.geometry(rois, H, W, xp)`` (``xp`` = cupy on a
   GPU, numpy in emulation) -- the kernels only read them (they never re-derive a bin or a
   sample), so every geometry the tables can express (legacy modes included) runs here;
4. ``op.forward_cuda(launch, geo, data)`` / ``op.backward_cuda(launch, geo, grad, shape,
   saved)`` pick the kernels and marshal the arguments through :class:`Launch`; no launch
   happens when there is nothing to compute (R = 0);
5. the result is stored honouring ``req`` (write/inplace, add, null).

Dtypes: the kernels run on the data's own element type ``T`` (float16 as ``__half``);
coordinates, weights and accumulation use the compute dtype ``A`` of
:func:`mx_roi.geometry.compute_dtype` (float32 for float16), and the backward accumulates
into a zeroed buffer of dtype ``A`` (float32 atomics for float16 data), converted to the
data dtype when it is stored.

Deterministic mode (``deterministic=True``): the backward kernels accumulate into an
``unsigned long long`` buffer in *fixed point*: each contribution ``v`` is added as the
integer ``v * scale`` rounded to nearest, ties to even (``__double2ll_rn``; ``llrint``
on the host), with an integer ``atomicAdd``.  Integer addition is
associative, so the result is bit-identical from run to run whatever the order of the
atomics.  ``scale = 2**(61 - e)`` where ``2**e > sum(|out_grad|) * spread``, a bound of the
magnitude of any input-gradient element (a bin hands out its gradient with weights summing
to at most ``spread``: 1 for the standard geometries, ``max(samples / divisor)`` of a
SampleGrid in general), so sums cannot overflow.  Precision trade-off: every contribution is
rounded to an absolute step of ``1/scale <= 2**-60 * sum(|out_grad|)``; that is far below a
float32 ulp of typical gradients, but for float64 data an element much smaller than the
total gradient mass keeps fewer significant bits than with float atomics.  It costs one
reduction of ``|out_grad|`` (a device->host sync) and 64-bit integer atomics.  If the
out-grad holds inf/NaN, fixed point cannot represent it and the float atomics are used.
The forward kernels have no atomics and are always deterministic; the NumPy backend is
deterministic anyway (the flag is accepted there).

Synchronisation (GPU): MXNet runs the custom op's Python callback after the engine has
completed the ops writing its inputs (``to_dlpack_for_read`` waits for them), and CuPy
launches on its current stream of ``cupy.cuda.Device(ctx.device_id)``.  Before returning,
the backend calls ``cupy.cuda.get_current_stream().synchronize()`` so that everything it
wrote is complete when MXNet's engine hands the outputs to the next operator (MXNet's
stream knows nothing of CuPy's).  Cost: one host wait per forward/backward -- the op's
kernels are not overlapped with the next MXNet op -- plus the small device->host reads of
input validation (``check_inputs``: finiteness and batch-index checks), of the geometry
(the padded sample count ``G``) and of the deterministic bound; each costs a launch
latency (microseconds), small against the kernels.  ``mx.nd.waitall()`` is never called
inside an op.
"""
from __future__ import annotations

import math

import numpy as np

from ..geometry import compute_dtype
from . import loader
from . import source as S

__all__ = ["CudaBackend", "Launch"]


class Launch:
    """What an op's ``forward_cuda``/``backward_cuda`` launches kernels through.

    Attributes: ``xp`` (numpy or cupy), ``dtype`` (data dtype), ``acc`` (compute dtype),
    ``T``/``A`` (their C types), ``deterministic``; after :meth:`grad_buffer`, ``O`` (the
    accumulator C type) and ``scale`` (numpy.float64).
    """

    def __init__(self, module, xp, dtype, deterministic=False):
        self.module = module
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.acc = compute_dtype(self.dtype)
        self.T = S.ctype_of(self.dtype)
        self.A = S.ctype_of(self.acc)
        self.deterministic = bool(deterministic)
        self.O = self.A
        self.scale = np.float64(1.0)
        self.fixed = False
        self.geo = None  # set by the backend: the geometry tables of this call
        # set by the native backend (req write/inplace): MXNet's own output / input-grad
        # memory, which the kernels then fill directly (no temporary, no copy)
        self.out_target = None
        self.grad_target = None
        self.launches = []  # (expression, n) of every launch, for tests

    # ---- argument helpers (kernel scalars are exact-width NumPy scalars) ----------
    @staticmethod
    def i32(v):
        v = int(v)
        if not -2 ** 31 <= v < 2 ** 31:
            raise OverflowError(f"{v} does not fit a kernel int parameter")
        return np.int32(v)

    @staticmethod
    def i64(v):
        return np.int64(int(v))

    def ints(self, a):
        """An int32 table, contiguous, on the backend's device."""
        return self.xp.ascontiguousarray(a, dtype=np.int32)

    def reals(self, a):
        """A weight/coordinate table in the compute dtype, contiguous."""
        return self.xp.ascontiguousarray(a, dtype=self.acc)

    def elements(self, a):
        """Data / out-grad as the kernels' element type ``T``, contiguous."""
        return self.xp.ascontiguousarray(a, dtype=self.dtype)

    def empty(self, shape, dtype=None):
        return self.xp.empty(shape, dtype=dtype or self.dtype)

    def output(self, shape):
        """The forward's output buffer: :attr:`out_target` when it fits, else a new one."""
        t = self.out_target
        if t is not None and tuple(t.shape) == tuple(shape) and t.dtype == self.dtype:
            return t
        return self.empty(shape)

    # ---- launching ----------------------------------------------------------------
    def forward(self, kernel, n, *args):
        """Launch ``kernel<T, A>`` over ``n`` work items (none if ``n == 0``)."""
        self._launch(S.expression(kernel, (self.T, self.A)), n, args)

    def backward(self, kernel, n, *args):
        """Launch ``kernel<T, A, O>`` (O from :meth:`grad_buffer`)."""
        self._launch(S.expression(kernel, (self.T, self.A, self.O)), n, args)

    def _launch(self, expr, n, args):
        k = self.module.get(expr)
        if int(n) <= 0:
            return
        grid, block = loader.launch_config(n)
        self.launches.append((expr, int(n)))
        k(grid, block, args)

    # ---- gradient accumulation ------------------------------------------------------
    def grad_buffer(self, shape, grad):
        """A zeroed accumulator for the input gradient; sets ``O`` and ``scale``."""
        xp = self.xp
        self.fixed = False
        if self.deterministic and grad.size:
            bound = float(xp.abs(grad.astype(np.float64)).sum()) * self._spread()
            if math.isfinite(bound):
                self.fixed = True
                e = math.frexp(bound)[1] if bound > 0 else 0  # bound < 2**e
                self.scale = np.float64(math.ldexp(1.0, max(min(61 - e, 1000), -1000)))
        if self.fixed:
            self.O = S.FIXED
            return _zeroed(xp, shape, np.uint64)
        self.O, self.scale = self.A, np.float64(1.0)
        t = self.grad_target
        if t is not None and tuple(t.shape) == tuple(shape) and t.dtype == self.acc:
            t.fill(0)
            return t
        return _zeroed(xp, shape, self.acc)

    def _spread(self):
        """How many times its out-grad a bin can hand out: 1 for integer bins and argmax
        routing; for a SampleGrid the largest ``samples / divisor`` (each sample's four
        bilinear weights sum to at most 1), which is 1 for every standard grid."""
        geo = self.geo
        if geo is None or not hasattr(geo, "divisor") or not hasattr(geo, "y"):
            return 1.0
        xp = self.xp
        if geo.divisor.size == 0:
            return 1.0
        n = geo.y.count[:, :, None].astype(np.float64) * geo.x.count[:, None, :]
        return max(1.0, float(xp.max(n / geo.divisor.astype(np.float64))))

    def grad_value(self, buf):
        """The accumulated gradient in the compute dtype."""
        if not self.fixed:
            return buf
        inv = np.float64(1.0) / self.scale  # a power of two: exact
        return (buf.view(np.int64).astype(np.float64) * inv).astype(self.acc)


def _zeroed(xp, shape, dtype):
    """Zeros, written rather than ``calloc``-ed: on the host, pages of a fresh mapping are
    then faulted in once, by one thread, instead of by every kernel thread (measured
    10x slower for a 60 MB gradient)."""
    buf = xp.empty(shape, dtype=dtype)
    buf.fill(0)
    return buf


class CudaBackend:
    """Runs ``op.forward_cuda``/``op.backward_cuda`` on CuPy arrays, or on NumPy arrays
    through the host-compiled kernels: the serial emulation (``emulated=True``) or the
    native multi-threaded CPU build (``native=True``, zero-copy NumPy views of the
    NDArrays)."""

    def __init__(self, emulated: bool, native: bool = False):
        self.native = bool(native)
        self.emulated = bool(emulated) or self.native
        self.name = "native" if self.native else (
            "emulated-cuda" if self.emulated else "cuda")
        if not self.emulated:
            import cupy  # noqa: F401  (fail early, with CuPy's own message)

    # ---- array I/O ----------------------------------------------------------------
    def _xp(self):
        if self.emulated:
            return np
        import cupy
        return cupy

    def _read(self, nd):
        if self.native:
            from ..backends import read_numpy
            return read_numpy(nd)
        if self.emulated:
            return nd.asnumpy()
        return _cupy_view(nd.to_dlpack_for_read(), nd)

    def _write(self, nd, req, value):
        if req == "null":
            return
        if req not in ("write", "inplace", "add"):
            raise ValueError(f"unknown req {req!r}")
        if self.emulated:
            from ..backends import write_numpy
            write_numpy(nd, req, value)
            return
        dst = _cupy_view(nd.to_dlpack_for_write(), nd)
        if req == "add":
            dst += value.astype(dst.dtype, copy=False)
        else:
            dst[...] = value

    def _target(self, nd, req):
        """MXNet's memory of ``nd`` for the kernels to write into (native backend, req
        write/inplace), else None."""
        if not self.native or req not in ("write", "inplace") or nd.size == 0:
            return None
        from ..backends import writable_numpy
        return writable_numpy(nd)

    def _device(self, nd):
        if self.emulated:
            return _NullContext()
        import cupy
        return cupy.cuda.Device(nd.context.device_id)

    def _sync(self):
        if not self.emulated:
            import cupy
            cupy.cuda.get_current_stream().synchronize()

    def _launch(self, op, dtype, nd):
        dev = -1 if self.emulated else nd.context.device_id
        module = loader.get_module(op.cuda_source, self.emulated, max(dev, 0), self.native)
        # the native build is deterministic anyway (each thread owns whole gradient
        # planes), so it never needs the fixed-point accumulation
        deterministic = getattr(op.param, "deterministic", False) and not self.native
        return Launch(module, self._xp(), dtype, deterministic)

    # ---- the backend interface ----------------------------------------------------
    def forward(self, op, req, data_nd, rois_nd, out_nd, keep=False):
        with self._device(data_nd):
            try:
                xp = self._xp()
                data, rois = self._read(data_nd), self._read(rois_nd)
                op.check_inputs(data.shape, data.dtype, rois, xp)
                _check_plane(op, data.shape)
                if req == "null" or rois.shape[0] == 0:
                    return None
                geo = op.geometry(rois, data.shape[2], data.shape[3], xp)
                launch = self._launch(op, data.dtype, data_nd)
                launch.out_target = self._target(out_nd, req)
                out, saved = op.forward_cuda(launch, geo, data)
                if out is not launch.out_target:
                    self._write(out_nd, req, out)
                if keep and self.emulated:  # host builds: the backward reuses the geometry
                    from ..backends import keep_for_backward
                    return keep_for_backward(saved, rois, data.shape[2:], geo)
                return saved if keep else None
            finally:
                self._sync()

    def backward(self, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved):
        if req == "null":
            return
        with self._device(in_grad_nd):
            try:
                xp = self._xp()
                shape = tuple(in_grad_nd.shape)
                _check_plane(op, shape)
                rois = self._read(rois_nd)
                if rois.shape[0] == 0:
                    if req != "add":
                        self._write(in_grad_nd, req, xp.zeros(shape, in_grad_nd.dtype))
                    return
                from ..backends import unpack_saved
                saved, geo = unpack_saved(saved, rois, shape[2:], xp)
                if geo is None:
                    geo = op.geometry(rois, shape[2], shape[3], xp)
                grad = self._read(grad_nd)
                launch = self._launch(op, grad.dtype, in_grad_nd)
                launch.geo = geo
                if saved is None and op.backward_needs_data:
                    _, saved = op.forward_cuda(launch, geo, self._read(data_nd))
                launch.grad_target = self._target(in_grad_nd, req)
                value = op.backward_cuda(launch, geo, grad, shape, saved)
                if value is not launch.grad_target:
                    self._write(in_grad_nd, req, value)
            finally:
                self._sync()


def _check_plane(op, shape):
    """Tensors may exceed 2^31 elements (64-bit indexing), one (H, W) plane may not: the
    kernels index within a plane (and ROIPooling's argmax ``h*W + w``) in int32."""
    if len(shape) == 4 and int(shape[2]) * int(shape[3]) >= 2 ** 31:
        raise ValueError(f"{op.name}: a feature map of {shape[2]}x{shape[3]} has 2^31 or more "
                         "elements per channel, more than the CUDA kernels index")


class _DLPackCapsule:
    """Protocol wrapper (``__dlpack__``/``__dlpack_device__``) around MXNet's capsule, for
    ``cupy.from_dlpack`` versions that no longer take a bare capsule."""

    def __init__(self, capsule, device_id):
        self._capsule = capsule
        self._device = (2, int(device_id))  # (kDLCUDA, device)

    def __dlpack__(self, stream=None):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


def _cupy_view(capsule, nd):
    """A CuPy array sharing the memory of GPU NDArray ``nd`` (no copy)."""
    import cupy
    if nd.size == 0:
        return cupy.zeros(nd.shape, dtype=nd.dtype)
    return cupy.from_dlpack(_DLPackCapsule(capsule, nd.context.device_id))


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
