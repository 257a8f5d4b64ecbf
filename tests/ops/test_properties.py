"""Hypothesis property tests: random shapes, boxes and parameters -> no crash, and
forward / data gradient parity with the scalar references (rois gradient zero)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import reference as ref
from tests.ops.base import assert_close, make_data, run_custom

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])

SCALES = [1.0, 0.5, 0.25, 0.0625, 0.7, 1.3]
DTYPES = [np.float32, np.float64, np.float16]


@st.composite
def problems(draw, op_type):
    dtype = draw(st.sampled_from(DTYPES))
    N = draw(st.integers(1, 3))
    H = draw(st.integers(1, 8))
    W = draw(st.integers(1, 8))
    scale = draw(st.sampled_from(SCALES))
    PH = draw(st.integers(1, 4))
    square = draw(st.booleans())
    PW = PH if square else draw(st.integers(1, 4))
    params = dict(pooled_size=(PH, PW) if draw(st.booleans()) else f"({PH}, {PW})",
                  spatial_scale=scale)
    C = draw(st.integers(1, 3))
    if op_type in ("PSROIPooling", "PSROIAlign"):
        G = draw(st.integers(1, 3)) if (PH != PW or draw(st.booleans())) else 0
        params.update(output_dim=C, group_size=G)
        Cin = C * (G or PH) ** 2
    else:
        Cin = C
    if op_type in ("ROIAlign", "PSROIAlign"):
        params.update(sample_ratio=draw(st.sampled_from([-1, 0, 1, 2, 3])),
                      aligned=draw(st.booleans()))
    if op_type == "ROIAlign":
        params["pool_mode"] = draw(st.sampled_from(["avg", "max"]))
    R = draw(st.integers(1, 6))
    # coordinates on a 1/4-cell lattice (hits .5 after scaling) or arbitrary floats
    lim = int(4 * max(H, W) * 1.5)
    rois = []
    for _ in range(R):
        b = draw(st.integers(-1, N - 1))
        if draw(st.booleans()):
            xs = [draw(st.integers(-lim, lim)) * 0.25 / scale for _ in range(4)]
        else:
            xs = [draw(st.floats(-1.5 * max(H, W) / scale, 1.5 * max(H, W) / scale,
                                 allow_nan=False, allow_infinity=False)) for _ in range(4)]
        rois.append([b] + xs)
    rois = np.asarray(rois, np.float64).astype(dtype)
    seed = draw(st.integers(0, 2 ** 31 - 1))
    kind = draw(st.sampled_from(["randn", "relu", "int"]))
    rng = np.random.default_rng(seed)
    data = make_data(rng, (N, Cin, H, W), dtype, kind)
    grad = make_data(rng, (R, C, PH, PW), dtype)
    return params, data, rois, grad


def _reference(op_type, data, rois, grad, params):
    p = dict(params)
    ps = p.pop("pooled_size")
    if isinstance(ps, str):
        ps = tuple(int(v) for v in ps.strip("()").split(","))
    if op_type == "ROIPooling":
        return (ref.roi_pooling_forward(data, rois, ps, **p),
                ref.roi_pooling_backward(data, rois, grad, ps, **p))
    if op_type == "ROIAlign":
        return (ref.roi_align_forward(data, rois, ps, **p),
                ref.roi_align_backward(data, rois, grad, ps, **p))
    if op_type == "PSROIPooling":
        return (ref.psroi_pooling_forward(data, rois, ps, **p),
                ref.psroi_pooling_backward(data, rois, grad, ps, **p))
    return (ref.psroi_align_forward(data, rois, ps, **p),
            ref.psroi_align_backward(data, rois, grad, ps, **p))


def _check(op_type, problem):
    params, data, rois, grad = problem
    out, dg, rg = run_custom(op_type, data, rois, params, grad=grad)
    rout, rdg = _reference(op_type, data, rois, grad, params)
    what = f"{op_type} {params} rois={rois.tolist()}"
    exact = op_type == "ROIPooling" and data.dtype != np.float16
    assert_close(out, rout, data.dtype, "forward " + what, exact=exact)
    assert_close(dg, rdg, data.dtype, "data grad " + what)
    assert not rg.any(), "rois gradient must be zero"


@SETTINGS
@given(problem=problems("ROIPooling"))
def test_roi_pooling_property(problem):
    _check("ROIPooling", problem)


@SETTINGS
@given(problem=problems("ROIAlign"))
def test_roi_align_property(problem):
    _check("ROIAlign", problem)


@SETTINGS
@given(problem=problems("PSROIPooling"))
def test_psroi_pooling_property(problem):
    _check("PSROIPooling", problem)


@SETTINGS
@given(problem=problems("PSROIAlign"))
def test_psroi_align_property(problem):
    _check("PSROIAlign", problem)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(op_type=st.sampled_from(["ROIPooling", "ROIAlign", "PSROIPooling", "PSROIAlign"]),
       data=st.data())
def test_all_ops_property_long(op_type, data):
    """A longer randomized run (not derandomized): -m slow."""
    _check(op_type, data.draw(problems(op_type)))
