"""The geometry's two implementations are one: the compiled twin (``mx_roi::geo`` in
operators/roi_common.cuh, through mx_roi.cuda.compiled_geometry) fills the very tables of
mx_roi/geometry.py, bit for bit, and checks the rois as ``RoIOp.check_inputs`` does.

Random grids, 1500 per dtype and mode (float16/32/64 x ROIPooling bins, PSROIPooling
bins, the ROIAlign grid -- aligned or not, adaptive or fixed sampling, which the max mode
shares -- the legacy Caffe and R-FCN grids), adversarially drawn: non-square pools,
padding rois (batch -1), no rois, boxes off the map, reversed and zero-size boxes,
coordinates on exact halves, -0.0, boxes so large that a float32 product overflows, and
boxes needing too many sample points (the same ValueError).  Every table is compared
byte for byte with its shape and dtype, in both host builds (native -O3 with its ISA
flags, and the emulation).
"""
import dataclasses

import numpy as np
import pytest

from mx_roi import geometry as G
from mx_roi.cuda import compiled_geometry as CG, loader
from mx_roi.ndio import Kind
from mx_roi.registry import get_op

GRIDS = 1500
DTYPES = (np.float16, np.float32, np.float64)
MODES = tuple(CG.MODES)


def _compiled(kind):
    return loader.get_module("roi_align.cu", kind).compiled_geometry()


def _tables(geo, prefix=""):
    for f in dataclasses.fields(geo):
        v = getattr(geo, f.name)
        if dataclasses.is_dataclass(v):
            yield from _tables(v, prefix + f.name + ".")
        else:
            yield prefix + f.name, np.asarray(v)


def _draw(rng, dtype):
    """One random problem: (rois, pooled, scale, sample_ratio, aligned, sample_num, H, W)."""
    R = int(rng.choice([0, 1, 2, 3, 5, 8]))
    H, W = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    P = int(rng.integers(1, 8))
    Q = P if rng.random() < 0.4 else int(rng.integers(1, 8))
    scale = float(rng.choice([1.0, 0.5, 0.25, 1 / 16, 0.3, 2.0, 1 / 3]))
    span = max(H, W) / scale
    c = rng.uniform(-0.3 * span, 1.3 * span, (R, 4))
    u = rng.random()
    if u < 0.25:
        c = np.floor(c * 2) / 2                  # exact halves and integers
    elif u < 0.3:
        c[:, 2:] = c[:, :2]                      # zero size
    elif u < 0.35:
        c = c[:, [2, 3, 0, 1]]                   # reversed
    elif u < 0.4:
        c *= -0.0 if rng.random() < 0.5 else 1e-30   # -0.0 / tiny
    elif u < 0.45 and dtype != np.float16:
        c *= 1e37                                # products overflow (float32: inf, NaN)
    elif u < 0.5:
        c *= 50                                  # far larger than the map
    elif u < 0.53:
        c *= 3e5                                 # too many sample points (adaptive grid)
    rois = np.empty((R, 5), dtype)
    rois[:, 0] = rng.integers(-1, 3, R)          # -1: padding rois
    rois[:, 1:] = c.astype(dtype)
    if rng.random() < 0.1:  # single -0.0 corners (a tie -0 vs +0 in np.maximum)
        rois[:, 1:][rng.random((R, 4)) < 0.4] = -0.0
    sample_ratio = int(rng.choice([-1, 0, 1, 2, 3, 5]))
    aligned = bool(rng.random() < 0.5)
    sample_num = int(rng.integers(1, 5))
    return rois, (P, Q), scale, sample_ratio, aligned, sample_num, H, W


def _numpy_and_spec(mode, rois, pooled, scale, sample_ratio, aligned, sample_num, H, W):
    if mode == "pool_bins":
        return (lambda: G.roi_pooling_bins(rois, pooled, scale, H, W),
                CG.Spec(mode, pooled, scale))
    if mode == "ps_pool_bins":
        return (lambda: G.psroi_pooling_bins(rois, pooled, scale, H, W),
                CG.Spec(mode, pooled, scale))
    if mode == "align_grid":
        return (lambda: G.roi_align_grid(rois, pooled, scale, sample_ratio, aligned, H, W),
                CG.Spec(mode, pooled, scale, sample_ratio, aligned))
    if mode == "caffe_grid":
        return (lambda: G.caffe_align_grid(rois, pooled, scale, H, W),
                CG.Spec(mode, pooled, scale))
    return (lambda: G.rfcn_align_grid(rois, pooled, scale, sample_num, H, W),
            CG.Spec(mode, pooled, scale, sample_num))


def _outcome(build):
    try:
        return build()
    except ValueError as exc:
        return exc


def _compare(ref, got, what):
    if isinstance(ref, Exception) or isinstance(got, Exception):
        assert type(ref) is type(got) and str(ref) == str(got), what
        return
    assert type(ref) is type(got), what
    ref_tables, got_tables = list(_tables(ref)), list(_tables(got))
    assert [n for n, _ in ref_tables] == [n for n, _ in got_tables], what
    for (name, a), (_, b) in zip(ref_tables, got_tables):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape,
                                                           a.dtype, b.dtype)
        if a.tobytes() != b.tobytes():
            k = next(k for k, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1)))
                     if x.tobytes() != y.tobytes())
            pytest.fail(f"{what}: table {name} differs at flat index {k}: geometry.py "
                        f"{a.reshape(-1)[k]!r}, compiled {b.reshape(-1)[k]!r}")


# the emulation compiles the same functions at -O2: its 1500 grids are slow-marked, its
# tables checked lean end to end (test_host_backends_use_the_compiled_tables_...)
@pytest.mark.parametrize("kind", [Kind.NATIVE,
                                  pytest.param(Kind.EMULATED, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mode", MODES)
def test_tables_bit_equal_on_random_grids(mode, dtype, kind):
    grids = GRIDS
    cg = _compiled(kind)
    rng = np.random.default_rng([MODES.index(mode), DTYPES.index(dtype), 34])
    with np.errstate(all="ignore"):
        for i in range(grids):
            problem = _draw(rng, dtype)
            build, spec = _numpy_and_spec(mode, *problem)
            ref = _outcome(build)
            got = _outcome(lambda: cg.build(spec, problem[0], *problem[-2:]))
            _compare(ref, got, f"grid {i}: {spec}, {np.dtype(dtype).name}, R="
                               f"{problem[0].shape[0]}, H, W = {problem[-2:]}")


def test_the_draws_reach_every_case():
    """The random grids above do reach what they claim: adaptive grids of unequal
    padded counts (per axis and combined), the too-many-samples error, padding rois, no
    rois, overflowing products and the NaN sample points they make (which the bilinear
    rule puts outside: no weight, no tap beyond the map's first cells), empty Caffe bins."""
    rng = np.random.default_rng([2, 1, 34])
    seen = set()
    with np.errstate(all="ignore"):
        for _ in range(GRIDS):
            rois, pooled, scale, sr, aligned, n, H, W = _draw(rng, np.float32)
            seen.add(("R", rois.shape[0] == 0))
            seen.add(("padding", bool((rois[:, 0] < 0).any())))
            seen.add(("square", pooled[0] == pooled[1]))
            seen.add(("nonfinite", not bool(np.isfinite(rois[:, 1:] * np.float32(scale)).all())))
            geo = _outcome(lambda: G.roi_align_grid(rois, pooled, scale, sr, aligned, H, W))
            if isinstance(geo, ValueError):
                seen.add("too many")
            else:
                if sr <= 0 and rois.shape[0]:
                    gy, gx = geo.y.low.shape[2], geo.x.low.shape[2]
                    seen.add(("adaptive, unequal", gy != gx, abs(gy - gx) > 8))
                for axis in (geo.y, geo.x):
                    nan = np.isnan(axis.coord)
                    if nan.any():  # inf * 0 points: outside (no weight, tap 0)
                        seen.add("NaN point")
                        assert not axis.w_low[nan].any() and not axis.w_high[nan].any()
                        assert not axis.low[nan].any() and (axis.high[nan] <= 1).all()
    for case in [("R", True), ("R", False), ("padding", True), ("square", True),
                 ("square", False), ("nonfinite", True), "too many", "NaN point",
                 ("adaptive, unequal", True, True), ("adaptive, unequal", True, False)]:
        assert case in seen, case


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
def test_group_index_bit_equal(kind):
    cg = _compiled(kind)
    for pooled in range(1, 33):
        for group in range(1, 33):
            np.testing.assert_array_equal(cg.group_index(pooled, group),
                                          G.group_index(pooled, group))


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
def test_ps_channel_map_kernel_bit_equal(kind):
    """``ps_channel_map_fill`` (the channel map the CUDA and emulated launches and the
    native GPU path build on the device, from mx_roi::geo::ps_channel) fills exactly
    geometry.ps_channel_map: every pooled and group grid up to 8 x 8 per side pair, then
    random ones up to 64 (float32's group rows: 7 * 3 / 7, 49 * 5 / 49, ...), the map
    pre-filled with garbage."""
    from mx_roi.cuda.backend import Launch
    launch = Launch.on_host("psroi_pooling.cu", kind, np.float32)
    rng = np.random.default_rng(21)
    cases = [(2, (P, Q), (Gh, Gw)) for P in range(1, 9) for Gh in range(1, 9)
             for Q, Gw in ((P, Gh), (9 - P, 9 - Gh))]
    cases += [(int(rng.integers(1, 6)), tuple(int(v) for v in rng.integers(1, 65, 2)),
               tuple(int(v) for v in rng.integers(1, 65, 2))) for _ in range(600)]
    for output_dim, (P, Q), (Gh, Gw) in cases:
        want = G.ps_channel_map(output_dim, (P, Q), (Gh, Gw))
        got = np.full(want.shape, -7, np.int32)
        launch.forward("ps_channel_map_fill", got.size, channel_map=got, P=P, Q=Q, Gh=Gh,
                       Gw=Gw)
        np.testing.assert_array_equal(got, want, f"{output_dim}, {(P, Q)}, {(Gh, Gw)}")


def _message(op, rois, n, compiled=None):
    try:
        op.check_inputs((n, 1, 4, 4), rois.dtype, rois, np, compiled=compiled)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_roi_check_finds_what_check_inputs_finds(dtype):
    """``check_inputs(..., compiled=...)`` (the compiled check, the backends of the host
    builds) raises NumPy's ``check_inputs`` message: the same first bad roi for NaN,
    +-inf, |x| at, just below and just above the guard bound, batch index >= N (and
    N = 0), negative padding indices."""
    from mx_roi.onednn import GUARD_BOUND
    cls = get_op("ROIAlign")
    # (a fixed grid: an adaptive one adds the box-size rule, which no compiled check has)
    op = cls(cls.param_cls.from_kwargs(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2))
    cg = _compiled(Kind.NATIVE)
    rng = np.random.default_rng([DTYPES.index(dtype), 7])
    big = float(np.finfo(dtype).max)
    specials = [np.nan, np.inf, -np.inf, 3.0, -1.0, 2.0, 2.5, -0.5, -0.0, 1e4]
    if big > GUARD_BOUND:
        below = float(np.nextafter(dtype(GUARD_BOUND), dtype(0)))
        above = float(np.nextafter(dtype(GUARD_BOUND), dtype(np.inf)))
        specials += [GUARD_BOUND, -GUARD_BOUND, below, -below, above,
                     float(dtype(GUARD_BOUND))]
    seen = set()
    for _ in range(400):
        R = int(rng.integers(0, 6))
        n = int(rng.integers(0, 4))
        rois = np.zeros((R, 5), dtype)
        rois[:, 0] = rng.integers(-1, 3, R)
        rois[:, 1:] = rng.uniform(-5, 20, (R, 4))
        for _ in range(int(rng.integers(0, 3))):
            if R:
                rois[rng.integers(R), rng.integers(5)] = rng.choice(specials)
        want = _message(op, rois, n)
        assert _message(op, rois, n, compiled=cg) == want, (rois, n)
        seen.add(want.split(" has ")[1][:5] if want else None)
    assert seen == {None, "a NaN", "batch"}


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,params", [
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sample_ratio=2)),
    ("RROIAlign", dict(pooled_size=(2, 2), spatial_scale=1.0, sampling_ratio=2)),
    ("PrRoIPool", dict(pooled_size=(2, 2), spatial_scale=1.0))])
def test_roi_check_kernel_finds_what_check_inputs_finds(name, params, dtype, kind):
    """The ``roi_check`` kernel (the extension library's check of an op whose kernels
    read the rois themselves) records in its status word the roi ``check_inputs`` names:
    the same first bad roi over each roi's ``rois_columns`` values (5, and RROIAlign's 6),
    for NaN, +-inf, |x| around the guard bound, batch index >= N (and N = 0), padding."""
    from mx_roi.cuda.backend import Launch
    from mx_roi.cuda.device_geometry import DeviceGeometry
    from mx_roi.onednn import GUARD_BOUND, bounded_dtype
    cls = get_op(name)
    op = cls(cls.param_cls.from_kwargs(**params))
    K = op.rois_columns
    launch = Launch.on_host(op.cuda_source, kind, dtype)
    rng = np.random.default_rng([DTYPES.index(dtype), K, 11])
    specials = [np.nan, np.inf, -np.inf, 3.0, -1.0, 2.0, 2.5, -0.5, -0.0, 1e4]
    if float(np.finfo(dtype).max) > GUARD_BOUND:
        below = float(np.nextafter(dtype(GUARD_BOUND), dtype(0)))
        specials += [GUARD_BOUND, -GUARD_BOUND, below, -below,
                     float(np.nextafter(dtype(GUARD_BOUND), dtype(np.inf)))]
    seen, last_column = set(), False
    for _ in range(400):
        R, n = int(rng.integers(1, 6)), int(rng.integers(0, 4))
        rois = np.zeros((R, K), dtype)
        rois[:, 0] = rng.integers(-1, 3, R)
        rois[:, 1:] = rng.uniform(-5, 20, (R, K - 1))
        for _ in range(int(rng.integers(0, 3))):
            r, c = int(rng.integers(R)), int(rng.integers(K))
            rois[r, c] = rng.choice(specials)
            last_column |= c == K - 1 and r == R - 1
        status = np.zeros(2, np.uint64)
        launch.forward("roi_check", R, rois=rois, columns=K, N=n, bound=float(GUARD_BOUND),
                       use_bound=int(bounded_dtype(rois.dtype)), status=status)
        err = DeviceGeometry(None, status, rois, n, False).error(op, status, np)
        want = _message(op, rois, n)
        assert (str(err) if err else None) == want, (rois, n, status)
        assert status[1] == 0
        seen.add(want.split(" has ")[1][:5] if want else None)
    assert seen == {None, "a NaN", "batch"} and last_column


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("ratio", [-1, 2])
def test_rroi_safe_rois_kernel(ratio, dtype, kind):
    """``rroi_align_safe_rois`` (the native GPU path's check before RROIAlign's kernels,
    which read the rois themselves) copies every roi that ``check_inputs`` accepts bit for
    bit and turns each bad one into a padding roi (-1, 0, 0, 0, 0, 0): a roi the
    ``roi_check`` kernel finds bad (the same status word 0), or with adaptive sampling a
    box over the samples-per-bin bound (geometry.adaptive_samples_per_bin, in float64
    over |h|, |w|: status word 1 = 2); the rois pass iff ``check_inputs`` passes them."""
    from mx_roi.cuda.backend import Launch
    from mx_roi.onednn import GUARD_BOUND, bounded_dtype
    op = get_op("RROIAlign")(get_op("RROIAlign").param_cls.from_kwargs(
        pooled_size="(2, 3)", spatial_scale="0.5", sampling_ratio=str(ratio)))
    launch = Launch.on_host(op.cuda_source, kind, dtype)
    rng = np.random.default_rng([DTYPES.index(dtype), ratio + 1, 13])
    bound = dict(N=0, bound=float(GUARD_BOUND), use_bound=int(bounded_dtype(dtype)))
    # (width, height): ceil(h * 0.5 / 2) * ceil(w * 0.5 / 3) = 1024 * 1024 = 2^20 exactly
    # (accepted), one cell more (refused), negative sides (|.|), float16's largest, 1e5
    sides = [(6144.0, 4096.0), (6145.0, 4096.0), (6144.0, 4097.0), (-6144.0, -4096.0),
             (65504.0, 3.0), (-65504.0, 65504.0), (1e5, 1.0)]
    seen = set()
    for _ in range(300):
        R, n = int(rng.integers(1, 6)), int(rng.integers(0, 4))
        rois = np.zeros((R, 6), dtype)
        rois[:, 0] = rng.integers(-1, 3, R)
        rois[:, 1:5] = rng.uniform(-5, 20, (R, 4))
        rois[:, 5] = rng.uniform(-180, 180, R)
        for _ in range(int(rng.integers(0, 3))):
            r, c = int(rng.integers(R)), int(rng.integers(1, 6))
            rois[r, c] = rng.choice([np.nan, np.inf, -np.inf, 2.5, -0.0])
        for _ in range(int(rng.integers(0, 3))):
            r = int(rng.integers(R))
            rois[r, 3:5] = sides[int(rng.integers(len(sides)))]
        safe = np.full((R, 6), 7, dtype)
        status = np.zeros(2, np.uint64)
        launch.forward("rroi_align_safe_rois", R, rois=rois, spatial_scale=0.5, ratio=ratio,
                       P=2, Q=3, safe=safe, status=status, **dict(bound, N=n))
        checked = np.zeros(2, np.uint64)
        launch.forward("roi_check", R, rois=rois, columns=6, status=checked,
                       **dict(bound, N=n))
        assert status[0] == checked[0], (rois, n)
        with np.errstate(invalid="ignore"):  # (NaN and inf sides)
            per_bin = G.adaptive_samples_per_bin(
                np.abs(rois[:, [4, 3]].astype(np.float64)), 0.5, (2, 3), dtype)
        any_over = False
        for r in range(R):
            row = np.zeros(2, np.uint64)
            launch.forward("roi_check", 1, rois=rois[r:r + 1].copy(), columns=6, status=row,
                           **dict(bound, N=n))
            over = ratio <= 0 and not row[0] and per_bin[r] > G.MAX_SAMPLES_PER_BIN
            if row[0] or over:
                np.testing.assert_array_equal(safe[r], [-1, 0, 0, 0, 0, 0])
            else:
                np.testing.assert_array_equal(safe[r].view(np.uint8), rois[r].view(np.uint8))
            any_over |= bool(over)
            seen.add("bad" if row[0] else "over" if over else
                     "edge" if per_bin[r] == G.MAX_SAMPLES_PER_BIN else "ok")
        assert status[1] == (2 if any_over else 0), (rois, status)
        assert (_message(op, rois, n) is None) == (not status.any()), (rois, n, status)
    assert seen == ({"ok", "bad", "over", "edge"} if ratio <= 0 else {"ok", "bad", "edge"})


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_roi_adaptive_bound_kernel(dtype, kind):
    """``roi_adaptive_bound`` (the native GPU path's samples-per-bin bound of an adaptive
    ROIAlign / PSROIAlign grid, after the geometry kernel) marks as padding (batch -1 in
    the tables) exactly the rois whose bins ``RoIOp._check_adaptive_grid`` counts over
    2^20 samples -- the edge, 1024 x 1024, accepted; one more column refused; reversed
    boxes (side 0), padding rois and boxes far off the map alike -- and flags status word 1
    = 3 iff there is one; the host check refuses the call iff the kernel flags it, naming
    the first such roi."""
    from mx_roi.cuda.backend import Launch
    cls = get_op("ROIAlign")
    op = cls(cls.param_cls.from_kwargs(pooled_size="(2, 3)", spatial_scale="0.5",
                                       sample_ratio="-1"))
    launch = Launch.on_host(op.cuda_source, kind, dtype)
    rng = np.random.default_rng([DTYPES.index(dtype), 19])
    # (height, width): ceil(h * 0.5 / 2) * ceil(w * 0.5 / 3) = 1024 * 1024 exactly, then
    # 1025 * 1024 (6148: float16 holds it), 1024 * 1025, reversed, float16's largest
    sides = [(4096.0, 6144.0), (4096.0, 6148.0), (4100.0, 6144.0), (-4100.0, -6148.0),
             (65504.0, 4.0), (65504.0, 65504.0), (8.0, 9.0)]
    seen = set()
    for _ in range(300):
        R = int(rng.integers(1, 6))
        rois = np.zeros((R, 5), dtype)
        rois[:, 0] = rng.integers(-1, 2, R)
        rois[:, 1:3] = rng.uniform(-50, 50, (R, 2))
        rois[:, 3:5] = rois[:, 1:3] + rng.uniform(-5, 40, (R, 2))
        for _ in range(int(rng.integers(0, 3))):
            r, (h, w) = int(rng.integers(R)), sides[int(rng.integers(len(sides)))]
            rois[r, 1:5] = (0, 0, w, h)
        batch = np.full(R, 5, np.int32)
        status = np.array([7, 0], np.uint64)
        launch.forward("roi_adaptive_bound", R, rois=rois, spatial_scale=0.5, P=2, Q=3,
                       batch=batch, status=status)
        f = rois[:, 1:5].astype(np.float64)
        per_bin = G.adaptive_samples_per_bin(np.maximum(f[:, 3:1:-1] - f[:, 1::-1], 0.0),
                                             0.5, (2, 3), dtype)
        over = per_bin > G.MAX_SAMPLES_PER_BIN
        np.testing.assert_array_equal(batch, np.where(over, -1, 5), str(rois))
        assert status[0] == 7 and status[1] == (3 if over.any() else 0)
        try:
            op._check_adaptive_grid(rois, np)
            assert not over.any()
        except ValueError as exc:
            assert str(exc).startswith(f"ROIAlign: rois[{int(np.argmax(over))}] is a box of ")
        seen |= {"over" if o else "edge" if b == G.MAX_SAMPLES_PER_BIN else "ok"
                 for o, b in zip(over, per_bin)}
    assert seen == {"ok", "edge", "over"}


def _trans_status_message(op, status):
    """The offsets' message ext_cuda.h's status_error gives for status words 2..4."""
    at, value = int(status[2]) - 1, float(status[4:5].view(np.float64)[0])
    w3 = int(status[3])
    return (f"{op.name}: trans{[at, w3 >> 32, w3 >> 16 & 0xffff, w3 & 0xffff]} is "
            f"{value!r}; offsets must be finite")


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_deformable_trans_check_kernels(dtype, kind):
    """``deformable_trans_check`` then ``deformable_trans_status`` (the native GPU path's
    check of DeformablePSROIPooling's offsets, which the kernels read as given) name in
    status words 2..4 the element and value ``check_extra_inputs`` names: the first bad
    one in C order, for NaN, +-inf, |x| at, just below and just above the guard bound
    (float16: finite is fine), on random (R, 2K, part, part) shapes; nothing for good
    offsets; an earlier call's offset (word 2 set) is kept, words 0 and 1 are never
    touched."""
    from mx_roi.cuda.backend import Launch
    from mx_roi.onednn import GUARD_BOUND, bounded_dtype
    cls = get_op("DeformablePSROIPooling")
    launch = Launch.on_host(cls.cuda_source, kind, dtype)
    rng = np.random.default_rng([DTYPES.index(dtype), 17])
    specials = [np.nan, np.inf, -np.inf, 2.5, -0.0]
    if float(np.finfo(dtype).max) > GUARD_BOUND:
        below = float(np.nextafter(dtype(GUARD_BOUND), dtype(0)))
        specials += [GUARD_BOUND, -GUARD_BOUND, below, -below,
                     float(np.nextafter(dtype(GUARD_BOUND), dtype(np.inf)))]
    else:
        specials += [float(np.finfo(dtype).max), -float(np.finfo(dtype).max)]
    seen, last = set(), False
    for case in range(300):
        part, K, R = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
        op = cls(cls.param_cls.from_kwargs(spatial_scale="0.5", output_dim=str(2 * K),
                                           group_size="1", pooled_size=str(part),
                                           trans_std="0.1"))
        trans = rng.uniform(-3, 3, (R, 2 * K, part, part)).astype(dtype)
        flat = trans.reshape(-1)
        for _ in range(int(rng.integers(0, 3))):
            i = int(rng.integers(flat.size))
            flat[i] = rng.choice(specials)
            last |= i == flat.size - 1
        first = np.zeros(1, np.uint64)
        launch.forward("deformable_trans_check", trans.size, trans=trans,
                       bound=float(GUARD_BOUND), use_bound=int(bounded_dtype(dtype)),
                       first=first)
        earlier = case % 7 == 0  # an earlier call's bad offset, not yet reported
        status = np.array([11, 12, 5 if earlier else 0, 13, 14], np.uint64)
        launch.forward("deformable_trans_status", 1, trans=trans, first=first,
                       channels=2 * K, part=part, status=status)
        try:
            op.check_extra_inputs((1, 2 * K, 4, 4), trans.dtype, np.zeros((R, 5), dtype),
                                  [trans], np)
            want = None
        except ValueError as exc:
            want = str(exc)
        assert list(status[:2]) == [11, 12]
        if earlier:
            assert list(status[2:]) == [5, 13, 14]
        elif want is None:
            assert first[0] == 0 and list(status[2:]) == [0, 13, 14], (trans, status)
        else:
            assert _trans_status_message(op, status) == want, (trans, status)
        seen.add("earlier" if earlier else "bad" if want else "ok")
    assert seen == {"ok", "bad", "earlier"} and last


# ---- end to end: the host backends run on the compiled tables, with today's bits -------

def _garbage(shape, dtype):
    return np.full(shape, 3.25, dtype)  # not 0, not 1: write must overwrite


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_host_backends_use_the_compiled_tables_with_the_same_bits(kind, dtype, monkeypatch):
    """Every op and mode of tests/test_emulation.py's cases, adversarial rois (padding,
    off the map, reversed), output and gradient buffers pre-filled with garbage: the
    forward and backward through the host build never call ``op.geometry`` (NumPy), and
    give bit for bit what they give on the NumPy-built tables."""
    import mxnet as mx
    from mx_roi.cuda.backend import CudaBackend
    from tests.test_emulation import CASES, make_op, problem
    backend = CudaBackend(kind)

    def run(op, data, rois, grad):
        x, r = mx.nd.array(data, dtype=dtype), mx.nd.array(rois, dtype=dtype)
        out = mx.nd.array(_garbage(op.out_shape(data.shape, rois.shape), dtype), dtype=dtype)
        dx = mx.nd.array(_garbage(data.shape, dtype), dtype=dtype)
        saved = backend.forward(op, "write", x, r, out, keep=True)
        backend.backward(op, "write", mx.nd.array(grad, dtype=dtype), x, r, dx, saved)
        return out.asnumpy(), dx.asnumpy()

    for i, (name, params) in enumerate(CASES):
        op = make_op(name, params)
        assert op.geometry_spec() is not None, name
        data, rois, grad = problem(op, dtype, seed=i)
        with monkeypatch.context() as m:  # the NumPy geometry: today's tables
            m.setattr(CudaBackend, "_compiled", lambda self, op: (None, None))
            want = run(make_op(name, params), data, rois, grad)
        with monkeypatch.context() as m:
            def refuse(*args, **kwargs):
                raise AssertionError("the host build called the NumPy geometry")
            m.setattr(type(op), "geometry", refuse)
            got = run(op, data, rois, grad)
        for w, g, what in zip(want, got, ("output", "gradient")):
            assert w.tobytes() == g.tobytes(), f"{name} {params} {what}"
