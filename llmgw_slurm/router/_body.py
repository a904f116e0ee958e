"""Rewrite one top-level field of a JSON object and leave every other byte as it was.

Re-serializing a parsed body would change more than the field: number
spellings (``1e400`` comes back as ``Infinity``, which engines refuse),
duplicate keys, escapes, key order. The router promises to pass bodies on
unchanged except for the fields it owns (``model``, and ``stream_options``
when it asks for usage), so it splices new values into the original text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Set as AbstractSet
from typing import Any

__all__ = ["top_level_spans", "with_fields"]

_WS = re.compile(r"[ \t\n\r]*")
_decoder = json.JSONDecoder()


def _skip(text: str, i: int) -> int:
    m = _WS.match(text, i)
    return m.end() if m else i


def top_level_spans(text: str) -> tuple[dict[str, tuple[int, int]], int]:
    """The span of each top-level value of the JSON object in ``text``, and of its ``}``.

    ``text`` must already be known to be a JSON object (``json.loads`` said
    so); a later duplicate key wins, as it does in ``json.loads``.
    """
    spans: dict[str, tuple[int, int]] = {}
    i = _skip(text, 0)
    if text[i] != "{":
        raise ValueError("not a JSON object")
    i = _skip(text, i + 1)
    if text[i] == "}":
        return spans, i
    while True:
        key, i = _decoder.raw_decode(text, i)
        i = _skip(text, _skip(text, i) + 1)  # past the ':'
        _, end = _decoder.raw_decode(text, i)
        spans[key] = (i, end)
        i = _skip(text, end)
        if text[i] == "}":
            return spans, i
        i = _skip(text, i + 1)  # past the ','


def with_fields(raw: bytes, fields: dict[str, Any], keys: AbstractSet[str] | None = None) -> bytes:
    """``raw`` (a JSON object) with the given top-level fields set, all else unchanged.

    ``keys``: the object's top-level keys, when the caller has parsed it. Fields
    none of them names (a stream's ``stream_options``, most often) are added
    before the closing brace, without finding each value's span: that walk
    decodes every value again, the whole conversation, on every stream."""
    if keys is not None and keys.isdisjoint(fields):
        return _added_at_end(raw, fields, bool(keys))
    text = raw.decode("utf-8")
    spans, close = top_level_spans(text)
    edits: list[tuple[int, int, str]] = []
    added: dict[str, Any] = {}
    for name, value in fields.items():
        if name in spans:
            start, end = spans[name]
            edits.append((start, end, _encoded(value)))
        else:
            added[name] = value
    if added:
        sep = "," if spans else ""
        edits.append((close, close, sep + _members(added)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text.encode("utf-8")


def _added_at_end(raw: bytes, fields: dict[str, Any], others: bool) -> bytes:
    # The object's "}" is its last byte but whitespace: json.loads took it whole.
    close = len(raw.rstrip(b" \t\n\r")) - 1
    added = ("," if others else "") + _members(fields)
    return raw[:close] + added.encode("utf-8") + raw[close:]


def _members(fields: dict[str, Any]) -> str:
    return ",".join(f"{json.dumps(name)}:{_encoded(value)}" for name, value in fields.items())


def _encoded(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
