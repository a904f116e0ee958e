"""An engine's SSE stream on its way to the client: split into events, its usage read.

Events go out as soon as they are complete; the only bytes held back are an
event's incomplete tail, which the client could not use anyway. The usage-only
chunk the gateway asked for (and the client did not) is dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ResponsesRelay", "SseRelay"]

USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')
# A "usage" key with something other than null: every event that can carry
# token counts has one. A JSON value that begins with "n" is null; a class,
# not a lookahead, so that the spaces before "null" cannot be given back to
# let it through (and the search runs at half the lookahead's cost).
USAGE_SET = re.compile(rb'"usage"\s*:\s*[^\sn]')


class SseRelay:
    """Splits an SSE byte stream into events, reads usage, drops unasked usage chunks."""

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of what came so far, as one piece; an incomplete one waits."""
        buf = self._buf + chunk if self._buf else chunk
        m = USAGE_SET.search(buf)
        if m is None and buf.endswith((b"\n\n", b"\r\n\r\n")):
            # The common case, a read of whole events with no usage in it (or
            # only "usage": null), passes as it is, with no look for where its
            # events end: most reads of a stream hold one event.
            self._buf = b""
            return buf
        crlf = b"\r" in buf  # the rarer separator is looked for only when it can be there
        out: list[bytes] = []
        start = 0  # the first byte not passed on or dropped yet
        # Only an event with a usage object in it is looked at; the events
        # around it pass in runs, as they came, never split one by one: a
        # read of a whole answer holds dozens of events and one usage event.
        while m is not None:
            begin = _last_end(buf, start, m.start(), crlf)
            end = _first_end(buf, m.start(), crlf)
            if end < 0:
                break  # that event is not whole yet
            if not self._keep(buf[begin:end]):
                out.append(buf[start:begin])
                start = end
            m = USAGE_SET.search(buf, end)
        last = _last_end(buf, start, len(buf), crlf)
        self._buf = buf[last:]
        if not out:
            return buf[:last]  # the whole of buf (no copy) when it ends an event
        out.append(buf[start:last])
        return b"".join(out)

    def rest(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        # Parsing every chunk's JSON would cost more than relaying it; only
        # events that carry a usage object are read.
        if b'"usage"' not in event or USAGE_NULL.search(event):
            return True
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                return True
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if self.strip and obj.get("choices") == []:
                    return False
        return True


class ResponsesRelay(SseRelay):
    """The SSE relay for ``/v1/responses``: usage and the response id come in
    the ``response.completed`` event, inside its ``response`` object."""

    def __init__(self) -> None:
        super().__init__(strip_usage_chunk=False)
        self.response_id: str | None = None

    def _keep(self, event: bytes) -> bool:
        # Called only for events with a usage object in them (see SseRelay.feed).
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            resp = obj.get("response") if isinstance(obj, dict) else None
            if not isinstance(resp, dict):
                continue
            if isinstance(resp.get("usage"), dict):
                self.usage = resp["usage"]
            if isinstance(resp.get("id"), str):
                self.response_id = resp["id"]
        return True


def _last_end(buf: bytes, start: int, stop: int, crlf: bool) -> int:
    """Where the last blank line within ``buf[start:stop]`` ends (``start``: none)."""
    i = buf.rfind(b"\n\n", start, stop)
    end = i + 2 if i >= 0 else start
    if crlf and (j := buf.rfind(b"\r\n\r\n", start, stop)) >= 0:
        end = max(end, j + 4)
    return end


def _first_end(buf: bytes, start: int, crlf: bool) -> int:
    """Where the first blank line from ``start`` on ends (-1: none yet)."""
    i = buf.find(b"\n\n", start)
    if crlf and (j := buf.find(b"\r\n\r\n", start)) >= 0 and (i < 0 or j < i):
        return j + 4
    return i + 2 if i >= 0 else -1
