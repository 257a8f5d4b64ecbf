"""The library's own timers of the native ops' callbacks (``mx_roi.ext.callback_timing`` /
``callback_times``): what the step benchmark subtracts from the profiler's time of an
``mx_roi_<Op>`` operator to give MXNet's share of it.  Each forward and backward callback
counts once, only while timing is on; starting zeroes the totals; the times are inside the
profiler's own span of the operator."""
import os
import subprocess
import sys
import textwrap

import pytest

from mx_roi import ext
from tests.child import child_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(bool(ext.unavailable_reason()),
                                reason="no extension library here: "
                                       + (ext.unavailable_reason() or ""))

CHILD = textwrap.dedent("""
    import json, os, time
    import numpy as np, mxnet as mx
    import mx_roi
    from mx_roi import ext
    ext.load()
    x = mx.nd.array(np.random.RandomState(0).rand(2, 16, 24, 32).astype("f4"))
    rois = mx.nd.array([[0, 1, 1, 20, 15], [1, 0, 2, 30, 22], [0, 5, 5, 6, 6]])
    x.attach_grad()
    def step(op):
        with mx.autograd.record():
            y = getattr(mx.nd, "mx_roi_" + op)(x, rois, pooled_size=(7, 7),
                                             spatial_scale=1.0)
        y.backward(mx.nd.ones_like(y))
        x.grad.wait_to_read()
    out = {}
    ext.callback_timing(True)
    out["zero"] = ext.callback_times()
    step("ROIAlign"); step("ROIPooling")
    out["two"] = ext.callback_times()
    ext.callback_timing(False)
    step("ROIAlign")
    out["off"] = ext.callback_times()
    ext.callback_timing(True)
    out["restart"] = ext.callback_times()
    # nested in the profiler's span of the operator
    mx.profiler.set_config(profile_all=True, aggregate_stats=True, filename=os.devnull)
    mx.profiler.set_state("run")
    for _ in range(5):
        step("ROIAlign")
    mx.profiler.set_state("stop")
    out["profiled"] = ext.callback_times()
    ext.callback_timing(False)
    table = mx.profiler.dumps(reset=True)
    ops = {}
    for line in table.splitlines():
        parts = line.split()
        if parts and parts[0] in ("mx_roi_ROIAlign", "_backward_mx_roi_ROIAlign"):
            ops[parts[0]] = float(parts[2])
    out["profiler_ms"] = ops
    print("RESULT", json.dumps(out))
""")


@pytest.fixture(scope="module")
def times():
    return child_result(CHILD)


def test_counts_each_callback_while_on(times):
    zero = dict(fwd_ms=0.0, fwd_calls=0, bwd_ms=0.0, bwd_calls=0)
    assert times["zero"] == zero
    two = times["two"]
    assert two["fwd_calls"] == 2 and two["bwd_calls"] == 2, two
    assert two["fwd_ms"] > 0 and two["bwd_ms"] > 0
    assert times["off"] == two          # stopped: nothing added
    assert times["restart"] == zero     # started again: zeroed


def test_inside_the_profilers_span(times):
    p, ms = times["profiled"], times["profiler_ms"]
    assert p["fwd_calls"] == 5 and p["bwd_calls"] == 5, p
    assert set(ms) == {"mx_roi_ROIAlign", "_backward_mx_roi_ROIAlign"}, ms
    # the profiler rounds to microseconds: 5 calls' worth of slack
    assert 0 < p["fwd_ms"] <= ms["mx_roi_ROIAlign"] + 0.005, (p, ms)
    assert 0 < p["bwd_ms"] <= ms["_backward_mx_roi_ROIAlign"] + 0.005, (p, ms)


def test_not_loaded_says_so():
    """Before the library is loaded (``MX_ROI_NATIVE_OPS=0``: ``import mx_roi`` loads
    nothing) the timers raise ExtLibraryError naming ``mx_roi.ext.load()``, not a ctypes
    error; after ``load()`` they work."""
    code = textwrap.dedent("""
        import mx_roi
        from mx_roi import ext
        for fn in (lambda: ext.callback_timing(True), ext.callback_times):
            try:
                fn()
                print("NO ERROR")
            except ext.ExtLibraryError as e:
                print("ERROR", e)
        ext.load()
        ext.callback_timing(True)
        print("LOADED", ext.callback_times())
    """)
    env = dict(os.environ, MX_ROI_NATIVE_OPS="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.split(" ")[0] in
             ("ERROR", "NO", "LOADED")]
    want = "ERROR mx_roi's extension library is not loaded (mx_roi.ext.load())"
    assert lines[:2] == [want, want], lines
    assert lines[2] == "LOADED " + str(dict(fwd_ms=0.0, fwd_calls=0, bwd_ms=0.0,
                                            bwd_calls=0)), lines
