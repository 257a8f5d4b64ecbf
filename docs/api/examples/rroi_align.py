import math

import mxnet as mx
import mx_roi

feat = mx.nd.random.uniform(shape=(1, 16, 20, 30))    # (N, C, H, W): a stride-16 map
# (R, 6) = (batch index, x_center, y_center, width, height, angle) in image
# coordinates; the angle in DEGREES, counter-clockwise (MXNet's and Detectron2's unit)
rois = mx.nd.array([[0, 240, 160, 200, 80, 30],
                    [0, 240, 160, 200, 80, -90]])
# pooled_size, spatial_scale, sampling_ratio (MXNet's RROIAlign spells it so;
# ROIAlign's is sample_ratio)
out = mx_roi.nd.RROIAlign(feat, rois, (7, 7), 1 / 16, 2)
print(out.shape)  # -> (2, 16, 7, 7)
# a box from mmcv's RoIAlignRotated, whose angle is in radians: convert it
theta = math.pi / 6
mmcv_box = mx.nd.array([[0, 240, 160, 200, 80, math.degrees(theta)]])
same = mx_roi.nd.RROIAlign(feat, mmcv_box, (7, 7), 1 / 16, 2)
print((same[0] == out[0]).min().asscalar())  # -> 1.0
