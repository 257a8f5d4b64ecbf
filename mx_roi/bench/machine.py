"""The machine a run is on: CPU, versions, thread settings, both sides' thread counts,
load and the checkout's git commit."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import List, Optional

import numpy as np

import mxnet as mx

import mx_roi

__all__ = ["machine_info", "usable_cores", "mxnet_omp_threads", "thread_info", "CHECKOUT"]

#: the directory holding the ``mx_roi`` package (the checkout's root in a source tree)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_names() -> List[str]:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        return [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    except Exception:
        return []


def machine_info(ctx_name: str) -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        features = sorted(f.name for f in mx.runtime.Features().values() if f.enabled)
    except Exception:
        features = []
    env_keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                "MKL_DYNAMIC", "KMP_AFFINITY", "OMP_PROC_BIND", "MX_ROI_BACKEND",
                "MX_ROI_NUM_THREADS", "MX_ROI_HOST_CXXFLAGS")
    env = {k: os.environ[k] for k in env_keys if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("MXNET_")})
    try:
        num_gpus = mx.context.num_gpus()
    except Exception:
        num_gpus = 0
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=_cpu_model(), cpu_count=os.cpu_count(), cpu_affinity=affinity,
        platform=platform.platform(), python=platform.python_version(),
        mxnet=mx.__version__, numpy=np.__version__, mx_roi=getattr(mx_roi, "__version__", "?"),
        mxnet_features=features, env=env, ctx=ctx_name, num_gpus=num_gpus,
        gpus=_gpu_names() if ctx_name == "gpu" else [], loadavg=_loadavg(),
        git=_git_commit(), threads=thread_info(), native_isa=native_isa())


def native_isa() -> str:
    """The vector width of the native kernels' float lanes in this process's build (the
    ROIAlign library's, built here if it is not cached), or why there is none."""
    from ..cuda import loader
    from ..ndio import Kind
    try:
        width = loader.float_vector_width(loader.get_module("roi_align.cu", Kind.NATIVE, 0)._lib)
    except Exception as exc:  # no compiler, ...: the bench says so and runs on
        return f"not built ({type(exc).__name__})"
    return {8: "AVX, 8-float lanes", 4: "SSE2, 4-float lanes"}.get(width, f"{width}-float lanes")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def mxnet_omp_threads(env=None) -> int:
    """The OpenMP threads MXNet's CPU operators use (its engine's rule, src/engine/openmp.cc):
    ``MXNET_OMP_MAX_THREADS`` if set, else ``OMP_NUM_THREADS`` if set, else half the
    usable logical cores on x86 (its comment: hyper-threading; all of them elsewhere)."""
    env = os.environ if env is None else env
    for key in ("MXNET_OMP_MAX_THREADS", "OMP_NUM_THREADS"):
        v = env.get(key, "").split(",")[0].strip()
        if v:
            try:
                return max(1, int(v))
            except ValueError:
                pass
    cores = usable_cores()
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return max(1, cores // 2 if x86 else cores)


def thread_info() -> dict:
    """Both sides' thread counts in this process."""
    from .. import parallel
    return dict(mxnet=mxnet_omp_threads(), ours=parallel.num_threads(),
                ours_blas_in_kernels=1 if parallel._blas_handles().set is not None else None,
                numpy_blas=parallel.blas_threads())


def _git_commit() -> Optional[str]:
    """The mx_roi checkout's commit (``+dirty`` with local changes), if it is a git tree."""
    root = CHECKOUT
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, timeout=10,
                              capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "mx_roi"], cwd=root, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def _loadavg():
    try:
        return [float(f"{v:.2f}") for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None

