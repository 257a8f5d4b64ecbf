"""Turn an op definition into a registered MXNet ``CustomOp`` + ``CustomOpProp``.

An op is described once by a subclass of :class:`RoIOp` in ``operators/`` (its shape
rule, geometry and per-backend kernels); :func:`register` generates the two MXNet
classes for it, so every op shares one copy of the plumbing: parameter parsing,
shape/type inference with errors that reach the caller, input validation, backend
dispatch, ``req`` handling and saving what the backward needs.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
from typing import Dict, Tuple, Type

import mxnet as mx
import numpy as np

from . import backends, error_slot, errors, geometry, ndio
from .cuda import source as kernel_sources
from .errors import issuer, recording
from .onednn import GUARD_BOUND, bounded_dtype
from .params import MAX_ELEMENTS

__all__ = ["RoIOp", "register", "REGISTERED", "get_op", "discover", "NATIVE_PREFIX",
           "native_op_type"]

REGISTERED: Dict[str, Type["RoIOp"]] = {}

_DTYPES = (np.float16, np.float32, np.float64)


class RoIOp:
    """Definition of one RoI operator; subclasses live in ``operators/``.

    Subclasses set the class attributes below and implement :meth:`out_channels`,
    :meth:`geometry` and the backend kernels ``forward_<backend>``/``backward_<backend>``
    (see :mod:`mx_roi.backends`).  Everything that lists the ops (``mx_roi.OP_TYPES``,
    ``mx_roi.nd``/``sym``/``gluon``, the kernel sources, the selftest) reads them from
    :data:`REGISTERED`, so a new op is its own ``operators/<op>.py`` + ``.cu``.
    """

    #: the ``op_type`` of ``mx.nd.Custom``; also the name in mx_roi.nd/sym/gluon
    name = ""
    #: the typed parameter struct (:mod:`mx_roi.params`)
    param_cls: type = None
    #: the op's kernel file in ``operators/`` (CUDA, GPU and host builds)
    cuda_source = ""
    #: ``mode`` of :func:`mx_roi.gluon.roi_pooler` / ``MultiScaleROIAlign`` ('' = none)
    gluon_mode = ""
    #: the built-in's positional parameter order after (data, rois); every entry point
    #: (mx_roi.nd/sym, gluon.ops(F), the Gluon blocks) takes it, followed by the struct's
    #: other fields (see :meth:`positional_order`); None = the struct's field order
    builtin_order: Tuple[str, ...] = None
    #: parameter dicts ``python -m mx_roi.selftest`` checks on every backend
    selftest_cases: Tuple[dict, ...] = ()
    #: whether ``selftest_builtin``'s built-in has a gradient to compare with
    selftest_builtin_grad = True
    #: whether the backward reads the input data (max modes) besides rois and out_grad
    backward_needs_data = False
    #: the kernels of ``cuda_source`` the native GPU path launches (``mx_roi.ext.cuda``:
    #: NVRTC compiles them into the launcher library for every dtype pair), each
    #: ``(kernel, template arguments after T, A)`` ("A": the pair's A, a backward's
    #: accumulator); () for an op without a native GPU path.  An op that has one also
    #: holds its driver-API entries in the .cu file's ``MX_ROI_EXT_CUDA_LAUNCHER`` section
    native_gpu_kernels: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    #: columns of a roi row and what they hold (shape rule and error messages)
    rois_columns = 5
    rois_layout = "(batch_index, x1, y1, x2, y2)"
    #: whether the output is differentiable in the roi coordinates: the backends then
    #: fill the rois' gradient with ``rois_backward_<backend>`` (else it is zeros)
    differentiates_rois = False
    #: the op's inputs, in MXNet's order: ``data`` and ``rois``, then any extra input
    #: (e.g. DeformablePSROIPooling's ``trans``); an op whose parameters drop an input
    #: says so in :meth:`input_names`.  The backends hand extra inputs to ``geometry``
    #: (after ``xp``), and a backward returning a tuple gives their gradients
    inputs: Tuple[str, ...] = ("data", "rois")

    def __init__(self, param):
        self.param = param

    def input_names(self) -> Tuple[str, ...]:
        """The inputs of a call with these parameters (MXNet's ``list_arguments``)."""
        return tuple(self.inputs)

    @classmethod
    def check_input_count(cls, n: int) -> None:
        """TypeError naming the op when ``n`` inputs are more than it can take."""
        if n > len(cls.inputs):
            raise TypeError(f"{cls.name}(): takes at most {len(cls.inputs)} inputs "
                            f"({', '.join(cls.inputs)}), got {n}")

    def order_inputs(self, given: dict, symbolic: bool = False) -> list:
        """The inputs of a call in :meth:`input_names` order, from ``given`` (input name ->
        array, symbol or None); TypeError naming a missing input or one these parameters
        do not take (every entry point: ``mx_roi.nd``/``sym``, the Gluon blocks,
        ``mx.nd.Custom``/``mx.sym.Custom``).  A ``symbolic`` call may leave trailing
        inputs out: MXNet then makes variables for them, as for its built-ins."""
        self.check_input_count(len(given))
        needed = self.input_names()
        unused = [k for k, v in given.items() if v is not None and k not in needed]
        if unused:
            raise TypeError(f"{self.name}(): input(s) {', '.join(map(repr, unused))} not "
                            f"taken with these parameters (inputs: {', '.join(needed)})")
        inputs = [given.get(k) for k in needed]
        while symbolic and inputs and inputs[-1] is None:
            inputs.pop()
        missing = [k for k, v in zip(needed, inputs) if v is None]
        if missing:
            raise TypeError(f"{self.name}() needs input(s) {', '.join(map(repr, missing))} "
                            f"with these parameters (inputs: {', '.join(needed)})")
        return inputs

    # ---- shapes -------------------------------------------------------------------
    def check_extra_shapes(self, data_shape, rois_shape, extra_shapes) -> None:
        """ValueError naming the problem if the extra inputs' shapes (in
        :meth:`input_names` order after data and rois) do not fit; none by default."""

    def out_channels(self, channels: int) -> int:
        """Output channels for ``channels`` input channels; raise ValueError if invalid."""
        return channels

    def out_shape(self, data_shape, rois_shape) -> Tuple[int, ...]:
        """(R, C_out, P, Q) for data (N, C, H, W) and rois (R, :attr:`rois_columns`);
        ValueError naming the problem."""
        if len(data_shape) != 4:
            raise ValueError(f"{self.name}: data must be 4-D (N, C, H, W), got shape "
                             f"{tuple(data_shape)}")
        k = self.rois_columns
        if len(rois_shape) != 2 or rois_shape[1] != k:
            raise ValueError(f"{self.name}: rois must have shape (R, {k}) = {self.rois_layout}, "
                             f"got {tuple(rois_shape)}")
        ph, pw = self.param.pooled_size
        return (rois_shape[0], self.out_channels(data_shape[1]), ph, pw)

    def check_out_size(self, shape) -> None:
        """ValueError if an output of ``shape`` (:meth:`out_shape`) has more elements than
        MXNet allocates (:data:`mx_roi.params.MAX_ELEMENTS`), naming what sizes it.  An
        empty dimension (no rois, no channels) or an unknown one (-1: a partial inference)
        counts as 1: parameters that no call could use are refused in an empty call too
        (whose arrays NumPy could not even view).
        The registry's shape inference calls it for every op; what a call keeps or
        allocates beside the output (an argmax, the output's gradient) has at most its
        elements."""
        size = math.prod(max(int(d), 1) for d in shape)
        if size <= MAX_ELEMENTS:
            return
        fields = self.param_cls.field_names()
        channels = "output_dim" if "output_dim" in fields else "data channels"
        reduce = "pooled_size, output_dim or the number of rois" if "output_dim" in fields \
            else "pooled_size, the number of rois or the data's channels"
        has = "has" if min(shape) > 0 else "would have (empty or unknown dimensions at 1)"
        raise ValueError(f"{self.name}: output shape {tuple(shape)} (rois, {channels}, "
                         f"pooled_size) {has} {size} elements, more than {MAX_ELEMENTS} (2^31 "
                         f"- 2, the most elements of an MXNet array): reduce {reduce}")

    def cpu_backend(self) -> str:
        """The CPU backend used when ``MX_ROI_BACKEND`` is unset (``'numpy'`` or
        ``'native'``): whichever is faster for this op and these parameters."""
        return "native"

    @classmethod
    def positional_order(cls) -> Tuple[str, ...]:
        """Positional parameter names of every entry point (after ``data, rois`` for the
        functions; the Gluon block constructors start with them): ``builtin_order``, then
        the parameter struct's other fields in field order."""
        head = tuple(cls.builtin_order or ())
        return head + tuple(n for n in cls.param_cls.field_names() if n not in head)

    @classmethod
    def random_rois(cls, rng, count: int, images: int, height: int, width: int,
                    spatial_scale: float):
        """``count`` random float64 rois (count, :attr:`rois_columns`) in image coordinates
        on ``images`` maps of ``height`` x ``width`` cells (the selftest's problems):
        boxes of 1 to 0.6 map sides, some partly off the map."""
        s = spatial_scale
        x1 = rng.uniform(-1, width * 0.7, count) / s
        y1 = rng.uniform(-1, height * 0.7, count) / s
        return np.stack([rng.integers(0, images, count), x1, y1,
                         x1 + rng.uniform(1, width * 0.6, count) / s,
                         y1 + rng.uniform(1, height * 0.6, count) / s], axis=1)

    @staticmethod
    def selftest_builtin(params: dict, data, rois, *extra):
        """MXNet's built-in with these parameters on NDArrays ``data``, ``rois`` (and the
        extra inputs) for the selftest's parity check, or None when MXNet has none."""
        return None

    def example_extra_inputs(self, rng, data_shape, rois) -> list:
        """Random valid extra inputs (NumPy, the rois' dtype) for ``data_shape`` and
        ``rois``, for the selftest and the bench; [] for an op without any."""
        return []

    # ---- geometry ---------------------------------------------------------------
    def geometry(self, rois, height: int, width: int, xp, *extra):
        """The call's bins / samples for the kernels; ``extra``: the op's extra inputs
        (host arrays, :attr:`inputs` after data and rois), none for most ops."""
        raise NotImplementedError

    def geometry_spec(self):
        """The compiled twin of :meth:`geometry` for these parameters, or None (the
        default: the host builds then call :meth:`geometry` with NumPy).  An op whose
        tables are one of ``geometry.py``'s builders over (R, 5) rois returns a
        :class:`mx_roi.cuda.compiled_geometry.Spec` naming it; the ``native`` and
        ``emulated-cuda`` backends then fill the same tables (proven bit-equal by
        tests/test_geometry_compiled.py) and check the rois in compiled code."""
        return None

    # ---- kernels (one set per backend) ---------------------------------------------
    def forward_numpy(self, geo, data, keep=True, out=None):
        """NumPy forward on the geometry tables: ``(output (R, C_out, P, Q), saved)``.

        ``data`` is in the compute dtype; ``saved`` (e.g. an argmax) is what the backward
        needs, and only when ``keep``; ``out``, when given, is an (R, C_out, P, Q) buffer
        the kernel may write into (and then return)."""
        raise NotImplementedError

    def backward_numpy(self, geo, grad, data_shape, saved):
        """NumPy input gradient (data_shape, compute dtype) from the out-grad."""
        raise NotImplementedError

    def forward_cuda(self, launch, geo, data):
        """CUDA forward through :class:`mx_roi.cuda.backend.Launch`: ``(output, saved)``."""
        raise NotImplementedError

    def backward_cuda(self, launch, geo, grad, data_shape, saved):
        """CUDA input gradient through :class:`mx_roi.cuda.backend.Launch`."""
        raise NotImplementedError

    def rois_backward_numpy(self, geo, grad, data, rois):
        """NumPy gradient of the rois (R, :attr:`rois_columns`), compute dtype, from the
        out-grad and the data (only when :attr:`differentiates_rois`)."""
        raise NotImplementedError

    @property
    def native_name(self) -> str:
        """The op's native operator in the extension library, ``NATIVE_PREFIX + name``
        (``mx_roi_ROIAlign``)."""
        return NATIVE_PREFIX + self.name

    def rois_backward_cuda(self, launch, geo, grad, data, rois):
        """CUDA gradient of the rois (only when :attr:`differentiates_rois`)."""
        raise NotImplementedError

    # ---- validation -------------------------------------------------------------
    def check_extra_inputs(self, data_shape, data_dtype, rois, extra, xp) -> None:
        """Errors for invalid extra inputs (host arrays, after :meth:`check_inputs`
        passed); the backends call it in the forward and again in the backward."""

    def check_inputs(self, data_shape, data_dtype, rois, xp, compiled=None):
        """Errors for invalid values: dtype mismatch, non-finite coordinates, batch >= N.

        ``compiled``: a :class:`mx_roi.cuda.compiled_geometry.CompiledGeometry` (host
        rois of an op with a :meth:`geometry_spec`) finds the first bad roi in compiled
        code instead of with array operations: the same roi, the same message."""
        self.check_dtypes(data_dtype, rois.dtype)
        if rois.shape[0] == 0:
            return
        if compiled is not None:
            code, row = compiled.check(rois, data_shape[0], GUARD_BOUND,
                                       bounded_dtype(rois.dtype))
            if code:
                raise self.roi_error(code, row, rois, data_shape[0])
        else:
            self._check_values(data_shape, rois, xp)
        self._check_adaptive_grid(rois, xp)

    def _check_adaptive_grid(self, rois, xp):
        """An adaptive ROIAlign grid (``align_grid``, sample_ratio <= 0: ROIAlign and
        PSROIAlign) grows with the box: geometry.check_samples_per_bin over the boxes'
        sides (x2 - x1, y2 - y1, reversed: 0)."""
        spec = self.geometry_spec()
        if spec is None or spec.mode != "align_grid" or spec.sample > 0:
            return
        f = rois[:, 1:5].astype(np.float64)
        sides = f[:, 3:1:-1] - f[:, 1::-1]            # (y2 - y1, x2 - x1)
        xp.maximum(sides, 0.0, out=sides)
        per_bin = geometry.adaptive_samples_per_bin(sides, spec.spatial_scale,
                                                    spec.pooled_size, rois.dtype, xp)
        geometry.check_samples_per_bin(
            self.name, per_bin, lambda r: (float(sides[r, 1]), float(sides[r, 0])),
            "sample_ratio", xp)

    def _check_values(self, data_shape, rois, xp):
        """Non-finite coordinates (code 1), batch index >= N (code 2), as array
        operations."""
        # |x| >= GUARD_BOUND counts as infinite: the oneDNN guard clips inf to it (float16
        # holds no such value: there, comparing would only cast the bound to inf).  One
        # comparison is also false for NaN and +-inf (a small call's cost is its number
        # of array operations; this check runs in the forward and again in the backward).
        if bounded_dtype(rois.dtype):
            finite = xp.abs(rois) < GUARD_BOUND
        else:
            finite = xp.isfinite(rois)
        if not bool(finite.all()):
            raise self.roi_error(1, int(xp.argwhere(~finite.all(axis=1))[0, 0]), rois,
                                 data_shape[0])
        n = data_shape[0]
        # the batch index is trunc(rois[:, 0]); with n >= 1 images trunc(b) >= n exactly
        # when b >= n (n an integer), so the comparison needs no truncated copy
        bad = rois[:, 0] >= n if n > 0 else xp.trunc(rois[:, 0]) >= n
        if bool(bad.any()):
            raise self.roi_error(2, int(xp.argwhere(bad)[0, 0]), rois, n)

    def check_dtypes(self, data_dtype, rois_dtype):
        """TypeError unless data and rois share one of the supported dtypes."""
        if np.dtype(data_dtype) != np.dtype(rois_dtype):
            raise TypeError(f"{self.name}: data and rois must have the same dtype, got data "
                            f"{np.dtype(data_dtype).name} and rois {np.dtype(rois_dtype).name}")
        if np.dtype(data_dtype).type not in _DTYPES:
            raise TypeError(f"{self.name}: dtype {np.dtype(data_dtype).name} is not supported "
                            "(float16, float32, float64)")

    def roi_error(self, code, r, rois, n) -> ValueError:
        """The error of bad roi ``r`` (host ``rois``, ``n`` images): ``code`` 1 a NaN or
        infinite value, 2 a batch index >= n -- the codes of the compiled check
        (:meth:`mx_roi.cuda.compiled_geometry.CompiledGeometry.check`)."""
        if code == 1:
            return ValueError(f"{self.name}: rois[{r}] has a NaN or infinite value "
                              f"{_row(rois, r)}; coordinates must be finite")
        return ValueError(f"{self.name}: rois[{r}] has batch index {float(rois[r, 0]):g} but "
                          f"data holds only {n} image(s) (valid: 0..{n - 1}; a negative "
                          "index marks a padding roi)")


def _zero(req, nd) -> None:
    """Zeros into ``nd`` for req write/inplace (nothing to add for add, nothing for null).

    A CPU array is zeroed straight in its memory (one ``memset`` at the address MXNet's C
    API gives, :func:`mx_roi.ndio.zero_host`): ``nd[:] = 0`` would push an MXNet op from
    the op's callback, about 0.1 ms -- a tenth of a small training call, paid by every
    backward for the rois' gradient."""
    if req in ("write", "inplace"):
        if nd.context.device_type == "cpu":
            ndio.zero_host(nd)
        elif nd.size:
            nd[:] = 0


def _fill_nan(nd) -> None:
    """NaN into all of ``nd`` (CPU: straight into its memory, no engine op)."""
    if nd.context.device_type == "cpu":
        ndio.writable_numpy(nd).fill(np.nan)
    else:
        nd[:] = np.nan


def _row(rois, r):
    try:
        return [float(v) for v in rois[r].tolist()]
    except Exception:  # pragma: no cover - only for messages
        return "?"


def register(op_cls: Type[RoIOp]) -> Type[RoIOp]:
    """Register ``op_cls`` with MXNet under ``op_cls.name`` (generating both classes)."""

    class _Op(mx.operator.CustomOp):
        def __init__(self, op: RoIOp, backend_name: str):
            super().__init__()
            self.op = op
            self.backend = backends.get(backend_name)
            self.saved = None
            # whether the last forward raised (MXNet still runs its queued backward)
            self.rejected = False
            # the thread that made the call (create_operator runs on it): errors of the
            # forward/backward, raised later by MXNet, are matched to it
            self._mx_roi_issuer = issuer()

        @recording
        def forward(self, is_train, req, in_data, out_data, aux):
            self.saved, self.rejected = None, True
            token = error_slot.enter()  # see mx_roi.error_slot: enter, then succeed/fail
            try:
                self.saved = self.backend.forward(self.op, req[0], in_data[0], in_data[1],
                                                  out_data[0], keep=is_train,
                                                  extra=in_data[2:])
            except Exception as exc:
                # NaN output: should the error still be lost, the result cannot pass for
                # numbers.  Written straight into memory on the CPU (an engine write
                # would hold back this op's completion).  A safety net only: its own
                # failure must not replace the op's error or skip what follows.
                try:
                    if req[0] in ("write", "inplace") and out_data[0].size:
                        _fill_nan(out_data[0])
                except Exception:  # noqa: BLE001
                    pass
                # the error reaches the caller through the output, not through MXNet's
                # one process-wide callback error, which another op may take
                # (mx_roi.error_slot); where that cannot be done, raise as usual
                if req[0] != "null" and out_data[0].size:
                    errors.record_output_error(exc, self._mx_roi_issuer)
                    try:
                        if error_slot.fail_output(token, out_data[0]):
                            return
                    except Exception:  # noqa: BLE001 - raise the op's own error below
                        pass
                    errors.discard_output_error(self._mx_roi_issuer)
                error_slot.fail(token)
                raise
            self.rejected = False
            error_slot.succeed(token, in_data[1])

        @recording
        def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
            saved, self.saved = self.saved, None
            rois_req = req[1] if self.op.differentiates_rois else "null"
            token = error_slot.enter()
            try:
                if self.rejected:
                    # MXNet runs the backward of a forward that raised: the forward's
                    # error is the one the caller gets; the gradient is zeros and no
                    # kernel reads the rejected rois
                    _zero(req[0], in_grad[0])
                    _zero(rois_req, in_grad[1])
                    for r, g in zip(req[2:], in_grad[2:]):
                        _zero(r, g)
                else:
                    # the backend validates the rois again itself before any kernel runs
                    self.backend.backward(self.op, req[0], out_grad[0], in_data[0],
                                          in_data[1], in_grad[0], saved, rois_req, in_grad[1],
                                          extra=in_data[2:],
                                          extra_grad=tuple(zip(req[2:], in_grad[2:])))
                if not self.op.differentiates_rois:
                    # rois get no gradient: zeros for write, nothing to add for add
                    _zero(req[1], in_grad[1])
            except Exception:
                error_slot.fail(token)
                raise
            error_slot.succeed(token, in_data[1])

    _Op.__name__ = _Op.__qualname__ = f"{op_cls.__name__}CustomOp"

    class _Prop(mx.operator.CustomOpProp):
        def __init__(self, **kwargs):
            super().__init__(need_top_grad=True)
            # MXNet calls this constructor outside any try/except: an exception escaping
            # here kills the process.  Keep the error and raise it from the first
            # protected callback (list_arguments), which MXNet turns into an MXNetError.
            self.op, self.param_error = None, None
            try:
                self.op = op_cls(op_cls.param_cls.from_kwargs(**kwargs))
            except Exception as exc:  # noqa: BLE001
                self.param_error = exc

        @recording
        def list_arguments(self):
            if self.param_error is not None:
                raise self.param_error
            return list(self.op.input_names())

        def list_outputs(self):
            return ["output"]

        @recording
        def infer_shape(self, in_shape):
            data_shape, rois_shape = in_shape[:2]
            out = self.op.out_shape(data_shape, rois_shape)
            self.op.check_extra_shapes(data_shape, rois_shape, in_shape[2:])
            self.op.check_out_size(out)
            return list(in_shape), [out], []

        @recording
        def infer_type(self, in_type):
            dtype = in_type[0]
            if in_type[1] is not None and np.dtype(in_type[1]) != np.dtype(dtype):
                raise TypeError(f"{op_cls.name}: data and rois must have the same dtype, got "
                                f"data {np.dtype(dtype).name} and rois {np.dtype(in_type[1]).name}")
            for name, t in zip(self.op.input_names()[2:], in_type[2:]):
                if t is not None and np.dtype(t) != np.dtype(dtype):
                    raise TypeError(f"{op_cls.name}: data and {name} must have the same "
                                    f"dtype, got data {np.dtype(dtype).name} and {name} "
                                    f"{np.dtype(t).name}")
            return [dtype] * len(in_type), [dtype], []

        def declare_backward_dependency(self, out_grad, in_data, out_data):
            # Every op declares every array of its numbering (output gradient, inputs,
            # output): MXNet 1.9.1 keeps the dependency list of the most recently
            # recorded Custom node process-wide and applies it to the backward of every
            # Custom node, and an index on that list that a node did not declare breaks
            # its backward ("unknown storage type: -1").  With every op declaring all of
            # its arrays, any op's list names only arrays every node has: a 2-input op's
            # {0..3} are arrays of a 3-input node too, and a 3-input op's index 4 is, in
            # a 2-input node, an input gradient (always handed over).  The output is on
            # the list though no backward reads it: a graph node (sym, hybridized Gluon,
            # the cached imperative call) is handed only its declared arrays, and a
            # recorded imperative call leaves the list in its own numbering
            # (mxpatch._set_backward_dependency).  (It costs nothing: the output guard
            # and the next layer keep the output until the backward anyway.)
            return [out_grad[0], *in_data, out_data[0]]

        @recording
        def create_operator(self, ctx, in_shapes, in_dtypes):
            return _Op(self.op, backends.select(ctx, self.op))

    _Prop.__name__ = _Prop.__qualname__ = f"{op_cls.__name__}Prop"
    mx.operator.register(op_cls.name)(_Prop)
    op_cls.CustomOp, op_cls.CustomOpProp = _Op, _Prop
    REGISTERED[op_cls.name] = op_cls
    # the kernel layer compiles only the files of registered ops; it is told, never asks
    kernel_sources.set_sources(op.cuda_source for op in REGISTERED.values())
    return op_cls


def get_op(name: str) -> Type[RoIOp]:
    return REGISTERED[name]


#: an op's native operator (the extension library, :mod:`mx_roi.ext`) is called
#: ``NATIVE_PREFIX + op_type``: ``mx_roi_ROIAlign``
NATIVE_PREFIX = "mx_roi_"


def native_op_type(op_name: str):
    """The op_type whose native operator ``op_name`` (a graph node's ``op``) is:
    ``'mx_roi_ROIAlign'`` -> ``'ROIAlign'``; None for any other name (``Custom``, a
    built-in, ``mx_roi_noop``)."""
    if not op_name.startswith(NATIVE_PREFIX):
        return None
    op_type = op_name[len(NATIVE_PREFIX):]
    return op_type if op_type in REGISTERED else None


def discover(package: str, path) -> Tuple[Type[RoIOp], ...]:
    """Import every public module of ``package`` (directory list ``path``), in name order:
    each registers its ops with :func:`register`.  Returns the registered op classes."""
    for name in sorted(m.name for m in pkgutil.iter_modules(path)):
        if not name.startswith("_"):
            importlib.import_module(f"{package}.{name}")
    return tuple(REGISTERED.values())
