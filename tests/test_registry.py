"""The registry is the one list of ops: a module dropped into an operators package is
discovered, registered with MXNet and its kernel source becomes compilable."""
import os
import subprocess
import sys
import textwrap

import mx_roi
from mx_roi import selftest
from mx_roi.cuda import source as S
from mx_roi.registry import REGISTERED


def test_every_list_derives_from_the_registry():
    names = tuple(REGISTERED)
    assert mx_roi.OP_TYPES == names
    assert mx_roi.nd.__all__ == list(names) and mx_roi.sym.__all__ == list(names)
    assert set(mx_roi.gluon.MODES.values()) == set(names)
    assert {n for n, _ in selftest.CASES} == set(names)
    assert S.sources() == tuple(op.cuda_source for op in REGISTERED.values())


CHILD = textwrap.dedent('''
    import os, sys
    import numpy as np
    import mxnet as mx
    import mx_roi
    from mx_roi.registry import discover, REGISTERED
    from mx_roi.cuda import source as S
    sys.path.insert(0, sys.argv[1])
    # the kernel files of this test live in its temporary directory, not operators/
    S._operators_dir = lambda: os.path.join(sys.argv[1], "kernels")
    discover("extra_ops", [os.path.join(sys.argv[1], "extra_ops")])
    assert "AlignCopy" in REGISTERED, list(REGISTERED)
    assert "align_copy.cu" in S.sources() and S.read_source("align_copy.cu")
    x = mx.nd.array(np.arange(2 * 3 * 6 * 6, dtype=np.float32).reshape(2, 3, 6, 6))
    r = mx.nd.array([[1, 0, 0, 4, 5]], dtype=np.float32)
    a = mx.nd.Custom(x, r, op_type="AlignCopy", pooled_size="(2, 2)", spatial_scale="1")
    b = mx.nd.Custom(x, r, op_type="ROIAlign", pooled_size="(2, 2)", spatial_scale="1")
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    print("OK")
''')

OP = textwrap.dedent('''
    from mx_roi.registry import register
    from mx_roi.operators.roi_align import ROIAlign

    @register
    class AlignCopy(ROIAlign):
        name = "AlignCopy"
        cuda_source = "align_copy.cu"
        gluon_mode = ""
''')


def test_a_new_module_registers_itself(tmp_path):
    pkg = tmp_path / "extra_ops"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "align_copy.py").write_text(OP)
    ops_dir = tmp_path / "kernels"
    ops_dir.mkdir()
    for f in ("roi_align.cu", S.HEADER):
        (ops_dir / f).write_text(open(f"{S._operators_dir()}/{f}").read())
    (ops_dir / "align_copy.cu").write_text((ops_dir / "roi_align.cu").read_text())
    env = dict(os.environ, MX_ROI_BACKEND="numpy")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
