"""Pictures of where each op reads the feature map (``pip install mx_roi[plot]``).

:func:`plot_sampling` draws the feature-map grid, the box, the bins, and the quantised
cells (pooling ops), the bilinear sample points and the taps of one sample (align ops),
and the score-map channel each bin reads (position-sensitive ops).  Everything drawn is
copied from ``op.geometry(...)`` -- the tables the kernels run on -- and returned as
NumPy arrays, so tests can check that a picture does not lie.

matplotlib is imported only when drawing: ``import mx_roi`` and :func:`sampling_coords`
work without it.  Command line: ``python -m mx_roi.viz --help``; the pictures of docs/semantics.md:
``python -m mx_roi.viz.regenerate docs``.
"""
from ._coords import PIXEL_CENTRE, default_feature_shape, make_op, sampling_coords, to_jsonable
from ._plot import plot_aligned_comparison, plot_sampling

__all__ = ["plot_sampling", "plot_aligned_comparison", "sampling_coords", "make_op",
           "default_feature_shape", "to_jsonable", "PIXEL_CENTRE"]
