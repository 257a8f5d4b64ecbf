"""Faster R-CNN symbols (MXNet symbol API, in the style of MXNet's example/rcnn).

    backbone -> RPN (anchors, MultiProposal) -> proposal-target sampling (CustomOp, training)
             -> RoI operator (roi_ops.roi_features: pool | align | psalign)
             -> head (cls + class-specific bbox regression) -> losses

Backbones: ``tiny`` (CPU friendly, stride 8, default), ``vgg16`` and ``resnet50`` (C4, stride 16),
with MXNet's usual parameter names so user-supplied ``.params`` load by name.
With ``psalign`` the head is R-FCN style: position-sensitive score/box maps + PSROIAlign +
average voting.
"""
from __future__ import annotations

import mxnet as mx

from . import proposal_target  # noqa: F401  (registers rcnn_proposal_target)
from .roi_ops import roi_features

EPS = 2e-5


# ----------------------------------------------------------------------------- backbones
def _conv_relu(x, name, num_filter, kernel=3, pad=1, stride=1):
    x = mx.sym.Convolution(x, num_filter=num_filter, kernel=(kernel, kernel), pad=(pad, pad),
                           stride=(stride, stride), name=name)
    return mx.sym.Activation(x, act_type="relu", name="relu_" + name)


def tiny_backbone(data):
    """5 convs, stride 8, 128 channels: trains in minutes on two CPU cores."""
    x = _conv_relu(data, "tconv1", 32)
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max", name="tpool1")
    x = _conv_relu(x, "tconv2", 64)
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max", name="tpool2")
    x = _conv_relu(x, "tconv3", 96)
    x = _conv_relu(x, "tconv4", 96)
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max", name="tpool3")
    return _conv_relu(x, "tconv5", 128)


def tiny_head(roi_feat, cfg):
    x = mx.sym.FullyConnected(roi_feat, num_hidden=cfg.head_hidden, name="tfc6")
    x = mx.sym.Activation(x, act_type="relu", name="relu_tfc6")
    x = mx.sym.FullyConnected(x, num_hidden=cfg.head_hidden, name="tfc7")
    return mx.sym.Activation(x, act_type="relu", name="relu_tfc7")


def vgg16_backbone(data):
    x = data
    for stage, (n, filters) in enumerate([(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)], 1):
        for i in range(1, n + 1):
            x = _conv_relu(x, "conv%d_%d" % (stage, i), filters)
        if stage < 5:
            x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max",
                               name="pool%d" % stage)
    return x


def vgg16_head(roi_feat, cfg, train):
    x = mx.sym.FullyConnected(mx.sym.flatten(roi_feat), num_hidden=cfg.head_hidden, name="fc6")
    x = mx.sym.Activation(x, act_type="relu", name="relu6")
    if train:
        x = mx.sym.Dropout(x, p=0.5, name="drop6")
    x = mx.sym.FullyConnected(x, num_hidden=cfg.head_hidden, name="fc7")
    x = mx.sym.Activation(x, act_type="relu", name="relu7")
    if train:
        x = mx.sym.Dropout(x, p=0.5, name="drop7")
    return x


def _bn(x, name, fix_gamma=False):
    # frozen BatchNorm (use_global_stats) as in MXNet's example/rcnn ResNet
    return mx.sym.BatchNorm(x, fix_gamma=fix_gamma, eps=EPS, use_global_stats=True, name=name)


def _residual_unit(data, num_filter, stride, dim_match, name):
    bn1 = _bn(data, name + "_bn1")
    act1 = mx.sym.Activation(bn1, act_type="relu", name=name + "_relu1")
    conv1 = mx.sym.Convolution(act1, num_filter=num_filter // 4, kernel=(1, 1), no_bias=True,
                               name=name + "_conv1")
    bn2 = _bn(conv1, name + "_bn2")
    act2 = mx.sym.Activation(bn2, act_type="relu", name=name + "_relu2")
    conv2 = mx.sym.Convolution(act2, num_filter=num_filter // 4, kernel=(3, 3), pad=(1, 1),
                               stride=stride, no_bias=True, name=name + "_conv2")
    bn3 = _bn(conv2, name + "_bn3")
    act3 = mx.sym.Activation(bn3, act_type="relu", name=name + "_relu3")
    conv3 = mx.sym.Convolution(act3, num_filter=num_filter, kernel=(1, 1), no_bias=True,
                               name=name + "_conv3")
    shortcut = data if dim_match else mx.sym.Convolution(
        act1, num_filter=num_filter, kernel=(1, 1), stride=stride, no_bias=True, name=name + "_sc")
    return conv3 + shortcut


def _stage(x, stage, units, num_filter, stride):
    x = _residual_unit(x, num_filter, (stride, stride), False, "stage%d_unit1" % stage)
    for i in range(2, units + 1):
        x = _residual_unit(x, num_filter, (1, 1), True, "stage%d_unit%d" % (stage, i))
    return x


def resnet50_c4_backbone(data):
    x = _bn(data, "bn_data", fix_gamma=True)
    x = mx.sym.Convolution(x, num_filter=64, kernel=(7, 7), stride=(2, 2), pad=(3, 3),
                           no_bias=True, name="conv0")
    x = mx.sym.Activation(_bn(x, "bn0"), act_type="relu", name="relu0")
    x = mx.sym.Pooling(x, kernel=(3, 3), stride=(2, 2), pad=(1, 1), pool_type="max", name="pool0")
    x = _stage(x, 1, 3, 256, 1)
    x = _stage(x, 2, 4, 512, 2)
    return _stage(x, 3, 6, 1024, 2)


def resnet50_c5_head(roi_feat):
    x = _stage(roi_feat, 4, 3, 2048, 2)
    x = mx.sym.Activation(_bn(x, "bn1"), act_type="relu", name="relu1")
    return mx.sym.Pooling(x, kernel=(7, 7), global_pool=True, pool_type="avg", name="pool1")


def backbone_symbol(cfg, data=None):
    data = mx.sym.Variable("data") if data is None else data
    if cfg.backbone == "tiny":
        return tiny_backbone(data)
    if cfg.backbone == "vgg16":
        return vgg16_backbone(data)
    if cfg.backbone == "resnet50":
        return resnet50_c4_backbone(data)
    raise ValueError("unknown backbone %r" % cfg.backbone)


def feature_shape(cfg):
    """(H, W) of the stride-``feat_stride`` feature map for ``cfg.image_size`` inputs."""
    _, out, _ = backbone_symbol(cfg).infer_shape(data=(1, 3, cfg.image_size, cfg.image_size))
    return tuple(out[0][2:])


# ----------------------------------------------------------------------------- detector
def _smooth_l1(x, sigma):
    return mx.sym.smooth_l1(x, scalar=sigma)


def _rpn(cfg, feat):
    num_anchors = len(cfg.anchor_scales) * len(cfg.anchor_ratios)
    channels = 512 if cfg.backbone != "tiny" else 128
    x = _conv_relu(feat, "rpn_conv_3x3", channels)
    cls = mx.sym.Convolution(x, kernel=(1, 1), num_filter=2 * num_anchors, name="rpn_cls_score")
    bbox = mx.sym.Convolution(x, kernel=(1, 1), num_filter=4 * num_anchors, name="rpn_bbox_pred")
    return cls, bbox, num_anchors


def _proposals(cfg, rpn_cls_score, rpn_bbox_pred, im_info, num_anchors, train):
    score = mx.sym.Reshape(rpn_cls_score, shape=(0, 2, -1, 0), name="rpn_cls_score_reshape")
    act = mx.sym.softmax(score, axis=1, name="rpn_cls_act")
    act = mx.sym.Reshape(act, shape=(0, 2 * num_anchors, -1, 0), name="rpn_cls_act_reshape")
    return score, mx.sym.contrib.MultiProposal(
        cls_prob=act, bbox_pred=rpn_bbox_pred, im_info=im_info, name="rois",
        feature_stride=cfg.feat_stride, scales=tuple(cfg.anchor_scales),
        ratios=tuple(cfg.anchor_ratios),
        rpn_pre_nms_top_n=cfg.rpn_pre_nms_train if train else cfg.rpn_pre_nms_test,
        rpn_post_nms_top_n=cfg.rpn_post_nms_train if train else cfg.rpn_post_nms_test,
        threshold=cfg.rpn_nms_thresh, rpn_min_size=cfg.rpn_min_size)


def _rcnn_head(cfg, feat, rois, train):
    """RoI operator + head -> (cls_score (R, C), bbox_pred (R, 4C))."""
    c = cfg.num_classes
    scale = 1.0 / cfg.feat_stride
    k = cfg.pooled_size
    if cfg.roi_op == "psalign":
        # R-FCN: one PSROIAlign over the concatenated score (C) and box (4C) maps
        x = feat
        if cfg.backbone != "tiny":
            x = _conv_relu(feat, "rfcn_conv", 512, kernel=1, pad=0)
        ps = mx.sym.Convolution(x, kernel=(1, 1), num_filter=5 * c * k * k, name="rfcn_ps")
    else:
        ps = feat
    roi_feat = roi_features(cfg.roi_op, ps, rois, k, scale, sample_ratio=cfg.sample_ratio,
                            aligned=cfg.aligned, output_dim=5 * c)
    if cfg.roi_op == "psalign":
        voted = mx.sym.mean(roi_feat, axis=(2, 3), name="rfcn_vote")
        cls_score = mx.sym.slice_axis(voted, axis=1, begin=0, end=c, name="cls_score")
        bbox_pred = mx.sym.slice_axis(voted, axis=1, begin=c, end=5 * c, name="bbox_pred")
        return cls_score, bbox_pred
    if cfg.backbone == "tiny":
        top = tiny_head(roi_feat, cfg)
    elif cfg.backbone == "vgg16":
        top = vgg16_head(roi_feat, cfg, train)
    else:
        top = resnet50_c5_head(roi_feat)
    cls_score = mx.sym.FullyConnected(top, num_hidden=c, name="cls_score")
    bbox_pred = mx.sym.FullyConnected(top, num_hidden=4 * c, name="bbox_pred")
    return cls_score, bbox_pred


def get_train_symbol(cfg, images_per_device, seed=0):
    """Training symbol. Outputs: rpn_cls_prob, rpn_bbox_loss, cls_prob, bbox_loss, label."""
    data = mx.sym.Variable("data")
    im_info = mx.sym.Variable("im_info")
    gt_boxes = mx.sym.Variable("gt_boxes")
    rpn_label = mx.sym.Variable("rpn_label")
    rpn_bbox_target = mx.sym.Variable("rpn_bbox_target")
    rpn_bbox_weight = mx.sym.Variable("rpn_bbox_weight")

    feat = backbone_symbol(cfg, data)
    rpn_cls_score, rpn_bbox_pred, num_anchors = _rpn(cfg, feat)
    score_reshape, rois = _proposals(cfg, rpn_cls_score, rpn_bbox_pred, im_info, num_anchors,
                                     train=True)
    rpn_cls_prob = mx.sym.SoftmaxOutput(score_reshape, label=rpn_label, multi_output=True,
                                        normalization="valid", use_ignore=True, ignore_label=-1,
                                        name="rpn_cls_prob")
    rpn_bbox_loss = mx.sym.MakeLoss(
        rpn_bbox_weight * _smooth_l1(rpn_bbox_pred - rpn_bbox_target, 3.0),
        grad_scale=1.0 / (images_per_device * cfg.rpn_batch_size), name="rpn_bbox_loss")

    group = mx.sym.Custom(rois=rois, gt_boxes=gt_boxes, op_type="rcnn_proposal_target",
                          num_classes=cfg.num_classes, batch_rois=cfg.batch_rois,
                          fg_fraction=cfg.fg_fraction, fg_thresh=cfg.fg_thresh,
                          bg_thresh_hi=cfg.bg_thresh_hi, bg_thresh_lo=cfg.bg_thresh_lo,
                          bbox_stds=str(tuple(cfg.bbox_stds)), seed=seed, name="ptarget")
    rois_s, label, bbox_target, bbox_weight = group[0], group[1], group[2], group[3]

    cls_score, bbox_pred = _rcnn_head(cfg, feat, rois_s, train=True)
    cls_prob = mx.sym.SoftmaxOutput(cls_score, label=label, normalization="batch",
                                    name="cls_prob")
    bbox_loss = mx.sym.MakeLoss(bbox_weight * _smooth_l1(bbox_pred - bbox_target, 1.0),
                                grad_scale=1.0 / (images_per_device * cfg.batch_rois),
                                name="bbox_loss")
    return mx.sym.Group([rpn_cls_prob, rpn_bbox_loss, cls_prob, bbox_loss,
                         mx.sym.BlockGrad(label, name="label_out")])


def get_test_symbol(cfg):
    """Inference symbol. Outputs: rois (B*R, 5), cls_prob (B*R, C), bbox_pred (B*R, 4C)."""
    data = mx.sym.Variable("data")
    im_info = mx.sym.Variable("im_info")
    feat = backbone_symbol(cfg, data)
    rpn_cls_score, rpn_bbox_pred, num_anchors = _rpn(cfg, feat)
    _, rois = _proposals(cfg, rpn_cls_score, rpn_bbox_pred, im_info, num_anchors, train=False)
    cls_score, bbox_pred = _rcnn_head(cfg, feat, rois, train=False)
    cls_prob = mx.sym.softmax(cls_score, axis=-1, name="cls_prob")
    return mx.sym.Group([rois, cls_prob, bbox_pred])


def initializer():
    """Xavier for the backbone; small Gaussians for the prediction layers (like example/rcnn)."""
    return mx.init.Mixed(
        [".*rpn_cls_score.*|.*rpn_bbox_pred.*|cls_score.*|rfcn_ps.*", "bbox_pred.*", ".*"],
        [mx.init.Normal(0.01), mx.init.Normal(0.001),
         mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2)])
