"""The API reference's op pages come from the registry: each registered op's own class
docstring (its semantics) and its parameter struct's fields, so a new op gets its page
and its parameter table without anyone editing one (docs/api/opdocs.py)."""
import dataclasses
import importlib.util
from pathlib import Path
from typing import Tuple

from mx_roi import params
from mx_roi.operators.roi_align import ROIAlign
from mx_roi.registry import REGISTERED

OPDOCS = Path(__file__).resolve().parent.parent / "docs" / "api" / "opdocs.py"
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
