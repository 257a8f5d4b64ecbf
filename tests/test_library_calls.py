"""The native backend's calls into the extension library (mx_roi.cuda.library_calls): the
Custom door's forward and backward on ``native`` run the native operators' own launcher
(``mx_roi_ext_invoke``), one compiled call per direction.

The checked path (``MX_ROI_LIBRARY_CALLS=0``: the rois read, checked and turned into
tables in Python, every kernel launched from Python) is the oracle: every call through
the library must give its outputs and gradients bit for bit, over buffers holding garbage,
for every registered op, mode and dtype, with padding rois and boxes far larger than the
map; a bad roi raises the checked path's message, and the next call works.  The counts
prove the call is one: no kernel launched from Python, one library call per forward and
per backward.
"""
import ctypes
import threading
import types

import mxnet as mx
import numpy as np
import pytest

from mx_roi import ext, opcheck
from mx_roi.cuda import library_calls, loader
from mx_roi.cuda.backend import CudaBackend
from mx_roi.ndio import Kind
from tests.test_native import CASES, identical, make_op, nd, problem

pytestmark = pytest.mark.skipif(bool(ext.unavailable_reason()),
                                reason="no extension library here: "
                                       + (ext.unavailable_reason() or ""))

FILL = 7.25
DTYPES = (np.float32, np.float64, np.float16)
#: every registered op's selftest cases (extra inputs, rotated and precise boxes included)
OP_CASES = list(opcheck.CASES)


@pytest.fixture
def backends(monkeypatch):
    """``(library, checked)``: two native backends, the second on the checked path."""
    monkeypatch.delenv(library_calls.ENV, raising=False)
    library, checked = CudaBackend(Kind.NATIVE), CudaBackend(Kind.NATIVE)
    checked.library_calls = False
    return library, checked


class PythonLaunches:
    """Kernel launches from Python (``loader._Kernel.__call__``), counted while installed."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = loader._Kernel.__call__

        def call(k, *a):
            self.count += 1
            return real(k, *a)

        monkeypatch.setattr(loader._Kernel, "__call__", call)


def step(backend, op, data, rois, grad, extra=(), fill=FILL, bwd_rois=None):
    """A training step into FILL-ed buffers: forward (keeping what the backward needs),
    then every gradient the op has (the data's, each extra input's, the rois' where the
    op differentiates them); returns NumPy arrays ``[out, data grad, *extra grads,
    (rois grad)]``."""
    out = mx.nd.full(op.out_shape(data.shape, rois.shape), fill, dtype=data.dtype)
    x, r = nd(data), nd(rois)
    ex = [nd(a) for a in extra]
    dgrad = mx.nd.full(data.shape, fill, dtype=data.dtype)
    egrad = [mx.nd.full(a.shape, fill, dtype=a.dtype) for a in extra]
    rgrad = mx.nd.full(rois.shape, fill, dtype=rois.dtype) if op.differentiates_rois else None
    saved = backend.forward(op, "write", x, r, out, keep=True, extra=ex)
    r_b = r if bwd_rois is None else nd(bwd_rois)
    backend.backward(op, "write", nd(grad), x, r_b, dgrad, saved,
                     "write" if rgrad is not None else "null", rgrad, extra=ex,
                     extra_grad=tuple(("write", g) for g in egrad))
    return [a.asnumpy() for a in [out, dgrad, *egrad] + ([rgrad] if rgrad is not None else [])]


def same_bits(library, checked, op, data, rois, grad, extra=(), what=""):
    got = step(library, op, data, rois, grad, extra, fill=FILL)
    want = step(checked, op, data, rois, grad, extra, fill=-FILL)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        identical(a, b, f"{what} array {i} ({['out', 'data grad'][i] if i < 2 else 'grad'})")
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", OP_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(OP_CASES)])
def test_every_op_in_one_library_call_per_direction_bit_for_bit(name, params, dtype, backends,
                                                                 monkeypatch):
    """Every registered op's cases (extra inputs and the rois' gradient included): the
    checked path's bits, one library call per direction, no launch from Python."""
    library, checked = backends
    op = make_op(name, params)
    for seed in range(2):
        data, rois, grad, extra = opcheck.problem(op, dtype, seed=seed)
        same_bits(library, checked, op, data, rois, grad, extra, f"seed {seed}")
    launches = PythonLaunches(monkeypatch)
    before = library._native.calls
    step(library, op, data, rois, grad, extra)
    assert library._native.calls - before == 2, "one library call per forward and backward"
    assert launches.count == 0, f"{launches.count} launches from Python"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                    enumerate(CASES)])
def test_adversarial_boxes_bit_for_bit(name, params, dtype, backends):
    """Degenerate boxes, padding rows and boxes far larger than the map (the library then
    builds exact tables, as the checked path does); three data kinds."""
    library, checked = backends
    op = make_op(name, params)
    for seed, kind in enumerate(("randn", "relu", "int", "neg")):
        data, rois, grad = problem(op, dtype, kind, seed=seed)
        same_bits(library, checked, op, data, rois, grad, what=f"{kind} seed {seed}")


def test_padding_only_and_box_far_beyond_the_tables(backends):
    """All rois padding (zeros), and one box 40x the map whose sample grid no table
    sized from the shapes holds."""
    library, checked = backends
    op = make_op("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1))
    data, rois, grad = problem(op, np.float32)
    pad = rois.copy()
    pad[:, 0] = -1
    got = same_bits(library, checked, op, data, pad, grad, what="padding only")
    assert not got[0].any() and not got[1].any()
    big = rois.copy()
    big[1, 1:5] = [0, 0, 400, 300]
    same_bits(library, checked, op, data, big, grad, what="huge box")


BAD_CASES = [c for c in OP_CASES if c[0] in ("ROIPooling", "ROIAlign", "PSROIAlign",
                                             "RROIAlign", "PrRoIPool",
                                             "DeformablePSROIPooling")]


@pytest.mark.parametrize("name,params", BAD_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CASES)])
def test_a_bad_roi_raises_the_checked_message_and_the_next_call_works(name, params,
                                                                       backends):
    library, checked = backends
    op = make_op(name, params)
    data, rois, grad, extra = opcheck.problem(op, np.float32)
    x, ex = nd(data), [nd(a) for a in extra]
    last, cols = rois.shape[0] - 1, op.rois_columns
    # (every value of every row is checked: the first and last row, the last column)
    for bad, row, col in (("nan", 2, 3), ("batch", 2, 0), ("nan", last, cols - 1),
                          ("inf", 0, 1), ("batch", last, 0)):
        broken = rois.copy()
        broken[row, col] = {"nan": np.nan, "inf": np.inf, "batch": 5}[bad]  # 2 images
        messages = []
        for backend in (checked, library):
            calls = backend._native.calls
            with pytest.raises(ValueError) as err:
                backend.forward(op, "write", x, nd(broken),
                                mx.nd.zeros(op.out_shape(data.shape, rois.shape)), keep=True,
                                extra=ex)
            assert backend._native.calls == calls  # (the library refused it: not counted)
            messages.append(str(err.value))
            # the backward re-checks (MXNet runs it after a rejected forward too)
            with pytest.raises(ValueError) as err:
                backend.backward(op, "write", nd(grad), x, nd(broken), mx.nd.zeros(data.shape),
                                 None, extra=ex,
                                 extra_grad=tuple(("write", mx.nd.zeros(a.shape))
                                                  for a in extra))
            messages.append(str(err.value))
        assert len(set(messages)) == 1 and messages[0].startswith(f"{name}: rois[{row}]"), \
            messages
        same_bits(library, checked, op, data, rois, grad, extra, "after the error")


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] == "ROIPooling" or
                                         c[1].get("pool_mode") == "max"])
def test_a_backward_on_other_rois_than_its_forwards(name, params, backends):
    """The library's backward keeps nothing of its forward: handed other rois (same
    shapes), its gradient is a step on those rois."""
    library, checked = backends
    op = make_op(name, params)
    data, rois, grad = problem(op, np.float32, seed=0)
    _, rois_b, _ = problem(op, np.float32, seed=1)
    got = step(library, op, data, rois, grad, bwd_rois=rois_b)
    want = step(checked, op, data, rois_b, grad)
    identical(got[1], want[1], "backward on other rois")


@pytest.mark.parametrize("req", ["add", "null"])
def test_req_add_and_null_take_the_checked_path(req, backends, monkeypatch):
    """MXNet never tells the library's launcher a req: a data gradient with ``add`` (and a
    forward with ``add`` / ``null``) takes the checked path, and adds."""
    library, checked = backends
    op = make_op(*CASES[2])
    data, rois, grad = problem(op, np.float32)
    results = []
    for backend in (library, checked):
        out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL)
        dgrad = mx.nd.full(data.shape, FILL)
        calls = backend._native.calls
        saved = backend.forward(op, req, nd(data), nd(rois), out, keep=True)
        backend.backward(op, req, nd(grad), nd(data), nd(rois), dgrad, saved)
        assert backend._native.calls == calls
        results.append((out.asnumpy(), dgrad.asnumpy()))
    for a, b in zip(*results):
        identical(a, b, req)
    if req == "add":
        assert not np.array_equal(results[0][1], np.full(data.shape, FILL, np.float32))


def test_null_rois_and_extra_gradients(backends):
    """PrRoIPool with the rois' gradient ``null`` (the library is handed no buffer and
    computes none); DeformablePSROIPooling with its offsets' gradient ``null`` (the
    library writes it into a scratch array, MXNet's stays untouched)."""
    library, checked = backends
    op = make_op("PrRoIPool", dict(pooled_size=(2, 3), spatial_scale=0.5))
    data, rois, grad, _ = opcheck.problem(op, np.float32)
    results = []
    for backend in (library, checked):
        x, r = nd(data), nd(rois)
        out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL)
        dgrad, rgrad = mx.nd.full(data.shape, FILL), mx.nd.full(rois.shape, FILL)
        calls = backend._native.calls
        saved = backend.forward(op, "write", x, r, out, keep=True)
        backend.backward(op, "write", nd(grad), x, r, dgrad, saved, "null", rgrad)
        assert backend._native.calls - calls == (2 if backend is library else 0)
        results.append((out.asnumpy(), dgrad.asnumpy(), rgrad.asnumpy()))
    for a, b in zip(*results):
        identical(a, b, "PrRoIPool, rois' gradient null")
    assert (results[0][2] == FILL).all()
    op = make_op("DeformablePSROIPooling", dict(opcheck.CASES[[n for n, _ in
                                                               opcheck.CASES].index(
        "DeformablePSROIPooling")][1]))
    data, rois, grad, extra = opcheck.problem(op, np.float32)
    if not extra:
        pytest.skip("this case has no offsets")
    results = []
    for backend in (library, checked):
        x, r, ex = nd(data), nd(rois), [nd(a) for a in extra]
        out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL)
        dgrad, tgrad = mx.nd.full(data.shape, FILL), mx.nd.full(extra[0].shape, FILL)
        saved = backend.forward(op, "write", x, r, out, keep=True, extra=ex)
        backend.backward(op, "write", nd(grad), x, r, dgrad, saved, extra=ex,
                         extra_grad=(("null", tgrad),))
        results.append((out.asnumpy(), dgrad.asnumpy(), tgrad.asnumpy()))
    for a, b in zip(*results):
        identical(a, b, "deformable, offsets' gradient null")
    assert (results[0][2] == FILL).all()


def test_switched_off_unavailable_or_missing_op_takes_the_checked_path(backends,
                                                                       monkeypatch):
    library, checked = backends
    op = make_op(*CASES[0])
    data, rois, grad = problem(op, np.float32)
    want = step(checked, op, data, rois, grad)

    def through(what):
        calls = library._native.calls
        got = step(library, op, data, rois, grad)
        for a, b in zip(got, want):
            identical(a, b, what)
        return library._native.calls - calls

    assert through("on") == 2
    monkeypatch.setenv(library_calls.ENV, "off")
    assert through("MX_ROI_LIBRARY_CALLS=off") == 0
    monkeypatch.delenv(library_calls.ENV)
    # no library here (no compiler, a failed build): the checked path, asked again later
    fresh = CudaBackend(Kind.NATIVE)

    def no_library():
        raise ext.ExtLibraryError("no compiler (planted)")

    real_path = ext.library_path
    monkeypatch.setattr(ext, "library_path", no_library)
    calls = fresh._native.calls
    got = step(fresh, op, data, rois, grad)
    assert fresh._native.calls == calls
    for a, b in zip(got, want):
        identical(a, b, "no library")
    monkeypatch.setattr(ext, "library_path", real_path)
    step(fresh, op, data, rois, grad)
    assert fresh._native.calls == calls + 2, "the library is asked for again"
    # a library without the op's launcher (an op with no MX_ROI_EXT_LAUNCHER section):
    # no handle, the checked path
    missing = types.SimpleNamespace(name="NoSuchOp", native_name="mx_roi_NoSuchOp",
                                    param=op.param, cuda_source=op.cuda_source,
                                    rois_columns=op.rois_columns, out_shape=op.out_shape)
    assert library._native._handle(library._native.library(), missing) == 0
    assert not library._native.forward(missing, "write", nd(data), nd(rois),
                                       mx.nd.zeros(op.out_shape(data.shape, rois.shape)))


def test_parameters_reach_the_launcher_as_mxnet_spells_them(backends):
    """The handle's parameters are ``str`` of ``to_kwargs``'s values (what MXNet hands the
    native operator): a non-default value of every kind changes the result as on the
    checked path (tuples, floats, bools, strings)."""
    library, checked = backends
    for params in (dict(pooled_size=(3, 2), spatial_scale=0.25, sample_ratio=3,
                        aligned=True, pool_mode="max"),
                   dict(pooled_size=(2, 3), spatial_scale=1 / 3, sample_ratio=-1,
                        legacy="caffe")):
        op = make_op("ROIAlign", params)
        data, rois, grad = problem(op, np.float64)
        same_bits(library, checked, op, data, rois, grad, what=str(params))


def test_concurrent_calls_from_threads(backends):
    """MXNet runs Custom ops on several worker threads: calls of different shapes from
    four threads at once, each the checked path's bits."""
    library, checked = backends
    ops = [make_op(*CASES[i]) for i in (0, 2, 5, 9)]
    problems = [problem(op, np.float32, seed=i, H=9 + i, W=10 + 2 * i)
                for i, op in enumerate(ops)]
    wants = [step(checked, op, *p) for op, p in zip(ops, problems)]
    errors = []

    def worker(i):
        try:
            for _ in range(20):
                for a, b in zip(step(library, ops[i], *problems[i]), wants[i]):
                    identical(a, b, f"thread {i}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_the_launcher_reads_the_thread_count_per_call(backends, monkeypatch):
    """``MX_ROI_NUM_THREADS`` read by the library at each call: 1 and 2 threads give the
    same bits (whole channels per thread), and both run in the library."""
    library, checked = backends
    monkeypatch.setenv("MX_ROI_MIN_ITEMS_PER_THREAD", "1")
    op = make_op(*CASES[6])
    data, rois, grad = problem(op, np.float32)
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("MX_ROI_NUM_THREADS", threads)
        calls = library._native.calls
        results.append(step(library, op, data, rois, grad))
        assert library._native.calls == calls + 2
    for a, b in zip(*results):
        identical(a, b, "1 vs 2 threads")


@pytest.mark.parametrize("value", ["", "1", "1000", "0012", "0", "-5", "abc", " 7", "1e3",
                                   "\u0663", "99999999999999999999999"])
def test_the_launcher_splits_items_as_the_loader_does(monkeypatch, value):
    """The library's threads of a launch over n items (ext_common.h's native_threads) are
    loader.native_threads': at most MX_ROI_NUM_THREADS, none with fewer than
    $MX_ROI_MIN_ITEMS_PER_THREAD items -- a value Python refuses (ValueError naming the
    variable) leaves the library at the default 2^16."""
    fn = ctypes.CDLL(ext.library_path()).mx_roi_ext_native_threads
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_longlong]
    monkeypatch.setenv("MX_ROI_NUM_THREADS", "4")
    monkeypatch.setenv(loader.MIN_ITEMS_ENV, value)
    try:
        want = [loader.native_threads(n, 4) for n in ITEMS]
    except ValueError as exc:
        assert str(exc).startswith(f"{loader.MIN_ITEMS_ENV}={value!r}: expected a whole "
                                   "number >= 1"), exc
        monkeypatch.delenv(loader.MIN_ITEMS_ENV)
        want = [loader.native_threads(n, 4) for n in ITEMS]
        monkeypatch.setenv(loader.MIN_ITEMS_ENV, value)
    assert [fn(n) for n in ITEMS] == want


#: launch sizes around the thread splits of the values above
ITEMS = [0, 1, 999, 1000, 2500, 3999, 4000, 2 ** 16 - 1, 2 ** 16, 3 * 2 ** 16, 10 ** 9]


def test_arrays_of_other_shapes_never_reach_the_library(backends):
    """The launcher reads and writes by the data's and the rois' shapes: an output,
    out-grad or gradient of another shape (MXNet's never are; a direct call's may be) is
    refused before the call, never written past its end."""
    library, checked = backends
    op = make_op("PrRoIPool", dict(pooled_size=(2, 3), spatial_scale=0.5))
    data, rois, grad, _ = opcheck.problem(op, np.float32)
    x, r, g = nd(data), nd(rois), nd(grad)
    out_shape = op.out_shape(data.shape, rois.shape)
    calls = library._native.calls
    L = library._native
    assert L.forward(op, "write", x, r, mx.nd.zeros(out_shape))  # (the right shapes run)
    for shape in ((out_shape[0] - 1,) + out_shape[1:], out_shape[:3] + (out_shape[3] + 1,)):
        assert not L.forward(op, "write", x, r, mx.nd.zeros(shape)), shape
        assert not L.backward(op, "write", nd(np.zeros(shape, np.float32)), x, r,
                              mx.nd.zeros(data.shape)), shape
    small = (data.shape[0], data.shape[1], data.shape[2], data.shape[3] - 1)
    assert not L.backward(op, "write", g, x, r, mx.nd.zeros(small))
    assert not L.backward(op, "write", g, x, r, mx.nd.zeros(data.shape), "write",
                          mx.nd.zeros((rois.shape[0] - 1, rois.shape[1])))
    assert L.backward(op, "write", g, x, r, mx.nd.zeros(data.shape), "write",
                      mx.nd.zeros(rois.shape))
    assert L.calls == calls + 2


def test_other_array_counts_are_refused_by_the_launcher(backends):
    """``mx_roi_ext_invoke`` itself (a C entry any caller may reach) takes exactly the
    arrays MXNet would hand the native operator: other counts, or another direction, are
    refused with a message naming them -- never indexed past -- and the next call works.
    DeformablePSROIPooling: three inputs with offsets, two with ``no_trans``."""
    import ctypes
    import struct
    library, _ = backends
    lib = library._native.library()
    err = ctypes.create_string_buffer(512)

    def packed(arrs):
        return b"".join(struct.pack("P6qii", a.ctypes.data, *a.shape, *([0] * (6 - a.ndim)),
                                    a.ndim, 0) for a in arrs)

    for name, params in [c for c in opcheck.CASES
                         if c[0] in ("DeformablePSROIPooling", "ROIAlign")]:
        op = make_op(name, params)
        handle = library._native._handle(lib, op)
        assert handle
        data, rois, _, extra = opcheck.problem(op, np.float32)
        arrays = [data, rois] + list(extra)
        n = len(arrays)
        out = np.full(op.out_shape(data.shape, rois.shape), np.nan, np.float32)
        for direction, n_in, n_out in ((0, n - 1, 1), (0, n, 0), (0, n, 2), (1, n, n),
                                       (1, n + 1, n - 1), (2, n, 1)):
            arrs = (arrays + [data])[:n_in] + [out] * n_out
            assert lib.mx_roi_ext_invoke(handle, direction, n_in, n_out, packed(arrs),
                                         err, len(err)) == 1
            want = (f"{name}: mx_roi_ext_invoke: direction 2 (0: forward, 1: backward)"
                    if direction == 2 else
                    f"{name}: mx_roi_ext_invoke: the {('forward', 'backward')[direction]} "
                    f"takes {n + direction} inputs and {n if direction else 1} outputs, "
                    f"got {n_in} and {n_out}")
            assert err.value.decode() == want, (name, direction, n_in, n_out)
        assert np.isnan(out).all()  # nothing written
        assert lib.mx_roi_ext_invoke(handle, 0, n, 1, packed(arrays + [out]), err,
                                     len(err)) == 0
        assert not np.isnan(out).any()
