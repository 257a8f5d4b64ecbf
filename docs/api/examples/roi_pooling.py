import mxnet as mx
import mx_roi

feat = mx.nd.random.uniform(shape=(2, 16, 20, 30))    # (N, C, H, W): a stride-16 map
rois = mx.nd.array([[0, 32, 48, 200, 180],            # (R, 5) = (batch index, x1, y1,
                    [1, 0, 0, 479, 319]])              # x2, y2), image coordinates
out = mx_roi.nd.ROIPooling(feat, rois, (7, 7), 1 / 16)   # pooled_size, spatial_scale
print(out.shape)  # -> (2, 16, 7, 7)
# the second box covers the whole map: its bins' maxima include the map's maximum
print(out[1].max().asscalar() == feat[1].max().asscalar())  # -> True
