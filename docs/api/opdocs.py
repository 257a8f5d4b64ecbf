"""The ``mx-roi-ops`` directive: one section per registered op, generated from the registry.

For every op of :data:`mx_roi.registry.REGISTERED` (so a new op appears without editing
a page): its class docstring (the op's semantics), its picture when ``docs/<module>.png``
exists, its inputs (the rois' columns, any extra input, whether the rois get a
gradient), the signature of every entry point and a parameter table in the positional
order (:func:`mx_roi.api.param_table`: name, type, default, the field's doc line), and
its example, ``docs/api/examples/<module>.py`` (run by tests/test_api_docs.py).
"""
import inspect
import os

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples")


def _cell(text):
    return text.replace("|", "\\|") or " "


def type_name(annotation) -> str:
    """A field's annotation as written: a string under PEP 563, else the type's name."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def param_rows(op_cls):
    """``(name, type, default, meaning)`` of every parameter, in the positional order."""
    from mx_roi.api import param_table
    return [(name, type_name(kind), "required" if default is inspect.Parameter.empty
             else repr(default), meaning) for name, default, kind, meaning in param_table(op_cls)]


def example_path(op_cls) -> str:
    """``docs/api/examples/<module>.py``: the op's runnable example."""
    return os.path.join(EXAMPLES, op_cls.__module__.rpartition(".")[2] + ".py")


def inputs_line(op_cls) -> str:
    """The op's inputs and what the rois get as a gradient, from its class attributes."""
    extra = [n for n in op_cls.inputs if n not in ("data", "rois")]
    more = "".join(f", ``{n}`` (see above)" for n in extra)
    grad = ("a gradient (:attr:`~mx_roi.registry.RoIOp.differentiates_rois`)"
            if op_cls.differentiates_rois else "a zero gradient")
    return (f"Inputs: ``data`` (N, C, H, W), ``rois`` (R, {op_cls.rois_columns}) = "
            f"``{op_cls.rois_layout}``{more}; the rois get {grad}.")


def op_section(op_cls):
    """reStructuredText of one op's section."""
    name = op_cls.name
    module = op_cls.__module__
    lines = [f".. _op-{name}:", "", name, "-" * len(name), "",
             f".. autoclass:: {module}.{op_cls.__qualname__}", "   :no-members:", ""]
    picture = os.path.join(DOCS, module.rpartition(".")[2] + ".png")
    if os.path.exists(picture):
        lines += [f".. image:: ../{os.path.basename(picture)}", f"   :alt: {name}", ""]
    inputs = ", ".join(op_cls.inputs)
    order = ", ".join(op_cls.positional_order())
    lines += [inputs_line(op_cls), "",
              f"``mx.nd.Custom({inputs}, op_type='{name}', ...)``, "
              f"``mx_roi.nd.{name}({inputs}, {order})``, the same in ``mx_roi.sym`` and "
              f"``mx_roi.gluon.ops(F)``, and the block ``mx_roi.gluon.{name}({order})``, "
              f"called as ``block({inputs})``.", "",
              ".. list-table:: Parameters",
              "   :header-rows: 1", "",
              "   * - name", "     - type", "     - default", "     - meaning"]
    for row in param_rows(op_cls):
        lines.append(f"   * - ``{row[0]}``")
        lines += [f"     - {_cell(text)}" for text in (f"``{row[1]}``", f"``{row[2]}``", row[3])]
    lines.append("")
    if os.path.exists(example_path(op_cls)):
        lines += ["Example:", "",
                  f".. literalinclude:: examples/{os.path.basename(example_path(op_cls))}",
                  "   :language: python", ""]
    return lines


class OpsDirective(SphinxDirective):
    """``.. mx-roi-ops::``: the sections of every registered op, in registry order."""

    has_content = False

    def run(self):
        from mx_roi.registry import REGISTERED
        text = []
        for op_cls in REGISTERED.values():
            text += op_section(op_cls)
        container = nodes.container()
        nested_parse_with_titles(self.state, StringList(text, source="mx_roi.registry"),
                                 container)
        return container.children


def setup(app):
    app.add_directive("mx-roi-ops", OpsDirective)
    return {"parallel_read_safe": True, "version": "1"}
