"""The package's import graph has no circle, counting imports inside functions too, and
no import goes up the layer table of docs/ARCHITECTURE.md.

Every ``.py`` of ``mx_roi`` (``mx_roi/operators`` through its symlink) is parsed with
``ast``; each ``import`` / ``from ... import`` anywhere in it -- module level, inside a
function, under ``try`` -- that names a module of ``mx_roi`` is an edge.  The implicit
import of a parent package (importing ``mx_roi.cuda.source`` runs ``mx_roi/__init__``
first) is not an edge: Python does it for every module.
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "mx_roi"


def modules(root=ROOT, package=PACKAGE):
    """``{module name: (path, is_package)}`` of every ``.py`` below ``root/package``."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package), followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                found[".".join(parts[:-1] if is_package else parts)] = (
                    os.path.join(dirpath, f), is_package)
    return found


def imported(tree, module, is_package, known):
    """The modules of ``known`` that ``tree`` (the source of ``module``) imports."""
    here = module if is_package else module.rpartition(".")[0]
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import mod` imports pkg.mod; else pkg itself
                edges.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {e for e in edges if e in known and e != module}


def import_graph(root=ROOT, package=PACKAGE):
    known = modules(root, package)
    graph = {}
    for name, (path, is_package) in known.items():
        with open(path, encoding="utf-8") as f:
            graph[name] = imported(ast.parse(f.read(), path), name, is_package, known)
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "mx_roi.operators.roi_align" in graph and "mx_roi.cuda.source" in graph
    assert cycles(graph) == []


def layers(known, path=os.path.join(ROOT, "docs", "ARCHITECTURE.md")):
    """``{module: row index}`` from the table under "## Layers" (row 0 = the top).  A cell
    names modules in backticks: ``mx_roi.x.y``, or a bare ``z`` after it for
    ``mx_roi.x.z``; a package covers its submodules."""
    with open(path, encoding="utf-8") as f:
        text = f.read().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| Layer")]
    found = {}
    for index, cell in enumerate(rows):
        parent = PACKAGE
        for token in re.findall(r"`([A-Za-z_][\w.]*)`", cell):
            name = token if token.startswith(PACKAGE + ".") else f"{parent}.{token}"
            if name in known:
                found[name] = index
                parent = name.rpartition(".")[0]
    for name in known:  # submodules of a listed package
        package = next((p for p in sorted(found, key=len, reverse=True)
                        if name.startswith(p + ".")), None)
        if name not in found and package:
            found[name] = found[package]
    return found


def test_no_import_goes_up_the_layer_table():
    graph = import_graph()
    layer = layers(graph)
    for must in ("mx_roi.mxpatch", "mx_roi.registry", "mx_roi.onednn", "mx_roi.cuda.loader",
                 "mx_roi.operators.roi_align", "mx_roi.gluon"):
        assert must in layer, must
    upward = sorted(f"{a} -> {b}" for a in graph for b in graph[a]
                    if a in layer and b in layer and layer[b] < layer[a])
    assert upward == []


@pytest.mark.parametrize("source, expected", [
    # a lazy import inside a function closes the circle as well as a top-level one
    ({"a": "from . import b\n", "b": "def f():\n    from .a import x\n"}, [["p.a", "p.b"]]),
    ({"a": "import p.b\n", "b": "def f():\n    import p.c\n", "c": "from .a import y\n"},
     [["p.a", "p.b", "p.c"]]),
    # importing the package itself from a submodule it imports is a circle too
    ({"__init__": "from . import a\n", "a": "def f():\n    import p\n"}, [["p", "p.a"]]),
    ({"a": "from . import b\n", "b": "import os\nfrom .c import z\n", "c": ""}, []),
])
def test_the_check_finds_lazy_cycles(tmp_path, source, expected):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in source.items():
        (pkg / f"{name}.py").write_text(text)
    assert cycles(import_graph(str(tmp_path), "p")) == expected
