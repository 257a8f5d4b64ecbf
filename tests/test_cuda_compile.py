"""Every CUDA kernel and every instantiated template compiles with NVRTC -- no GPU needed.

NVRTC comes from the ``nvidia-cuda-nvrtc-cu11`` wheel (loaded with ctypes: no driver is
needed to compile to PTX) and ``cuda_fp16.h`` from a directory of the same CUDA major
version (CuPy's bundled copy or ``nvidia-cuda-runtime-cu11``, both installed by the
``test`` extra).  The code, name expressions and options are those the CuPy ``RawModule``
gets (:func:`mx_roi.cuda.source.module_source`).  Never skipped: a CPU-only CI machine
must prove the kernels compile, from Maxwell (sm_52: no double ``atomicAdd``, a
compare-and-swap loop instead) to Hopper (sm_90).
"""
import functools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from mx_roi.cuda import nvrtc
from mx_roi.cuda import source as S

ARCHS = (52, 61, 70, 75, 80, 86, 90)
#: the default run compiles every source for these and roi_align.cu for every arch; the
#: rest of the (source, arch) matrix is marked slow (make test runs it)
FAST_ARCHS = (52, 70, 90)


def _fast(filename, arch):
    return arch in FAST_ARCHS or filename == "roi_align.cu"


@functools.lru_cache(maxsize=None)
def _fast_compiled():
    """Compile the default run's (source, arch) pairs once, in parallel threads (NVRTC
    releases the GIL)."""
    jobs = [(f, a) for f in S.sources() for a in ARCHS if _fast(f, a)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: nvrtc.compile_source(*job), jobs))
    return dict(zip(jobs, results))


@functools.lru_cache(maxsize=None)
def compiled(filename, arch):
    if _fast(filename, arch):
        return _fast_compiled()[(filename, arch)]
    return nvrtc.compile_source(filename, arch)


def test_nvrtc_available_and_supports_archs():
    assert nvrtc.find_library(), "install the test extra: pip install -e '.[test]'"
    major, minor = nvrtc.version()
    assert (major, minor) >= (11, 8)
    archs = nvrtc.supported_archs()
    for a in ARCHS:
        assert a in archs, f"NVRTC {major}.{minor} does not support compute_{a}: {archs}"


def test_fp16_header_matches_nvrtc():
    """Our NVRTC path includes a ``cuda_fp16.h`` of its own NVRTC's major version; the
    RawModule options carry no include path (CuPy adds the headers of its NVRTC)."""
    major = nvrtc.version()[0]
    dirs = S.cuda_include_dirs(major)
    assert dirs, "cuda_fp16.h not found: pip install nvidia-cuda-runtime-cu11 (test extra)"
    assert nvrtc.include_options() == (f"-I{dirs[0]}",)
    for d in dirs:
        assert d.endswith(f"cuda-{major}") or S._cuda_header_version(d)[0] == major, d
    assert S.cuda_include_dirs(major + 7) == []   # no headers of another major version
    _, _, options = S.module_source("roi_align.cu")
    assert not any(o.startswith("-I") for o in options), options
    assert "--fmad=false" in options
    assert "--std=c++11" in options   # CuPy 12 refuses template code without a --std


@pytest.mark.parametrize("filename, arch", [
    pytest.param(f, a, id=f"{f}-compute_{a}", marks=() if _fast(f, a) else pytest.mark.slow)
    for f in S.sources() for a in ARCHS])
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
    values = {"O": lambda t, a: (a, S.FIXED), "I": lambda t, a: S.INDEX_TYPES}
    for filename in S.sources():
        exprs = S.name_expressions(filename)
        for kernel, (tparams, _) in S.kernel_signatures(filename).items():
            assert tparams[:2] == ("T", "A"), (kernel, tparams)
            for t, a in S.TYPE_PAIRS:
                want = [(t, a)]
                for p in tparams[2:]:
                    want = [w + (v,) for w in want for v in values[p](t, a)]
                for targs in want:
                    assert S.expression(kernel, targs) in exprs
    # the max kernels store their argmax in each index type
    exprs = S.name_expressions("roi_pooling.cu") + S.name_expressions("roi_align.cu")
    for kernel in ("roi_pooling_forward", "roi_align_forward_max"):
        for i in ("unsigned char", "unsigned short", "unsigned int"):
            assert S.expression(kernel, ("float", "float", i)) in exprs
    for kernel in ("roi_pooling_backward", "roi_align_backward_max"):
        for i in ("unsigned char", "unsigned short", "unsigned int"):
            assert S.expression(kernel, ("__half", "float", S.FIXED, i)) in exprs


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


def test_double_atomics_below_sm60_use_compare_and_swap():
    """sm_52 has no ``atomicAdd(double*, double)``: the plain double backward falls back to
    a 64-bit compare-and-swap loop there, and uses the native ``add.f64`` from sm_60 on."""
    for arch, want, unwanted in ((52, "cas.b64", "add.f64"), (61, "add.f64", "cas.b64")):
        result = compiled("roi_align.cu", arch)
        bodies = {b.split("(", 1)[0]: b for b in re.split(r"\.entry\s+", result.ptx)[1:]}
        plain_double = [e for e in result.lowered if "<double, double, double" in e]
        # backward_avg, backward_max x 3 argmax index types, backward_max_rescan
        assert len(plain_double) == 5, plain_double
        for expr in plain_double:
            body = bodies[result.lowered[expr]]
            ops = set(re.findall(r"\b(?:atom|red)\.global\.(\w+\.\w+)", body))
            assert want in ops and unwanted not in ops, (arch, expr, ops)


def test_signatures_parsed():
    for filename in S.sources():
        for expr in S.name_expressions(filename):
            sig = S.instantiate(filename, expr)
            assert sig.params[-1].name == "n" and sig.params[-1].ctype == "long long"
            assert any(p.pointer and not p.decl.startswith("const") for p in sig.params)


def test_compile_error_is_reported():
    with pytest.raises(nvrtc.NvrtcError, match="undeclared|identifier"):
        nvrtc.compile_ptx("__global__ void k() { undeclared_thing = 1; }", "bad.cu", [],
                          ("--gpu-architecture=compute_70",))
