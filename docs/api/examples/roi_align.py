import mxnet as mx
from mxnet import autograd
import mx_roi

feat = mx.nd.random.uniform(shape=(2, 16, 20, 30))    # (N, C, H, W): a stride-16 map
feat.attach_grad()
rois = mx.nd.array([[0, 32.5, 48.2, 200.7, 180.1],    # (R, 5) = (batch index, x1, y1,
                    [1, 0, 0, 479, 319]])              # x2, y2), image coordinates
with autograd.record():
    # pooled_size, spatial_scale, sample_ratio, as mx.nd.contrib.ROIAlign
    out = mx_roi.nd.ROIAlign(feat, rois, (7, 7), 1 / 16, 2, aligned=True)
out.backward()
print(out.shape)  # -> (2, 16, 7, 7)
print(feat.grad.shape)  # -> (2, 16, 20, 30)
# max pooling of the samples (an extension), as a Gluon block
pool = mx_roi.gluon.ROIAlign((7, 7), 1 / 16, 2, pool_mode="max")
print(pool(feat, rois).shape)  # -> (2, 16, 7, 7)
