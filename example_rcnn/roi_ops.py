"""The ONE place where the detector's RoI operator is chosen (``--roi-op pool|align|psalign``).

The ops come from :mod:`mx_roi.sym`, whose wrappers also guard against the oneDNN memory
hazard of custom ops fed directly by convolutions.  If ``mx_roi.sym`` is not importable
(an mx_roi checkout without it), MXNet's built-in operators are used instead and a warning is
printed once; :data:`BACKEND` says which is in use.  ``EXAMPLE_RCNN_BUILTIN_ROI=1`` forces the
built-ins (a debugging/comparison switch, not for normal use).
"""
from __future__ import annotations

import os
import warnings

import mxnet as mx

_IMPORT_ERROR = "EXAMPLE_RCNN_BUILTIN_ROI=1"
if os.environ.get("EXAMPLE_RCNN_BUILTIN_ROI", "0") == "1":
    # debugging switch only: compare against MXNet's built-in operators
    _roi_sym = None
    BACKEND = "mxnet-builtin"
else:
    try:
        import mx_roi  # noqa: F401  (registers the custom ops)
        from mx_roi import sym as _roi_sym
        BACKEND = "mx_roi"
    except Exception as _err:  # pragma: no cover - depends on the mx_roi checkout
        _roi_sym = None
        BACKEND = "mxnet-builtin"
        _IMPORT_ERROR = repr(_err)

_warned = False


def _fallback_warning():
    global _warned
    if not _warned:
        warnings.warn("mx_roi.sym is unavailable (%s); using MXNet's built-in RoI ops"
                      % _IMPORT_ERROR)
        _warned = True


def roi_features(roi_op, data, rois, pooled_size, spatial_scale, sample_ratio=2,
                 aligned=True, output_dim=None, name="roi_feat"):
    """Apply the selected RoI operator to ``data`` for ``rois (R, 5)``.

    ``pool`` -> ROIPooling, ``align`` -> ROIAlign (average), ``psalign`` -> PSROIAlign with
    ``output_dim`` channels out and ``group_size == pooled_size`` (R-FCN).
    """
    k = int(pooled_size)
    if _roi_sym is not None:
        if roi_op == "pool":
            return _roi_sym.ROIPooling(data=data, rois=rois, pooled_size=(k, k),
                                       spatial_scale=spatial_scale, name=name)
        if roi_op == "align":
            return _roi_sym.ROIAlign(data=data, rois=rois, pooled_size=(k, k),
                                     spatial_scale=spatial_scale, sample_ratio=sample_ratio,
                                     aligned=aligned, name=name)
        if roi_op == "psalign":
            return _roi_sym.PSROIAlign(data=data, rois=rois, pooled_size=k,
                                       output_dim=int(output_dim), spatial_scale=spatial_scale,
                                       sample_ratio=sample_ratio, aligned=aligned,
                                       group_size=k, name=name)
    else:
        _fallback_warning()
        if roi_op == "pool":
            return mx.sym.ROIPooling(data=data, rois=rois, pooled_size=(k, k),
                                     spatial_scale=spatial_scale, name=name)
        if roi_op == "align":
            return mx.sym.contrib.ROIAlign(data=data, rois=rois, pooled_size=(k, k),
                                           spatial_scale=spatial_scale,
                                           sample_ratio=sample_ratio, aligned=aligned, name=name)
        if roi_op == "psalign":
            return mx.sym.contrib.ROIAlign(data=data, rois=rois, pooled_size=(k, k),
                                           spatial_scale=spatial_scale,
                                           sample_ratio=sample_ratio, aligned=aligned,
                                           position_sensitive=True, name=name)
    raise ValueError("roi_op must be pool, align or psalign, got %r" % (roi_op,))
