"""Faster R-CNN example (MXNet symbol API) using mx_roi's RoI operators.

Entry points: ``python -m example_rcnn.train | evaluate | compare | launch | demo``.
See ``example_rcnn/README.md``.
"""
