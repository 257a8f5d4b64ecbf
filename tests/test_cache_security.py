"""The compiled-kernel cache never loads someone else's code, and heals a broken entry.

Each attack runs in a child process (its own ``TMPDIR``, cache and per-process trust
decisions) calling ``ROIPooling`` on the ``native`` backend.  The planted library is a
complete impostor: it exports every ``mx_roi_launch_<k>`` and the right build key, and its
constructor (``__attribute__((constructor))``, run by ``dlopen`` itself) writes a marker
file.  So only the trust checks on directories and files can keep it out: the marker must
never appear, and the call must give the reference numbers (``tests/reference.py``).

We run as root here, so ``os.access`` would always say yes: the cases are made real with
ownership and modes (a world-writable directory, one chowned to uid 12345, a cache home
under a regular file so it cannot be created).
"""
import json
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mx_roi import backends
from mx_roi.cuda import loader
from mx_roi.ndio import Kind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "roi_pooling.cu"
N_LAUNCH = len(loader.host_source(SOURCE, Kind.NATIVE)[1])

# The child: one native ROIPooling forward against the scalar reference, then a report.
CHILD = r"""
import json, os, sys, warnings
warnings.simplefilter("always")
import numpy as np
import mxnet as mx
import mx_roi
from mx_roi.cuda import loader
from mx_roi.ndio import Kind
from tests import reference
data = np.random.default_rng(0).standard_normal((2, 3, 8, 9)).astype(np.float32)
rois = np.array([[0, 0, 0, 5, 5], [1, 1, 2, 8, 6], [0, 3, 1, 7, 7]], np.float32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = mx_roi.nd.ROIPooling(mx.nd.array(data), mx.nd.array(rois), pooled_size=(2, 3),
                               spatial_scale=1.0).asnumpy()
want = reference.roi_pooling_forward(data, rois, (2, 3), 1.0)
mod = loader._MODULES[("roi_pooling.cu", Kind.NATIVE, -1)]  # the one the op used
print("REPORT" + json.dumps(dict(
    equal=bool(np.array_equal(out, want)), lib=mod._lib._name, cache=loader.cache_dir(),
    problems=[loader.path_problem(os.path.dirname(mod._lib._name), True),
              loader.path_problem(mod._lib._name, False)],
    warnings=[str(w.message) for w in caught])))
"""

CONSTRUCTOR_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen("%s", "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


def expected_name():
    """The library's file name, from the loader's own functions (anyone can compute it)."""
    return os.path.basename(loader.host_library_path(SOURCE, Kind.NATIVE)[0])


def build_plant(tmp_path, marker, with_launch=True, with_constructor=True):
    """A library named like our build; by default a complete impostor whose constructor
    writes ``marker``."""
    name = expected_name()
    key = name.rsplit("-", 1)[1][:-3]
    code = (CONSTRUCTOR_C % marker if with_constructor else "") + \
        f'const char mx_roi_build_key[] = "{key}";\n'
    if with_launch:
        code += "".join(f"void mx_roi_launch_{k}(int n, void** a) {{}}\n"
                        for k in range(N_LAUNCH))
    src = tmp_path / "plant.c"
    src.write_text(code)
    lib = tmp_path / "plant.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return lib, name


def child_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MX_ROI_CACHE", "XDG_CACHE_HOME", "MX_ROI_BACKEND", "TMPDIR")}
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    # MX_ROI_NATIVE_OPS=0: the Custom door, whose native backend loads the host library
    # under test; MX_ROI_LIBRARY_CALLS=0: its checked path runs the kernels from that
    # library (else the extension library's launcher would, built into the same cache:
    # it has its own cache test in test_ext_library)
    env.update(TMPDIR=str(tmp), MX_ROI_BACKEND="native", MX_ROI_NATIVE_OPS="0",
               MX_ROI_LIBRARY_CALLS="0", PYTHONPATH=ROOT)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_child(env):
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


def plant(directory, lib, name, mode=0o755, owner=None):
    path = os.path.join(directory, name)
    shutil.copy(lib, path)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


def assert_safe(report, marker, bad_dir):
    assert not marker.exists(), "the planted library's code ran"
    assert report["equal"], "wrong numbers"
    assert not report["lib"].startswith(str(bad_dir) + os.sep), report
    assert report["problems"] == ["", ""], "loaded from an untrusted place"


# ------------------------------------------------------------------ planted libraries
def test_world_writable_mx_roi_cache_is_not_loaded_from(tmp_path, marker):
    lib, name = build_plant(tmp_path, marker)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    plant(shared, lib, name)
    # the private fallback already holds a good build of ours: no compile needed here
    private = tmp_path / "tmpdir" / f"mx_roi-{os.geteuid()}"
    private.mkdir(parents=True, mode=0o700)
    shutil.copy(loader.get_module(SOURCE, Kind.NATIVE)._lib._name, private / name)
    report = run_child(child_env(tmp_path, MX_ROI_CACHE=shared))
    assert_safe(report, marker, shared)
    assert report["cache"] == str(private) and report["lib"] == str(private / name)
    msgs = [w for w in report["warnings"] if str(shared) in w]
    assert len(msgs) == 1, report["warnings"]
    assert "writable by group or others" in msgs[0] and f"chmod go-w {shared}" in msgs[0]


def _unwritable_home(tmp_path):
    """A cache home that cannot be created: it lies under a regular file."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    return dict(HOME=blocker, XDG_CACHE_HOME=blocker / "cache")


def test_world_writable_temp_fallback_is_not_loaded_from(tmp_path, marker):
    lib, name = build_plant(tmp_path, marker)
    squat = tmp_path / "tmpdir" / f"mx_roi-{os.geteuid()}"
    squat.mkdir(parents=True)
    os.chmod(squat, 0o777)
    plant(squat, lib, name)
    report = run_child(child_env(tmp_path, **_unwritable_home(tmp_path)))
    assert_safe(report, marker, squat)
    assert report["cache"].startswith(f"{squat}-")  # a fresh mkdtemp folder
    assert any(str(squat) in w and "writable by group or others" in w
               for w in report["warnings"]), report["warnings"]


def test_foreign_owned_temp_fallback_is_not_loaded_from(tmp_path, marker):
    lib, name = build_plant(tmp_path, marker)
    squat = tmp_path / "tmpdir" / f"mx_roi-{os.geteuid()}"
    squat.mkdir(parents=True, mode=0o755)
    plant(squat, lib, name, owner=12345)
    os.chown(squat, 12345, 12345)  # not writable by us-as-others: only the owner differs
    report = run_child(child_env(tmp_path, **_unwritable_home(tmp_path)))
    assert_safe(report, marker, squat)
    assert any(str(squat) in w and "owned by uid 12345" in w for w in report["warnings"])


@pytest.mark.slow
def test_foreign_owned_file_in_our_cache_is_replaced(tmp_path, marker):
    """A library owned by someone else inside our own cache is not loaded but rebuilt."""
    lib, name = build_plant(tmp_path, marker)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    path = plant(cache, lib, name, owner=12345)
    report = run_child(child_env(tmp_path, MX_ROI_CACHE=cache))
    assert not marker.exists() and report["equal"]
    assert report["lib"] == path and os.stat(path).st_uid == os.geteuid()
    assert any("owned by uid 12345" in w for w in report["warnings"])


# ------------------------------------------------------------------ self-healing
def test_truncated_entry_is_rebuilt_by_the_next_call(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    good = loader.get_module(SOURCE, Kind.NATIVE)._lib._name
    name = os.path.basename(good)
    with open(good, "rb") as f:
        (cache / name).write_bytes(f.read(4096))
    report = run_child(child_env(tmp_path, MX_ROI_CACHE=cache))
    assert report["equal"] and report["lib"] == str(cache / name)
    assert any("rebuilding the damaged cache entry" in w and name in w
               for w in report["warnings"]), report["warnings"]
    assert os.path.getsize(cache / name) > 4096
    # the next process loads the healed entry without a word
    report = run_child(child_env(tmp_path, MX_ROI_CACHE=cache))
    assert report["equal"] and report["warnings"] == []


@pytest.mark.slow
def test_entry_lacking_the_launch_symbols_is_rebuilt(tmp_path, marker):
    lib, name = build_plant(tmp_path, marker, with_launch=False, with_constructor=False)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    plant(cache, lib, name)
    report = run_child(child_env(tmp_path, MX_ROI_CACHE=cache))
    assert report["equal"] and report["lib"] == str(cache / name)
    assert any("lacks mx_roi_launch_0" in w for w in report["warnings"]), report["warnings"]


@pytest.mark.slow
def test_two_processes_build_the_same_library_at_once(tmp_path):
    cache = tmp_path / "cache"
    env = child_env(tmp_path, MX_ROI_CACHE=cache)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        report = json.loads(next(x for x in out.splitlines()
                                 if x.startswith("REPORT"))[len("REPORT"):])
        assert report["equal"] and report["warnings"] == []
    # one complete library, no torn file, no leftovers of either build
    assert sorted(os.listdir(cache)) == [expected_name_in(cache)]


def expected_name_in(cache):
    libs = [f for f in os.listdir(cache) if f.endswith(".so")]
    assert len(libs) == 1, os.listdir(cache)
    lib, why = loader._try_load(os.path.join(cache, libs[0]), N_LAUNCH)
    assert lib is not None, why
    return libs[0]


# ------------------------------------------------------------------ in-process rules
def test_path_problem():
    import tempfile
    d = tempfile.mkdtemp()
    try:
        f = os.path.join(d, "f")
        open(f, "w").close()
        os.chmod(f, 0o644)
        assert loader.path_problem(d, True) == "" and loader.path_problem(f, False) == ""
        assert loader.path_problem(f, True) == "is not a directory"
        assert loader.path_problem(d, False) == "is not a regular file"
        os.symlink(f, os.path.join(d, "link"))
        assert loader.path_problem(os.path.join(d, "link"), False) == "is a symbolic link"
        os.chmod(f, 0o664)
        assert loader.path_problem(f, False) == \
            "is writable by group or others (mode 0664)"
        os.chmod(f, 0o644)
        os.chown(f, 12345, 12345)
        assert loader.path_problem(f, False).startswith("is owned by uid 12345, not by you")
    finally:
        shutil.rmtree(d)


def test_cache_dir_is_checked_once_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path / "c"))
    calls = []
    real = loader.path_problem
    monkeypatch.setattr(loader, "path_problem", lambda *a: calls.append(a) or real(*a))
    d = loader.cache_dir()
    assert d == str(tmp_path / "c") and oct(os.stat(d).st_mode & 0o777) == "0o700"
    n = len(calls)
    assert n >= 1
    for _ in range(3):
        assert loader.cache_dir() == d
    assert len(calls) == n


def test_group_writable_parent_is_not_trusted(tmp_path, monkeypatch):
    parent = tmp_path / "team"
    parent.mkdir()
    os.chmod(parent, 0o775)  # a group could rename our directory and put its own there
    monkeypatch.setenv("MX_ROI_CACHE", str(parent / "me"))
    monkeypatch.setattr(loader, "_CACHE_DIRS", {})
    with pytest.warns(loader.CacheWarning, match=r"its parent .*team is writable by group"):
        d = loader.cache_dir()
    assert not d.startswith(str(parent))


@pytest.fixture
def failing_compiler(tmp_path, monkeypatch):
    """A compiler that answers ``--version`` and fails every build (counted)."""
    log = tmp_path / "calls"
    cxx = tmp_path / "broken-c++"
    cxx.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo broken 1.0 && exit 0\n'
                   f'echo x >> {log}\necho "broken: cannot compile" >&2\nexit 1\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("MX_ROI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backends, "_NATIVE_OK", {})
    monkeypatch.setattr(loader, "_MODULES", {})
    monkeypatch.setattr(loader, "_FAILED", {})
    monkeypatch.delenv("MX_ROI_BACKEND", raising=False)
    # the Custom door: these calls test its host library's fallback (the extension
    # library, loaded in this process already, would not use the host build at all)
    monkeypatch.setenv("MX_ROI_NATIVE_OPS", "0")
    # a truncated entry under the expected name: it will fail to load, and so will the
    # rebuild
    path = loader.host_library_path(SOURCE, Kind.NATIVE)[0]
    with open(path, "wb") as f:
        f.write(b"\x7fELF" + b"\0" * 60)
    return log


def _call(mx_roi, mx):
    x = mx.nd.array(np.arange(50, dtype=np.float32).reshape(1, 2, 5, 5))
    r = mx.nd.array(np.array([[0, 0, 0, 3, 3]], np.float32))
    return mx_roi.nd.ROIPooling(x, r, pooled_size=(2, 2), spatial_scale=1.0).asnumpy()


def test_unhealable_entry_falls_back_to_numpy_under_auto(failing_compiler):
    import mxnet as mx
    import mx_roi
    with pytest.warns(RuntimeWarning) as rec:
        y = _call(mx_roi, mx)
    np.testing.assert_array_equal(y[0, 0], [[6, 8], [16, 18]])
    msgs = [str(w.message) for w in rec]
    assert sum("using the NumPy kernels" in m and "building the host kernels of "
               "roi_pooling.cu failed" in m for m in msgs) == 1, msgs
    assert sum("rebuilding the damaged cache entry" in m for m in msgs) == 1, msgs
    assert failing_compiler.read_text().count("x") == 1  # one rebuild attempt
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call(mx_roi, mx)
    assert failing_compiler.read_text().count("x") == 1


def test_unhealable_entry_forced_native_is_a_clear_error(failing_compiler, monkeypatch):
    import mxnet as mx
    import mx_roi
    monkeypatch.setenv("MX_ROI_BACKEND", "native")
    with pytest.warns(loader.CacheWarning, match="rebuilding the damaged cache entry"):
        with pytest.raises(mx.base.MXNetError,
                           match="building the host kernels of roi_pooling.cu failed"):
            _call(mx_roi, mx)
    # the same clear error on the next call, without rebuilding again
    with pytest.raises(mx.base.MXNetError,
                       match="building the host kernels of roi_pooling.cu failed"):
        _call(mx_roi, mx)
    assert failing_compiler.read_text().count("x") == 1
    monkeypatch.setenv("MX_ROI_BACKEND", "numpy")  # the process is not broken
    np.testing.assert_array_equal(_call(mx_roi, mx)[0, 0], [[6, 8], [16, 18]])
