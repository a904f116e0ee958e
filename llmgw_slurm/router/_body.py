"""JSON bodies: parsed fast, and one top-level field rewritten with every other byte as it was.

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

import orjson

__all__ = ["loads", "top_level_spans", "with_fields"]

_WS = re.compile(r"[ \t\n\r]*")
_decoder = json.JSONDecoder()
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
# Well under json's depth limit (the interpreter's recursion limit, 1,000,
# less the stack in use): fewer openings than this cannot nest deeper.
_MAX_OPENINGS = 400


def loads(raw: bytes) -> Any:
    """``raw`` (UTF-8) parsed as the standard library's json parses it.

    orjson when it would give the same: it parses a request or an answer
    several times faster, and every body passes through here twice. json
    for the rest, so that the result, and the error for a body that is not
    JSON, are json's: what orjson refuses (invalid JSON, and NaN, 1e400 or a
    lone surrogate, which json takes), and what it reads otherwise, looked
    for in the bytes (cheaper than telling which are in strings):
    - 19 digits in a row: orjson reads an integer past 64 bits as a float;
    - 400 brackets or more: orjson nests without a limit, where json refuses
      (RecursionError) what nests deeper than about a thousand levels."""
    if raw.count(b"[") + raw.count(b"{") < _MAX_OPENINGS and _LONG_DIGITS.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw.decode("utf-8"))


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
