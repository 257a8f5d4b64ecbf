"""Fixtures shared by the test modules."""
import pytest

from mx_roi.cuda import native_program
from mx_roi.cuda.backend import Launch


@pytest.fixture
def launches(monkeypatch):
    """Records the kernel expression of every launch (any host/GPU seam), and of every
    kernel a recorded native program runs (mx_roi.cuda.native_program: its geometry
    kernel first; :func:`op_kernels` leaves the geometry kernels out)."""
    seen = []
    real = Launch._launch
    real_run = native_program._Program.__call__

    def spy(self, expr, n, args):
        seen.append(expr)
        return real(self, expr, n, args)

    def run(program, values):
        ok = real_run(program, values)
        # the geometry kernel runs always, the others only when the status is clean
        seen.extend(program.exprs if ok else program.exprs[:1])
        return ok

    monkeypatch.setattr(Launch, "_launch", spy)
    monkeypatch.setattr(native_program._Program, "__call__", run)
    return seen


def op_kernels(launches):
    """The op's own kernels among ``launches`` (the device geometry's left out)."""
    return [e for e in launches if not e.startswith(("roi_bins_geometry",
                                                      "roi_grid_geometry"))]
