"""Module-loader seam: the same kernel source as CuPy ``RawModule`` or a host library.

:func:`get_module` returns a :class:`KernelModule` whose ``get(expr)`` gives a callable
``kernel(grid, block, args)`` -- the CuPy ``RawKernel`` calling convention -- for a name
expression such as ``roi_align_forward_avg<float, float>``:

* ``Kind.CUDA``: compiled with NVRTC through CuPy (``RawModule``'s own compile
  function, :class:`CupyToolchain`) for the arch of the intended device, once per
  (source, device) and memoised; the binary and its name-expression -> mangled-name map
  are cached on disk by us (CuPy never reuses its own cache with name expressions), keyed
  by source, options, arch, NVRTC and CuPy versions, and loaded without recompiling;
* ``Kind.EMULATED``: the same text compiled with ``g++`` through
  ``mx_roi/cuda/host_shim.h`` into a shared library with one generated
  ``extern "C" void mx_roi_launch_<k>(unsigned grid, unsigned block, void** args)``
  per name expression (``args[i]`` points at parameter ``i``'s value, as in
  ``cuLaunchKernel``), loaded with ctypes.  The library is cached by a hash of the
  generated source, the shim, the compiler and its flags in :func:`cache_dir` (only a
  directory and file that are ours and not group/other-writable are trusted; a damaged
  entry is rebuilt once) and built on first use (a few seconds per source).  ``$CXX`` picks
  the compiler, ``$MX_ROI_HOST_CXXFLAGS`` adds flags (e.g. ``-DMX_ROI_SOFT_HALF``).
  The launch runs the grid serially (a faithful emulation of the GPU's grid-stride loops);
* ``Kind.NATIVE``: the same text compiled the same way with ``-O3 -DMX_ROI_HOST_NATIVE``
  (and ``-mavx2`` on a CPU with AVX2, :func:`native_isa_flags`):
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

import atexit
import ctypes
import hashlib
import json
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Dict, Tuple

import numpy as np

from . import source as S
from .pointers import address as _address
from ..ndio import Kind  # the backend kind (an enum; ndio imports nothing of ours)

__all__ = ["KernelArgumentError", "KernelModule", "get_module", "check_args", "cache_dir",
           "CacheWarning", "HostLibraryError", "path_problem", "host_library_path",
           "host_compiler", "launch_config", "BLOCK", "MAX_GRID"]

BLOCK = 256
MAX_GRID = 65535
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_shim.h")
HOST_FLAGS = ("-O2", "-std=c++14", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
              "-w")
#: a native launch uses no more threads than items // this: starting a thread (~0.1 ms
#: here) costs more than it saves on fewer items.  ``MX_ROI_MIN_ITEMS_PER_THREAD`` (read
#: per launch, here and by the extension library's launcher: ext_common.h) sets another
#: value -- the tests' way to run several threads on small problems
NATIVE_MIN_ITEMS_PER_THREAD = 1 << 16
MIN_ITEMS_ENV = "MX_ROI_MIN_ITEMS_PER_THREAD"
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
        # (pointer, dtype) per parameter: the per-launch check reads these (parsed once)
        self._plan = tuple((p.pointer, p.dtype) for p in self.signature.params)

    def __call__(self, grid, block, args):
        if not _args_match(self._plan, args, self._array_type):
            # the exact check, with its message (it raises on whatever did not match)
            check_args(self.signature, args, self._array_type, self.expr)
        grid = _dim(grid, "grid")
        block = _dim(block, "block")
        self._launch(grid, block, tuple(args))

    def __repr__(self):
        return f"<kernel {self.expr} from {self.filename}>"


def _args_match(plan, args, array_type) -> bool:
    """Whether ``args`` pass :func:`check_args` (same rules, no messages): the per-launch
    fast path; on False the caller runs :func:`check_args` for the error."""
    if type(args) is not tuple and type(args) is not list or len(args) != len(plan):
        return False
    for (pointer, dtype), a in zip(plan, args):
        if pointer:
            if not isinstance(a, array_type) or a.dtype != dtype or not a.flags.c_contiguous:
                return False
        elif not isinstance(a, np.generic) or a.dtype != dtype:
            return False
    return True


def _dim(v, what):
    if type(v) is tuple and len(v) == 3 and all(type(x) is int and x >= 1 for x in v):
        return v  # launch_config's form: nothing to convert
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if len(t) != 3 or min(t) < 1:
        raise ValueError(f"bad {what} {v!r}")
    return t


class KernelModule:
    """The compiled kernels of one source file (for one device, or the host)."""

    def __init__(self, filename: str, kind: Kind, device_id: int = 0):
        self.filename = filename
        self.kind = _build_kind(kind)
        self.device_id = device_id
        self.expressions = S.name_expressions(filename)
        self._kernels: Dict[str, _Kernel] = {}
        if self.kind.on_host:
            self._lib, self._index = _build_host_library(filename, self.kind)
            self.array_type = np.ndarray
        else:
            toolchain = _cupy_toolchain()
            self._module, self._mangled = _cupy_module(toolchain, filename, device_id)
            self.array_type = toolchain.ndarray

    def compiled_geometry(self):
        """The geometry and roi-check entry points of this host library
        (:class:`mx_roi.cuda.compiled_geometry.CompiledGeometry`, made once); host builds
        only."""
        cg = getattr(self, "_compiled_geometry", None)
        if cg is None:
            if not self.kind.on_host:
                raise ValueError("the compiled geometry's entry points are in the host builds")
            from .compiled_geometry import CompiledGeometry
            cg = self._compiled_geometry = CompiledGeometry(self._lib)
        return cg

    def get(self, expr: str) -> _Kernel:
        k = self._kernels.get(expr)
        if k is None:
            if expr not in self.expressions:
                raise KeyError(f"{self.filename}: {expr!r} is not instantiated; compiled: "
                               + ", ".join(self.expressions))
            if self.kind is Kind.NATIVE:
                launch = self._native_launcher(expr)
            elif self.kind is Kind.EMULATED:
                launch = self._host_launcher(expr)
            else:
                fn = self._module.get_function(self._mangled[expr])

                def launch(grid, block, args, fn=fn):
                    fn(grid, block, args)
            k = self._kernels[expr] = _Kernel(self.filename, expr, launch, self.array_type)
        return k

    def _native_launcher(self, expr):
        from .. import parallel
        fn = getattr(self._lib, f"mx_roi_launch_{self._index[expr]}")
        fn.restype = None
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
        params = S.instantiate(self.filename, expr).params
        n_index = [p.name for p in params].index("n")
        pack = _slot_packer(params)

        def launch(grid, block, args):  # the grid is the GPU's; threads split channels
            buf = pack(args)
            fn(native_threads(int(args[n_index]), parallel.num_threads()),
               ctypes.addressof(buf))
        return launch

    def _host_launcher(self, expr):
        fn = getattr(self._lib, f"mx_roi_launch_{self._index[expr]}")
        fn.restype = None
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
        pack = _slot_packer(S.instantiate(self.filename, expr).params)

        def launch(grid, block, args):
            if grid[1:] != (1, 1) or block[1:] != (1, 1):
                raise ValueError("the host emulation runs 1-D launches only")
            buf = pack(args)
            fn(grid[0], block[0], ctypes.addressof(buf))
        return launch


def min_items_per_thread() -> int:
    """The fewest items a thread of a native launch gets: ``$MX_ROI_MIN_ITEMS_PER_THREAD``
    (ASCII digits, at least 1), else :data:`NATIVE_MIN_ITEMS_PER_THREAD`.  ValueError
    naming the variable for any other value (the extension library's launcher, which
    cannot raise, takes the default then)."""
    value = os.environ.get(MIN_ITEMS_ENV, "")
    if not value:
        return NATIVE_MIN_ITEMS_PER_THREAD
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise ValueError(f"{MIN_ITEMS_ENV}={value!r}: expected a whole number >= 1 (the "
                         "fewest items per thread of a native launch; unset: "
                         f"{NATIVE_MIN_ITEMS_PER_THREAD})")
    return int(value)


def native_threads(items: int, available: int) -> int:
    """Threads of a native launch over ``items``: at most ``available``, and none that
    would get fewer than :func:`min_items_per_thread` items."""
    return max(1, min(int(available), int(items) // min_items_per_thread()))


#: struct codes of the scalar parameter types (each value gets an 8-byte cell)
_SCALAR_CODES = {np.dtype(np.int32): "i4x", np.dtype(np.uint32): "I4x",
                 np.dtype(np.int64): "q", np.dtype(np.uint64): "Q",
                 np.dtype(np.float32): "f4x", np.dtype(np.float64): "d"}


def _slot_packer(params):
    """``pack(args) -> buffer`` for a kernel with parameters ``params``: one ctypes buffer
    holding the ``void*`` array of the launch (``args[i]`` points at parameter ``i``'s
    value, as in ``cuLaunchKernel``) followed by one 8-byte cell per value (an array's
    data address, or a scalar's bytes in its exact type), written by one ``struct`` call.
    The buffer must stay alive during the call (the caller holds it).  Arguments are
    checked (:func:`check_args`) before they get here.  Parameter types without a code
    fall back to :func:`_arg_slots`."""
    codes = []
    for p in params:
        code = "P" if p.pointer else _SCALAR_CODES.get(p.dtype)
        if code is None:
            return _generic_packer
        codes.append(code)
    n = max(len(codes), 1)
    fmt = "@" + "P" * len(codes) + "".join(codes)
    size = struct.calcsize(fmt)
    assert size == 16 * len(codes), fmt  # 8-byte slots, then 8-byte cells
    kinds = tuple(p.pointer for p in params)
    offsets = tuple(8 * (n + i) for i in range(len(codes)))
    buf_type = ctypes.c_byte * max(size, 8)
    pack_into = struct.Struct(fmt).pack_into

    def pack(args):
        buf = buf_type()
        base = ctypes.addressof(buf)
        values = [_address(a) if pointer else a for pointer, a in zip(kinds, args)]
        pack_into(buf, 0, *[base + o for o in offsets], *values)
        return buf
    return pack


def _generic_packer(args):
    slots, keep = _arg_slots(args)
    slots._mx_roi_keep = keep  # alive as long as the slot array
    return slots


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


# --------------------------------------------------------------------------- trusted cache
# Every compiled artifact (host libraries, CuPy binaries) is loaded from a directory that
# only the current user can write, and only after the file itself passed the same check:
# otherwise another local user could plant code under the predictable file name and have
# it run in our process (the attack class of pip's /tmp/pip-build and PyTorch's
# /tmp/torch_extensions).  The rules are those of ssh's StrictModes.

class CacheWarning(RuntimeWarning):
    """A cache directory was not trusted, or a damaged cache entry was rebuilt."""


class HostLibraryError(RuntimeError):
    """A host library could not be built, or could not be loaded even after a rebuild."""


_CACHE_DIRS: Dict[str, str] = {}     # requested directory -> directory used (per process)
_CACHE_LOCK = threading.Lock()
_WARNED: set = set()


def _uid():
    return os.geteuid() if hasattr(os, "geteuid") else None


def path_problem(path: str, directory: bool, st=None) -> str:
    """Why ``path`` may not be trusted ('' if it may): it must be a real directory (or a
    regular file, ``directory=False``), not a symbolic link, owned by the current user and
    not writable by group or others."""
    try:
        st = st or os.lstat(path)
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _parents_problem(path: str) -> str:
    """Why a parent of the (resolved) ``path`` lets others replace it ('' if none does): each
    must be owned by root or us and not writable by group/others unless sticky (``/tmp``)."""
    uid = _uid()
    parent = os.path.dirname(path)
    while True:
        try:
            st = os.stat(parent)
        except OSError as exc:
            return f"its parent {parent} cannot be inspected ({exc.strerror})"
        if uid is not None and st.st_uid not in (0, uid):
            return f"its parent {parent} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"its parent {parent} is writable by group or others (mode "
                    f"{stat.S_IMODE(st.st_mode):04o})")
        up = os.path.dirname(parent)
        if up == parent:
            return ""
        parent = up


def _dir_problem(path: str) -> str:
    return path_problem(path, True) or _parents_problem(path)


def _warn_once(key, message):
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, CacheWarning, stacklevel=3)


def _requested_cache_dir() -> Tuple[str, str]:
    env = os.environ.get("MX_ROI_CACHE")
    if env:
        return env, "MX_ROI_CACHE"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mx_roi"), "the default cache"


def cache_dir() -> str:
    """The trusted directory compiled kernels are cached in (checked once per process).

    ``$MX_ROI_CACHE``, else ``$XDG_CACHE_HOME/mx_roi`` or ``~/.cache/mx_roi`` (created
    0700).  It is used only if it (and each parent) is ours and not writable by group or
    others; if not, a :class:`CacheWarning` names it and the fix, once, and the builds go
    to the private per-user folder ``<tmp>/mx_roi-<uid>`` (created 0700 and verified); if
    that one is not ours either, to a fresh ``mkdtemp`` folder removed at exit.  A folder
    that cannot be created (read-only home) falls back the same way, silently.
    """
    requested, what = _requested_cache_dir()
    with _CACHE_LOCK:
        d = _CACHE_DIRS.get(requested)
        if d is None or not os.path.isdir(d):
            d = _CACHE_DIRS[requested] = _resolve_cache_dir(requested, what)
        return d


def _resolve_cache_dir(requested: str, what: str) -> str:
    try:
        os.makedirs(requested, mode=0o700, exist_ok=True)
    except OSError:
        return _private_dir()  # cannot be created: a per-user temp folder instead
    real = os.path.realpath(requested)
    problem = _dir_problem(real)
    if not problem:
        return real
    fix = (f"chmod go-w {real}" if "writable" in problem and "parent" not in problem
           else "point MX_ROI_CACHE at a directory of your own that only you can write")
    private = _private_dir()
    _warn_once(("dir", real), f"mx_roi: not loading compiled kernels from {real} ({what}): "
                              f"it {problem}; nothing is loaded from it (fix: {fix}); "
                              f"building into the private directory {private} instead")
    return private


def _private_dir() -> str:
    """``<tmp>/mx_roi-<uid>``, created 0700 here or verified ours; else a fresh mkdtemp."""
    uid = _uid()
    d = os.path.join(tempfile.gettempdir(), f"mx_roi-{uid if uid is not None else 'user'}")
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError:
        d = ""
    problem = _dir_problem(d) if d else "cannot be created"
    if not problem:
        return d
    fresh = tempfile.mkdtemp(prefix=f"mx_roi-{uid}-")  # 0700, ours by construction
    atexit.register(shutil.rmtree, fresh, True)
    if d:
        _warn_once(("dir", d), f"mx_roi: not using {d}: it {problem} (someone else may have "
                               f"created it; remove it); building into {fresh} instead")
    problem = _dir_problem(fresh)
    if problem:  # pragma: no cover - a temp dir others can write
        raise HostLibraryError(f"mx_roi: no private cache directory: {fresh} {problem}")
    return fresh


def write_private(directory: str, name: str, data: bytes, mode: int = 0o644) -> str:
    """Write ``data`` as ``directory/name`` atomically (private temp file, then rename)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        path = os.path.join(directory, name)
        os.replace(tmp, path)
        return path
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def host_compiler() -> str:
    """The C++ compiler of the emulation: ``$CXX``, else ``g++``; '' if none."""
    cxx = os.environ.get("CXX") or "g++"
    return shutil.which(cxx) or ""


def _build_kind(kind) -> Kind:
    """``kind`` as a kernel build: ``Kind.CUDA``, ``Kind.EMULATED`` or ``Kind.NATIVE``
    (or its ``MX_ROI_BACKEND`` name); TypeError/ValueError naming it otherwise."""
    if isinstance(kind, bool) or not isinstance(kind, (Kind, str)):
        raise TypeError(f"kind: expected an mx_roi.ndio.Kind (CUDA, EMULATED or NATIVE), "
                        f"got {kind!r}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ValueError(f"kind: expected an mx_roi.ndio.Kind (CUDA, EMULATED or NATIVE), "
                         f"got {kind!r}") from None
    if kind is Kind.NUMPY:
        raise ValueError("kind: Kind.NUMPY has no compiled kernels (expected CUDA, EMULATED "
                         "or NATIVE)")
    return kind


def host_source(filename: str, kind: Kind = Kind.EMULATED) -> Tuple[str, Dict[str, int]]:
    """The C++ translation unit of the host build and ``{expr: wrapper index}``.

    Emulation wrappers take ``(grid, block, args)``; native ones ``(nthreads, args)`` and
    split the kernel's ``C`` (output channels) over the threads (a kernel without ``C``,
    over rois, runs on one thread)."""
    native = _host_kind(kind) is Kind.NATIVE
    code = S.read_source(filename)
    lines = [code, "", "// ---- generated launch wrappers (mx_roi.cuda.loader) ----"]
    index = {}
    for k, expr in enumerate(S.name_expressions(filename)):
        sig = S.instantiate(filename, expr)
        call_args = ", ".join(f"*({p.decl}*)a[{i}]" for i, p in enumerate(sig.params))
        names = [p.name for p in sig.params]
        if native and "C" not in names and "n" in names:
            # a kernel over rois, not channels (the device geometry): one serial thread,
            # its grid-stride loop covering all n items
            lines.append(
                f'extern "C" void mx_roi_launch_{k}(int nthreads, void** a) {{\n'
                f"  mx_roi_launch_serial(1, 1, [&]() {{ {expr}({call_args}); }});\n}}")
        elif native:
            if "C" not in names or "n" not in names:
                raise ValueError(f"{filename}: {expr} needs the parameters 'C' (output "
                                 "channels) and 'n' (items) for the native launch to split")
            plane = (f"(long long)*(int*)a[{names.index('H')}] * *(int*)a[{names.index('W')}]"
                     if "H" in names and "W" in names else "0")
            lines.append(
                f'extern "C" void mx_roi_launch_{k}(int nthreads, void** a) {{\n'
                f"  mx_roi_launch_channels(*(int*)a[{names.index('C')}], nthreads, "
                f"[&]() {{ {expr}({call_args}); }}, {plane});\n}}")
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


def _host_kind(kind) -> Kind:
    kind = _build_kind(kind)
    if not kind.on_host:
        raise ValueError(f"kind: expected a host build (Kind.EMULATED or Kind.NATIVE), got "
                         f"{kind}")
    return kind


def host_library_path(filename: str, kind: Kind = Kind.EMULATED
                      ) -> Tuple[str, str, Dict[str, int]]:
    """``(path, code, {expr: wrapper index})`` of the host library of ``filename``: its
    file in :func:`cache_dir`, named by a hash of the source, shim, compiler and flags
    (the name and hash are those of the former ``native=`` flag: caches stay valid)."""
    native = _host_kind(kind) is Kind.NATIVE
    cxx = host_compiler()
    if not cxx:
        raise HostLibraryError(
            f"the {'native' if native else 'emulated-cuda'} backend needs a C++ compiler "
            "(g++ or $CXX) to build the kernels for the host; none was found")
    code, index = host_source(filename, kind)
    with open(SHIM, encoding="utf-8") as f:
        shim = f.read()
    key = S.source_hash(code, shim, _compiler_id(cxx), " ".join(_host_flags(native)),
                        sys.platform)
    # the library says which build it is: a file of another build under this name
    # (copied, or planted in our own directory) is rejected like a damaged one
    code += f'extern "C" const char mx_roi_build_key[] = "{key}";\n'
    stem = os.path.splitext(filename)[0] + ("-native" if native else "")
    return os.path.join(cache_dir(), f"{stem}-{key}.so"), code, index


def _host_flags(native):
    return (NATIVE_FLAGS + native_isa_flags() if native else HOST_FLAGS) + tuple(
        os.environ.get("MX_ROI_HOST_CXXFLAGS", "").split())


#: instruction-set flags of the native build on a CPU with AVX2
AVX2_FLAGS = ("-mavx2",)


def native_isa_flags(cpuinfo: str = "/proc/cpuinfo") -> Tuple[str, ...]:
    """The native build's instruction-set flags: :data:`AVX2_FLAGS` on an x86-64 CPU
    whose ``cpuinfo`` flags list ``avx2`` (Linux lists it only where the kernel saves the
    256-bit registers), else none (x86-64's SSE2 baseline).  With AVX the kernels' float
    lanes are 8-wide vectors instead of 4-wide: the same operations per lane, the same
    bits, fewer instructions (no FMA: ``-ffp-contract=off`` keeps every product
    rounded).  The flags are part of the library's cache key: a library built for AVX2
    is loaded only by a process that found AVX2 itself.  ``MX_ROI_HOST_CXXFLAGS`` comes
    after them (``-mno-avx`` builds the 4-wide lanes)."""
    if cpuinfo == "/proc/cpuinfo" and _ISA_CACHE:
        return _ISA_CACHE[0]
    flags: Tuple[str, ...] = ()
    if platform.machine().lower() in ("x86_64", "amd64"):
        try:
            with open(cpuinfo, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = AVX2_FLAGS if "avx2" in line.split(":", 1)[-1].split() else ()
                        break
        except OSError:
            flags = ()
    if cpuinfo == "/proc/cpuinfo":
        _ISA_CACHE.append(flags)
    return flags


_ISA_CACHE: list = []


def float_vector_width(lib) -> int:
    """The float lanes' vector width (floats) a loaded native library was built with
    (``mx_roi_float_vector_width``); 0 for a library without lanes (the emulation)."""
    try:
        return int(ctypes.c_int.in_dll(lib, "mx_roi_float_vector_width").value)
    except ValueError:
        return 0


_FAILED: Dict[str, str] = {}  # library path -> why it could not be built/loaded


def _build_host_library(filename: str, kind: Kind):
    """Load the cached host library of ``filename``, building it if missing.

    An entry that fails to load (truncated, wrong architecture, lacking a launch symbol,
    of another build, or not trusted) is removed and rebuilt, once; if that fails too, a
    :class:`HostLibraryError` says why, and later calls in this process repeat it without
    rebuilding."""
    lib_path, code, index = host_library_path(filename, kind)
    native = kind is Kind.NATIVE
    with _BUILD_LOCK:
        if lib_path in _FAILED:
            raise HostLibraryError(_FAILED[lib_path])
        lib, why = _try_load(lib_path, len(index))
        if lib is None:
            if why:  # a damaged entry: heal it
                _warn_once(("heal", lib_path), f"mx_roi: rebuilding the damaged cache entry "
                                               f"{lib_path} ({why})")
                _remove(lib_path)
            try:
                _compile_host(filename, code, _host_flags(native), lib_path)
            except HostLibraryError as exc:
                _FAILED[lib_path] = str(exc)
                raise
            lib, why = _try_load(lib_path, len(index))
            if lib is None:
                _FAILED[lib_path] = (f"the host build of {filename} cannot be loaded even "
                                     f"after a rebuild: {why}")
                raise HostLibraryError(_FAILED[lib_path])
    return lib, index


def _try_load(lib_path: str, n_launch: int):
    """``(library, '')``, ``(None, '')`` if there is no file, ``(None, why)`` if the file
    must not or cannot be used."""
    try:
        st = os.lstat(lib_path)
    except FileNotFoundError:
        return None, ""
    problem = path_problem(lib_path, False, st)
    if problem:
        return None, f"it {problem}"
    problem = elf_problem(lib_path)
    if problem:
        return None, problem
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as exc:
        return None, str(exc)
    key = os.path.basename(lib_path).rsplit("-", 1)[-1][:-3].encode()
    try:
        got = (ctypes.c_char * (len(key) + 1)).in_dll(lib, "mx_roi_build_key").value
        missing = [k for k in range(n_launch) if not hasattr(lib, f"mx_roi_launch_{k}")]
    except ValueError:
        got, missing = b"", []
    if got != key or missing:
        _dlclose(lib)
        return None, ("it lacks " + ", ".join(f"mx_roi_launch_{k}" for k in missing[:3])
                      if missing and got == key else "it is not the build of this name")
    return lib, ""


_ELF_HEADER = {1: ("16sHHIIIIIHHHHHH", "IIIIIIII", (1, 4)),     # 32-bit: offset, filesz
               2: ("16sHHIQQQIHHHHHH", "IIQQQQQQ", (2, 5))}     # 64-bit


def _elf_machine(path):
    with open(path, "rb") as f:
        head = f.read(20)
    return head[:7], head[18:20]


def elf_problem(path: str) -> str:
    """Why the shared library ``path`` must not be handed to ``dlopen`` ('' if none): not an
    ELF file of this process's class and machine, or shorter than its own headers say.  A
    truncated library would otherwise be mapped past its end, and the loader itself dies
    of SIGBUS touching it.  ('' off Linux, where libraries are not ELF.)"""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        with open(path, "rb") as f:
            data = f.read(64)
            size = os.fstat(f.fileno()).st_size
            if data[:4] != b"\x7fELF" or data[4] not in _ELF_HEADER or data[5] not in (1, 2):
                return "it is not an ELF shared library"
            hdr, phdr, (i_off, i_size) = _ELF_HEADER[data[4]]
            end = "<" if data[5] == 1 else ">"
            hsize = struct.calcsize(end + hdr)
            if size < hsize:
                return f"it is truncated ({size} bytes)"
            if (data[:7], data[18:20]) != _elf_machine(sys.executable):
                return "it is an ELF file for another architecture"
            h = struct.unpack(end + hdr, data[:hsize])
            phoff, shoff = h[5], h[6]
            phentsize, phnum, shentsize, shnum = h[9], h[10], h[11], h[12]
            need = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            if phentsize < struct.calcsize(end + phdr) or need > size:
                return f"it is truncated ({size} bytes, its headers need {need})"
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for k in range(phnum):
                ph = struct.unpack_from(end + phdr, table, k * phentsize)
                if ph[0] == 1 and ph[i_off] + ph[i_size] > size:  # PT_LOAD past the end
                    return (f"it is truncated ({size} bytes, a segment ends at "
                            f"{ph[i_off] + ph[i_size]})")
    except (OSError, struct.error) as exc:
        return f"it cannot be read ({exc})"
    return ""


def _dlclose(lib):
    """Unload a rejected library, so that its rebuilt successor under the same path is
    really loaded (the dynamic loader hands out a loaded library again by name)."""
    try:
        import _ctypes
        _ctypes.dlclose(lib._handle)
    except Exception:  # pragma: no cover - no dlclose on this platform
        pass


def _compile_host(filename, code, flags, lib_path):
    """Compile into a private build directory next to ``lib_path``, then rename it there
    atomically (concurrent builders are harmless: each renames a complete file)."""
    cxx = host_compiler()
    stem = os.path.basename(lib_path)[:-3]
    directory = os.path.dirname(lib_path)
    with open(SHIM, encoding="utf-8") as f:
        shim = f.read()
    tmpdir = tempfile.mkdtemp(prefix="build-", dir=directory)  # 0700
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
            raise HostLibraryError(f"building the host kernels of {filename} failed:\n"
                                   f"{' '.join(cmd)}\n{res.stderr[-4000:]}")
        os.chmod(out, 0o755)  # whatever the umask: never group/other-writable
        os.replace(out, lib_path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# --------------------------------------------------------------------------- CuPy build
class CupyToolchain:
    """The few CuPy calls of the GPU path (tests stand in for it without a GPU).

    :meth:`compile` goes through ``cupy._core.core.compile_with_cache``, the function
    ``RawModule`` itself compiles with (same options, headers and ``-ftz=true``), for the
    arch of the intended device (not the device current at a lazy first
    ``get_function``).  CuPy writes the binary into its cache folder even when it will
    never read it back (it does not, with name expressions); we give it a private scratch
    folder and keep that binary in our own cache."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.ndarray = cupy.ndarray
        self.version = cupy.__version__

    def arch(self, device_id: int) -> str:
        """The ``sm_`` arch NVRTC compiles for on ``device_id`` (capped by NVRTC)."""
        from cupy.cuda import compiler
        with self.cupy.cuda.Device(device_id):
            return str(compiler._get_arch())

    def nvrtc_version(self) -> str:
        from cupy.cuda import nvrtc
        return ".".join(str(v) for v in nvrtc.getVersion())

    def compile(self, code, options, exprs, arch, device_id, scratch):
        """``(loaded module, binary or None, {expression: mangled name})``."""
        from cupy._core import core
        if int(self.version.split(".")[0]) >= 14:
            return self._compile_cupy14(code, options, exprs, arch, device_id)
        with self.cupy.cuda.Device(device_id):
            mod = core.compile_with_cache(code, tuple(options), arch, scratch, False,
                                          name_expressions=list(exprs))
        binary = None
        files = [f for f in os.listdir(scratch) if f.endswith(".cubin")]
        if len(files) == 1:  # CUPY_CACHE_IN_MEMORY=1 writes none: no disk cache then
            with open(os.path.join(scratch, files[0]), "rb") as f:
                data = f.read()
            # CuPy's format: 40 hex digits of the binary's SHA-1, then the binary
            if hashlib.sha1(data[40:]).hexdigest().encode() == data[:40]:
                binary = data[40:]
        return mod, binary, dict(mod.mapping)

    def _compile_cupy14(self, code, options, exprs, arch, device_id):
        """CuPy 14: ``compile_with_cache`` takes no cache folder (one process-wide cache
        backend stores binaries).  It is called as ``RawModule`` calls it, while a backend
        stands in that reports every entry missing (so this source is compiled afresh),
        keeps this source's binary and hands any other compile's to CuPy's own."""
        from cupy._core import core
        from cupy.cuda import compiler
        own, captured = compiler._kernel_cache_backend, []

        class Capture:
            def load(self, name):
                return None

            def save(self, name, payload, source):
                if code in source:  # (CuPy may put a preamble before it)
                    captured.append(payload)
                else:
                    own.save(name, payload, source)

        compiler._set_kernel_cache_backend(Capture())
        try:
            with self.cupy.cuda.Device(device_id):
                mod = core.compile_with_cache(code, tuple(options), arch=arch,
                                              prepend_cupy_headers=False,
                                              name_expressions=list(exprs))
        finally:
            compiler._set_kernel_cache_backend(own)
        binary = None
        decode = getattr(compiler, "_decode_cache_payload", None)
        if captured and decode is not None:
            # CuPy 14's payload: a magic, the mangled names, then the binary
            decoded = decode(captured[-1], len(exprs))
            binary = decoded[1] if decoded is not None else None
        return mod, binary, dict(mod.mapping)

    def load(self, binary: bytes, device_id: int):
        from cupy.cuda import function
        with self.cupy.cuda.Device(device_id):
            mod = function.Module()
            mod.load(binary)
        return mod


def _cupy_toolchain():
    return CupyToolchain()


def cupy_options(filename: str) -> Tuple[str, ...]:
    """NVRTC options of the GPU build: :func:`mx_roi.cuda.source.module_source`'s, with a
    C++ dialect if none is given (CuPy 12 refuses templates without one; CuPy 13's
    ``RawModule`` adds ``--std=c++11`` itself).  CuPy appends ``-ftz=true`` to every
    compile (NVRTC rejects a second ``-ftz``), so float32 subnormals flush to zero on
    the GPU, unlike NumPy and the host builds; see docs/gpu.md."""
    options = tuple(S.module_source(filename)[2])
    if not any(o.startswith(("-std", "--std")) for o in options):
        options += ("--std=c++11",)
    return options


def cupy_binary_path(toolchain, filename: str, device_id: int) -> Tuple[str, str]:
    """``(cache file, arch)`` of ``filename``'s GPU binary for ``device_id``: keyed by the
    source, the options, the arch, the NVRTC version and the CuPy version."""
    code, _, _ = S.module_source(filename)
    arch = toolchain.arch(device_id)
    key = S.source_hash(code, " ".join(cupy_options(filename)), arch,
                        toolchain.nvrtc_version(), toolchain.version)
    stem = os.path.splitext(filename)[0]
    return os.path.join(cache_dir(), f"{stem}-sm{arch}-{key}.cubin"), arch


def _read_binary(path: str, exprs):
    """``(binary, mapping, '')``; ``(None, None, '')`` if absent, ``(None, None, why)`` if
    the entry must not or cannot be used."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None, ""
    problem = path_problem(path, False, st)
    if problem:
        return None, None, f"it {problem}"
    try:
        with open(path, "rb") as f:
            head, _, binary = f.read().partition(b"\n")
        meta = json.loads(head)
        if hashlib.sha256(binary).hexdigest() != meta["sha256"]:
            return None, None, "its checksum does not match"
        mapping = {e: meta["mapping"][e] for e in exprs}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, None, f"it is not a valid entry ({type(exc).__name__})"
    return binary, mapping, ""


_GPU_BUILD_LOCK = threading.Lock()


def _cupy_module(toolchain, filename: str, device_id: int):
    """The loaded GPU module of ``filename`` and its ``{expression: mangled name}``: from
    our cache if a valid, trusted entry exists, else compiled and stored (atomically)."""
    code, exprs, _ = S.module_source(filename)
    path, arch = cupy_binary_path(toolchain, filename, device_id)
    with _GPU_BUILD_LOCK:
        binary, mapping, why = _read_binary(path, exprs)
        if binary is not None:
            try:
                return toolchain.load(binary, device_id), mapping
            except Exception as exc:  # noqa: BLE001 - e.g. an image the driver rejects
                why = f"it cannot be loaded ({str(exc).splitlines()[0] if str(exc) else exc!r})"
        if why:
            _warn_once(("heal", path), f"mx_roi: recompiling the damaged cache entry {path} "
                                       f"({why})")
            _remove(path)
        scratch = tempfile.mkdtemp(prefix="nvrtc-", dir=os.path.dirname(path))
        try:
            module, binary, mapping = toolchain.compile(
                code, cupy_options(filename), exprs, arch, device_id, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        mapping = {e: mapping[e] for e in exprs}
        if binary is not None:
            meta = json.dumps({"sha256": hashlib.sha256(binary).hexdigest(),
                               "mapping": mapping}, sort_keys=True).encode()
            write_private(os.path.dirname(path), os.path.basename(path),
                          meta + b"\n" + binary)
        return module, mapping


_MODULES: Dict[Tuple[str, Kind, int], KernelModule] = {}
_MODULES_LOCK = threading.RLock()


def get_module(filename: str, kind: Kind, device_id: int = 0) -> KernelModule:
    """The memoised :class:`KernelModule` of ``filename`` built for ``kind``
    (``Kind.CUDA``: per device; ``Kind.EMULATED``/``Kind.NATIVE``: one per host build)."""
    if type(kind) is not Kind:  # (a Kind needs no conversion: the per-call path)
        kind = _build_kind(kind)
    elif kind is Kind.NUMPY:
        _build_kind(kind)  # raises
    key = (filename, kind, -1 if kind.on_host else int(device_id))
    mod = _MODULES.get(key)
    if mod is None:
        with _MODULES_LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                mod = _MODULES[key] = KernelModule(filename, kind, device_id)
    return mod
