"""Graphs MXNet writes with raw control characters in attribute values (mx_roi.symbol_json):
mx_roi reads them and hands them back as MXNet reads them, through the oneDNN guard of a
Custom node, the loaders' check and a graph's round trip."""
import ctypes

import mxnet as mx
import numpy as np
import pytest
from mxnet.base import _LIB, SymbolHandle, c_str, check_call

import mx_roi
from mx_roi import symbol_json
from mx_roi.onednn import onednn_enabled

# every control character, both quotes, a backslash before characters an escape would
# start with, text that looks like an escape, non-ASCII (a no-break space, an em space,
# a character beyond the BMP)
AWKWARD = ["".join(chr(c) for c in range(1, 32)), 'a"b\'c', "\\", "\\u0037", "\\n\\",
           "x\\\\u00", "\xa0\u2003\U0001f600", "\b\f\\b\\f"]


def _from_json(text):
    handle = SymbolHandle()
    check_call(_LIB.MXSymbolCreateFromJSON(c_str(text), ctypes.byref(handle)))
    return mx.sym.Symbol(handle)


@pytest.mark.parametrize("value", AWKWARD)
def test_parse_then_dump_gives_mxnet_the_same_strings(value):
    """MXNet's text of a graph holding ``value`` as an attribute parses, and what dump
    writes MXNet reads back to the same attribute and the same text.  Planted: strict
    json (JSONDecodeError on the control characters) or plain json.dumps (MXNet: "unknown
    string escape")."""
    sym = mx.sym.var("x", attr={"k": value})
    text = sym.tojson()
    graph = symbol_json.parse(text)
    assert graph["nodes"][0]["attrs"]["k"] == value
    back = _from_json(symbol_json.dump(graph))
    assert back.attr("k") == value
    assert back.tojson() == text


def _loaded(pooled_size):
    """A graph text as MXNet writes it (the control character raw), a Convolution feeding
    a Custom ROIAlign node, through the patched ``load_json`` (the guard: parse, rewrite,
    dump), bound and run."""
    d, r = mx.sym.var("data"), mx.sym.var("rois")
    c = mx.sym.Convolution(d, kernel=(1, 1), num_filter=3, no_bias=True, name="conv")
    text = mx.sym.contrib.ROIAlign(c, r, pooled_size=(7, 7), spatial_scale=0.5,
                                   name="pool").tojson()
    text = text.replace('"op": "_contrib_ROIAlign"', '"op": "Custom"').replace(
        '"pooled_size": "(7, 7)"', '"op_type": "ROIAlign", "pooled_size": "%s"' % pooled_size)
    assert pooled_size in text
    sym = mx.sym.load_json(text)
    assert "clip" in [n["op"] for n in symbol_json.parse(sym.tojson())["nodes"]]
    e = sym.simple_bind(mx.cpu(), data=(1, 3, 8, 8), rois=(1, 5))
    e.arg_dict["data"][:] = np.arange(192).reshape(1, 3, 8, 8)
    e.arg_dict["conv_weight"][:] = np.eye(3).reshape(3, 3, 1, 1)
    e.arg_dict["rois"][:] = np.array([[0, 1, 1, 9, 9]])
    return e.forward()[0].asnumpy()


@pytest.mark.skipif(not onednn_enabled(), reason="the guard rewrites graphs with oneDNN on")
@pytest.mark.parametrize("spelling", ["\x1c7", "7\x1f", "\x0c7", "\xa07", "\u20037"])
def test_loaded_custom_node_with_a_control_character_in_a_parameter_runs(spelling):
    """A parameter both parsers read as 7 despite a control character or a Unicode space
    (str.strip's whitespace) loads through the guard's rewrite and computes what '7'
    does.  Planted: strict json in the guard (JSONDecodeError at load_json); plain
    json.dumps (MXNet refuses its escapes)."""
    np.testing.assert_array_equal(_loaded(spelling), _loaded("7"))


def test_constructed_custom_node_with_a_control_character_binds():
    """mx.sym.Custom with such a parameter, straight on a variable: simple_bind (which
    reads the graph for the guard) works.  Planted (strict json): JSONDecodeError."""
    d, r = mx.sym.var("data"), mx.sym.var("rois")
    s = mx.sym.Custom(d, r, op_type="ROIAlign", pooled_size="\x1c7", spatial_scale="0.5")
    e = s.simple_bind(mx.cpu(), data=(1, 3, 8, 8), rois=(1, 5))
    assert e.forward()[0].shape == (1, 3, 7, 7)


def test_check_symbol_json_reads_a_saved_graph_with_control_characters(tmp_path):
    """mx_roi.gluon.check_symbol_json (and imports) read a file MXNet saved with a raw
    control character in an attribute."""
    d, r = mx.sym.var("data"), mx.sym.var("rois")
    s = mx.sym.Custom(d, r, op_type="ROIAlign", pooled_size="\x1c7", spatial_scale="0.5")
    path = str(tmp_path / "g-symbol.json")
    s.save(path)
    assert "\x1c" in open(path, encoding="utf-8").read()
    assert "ROIAlign" in mx_roi.gluon.check_symbol_json(path)
