"""PSROIPooling: position-sensitive average pooling over quantised bins (R-FCN, Dai 2016);
semantics in the class docstring.  :class:`PositionSensitive` holds the channel rule both
position-sensitive ops share."""
from __future__ import annotations

import numpy as np

from mx_roi import geometry, kernels_numpy as K
from mx_roi.ndio import Kind
from mx_roi.params import PSROIPoolingParam
from mx_roi.registry import RoIOp, register
from mx_roi.cuda.tables import int_bins_tables
from mx_roi.cuda.compiled_geometry import Spec


class PositionSensitive(RoIOp):
    """Shared channel rule of the two position-sensitive ops."""

    def out_channels(self, channels):
        p = self.param
        need = p.in_channels
        if channels != need:
            gh, gw = p.group_grid
            raise ValueError(f"{self.name}: data has {channels} channels but output_dim * gh "
                             f"* gw = {p.output_dim} * {gh} * {gw} = {need} are required "
                             f"(group grid (gh, gw) = ({gh}, {gw}), from group_size="
                             f"{_spelled(p.group_size)} and pooled_size="
                             f"{tuple(p.pooled_size)})")
        return p.output_dim

    def group_args(self, xp=np):
        """(output_dim, (Gh, Gw), gh (P,), gw (Q,)) for the position-sensitive kernels."""
        p = self.param
        Gh, Gw = p.group_grid
        if xp is np:
            return _host_tables(p)[0]
        return (p.output_dim, (Gh, Gw), geometry.group_index(p.pooled_size[0], Gh, xp),
                geometry.group_index(p.pooled_size[1], Gw, xp))

    # ---- CUDA (operators/<op>.cu; see mx_roi.cuda.backend) ----------------------------
    # Both ops launch ``<cuda_source stem>_forward`` / ``_backward`` with their geometry's
    # kernel tables (``kernel_tables``) and the channel map; only the tables differ.
    kernel_tables = None

    def _kernel(self, direction):
        return f"{self.cuda_source.rsplit('.', 1)[0]}_{direction}"

    def forward_cuda(self, launch, geo, data):
        """Mean over each bin (cells or samples) of input channel channel_map[c, p, q]."""
        _, Cin, H, W = data.shape
        tables = self.kernel_tables(geo)
        C = self.param.output_dim
        out = launch.output((tables["batch"].shape[0], C, tables["P"], tables["Q"]))
        launch.forward(self._kernel("forward"), out.size, tables, data=data,
                       channel_map=self.launch_channel_map(launch), C=C, Cin=Cin, H=H, W=W,
                       out=out)
        return out, None

    def backward_cuda(self, launch, geo, grad, data_shape, saved):
        _, Cin, H, W = data_shape
        buf = launch.grad_buffer(data_shape, grad)
        launch.backward(self._kernel("backward"), grad.size, self.kernel_tables(geo),
                        grad=grad, channel_map=self.launch_channel_map(launch),
                        C=self.param.output_dim, Cin=Cin, H=H, W=W, bottom=buf)
        return launch.grad_value(buf)

    def channel_map(self, xp=np):
        """(C_out, P, Q) int32 input channel of each output bin (geometry.ps_channel_map):
        on the host read-only, shared by the calls with these parameters; ``xp`` another
        array module: a copy there (the kernels' launches use :meth:`launch_channel_map`)."""
        cmap = _host_tables(self.param)[1]
        return cmap if xp is np else xp.asarray(cmap)

    def launch_channel_map(self, launch):
        """The channel map ``launch``'s kernels read: the host table in the native build;
        where the kernels run as on a GPU (CUDA, emulated-cuda) the ``ps_channel_map_fill``
        kernel's (the native GPU path's way too: nothing copied to the device), filled
        once per parameters and device -- the call that fills it waits for its stream
        before it returns (the backend's one sync), so a later call on any stream reads
        it complete."""
        if launch.module.kind is Kind.NATIVE:
            return self.channel_map()
        kind = launch.module.kind
        key = (self.param, kind, 0 if kind.on_host else int(launch.xp.cuda.get_device_id()))
        cmap = _DEVICE_MAPS.get(key)
        if cmap is None:
            p = self.param
            (P, Q), (Gh, Gw) = p.pooled_size, p.group_grid
            cmap = launch.empty((p.output_dim, P, Q), np.int32)
            launch.forward("ps_channel_map_fill", cmap.size, channel_map=cmap, P=P, Q=Q,
                           Gh=Gh, Gw=Gw)
            if len(_DEVICE_MAPS) >= 256:  # stay bounded, as _HOST_TABLES
                _DEVICE_MAPS.clear()
            _DEVICE_MAPS[key] = cmap
        return cmap


_HOST_TABLES = {}
#: (parameters, kind, device id) -> the channel map ps_channel_map_fill made there (read-only
#: by the kernels)
_DEVICE_MAPS = {}


def _host_tables(param):
    """``(group_args, channel_map)`` on the host for a parameter struct, built once per
    distinct parameters (they depend on nothing else) and read-only, so every call of
    an op with these parameters shares them."""
    tables = _HOST_TABLES.get(param)
    if tables is None:
        Gh, Gw = param.group_grid
        gh = geometry.group_index(param.pooled_size[0], Gh, np)
        gw = geometry.group_index(param.pooled_size[1], Gw, np)
        cmap = geometry.ps_channel_map(param.output_dim, param.pooled_size, param.group_grid,
                                       np)
        for a in (gh, gw, cmap):
            a.flags.writeable = False
        tables = (param.output_dim, (Gh, Gw), gh, gw), cmap
        if len(_HOST_TABLES) >= 256:  # parameter sets of a process are few; stay bounded
            _HOST_TABLES.clear()
        _HOST_TABLES[param] = tables
    return tables


def _spelled(group):
    return group[0] if group[0] == group[1] else tuple(group)


@register
class PSROIPooling(PositionSensitive):
    """Position-sensitive average over quantised bins (R-FCN, Dai et al. 2016):
    ``mx.nd.contrib.PSROIPooling``.

    ``data`` (N, output_dim * Gh * Gw, H, W) and ``rois`` (R, 5) = (batch index, x1, y1,
    x2, y2), of one dtype; output (R, output_dim, P, Q) for ``pooled_size`` (P, Q).

    Every bin reads its own score map: on the group grid (Gh, Gw) = ``group_size`` (0:
    the pooled grid; an int G: G x G; or ``(gh, gw)``) output channel ``c`` at bin
    ``(p, q)`` reads input channel ``(c * Gh + floor(p * Gh / P)) * Gw + floor(q * Gw /
    Q)``.  The corners are rounded in image coordinates *before* scaling (C ``round``),
    the end is ``round(x2) + 1``, the box is at least 0.1 cell, bins are ``floor`` /
    ``ceil`` cells clipped to the map, and each output is the mean over its bin (0 if the
    bin is empty).

    Differences from the built-in: ``pooled_size`` and ``group_size`` may be ``(h, w)``
    (the built-in takes ints only: with those this is its rule exactly); a negative batch
    index marks a padding roi (output 0, no gradient); a batch index >= N or a channel
    count other than ``output_dim * Gh * Gw`` is an error naming the numbers.
    """
    name = "PSROIPooling"
    param_cls = PSROIPoolingParam
    cuda_source = "psroi_pooling.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section)
    native_gpu_kernels = (("roi_bins_geometry", ()), ("ps_channel_map_fill", ()),
                          ("psroi_pooling_forward", ()), ("psroi_pooling_backward", ("A",)))
    gluon_mode = "pspool"
    builtin_order = ("spatial_scale", "output_dim", "pooled_size",        # contrib.PSROIPooling
                     "group_size")
    selftest_cases = (dict(pooled_size=3, output_dim=2, spatial_scale=0.5),)
    kernel_tables = staticmethod(int_bins_tables)

    def geometry(self, rois, height, width, xp):
        p = self.param
        return geometry.psroi_pooling_bins(rois, p.pooled_size, p.spatial_scale, height, width,
                                           xp)

    def geometry_spec(self):
        return Spec("ps_pool_bins", self.param.pooled_size, self.param.spatial_scale)

    @staticmethod
    def _separable(bins, height, width, dtype):
        ay = K.indicator_matrix(bins.hstart, bins.hend, height)
        ax = K.indicator_matrix(bins.wstart, bins.wend, width)
        area = (bins.hend - bins.hstart)[:, :, None] * (bins.wend - bins.wstart)[:, None, :]
        return bins.batch, ay, ax, np.maximum(area, 1).astype(dtype)

    def forward_numpy(self, bins, data, keep=True, out=None):
        sep = self._separable(bins, data.shape[2], data.shape[3], data.dtype)
        return K.ps_avg_forward(sep, data, *self.group_args()), None

    def backward_numpy(self, bins, grad, data_shape, saved):
        sep = self._separable(bins, data_shape[2], data_shape[3], grad.dtype)
        return K.ps_avg_backward(sep, grad, data_shape, *self.group_args())
