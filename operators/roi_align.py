"""ROIAlign: bilinear samples averaged (or maxed) per bin (Mask R-CNN, He et al. 2017);
semantics in the class docstring."""
from __future__ import annotations

from mx_roi import geometry, kernels_numpy as K
from mx_roi.params import ROIAlignParam
from mx_roi.registry import RoIOp, register
from mx_roi.cuda.tables import sample_grid_tables
from mx_roi.cuda.compiled_geometry import Spec


@register
class ROIAlign(RoIOp):
    """Bilinear samples averaged (or maxed) per bin (Mask R-CNN, He et al. 2017):
    ``mx.nd.contrib.ROIAlign``.

    ``data`` (N, C, H, W) and ``rois`` (R, 5) = (batch index, x1, y1, x2, y2) in image
    coordinates, of one dtype; output (R, C, P, Q) for ``pooled_size`` (P, Q).

    No coordinate is rounded: the scaled box is cut into P x Q equal bins, each bin holds
    a regular grid of sample points, each sample is interpolated bilinearly from its four
    taps, and the output is the average of the bin's samples (``pool_mode='avg'``, the
    built-in) or their maximum (``pool_mode='max'``, an extension: the gradient goes to
    the four taps of the winning sample).  ``sample_ratio = n > 0`` puts n x n samples in
    every bin; ``sample_ratio <= 0`` uses ``ceil(roi_h / P) x ceil(roi_w / Q)`` per bin,
    per roi.

    ``aligned=False`` (MXNet's default, the original Mask R-CNN) samples as if pixel
    centres lay on integer coordinates and clamps the box to at least 1 x 1 cell;
    ``aligned=True`` (Detectron2) subtracts 0.5 from the scaled corners and uses the size
    as is.  A sample more than one cell outside the map has weight 0 but still counts in
    the average's divisor; one between the last pixel centre and the edge snaps to the
    last pixel.

    The max mode follows ROIPooling's NaN rule: a bin starts at ``-FLT_MAX``, only a
    strictly greater sample replaces it, a NaN on any tap makes the sample NaN (it never
    wins), and a bin without a winner gives ``-FLT_MAX`` and no gradient.

    ``legacy='caffe'`` reproduces the forward of the Caffe ``ROIAlign`` layer of
    caffe-faster-rcnn forks (box ``+1``, unit-step points from each bin's corner, max;
    ``sample_ratio``, ``aligned`` and ``pool_mode`` ignored) with the true gradient of
    that forward, for porting weights trained with it.

    Differences from the built-in: a zero-size or reversed box with ``aligned=True``
    samples nothing and gives 0 (MXNet aborts the process); a batch index >= N is an
    error; a negative batch index marks a padding roi (output 0, no gradient);
    ``position_sensitive=True`` is refused with a pointer to :class:`PSROIAlign`.
    """
    name = "ROIAlign"
    param_cls = ROIAlignParam
    cuda_source = "roi_align.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section)
    native_gpu_kernels = (("roi_grid_geometry", ()), ("roi_adaptive_bound", ()),
                          ("roi_align_forward_avg", ()),
                          ("roi_align_forward_max", ("unsigned char",)),
                          ("roi_align_backward_avg", ("A",)),
                          ("roi_align_backward_max_rescan", ("A",)))
    gluon_mode = "align"
    builtin_order = ("pooled_size", "spatial_scale", "sample_ratio",      # mx.sym.contrib.ROIAlign
                     "position_sensitive", "aligned")
    selftest_cases = (
        dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1),
        dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2, aligned=True,
             pool_mode="max"),
    )

    @staticmethod
    def selftest_builtin(params, data, rois):
        if params.get("pool_mode", "avg") != "avg":
            return None
        import mxnet as mx
        return mx.nd.contrib.ROIAlign(data, rois, pooled_size=params["pooled_size"],
                                      spatial_scale=params["spatial_scale"],
                                      sample_ratio=params.get("sample_ratio", -1),
                                      aligned=params.get("aligned", False))

    @property
    def is_max(self) -> bool:
        return self.param.pool_mode == "max" or self.param.legacy == "caffe"

    @property
    def backward_needs_data(self) -> bool:
        return self.is_max

    def cpu_backend(self) -> str:
        # native for every call: 16 channels per pass in the forward (mx_roi::SumLanes)
        # and in the average's backward (mx_roi::AddLanes), threads over channels.  The
        # NumPy/BLAS form (per roi two small products shared by all channels) is as fast
        # on one thread but does not scale with threads (7x7 / 256 boxes fwd+bwd, 2
        # threads: 39 vs 58 ms; 14x14 aligned: 143 vs 146 ms)
        return "native"

    def geometry(self, rois, height, width, xp):
        p = self.param
        if p.legacy == "caffe":
            return geometry.caffe_align_grid(rois, p.pooled_size, p.spatial_scale, height, width,
                                             xp)
        return geometry.roi_align_grid(rois, p.pooled_size, p.spatial_scale, p.sample_ratio,
                                       p.aligned, height, width, xp)

    def geometry_spec(self):
        p = self.param
        if p.legacy == "caffe":
            return Spec("caffe_grid", p.pooled_size, p.spatial_scale)
        return Spec("align_grid", p.pooled_size, p.spatial_scale, p.sample_ratio, p.aligned)

    def forward_numpy(self, geo, data, keep=True, out=None):
        if self.is_max:
            return K.max_forward(geo, data, data.shape[1], need_arg=keep)
        return K.avg_forward(K.separable(geo, *data.shape[2:]), data, out=out), None

    def backward_numpy(self, geo, grad, data_shape, saved):
        if self.is_max:
            return K.max_backward(geo, grad, data_shape, saved)
        return K.avg_backward(K.separable(geo, *data_shape[2:]), grad, data_shape)

    # ---- CUDA (operators/roi_align.cu; see mx_roi.cuda.backend) ------------------------
    def forward_cuda(self, launch, geo, data):
        """Average (or max + argmax) of each bin's samples, read from the SampleGrid."""
        _, C, H, W = data.shape
        R, P, Q = geo.divisor.shape
        out = launch.output((R, C, P, Q))
        tables = sample_grid_tables(geo)
        if self.is_max:
            # the argmax: bin-relative iy*Gx+ix on the padded grid, in the smallest
            # unsigned dtype holding Gy*Gx indices (its maximum: no winner); the kernel
            # instantiation follows that dtype
            gy, gx = tables["Gy"], tables["Gx"]
            if gy * gx >= 2 ** 31:  # the kernels' running argmax iy*Gx+ix is an int
                raise ValueError(f"{self.name}: {gy}x{gx} sample points per bin are "
                                 "too many for pool_mode='max' on the CUDA backend")
            arg, store = launch.argmax((R, C, P, Q), lambda: gy * gx)
            launch.forward("roi_align_forward_max", out.size, tables, data=data, C=C, H=H,
                           W=W, out=out, argmax=arg, store_argmax=int(store))
            return out, (arg if store else None)
        launch.forward("roi_align_forward_avg", out.size, tables, data=data, C=C, H=H, W=W,
                       out=out)
        return out, None

    def backward_cuda(self, launch, geo, grad, data_shape, saved):
        """Input gradient (compute dtype): bins' gradients to their samples' taps (max:
        the winning sample's, from the kept argmax or found again in ``launch.data``)."""
        _, C, H, W = data_shape
        buf = launch.grad_buffer(data_shape, grad)
        if not self.is_max:
            kernel, extra = "roi_align_backward_avg", {}
        elif saved is None:
            kernel, extra = "roi_align_backward_max_rescan", {"data": launch.data}
        else:
            kernel, extra = "roi_align_backward_max", {"argmax": saved}
        launch.backward(kernel, grad.size, sample_grid_tables(geo), grad=grad, C=C, H=H, W=W,
                        bottom=buf, **extra)
        return launch.grad_value(buf)
