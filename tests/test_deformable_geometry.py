"""DeformablePSROIPooling's two geometries are one: the sample grid the kernels derive
(operators/deformable_psroi_pooling.cu, its ``deform_*`` __host__ __device__ functions,
read back through the ``deformable_psroi_pooling_samples`` kernel of the native build)
equals ``mx_roi.geometry.deformable_samples`` (the NumPy backend's and the pictures')
bit for bit, over 1500 random grids x every dtype x with / without offsets."""
import numpy as np
import pytest

import mx_roi  # noqa: F401  (registers the op)
from mx_roi import geometry
from mx_roi.cuda import loader
from mx_roi.cuda.backend import Launch
from mx_roi.ndio import Kind

GRIDS = 1500
DTYPES = (np.float16, np.float32, np.float64)


def random_grid(rng):
    """One random problem: parameters, map size, rois and offsets (adversarial values:
    boxes off the map, reversed, tiny, huge, on .5 and on integer cell edges, big
    offsets)."""
    P, part, S = int(rng.integers(1, 8)), int(rng.integers(1, 9)), int(rng.integers(1, 6))
    scale = float(rng.choice([1.0, 0.5, 0.25, 0.0625, rng.uniform(0.01, 2.0)]))
    tstd = float(rng.choice([0.0, 0.1, 1.0, rng.uniform(0, 1)]))
    H, W, R, K = (int(rng.integers(1, 21)), int(rng.integers(1, 21)), int(rng.integers(0, 7)),
                  int(rng.integers(1, 4)))
    kind = rng.integers(0, 3)
    if kind == 0:    # integer coordinates: samples on cell edges and on -0.5 / W - 0.5
        boxes = rng.integers(-4, 2 * max(H, W), (R, 4)).astype(np.float64) / scale
    elif kind == 1:  # .5 coordinates (C rounding)
        boxes = rng.integers(-8, 4 * max(H, W), (R, 4)) / 2.0
    else:
        boxes = rng.uniform(-2, 1.5, (R, 4)) * np.array([W, H, W, H]) / scale
    boxes[rng.random(R) < 0.1] *= 1e4                                    # huge
    rois = np.concatenate([rng.integers(-1, 3, (R, 1)), boxes], 1)
    trans = rng.uniform(-2, 2, (R, 2 * K, part, part))
    trans[rng.random(trans.shape) < 0.05] *= 100                          # far off the map
    return dict(pooled_size=P, part_size=part, sample_per_part=S, spatial_scale=scale,
                trans_std=tstd, height=H, width=W), rois, trans


def compiled_samples(module, rois, trans, p):
    """The kernels' sample table: (y, x, y_in, x_in), each (R, K, P, P, S)."""
    R, P, S = rois.shape[0], p["pooled_size"], p["sample_per_part"]
    K = 1 if trans is None else trans.shape[1] // 2
    launch = Launch(module, np, rois.dtype)
    shape = (R, K, P, P, S)
    y, x = np.empty(shape, launch.acc), np.empty(shape, launch.acc)
    y_in, x_in = np.empty(shape, np.int32), np.empty(shape, np.int32)
    launch.forward("deformable_psroi_pooling_samples", R * K * P * P, rois=rois,
                   trans=trans if trans is not None else np.zeros(1, rois.dtype),
                   spatial_scale=float(np.float32(p["spatial_scale"])),
                   trans_std=float(np.float32(p["trans_std"])), no_trans=int(trans is None),
                   part=p["part_size"], S=S, C=K, H=p["height"], W=p["width"], P=P, Q=P,
                   y=y, x=x, y_in=y_in, x_in=x_in)
    return y, x, y_in.astype(bool), x_in.astype(bool)


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    if not np.array_equal(nan, np.isnan(b)):
        return False
    u = {4: np.uint32, 8: np.uint64}[a.itemsize]
    return np.array_equal(a.view(u)[~nan], b.view(u)[~nan])


@pytest.fixture(scope="module")
def module():
    if not loader.host_compiler():
        pytest.skip("no C++ compiler")
    return loader.get_module("deformable_psroi_pooling.cu", Kind.NATIVE)


def test_compiled_and_numpy_samples_are_bit_equal(module):
    rng = np.random.default_rng(2026)
    checked = inside = 0
    for g in range(GRIDS):
        p, rois, trans = random_grid(rng)
        for dtype in DTYPES:
            r = rois.astype(dtype)
            for t in (trans.astype(dtype), None):
                if dtype == np.float16 and not np.isfinite(r).all():
                    continue  # (huge boxes overflow float16: refused by the op's checks)
                want = geometry.deformable_samples(r, t, p["pooled_size"], p["part_size"],
                                                   p["sample_per_part"], p["spatial_scale"],
                                                   p["trans_std"], p["height"], p["width"])
                got = compiled_samples(module, r, t, p)
                for name, a, b in zip(("y", "x", "y_in", "x_in"), got,
                                      (want.y, want.x, want.y_in, want.x_in)):
                    assert same_bits(a, b) if a.dtype != bool else np.array_equal(a, b), \
                        f"grid {g} {np.dtype(dtype).name} trans={t is not None}: {name} " \
                        f"differs ({p})"
                checked += 1
                inside += int(want.x_in.sum())
    assert checked >= GRIDS * 5 and inside > 0
