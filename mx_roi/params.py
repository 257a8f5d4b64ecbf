"""Typed parameter structs of the RoI operators (the four here, the newer ops' in their
modules in ``operators/``), and the limits every struct shares.

MXNet hands a ``CustomOpProp`` every keyword argument as a *string* (``"(7, 7)"``,
``"0.0625"``, ``"False"``), and ``bool("False")`` is ``True``.  Each struct here is a
frozen dataclass whose ``from_kwargs`` parses such strings (or plain Python values),
validates them and raises ``ValueError`` naming the parameter and the bad value.
``to_kwargs`` gives back the strings to pass to ``mx.nd.Custom``/``mx.sym.Custom``.

Every parser and every field also *declares* values it must reject
(:func:`invalid_examples`): the parser's ill-formed spellings (``parser.invalid``) and
the field's out-of-domain values (``param_field(..., invalid=...)``, e.g. 0 for a
positive field).  ``tests/ops/test_bad_inputs.py`` feeds each of them to every
registered op and expects the parameter's name in the error, so a new op's parameters
are covered without editing the test -- and a field that declares none fails it.

Every integer field is bounded (``param_field(bounds=...)``): a size by :data:`MAX_ELEMENTS`,
a sampling ratio by :data:`MAX_SAMPLES_PER_SIDE`; the tests check that each bound is
declared, accepted at its limit and refused just beyond it.
"""
from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

from . import geometry

__all__ = ["ParamBase", "param_field", "invalid_examples", "ROIPoolingParam", "ROIAlignParam",
           "PSROIPoolingParam", "PSROIAlignParam",
           "parse_bool", "parse_int", "parse_float", "parse_size2", "parse_group",
           "parse_choice", "pooled_size_field", "spatial_scale_field", "sample_ratio_field",
           "INVALID_POSITIVE", "INVALID_POSITIVE_PAIR", "INVALID_SIZE", "INVALID_SIZE_PAIR",
           "INVALID_SAMPLES", "INVALID_ADAPTIVE_SAMPLES", "SIZE_BOUNDS", "SAMPLES_BOUNDS",
           "ADAPTIVE_SAMPLES_BOUNDS", "MAX_ELEMENTS", "MAX_SAMPLES_PER_SIDE"]

#: the most elements of one array in MXNet 1.9.1 built without USE_INT64_TENSOR_SIZE (the
#: pip wheels): it allocates an array only if ``size < 2^31 - 1`` (``CHECK_LT`` in
#: ``c_api.cc``, ``ndarray.cc``, ``imperative_utils.h``: "larger than 2^31 elements").
#: It bounds every size parameter (a dimension of the output or of an input: pooled
#: sizes, output_dim, group and part grids; a larger one also overflows the C ints in
#: which MXNet hands a custom op its shapes, ``array('i', ...)`` in
#: ``mxnet/operator.py``, in an error naming neither the op nor the parameter), and the
#: shape rule refuses a larger output (:meth:`mx_roi.registry.RoIOp.check_out_size`)
MAX_ELEMENTS = 2 ** 31 - 2
#: the most samples per bin side of a sampling ratio: 2^20 samples per bin
#: (``geometry.MAX_ROTATED_SAMPLES``), a kernel's loop in reasonable time and int range
MAX_SAMPLES_PER_SIDE = math.isqrt(geometry.MAX_ROTATED_SAMPLES)


def _fail(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"parameter '{name}': expected {expected}, got {value!r}")


def _rejects(*examples):
    """Decorator: declare ``examples``, values (or strings) the parser must reject, as
    ``parser.invalid`` (read by :func:`invalid_examples`; not used for validation; a
    callable returning them is accepted too)."""
    def mark(parser):
        parser.invalid = tuple(examples)
        return parser
    return mark


@_rejects("maybe", 2, "")
def parse_bool(name: str, value: Any) -> bool:
    """Parse ``True/False/1/0/true/false/yes/no`` (strings or values) into a bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise _fail(name, value, "a boolean (True/False/1/0)")


@_rejects(1.5, "x", "inf", True)
def parse_int(name: str, value: Any) -> int:
    """Parse an integer; ``"7"``, ``7`` and ``7.0`` are accepted, ``"7.5"`` is not."""
    if isinstance(value, bool):
        raise _fail(name, value, "an integer")
    if isinstance(value, int):
        return int(value)
    try:
        number = float(str(value).strip())
    except ValueError:
        raise _fail(name, value, "an integer") from None
    if not math.isfinite(number) or number != int(number):
        raise _fail(name, value, "an integer")
    return int(number)


@_rejects("abc", "nan", "-inf", True)
def parse_float(name: str, value: Any) -> float:
    """Parse a finite float."""
    if isinstance(value, bool):
        raise _fail(name, value, "a number")
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise _fail(name, value, "a number") from None
    if not math.isfinite(number):
        raise _fail(name, value, "a finite number")
    return number


@_rejects("abc", (1, 2, 3), (2.5, 2), "")
def parse_size2(name: str, value: Any) -> Tuple[int, int]:
    """Parse ``7``, ``"7"``, ``"(7, 7)"``, ``"[7,5]"``, ``(7,)`` into ``(h, w)``."""
    parsed = value
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = ast.literal_eval(text) if text else None
        except (ValueError, SyntaxError):
            raise _fail(name, value, "an int or a (height, width) tuple") from None
    if isinstance(parsed, (list, tuple)):
        items = list(parsed)
    else:
        items = [parsed]
    if len(items) == 1:
        items = items * 2
    if len(items) != 2:
        raise _fail(name, value, "an int or a (height, width) tuple")
    try:
        size = tuple(parse_int(name, item) for item in items)
    except ValueError:
        raise _fail(name, value, "an int or a (height, width) tuple") from None
    return size  # type: ignore[return-value]


_GROUP_EXPECTED = "0 (= the pooled grid), a positive int or a (gh, gw) pair of positive ints"


@_rejects("abc", (1, 2, 3), 1.5)
def parse_group(name: str, value: Any) -> Tuple[int, int]:
    """Parse a position-sensitive group grid into ``(gh, gw)``.

    ``0``/``"0"`` -> ``(0, 0)`` (the pooled grid, square or not), ``3`` -> ``(3, 3)``,
    ``"(3, 4)"``/``[3, 4]`` -> ``(3, 4)``.  Signs are checked by the param structs.
    """
    try:
        return parse_size2(name, value)
    except ValueError:
        raise _fail(name, value, _GROUP_EXPECTED) from None


def parse_choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise _fail(name, value, "one of " + ", ".join(repr(c) for c in choices))
    return text


def param_field(parser, default=dataclasses.MISSING, doc="", invalid=(), bounds=None):
    """A dataclass field carrying the string parser used by ``from_kwargs``.

    ``invalid``: values that parse but are out of the field's domain (0 for a positive
    size, ...), declared for the tests (:func:`invalid_examples`), not for validation.
    ``bounds``: ``(low, high, why)``, the inclusive range of the value (of each value of
    a pair; ``None``: no bound on that side), which :class:`ParamBase` checks; ``why``
    says what the limit is in the message (e.g. :data:`SIZE_BOUNDS`)."""
    return field(default=default, metadata={"parser": parser, "doc": doc,
                                            "invalid": tuple(invalid), "bounds": bounds})


def invalid_examples(param_cls, name: str) -> Tuple[Any, ...]:
    """Values ``param_cls.from_kwargs`` must reject for field ``name``, each with an error
    naming it: the field's parser's declared ill-formed values (``parser.invalid``), then
    the field's own out-of-domain ones (``param_field(invalid=...)``).  Empty when
    neither declares any (the bad-input tests fail for such a field)."""
    f = {f.name: f for f in dataclasses.fields(param_cls)}[name]
    declared = getattr(f.metadata["parser"], "invalid", ())
    return tuple(declared() if callable(declared) else declared) + \
        tuple(f.metadata.get("invalid", ()))


_PARSED: Dict[Any, Any] = {}
_PARSED_MAX = 1024


class ParamBase:
    """Shared ``from_kwargs``/``to_kwargs``/validation for the op parameter structs.

    A new op's struct: ``@dataclass(frozen=True) class MyParam(ParamBase)`` with
    ``op_name`` and fields made by :func:`param_field` (a parser such as
    :func:`parse_float`, a default, a doc line); ``_positive`` names the fields that must
    be positive."""

    op_name = ""

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs):
        """Build the struct from keyword arguments as MXNet passes them (strings).

        Every imperative call builds a new ``CustomOpProp`` and so parses its kwargs
        again; the (frozen) result is memoised per kwargs, errors are not.
        """
        try:
            key = (cls, tuple((k, type(v).__name__, v) for k, v in sorted(kwargs.items())))
            hit = _PARSED.get(key)
        except TypeError:  # an unhashable value: parse it every time
            key = hit = None
        if hit is not None:
            return hit
        param = cls._parse(kwargs)
        if key is not None and len(_PARSED) < _PARSED_MAX:
            _PARSED[key] = param
        return param

    @classmethod
    def _parse(cls, kwargs):
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, raw in kwargs.items():
            if key not in known:
                raise ValueError(f"{cls.op_name}: unknown parameter '{key}' (= {raw!r}); "
                                 f"known parameters: {', '.join(known)}")
            try:
                values[key] = known[key].metadata["parser"](key, raw)
            except ValueError as exc:
                raise ValueError(f"{cls.op_name}: {exc}") from None
        missing = [name for name, f in known.items()
                   if name not in values and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{cls.op_name}: missing required parameter(s) "
                             + ", ".join(f"'{m}'" for m in missing))
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{cls.op_name}: {exc}") from None

    def to_kwargs(self) -> Dict[str, str]:
        """The parameters as the strings ``mx.nd.Custom``/``mx.sym.Custom`` carry."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(tuple(value)) if isinstance(value, tuple) else str(value)
        return out

    #: fields that must be positive (every element of a pair)
    _positive: Tuple[str, ...] = ("pooled_size", "spatial_scale")

    def __post_init__(self):
        for name in self._positive:
            values = getattr(self, name)
            for v in _each(values):
                if v <= 0:
                    raise _fail(name, values, "positive value(s)")
        for f in dataclasses.fields(self):
            if f.metadata.get("bounds"):
                _check_bounds(f.name, getattr(self, f.name), *f.metadata["bounds"])


def _each(values):
    """The values of a pair, or a single value as a 1-tuple."""
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


def _check_bounds(name, values, low, high, why):
    for v in _each(values):
        if high is not None and v > high:
            raise _fail(name, values, f"at most {high} ({why})")
        if low is not None and v < low:
            raise _fail(name, values, f"at least {low} ({why})")


#: out-of-domain examples of the fields (``param_field(invalid=...)``); the public two are
#: also declared by the ops' own structs in ``operators/``
INVALID_POSITIVE = (0, -1)
INVALID_POSITIVE_PAIR = (0, -2, (0, 2), (2, -1))

#: ``bounds`` of a size (one value or both of a pair): :data:`MAX_ELEMENTS`
SIZE_BOUNDS = (None, MAX_ELEMENTS, "2^31 - 2, the most elements of an MXNet array")
#: a size's out-of-domain examples: not positive, one past :data:`MAX_ELEMENTS`, 2^31
INVALID_SIZE = INVALID_POSITIVE + (MAX_ELEMENTS + 1, 2 ** 31)
INVALID_SIZE_PAIR = INVALID_POSITIVE_PAIR + (MAX_ELEMENTS + 1, 2 ** 31, (2, MAX_ELEMENTS + 1))
#: ``bounds`` of a positive sampling ratio (samples per bin side)
SAMPLES_BOUNDS = (None, MAX_SAMPLES_PER_SIDE, "samples per bin side")
#: ``bounds`` of a sampling ratio where <= 0 means adaptive (and in C int range)
ADAPTIVE_SAMPLES_BOUNDS = (-2 ** 31, MAX_SAMPLES_PER_SIDE, "samples per bin side")
INVALID_SAMPLES = (MAX_SAMPLES_PER_SIDE + 1, 2 ** 31)
INVALID_ADAPTIVE_SAMPLES = INVALID_SAMPLES + (-2 ** 31 - 1,)
_GROUP_INVALID = (-1, (2, -1), (0, 3), (3, 0), MAX_ELEMENTS + 1, 2 ** 31,
                  (2, MAX_ELEMENTS + 1))


@_rejects(*parse_size2.invalid)
def _size2(name, value):
    return parse_size2(name, value)


def pooled_size_field(doc="(h, w) of the output"):
    """The ``pooled_size`` field of an op with a (P, Q) output grid (an int or a pair)."""
    return param_field(_size2, doc=doc, invalid=INVALID_SIZE_PAIR, bounds=SIZE_BOUNDS)


def spatial_scale_field(doc="image -> feature map scale"):
    """The ``spatial_scale`` field (the box coordinates' scale onto the feature map)."""
    return param_field(parse_float, doc=doc, invalid=INVALID_POSITIVE)


@_rejects("median", "", 1)
def _mode(name, value):
    return parse_choice(name, value, ("avg", "max"))


#: every ``legacy`` kernel name of every op (an op must refuse the others' names)
_LEGACY_KERNELS = set()


def _legacy(*kernels):
    """Parser of a ``legacy`` field: '' (or 'none') or one of ``kernels``."""
    _LEGACY_KERNELS.update(kernels)

    def parse(name, value):
        text = str(value).strip().lower()
        return parse_choice(name, "" if text in ("none", "") else text, ("",) + kernels)
    # read when the tests ask (every op's names are known by then): the other ops' kernels
    parse.invalid = lambda: ("bogus", 1, "-".join(kernels) + "-x") + \
        tuple(sorted(_LEGACY_KERNELS - set(kernels)))
    return parse


@dataclass(frozen=True)
class ROIPoolingParam(ParamBase):
    """Parameters of ``ROIPooling`` (Fast R-CNN max pooling over quantised bins)."""

    op_name = "ROIPooling"
    pooled_size: Tuple[int, int] = pooled_size_field()
    spatial_scale: float = spatial_scale_field("image -> feature map scale, e.g. 1/16")
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")


def _check_axis_samples(param, name) -> None:
    """A fixed sampling ratio ``name`` (> 0) puts ratio * P sample points along an axis of
    P bins: refuse more than the sample tables hold (``geometry.MAX_SAMPLES_PER_AXIS``),
    naming the parameter (the tables would refuse them later, blaming the rois)."""
    ratio, side = getattr(param, name), max(param.pooled_size)
    most = geometry.MAX_SAMPLES_PER_AXIS // side
    if ratio > most:
        raise _fail(name, ratio, f"at most {most} with pooled_size {tuple(param.pooled_size)} "
                                 f"({geometry.MAX_SAMPLES_PER_AXIS} sample points along an "
                                 "axis)")


def sample_ratio_field(doc="samples per bin side; <=0 adaptive"):
    """A sampling ratio where <= 0 means an adaptive grid (default -1)."""
    return param_field(parse_int, -1, doc, invalid=INVALID_ADAPTIVE_SAMPLES,
                       bounds=ADAPTIVE_SAMPLES_BOUNDS)


@dataclass(frozen=True)
class ROIAlignParam(ParamBase):
    """Parameters of ``ROIAlign`` (bilinear sampling, average or max per bin)."""

    op_name = "ROIAlign"
    pooled_size: Tuple[int, int] = pooled_size_field()
    spatial_scale: float = spatial_scale_field()
    sample_ratio: int = sample_ratio_field()
    aligned: bool = param_field(parse_bool, False, "half-pixel offset (Detectron2 'aligned')")
    pool_mode: str = param_field(_mode, "avg", "'avg' or 'max' over the sample points")
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")
    legacy: str = param_field(_legacy("caffe"), "", "'' (MXNet/Detectron) or 'caffe' (old max ROIAlign)")

    def __post_init__(self):
        super().__post_init__()
        if self.legacy != "caffe":  # the Caffe grid ignores sample_ratio
            _check_axis_samples(self, "sample_ratio")


@dataclass(frozen=True)
class _GroupGrid(ParamBase):
    """The position-sensitive ops' leading fields and their ``group_size`` rule: ``(gh,
    gw)``, ``(0, 0)`` = pooled grid (each subclass declares ``group_size`` with
    :func:`_group_size_field`, in its own field order).

    Output channel ``c`` at bin ``(p, q)`` reads input channel ``(c*gh + i)*gw + j`` with
    ``i = floor(p*gh/P)``, ``j = floor(q*gw/Q)`` (R-FCN's rule, per axis).
    ``mx.nd.contrib.ROIAlign(position_sensitive=True)`` always uses the pooled grid.
    """

    pooled_size: Tuple[int, int] = pooled_size_field("output bins per side")
    output_dim: int = param_field(parse_int, doc="output channels", invalid=INVALID_SIZE,
                                  bounds=SIZE_BOUNDS)
    spatial_scale: float = spatial_scale_field()

    _positive = ("pooled_size", "output_dim", "spatial_scale")

    def __post_init__(self):
        super().__post_init__()
        group = parse_group("group_size", self.group_size)  # also a directly passed int
        object.__setattr__(self, "group_size", group)       # frozen dataclass
        if group != (0, 0) and min(group) <= 0:
            raise _fail("group_size", group[0] if group[0] == group[1] else group,
                        _GROUP_EXPECTED)

    @property
    def group_grid(self) -> Tuple[int, int]:
        """The ``(gh, gw)`` grid in use: ``group_size``, or ``pooled_size`` when 0."""
        return tuple(self.group_size) if self.group_size != (0, 0) else tuple(self.pooled_size)

    @property
    def in_channels(self) -> int:
        """Input channels the op needs: ``output_dim * gh * gw``."""
        gh, gw = self.group_grid
        return self.output_dim * gh * gw


def _group_size_field():
    return param_field(parse_group, (0, 0), "position-sensitive (gh, gw) grid; 0 = pooled_size",
                       invalid=_GROUP_INVALID, bounds=SIZE_BOUNDS)


@dataclass(frozen=True)
class PSROIPoolingParam(_GroupGrid):
    """Parameters of ``PSROIPooling`` (R-FCN position-sensitive average pooling)."""

    op_name = "PSROIPooling"
    group_size: Tuple[int, int] = _group_size_field()
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")


@dataclass(frozen=True)
class PSROIAlignParam(_GroupGrid):
    """Parameters of ``PSROIAlign`` (position-sensitive ROIAlign, average)."""

    op_name = "PSROIAlign"
    sample_ratio: int = sample_ratio_field()
    aligned: bool = param_field(parse_bool, False, "half-pixel offset")
    group_size: Tuple[int, int] = _group_size_field()
    deterministic: bool = param_field(parse_bool, False, "bit-identical GPU backward")
    legacy: str = param_field(_legacy("rfcn"), "", "'' (MXNet) or 'rfcn' (R-FCN-PSROIAlign layer)")
    sample_num: int = param_field(parse_int, 2, "legacy='rfcn': interior samples per bin side",
                                  invalid=INVALID_POSITIVE + INVALID_SAMPLES,
                                  bounds=SAMPLES_BOUNDS)

    _positive = _GroupGrid._positive + ("sample_num",)

    def __post_init__(self):
        super().__post_init__()
        _check_axis_samples(self, "sample_num" if self.legacy == "rfcn" else "sample_ratio")
