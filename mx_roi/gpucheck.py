"""What a GPU machine needs (:func:`diagnose`) and the first-GPU-run checklist (:func:`checklist`).

Both are run by ``python -m mx_roi.selftest`` (the checklist with ``--gpu``).  The diagnosis
names every missing piece with the command that fixes it:

=========  ==========================================================================
driver     ``libcuda.so.1`` loads, ``cuInit`` succeeds, CUDA 11.2+ driver, >= 1 GPU
mxnet      the MXNet build has CUDA (``mxnet-cu112``), sees the GPUs and can run on them:
           MXNet 1.9.1's CUDA wheels carry no code for a GPU of compute capability 9.0+
           (Hopper: H100, H200) -- there no wheel helps (:func:`mxnet_gpu_gap`)
cupy       CuPy imports, 12.x-14.x (setup.py installs ``cupy-cuda11x>=12,<14``)
nvrtc      the ``libnvrtc`` CuPy opens by name loads (a CUDA toolkit on the loader path,
           ``LD_LIBRARY_PATH``, or the ``nvidia-cuda-nvrtc-cu11`` wheel that mx_roi
           preloads); CuPy 14 finds its own, so it is asked
headers    a ``cuda_fp16.h`` for that NVRTC (CuPy bundles it for CUDA 11.x and 12.0/12.1)
=========  ==========================================================================

The checklist runs on the host what can run there (the emulated references, the
grid-stride wrap on the emulation) and reports each GPU-only step as SKIP with its reason.
The kernel steps need the driver, CuPy, NVRTC and the headers (:data:`KERNEL_PIECES`), not
MXNet's CUDA build: without it they run on CuPy arrays standing in for GPU NDArrays
(:func:`gpu_context`, :mod:`mx_roi.cuda.cupy_arrays`).
Every machine query goes through :class:`Probe`, so tests can simulate a missing piece.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np

__all__ = ["Probe", "Piece", "diagnose", "Step", "checklist", "GRID_WRAP_ITEMS",
           "gpu_kernels_main", "gpu_context", "is_standin", "mxnet_gpu_count",
           "cupy_gpu_count", "MXNET_WHEEL_ARCHS", "wheel_runs_on", "mxnet_distribution",
           "mxnet_gpu_gap",
           "standin_reason"]

#: what setup.py's ``gpu`` extra installs (``CUPY``): CuPy for CUDA 11, as mxnet-cu112
CUPY_REQUIREMENT = "cupy-cuda11x>=12,<14"
#: the CuPy releases the GPU path runs on: 12 and 13 (CUDA 11/12), and 14 (CUDA 12/13,
#: whose compile function takes no cache folder: :meth:`mx_roi.cuda.loader.CupyToolchain.compile`)
CUPY_RANGE = ((12, 0), (15, 0))
MIN_DRIVER = 11020  # CUDA 11.2, what mxnet-cu112 and cupy-cuda11x need
#: one past what a single pass of the largest grid covers: the kernels' grid-stride loops
#: must wrap (``MAX_GRID * BLOCK`` of mx_roi.cuda.loader)
GRID_WRAP_ITEMS = 65535 * 256 + 3

#: the GPU architectures MXNet 1.9.1's CUDA wheels carry machine code for: measured with
#: ``cuobjdump --list-elf --list-ptx libmxnet.so`` on ``mxnet-cu112`` and ``mxnet-cu117``
#: 1.9.1 (the same list in both, and no PTX the driver could compile for a newer GPU)
MXNET_WHEEL_ARCHS = ((5, 0), (6, 0), (7, 0), (8, 0), (8, 6))
#: how a message names those wheels' code
WHEEL_CODE = ("MXNet 1.9.1's CUDA wheels (mxnet-cu112, mxnet-cu117) carry machine code for "
              "sm_50/60/70/80/86 only, and no PTX")

FIX = {
    "driver": "install an NVIDIA driver for CUDA 11.2+ (R460 or newer, e.g. "
              "`sudo apt-get install nvidia-driver-535`), reboot, check `nvidia-smi`",
    "mxnet": "pip uninstall -y mxnet && pip install mxnet-cu112==1.9.1",
    "cupy": f'pip install "{CUPY_REQUIREMENT}"',
    "nvrtc": "pip install nvidia-cuda-nvrtc-cu11 (mx_roi preloads it), or put a CUDA "
             "toolkit's lib64 on the path: export LD_LIBRARY_PATH=/usr/local/cuda/lib64"
             ":$LD_LIBRARY_PATH",
    "headers": "pip install nvidia-cuda-runtime-cu11 (or set CUDA_PATH to a CUDA toolkit "
               "of the NVRTC's version)",
    # the mxnet piece on a GPU no MXNet 1.9.1 wheel runs on (mxnet_gpu_gap): no pip command
    "mxnet-arch": "no pip package fixes this: MXNet's own GPU work (mx.gpu contexts, its "
                  "built-ins) needs a GPU of compute capability 5.x-8.x (Maxwell to Ampere) "
                  "or an MXNet built from source for this GPU's sm_XX (`cuobjdump "
                  "--list-elf --list-ptx libmxnet.so` lists a build's code); mx_roi's GPU "
                  "kernels run here on CuPy arrays without it",
}


def mxnet_distribution(installed, cuda: bool) -> str:
    """Which of the ``installed`` pip distributions (lower-case names) holds the MXNet
    that imports: an ``mxnet-cu*`` wheel for a CUDA build, else ``mxnet``, else ''."""
    wheels = sorted(n for n in installed if n.startswith("mxnet-cu"))
    return wheels[0] if cuda and wheels else ("mxnet" if "mxnet" in installed else "")


def wheel_runs_on(capability: Tuple[int, int]) -> bool:
    """Whether MXNet 1.9.1's CUDA wheels (:data:`MXNET_WHEEL_ARCHS`) have code that runs on
    a GPU of compute capability ``(major, minor)``.  CUDA's rule: machine code for sm_XY
    runs on X.Z with Z >= Y (so sm_86 serves 8.9, Ada), never on another major; without
    PTX nothing is compiled for a newer GPU."""
    major, minor = capability
    return any(major == m and minor >= n for m, n in MXNET_WHEEL_ARCHS)


@dataclass
class Piece:
    name: str
    ok: bool
    detail: str
    fix: str = ""


class Probe:
    """The machine queries of :func:`diagnose`: each returns ``(ok, detail)``."""

    def driver(self) -> Tuple[bool, str]:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            return False, f"no NVIDIA driver: libcuda.so.1 not loadable ({e})"
        rc = lib.cuInit(0)
        if rc != 0:
            return False, f"cuInit failed (CUresult {rc}): no usable GPU, or the driver " \
                          "does not match its kernel module"
        v, n = ctypes.c_int(), ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(v))
        lib.cuDeviceGetCount(ctypes.byref(n))
        cuda = f"{v.value // 1000}.{v.value % 1000 // 10}"
        if v.value < MIN_DRIVER:
            return False, f"the driver supports CUDA {cuda}; 11.2 or newer is needed"
        if n.value < 1:
            return False, f"driver for CUDA {cuda}, but no GPU visible " \
                          "(CUDA_VISIBLE_DEVICES?)"
        return True, f"driver for CUDA {cuda}, {n.value} GPU(s)"

    def mxnet(self) -> Tuple[bool, str]:
        try:
            import mxnet as mx
        except Exception as e:  # mxnet-cu112 does not import without the driver
            return False, f"mxnet not importable ({type(e).__name__}: " \
                          f"{str(e).strip().splitlines()[-1][:100] if str(e).strip() else ''})"
        if not mx.runtime.Features().is_enabled("CUDA"):
            return False, f"mxnet {mx.__version__} is a CPU build"
        n = mx.context.num_gpus()
        if n < 1:
            return False, f"mxnet {mx.__version__} (CUDA build) sees no GPU"
        return True, f"mxnet {mx.__version__} with CUDA, {n} GPU(s)"

    def devices(self) -> List[Tuple[str, Tuple[int, int]]]:
        """``(name, (major, minor))`` -- name and compute capability -- of every GPU the
        driver shows (``CUDA_VISIBLE_DEVICES`` applies); [] without a driver or a GPU."""
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return []
        n = ctypes.c_int()
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return []
        found = []
        for i in range(n.value):
            dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            name = ctypes.create_string_buffer(256)
            # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR (cuda.h)
            if (lib.cuDeviceGet(ctypes.byref(dev), i) != 0
                    or lib.cuDeviceGetName(name, 256, dev) != 0
                    or lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0
                    or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0):
                break
            found.append((name.value.decode(errors="replace"), (major.value, minor.value)))
        return found

    def mxnet_build(self) -> Optional[Tuple[str, str, bool]]:
        """``(pip distribution, version, has CUDA)`` of the MXNet that imports, or None.
        The distribution is the ``mxnet-cu*`` wheel of a CUDA build installed from one,
        ``mxnet`` for the CPU wheel (or a source build installed under that name), ''
        for a build pip did not install."""
        try:
            import mxnet as mx
            cuda = bool(mx.runtime.Features().is_enabled("CUDA"))
        except Exception:  # noqa: BLE001 - not installed, or it does not import
            return None
        from importlib import metadata
        names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
        return mxnet_distribution(names, cuda), mx.__version__, cuda

    def mxnet_gpus(self) -> int:
        """GPUs MXNet's CUDA build sees (``mx.context.num_gpus()``)."""
        import mxnet as mx
        return mx.context.num_gpus()

    def cupy(self) -> Tuple[bool, str]:
        try:
            import cupy
        except Exception as e:  # ImportError, or CuPy's own load errors
            return False, f"CuPy not importable ({type(e).__name__}: " \
                          f"{str(e).strip().splitlines()[-1][:100] if str(e).strip() else ''})"
        version = tuple(int(x) for x in cupy.__version__.split(".")[:2])
        if not CUPY_RANGE[0] <= version < CUPY_RANGE[1]:
            return False, (f"CuPy {cupy.__version__} is outside the supported "
                           f"{CUPY_RANGE[0][0]}.x-{CUPY_RANGE[1][0] - 1}.x")
        return True, f"CuPy {cupy.__version__}"

    def nvrtc(self) -> Tuple[bool, str]:
        from .cuda import nvrtc
        version = self._cupy14_nvrtc()
        if version:  # CuPy 14 finds its NVRTC itself (cuda-pathfinder): ask it
            return True, f"NVRTC {version[0]}.{version[1]}, found by CuPy itself"
        major = nvrtc.cupy_cuda_major() or 11
        soname = nvrtc.CUPY_NVRTC_SONAMES[major]
        if self.loadable_by_name(soname):
            return True, f"{soname} on the loader path (CUDA toolkit or LD_LIBRARY_PATH)"
        wheel = nvrtc.wheel_library(soname)
        if wheel and nvrtc.preload_for_cupy(major) is not None:
            return True, f"{soname} not on the loader path; mx_roi preloads the " \
                         f"nvidia-cuda-nvrtc-cu{major} wheel's copy {wheel}"
        return False, f"{soname} (the NVRTC CuPy {major}.x wheels open by name) is neither " \
                      f"on the loader path nor in an nvidia-cuda-nvrtc-cu{major} wheel"

    def loadable_by_name(self, soname: str) -> bool:
        """Whether a fresh process finds ``soname`` by name, as CuPy does (this process
        may hold a copy loaded by path already)."""
        code = f"import ctypes; ctypes.CDLL({soname!r})"
        return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0

    def _cupy14_nvrtc(self) -> Optional[Tuple[int, int]]:
        """NVRTC's version as CuPy 14+ loads it, else None (older CuPy, or none found)."""
        try:
            import cupy
            if int(cupy.__version__.split(".")[0]) < 14:
                return None
            from cupy.cuda import nvrtc as cupy_nvrtc
            return tuple(int(v) for v in cupy_nvrtc.getVersion())[:2]
        except Exception:  # noqa: BLE001 - no CuPy, or its NVRTC does not load
            return None

    def nvrtc_version(self) -> Optional[Tuple[int, int]]:
        from .cuda import nvrtc
        version = self._cupy14_nvrtc()
        if version:
            return version
        major = nvrtc.cupy_cuda_major() or 11
        try:
            lib = ctypes.CDLL(nvrtc.CUPY_NVRTC_SONAMES[major])
        except OSError:
            return None
        a, b = ctypes.c_int(), ctypes.c_int()
        return (a.value, b.value) if lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b)) == 0 \
            else None

    def headers(self) -> Tuple[bool, str]:
        from .cuda import source as S
        version = self.nvrtc_version()
        if version is None:
            return False, "no NVRTC, so no header check (fix nvrtc first)"
        dirs = S.cuda_include_dirs(version[0])
        if version[0] == 12 and version[1] >= 2:  # CuPy bundles none for 12.2+
            dirs = [d for d in dirs if not d.endswith("cuda-12")]
        if not dirs:
            return False, f"no cuda_fp16.h for NVRTC {version[0]}.{version[1]}"
        return True, f"cuda_fp16.h for NVRTC {version[0]}.{version[1]}: {dirs[0]}"


def diagnose(probe: Optional[Probe] = None) -> List[Piece]:
    """One :class:`Piece` per requirement of the GPU path, in dependency order."""
    probe = probe or Probe()
    pieces = []
    for name in ("driver", "mxnet", "cupy", "nvrtc", "headers"):
        try:
            ok, detail = getattr(probe, name)()
        except Exception as e:  # a probe must never stop the diagnosis
            ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0][:160]
        fix = "" if ok else FIX[name]
        if name == "mxnet":
            try:
                gap = mxnet_gpu_gap(probe)
            except Exception as e:  # noqa: BLE001 - nor may this query
                gap = ""
                detail += (" (GPU architectures not checked: "
                           f"{type(e).__name__}: {e}".splitlines()[0][:160] + ")")
            if gap:
                ok, detail, fix = False, (detail + "; " if ok else detail + ", and ") + gap, \
                    FIX["mxnet-arch"]
        pieces.append(Piece(name, bool(ok), detail, fix))
    return pieces


def mxnet_gpu_gap(probe: Optional[Probe] = None) -> str:
    """Why MXNet's own GPU operators cannot run on a GPU of this machine, or ''.

    Said when a GPU needs code MXNet 1.9.1's CUDA wheels lack (:func:`wheel_runs_on`:
    compute capability 9.0+, Hopper: H100, H200) and the MXNet here is such a wheel, the
    CPU wheel or none -- the cases where ``pip install mxnet-cu112`` would be the wrong
    advice.  A CUDA build pip did not install as a wheel (built from source) may have
    the code: nothing is said."""
    probe = probe or Probe()
    beyond = [f"GPU {i} ({name}, sm_{major}{minor})"
              for i, (name, (major, minor)) in enumerate(probe.devices())
              if not wheel_runs_on((major, minor))]
    if not beyond:
        return ""
    build = probe.mxnet_build()
    if build is not None and build[2] and not (build[0].startswith("mxnet-cu")
                                               and build[1].startswith("1.")):
        return ""
    return (f"{', '.join(beyond)}: {WHEEL_CODE}, so MXNet's own GPU operators cannot run "
            "there")


def standin_reason(pieces: List[Piece]) -> str:
    """Why the GPU kernels ran on CuPy arrays (the selftest's last line), from the
    diagnosis: MXNet is a CPU build, or no MXNet wheel runs on this GPU."""
    mxnet = next(p for p in pieces if p.name == "mxnet")
    if mxnet.fix == FIX["mxnet-arch"]:
        return ("no MXNet 1.9.1 wheel runs on this GPU: the GPU kernels ran on CuPy arrays "
                "(mx.gpu contexts need a GPU of compute capability 5.x-8.x or an MXNet "
                "built for this one)")
    return ("MXNet is a CPU build: the GPU kernels ran on CuPy arrays (mx.gpu contexts "
            "need mxnet-cu112)")


# --------------------------------------------------------------------------- checklist
@dataclass
class Step:
    name: str
    where: str      # "host" or "gpu"
    status: str     # PASS, FAIL, SKIP
    detail: str


CASES_DTYPES = (np.float16, np.float32, np.float64)

#: how a report names the CuPy stand-in for MXNet's GPU arrays
STANDIN_NOTE = "MXNet is a CPU build"


def mxnet_gpu_count(probe: Optional[Probe] = None) -> int:
    """GPUs MXNet can run its operators on: 0 for a CPU build, and 0 where its wheel has
    no code for a GPU here (:func:`mxnet_gpu_gap`; the GPU steps then run on CuPy arrays)."""
    probe = probe or Probe()
    try:
        build = probe.mxnet_build()
        if build is None or not build[2] or mxnet_gpu_gap(probe):
            return 0
        return probe.mxnet_gpus()
    except Exception:  # noqa: BLE001 - a CPU build, or no driver
        return 0


def cupy_gpu_count() -> int:
    """GPUs CuPy sees (0 without CuPy, a driver or a device)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return 0


def gpu_context(gpu_id: int = 0):
    """Where the GPU steps run: ``mx.gpu(gpu_id)`` if MXNet has CUDA and sees that GPU,
    else CuPy arrays on that GPU standing in for MXNet's
    (:class:`mx_roi.cuda.cupy_arrays.Device`: the same kernels, geometry and DLPack I/O).
    Raises RuntimeError if neither sees it."""
    if mxnet_gpu_count() > gpu_id:
        import mxnet as mx
        return mx.gpu(gpu_id)
    if cupy_gpu_count() > gpu_id:
        from .cuda.cupy_arrays import Device
        return Device(gpu_id)
    raise RuntimeError(f"no GPU {gpu_id} visible to MXNet or CuPy")


def is_standin(ctx) -> bool:
    """Whether ``ctx`` is the CuPy stand-in (:func:`gpu_context`), not an MXNet context."""
    return hasattr(ctx, "array")


def _all_cases():
    """``(name, params, dtype, rescan)`` of every check: each op x dtype, the max modes
    also with the rescanning backward (:func:`mx_roi.opcheck.rescan_variants`)."""
    from .opcheck import CASES, rescan_variants
    return [(name, params, dtype, rescan) for name, params in CASES for dtype in CASES_DTYPES
            for rescan in rescan_variants(name, params)]


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _against_emulation(gpu_id: int, what: str) -> str:
    """GPU forward (``what='forward'``) or deterministic data gradient (``'grad'``) of
    every op x dtype bit-equal to ``emulated-cuda``."""
    import mxnet as mx
    from .backends import get
    from .opcheck import make_op as _op, problem as _problem, run as _run
    gpu = gpu_context(gpu_id)
    n = 0
    for name, params, dtype, rescan in _all_cases():
        op = _op(name, dict(params, deterministic=True))
        data, rois, grad, extra = _problem(op, dtype)
        o1, g1 = _run(get("cuda"), op, data, rois, grad, gpu, rescan, extra=extra)
        o2, g2 = _run(get("emulated-cuda"), op, data, rois, grad, mx.cpu(), rescan,
                      extra=extra)
        a, b = (o1, o2) if what == "forward" else (_joined(g1), _joined(g2))
        if not np.array_equal(_bits(a), _bits(b)):
            bad = int(np.count_nonzero(_bits(a) != _bits(b)))
            raise AssertionError(f"{name} {params} {np.dtype(dtype).name}"
                                 + (" (rescan)" if rescan else "")
                                 + f": {what} differs from emulated-cuda in {bad} of "
                                 f"{a.size} elements")
        n += 1
    return f"{n} op x dtype cases bit-equal to emulated-cuda ({what}){_on(gpu)}"


def _joined(grads):
    """The gradients of every input of a call (``selftest._run``) as one flat array."""
    return np.concatenate([np.ravel(g) for g in grads])


def _on(ctx) -> str:
    return f" on CuPy arrays ({STANDIN_NOTE})" if is_standin(ctx) else ""


def _emulated_references() -> str:
    """The host half of the bit-equality steps: every op x dtype on ``emulated-cuda``
    (deterministic mode), twice, bit-identical."""
    import mxnet as mx
    from .backends import get
    from .opcheck import make_op as _op, problem as _problem, run as _run
    n = 0
    for name, params, dtype, rescan in _all_cases():
        op = _op(name, dict(params, deterministic=True))
        data, rois, grad, extra = _problem(op, dtype)
        first = _run(get("emulated-cuda"), op, data, rois, grad, mx.cpu(), rescan,
                     extra=extra)
        again = _run(get("emulated-cuda"), op, data, rois, grad, mx.cpu(), rescan,
                     extra=extra)
        for x, y in zip((first[0], _joined(first[1])), (again[0], _joined(again[1]))):
            assert np.array_equal(_bits(x), _bits(y)), f"{name} {dtype}: not reproducible"
        n += 1
    return f"{n} op x dtype emulated-cuda references (forward + deterministic grad)"


def _grid_wrap(backend: str, ctx) -> str:
    """ROIPooling over ``GRID_WRAP_ITEMS`` items (one 1x1 bin per channel): the last items
    are reached only when the grid-stride loop wraps; forward and gradient vs NumPy."""
    from .backends import get
    from .opcheck import make_op as _op, run as _run
    op = _op("ROIPooling", dict(pooled_size=(1, 1), spatial_scale=1.0))
    C = GRID_WRAP_ITEMS
    data = (np.arange(C, dtype=np.float32) % 7).reshape(1, C, 1, 1)
    rois = np.zeros((1, 5), np.float32)
    grad = (np.arange(C, dtype=np.float32) % 5 + 1).reshape(1, C, 1, 1)
    out, (dg,) = _run(get(backend), op, data, rois, grad, ctx)
    if not (np.array_equal(out, data) and np.array_equal(dg, grad)):
        first = int(np.argmax((out != data).ravel() | (dg != grad).ravel()))
        raise AssertionError(f"{backend}: item {first} of {C} wrong (grid-stride wrap)")
    return (f"{backend}: {C} items (> 65535 blocks x 256 threads), forward + grad exact"
            + _on(ctx))


def _device(gpu_id: int) -> str:
    import mxnet as mx
    from .backends import get
    from .opcheck import CASES, assert_close as _close, assert_close_grads as _close_grads
    from .opcheck import make_op as _op, problem as _problem, run as _run
    gpu = gpu_context(gpu_id)
    for name, params in CASES:
        op = _op(name, params)
        data, rois, grad, extra = _problem(op, np.float32)
        o1, g1 = _run(get("cuda"), op, data, rois, grad, gpu, extra=extra)
        o2, g2 = _run(get("numpy"), op, data, rois, grad, mx.cpu(), extra=extra)
        _close(o1, o2, np.float32, f"{name} forward on gpu({gpu_id})")
        _close_grads(g1, g2, np.float32, f"{name} on gpu({gpu_id})", op)
    return f"{len(CASES)} ops on gpu({gpu_id}) vs numpy{_on(gpu)}"


def _memory(steps: int = 200) -> str:
    """A training loop (record -> backward -> read, no wait in between) of ROIAlign on
    GPU 0; CuPy's pool must not grow after warm-up, and what it holds is reported.  Where
    MXNet is a CPU build the same calls go straight to the backend on CuPy arrays."""
    import cupy
    gpu = gpu_context(0)
    step = _standin_step(gpu) if is_standin(gpu) else _mxnet_step(gpu)
    pool = cupy.get_default_memory_pool()
    held = []
    for i in range(steps):
        step()
        if i in (10, steps - 1):
            held.append(pool.total_bytes())
    if held[1] > held[0]:
        raise AssertionError(f"CuPy's pool grew from {held[0]} to {held[1]} bytes between "
                             f"step 10 and step {steps}")
    free, total = cupy.cuda.runtime.memGetInfo()
    return (f"{steps} steps{_on(gpu)}: CuPy pool holds {held[1] / 2**20:.1f} MiB (used "
            f"{pool.used_bytes() / 2**20:.1f} MiB); GPU free {free / 2**30:.2f} of "
            f"{total / 2**30:.2f} GiB")


_MEMORY_ROIS = [[0, 4, 4, 200, 180], [1, 0, 0, 120, 250]] * 64
_MEMORY_PARAMS = dict(pooled_size=(7, 7), spatial_scale=0.25, sample_ratio=2)


def _mxnet_step(ctx):
    """One recorded training step of our ROIAlign through MXNet on ``ctx``."""
    import mxnet as mx
    from mxnet import autograd
    from . import nd as mx_roi_nd
    x = mx.nd.random.normal(shape=(2, 256, 64, 64), ctx=ctx)
    x.attach_grad()
    rois = mx.nd.array(_MEMORY_ROIS, ctx=ctx)

    def step():
        with autograd.record():
            y = mx_roi_nd.ROIAlign(x, rois, **_MEMORY_PARAMS)
        y.backward()
        float(x.grad[0, 0, 0, 0].asscalar())
    return step


def _standin_step(gpu):
    """The same step on CuPy arrays: the backend's forward (keeping its saved state) and
    backward, then a read of the gradient."""
    from .backends import get
    from .opcheck import make_op as _op
    op, cuda = _op("ROIAlign", _MEMORY_PARAMS), get("cuda")
    x = gpu.array(np.random.default_rng(0).standard_normal((2, 256, 64, 64)), np.float32)
    rois = gpu.array(np.array(_MEMORY_ROIS, np.float32))
    out = gpu.zeros(op.out_shape(x.shape, rois.shape))
    dy, dx = gpu.array(np.ones(out.shape, np.float32)), gpu.zeros(x.shape)

    def step():
        saved = cuda.forward(op, "write", x, rois, out, keep=True)
        cuda.backward(op, "write", dy, x, rois, dx, saved)
        float(dx.data[0, 0, 0, 0])
    return step


def _sanitizer_tool() -> str:
    for d in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                           "/usr/local/cuda")):
        path = os.path.join(d, "bin", "compute-sanitizer")
        if os.path.exists(path):
            return path
    return shutil.which("compute-sanitizer") or ""


def _sanitize(tool: str) -> str:
    done = []
    for check in ("memcheck", "initcheck"):
        cmd = [tool, "--tool", check, "--error-exitcode", "97", sys.executable, "-m",
               "mx_roi.selftest", "--gpu-kernels"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            tail = " | ".join((res.stdout + res.stderr).strip().splitlines()[-3:])
            raise AssertionError(f"{check} (exit {res.returncode}): {tail[:300]}")
        done.append(check)
    return f"{' and '.join(done)} clean on every op x dtype (forward + backward, both modes)"


def gpu_kernels_main() -> int:
    """``--gpu-kernels``: every op x dtype x mode forward + backward once on GPU 0 (an
    MXNet GPU context, or CuPy arrays standing in for it): what compute-sanitizer
    watches."""
    from .backends import get
    from .opcheck import make_op as _op, problem as _problem, run as _run
    gpu = gpu_context(0)
    for name, params, dtype, rescan in _all_cases():
        for det in (False, True):
            op = _op(name, dict(params, deterministic=det))
            data, rois, grad, extra = _problem(op, dtype)
            _run(get("cuda"), op, data, rois, grad, gpu, rescan, extra=extra)
    return 0


#: what the kernels need; MXNet's CUDA build is needed only for its own GPU work (the
#: built-ins, its engine and autograd): without it the kernel steps run on CuPy arrays
KERNEL_PIECES = ("driver", "cupy", "nvrtc", "headers")


def _gpu_count(pieces: List[Piece]) -> int:
    ok = {p.name for p in pieces if p.ok}
    if not ok.issuperset(KERNEL_PIECES):
        return 0
    return mxnet_gpu_count() if "mxnet" in ok else cupy_gpu_count()


def checklist(pieces: Optional[List[Piece]] = None,
              gpus: Optional[int] = None, sanitizer: Optional[str] = None) -> List[Step]:
    """The first-GPU-run checklist (docs/gpu.md, "The first-run checklist"): host parts run here, GPU
    parts when :func:`diagnose` found everything and a GPU is visible."""
    pieces = diagnose() if pieces is None else pieces
    missing = [p.name for p in pieces if not p.ok and p.name in KERNEL_PIECES]
    gpus = _gpu_count(pieces) if gpus is None else gpus
    no_gpu = (f"GPU setup incomplete ({', '.join(missing)} missing; see the diagnosis)"
              if missing else "no GPU visible")
    sanitizer = _sanitizer_tool() if sanitizer is None else sanitizer
    import mxnet as mx

    plan: List[Tuple[str, str, Callable[[], str], str]] = [
        ("sanitizer", "gpu", lambda: _sanitize(sanitizer),
         no_gpu if not gpus else ("" if sanitizer else
                                  "compute-sanitizer not found (CUDA toolkit's bin/, or "
                                  "CUDA_HOME)")),
        ("emulated references", "host", _emulated_references, ""),
        ("grad bits = emulation", "gpu", lambda: _against_emulation(0, "grad"),
         "" if gpus else no_gpu),
        ("forward bits = emulation", "gpu", lambda: _against_emulation(0, "forward"),
         "" if gpus else no_gpu),
        ("grid-stride wrap", "host", lambda: _grid_wrap("emulated-cuda", mx.cpu()), ""),
        ("grid-stride wrap", "gpu", lambda: _grid_wrap("cuda", gpu_context(0)),
         "" if gpus else no_gpu),
        ("device 1", "gpu", lambda: _device(1),
         "" if gpus >= 2 else f"needs two GPUs ({gpus} visible)"),
        ("memory after training", "gpu", _memory, "" if gpus else no_gpu),
    ]
    steps = []
    for name, where, fn, skip in plan:
        if skip:
            steps.append(Step(name, where, "SKIP", skip))
            continue
        t0 = time.perf_counter()
        try:
            detail, status = fn(), "PASS"
        except Exception as e:  # report and go on
            status, detail = "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:300]
        steps.append(Step(name, where, status,
                          f"{detail} ({time.perf_counter() - t0:.1f}s)"))
    return steps
