"""mx_roi.ext's position-sensitive channel map (ext_launch.h's ps_channel_map, kept per
thread for the last group grid): calls that alternate between grids differing in one
component only (output_dim, P and Q equal) each get their own map, bit for bit the Custom
path's (native backend)."""
import os

import numpy as np
import pytest

import mxnet as mx

import mx_roi  # noqa: F401  (registers the Custom ops)
from mx_roi import ext

pytestmark = pytest.mark.skipif(bool(ext.unavailable_reason()),
                                reason="no extension library here: "
                                       + (ext.unavailable_reason() or ""))


@pytest.fixture(autouse=True)
def native_backend(monkeypatch):
    """The Custom path on the native backend's checked path (the kernels the library runs,
    launched from Python: the library's launcher is not the oracle of itself)."""
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    monkeypatch.setenv("MX_ROI_LIBRARY_CALLS", "0")
    ext.load()


def _forward_backward(name, data_np, rois_np, grad_np, kw):
    """Output and data gradient of one training call (gradient buffer prefilled with
    garbage, as MXNet may hand it)."""
    data = mx.nd.array(data_np)
    rois = mx.nd.array(rois_np)
    data.attach_grad()
    data.grad[:] = 5.0
    with mx.autograd.record():
        if name.startswith("mx_roi_"):
            out = getattr(mx.nd, name)(data, rois, **kw)
        else:
            out = mx.nd.Custom(data, rois, op_type=name, **kw)
    out.backward(mx.nd.array(grad_np))
    return out.asnumpy(), data.grad.asnumpy()


# (pooled_size, two group grids that differ in gh only or in gw only)
GRIDS = [((2, 4), (2, 2), (2, 4)),   # gw only
         ((4, 2), (2, 2), (4, 2))]   # gh only


@pytest.mark.parametrize("op", ["PSROIPooling", "PSROIAlign"])
@pytest.mark.parametrize("pooled, first, second", GRIDS)
def test_alternating_group_grids_each_get_their_own_channel_map(op, pooled, first, second):
    rng = np.random.RandomState(3)
    rois = np.array([[0, 0, 0, 7, 5], [0, 2, 1, 6, 7]], np.float32)
    grad = rng.standard_normal((2, 1) + pooled).astype(np.float32)
    calls = []
    for group in (first, second) * 3:
        data = rng.standard_normal((1, group[0] * group[1], 8, 9)).astype(np.float32)
        kw = dict(pooled_size=pooled, output_dim=1, spatial_scale=1.0, group_size=group)
        calls.append((group, data, kw))
    for group, data, kw in calls:
        ours = _forward_backward("mx_roi_" + op, data, rois, grad, kw)
        theirs = _forward_backward(op, data, rois, grad, kw)
        for a, b, what in zip(ours, theirs, ("output", "data gradient")):
            assert a.tobytes() == b.tobytes(), (op, group, what)
