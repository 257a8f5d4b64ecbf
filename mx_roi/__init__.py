"""mx_roi: RoI operators for MXNet as custom ops -- ROIPooling, ROIAlign, PSROIPooling,
PSROIAlign, RROIAlign, DeformablePSROIPooling and PrRoIPool (:data:`OP_TYPES`).

``import mx_roi`` registers every op (``mx.nd.Custom(data, rois, op_type='ROIAlign',
...)``), loads the extension library's native operators ``mx_roi_<Op>`` when it is cached
(:mod:`mx_roi.ext.door`: which calls use them) and exposes :mod:`mx_roi.nd`,
:mod:`mx_roi.sym` and :mod:`mx_roi.gluon` with the built-ins' signatures, and registers the ONNX export of ROIPooling, ROIAlign,
PSROIPooling and PSROIAlign with ``mx.onnx.export_model`` (:mod:`mx_roi.onnx`).
"""
import atexit

import mxnet as _mx  # noqa: F401  (ops register against the imported mxnet)

from ._version import __version__  # noqa: F401

from . import errors, params, geometry, registry, mxpatch  # noqa: F401
from .mxpatch import call_custom  # noqa: F401  (Custom nodes of our ops, oneDNN-guarded)
from . import operators  # noqa: F401  (imports operators/*.py: registers every op)

for _cls in registry.REGISTERED.values():  # mx_roi.ROIAlign etc.: the op definitions
    globals()[_cls.__name__] = _cls
del _cls
from . import nd, sym, gluon  # noqa: F401

# every MXNet patch: error translation, plain mx.nd.Custom(op_type=<ours>) guarded too,
# mx.onnx.export_model translating our Custom nodes
mxpatch.install(registry.REGISTERED)

# the native door: the extension library's ops mx_roi_<Op>, loaded here when cached
# (about 10 ms; a missing one is built by the first call that needs it, about 40 s of
# g++); never fails the import (mx_roi.ext.door: the rule, MX_ROI_NATIVE_OPS=0)
from .ext import door as _door  # noqa: E402
_door.load_at_import()


def _finish_pending_ops():
    """At exit, let queued ops finish: a custom op still running in MXNet's worker thread
    while the interpreter shuts down aborts the process ("terminate called without an
    active exception").  Runs before MXNet's own shutdown hook (atexit is LIFO)."""
    try:
        _mx.nd.waitall()
    except Exception:  # noqa: BLE001 - an op's error was the caller's to see; exit quietly
        pass


atexit.register(_finish_pending_ops)

#: the registered op types (``mx.nd.Custom(op_type=...)``)
OP_TYPES = tuple(registry.REGISTERED)


def library_path() -> str:
    """Path of mx_roi's MXNet extension library -- the ops as native MXNet operators
    ``mx_roi_<Op>`` (docs/native_ops.md; ``mx_roi.nd`` / ``sym`` / Gluon use them where
    :mod:`mx_roi.ext.door` says so; ``mx.library.load(path)`` elsewhere) -- built with g++
    on first use and cached;
    :class:`mx_roi.ext.ExtLibraryError` says why when it cannot be built here."""
    from .ext import library_path as _library_path
    return _library_path()
