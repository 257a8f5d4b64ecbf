"""The cost of the ``Custom`` call itself: two trivial custom ops with the workloads'
shapes, one that does nothing (also the Custom door's floor of the fixed-cost section,
:mod:`.small_call`) and one that only moves the inputs to NumPy and writes zeros (the
floor of any NumPy-backed custom op).  Importing this module registers the two
(``mx_roi_bench_noop``, ``mx_roi_bench_numpy_io``)."""
from __future__ import annotations

import json
from typing import List

import numpy as np

import mxnet as mx

from .timing import bench_pair
from .workloads import DIRECTIONS, Inputs, Workload

__all__ = ["OVERHEAD_OPS", "bench_overhead"]

class _NoopOp(mx.operator.CustomOp):
    """Does nothing: the cost of the Custom call (dispatch, thread hop, callbacks)."""

    def forward(self, is_train, req, in_data, out_data, aux):
        pass

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        pass


class _NumpyIOOp(mx.operator.CustomOp):
    """Moves the inputs to NumPy and writes zeros: the floor of a NumPy-backed op."""

    def forward(self, is_train, req, in_data, out_data, aux):
        in_data[0].asnumpy()
        in_data[1].asnumpy()
        out_data[0][:] = np.zeros(out_data[0].shape, np.float32)

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        out_grad[0].asnumpy()
        in_data[1].asnumpy()
        in_grad[0][:] = np.zeros(in_grad[0].shape, np.float32)
        in_grad[1][:] = 0


def _overhead_prop(op_cls):
    class _Prop(mx.operator.CustomOpProp):
        def __init__(self, out_shape):
            super().__init__(need_top_grad=True)
            self.out_shape = tuple(int(v) for v in json.loads(out_shape))

        def list_arguments(self):
            return ["data", "rois"]

        def list_outputs(self):
            return ["output"]

        def infer_shape(self, in_shape):
            return in_shape, [self.out_shape], []

        def declare_backward_dependency(self, out_grad, in_data, out_data):
            return [out_grad[0], in_data[1]]

        def create_operator(self, ctx, shapes, dtypes):
            return op_cls()

    return _Prop


OVERHEAD_OPS = {"mx_roi_bench_noop": (_NoopOp, "Custom call, no-op"),
                "mx_roi_bench_numpy_io": (_NumpyIOOp, "Custom call + NumPy I/O, zeros out")}
for _name, (_cls, _) in OVERHEAD_OPS.items():
    mx.operator.register(_name)(_overhead_prop(_cls))


def bench_overhead(inputs: Inputs, workloads: List[Workload], repeat: int):
    """Time the trivial custom ops with the shapes of each distinct main workload."""
    rows, seen = [], set()
    for w in workloads:
        shape = w.out_shape
        sig = (w.channels, shape)
        if sig in seen or w.key.endswith("-big"):
            continue
        seen.add(sig)
        rois = inputs.rois(w.boxes, w.rois_columns)
        out_grad = inputs.out_grad(shape)
        for op_type, (_, label) in OVERHEAD_OPS.items():
            def fn(data, rois, _t=op_type, _s=json.dumps(list(shape))):
                return mx.nd.Custom(data, rois, op_type=_t, out_shape=_s)
            for direction in DIRECTIONS:
                data = inputs.data(w.channels)
                res = bench_pair(fn, None, data, rois, direction, repeat, out_grad)
                rows.append(dict(op_type=op_type, label=label, direction=direction,
                                 data_shape=list(data.shape), out_shape=list(shape),
                                 ms=res["ours_ms"], runs_ms=res["ours_runs_ms"]))
    return rows

