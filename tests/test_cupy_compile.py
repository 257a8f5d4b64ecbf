"""Every kernel source compiles through CuPy's own compile pipeline -- no GPU, no driver.

``cupy.RawModule(code, options, name_expressions)`` (what :mod:`mx_roi.cuda.loader` creates
from :func:`mx_roi.cuda.source.module_source`) compiles, on first use, through
``cupy._core.core.compile_with_cache`` -> ``cupy.cuda.compiler._compile_module_with_cache``
(adds ``-ftz=true`` and CuPy's include paths, picks ``-arch=sm_XX``, compiles with NVRTC to
a cubin, maps each name expression to its mangled name) and finally loads the cubin.
Here that pipeline runs in a child process for sm_52 ... sm_90, with three stand-ins for
what needs a driver:

1. ``compiler._get_arch_for_options_for_nvrtc`` runs its own body without CuPy's
   per-device memo (the memo asks the CUDA runtime for the current device);
2. ``compiler.function.Module`` records the cubin instead of ``cuModuleLoadData``;
3. CuPy's NVRTC binding asks the CUDA runtime for its version (CuPy 13 before opening
   ``libnvrtc.so.11.2``, CuPy 12 in ``getCUBIN``), so ``compiler.nvrtc`` is a ctypes
   binding of the same library making the same calls.

The Cython front (``core.compile_with_cache``, which also asks the runtime) is the one
step reproduced here: it appends CuPy's include directories (``-I`` its headers, its
bundled ``cuda_fp16.h`` for the NVRTC major version, ``$CUDA_PATH/include``) and, in CuPy 13,
a ``--std`` only if none is given -- ours always has one.  Everything else is CuPy's code.
Checked per (source, arch): the cubin is an ELF for that SM, every name expression maps to
a function symbol in its symbol table, and NVRTC saw our options, CuPy's ``-ftz=true`` and
CuPy's bundled ``cuda_fp16.h`` and no other copy.  The child also proves the ``libnvrtc``
preload that makes the wheel's NVRTC visible to CuPy (no ``LD_LIBRARY_PATH``).

Run by hand against another CuPy: ``python tests/test_cupy_compile.py roi_align.cu:52
roi_align.cu:70`` prints the JSON report of the child.  CuPy 12.3 was checked that way
(every source, sm_52 ... sm_90: passes; without ``--std`` its ``RawModule`` refuses the
sources): ``pip install --target /tmp/cupy12 cupy-cuda11x==12.3.0 --no-deps``; CuPy 12
links ``libcuda.so.1``, cuBLAS, cuFFT, cuRAND, cuSPARSE at import, so empty libraries of
those names (``gcc -shared -fPIC -o libcuda.so.1 empty.c -Wl,-soname,libcuda.so.1``, ...)
go on ``LD_LIBRARY_PATH`` with the runtime wheel's ``nvidia/cuda_runtime/lib``, and the
child is started after ``sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)`` with
``/tmp/cupy12`` first on ``PYTHONPATH``.
"""
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = (52, 61, 70, 75, 80, 86, 90)
EM_CUDA = 190


# --------------------------------------------------------------------------- the child
class _CtypesNvrtc(types.ModuleType):
    """The calls ``cupy.cuda.compiler`` makes on ``cupy_backends.cuda.libs.nvrtc``, over
    the same ``libnvrtc`` through ctypes (stand-in 3 above)."""

    class NVRTCError(RuntimeError):
        pass

    def __init__(self):
        super().__init__("nvrtc")
        from mx_roi.cuda import nvrtc
        self._lib = nvrtc.load()
        self._keep = {}

    def _check(self, status):
        if status != 0:
            raise self.NVRTCError(self._lib.nvrtcGetErrorString(status).decode())

    def getVersion(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        return major.value, minor.value

    def createProgram(self, src, name, headers, include_names):
        assert not headers and not include_names  # only jitify passes headers
        prog = ctypes.c_void_p()
        self._check(self._lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(),
                                                 name.encode(), 0, None, None))
        return prog.value

    def destroyProgram(self, prog):
        self._check(self._lib.nvrtcDestroyProgram(ctypes.byref(ctypes.c_void_p(prog))))

    def addNameExpression(self, prog, name):
        self._check(self._lib.nvrtcAddNameExpression(prog, name.encode()))

    def compileProgram(self, prog, options):
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        self._check(self._lib.nvrtcCompileProgram(prog, len(options), opts))

    def getLoweredName(self, prog, name):
        out = ctypes.c_char_p()
        self._check(self._lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)))
        return out.value.decode()

    def _get(self, prog, what):
        size = ctypes.c_size_t()
        self._check(getattr(self._lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        self._check(getattr(self._lib, f"nvrtcGet{what}")(prog, buf))
        return buf.raw

    def getProgramLog(self, prog):
        return self._get(prog, "ProgramLog").rstrip(b"\0").decode(errors="replace")

    def getCUBIN(self, prog):
        return self._get(prog, "CUBIN")

    def getPTX(self, prog):
        return self._get(prog, "PTX").rstrip(b"\0")


def _install_stand_ins(seen_options):
    """Stand-ins 1-3; NVRTC's options of every compile are appended to ``seen_options``."""
    import cupy.cuda.compiler as compiler
    from cupy.cuda import function

    binding = _CtypesNvrtc()

    class Recording(types.ModuleType):
        def __getattr__(self, name):
            return getattr(binding, name)

        def compileProgram(self, prog, options):
            seen_options.append(tuple(options))
            return binding.compileProgram(prog, options)

    compiler.nvrtc = Recording("nvrtc")
    compiler._nvrtc_version = None
    compiler._get_arch_for_options_for_nvrtc = \
        compiler._get_arch_for_options_for_nvrtc.__wrapped__

    class RecordedModule(function.Module):
        def load(self, cubin):  # instead of cuModuleLoadData
            self.cubin = bytes(cubin)

        def _set_mapping(self, mapping):
            self.recorded_mapping = dict(mapping)

    compiler.function = types.SimpleNamespace(Module=RecordedModule,
                                              LinkState=function.LinkState)
    return binding


def _cupy_front_options(options, nvrtc_major):
    """What ``core.compile_with_cache`` appends before handing over to the compiler (the
    reproduced step; see the module docstring)."""
    import cupy
    core = cupy._core.core
    assert any(o.startswith(("-std=", "--std=")) for o in options), options
    header_dir = core._get_header_dir_path()
    if hasattr(core, "_get_cccl_include_options"):  # CuPy 13: bundled CCCL searched first
        options = tuple(core._get_cccl_include_options()) + tuple(options)
    options = tuple(options) + (f"-I{header_dir}",
                                f"-I{os.path.join(header_dir, 'cupy', '_cuda', f'cuda-{nvrtc_major}')}")
    cuda_path = cupy.cuda.get_cuda_path()
    if cuda_path:
        options += (f"-I{os.path.join(cuda_path, 'include')}",)
    return options


def child(jobs):
    """Compile each ``(source, arch)`` of ``jobs`` through CuPy's pipeline; a JSON-able
    report."""
    from mx_roi.cuda import nvrtc as our_nvrtc
    try:
        ctypes.CDLL("libnvrtc.so.11.2", mode=os.RTLD_NOLOAD)
        report = {"loaded_before": True}
    except OSError:
        report = {"loaded_before": False}
    try:  # a CUDA toolkit on the loader path would do without the preload
        report["loadable_before"] = subprocess.run(
            [sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvrtc.so.11.2')"],
            capture_output=True).returncode == 0
    except OSError:  # pragma: no cover
        report["loadable_before"] = None
    report["preload"] = our_nvrtc.preload_for_cupy(11)
    ctypes.CDLL("libnvrtc.so.11.2")  # what CuPy 13 dlopens: found now, by name
    import cupy
    import cupy.cuda.compiler as compiler
    from mx_roi.cuda import source as S
    report["cupy"] = cupy.__version__
    seen = []
    _install_stand_ins(seen)
    major, minor = compiler._get_nvrtc_version()
    report["nvrtc"] = [major, minor]
    out = report["compiled"] = {}
    for filename, arch in jobs:
        code, exprs, options = S.module_source(filename)
        # RawModule's own argument checks (CuPy 12 refuses templates without --std here)
        cupy.RawModule(code=code, options=tuple(options), name_expressions=list(exprs))
        del seen[:]
        mod = compiler._compile_module_with_cache(
            code, _cupy_front_options(tuple(options), major), str(arch), None,
            cupy._core.core._get_header_source(), "nvrtc", name_expressions=tuple(exprs))
        out[f"{filename}:{arch}"] = {"mapping": mod.recorded_mapping,
                                     "options": list(seen[-1]), **elf_info(mod.cubin)}
    return report


def elf_info(blob):
    """Machine, SM (``e_flags & 0xff``) and function symbols of an ELF64 cubin."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        return {"machine": None, "sm": None, "functions": []}
    machine, = struct.unpack_from("<H", blob, 18)
    shoff, = struct.unpack_from("<Q", blob, 40)
    flags, = struct.unpack_from("<I", blob, 48)
    shentsize, shnum = struct.unpack_from("<HH", blob, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize)
                for i in range(shnum)]
    functions = []
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_off, info = struct.unpack_from("<IB", blob, off)
            if info & 0xF == 2:  # STT_FUNC
                start = strtab[4] + name_off
                functions.append(blob[start:blob.index(b"\0", start)].decode())
    return {"machine": machine, "sm": flags & 0xFF, "functions": functions}


# --------------------------------------------------------------------------- the tests
def _run_child(jobs, pythonpath=()):
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)  # the preload must do it
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, ROOT])
    with tempfile.TemporaryDirectory() as cache:
        env["CUPY_CACHE_DIR"] = cache
        res = subprocess.run(
            [sys.executable, os.path.abspath(__file__)] + [f"{f}:{a}" for f, a in jobs],
            capture_output=True, text=True, env=env, cwd=ROOT,
            timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _check_report(report, jobs):
    import cupy
    from mx_roi.cuda import source as S
    header_dir = cupy._core.core._get_header_dir_path()
    bundled = f"-I{os.path.join(header_dir, 'cupy', '_cuda', 'cuda-11')}"
    # the preload loads the wheel's libnvrtc exactly when CuPy could not find one by name
    assert not report["loaded_before"]
    if report["loadable_before"]:
        assert report["preload"] == ""
    else:
        from mx_roi.cuda import nvrtc
        assert report["preload"] == nvrtc.wheel_library("libnvrtc.so.11.2") is not None
    assert report["nvrtc"][0] == 11
    assert sorted(report["compiled"]) == sorted(f"{f}:{a}" for f, a in jobs)
    for filename, arch in jobs:
        exprs = S.name_expressions(filename)
        got = report["compiled"][f"{filename}:{arch}"]
        assert got["machine"] == EM_CUDA and got["sm"] == arch, (filename, arch, got["sm"])
        assert set(got["mapping"]) == set(exprs)
        missing = [e for e in exprs if got["mapping"][e] not in got["functions"]]
        assert not missing, (filename, arch, missing)
        opts = got["options"]
        for o in (*S.NVRTC_OPTIONS, "-ftz=true", f"-arch=sm_{arch}", bundled):
            assert o in opts, (o, opts)
        other = [o for o in opts if o.startswith("-I") and "nvidia" in o]
        assert not other, f"a cuda_fp16.h other than CuPy's on its path: {other}"


#: the default run: every source for sm_70, roi_align.cu also for sm_52 and sm_90 (about
#: 2 s of CPU per compile); the rest of the matrix is marked slow (make test runs it)
FAST = tuple((f, 70) for f in ("roi_pooling.cu", "roi_align.cu", "psroi_pooling.cu",
                               "psroi_align.cu")) + (("roi_align.cu", 52), ("roi_align.cu", 90))


def test_cupy_compile_every_source():
    """Every source through CuPy's compile path (sm_70), roi_align.cu for sm_52/90 too."""
    report = _run_child(FAST)
    _check_report(report, FAST)


@pytest.mark.slow
def test_cupy_compile_every_arch():
    """Every source for sm_70 and sm_90 (Hopper: the lent devices), roi_align.cu for
    every other arch: CuPy's pipeline on each arch.  NVRTC's side of the whole (source,
    arch) matrix is tests/test_cuda_compile.py's (PTX; its other 30 cubins here would add
    about two minutes of CI and no other step)."""
    from mx_roi.cuda import source as S
    pairs = [(f, a) for f in S.sources() for a in (70, 90)] + \
        [("roi_align.cu", a) for a in ARCHS]
    rest = [job for job in dict.fromkeys(pairs) if job not in FAST]
    _check_report(_run_child(rest), rest)


def test_elf_reader_rejects_non_elf():
    assert elf_info(b"// PTX text") == {"machine": None, "sm": None, "functions": []}


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(child([(j.split(":")[0], int(j.split(":")[1])) for j in sys.argv[1:]])))
