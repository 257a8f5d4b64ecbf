"""DeformablePSROIPooling: position-sensitive RoI pooling with learned bin offsets; semantics
in the class docstring."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mx_roi import geometry
from mx_roi.geometry import compute_dtype
from mx_roi.onednn import GUARD_BOUND
from mx_roi.params import INVALID_POSITIVE, INVALID_SAMPLES, INVALID_SIZE, MAX_ELEMENTS, \
    SAMPLES_BOUNDS, SIZE_BOUNDS, ParamBase, param_field, parse_bool, parse_float, parse_int, \
    spatial_scale_field
from mx_roi.registry import RoIOp, register

#: the largest square grids an MXNet array holds: pooled_size^2 bins of one roi and
#: channel, 2 * part_size^2 offsets of one roi (one class)
MAX_POOLED = math.isqrt(MAX_ELEMENTS)
MAX_PART = math.isqrt(MAX_ELEMENTS // 2)


@dataclass(frozen=True)
class DeformablePSROIPoolingParam(ParamBase):
    """Parameters of ``DeformablePSROIPooling`` (``contrib.DeformablePSROIPooling``'s)."""

    op_name = "DeformablePSROIPooling"
    spatial_scale: float = spatial_scale_field()
    output_dim: int = param_field(parse_int, doc="output channels", invalid=INVALID_SIZE,
                                  bounds=SIZE_BOUNDS)
    group_size: int = param_field(parse_int, doc="position-sensitive G x G grid",
                                  invalid=INVALID_SIZE + ((2, 2),), bounds=SIZE_BOUNDS)
    pooled_size: int = param_field(parse_int, doc="output bins per side",
                                   invalid=INVALID_POSITIVE + (MAX_POOLED + 1, 2 ** 31, (3, 3)),
                                   bounds=(None, MAX_POOLED, "pooled_size^2 bins of one roi "
                                           "and channel in an MXNet array"))
    part_size: int = param_field(parse_int, 0, "offset cells per side; 0 = pooled_size",
                                 invalid=(-1, MAX_PART + 1, 2 ** 31),
                                 bounds=(None, MAX_PART, "2 * part_size^2 offsets of one roi "
                                         "in an MXNet array"))
    sample_per_part: int = param_field(parse_int, 1, "samples per bin side",
                                       invalid=INVALID_POSITIVE + INVALID_SAMPLES,
                                       bounds=SAMPLES_BOUNDS)
    trans_std: float = param_field(parse_float, 0.0, "offset scale (trans * trans_std)",
                                   invalid=(-0.1,))
    no_trans: bool = param_field(parse_bool, False, "no offsets: inputs data, rois only")
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")

    _positive = ("spatial_scale", "output_dim", "group_size", "pooled_size",
                 "sample_per_part")

    def __post_init__(self):
        super().__post_init__()
        if self.part_size < 0:
            raise ValueError(f"parameter 'part_size': expected 0 (= pooled_size) or a "
                             f"positive int, got {self.part_size!r}")
        if self.trans_std < 0:
            raise ValueError(f"parameter 'trans_std': expected a value >= 0, got "
                             f"{self.trans_std!r}")

    @property
    def in_channels(self) -> int:
        """Input channels the op reads: ``output_dim * group_size ** 2``."""
        return self.output_dim * self.group_size * self.group_size

    @property
    def part(self) -> int:
        """The offset grid's side: ``part_size``, or ``pooled_size`` when 0."""
        return self.part_size or self.pooled_size


@dataclass
class DeformableCall:
    """What the kernels of one call read: rois (R, 5) and trans (R, 2K, part, part) or
    None, as the backend holds them (the geometry is derived in the kernels)."""

    rois: Any
    trans: Any


_MAX_ITEMS = 1 << 21  # NumPy kernels: work arrays of at most this many elements per chunk


@register
class DeformablePSROIPooling(RoIOp):
    """DeformablePSROIPooling: position-sensitive RoI pooling with learned bin offsets
    (Deformable R-FCN: Dai et al., "Deformable Convolutional Networks", ICCV 2017).

    Semantics of ``mx.nd.contrib.DeformablePSROIPooling`` (same parameters, defaults and
    positional order; inputs ``data`` (N, C, H, W), ``rois`` (R, 5) and, unless
    ``no_trans``, ``trans`` (R, 2K, part_size, part_size)): the box ``round(x1) * s - 0.5 ..
    (round(x2) + 1) * s - 0.5`` (sizes at least 0.1) is cut into ``pooled_size`` x
    ``pooled_size`` bins; bin (p, q) of output channel c is shifted by
    ``trans[r, 2k + {0: x, 1: y}, u, v] * trans_std`` times the box size (class
    ``k = c / (output_dim / K)``, part cell ``u = floor(p / pooled_size * part_size)``), and
    averages ``sample_per_part``\\ :sup:`2` bilinear samples -- those outside
    ``[-0.5, W - 0.5] x [-0.5, H - 0.5]`` skipped, the others clamped to the map -- of input
    channel ``(c * G + gh) * G + gw`` (``gh = floor(p * G / pooled_size)``, G =
    ``group_size``); 0 when no sample is inside.  Gradients for data and trans (the rois get
    zeros).  Beyond the built-in: a padding roi (batch index < 0) gives 0 and no gradient,
    a NaN sample coordinate counts as outside, bad shapes / values are refused with a
    message instead of read out of bounds; ``deterministic`` as the other ops.
    """
    name = "DeformablePSROIPooling"
    param_cls = DeformablePSROIPoolingParam
    cuda_source = "deformable_psroi_pooling.cu"
    #: the native GPU path (the .cu file's MX_ROI_EXT_CUDA_LAUNCHER section): the kernels
    #: read the rois and offsets themselves, so the path runs them on roi_safe_copy's
    #: checked rois after the offsets' device check
    native_gpu_kernels = (("roi_safe_copy", ()), ("deformable_trans_check", ()),
                          ("deformable_trans_status", ()),
                          ("deformable_psroi_pooling_forward", ()),
                          ("deformable_psroi_pooling_backward", ("A",)),
                          ("deformable_psroi_pooling_backward_trans", ()))
    gluon_mode = "deformpool"  # roi_pooler('deformpool', ...); with offsets: block(x, rois, trans)
    inputs = ("data", "rois", "trans")
    builtin_order = ("spatial_scale", "output_dim", "group_size", "pooled_size",
                     "part_size", "sample_per_part", "trans_std", "no_trans")
    selftest_cases = (dict(spatial_scale=0.5, output_dim=2, group_size=2, pooled_size=3,
                           part_size=2, sample_per_part=2, trans_std=0.2),
                      dict(spatial_scale=0.5, output_dim=2, group_size=1, pooled_size=2,
                           sample_per_part=2, no_trans=True))

    def input_names(self):
        return self.inputs[:2] if self.param.no_trans else self.inputs

    @property
    def backward_needs_data(self):
        """The offsets' gradient reads the data (the bilinear surface's slope)."""
        return not self.param.no_trans

    # ---- shapes and checks -----------------------------------------------------------
    def out_shape(self, data_shape, rois_shape):
        """(R, output_dim, pooled_size, pooled_size)."""
        if len(data_shape) != 4:
            raise ValueError(f"{self.name}: data must be 4-D (N, C, H, W), got shape "
                             f"{tuple(data_shape)}")
        if len(rois_shape) != 2 or rois_shape[1] != 5:
            raise ValueError(f"{self.name}: rois must have shape (R, 5) = (batch_index, x1, "
                             f"y1, x2, y2), got {tuple(rois_shape)}")
        P = self.param.pooled_size
        return (rois_shape[0], self.out_channels(data_shape[1]), P, P)

    def out_channels(self, channels):
        p = self.param
        need = p.in_channels
        if channels < need:  # the built-in reads the first `need` channels (more: unused)
            raise ValueError(f"{self.name}: data has {channels} channels but output_dim * "
                             f"group_size^2 = {p.output_dim} * {p.group_size}^2 = {need} "
                             "are required")
        return p.output_dim

    def check_extra_shapes(self, data_shape, rois_shape, extra_shapes):
        if self.param.no_trans or not extra_shapes or not len(extra_shapes[0]):
            return  # an unknown shape (a free graph variable) is not inferred
        self._check_trans_shape(tuple(extra_shapes[0]), rois_shape[0])

    def _check_trans_shape(self, shape, R):
        p = self.param
        part = p.part
        want = f"(R, 2 * K, part_size, part_size) = ({R}, 2 * K, {part}, {part})"
        if len(shape) != 4 or shape[0] != R or shape[2:] != (part, part) or \
                shape[1] < 2 or shape[1] % 2:
            raise ValueError(f"{self.name}: trans must have shape {want} with K >= 1 offset "
                             f"classes, got {tuple(shape)}")
        K = shape[1] // 2
        if p.output_dim % K:
            raise ValueError(f"{self.name}: trans has K = {K} offset classes (shape "
                             f"{tuple(shape)}) but output_dim = {p.output_dim} is not a "
                             "multiple of K")

    def check_extra_inputs(self, data_shape, data_dtype, rois, extra, xp):
        names = self.input_names()
        if len(extra) != len(names) - 2:
            raise ValueError(f"{self.name}: takes inputs {', '.join(names)} with no_trans="
                             f"{self.param.no_trans}, got {2 + len(extra)} input(s)")
        if self.param.no_trans:
            return
        trans = extra[0]
        if np.dtype(trans.dtype) != np.dtype(data_dtype):
            raise TypeError(f"{self.name}: data and trans must have the same dtype, got data "
                            f"{np.dtype(data_dtype).name} and trans {np.dtype(trans.dtype).name}")
        self._check_trans_shape(tuple(trans.shape), rois.shape[0])
        if trans.size:
            finite = xp.abs(trans) < GUARD_BOUND if trans.dtype != np.float16 \
                else xp.isfinite(trans)
            if not bool(finite.all()):
                at = tuple(int(i) for i in xp.argwhere(~finite)[0])
                raise ValueError(f"{self.name}: trans{list(at)} is "
                                 f"{float(trans[at])!r}; offsets must be finite")

    def example_extra_inputs(self, rng, data_shape, rois):
        if self.param.no_trans:
            return []
        part = self.param.part
        K = 2 if self.param.output_dim % 2 == 0 else 1
        return [rng.uniform(-2, 2, (rois.shape[0], 2 * K, part, part)).astype(rois.dtype)]

    @staticmethod
    def selftest_builtin(params, data, rois, *extra):
        import mxnet as mx
        kw = {k: v for k, v in params.items() if k != "deterministic"}
        return mx.nd.contrib.DeformablePSROIPooling(data, rois, *extra, **kw)

    def roofline_work(self, data_shape, rois, itemsize=4):
        """Bytes and multiply-adds a call must spend (``mx_roi.bench.roofline``), its
        samples counted without offsets: per live sample 4 taps (forward: 4 products, the
        data gradient 4 adds, the offsets' gradient another 8)."""
        p = self.param
        N, C, H, W = data_shape
        geo = self.samples(DeformableCall(np.asarray(rois, np.float32), None), H, W)
        live = geo.batch >= 0
        used = (geo.y_in[live][..., :, None] & geo.x_in[live][..., None, :]).sum()
        taps = float(used) * p.output_dim * 4
        R = rois.shape[0]
        out_bytes = R * p.output_dim * p.pooled_size ** 2 * itemsize
        read = min(float(N * p.in_channels * H * W), taps) * itemsize
        trans = 0 if p.no_trans else 2.0 * R * p.part ** 2 * itemsize
        return dict(fwd_bytes=read + out_bytes + trans, fwd_ops=taps,
                    bwd_bytes=out_bytes + N * C * H * W * itemsize + trans
                    + (0 if p.no_trans else read),
                    bwd_ops=taps * (1 if p.no_trans else 3))

    # ---- geometry: derived in the kernels (geometry.deformable_samples for NumPy) -------
    def geometry(self, rois, height, width, xp, *extra):
        return DeformableCall(rois, extra[0] if extra and not self.param.no_trans else None)

    def samples(self, call, height, width):
        p = self.param
        return geometry.deformable_samples(call.rois, call.trans, p.pooled_size, p.part,
                                           p.sample_per_part, p.spatial_scale, p.trans_std,
                                           height, width)

    # ---- NumPy -------------------------------------------------------------------------
    def _channels(self, K, cdt):
        """(class of each output channel (D,), input channel (D, P, P))."""
        p = self.param
        D, G, P = p.output_dim, p.group_size, p.pooled_size
        gh = geometry.deformable_group(P, G, cdt)
        c = np.arange(D)
        cin = (c[:, None, None] * G + gh[None, :, None]) * G + gh[None, None, :]
        return c // (D // K), cin

    def _chunks(self, geo):
        p = self.param
        per_roi = p.output_dim * p.pooled_size ** 2 * p.sample_per_part ** 2 * 4
        step = max(1, _MAX_ITEMS // max(per_roi, 1))
        live = np.flatnonzero(geo.batch >= 0)
        for i in range(0, live.size, step):
            yield live[i:i + step]

    @staticmethod
    def _taps(geo, rs, kc):
        """Per item (r in rs, c, p, q) and sample row / column: clamped coordinate (0 where
        outside: never read), whether inside, low and high tap, distance."""
        out = []
        for v, inside in ((geo.y, geo.y_in), (geo.x, geo.x_in)):
            inside = inside[rs][:, kc]                                   # (r, D, P, P, S)
            v = np.where(inside, v[rs][:, kc], 0)
            lo = np.floor(v)
            out.append((inside, lo.astype(np.int64), np.ceil(v).astype(np.int64), v - lo))
        return out

    def forward_numpy(self, call, data, keep=True, out=None):
        p = self.param
        N, Cin, H, W = data.shape
        geo = self.samples(call, H, W)
        cdt = data.dtype
        kc, cin = self._channels(geo.y.shape[1], cdt)
        R, D, P, S = geo.batch.shape[0], p.output_dim, p.pooled_size, p.sample_per_part
        res = np.zeros((R, D, P, P), cdt)
        flat = data.reshape(-1)
        one = cdt.type(1)
        for rs in self._chunks(geo):
            (yin, y0, y1, dy), (xin, x0, x1, dx) = self._taps(geo, rs, kc)
            base = ((geo.batch[rs][:, None, None, None].astype(np.int64) * Cin + cin) * H)
            total = np.zeros((rs.size, D, P, P), cdt)
            count = np.zeros((rs.size, D, P, P), np.int64)
            for i in range(S):
                for j in range(S):
                    ok = yin[..., i] & xin[..., j]
                    a, b = dx[..., j], dy[..., i]

                    def at(yy, xx):
                        return flat[(base + yy[..., i]) * W + xx[..., j]]

                    value = ((one - a) * (one - b) * at(y0, x0) + (one - a) * b * at(y1, x0)
                             + a * (one - b) * at(y0, x1) + a * b * at(y1, x1))
                    total = np.where(ok, total + value, total)
                    count += ok
            with np.errstate(invalid="ignore", divide="ignore"):
                res[rs] = np.where(count == 0, cdt.type(0), total / count.astype(cdt))
        return res, (data if keep and not p.no_trans else None)

    def backward_numpy(self, call, grad, data_shape, saved):
        p = self.param
        N, Cin, H, W = data_shape
        geo = self.samples(call, H, W)
        cdt = grad.dtype
        K = geo.y.shape[1]
        kc, cin = self._channels(K, cdt)
        D, P, S, part = p.output_dim, p.pooled_size, p.sample_per_part, p.part
        dgrad = np.zeros(data_shape, cdt)
        tgrad = None if p.no_trans else np.zeros(call.trans.shape, cdt)
        one, tstd = cdt.type(1), geometry._scale(p.trans_std, cdt)
        u = geometry.deformable_part(P, part, cdt)
        for rs in self._chunks(geo):
            (yin, y0, y1, dy), (xin, x0, x1, dx) = self._taps(geo, rs, kc)
            ok = yin[..., :, None] & xin[..., None, :]                  # (r, D, P, P, S, S)
            count = ok.sum(axis=(4, 5))
            live = count > 0
            with np.errstate(invalid="ignore", divide="ignore"):
                diff = np.where(live, grad[rs] / np.maximum(count, 1).astype(cdt), 0)
            diff = diff[..., None, None]
            ok &= live[..., None, None]
            a, b = dx[..., None, :], dy[..., :, None]                   # x: column j, y: row i
            Y0, Y1, X0, X1 = (y0[..., :, None], y1[..., :, None], x0[..., None, :],
                              x1[..., None, :])
            base = (geo.batch[rs][:, None, None, None, None, None].astype(np.int64) * Cin
                    + cin[..., None, None]) * H
            taps = [((base + Y0) * W + X0, (one - a) * (one - b)),
                    ((base + Y1) * W + X0, (one - a) * b),
                    ((base + Y0) * W + X1, a * (one - b)),
                    ((base + Y1) * W + X1, a * b)]
            shape = ok.shape
            index = np.stack([np.broadcast_to(t[0], shape) for t in taps], axis=-1)
            value = np.stack([np.broadcast_to(t[1] * diff, shape) for t in taps], axis=-1)
            np.add.at(dgrad.reshape(-1), index[ok], value[ok])         # MXNet's order
            if tgrad is None:
                continue
            flat = saved.reshape(-1)
            u00, u01, u10, u11 = (flat[t[0]] for t in taps)
            gx = (u11 * b + u10 * (one - b) - u01 * b - u00 * (one - b)) \
                * (tstd * diff * geo.roi_w[rs][:, None, None, None, None, None])
            gy = (u11 * a + u01 * (one - a) - u10 * a - u00 * (one - a)) \
                * (tstd * diff * geo.roi_h[rs][:, None, None, None, None, None])
            r_ = rs[:, None, None, None, None, None]
            k_ = kc[None, :, None, None, None, None]
            cell = u[None, None, :, None, None, None] * part + u[None, None, None, :, None, None]
            tx = ((r_ * K + k_) * 2 * part * part + cell)
            np.add.at(tgrad.reshape(-1), np.broadcast_to(tx, shape)[ok],
                      np.broadcast_to(gx, shape)[ok])
            np.add.at(tgrad.reshape(-1), np.broadcast_to(tx + part * part, shape)[ok],
                      np.broadcast_to(gy, shape)[ok])
        return dgrad if tgrad is None else (dgrad, tgrad)

    # ---- CUDA (operators/deformable_psroi_pooling.cu) -----------------------------------
    def _kernel_args(self, launch, call, data_shape):
        p = self.param
        _, Cin, H, W = data_shape
        xp = launch.xp
        trans = call.trans if call.trans is not None else xp.zeros((1,), launch.dtype)
        K = 1 if call.trans is None else call.trans.shape[1] // 2
        return dict(rois=xp.asarray(call.rois), trans=xp.asarray(trans),
                    spatial_scale=float(np.float32(p.spatial_scale)),
                    trans_std=float(np.float32(p.trans_std)), G=p.group_size, part=p.part,
                    S=p.sample_per_part, Cin=Cin, H=H, W=W, P=p.pooled_size,
                    Q=p.pooled_size), K

    def forward_cuda(self, launch, call, data):
        args, K = self._kernel_args(launch, call, data.shape)
        D, P = self.param.output_dim, self.param.pooled_size
        out = launch.output((call.rois.shape[0], D, P, P))
        launch.forward("deformable_psroi_pooling_forward", out.size, data=data,
                       no_trans=int(call.trans is None), K=K, C=D, out=out, **args)
        return out, None

    def _fused(self, K, cdt) -> bool:
        """Whether every offset element is one output element's alone (one class per
        output channel, one bin per part cell), so the data gradient's pass writes the
        offsets' gradient too."""
        p = self.param
        return (K == p.output_dim and p.part == p.pooled_size and
                len(set(geometry.deformable_part(p.pooled_size, p.part, cdt).tolist()))
                == p.pooled_size)

    def backward_cuda(self, launch, call, grad, data_shape, saved):
        args, K = self._kernel_args(launch, call, data_shape)
        D = self.param.output_dim
        buf = launch.grad_buffer(data_shape, grad)
        has_trans = call.trans is not None
        tgrad = launch.empty(call.trans.shape if has_trans else (1,), launch.acc)
        fuse = has_trans and self._fused(K, launch.acc)
        data = launch.data if has_trans else launch.xp.zeros((1,), launch.dtype)
        launch.backward("deformable_psroi_pooling_backward", grad.size, grad=grad, data=data,
                        no_trans=int(not has_trans), K=K, C=D, bottom=buf, trans_grad=tgrad,
                        fuse_trans=int(fuse), **args)
        dgrad = launch.grad_value(buf)
        if not has_trans:
            return dgrad
        if fuse:
            return dgrad, tgrad
        RK = call.rois.shape[0] * K  # items (r * K + k, u, v): C = R * K
        launch.forward("deformable_psroi_pooling_backward_trans", RK * self.param.part ** 2,
                       grad=grad, data=launch.data, K=K, C=RK, D=D, trans_grad=tgrad, **args)
        return dgrad, tgrad
