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


def _device_equals_host(kind, spec, rois, host, flagged=()):
    """The device geometry kernel's tables of ``rois`` (shape-derived widths) against the
    host tables ``host``: a row not in ``flagged`` has the host's values in its first
    columns and zero padding after them; a row in ``flagged`` is padding (batch -1) and
    status[1] is set exactly when ``flagged`` is not empty.  Returns the status."""
    launch = Launch.on_host("roi_align.cu", kind, rois.dtype)
    dev = DG.build(launch, spec, rois, N, H, W)
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
    on those rois, through the host build (native: compiled tables, then the recorded
    call's device geometry kernel; emulation: the device geometry kernel's) into
    garbage-filled outputs, against the scalar references."""
    mode, p, L, targets = config
    dtype = np.float32
    rois, _ = edge_rois(mode, p, L, targets, dtype)
    op = _op(mode, p)
    rng = np.random.default_rng(41)
    data = (rng.standard_normal((N, 1, H, W)) + 2).astype(dtype)
    want = _reference(mode, p, data, rois)
    backend = CudaBackend(kind)
    for call in range(2):  # native: the checked call, then the recorded one's replay
        out = nd(np.full(op.out_shape(data.shape, rois.shape), -7.25, dtype))
        backend.forward(op, "write", nd(data), nd(rois), out)
        close(out.asnumpy(), want, dtype, what=f"{config[:2]} {kind} call {call}")
