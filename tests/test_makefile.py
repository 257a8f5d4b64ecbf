"""The Makefile creates .venv with Python 3.11: python3.11 from PATH, else the one named by
PYTHON=..., else a clear error (numpy<1.24, which MXNet 1.9.1 needs, has no 3.12 wheels).

Each case runs ``make`` on a copy of the Makefile whose PATH holds only a stand-in
``python3.11`` (or nothing), which records how it was called and fails, so no venv is
ever made."""
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")


def _make(tmp_path, *args, with_python311=True):
    repo, bindir = tmp_path / "repo", tmp_path / "bin"
    repo.mkdir()
    bindir.mkdir()
    for name in ("Makefile", "setup.py"):
        shutil.copy(ROOT / name, repo / name)
    calls = tmp_path / "calls"
    if with_python311:
        fake = bindir / "python3.11"
        fake.write_text(f'#!/bin/sh\necho "python3.11 $@" >> {calls}\nexit 3\n')
        fake.chmod(0o755)
    other = tmp_path / "chosen-python"
    other.write_text(f'#!/bin/sh\necho "chosen $@" >> {calls}\nexit 4\n')
    other.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "MAKEFLAGS", "MFLAGS")}
    env["PATH"] = str(bindir)
    out = subprocess.run([MAKE, *[a.replace("CHOSEN", str(other)) for a in args]], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=60)
    return out, calls.read_text() if calls.exists() else ""


def test_python311_from_path_creates_the_venv(tmp_path):
    out, calls = _make(tmp_path, "test")
    assert out.returncode != 0 and calls == "python3.11 -m venv .venv\n", out.stderr


def test_without_python311_a_clear_error_names_the_fix(tmp_path):
    out, calls = _make(tmp_path, "demo", with_python311=False)
    assert out.returncode != 0 and calls == ""
    assert ("make: Python 3.11 is needed to create .venv (numpy<1.24, which MXNet 1.9.1 "
            "needs, has no wheels for Python 3.12+), and python3.11 is not on PATH.") \
        in out.stderr
    assert "make demo PYTHON=/path/to/python3.11" in out.stderr


def test_python_given_is_used_as_given(tmp_path):
    out, calls = _make(tmp_path, "test", "PYTHON=CHOSEN", with_python311=False)
    assert out.returncode != 0 and calls == "chosen -m venv .venv\n", out.stderr
    again = tmp_path / "again"
    again.mkdir()
    out, calls = _make(again, "test", "PYTHON=CHOSEN")     # python3.11 on PATH too
    assert out.returncode != 0 and calls == "chosen -m venv .venv\n", out.stderr
