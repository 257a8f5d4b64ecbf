"""The native backend's recorded programs (mx_roi.cuda.native_program): one compiled call
per forward and per backward, replayed with each call's addresses.

The checked path (``native_program = False``: the rois read, checked and turned into
tables on the host, every kernel launched from Python) is the oracle: every call of a
replayed program must give its outputs and gradients bit for bit, over buffers holding
garbage, with new data and new rois of the recorded shapes, and raise its message for a
bad roi.  The counts prove the replay is one call: no kernel launched from Python, one
``mx_roi_run_program`` per forward and per backward.
"""
import threading

import mxnet as mx
import numpy as np
import pytest

from mx_roi.cuda import loader, native_program
from mx_roi.cuda.backend import CudaBackend
from mx_roi.ndio import Kind
from tests.test_native import CASES, identical, make_op, nd, problem

FILL = 7.25
DTYPES = (np.float32, np.float64, np.float16)


def _backends():
    program = CudaBackend(Kind.NATIVE)
    checked = CudaBackend(Kind.NATIVE)
    checked.native_program = False
    return program, checked


class Counts:
    """Kernel launches from Python (``loader._Kernel.__call__``), program runs and
    recordings, counted while installed."""

    def __init__(self, monkeypatch):
        self.launches = self.runs = self.records = 0
        real_call = loader._Kernel.__call__
        real_run = native_program._Program.__call__
        real_init = native_program._Program.__init__

        def call(k, *a):
            self.launches += 1
            return real_call(k, *a)

        def run(p, *a):
            self.runs += 1
            return real_run(p, *a)

        def init(p, *a):
            self.records += 1
            return real_init(p, *a)

        monkeypatch.setattr(loader._Kernel, "__call__", call)
        monkeypatch.setattr(native_program._Program, "__call__", run)
        monkeypatch.setattr(native_program._Program, "__init__", init)

    def reset(self):
        self.launches = self.runs = self.records = 0


def step(backend, op, data, rois, grad, keep=True, bwd_rois=None):
    """Forward into a FILL-ed output (keeping what the backward needs), backward into a
    FILL-ed gradient with ``bwd_rois`` (default: the forward's); returns NumPy arrays."""
    out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL, dtype=data.dtype)
    dgrad = mx.nd.full(data.shape, FILL, dtype=data.dtype)
    x, r = nd(data), nd(rois)
    saved = backend.forward(op, "write", x, r, out, keep=keep)
    r_b = r if bwd_rois is None else nd(bwd_rois)
    backend.backward(op, "write", nd(grad), x, r_b, dgrad, saved)
    return out.asnumpy(), dgrad.asnumpy()


def same_bits(program, checked, op, problems):
    """A training step of each problem on both backends: the same bits; returns the last
    problem."""
    for i, (data, rois, grad) in enumerate(problems):
        out, g = step(program, op, data, rois, grad)
        want_out, want_g = step(checked, op, data, rois, grad)
        identical(out, want_out, f"problem {i}: forward")
        identical(g, want_g, f"problem {i}: backward")
    return problems[-1]


def inside_problem(op, dtype, seed, N=2, H=9, W=10):
    """A detector's call: boxes inside the map (clipped proposals), every 4th padding."""
    rng = np.random.default_rng(seed)
    data, _, _ = problem(op, dtype, seed=seed, N=N, H=H, W=W)
    s = op.param.spatial_scale
    R = 12
    x1, y1 = rng.uniform(0, 0.8 * W / s, R), rng.uniform(0, 0.8 * H / s, R)
    x2 = np.minimum(x1 + rng.uniform(1 / s, 0.6 * W / s, R), (W - 1) / s)
    y2 = np.minimum(y1 + rng.uniform(1 / s, 0.6 * H / s, R), (H - 1) / s)
    rois = np.stack([rng.integers(0, N, R), x1, y1, x2, y2], axis=1)
    rois[::4, 0] = -1
    rois = rois.astype(dtype)
    grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(dtype)
    return data, rois, grad


#: ops whose kernels read the rois themselves: a recorded call checks them with roi_check
LAZY_CASES = [
    ("RROIAlign", dict(pooled_size=(3, 2), spatial_scale=0.5, sampling_ratio=2)),
    ("RROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sampling_ratio=1, aligned=True,
                       clockwise=True)),
    ("PrRoIPool", dict(pooled_size=(2, 3), spatial_scale=0.5)),
]


def lazy_problem(op, dtype, seed, N=2, H=9, W=10):
    """The op's own random rois (its layout; some partly off the map), every 4th padding,
    and boxes 20x the map (adversarial for the sizes, never for the checks)."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((N, 3, H, W)).astype(dtype)
    rois = np.asarray(type(op).random_rois(rng, 12, N, H, W, op.param.spatial_scale))
    rois[::4, 0] = -1
    rois[1, 1:5] *= 20
    rois = rois.astype(dtype)
    grad = rng.standard_normal(op.out_shape(data.shape, rois.shape)).astype(dtype)
    return data, rois, grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", LAZY_CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                         enumerate(LAZY_CASES)])
def test_replay_of_an_op_whose_kernels_read_the_rois(name, params, dtype, monkeypatch):
    """RROIAlign (fixed sampling) and PrRoIPool: the roi check kernel, then the op's
    kernels, in one compiled call per direction; bits as the checked path's."""
    op = make_op(name, params)
    assert op.kernels_read_rois()
    program, checked = _backends()
    counts = Counts(monkeypatch)
    data, rois, grad = same_bits(program, checked, op,
                                 [lazy_problem(op, dtype, seed) for seed in range(3)])
    counts.reset()
    step(program, op, data, rois, grad)
    half = np.dtype(dtype) == np.float16
    assert counts.records == 0 and counts.runs == (1 if half else 2)
    if not half:
        assert counts.launches == 0


def test_an_adaptive_rotated_grid_is_not_recorded():
    """RROIAlign with sampling_ratio <= 0 checks the box sizes on the host too: its calls
    take the checked path (and still refuse a box needing too many samples)."""
    op = make_op("RROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sampling_ratio=0))
    assert not op.kernels_read_rois()
    program, checked = _backends()
    data, rois, grad = lazy_problem(op, np.float32, 0)
    rois[1, 3:5] = 1e6
    for backend in (checked, program):
        with pytest.raises(ValueError, match=r"RROIAlign: rois\[1\] is a box of"):
            backend.forward(op, "write", nd(data), nd(rois),
                            mx.nd.zeros(op.out_shape(data.shape, rois.shape)), keep=True)
    assert program._native.programs() == {}


@pytest.mark.parametrize("boxes", ("inside", "adversarial"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                    enumerate(CASES)])
def test_replay_is_the_checked_path_bit_for_bit(name, params, dtype, boxes, monkeypatch):
    """Three calls of the same shapes (new data, new rois) recorded once and replayed:
    outputs and gradients byte-equal to the checked path's; a replay launches nothing
    from Python.  ``inside``: a detector's boxes (never past the tables sized from the
    shapes); ``adversarial``: degenerate boxes, padding rows and boxes far larger than
    the map, which the status sends back to the checked path."""
    op = make_op(name, params)
    program, checked = _backends()
    counts = Counts(monkeypatch)
    make = inside_problem if boxes == "inside" else problem
    problems = [make(op, dtype, seed=seed) for seed in range(3)]
    if boxes == "inside":
        assert not any(_needs_rerun(op, rois, data.shape) for data, rois, _ in problems)
    data, rois, grad = same_bits(program, checked, op, problems)
    # the last seed's call again: one compiled call per direction, nothing recorded
    counts.reset()
    step(program, op, data, rois, grad)
    half = np.dtype(dtype) == np.float16  # its backward accumulates in float32: checked
    assert counts.records == 0
    if _needs_rerun(op, rois, data.shape):
        # the forward's status sends it to the checked path; its backward goes there
        # directly (a kept argmax of host-built tables)
        assert counts.runs >= 1 and counts.launches > 0
    else:
        assert counts.runs == (1 if half else 2), "one program per forward and per backward"
        if not half:
            assert counts.launches == 0, f"{counts.launches} launches from Python in a replay"


def _needs_rerun(op, rois, shape):
    """Whether some live roi of ``rois`` needs a bin or sample grid wider than the tables
    of the program (the device geometry's shape-derived sizes)."""
    from mx_roi.cuda import device_geometry
    spec = op.geometry_spec()
    geo = op.geometry(rois, shape[2], shape[3], np)
    if spec.mode in ("pool_bins", "ps_pool_bins"):
        cells = device_geometry.bin_cells(spec, shape[2], shape[3])
        h = (geo.hend - geo.hstart).max(axis=1)
        w = (geo.wend - geo.wstart).max(axis=1)
        return bool(((h * w > cells) & (geo.batch >= 0)).any())
    gy, gx = device_geometry.grid_widths(spec, shape[2], shape[3])
    return bool((((geo.y.count > gy).any(axis=1) | (geo.x.count > gx).any(axis=1))
                 & (geo.batch >= 0)).any())


BAD_CASES = CASES[::2] + LAZY_CASES[::2]


@pytest.mark.parametrize("name,params", BAD_CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                        enumerate(BAD_CASES)])
def test_a_bad_roi_in_a_replay_raises_the_checked_message_and_the_next_call_works(
        name, params):
    op = make_op(name, params)
    program, checked = _backends()
    data, rois, grad = (lazy_problem(op, np.float32, 0) if op.kernels_read_rois() else
                        problem(op, np.float32))
    step(program, op, data, rois, grad)  # recorded
    last, cols = rois.shape[0] - 1, op.rois_columns
    # (every value of every row is checked: the first and last row, the last column)
    for bad, row, col in (("nan", 2, 3), ("batch", 2, 0), ("nan", last, cols - 1),
                          ("nan", 0, 1), ("batch", last, 0)):
        broken = rois.copy()
        broken[row, col] = np.nan if bad == "nan" else 5  # 2 images
        for backend in (checked, program):
            with pytest.raises(ValueError) as err:
                backend.forward(op, "write", nd(data), nd(broken),
                                mx.nd.zeros(op.out_shape(data.shape, rois.shape)), keep=True)
            if backend is checked:
                want = str(err.value)
            else:
                assert str(err.value) == want
        # the backward re-checks (MXNet runs it after a rejected forward too)
        with pytest.raises(ValueError) as err:
            program.backward(op, "write", nd(grad), nd(data), nd(broken),
                             mx.nd.zeros(data.shape), None)
        assert str(err.value) == want
        out, g = step(program, op, data, rois, grad)
        want_out, want_g = step(checked, op, data, rois, grad)
        identical(out, want_out, "forward after the error")
        identical(g, want_g, "backward after the error")


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] == "ROIPooling" or
                                         c[1].get("pool_mode") == "max"])
def test_the_argmax_serves_only_the_rois_it_was_found_for(name, params):
    """A backward handed other rois than its forward's (same shapes) must not route the
    gradient through the forward's argmax: it equals a step on those rois."""
    op = make_op(name, params)
    program, checked = _backends()
    data, rois, grad = problem(op, np.float32, seed=0)
    _, rois_b, _ = problem(op, np.float32, seed=1)
    _, g = step(program, op, data, rois, grad, bwd_rois=rois_b)
    _, want = step(checked, op, data, rois_b, grad)
    identical(g, want, "backward on other rois")


def test_inference_forward_and_thread_count_are_part_of_the_key(monkeypatch):
    op = make_op(*CASES[4])  # max ROIAlign: the argmax kept or not
    program, checked = _backends()
    data, rois, grad = problem(op, np.float32)
    counts = Counts(monkeypatch)
    for threads in ("1", "2", "1"):
        monkeypatch.setenv("MX_ROI_NUM_THREADS", threads)
        for keep in (False, True):
            out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL)
            assert program.forward(op, "write", nd(data), nd(rois), out, keep=keep) is None \
                or keep
            want = mx.nd.zeros(out.shape)
            checked.forward(op, "write", nd(data), nd(rois), want, keep=keep)
            identical(out.asnumpy(), want.asnumpy(), f"threads {threads}, keep {keep}")
    assert counts.records == 4, "one program per (keep, thread count)"


def test_programs_serve_one_call_at_a_time_and_are_bounded(monkeypatch):
    """Two threads replaying concurrently (a program's tables and role cells serve one
    call at a time: a busy one is not shared, another is recorded) get the checked path's
    bits; a key keeps no more programs than calls ran at once, and at most MAX_PROGRAMS
    keys are kept."""
    op = make_op(*CASES[2])
    program, checked = _backends()
    problems = [inside_problem(op, np.float32, seed=s) for s in range(4)]
    wants = [step(checked, op, *p) for p in problems]
    errors = []
    counts = Counts(monkeypatch)

    def work(offset):
        try:
            for i in range(40):
                k = (i + offset) % len(problems)
                got = step(program, op, *problems[k])
                identical(got[0], wants[k][0], "forward")
                identical(got[1], wants[k][1], "backward")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(o,)) for o in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert counts.runs == 2 * 2 * 40 and counts.launches == 0
    kept = program._native.programs()
    assert len(kept) == 2 and all(1 <= len(v) <= 2 for v in kept.values()), kept
    assert counts.records == sum(len(v) for v in kept.values())
    monkeypatch.setattr(native_program, "MAX_PROGRAMS", 3)
    for r in range(1, 8):  # seven roi counts: seven shapes (fourteen keys)
        data, rois, grad = problems[0]
        step(program, op, data, rois[:r], grad[:r])
    assert len(program._native.programs()) == 3


def test_an_unrecordable_call_is_remembered_and_takes_the_checked_path(monkeypatch):
    """float16's backward accumulates in a float32 temporary: not recordable; the verdict
    is kept (no second recording attempt), and the checked path gives the bits."""
    op = make_op(*CASES[2])
    program, checked = _backends()
    data, rois, grad = inside_problem(op, np.float16, seed=0)
    tries = []
    real = program._native._recorder
    monkeypatch.setattr(program._native, "_recorder", lambda *a: (tries.append(1), real(*a))[1])
    for _ in range(3):
        got = step(program, op, data, rois, grad)
    identical(got[1], step(checked, op, data, rois, grad)[1], "float16 backward")
    # the forward recorded twice (the second from other values: nothing fixed in it may
    # depend on them), the backward tried once; nothing again on later calls
    assert len(tries) == 3


@pytest.mark.parametrize("name,params", [CASES[0], CASES[5]], ids=["ROIPooling", "max"])
def test_a_large_call_keeps_no_argmax_and_its_backward_rescans(name, params, monkeypatch,
                                                                launches):
    """Past ARGMAX_KEEP_MAX_ELEMENTS the recorded forward keeps no argmax and the recorded
    backward runs the rescan kernel: the same output and gradient bits as with it kept."""
    from mx_roi.cuda import backend as B
    op = make_op(name, params)
    data, rois, grad = inside_problem(op, np.float32, seed=4)
    kept_out, kept_g = step(_backends()[0], op, data, rois, grad)
    assert any("rescan" not in e and "backward" in e for e in launches)
    monkeypatch.setattr(B, "ARGMAX_KEEP_MAX_ELEMENTS", grad.size - 1)
    program = _backends()[0]
    launches.clear()
    for _ in range(2):
        out, g = step(program, op, data, rois, grad)
        identical(out, kept_out, "forward")
        identical(g, kept_g, "rescan backward")
    assert any("rescan" in e for e in launches) and not any(
        "rescan" not in e and "backward" in e for e in launches), launches


# ---- the double recording: a recording that depends on the rois' values ------------------
from mx_roi.operators.prroi_pool import PrRoIPool  # noqa: E402


class _RoisDependent(PrRoIPool):
    """PrRoIPool whose launches depend on the rois' values through the host -- what the
    second recording exists to catch (a program would fix the first call's choice):

    * ``array``: the kernels read a host copy of the rois (an array that is neither a role
      nor the recording's own: fixed in a program while the rois change);
    * ``scalar``: a spatial scale computed from the first roi's x1;
    * ``items``: the forward runs again over a number of items computed from it (the same
      values written twice: no change in the output);
    * ``launches``: that extra launch only when the first roi's x1 is past 4.

    The checked path runs the same code each call, so its bits are the oracle; a program
    recorded from the first call would give other bits for ``array`` and ``scalar``."""

    how = None

    def _x1(self, geo):
        return abs(float(geo.rois[0, 1]))

    def _args(self, geo):
        args = super()._args(geo)
        if self.how == "array":
            args["rois"] = np.array(geo.rois)
        elif self.how == "scalar":
            args["spatial_scale"] = self.param.spatial_scale * (1 + 1 / (8 + self._x1(geo)))
        return args

    def forward_cuda(self, launch, geo, data):
        out, saved = super().forward_cuda(launch, geo, data)
        x1 = self._x1(geo)
        if self.how == "items" or (self.how == "launches" and x1 > 4):
            _, C, H, W = data.shape
            n = 1 + int(x1) % out.size if self.how == "items" else out.size
            launch.forward("prroi_pool_forward", n, data=data, C=C, H=H, W=W, out=out,
                           **self._args(geo))
        return out, saved


def _rois_dependent_problem(op, seed, x1):
    """A PrRoIPool problem whose first roi starts at ``x1`` (the second recording moves
    it to 1.5 * x1 + 3: other scalars, item counts, launches and copied bytes)."""
    data, rois, grad = lazy_problem(op, np.float32, seed)
    rois[0, 1] = x1
    return data, rois, grad


@pytest.mark.parametrize("how", ("array", "scalar", "items", "launches"))
def test_a_recording_that_depends_on_the_rois_values_is_not_recorded(how, monkeypatch):
    """A call whose two recordings (the call's rois, then other rois of the same shape)
    differ in a copied array's bytes, a scalar, a launch's item count or the number of
    launches is unrecordable: the verdict is kept (no new recording) and every call
    gives the checked path's bits -- also a later call with other rois, where a program
    recorded from the first call's values would be wrong."""
    op = _RoisDependent(PrRoIPool.param_cls.from_kwargs(pooled_size=(2, 3),
                                                        spatial_scale=0.5))
    op.how = how
    assert op.kernels_read_rois()
    program, checked = _backends()
    counts = Counts(monkeypatch)
    tries = []
    real = program._native._recorder
    monkeypatch.setattr(program._native, "_recorder", lambda *a: (tries.append(1), real(*a))[1])
    first = _rois_dependent_problem(op, 0, 2.25)
    other = _rois_dependent_problem(op, 1, 1.5)
    for i, p in enumerate((first, other, first)):
        # (inference forwards: the backward, handed nothing, is recorded on its own)
        out, g = step(program, op, *p, keep=False)
        want_out, want_g = step(checked, op, *p, keep=False)
        identical(out, want_out, f"{how}: call {i}: forward")
        identical(g, want_g, f"{how}: call {i}: backward")
        if i == 0:
            tried = len(tries)
    assert len(tries) == tried, "the unrecordable verdict is kept"
    forward = {k: v for k, v in program._native.programs().items() if k[0] == "fwd"}
    assert list(forward.values()) == [None], forward
    backward = [v for k, v in program._native.programs().items() if k[0] == "bwd"]
    if how in ("array", "scalar"):  # the backward reads them too: not recorded either
        assert backward == [None] and counts.records == 0
    else:  # a forward-only dependence: the backward is a program
        assert len(backward) == 1 and len(backward[0]) == 1 and counts.records == 1


# ---- what a recorded forward keeps, and for which backward --------------------------------
MAX_CASES = [CASES[0], CASES[5]]


@pytest.mark.parametrize("name,params", MAX_CASES, ids=["ROIPooling", "max"])
def test_the_argmax_of_a_forward_on_another_map_size_is_not_read(name, params):
    """A ProgramSaved kept by a forward on an HxW map, handed to a backward on another
    map size with the same rois (and other data): the backward must not route the
    gradient through that argmax -- it equals a step on the new map."""
    op = make_op(name, params)
    program, checked = _backends()
    data, rois, grad = inside_problem(op, np.float32, seed=0, H=9, W=10)
    data2 = inside_problem(op, np.float32, seed=1, H=12, W=11)[0]
    out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL)
    saved = program.forward(op, "write", nd(data), nd(rois), out, keep=True)
    assert isinstance(saved, native_program.ProgramSaved) and saved.value is not None
    dgrad = mx.nd.full(data2.shape, FILL)
    program.backward(op, "write", nd(grad), nd(data2), nd(rois), dgrad, saved)
    _, want = step(checked, op, data2, rois, grad)
    identical(dgrad.asnumpy(), want, "backward on another map size")


@pytest.mark.parametrize("change", ("last row", "last value"))
@pytest.mark.parametrize("name,params", MAX_CASES, ids=["ROIPooling", "max"])
def test_the_rois_comparison_covers_every_byte(name, params, change):
    """rois that differ from the forward's only in the last row (or only in its last
    value) are other rois: the backward does not read the forward's argmax."""
    op = make_op(name, params)
    program, checked = _backends()
    data, rois, grad = inside_problem(op, np.float32, seed=2)
    assert rois[-1, 0] >= 0  # a live roi
    rois_b = rois.copy()
    if change == "last row":
        rois_b[-1, 1:] = rois[1, 1:]
    else:
        rois_b[-1, -1] = rois[-1, 2] + 0.55 * (rois[-1, -1] - rois[-1, 2])
    _, want = step(checked, op, data, rois_b, grad)
    assert not np.array_equal(want, step(checked, op, data, rois, grad)[1])  # can fail
    _, g = step(program, op, data, rois, grad, bwd_rois=rois_b)
    identical(g, want, f"backward with the {change} changed")


def test_the_call_after_a_rejected_one_is_replayed(monkeypatch):
    """A bad roi sets the program's status word; the next good call zeroes it again and
    is replayed (one compiled call per direction, nothing launched from Python), not sent
    to the checked path by the stale status."""
    op = make_op(*CASES[2])
    program, checked = _backends()
    data, rois, grad = inside_problem(op, np.float32, seed=0)
    step(program, op, data, rois, grad)  # recorded
    counts = Counts(monkeypatch)
    for _ in range(2):
        broken = rois.copy()
        broken[5, 2] = np.nan
        with pytest.raises(ValueError, match=r"ROIAlign: rois\[5\] has a NaN"):
            program.forward(op, "write", nd(data), nd(broken),
                            mx.nd.zeros(op.out_shape(data.shape, rois.shape)), keep=True)
        counts.reset()
        out, g = step(program, op, data, rois, grad)
        assert (counts.runs, counts.launches, counts.records) == (2, 0, 0)
        want_out, want_g = step(checked, op, data, rois, grad)
        identical(out, want_out, "forward after the rejected call")
        identical(g, want_g, "backward after the rejected call")


def test_a_recently_used_key_survives_eviction(monkeypatch):
    """The keys are dropped least recently used first: with room for two shapes (four
    keys), shapes A, B, A, C keep A and C (no new recording when they run again) and drop
    B (recorded again)."""
    monkeypatch.setattr(native_program, "MAX_PROGRAMS", 4)
    op = make_op(*CASES[2])
    program, _ = _backends()
    data, rois, grad = inside_problem(op, np.float32, seed=0)
    counts = Counts(monkeypatch)

    def run(r):
        counts.reset()
        step(program, op, data, rois[:r], grad[:r])
        return counts.records

    assert [run(r) for r in (3, 5, 3, 7)] == [2, 2, 0, 2]
    assert sorted(k[3][0] for k in program._native.programs()) == [3, 3, 7, 7]
    assert [run(r) for r in (3, 7, 5)] == [0, 0, 2]


@pytest.mark.parametrize("name,params", [CASES[0], CASES[2]], ids=["ROIPooling", "avg"])
def test_req_add_and_null_take_the_checked_path(name, params, monkeypatch):
    """A forward or backward with req add adds to what the output / gradient held (a
    program overwrites: never recorded); null leaves it as it was.  Garbage-filled
    buffers; the checked path's bits; nothing recorded, no program run."""
    op = make_op(name, params)
    program, checked = _backends()
    data, rois, grad = inside_problem(op, np.float32, seed=3)
    counts = Counts(monkeypatch)
    for req in ("add", "null", "add"):
        got, want = [], []
        for backend, into in ((program, got), (checked, want)):
            out = mx.nd.full(op.out_shape(data.shape, rois.shape), FILL)
            dgrad = mx.nd.full(data.shape, FILL)
            saved = backend.forward(op, req, nd(data), nd(rois), out, keep=True)
            backend.backward(op, req, nd(grad), nd(data), nd(rois), dgrad, saved)
            into += [out.asnumpy(), dgrad.asnumpy()]
        identical(got[0], want[0], f"forward req {req}")
        identical(got[1], want[1], f"backward req {req}")
        if req == "null":
            assert (got[0] == FILL).all() and (got[1] == FILL).all()
        else:
            assert not (got[0] == FILL).all()
    assert counts.records == 0 and counts.runs == 0 and program._native.programs() == {}


def test_a_const_array_the_binding_converts_makes_a_call_unrecordable():
    """The recording launch refuses a read-only array that binding would copy (another
    dtype, another layout): a copy would be fixed in the program while its source
    changes.  The same arguments as they are: one launch recorded."""
    from mx_roi.cuda.backend import Launch
    module = loader.get_module("prroi_pool.cu", Kind.NATIVE)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    rois = np.array([[0, 1, 1, 4, 3], [1, 0, 0, 2, 2]], np.float32)
    out = np.empty((2, 3, 2, 2), np.float32)
    args = dict(C=3, H=5, W=6, P=2, Q=2, spatial_scale=1.0, out=out)
    for name, value in (("data", np.asfortranarray(data)), ("rois", rois.astype(np.float64)),
                        ("data", data[:, :, :, ::-1])):
        rec = native_program._recorder_class(Launch)(module, np.float32)
        given = {**args, "data": data, "rois": rois, name: value}
        with pytest.raises(native_program._Unsupported, match=rf"^{name} converted for the "
                                                               r"kernel$"):
            rec.forward("prroi_pool_forward", out.size, **given)
        assert rec.recorded == []
    rec = native_program._recorder_class(Launch)(module, np.float32)
    rec.forward("prroi_pool_forward", out.size, data=data, rois=rois, **args)
    [(expr, n, bound)] = rec.recorded
    assert expr.startswith("prroi_pool_forward") and n == out.size
    assert any(a is data for a in bound) and any(a is rois for a in bound)
