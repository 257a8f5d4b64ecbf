import mxnet as mx
import mx_roi

# R-FCN: output_dim 4 (classes) x a 3 x 3 group grid of score maps
scores = mx.nd.random.uniform(shape=(1, 4 * 3 * 3, 20, 30))
rois = mx.nd.array([[0, 32, 48, 200, 180],            # (R, 5) = (batch index, x1, y1,
                    [0, 0, 0, 479, 319]])              # x2, y2), image coordinates
# spatial_scale, output_dim, pooled_size, as mx.nd.contrib.PSROIPooling
out = mx_roi.nd.PSROIPooling(scores, rois, 1 / 16, 4, 3)
print(out.shape)  # -> (2, 4, 3, 3)
