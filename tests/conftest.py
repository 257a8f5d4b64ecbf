"""Fixtures shared by the test modules."""
import pytest

from mx_roi.cuda.backend import Launch


@pytest.fixture
def launches(monkeypatch):
    """Records the kernel expression of every launch from Python (any host/GPU seam;
    :func:`op_kernels` leaves the device geometry's kernels out).  The seams are the
    Custom door's backends, so the test runs on the Custom door (``MX_ROI_NATIVE_OPS=0``:
    ``mx_roi.nd`` / ``sym`` / Gluon build Custom nodes), and the native backend on its
    checked path (``MX_ROI_LIBRARY_CALLS=0``: the extension library's launcher, which
    the native backend calls otherwise, launches nothing Python sees --
    tests/test_library_calls.py compares the two)."""
    monkeypatch.setenv("MX_ROI_NATIVE_OPS", "0")
    monkeypatch.setenv("MX_ROI_LIBRARY_CALLS", "0")
    seen = []
    real = Launch._launch

    def spy(self, expr, n, args):
        seen.append(expr)
        return real(self, expr, n, args)

    monkeypatch.setattr(Launch, "_launch", spy)
    return seen


def op_kernels(launches):
    """The op's own kernels among ``launches`` (the device geometry's left out)."""
    return [e for e in launches if not e.startswith(("roi_bins_geometry",
                                                      "roi_grid_geometry"))]


@pytest.fixture(params=["native", "custom"])
def door(request, monkeypatch):
    """Runs a test on each door of mx_roi.nd / sym / Gluon (mx_roi.ext.door): the
    default rule (native where it applies) and ``MX_ROI_NATIVE_OPS=0`` (Custom)."""
    from mx_roi.ext import door as door_module
    if request.param == "custom":
        monkeypatch.setenv(door_module.ENV, "0")
    else:
        monkeypatch.delenv(door_module.ENV, raising=False)
    return request.param


@pytest.fixture
def custom_door(monkeypatch):
    """Pins a test to the Custom door (``MX_ROI_NATIVE_OPS=0``); each use says why."""
    from mx_roi.ext import door as door_module
    monkeypatch.setenv(door_module.ENV, "0")
    return "custom"


def roi_nodes(nodes, op):
    """The attrs (``op_type`` left out) of the graph ``nodes`` (JSON) that run ``op``:
    ``Custom(op_type=op)`` or ``mx_roi_<op>`` (either door)."""
    found = []
    for n in nodes:
        attrs = dict(n.get("attrs", {}))
        if n["op"] == f"mx_roi_{op}" or (n["op"] == "Custom" and attrs.pop("op_type", None) == op):
            found.append(attrs)
    return found
