"""NVRTC through ctypes: compile the kernels to PTX without a GPU or a driver.

Used by ``tests/test_cuda_compile.py`` and ``python -m mx_roi.selftest`` to prove that every
kernel and every instantiated template (float, double, __half; plain and fixed-point
backward) compiles for the supported architectures with exactly the code, name
expressions and options that :class:`mx_roi.cuda.loader.KernelModule` hands to
``cupy.RawModule``.  ``libnvrtc`` comes from the ``nvidia-cuda-nvrtc-cu11`` wheel (or
``$MX_ROI_NVRTC``); ``cuda_fp16.h`` from a directory whose headers are of the same CUDA
major version as that NVRTC (:func:`mx_roi.cuda.source.cuda_include_dirs`: CuPy's bundled
copy, the ``nvidia-cuda-runtime-cu11`` wheel, ``$CUDA_PATH``), as CuPy itself does.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from . import source as S

__all__ = ["NvrtcError", "find_library", "load", "version", "supported_archs", "compile_ptx",
           "compile_source", "include_options", "CompileResult", "CUPY_NVRTC_SONAMES",
           "cupy_cuda_major", "wheel_library", "preload_for_cupy"]


class NvrtcError(RuntimeError):
    pass


def find_library() -> Optional[str]:
    env = os.environ.get("MX_ROI_NVRTC")
    if env:
        return env
    try:
        import nvidia
        roots = list(getattr(nvidia, "__path__", []))
    except ImportError:
        roots = []
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h]
        if hits:
            return hits[0]
    return None


#: The NVRTC library each CuPy wheel opens by name (CuPy 13 on Linux; it does not look
#: inside the ``nvidia-cuda-nvrtc-cu*`` wheels; CuPy 14 finds its own through
#: ``cuda-pathfinder``, wheels included).
CUPY_NVRTC_SONAMES = {11: "libnvrtc.so.11.2", 12: "libnvrtc.so.12", 13: "libnvrtc.so.13"}


def cupy_cuda_major() -> Optional[int]:
    """CUDA major version of the installed CuPy wheel (``cupy-cuda11x`` -> 11), read from
    the package metadata without importing CuPy; None if no such wheel is installed."""
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover (Python < 3.8)
        return None
    for major in sorted(CUPY_NVRTC_SONAMES):
        try:
            metadata.version(f"cupy-cuda{major}x")
            return major
        except metadata.PackageNotFoundError:
            continue
    return None


def wheel_library(soname: str) -> Optional[str]:
    """Path of ``soname`` inside the ``nvidia-cuda-nvrtc-cu*`` wheel, if installed."""
    try:
        import nvidia
        roots = list(getattr(nvidia, "__path__", []))
    except ImportError:
        roots = []
    for root in roots:  # CUDA 11/12 wheels: nvidia/cuda_nvrtc/lib; CUDA 13: nvidia/cu13/lib
        for path in [os.path.join(root, "cuda_nvrtc", "lib", soname)] + \
                sorted(glob.glob(os.path.join(root, "cu[0-9]*", "lib", soname))):
            if os.path.exists(path):
                return path
    return None


def preload_for_cupy(major: Optional[int] = None) -> Optional[str]:
    """Make the NVRTC that CuPy opens by name loadable (Linux).

    CuPy 13 opens ``libnvrtc.so.11.2`` (cupy-cuda11x) by name: found only in a CUDA
    toolkit on the loader path or on ``LD_LIBRARY_PATH``.  If that fails and the
    ``nvidia-cuda-nvrtc-cu11`` wheel is installed, its copy is loaded here with
    ``RTLD_GLOBAL``; the dynamic loader then hands CuPy's later ``dlopen`` of the same
    name this already loaded library.

    Returns
    -------
    ``""`` if the library was loadable already (or not Linux, or no CuPy wheel), the
    wheel's path if it was preloaded, None if neither worked (CuPy will fail to compile).
    """
    if not sys.platform.startswith("linux"):
        return ""
    major = cupy_cuda_major() if major is None else major
    if major not in CUPY_NVRTC_SONAMES:
        return ""
    soname = CUPY_NVRTC_SONAMES[major]
    try:
        ctypes.CDLL(soname)  # what CuPy will do: a toolkit or LD_LIBRARY_PATH copy wins
        return ""
    except OSError:
        pass
    path = wheel_library(soname)
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    return path


_LIB = None


def load():
    global _LIB
    if _LIB is None:
        path = find_library()
        if not path:
            raise NvrtcError("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu11 "
                             "(or set MX_ROI_NVRTC to the library)")
        lib = ctypes.CDLL(path)
        P = ctypes.c_void_p
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, P, P]
        lib.nvrtcAddNameExpression.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcGetPTXSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetPTX.argtypes = [P, ctypes.c_char_p]
        if hasattr(lib, "nvrtcGetCUBIN"):  # NVRTC >= 11.1
            lib.nvrtcGetCUBINSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
            lib.nvrtcGetCUBIN.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcGetLoweredName.argtypes = [P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
        _LIB = lib
    return _LIB


def _check(lib, status, what):
    if status != 0:
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def version():
    lib = load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> List[int]:
    lib = load()
    n = ctypes.c_int()
    if not hasattr(lib, "nvrtcGetNumSupportedArchs"):  # pragma: no cover (NVRTC < 11.2)
        return []
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    arr = (ctypes.c_int * n.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
    return list(arr)


@dataclass
class CompileResult:
    ptx: str
    lowered: Dict[str, str]   # name expression -> mangled kernel name
    log: str


def compile_ptx(code: str, name: str, name_expressions: Sequence[str],
                options: Sequence[str]) -> CompileResult:
    """Compile ``code`` to PTX; raise :class:`NvrtcError` with the log on failure."""
    lib = load()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0,
                                       None, None), "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()),
                   f"nvrtcAddNameExpression({expr})")
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if status != 0:
            raise NvrtcError(f"compiling {name} with {' '.join(options)} failed "
                             f"({lib.nvrtcGetErrorString(status).decode()}):\n{log}")
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)),
                   f"nvrtcGetLoweredName({expr})")
            lowered[expr] = out.value.decode()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return CompileResult(ptx.value.decode(errors="replace"), lowered, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def include_options() -> tuple:
    """``-I`` of the first ``cuda_fp16.h`` matching this NVRTC's major version."""
    major = version()[0]
    dirs = S.cuda_include_dirs(major)
    if not dirs:
        raise NvrtcError(f"no cuda_fp16.h for NVRTC {major}.x: pip install "
                         f"nvidia-cuda-runtime-cu{major} (or cupy-cuda{major}x, or set "
                         "CUDA_PATH to a CUDA toolkit of that version)")
    return (f"-I{dirs[0]}",)


def compile_source(filename: str, arch: int) -> CompileResult:
    """Compile ``operators/<filename>`` for ``compute_<arch>`` exactly as the RawModule
    does (same code, name expressions and options), plus ``--gpu-architecture`` and the
    ``cuda_fp16.h`` of this NVRTC's version (CuPy adds its own the same way)."""
    code, exprs, options = S.module_source(filename)
    return compile_ptx(code, filename, exprs, tuple(options) + include_options()
                       + (f"--gpu-architecture=compute_{arch}",))
