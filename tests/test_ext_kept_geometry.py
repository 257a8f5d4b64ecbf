"""The tables a native forward keeps for its backward (ext_launch.h's KeptGeometry): the
backward of the same call takes them (``mx_roi.ext.geometry_reuse`` counts it), and
builds its own whenever anything the tables depend on differs -- the rois (same shape,
other values), the parameters, the data's shape -- or another call has laid its tables
over the op's scratch since (the same op in float64 between a float32 forward and its
backward: every other key equal).  Each case's gradient is bit for bit the Custom path's
(native backend, kernels launched from Python), with the gradient buffer garbage-filled
first.  In a child process: a backward on stale tables would read wrong indices."""
import textwrap

import pytest

from mx_roi import ext
from tests.child import child_result

pytestmark = pytest.mark.skipif(bool(ext.unavailable_reason()),
                                reason="no extension library here: "
                                       + (ext.unavailable_reason() or ""))

OPS = ("ROIAlign", "ROIPooling", "PSROIAlign", "PSROIPooling")

CHILD = textwrap.dedent("""
    import json, os
    os.environ["MX_ROI_BACKEND"] = "native"
    os.environ["MX_ROI_LIBRARY_CALLS"] = "0"
    import numpy as np, mxnet as mx
    import mx_roi
    from mx_roi import ext
    ext.load()

    rng = np.random.RandomState(11)
    OPS = {
        "ROIAlign": (8, dict(pooled_size=(7, 7), spatial_scale=0.125, sample_ratio=2)),
        "ROIPooling": (8, dict(pooled_size=(7, 7), spatial_scale=0.125)),
        "PSROIAlign": (18, dict(pooled_size=(3, 3), output_dim=2, spatial_scale=0.125,
                                sample_ratio=2)),
        "PSROIPooling": (18, dict(pooled_size=(3, 3), output_dim=2, spatial_scale=0.125)),
    }

    def rois_np(seed):
        r = np.random.RandomState(seed)
        xy = np.sort(r.uniform(0, 120, (6, 2, 2)), axis=1)
        return np.concatenate([r.randint(0, 2, (6, 1)), xy[:, 0], xy[:, 1]], 1)

    def grad_of(name, door, calls, dtype="float32"):
        # records every (data, rois, kw) of ``calls``, then the first call's backward
        # only; returns its data gradient (the buffer garbage-filled first)
        xs, ys = [], []
        with mx.autograd.record():
            for data, rois, kw in calls:
                x = mx.nd.array(data, dtype=data.dtype)
                x.attach_grad()
                x.grad[:] = 5.0
                r = mx.nd.array(rois, dtype=data.dtype)
                if door == "native":
                    y = getattr(mx.nd, "mx_roi_" + name)(x, r, **kw)
                else:
                    y = mx.nd.Custom(x, r, op_type=name, **kw)
                xs.append(x)
                ys.append(y)
        y = ys[0]
        y.backward(mx.nd.array(np.arange(y.size, dtype="f8").reshape(y.shape) % 7 - 3,
                               dtype=y.dtype))
        return xs[0].grad.asnumpy()

    out = {}
    for name, (C, kw) in OPS.items():
        data = rng.standard_normal((2, C, 16, 20)).astype("f4")
        other_hw = rng.standard_normal((2, C, 15, 22)).astype("f4")
        r1, r2 = rois_np(1), rois_np(2)
        scaled = dict(kw, spatial_scale=0.25)
        first = (data, r1, kw)
        cases = {
            "same call": [first],
            "same call, float64": [(data.astype("f8"), r1, kw)],
            "same call, float16": [(data.astype("f2"), r1, kw)],
            "other rois": [first, (data, r2, kw)],
            "other parameters": [first, (data, r1, scaled)],
            "other data shape": [first, (other_hw, r1, kw)],
            "tables laid since": [first, (data.astype("f8"), r1, kw)],
        }
        res = {}
        for case, calls in cases.items():
            want = grad_of(name, "custom", calls[:1])
            before = ext.geometry_reuse()
            got = grad_of(name, "native", calls)
            after = ext.geometry_reuse()
            res[case] = dict(equal=bool(np.array_equal(got, want)),
                             nonzero=bool(np.any(got != 0)),
                             built=after["built"] - before["built"],
                             reused=after["reused"] - before["reused"])
        out[name] = res
    print("RESULT", json.dumps(out))
""")


@pytest.fixture(scope="module")
def results():
    return child_result(CHILD, timeout=600)


@pytest.mark.parametrize("case", ["same call", "same call, float64", "same call, float16"])
@pytest.mark.parametrize("op", OPS)
def test_the_backward_of_the_same_call_takes_the_kept_tables(results, op, case):
    r = results[op][case]
    assert (r["built"], r["reused"]) == (0, 1), r
    assert r["equal"] and r["nonzero"], r


@pytest.mark.parametrize("case", ["other rois", "other parameters", "other data shape",
                                  "tables laid since"])
@pytest.mark.parametrize("op", OPS)
def test_a_backward_builds_its_own_tables_when_anything_differs(results, op, case):
    r = results[op][case]
    assert (r["built"], r["reused"]) == (1, 0), r
    assert r["equal"] and r["nonzero"], r
