import mxnet as mx
from mxnet import autograd
import mx_roi

feat = mx.nd.random.uniform(shape=(2, 16, 20, 30))    # (N, C, H, W): a stride-16 map
rois = mx.nd.array([[0, 32.5, 48.2, 200.7, 180.1],    # (R, 5) = (batch index, x1, y1,
                    [1, 16, 16, 300, 240]])            # x2, y2), image coordinates
feat.attach_grad()
rois.attach_grad()                                    # the box gets a gradient too
with autograd.record():
    out = mx_roi.nd.PrRoIPool(feat, rois, (7, 7), 1 / 16)   # pooled_size, spatial_scale
out.backward()
print(out.shape)  # -> (2, 16, 7, 7)
print(rois.grad.shape)  # -> (2, 5)
print(rois.grad[:, 0].asnumpy().tolist())  # -> [0.0, 0.0]
