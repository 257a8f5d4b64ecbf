"""Packaging for mx_roi: RoI operators for MXNet as Python custom ops."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
# the one place of the version, read as text: importing mx_roi would import mxnet
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (HERE / "mx_roi" / "_version.py").read_text(encoding="utf-8"), re.M).group(1)

# mxnet 1.9.1 uses ``np.bool`` (removed in numpy 1.24), so numpy is pinned below 1.24.
NUMPY = "numpy<1.24"
# The GPU compile path is tested (without a GPU) with CuPy 12 (Python 3.8) and 13; CuPy 12
# refuses template code without --std (we pass one), CuPy 13 needs Python >= 3.9 and
# libnvrtc.so.11.2 loadable.  This extra has never run on a GPU (docs/gpu.md).
CUPY = "cupy-cuda11x>=12,<14"

setup(
    name="mx_roi",
    version=VERSION,
    description="RoI operators for MXNet 1.9.1 as custom operators: ROIPooling, ROIAlign, "
                "PSROIPooling, PSROIAlign, RROIAlign, DeformablePSROIPooling and PrRoIPool "
                "(the CUDA kernels compiled for the CPU, or NumPy; CuPy on a GPU)",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.8",
    # mx_roi and every subpackage.  operators/ ships as mx_roi.operators through the
    # symlink mx_roi/operators -> ../operators, the one mechanism for a checkout,
    # `pip install -e .` and the wheel (setuptools follows it and copies the files).
    # example_rcnn is not installed: it runs from a checkout (`python -m example_rcnn.demo`).
    packages=find_packages(include=["mx_roi", "mx_roi.*"]),
    package_data={"mx_roi.operators": ["*.cu", "*.cuh"], "mx_roi.cuda": ["*.h"],
                  "mx_roi.ext": ["*.cc", "*.h", "*.cu"]},  # the extension libraries' sources
    install_requires=[NUMPY],
    extras_require={
        "cpu": ["mxnet==1.9.1", NUMPY],
        "gpu": ["mxnet-cu112==1.9.1", CUPY, "nvidia-cuda-nvrtc-cu11", NUMPY],
        "plot": ["matplotlib<3.9"],
        "onnx": ["onnx==1.14.1"],  # + onnxruntime==1.16.3 with --no-deps: docs/installing.md
        # python -m mx_roi.bench's torchvision column; never needed by make test (its tests
        # use the stand-in in tests/fake_torch).  Checked: torch 2.14.1, torchvision 0.29.1
        # (PyPI's CUDA builds: ~2 GB of nvidia-* wheels, run on CPU) next to numpy 1.23.5.
        "torch": ["torch", "torchvision", NUMPY],
        "example": ["tqdm", "Pillow", "matplotlib<3.9"],
        # `make docs`: the API reference (docs/api, Sphinx autodoc) built with -W
        "docs": ["sphinx>=7,<9"],
        # nvrtc + runtime (cuda_fp16.h): tests/test_cuda_compile.py compiles the kernels;
        # CuPy (imports without a driver): tests/test_cupy_compile.py runs its compile path
        "test": ["pytest", "pytest-xdist", "hypothesis", "nvidia-cuda-nvrtc-cu11", "nvidia-cuda-runtime-cu11",
                 CUPY,
                 "wheel", "tqdm", "Pillow", "matplotlib<3.9"],
    },
)
