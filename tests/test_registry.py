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


def test_check_inputs_batch_index_and_finite_bounds():
    """``RoIOp.check_inputs``, every op: a batch index is ``trunc(rois[:, 0])`` -- valid
    below N (1.999 reads image 1), negative for a padding roi (-0.5 and -7.5 too), an
    error from N on; with no image at all any index from -1 exclusive is one (trunc(-0.5)
    is 0).  A coordinate is infinite at |x| >= 3e38 (the oneDNN guard's clip bound) in
    float32 / float64, at inf in float16; NaN never passes."""
    import numpy as np
    import pytest
    import dataclasses
    for name, cls in REGISTERED.items():
        params = _minimal_params(cls)
        if "sample_ratio" in {f.name for f in dataclasses.fields(cls.param_cls)}:
            # a fixed grid: an adaptive one also bounds the box's size (2.9e38 wide here;
            # test_geometry_boundaries' adaptive samples per bin)
            params["sample_ratio"] = 2
        op = cls(cls.param_cls.from_kwargs(**params))

        def check(batch, n=2, value=10.0, dtype=np.float32):
            if cls.rois_columns == 6:  # rotated: the value as the x centre
                rows = [[0 if n else -1, 1, 1, 5, 5, 0], [batch, value, 2, 2, 6, 30]]
            else:
                rows = [[0 if n else -1, 1, 1, 5, 5], [batch, 2, 2, value, 6]]
            op.check_inputs((n, 4, 8, 8), np.dtype(dtype), np.array(rows, dtype), np)

        for ok in (1.999, 1.5, 1.0, 0.0, -0.5, -1.0, -7.5):
            check(ok)
        for bad in (2.0, 2.5, 7.0):
            with pytest.raises(ValueError, match=rf"{name}: rois\[1\] has batch index "
                                                 rf"{bad:g} but data holds only 2 image"):
                check(bad)
        check(-1.0, n=0)
        with pytest.raises(ValueError, match=r"batch index -0.5 but data holds only 0"):
            check(-0.5, n=0)
        for dtype, fine, infinite in ((np.float32, 2.9e38, 3e38), (np.float64, 2.9e38, 3e38),
                                      (np.float16, 65504.0, np.inf)):
            check(0, value=fine, dtype=dtype)
            check(0, value=-fine, dtype=dtype)
            for v in (infinite, -infinite, np.nan):
                with pytest.raises(ValueError, match=r"rois\[1\] has a NaN or infinite"):
                    check(0, value=v, dtype=dtype)


def _minimal_params(cls):
    """The smallest valid parameters of a registered op (required ones filled in)."""
    import dataclasses
    params = {}
    for f in dataclasses.fields(cls.param_cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            params[f.name] = {"pooled_size": 2, "spatial_scale": 1.0,
                              "output_dim": 1, "group_size": 1}[f.name]
    return params
