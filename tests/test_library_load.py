"""Loading an MXNet extension library (``mx.library.load``: mx_roi's own, or any other)
regenerates MXNet's operator functions, ``mx.nd.Custom`` / ``mx.sym.Custom`` among them
(and overwrites the two modules' ``__name__`` etc. with ``mxnet.ndarray.op``'s);
``import mx_roi``'s wrapper of ``Custom`` (the oneDNN guard, our input messages) must
survive it.  Run in a child process: the load is process-wide."""
import subprocess
import sys

CHILD = r'''
import mxnet as mx
import mx_roi, mx_roi.mxpatch as mxpatch
from mx_roi import ext
assert mx.nd.Custom._mx_roi_guard and mx.sym.Custom._mx_roi_guard
# (import mx_roi loaded it already with MXLoadLib and its own functions, ext.load; a
# second mx.library.load of the same file regenerates every operator function)
mx.library.load(ext.library_path(), verbose=False)
assert hasattr(mx.nd, "mx_roi_ROIAlign")
assert getattr(mx.nd.Custom, "_mx_roi_guard", False), "mx.nd.Custom lost its wrapper"
assert getattr(mx.sym.Custom, "_mx_roi_guard", False), "mx.sym.Custom lost its wrapper"
assert mxpatch._ORIGINAL_CUSTOM["mxnet.ndarray"] is not mx.nd.Custom
# MXNet copies mxnet.ndarray.op's dunders into mxnet.ndarray; the hook puts them back
assert (mx.nd.__name__, mx.sym.__name__) == ("mxnet.ndarray", "mxnet.symbol"), mx.nd.__name__
assert mx.nd.__file__.endswith("ndarray/__init__.py") and mx.nd.__spec__.name == "mxnet.ndarray"
assert sorted(mxpatch._ORIGINAL_CUSTOM) == ["mxnet.ndarray", "mxnet.symbol"]
d, r = mx.nd.ones((1, 8, 6, 6)), mx.nd.array([[0, 0, 0, 3, 3]])
try:  # our message, not MXNet's "Operator Custom expects 2 inputs, but got 3"
    mx.nd.Custom(d, r, d, op_type="ROIAlign", pooled_size=2, spatial_scale=1.0)
except TypeError as e:
    assert str(e) == "ROIAlign(): takes at most 2 inputs (data, rois), got 3", e
else:
    raise AssertionError("no error")
y = mx.nd.Custom(d, r, op_type="ROIAlign", pooled_size=2, spatial_scale=1.0)
assert y.shape == (1, 8, 2, 2) and float(y.sum().asscalar()) == 32.0
print("ok")
'''


def test_custom_keeps_its_wrapper_after_a_library_load():
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), \
        res.stdout[-2000:] + res.stderr[-3000:]
