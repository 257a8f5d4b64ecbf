"""The DLPack wrappers accept the array API's full ``__dlpack__`` protocol.

CuPy 13's ``from_dlpack`` calls ``__dlpack__(stream=..., max_version=..., copy=...)`` and
only retries the old way on ``TypeError``; a later CuPy may not retry.  MXNet hands out an
unversioned capsule (allowed for any ``max_version``) that we cannot copy.
"""
import mxnet as mx
import numpy as np
import pytest

from mx_roi.ndio import DLPackCapsule

WRAPPERS = [(lambda c: DLPackCapsule(c), (1, 0)), (lambda c: DLPackCapsule(c, (2, 3)), (2, 3))]


@pytest.mark.parametrize("wrap, device", WRAPPERS, ids=["cpu", "cuda"])
def test_full_protocol(wrap, device):
    capsule = mx.nd.arange(6).reshape((2, 3)).to_dlpack_for_read()
    w = wrap(capsule)
    assert w.__dlpack_device__() == device
    assert w.__dlpack__() is capsule
    assert w.__dlpack__(stream=None) is capsule
    assert w.__dlpack__(stream=None, max_version=(1, 0), dl_device=device, copy=False) \
        is capsule
    assert w.__dlpack__(max_version=(0, 8), copy=None) is capsule
    with pytest.raises(BufferError, match="cannot be copied"):
        w.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"not \(?.*\(4, 0\)"):
        w.__dlpack__(dl_device=(4, 0))
    with pytest.raises(TypeError):  # keyword-only, as in the array API
        w.__dlpack__(None)
    assert w.__dlpack__() is capsule  # still usable after the refusals


def test_numpy_reads_through_the_wrapper():
    x = mx.nd.arange(6).reshape((2, 3))
    view = np.from_dlpack(DLPackCapsule(x.to_dlpack_for_read()))
    np.testing.assert_array_equal(view, np.arange(6).reshape(2, 3))


def test_no_import_cycle_between_the_backends():
    """mx_roi.backends imports mx_roi.cuda.backend (lazily, to make a CUDA backend); the
    CUDA backend reads and writes NDArrays through mx_roi.ndio, never through backends."""
    import ast
    import inspect
    import mx_roi.cuda.backend as cb
    tree = ast.parse(inspect.getsource(cb))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.endswith("backends") for m in imported), imported
