"""The native door advises MXNet's fresh output and gradient memory onto transparent huge
pages before its kernels first touch it, as the Custom door's checked path on the native
backend does (scratch.advise_huge_pages_at).  Without it a detector-sized forward
(ROIAlign 14x14, 256 boxes, a 51 MB output) took ~12,500 page faults more per call than
the Custom door and ran up to 1.4x slower (docs/native_ops.md, issue 42's detector rows).

* the library's range (ext_common.h's huge_page_range, exported as
  mx_roi_ext_huge_page_range) is scratch.advise_huge_pages_at's, at the boundaries;
* in a fresh process that never runs the Custom door, the VMA flags of a native call's
  output (forward) and data gradient (backward) carry ``hg`` (VM_HUGEPAGE, set only by
  madvise(MADV_HUGEPAGE)), while a same-sized array MXNet wrote by itself does not."""
import ctypes
import os
import textwrap

import numpy as np
import pytest

from mx_roi import ext, scratch
from tests.child import child_result

pytestmark = pytest.mark.skipif(bool(ext.unavailable_reason()),
                                reason="no extension library here: "
                                       + (ext.unavailable_reason() or ""))

HUGE = 2 << 20


def _library_range(addr, nbytes):
    """(start, length) of the library's huge_page_range; None where it advises nothing."""
    fn = ctypes.CDLL(ext.library_path()).mx_roi_ext_huge_page_range
    fn.restype = None
    fn.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong,
                   ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]
    start, length = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    fn(addr, nbytes, ctypes.byref(start), ctypes.byref(length))
    return (start.value, length.value) if length.value else None


def _scratch_range(monkeypatch, addr, nbytes):
    """(start, length) scratch.advise_huge_pages_at hands madvise; None: no call."""
    calls = []
    monkeypatch.setattr(scratch, "_madvise",
                        lambda start, n, advice: calls.append((start, n, advice)) or 0)
    scratch.advise_huge_pages_at(addr, nbytes)
    assert all(c[2] == 14 for c in calls)  # MADV_HUGEPAGE
    return calls[-1][:2] if calls else None


def test_huge_page_range_is_scratchs(monkeypatch):
    base = 100 * HUGE
    M = scratch.HUGE_MIN_BYTES
    cases = [(base, M - 1), (base + 5, M - 1), (base, M), (base + 5, M), (base + 1, M + HUGE),
             (base + 5, 5 * HUGE), (base + 5, 5 * HUGE - 6), (base + 5, 5 * HUGE - 5),
             (base - 1, 5 * HUGE + 1), (base + HUGE - 1, M), (0, 4 * HUGE), (base, 0)]
    rng = np.random.RandomState(0)
    cases += [(int(a), int(n)) for a, n in zip(rng.randint(1, 1 << 40, 200),
                                               rng.randint(M - 3 * HUGE, 40 * HUGE, 200))]
    for addr, nbytes in cases:
        assert _library_range(addr, nbytes) == _scratch_range(monkeypatch, addr, nbytes), \
            (addr, nbytes)
    # the cases reach both answers, and the threshold is scratch's
    assert _library_range(base, M) == (base, M)
    assert _library_range(base, M - 1) is None


CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["MX_ROI_BACKEND"] = "native"
    import numpy as np
    # (NumPy advises its own large arrays: their freed pages could carry the flag into
    # MXNet's memory)
    np.core.multiarray._set_madvise_hugepage(False)
    import mxnet as mx, mx_roi
    from mx_roi import ndio

    HUGE = 2 << 20

    def flags(lo=0, hi=1 << 64):
        # the VmFlags of every mapping over [lo, hi)
        out, cur = [], None
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    cur = tuple(int(x, 16) for x in head.split("-"))
                elif head == "VmFlags:" and cur[0] < hi and cur[1] > lo:
                    out.append(line.split()[1:])
        return out

    def array_flags(nd):
        # the VmFlags over the 2 MiB pages inside nd's memory
        addr, shape, dtype = ndio.array_info(nd)
        lo = (addr + HUGE - 1) & ~(HUGE - 1)
        hi = (addr + int(np.prod(shape)) * dtype.itemsize) & ~(HUGE - 1)
        assert hi > lo, (addr, shape)
        return flags(lo, hi)

    rng = np.random.RandomState(0)
    # 1 x 128 x 100 x 100 float32 map, 256 boxes 14 x 14: 25.7 MB outputs; 10 MB gradient
    data = mx.nd.array(rng.standard_normal((1, 128, 100, 100)).astype(np.float32))
    big = mx.nd.array(rng.standard_normal((2, 128, 100, 100)).astype(np.float32))
    xy = rng.uniform(0, 800, (256, 4))
    rois = mx.nd.array(np.concatenate([np.zeros((256, 1)), np.minimum(xy[:, :2], xy[:, 2:]),
                                       np.maximum(xy[:, :2], xy[:, 2:])], 1).astype(np.float32))
    kw = dict(pooled_size=(14, 14), spatial_scale=1 / 8.0, sample_ratio=2)
    big.attach_grad()
    mx.nd.waitall()
    # the controls: no memory of this process advised yet (then any advice seen below is
    # the call's: every array advised stays alive, so no later one reuses its pages), and
    # the gradient's memory, written by MXNet at attach_grad, not advised
    res = {"process": [f for f in flags() if "hg" in f], "gradient_before": array_flags(big.grad)}
    keep = [mx.nd.mx_roi_ROIAlign(data, rois, **kw)]
    res["forward"] = array_flags(keep[-1])
    keep.append(mx.nd.mx_roi_ROIPooling(data, rois, pooled_size=(14, 14), spatial_scale=0.125))
    res["pool_forward"] = array_flags(keep[-1])
    with mx.autograd.record():
        keep.append(mx.nd.mx_roi_ROIAlign(big, rois, **kw))
    keep[-1].backward(mx.nd.ones(keep[-1].shape))
    res["gradient"] = array_flags(big.grad)
    print("RESULT " + json.dumps(res))
""")


def test_native_calls_advise_their_fresh_memory_onto_huge_pages():
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps here (not Linux)")
    probe = np.empty(4 * scratch.HUGE_MIN_BYTES, np.uint8)
    if not scratch.advise_huge_pages(probe):
        pytest.skip("madvise(MADV_HUGEPAGE) fails here (a kernel without THP): nothing "
                    "to advise")
    res = child_result(CHILD, env={"MX_ROI_NATIVE_OPS": "1"})
    assert res["process"] == [], res["process"]  # (the controls: see CHILD)
    assert res["gradient_before"] and not any("hg" in f for f in res["gradient_before"]), \
        res["gradient_before"]
    for what in ("forward", "pool_forward", "gradient"):
        assert res[what] and all("hg" in f for f in res[what]), (what, res[what])
