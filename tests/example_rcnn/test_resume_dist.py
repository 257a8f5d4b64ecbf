"""Checkpoint/resume exactness and the 2-worker + 1-server dist_sync run on loopback."""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from example_rcnn import train as tr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--num-images", "12", "--batch-size", "2", "--max-iters", "3", "--no-progress",
         "--seed", "5"]


def params(path):
    return {k: v.asnumpy() for k, v in mx.nd.load(path).items()}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_matches_uninterrupted(tmp_path, optimizer):
    extra = SMALL + ["--optimizer", optimizer, "--lr-steps", "1"]
    full = str(tmp_path / "full")
    part = str(tmp_path / "part")
    tr.train(tr.parse_args(extra + ["--epochs", "3", "--out", full]))
    tr.train(tr.parse_args(extra + ["--epochs", "1", "--out", part]))
    s = tr.train(tr.parse_args(extra + ["--epochs", "3", "--out", part, "--resume"]))
    assert [h["epoch"] for h in s["history"]] == [0] * 3 + [1] * 3 + [2] * 3
    a, b = params(full + "/model-0003.params"), params(part + "/model-0003.params")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # and the runs did train: epoch 1 and epoch 3 differ
    c = params(full + "/model-0001.params")
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_dist_sync_two_workers_one_server(tmp_path):
    out = str(tmp_path / "dist")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PORT="9")   # the launcher must drop PORT
    cmd = [sys.executable, "-m", "example_rcnn.launch", "-n", "2", "-s", "1", "--timeout",
           "150", "--"] + SMALL + ["--epochs", "2", "--out", out]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=200, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    w0, w1 = params(out + "/worker0-final.params"), params(out + "/worker1-final.params")
    assert w0.keys() == w1.keys() and len(w0) > 10
    for k in w0:
        np.testing.assert_array_equal(w0[k], w1[k], err_msg=k)
    ckpt = params(out + "/model-0002.params")
    np.testing.assert_array_equal(ckpt["arg:tconv1_weight"], w0["tconv1_weight"])
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert out not in ps        # no worker outlived the launcher


def test_launcher_timeout_kills_everything(tmp_path):
    from example_rcnn import launch
    # workers would need 1000 epochs: the 3 s budget runs out and everything is stopped
    out = str(tmp_path / "slow")
    status = launch.launch(2, 1, SMALL + ["--epochs", "1000", "--out", out], timeout=3.0,
                           log=lambda *a: None)
    assert status == 124
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout
    assert out not in ps
    assert "example_rcnn.ps_node" not in ps
