"""Fixtures shared by the test modules."""
import pytest

from mx_roi.cuda.backend import Launch


@pytest.fixture
def launches(monkeypatch):
    """Records the kernel expression of every launch (any host/GPU seam)."""
    seen = []
    real = Launch._launch

    def spy(self, expr, n, args):
        seen.append(expr)
        return real(self, expr, n, args)

    monkeypatch.setattr(Launch, "_launch", spy)
    return seen
