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
from typing import Optional

import numpy as np

from .. import parallel, scratch
from ..ndio import array_info
from ..saved import Saved
from . import device_geometry
from .loader import check_args
from .pointers import address

__all__ = ["NativeCalls", "ProgramSaved", "MAX_PROGRAMS_PER_THREAD"]

#: programs kept per thread (least recently used dropped first): a detector's calls have
#: a few distinct shapes (levels, roi counts); each program holds its tables
MAX_PROGRAMS_PER_THREAD = 16

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
        """A launch that records instead of running: every array it allocates is owned
        by the recording (never the reused host scratch), and a const array argument that
        binding would convert (a copy, fixed in the program while its source changes)
        makes the call unrecordable."""

        def __init__(self, module, dtype):
            super().__init__(module, np, dtype, False)
            self.recorded = []

        def empty(self, shape, dtype=None):
            return np.empty(shape, dtype or self.dtype)

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


class _Program:
    """A recorded call: its steps (ctypes), the argument buffers and arrays they point at
    (kept alive here), the role cells, and what a replay allocates (the argmax)."""

    __slots__ = ("steps", "count", "roles", "keep", "argmax", "status", "run", "exprs")

    def __init__(self, module, recorded, role_arrays, zero, status):
        """``recorded``: (expr, n, args) per launch; ``role_arrays``: role -> the array the
        recording used; ``zero``: (role, nbytes) to zero before the launches after the
        geometry (the input gradient); ``status``: the device geometry's status array."""
        self.run = module.run_program
        self.status = status
        self.exprs = tuple(expr for expr, _, _ in recorded)  # the kernels, in order
        self.roles = _RolesArray()
        by_address = {}
        for role, a in role_arrays.items():
            if a is None:
                continue
            if a.size == 0:
                raise _Unsupported(f"empty {role}")
            addr = address(a)
            if addr in by_address:
                raise _Unsupported(f"{role} and {by_address[addr]} share memory")
            by_address[addr] = role
        role_base = ctypes.addressof(self.roles)
        keep, steps = [status], []
        status_addr = address(status)
        # the status word is zeroed by the program itself before the geometry kernel
        steps.append((None, None, status.nbytes, 1, _ROLE["status"], None))
        for i, (expr, n, args) in enumerate(recorded):
            fn, params = module.native_entry(expr)
            count = max(len(params), 1)
            buf = (ctypes.c_char * (16 * count))()
            base = ctypes.addressof(buf)
            for j, (p, a) in enumerate(zip(params, args)):
                cell = base + 8 * (count + j)
                if p.pointer:
                    addr = address(a)
                    role = by_address.get(addr)
                    if role is not None:
                        slot = role_base + 8 * _ROLE[role]
                    else:
                        keep.append(a)
                        struct.pack_into("@P", buf, 8 * (count + j), addr)
                        slot = cell
                else:
                    raw = np.asarray(a).tobytes()
                    ctypes.memmove(cell, raw, len(raw))
                    slot = cell
                struct.pack_into("@P", buf, 8 * j, slot)
            keep.append(buf)
            nthreads = module.native_threads(expr, n)
            geometry = expr.startswith(("roi_bins_geometry", "roi_grid_geometry"))
            steps.append((fn, base, 0, nthreads, 0, status_addr if geometry else None))
            if geometry and zero is not None:  # the gradient, once the rois are known good
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
    """The recorded programs of one backend, per thread (a program's tables and role
    cells are written by its call), keyed by everything the recording depended on."""

    def __init__(self, launch_cls):
        self._recorder = _recorder_class(launch_cls)
        # by the OS thread's id, not threading.local: MXNet's worker threads are not
        # Python threads, and each callback gets a fresh Python thread state (its
        # threading.local values are gone when the callback returns)
        self._by_thread = {}

    def _programs(self):
        ident = threading.get_ident()
        d = self._by_thread.get(ident)
        if d is None:
            d = self._by_thread[ident] = {}
        return d

    def _get(self, key, make):
        programs = self._programs()
        prog = programs.get(key)
        if prog is None:
            if key in programs:  # recorded as unsupported
                return None
            try:
                prog = make()
            except _Unsupported:
                prog = None
            if len(programs) >= MAX_PROGRAMS_PER_THREAD:
                programs.pop(next(iter(programs)))
            programs[key] = prog
        else:  # most recently used last
            programs[key] = programs.pop(key)
        return prog

    # ---- forward ----------------------------------------------------------------------
    def forward(self, backend, op, req, data_nd, rois_nd, out_nd, keep):
        """Run the forward as one compiled call; returns ``(True, saved)``, or ``(False,
        None)`` when the checked path must run it (nothing recorded applies, or the
        status reported a roi it must raise for or rerun)."""
        if req not in ("write", "inplace"):
            return False, None
        spec = backend._spec(op)
        if spec is None:
            return False, None
        d, r, o = array_info(data_nd), array_info(rois_nd), array_info(out_nd)
        if d is None or r is None or o is None:
            return False, None
        (dp, dshape, dtype), (rp, rshape, rdtype), (op_, oshape, odtype) = d, r, o
        if dtype is None or dtype != rdtype or dtype != odtype or \
                len(dshape) != 4 or len(rshape) != 2 or rshape[1] != 5 or rshape[0] == 0 \
                or 0 in dshape or not device_geometry.supported(spec, dshape[2], dshape[3]):
            return False, None
        threads = parallel.num_threads()
        key = ("fwd", op, dshape, rshape, oshape, dtype, bool(keep), threads)

        def make():
            data, rois = _host_view(dp, dshape, dtype), _host_view(rp, rshape, dtype)
            out = _host_view(op_, oshape, dtype)
            op.check_inputs(dshape, dtype, rois, np, compiled=backend._compiled(op)[1])
            if tuple(op.out_shape(dshape, rshape)) != tuple(oshape):
                raise _Unsupported("output shape")
            rec = self._recorder(backend._launch(op, dtype, data_nd).module, dtype)
            dev = device_geometry.build(rec, spec, rois, dshape[0], dshape[2], dshape[3])
            rec.out_target, rec.keep = out, bool(keep)
            result, saved = op.forward_cuda(rec, dev.geo, data)
            if result is not out:
                raise _Unsupported("the output is written through a temporary")
            roles = {"data": data, "rois": rois, "out": out, "status": dev.status}
            if saved is not None:
                roles["argmax"] = saved
            prog = _Program(rec.module, rec.recorded, roles, None,
                            dev.status)
            if saved is not None:
                prog.argmax = (saved.shape, saved.dtype)
            return prog

        prog = self._get(key, make)
        if prog is None:
            return False, None
        argmax = np.empty(*prog.argmax) if prog.argmax is not None else None
        # a large fresh output: huge pages before its first touch (as the checked path)
        scratch.advise_huge_pages_at(op_, math.prod(oshape) * dtype.itemsize)
        if not prog((dp, rp, op_, address(argmax) if argmax is not None else 0,
                     address(prog.status), 0, 0, 0)):
            return False, None
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
        spec = backend._spec(op)
        if spec is None:  # (deterministic=True: the native build is deterministic anyway)
            return False
        g, r, b = array_info(grad_nd), array_info(rois_nd), array_info(in_grad_nd)
        if g is None or r is None or b is None:
            return False
        (gp, gshape, dtype), (rp, rshape, rdtype), (bp, bshape, bdtype) = g, r, b
        if dtype is None or dtype != rdtype or dtype != bdtype or \
                len(bshape) != 4 or len(rshape) != 2 or rshape[1] != 5 or rshape[0] == 0 \
                or 0 in bshape or not device_geometry.supported(spec, bshape[2], bshape[3]):
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
        threads = parallel.num_threads()
        key = ("bwd", op, gshape, rshape, bshape, dtype, None if arg is None else
               (arg.shape, arg.dtype), needs_data, threads)

        def make():
            rois, grad = _host_view(rp, rshape, dtype), _host_view(gp, gshape, dtype)
            bottom = _host_view(bp, bshape, dtype)
            op.check_inputs(bshape, dtype, rois, np, compiled=backend._compiled(op)[1])
            if tuple(op.out_shape(bshape, rshape)) != tuple(gshape):
                raise _Unsupported("out-grad shape")
            rec = self._recorder(backend._launch(op, dtype, in_grad_nd).module, dtype)
            dev = device_geometry.build(rec, spec, rois, bshape[0], bshape[2], bshape[3])
            rec.geo = dev.geo
            data = None
            if needs_data:
                data = _host_view(dp, bshape, dtype)
                rec.data = data
            rec.grad_target, rec.grad_req = bottom, req
            value = op.backward_cuda(rec, dev.geo, grad, bshape, arg)
            if value is not bottom:
                raise _Unsupported("the gradient is returned through a temporary")
            roles = {"rois": rois, "grad": grad, "bottom": bottom, "status": dev.status,
                     "data": data, "saved": arg}
            return _Program(rec.module, rec.recorded, roles,
                            ("bottom", bottom.nbytes), dev.status)

        prog = self._get(key, make)
        if prog is None:
            return False
        scratch.advise_huge_pages_at(bp, math.prod(bshape) * dtype.itemsize)
        return prog((dp, rp, 0, 0, address(prog.status), gp, bp,
                     address(arg) if arg is not None else 0))


def _same_bytes(a: np.ndarray, addr: int) -> bool:
    """Whether C-contiguous ``a`` holds the same bytes as the memory at ``addr``."""
    return ctypes.string_at(address(a), a.nbytes) == ctypes.string_at(addr, a.nbytes)
