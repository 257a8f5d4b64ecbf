"""The GPU-setup diagnosis and the first-GPU-run checklist of ``python -m mx_roi.selftest``.

No GPU here: missing pieces are simulated by a :class:`mx_roi.gpucheck.Probe` whose answers
are replaced (the machine queries are the only thing stubbed); the checklist's host steps
really run, and its GPU steps must be reported as SKIP with their reason.
"""
import re

import pytest

from mx_roi import gpucheck, selftest

REAL_DIAGNOSE = gpucheck.diagnose

MISSING = {
    "driver": "no NVIDIA driver: libcuda.so.1 not loadable",
    "mxnet": "mxnet 1.9.1 is a CPU build",
    "cupy": "CuPy not importable (ImportError: No module named 'cupy')",
    "nvrtc": "libnvrtc.so.11.2 is neither on the loader path nor in a wheel",
    "headers": "no cuda_fp16.h for NVRTC 11.8",
}


class FakeProbe(gpucheck.Probe):
    """Answers ``(False, MISSING[name])`` for the pieces in ``missing``, OK otherwise."""

    def __init__(self, missing=(), broken=()):
        self.missing, self.broken = set(missing), set(broken)

    def _answer(self, name):
        if name in self.broken:
            raise RuntimeError(f"probe {name} crashed")
        return (False, MISSING[name]) if name in self.missing else (True, f"{name} fine")

    def driver(self):
        return self._answer("driver")

    def mxnet(self):
        return self._answer("mxnet")

    def cupy(self):
        return self._answer("cupy")

    def nvrtc(self):
        return self._answer("nvrtc")

    def headers(self):
        return self._answer("headers")


@pytest.mark.parametrize("name", sorted(MISSING))
def test_each_missing_piece_named_with_its_fix(name):
    pieces = {p.name: p for p in gpucheck.diagnose(FakeProbe(missing={name}))}
    assert list(pieces) == ["driver", "mxnet", "cupy", "nvrtc", "headers"]
    assert not pieces[name].ok
    assert pieces[name].detail == MISSING[name]
    assert pieces[name].fix == gpucheck.FIX[name]
    assert all(p.ok and p.fix == "" for n, p in pieces.items() if n != name)


def test_fix_commands():
    assert "nvidia-smi" in gpucheck.FIX["driver"]
    assert "pip install mxnet-cu112==1.9.1" in gpucheck.FIX["mxnet"]
    assert 'pip install "cupy-cuda11x>=12,<14"' == gpucheck.FIX["cupy"]
    assert "pip install nvidia-cuda-nvrtc-cu11" in gpucheck.FIX["nvrtc"]
    assert "LD_LIBRARY_PATH" in gpucheck.FIX["nvrtc"]
    assert "pip install nvidia-cuda-runtime-cu11" in gpucheck.FIX["headers"]


def test_supported_cupy_range_is_the_one_setup_py_installs():
    import os
    setup_py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "setup.py")
    with open(setup_py, encoding="utf-8") as f:
        text = f.read()
    assert f'CUPY = "{gpucheck.CUPY_REQUIREMENT}"' in text
    assert gpucheck.CUPY_REQUIREMENT.endswith(">=12,<14")
    # the range the GPU path runs on: 12 and 13, and 14 (CUDA 12/13)
    assert gpucheck.CUPY_RANGE == ((12, 0), (15, 0))


def test_crashing_probe_is_reported_not_raised():
    pieces = {p.name: p for p in gpucheck.diagnose(FakeProbe(broken={"cupy"}))}
    assert not pieces["cupy"].ok
    assert pieces["cupy"].detail == "RuntimeError: probe cupy crashed"
    assert pieces["nvrtc"].ok  # the diagnosis went on


def test_real_probes_for_what_the_test_extra_installs():
    """CuPy, its NVRTC (by name, or the wheel mx_roi preloads) and cuda_fp16.h are found
    on any machine with the test extra, GPU or not."""
    probe = gpucheck.Probe()
    ok, detail = probe.cupy()
    assert ok and re.fullmatch(r"CuPy 1[23]\.\d+\.\d+", detail), detail
    ok, detail = probe.nvrtc()
    assert ok and "libnvrtc.so.11.2" in detail, detail
    ok, detail = probe.headers()
    assert ok and detail.startswith("cuda_fp16.h for NVRTC 11."), detail


def test_real_driver_probe_without_a_driver():
    ok, detail = gpucheck.Probe().driver()
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert not ok and detail.startswith("no NVIDIA driver: libcuda.so.1 not loadable")
    else:  # pragma: no cover (a GPU machine)
        assert isinstance(ok, bool) and detail


@pytest.fixture(scope="module")
def host_steps():
    """The checklist on this machine, the GPU setup simulated as missing."""
    pieces = gpucheck.diagnose(FakeProbe(missing={"driver", "mxnet"}))
    return gpucheck.checklist(pieces, sanitizer="")


def test_checklist_runs_host_parts_and_skips_gpu_parts(host_steps):
    by = {(s.name, s.where): s for s in host_steps}
    assert set(by) == {
        ("sanitizer", "gpu"), ("emulated references", "host"),
        ("grad bits = emulation", "gpu"), ("forward bits = emulation", "gpu"),
        ("grid-stride wrap", "host"), ("grid-stride wrap", "gpu"), ("device 1", "gpu"),
        ("memory after training", "gpu")}
    for s in host_steps:
        if s.where == "host":
            assert s.status == "PASS", s
        else:
            assert s.status == "SKIP", s
    # MXNet's CUDA build is not one of the kernels' needs (CuPy arrays stand in for its)
    reason = "GPU setup incomplete (driver missing; see the diagnosis)"
    assert by[("sanitizer", "gpu")].detail == reason
    assert by[("memory after training", "gpu")].detail == reason
    assert by[("device 1", "gpu")].detail == "needs two GPUs (0 visible)"
    assert str(gpucheck.GRID_WRAP_ITEMS) in by[("grid-stride wrap", "host")].detail
    assert gpucheck.GRID_WRAP_ITEMS > 65535 * 256
    # every op's selftest cases x 3 dtypes, the max modes again with the rescanning backward
    from mx_roi import selftest
    n = 3 * sum(len(selftest.rescan_variants(*c)) for c in selftest.CASES)
    assert by[("emulated references", "host")].detail.startswith(f"{n} op x dtype")


def test_checklist_skip_reasons_with_setup_complete_but_no_gpu(monkeypatch):
    monkeypatch.setattr(gpucheck, "_emulated_references", lambda: "stubbed")
    monkeypatch.setattr(gpucheck, "_grid_wrap", lambda *a: "stubbed")
    steps = gpucheck.checklist(gpucheck.diagnose(FakeProbe()), gpus=0, sanitizer="")
    skips = {s.name: s.detail for s in steps if s.status == "SKIP"}
    assert skips["sanitizer"] == "no GPU visible"
    assert skips["device 1"] == "needs two GPUs (0 visible)"


def test_sanitizer_reason_when_the_tool_is_missing(monkeypatch):
    monkeypatch.setattr(gpucheck, "_emulated_references", lambda: "stubbed")
    monkeypatch.setattr(gpucheck, "_grid_wrap", lambda *a: "stubbed")
    # gpus=1 with everything GPU-side replaced: only the sanitizer's own reason is left
    for name in ("_against_emulation", "_memory"):
        monkeypatch.setattr(gpucheck, name, lambda *a: "ran")
    steps = gpucheck.checklist(gpucheck.diagnose(FakeProbe()), gpus=1, sanitizer="")
    by = {s.name: s for s in steps if s.where == "gpu"}
    assert by["sanitizer"].status == "SKIP"
    assert by["sanitizer"].detail.startswith("compute-sanitizer not found")
    assert by["memory after training"].status == "PASS"
    assert by["device 1"].detail == "needs two GPUs (1 visible)"


def _main(monkeypatch, capsys, argv, steps, missing=("driver", "mxnet"), backend="PASS"):
    monkeypatch.setattr(selftest, "run_checks", lambda **kw: [
        ("numpy", backend, 0.0, "stand-in row"), ("cuda", "SKIP", 0.0, "no GPU")])
    monkeypatch.setattr(gpucheck, "diagnose",
                        lambda probe=None: REAL_DIAGNOSE(FakeProbe(missing=missing)))
    monkeypatch.setattr(gpucheck, "checklist", lambda pieces: steps)
    rc = selftest.main(argv)
    return rc, capsys.readouterr().out


def test_selftest_exit_codes(monkeypatch, capsys, host_steps):
    rc, out = _main(monkeypatch, capsys, ["--gpu"], host_steps)
    assert rc == 0, out
    assert "OK: every usable backend passed (numpy); GPU setup incomplete (driver, mxnet)" \
        in out
    assert f"fix:     {gpucheck.FIX['driver']}" in out
    assert f"fix:     {gpucheck.FIX['mxnet']}" in out
    assert re.search(r"device 1\s+gpu\s+SKIP\s+needs two GPUs \(0 visible\)", out), out
    assert re.search(r"grid-stride wrap\s+host\s+PASS", out), out

    rc, out = _main(monkeypatch, capsys, ["--gpu", "--require-gpu"], host_steps)
    assert rc == 1 and "FAILED (--require-gpu): GPU setup missing: driver, mxnet" in out

    rc, out = _main(monkeypatch, capsys, ["--gpu", "--require-gpu"], host_steps, missing=())
    assert rc == 1 and "FAILED (--require-gpu): GPU steps skipped: sanitizer" in out

    failing = host_steps + [gpucheck.Step("memory after training", "gpu", "FAIL", "grew")]
    rc, out = _main(monkeypatch, capsys, ["--gpu"], failing)
    assert rc == 1 and "FAILED: memory after training (gpu)" in out

    rc, out = _main(monkeypatch, capsys, [], host_steps, backend="FAIL")
    assert rc == 1 and "FAILED: numpy" in out
    assert "GPU checklist" not in out  # the checklist only with --gpu


def test_kernel_steps_run_without_mxnets_cuda_build(monkeypatch):
    """MXNet's CUDA build is not a kernel need: with it missing and a GPU that CuPy sees,
    the GPU steps run (on CuPy arrays), and only the setup line names mxnet."""
    monkeypatch.setattr(gpucheck, "_emulated_references", lambda: "stubbed")
    monkeypatch.setattr(gpucheck, "_grid_wrap", lambda *a: "ran")
    for name in ("_against_emulation", "_memory", "_sanitize"):
        monkeypatch.setattr(gpucheck, name, lambda *a: "ran")
    monkeypatch.setattr(gpucheck, "mxnet_gpu_count", lambda: 0)
    monkeypatch.setattr(gpucheck, "cupy_gpu_count", lambda: 1)
    pieces = gpucheck.diagnose(FakeProbe(missing={"mxnet"}))
    steps = gpucheck.checklist(pieces, sanitizer="/usr/local/cuda/bin/compute-sanitizer")
    status = {(s.name, s.where): s.status for s in steps}
    assert status.pop(("device 1", "gpu")) == "SKIP"
    assert set(status.values()) == {"PASS"}, steps
    # and no GPU step runs when a kernel piece is missing
    for piece in gpucheck.KERNEL_PIECES:
        steps = gpucheck.checklist(gpucheck.diagnose(FakeProbe(missing={piece, "mxnet"})),
                                   sanitizer="x")
        skips = {s.detail for s in steps if s.where == "gpu" and s.name != "device 1"}
        assert skips == {f"GPU setup incomplete ({piece} missing; see the diagnosis)"}


def test_gpu_context_prefers_mxnet_then_cupy_arrays(monkeypatch):
    import mxnet as mx
    monkeypatch.setattr(gpucheck, "mxnet_gpu_count", lambda: 1)
    monkeypatch.setattr(gpucheck, "cupy_gpu_count", lambda: 1)
    ctx = gpucheck.gpu_context(0)
    assert ctx == mx.gpu(0) and not gpucheck.is_standin(ctx)
    monkeypatch.setattr(gpucheck, "mxnet_gpu_count", lambda: 0)
    with pytest.raises(RuntimeError, match=r"^no GPU 1 visible to MXNet or CuPy$"):
        gpucheck.gpu_context(1)
    pytest.importorskip("cupy")
    ctx = gpucheck.gpu_context(0)
    assert gpucheck.is_standin(ctx) and ctx.device_id == 0 and repr(ctx) == "cupy-gpu(0)"


def test_selftest_says_the_kernels_ran_on_cupy_arrays(monkeypatch, capsys, host_steps):
    """MXNet's CPU build with a working GPU row: not "the GPU path is not usable"."""
    monkeypatch.setattr(selftest, "run_checks", lambda **kw: [
        ("numpy", "PASS", 0.0, "row"), ("cuda", "PASS", 0.0, "on CuPy arrays")])
    monkeypatch.setattr(gpucheck, "diagnose",
                        lambda probe=None: REAL_DIAGNOSE(FakeProbe(missing={"mxnet"})))
    monkeypatch.setattr(gpucheck, "checklist", lambda pieces: host_steps)
    assert selftest.main(["--gpu"]) == 0
    out = capsys.readouterr().out
    assert "GPU checklist (docs/gpu.md, 'The first-run checklist')" in out
    assert out.rstrip().endswith(
        "OK: every usable backend passed (numpy, cuda); MXNet is a CPU build: the GPU kernels "
        "ran on CuPy arrays (mx.gpu contexts need mxnet-cu112)")
    assert selftest.main(["--gpu", "--require-gpu"]) == 1
    assert "FAILED (--require-gpu): GPU setup missing: mxnet" in capsys.readouterr().out


# ---- GPUs MXNet 1.9.1's wheels have no code for (compute capability 9.0+: H100, H200) ----

H200 = ("NVIDIA H200", (9, 0))
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
CPU_WHEEL = ("mxnet", "1.9.1", False)
CU112 = ("mxnet-cu112", "1.9.1", True)
CU117 = ("mxnet-cu117", "1.9.1", True)
SOURCE = ("", "1.9.1", True)               # a CUDA build pip did not install
SOURCE_AS_MXNET = ("mxnet", "1.9.1", True)  # one installed from its python/ folder
HOPPER_GAP = ("GPU 0 (NVIDIA H200, sm_90): MXNet 1.9.1's CUDA wheels (mxnet-cu112, "
              "mxnet-cu117) carry machine code for sm_50/60/70/80/86 only, and no PTX, so "
              "MXNet's own GPU operators cannot run there")


class MachineProbe(FakeProbe):
    """:class:`FakeProbe` with given GPUs ``(name, (major, minor))`` and MXNet build
    ``(distribution, version, has CUDA)`` (None: MXNet does not import)."""

    def __init__(self, devices, build, missing=(), broken=()):
        super().__init__(missing, broken)
        self._devices, self._build = list(devices), build

    def devices(self):
        if "devices" in self.broken:
            raise RuntimeError("probe devices crashed")
        return self._devices

    def mxnet_build(self):
        return self._build

    def mxnet_gpus(self):
        return len(self._devices)


@pytest.mark.parametrize("capability, runs", [
    ((3, 7), False), ((5, 0), True), ((5, 2), True), ((6, 1), True), ((7, 0), True),
    ((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), False),
    ((10, 0), False), ((12, 0), False)])
def test_wheel_runs_on_follows_cudas_rule_for_the_measured_archs(capability, runs):
    assert gpucheck.MXNET_WHEEL_ARCHS == ((5, 0), (6, 0), (7, 0), (8, 0), (8, 6))
    assert gpucheck.wheel_runs_on(capability) is runs


def _mxnet_piece(probe):
    return {p.name: p for p in gpucheck.diagnose(probe)}["mxnet"]


def test_cpu_wheel_on_hopper_is_not_told_to_install_mxnet_cu112():
    probe = MachineProbe([H200], CPU_WHEEL, missing={"mxnet"})
    piece = _mxnet_piece(probe)
    assert not piece.ok
    assert piece.detail == f"{MISSING['mxnet']}, and {HOPPER_GAP}"
    assert piece.fix == gpucheck.FIX["mxnet-arch"]
    assert "pip install" not in piece.fix and "compute capability 5.x-8.x" in piece.fix
    assert "cuobjdump --list-elf --list-ptx libmxnet.so" in piece.fix
    assert gpucheck.mxnet_gpu_count(probe) == 0


@pytest.mark.parametrize("build", [CU112, CU117], ids=["cu112", "cu117"])
def test_cuda_wheel_on_hopper_is_flagged_and_not_used(build):
    probe = MachineProbe([H200], build)          # MXNet itself says "CUDA, 1 GPU"
    piece = _mxnet_piece(probe)
    assert not piece.ok and piece.detail == f"mxnet fine; {HOPPER_GAP}"
    assert piece.fix == gpucheck.FIX["mxnet-arch"]
    assert gpucheck.mxnet_gpu_count(probe) == 0  # the GPU steps take CuPy arrays
    # the kernel pieces are all there: the checklist's GPU steps still run (on CuPy)
    assert not set(gpucheck.KERNEL_PIECES) & {p.name for p in gpucheck.diagnose(probe)
                                              if not p.ok}


def test_no_mxnet_on_hopper_is_flagged_too():
    piece = _mxnet_piece(MachineProbe([H200], None, missing={"mxnet"}))
    assert not piece.ok and piece.fix == gpucheck.FIX["mxnet-arch"]


@pytest.mark.parametrize("devices, build, count", [
    ([A100], CU112, 1), ([("NVIDIA L4", (8, 9))], CU117, 1), ([H200], SOURCE, 1),
    ([H200], SOURCE_AS_MXNET, 1), ([A100], CPU_WHEEL, 0), ([], CPU_WHEEL, 0)],
    ids=["a100-cu112", "l4-cu117", "h200-source", "h200-source-as-mxnet", "a100-cpu",
         "no-gpu-cpu"])
def test_no_flag_where_mxnet_has_code_for_the_gpu_or_may_have(devices, build, count):
    missing = set() if build[2] else {"mxnet"}
    probe = MachineProbe(devices, build, missing=missing)
    piece = _mxnet_piece(probe)
    assert piece.ok is build[2]
    assert piece.fix == ("" if build[2] else gpucheck.FIX["mxnet"])
    assert gpucheck.mxnet_gpu_gap(probe) == ""
    assert gpucheck.mxnet_gpu_count(probe) == count


def test_a_mixed_machine_names_the_gpu_without_code():
    gap = gpucheck.mxnet_gpu_gap(MachineProbe([A100, ("NVIDIA H100 PCIe", (9, 0))], CU112))
    assert gap.startswith("GPU 1 (NVIDIA H100 PCIe, sm_90): MXNet 1.9.1's CUDA wheels")
    assert "GPU 0" not in gap


def test_a_crashing_architecture_query_leaves_the_piece_as_it_was():
    piece = _mxnet_piece(MachineProbe([H200], CU112, broken={"devices"}))
    assert piece.ok and piece.fix == ""
    assert piece.detail == ("mxnet fine (GPU architectures not checked: RuntimeError: probe "
                            "devices crashed)")


def test_selftest_on_hopper_says_why_and_no_pip_command(monkeypatch, capsys, host_steps):
    monkeypatch.setattr(selftest, "run_checks", lambda **kw: [
        ("numpy", "PASS", 0.0, "row"), ("cuda", "PASS", 0.0, "on CuPy arrays")])
    monkeypatch.setattr(gpucheck, "diagnose", lambda probe=None: REAL_DIAGNOSE(
        MachineProbe([H200], CPU_WHEEL, missing={"mxnet"})))
    monkeypatch.setattr(gpucheck, "checklist", lambda pieces: host_steps)
    assert selftest.main(["--gpu"]) == 0
    out = capsys.readouterr().out
    assert "pip install mxnet-cu112" not in out
    assert f"fix:     {gpucheck.FIX['mxnet-arch']}" in out
    assert "sm_90" in out
    assert out.rstrip().endswith(
        "OK: every usable backend passed (numpy, cuda); no MXNet 1.9.1 wheel runs on this "
        "GPU: the GPU kernels ran on CuPy arrays (mx.gpu contexts need a GPU of compute "
        "capability 5.x-8.x or an MXNet built for this one)")


FAKE_LIBCUDA = r"""
#include <string.h>
static const char *names[] = {"NVIDIA H200", "NVIDIA A100-SXM4-80GB"};
static const int caps[][2] = {{9, 0}, {8, 0}};
int cuInit(unsigned flags) { return 0; }
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
int cuDeviceGetCount(int *n) { *n = 2; return 0; }
int cuDeviceGet(int *dev, int i) { if (i < 0 || i > 1) return 101; *dev = i; return 0; }
int cuDeviceGetName(char *name, int len, int dev) {
    strncpy(name, names[dev], len - 1); name[len - 1] = 0; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) {
    if (attr == 75) { *v = caps[dev][0]; return 0; }   /* ..._COMPUTE_CAPABILITY_MAJOR */
    if (attr == 76) { *v = caps[dev][1]; return 0; }   /* ..._COMPUTE_CAPABILITY_MINOR */
    return 1; }
"""


def test_real_devices_probe_reads_name_and_capability_from_the_driver(tmp_path):
    """The ctypes calls of :meth:`Probe.devices` against a stand-in ``libcuda.so.1`` (two
    GPUs), loaded by a child process through ``LD_LIBRARY_PATH``."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("cc")
    if cxx is None:
        pytest.skip("no C compiler")
    (tmp_path / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([cxx, "-x", "c", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"),
                    str(tmp_path / "fake.c")], check=True)
    code = ("import json; from mx_roi import gpucheck; p = gpucheck.Probe(); "
            "print(json.dumps([p.devices(), p.driver(), gpucheck.mxnet_gpu_gap(p)]))")
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
    devices, driver, gap = json.loads(out.stdout.strip().splitlines()[-1])
    assert devices == [["NVIDIA H200", [9, 0]], ["NVIDIA A100-SXM4-80GB", [8, 0]]]
    assert driver == [True, "driver for CUDA 12.4, 2 GPU(s)"]
    assert gap == HOPPER_GAP  # this machine's MXNet is the CPU wheel


def test_which_distribution_holds_mxnet():
    import mxnet as mx
    assert gpucheck.Probe().mxnet_build() == ("mxnet", mx.__version__, False)  # cpu extra
    pick = gpucheck.mxnet_distribution
    assert pick({"mxnet-cu112", "numpy"}, cuda=True) == "mxnet-cu112"
    assert pick({"mxnet", "mxnet-cu117"}, cuda=True) == "mxnet-cu117"
    assert pick({"mxnet", "mxnet-cu117"}, cuda=False) == "mxnet"   # the CPU wheel imports
    assert pick({"mxnet"}, cuda=True) == "mxnet"                  # a source build
    assert pick({"numpy"}, cuda=True) == ""
