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


def with_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object) with the given top-level fields set, all else unchanged."""
    text = raw.decode("utf-8")
    spans, close = top_level_spans(text)
    edits: list[tuple[int, int, str]] = []
    added: list[str] = []
    for name, value in fields.items():
        encoded = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        if name in spans:
            start, end = spans[name]
            edits.append((start, end, encoded))
        else:
            added.append(f"{json.dumps(name)}:{encoded}")
    if added:
        sep = "," if spans else ""
        edits.append((close, close, sep + ",".join(added)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text.encode("utf-8")
