"""The one spelling rule of mx_roi's on/off environment variables.

``MX_ROI_NATIVE_OPS`` (:mod:`mx_roi.ext.door`), ``MX_ROI_LIBRARY_CALLS``
(:mod:`mx_roi.cuda.library_calls`) and MXNet's ``MXNET_MKLDNN_ENABLED`` as
:mod:`mx_roi.onednn` reads it are *off* when set to ``0``, ``false``, ``off`` or ``no``
(any case, surrounding spaces ignored); any other value, or none, leaves them on.
"""
from __future__ import annotations

import os

__all__ = ["OFF", "switched_off"]

#: the spellings of "off"
OFF = ("0", "false", "off", "no")


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` is set to one of :data:`OFF`."""
    return os.environ.get(name, "1").strip().lower() in OFF
