"""Every fenced ```python block of README.md and docs/*.md runs, as written.

The blocks run in one child process, each in a fresh namespace and in its own empty
working directory: a block may use only what it imports and defines itself (a reader
copies one block, not the page).  A block that needs a GPU must still run on a CPU
machine (``ctx = mx.gpu() if mx.context.num_gpus() else mx.cpu()``).
"""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)

CHILD = textwrap.dedent('''
    import json, os, sys, tempfile, traceback
    blocks = json.load(sys.stdin)
    failed = []
    for where, code in blocks:
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            try:
                exec(compile(code, where, "exec"), {"__name__": "__main__"})
            except BaseException:
                failed.append(where + "\\n" + traceback.format_exc(limit=-3))
    print(json.dumps(failed))
''')


def pages():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path, root=ROOT):
    """``[(file:line, code), ...]``: the fenced ``python`` blocks of one Markdown file."""
    text = path.read_text(encoding="utf-8")
    return [(f"{path.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in FENCE.finditer(text)]


def test_the_extractor_finds_fenced_python_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n```python\nx = 1\n```\n```\nshell\n```\n\n```python\ny = 2\n```\n")
    assert python_blocks(page, tmp_path) == [("page.md:2", "x = 1\n"), ("page.md:9", "y = 2\n")]


def test_every_python_block_of_the_docs_runs():
    blocks = [b for page in pages() for b in python_blocks(page)]
    assert len(blocks) >= 6, [where for where, _ in blocks]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(blocks),
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(failed)
