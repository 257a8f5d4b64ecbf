"""Our own disk cache of the GPU binaries (CuPy never reuses its cache with name
expressions, so each process would recompile every source).

No GPU here: :class:`Toolchain` stands in for the four CuPy calls of
``loader.CupyToolchain`` (arch of a device, NVRTC version, compile, load).  It counts
compiles and returns a deterministic fake binary and name map, so what is tested is
exactly our cache logic: the key (source, options, arch, NVRTC version, CuPy version), the
entry format and checksum, the trust checks and the healing.
"""
import hashlib
import json
import os
import sys
import types

import numpy as np
import pytest

from mx_roi.cuda import loader
from mx_roi.cuda import source as S
from mx_roi.ndio import Kind

SRC = "psroi_pooling.cu"


class Toolchain:
    """The four CuPy calls: a "binary" is a hash of its inputs, a module records it."""

    ndarray = np.ndarray

    def __init__(self, arch="80", nvrtc="11.8", version="13.6.0"):
        self.archs, self.nvrtc, self.version = {0: arch, 1: "70"}, nvrtc, version
        self.compiled, self.loaded = [], []

    def arch(self, device_id):
        return self.archs[device_id]

    def nvrtc_version(self):
        return self.nvrtc

    def compile(self, code, options, exprs, arch, device_id, scratch):
        assert os.path.isdir(scratch) and loader.path_problem(scratch, True) == ""
        self.compiled.append((arch, device_id))
        binary = hashlib.sha256(f"{code}{options}{arch}".encode()).digest() * 4
        return Module(binary, device_id), binary, {e: f"_Z{k}mangled" for k, e in
                                                   enumerate(exprs)}

    def load(self, binary, device_id):
        self.loaded.append(device_id)
        return Module(binary, device_id)


class Module:
    def __init__(self, binary, device_id):
        self.binary, self.device_id = binary, device_id

    def get_function(self, mangled):
        return lambda grid, block, args: (mangled, grid, block)


@pytest.fixture
def tc(tmp_path, monkeypatch):
    toolchain = Toolchain()
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_cupy_toolchain", lambda: toolchain)
    monkeypatch.setattr(loader, "_MODULES", {})
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    return toolchain


def fresh_process():
    loader._MODULES.clear()  # what a new process starts with


def entries(tmp_path):
    return sorted(f for f in os.listdir(tmp_path / "cache") if f.endswith(".cubin"))


def test_second_process_loads_without_compiling(tc, tmp_path):
    mod = loader.get_module(SRC, Kind.CUDA, 0)
    assert tc.compiled == [("80", 0)] and tc.loaded == []
    [entry] = entries(tmp_path)
    assert entry.startswith("psroi_pooling-sm80-")
    assert oct(os.stat(tmp_path / "cache" / entry).st_mode & 0o777) == "0o644"
    exprs = S.name_expressions(SRC)
    fresh_process()
    again = loader.get_module(SRC, Kind.CUDA, 0)
    assert tc.compiled == [("80", 0)] and tc.loaded == [0]
    assert again._mangled == mod._mangled == {e: f"_Z{k}mangled" for k, e in enumerate(exprs)}
    assert again._module.binary == mod._module.binary
    # the kernel is looked up by its mangled name
    assert again._module.get_function(again._mangled[exprs[1]])(1, 2, ())[0] == "_Z1mangled"
    # no scratch folder is left behind
    assert sorted(os.listdir(tmp_path / "cache")) == [entry]


@pytest.mark.parametrize("change", ["arch", "nvrtc", "cupy", "options"])
def test_key_covers_arch_nvrtc_cupy_and_options(tc, tmp_path, monkeypatch, change):
    loader.get_module(SRC, Kind.CUDA, 0)
    fresh_process()
    if change == "arch":
        tc.archs[0] = "90"
    elif change == "nvrtc":
        tc.nvrtc = "12.4"
    elif change == "cupy":
        tc.version = "12.3.0"
    else:
        monkeypatch.setattr(S, "NVRTC_OPTIONS", tuple(S.NVRTC_OPTIONS) + ("-DMX_ROI_X=1",))
    loader.get_module(SRC, Kind.CUDA, 0)
    assert len(tc.compiled) == 2 and tc.loaded == []
    assert len(entries(tmp_path)) == 2


def test_compiled_for_the_intended_device(tc, tmp_path):
    """Each device gets the binary of its own arch, compiled now (not lazily later)."""
    loader.get_module(SRC, Kind.CUDA, 1)
    assert tc.compiled == [("70", 1)]
    assert entries(tmp_path)[0].startswith("psroi_pooling-sm70-")
    loader.get_module(SRC, Kind.CUDA, 0)
    assert tc.compiled == [("70", 1), ("80", 0)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "mapping"])
def test_damaged_entry_is_recompiled_once(tc, tmp_path, damage):
    loader.get_module(SRC, Kind.CUDA, 0)
    path = tmp_path / "cache" / entries(tmp_path)[0]
    data = path.read_bytes()
    head, _, binary = data.partition(b"\n")
    if damage == "flip":
        data = head + b"\n" + bytes([binary[0] ^ 1]) + binary[1:]
    elif damage == "truncate":
        data = data[:len(data) - 7]
    elif damage == "garbage":
        data = b"\x00garbage"
    else:  # a name map lacking an expression
        meta = json.loads(head)
        del meta["mapping"][S.name_expressions(SRC)[0]]
        data = json.dumps(meta).encode() + b"\n" + binary
    path.write_bytes(data)
    fresh_process()
    with pytest.warns(loader.CacheWarning, match="recompiling the damaged cache entry"):
        loader.get_module(SRC, Kind.CUDA, 0)
    assert len(tc.compiled) == 2 and tc.loaded == []
    fresh_process()
    loader.get_module(SRC, Kind.CUDA, 0)  # healed: loaded, no third compile
    assert len(tc.compiled) == 2 and tc.loaded == [0]


def test_entry_the_driver_rejects_is_recompiled(tc, tmp_path, monkeypatch):
    loader.get_module(SRC, Kind.CUDA, 0)
    fresh_process()

    def reject(binary, device_id):
        raise RuntimeError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
    monkeypatch.setattr(tc, "load", reject)
    with pytest.warns(loader.CacheWarning, match="CUDA_ERROR_INVALID_IMAGE"):
        loader.get_module(SRC, Kind.CUDA, 0)
    assert len(tc.compiled) == 2


def test_untrusted_entry_and_dir_are_not_loaded(tc, tmp_path, monkeypatch):
    loader.get_module(SRC, Kind.CUDA, 0)
    path = tmp_path / "cache" / entries(tmp_path)[0]
    os.chmod(path, 0o666)  # someone could have written it
    fresh_process()
    with pytest.warns(loader.CacheWarning, match="writable by group or others"):
        loader.get_module(SRC, Kind.CUDA, 0)
    assert len(tc.compiled) == 2 and tc.loaded == []
    # a world-writable cache directory: its entry is never read
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / path.name).write_bytes(path.read_bytes())
    monkeypatch.setenv("MX_ROI_CACHE", str(shared))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(loader.tempfile, "tempdir", None)
    fresh_process()
    with pytest.warns(loader.CacheWarning, match="chmod go-w"):
        loader.get_module(SRC, Kind.CUDA, 0)
    assert len(tc.compiled) == 3 and tc.loaded == []


def test_no_binary_means_no_disk_entry(tc, tmp_path, monkeypatch):
    """CUPY_CACHE_IN_MEMORY=1: CuPy writes no binary; the module still works."""
    real = tc.compile
    monkeypatch.setattr(tc, "compile", lambda *a: real(*a)[:1] + (None,) + real(*a)[2:])
    mod = loader.get_module(SRC, Kind.CUDA, 0)
    assert mod._mangled and entries(tmp_path) == []


def test_cupy_options_add_a_dialect_once():
    opts = loader.cupy_options(SRC)
    assert sum(o.startswith(("-std", "--std")) for o in opts) == 1
    assert not any(o.startswith("-ftz") for o in opts)  # CuPy appends -ftz=true itself


class _Cupy14:
    """CuPy 14's compile seams, as :meth:`loader.CupyToolchain._compile_cupy14` uses them:
    ``cupy._core.core.compile_with_cache`` (no cache folder) reading and writing through
    ``cupy.cuda.compiler``'s process-wide cache backend, whose payload for name
    expressions is a magic, the mangled names, then the binary."""

    MAGIC = b"\x93CUPYNE\x00"

    def __init__(self, monkeypatch, fail=False):
        from cupy._core import core
        from cupy.cuda import compiler
        self.compiler, self.fail, self.foreign = compiler, fail, []
        outer = self

        class Own:  # CuPy's own disk backend: our compile must neither read nor write it
            def load(self, name):
                raise AssertionError("our compile read CuPy's cache")

            def save(self, name, payload, source):
                outer.foreign.append((name, source))

        self.own = Own()
        monkeypatch.setattr(compiler, "_kernel_cache_backend", self.own, raising=False)
        monkeypatch.setattr(compiler, "_set_kernel_cache_backend",
                            lambda b: setattr(compiler, "_kernel_cache_backend", b),
                            raising=False)
        monkeypatch.setattr(compiler, "_decode_cache_payload", self.decode, raising=False)
        monkeypatch.setattr(core, "compile_with_cache", self.compile_with_cache)

    @classmethod
    def decode(cls, payload, count):
        assert payload.startswith(cls.MAGIC)
        names, cubin = payload[len(cls.MAGIC):].split(b"|", 1)
        names = names.decode().split(",")
        return (names, cubin) if len(names) == count else None

    def compile_with_cache(self, source, options=(), arch=None, prepend_cupy_headers=True,
                           name_expressions=None):
        assert prepend_cupy_headers is False and arch == "90"
        backend = self.compiler._kernel_cache_backend
        assert backend.load("our-key") is None  # every entry missing: compiled afresh
        backend.save("other-key", b"other", "a kernel of some other CuPy user")
        if self.fail:
            raise RuntimeError("nvrtc: error")
        mapping = {e: f"_Z{i}" for i, e in enumerate(name_expressions)}
        payload = self.MAGIC + ",".join(mapping.values()).encode() + b"|" + b"CUBIN" + \
            hashlib.sha1(source.encode()).digest()
        backend.save("our-key", payload, "// CuPy's preamble\n" + source)
        return types.SimpleNamespace(mapping=mapping)


def _cupy14_toolchain():
    import contextlib
    tc = loader.CupyToolchain.__new__(loader.CupyToolchain)
    tc.version = "14.2.0"
    tc.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: contextlib.nullcontext()))
    return tc


def test_cupy14_compile_captures_the_binary_and_leaves_cupys_cache_alone(monkeypatch):
    pytest.importorskip("cupy")
    fake = _Cupy14(monkeypatch)
    code, exprs, _ = S.module_source(SRC)
    mod, binary, mapping = _cupy14_toolchain().compile(
        code, loader.cupy_options(SRC), exprs, "90", 0, scratch=None)
    assert binary == b"CUBIN" + hashlib.sha1(code.encode()).digest()
    assert mapping == {e: f"_Z{i}" for i, e in enumerate(exprs)} == mod.mapping
    # the other user's binary went to CuPy's own cache, ours did not; the backend is back
    assert fake.foreign == [("other-key", "a kernel of some other CuPy user")]
    assert fake.compiler._kernel_cache_backend is fake.own


def test_cupy14_backend_restored_when_the_compile_fails(monkeypatch):
    pytest.importorskip("cupy")
    fake = _Cupy14(monkeypatch, fail=True)
    code, exprs, _ = S.module_source(SRC)
    with pytest.raises(RuntimeError, match="nvrtc: error"):
        _cupy14_toolchain().compile(code, loader.cupy_options(SRC), exprs, "90", 0, None)
    assert fake.compiler._kernel_cache_backend is fake.own
