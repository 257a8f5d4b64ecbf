import mxnet as mx
import mx_roi

# output_dim 2 x a 7 x 7 group grid (the pooled grid, group_size=0) of score maps
scores = mx.nd.random.uniform(shape=(1, 2 * 7 * 7, 20, 30))
rois = mx.nd.array([[0, 32, 48, 200, 180],            # (R, 5) = (batch index, x1, y1,
                    [0, 0, 0, 479, 319]])              # x2, y2), image coordinates
pool = mx_roi.gluon.PSROIAlign(pooled_size=7, output_dim=2, spatial_scale=1 / 16,
                               sample_ratio=2)
out = pool(scores, rois)
print(out.shape)  # -> (2, 2, 7, 7)
# the same as MXNet's ROIAlign(position_sensitive=True)
ref = mx.nd.contrib.ROIAlign(scores, rois, (7, 7), 1 / 16, 2, position_sensitive=True)
print(float(abs(out - ref).max().asscalar()) < 1e-5)  # -> True
