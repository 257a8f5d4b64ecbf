"""Every CUDA kernel and every instantiated template compiles with NVRTC -- no GPU needed.

NVRTC comes from the ``nvidia-cuda-nvrtc-cu11`` wheel (loaded with ctypes: no driver is
needed to compile to PTX) and ``cuda_fp16.h`` from ``nvidia-cuda-runtime-cu11`` (both in
the ``test`` extra).  The code, name expressions and options are those the CuPy
``RawModule`` gets (:func:`mx_roi.cuda.source.module_source`).  Never skipped: a CPU-only
CI machine must prove the kernels compile.
"""
import functools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from mx_roi.cuda import nvrtc
from mx_roi.cuda import source as S

ARCHS = (70, 80, 90)


@functools.lru_cache(maxsize=None)
def _all_compiled():
    """Compile every (source, arch) once, in parallel threads (NVRTC releases the GIL)."""
    jobs = [(f, a) for f in S.SOURCES for a in ARCHS]
    with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as pool:
        results = list(pool.map(lambda job: nvrtc.compile_source(*job), jobs))
    return dict(zip(jobs, results))


def compiled(filename, arch):
    return _all_compiled()[(filename, arch)]


def test_nvrtc_available_and_supports_archs():
    assert nvrtc.find_library(), "install the test extra: pip install -e '.[test]'"
    major, minor = nvrtc.version()
    assert (major, minor) >= (11, 8)
    archs = nvrtc.supported_archs()
    for a in ARCHS:
        assert a in archs, f"NVRTC {major}.{minor} does not support compute_{a}: {archs}"


def test_fp16_header_from_wheel():
    dirs = S.cuda_include_dirs()
    assert dirs, "cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu11 (test extra)"
    _, _, options = S.module_source("roi_align.cu")
    assert any(o == f"-I{dirs[0]}" for o in options)
    assert "--fmad=false" in options


@pytest.mark.parametrize("arch", ARCHS, ids=[f"compute_{a}" for a in ARCHS])
@pytest.mark.parametrize("filename", S.SOURCES)
def test_compile(filename, arch):
    result = compiled(filename, arch)
    exprs = S.name_expressions(filename)
    assert set(result.lowered) == set(exprs)
    assert re.search(rf"\.target\s+sm_{arch}\b", result.ptx)
    for expr in exprs:
        mangled = result.lowered[expr]
        assert re.search(rf"\.entry\s+{re.escape(mangled)}\s*\(", result.ptx), expr
        # the PTX entry has exactly the parameters the launch glue marshals
        entry = result.ptx.split(f".entry {mangled}(", 1)[1].split(")", 1)[0]
        assert entry.count(".param") == len(S.instantiate(filename, expr).params), expr


def test_every_type_instantiated():
    for filename in S.SOURCES:
        exprs = S.name_expressions(filename)
        for kernel, (tparams, _) in S.kernel_signatures(filename).items():
            for t, a in S.TYPE_PAIRS:
                if len(tparams) == 2:
                    assert S.expression(kernel, (t, a)) in exprs
                else:
                    assert S.expression(kernel, (t, a, a)) in exprs
                    assert S.expression(kernel, (t, a, S.FIXED)) in exprs


def test_fixed_point_backward_uses_integer_atomics():
    """Deterministic instantiations accumulate with 64-bit integer atomics only."""
    result = compiled("roi_align.cu", 80)
    bodies = re.split(r"\.entry\s+", result.ptx)[1:]
    by_name = {b.split("(", 1)[0]: b for b in bodies}
    for expr, mangled in result.lowered.items():
        if "backward" not in expr:
            continue
        body = by_name[mangled]
        atomics = set(re.findall(r"\b(?:atom|red)\.global\.add\.(\w+)", body))
        if S.FIXED in expr:
            assert atomics == {"u64"}, (expr, atomics)
        else:
            assert atomics and "u64" not in atomics, (expr, atomics)


def test_signatures_parsed():
    for filename in S.SOURCES:
        for expr in S.name_expressions(filename):
            sig = S.instantiate(filename, expr)
            assert sig.params[-1].name == "n" and sig.params[-1].ctype == "long long"
            assert any(p.pointer and not p.decl.startswith("const") for p in sig.params)


def test_compile_error_is_reported():
    with pytest.raises(nvrtc.NvrtcError, match="undeclared|identifier"):
        nvrtc.compile_ptx("__global__ void k() { undeclared_thing = 1; }", "bad.cu", [],
                          ("--gpu-architecture=compute_70",))
