"""The compiled geometry at its exact boundaries (the random grids of
tests/test_geometry_compiled.py rarely land on one).

* Sample points exactly on the bilinear rules' edges, and one ulp either side: ROIAlign's
  ``y < -1 || y > H`` with its clamp at 0 and its snap at ``H - 1`` (aligned or not, fixed
  or adaptive sampling), the Caffe grid's floor / ceil taps kept inside ``[0, H - 1]``
  and its points ``< hend``, the R-FCN grid's points ``< hend`` in bins clipped to
  ``[0, H - 1]`` (its ``> H - 0.5`` rule), on a map whose height and width differ.  The
  compiled tables equal geometry.py's bit for bit, the device geometry kernel's equal the
  host ones, and the ops' outputs equal the slow scalar references.
* The device geometry's tables (sized from the shapes, mx_roi.cuda.device_geometry): the
  largest roi they hold is not flagged; one more sample point or cell is (padding, and
  status[1], which sends the call to the checked path); a box inside the map never is.
* geometry.MAX_SAMPLES_PER_AXIS: at the limit and one over, with the two axes' padded
  counts built together or one at a time (``|gy - gx|`` 7, 8, 9).
* RROIAlign's samples per bin (geometry.MAX_ROTATED_SAMPLES): at the limit and one over.
"""
import numpy as np
import pytest

from mx_roi import geometry as G
from mx_roi.cuda import compiled_geometry as CG, device_geometry as DG, loader
from mx_roi.cuda.backend import CudaBackend, Launch
from mx_roi.ndio import Kind
from tests import legacy_reference as LR, reference as REF
from tests.test_emulation import close, make_op, nd
from tests.test_geometry_compiled import _compare, _tables

DTYPES = (np.float16, np.float32, np.float64)
KINDS = (Kind.NATIVE, Kind.EMULATED)
H, W = 7, 10  # a map whose sides differ: an x/y mix-up shows
N = 2


def _compiled(kind):
    return loader.get_module("roi_align.cu", kind).compiled_geometry()


def _step(v, dtype, k):
    """``v`` (a ``dtype`` value) moved ``k`` ulps."""
    v = dtype(v)
    toward = dtype(np.inf if k > 0 else -np.inf)
    for _ in range(abs(k)):
        v = np.nextafter(v, toward)
    return v


# ---- sample points on the bilinear rules' edges ------------------------------------------
# (mode, spec parameters, box length L in map cells (scale 1), the targets, the offsets of
# the box's sample points from its first corner v (float64; the search below corrects the
# rounding), the box from v and L: (v1, v2))
def _align_offsets(P, ratio, aligned, L):
    bin_ = L / P
    g = ratio if ratio > 0 else int(np.ceil(L / P))
    shift = -0.5 if aligned else 0.0
    return [shift + p * bin_ + (k + 0.5) * bin_ / g for p in range(P) for k in range(g)]


CONFIGS = [
    # ROIAlign: y < -1 or y > limit outside; <= 0 clamped; >= limit - 1 snapped
    ("align_grid", dict(pooled=1, sample=1, aligned=False), 1.0,
     lambda n: (-1.0, -0.5, 0.0, n - 1.0, n - 0.5, float(n))),
    ("align_grid", dict(pooled=2, sample=2, aligned=False), 2.0,
     lambda n: (-1.0, 0.0, n - 1.0, float(n))),
    ("align_grid", dict(pooled=2, sample=2, aligned=True), 2.0,
     lambda n: (-1.0, 0.0, n - 1.0, float(n))),
    ("align_grid", dict(pooled=2, sample=-1, aligned=False), 3.0,
     lambda n: (-1.0, 0.0, n - 1.0, float(n))),
    ("align_grid", dict(pooled=1, sample=0, aligned=True), 1.0,
     lambda n: (-1.0, 0.0, n - 1.0, float(n))),
    # Caffe: points lo, lo + 1, ... < hend; floor / ceil taps kept inside [0, limit - 1]
    ("caffe_grid", dict(pooled=1), 2.0, lambda n: (0.0, 1.0, n - 2.0, n - 1.0)),
    ("caffe_grid", dict(pooled=2), 3.0, lambda n: (0.0, n - 2.0, n - 1.0)),
    # R-FCN: bins clipped to [0, limit - 1], points < hend, the > limit - 0.5 rule
    # (a bin clipped at 0: its first point at step = bin / (sample + 1))
    ("rfcn_grid", dict(pooled=1, sample=1), 2.0, lambda n: (1.0, n - 1.5, n - 1.0)),
    ("rfcn_grid", dict(pooled=2, sample=2), 9.0, lambda n: (n - 2.0, n - 1.0)),
]


def _offsets(mode, p, L, P):
    """The offsets of the sample points of a box of length L with P bins."""
    if mode == "align_grid":
        return _align_offsets(P, p["sample"], p["aligned"], L)
    if mode == "caffe_grid":  # box v .. v + L - 1: size L; points lo + k, k = 0, 1, ...
        return [q * L / P + k for q in range(P) for k in range(3)]
    # R-FCN: box v*s .. (v2 + 1)*s = v .. v + L; point k of bin q: lo + (k + 1) * step
    S = p["sample"]
    return [q * L / P + (k + 1) * (L / P) / (S + 1) for q in range(P) for k in range(S)]


def _box(mode, v, L, dtype):
    """Corners (v1, v2) in ``dtype`` of a box of length L from v (R-FCN's box ends at
    v2 + 1, Caffe's size is v2 - v1 + 1)."""
    end = {"align_grid": L, "caffe_grid": L - 1, "rfcn_grid": L - 1}[mode]
    return dtype(v), dtype(dtype(v) + dtype(end))


def _spec(mode, p):
    P = p["pooled"]
    if mode == "align_grid":
        return CG.Spec(mode, (P, P + 1), 1.0, p["sample"], p["aligned"])
    if mode == "caffe_grid":
        return CG.Spec(mode, (P, P + 1), 1.0)
    return CG.Spec(mode, (P, P + 1), 1.0, p["sample"])


def _numpy_grid(spec, rois):
    P, Q = spec.pooled_size
    if spec.mode == "align_grid":
        return G.roi_align_grid(rois, (P, Q), 1.0, spec.sample, spec.aligned, H, W)
    if spec.mode == "caffe_grid":
        return G.caffe_align_grid(rois, (P, Q), 1.0, H, W)
    return G.rfcn_align_grid(rois, (P, Q), 1.0, spec.sample, H, W)


def edge_rois(mode, p, L, targets, dtype):
    """Rois whose sample points (y axis, then x axis: the other axis inside the map) land
    on each target, and within a few ulps either side; ``(rois, hits)``: hits[axis][t] =
    (exactly on t, just below, just above) seen in geometry.py's coordinates."""
    spec = _spec(mode, p)
    cdt = G.compute_dtype(dtype)
    rows, hits = [], {}
    inner = _box(mode, 2.0, L, dtype)
    for axis, limit in ((0, H), (1, W)):
        hits[axis] = {}
        for t in targets(limit):
            for o in _offsets(mode, p, L, spec.pooled_size[axis]):
                # ulps of the corner, and steps of the target's ulp (a corner near 0
                # has far finer ulps than the point it moves)
                sp = float(np.spacing(dtype(max(abs(t), abs(t - o), 1.0))))
                starts = [_step(dtype(t - o), dtype, k) for k in range(-4, 5)]
                starts += [dtype(float(dtype(t - o)) + k * sp / 2) for k in range(-4, 5)]
                for v in starts:
                    v1, v2 = _box(mode, v, L, dtype)
                    y, x = ((v1, v2), inner) if axis == 0 else (inner, (v1, v2))
                    rows.append([len(rows) % N, x[0], y[0], x[1], y[1]])
    rois = np.array(rows, dtype)
    geo = _numpy_grid(spec, rois)
    for axis, limit in ((0, H), (1, W)):
        ax = geo.y if axis == 0 else geo.x
        coords = ax.coord.reshape(-1)
        for t in targets(limit):
            t_c = cdt.type(t)
            eps = 8 * float(np.spacing(dtype(max(abs(t), 1.0))))
            hits[axis][t] = (bool((coords == t_c).any()),
                             bool(((coords < t_c) & (coords > t_c - eps)).any()),
                             bool(((coords > t_c) & (coords < t_c + eps)).any()))
    return rois, hits


def _config_id(c):
    return f"{c[0]}-" + "-".join(f"{k}{v}" for k, v in c[1].items())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_points_on_the_edges_bit_equal(config, dtype):
    """Compiled (native, emulation) == geometry.py on points exactly on every edge of the
    bilinear rule and one ulp either side (the search reaches each: checked), and the
    device geometry kernel's tables == the host ones (no roi flagged: small boxes)."""
    mode, p, L, targets = config
    rois, hits = edge_rois(mode, p, L, targets, dtype)
    for axis in hits:
        for i, (t, (on, below, above)) in enumerate(hits[axis].items()):
            # (the legacy grids clip their bins at 0: no point below the first target)
            below = below or (i == 0 and mode != "align_grid")
            assert on and below and above, (axis, t, on, below, above)
    spec = _spec(mode, p)
    ref = _numpy_grid(spec, rois)
    for kind in KINDS:
        got = _compiled(kind).build(spec, rois, H, W)
        _compare(ref, got, f"{spec} {np.dtype(dtype).name} {kind}")
        _device_equals_host(kind, spec, rois, got)


def _device_equals_host(kind, spec, rois, host, flagged=(), shape=(H, W)):
    """The device geometry kernel's tables of ``rois`` (shape-derived widths) against the
    host tables ``host``: a row not in ``flagged`` has the host's values in its first
    columns and zero padding after them; a row in ``flagged`` is padding (batch -1) and
    status[1] is set exactly when ``flagged`` is not empty.  Returns the status."""
    launch = Launch.on_host("roi_align.cu", kind, rois.dtype)
    dev = DG.build(launch, spec, rois, N, *shape)
    status = np.asarray(dev.status)
    assert int(status[0]) == 0, status
    assert int(status[1]) == (1 if len(flagged) else 0), (spec, flagged, status)
    keep = np.ones(rois.shape[0], bool)
    keep[list(flagged)] = False
    assert (dev.geo.batch[~keep] == -1).all()
    np.testing.assert_array_equal(dev.geo.batch[keep], host.batch[keep])
    for name in ("y", "x"):
        d, h = getattr(dev.geo, name), getattr(host, name)
        np.testing.assert_array_equal(d.count[keep], h.count[keep], err_msg=name)
        g = h.low.shape[2]
        for f in ("low", "high", "w_low", "w_high"):
            a, b = getattr(d, f)[keep], getattr(h, f)[keep]
            width = min(g, a.shape[2])
            assert a[..., :width].tobytes() == b[..., :width].tobytes(), (spec, name, f)
            assert not a[..., width:].any(), (spec, name, f, "padding not zero")
            assert not b[..., width:].any(), (spec, name, f, "host columns cut off")
    assert dev.geo.divisor[keep].tobytes() == host.divisor[keep].tobytes(), spec
    return status


# ---- the ops on those points against the slow scalar references ------------------------
def _reference(mode, p, data, rois):
    P = p["pooled"]
    if mode == "align_grid":
        return REF.roi_align_forward(data, rois, (P, P + 1), 1.0, p["sample"], p["aligned"])
    if mode == "caffe_grid":
        return LR.caffe_roi_align_forward(data, rois, (P, P + 1), 1.0)
    return LR.rfcn_psroi_align_forward(data, rois, (P, P + 1), 1, 1.0, p["sample"],
                                       group_size=1)


def _op(mode, p):
    P = p["pooled"]
    if mode == "align_grid":
        return make_op("ROIAlign", dict(pooled_size=(P, P + 1), spatial_scale=1.0,
                                        sample_ratio=p["sample"], aligned=p["aligned"]))
    if mode == "caffe_grid":
        return make_op("ROIAlign", dict(pooled_size=(P, P + 1), spatial_scale=1.0,
                                        legacy="caffe"))
    return make_op("PSROIAlign", dict(pooled_size=(P, P + 1), output_dim=1, group_size=1,
                                      spatial_scale=1.0, legacy="rfcn",
                                      sample_num=p["sample"]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_ops_on_the_edges_match_the_references(config, kind):
    """ROIAlign (fixed / adaptive, aligned), Caffe ROIAlign and R-FCN PSROIAlign forward
    on those rois, through the host builds (native: the extension library's launcher, its
    tables from the device geometry kernel, then the checked path, its tables from the
    compiled geometry; emulation: the device geometry kernel's tables, twice) into
    garbage-filled outputs, against the scalar references."""
    mode, p, L, targets = config
    dtype = np.float32
    rois, _ = edge_rois(mode, p, L, targets, dtype)
    op = _op(mode, p)
    rng = np.random.default_rng(41)
    data = (rng.standard_normal((N, 1, H, W)) + 2).astype(dtype)
    want = _reference(mode, p, data, rois)
    backend = CudaBackend(kind)
    for call in range(2):  # native: the library, then the checked path
        backend.library_calls = call == 0
        out = nd(np.full(op.out_shape(data.shape, rois.shape), -7.25, dtype))
        backend.forward(op, "write", nd(data), nd(rois), out)
        close(out.asnumpy(), want, dtype, what=f"{config[:2]} {kind} call {call}")


# ---- the device geometry's shape-derived tables: the largest roi they hold -------------
def _grid_widths_formula(P, Q, h, w):
    """device_geometry's documented padded counts: ceil((H + 1) / P) + 1 per bin side."""
    return -(-(h + 1) // P) + 1, -(-(w + 1) // Q) + 1


def test_grid_widths_and_bin_cells_are_the_documented_bounds():
    """Adaptive ROIAlign and the Caffe grid: ceil((H + 1) / P) + 1 (any box inside the map,
    a cell to spare); fixed sampling: the count; integer bins: the largest bin of a box
    inside the map, at most H * W (PSROIPooling: no bound, H * W); None over
    MAX_SAMPLES_PER_AXIS (at it: the widths)."""
    for P, Q, h, w in ((2, 3, 10, 13), (1, 1, 1, 1), (7, 7, 50, 68), (3, 2, 4, 30)):
        want = _grid_widths_formula(P, Q, h, w)
        for spec in (CG.Spec("align_grid", (P, Q), 1.0, 0, False),
                     CG.Spec("align_grid", (P, Q), 1.0, -1, True),
                     CG.Spec("caffe_grid", (P, Q), 1.0)):
            assert DG.grid_widths(spec, h, w) == want, (spec, h, w)
            assert DG.may_overflow(spec) and DG.supported(spec, h, w)
        for spec in (CG.Spec("align_grid", (P, Q), 1.0, 3, False),
                     CG.Spec("rfcn_grid", (P, Q), 1.0, 3)):
            assert DG.grid_widths(spec, h, w) == (3, 3), spec
            assert not DG.may_overflow(spec)
        assert DG.grid_widths(CG.Spec("pool_bins", (P, Q), 1.0), h, w) is None
        cells = DG.bin_cells(CG.Spec("pool_bins", (P, Q), 1.0), h, w)
        assert cells == min(h * w, want[0] * want[1]), (P, Q, h, w)
        assert DG.bin_cells(CG.Spec("ps_pool_bins", (P, Q), 1.0), h, w) == h * w
    assert DG.bin_cells(CG.Spec("pool_bins", (2, 3), 1.0), 10, 13) == 42  # 7 x 6 < 130
    assert DG.bin_cells(CG.Spec("pool_bins", (1, 1), 1.0), 10, 13) == 130  # the map
    assert DG.grid_widths(CG.Spec("rfcn_grid", (2, 2), 1.0, 0), 5, 5) is None
    M = G.MAX_SAMPLES_PER_AXIS
    assert DG.grid_widths(CG.Spec("align_grid", (1, 1), 1.0, 0), M - 2, 3) == (M, 5)
    assert DG.grid_widths(CG.Spec("align_grid", (1, 1), 1.0, 0), M - 1, 3) is None
    assert DG.grid_widths(CG.Spec("align_grid", (1, 1), 1.0, 0), 3, M - 1) is None
    assert DG.grid_widths(CG.Spec("align_grid", (4, 2), 1.0, M // 2), 3, 3) is None
    assert DG.grid_widths(CG.Spec("align_grid", (2, 4), 1.0, M // 2), 3, 3) is None
    assert DG.grid_widths(CG.Spec("align_grid", (4, 4), 1.0, M // 4), 3, 3) == (M // 4,) * 2
    assert DG.grid_widths(CG.Spec("align_grid", (4, 4), 1.0, M // 4 + 1), 3, 3) is None


BH, BW = 10, 13  # (2, 3) bins: Gy = 7 (y size up to 14), Gx = 6 (x size up to 18)


def _fit_rois(mode, aligned, dtype):
    """Rows: 0 the largest box the widths hold along y, 1 one ulp more, 2 the largest
    along x, 3 one ulp more, 4 both largest, 5 a box covering the map; a (2, 3) pool on a
    10 x 13 map.  ROIAlign adaptive: ceil(size / pooled) <= G; Caffe: its first bin's
    points 0, 1, ... < size / pooled <= G (size = x2 - x1 + 1)."""
    up = lambda v: _step(v, dtype, 1)  # noqa: E731
    y_end, x_end = (12.0, 16.0) if mode == "align_grid" else (13.0, 17.0)
    y0 = -2.0 if mode == "align_grid" else 0.0
    x0 = -2.0 if mode == "align_grid" else 0.0
    rows = [[0, 1, y0, 3, y_end], [1, 1, y0, 3, up(y_end)],
            [0, x0, 1, x_end, 3], [1, x0, 1, up(x_end), 3],
            [0, x0, y0, x_end, y_end], [1, 0, 0, BW, BH]]
    return np.array(rows, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("mode,aligned", [("align_grid", False), ("align_grid", True),
                                          ("caffe_grid", False)])
def test_largest_roi_the_device_tables_hold_is_not_flagged_one_ulp_more_is(mode, aligned,
                                                                          dtype, kind):
    """A roi needing exactly Gy (Gx) points per bin side fills the device tables (its rows
    the host's, not padding, status[1] clear); one ulp longer needs one more: padding
    (batch -1) and status[1] set (the call then reruns on host tables).  Each alone, so
    the status of one is not the other's."""
    spec = CG.Spec(mode, (2, 3), 1.0, 0, aligned)
    assert DG.grid_widths(spec, BH, BW) == (7, 6)
    rois = _fit_rois(mode, aligned, dtype)
    host = _compiled(kind).build(spec, rois, BH, BW)
    ref = _numpy_grid_on(spec, rois, BH, BW)
    _compare(ref, host, f"{spec} {np.dtype(dtype).name}")
    # (the boxes need what the rows say)
    assert host.y.count[[0, 4], 0].tolist() == [7, 7] and host.y.count[1, 0] == 8
    assert host.x.count[[2, 4], 0].tolist() == [6, 6] and host.x.count[3, 0] == 7
    for rows, flagged in (([0, 2, 4, 5], ()), ([1], (0,)), ([3], (0,)),
                          ([0, 1, 2, 3, 4, 5], (1, 3))):
        sub = np.ascontiguousarray(rois[rows])
        _device_equals_host(kind, spec, sub, _compiled(kind).build(spec, sub, BH, BW),
                            flagged, (BH, BW))


def _numpy_grid_on(spec, rois, h, w):
    P, Q = spec.pooled_size
    if spec.mode == "align_grid":
        return G.roi_align_grid(rois, (P, Q), 1.0, spec.sample, spec.aligned, h, w)
    return G.caffe_align_grid(rois, (P, Q), 1.0, h, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_largest_bin_the_argmax_type_holds_is_not_flagged_one_cell_more_is(dtype, kind):
    """ROIPooling on the device: a roi whose largest bin has exactly ``cells`` cells
    (h x w = 7 x 6 = 42 on a 10 x 13 map, (2, 3) bins: bin_cells) is kept; the next larger
    bin (8 x 6) is padding and sets status[1]; and the kernel's own test, with ``cells``
    set one below and at a bin's size; PSROIPooling (no argmax) flags no box."""
    spec = CG.Spec("pool_bins", (2, 3), 1.0)
    assert DG.bin_cells(spec, BH, BW) == 42
    # y 0..13: bins [0, 7), [7, 10); x 0..17: [0, 6), [6, 12), [12, 13); y 0..14: [0, 8)
    rois = np.array([[0, 0, 0, 17, 13], [1, 0, 0, 17, 14], [0, 0, 0, 13, 6],
                     [1, 0, 0, BW, BH]], dtype)
    launch = Launch.on_host("roi_align.cu", kind, dtype)
    host = _compiled(kind).build(spec, rois, BH, BW)
    cells = ((host.hend - host.hstart).max(1) * (host.wend - host.wstart).max(1)).tolist()
    assert cells == [42, 48, 24, 36], cells
    for rows, flagged in (([0, 2, 3], ()), ([1], (0,)), ([0, 1, 2, 3], (1,))):
        sub = np.ascontiguousarray(rois[rows])
        dev = DG.build(launch, spec, sub, N, BH, BW)
        _bins_verdict(dev, sub, host, rows, flagged)
    for limit, flagged in ((42, (1,)), (41, (0, 1)), (48, ())):  # the kernel's comparison
        dev = _bins_kernel(launch, spec, rois[:2], limit)
        _bins_verdict(dev, rois[:2], host, [0, 1], flagged)
    ps = CG.Spec("ps_pool_bins", (2, 3), 1.0)
    huge = np.array([[0, -500, -400, 900, 700], [1, 0, 0, BW, BH]], dtype)
    dev = DG.build(launch, ps, huge, N, BH, BW)
    _bins_verdict(dev, huge, _compiled(kind).build(ps, huge, BH, BW), [0, 1], ())


def _bins_kernel(launch, spec, rois, cells):
    """roi_bins_geometry with its ``cells`` bound given (as device_geometry.build calls it)."""
    R, (P, Q) = rois.shape[0], spec.pooled_size
    t = [np.full(s, -99, np.int32) for s in ((R,), (R, P), (R, P), (R, Q), (R, Q))]
    status = np.zeros(2, np.uint64)
    launch.forward("roi_bins_geometry", R, rois=rois, mode=CG.MODES[spec.mode], P=P, Q=Q,
                   H=BH, W=BW, spatial_scale=1.0, N=N, bound=1e30, use_bound=0,
                   status=status, cells=cells, batch=t[0], hstart=t[1], hend=t[2],
                   wstart=t[3], wend=t[4])
    return DG.DeviceGeometry(G.IntBins(*t), status, rois, N, True)


def _bins_verdict(dev, rois, host, rows, flagged):
    status = np.asarray(dev.status)
    assert int(status[0]) == 0 and int(status[1]) == (1 if flagged else 0), (flagged, status)
    want = host.batch[rows].copy()
    want[list(flagged)] = -1
    np.testing.assert_array_equal(dev.geo.batch, want)
    for f in ("hstart", "hend", "wstart", "wend"):
        np.testing.assert_array_equal(getattr(dev.geo, f), getattr(host, f)[rows], err_msg=f)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["pool_bins", "ps_pool_bins", "align_adaptive",
                                  "align_adaptive_aligned", "align_fixed", "caffe_grid",
                                  "rfcn_grid"])
def test_a_box_inside_the_map_never_sets_the_overflow_status(mode, kind):
    """Boxes with corners anywhere in [0, H] x [0, W] (map cells; corners exactly on 0, H,
    W and one ulp inside), every pool 1..7 x 1..7, maps 1..24, scales: no roi is padding,
    status[1] stays clear, the tables are the host ones -- and with the spare cell, no
    such box needs the widths' last column (Gy - 1, Gx - 1 suffice)."""
    rng = np.random.default_rng([CG.MODES.get(mode, 5), 41])
    seen_max = 0
    for i in range(150):
        h, w = int(rng.integers(1, 25)), int(rng.integers(1, 25))
        P, Q = int(rng.integers(1, 8)), int(rng.integers(1, 8))
        scale = float(rng.choice([1.0, 0.5, 0.25, 1 / 16]))
        dtype = DTYPES[i % 3]
        spec = _inside_spec(mode, (P, Q), scale)
        R = 12
        ys = rng.uniform(0, h, (R, 2))
        xs = rng.uniform(0, w, (R, 2))
        ys[:4] = [[0, h], [h, 0], [0, 0], [h, h]]
        xs[:4] = [[0, w], [w, w], [0, 0], [0, w]]
        ys[4:6] = np.floor(ys[4:6])
        xs[4:6] = np.ceil(xs[4:6])
        rois = np.empty((R, 5), dtype)
        rois[:, 0] = rng.integers(0, N, R)
        rois[:, [2, 4]] = (ys / np.float32(scale)).astype(dtype)
        rois[:, [1, 3]] = (xs / np.float32(scale)).astype(dtype)
        # (the corners as the geometry reads them: inside [0, h] x [0, w] after the scale)
        cdt = G.compute_dtype(dtype)
        s = cdt.type(np.float32(scale))
        y_map = rois[:, [2, 4]].astype(cdt) * s
        x_map = rois[:, [1, 3]].astype(cdt) * s
        rois[(y_map > h).any(1) | (x_map > w).any(1), 1:] = 0
        rois[6:8, 1:] = rois[6:8, [3, 4, 1, 2]]  # reversed (aligned: no samples)
        rois[8, 3:] = rois[8, 1:3]  # zero size
        host = _compiled(kind).build(spec, rois, h, w)
        _compare(_numpy_of(spec, rois, h, w), host, f"{spec} {h}x{w}")
        launch = Launch.on_host("roi_align.cu", kind, dtype)
        dev = DG.build(launch, spec, rois, N, h, w)
        status = np.asarray(dev.status)
        assert status.tolist() == [0, 0], (spec, h, w, np.dtype(dtype).name)
        np.testing.assert_array_equal(dev.geo.batch, rois[:, 0].astype(np.int32))
        if spec.mode in CG.INT_BINS_MODES:
            seen_max = max(seen_max, int(((host.hend - host.hstart).max(1)
                                          * (host.wend - host.wstart).max(1)).max()))
            continue
        gy, gx = DG.grid_widths(spec, h, w)
        if DG.may_overflow(spec):
            assert host.y.count.max() <= gy - 1 and host.x.count.max() <= gx - 1, (spec, h, w)
        seen_max = max(seen_max, int(host.y.count.max()), int(host.x.count.max()))
    assert seen_max > (8 if mode not in ("align_fixed", "rfcn_grid") else 1)  # (large boxes)


def _numpy_of(spec, rois, h, w):
    """geometry.py's tables of ``spec`` (any mode) on an h x w map."""
    P, Q = spec.pooled_size
    s = spec.spatial_scale
    if spec.mode == "pool_bins":
        return G.roi_pooling_bins(rois, (P, Q), s, h, w)
    if spec.mode == "ps_pool_bins":
        return G.psroi_pooling_bins(rois, (P, Q), s, h, w)
    if spec.mode == "align_grid":
        return G.roi_align_grid(rois, (P, Q), s, spec.sample, spec.aligned, h, w)
    if spec.mode == "caffe_grid":
        return G.caffe_align_grid(rois, (P, Q), s, h, w)
    return G.rfcn_align_grid(rois, (P, Q), s, spec.sample, h, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_empty_grids_have_one_padded_column(dtype, kind):
    """No rois, or only boxes with no sample point (reversed or zero-size, aligned;
    Caffe bins clipped away): every sample grid is one padded column wide (geometry.py's
    floor of 1), its counts 0; the same bits compiled."""
    cg = _compiled(kind)
    reversed_ = np.array([[0, 4, 4, 1, 1], [1, 3, 2, 3, 2]], dtype)
    off_map = np.array([[0, -40, -30, -20, -10], [1, 50, 60, 70, 80]], dtype)
    for spec, rois in ((CG.Spec("align_grid", (2, 3), 1.0, 0, True), reversed_),
                       (CG.Spec("align_grid", (2, 3), 1.0, 0, True), reversed_[:0]),
                       (CG.Spec("align_grid", (2, 3), 1.0, 2, False), reversed_[:0]),
                       (CG.Spec("caffe_grid", (2, 3), 1.0), off_map),
                       (CG.Spec("caffe_grid", (2, 3), 1.0), off_map[:0])):
        ref = _numpy_of(spec, rois, H, W)
        assert ref.y.low.shape[2] == ref.x.low.shape[2] == 1, spec
        if spec.sample <= 0:
            assert not ref.y.count.any() and not ref.x.count.any()
        _compare(ref, cg.build(spec, rois, H, W), f"{spec} R={rois.shape[0]}")


def _inside_spec(mode, pooled, scale):
    if mode in ("pool_bins", "ps_pool_bins", "caffe_grid"):
        return CG.Spec(mode, pooled, scale)
    if mode == "rfcn_grid":
        return CG.Spec(mode, pooled, scale, 2)
    return CG.Spec("align_grid", pooled, scale, 2 if mode == "align_fixed" else 0,
                   mode == "align_adaptive_aligned")


# ---- MAX_SAMPLES_PER_AXIS: at the limit, one over, the axes built together or not -------
def _too_many(n):
    return (f"rois: a box needs {n} sample points along one axis (more than "
            f"{G.MAX_SAMPLES_PER_AXIS}); check the coordinates and spatial_scale")


def _align_outcome(build):
    try:
        build()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pooled", [(1, 1), (2, 2), (1, 2), (2, 1)], ids=str)
def test_too_many_samples_named_as_geometry_py_names_it(pooled, kind):
    """Adaptive ROIAlign, both axes over MAX_SAMPLES_PER_AXIS: geometry.py builds the two
    axes together (the larger count reported) when P == Q and the padded counts differ by
    at most 8, else y first; the compiled build reports the same count at |gy - gx| = 0,
    7, 8, 9 (either axis the larger) and at exactly the limit along y (gy * P = M: no
    error) against one more."""
    M = G.MAX_SAMPLES_PER_AXIS
    P, Q = pooled
    cg = _compiled(kind)
    base = M // P + 1  # gy * P > M
    seen = set()
    for d in (0, 7, 8, 9, -7, -8, -9):
        gy, gx = (base, base + d) if d >= 0 else (base - d, base)
        # float32 rois: integers exact (< 2^24); adaptive count = ceil(size / pooled)
        rois = np.array([[0, 0, 0, gx * Q, gy * P]], np.float32)
        spec = CG.Spec("align_grid", pooled, 1.0, 0, False)
        want = _align_outcome(lambda: G.roi_align_grid(rois, pooled, 1.0, 0, False, 5, 5))
        got = _align_outcome(lambda: cg.build(spec, rois, 5, 5))
        assert got == want, (pooled, gy, gx)
        together = P == Q and abs(gy - gx) <= 8
        assert want == _too_many(max(gy, gx) * P if together else gy * P), (pooled, d)
        assert CG.align_samples_problem(gy, gx, P, Q) == (max(gy, gx) * P if together
                                                          else gy * P)
        seen.add(together)
    assert seen == ({True, False} if P == Q else {False})
    # only x over: reported whichever way the axes are built
    bx = M // Q + 1
    assert CG.align_samples_problem(1, bx, P, Q) == bx * Q
    assert CG.align_samples_problem(1, bx - 1, P, Q) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_samples_exactly_at_the_limit_build_one_more_is_refused(kind):
    """gy * P == MAX_SAMPLES_PER_AXIS builds (compiled == geometry.py, bit for bit);
    gy * P == MAX + 1 is refused with geometry.py's message; along x alike."""
    M = G.MAX_SAMPLES_PER_AXIS
    cg = _compiled(kind)
    spec = CG.Spec("align_grid", (1, 1), 1.0, 0, False)
    assert CG.align_samples_problem(M, 1, 1, 1) == 0
    assert CG.align_samples_problem(M, M - 8, 1, 1) == 0
    assert CG.align_samples_problem(M + 1, M - 7, 1, 1) == M + 1
    assert CG.align_samples_problem(1, M + 1, 1, 1) == M + 1
    rois = np.array([[0, 0, 0, 2, M]], np.float32)
    ref = G.roi_align_grid(rois, (1, 1), 1.0, 0, False, 5, 5)
    assert ref.y.low.shape == (1, 1, M)
    _compare(ref, cg.build(spec, rois, 5, 5), "at the limit")
    del ref
    for over in (np.array([[0, 0, 0, 2, M + 1]], np.float32),
                 np.array([[0, 0, 0, M + 1, 2]], np.float32)):
        want = _align_outcome(lambda: G.roi_align_grid(over, (1, 1), 1.0, 0, False, 5, 5))
        assert want == _too_many(M + 1)
        assert _align_outcome(lambda: cg.build(spec, over, 5, 5)) == want


@pytest.mark.parametrize("kind", KINDS)
def test_caffe_bin_of_exactly_the_limit_builds_one_more_is_refused(kind):
    """The Caffe grid counts a bin's points up to MAX_SAMPLES_PER_AXIS + 1 (the compiled
    cap): a bin of exactly M points (a map M cells high, the box covering it) builds
    with count M; M + 1 points is refused with geometry.py's message.  (geometry.py's
    point-by-point loop would take minutes here; its rule: _check_samples per point.)"""
    M = G.MAX_SAMPLES_PER_AXIS
    cg = _compiled(kind)
    spec = CG.Spec("caffe_grid", (1, 1), 1.0)
    rois = np.array([[0, 0, 0, 1, M - 1]], np.float32)  # points 0, 1, ..., M - 1 < M
    got = cg.build(spec, rois, M + 5, 3)
    assert got.y.count.tolist() == [[M]] and got.y.low.shape == (1, 1, M)
    assert got.y.coord[0, 0, -1] == M - 1
    over = np.array([[0, 0, 0, 1, M]], np.float32)
    assert _align_outcome(lambda: cg.build(spec, over, M + 5, 3)) == _too_many(M + 1)
    # (geometry.py's own rule, at a small map: the count is the points < hend)
    small = np.array([[0, 0, 0, 1, 6]], np.float32)
    _compare(G.caffe_align_grid(small, (1, 1), 1.0, 9, 3), cg.build(spec, small, 9, 3), "")


# ---- RROIAlign: samples per bin at the limit and one over -------------------------------
def _rroi(**params):
    return make_op("RROIAlign", dict(dict(pooled_size=(1, 1), spatial_scale=1.0,
                                          sampling_ratio=-1), **params))


def test_rroi_sampling_ratio_at_the_limit_accepted_one_over_refused():
    cls = make_op("RROIAlign", dict(pooled_size=(1, 1), spatial_scale=1.0)).param_cls
    side = int(G.MAX_ROTATED_SAMPLES ** 0.5)
    assert side * side == G.MAX_ROTATED_SAMPLES
    assert cls.from_kwargs(pooled_size=(1, 1), spatial_scale=1.0,
                           sampling_ratio=side).sampling_ratio == side
    with pytest.raises(ValueError, match=rf"RROIAlign: .*'sampling_ratio': expected at most "
                                         rf"{side} \(samples per bin side\), got {side + 1}"):
        cls.from_kwargs(pooled_size=(1, 1), spatial_scale=1.0, sampling_ratio=side + 1)


def test_rroi_adaptive_samples_per_bin_at_the_limit_accepted_one_over_refused():
    """check_inputs: ceil(h * s / P) * ceil(w * s / Q) == MAX_ROTATED_SAMPLES (16 x 65536,
    a width one ulp under 65536 rounds up to it) passes; MAX + 1 (17 x 61681), one ulp
    wider than 65536 and sides whose product is under MAX but whose ceilings' is not are
    refused, naming the roi; a (2, 4) pool scales the sides."""
    M = G.MAX_ROTATED_SAMPLES
    assert 16 * 65536 == M and 17 * 61681 == M + 1
    ok = [[0, 5, 5, 65536, 16, 30], [0, 5, 5, np.float32(65535.5), 16, 0],
          [0, 5, 5, 16, 65536, -90], [0, 5, 5, 1, M, 0]]
    wider = np.nextafter(np.float32(65536), np.float32(np.inf))
    # (15 x 69905.05: the product is under M, the sides' ceilings are not)
    bad = [[0, 5, 5, 61681, 17, 0], [0, 5, 5, wider, 16, 0], [0, 5, 5, 1, M + 1, 0],
           [0, 5, 5, 69905.05, 15, 0], [0, 5, 5, 15, 69905.05, 0]]
    op = _rroi()
    rois = np.array(ok, np.float32)
    op.check_inputs((1, 1, 4, 4), np.float32, rois, np)
    for row in bad:
        rois = np.array(ok + [row], np.float32)
        with pytest.raises(ValueError, match=rf"RROIAlign: rois\[4\] is a box of .*: "
                                             rf".* samples per bin with sampling_ratio <= 0, "
                                             rf"more than {M}"):
            op.check_inputs((1, 1, 4, 4), np.float32, rois, np)
    op2 = _rroi(pooled_size=(2, 4), spatial_scale=0.5)  # ceil(64*.5/2) * ceil(524288*.5/4)
    op2.check_inputs((1, 1, 4, 4), np.float32, np.array([[0, 1, 1, 524288, 64, 0]],
                                                        np.float32), np)
    with pytest.raises(ValueError, match=r"RROIAlign: rois\[0\]"):
        op2.check_inputs((1, 1, 4, 4), np.float32, np.array([[0, 1, 1, 524289, 64, 0]],
                                                            np.float32), np)


# ---- ROIAlign / PSROIAlign: an adaptive grid's samples per bin at the limit and one over --
@pytest.mark.parametrize("name, params", [
    ("ROIAlign", dict(pooled_size=(1, 3), spatial_scale=1.0)),
    ("ROIAlign", dict(pooled_size=(1, 3), spatial_scale=1.0, aligned=True, sample_ratio=0)),
    ("PSROIAlign", dict(pooled_size=(1, 3), output_dim=1, spatial_scale=1.0))])
def test_adaptive_align_samples_per_bin_at_the_limit_accepted_one_over_refused(name, params):
    """check_inputs (every backend's Custom door) and the native operator alike:
    ceil(h * s / P) * ceil(w * s / Q) == MAX_SAMPLES_PER_BIN (h 1024, w 3072 over a (1, 3)
    pool) passes, as do a reversed box and the transposed box under a fixed ratio; one
    cell wider (1025 x 1024 per bin) and the transposed box (3072 x 342) are refused,
    naming the roi.  Planted: ``>=`` for ``>``, P and Q swapped, the sides not clipped at
    0 (a reversed box's two negative ceilings multiply to a huge count)."""
    M = G.MAX_SAMPLES_PER_BIN
    assert 1024 * 1024 == M and 1025 * 1024 > M and 3072 * 342 > M
    op = make_op(name, params)
    shape = (1, 3, 4, 4)
    ok = [[0, 5, 5, 5 + 3072, 5 + 1024], [0, 5e6, 5e6, 0, 0]]
    op.check_inputs(shape, np.float32, np.array(ok, np.float32), np)
    fixed = make_op(name, dict(params, sample_ratio=2))
    fixed.check_inputs(shape, np.float32, np.array(ok + [[0, 5, 5, 5 + 1024, 5 + 3072]],
                                                   np.float32), np)
    messages = []
    for row, sides in (([0, 5, 5, 5 + 3073, 5 + 1024], "3073 x 1024: 1.05e+06"),
                       ([0, 5, 5, 5 + 1024, 5 + 3072], "1024 x 3072: 1.05e+06")):
        want = (f"{name}: rois[2] is a box of {sides} samples per bin with sample_ratio <= 0, "
                f"more than {M}; check the box size and spatial_scale, or set sample_ratio")
        with pytest.raises(ValueError) as e:
            op.check_inputs(shape, np.float32, np.array(ok + [row], np.float32), np)
        assert str(e.value) == want
        messages.append((row, want))
    from mx_roi import ext
    if ext.unavailable_reason():
        return
    import mxnet as mx
    ext.load()
    native = getattr(mx.nd, "mx_roi_" + name)
    data = mx.nd.ones(shape)
    kw = {k: v for k, v in params.items()}
    assert native(data, mx.nd.array(ok), **kw).shape[0] == 2  # (runs: 2^20 samples a bin)
    for row, want in messages:
        with pytest.raises(mx.MXNetError) as e:
            native(data, mx.nd.array(ok + [row]), **kw).asnumpy()
        assert "\t[0] " + want + "\n" in str(e.value) + "\n", str(e.value)[-600:]


@pytest.mark.parametrize("kind", ["native", "emulated-cuda"])
def test_rroi_grid_at_the_sample_limit_bit_equal(kind):
    """The kernels' sample count per side (rotated_grid_side, clamped to
    MAX_ROTATED_SAMPLES) equals geometry.rotated_boxes' at the limit and past it."""
    from mx_roi.operators.rroi_align import compiled_grid
    M = G.MAX_ROTATED_SAMPLES
    for h in (M - 1, M, M + 1, 4 * M):
        op = _rroi()
        rois = np.array([[0, 2, 2, 0.5, h, 0]], np.float32)
        want = G.rotated_grid(rois, (1, 1), 1.0, -1, False, False, 4, 4)
        got = compiled_grid(op, rois, 4, 4, kind)
        assert int(want.count[0]) == min(h, M)
        for name in G.RotatedGrid.__dataclass_fields__:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), (h, name)


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
def test_rroi_grid_of_overflowing_boxes_bit_equal(kind):
    """A spatial_scale that is inf in float32 (1e300), or a finite one that overflows the
    rotated coordinates (3e38 sides at 30 degrees): the points are inf or NaN, the
    kernels' rotated_sample and geometry.rotated_grid both count NaN as outside, bit for
    bit (planted: NaN let through as a tap in one of them)."""
    from mx_roi.operators.rroi_align import compiled_grid
    rois = np.array([[0, 4, 4, 3, 2, 0], [0, 4, 4, 3e38, 3e38, 30], [1, 0, 0, 5, 6, -45]],
                    np.float32)
    for scale, ratio in ((1e300, 2), (1.0, 2), (1e300, 1)):  # (adaptive: refused, too many)
        op = _rroi(spatial_scale=scale, sampling_ratio=ratio)
        with np.errstate(all="ignore"):
            want = G.rotated_grid(rois, (1, 1), scale, ratio, False, False, 4, 4)
            got = compiled_grid(op, rois, 4, 4, kind)
        assert np.isnan(want.x).any() or np.isnan(want.y).any(), scale
        for name in G.RotatedGrid.__dataclass_fields__:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), (scale, name)
        nan = np.isnan(want.x) | np.isnan(want.y)
        for name in ("w1", "w2", "w3", "w4", "y_low", "y_high", "x_low", "x_high"):
            assert not getattr(want, name)[nan].any(), name  # outside: no weight, tap 0


@pytest.mark.parametrize("kind", [Kind.NATIVE, Kind.EMULATED])
def test_rroi_forward_at_the_sample_limit_runs_one_over_raises_next_works(kind):
    """A box needing exactly MAX_ROTATED_SAMPLES samples in its bin (16 x 65536 inside a
    16 x 65536 map of ones): the average is exactly 1; one more (17 rows) raises the
    op's message; the next call works."""
    op = _rroi()
    backend = CudaBackend(kind)
    data = np.ones((1, 1, 17, 65536), np.float32)
    good = np.array([[0, 32768, 8, 65536, 16, 0]], np.float32)
    bad = np.array([[0, 32768, 8.5, 65536, 17, 0]], np.float32)
    for rois, fails in ((good, False), (bad, True), (good, False)):
        out = nd(np.full((1, 1, 1, 1), -3.5, np.float32))
        if fails:
            with pytest.raises(ValueError, match=r"RROIAlign: rois\[0\] is a box of 65536 x "
                                                 r"17: 1.11e\+06 samples per bin"):
                backend.forward(op, "write", nd(data), nd(rois), out)
        else:
            backend.forward(op, "write", nd(data), nd(rois), out)
            assert out.asnumpy().tolist() == [[[[1.0]]]]


# ---- the compiled entry points' own guards -----------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_build_refuses_what_geometry_py_refuses(kind):
    """sample_num 0 of the R-FCN grid (geometry.py's message), and rois the compiled code
    must not read: not (R, 5) -- 6 or 4 columns, one dimension -- or an integer dtype."""
    cg = _compiled(kind)
    rois = np.array([[0, 1, 1, 4, 4]], np.float32)
    for n in (0, -1):
        with pytest.raises(ValueError) as want:
            G.rfcn_align_grid(rois, (2, 2), 1.0, n, 5, 5)
        with pytest.raises(ValueError) as got:
            cg.build(CG.Spec("rfcn_grid", (2, 2), 1.0, n), rois, 5, 5)
        assert str(got.value) == str(want.value) == f"sample_num must be >= 1, got {n}"
    _compare(G.rfcn_align_grid(rois, (2, 2), 1.0, 1, 5, 5),
             cg.build(CG.Spec("rfcn_grid", (2, 2), 1.0, 1), rois, 5, 5), "sample_num 1")
    spec = CG.Spec("align_grid", (2, 2), 1.0, 2)
    for bad in (np.zeros((2, 6), np.float32), np.zeros((2, 4), np.float32),
                np.zeros(5, np.float32), np.zeros((2, 5), np.int32)):
        for call in (lambda: cg.build(spec, bad, 5, 5), lambda: cg.check(bad, 1, 1e30, False)):
            with pytest.raises(ValueError, match=r"rois must be an \(R, 5\) float16/32/64 "
                                                 r"array, got "):
                call()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", ["batch", "nan"])
@pytest.mark.parametrize("mode", ["pool_bins", "align_grid"])
def test_device_status_names_a_bad_first_roi(mode, bad, kind):
    """The status word's key of roi 0 (a batch error: key exactly STATUS_BATCH_KEY; a NaN:
    key 0, the word all ones) decodes to check_inputs' message for rois[0]; the row is
    padding, the others are not."""
    from mx_roi.onednn import GUARD_BOUND
    op = make_op("ROIAlign" if mode == "align_grid" else "ROIPooling",
                 dict(pooled_size=(2, 2), spatial_scale=1.0))
    rois = np.array([[0, 1, 1, 4, 4], [1, 0, 0, 3, 3], [0, 2, 2, 5, 5]], np.float32)
    rois[0, 0 if bad == "batch" else 3] = N if bad == "batch" else np.nan
    spec = CG.Spec(mode, (2, 2), 1.0, 0)
    dev = DG.build(Launch.on_host("roi_align.cu", kind, np.float32), spec, rois, N, H, W)
    status = np.asarray(dev.status)
    assert int(status[0]) == ((1 << 64) - 1 if bad == "nan" else
                              (~DG.STATUS_BATCH_KEY) & ((1 << 64) - 1))
    with pytest.raises(ValueError) as want:
        op.check_inputs((N, 1, H, W), np.float32, rois, np)
    assert "rois[0]" in str(want.value)
    assert str(dev.error(op, status, np)) == str(want.value)
    assert dev.geo.batch.tolist() == [-1, 1, 0]
    assert not DG.DeviceGeometry.overflowed(status)
    assert DG.DeviceGeometry.overflowed(np.array([0, 1], np.uint64))
