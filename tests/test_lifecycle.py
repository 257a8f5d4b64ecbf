"""Process-level behaviour: exiting with work queued must not abort the interpreter."""
import subprocess
import sys
import textwrap


def test_exit_with_a_pending_op_is_clean():
    """MXNet aborts ("terminate called without an active exception") when a custom op
    still runs in its worker thread at shutdown; ``import mx_roi`` waits for it."""
    script = textwrap.dedent("""
        import mxnet as mx, mx_roi
        feat = mx.nd.random.uniform(shape=(2, 256, 38, 50))
        rois = mx.nd.array([[0, 10.3, 6.2, 90.1, 61.7], [1, 200., 40., 420., 300.]])
        y = mx_roi.nd.ROIAlign(feat, rois, (7, 7), 1 / 16, sample_ratio=2, pool_mode='max')
        # no wait: the interpreter exits while the op may still be running
    """)
    # without the exit hook this aborted in about one run in three here: run it a few times
    for _ in range(4):
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "terminate called" not in res.stderr
