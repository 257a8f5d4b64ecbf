"""One compiled call per op call on the ``native`` backend: a recorded program.

A small call's cost is not its kernels but the glue around them: reading every NDArray
through DLPack, checking the rois, building the tables, binding a dozen arguments per
launch, each a few microseconds of Python.  For an op with a compiled geometry
(:meth:`mx_roi.registry.RoIOp.geometry_spec`) the ``native`` backend therefore runs a
forward or backward as one call into the op's host library (``mx_roi_run_program`` in
``host_shim.h``), which

1. zeroes the status word and runs the geometry kernel of the device path
   (:mod:`mx_roi.cuda.device_geometry`: the roi check and the tables, in compiled code,
   into tables sized from the shapes), and stops there when a roi is bad or needs more
   than those tables hold;
2. zeroes the input gradient (a backward with req write/inplace);
3. runs the op's kernels, which write straight into MXNet's memory.

The program is *recorded* the first time a thread sees a call's shapes: the op's own
``forward_cuda`` / ``backward_cuda`` run with a :class:`_Recorder` launch that keeps every
launch (kernel, work items, bound arguments) instead of running it.  Each pointer argument
is then either one of the call's *roles* -- the data, the rois, the output, the out-grad,
the input gradient, the argmax (new per training forward), the status word -- whose
addresses change from call to call, or memory the recording owns (tables, constants),
fixed for the program's lifetime.  A replay writes the roles' addresses (read with MXNet's
C API, :func:`mx_roi.ndio.array_info`) into one small array and makes the one call.  Everything that
depends on values (which roi is bad, a box too large for the tables) is decided in the
compiled code; the Python side reads the status and, when it is set, takes the backend's
checked path, which raises today's message (or reruns on exact tables), so errors, bits
and the gradients are those of the checked path -- tests/test_native_program.py compares
them call by call.

What is not recorded (the checked path runs instead): req add / null, a float16
backward (it accumulates in a float32 buffer), extra inputs, an op without a compiled geometry, empty calls, tables wider than the shapes
allow (:func:`mx_roi.cuda.device_geometry.supported`), and any recording whose pointer
arguments are not all roles or memory it owns (checked, never assumed).
"""
from __future__ import annotations

import ctypes
import math
import struct
import threading

import numpy as np

from .. import parallel, scratch
from ..ndio import Kind, array_info
from ..onednn import GUARD_BOUND, bounded_dtype
from ..saved import Saved
from . import device_geometry, loader
from . import source as S
from .loader import check_args
from .pointers import address

__all__ = ["NativeCalls", "ProgramSaved", "MAX_PROGRAMS"]

#: shapes (keys) whose programs are kept (least recently used dropped first): a
#: detector's calls have a few distinct shapes (levels, roi counts, both directions);
#: each program holds its tables
MAX_PROGRAMS = 32

_ROLES = ("data", "rois", "out", "argmax", "status", "grad", "bottom", "saved")
_ROLE = {name: i for i, name in enumerate(_ROLES)}
_RolesArray = ctypes.c_void_p * len(_ROLES)
_pack_roles = struct.Struct("@" + "P" * len(_ROLES)).pack_into


class _Step(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p),
                ("zero_bytes", ctypes.c_longlong), ("nthreads", ctypes.c_int),
                ("zero_role", ctypes.c_int), ("status", ctypes.c_void_p)]


def _host_view(addr, shape, dtype):
    """A NumPy view of ``shape`` / ``dtype`` at ``addr`` (for the recording only)."""
    n = math.prod(shape) * dtype.itemsize
    return np.frombuffer((ctypes.c_char * n).from_address(addr), dtype).reshape(shape)


# ---- recording -------------------------------------------------------------------------
class ProgramSaved(Saved):
    """What a recorded forward keeps: its argmax indexes the bins of the program's tables
    (sized from the shapes), so only a recorded backward of the same shapes may read it;
    the checked path takes such a backward as one whose forward kept nothing (it finds
    the winners again in the data: the same winners, the same sums)."""

    __slots__ = ()


class _Unsupported(Exception):
    """The call cannot be recorded: the checked path runs it."""


def _recorder_class(launch_cls):
    """The recording subclass of the backend's launch class (handed in: this module sits
    below the backend)."""

    class _Recorder(launch_cls):
        """A launch that records instead of running.  Every array it allocates is owned by
        the recording (never the reused host scratch; :attr:`owned` holds their address
        ranges), and a const array argument that binding would convert (a copy, fixed in
        the program while its source changes) makes the call unrecordable."""

        def __init__(self, module, dtype):
            super().__init__(module, np, dtype, False)
            self.recorded = []
            self.owned = []

        def empty(self, shape, dtype=None):
            a = np.empty(shape, dtype or self.dtype)
            self.owned.append((address(a), a.nbytes))
            return a

        def owns(self, addr) -> bool:
            return any(lo <= addr < lo + n for lo, n in self.owned)

        def bind(self, sig, n, tables, args):
            ordered = super().bind(sig, n, tables, args)
            values = {**tables, **args}
            for p, v in zip(sig.params, ordered):
                if p.pointer and p.name in values and values[p.name] is not v:
                    raise _Unsupported(f"{p.name} converted for the kernel")
            return ordered

        def _launch(self, expr, n, args):
            if int(n) <= 0:
                return
            k = self.module.get(expr)
            check_args(k.signature, args, np.ndarray, expr)
            self.recorded.append((expr, int(n), tuple(args)))

        def grad_buffer(self, shape, grad):
            # MXNet's gradient memory, zeroed by the program (write)
            t = self.grad_target
            if t is None or tuple(t.shape) != tuple(shape) or t.dtype != self.acc:
                raise _Unsupported("the gradient is accumulated in a temporary")
            self.O, self.scale, self.fixed = self.A, np.float64(1.0), False
            return t

    return _Recorder


#: the kernels that check the rois into the status word (a program stops after them
#: when it is set); the device geometry's fill the tables too
_CHECKS = ("roi_bins_geometry", "roi_grid_geometry", "roi_check")


class _Recording:
    """One recording of a call: its launches, the arrays of its roles, and how each
    pointer argument is classified: ``("role", name)``, ``("owned",)`` (allocated by the
    recording: tables, status, a dummy argmax) or ``("fixed", array)`` (anything else: a
    constant of the op, e.g. a channel map -- checked against a second recording)."""

    def __init__(self, rec, roles):
        self.rec, self.roles = rec, roles
        by_address = {}
        for role, a in roles.items():
            if a is None:
                continue
            if a.size == 0:
                raise _Unsupported(f"empty {role}")
            addr = address(a)
            if addr in by_address:
                raise _Unsupported(f"{role} and {by_address[addr]} share memory")
            by_address[addr] = role
        self.by_address = by_address
        self.kinds = []
        for expr, n, args in rec.recorded:
            params = S.instantiate(rec.module.filename, expr).params
            kinds = []
            for p, a in zip(params, args):
                if not p.pointer:
                    kinds.append(("scalar", np.asarray(a).tobytes()))
                    continue
                addr = address(a)
                if addr in by_address:
                    kinds.append(("role", by_address[addr]))
                elif rec.owns(addr):
                    kinds.append(("owned", a.shape, a.dtype))
                else:
                    kinds.append(("fixed", a))
            self.kinds.append((expr, n, kinds))

    def same_program(self, other) -> bool:
        """Whether ``other`` (recorded from other inputs of the same shapes) made the same
        launches with the same scalars and the same roles, and its fixed arrays hold the
        same bytes: nothing fixed in the program depends on the inputs' values."""
        if len(self.kinds) != len(other.kinds):
            return False
        for (e1, n1, k1), (e2, n2, k2) in zip(self.kinds, other.kinds):
            if e1 != e2 or n1 != n2 or len(k1) != len(k2):
                return False
            for a, b in zip(k1, k2):
                if a[0] != b[0]:
                    return False
                if a[0] == "fixed":
                    x, y = a[1], b[1]
                    if x.shape != y.shape or x.dtype != y.dtype or \
                            x.tobytes() != y.tobytes():
                        return False
                elif a[1:] != b[1:]:
                    return False
        return True


def _perturbed(role_arrays):
    """Other inputs of the same shapes (for the second recording): the rois' coordinates
    moved (the batch column kept), every other array other memory (uninitialised: a
    recording reads no data, and a large copy would cost more than the call)."""
    out = {}
    for role, a in role_arrays.items():
        if a is None:
            out[role] = None
        elif role == "rois":
            b = a.copy()
            with np.errstate(over="ignore", invalid="ignore"):  # (huge boxes: inf is fine)
                b[:, 1:] = b[:, 1:] * 1.5 + 3
            out[role] = b
        else:
            out[role] = np.empty_like(a)
    return out


class _Program:
    """A recorded call: its steps (ctypes), the argument buffers and arrays they point at
    (kept alive here), the role cells, and what a replay allocates (the argmax)."""

    __slots__ = ("steps", "count", "roles", "keep", "argmax", "status", "status_at", "run",
                 "exprs")

    def __init__(self, module, recording, zero, status):
        """``recording``: a :class:`_Recording`; ``zero``: (role, nbytes) to zero once the
        rois are checked (the input gradient); ``status``: the status word's array."""
        self.run = module.run_program
        self.status, self.status_at = status, address(status)
        recorded = recording.rec.recorded
        self.exprs = tuple(expr for expr, _, _ in recorded)  # the kernels, in order
        self.roles = _RolesArray()
        role_base = ctypes.addressof(self.roles)
        keep, steps = [status, recording.rec], []
        # the status word is zeroed by the program itself before the check
        steps.append((None, None, status.nbytes, 1, _ROLE["status"], None))
        for (expr, n, args), (_, _, kinds) in zip(recorded, recording.kinds):
            fn, params = module.native_entry(expr)
            count = max(len(params), 1)
            buf = (ctypes.c_char * (16 * count))()
            base = ctypes.addressof(buf)
            for j, (a, kind) in enumerate(zip(args, kinds)):
                cell = base + 8 * (count + j)
                if kind[0] == "role":
                    slot = role_base + 8 * _ROLE[kind[1]]
                elif kind[0] == "scalar":
                    ctypes.memmove(cell, kind[1], len(kind[1]))
                    slot = cell
                else:  # owned or fixed: kept alive, its address in the cell
                    keep.append(a)
                    struct.pack_into("@P", buf, 8 * (count + j), address(a))
                    slot = cell
                struct.pack_into("@P", buf, 8 * j, slot)
            keep.append(buf)
            nthreads = loader.native_threads(n, parallel.num_threads())
            check = expr.startswith(_CHECKS)
            steps.append((fn, base, 0, nthreads, 0, self.status_at if check else None))
            if check and zero is not None:  # the gradient, once the rois are known good
                steps.append((None, None, zero[1], 1, _ROLE[zero[0]], None))
        self.count = len(steps)
        self.steps = (_Step * self.count)(*[
            _Step(fn, args, zb, nt, zr, st) for fn, args, zb, nt, zr, st in steps])
        self.keep = keep
        self.argmax = None

    def __call__(self, values) -> bool:
        """Run with the roles' addresses ``values`` (in :data:`_ROLES` order); True when
        the status is clean (else the checked path must run the call)."""
        _pack_roles(self.roles, 0, *values)
        return self.run(self.count, self.steps, self.roles) == 0


class NativeCalls:
    """The recorded programs of one backend, keyed by everything a recording depended on.

    A program's tables and role cells are written by its call, so a program serves one
    call at a time: each key holds the idle programs, a call takes one (or records one
    when all are busy: MXNet runs custom ops on several worker threads) and gives it
    back.  At most :data:`MAX_PROGRAMS` keys are kept (least recently used dropped
    first), with no more programs each than calls ran at once."""

    def __init__(self, launch_cls):
        self._recorder = _recorder_class(launch_cls)
        self._lock = threading.Lock()
        self._idle = {}  # key -> [idle programs], or None: not recordable

    def programs(self, key=None):
        """The idle programs of ``key`` (a list; None: not recordable), or all keys."""
        with self._lock:
            return dict(self._idle) if key is None else self._idle.get(key, [])

    def _take(self, key, make):
        """An idle program of ``key`` (recorded now when there is none), or None."""
        with self._lock:
            idle = self._idle.get(key, ())
            if idle is None:  # recorded as not recordable
                return None
            if idle:
                self._idle[key] = self._idle.pop(key)  # most recently used last
                return idle.pop()
        try:
            return make()
        except _Unsupported:
            with self._lock:
                self._idle[key] = None
                self._trim()
            return None

    def _give_back(self, key, prog):
        with self._lock:
            idle = self._idle.pop(key, [])
            if idle is not None:
                idle.append(prog)
                self._idle[key] = idle
                self._trim()

    def _trim(self):
        while len(self._idle) > MAX_PROGRAMS:
            self._idle.pop(next(iter(self._idle)))

    def _run(self, key, make, values):
        """Take a program of ``key``, run it with the role values ``values(prog)``, give
        it back; None when not recordable, else whether its status was clean."""
        prog = self._take(key, make)
        if prog is None:
            return None, None
        try:
            return prog(values(prog)), prog
        finally:
            self._give_back(key, prog)

    @staticmethod
    def _how(backend, op):
        """How a recorded call of ``op`` checks its rois: ``(spec, None)`` -- the device
        geometry's kernel (tables too) --, ``(None, "check")`` -- the ``roi_check`` kernel
        (kernels that read the rois themselves) --, or None: not recordable."""
        spec = backend._spec(op)
        if spec is not None:
            return spec, None
        if op.kernels_read_rois():
            return None, "check"
        return None

    def _record(self, backend, op, how, dtype, module_nd, shape, inputs, run):
        """Record twice -- with the call's arrays (``run(rec, geo, arrays)`` given
        ``arrays`` by role) and with other values of the same shapes -- and return the
        first recording and its status array, after checking that the two agree (else
        :class:`_Unsupported`)."""
        spec, _ = how
        module = backend._launch(op, dtype, module_nd).module
        recordings = []
        for arrays in (inputs, _perturbed(inputs)):
            rec = self._recorder(module, dtype)
            r = arrays["rois"]
            if spec is not None:
                dev = device_geometry.build(rec, spec, r, shape[0], shape[2], shape[3],
                                            empty=rec.empty)
                geo, status = dev.geo, dev.status
            else:
                status = rec.empty((2,), np.uint64)
                status.fill(0)
                rec.forward("roi_check", r.shape[0], rois=r, columns=r.shape[1],
                            N=shape[0], bound=float(GUARD_BOUND),
                            use_bound=int(bounded_dtype(r.dtype)), status=status)
                geo = op.geometry(r, shape[2], shape[3], np)
            rec.geo = geo
            arrays = run(rec, geo, arrays)
            recordings.append((_Recording(rec, dict(arrays, status=status)), status))
        (first, status), (second, _) = recordings
        if not first.same_program(second):
            raise _Unsupported("the recording depends on the inputs' values")
        return first, status

    # ---- forward ----------------------------------------------------------------------
    def forward(self, backend, op, req, data_nd, rois_nd, out_nd, keep):
        """Run the forward as one compiled call; returns ``(True, saved)``, or ``(False,
        None)`` when the checked path must run it (nothing recorded applies, or the
        status reported a roi it must raise for or rerun)."""
        if req not in ("write", "inplace"):
            return False, None
        how = self._how(backend, op)
        if how is None:
            return False, None
        d, r, o = array_info(data_nd), array_info(rois_nd), array_info(out_nd)
        if d is None or r is None or o is None:
            return False, None
        (dp, dshape, dtype), (rp, rshape, rdtype), (op_, oshape, odtype) = d, r, o
        if not _shapes_ok(op, how, dshape, rshape, dtype, rdtype) or dtype != odtype:
            return False, None
        key = ("fwd", _op_key(op), dshape, rshape, oshape, dtype, bool(keep),
               parallel.num_threads())

        def make():
            rois, out = _checked_views(backend, op, dshape, rp, rshape, op_, oshape, dtype)
            data = _host_view(dp, dshape, dtype)

            def run(rec, geo, arrays):
                rec.out_target, rec.keep = arrays["out"], bool(keep)
                result, saved = op.forward_cuda(rec, geo, arrays["data"])
                if result is not arrays["out"]:
                    raise _Unsupported("the output is written through a temporary")
                return dict(arrays, argmax=saved)

            recording, status = self._record(backend, op, how, dtype, data_nd, dshape,
                                             {"data": data, "rois": rois, "out": out}, run)
            prog = _Program(recording.rec.module, recording, None, status)
            saved = recording.roles.get("argmax")
            if saved is not None:
                prog.argmax = (saved.shape, saved.dtype)
            return prog

        # a large fresh output: huge pages before its first touch (as the checked path)
        scratch.advise_huge_pages_at(op_, math.prod(oshape) * dtype.itemsize)
        kept = []

        def values(prog):
            argmax = np.empty(*prog.argmax) if prog.argmax is not None else None
            kept.append(argmax)
            return (dp, rp, op_, address(argmax) if argmax is not None else 0,
                    prog.status_at, 0, 0, 0)

        ok, _ = self._run(key, make, values)
        if not ok:
            return False, None
        argmax = kept[0]
        if not keep:
            return True, None
        rois_copy = np.empty(rshape, dtype)
        ctypes.memmove(address(rois_copy), rp, rois_copy.nbytes)
        return True, ProgramSaved(argmax, rois_copy, tuple(dshape[2:]), None)

    # ---- backward ---------------------------------------------------------------------
    def backward(self, backend, op, req, grad_nd, data_nd, rois_nd, in_grad_nd, saved):
        """Run the data gradient's backward as one compiled call; True when done, False
        when the checked path must run it."""
        if req not in ("write", "inplace"):
            return False
        how = self._how(backend, op)  # (deterministic=True: the native build is anyway)
        if how is None:
            return False
        g, r, b = array_info(grad_nd), array_info(rois_nd), array_info(in_grad_nd)
        if g is None or r is None or b is None:
            return False
        (gp, gshape, dtype), (rp, rshape, rdtype), (bp, bshape, bdtype) = g, r, b
        if not _shapes_ok(op, how, bshape, rshape, dtype, rdtype) or dtype != bdtype:
            return False
        # the forward's argmax, only for the very rois and map it was found on
        arg = None
        if isinstance(saved, ProgramSaved) and saved.value is not None:
            if saved.hw != tuple(bshape[2:]) or saved.rois.shape != rshape or \
                    saved.rois.dtype != dtype or not _same_bytes(saved.rois, rp):
                return False
            arg = saved.value
        elif saved is not None and not isinstance(saved, ProgramSaved):
            return False  # the checked forward's (host tables): the checked backward
        needs_data = arg is None and op.backward_needs_data
        dp = 0
        if needs_data:
            d = array_info(data_nd)
            if d is None or d[1] != bshape or d[2] != dtype:
                return False
            dp = d[0]
        key = ("bwd", _op_key(op), gshape, rshape, bshape, dtype, None if arg is None else
               (arg.shape, arg.dtype), needs_data, parallel.num_threads())

        def make():
            rois, grad = _checked_views(backend, op, bshape, rp, rshape, gp, gshape, dtype)
            bottom = _host_view(bp, bshape, dtype)
            arrays = {"rois": rois, "grad": grad, "bottom": bottom, "saved": arg,
                      "data": _host_view(dp, bshape, dtype) if needs_data else None}

            def run(rec, geo, arrays):
                rec.data = arrays["data"]
                rec.grad_target, rec.grad_req = arrays["bottom"], req
                value = op.backward_cuda(rec, geo, arrays["grad"], bshape, arrays["saved"])
                if value is not arrays["bottom"]:
                    raise _Unsupported("the gradient is returned through a temporary")
                return arrays

            recording, status = self._record(backend, op, how, dtype, in_grad_nd, bshape,
                                             arrays, run)
            return _Program(recording.rec.module, recording, ("bottom", bottom.nbytes),
                            status)

        scratch.advise_huge_pages_at(bp, math.prod(bshape) * dtype.itemsize)
        ok, _ = self._run(key, make, lambda prog: (dp, rp, 0, 0, prog.status_at, gp,
                                                   bp, address(arg) if arg is not None
                                                   else 0))
        return bool(ok)


def _op_key(op):
    """What of ``op`` a program depends on: its class, its parameters, and its host
    library (the module object: a library loaded anew -- e.g. a cache reset -- is asked
    for again, with its errors)."""
    return type(op), op.param, id(loader.get_module(op.cuda_source, Kind.NATIVE))


def _checked_views(backend, op, shape, rp, rshape, yp, yshape, dtype):
    """NumPy views of the rois and of the op's output (or out-grad) ``yshape`` at ``yp``,
    after the checked path's checks of the recording call (its error, if any, is the
    call's) and of the output's shape."""
    rois = _host_view(rp, rshape, dtype)
    op.check_inputs(shape, dtype, rois, np, compiled=backend._compiled(op)[1])
    if tuple(op.out_shape(shape, rshape)) != tuple(yshape):
        raise _Unsupported("the output's shape")
    return rois, _host_view(yp, yshape, dtype)


def _shapes_ok(op, how, shape, rshape, dtype, rdtype) -> bool:
    """Whether a call of these shapes and dtypes can be recorded: 4-D map and (R, K) rois
    of the op's layout, R >= 1, nothing empty, one supported dtype, and (device geometry)
    tables the shapes can size."""
    spec = how[0]
    return dtype is not None and dtype == rdtype and len(shape) == 4 and \
        len(rshape) == 2 and rshape[1] == op.rois_columns and rshape[0] > 0 and \
        0 not in shape and (spec is None or device_geometry.supported(spec, shape[2],
                                                                      shape[3]))


def _same_bytes(a: np.ndarray, addr: int) -> bool:
    """Whether C-contiguous ``a`` holds the same bytes as the memory at ``addr``."""
    return ctypes.string_at(address(a), a.nbytes) == ctypes.string_at(addr, a.nbytes)
