"""The torchvision column: ``torchvision.ops`` on the same inputs at mx_roi's thread count.

When ``torch`` and ``torchvision`` import, every workload whose op has a torchvision
counterpart (``roi_pool``, ``roi_align`` with its ``aligned`` flag and
``sampling_ratio``, ``ps_roi_pool``, ``ps_roi_align``) is run once through it and
compared with our output (and, for fwd+bwd, our data gradient) with the bench's
``np.allclose``; only where they agree is torchvision timed, interleaved with the other
sides, and its ratio ours / torchvision reported.  Where the semantics differ (max-mode
RoIAlign has no counterpart; torchvision's position-sensitive ops place their bins
differently from MXNet's) the column says '-' and the note says why.  torch is optional
(``pip install "mx_roi[torch]"``, docs/installing.md): nothing here imports it until
:func:`load` is called.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple

import numpy as np

__all__ = ["Torchvision", "GpuRun", "gpu_available", "load", "counterpart"]

#: our op -> the torchvision.ops function computing the same thing (where it does)
FUNCTIONS = {"ROIPooling": "roi_pool", "ROIAlign": "roi_align",
             "PSROIPooling": "ps_roi_pool", "PSROIAlign": "ps_roi_align"}


def counterpart(op: str, kwargs: Dict) -> Tuple[Optional[str], Dict, str]:
    """(torchvision.ops function name or None, its keyword arguments, why not) for our
    op ``op`` with parameters ``kwargs`` (a workload's ``ours_kwargs``)."""
    if op not in FUNCTIONS:
        return None, {}, f"torchvision has no {op}"
    if kwargs.get("pool_mode", "avg") != "avg":
        return None, {}, "torchvision has no max-mode RoIAlign"
    if kwargs.get("legacy"):
        return None, {}, f"torchvision has no legacy={kwargs['legacy']!r} variant"
    ph, pw = kwargs["pooled_size"]
    group = kwargs.get("group_size")
    if group is not None and tuple(np.broadcast_to(group, 2)) != (ph, pw):
        return None, {}, "torchvision's position-sensitive grid is the output grid"
    tv = dict(output_size=(int(ph), int(pw)), spatial_scale=float(kwargs["spatial_scale"]))
    if op in ("ROIAlign", "PSROIAlign"):
        tv["sampling_ratio"] = int(kwargs.get("sample_ratio", -1))
    if op == "ROIAlign":
        tv["aligned"] = bool(kwargs.get("aligned", False))
    return FUNCTIONS[op], tv, ""


def describe(name: str, kwargs: Dict) -> str:
    """``torchvision.ops.roi_align(aligned=True, sampling_ratio=2)`` for the table."""
    extra = ", ".join(f"{k}={kwargs[k]}" for k in ("aligned", "sampling_ratio") if k in kwargs)
    return f"torchvision.ops.{name}({extra})"


class Torchvision:
    """torch + torchvision.ops, their threads set to ``threads`` (mx_roi's count), on the
    host or (``device_id``) on that CUDA device."""

    def __init__(self, torch, ops, torchvision_version: str, threads: int,
                 device_id: Optional[int] = None):
        self.torch, self.ops = torch, ops
        self.device_id = device_id
        torch.set_num_threads(int(threads))
        self.info = dict(torch=str(torch.__version__), torchvision=torchvision_version,
                         threads=int(torch.get_num_threads()),
                         device="cpu" if device_id is None else f"cuda:{int(device_id)}")

    def tensors(self, *arrays):
        """float32 tensors of ``arrays`` where this side runs (copies), and its sync:
        ``torch.cuda.synchronize`` on a GPU (a timed call ends when its kernels have),
        nothing on the host."""
        torch = self.torch
        out = [torch.from_numpy(np.ascontiguousarray(a, np.float32)) for a in arrays]
        if self.device_id is None:
            return out, _no_sync
        dev = torch.device("cuda", int(self.device_id))
        return [t.to(dev) for t in out], torch.cuda.synchronize

    def runner(self, name: str, kwargs: Dict, data: np.ndarray, rois: np.ndarray,
               out_grad: np.ndarray) -> Callable:
        """``run(direction) -> (seconds, output, data gradient or None)`` on copies of the
        bench's arrays (``data`` (N, C, H, W), ``rois`` (R, 5), ``out_grad``)."""
        fn = getattr(self.ops, name)
        (x, boxes, g), sync = self.tensors(data, rois, out_grad)

        def run(direction):
            if direction == "fwd":
                t0 = time.perf_counter()
                out = fn(x, boxes, **kwargs)
                sync()
                elapsed = time.perf_counter() - t0
                return elapsed, out.detach().cpu().numpy(), None
            leaf = x.detach().requires_grad_(True)  # a fresh leaf: the gradient is written
            t0 = time.perf_counter()
            out = fn(leaf, boxes, **kwargs)
            out.backward(g)
            sync()
            elapsed = time.perf_counter() - t0
            return elapsed, out.detach().cpu().numpy(), leaf.grad.cpu().numpy()
        return run


def _no_sync():
    pass


class GpuRun:
    """torchvision on the GPU for :mod:`mx_roi.bench.gpu_kernels` (``tv`` made with a
    ``device_id``): the inputs copied there once, one forward + backward made (``out``,
    ``grad``: NumPy copies, for the check against ours), and ``calls``: 'fwd' (a training
    forward: the input requires its gradient, so the graph is built as in a training
    step) and 'bwd' (``torch.autograd.grad`` of the kept forward; the graph is retained
    for the next repeat), each ending in ``torch.cuda.synchronize()`` as our calls do."""

    def __init__(self, tv: "Torchvision", name: str, kwargs: Dict, data: np.ndarray,
                 rois: np.ndarray, out_grad: np.ndarray):
        torch, fn = tv.torch, getattr(tv.ops, name)
        (x, boxes, g), sync = tv.tensors(data, rois, out_grad)
        leaf = x.detach().requires_grad_(True)
        kept = fn(leaf, boxes, **kwargs)
        (grad,) = torch.autograd.grad(kept, leaf, g, retain_graph=True)
        self.out, self.grad = kept.detach().cpu().numpy(), grad.cpu().numpy()

        def fwd():
            fn(leaf, boxes, **kwargs)
            sync()

        def bwd():
            torch.autograd.grad(kept, leaf, g, retain_graph=True)
            sync()
        self.calls = {"fwd": fwd, "bwd": bwd}


def gpu_available(tv: Optional["Torchvision"]) -> str:
    """'' when ``tv``'s torch sees a CUDA device, else why not."""
    if tv is None:
        return "torch / torchvision not importable"
    if not tv.torch.cuda.is_available():
        return f"torch {tv.info['torch']} sees no CUDA device"
    return ""


def load(threads: int, device_id: Optional[int] = None) -> Tuple[Optional[Torchvision], str]:
    """(:class:`Torchvision`, '') when torch and torchvision import, else (None, why); with
    ``device_id`` its tensors live on that CUDA device (:func:`gpu_available` says whether
    torch sees one)."""
    try:
        import torch
        import torchvision
        from torchvision import ops
    except Exception as exc:  # noqa: BLE001 - any import failure means: no column
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return Torchvision(torch, ops, str(getattr(torchvision, "__version__", "?")), threads,
                       device_id), ""
