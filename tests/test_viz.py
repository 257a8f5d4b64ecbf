"""mx_roi.viz: pictures are drawn headless and show exactly the geometry tables.

* every coordinate plot_sampling returns equals mx_roi.geometry's tables, and so do
  the artists actually drawn (scatter offsets, rectangles, labels) -- a picture cannot lie;
* the committed docs/*.png carry the coordinates they draw (PNG text chunk); they must
  equal a fresh regeneration and the geometry module (PNG bytes too, same matplotlib);
* the CLI runs in a subprocess; ``import mx_roi`` does not import matplotlib.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
pytestmark = pytest.mark.filterwarnings("ignore:'enablePackrat' deprecated")

from mx_roi import geometry  # noqa: E402
from mx_roi import viz  # noqa: E402
from mx_roi.viz import regenerate as regen  # noqa: E402
from mx_roi.viz._coords import PIXEL_CENTRE  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
C = PIXEL_CENTRE

ROI = (0, 18.5, 10.2, 92.3, 66.9)
OFF_MAP = (0, 36, 20, 90, 60)                 # hangs over the bottom-right edge of (6, 8)
CASES = [
    ("ROIPooling", (10, 14), ROI, dict(pooled_size=3, spatial_scale=0.125)),
    ("ROIPooling", (6, 8), OFF_MAP, dict(pooled_size=(3, 2), spatial_scale=0.125)),
    ("ROIAlign", (10, 14), ROI, dict(pooled_size=3, spatial_scale=0.125)),
    ("ROIAlign", (6, 8), OFF_MAP, dict(pooled_size=(3, 2), spatial_scale=0.125, sample_ratio=2,
                                       aligned=True)),
    ("ROIAlign", (12, 12), (0, 10.3, 6.2, 90.1, 61.7), dict(pooled_size=7, spatial_scale=0.0625,
                                                            pool_mode="max")),
    ("PSROIPooling", (10, 14), ROI, dict(pooled_size=3, output_dim=2, spatial_scale=0.125)),
    ("PSROIPooling", (10, 14), ROI, dict(pooled_size=4, group_size=3, output_dim=2,
                                         spatial_scale=0.125)),
    ("PSROIAlign", (10, 14), ROI, dict(pooled_size=4, group_size=2, output_dim=3,
                                       spatial_scale=0.125, sample_ratio=2)),
    ("PSROIAlign", (6, 8), OFF_MAP, dict(pooled_size=3, output_dim=1, spatial_scale=0.125,
                                         aligned=True)),
]


def _ids(case):
    return f"{case[0]}-{case[1][0]}x{case[1][1]}-" + "-".join(f"{k}={v}" for k, v in case[3].items())


def _tables(name, shape, roi, kw):
    """The geometry module's tables for this case, called directly (not via the op)."""
    rois = np.asarray(roi, np.float32)[None]
    P = kw["pooled_size"]
    P = (P, P) if isinstance(P, int) else P
    H, W = shape
    s = kw["spatial_scale"]
    if name == "DeformablePSROIPooling":
        trans = kw.get("trans")
        part = kw.get("part_size") or P[0]
        t = None if kw.get("no_trans") else \
            np.asarray(trans if trans is not None else np.zeros((2, part, part)),
                       np.float32).reshape(1, -1, part, part)
        return geometry.deformable_samples(rois, t, P[0], part, kw.get("sample_per_part", 1),
                                           s, kw.get("trans_std", 0.0), H, W)
    if name == "ROIPooling":
        return geometry.roi_pooling_bins(rois, P, s, H, W, np)
    if name == "PSROIPooling":
        return geometry.psroi_pooling_bins(rois, P, s, H, W, np)
    return geometry.roi_align_grid(rois, P, s, kw.get("sample_ratio", -1), kw.get("aligned", False),
                                   H, W, np)


def _check_own_geometry(panel, spec, kw):
    """A panel of an op that draws its own geometry (viz_coords) against the geometry
    module, called directly: RROIAlign's sample points, PrRoIPool's node weights."""
    rois = np.asarray(spec["roi"], np.float32)[None]
    H, W = spec["feature_shape"]
    P = kw["pooled_size"]
    P, Q = (P, P) if isinstance(P, int) else P
    assert len(panel["bin_polygons"]) == P * Q
    if spec["op"] == "RROIAlign":
        g = geometry.rotated_grid(rois, (P, Q), kw["spatial_scale"], kw["sampling_ratio"],
                                  kw.get("aligned", False), kw.get("clockwise", False), H, W)
        n = int(g.count[0])
        want = np.stack([g.y[0, :, :, :n].reshape(-1), g.x[0, :, :, :n].reshape(-1)], axis=1)
        assert panel["samples"] == want.tolist()
    else:
        b = geometry.precise_bins(rois, (P, Q), kw["spatial_scale"], H, W)
        i, j = panel["node_bin"]
        w = np.outer(b.y.weight[0, i, :b.y.count[0, i]], b.x.weight[0, j, :b.x.count[0, j]])
        np.testing.assert_allclose(sorted(panel["node_weights"]),
                                   sorted((w[w > 0] / b.area[0]).tolist()), rtol=1e-6)


def _drawn(ax, gid):
    return [a for a in list(ax.collections) + list(ax.patches) if a.get_gid() == gid]


@pytest.fixture(autouse=True)
def _agg():
    # plot_sampling never uses pyplot; make sure nothing would open a window anyway
    prev = matplotlib.get_backend()
    matplotlib.use("Agg", force=True)
    yield
    matplotlib.use(prev, force=True)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_plotted_coordinates_are_the_geometry_tables(case, tmp_path):
    name, shape, roi, kw = case
    channel = kw.get("output_dim", 1) - 1
    c = viz.plot_sampling(name, shape, roi, channel=channel, **kw)
    ax = c["ax"]
    assert ax.mx_roi_coords is c
    t = _tables(name, shape, roi, kw)
    if name in ("ROIPooling", "PSROIPooling"):
        for key in ("hstart", "hend", "wstart", "wend"):
            np.testing.assert_array_equal(c[key], getattr(t, key)[0])
        P, Q = t.hstart.shape[1], t.wstart.shape[1]
        n_drawn = 0
        for p in range(P):
            for q in range(Q):
                h0, h1, w0, w1 = t.hstart[0, p], t.hend[0, p], t.wstart[0, q], t.wend[0, q]
                empty = h1 <= h0 or w1 <= w0
                assert c["empty"][p, q] == empty
                rects = _drawn(ax, f"cells_{p}_{q}")
                if empty:
                    assert not rects
                    continue
                (rect,) = rects
                n_drawn += 1
                assert (rect.get_x(), rect.get_y()) == (w0, h0)
                assert (rect.get_width(), rect.get_height()) == (w1 - w0, h1 - h0)
        assert n_drawn == int((~c["empty"]).sum())
    else:
        np.testing.assert_array_equal(c["count_y"], t.y.count[0])
        np.testing.assert_array_equal(c["count_x"], t.x.count[0])
        expect, outside = [], []
        P, Q = t.y.count.shape[1], t.x.count.shape[1]
        for p in range(P):
            for q in range(Q):
                for iy in range(t.y.count[0, p]):
                    for ix in range(t.x.count[0, q]):
                        expect.append((t.y.coord[0, p, iy], t.x.coord[0, q, ix]))
                        outside.append(t.y.w_low[0, p, iy] + t.y.w_high[0, p, iy] == 0
                                       or t.x.w_low[0, q, ix] + t.x.w_high[0, q, ix] == 0)
        expect, outside = np.array(expect), np.array(outside, bool)
        np.testing.assert_array_equal(c["samples"], expect)
        np.testing.assert_array_equal(c["outside"], outside)
        (dots,) = _drawn(ax, "samples")
        np.testing.assert_array_equal(dots.get_offsets(),
                                      expect[~outside][:, ::-1].astype(np.float64) + C)
        crosses = _drawn(ax, "samples_outside")
        if outside.any():
            np.testing.assert_array_equal(crosses[0].get_offsets(),
                                          expect[outside][:, ::-1].astype(np.float64) + C)
        else:
            assert not crosses
        # the four taps of the chosen sample and their weights wy * wx
        p, q, iy, ix = c["tap_sample"]
        rows = (t.y.low[0, p, iy], t.y.high[0, p, iy])
        cols = (t.x.low[0, q, ix], t.x.high[0, q, ix])
        wy = (t.y.w_low[0, p, iy], t.y.w_high[0, p, iy])
        wx = (t.x.w_low[0, q, ix], t.x.w_high[0, q, ix])
        np.testing.assert_array_equal(c["taps"], [(r, k) for r in rows for k in cols])
        np.testing.assert_array_equal(c["tap_weights"], [a * b for a in wy for b in wx])
        (taps,) = _drawn(ax, "taps")
        np.testing.assert_array_equal(taps.get_offsets(), c["taps"][:, ::-1] + C)
        # bin edges: each bin's live samples lie inside its drawn rectangle
        for p in range(P):
            for q in range(Q):
                (rect,) = _drawn(ax, f"bin_{p}_{q}")
                x0, y0 = rect.get_x(), rect.get_y()
                x1, y1 = x0 + rect.get_width(), y0 + rect.get_height()
                ys = t.y.coord[0, p, :t.y.count[0, p]] + C
                xs = t.x.coord[0, q, :t.x.count[0, q]] + C
                assert np.all((ys > min(y0, y1) - 1e-4) & (ys < max(y0, y1) + 1e-4))
                assert np.all((xs > min(x0, x1) - 1e-4) & (xs < max(x0, x1) + 1e-4))
    if name.startswith("PS"):
        P = kw["pooled_size"]
        G = kw.get("group_size") or P
        gh = gw = geometry.group_index(P, G)
        want = (channel * G + gh[:, None]) * G + gw[None, :]
        np.testing.assert_array_equal(c["channel_map"], want)
        labels = sorted(tx.get_text() for tx in ax.texts if tx.get_text().startswith("ch "))
        if name == "PSROIAlign":
            assert labels == sorted(f"ch {v}" for v in want.ravel())
        else:
            assert labels == sorted(f"ch {v}" for v in want[~c["empty"]].ravel())
    out = tmp_path / "pic.png"
    c["figure"].savefig(out, dpi=40)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name,kw,fn", [
    ("ROIAlign", dict(pooled_size=3, legacy="caffe"), "caffe_align_grid"),
    ("PSROIAlign", dict(pooled_size=3, output_dim=1, legacy="rfcn", sample_num=2),
     "rfcn_align_grid")])
def test_legacy_modes_draw_their_own_tables(name, kw, fn):
    if not hasattr(geometry, fn):
        pytest.skip(f"geometry.{fn} not available")
    c = viz.plot_sampling(name, (6, 8), OFF_MAP, spatial_scale=0.125, **kw)
    t = c["ax"].mx_roi_coords and viz.make_op(name, spatial_scale=0.125, **kw).geometry(
        np.asarray(OFF_MAP, np.float32)[None], 6, 8, np)
    expect = [(t.y.coord[0, p, iy], t.x.coord[0, q, ix])
              for p in range(t.y.count.shape[1]) for q in range(t.x.count.shape[1])
              for iy in range(t.y.count[0, p]) for ix in range(t.x.count[0, q])]
    np.testing.assert_array_equal(c["samples"], np.array(expect).reshape(-1, 2))
    assert c["bin_y"] is None and not _drawn(c["ax"], "bin_0_0")   # no bin edges drawn


def test_aligned_comparison_is_a_half_pixel_shift(tmp_path):
    res = viz.plot_aligned_comparison("ROIAlign", (6, 7), (0, 8, 8, 40, 32), pooled_size=2,
                                      spatial_scale=0.125, sample_ratio=2)
    off, on = res[False], res[True]
    np.testing.assert_allclose(on["samples"], off["samples"] - 0.5, atol=1e-6)
    assert off["ax"] is not on["ax"] and off["figure"] is on["figure"] is res["figure"]
    res["figure"].savefig(tmp_path / "cmp.png", dpi=50)
    with pytest.raises(ValueError, match="aligned"):
        viz.plot_aligned_comparison("ROIPooling", None, ROI, pooled_size=2, spatial_scale=0.125)


def test_default_feature_shape_contains_the_box():
    c = viz.sampling_coords("ROIAlign", None, (0, 10.3, 6.2, 90.1, 61.7), pooled_size=7,
                            spatial_scale=0.0625)
    H, W = c["feature_shape"]
    assert (H, W) == (5, 7)
    assert not c["outside"].any()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown op"):
        viz.sampling_coords("ROIFoo", (4, 4), ROI, pooled_size=2, spatial_scale=1)
    with pytest.raises(ValueError, match="tap_sample"):
        viz.sampling_coords("ROIAlign", (10, 14), ROI, pooled_size=2, spatial_scale=0.125,
                            sample_ratio=2, tap_sample=(0, 0, 5, 0))
    with pytest.raises(ValueError, match="channel"):
        viz.sampling_coords("PSROIPooling", (10, 14), ROI, pooled_size=2, output_dim=2,
                            spatial_scale=0.125, channel=2)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs")
    return out, regen.regenerate(str(out))


@pytest.mark.parametrize("name", sorted(regen.FIGURES))
def test_committed_pictures_match_regeneration_and_geometry(name, regenerated):
    out, coords = regenerated
    committed = os.path.join(DOCS, name)
    assert os.path.exists(committed), f"run: python -m mx_roi.viz.regenerate docs ({name})"
    meta = regen.read_png_text(committed)
    assert "Software" not in meta
    # the committed picture draws what the geometry module computes today
    assert regen.read_coords(committed) == coords[name] == regen.read_coords(str(out / name)), \
        f"docs/{name} is stale: run python -m mx_roi.viz.regenerate docs"
    for panel, spec in zip(coords[name], regen.FIGURES[name]):
        spec = dict(spec)
        kw = {k: v for k, v in spec.items() if k not in ("op", "feature_shape", "roi",
                                                         "tap_sample", "channel")}
        if spec["op"] in ("RROIAlign", "PrRoIPool"):
            _check_own_geometry(panel, spec, kw)
            continue
        t = _tables(spec["op"], spec["feature_shape"], spec["roi"], kw)
        if hasattr(t, "y_in"):  # deformable: every sample, bin-major then (i, j)
            S = t.y.shape[-1]
            ys = np.repeat(t.y[0, 0], S, axis=-1).reshape(-1)
            xs = np.tile(t.x[0, 0], (1, 1, S)).reshape(-1)
            assert panel["samples"] == np.stack([ys, xs], 1).tolist()
        elif hasattr(t, "hstart"):
            assert panel["hstart"] == t.hstart[0].tolist()
            assert panel["wend"] == t.wend[0].tolist()
        else:
            assert panel["coord_y"] == t.y.coord[0].tolist()
            assert panel["coord_x"] == t.x.coord[0].tolist()
    # deterministic bytes: equal to the committed file when made with the same matplotlib
    # (fonts and the PNG encoder differ between versions), else twice in a row equal
    if meta.get(regen.VERSION_KEY) == matplotlib.__version__:
        with open(committed, "rb") as fh:
            assert fh.read() == (out / name).read_bytes()
    else:
        again = out / "again"
        regen.regenerate(str(again), [name])
        assert (again / name).read_bytes() == (out / name).read_bytes()


def test_cli_subprocess_and_lazy_matplotlib(tmp_path):
    """One subprocess (mxnet takes seconds to import): ``import mx_roi`` and the coordinate
    helpers leave matplotlib unimported, then ``python -m mx_roi.viz`` as documented."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    png = tmp_path / "roialign.png"
    code = ("import sys, runpy; import mx_roi, mx_roi.viz; "
            "c = mx_roi.viz.sampling_coords('ROIAlign', None, (0, 1, 1, 9, 9), pooled_size=2, "
            "spatial_scale=0.5); assert 'matplotlib' not in sys.modules, 'eager matplotlib'; "
            "sys.argv = ['mx_roi.viz'] + sys.argv[1:]; "
            "runpy.run_module('mx_roi.viz', run_name='__main__', alter_sys=True)")
    args = ["--op", "ROIAlign", "--roi", "0,10.3,6.2,90.1,61.7", "--spatial-scale", "0.0625",
            "--pooled-size", "7", "-o", str(png)]
    r = subprocess.run([sys.executable, "-c", code] + args, cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_options(tmp_path, capsys):
    from mx_roi.viz.__main__ import main
    ps = tmp_path / "ps.svg"
    assert main(["--op", "psroialign", "--roi", "0,18.5,10.2,92.3,66.9", "--spatial-scale",
                 "0.125", "--pooled-size", "4", "--group-size", "2", "--output-dim", "2",
                 "--channel", "1", "--sample-ratio", "2", "--aligned", "--feature-shape",
                 "10,14", "--tap-sample", "1,2,1,0", "--dpi", "40", "-o", str(ps)]) == 0
    assert b"<svg" in ps.read_bytes()
    cmp_png = tmp_path / "cmp.png"
    assert main(["--op", "ROIAlign", "--roi", "8,8,40,32", "--spatial-scale", "0.125",
                 "--pooled-size", "2,3", "--compare-aligned", "--dpi", "40",
                 "-o", str(cmp_png)]) == 0
    assert cmp_png.stat().st_size > 1000
    assert main(["--op", "ROIPooling", "--roi", "0,1,2,3,4", "--spatial-scale", "-1",
                 "--pooled-size", "2", "-o", str(tmp_path / "x.png")]) == 2
    assert "spatial_scale" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--op", "ROIPooling", "--roi", "0,1,2,3,4", "--spatial-scale", "1",
              "--pooled-size", "2", "--aligned", "-o", str(tmp_path / "x.png")])
    assert exc.value.code == 2


def test_cli_rotated_and_precise_ops(tmp_path):
    """The CLI draws RROIAlign (sampling_ratio, clockwise) and PrRoIPool."""
    from mx_roi.viz.__main__ import main
    for argv in (["--op", "rroialign", "--roi", "0,40,30,50,20,-40", "--spatial-scale", "0.125",
                  "--pooled-size", "2,3", "--sample-ratio", "2", "--clockwise"],
                 ["--op", "PrRoIPool", "--roi", "0,10,10,60,50", "--spatial-scale", "0.125",
                  "--pooled-size", "2", "--feature-shape", "8,9"]):
        out = tmp_path / f"{argv[1]}.png"
        assert main(argv + ["--dpi", "40", "-o", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
