"""Smoke tests of ``python -m mx_roi.bench`` (no timing assertions)."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (key, has a built-in) of the main workloads; every one runs in fwd and fwd+bwd
EXPECTED = {
    "ROIPooling/7x7": True,
    "ROIAlign/7x7": True,
    "ROIAlign-aligned/14x14": True,
    "ROIAlign-max/7x7": False,
    "PSROIPooling/7x7": True,
    "PSROIAlign/7x7": True,
}
DIRECTIONS = ("fwd", "fwd+bwd")


def _run(args, timeout=120):  # a few seconds normally; generous for a loaded CI machine
    proc = subprocess.run([sys.executable, "-m", "mx_roi.bench"] + args, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out_json = tmp / "tmp.json"
    proc = _run(["--quick", "--json", str(out_json)])
    with open(out_json) as f:
        return proc, json.load(f)


def _positive(v):
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_every_op_and_direction_has_positive_times(quick_run):
    _, payload = quick_run
    rows = {(r["key"], r["direction"]): r for r in payload["results"]}
    for key, has_builtin in EXPECTED.items():
        for direction in DIRECTIONS:
            assert (key, direction) in rows, f"missing {key} {direction}"
            r = rows[(key, direction)]
            assert _positive(r["ours_ms"]) and all(_positive(t) for t in r["ours_runs_ms"])
            if has_builtin:
                assert _positive(r["builtin_ms"]) and _positive(r["ratio"])
                assert r["check"]["ok"], r["check"]
            else:
                assert r["builtin_ms"] is None and r["ratio"] is None
    assert {r["op"] for r in payload["results"]} == {
        "ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign"}
    assert payload["failures"] == []
    assert _positive(payload["geomean_fwd_bwd_ratio"])


def test_overhead_and_header(quick_run):
    proc, payload = quick_run
    assert payload["overhead"], "no Custom-overhead rows"
    assert {o["direction"] for o in payload["overhead"]} == set(DIRECTIONS)
    assert all(_positive(o["ms"]) for o in payload["overhead"])
    machine = payload["machine"]
    for k in ("cpu", "cpu_count", "mxnet", "numpy", "env"):
        assert k in machine
    assert "geometric mean of fwd+bwd ratios" in proc.stdout
    assert "ours/bi" in proc.stdout
    assert "Custom-op overhead" in proc.stdout


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out_json, png = tmp_path / "plot.json", tmp_path / "plot.png"
    _run(["--quick", "--only", "ROIAlign/7x7,ROIAlign-max", "--repeat", "1",
          "--plot", str(png), "--plot-boxes", "16,32", "--plot-repeat", "1",
          "--json", str(out_json)])
    with open(out_json) as f:
        sweep = json.load(f)["sweep"]
    assert set(sweep) == {"ROIAlign/7x7", "ROIAlign-max/7x7"}
    assert sweep["ROIAlign/7x7"]["boxes"] == [16, 32]
    assert all(_positive(t) for t in sweep["ROIAlign/7x7"]["builtin_ms"])
    assert all(_positive(t) for e in sweep.values() for t in e["ours_ms"])
    assert png.exists() and png.stat().st_size > 1000


def test_memory_subprocess(tmp_path):
    out_json = tmp_path / "mem.json"
    _run(["--quick", "--memory", "--only", "ROIAlign/7x7", "--repeat", "1",
          "--json", str(out_json)])
    with open(out_json) as f:
        payload = json.load(f)
    (entry,) = payload["memory"]
    assert entry["key"] == "ROIAlign/7x7"
    for side in ("ours", "builtin"):
        assert isinstance(entry[side], int) and entry[side] >= 0, entry
    assert entry["out_bytes"] > 0 and entry["grad_bytes"] > 0
