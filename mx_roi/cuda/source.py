"""The CUDA kernel sources of the registered ops, their instantiations and parameter lists.

One place says what gets compiled and how, for every consumer: the CuPy ``RawModule``
on a GPU, the host (g++) emulation and the NVRTC compile test all call
:func:`module_source`, so they compile the same text with the same name expressions.

* The sources are ``operators/<op>.cu``, one per registered op (:func:`sources`: each
  op's ``cuda_source``) (shipped in the wheel as package data of
  ``mx_roi.operators``); ``#include "roi_common.cuh"`` is inlined, so the compiled text
  is self-contained and needs no include path of ours.
* Each ``__global__`` kernel is a template whose parameters are named: ``<T, A>``
  (forward) or ``<T, A, O>`` (backward) with ``(T, A)`` one of :data:`TYPE_PAIRS` and
  ``O`` either ``A`` (plain atomics) or ``unsigned long long`` (deterministic fixed-point
  accumulation), optionally followed by ``I``, the storage type of a max kernel's argmax,
  one of :data:`INDEX_TYPES` (:data:`TEMPLATE_VALUES`: the values of each name).  Every
  combination is instantiated (:func:`name_expressions`); a launch picks ``T``, ``A``,
  ``O`` from its dtypes and deduces any other parameter from the dtype of the array
  argument declared with it (:func:`deduced_from`, ``mx_roi.cuda.backend.Launch``).
* :func:`kernel_signatures` parses every kernel's parameter list from the source; the
  launch glue checks each launch's arguments against it (:mod:`mx_roi.cuda.loader`).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

__all__ = ["HEADER", "TYPE_PAIRS", "INDEX_TYPES", "TEMPLATE_VALUES", "CTYPES", "NVRTC_OPTIONS",
           "Param", "Signature", "sources", "set_sources", "read_source", "module_source", "name_expressions",
           "kernel_signatures", "instantiate", "expression", "ctype_of", "deduced_from",
           "cuda_include_dirs"]

HEADER = "roi_common.cuh"

#: (element type, accumulator/table type) of every instantiation.
TYPE_PAIRS = (("float", "float"), ("double", "double"), ("__half", "float"))
#: Accumulator of the deterministic backward (fixed point, see mx_roi.cuda.backend).
FIXED = "unsigned long long"
#: Storage types of a max kernel's argmax (template parameter ``I``), smallest first: a
#: bin-relative index, the type's maximum value meaning "no winner"
#: (:func:`mx_roi.cuda.tables.argmax_dtype` picks one per call).
INDEX_TYPES = ("unsigned char", "unsigned short", "unsigned int")
#: Template parameter name -> its values, given the ``(T, A)`` pair; ``T`` and ``A``
#: themselves come from :data:`TYPE_PAIRS` and lead every kernel's template list.
TEMPLATE_VALUES = {"O": lambda t, a: (a, FIXED), "I": lambda t, a: INDEX_TYPES}

#: C type -> NumPy dtype of kernel parameters.
CTYPES: Dict[str, np.dtype] = {
    "float": np.dtype(np.float32), "double": np.dtype(np.float64),
    "__half": np.dtype(np.float16), "int": np.dtype(np.int32),
    "unsigned char": np.dtype(np.uint8), "unsigned short": np.dtype(np.uint16),
    "unsigned int": np.dtype(np.uint32), "long long": np.dtype(np.int64),
    "unsigned long long": np.dtype(np.uint64),
}

#: Options of every CUDA compile (CuPy RawModule and the NVRTC test).  ``--fmad=false``
#: keeps ``a*b + c*d`` as two roundings, like the NumPy backend and the host emulation
#: (ties in the max modes then break identically on every backend).  ``--std=c++11``:
#: CuPy 12 refuses template code without a ``--std`` option ("need to specify C++
#: standard for compiling template code"); CuPy 13 adds its own default only when none
#: is given, so the sources (plain C++11) compile with the same dialect on both.
NVRTC_OPTIONS = ("--fmad=false", "--std=c++11")


def ctype_of(dtype) -> str:
    """The C type of a NumPy dtype (float16 -> ``__half``)."""
    dtype = np.dtype(dtype)
    for name, dt in CTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(f"no CUDA type for dtype {dtype}")


def _operators_dir() -> str:
    """The directory of the package ``mx_roi.operators``, where the ``.cu`` files are: in
    a checkout (and an editable install) the symlink ``mx_roi/operators -> ../operators``,
    in a wheel the copy that setuptools made of it.  Found from this file's place, so the
    kernel layer never imports the operators (which import the layers above it)."""
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package_dir, "operators")


#: The kernel files of the registered ops, in registration order.  The registry hands the
#: list over (:func:`set_sources`) each time it registers an op: this layer sits below it
#: and never asks.
_SOURCES: Tuple[str, ...] = ()


def set_sources(filenames) -> None:
    """Make ``filenames`` (each registered op's ``cuda_source``; empty ones skipped,
    duplicates once) the known kernel files.  Called by :func:`mx_roi.registry.register`."""
    global _SOURCES
    _SOURCES = tuple(dict.fromkeys(f for f in filenames if f))


def sources() -> Tuple[str, ...]:
    """The kernel files of the registered ops (each op's ``cuda_source``), in order."""
    return _SOURCES


@functools.lru_cache(maxsize=None)
def read_source(filename: str) -> str:
    """Text of ``operators/<filename>`` with ``#include "roi_common.cuh"`` inlined."""
    known = sources()
    if filename not in known:
        raise ValueError(f"unknown kernel source {filename!r}; expected one of {known}")
    base = _operators_dir()
    with open(os.path.join(base, filename), encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(base, HEADER), encoding="utf-8") as f:
        header = f.read()
    include = f'#include "{HEADER}"'
    if include not in text:
        raise ValueError(f"{filename}: expected {include}")
    return text.replace(include, f"// ---- {HEADER} (inlined) ----\n{header}\n"
                                 f"// ---- end of {HEADER} ----", 1)


@dataclass(frozen=True)
class Param:
    """One kernel parameter: C type (template names substituted), pointer or not."""

    name: str
    ctype: str       # base type, e.g. "float", "int", "unsigned long long"
    pointer: bool
    decl: str        # full C declaration type, e.g. "const float*"

    @property
    def dtype(self) -> np.dtype:
        return CTYPES[self.ctype]

    def describe(self) -> str:
        return f"{self.decl} {self.name}"


@dataclass(frozen=True)
class Signature:
    kernel: str
    template: Tuple[str, ...]
    params: Tuple[Param, ...]


_KERNEL_RE = re.compile(
    r"template\s*<([^>]*)>\s*__global__\s+void\s+(\w+)\s*\(([^)]*)\)", re.S)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _parse_param(text: str, subst: Dict[str, str]) -> Param:
    text = " ".join(text.replace("*", " * ").split())
    tokens = text.split(" ")
    name = tokens[-1]
    words = [subst.get(t, t) for t in tokens[:-1] if t != "__restrict__"]
    pointer = "*" in words
    base = " ".join(w for w in words if w not in ("const", "*"))
    if base not in CTYPES:
        raise ValueError(f"kernel parameter {text!r}: unsupported type {base!r}")
    decl = " ".join(words).replace(" *", "*")
    return Param(name, base, pointer, decl)


@functools.lru_cache(maxsize=None)
def kernel_signatures(filename: str) -> Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]]:
    """``{kernel: (template parameter names, raw parameter declarations)}`` of a source."""
    out = {}
    for m in _KERNEL_RE.finditer(_strip_comments(read_source(filename))):
        tparams = tuple(p.strip().split()[-1] for p in m.group(1).split(","))
        params = tuple(" ".join(p.split()) for p in m.group(3).split(","))
        out[m.group(2)] = (tparams, params)
    if not out:
        raise ValueError(f"{filename}: no templated __global__ kernels found")
    return out


def expression(kernel: str, targs) -> str:
    """Name expression ``kernel<float, float>`` (as NVRTC/CuPy spell it)."""
    return f"{kernel}<{', '.join(targs)}>"


@functools.lru_cache(maxsize=None)
def instantiate(filename: str, expr: str) -> Signature:
    """The concrete signature of the name expression ``expr`` of ``filename``."""
    m = re.fullmatch(r"\s*(\w+)\s*<(.*)>\s*", expr)
    if not m:
        raise ValueError(f"bad name expression {expr!r}")
    kernel, targs = m.group(1), tuple(" ".join(a.split()) for a in m.group(2).split(","))
    sigs = kernel_signatures(filename)
    if kernel not in sigs:
        raise KeyError(f"{filename} has no kernel {kernel!r} (has: {', '.join(sigs)})")
    tparams, raw = sigs[kernel]
    if len(tparams) != len(targs):
        raise ValueError(f"{expr}: {kernel} takes {len(tparams)} template arguments")
    subst = dict(zip(tparams, targs))
    return Signature(kernel, targs, tuple(_parse_param(p, subst) for p in raw))


@functools.lru_cache(maxsize=None)
def name_expressions(filename: str) -> Tuple[str, ...]:
    """Every instantiation compiled for ``filename``: each kernel x :data:`TYPE_PAIRS` x
    the values of its further template parameters, by name (:data:`TEMPLATE_VALUES`:
    ``O`` in {A, unsigned long long}, ``I`` in :data:`INDEX_TYPES`)."""
    exprs: List[str] = []
    for kernel, (tparams, _) in kernel_signatures(filename).items():
        rest = tparams[2:]
        if tparams[:2] != ("T", "A") or len(set(tparams)) != len(tparams) \
                or any(p not in TEMPLATE_VALUES for p in rest):
            raise ValueError(f"{filename}: {kernel} has template parameters "
                             f"<{', '.join(tparams)}>; expected T, A, then any of "
                             f"{', '.join(TEMPLATE_VALUES)}")
        for t, a in TYPE_PAIRS:
            for combo in itertools.product(*(TEMPLATE_VALUES[p](t, a) for p in rest)):
                exprs.append(expression(kernel, (t, a) + combo))
    return tuple(exprs)


@functools.lru_cache(maxsize=None)
def deduced_from(filename: str, kernel: str) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """``((template parameter, names of the kernel parameters declared with it), ...)``
    in template order: where a launch can read a template argument from an argument's
    dtype (``I`` from ``I* argmax``), as C++ deduces it."""
    sigs = kernel_signatures(filename)
    if kernel not in sigs:
        raise KeyError(f"{filename} has no kernel {kernel!r} (has: {', '.join(sigs)})")
    tparams, raw = sigs[kernel]
    uses = {t: [] for t in tparams}
    for decl in raw:
        tokens = decl.replace("*", " * ").split()
        for t in set(tokens[:-1]) & set(uses):
            uses[t].append(tokens[-1])
    return tuple((t, tuple(uses[t])) for t in tparams)


def _cuda_header_version(include_dir: str):
    """``(major, minor)`` of the CUDA headers in ``include_dir`` (``CUDART_VERSION`` of
    ``cuda_runtime_api.h``), or None when the directory does not say."""
    try:
        with open(os.path.join(include_dir, "cuda_runtime_api.h"), encoding="utf-8",
                  errors="replace") as f:
            m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    return (int(m.group(1)) // 1000, int(m.group(1)) % 1000 // 10) if m else None


def cuda_include_dirs(nvrtc_major: int = 11) -> List[str]:
    """Directories with a ``cuda_fp16.h`` for NVRTC ``nvrtc_major``.x, best first.

    Only for our own NVRTC path (:mod:`mx_roi.cuda.nvrtc`): ``cupy.RawModule`` adds the
    ``cuda_fp16.h`` CuPy bundles for the NVRTC it loaded, and :func:`module_source`
    adds none, so CuPy's headers always match CuPy's compiler.  Candidates, each kept
    only if its headers are of the same CUDA major version: CuPy's bundled
    ``cupy/_core/include/cupy/_cuda/cuda-<major>``, the ``nvidia-cuda-runtime-cu<major>``
    wheel (``nvidia/cu<major>/include`` for CUDA 13), ``$CUDA_PATH/include``, CuPy 14's
    CUDA root.
    """
    dirs = []
    try:
        import importlib.util
        spec = importlib.util.find_spec("cupy")  # without importing CuPy (needs no driver)
        if spec and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                inc = os.path.join(root, "_core", "include", "cupy", "_cuda",
                                   f"cuda-{nvrtc_major}")
                if os.path.exists(os.path.join(inc, "cuda_fp16.h")):
                    dirs.append(inc)
    except (ImportError, ValueError):  # pragma: no cover
        pass
    candidates = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels
        for r in getattr(nvidia, "__path__", []):  # CUDA 11/12 wheels, and 13's nvidia/cu13
            candidates += [os.path.join(r, "cuda_runtime", "include"),
                           os.path.join(r, f"cu{nvrtc_major}", "include")]
    except ImportError:
        pass
    if os.environ.get("CUDA_PATH"):
        candidates.append(os.path.join(os.environ["CUDA_PATH"], "include"))
    try:  # CuPy 14's CUDA root (where its NVRTC lives): the headers it compiles with
        from cupy import _environment
        root = _environment.get_cuda_path()
        if root:
            candidates.append(os.path.join(root, "include"))
    except Exception:  # noqa: BLE001 - no CuPy, an older one, or no CUDA root
        pass
    for inc in candidates:
        version = _cuda_header_version(inc)
        if (os.path.exists(os.path.join(inc, "cuda_fp16.h")) and version
                and version[0] == nvrtc_major):
            dirs.append(inc)
    return dirs


def module_source(filename: str):
    """``(code, name_expressions, options)`` exactly as ``cupy.RawModule`` gets them.

    No include path: CuPy adds its own ``cuda_fp16.h`` for the NVRTC it uses (our NVRTC
    path adds headers of its own NVRTC's version, :func:`cuda_include_dirs`)."""
    return read_source(filename), name_expressions(filename), NVRTC_OPTIONS


def source_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:24]
