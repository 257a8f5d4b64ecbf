"""Smoke test of ``python -m mx_roi.bench --step --quick`` (structure and first-step
equality of the built-in and mx_roi sides; no timing assertions)."""
import json
import math
import statistics
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


@pytest.fixture(scope="module")
def step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_step") / "step.json"
    proc = subprocess.run([sys.executable, "-m", "mx_roi.bench", "--step", "--quick",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    with open(out) as f:
        return proc, json.load(f)


def test_both_sides_ran_the_same_step(step_run):
    _, payload = step_run
    assert payload["mode"] == "step" and payload["failures"] == []
    (setting,) = payload["settings"]
    assert setting["threads"] == "default"
    rows = {r["name"]: r for r in setting["results"]}
    assert set(rows) == {"frcnn-pool7", "rfcn-pspool7"}
    for name, r in rows.items():
        # the same graph apart from the RoI node (ours: Custom + guard nodes, hence more)
        assert r["graph"]["same"] and r["graph"]["params_equal"], (name, r["graph"])
        assert r["graph"]["nodes"]["ours"] > r["graph"]["nodes"]["builtin"]
        # equal losses and parameter gradients after the first step
        check = r["check"]
        assert check["ok"] and check["max_rel_err"] <= 1e-3, (name, check)
        assert check["compared"] > 20
        losses = check["losses"]
        assert _positive(losses["builtin"])
        assert math.isclose(losses["ours"], losses["builtin"], rel_tol=1e-5)
        assert len(r["ours_runs_ms"]) == len(r["builtin_runs_ms"]) == payload["steps"] == 2
        assert all(_positive(t) for t in r["ours_runs_ms"] + r["builtin_runs_ms"])
        assert r["ours_ms"] == min(r["ours_runs_ms"])
        assert math.isclose(r["ratio"], r["ours_ms"] / r["builtin_ms"])
        assert math.isclose(r["median_ratio"], statistics.median(r["ours_runs_ms"]) /
                            statistics.median(r["builtin_runs_ms"]))
        assert math.isclose(r["builtin_spread"], max(r["builtin_runs_ms"]) /
                            min(r["builtin_runs_ms"]) - 1)


def test_native_door_column(step_run):
    """The third side: the same step with the RoI node built as ``mx.sym.mx_roi_<Op>``,
    interleaved with the other two, checked against the built-in, and the verdict native
    no slower than the Custom door."""
    proc, payload = step_run
    rows = payload["settings"][0]["results"]
    for r in rows:
        n = r["native"]
        assert n["missing"] == "" and n["graph_same"], (r["name"], n)
        assert n["check"]["ok"] and n["check"]["max_rel_err"] <= 1e-3, (r["name"], n["check"])
        assert math.isclose(n["check"]["losses"]["native"], n["check"]["losses"]["builtin"],
                            rel_tol=1e-5)
        assert len(n["runs_ms"]) == payload["steps"] and all(_positive(t) for t in n["runs_ms"])
        assert n["ms"] == min(n["runs_ms"])
        assert math.isclose(n["ratio"], n["ms"] / r["ours_ms"])
        assert math.isclose(n["median_ratio"], statistics.median(n["runs_ms"]) /
                            statistics.median(r["ours_runs_ms"]))
        assert n["no_slower"] == (n["ms"] <= r["ours_ms"])
        # the RoI node is the extension op: its forward and backward in the profile
        entries = r["profile"]["native"]["op_entries"]
        assert f"mx_roi_{r['op']}" in entries and f"_backward_mx_roi_{r['op']}" in entries
        assert not any(k.endswith("::pure_python") for k in entries)
    table = proc.stdout.split("nat<=ours")[1]
    for r in rows:
        line = next(ln for ln in table.splitlines() if ln.startswith(r["name"] + " "))
        n = r["native"]
        assert f"{n['ms']:8.1f} {n['ratio']:8.3f} {n['median_ratio']:6.3f} " \
            f"{'yes' if n['no_slower'] else 'NO':>9}" in line, line
    ok = sum(r["native"]["no_slower"] for r in rows)
    assert f"native no slower than Custom (min steps) in {ok} of {len(rows)} rows" in proc.stdout


def test_sides_are_built_through_the_doors():
    """The step's RoI nodes: Custom for ours, mx_roi_<Op> for native, the built-in's op."""
    import json as _json
    import mx_roi  # noqa: F401
    from mx_roi.bench.step_model import QUICK_CONFIGS, build_symbol
    for cfg in QUICK_CONFIGS:
        ops = {side: [n["op"] for n in _json.loads(build_symbol(cfg, side, "quick")
                                                   .tojson())["nodes"]]
               for side in ("ours", "native", "builtin")}
        assert f"mx_roi_{cfg.op}" in ops["native"] and "Custom" not in ops["native"]
        assert "Custom" in ops["ours"] and f"mx_roi_{cfg.op}" not in ops["ours"]
        assert "Custom" not in ops["builtin"]


def test_profile_finds_each_side_op(step_run):
    proc, payload = step_run
    for r in payload["settings"][0]["results"]:
        builtin, ours = r["profile"]["builtin"], r["profile"]["ours"]
        assert _positive(builtin["op_ms"]) and _positive(builtin["wall_ms"])
        # ours runs as Custom: its Python callbacks in the profiler's Custom Operator domain
        assert any(k.endswith("::pure_python") for k in ours["op_entries"]), ours
        assert _positive(ours["op_ms"]) and ours["op_ms"] <= ours["operators_ms"] + 1e-6
        assert _positive(ours["guard_ms"]) and "clip" in ours["guard_entries"]
        cb = ours["callback_ms"]
        # the checked path's pieces, or the native backend's calls into the extension
        # library (checks, geometry and kernels in one compiled call per direction)
        pieces = ("library_fwd", "library_bwd") if "library_fwd" in cb else \
            ("kernel_fwd", "kernel_bwd", "geometry")
        for key in pieces + ("callback_fwd", "callback_bwd"):
            assert _positive(cb.get(key)), (key, cb)
        assert cb[pieces[0]] <= cb["callback_fwd"]
        # the native door: its callbacks timed by the library, the rest of its operators'
        # time is MXNet's (nested inside the profiler's span: never negative beyond the
        # profiler's microsecond rounding)
        native = r["profile"]["native"]
        ncb = native["callback_ms"]
        assert _positive(ncb["fwd"]) and _positive(ncb["bwd"]), ncb
        assert math.isclose(native["mxnet_ms"], native["op_ms"] - ncb["fwd"] - ncb["bwd"])
        assert native["mxnet_ms"] >= -0.05, native
        assert (f"inside the callbacks: fwd {ncb['fwd']:.1f}, bwd {ncb['bwd']:.1f}; "
                f"MXNet's share {native['mxnet_ms']:.1f})") in proc.stdout
    assert "ours/bi" in proc.stdout and "op%bi" in proc.stdout
    assert "frcnn-pool7" in proc.stdout and "rfcn-pspool7" in proc.stdout


def test_bad_config_name_is_rejected():
    proc = subprocess.run([sys.executable, "-m", "mx_roi.bench", "--step", "--configs",
                           "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown configuration(s) ['nope']" in proc.stderr


def test_hugetlb_setting_adds_the_tunable(monkeypatch):
    """``--hugetlb``: the children get glibc's huge-page tunable, after any the caller set;
    without it their GLIBC_TUNABLES is the caller's."""
    from mx_roi.bench import step
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert step._child_env("default", True)["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert step._child_env("equal", False)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert step._child_env("default", True)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in step._child_env("default", False)
    assert step._parse_args(["--hugetlb", "--quick"]).hugetlb
    assert not step._parse_args(["--quick"]).hugetlb
