"""The cases, problems and tolerances shared by the GPU test files (``tests/test_gpu.py``
on ``mx.gpu(0)``, ``tests/test_gpu_cupy.py`` on CuPy arrays)."""
import numpy as np

from tests.ops.base import adversarial_rois, make_data, random_rois

DTYPES = (np.float16, np.float32, np.float64)
TOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-10}
CASES = [
    ("ROIPooling", dict(pooled_size=(2, 3), spatial_scale=0.5)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.0625, sample_ratio=-1)),
    ("ROIAlign", dict(pooled_size=(3, 2), spatial_scale=1.0, sample_ratio=2, aligned=True)),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=-1, pool_mode="max")),
    ("ROIAlign", dict(pooled_size=(2, 2), spatial_scale=0.5, sample_ratio=2, pool_mode="max",
                      aligned=True)),
    ("PSROIPooling", dict(pooled_size=3, output_dim=2, spatial_scale=0.5)),
    ("PSROIAlign", dict(pooled_size=2, output_dim=2, spatial_scale=0.5, sample_ratio=2)),
    # (RROIAlign runs on a GPU through tests/ops with MX_ROI_TEST_CTX=gpu: its cosf / sinf
    # are the device's, not bit for bit the host's)
    ("PrRoIPool", dict(pooled_size=(2, 3), spatial_scale=0.5)),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]


def gpu_available():
    """Whether ``mx.gpu(0)`` runs our ops: CuPy, an MXNet GPU build and a GPU."""
    import mxnet as mx
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    try:
        return mx.context.num_gpus() > 0
    except Exception:
        return False


def channels(name, params, c=3):
    """Input channels: ``c``, or output_dim * group_size^2 for the position-sensitive ops."""
    if "output_dim" not in params:
        return c
    ps = params["pooled_size"]
    g = params.get("group_size") or (ps if isinstance(ps, int) else ps[0])
    return params["output_dim"] * g * g


def problem(name, params, dtype, seed=0, N=2, H=9, W=10):
    """Data ``(N, C, H, W)`` and rois: the adversarial set plus six ordinary boxes."""
    rng = np.random.default_rng(seed)
    data = make_data(rng, (N, channels(name, params), H, W), dtype)
    rois = np.concatenate([adversarial_rois(rng, N, H, W, params["spatial_scale"], dtype=dtype),
                           random_rois(rng, 6, N, H, W, params["spatial_scale"], dtype)])
    return data, rois.astype(dtype)


def close(a, b, dtype, what, exact=False):
    if exact:
        np.testing.assert_array_equal(a, b, err_msg=what)
        return
    t = TOL[np.dtype(dtype)]
    scale = max(1.0, float(np.abs(b.astype(np.float64)).max()) if b.size else 1.0)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=t,
                               atol=t * scale, err_msg=what)
