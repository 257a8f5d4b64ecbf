"""The ``mx-roi-ops`` directive: one section per registered op, generated from the registry.

For every op of :data:`mx_roi.registry.REGISTERED` (so a new op appears without editing
a page): its class docstring (the op's semantics), its picture when ``docs/<module>.png``
exists, and a parameter table read from its parameter struct (name, type, default, the
field's doc line) with the positional order of every entry point.
"""
import dataclasses
import os

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """``(name, type, default, meaning)`` of every field of the op's parameter struct."""
    rows = []
    for f in dataclasses.fields(op_cls.param_cls):
        required = f.default is dataclasses.MISSING
        rows.append((f.name, type_name(f.type), "required" if required else repr(f.default),
                     f.metadata.get("doc", "")))
    return rows


def op_section(op_cls):
    """reStructuredText of one op's section."""
    name = op_cls.name
    module = op_cls.__module__
    lines = [f".. _op-{name}:", "", name, "-" * len(name), "",
             f".. autoclass:: {module}.{op_cls.__qualname__}", "   :no-members:", ""]
    picture = os.path.join(DOCS, module.rpartition(".")[2] + ".png")
    if os.path.exists(picture):
        lines += [f".. image:: ../{os.path.basename(picture)}", f"   :alt: {name}", ""]
    order = ", ".join(op_cls.positional_order())
    lines += [f"``mx.nd.Custom(data, rois, op_type='{name}', ...)``, "
              f"``mx_roi.nd.{name}(data, rois, {order})``, the same in ``mx_roi.sym`` and "
              f"``mx_roi.gluon.ops(F)``, and the block ``mx_roi.gluon.{name}({order})``.", "",
              ".. list-table:: Parameters",
              "   :header-rows: 1", "",
              "   * - name", "     - type", "     - default", "     - meaning"]
    for row in param_rows(op_cls):
        lines.append(f"   * - ``{row[0]}``")
        lines += [f"     - {_cell(text)}" for text in (f"``{row[1]}``", f"``{row[2]}``", row[3])]
    return lines + [""]


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
