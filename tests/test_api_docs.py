"""The API reference's op pages come from the registry: each registered op's own class
docstring (its semantics) and its parameter struct's fields, so a new op gets its page
and its parameter table without anyone editing one (docs/api/opdocs.py)."""
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Tuple

from mx_roi import params
from mx_roi.operators.roi_align import ROIAlign
from mx_roi.registry import REGISTERED

ROOT = Path(__file__).resolve().parent.parent
OPDOCS = ROOT / "docs" / "api" / "opdocs.py"
_spec = importlib.util.spec_from_file_location("opdocs", OPDOCS)
opdocs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(opdocs)


def test_every_registered_op_states_its_semantics_in_its_own_class_docstring():
    for name, cls in REGISTERED.items():
        doc = cls.__dict__.get("__doc__") or ""
        assert len(doc.split()) >= 40, f"{name}: the class docstring is the op's semantics"
        assert f"(R, {cls.rois_columns})" in doc and "batch" in doc, name


def test_each_op_section_has_its_docstring_and_every_field_of_its_struct():
    for name, cls in REGISTERED.items():
        text = "\n".join(opdocs.op_section(cls))
        assert f".. autoclass:: {cls.__module__}.{cls.__qualname__}" in text
        for f in dataclasses.fields(cls.param_cls):
            assert f"   * - ``{f.name}``" in text, (name, f.name)
            default = "required" if f.default is dataclasses.MISSING else repr(f.default)
            assert f"``{default}``" in text, (name, f.name)
        assert ", ".join(cls.positional_order()) in text


@dataclasses.dataclass(frozen=True)
class _WideParam(params.ROIAlignParam):
    op_name = "WideAlign"
    widen: Tuple[int, int] = params.param_field(params.parse_size2, (1, 2),
                                                "how much wider each bin reads")


class _WideAlign(ROIAlign):
    """A made-up op (never registered): its section is generated like the others."""
    name = "WideAlign"
    param_cls = _WideParam


def test_a_new_op_and_a_new_parameter_appear_without_editing_a_table():
    text = "\n".join(opdocs.op_section(_WideAlign))
    assert "WideAlign\n---------" in text
    assert "   * - ``widen``\n     - ``Tuple[int, int]``\n     - ``(1, 2)``\n" \
           "     - how much wider each bin reads" in text
    assert "mx_roi.nd.WideAlign(data, rois, pooled_size, spatial_scale" in text


# ---- each op's example (docs/api/examples/<module>.py, shown on its page) --------------

EXPECTED = re.compile(r"^print\(.*\)\s+# -> (.*)$")

RUN_EXAMPLES = textwrap.dedent('''
    import contextlib, io, json, os, sys, tempfile, traceback
    results = {}
    for path in json.load(sys.stdin):
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
            os.chdir(tmp)
            try:
                code = open(path, encoding="utf-8").read()
                exec(compile(code, path, "exec"), {"__name__": "__main__"})
                error = ""
            except BaseException:
                error = traceback.format_exc(limit=-3)
        results[path] = [out.getvalue(), error]
    print(json.dumps(results))
''')


def expected_output(path):
    """The lines an example prints: each ``print(...)  # -> TEXT`` line's TEXT."""
    return [m.group(1).strip() for line in Path(path).read_text(encoding="utf-8").splitlines()
            if (m := EXPECTED.match(line.strip()))]


def test_every_registered_op_has_an_example_on_its_page():
    for name, cls in REGISTERED.items():
        path = Path(opdocs.example_path(cls))
        assert path.is_file(), f"{name}: no example {path}"
        code = path.read_text(encoding="utf-8")
        assert re.search(rf"mx_roi\.(nd|sym|gluon)\.{name}\(", code), name
        assert expected_output(path), f"{name}: the example prints nothing it checks"
        text = "\n".join(opdocs.op_section(cls))
        assert f".. literalinclude:: examples/{path.name}\n   :language: python" in text
    assert "Example:" not in "\n".join(opdocs.op_section(_WideAlign))  # none, none shown


def test_the_examples_run_and_print_what_they_say():
    paths = [opdocs.example_path(cls) for cls in REGISTERED.values()]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", RUN_EXAMPLES], input=json.dumps(paths),
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for path in paths:
        printed, error = results[path]
        assert not error, f"{path}\n{error}"
        assert [line.strip() for line in printed.splitlines()] == expected_output(path), path


def test_expected_output_reads_only_checked_prints(tmp_path):
    page = tmp_path / "x.py"
    page.write_text("x = 1\nprint(x)  # -> 1\nprint(x)\n    print(x + 1)  # -> 2\n")
    assert expected_output(page) == ["1", "2"]


def test_each_op_section_states_its_inputs_and_the_rois_gradient():
    for name, cls in REGISTERED.items():
        text = "\n".join(opdocs.op_section(cls))
        inputs = ", ".join(cls.inputs)
        assert f"``mx_roi.nd.{name}({inputs}, {', '.join(cls.positional_order())})``" in text
        assert f"``rois`` (R, {cls.rois_columns}) = ``{cls.rois_layout}``" in text
        grad = "the rois get a gradient" if cls.differentiates_rois else \
            "the rois get a zero gradient"
        assert grad in text, name
    text = "\n".join(opdocs.op_section(REGISTERED["DeformablePSROIPooling"]))
    assert "``mx_roi.nd.DeformablePSROIPooling(data, rois, trans, spatial_scale," in text
    assert "``trans`` (see above)" in text
    text = "\n".join(opdocs.op_section(REGISTERED["ROIAlign"]))
    assert "   * - ``position_sensitive``\n     - ``bool``\n     - ``False``" in text


def test_the_operators_page_names_every_op_that_differs_from_the_common_rule():
    """docs/api/ops.rst states the common rule ((R, 5) rois, data and rois only, zero
    rois gradient) and names each exception; a new exception must be named there."""
    intro = (ROOT / "docs" / "api" / "ops.rst").read_text(encoding="utf-8")
    intro = " ".join(intro.split())
    for name, cls in REGISTERED.items():
        if cls.rois_columns != 5:
            assert f"(R, {cls.rois_columns}) rotated boxes for {name}" in intro, name
        for extra in cls.inputs[2:]:
            assert f"{name} takes a third input, ``{extra}``" in intro, name
        if cls.differentiates_rois:
            assert f"a zero gradient except in {name}" in intro, name
