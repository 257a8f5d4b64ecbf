"""``python -m mx_roi.selftest``'s ``native-ops`` row: the extension library's native ops
(:mod:`mx_roi.ext`) checked bit for bit against the ``native`` backend's Custom path, a
mismatch reported, and a machine that cannot build the library told that the ops run as
Custom ops (never a failure)."""
import mxnet as mx
import pytest

import mx_roi
from mx_roi import ext, selftest


def test_native_ops_row_passes_here(monkeypatch):
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    monkeypatch.delenv("MX_ROI_NATIVE_OPS", raising=False)
    assert ext.unavailable_reason() == ""  # g++ and the wheel's extension API are here
    detail = selftest.check_extension(quick=True)
    assert "ROIAlign" in detail and "ROIPooling" in detail
    assert "bit-equal" in detail
    # the door: the ops with a native section, then those without, by the library's names
    native = [n for n in mx_roi.OP_TYPES if f"mx_roi_{n}" in ext.loaded_ops()]
    custom = [n for n in mx_roi.OP_TYPES if n not in native]
    assert {"ROIAlign", "ROIPooling", "PSROIPooling", "PSROIAlign"} <= set(native)
    want = f"door: native for {', '.join(native)}"
    if custom:
        want += f"; Custom for {', '.join(custom)} (the extension library has no mx_roi_<Op>)"
    assert detail.endswith("bit-equal; " + want), detail


@pytest.mark.parametrize("env,reason", [
    ({"MX_ROI_NATIVE_OPS": "0"}, "MX_ROI_NATIVE_OPS=0"),
    ({"MX_ROI_BACKEND": "numpy"}, "the CPU backend is 'numpy'"),
    ({"MX_ROI_BACKEND": "emulated-cuda"}, "the CPU backend is 'emulated-cuda'")])
def test_the_door_row_says_custom_and_why(monkeypatch, env, reason):
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    monkeypatch.delenv("MX_ROI_NATIVE_OPS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert selftest.door_summary() == f"door: Custom for {', '.join(mx_roi.OP_TYPES)} ({reason})"


def test_the_door_row_names_a_library_that_cannot_be_built(monkeypatch):
    from mx_roi.ext import door
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    monkeypatch.delenv("MX_ROI_NATIVE_OPS", raising=False)
    monkeypatch.setattr(ext, "_STATE", dict(ext._STATE, ops=None, loaded=None))
    monkeypatch.setitem(door._STATE, "failed", "mx_roi.ext needs a C++ compiler")
    assert selftest.door_summary() == (
        f"door: Custom for {', '.join(mx_roi.OP_TYPES)} (the extension library is not "
        "available (mx_roi.ext needs a C++ compiler))")


def test_native_ops_row_fails_on_a_mismatch(monkeypatch):
    ext.load()
    real = mx.nd.mx_roi_ROIAlign
    monkeypatch.setattr(mx.nd, "mx_roi_ROIAlign", lambda *a, **k: real(*a, **k) * 2)
    with pytest.raises(AssertionError, match=r"^mx_roi_ROIAlign .*: not bit-equal to the "
                                             r"checked path \(native\)$"):
        selftest.check_extension(quick=True)


def test_native_ops_row_skips_with_the_reason(monkeypatch):
    monkeypatch.setattr(ext, "unavailable_reason", lambda: "no C++ compiler (g++ or $CXX)")
    with pytest.raises(selftest.Skip, match=r"^no C\+\+ compiler \(g\+\+ or \$CXX\); the ops "
                                            r"run as Custom ops$"):
        selftest.check_extension(quick=True)


def test_library_path_at_the_top_is_the_extension_library():
    import os
    path = mx_roi.library_path()
    assert path == ext.library_path() and os.path.isfile(path)
    assert os.path.basename(path).startswith("mx_roi_ext-mx1.9.1-api11-")


def test_ext_bench_markdown_marks_the_cost_above_the_extension_floor():
    """``python -m mx_roi.ext.bench --markdown`` (the bench's fixed-cost rows): every side's
    whole call, the cost above each floor, issue 42's target and the whole-call verdict."""
    from mx_roi.ext import bench
    ms = {"noop Custom": 0.3, "noop native": 0.1, "Custom": 0.5, "native": 0.15,
          "native add_safe": 0.2, "built-in": 0.4}
    row = dict(key="X", direction="fwd", ms=ms, extra_ms=0.2, native_extra_ms=0.05,
               native_target_ms=0.05, native_met=True, whole_met=True)
    rows = [row, dict(row, direction="fwd+bwd", native_extra_ms=0.21, native_target_ms=0.2,
                      native_met=False, whole_met=False),
            dict(row, key="Y", native_target_ms=None, native_met=None, whole_met=None,
                 ms=dict(ms, **{"built-in": None}))]
    text = bench.markdown(rows, 5)
    assert text.startswith("`python -m mx_roi.ext.bench --repeat 5 --markdown` at git ")
    lines = text.splitlines()
    assert lines[-5] == ("| op | dir | noop Custom | noop native | Custom | native | "
                         "native add_safe | built-in | Custom above floor | native above floor "
                         "| native target | native <= built-in |")
    assert lines[-3] == ("| X | fwd | 0.300 | 0.100 | 0.500 | 0.150 | 0.200 | 0.400 | 0.200 | "
                         "0.050 | <= 0.05 | yes |")
    assert lines[-2].endswith("| 0.210 | **>** 0.2 | **no** |")
    assert lines[-1].endswith("| - | 0.200 | 0.050 | - | - |")


@pytest.mark.parametrize("affinity,said", [(1, True), (2, False), (None, False)])
def test_ext_bench_markdown_says_when_the_process_is_pinned(monkeypatch, affinity, said):
    """A run under ``taskset`` (fewer usable cores than the machine has) says so in the
    table's header: on a VM, a call's hand-off between MXNet's threads costs less when
    both share one vCPU, so the floors of a pinned run are not those of a free one."""
    from mx_roi.bench import machine
    from mx_roi.ext import bench
    info = dict(git="abc1234", date="2026-11-30 01:00 UTC", cpu="Some CPU", cpu_count=2,
                cpu_affinity=affinity, loadavg=[0.1, 0.2, 0.3])
    monkeypatch.setattr(machine, "machine_info", lambda ctx: info)
    head = bench.markdown([], 5).splitlines()[0]
    assert ("Some CPU (2 logical cores, the process pinned to 1 of them), load" in head) \
        == said, head
    assert ("Some CPU (2 logical cores), load" in head) == (not said), head
