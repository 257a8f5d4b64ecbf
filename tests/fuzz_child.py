"""Child process of tests/test_fuzz.py: seeded bad-input cases as training steps.

``python -m tests.fuzz_child fuzz SEED CASES`` runs CASES random cases (op, entry point,
defect) -- each a training step (record -> forward -> backward -> read, no wait in
between) through ``mx.nd.Custom``, ``mx_roi.nd``, ``mx.sym`` + ``simple_bind`` or Gluon
(hybridized or not) -- followed by a valid step whose output and gradient are checked
against tests/reference.py.  ``python -m tests.fuzz_child soak STEPS`` runs STEPS
alternating good/bad Gluon training steps per op in one process (oneDNN guard on),
checking each good step's gradient against a finite-difference-free reference (the
gradient of a sum is checked through the forward's linearity: see ``_grad_ref``) and
reporting RSS.  ``handover ROUNDS ENTRIES OPS`` forces MXNet 1.9.1's hand-over of a
failed callback's error to another op's completion (mx_roi.error_slot) and checks each
error stays with its own call; ``unread STEPS ENTRIES OPS`` runs bad training steps whose
gradient nobody reads (the loop in which that hand-over was seen).  Prints one JSON line
with the counts; exit status 0 unless a check fails.  An abort or hang shows up in the
parent as a signal / timeout.
"""
from __future__ import annotations

import json
import os
import resource
import sys

import numpy as np

import mxnet as mx
from mxnet import autograd

import mx_roi
from tests import reference as ref

OPS = {
    "ROIPooling": (dict(pooled_size=(2, 2), spatial_scale=0.5), 3,
                   lambda x, r: ref.roi_pooling_forward(x, r, (2, 2), 0.5)),
    "ROIAlign": (dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=2), 3,
                 lambda x, r: ref.roi_align_forward(x, r, (2, 2), 0.5, 2)),
    "PSROIPooling": (dict(pooled_size=2, output_dim=2, spatial_scale=0.5), 8,
                     lambda x, r: ref.psroi_pooling_forward(x, r, 2, 2, 0.5)),
    "PSROIAlign": (dict(pooled_size=2, output_dim=2, spatial_scale=0.5, sample_ratio=2), 8,
                   lambda x, r: ref.psroi_align_forward(x, r, 2, 2, 0.5, 2)),
}
ENTRIES = ("nd", "mx_roi.nd", "sym", "gluon", "gluon-hybrid")
GOOD_ROIS = np.array([[0, 1, 1, 9, 8], [1, 0, 2, 12, 11], [1, 3, 3, 4, 5]], np.float32)

# defect -> (rois transform, params override, data shape/dtype override, message regex)
DEFECTS = {
    "batch>=N": (lambda r, g: _set(r, (1, 0), 2 + g.integers(0, 50)), "batch index"),
    "batch frac>=N": (lambda r, g: _set(r, (0, 0), 2.5), "batch index"),
    "nan": (lambda r, g: _set(r, (g.integers(0, 3), g.integers(0, 5)), np.nan), "NaN or infinite"),
    "+inf": (lambda r, g: _set(r, (g.integers(0, 3), g.integers(1, 5)), np.inf),
             "NaN or infinite"),
    "-inf": (lambda r, g: _set(r, (g.integers(0, 3), g.integers(1, 5)), -np.inf),
             "NaN or infinite"),
    "width4": (lambda r, g: r[:, :4], "rois must have shape"),
    "rank1": (lambda r, g: r[0], "rois must have shape"),
    "rank3": (lambda r, g: r[None], "rois must have shape"),
    "dtype": (lambda r, g: r.astype(np.float64), "same dtype"),
    "pooled0": (None, "pooled_size"),
    "pooled2^31": (None, "pooled_size"),
    "scale-neg": (None, "spatial_scale"),
    "scale-str": (None, "spatial_scale"),
}
# valid unusual inputs: must work and match the reference
VALID = {
    "R=0": lambda r, g: r[:0],
    "pad -1": lambda r, g: _set(r, (2, 0), -1),
    "batch frac<N": lambda r, g: _set(r, (0, 0), 0.7),
    "1e30": lambda r, g: _set(r, (2, g.integers(1, 5)), 1e30),
}
BAD_PARAMS = {"pooled0": dict(pooled_size=0), "pooled2^31": dict(pooled_size=2 ** 31),
              "scale-neg": dict(spatial_scale=-1.0),
              "scale-str": dict(spatial_scale="abc")}


def _set(r, idx, v):
    r = r.copy()
    r[int(idx[0]), int(idx[1])] = v
    return r


def _grad_ref(op_type, x, rois, params):
    """Reference input gradient of sum(output) for ``ones`` out-grad: the tests/reference
    backward where it exists, else None (then only finiteness/shape are checked)."""
    fn = getattr(ref, {"ROIPooling": "roi_pooling_backward", "ROIAlign": "roi_align_backward",
                       "PSROIPooling": "psroi_pooling_backward",
                       "PSROIAlign": "psroi_align_backward"}[op_type], None)
    return fn


def _step(op_type, entry, x, rois, params, blocks):
    """One training step; returns (output, grad) as NumPy."""
    xd = mx.nd.array(x, dtype=x.dtype)
    xd.attach_grad()
    xd.grad[:] = 7.0
    rd = mx.nd.array(rois, dtype=rois.dtype)
    if entry == "sym" and 0 in x.shape + rois.shape and not mx.util.is_np_shape():
        with mx.util.np_shape(True):  # zero-size dims bind only with np_shape semantics
            return _step(op_type, entry, x, rois, params, blocks)
    if entry == "sym":
        sym = mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"), op_type=op_type, **params)
        exe = sym.simple_bind(mx.cpu(), data=x.shape, rois=rois.shape,
                              type_dict={"data": x.dtype, "rois": rois.dtype},
                              grad_req={"data": "write", "rois": "null"})
        exe.arg_dict["data"][:] = xd
        exe.arg_dict["rois"][:] = rd
        exe.grad_dict["data"][:] = 7.0
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones(exe.outputs[0].shape, dtype=x.dtype))
        return exe.outputs[0].asnumpy(), exe.grad_dict["data"].asnumpy()
    with autograd.record():
        if entry == "nd":
            y = mx.nd.Custom(xd, rd, op_type=op_type, **params)
        elif entry == "mx_roi.nd":
            y = getattr(mx_roi.nd, op_type)(xd, rd, **params)
        else:
            key = (op_type, entry, json.dumps(params, sort_keys=True, default=str))
            if key not in blocks:
                blk = getattr(mx_roi.gluon, op_type)(**params)
                if entry == "gluon-hybrid":
                    blk.hybridize()
                blocks[key] = blk
            y = blocks[key](xd, rd)
    y.backward()
    return y.asnumpy(), xd.grad.asnumpy()


def _good_step(op_type, entry, g, blocks, counts):
    params, cin, fwd = OPS[op_type]
    x = g.standard_normal((2, cin, 6, 7)).astype(np.float32)
    out, grad = _step(op_type, entry, x, GOOD_ROIS, params, blocks)
    if not np.allclose(out, fwd(x, GOOD_ROIS), rtol=1e-4, atol=1e-4):
        counts["wrong_numbers"] += 1
    if grad.shape != x.shape or not np.isfinite(grad).all() or (grad == 7.0).any():
        counts["wrong_grad"] += 1
    # the gradient of sum(output) of a linear-in-data op (all but the max modes):
    # <grad, x> == sum(output)
    if op_type in ("ROIAlign", "PSROIAlign") and not np.isclose(
            float((grad * x).sum()), float(out.sum()), rtol=1e-3, atol=1e-3):
        counts["wrong_grad"] += 1


def _expect_valid(counts, bad_log, where, run, problem):
    """A case that must succeed: ``run()`` gives (out, grad), ``problem(out, grad)`` names
    what is wrong with them ('' if nothing); an MXNetError counts as a wrong message."""
    try:
        out, grad = run()
        what = problem(out, grad)
        if what:
            counts["wrong_numbers"] += 1
            bad_log.append(where + (what,))
        counts["valid"] += 1
    except mx.base.MXNetError as exc:
        counts["wrong_message"] += 1
        bad_log.append(where + (str(exc).splitlines()[0],))


def fuzz(seed: int, cases: int) -> dict:
    g = np.random.default_rng(seed)
    counts = dict(cases=0, raised=0, wrong_message=0, silent=0, wrong_numbers=0, wrong_grad=0,
                  valid=0)
    blocks = {}
    names = list(DEFECTS) + list(VALID) + ["empty-map", "env-backend", "env-threads",
                                           "env-min-items"]
    bad_log = []
    for _ in range(cases):
        op_type = list(OPS)[g.integers(0, len(OPS))]
        entry = ENTRIES[g.integers(0, len(ENTRIES))]
        name = names[g.integers(0, len(names))]
        params, cin, fwd = OPS[op_type]
        x = g.standard_normal((2, cin, 6, 7)).astype(np.float32)
        rois = GOOD_ROIS.copy()
        counts["cases"] += 1
        where = (op_type, entry, name)
        if name in VALID:
            r = VALID[name](rois, g)
            if name == "R=0":  # zero-size arrays need np_shape semantics in MXNet
                def run():
                    with mx.util.np_shape(True):
                        return _step(op_type, entry, x, r, params, {})
            else:
                def run():
                    return _step(op_type, entry, x, r, params, blocks)
            _expect_valid(counts, bad_log, where, run, lambda out, grad: "numbers" if not (
                np.allclose(out, fwd(x, r), rtol=1e-4, atol=1e-4) and np.isfinite(grad).all())
                else "")
            continue
        env = {}
        if name == "empty-map":
            def run():
                with mx.util.np_shape(True):
                    xe = np.zeros((2, cin, 0, 7), np.float32)
                    return _step(op_type, entry if entry != "mx_roi.nd" else "nd",
                                 xe, rois, params, {})
            _expect_valid(counts, bad_log, where, run,
                          lambda out, grad: "nonzero" if (out != 0).any() else "")
            _good_step(op_type, entry, g, blocks, counts)
            continue
        if name == "env-backend":
            env, pattern, r, p = {"MX_ROI_BACKEND": "nativ"}, "MX_ROI_BACKEND='nativ'", rois, params
        elif name == "env-threads":
            env, pattern, r, p = ({"MX_ROI_BACKEND": "native", "MX_ROI_NUM_THREADS": "abc"},
                                  "MX_ROI_NUM_THREADS='abc'", rois, params)
        elif name == "env-min-items":
            env, pattern, r, p = ({"MX_ROI_BACKEND": "native", "MX_ROI_MIN_ITEMS_PER_THREAD":
                                   "0"}, "MX_ROI_MIN_ITEMS_PER_THREAD='0'", rois, params)
        else:
            fn, pattern = DEFECTS[name]
            r = fn(rois, g) if fn else rois
            p = dict(params, **BAD_PARAMS.get(name, {}))
            if name == "dtype":
                pattern = "same dtype"
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            _step(op_type, entry, x, r, p, blocks if name not in BAD_PARAMS else {})
            counts["silent"] += 1
            bad_log.append((op_type, entry, name, "no error"))
        except (mx.base.MXNetError, ValueError, TypeError, RuntimeError) as exc:
            counts["raised"] += 1
            if pattern not in str(exc).split("MXNet's report follows")[0]:
                counts["wrong_message"] += 1
                bad_log.append((op_type, entry, name, str(exc).splitlines()[0][:160]))
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _good_step(op_type, entry, g, blocks, counts)
    counts["log"] = bad_log[:20]
    return counts


def soak(steps: int) -> dict:
    g = np.random.default_rng(1)
    counts = dict(steps=0, raised=0, wrong_message=0, silent=0, wrong_numbers=0, wrong_grad=0)
    rss = []
    blocks = {}
    for op_type in OPS:
        params, cin, _ = OPS[op_type]
        for i in range(steps):
            counts["steps"] += 1
            entry = ("gluon", "gluon-hybrid")[i // 2 % 2]
            if i % 2 == 0:
                _good_step(op_type, entry, g, blocks, counts)
            else:
                x = g.standard_normal((2, cin, 6, 7)).astype(np.float32)
                k = 2 + i
                r = _set(GOOD_ROIS, (1, 0), k) if i % 4 == 1 else \
                    _set(GOOD_ROIS, (2, 1 + i % 4), (np.nan, np.inf, -np.inf)[i % 3])
                want = f"batch index {k} but" if i % 4 == 1 else "rois[2] has a NaN or infinite"
                try:
                    _step(op_type, entry, x, r, params, blocks)
                    counts["silent"] += 1
                except mx.base.MXNetError as exc:
                    counts["raised"] += 1
                    if want not in str(exc).splitlines()[0]:
                        counts["wrong_message"] += 1
            if i % 100 == 0:
                rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    counts["rss_kb_first_last"] = [rss[len(rss) // 4], rss[-1]]
    return counts


def _inputs(x, rois):
    """NDArrays for a step: data (with a gradient buffer) and rois.  Creating an NDArray
    from NumPy waits for MXNet's CPU worker: :func:`handover` makes them before it
    occupies the worker."""
    xd = mx.nd.array(x)
    xd.attach_grad()
    return xd, mx.nd.array(rois)


def _issue(op_type, entry, xd, rd, params, blocks):
    """Issue a training step on NDArrays ``xd`` (gradient attached), ``rd``: record ->
    forward -> backward, nothing read.  Returns the output and the input gradient, both
    still being computed."""
    if entry == "sym":
        key = (op_type, "sym")
        if key not in blocks:
            blocks[key] = mx.sym.Custom(mx.sym.var("data"), mx.sym.var("rois"),
                                        op_type=op_type, **params)
        exe = blocks[key].bind(mx.cpu(), args={"data": xd, "rois": rd},
                               args_grad={"data": xd.grad},
                               grad_req={"data": "write", "rois": "null"})
        exe.forward(is_train=True)
        exe.backward(mx.nd.ones(exe.outputs[0].shape))
        return exe.outputs[0], xd.grad
    with autograd.record():
        if entry == "nd":
            y = mx.nd.Custom(xd, rd, op_type=op_type, **params)
        else:
            key = (op_type, entry)
            if key not in blocks:
                blocks[key] = getattr(mx_roi.gluon, op_type)(**params)
                blocks[key].hybridize()
            y = blocks[key](xd, rd)
    y.backward(mx.nd.ones(y.shape))
    return y, xd.grad


def _unread_step(op_type, entry, x, rois, params, blocks):
    """A training step that reads the output only (the gradient is left unread, as a
    training loop does after a step that raised)."""
    y, grad = _issue(op_type, entry, *_inputs(x, rois), params, blocks)
    return y.asnumpy(), grad


def _closing_checks(counts, log) -> dict:
    """``counts`` with the checks that close a run of steps: no stale error left for a
    later synchronisation (``stale_at_waitall``), no error record still pending
    (``pending_records``), and the first 20 ``log`` lines."""
    try:
        mx.nd.waitall()
        counts["stale_at_waitall"] = 0
    except mx.base.MXNetError as exc:
        counts["stale_at_waitall"] = 1
        log.append(("waitall", str(exc).splitlines()[0][:120]))
    from mx_roi import errors
    counts["pending_records"] = errors.pending()
    counts["log"] = log[:20]
    return counts


def handover(rounds: int, entries, op_types, busy: int = 1000) -> dict:
    """The hand-over of MXNet 1.9.1's custom-op error slot, made to happen every time:
    queue a (busy, busy) matrix product (MXNet's CPU worker is busy with it), issue a
    valid training step (its callbacks finish; their completions wait behind the
    product), then a bad one, whose forward fails while those completions still wait.
    Without mx_roi.error_slot the valid step's completion took the bad step's error: the
    bad output read with no error (``bad_silent``) and the valid one raised
    (``good_raised``)."""
    import time
    counts = dict(steps=0, raised=0, wrong_message=0, bad_silent=0, good_raised=0,
                  wrong_numbers=0, wrong_grad=0)
    blocks = {}
    g = np.random.default_rng(6)
    heavy = mx.nd.ones((busy, busy))
    log = []
    for op_type in op_types:
        params, cin, fwd = OPS[op_type]
        x = g.standard_normal((2, cin, 6, 7)).astype(np.float32)
        want_out = fwd(x, GOOD_ROIS)
        for entry in entries:
            for i in range(rounds):
                counts["steps"] += 2
                bad = GOOD_ROIS.copy()
                bad[1, 4] = np.nan
                good_in, bad_in = _inputs(x, GOOD_ROIS), _inputs(x, bad)
                mx.nd.dot(heavy, heavy)
                good_out, good_grad = _issue(op_type, entry, *good_in, params, blocks)
                time.sleep(0.005)  # the valid step's forward callback finishes meanwhile
                bad_out, _ = _issue(op_type, entry, *bad_in, params, blocks)
                try:
                    bad_out.asnumpy()
                    counts["bad_silent"] += 1
                    log.append((op_type, entry, i, "bad step: no error"))
                except mx.base.MXNetError as exc:
                    counts["raised"] += 1
                    if "rois[1] has a NaN or infinite" not in str(exc).splitlines()[0]:
                        counts["wrong_message"] += 1
                        log.append((op_type, entry, i, str(exc).splitlines()[0][:120]))
                try:
                    out, grad = good_out.asnumpy(), good_grad.asnumpy()
                    counts["wrong_numbers"] += not np.allclose(out, want_out, rtol=1e-4,
                                                               atol=1e-4)
                    counts["wrong_grad"] += not np.isfinite(grad).all()
                except mx.base.MXNetError as exc:
                    counts["good_raised"] += 1
                    log.append((op_type, entry, i, "valid step raised",
                                str(exc).splitlines()[0][:120]))
    return _closing_checks(counts, log)


def unread(steps: int, entries, op_types) -> dict:
    """Training steps with bad rois whose gradient nobody reads (record -> backward, no
    wait -> read the output), every tenth one valid (output and gradient read, checked):
    each bad step must raise its own error when the output is read (MXNet 1.9.1 hands a
    failed callback's error to whichever custom op completes next: mx_roi.error_slot),
    and no valid step may raise.  :func:`handover` forces the hand-over; this is the
    plain training loop in which it was seen."""
    counts = dict(steps=0, raised=0, wrong_message=0, silent=0, nonfinite_silent=0,
                  wrong_numbers=0, wrong_grad=0, valid=0)
    blocks = {}
    g = np.random.default_rng(5)
    log = []
    for op_type in op_types:
        params, cin, fwd = OPS[op_type]
        x = g.standard_normal((2, cin, 6, 7)).astype(np.float32)
        for entry in entries:
            for i in range(steps):
                counts["steps"] += 1
                if i % 10 == 9:
                    try:
                        out, grad = _unread_step(op_type, entry, x, GOOD_ROIS, params, blocks)
                        grad = grad.asnumpy()
                        counts["valid"] += 1
                        counts["wrong_numbers"] += not np.allclose(
                            out, fwd(x, GOOD_ROIS), rtol=1e-4, atol=1e-4)
                        counts["wrong_grad"] += not np.isfinite(grad).all()
                    except mx.base.MXNetError as exc:
                        counts["wrong_message"] += 1
                        log.append((op_type, entry, i, "valid step raised",
                                    str(exc).splitlines()[0][:120]))
                    continue
                r = GOOD_ROIS.copy()
                if i % 2:
                    r[1, 0], want = 7 + i, f"rois[1] has batch index {7 + i} but"
                else:
                    r[1, 4], want = np.nan, "rois[1] has a NaN or infinite"
                try:
                    out, _ = _unread_step(op_type, entry, x, r, params, blocks)
                    counts["silent"] += 1
                    counts["nonfinite_silent"] += not np.isfinite(out).all()
                    log.append((op_type, entry, i, "no error"))
                except mx.base.MXNetError as exc:
                    counts["raised"] += 1
                    if want not in str(exc).splitlines()[0]:
                        counts["wrong_message"] += 1
                        log.append((op_type, entry, i, str(exc).splitlines()[0][:120]))
    return _closing_checks(counts, log)


if __name__ == "__main__":
    if os.environ.get("MX_ROI_FUZZ_RESCAN") == "1":
        # every training call of a max op keeps no argmax: its backward rescans the data
        from mx_roi.cuda import backend as _backend
        _backend.ARGMAX_KEEP_MAX_ELEMENTS = 0
    mode = sys.argv[1]
    if mode == "fuzz":
        res = fuzz(int(sys.argv[2]), int(sys.argv[3]))
    elif mode == "unread":  # unread STEPS ENTRY,ENTRY,... OP,OP,...
        res = unread(int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4].split(","))
    elif mode == "handover":  # handover ROUNDS ENTRY,ENTRY,... OP,OP,...
        res = handover(int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4].split(","))
    else:
        res = soak(int(sys.argv[2]))
    print("RESULT " + json.dumps(res, default=str), flush=True)
    bad = sum(res.get(k, 0) for k in ("wrong_message", "silent", "wrong_numbers", "wrong_grad",
                                       "stale_at_waitall", "bad_silent", "good_raised"))
    sys.exit(1 if bad else 0)
