"""Makes MXNet 1.9.1's CPU wheel importable under NumPy 2 and Python 3.12 -- for the GPU
checks of ``tools/gpu_device/run.sh`` on a machine that has CuPy and a GPU but no MXNet
(and no NumPy < 1.24 for its Python).  Not part of mx_roi, which needs none of it.

MXNet 1.9.1 reads, at import, NumPy names that NumPy 2 removed (``np.NaN``, ``np.PZERO``,
``np.alltrue``, ...; ``mxnet.numpy.fallback`` lists NumPy 1.x's whole namespace) and
imports ``distutils.version`` (gone in Python 3.12).  The names get their NumPy 2
equivalents, or -- looked up by MXNet's own modules only -- a stub that raises if called;
``distutils.version`` comes from setuptools.
"""
import sys
import types

import numpy as _np

#: removed name -> its NumPy 2 spelling (a name) or value
_RENAMED = {"NaN": "nan", "NAN": "nan", "Inf": "inf", "PINF": "inf", "Infinity": "inf",
            "infty": "inf", "alltrue": "all", "sometrue": "any", "product": "prod",
            "cumproduct": "cumprod", "round_": "round", "float_": "float64",
            "complex_": "complex128", "string_": "bytes_", "unicode_": "str_",
            "in1d": "isin", "trapz": "trapezoid", "row_stack": "vstack"}
_VALUES = {"NINF": -_np.inf, "PZERO": 0.0, "NZERO": -0.0}

_numpy_getattr = _np.__getattr__


def _removed(name):
    def gone(*args, **kwargs):
        raise AttributeError(f"numpy.{name} does not exist in NumPy {_np.__version__}")
    gone.__name__ = name
    return gone


def _getattr(name):
    if name in _RENAMED:
        return getattr(_np, _RENAMED[name])
    if name in _VALUES:
        return _VALUES[name]
    try:
        return _numpy_getattr(name)
    except AttributeError:
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("mxnet"):
            raise
        return _removed(name)


_np.__getattr__ = _getattr

try:
    import distutils.version  # noqa: F401
except ImportError:
    from setuptools._distutils import version as _version
    _distutils = types.ModuleType("distutils")
    _distutils.version = _version
    sys.modules.setdefault("distutils", _distutils)
    sys.modules["distutils.version"] = _version
