"""The native GPU path's launcher library (opt-in; docs/gpu.md, "The native GPU path").

``ext_cuda.h`` + ``ext_cuda_ops.cc`` (the shared part) and every op's native GPU section
(its .cu file's ``MX_ROI_EXT_CUDA_LAUNCHER`` block, gathered into ``ext_cuda_sections.h``;
the kernels it launches are the op's ``native_gpu_kernels``) compiled with g++ into
``mx_roi_ext_cuda-<key>.so``: C entry points that launch an op's kernels through the CUDA
driver API (``libcuda.so.1``, opened at the first call) on the caller's stream, from raw
device pointers -- callable through ctypes (a CuPy array's ``data.ptr``, a CuPy stream's
``ptr``; this module's wrappers) and from the extension library's ``"gpu"`` callbacks
(``OpResource::get_cuda_stream()``).  An op gets the path from its own two files (and a
wrapper here for ctypes callers).  No nvcc, no
CUDA runtime and no CuPy in the call path: the kernels are the PTX that NVRTC makes of the
op's ``.cu`` text when the library is built (the ``RawModule``'s options, for the lowest
architecture that NVRTC supports, so that the driver can compile it for any newer GPU).

Building needs g++ and NVRTC (:mod:`mx_roi.cuda.nvrtc`: the ``nvidia-cuda-nvrtc-cu*``
wheel or ``$MX_ROI_NVRTC``), not a GPU or a driver.  The library is cached under the
rules of the host kernel libraries (:func:`mx_roi.cuda.loader.cache_dir`,
``loader._try_load``), named by a hash of every source, the NVRTC version, the
architecture, the options, the compiler and the flags.

Today: ROIAlign's, ROIPooling's, PSROIPooling's, PSROIAlign's, RROIAlign's and PrRoIPool's
forward and backward (:func:`roi_align_forward`, :func:`roi_align_backward`,
:func:`roi_pooling_forward`, ..., :func:`prroi_pool_backward`), also those extension ops'
``"gpu"`` forward and backward, which call them once :func:`enable` has run.  Not yet: a
deterministic backward, DeformablePSROIPooling.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import tempfile
import threading
from typing import Dict, Tuple

import numpy as np

from ..cuda import loader
from ..cuda import source as S
from . import ExtLibraryError, _read, _run, load_or_build

__all__ = ["library_path", "enable", "kernel_expressions", "ptx_arch", "roi_align_workspace",
           "roi_align_forward", "roi_align_backward_workspace", "roi_align_backward",
           "roi_pooling_workspace", "roi_pooling_forward", "roi_pooling_backward",
           "psroi_pooling_workspace", "psroi_pooling_forward", "psroi_pooling_backward",
           "psroi_align_workspace", "psroi_align_forward", "psroi_align_backward",
           "rroi_align_workspace", "rroi_align_forward", "rroi_align_backward",
           "prroi_pool_workspace", "prroi_pool_forward", "prroi_pool_backward",
           "deformable_psroi_pooling_workspace", "deformable_psroi_pooling_forward",
           "deformable_psroi_pooling_backward",
           "check", "DTYPE_CODES",
           "CudaLaunchError"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES = ("ext_cuda.h", "ext_cuda_ops.cc", "ext_cuda_cast.cu", "py_repr.h")
#: an op's .cu file holds its native GPU entries in this section (the launcher build takes
#: the text from ``#ifdef`` to the matching ``#endif  // ...`` line)
SECTION_MACRO = "MX_ROI_EXT_CUDA_LAUNCHER"
#: the launcher's own NVRTC source (mx_roi/ext): its kernels' name expressions
OWN_KERNELS = {"ext_cuda_cast.cu": ("store_float_as<__half>",)}
#: MXNet's dtype codes (lib_api.h MXDType), the entries' ``dtype`` argument
DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2}
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-pthread")
_PTX_DELIMITER = "mx_roi_ptx"


class CudaLaunchError(RuntimeError):
    """An error reported by a native GPU entry point (its message: "<Op>: <problem>")."""


def gpu_ops() -> Dict[str, tuple]:
    """``{op source: its native_gpu_kernels}`` of the registered ops whose .cu file has a
    native GPU section (:data:`SECTION_MACRO`)."""
    from ..registry import REGISTERED
    out = {}
    for cls in REGISTERED.values():
        if cls.native_gpu_kernels:
            if f"#ifdef {SECTION_MACRO}" not in S.read_source(cls.cuda_source):
                raise ExtLibraryError(f"{cls.name} declares native_gpu_kernels but "
                                      f"{cls.cuda_source} has no {SECTION_MACRO} section")
            out[cls.cuda_source] = tuple(cls.native_gpu_kernels)
    return out


def kernel_expressions(filename: str) -> Tuple[str, ...]:
    """The name expressions the library's image of ``filename`` holds (every dtype; an
    extra template argument "A" is the pair's A)."""
    return tuple(S.expression(k, (t, a) + tuple(a if x == "A" else x for x in extra))
                 for k, extra in gpu_ops()[filename] for t, a in S.TYPE_PAIRS)


def image_name(filename: str) -> str:
    """The C++ name of ``filename``'s image in ext_cuda_kernels.h (``roi_align.cu``:
    ``ROI_ALIGN_IMAGE``)."""
    return re.sub(r"\W", "_", os.path.splitext(filename)[0]).upper() + "_IMAGE"


def section(filename: str) -> str:
    """The native GPU section of an op's .cu file (``#ifdef`` line to ``#endif`` line)."""
    text = S.read_source(filename)
    start = text.index(f"#ifdef {SECTION_MACRO}")
    end = text.index(f"#endif  // {SECTION_MACRO}", start)
    return text[start:text.index("\n", end) + 1]


def _sections_header() -> str:
    """ext_cuda_sections.h: every op's native GPU section, in source order."""
    out = ["// generated by mx_roi.ext.cuda: each op's native GPU section", "#pragma once",
           f"#define {SECTION_MACRO} 1"]
    for filename in sorted(gpu_ops()):
        out += [f"// ---- {filename} ----", section(filename)]
    return "\n".join(out) + "\n"


def ptx_arch() -> int:
    """The virtual architecture of the PTX: the lowest that this NVRTC supports, from
    sm_52 on (the driver compiles PTX for any newer GPU, Hopper included)."""
    from ..cuda import nvrtc
    archs = [a for a in nvrtc.supported_archs() if a >= 52]
    return min(archs) if archs else 52


def _generated_header() -> str:
    """ext_cuda_kernels.h: each source's PTX and its lowered kernel names."""
    from ..cuda import nvrtc
    arch = ptx_arch()
    out = ["// generated by mx_roi.ext.cuda: NVRTC's PTX of each op source", "#pragma once",
           "namespace mx_roi_cuda {"]
    sources = [(f, S.read_source(f), kernel_expressions(f)) for f in sorted(gpu_ops())]
    sources += [(f, _read(os.path.join(_HERE, f)), exprs)
                for f, exprs in sorted(OWN_KERNELS.items())]
    for i, (filename, text, exprs) in enumerate(sources):
        res = nvrtc.compile_ptx(text, filename, exprs,
                                tuple(S.NVRTC_OPTIONS) + nvrtc.include_options()
                                + (f"--gpu-architecture=compute_{arch}",))
        if f"){_PTX_DELIMITER}\"" in res.ptx:
            raise ExtLibraryError(f"the PTX of {filename} holds the raw-string delimiter")
        names = ",\n".join(f'    {{"{e}", "{res.lowered[e]}"}}' for e in exprs)
        out += [f'static const char PTX_{i}[] = R"{_PTX_DELIMITER}({res.ptx}){_PTX_DELIMITER}";',
                f"static const KernelName NAMES_{i}[] = {{\n{names},\n    {{nullptr, nullptr}}}};",
                f'static const Image {image_name(filename)} = '
                f'{{"{filename}", PTX_{i}, NAMES_{i}}};']
    out.append("}  // namespace mx_roi_cuda")
    return "\n".join(out) + "\n"


def _plan():
    """``(library path, {file name: text})``; the generated header is made at build."""
    from ..cuda import nvrtc
    from .. import registry  # noqa: F401  (registers the ops: S.read_source knows them)
    cxx = loader.host_compiler()
    if not cxx:
        raise ExtLibraryError("mx_roi.ext.cuda needs a C++ compiler (g++ or $CXX)")
    try:
        nv = nvrtc.version()
        arch = ptx_arch()
    except nvrtc.NvrtcError as exc:
        raise ExtLibraryError(f"mx_roi.ext.cuda needs NVRTC to build its PTX: {exc}") from exc
    files = {name: _read(os.path.join(_HERE, name)) for name in _OWN_FILES}
    files["ext_cuda_sections.h"] = _sections_header()
    key = S.source_hash(*(f"{n}\0{t}" for n, t in sorted(files.items())),
                        *(S.read_source(f) for f in sorted(gpu_ops())),
                        *(" ".join(kernel_expressions(f)) for f in sorted(gpu_ops())),
                        _read(os.path.abspath(__file__)), " ".join(S.NVRTC_OPTIONS),
                        f"nvrtc{nv[0]}.{nv[1]}", f"compute_{arch}", loader._compiler_id(cxx),
                        " ".join(FLAGS))
    files["ext_cuda_ops.cc"] += (f'\nextern "C" __attribute__((visibility("default"))) '
                                 f'const char mx_roi_build_key[] = "{key}";\n')
    return os.path.join(loader.cache_dir(), f"mx_roi_ext_cuda-{key}.so"), files


def _compile(lib_path: str, files: Dict[str, str]) -> None:
    tmpdir = tempfile.mkdtemp(prefix="build-ext-cuda-", dir=os.path.dirname(lib_path))
    try:
        files = dict(files, **{"ext_cuda_kernels.h": _generated_header()})
        for name, text in files.items():
            with open(os.path.join(tmpdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        lib = os.path.join(tmpdir, "lib.so")
        _run([loader.host_compiler(), *FLAGS, "-I", tmpdir,
              os.path.join(tmpdir, "ext_cuda_ops.cc"), "-o", lib, "-ldl"])
        os.chmod(lib, 0o755)
        os.replace(lib, lib_path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


_LOCK = threading.Lock()
_STATE = {"path": None, "lib": None}


def library_path() -> str:
    """The launcher library's path, built (or rebuilt when the cached file must not be
    loaded) if needed; :class:`mx_roi.ext.ExtLibraryError` says why it cannot be."""
    with _LOCK:
        if _STATE["path"]:
            return _STATE["path"]
        lib_path, files = _plan()
        lib = load_or_build(lib_path, lambda: _compile(lib_path, files), "native GPU library")
        _STATE["path"], _STATE["lib"] = lib_path, lib
        return lib_path


def enable() -> str:
    """Opt in to the native GPU path in this process: load the extension library into
    MXNet (:func:`mx_roi.ext.load`) and hand it this launcher library, so that the
    ``"gpu"`` forward and backward of the ops with a native GPU path (:func:`gpu_ops`: all
    seven ``mx_roi_<Op>``) run (on an MXNet CUDA build; GPU contexts of ``mx_roi.nd`` /
    ``sym`` / Gluon keep the Custom door).
    Returns the launcher's path."""
    from . import load
    path = library_path()
    ext = ctypes.CDLL(load())  # the library MXNet opened (the loader hands out the same)
    fn = ext.mx_roi_ext_set_gpu_launcher
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    err = ctypes.create_string_buffer(2048)
    if fn(path.encode(), err, len(err)):
        raise ExtLibraryError(f"mx_roi: the native GPU launcher {path} cannot be opened: "
                              f"{err.value.decode(errors='replace')}")
    return path


def _lib():
    library_path()
    lib = _STATE["lib"]
    if not hasattr(lib, "_mx_roi_typed"):
        c = ctypes
        lib.mx_roi_ext_cuda_roi_align_workspace.argtypes = [
            c.c_int, c.c_longlong, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int,
            c.POINTER(c.c_ulonglong), c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_roi_align_forward.argtypes = [
            c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong,
            c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int, c.c_float, c.c_int,
            c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_ulonglong, c.c_void_p, c.c_char_p,
            c.c_size_t]
        lib.mx_roi_ext_cuda_roi_align_backward_workspace.argtypes = [
            c.c_int, c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong,
            c.c_int, c.c_int, c.c_int, c.c_int, c.POINTER(c.c_ulonglong), c.c_char_p,
            c.c_size_t]
        lib.mx_roi_ext_cuda_roi_align_backward.argtypes = [
            c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong,
            c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int,
            c.c_float, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_ulonglong,
            c.c_void_p, c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_roi_pooling_workspace.argtypes = [
            c.c_int, c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong,
            c.c_int, c.c_int, c.c_int, c.POINTER(c.c_ulonglong), c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_roi_pooling_forward.argtypes = [
            c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong,
            c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int, c.c_float, c.c_void_p,
            c.c_ulonglong, c.c_void_p, c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_roi_pooling_backward.argtypes = [
            c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong,
            c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int,
            c.c_float, c.c_void_p, c.c_ulonglong, c.c_void_p, c.c_char_p, c.c_size_t]
        ps = [c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong,
              c.c_longlong, c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int,
              c.c_int, c.c_int, c.c_float]  # (the forward's; the backward: one more pointer)
        tail = [c.c_void_p, c.c_ulonglong, c.c_void_p, c.c_char_p, c.c_size_t]
        grid = [c.c_int] * 4  # sample_ratio, aligned, rfcn, sample_num
        ws = [c.c_int] + [c.c_longlong] * 6 + [c.c_int] * 2
        lib.mx_roi_ext_cuda_psroi_pooling_workspace.argtypes = ws + [
            c.c_int, c.POINTER(c.c_ulonglong), c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_psroi_pooling_forward.argtypes = ps + tail
        lib.mx_roi_ext_cuda_psroi_pooling_backward.argtypes = ps[:4] + [c.c_void_p] + \
            ps[4:] + tail
        lib.mx_roi_ext_cuda_psroi_align_workspace.argtypes = ws + [c.c_int] * 4 + [
            c.POINTER(c.c_ulonglong), c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_psroi_align_forward.argtypes = ps + grid + tail
        lib.mx_roi_ext_cuda_psroi_align_backward.argtypes = ps[:4] + [c.c_void_p] + \
            ps[4:] + grid + tail
        rr = [c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong,
              c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int, c.c_float, c.c_int,
              c.c_int, c.c_int]  # (the forward's; the backward: one more pointer)
        lib.mx_roi_ext_cuda_rroi_align_workspace.argtypes = [c.c_int] + [c.c_longlong] * 5 + [
            c.c_int, c.POINTER(c.c_ulonglong), c.c_char_p, c.c_size_t]
        lib.mx_roi_ext_cuda_rroi_align_forward.argtypes = rr + tail
        lib.mx_roi_ext_cuda_rroi_align_backward.argtypes = rr[:4] + [c.c_void_p] + rr[4:] + \
            tail
        pr = [c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong,
              c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int, c.c_float]
        lib.mx_roi_ext_cuda_prroi_pool_workspace.argtypes = \
            lib.mx_roi_ext_cuda_rroi_align_workspace.argtypes
        lib.mx_roi_ext_cuda_prroi_pool_forward.argtypes = pr + tail
        lib.mx_roi_ext_cuda_prroi_pool_backward.argtypes = pr[:4] + [c.c_void_p] * 2 + \
            pr[4:] + tail
        dp = [c.c_longlong] * 6 + [c.c_int] * 5 + [c.c_float] * 2  # N .. K, output_dim ..
        lib.mx_roi_ext_cuda_deformable_psroi_pooling_workspace.argtypes = [c.c_int] + [
            c.c_longlong] * 6 + [c.c_int] * 2 + [c.POINTER(c.c_ulonglong), c.c_char_p,
                                                  c.c_size_t]
        lib.mx_roi_ext_cuda_deformable_psroi_pooling_forward.argtypes = [c.c_int] + [
            c.c_void_p] * 4 + dp + tail
        lib.mx_roi_ext_cuda_deformable_psroi_pooling_backward.argtypes = [c.c_int] + [
            c.c_void_p] * 7 + dp + tail
        lib.mx_roi_ext_cuda_check.argtypes = [c.c_char_p, c.c_void_p, c.c_int, c.c_char_p,
                                              c.c_size_t]
        lib._mx_roi_typed = True
    return lib


def _raise(rc: int, err) -> None:
    if rc:
        raise CudaLaunchError(err.value.decode(errors="replace"))


def _pooled(pooled_size) -> Tuple[int, int]:
    p = (pooled_size, pooled_size) if np.isscalar(pooled_size) else tuple(pooled_size)
    return int(p[0]), int(p[1])


def roi_align_workspace(dtype, R: int, pooled_size, H: int, W: int, sample_ratio: int = -1,
                        caffe: bool = False) -> int:
    """Bytes of device memory a ROIAlign forward's tables need (0 for R = 0)."""
    P, Q = _pooled(pooled_size)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_roi_align_workspace(
        DTYPE_CODES[np.dtype(dtype)], int(R), P, Q, int(H), int(W), int(sample_ratio),
        int(bool(caffe)), ctypes.byref(out), err, len(err)), err)
    return out.value


def roi_align_forward(dtype, data: int, rois: int, out: int, data_shape, R: int, pooled_size,
                      spatial_scale: float, sample_ratio: int = -1, aligned: bool = False,
                      pool_mode: str = "avg", caffe: bool = False, workspace: int = 0,
                      workspace_bytes: int = 0, stream: int = 0) -> None:
    """Queue ROIAlign's forward on ``stream`` (a handle: CuPy's ``stream.ptr``; 0 the
    legacy default stream) over device pointers ``data`` (N, C, H, W), ``rois`` (R, 5)
    and ``out`` (R, C, P, Q) of ``dtype``, with ``workspace`` (at least
    :func:`roi_align_workspace` bytes).  Returns without waiting; raises
    :class:`CudaLaunchError` (a bad roi of an earlier call on this stream: the
    status-word rule of docs/gpu.md)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_roi_align_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, out, N, C, H, W, int(R), P, Q,
        float(np.float32(spatial_scale)), int(sample_ratio), int(bool(aligned)),
        int(pool_mode == "max"), int(bool(caffe)), workspace, int(workspace_bytes), stream,
        err, len(err)), err)


def roi_align_backward_workspace(dtype, data_shape, R: int, pooled_size,
                                 sample_ratio: int = -1, caffe: bool = False) -> int:
    """Bytes of device memory a ROIAlign backward needs: its tables and, for float16, the
    float32 accumulator of the data gradient (0 for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_roi_align_backward_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), P, Q, int(sample_ratio),
        int(bool(caffe)), ctypes.byref(out), err, len(err)), err)
    return out.value


def roi_align_backward(dtype, grad: int, data: int, rois: int, in_grad: int, data_shape,
                       R: int, pooled_size, spatial_scale: float, sample_ratio: int = -1,
                       aligned: bool = False, pool_mode: str = "avg", caffe: bool = False,
                       workspace: int = 0, workspace_bytes: int = 0, stream: int = 0,
                       rois_grad: int = 0) -> None:
    """Queue ROIAlign's backward on ``stream``: ``in_grad`` (N, C, H, W) written (req
    write) from the out-grad ``grad`` (R, C, P, Q), ``rois_grad`` (R, 5) zeroed where given
    (0: none); ``data`` (N, C, H, W) is read by the max modes (the forward kept no argmax);
    device pointers of ``dtype``; ``workspace``: at least
    :func:`roi_align_backward_workspace` bytes.
    Returns without waiting.  A bad roi raises nothing here (its rows give no gradient):
    the next forward on the stream, or :func:`check`, reports it (docs/gpu.md)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_roi_align_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, data, rois, in_grad, rois_grad, N, C, H, W,
        int(R), P, Q, float(np.float32(spatial_scale)), int(sample_ratio),
        int(bool(aligned)), int(pool_mode == "max"), int(bool(caffe)), workspace,
        int(workspace_bytes), stream, err, len(err)), err)


def roi_pooling_workspace(dtype, data_shape, R: int, pooled_size,
                          backward: bool = False) -> int:
    """Bytes of device memory a ROIPooling forward (or ``backward``) needs: its integer
    bins' tables and, for a float16 backward, the float32 accumulator (0 for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_roi_pooling_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), P, Q, int(bool(backward)),
        ctypes.byref(out), err, len(err)), err)
    return out.value


def roi_pooling_forward(dtype, data: int, rois: int, out: int, data_shape, R: int,
                        pooled_size, spatial_scale: float, workspace: int = 0,
                        workspace_bytes: int = 0, stream: int = 0) -> None:
    """Queue ROIPooling's forward on ``stream`` (as :func:`roi_align_forward`; the
    workspace: :func:`roi_pooling_workspace` bytes)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_roi_pooling_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, out, N, C, H, W, int(R), P, Q,
        float(np.float32(spatial_scale)), workspace, int(workspace_bytes), stream, err,
        len(err)), err)


def roi_pooling_backward(dtype, grad: int, data: int, rois: int, in_grad: int, data_shape,
                         R: int, pooled_size, spatial_scale: float, workspace: int = 0,
                         workspace_bytes: int = 0, stream: int = 0, rois_grad: int = 0) -> None:
    """Queue ROIPooling's backward on ``stream`` (as :func:`roi_align_backward`: each
    bin's winner found again in ``data``; the workspace: :func:`roi_pooling_workspace`
    with ``backward``)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_roi_pooling_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, data, rois, in_grad, rois_grad, N, C, H, W,
        int(R), P, Q, float(np.float32(spatial_scale)), workspace, int(workspace_bytes),
        stream, err, len(err)), err)


def _ps(op_name, pooled_size, output_dim, group_size, **grid):
    """``(P, Q, output_dim, Gh, Gw)`` of a position-sensitive call, its parameters checked
    as the op's parameter struct checks them (its group-grid rule, its messages)."""
    from ..registry import get_op
    cls = get_op(op_name)
    p = cls.param_cls.from_kwargs(**{k: str(v) for k, v in dict(
        pooled_size=pooled_size, output_dim=output_dim, spatial_scale=1.0,
        group_size=group_size, **grid).items()})
    (P, Q), (Gh, Gw) = p.pooled_size, p.group_grid
    return int(P), int(Q), int(p.output_dim), int(Gh), int(Gw)


def psroi_pooling_workspace(dtype, data_shape, R: int, pooled_size, output_dim: int,
                            backward: bool = False) -> int:
    """Bytes of device memory a PSROIPooling forward (or ``backward``) needs: its integer
    bins' tables, the channel map and, for a float16 backward, the float32 accumulator (0
    for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_psroi_pooling_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), int(output_dim), P, Q,
        int(bool(backward)), ctypes.byref(out), err, len(err)), err)
    return out.value


def psroi_pooling_forward(dtype, data: int, rois: int, out: int, data_shape, R: int,
                          pooled_size, output_dim: int, spatial_scale: float, group_size=0,
                          workspace: int = 0, workspace_bytes: int = 0,
                          stream: int = 0) -> None:
    """Queue PSROIPooling's forward on ``stream``: ``data`` (N, output_dim * Gh * Gw, H, W),
    ``rois`` (R, 5), ``out`` (R, output_dim, P, Q); ``group_size`` as the op's (0: the
    pooled grid); the workspace: :func:`psroi_pooling_workspace` bytes.  Otherwise as
    :func:`roi_align_forward`."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q, D, Gh, Gw = _ps("PSROIPooling", pooled_size, output_dim, group_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_psroi_pooling_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, out, N, C, H, W, int(R), D, P, Q, Gh, Gw,
        float(np.float32(spatial_scale)), workspace, int(workspace_bytes), stream, err,
        len(err)), err)


def psroi_pooling_backward(dtype, grad: int, rois: int, in_grad: int, data_shape, R: int,
                           pooled_size, output_dim: int, spatial_scale: float, group_size=0,
                           workspace: int = 0, workspace_bytes: int = 0, stream: int = 0,
                           rois_grad: int = 0) -> None:
    """Queue PSROIPooling's backward on ``stream``: ``in_grad`` (N, output_dim * Gh * Gw, H,
    W) written from ``grad`` (R, output_dim, P, Q) (the data is not read); otherwise as
    :func:`roi_align_backward` (the workspace: :func:`psroi_pooling_workspace` with
    ``backward``)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q, D, Gh, Gw = _ps("PSROIPooling", pooled_size, output_dim, group_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_psroi_pooling_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, rois, in_grad, rois_grad, N, C, H, W, int(R), D,
        P, Q, Gh, Gw, float(np.float32(spatial_scale)), workspace, int(workspace_bytes),
        stream, err, len(err)), err)


def _ps_grid(sample_ratio, aligned, legacy, sample_num):
    rfcn = legacy == "rfcn"
    return (int(sample_ratio), int(bool(aligned) and not rfcn), int(rfcn), int(sample_num))


def psroi_align_workspace(dtype, data_shape, R: int, pooled_size, output_dim: int,
                          sample_ratio: int = -1, legacy: str = "", sample_num: int = 2,
                          backward: bool = False) -> int:
    """Bytes of device memory a PSROIAlign forward (or ``backward``) needs: its sample
    grid's tables, the channel map and, for a float16 backward, the float32 accumulator
    (0 for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    ratio, _, rfcn, num = _ps_grid(sample_ratio, False, legacy, sample_num)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_psroi_align_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), int(output_dim), P, Q, ratio, rfcn,
        num, int(bool(backward)), ctypes.byref(out), err, len(err)), err)
    return out.value


def psroi_align_forward(dtype, data: int, rois: int, out: int, data_shape, R: int,
                        pooled_size, output_dim: int, spatial_scale: float, sample_ratio=-1,
                        aligned: bool = False, group_size=0, legacy: str = "",
                        sample_num: int = 2, workspace: int = 0, workspace_bytes: int = 0,
                        stream: int = 0) -> None:
    """Queue PSROIAlign's forward on ``stream`` (as :func:`psroi_pooling_forward`, on
    ROIAlign's samples or, ``legacy='rfcn'``, the R-FCN grid of ``sample_num``; the
    workspace: :func:`psroi_align_workspace` bytes)."""
    N, C, H, W = (int(v) for v in data_shape)
    grid = _ps_grid(sample_ratio, aligned, legacy, sample_num)
    P, Q, D, Gh, Gw = _ps("PSROIAlign", pooled_size, output_dim, group_size,
                          sample_ratio=sample_ratio, legacy=legacy, sample_num=sample_num)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_psroi_align_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, out, N, C, H, W, int(R), D, P, Q, Gh, Gw,
        float(np.float32(spatial_scale)), *grid, workspace, int(workspace_bytes), stream, err,
        len(err)), err)


def psroi_align_backward(dtype, grad: int, rois: int, in_grad: int, data_shape, R: int,
                         pooled_size, output_dim: int, spatial_scale: float, sample_ratio=-1,
                         aligned: bool = False, group_size=0, legacy: str = "",
                         sample_num: int = 2, workspace: int = 0, workspace_bytes: int = 0,
                         stream: int = 0, rois_grad: int = 0) -> None:
    """Queue PSROIAlign's backward on ``stream`` (as :func:`psroi_pooling_backward`; the
    workspace: :func:`psroi_align_workspace` with ``backward``)."""
    N, C, H, W = (int(v) for v in data_shape)
    grid = _ps_grid(sample_ratio, aligned, legacy, sample_num)
    P, Q, D, Gh, Gw = _ps("PSROIAlign", pooled_size, output_dim, group_size,
                          sample_ratio=sample_ratio, legacy=legacy, sample_num=sample_num)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_psroi_align_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, rois, in_grad, rois_grad, N, C, H, W, int(R), D,
        P, Q, Gh, Gw, float(np.float32(spatial_scale)), *grid, workspace,
        int(workspace_bytes), stream, err, len(err)), err)


def rroi_align_workspace(dtype, data_shape, R: int, backward: bool = False) -> int:
    """Bytes of device memory a RROIAlign forward (or ``backward``) needs: the rois'
    checked copy and, for a float16 backward, the float32 accumulator (0 for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_rroi_align_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), int(bool(backward)),
        ctypes.byref(out), err, len(err)), err)
    return out.value


def rroi_align_forward(dtype, data: int, rois: int, out: int, data_shape, R: int, pooled_size,
                       spatial_scale: float, sampling_ratio: int = -1, aligned: bool = False,
                       clockwise: bool = False, workspace: int = 0, workspace_bytes: int = 0,
                       stream: int = 0) -> None:
    """Queue RROIAlign's forward on ``stream``: ``rois`` (R, 6) (batch, centre x, centre y,
    width, height, angle in degrees), checked on the device into the workspace
    (:func:`rroi_align_workspace` bytes) before the kernel reads them; otherwise as
    :func:`roi_align_forward`."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_rroi_align_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, out, N, C, H, W, int(R), P, Q,
        float(np.float32(spatial_scale)), int(sampling_ratio), int(bool(aligned)),
        int(bool(clockwise)), workspace, int(workspace_bytes), stream, err, len(err)), err)


def rroi_align_backward(dtype, grad: int, rois: int, in_grad: int, data_shape, R: int,
                        pooled_size, spatial_scale: float, sampling_ratio: int = -1,
                        aligned: bool = False, clockwise: bool = False, workspace: int = 0,
                        workspace_bytes: int = 0, stream: int = 0, rois_grad: int = 0) -> None:
    """Queue RROIAlign's backward on ``stream`` (``rois_grad`` (R, 6); the data is not
    read; the workspace: :func:`rroi_align_workspace` with ``backward``); otherwise as
    :func:`roi_align_backward`."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_rroi_align_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, rois, in_grad, rois_grad, N, C, H, W, int(R), P,
        Q, float(np.float32(spatial_scale)), int(sampling_ratio), int(bool(aligned)),
        int(bool(clockwise)), workspace, int(workspace_bytes), stream, err, len(err)), err)


def prroi_pool_workspace(dtype, data_shape, R: int, backward: bool = False) -> int:
    """Bytes of device memory a PrRoIPool forward (or ``backward``) needs: the rois'
    checked copy and, for a float16 backward, the float32 results of both gradients (0
    for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_prroi_pool_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), int(bool(backward)),
        ctypes.byref(out), err, len(err)), err)
    return out.value


def prroi_pool_forward(dtype, data: int, rois: int, out: int, data_shape, R: int, pooled_size,
                       spatial_scale: float, workspace: int = 0, workspace_bytes: int = 0,
                       stream: int = 0) -> None:
    """Queue PrRoIPool's forward on ``stream`` (the rois checked on the device into the
    workspace, :func:`prroi_pool_workspace` bytes); otherwise as
    :func:`roi_align_forward`."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_prroi_pool_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, out, N, C, H, W, int(R), P, Q,
        float(np.float32(spatial_scale)), workspace, int(workspace_bytes), stream, err,
        len(err)), err)


def prroi_pool_backward(dtype, grad: int, data: int, rois: int, in_grad: int, data_shape,
                        R: int, pooled_size, spatial_scale: float, workspace: int = 0,
                        workspace_bytes: int = 0, stream: int = 0, rois_grad: int = 0) -> None:
    """Queue PrRoIPool's backward on ``stream``: ``in_grad`` written and, where given,
    ``rois_grad`` (R, 5) -- this op's gradient of its rois, which reads ``data``; the
    workspace: :func:`prroi_pool_workspace` with ``backward``.  Otherwise as
    :func:`roi_align_backward`."""
    N, C, H, W = (int(v) for v in data_shape)
    P, Q = _pooled(pooled_size)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_prroi_pool_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, data, rois, in_grad, rois_grad, N, C, H, W,
        int(R), P, Q, float(np.float32(spatial_scale)), workspace, int(workspace_bytes),
        stream, err, len(err)), err)


def _deformable(output_dim, group_size, pooled_size, part_size, sample_per_part,
                spatial_scale, trans_std) -> tuple:
    """The entries' parameter arguments (DeformablePSROIPoolingParam's meaning: part_size
    0 = pooled_size; the scales as float32)."""
    return (int(output_dim), int(group_size), int(pooled_size),
            int(part_size) or int(pooled_size), int(sample_per_part),
            float(np.float32(spatial_scale)), float(np.float32(trans_std)))


def deformable_psroi_pooling_workspace(dtype, data_shape, R: int, K: int, part: int,
                                       backward: bool = False) -> int:
    """Bytes of device memory a DeformablePSROIPooling forward (or ``backward``) needs with
    ``K`` offset classes of ``part`` x ``part`` cells (K = 0: no offsets): the rois'
    checked copy, a 16-byte scratch and, for a float16 backward, float32 results of the
    gradients (0 for R = 0)."""
    N, C, H, W = (int(v) for v in data_shape)
    out, err = ctypes.c_ulonglong(), ctypes.create_string_buffer(1024)
    _raise(_lib().mx_roi_ext_cuda_deformable_psroi_pooling_workspace(
        DTYPE_CODES[np.dtype(dtype)], N, C, H, W, int(R), int(K), int(part),
        int(bool(backward)), ctypes.byref(out), err, len(err)), err)
    return out.value


def deformable_psroi_pooling_forward(dtype, data: int, rois: int, trans: int, out: int,
                                     data_shape, R: int, K: int, output_dim: int,
                                     group_size: int, pooled_size: int, spatial_scale: float,
                                     part_size: int = 0, sample_per_part: int = 1,
                                     trans_std: float = 0.0, workspace: int = 0,
                                     workspace_bytes: int = 0, stream: int = 0) -> None:
    """Queue DeformablePSROIPooling's forward on ``stream``: ``trans`` (R, 2K, part, part)
    or 0 (no offsets; ``K`` then unread); the rois checked and the offsets' device check
    in the workspace (:func:`deformable_psroi_pooling_workspace` bytes); a bad offset is
    reported, as a bad roi, by a later call.  Otherwise as :func:`roi_align_forward`."""
    N, C, H, W = (int(v) for v in data_shape)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_deformable_psroi_pooling_forward(
        DTYPE_CODES[np.dtype(dtype)], data, rois, trans, out, N, C, H, W, int(R), int(K),
        *_deformable(output_dim, group_size, pooled_size, part_size, sample_per_part,
                     spatial_scale, trans_std), workspace, int(workspace_bytes), stream, err,
        len(err)), err)


def deformable_psroi_pooling_backward(dtype, grad: int, data: int, rois: int, trans: int,
                                      in_grad: int, data_shape, R: int, K: int,
                                      output_dim: int, group_size: int, pooled_size: int,
                                      spatial_scale: float, part_size: int = 0,
                                      sample_per_part: int = 1, trans_std: float = 0.0,
                                      workspace: int = 0, workspace_bytes: int = 0,
                                      stream: int = 0, rois_grad: int = 0,
                                      trans_grad: int = 0) -> None:
    """Queue DeformablePSROIPooling's backward on ``stream``: ``in_grad`` written,
    ``rois_grad`` (R, 5) zeroed where given, ``trans_grad`` (R, 2K, part, part) written
    where given with offsets (``data`` is read for it); the workspace:
    :func:`deformable_psroi_pooling_workspace` with ``backward``.  Otherwise as
    :func:`roi_align_backward`."""
    N, C, H, W = (int(v) for v in data_shape)
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_deformable_psroi_pooling_backward(
        DTYPE_CODES[np.dtype(dtype)], grad, data, rois, trans, in_grad, rois_grad, trans_grad,
        N, C, H, W, int(R), int(K),
        *_deformable(output_dim, group_size, pooled_size, part_size, sample_per_part,
                     spatial_scale, trans_std), workspace, int(workspace_bytes), stream, err,
        len(err)), err)


def check(op: str, stream: int = 0, wait: bool = True) -> None:
    """Report ``op``'s status word on ``stream`` (docs/gpu.md's rule): with ``wait``, after
    waiting for the latest call there (the one host wait of the path)."""
    err = ctypes.create_string_buffer(4096)
    _raise(_lib().mx_roi_ext_cuda_check(op.encode(), stream, int(bool(wait)), err, len(err)),
           err)
