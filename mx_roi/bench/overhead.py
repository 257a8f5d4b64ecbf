"""The cost of the ``Custom`` call itself: two trivial custom ops with the workloads'
shapes, one that does nothing and one that only moves the inputs to NumPy and writes
zeros (the floor of any NumPy-backed custom op); and the fixed cost of each op on a small
call, above the no-op.  Importing this module registers the two
(``mx_roi_bench_noop``, ``mx_roi_bench_numpy_io``)."""
from __future__ import annotations

import json
import statistics
from typing import List

import numpy as np

import mxnet as mx

import mx_roi

from .timing import bench_pair
from .workloads import (DIRECTIONS, FIXED_COST_TARGET_MS, Inputs, Workload, in_layout,
                        make_rois, pooled_hw)

__all__ = ["OVERHEAD_OPS", "bench_overhead", "bench_fixed_cost", "FIXED_COST_TARGET_MS"]

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


#: the small call of the fixed-cost section: one image, a 64-channel stride-32 map of a
#: 600x800 image (19x25), 16 proposals -- a call where the op's own work is negligible
SMALL_CHANNELS, SMALL_HW, SMALL_BOXES, SMALL_REPEAT, SEED_SMALL = 64, (19, 25), 16, 41, 7


def bench_fixed_cost(workloads: List[Workload], ctx, repeat: int = SMALL_REPEAT):
    """Per op configuration (the main workloads' families): the small call's median time,
    ours and the no-op Custom op with the same shapes, interleaved; ``extra_ms``: the
    median of the paired differences ours - no-op (each run of ours with the no-op's run
    next to it), the op's cost above MXNet's own cost of a Python custom op."""
    rows, seen = [], set()
    rois_np = make_rois(SMALL_BOXES, batch=1, seed=SEED_SMALL)
    for w in workloads:
        kwargs = dict(w.ours_kwargs)
        family = w.key.split("/")[0]
        if family in seen:
            continue
        ph, pw = pooled_hw(kwargs["pooled_size"])
        seen.add(family)
        channels = SMALL_CHANNELS
        if w.extra is not None:  # deformable: output_dim * group_size^2 channels
            G = kwargs["group_size"]
            kwargs["output_dim"] = max(1, SMALL_CHANNELS // (G * G))
            channels = kwargs["output_dim"] * G * G
        elif "output_dim" in kwargs:  # position-sensitive: output_dim * P * Q channels
            kwargs["output_dim"] = max(1, SMALL_CHANNELS // (ph * pw))
            channels = kwargs["output_dim"] * ph * pw
        kwargs["spatial_scale"] = 1.0 / 32
        rng = np.random.RandomState(SEED_SMALL)
        data = mx.nd.array(rng.standard_normal((1, channels) + SMALL_HW).astype(np.float32),
                           ctx=ctx)
        rois = mx.nd.array(in_layout(rois_np, w.rois_columns), ctx=ctx)
        shape = (SMALL_BOXES, kwargs.get("output_dim", channels), ph, pw)
        out_grad = mx.nd.array(np.ones(shape, np.float32), ctx=ctx)
        ours = getattr(mx_roi.nd, w.op)
        _s = json.dumps(list(shape))

        def noop(data, rois):
            return mx.nd.Custom(data, rois, op_type="mx_roi_bench_noop", out_shape=_s)

        extra_in = w.extra_inputs(rois, kwargs)
        for direction in DIRECTIONS:
            res = bench_pair(lambda d, r: ours(d, r, *extra_in, **kwargs), noop, data, rois,
                             direction, repeat, out_grad)
            # the median of the paired differences (each run of ours next to a run of
            # the no-op): a shared machine's drift cancels in a pair, not across medians
            extra = statistics.median(o - b for o, b in zip(res["ours_runs_ms"],
                                                            res["builtin_runs_ms"]))
            rows.append(dict(key=family,
                             op=w.op, direction=direction, data_shape=list(data.shape),
                             out_shape=list(shape), ours_ms=res["ours_ms"],
                             noop_ms=res["builtin_ms"], extra_ms=extra,
                             ours_runs_ms=res["ours_runs_ms"],
                             noop_runs_ms=res["builtin_runs_ms"],
                             target_ms=FIXED_COST_TARGET_MS[direction],
                             met=extra <= FIXED_COST_TARGET_MS[direction]))
    return rows
