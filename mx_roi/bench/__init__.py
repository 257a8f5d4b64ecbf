"""Benchmark the mx_roi custom ops against MXNet's built-in RoI operators.

Run as ``python -m mx_roi.bench`` (``--help`` for the options).  For every workload the
custom op ("ours") and the MXNet built-in run in the *same* process on the *same*
NDArrays, interleaved (ours, builtin, ours, builtin, ...), synchronised with
``wait_to_read``/``mx.nd.waitall`` outside the timed op; the table shows the medians and
the ratio ours/builtin (< 1: ours is faster).  Before any timing counts, the forward
outputs (and, for fwd+bwd, the input gradients) of both sides are compared with
``np.allclose`` on the benchmark inputs; a mismatch is flagged in the table and makes
the run exit with status 2, so a fast-but-wrong kernel cannot hide behind a good ratio.

Workloads (issue 6): data (N=2, C=256, 38x50) - a 600x800 image at stride 16 -,
256 seeded random proposals inside the image, median of ``--repeat`` (5) runs:

* ROIPooling 7x7                      vs ``mx.nd.ROIPooling``
* ROIAlign 7x7, sample_ratio=2        vs ``mx.nd.contrib.ROIAlign``
* ROIAlign 14x14, aligned=True        vs ``mx.nd.contrib.ROIAlign(aligned=True)``
* ROIAlign 7x7, pool_mode='max'       no built-in: absolute time only
* PSROIPooling 21 classes, 7x7        vs ``mx.nd.contrib.PSROIPooling``
* PSROIAlign 21 classes, 7x7          vs ``mx.nd.contrib.ROIAlign(position_sensitive=True)``

plus, with ``--variants`` (on by default in a full run), a 14x14 / 512-box variant of
each.  Each in ``fwd`` and ``fwd+bwd`` (autograd: ``attach_grad`` on data, ``record``,
``backward`` with a fixed seeded out-grad, ``wait_to_read`` on the gradient).

Also reported: the cost of the ``Custom`` call itself (two trivial custom ops registered
here with the same shapes: one that does nothing, one that only moves the inputs to
NumPy and writes a zero output / gradient, the floor of any NumPy-backed custom op), the
fixed cost of a small call through both front doors against their floors (the no-op
``Custom`` op, the extension library's ``mx_roi_noop``) and the built-in, with issue 34's
and 42's targets flagged (:mod:`.small_call`),
the peak extra resident memory of one fwd+bwd (``ru_maxrss`` delta in a fresh
subprocess per op and side; ``--memory``) and, with ``--plot out.png``, time against
the number of boxes (64 ... 2048) for ours and the built-in.  When torch and torchvision
import, ``torchvision.ops`` is timed as a third side at our thread count where it
computes the same (:mod:`.torchvision_ops`).

The package (importing ``mx_roi`` does not import it; nothing here registers an op
until :mod:`.overhead` is imported):

* :mod:`.workloads` -- the seeded inputs and the workload table;
* :mod:`.timing`    -- synchronised, interleaved timing and the agreement check;
* :mod:`.overhead`  -- the two trivial Custom ops (registered when imported) and their timing;
* :mod:`.doors`     -- an op through the Custom door or the native door (``mx_roi_<Op>``);
* :mod:`.small_call` -- the small call through both doors (the fixed-cost section, also
  ``python -m mx_roi.ext.bench``) and ``--doors``: the detector-sized workloads through
  both doors, interleaved, with a verdict per row (one timing function for both);
* :mod:`.memory`    -- peak extra RSS of one fwd+bwd in a fresh subprocess;
* :mod:`.machine`   -- machine description and both sides' thread counts;
* :mod:`.roofline`  -- first-principles lower bounds and the bandwidth / FMA probe;
* :mod:`.busy`      -- the competing process of ``--busy``;
* :mod:`.threads`   -- ``--threads``: one child run per thread setting;
* :mod:`.torchvision_ops` -- the torchvision column (when torch and torchvision import),
  on the CPU and, in :mod:`.gpu_kernels`, on the GPU;
* :mod:`.gpu_kernels` -- ``--ctx gpu`` with MXNet's CPU build: our calls on CuPy arrays;
* :mod:`.report`    -- the printed tables and the plot;
* :mod:`.step`      -- ``--step``: a detector's train step, built-in against ours through
  the Custom door and through the native door
  (:mod:`.step_model`: the graphs, inputs and check; :mod:`.step_profile`: the profile);
* :mod:`.cli`       -- the options and ``main``.
"""
