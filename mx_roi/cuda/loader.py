"""Module-loader seam: the same kernel source as CuPy ``RawModule`` or a host library.

:func:`get_module` returns a :class:`KernelModule` whose ``get(expr)`` gives a callable
``kernel(grid, block, args)`` -- the CuPy ``RawKernel`` calling convention -- for a name
expression such as ``roi_align_forward_avg<float, float>``:

* ``emulated=False``: ``cupy.RawModule(code=..., options=..., name_expressions=[...])``
  (NVRTC), compiled once per (source, device) and memoised;
* ``emulated=True``: the same text compiled with ``g++`` through
  ``mx_roi/cuda/host_shim.h`` into a shared library with one generated
  ``extern "C" void mx_roi_launch_<k>(unsigned grid, unsigned block, void** args)``
  per name expression (``args[i]`` points at parameter ``i``'s value, as in
  ``cuLaunchKernel``), loaded with ctypes.  The library is cached by a hash of the
  generated source, the shim, the compiler and its flags under ``$MX_ROI_CACHE`` (default
  ``~/.cache/mx_roi``) and built on first use (a few seconds per source).  ``$CXX`` picks
  the compiler, ``$MX_ROI_HOST_CXXFLAGS`` adds flags (e.g. ``-DMX_ROI_SOFT_HALF``).
  The launch runs the grid serially (a faithful emulation of the GPU's grid-stride loops);
* ``native=True``: the same text compiled the same way with ``-O3 -DMX_ROI_HOST_NATIVE``:
  the launch ignores the grid and splits the output channels over
  :func:`mx_roi.parallel.num_threads` threads (see ``host_shim.h``); the CPU backend
  ``native`` of :mod:`mx_roi.backends`.

Both seams check every launch's arguments against the kernel's parameter list parsed
from the source (:func:`check_args`) before launching: one array per pointer parameter
(of exactly the parameter's dtype, C-contiguous, of the seam's array type) and one NumPy
scalar of exactly the parameter's dtype per value parameter.  A Python ``int``/``float``,
a wrong-width scalar or a wrong-dtype array raises :class:`KernelArgumentError`, in the
emulation too, so the emulated run proves the marshalling of the real launch.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Dict, Tuple

import numpy as np

from . import source as S

__all__ = ["KernelArgumentError", "KernelModule", "get_module", "check_args", "cache_dir",
           "host_compiler", "launch_config", "BLOCK", "MAX_GRID"]

BLOCK = 256
MAX_GRID = 65535
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_shim.h")
HOST_FLAGS = ("-O2", "-std=c++14", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
              "-w")
#: a native launch uses no more threads than items // this: starting a thread (~0.1 ms
#: here) costs more than it saves on fewer items
NATIVE_MIN_ITEMS_PER_THREAD = 1 << 14
# -ffp-contract=off: no fused multiply-adds, the operation order of MXNet's CPU kernels
NATIVE_FLAGS = ("-O3", "-std=c++14", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
                "-fno-fast-math", "-DMX_ROI_HOST_NATIVE", "-w")


class KernelArgumentError(TypeError):
    """A launch's arguments do not match the kernel's parameter types."""


def launch_config(n: int, block: int = BLOCK) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """1-D (grid, block) for ``n`` work items; the kernels' grid-stride loops cover the rest."""
    grid = max(1, min((int(n) + block - 1) // block, MAX_GRID))
    return (grid, 1, 1), (block, 1, 1)


def check_args(sig: S.Signature, args, array_type, where: str = "") -> None:
    """Raise :class:`KernelArgumentError` unless ``args`` match ``sig`` exactly."""
    name = where or S.expression(sig.kernel, sig.template)
    if not isinstance(args, (tuple, list)):
        raise KernelArgumentError(f"{name}: args must be a tuple, got {type(args).__name__}")
    if len(args) != len(sig.params):
        raise KernelArgumentError(
            f"{name}: {len(args)} arguments for {len(sig.params)} parameters ("
            + ", ".join(p.describe() for p in sig.params) + ")")
    for k, (p, a) in enumerate(zip(sig.params, args)):
        if p.pointer:
            if not isinstance(a, array_type):
                raise KernelArgumentError(
                    f"{name}: argument {k} ({p.describe()}) must be a "
                    f"{array_type.__module__}.{array_type.__name__}, got {type(a).__name__}")
            if a.dtype != p.dtype:
                raise KernelArgumentError(
                    f"{name}: argument {k} ({p.describe()}) must have dtype {p.dtype}, got "
                    f"{a.dtype}")
            if not a.flags.c_contiguous:
                raise KernelArgumentError(
                    f"{name}: argument {k} ({p.describe()}) must be C-contiguous")
        else:
            if not isinstance(a, np.generic) or isinstance(a, np.ndarray):
                raise KernelArgumentError(
                    f"{name}: argument {k} ({p.describe()}) must be a NumPy scalar of dtype "
                    f"{p.dtype} (e.g. numpy.{p.dtype.name}(...)), got {type(a).__name__} "
                    f"{a!r}")
            if a.dtype != p.dtype:
                raise KernelArgumentError(
                    f"{name}: argument {k} ({p.describe()}) must have dtype {p.dtype}, got "
                    f"{a.dtype}")


class _Kernel:
    """``kernel(grid, block, args)`` with the argument check in front of the launch."""

    def __init__(self, filename, expr, launch, array_type):
        self.filename = filename
        self.expr = expr
        self.signature = S.instantiate(filename, expr)
        self._launch = launch
        self._array_type = array_type

    def __call__(self, grid, block, args):
        check_args(self.signature, args, self._array_type, self.expr)
        grid = _dim(grid, "grid")
        block = _dim(block, "block")
        self._launch(grid, block, tuple(args))

    def __repr__(self):
        return f"<kernel {self.expr} from {self.filename}>"


def _dim(v, what):
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if len(t) != 3 or min(t) < 1:
        raise ValueError(f"bad {what} {v!r}")
    return t


class KernelModule:
    """The compiled kernels of one source file (for one device, or the host)."""

    def __init__(self, filename: str, emulated: bool, device_id: int = 0, native: bool = False):
        self.filename = filename
        self.native = bool(native)
        self.emulated = bool(emulated) or self.native  # host-compiled
        self.device_id = device_id
        self.expressions = S.name_expressions(filename)
        self._kernels: Dict[str, _Kernel] = {}
        if self.emulated:
            self._lib, self._index = _build_host_library(filename, self.native)
            self.array_type = np.ndarray
        else:
            import cupy
            code, exprs, options = S.module_source(filename)
            with cupy.cuda.Device(device_id):
                self._module = cupy.RawModule(code=code, options=options,
                                              name_expressions=list(exprs))
            self.array_type = cupy.ndarray

    def get(self, expr: str) -> _Kernel:
        k = self._kernels.get(expr)
        if k is None:
            if expr not in self.expressions:
                raise KeyError(f"{self.filename}: {expr!r} is not instantiated; compiled: "
                               + ", ".join(self.expressions))
            if self.native:
                launch = self._native_launcher(expr)
            elif self.emulated:
                launch = self._host_launcher(expr)
            else:
                fn = self._module.get_function(expr)

                def launch(grid, block, args, fn=fn):
                    fn(grid, block, args)
            k = self._kernels[expr] = _Kernel(self.filename, expr, launch, self.array_type)
        return k

    def _native_launcher(self, expr):
        from .. import parallel
        fn = getattr(self._lib, f"mx_roi_launch_{self._index[expr]}")
        fn.restype = None
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
        n_index = [p.name for p in S.instantiate(self.filename, expr).params].index("n")

        def launch(grid, block, args):  # the grid is the GPU's; threads split channels
            slots, keep = _arg_slots(args)
            fn(native_threads(int(args[n_index]), parallel.num_threads()),
               ctypes.cast(slots, ctypes.c_void_p))
            del keep
        return launch

    def _host_launcher(self, expr):
        fn = getattr(self._lib, f"mx_roi_launch_{self._index[expr]}")
        fn.restype = None
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]

        def launch(grid, block, args):
            if grid[1:] != (1, 1) or block[1:] != (1, 1):
                raise ValueError("the host emulation runs 1-D launches only")
            slots, keep = _arg_slots(args)
            fn(grid[0], block[0], ctypes.cast(slots, ctypes.c_void_p))
            del keep
        return launch


def native_threads(items: int, available: int) -> int:
    """Threads of a native launch over ``items``: at most ``available``, and none that
    would get fewer than :data:`NATIVE_MIN_ITEMS_PER_THREAD` items."""
    return max(1, min(int(available), int(items) // max(1, NATIVE_MIN_ITEMS_PER_THREAD)))


def _arg_slots(args):
    """``void*`` per argument pointing at its value (``cuLaunchKernel`` style), and the
    ctypes/NumPy cells that must stay alive during the call."""
    keep = []
    slots = (ctypes.c_void_p * max(len(args), 1))()
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            cell = ctypes.c_void_p(a.ctypes.data)
            keep.append(cell)
            slots[i] = ctypes.addressof(cell)
        else:
            cell = np.array(a)  # the scalar's bytes, its exact dtype
            keep.append(cell)
            slots[i] = cell.ctypes.data
    return slots, keep


# --------------------------------------------------------------------------- host build
def cache_dir() -> str:
    """``$MX_ROI_CACHE``, else ``$XDG_CACHE_HOME/mx_roi`` or ``~/.cache/mx_roi``; if that
    cannot be created or written (read-only home), a per-user folder in the temp dir."""
    d = os.environ.get("MX_ROI_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "mx_roi")
    try:
        os.makedirs(d, exist_ok=True)
        if os.access(d, os.W_OK | os.X_OK):
            return d
    except OSError:
        pass
    uid = os.getuid() if hasattr(os, "getuid") else 0
    d = os.path.join(tempfile.gettempdir(), f"mx_roi-{uid}")
    os.makedirs(d, exist_ok=True)
    return d


def host_compiler() -> str:
    """The C++ compiler of the emulation: ``$CXX``, else ``g++``; '' if none."""
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx) or ""


def host_source(filename: str, native: bool = False) -> Tuple[str, Dict[str, int]]:
    """The C++ translation unit of the host build and ``{expr: wrapper index}``.

    Emulation wrappers take ``(grid, block, args)``; native ones ``(nthreads, args)`` and
    split the kernel's ``C`` (output channels) over the threads."""
    code = S.read_source(filename)
    lines = [code, "", "// ---- generated launch wrappers (mx_roi.cuda.loader) ----"]
    index = {}
    for k, expr in enumerate(S.name_expressions(filename)):
        sig = S.instantiate(filename, expr)
        call_args = ", ".join(f"*({p.decl}*)a[{i}]" for i, p in enumerate(sig.params))
        if native:
            names = [p.name for p in sig.params]
            if "C" not in names or "n" not in names:
                raise ValueError(f"{filename}: {expr} needs the parameters 'C' (output "
                                 "channels) and 'n' (items) for the native launch to split")
            lines.append(
                f'extern "C" void mx_roi_launch_{k}(int nthreads, void** a) {{\n'
                f"  mx_roi_launch_channels(*(int*)a[{names.index('C')}], nthreads, "
                f"[&]() {{ {expr}({call_args}); }});\n}}")
        else:
            lines.append(
                f'extern "C" void mx_roi_launch_{k}(unsigned grid, unsigned block, void** a) {{\n'
                f"  mx_roi_launch_serial(grid, block, [&]() {{ {expr}({call_args}); }});\n}}")
        index[expr] = k
    return "\n".join(lines) + "\n", index


_BUILD_LOCK = threading.Lock()


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except Exception:  # pragma: no cover
        return cxx


def _build_host_library(filename: str, native: bool = False):
    cxx = host_compiler()
    if not cxx:
        raise RuntimeError(f"the {'native' if native else 'emulated-cuda'} backend needs a C++ "
                           "compiler (g++ or $CXX) to build the kernels for the host; none was "
                           "found")
    code, index = host_source(filename, native)
    with open(SHIM, encoding="utf-8") as f:
        shim = f.read()
    flags = (NATIVE_FLAGS if native else HOST_FLAGS) + tuple(
        os.environ.get("MX_ROI_HOST_CXXFLAGS", "").split())
    key = S.source_hash(code, shim, _compiler_id(cxx), " ".join(flags), sys.platform)
    stem = os.path.splitext(filename)[0] + ("-native" if native else "")
    lib_path = os.path.join(cache_dir(), f"{stem}-{key}.so")
    with _BUILD_LOCK:
        if not os.path.exists(lib_path):
            tmpdir = tempfile.mkdtemp(prefix="build-", dir=cache_dir())
            try:
                src = os.path.join(tmpdir, f"{stem}.cpp")
                shim_copy = os.path.join(tmpdir, "host_shim.h")
                with open(src, "w", encoding="utf-8") as f:
                    f.write(code)
                with open(shim_copy, "w", encoding="utf-8") as f:
                    f.write(shim)
                out = os.path.join(tmpdir, f"{stem}.so")
                cmd = [cxx, *flags, "-include", shim_copy, "-x", "c++", src, "-o", out]
                res = subprocess.run(cmd, capture_output=True, text=True)
                if res.returncode != 0:
                    raise RuntimeError(f"building the host emulation of {filename} failed:\n"
                                       f"{' '.join(cmd)}\n{res.stderr[-4000:]}")
                os.replace(out, lib_path)  # atomic: concurrent builders are harmless
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)
    return ctypes.CDLL(lib_path), index


_MODULES: Dict[Tuple[str, bool, int, bool], KernelModule] = {}
_MODULES_LOCK = threading.RLock()


def get_module(filename: str, emulated: bool, device_id: int = 0,
               native: bool = False) -> KernelModule:
    """The memoised :class:`KernelModule` of ``filename`` (per device; one per host build)."""
    host = bool(emulated) or bool(native)
    key = (filename, host, -1 if host else int(device_id), bool(native))
    mod = _MODULES.get(key)
    if mod is None:
        with _MODULES_LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                mod = _MODULES[key] = KernelModule(filename, emulated, device_id, native)
    return mod
