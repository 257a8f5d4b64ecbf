import mxnet as mx
import mx_roi

# Deformable R-FCN: output_dim 4 x a 3 x 3 group grid of score maps
scores = mx.nd.random.uniform(shape=(1, 4 * 3 * 3, 20, 30))
rois = mx.nd.array([[0, 32, 48, 200, 180],            # (R, 5) = (batch index, x1, y1,
                    [0, 0, 0, 479, 319]])              # x2, y2), image coordinates
# trans: (R, 2K, part_size, part_size) bin offsets, x then y, for K = 1 class group
trans = mx.nd.random.uniform(-1, 1, shape=(2, 2, 3, 3))
# data, rois, trans, then spatial_scale, output_dim, group_size, pooled_size, as
# mx.nd.contrib.DeformablePSROIPooling
out = mx_roi.nd.DeformablePSROIPooling(scores, rois, trans, 1 / 16, 4, 3, 3,
                                       part_size=3, sample_per_part=2, trans_std=0.1)
print(out.shape)  # -> (2, 4, 3, 3)
# without offsets: no_trans=True, and None for trans
plain = mx_roi.nd.DeformablePSROIPooling(scores, rois, None, 1 / 16, 4, 3, 3,
                                         sample_per_part=2, no_trans=True)
print(plain.shape)  # -> (2, 4, 3, 3)
