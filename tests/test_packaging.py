"""The built wheel works on its own: kernels, CUDA sources and ops ship inside it."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # from a copy without build outputs: setuptools would pack a stale build/lib as well
    src = tmp_path_factory.mktemp("src") / "mx_roi"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True, cwd=out)
    (whl,) = out.glob("mx_roi-*.whl")
    return whl


def test_wheel_contains_operators_and_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for op in ("roi_pooling", "roi_align", "psroi_pooling", "psroi_align"):
        assert f"mx_roi/operators/{op}.py" in names
        assert f"mx_roi/operators/{op}.cu" in names
    assert "mx_roi/operators/roi_common.cuh" in names
    assert "mx_roi/operators/__init__.py" in names
    assert "mx_roi/cuda/host_shim.h" in names
    assert "mx_roi/viz/__init__.py" in names
    assert "mx_roi/bench/__main__.py" in names  # python -m mx_roi.bench after pip install
    # only mx_roi goes into site-packages: no example_rcnn, tests or bare operators/
    tops = {n.split("/")[0] for n in names if not n.startswith("mx_roi-")}
    assert tops == {"mx_roi"}, tops
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["mx_roi"]


def test_operators_ship_through_one_mechanism():
    """operators/ becomes mx_roi.operators through the symlink only: no package_dir
    mapping in setup.py, no path fallback in the source reader."""
    link = ROOT / "mx_roi" / "operators"
    assert link.is_symlink() and os.readlink(link) == "../operators"
    assert "package_dir" not in (ROOT / "setup.py").read_text()
    import mx_roi.operators
    from mx_roi.cuda import source
    assert not hasattr(source, "OPERATORS_DIR")
    assert source._operators_dir() == os.path.dirname(os.path.abspath(mx_roi.operators.__file__))
    assert Path(source._operators_dir()).resolve() == ROOT / "operators"


# Run with the wheel's files first on sys.path, from a directory outside the checkout:
# the kernel sources are read from the installed package, every op runs, and neither
# example_rcnn nor the checkout's operators/ is importable.
INSTALLED = r"""
import os, sys
import numpy as np, mxnet as mx
import mx_roi
from mx_roi.cuda import source
target = sys.argv[1]
assert mx_roi.__file__.startswith(target), mx_roi.__file__
assert source._operators_dir() == os.path.join(target, "mx_roi", "operators")
for f in source.sources():
    assert "roi_common.cuh (inlined)" in source.read_source(f), f
x = mx.nd.array(np.arange(2 * 8 * 8 * 8, dtype="f4").reshape(2, 8, 8, 8))
r = mx.nd.array([[1, 0, 0, 7, 7]])
out = {}
for op, kw in [("ROIPooling", {}), ("ROIAlign", {"sample_ratio": 2}),
               ("PSROIPooling", {"output_dim": 2}), ("PSROIAlign", {"output_dim": 2})]:
    out[op] = getattr(mx_roi.nd, op)(x, r, pooled_size=(2, 2), spatial_scale=1.0, **kw)
    print(op, out[op].shape)
# one host build, from the installed .cu and host_shim.h
os.environ["MX_ROI_BACKEND"] = "emulated-cuda"
e = mx_roi.nd.ROIPooling(x, r, pooled_size=(2, 2), spatial_scale=1.0)
np.testing.assert_array_equal(e.asnumpy(), out["ROIPooling"].asnumpy())
lib = mx_roi.cuda.loader._MODULES[("roi_pooling.cu", mx_roi.ndio.Kind.EMULATED, -1)]._lib._name
assert lib.startswith(os.environ["MX_ROI_CACHE"]), lib
print("emulated ok")
for name in ("example_rcnn", "operators"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        print("no", name)
"""


def test_installed_wheel_runs_outside_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MX_ROI_BACKEND"}
    # -S: no .pth files, so no editable install of this (or another) checkout is seen;
    # the environment's packages (mxnet, numpy) come after the wheel's on the path
    paths = [str(target)] + list(dict.fromkeys(sysconfig.get_paths()[k]
                                               for k in ("purelib", "platlib")))
    env.update(PYTHONPATH=os.pathsep.join(paths), MX_ROI_BACKEND="numpy",
               MX_ROI_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-S", "-c", INSTALLED, str(target)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    for line in ("ROIPooling (1, 8, 2, 2)", "ROIAlign (1, 8, 2, 2)",
                 "PSROIPooling (1, 2, 2, 2)", "PSROIAlign (1, 2, 2, 2)",
                 "emulated ok", "no example_rcnn", "no operators"):
        assert line in res.stdout, res.stdout + res.stderr


def test_example_runs_from_the_checkout():
    """``python -m example_rcnn...`` (``make demo``) from the repository root imports the
    checkout's example, which the wheel does not install."""
    res = subprocess.run([sys.executable, "-c", "import example_rcnn.symbol, mx_roi; "
                          "print(example_rcnn.symbol.__file__)"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(ROOT / "example_rcnn" / "symbol.py")
    res = subprocess.run([sys.executable, "-m", "example_rcnn.demo", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "--ops" in res.stdout, res.stdout + res.stderr


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


def test_the_package_description_names_every_registered_op():
    """setup.py reads no module of mx_roi (it would import mxnet), so its description
    names the ops by hand; this keeps it true when an op is added."""
    import ast
    from mx_roi.registry import REGISTERED
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "id", "") == "setup"]
    (description,) = [ast.literal_eval(k.value) for k in call.keywords
                      if k.arg == "description"]
    for name in REGISTERED:
        assert re.search(rf"\b{name}\b", description), name
