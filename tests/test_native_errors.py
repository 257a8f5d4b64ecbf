"""A native op's error reaches the caller as the Custom door's does: an
:class:`mx_roi.errors.RoIError` (an MXNetError and a ValueError) whose first line is the
op's own message -- the Custom door's line, without the Python type's name -- with MXNet's report after it
(MXNet puts ``Traceback ... Error calling FCompute for custom operator 'mx_roi_<Op>'``
first)."""
import re

import numpy as np
import pytest
import mxnet as mx

import mx_roi
from mx_roi.errors import RoIError

pytestmark = pytest.mark.skipif(bool(mx_roi.ext.unavailable_reason()),
                                reason="the extension library cannot be built here")

GOOD = [[0, 0, 0, 3, 3]]
BAD_INPUTS = {
    "nan roi": (np.ones((1, 4, 5, 5)), [[0, 0, 0, np.nan, 3]]),
    "batch index": (np.ones((1, 4, 5, 5)), [[3, 0, 0, 3, 3]]),
    "rois shape": (np.ones((1, 4, 5, 5)), [[0, 0, 0, 3]]),
    "dtype": (np.ones((1, 4, 5, 5)), np.array(GOOD, np.float64)),
}


def _first_line(call):
    with pytest.raises(mx.base.MXNetError) as info:
        call().asnumpy()
    return info.value, str(info.value).splitlines()[0]


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_native_error_is_the_custom_doors_first_line(kind):
    mx_roi.ext.load()
    x, r = BAD_INPUTS[kind]
    data = mx.nd.array(x, dtype="float32")
    rois = mx.nd.array(r, dtype=np.asarray(r).dtype if isinstance(r, np.ndarray) else "float32")
    params = dict(pooled_size=(2, 2), spatial_scale=1.0)
    _, want = _first_line(lambda: mx.nd.Custom(data, rois, op_type="ROIAlign", **params))
    err, got = _first_line(lambda: mx.nd.mx_roi_ROIAlign(data, rois, **params))
    assert isinstance(err, RoIError) and isinstance(err, ValueError)
    # the Custom door names the Python exception's type first ("ValueError: ROIAlign: ...")
    assert got == re.sub(r"^\w+Error: ", "", want)
    assert got.startswith("ROIAlign: ")
    assert "Error calling" in str(err)  # MXNet's report kept after it
    # the next good call works
    good = mx.nd.mx_roi_ROIAlign(data, mx.nd.array(GOOD), **params).asnumpy()
    assert np.isfinite(good).all()


def test_native_parameter_error_names_op_and_parameter():
    mx_roi.ext.load()
    err, got = _first_line(lambda: mx.nd.mx_roi_ROIAlign(
        mx.nd.ones((1, 4, 5, 5)), mx.nd.array(GOOD), pooled_size=(2, 2), spatial_scale=-1.0))
    assert isinstance(err, RoIError)
    assert got == "ROIAlign: parameter 'spatial_scale': expected positive value(s), got -1.0"


def test_other_errors_are_left_alone():
    with pytest.raises(mx.base.MXNetError) as info:
        mx.nd.ones((2, 3)).reshape((7,))
    assert not isinstance(info.value, RoIError)
