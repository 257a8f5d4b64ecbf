"""The RoI operators, one module (and one ``.cu`` kernel file) each.

Importing this package imports every module in it; each registers its op with
:func:`mx_roi.registry.register` (``mx.nd.Custom(op_type=...)``), and everything that
lists the ops reads :data:`mx_roi.registry.REGISTERED`.  Adding an op is adding
``<op>.py`` + ``<op>.cu`` here.
"""
from mx_roi.registry import discover as _discover

for _cls in _discover(__name__, __path__):
    globals()[_cls.__name__] = _cls
del _cls
