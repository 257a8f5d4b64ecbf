"""The built wheel works on its own: kernels, CUDA sources and ops ship inside it."""
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, cwd=out)
    (whl,) = out.glob("mx_roi-*.whl")
    return whl


def test_wheel_contains_operators_and_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for op in ("roi_pooling", "roi_align", "psroi_pooling", "psroi_align"):
        assert f"mx_roi/operators/{op}.py" in names
        assert f"mx_roi/operators/{op}.cu" in names
    assert "mx_roi/operators/roi_common.cuh" in names
    assert "mx_roi/cuda/host_shim.h" in names
    assert "mx_roi/viz/__init__.py" in names
    assert "mx_roi/bench/__main__.py" in names  # python -m mx_roi.bench after pip install


@pytest.mark.slow
def test_wheel_installs_and_runs_in_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[cpu]"], check=True,
                   cwd=tmp_path)
    script = (
        "import mxnet as mx, numpy as np, mx_roi, os\n"
        "assert 'site-packages' in mx_roi.__file__, mx_roi.__file__\n"
        "x = mx.nd.array(np.arange(2*4*8*8, dtype='f4').reshape(2,4,8,8))\n"
        "r = mx.nd.array([[1, 0, 0, 7, 7]])\n"
        "for op, kw in [('ROIPooling', {}), ('ROIAlign', {'sample_ratio': 2})]:\n"
        "    y = mx.nd.Custom(x, r, op_type=op, pooled_size=(2, 2), spatial_scale=1.0, **kw)\n"
        "    print(op, y.shape, float(y.sum().asscalar()))\n"
        "from mx_roi.cuda import source\n"
        "print('cuda sources', len(source.__doc__ or '') >= 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MX_ROI_BACKEND")}
    res = subprocess.run([str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ROIPooling (1, 4, 2, 2)" in res.stdout
    assert "ROIAlign (1, 4, 2, 2)" in res.stdout
