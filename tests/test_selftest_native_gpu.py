"""``python -m mx_roi.selftest``'s ``native-gpu`` row: the native GPU launcher's build
(here: skipped for want of a GPU, saying that it builds), and -- with CuPy and a GPU,
stood in for here by a NumPy-backed ``cupy`` and a recording ``roi_align_forward`` (the
launcher itself is proven against a stand-in driver in tests/test_ext_cuda.py) -- the
row's own logic: each ROIAlign case launched with the op's parameters on a stream, the
status checked, the output compared bit for bit, a mismatch a failure."""
import sys
import types

import numpy as np
import pytest

from mx_roi import gpucheck, selftest
from mx_roi.ext import cuda as ext_cuda


def test_row_skips_without_a_gpu_saying_the_launcher_builds():
    if gpucheck.cupy_gpu_count():  # pragma: no cover (a GPU machine runs the launch)
        pytest.skip("a GPU is here")
    with pytest.raises(selftest.Skip, match=r"^no GPU for CuPy; the launcher builds \(7 ops, "
                                            r"PTX compute_\d+; opt-in: "
                                            r"mx_roi\.ext\.cuda\.enable\(\)\)$"):
        selftest.check_native_gpu(quick=True)


class _Array:
    """A "device" array: NumPy memory with CuPy's ``.data.ptr`` and ``.nbytes``."""

    def __init__(self, a, pool):
        self.a = a
        self.nbytes = a.nbytes
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)
        pool[self.data.ptr] = a


def _fake_cupy(pool):
    class Stream:
        ptr = 0x5700

        def __init__(self, non_blocking=False):
            assert non_blocking

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    return types.SimpleNamespace(
        cuda=types.SimpleNamespace(Stream=Stream), uint8=np.uint8,
        asarray=lambda a: _Array(np.array(a), pool),
        full=lambda shape, v, dtype: _Array(np.full(shape, v, dtype), pool),
        empty=lambda n, dtype: _Array(np.empty(n, dtype), pool),
        asnumpy=lambda x: x.a.copy())


@pytest.mark.parametrize("wrong", [False, True])
def test_row_launches_each_case_and_compares_bits(monkeypatch, wrong):
    import mxnet as mx
    from mx_roi.backends import get
    pool, calls = {}, []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(pool))
    monkeypatch.setattr(gpucheck, "cupy_gpu_count", lambda: 1)

    def forward(dtype, data, rois, out, data_shape, R, pooled_size, spatial_scale,
                sample_ratio, aligned, pool_mode, caffe, workspace, workspace_bytes, stream):
        calls.append(dict(pooled_size=pooled_size, spatial_scale=spatial_scale,
                          sample_ratio=sample_ratio, aligned=aligned, pool_mode=pool_mode,
                          caffe=caffe, stream=stream,
                          ws=pool[workspace].nbytes == workspace_bytes))
        op = selftest._op("ROIAlign", dict(pooled_size=pooled_size,
                                            spatial_scale=spatial_scale,
                                            sample_ratio=sample_ratio, aligned=aligned,
                                            pool_mode=pool_mode,
                                            legacy="caffe" if caffe else ""))
        want, _ = selftest._run(get("emulated-cuda"), op, pool[data], pool[rois],
                                np.ones(op.out_shape(pool[data].shape, pool[rois].shape),
                                        dtype), mx.cpu())
        pool[out][...] = want
        if wrong:  # the lowest bit of one element flipped
            pool[out].view(np.uint8).reshape(-1)[0] ^= 1

    checked = []
    monkeypatch.setattr(ext_cuda, "roi_align_forward", forward)
    monkeypatch.setattr(ext_cuda, "check", lambda op, stream, wait: checked.append(
        (op, stream, wait)))
    cases = [params for name, params in selftest.CASES if name == "ROIAlign"]
    if wrong:
        with pytest.raises(AssertionError, match=r"^native GPU ROIAlign .* float32: not "
                                                 r"bit-equal to emulated-cuda$"):
            selftest.check_native_gpu(quick=True)
        return
    detail = selftest.check_native_gpu(quick=True)
    assert detail.endswith(f"; {len(cases)} ROIAlign forwards through it on the GPU, "
                           "bit-equal to emulated-cuda")
    assert checked == [("ROIAlign", 0x5700, True)] * len(cases)
    for params, got in zip(cases, calls):
        op = selftest._op("ROIAlign", params)
        assert got == dict(pooled_size=op.param.pooled_size,
                           spatial_scale=op.param.spatial_scale,
                           sample_ratio=op.param.sample_ratio, aligned=op.param.aligned,
                           pool_mode=op.param.pool_mode, caffe=op.param.legacy == "caffe",
                           stream=0x5700, ws=True)
