"""The ``cuda``, ``native`` and ``emulated-cuda`` backends: the ops' CUDA kernels, on a GPU,
compiled for the host as fast multi-threaded CPU code, or emulated serially on the host.

Flow of one call (``forward`` or ``backward``), identical for all three (on ``native``,
a call runs as one call into the extension library's launcher instead -- the native
operators' own code, :mod:`mx_roi.cuda.library_calls` -- and comes here, the *checked
path*, only when that does not apply or the launcher refused an input):

1. inputs -> arrays: on a GPU the MXNet NDArrays are handed to CuPy *without copies*
   through DLPack (``NDArray.to_dlpack_for_read`` -> ``cupy.from_dlpack``; outputs through
   ``to_dlpack_for_write``); ``native`` reads NumPy views through DLPack and lets the
   kernels write straight into MXNet's output / input-gradient memory (req write/inplace:
   ``Launch.out_target`` / ``grad_target``); the emulation copies through NumPy
   (``asnumpy``, ``dst[:] = value``);
2. a GPU or ``emulated-cuda`` forward of an op with a compiled geometry
   (``op.geometry_spec()``) reads no roi on the host before its launches: one kernel, one
   thread per roi, checks the rois and fills the tables on the device
   (:mod:`mx_roi.cuda.device_geometry`); a bad roi is recorded in a status word and its
   row marked as padding (no data read with it); the status is read at the stream sync
   the call ends with, and the call then raises the host check's message (a box needing
   wider tables than the shapes allot reruns on host tables, below).  Every other call
   (the backward, ``native``, req null/add, no rois, an empty map):
   ``op.check_inputs(shape, dtype, rois, np)`` exactly like the NumPy backend, on the
   rois on the host (a GPU call copies its (R, 5) rois back once); on the host builds,
   for an op with a compiled geometry (``op.geometry_spec()``), the first bad roi is
   found in compiled code (``check_inputs(..., compiled=...)``: the same roi, the same
   message);
3. the op's geometry tables, once per training step: on the host builds from the
   compiled twin of :mod:`mx_roi.geometry` (:mod:`mx_roi.cuda.compiled_geometry`: the
   same tables bit for bit, tests/test_geometry_compiled.py), else (a GPU call, an op
   without a ``geometry_spec``) ``op.geometry(rois, H, W, np)`` on the host -- on a GPU
   then moved in one packed copy (:func:`mx_roi.cuda.tables.to_device`:
   a few dozen tiny CuPy kernels and device reads cost more than the kernels themselves),
   and kept with the forward's argmax for its backward -- the kernels only read them (they
   never re-derive a bin or a sample), so every geometry the tables can express (legacy
   modes included) runs here, with the same tables bit for bit on every backend;
4. ``op.forward_cuda(launch, geo, data)`` / ``op.backward_cuda(launch, geo, grad, shape,
   saved)`` pick the kernels and marshal the arguments through :class:`Launch`; no launch
   happens when there is nothing to compute (R = 0);
5. the result is stored honouring ``req`` (write/inplace, add, null).

Dtypes: the kernels run on the data's own element type ``T`` (float16 as ``__half``);
coordinates, weights and accumulation use the compute dtype ``A`` of
:func:`mx_roi.geometry.compute_dtype` (float32 for float16), and the backward accumulates
straight into MXNet's input-gradient memory when its dtype is ``A`` (float32/float64:
zeroed first for ``write``, added to as it is for ``add``, as MXNet's own kernels do); for
float16 data into one zeroed float32 buffer of the input's size (float32 atomics),
converted when it is stored.

GPU memory: besides what a training forward keeps for its backward -- the argmax (max
modes) and the geometry tables (one small block) -- the op holds no GPU memory between
calls.  The argmax is (R, C, P, Q), bin-relative (the winner's
index among its bin's candidates), in the smallest unsigned type that fits every bin of
the call (:func:`mx_roi.cuda.tables.argmax_dtype`: ``uint8`` for bins of at most 254
candidates -- a quarter of an int32 argmax --, else ``uint16`` or ``uint32``; the type's
maximum means "no winner"; on device-built tables the type fits the largest bin of a
box inside the map, :func:`mx_roi.cuda.device_geometry.bin_cells`, and the sample grids'
padded widths, as nothing of the rois is read on the host), the kernels' template
parameter ``I``, deduced from the array's dtype (:meth:`Launch.expression`).  A call's temporaries (geometry tables, the
float16 or fixed-point accumulator) are dropped when it returns, and after the stream
sync CuPy's default memory pool frees its unused blocks whenever they exceed
:data:`POOL_KEEP_BYTES` (32 MiB), so MXNet's allocator can reuse them; smaller caches are
kept to spare per-call ``cudaMalloc``.

Deterministic mode (``deterministic=True``): the backward kernels accumulate into an
``unsigned long long`` buffer in *fixed point*: each contribution ``v`` is added as the
integer ``v * scale`` rounded to nearest, ties to even (``__double2ll_rn``; ``llrint``
on the host), with an integer ``atomicAdd``.  Integer addition is
associative, so the result is bit-identical from run to run whatever the order of the
atomics.  ``scale = 2**(61 - e)`` where ``2**e > sum(|out_grad|) * spread``, a bound of the
magnitude of any input-gradient element (a bin hands out its gradient with weights summing
to at most ``spread``, computed from the geometry tables by :meth:`Launch._spread`: 1 for
the standard geometries, 4 on the Caffe legacy grid), so sums stay below ``2**61``, with
a factor 4 to spare for rounding.  The ``uint64`` buffer (8 bytes per input element) is
decoded in place into float64 and then stored into MXNet's gradient.  Precision trade-off: every contribution is
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
kernels are not overlapped with the next MXNet op.  A forward on device-built tables
copies nothing to or from the host before its launches and makes that wait the copy of
its 16-byte status word (``cupy.asnumpy(status, stream=...)``: one copy, one sync);
the backward still copies its rois to the host first (validation and geometry there:
one more wait; after a device-path forward, its kept rois come back in the same copy)
and, in deterministic mode, reads the bound; each a few microseconds.
``mx.nd.waitall()`` is never called inside an op.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ndio, scratch
from ..geometry import compute_dtype
from ..ndio import Kind
from ..saved import Saved, keep_for_backward, unpack_saved
from . import device_geometry, loader
from .library_calls import LibraryCalls
from . import source as S
from .tables import argmax_dtype, host_tables, to_device

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
        # 'add': the kernels add into grad_target as it is (not zeroed)
        self.grad_req = "write"
        # False (set by the backend for an inference forward): nothing is kept for a
        # backward, so the max kernels need not store their argmax
        self.keep = True
        # set by the backend for the backward of a max op whose forward kept no argmax:
        # the input data, in which its rescan kernel finds the winners again
        self.data = None
        self.launches = []  # (expression, n) of every launch, for tests

    @classmethod
    def on_host(cls, cuda_source, kind, dtype):
        """A launch of ``cuda_source``'s kernels in the host build ``kind`` (a
        :class:`~mx_roi.ndio.Kind` or its value) over NumPy arrays of ``dtype``: how the
        compiled-geometry tests call a kernel directly."""
        return cls(loader.get_module(cuda_source, Kind(kind)), np, dtype)

    def empty(self, shape, dtype=None):
        if self.xp is np:  # large host scratch arrays reuse their memory
            return scratch.empty(shape, dtype or self.dtype)
        return self.xp.empty(shape, dtype=dtype or self.dtype)

    def output(self, shape):
        """The forward's output buffer: :attr:`out_target` when it fits, else a new one."""
        t = self.out_target
        if t is not None and tuple(t.shape) == tuple(shape) and t.dtype == self.dtype:
            return t
        return self.empty(shape)

    def argmax(self, shape, max_candidates):
        """A max kernel's argmax buffer and whether the forward stores it: ``(argmax,
        True)``, ``shape`` in the smallest index dtype holding ``max_candidates()``
        bin-relative indices (:func:`~mx_roi.cuda.tables.argmax_dtype`), when a backward
        follows (:attr:`keep`) and the output has at most
        :data:`ARGMAX_KEEP_MAX_ELEMENTS` elements; else ``(dummy, False)``, a one-element
        ``uint8`` array (nothing stored, ``max_candidates`` not called): an inference
        forward, or a large training call whose backward finds the winners again in the
        data (the op's ``*_rescan`` kernel, :attr:`data`)."""
        if not self.keep or math.prod(shape) > ARGMAX_KEEP_MAX_ELEMENTS:
            return self.empty((1,), argmax_dtype(0)), False
        return self.empty(shape, argmax_dtype(max_candidates())), True

    # ---- launching ----------------------------------------------------------------
    def forward(self, kernel, n, tables=None, **args):
        """Launch ``kernel<T, A, ...>`` over ``n`` work items (none if ``n == 0``), its
        arguments bound by parameter name (:meth:`bind`); further template parameters
        are deduced from the arguments (:meth:`expression`)."""
        tables = tables or {}
        self._bind_and_launch(self.expression(kernel, {"T": self.T, "A": self.A},
                                              tables, args), n, tables, args)

    def backward(self, kernel, n, tables=None, **args):
        """Launch ``kernel<T, A, O, ...>`` (O from :meth:`grad_buffer`), arguments by
        name, further template parameters deduced (:meth:`expression`)."""
        tables = tables or {}
        self._bind_and_launch(self.expression(kernel, {"T": self.T, "A": self.A,
                                                       "O": self.O}, tables, args),
                              n, tables, args)

    def expression(self, kernel, given, tables, args) -> str:
        """The name expression of ``kernel``: template parameters named in ``given``
        (``T``, ``A``, and ``O`` for a backward) take those C types; any other is deduced
        from the dtype of the array argument (or table) declared with it, e.g. ``I`` of
        ``I* argmax`` from the ``argmax`` array (``uint8`` -> ``unsigned char``), so an op
        picks an instantiation by the arrays it allocates."""
        targs = []
        for name, params in S.deduced_from(self.module.filename, kernel):
            if name in given:
                targs.append(given[name])
                continue
            values = [v for v in (args.get(p, tables.get(p)) for p in params)
                      if v is not None]
            dtypes = {np.dtype(v.dtype) for v in values if hasattr(v, "dtype")}
            if not values:
                raise loader.KernelArgumentError(
                    f"{kernel}: missing argument(s) for {', '.join(params) or '(none)'} "
                    f"(the template parameter {name} is deduced from its dtype)")
            if len(dtypes) != 1 or len(values) != sum(hasattr(v, "dtype") for v in values):
                raise loader.KernelArgumentError(
                    f"{kernel}: cannot deduce the template parameter {name} from "
                    f"{', '.join(params)}: " + (f"dtypes {sorted(map(str, dtypes))} differ"
                                                if len(dtypes) > 1 else "not an array"))
            targs.append(S.ctype_of(dtypes.pop()))
        return S.expression(kernel, targs)

    def _bind_and_launch(self, expr, n, tables, args):
        self._launch(expr, n, self.bind(self.module.get(expr).signature, n, tables, args))

    def _launch(self, expr, n, args):
        k = self.module.get(expr)
        if int(n) <= 0:
            return
        grid, block = loader.launch_config(n)
        self.launches.append((expr, int(n)))
        k(grid, block, args)

    def bind(self, sig, n, tables, args) -> tuple:
        """The argument tuple of kernel signature ``sig`` (parsed from the source), in its
        parameter order, from arguments by name:

        * ``args``: every one must name a parameter of the kernel;
        * ``tables``: geometry tables by name (:mod:`mx_roi.cuda.tables`), each used
          where the kernel has a parameter of that name;
        * ``n`` (work items) and ``scale`` (:meth:`grad_buffer`) unless given.

        Read-only arrays (``const`` pointers) are made contiguous in the parameter's
        dtype (element type ``T``, compute type ``A`` or ``int``); Python numbers become
        NumPy scalars of the parameter's type.  Written arrays are passed as they are:
        :func:`mx_roi.cuda.loader.check_args` then checks every argument at launch.
        """
        plan = _bind_plan(sig)
        names = plan.names
        unknown = [a for a in args if a not in names]
        if unknown:
            raise loader.KernelArgumentError(
                f"{plan.where}: no parameter(s) {', '.join(unknown)}; parameters: "
                + ", ".join(p.describe() for p in sig.params))
        values = {"n": n, "scale": self.scale, **tables, **args}
        if not names.issubset(values):
            missing = [p.describe() for p in sig.params if p.name not in values]
            raise loader.KernelArgumentError(f"{plan.where}: missing argument(s) for "
                                             + ", ".join(missing))
        ordered = []
        xp = self.xp
        array_type = xp.ndarray
        for p, name, kind, dtype in plan.params:
            v = values[name]
            if kind is _CONST:
                # already fine: as it is (on a GPU each conversion call costs microseconds)
                if not (type(v) is array_type and v.dtype == dtype and v.flags.c_contiguous):
                    v = xp.ascontiguousarray(v, dtype=dtype)
            elif kind is _SCALAR:
                if type(v) is int and dtype is _INT32 and -_I32 <= v < _I32:
                    v = _np_int32(v)  # the common case (sizes, flags), no checks to run
                elif isinstance(v, _NUMBERS) and not isinstance(v, bool) \
                        and not (isinstance(v, np.generic) and v.dtype == dtype):
                    v = _scalar(v, p)
            ordered.append(v)
        return tuple(ordered)

    # ---- gradient accumulation ------------------------------------------------------
    def grad_buffer(self, shape, grad):
        """The accumulator of the input gradient; sets ``O`` and ``scale``.

        :attr:`grad_target` itself (MXNet's gradient memory, zeroed for ``write``, as it
        is for ``add``) when its dtype is the compute dtype and no fixed point is used;
        else a zeroed temporary of the input's size: ``uint64`` (fixed point) or float32
        (float16 data).
        """
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
            if self.grad_req != "add":
                t.fill(0)
            return t
        return _zeroed(xp, shape, self.acc)

    def _spread(self):
        """How many times its out-grad a bin can hand out, from the tables: 1 for integer
        bins (argmax, or weights ``1/area``); for a SampleGrid the largest of

        * ``Sy * Sx / divisor`` (average: every sample), ``S`` the sum over a bin's
          samples of an axis of ``|w_low| + |w_high|``, and
        * ``My * Mx`` (max: the winning sample), ``M`` their largest;

        a sample's four weights sum to ``(|wyl| + |wyh|) * (|wxl| + |wxh|)``: 1 for the
        standard bilinear rule, up to 4 on the Caffe legacy grid (both taps of weight 1
        at an integer coordinate).  Every legacy grid is covered, whatever its weights."""
        geo = host_tables(self.geo) if self.geo is not None else None
        if geo is None or not hasattr(geo, "divisor") or not hasattr(geo, "y"):
            return 1.0
        xp = np  # the host tables (a GPU call's too): no device reads, emulation's bits
        if geo.divisor.size == 0:
            return 1.0

        def host(a):  # tables built on the device (device_geometry): read once, here
            return a if isinstance(a, np.ndarray) else self.xp.asnumpy(a)

        sums, peaks = [], []
        for axis in (geo.y, geo.x):
            w = xp.abs(host(axis.w_low).astype(np.float64)) + \
                xp.abs(host(axis.w_high).astype(np.float64))
            live = xp.arange(w.shape[2])[None, None, :] < host(axis.count)[:, :, None]
            w = xp.where(live, w, 0.0)                                   # (R, P, G)
            sums.append(w.sum(axis=2))
            peaks.append(w.max(axis=2) if w.shape[2] else xp.zeros(w.shape[:2]))
        avg = sums[0][:, :, None] * sums[1][:, None, :] / host(geo.divisor).astype(np.float64)
        peak = peaks[0][:, :, None] * peaks[1][:, None, :]
        return max(1.0, float(xp.max(xp.maximum(avg, peak))))

    def grad_value(self, buf):
        """The accumulated gradient: ``buf`` itself, or for fixed point ``buf`` decoded in
        place as float64 (no temporary: each element is read, then overwritten)."""
        if not self.fixed:
            return buf
        inv = np.float64(1.0) / self.scale  # a power of two: exact
        out = buf.view(np.float64)
        self.xp.multiply(buf.view(np.int64), inv, out=out)
        return out


_NUMBERS = (int, float, np.integer, np.floating)


_CONST, _POINTER, _SCALAR = "const pointer", "pointer", "scalar"
_INT32 = np.dtype(np.int32)
_I32 = 2 ** 31
_np_int32 = np.int32


class _BindPlan:
    """What :meth:`Launch.bind` needs of a signature, derived once per signature:
    per parameter ``(param, name, kind, dtype)``, kind one of ``_CONST`` (read-only
    array), ``_POINTER`` (written array), ``_SCALAR``."""

    __slots__ = ("sig", "where", "names", "params")

    def __init__(self, sig):
        self.sig = sig
        self.where = S.expression(sig.kernel, sig.template)
        self.names = frozenset(p.name for p in sig.params)
        self.params = tuple(
            (p, p.name,
             (_CONST if p.decl.startswith("const ") else _POINTER) if p.pointer else _SCALAR,
             _INT32 if p.dtype == _INT32 else p.dtype)
            for p in sig.params)


_BIND_PLANS = {}


def _bind_plan(sig) -> _BindPlan:
    """The plan of ``sig``, found by identity: signatures are made once per kernel
    instantiation (:func:`mx_roi.cuda.source.instantiate`), and hashing one (a tuple of
    parameter records) cost more than the rest of a small launch's binding."""
    plan = _BIND_PLANS.get(id(sig))
    if plan is None or plan.sig is not sig:
        plan = _BIND_PLANS[id(sig)] = _BindPlan(sig)
    return plan


def _scalar(v, p):
    """``v`` as a NumPy scalar of scalar parameter ``p``'s type (ints range-checked)."""
    if p.dtype.kind in "iu":
        if isinstance(v, (float, np.floating)) and v != int(v):
            raise TypeError(f"{p.describe()}: {v!r} is not an integer")
        lo, hi = _int_range(p.dtype)
        if not lo <= int(v) <= hi:
            raise OverflowError(f"{v} does not fit the kernel parameter {p.describe()}")
        return p.dtype.type(int(v))
    return p.dtype.type(v)


_INT_RANGES = {}


def _int_range(dtype):
    """``(min, max)`` of an integer dtype (``np.iinfo``, read once per dtype)."""
    r = _INT_RANGES.get(dtype)
    if r is None:
        info = np.iinfo(dtype)
        r = _INT_RANGES[dtype] = (int(info.min), int(info.max))
    return r


def _zeroed(xp, shape, dtype):
    """Zeros, written rather than ``calloc``-ed: on the host, pages of a fresh mapping are
    then faulted in once, by one thread, instead of by every kernel thread (measured
    10x slower for a 60 MB gradient)."""
    buf = xp.empty(shape, dtype=dtype)
    buf.fill(0)
    return buf


class CudaBackend:
    """Runs ``op.forward_cuda``/``op.backward_cuda`` on CuPy arrays (``Kind.CUDA``), or on
    NumPy arrays through the host-compiled kernels: the serial emulation
    (``Kind.EMULATED``) or the native multi-threaded CPU build (``Kind.NATIVE``, zero-copy
    NumPy views of the NDArrays).  Array I/O: :mod:`mx_roi.ndio`."""

    def __init__(self, kind: Kind):
        self.kind = Kind(kind)
        if self.kind is Kind.NUMPY:
            raise ValueError("CudaBackend runs the CUDA kernels: native, emulated-cuda or cuda")
        self.name = self.kind.value
        # native: one call into the extension library's launcher where it applies
        self._native = LibraryCalls() if self.kind is Kind.NATIVE else None
        if self.kind is Kind.CUDA:
            from .nvrtc import preload_for_cupy
            preload_for_cupy()  # the nvrtc wheel's library, if CuPy cannot find one
            import cupy  # noqa: F401  (fail early, with CuPy's own message)

    # ---- array I/O (mx_roi.ndio) ----------------------------------------------------
    def _xp(self):
        return ndio.xp_of(self.kind)

    def _read(self, nd):
        return ndio.read(self.kind, nd)

    def _write(self, nd, req, value):
        ndio.write(self.kind, nd, req, value)

    def _target(self, nd, req, grad=False, size=None):
        """The memory the kernels write ``nd``'s result into, else None:

        * ``native``: MXNet's memory (NumPy view), req write/inplace;
        * GPU: MXNet's memory (CuPy view through DLPack), req write/inplace, and for the
          input gradient (``grad``) also ``add``: the kernels then add into it;
        * ``emulated-cuda``: for the input gradient, a host copy standing in for MXNet's
          GPU memory, written back whole (so the emulation adds exactly as a GPU does).
        """
        if req not in ("write", "inplace", "add") or \
                (nd.size if size is None else size) == 0:  # size: nd's, when known
            return None
        if req == "add" and not (grad and self.kind is not Kind.NATIVE):
            return None
        if self.kind is Kind.EMULATED and not grad:
            return None
        target = ndio.writable(self.kind, nd)
        if self.kind is Kind.NATIVE and req != "add":
            # typically a fresh MXNet buffer the kernels touch first: fewer page faults
            scratch.advise_huge_pages(target)
        return target

    def _store_grad(self, nd, req, value, target):
        """Store the backward's ``value`` honouring ``req``, through ``target``."""
        if value is not target:
            if target is None:
                self._write(nd, req, value)
                return
            if req == "add":  # in the destination's dtype, as MXNet's kAddTo does
                target += value.astype(target.dtype, copy=False)
            else:
                target[...] = value
        if self.kind is Kind.EMULATED:  # the host copy back to the NDArray
            ndio.write_numpy(nd, "write", target)

    def _device(self, nd):
        if self.kind.on_host:
            return _NullContext()
        import cupy
        return cupy.cuda.Device(nd.context.device_id)

    def _sync(self, status=None):
        """Wait for the call's work on the stream (GPU); returns the host copy of the
        device geometry's ``status`` when given -- read as the wait itself: one copy
        on the stream, then one synchronisation."""
        if self.kind is not Kind.CUDA:
            return status
        import cupy
        stream = cupy.cuda.get_current_stream()
        if status is not None:
            host = cupy.asnumpy(status, stream=stream)  # a copy on the stream, its sync
        else:
            stream.synchronize()
            host = None
        _trim_pool(cupy)
        return host

    def _launch(self, op, dtype, nd):
        native = self.kind is Kind.NATIVE
        module = loader.get_module(op.cuda_source, self.kind,
                                   0 if self.kind.on_host else nd.context.device_id)
        # the native build is deterministic anyway (each thread owns whole gradient
        # planes), so it never needs the fixed-point accumulation
        deterministic = getattr(op.param, "deterministic", False) and not native
        return Launch(module, self._xp(), dtype, deterministic)

    # ---- the backend interface ----------------------------------------------------
    #: whether the GPU and emulated-cuda forwards build the geometry on the device
    #: (:mod:`mx_roi.cuda.device_geometry`); False: the rois go to the host (the path of
    #: calls the device path does not take), kept switchable for tests comparing the two
    device_geometry = True
    #: whether the native forward and backward run as one call into the extension
    #: library's launcher (:mod:`mx_roi.cuda.library_calls`) where they can; False: every
    #: call takes the checked path below (kept switchable for tests comparing the two)
    library_calls = True

    def forward(self, op, req, data_nd, rois_nd, out_nd, keep=False, extra=()):
        if self._native is not None and self.library_calls and \
                self._native.forward(op, req, data_nd, rois_nd, out_nd, extra):
            return None  # (the library's backward finds what it needs again)
        with self._device(data_nd):
            dev = None
            try:
                if not extra:  # (an op with extra inputs has no compiled geometry)
                    dev = self._device_path(op, req, data_nd, rois_nd)
                if dev is None:
                    return self._forward(op, req, data_nd, rois_nd, out_nd, keep, extra)
                result = self._forward_device(op, req, data_nd, out_nd, keep, dev)
            finally:  # after _forward's temporaries are dropped: the pool can free them
                status = self._sync(dev.status if dev is not None else None)
            dev.raise_if_bad(op, status, self._xp())
            if dev.overflowed(status):  # a box needing wider tables: the host-built ones
                try:
                    return self._forward(op, req, data_nd, rois_nd, out_nd, keep)
                finally:
                    self._sync()
            return result

    def _device_path(self, op, req, data_nd, rois_nd):
        """The device geometry's rois and spec, ``(spec, rois)``, when this forward builds
        its tables on the device; else None (host path: the native build, an op without
        a compiled geometry, req null or add, no rois, an empty map, a sample grid too
        wide for the shape-derived widths)."""
        if not self.device_geometry or self.kind is Kind.NATIVE or \
                req not in ("write", "inplace"):
            return None
        shape, rshape = tuple(data_nd.shape), tuple(rois_nd.shape)
        if len(shape) != 4 or len(rshape) != 2 or rshape[0] == 0 or 0 in shape:
            return None
        spec = self._spec(op)
        if not device_geometry.supported(spec, shape[2], shape[3]):
            return None
        return _DevicePending(spec, self._read(rois_nd))

    def _spec(self, op):
        spec = op.__dict__.get("_compiled_spec", _UNSET)
        if spec is _UNSET:
            spec = op.__dict__["_compiled_spec"] = op.geometry_spec()
        return spec

    def _forward_device(self, op, req, data_nd, out_nd, keep, pending):
        """The forward on device-built tables (no host read of the rois); ``pending``
        becomes the call's :class:`~mx_roi.cuda.device_geometry.DeviceGeometry` (its
        status read at the sync)."""
        data, rois = self._read(data_nd), pending.rois
        op.check_dtypes(data.dtype, rois.dtype)
        _check_plane(op, data.shape)
        launch = self._launch(op, data.dtype, data_nd)
        dev = device_geometry.build(launch, pending.spec, rois, data.shape[0], data.shape[2],
                                    data.shape[3])
        pending.dev = dev
        return self._run_forward(op, req, launch, dev.geo, data, rois, out_nd, keep)

    def _run_forward(self, op, req, launch, geo, data, rois, out_nd, keep):
        """The op's forward kernels on ``geo``, the output stored honouring ``req``;
        what the backward keeps (with the rois and tables), or None."""
        launch.out_target = self._target(out_nd, req, size=math.prod(op.out_shape(data.shape,
                                                                          rois.shape)))
        launch.keep = bool(keep)
        out, saved = op.forward_cuda(launch, geo, data)
        if out is not launch.out_target:
            self._write(out_nd, req, out)
        if keep:  # the backward reuses the geometry (when its rois are the same)
            return keep_for_backward(saved, rois, data.shape[2:], geo)
        return None

    def _host_rois(self, rois_nd) -> np.ndarray:
        """The rois as a NumPy array: the checks and the geometry run on the host for every
        kind -- on a GPU after one copy of the (R, 5) rois, instead of a few dozen small
        kernels and several device reads -- so a GPU call builds the very tables (bit for
        bit) the host builds run on."""
        if self.kind is Kind.CUDA:
            import cupy
            return cupy.asnumpy(ndio.read_cupy(rois_nd))
        return self._read(rois_nd)

    def _backward_rois(self, rois_nd, saved) -> np.ndarray:
        """The backward's rois on the host (:meth:`_host_rois`).  A device-path forward
        kept its rois on the device (``saved.rois``): both come back in the same one copy
        (and wait), and ``saved.rois`` becomes the host copy :func:`unpack_saved` compares."""
        if self.kind is not Kind.CUDA or not isinstance(saved, Saved):
            return self._host_rois(rois_nd)
        import cupy
        if not isinstance(saved.rois, cupy.ndarray):
            return self._host_rois(rois_nd)
        rois = ndio.read_cupy(rois_nd)
        if saved.rois.shape != rois.shape or saved.rois.dtype != rois.dtype:
            saved.rois = np.empty((0, 5), rois.dtype)  # not the same rois: nothing reused
            return cupy.asnumpy(rois)
        both = cupy.asnumpy(cupy.concatenate([saved.rois, rois]))
        saved.rois = both[:rois.shape[0]]
        return both[rois.shape[0]:]

    def _compiled(self, op):
        """``(spec, CompiledGeometry)`` when ``op`` has a compiled geometry
        (:meth:`~mx_roi.registry.RoIOp.geometry_spec`) and this is a host build, else
        ``(None, None)``.  The spec depends on the parameters only: kept on the op."""
        if not self.kind.on_host:
            return None, None
        spec = op.__dict__.get("_compiled_spec", _UNSET)
        if spec is _UNSET:
            spec = op.__dict__["_compiled_spec"] = op.geometry_spec()
        if spec is None:
            return None, None
        return spec, loader.get_module(op.cuda_source, self.kind).compiled_geometry()

    def _check(self, op, shape, dtype, rois):
        """``op.check_inputs``, in compiled code for an op with a compiled geometry on the
        host builds (the same first bad roi, the same message)."""
        compiled = self._compiled(op)[1]
        if compiled is None:  # (an op without a compiled geometry may not take it)
            op.check_inputs(shape, dtype, rois, np)
        else:
            op.check_inputs(shape, dtype, rois, np, compiled=compiled)

    def _extra(self, extra):
        """The extra inputs as host arrays (checks and geometry) and as kernel arrays."""
        host = [self._host_rois(nd) for nd in extra]
        return host, (host if self.kind.on_host else [self._read(nd) for nd in extra])

    def _geometry(self, op, rois, height, width, extra=()):
        """``op``'s geometry tables for host ``rois``, where the kernels read them (on a
        GPU: one packed copy, :func:`mx_roi.cuda.tables.to_device`); on the host builds
        from the compiled geometry when the op has one; ``extra``: the op's extra inputs
        as the kernels read them."""
        spec, cg = self._compiled(op)
        if spec is not None:
            return cg.build(spec, rois, height, width)
        geo = op.geometry(rois, height, width, np, *extra)
        if self.kind is Kind.CUDA:
            import cupy
            return to_device(geo, cupy)
        return geo

    def _forward(self, op, req, data_nd, rois_nd, out_nd, keep, extra=()):
        xp = self._xp()
        data, rois = self._read(data_nd), self._host_rois(rois_nd)
        self._check(op, data.shape, data.dtype, rois)
        host_extra, extra = self._extra(extra)
        op.check_extra_inputs(data.shape, data.dtype, rois, host_extra, np)
        _check_plane(op, data.shape)
        if req == "null" or rois.shape[0] == 0:
            return None
        if data.size == 0:  # an empty map (H or W = 0 under np_shape): zeros
            if req != "add":
                self._write(out_nd, req, xp.zeros(tuple(out_nd.shape), out_nd.dtype))
            return None
        geo = self._geometry(op, rois, data.shape[2], data.shape[3], extra)
        launch = self._launch(op, data.dtype, data_nd)
        return self._run_forward(op, req, launch, geo, data, rois, out_nd, keep)

    def backward(self, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved,
                 rois_req="null", rois_grad_nd=None, extra=(), extra_grad=()):
        """The data gradient (``req``); for an op that differentiates its rois, the rois'
        gradient (``rois_req``, into ``rois_grad_nd``); ``extra``: the op's extra inputs,
        ``extra_grad``: ``(req, gradient NDArray)`` of each (from a backward that returns
        a tuple, else zeros)."""
        if req == "null" and rois_req == "null" and all(r == "null" for r, _ in extra_grad):
            return
        if self._native is not None and self.library_calls and \
                self._native.backward(op, req, grad_nd, data_nd, rois_nd, in_grad_nd,
                                      rois_req, rois_grad_nd, extra, extra_grad):
            return
        with self._device(data_nd):
            dev = None
            try:
                if rois_req == "null" and not extra and req in ("write", "inplace", "add"):
                    dev = self._backward_device_path(op, req, rois_nd, in_grad_nd, saved)
                if dev is None:
                    self._backward(op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved,
                                   rois_req, rois_grad_nd, extra, extra_grad)
                    return
                self._backward_device(op, req, grad_nd, data_nd, in_grad_nd, dev)
            finally:  # after _backward's temporaries are dropped: the pool can free them
                status = self._sync(dev.status if dev is not None else None)
            dev.raise_if_bad(op, status, self._xp())
            if dev.overflowed(status):  # (req write/inplace): again on host-built tables
                try:
                    self._backward(op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved,
                                   "null", None)
                finally:
                    self._sync()

    def _backward_device_path(self, op, req, rois_nd, in_grad_nd, saved):
        """Like :meth:`_device_path`, for a backward that needs nothing of its forward but
        the rois (an average op, or a max op whose forward kept no argmax: the rescan
        kernels), not deterministic (its bound reads the tables on the host), and for req
        add only where no roi can need wider tables (a rerun would add twice)."""
        value = saved.value if isinstance(saved, Saved) else saved
        if value is not None or getattr(op.param, "deterministic", False):
            return None
        pending = self._device_path(op, "write", in_grad_nd, rois_nd)
        if pending is None or req not in ("write", "inplace", "add"):
            return None
        if req == "add":
            shape = tuple(in_grad_nd.shape)
            spec = pending.spec
            if device_geometry.may_overflow(spec) or (
                    spec.mode == "pool_bins" and
                    device_geometry.bin_cells(spec, shape[2], shape[3]) < shape[2] * shape[3]):
                return None
        return pending

    def _backward_device(self, op, req, grad_nd, data_nd, in_grad_nd, pending):
        """The backward on device-built tables (no host read of the rois; the status read
        at the sync, as the forward's)."""
        shape = tuple(in_grad_nd.shape)
        _check_plane(op, shape)
        rois = pending.rois
        op.check_dtypes(in_grad_nd.dtype, rois.dtype)
        grad = self._read(grad_nd)
        launch = self._launch(op, grad.dtype, in_grad_nd)
        dev = device_geometry.build(launch, pending.spec, rois, shape[0], shape[2], shape[3])
        pending.dev = dev
        launch.geo = dev.geo
        if op.backward_needs_data:  # no argmax: the winners are rescanned
            launch.data = self._read(data_nd)
        target = self._target(in_grad_nd, req, grad=True, size=math.prod(shape))
        launch.grad_target, launch.grad_req = target, req
        value = op.backward_cuda(launch, dev.geo, grad, shape, None)
        self._store_grad(in_grad_nd, req, value, target)

    def _backward(self, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved, rois_req,
                  rois_grad_nd, extra=(), extra_grad=()):
        xp = self._xp()
        shape = tuple(data_nd.shape)
        _check_plane(op, shape)
        rois = self._backward_rois(rois_nd, saved)
        # validated again here: the backward never indexes with rois it has not
        # checked (MXNet runs it even when the forward raised)
        self._check(op, shape, data_nd.dtype, rois)
        host_extra, extra = self._extra(extra)
        op.check_extra_inputs(shape, data_nd.dtype, rois, host_extra, np)
        if rois.shape[0] == 0 or math.prod(shape) == 0:
            self._store_extra(extra_grad, ())
            if req not in ("add", "null"):
                self._write(in_grad_nd, req, xp.zeros(shape, in_grad_nd.dtype))
            if rois_req not in ("add", "null"):
                self._write(rois_grad_nd, rois_req, xp.zeros(rois.shape, rois_grad_nd.dtype))
            return
        saved, geo = unpack_saved(saved, rois, shape[2:], np)
        if geo is None or extra:  # extra inputs are read again: their geometry too
            geo = self._geometry(op, rois, shape[2], shape[3], extra)
        grad = self._read(grad_nd)
        if rois_req != "null":
            launch = self._launch(op, grad.dtype, rois_grad_nd)
            launch.geo = geo
            value = op.rois_backward_cuda(launch, geo, grad, self._read(data_nd),
                                          self._read(rois_nd))
            self._write(rois_grad_nd, rois_req, value)
        if req == "null" and all(r == "null" for r, _ in extra_grad):
            return
        launch = self._launch(op, grad.dtype, in_grad_nd)
        launch.geo = geo
        if saved is None and op.backward_needs_data:  # no argmax: the winners are rescanned
            launch.data = self._read(data_nd)
        target = self._target(in_grad_nd, req, grad=True, size=math.prod(shape))
        launch.grad_target, launch.grad_req = target, req
        value = op.backward_cuda(launch, geo, grad, shape, saved)
        values = value if isinstance(value, tuple) else (value,)
        if req != "null":
            self._store_grad(in_grad_nd, req, values[0], target)
        self._store_extra(extra_grad, values[1:])

    def _store_extra(self, extra_grad, values):
        """Each extra input's gradient (``values``, missing or None = zeros) honouring
        its req."""
        for i, (r, nd) in enumerate(extra_grad):
            v = values[i] if i < len(values) else None
            if r == "null" or (v is None and r == "add"):
                continue
            self._write(nd, r, self._xp().zeros(tuple(nd.shape), nd.dtype) if v is None else v)


#: A training forward of a max op (ROIPooling, max / Caffe ROIAlign) keeps its argmax
#: for the backward only up to this many output elements.  A larger call keeps none: its
#: backward finds each bin's winner again with the forward's own scan of the data (the
#: ``*_rescan`` kernels; same winners, same sums), so the call's extra memory stays the
#: output and the gradients -- ROIPooling 14x14 / 512 rois: a 98 MB output and a 25 MB
#: uint8 argmax, peak 2.18x (output + data gradient) before, 1.95x without.  Below it the
#: argmax (1-4 bytes per element) is cheap and spares the backward the scan.
ARGMAX_KEEP_MAX_ELEMENTS = 4 << 20

#: CuPy memory-pool policy: after every GPU call (once the stream is synchronised and the
#: call's temporaries are dropped) the default pool gives its unused blocks back to the
#: driver -- where MXNet's allocator can get them -- whenever they exceed this many bytes.
#: Smaller caches (the geometry tables of typical calls) are kept to spare the allocation.
POOL_KEEP_BYTES = 32 << 20


def _trim_pool(cupy):
    pool = cupy.get_default_memory_pool()
    if pool.total_bytes() - pool.used_bytes() > POOL_KEEP_BYTES:
        pool.free_all_blocks()


def _check_plane(op, shape):
    """Tensors may exceed 2^31 elements (64-bit indexing), one (H, W) plane may not: the
    kernels index within a plane (and hold a running argmax, at most a plane's size) in
    int32."""
    if len(shape) == 4 and int(shape[2]) * int(shape[3]) >= 2 ** 31:
        raise ValueError(f"{op.name}: a feature map of {shape[2]}x{shape[3]} has 2^31 or more "
                         "elements per channel, more than the CUDA kernels index")


_UNSET = object()


class _DevicePending:
    """A forward taking the device path: its spec and device rois, then (``dev``) its
    :class:`~mx_roi.cuda.device_geometry.DeviceGeometry` once the kernel is queued."""

    __slots__ = ("spec", "rois", "dev")

    def __init__(self, spec, rois):
        self.spec, self.rois, self.dev = spec, rois, None

    @property
    def status(self):
        return self.dev.status if self.dev is not None else None

    def raise_if_bad(self, op, status, xp):
        if self.dev is not None:
            self.dev.raise_if_bad(op, status, xp)

    def overflowed(self, status):
        return self.dev is not None and self.dev.overflow_possible and \
            self.dev.overflowed(status)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
