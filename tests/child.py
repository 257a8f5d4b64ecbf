"""A test's code run in a child Python process -- where a defect could abort the process,
or the code needs a fresh one (its own environment, a library loaded once) -- and the
JSON the child prints on its last ``RESULT <json>`` line."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_result(code, *args, env=None, drop=(), timeout=300):
    """Runs ``python -c code *args`` from the repository root (``mx_roi`` and ``tests``
    importable), with ``env`` added to this environment and the names in ``drop`` removed.
    Returns the JSON of the child's last ``RESULT `` line; skips the test when the child's
    output starts with ``SKIP`` (its reason); fails it, with the child's output, when the
    child exits non-zero or prints no result."""
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.update(env or {})
    for name in drop:
        full.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-3000:],
                                           proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])
