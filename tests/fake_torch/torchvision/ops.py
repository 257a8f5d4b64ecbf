"""Stand-ins for ``torchvision.ops`` computed by MXNet's built-in operators (tests only).

``roi_pool``, ``roi_align`` and ``ps_roi_pool`` compute what torchvision's would where the
semantics coincide with MXNet's; ``ps_roi_align`` models torchvision's half-pixel offset
(MXNet's position-sensitive ROIAlign with ``aligned=True``), so it differs from a
workload with ``aligned=False``, as the real one does.
"""
import mxnet as mx

from torch import Tensor


def _call(fn, x, boxes):
    data, rois = mx.nd.array(x.numpy()), mx.nd.array(boxes.numpy())
    if not x.requires_grad:
        return Tensor(fn(data, rois).asnumpy())
    data.attach_grad()
    with mx.autograd.record():
        out = fn(data, rois)

    def backward(grad):
        out.backward(mx.nd.array(grad), retain_graph=True)  # repeated by the GPU column
        x.grad = Tensor(data.grad.asnumpy())
    return Tensor(out.asnumpy(), backward)


def roi_pool(x, boxes, output_size, spatial_scale=1.0):
    return _call(lambda d, r: mx.nd.ROIPooling(d, r, pooled_size=output_size,
                                               spatial_scale=spatial_scale), x, boxes)


def roi_align(x, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False):
    return _call(lambda d, r: mx.nd.contrib.ROIAlign(
        d, r, pooled_size=output_size, spatial_scale=spatial_scale,
        sample_ratio=sampling_ratio, aligned=aligned), x, boxes)


def ps_roi_pool(x, boxes, output_size, spatial_scale=1.0):
    ph, pw = output_size
    return _call(lambda d, r: mx.nd.contrib.PSROIPooling(
        d, r, pooled_size=ph, group_size=ph, output_dim=d.shape[1] // (ph * pw),
        spatial_scale=spatial_scale), x, boxes)


def ps_roi_align(x, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1):
    return _call(lambda d, r: mx.nd.contrib.ROIAlign(
        d, r, pooled_size=output_size, spatial_scale=spatial_scale,
        sample_ratio=sampling_ratio, position_sensitive=True, aligned=True), x, boxes)
