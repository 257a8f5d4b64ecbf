"""MXNet's symbol JSON as Python reads and writes it.

MXNet (dmlc-core's JSON writer) puts control characters of attribute values into the
text raw, which Python's strict ``json`` refuses ("Invalid control character"); and its
reader knows only the escapes ``\\\\ \\" \\n \\r \\t``, so the ``\\u00XX``, ``\\b`` and ``\\f``
that ``json.dumps`` writes are refused there.  Every graph mx_roi parses from MXNet or
hands back to it goes through :func:`parse` and :func:`dump` (a parameter such as
``pooled_size='\\x1c7'``, which both parameter parsers read as 7, made the oneDNN guard
raise a ``JSONDecodeError``).
"""
import json
import re

# an escaped backslash (kept, so that the next character is not taken as an escape), or
# one of the escapes MXNet's reader does not know, which become the raw character
_UNKNOWN_TO_MXNET = re.compile(r"\\(\\|u00[01][0-9a-fA-F]|b|f)")
_RAW = {"b": "\b", "f": "\f"}


def parse(text: str):
    """The graph of ``Symbol.tojson()`` (or a saved symbol file's text) as Python objects;
    raw control characters in strings are read as they are."""
    return json.loads(text, strict=False)


def load(path: str):
    """:func:`parse` of the file at ``path``."""
    with open(path, encoding="utf-8") as f:
        return parse(f.read())


def _unescape(m):
    s = m.group(1)
    if s == "\\":
        return m.group(0)
    return _RAW.get(s) or chr(int(s[1:], 16))


def dump(graph) -> str:
    """``graph`` as text ``MXSymbolCreateFromJSON`` reads back to the same strings: no
    ASCII escapes of non-ASCII characters, control characters raw as MXNet writes them."""
    return _UNKNOWN_TO_MXNET.sub(_unescape, json.dumps(graph, ensure_ascii=False))
