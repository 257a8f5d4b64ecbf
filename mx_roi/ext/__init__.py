"""mx_roi's MXNet extension library: the ops as native MXNet operators (``mx_roi_<Op>``),
no Python in the call, loadable by any MXNet front end (``mx.library.load``, or the C API's
``MXLoadLib`` before ``MXPredCreate``).  ``import mx_roi`` loads it when it is cached
(:func:`load_if_cached`); the first call that wants a native op builds it otherwise
(:mod:`mx_roi.ext.door`: which entry point uses which door).  See docs/native_ops.md.

The library is built with g++ from MXNet's own ``src/lib_api.cc`` (shipped in the mxnet
wheel with ``include/mxnet/lib_api.h``), ``ext_main.cc`` (the error channel, the no-op op
``mx_roi_noop``) and, per op whose ``operators/<op>.cu`` has an ``MX_ROI_EXT_LAUNCHER``
section, that file compiled with the native backend's flags (``loader._host_flags``): the
same kernels, the same geometry kernel and roi check.  It is cached like the host kernel
libraries, in :func:`mx_roi.cuda.loader.cache_dir` under the same rules (a file that is
not ours, group/other-writable, truncated, not ELF, or of another build is never loaded;
it is rebuilt once), named by a hash of every source, the compiler, the flags, the mxnet
version and ``MX_LIBRARY_VERSION``.  Without a compiler nothing fails at import:
:func:`unavailable_reason` says why.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import List, Tuple

from ..cuda import library_calls as _library_calls
from ..cuda import loader
from ..cuda import source as S

__all__ = ["ExtLibraryError", "library_path", "load", "load_if_cached", "loaded_ops",
           "unavailable_reason", "op_sources",
           "mxnet_extension_files", "LAUNCHER_MACRO", "add_safe", "parse_params",
           "callback_timing", "callback_times", "geometry_reuse"]

#: the macro of an op's extension section in its ``.cu`` file
LAUNCHER_MACRO = "MX_ROI_EXT_LAUNCHER"
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES = ("ext_main.cc", "ext_common.h", "ext_launch.h", "py_repr.h")
#: -Bsymbolic: the library's own lib_api.cc symbols bind inside it.  A C/C++ program that
#: links libmxnet.so (or dlopens it RTLD_GLOBAL) exports libmxnet's copies of the same
#: mxnet::ext functions, and without it those would be called from our registration code
#: (seen: a SIGFPE in CustomOp::setBackward at MXLoadLib)
LINK_FLAGS = ("-shared", "-pthread", "-Wl,-Bsymbolic")


class ExtLibraryError(loader.HostLibraryError):
    """The extension library cannot be built or loaded here (the message says why)."""


def mxnet_extension_files() -> Tuple[str, str, str, int]:
    """``(include dir, lib_api.cc, mxnet version, MX_LIBRARY_VERSION)`` of the installed
    mxnet (found without importing it)."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        raise ExtLibraryError("mx_roi.ext needs mxnet installed")
    root = list(spec.submodule_search_locations)[0]
    include = os.path.join(root, "include")
    header = os.path.join(include, "mxnet", "lib_api.h")
    lib_api = os.path.join(root, "src", "lib_api.cc")
    for f in (header, lib_api):
        if not os.path.isfile(f):
            raise ExtLibraryError(f"mx_roi.ext: this mxnet has no extension API ({f} is missing)")
    with open(header, encoding="utf-8") as f:
        m = re.search(r"#define\s+MX_LIBRARY_VERSION\s+(\d+)", f.read())
    if not m:
        raise ExtLibraryError(f"mx_roi.ext: no MX_LIBRARY_VERSION in {header}")
    with open(os.path.join(root, "libinfo.py"), encoding="utf-8") as f:
        v = re.search(r"__version__\s*=\s*[\"']([^\"']+)", f.read())
    return include, lib_api, v.group(1) if v else "unknown", int(m.group(1))


def op_sources() -> List[str]:
    """The registered ops' kernel files that carry an extension section."""
    from .. import registry  # noqa: F401  (registers the ops: S.sources() is then known)
    return [f for f in S.sources() if f"#ifdef {LAUNCHER_MACRO}" in S.read_source(f)]


def _unit_source(filename) -> str:
    """One op's translation unit: its kernel file as the native build reads it
    (roi_common.cuh inlined), wrapped in a namespace of its own, after the headers it
    includes (then no-ops inside the namespace), lib_api.h and ext_common.h.  Every op's
    unit inlines roi_common.cuh and the host shim: without the namespace the linker would
    merge their inline functions and kernels across units (COMDAT), although they read
    the shim's per-unit ``static thread_local`` launch state -- a second op then ran the
    first op's copies, read its channel range and wrote zeros."""
    text = S.read_source(filename)
    launcher = _read(os.path.join(_HERE, "ext_launch.h"))  # (included inside the namespace)
    headers = dict.fromkeys(re.findall(r"^\s*#\s*include\s*<([^>]+)>", text + launcher, re.M))
    prelude = [f"#if __has_include(<{h}>)\n#include <{h}>\n#endif" for h in headers
               if "cuda" not in h]
    unit = "mx_roi_unit_" + re.sub(r"\W", "_", os.path.splitext(filename)[0])
    return "\n".join(prelude + ['#include "mxnet/lib_api.h"',
                                 '#include "ext_common.h"', f"namespace {unit} {{", text,
                                 f"}}  // namespace {unit}", ""])


#: lib_api.cc's one process-wide error list, made one list per thread: MXNet reads a failed
#: callback's messages (_msgSize, then _msgGet(i)) on the thread that called it, while
#: another thread's call may clear or fill the shared list (ext_main.cc's begin_call /
#: set_error): a message of the other call, or a use after free.  tests/test_ext_fuzz.py
#: raises errors from two threads at once.
_ERRORS_SINGLETON = "static MXerrorMsgs inst;"


def _per_thread_errors(text):
    if text.count(_ERRORS_SINGLETON) != 1:
        raise ExtLibraryError("mx_roi.ext: this mxnet's src/lib_api.cc has no "
                              f"'{_ERRORS_SINGLETON}' to make per-thread")
    return text.replace(_ERRORS_SINGLETON, "static thread_local MXerrorMsgs inst;")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _plan():
    """``(library path, {file name: text}, include dir, lib_api.cc, flags)``."""
    cxx = loader.host_compiler()
    if not cxx:
        raise ExtLibraryError("mx_roi.ext needs a C++ compiler (g++ or $CXX) to build the "
                              "extension library; none was found")
    include, lib_api, mx_version, lib_version = mxnet_extension_files()
    flags = loader._host_flags(True)
    files = {name: _read(os.path.join(_HERE, name)) for name in _OWN_FILES}
    from . import unicode_table  # (Python's Unicode tables, for the C++ parser)
    files["lib_api.cc"] = _per_thread_errors(_read(lib_api))
    ops = op_sources()
    for f in ops:
        files[os.path.splitext(f)[0] + ".cpp"] = _unit_source(f)
    # (this file too: it is the build recipe -- the units, the flags, the symbol rules)
    key = S.source_hash(*(f"{n}\0{t}" for n, t in sorted(files.items())), _read(loader.SHIM),
                        _read(os.path.abspath(__file__)),
                        _read(os.path.join(include, "mxnet", "lib_api.h")), _read(lib_api),
                        loader._compiler_id(cxx), " ".join(flags + LINK_FLAGS), mx_version, str(lib_version),
                        sys.platform, unicode_table.key())
    # the library says which build it is (loader._try_load compares it with the name)
    files["ext_main.cc"] += f'\nextern "C" const char mx_roi_build_key[] = "{key}";\n'
    name = f"mx_roi_ext-mx{mx_version}-api{lib_version}-{key}.so"
    return os.path.join(loader.cache_dir(), name), files, include, lib_api, flags, ops


def _compile(lib_path, files, include, lib_api, flags, ops):
    """Compile each translation unit in a private folder next to ``lib_path``, link, and
    rename the library into place atomically (as loader._compile_host)."""
    from .unicode_table import header
    cxx = loader.host_compiler()
    tmpdir = tempfile.mkdtemp(prefix="build-ext-", dir=os.path.dirname(lib_path))
    try:
        for name, text in dict(files, **{"ext_unicode.h": header()}).items():
            with open(os.path.join(tmpdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        shutil.copy(loader.SHIM, os.path.join(tmpdir, "host_shim.h"))
        base = [cxx, *flags, "-I", tmpdir, "-I", include, "-c"]
        units = [(base + [os.path.join(tmpdir, "ext_main.cc")], "ext_main.o"),
                 (base + [os.path.join(tmpdir, "lib_api.cc")], "lib_api.o")]
        for f in ops:
            src = os.path.join(tmpdir, os.path.splitext(f)[0] + ".cpp")
            units.append((base + [f"-D{LAUNCHER_MACRO}", "-include",
                                  os.path.join(tmpdir, "host_shim.h"), "-x", "c++", src],
                          os.path.splitext(f)[0] + ".o"))
        objects = []
        for cmd, obj in units:
            out = os.path.join(tmpdir, obj)
            _run(cmd + ["-o", out])
            if LAUNCHER_MACRO in " ".join(cmd):
                _localize_op_object(out)
            objects.append(out)
        lib = os.path.join(tmpdir, "lib.so")
        _run([cxx, *LINK_FLAGS, *objects, "-o", lib])
        os.chmod(lib, 0o755)
        os.replace(lib, lib_path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _localize_op_object(obj):
    """Make the C entry points that every op's unit defines (roi_common.cuh's
    ``mx_roi_geometry_counts`` ..., ``mx_roi_float_vector_width``) local to ``obj``: the
    library needs none of them from outside the unit, and two ops' units would clash on
    them (C names ignore the unit's namespace, :func:`_unit_source`)."""
    nm, objcopy = shutil.which("nm"), shutil.which("objcopy")
    if not nm or not objcopy:
        raise ExtLibraryError("building mx_roi's extension library needs nm and objcopy "
                              "(binutils) beside the compiler")
    res = subprocess.run([nm, "-g", "--defined-only", obj], capture_output=True, text=True)
    names = sorted({line.split()[-1] for line in res.stdout.splitlines()
                    if line.split() and line.split()[-1].startswith("mx_roi_")})
    if names:
        _run([objcopy, *(f"--localize-symbol={n}" for n in names), obj])


def _run(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ExtLibraryError("building mx_roi's extension library failed:\n"
                              f"{' '.join(cmd)}\n{res.stderr[-4000:]}")


_LOCK = threading.Lock()
_STATE = {"path": None, "failed": None, "loaded": None, "ops": None}


def library_path() -> str:
    """The extension library's path, built (or rebuilt, if the cached file must not be
    loaded) if needed; :class:`ExtLibraryError` says why when it cannot be.  A failure is
    remembered for the process."""
    with _LOCK:
        if _STATE["failed"]:
            raise ExtLibraryError(_STATE["failed"])
        if _STATE["path"]:
            return _STATE["path"]
        try:
            path = _build_checked()
        except ExtLibraryError as exc:
            _STATE["failed"] = str(exc)
            raise
        _STATE["path"] = path
        return path


def _locate_for_the_native_backend() -> str:
    return library_path()  # (looked up per call: tests replace library_path)


# the native backend's calls into the library (mx_roi.cuda.library_calls, a layer below)
_library_calls.set_locator(_locate_for_the_native_backend)


def load_or_build(lib_path: str, build, what: str):
    """The checked library at ``lib_path`` (``loader._try_load``), built by ``build()``
    first when there is none, and rebuilt once when the cached file must not be loaded
    (a warning says why); :class:`ExtLibraryError` names ``what`` if even that fails."""
    lib, why = loader._try_load(lib_path, 0)
    if lib is None:
        if why:
            loader._warn_once(("heal", lib_path), f"mx_roi: rebuilding the damaged cache "
                                                  f"entry {lib_path} ({why})")
            loader._remove(lib_path)
        build()
        lib, why = loader._try_load(lib_path, 0)
        if lib is None:
            raise ExtLibraryError(f"mx_roi's {what} cannot be loaded even after a "
                                  f"rebuild: {why}")
    return lib


def _build_checked() -> str:
    lib_path, files, include, lib_api, flags, ops = _plan()
    lib = load_or_build(lib_path, lambda: _compile(lib_path, files, include, lib_api, flags,
                                                   ops), "extension library")
    # checked; MXNet opens it itself (load).  Closed here so that a later check of the
    # same name reads the file again (the dynamic loader hands out a loaded library by
    # its name, whatever the file now holds)
    loader._dlclose(lib)
    return lib_path


def unavailable_reason() -> str:
    """'' when the extension library can be built and loaded here, else why not."""
    try:
        library_path()
    except ExtLibraryError as exc:
        return str(exc)
    return ""


def load() -> str:
    """Build if needed and load the library into MXNet, once per process; returns its
    path.  Afterwards ``mx.nd.mx_roi_<Op>`` / ``mx.sym.mx_roi_<Op>`` exist.
    :class:`ExtLibraryError` when it cannot be built or loaded.

    MXNet's ``mx.library.load`` would regenerate the Python function of every operator
    (about 0.39 s here, measured: ``MXLoadLib`` itself takes 0.3 ms); this calls
    ``MXLoadLib`` and makes the functions of the library's own operators only
    (:func:`_make_functions`), which lets ``import mx_roi`` load a cached library."""
    path = library_path()
    with _LOCK:
        if _STATE["loaded"] is None:
            import mxnet as mx
            from mxnet.base import _LIB, check_call, c_str, mx_uint
            check_call(_LIB.MXLoadLib(c_str(path), mx_uint(0)))
            _STATE["ops"] = _make_functions(mx)
            _STATE["loaded"] = path
        return _STATE["loaded"]


def load_if_cached() -> bool:
    """:func:`load` when the library of this build is in the cache already (a check and
    ``MXLoadLib``: about 10 ms), else nothing (building takes about 40 s of g++: left to
    the first call that wants a native op).  ``import mx_roi`` calls it."""
    if _STATE["loaded"]:
        return True
    if not os.path.isfile(_plan()[0]):
        return False
    load()
    return True


def loaded_ops() -> frozenset:
    """The operators the loaded library registered (``'mx_roi_ROIAlign'``, ...); empty
    before :func:`load`."""
    return _STATE.get("ops") or frozenset()


def _make_functions(mx) -> frozenset:
    """``mx.nd.<op>`` / ``mx.sym.<op>`` (and ``mxnet.ndarray.op`` / ``mxnet.symbol.op``)
    for every ``mx_roi_*`` operator MXNet now knows, as ``mx.library.load``'s
    ``_init_op_module`` makes them; returns their names."""
    from mxnet.base import _LIB, check_call, c_str, OpHandle, py_str
    from mxnet.ndarray.register import _make_ndarray_function
    from mxnet.symbol.register import _make_symbol_function
    size, plist = ctypes.c_uint(), ctypes.POINTER(ctypes.c_char_p)()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
    names = [py_str(plist[i]) for i in range(size.value)]
    names = frozenset(n for n in names if n.startswith("mx_roi_"))
    for name in names:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        for module, make in (("mxnet.ndarray", _make_ndarray_function),
                             ("mxnet.symbol", _make_symbol_function)):
            function = make(handle, name, name)
            function.__module__ = module
            for target in (sys.modules[module + ".op"], sys.modules[module]):
                setattr(target, name, function)
    _run_in_float32_under_amp(names)
    return names


def _run_in_float32_under_amp(names) -> None:
    """Put the native ops beside ``Custom`` in AMP's float32 lists (float16 and
    bfloat16): ``amp.convert_symbol`` / ``convert_hybrid_block`` then cast their inputs
    to float32, as for the Custom door (unlisted, a native node got a float16 map and
    float32 rois: "rois must have the data's dtype")."""
    from mxnet.contrib.amp.lists import symbol_bf16, symbol_fp16
    for lists in (symbol_fp16, symbol_bf16):
        lists.FP32_FUNCS.extend(n for n in sorted(names) if n not in lists.FP32_FUNCS)


def parse_params(op: str, **kwargs) -> Tuple[bool, str]:
    """The library's parameter parser for ``op`` (e.g. ``'ROIAlign'``) on string values:
    ``(True, 'name=value;...')`` (params.ParamBase.to_kwargs's spelling) or ``(False,
    message)``; for the tests that compare it with :mod:`mx_roi.params`."""
    lib = ctypes.CDLL(library_path())
    fn = lib.mx_roi_ext_parse_params
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                   ctypes.POINTER(ctypes.c_char_p), ctypes.c_char_p, ctypes.c_int]
    keys = (ctypes.c_char_p * max(1, len(kwargs)))(*[k.encode() for k in kwargs])
    vals = (ctypes.c_char_p * max(1, len(kwargs)))(*[str(v).encode() for v in kwargs.values()])
    out = ctypes.create_string_buffer(1 << 16)
    rc = fn(op.encode(), len(kwargs), keys, vals, out, len(out))
    if rc < 0:
        raise ValueError(f"mx_roi_ext_parse_params({op!r}) returned {rc}")
    return rc == 0, out.value.decode()


def _loaded_library() -> ctypes.CDLL:
    """The library MXNet loaded (:func:`load`), opened again by its path: the dynamic
    loader hands out the same loaded object, so its globals are MXNet's."""
    path = _STATE["loaded"]
    if not path:
        raise ExtLibraryError("mx_roi's extension library is not loaded (mx_roi.ext.load())")
    return ctypes.CDLL(path)


def callback_timing(enable: bool) -> None:
    """Start (zeroing the totals) or stop timing the native ops' CPU forward and backward
    callbacks in the loaded library (:func:`callback_times`).  The profiler's time of an
    ``mx_roi_<Op>`` operator minus its callbacks' is MXNet's share of the call: its
    dispatch, and its copy of every input in a oneDNN layout into fresh memory before
    the callback runs."""
    _loaded_library().mx_roi_ext_callback_timing(ctypes.c_int(1 if enable else 0))


def callback_times() -> dict:
    """Totals since :func:`callback_timing` started: ``fwd_ms``, ``fwd_calls``,
    ``bwd_ms``, ``bwd_calls`` (every native op's callbacks, on every thread)."""
    out = (ctypes.c_longlong * 4)()
    _loaded_library().mx_roi_ext_callback_times(out)
    return dict(fwd_ms=out[0] / 1e6, fwd_calls=int(out[1]), bwd_ms=out[2] / 1e6,
                bwd_calls=int(out[3]))


def geometry_reuse() -> dict:
    """How the loaded library's CPU backwards got their tables (the grid or bins the
    forward builds from the rois), counted since it loaded, every native op and thread:
    ``built`` (checked and built again) or ``reused`` (the forward's, kept on its thread:
    the same parameters, data shape and rois, byte for byte, and no tables built since).
    Ops whose kernels read the rois themselves (PrRoIPool, RROIAlign,
    DeformablePSROIPooling) count in neither."""
    out = (ctypes.c_longlong * 2)()
    _loaded_library().mx_roi_ext_geometry_reuse(out)
    return dict(built=int(out[0]), reused=int(out[1]))


def add_safe(x, name=None):
    """``x`` through an identity (``mx.nd.identity`` / ``mx.sym.identity``): feed an
    extension op's differentiable input through it wherever ``grad_req='add'`` can reach
    that input.  MXNet 1.9.1's extension dispatcher (``CustomFComputeDispatcher``) never
    passes ``req`` to the library, so the op always *writes* its input gradient; behind
    the identity it writes a fresh buffer, and the identity's backward adds it to the
    accumulated gradient as ``req`` says.  Cost: one copy forward and one backward.
    ``name``: the identity node's name (symbols)."""
    import mxnet as mx
    if isinstance(x, mx.sym.Symbol):
        return mx.sym.identity(x, **({"name": name} if name else {}))
    return mx.nd.identity(x)
