"""Fuzz and soak of bad inputs as training steps, each run in a child process so that an
abort or a hang fails the test instead of killing pytest (see tests/fuzz_child.py).

Default: 2 x 150 fuzz cases and a 200-step-per-op soak.  ``MX_ROI_FUZZ_CASES=N`` sets
the cases per child; ``-m slow`` adds 6 x 400 cases and the 2000-step soak."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(args, timeout, **extra_env):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **extra_env)
    env.pop("MX_ROI_BACKEND", None)
    # the Custom door: this fuzz's oracle is its error and gradient semantics (each
    # error's first line is the op's message; a rejected step's gradients zeroed).  The
    # native door's errors put MXNet's lines first (docs/native_ops.md); its fuzz is
    # issue 42's own (see the report: this child on the native door also counted
    # wrong_numbers in the completions-queue soak, not investigated here)
    env.setdefault("MX_ROI_NATIVE_OPS", "0")
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz_child", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.returncode, lines, proc.stderr[-3000:])
    res = json.loads(lines[-1][len("RESULT "):])
    # a rejected call prints nothing but the error it raises
    assert "Error in CustomOp" not in proc.stdout
    return res


def _fuzz(seed, cases, **env):
    res = _child(["fuzz", seed, cases], timeout=600, **env)
    assert res["cases"] == cases and res["raised"] > 0 and res["valid"] > 0
    for k in ("wrong_message", "silent", "wrong_numbers", "wrong_grad"):
        assert res[k] == 0, res


@pytest.mark.parametrize("seed", [11, 12])
def test_fuzz(seed):
    _fuzz(seed, int(os.environ.get("MX_ROI_FUZZ_CASES", "150")))


def test_fuzz_rescanning_backward():
    """The same fuzz with every max-op training call keeping no argmax (the backward of
    a large call rescans the data: mx_roi.cuda.backend.ARGMAX_KEEP_MAX_ELEMENTS)."""
    _fuzz(13, int(os.environ.get("MX_ROI_FUZZ_CASES", "100")), MX_ROI_FUZZ_RESCAN="1")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 106))
def test_fuzz_long(seed):
    _fuzz(seed, int(os.environ.get("MX_ROI_FUZZ_CASES", "400")))


def _soak(steps, **env):
    res = _child(["soak", steps], timeout=900, **env)
    assert res["steps"] == 4 * steps and res["raised"] == 2 * steps, res
    for k in ("wrong_message", "silent", "wrong_numbers", "wrong_grad"):
        assert res[k] == 0, res
    first, last = res["rss_kb_first_last"]
    assert last - first < 64 * 1024, res  # peak RSS flat after warm-up (< 64 MB growth)


def test_soak_short():
    _soak(200)


def test_soak_rescanning_backward():
    _soak(100, MX_ROI_FUZZ_RESCAN="1")


@pytest.mark.slow
def test_soak_2000():
    _soak(2000)


def _no_lost_error(res):
    for k in ("wrong_message", "bad_silent", "good_raised", "silent", "nonfinite_silent",
              "wrong_numbers", "wrong_grad", "stale_at_waitall", "pending_records"):
        assert res.get(k, 0) == 0, res


def test_failed_forward_keeps_its_error_while_completions_queue():
    """MXNet 1.9.1 gives a failed custom-op callback's error to whichever op's completion
    runs next (mx_roi.error_slot).  Forced here every round: a valid step's completion
    waits behind a busy engine while a bad step's forward fails.  Each bad step must raise
    its own error, each valid step none, through nd, sym and hybridized Gluon (before
    mx_roi.error_slot: most bad steps read NaN with no error and their valid neighbour
    raised instead; 165 of 240 in the soak below)."""
    res = _child(["handover", 8, "nd,sym,gluon-hybrid", "PSROIPooling,ROIAlign"],
                 timeout=300)
    assert res["steps"] == 96 and res["raised"] == 48, res
    _no_lost_error(res)


def test_unread_gradient_steps_keep_their_errors():
    """Bad training steps whose gradient nobody reads (record -> backward without a wait
    -> read the output), several hundred in one process, every tenth one valid: each bad
    one raises its own message, no valid one raises, nothing is left for waitall."""
    res = _child(["unread", 150, "nd,sym,gluon-hybrid", "PSROIPooling"], timeout=300)
    assert res["steps"] == 450 and res["raised"] == 405 and res["valid"] == 45, res
    _no_lost_error(res)


@pytest.mark.slow
def test_unread_gradient_steps_keep_their_errors_soak():
    res = _child(["unread", 1000, "nd,sym,gluon-hybrid", "PSROIPooling,ROIPooling,ROIAlign,"
                  "PSROIAlign"], timeout=900)
    assert res["steps"] == 12000 and res["raised"] == 10800, res
    _no_lost_error(res)


@pytest.mark.slow
def test_failed_forward_keeps_its_error_while_completions_queue_soak():
    res = _child(["handover", 40, "nd,sym,gluon-hybrid", "PSROIPooling,ROIPooling,ROIAlign,"
                  "PSROIAlign"], timeout=900)
    assert res["raised"] == res["steps"] // 2, res
    _no_lost_error(res)
