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
# token counts has one (possessive, so that the spaces before "null" are not
# given back to let the lookahead pass).
USAGE_SET = re.compile(rb'"usage"\s*+:\s*+(?!null)')


class SseRelay:
    """Splits an SSE byte stream into events, reads usage, drops unasked usage chunks."""

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if (
            not self._buf
            and chunk.endswith((b"\n\n", b"\r\n\r\n"))
            and USAGE_SET.search(chunk) is None
        ):
            # The common case, a chunk of whole events with no usage in it
            # (or only "usage": null), passes as it is: splitting it into
            # events would cost more than the relay itself.
            return chunk
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        # Events are kept in runs: only one with a usage object in it is
        # looked at, and a dropped one ends a run (a burst of many events, the
        # whole answer in one read, has one usage event among dozens).
        run = 0
        m = USAGE_SET.search(buf)
        u = m.start() if m else -1
        # The next separator of each kind, -1 for none: each is searched for
        # again only once passed, so that a chunk of many events is scanned
        # once, not once per event.
        i = buf.find(b"\n\n")
        j = buf.find(b"\r\n\r\n")
        while i >= 0 or j >= 0:
            end = i + 2 if j < 0 or (0 <= i < j) else j + 4
            if 0 <= u < end:
                if not self._keep(buf[start:end]):
                    out.append(buf[run:start])
                    run = end
                m = USAGE_SET.search(buf, end)
                u = m.start() if m else -1
            start = end
            if 0 <= i < start:
                i = buf.find(b"\n\n", start)
            if 0 <= j < start:
                j = buf.find(b"\r\n\r\n", start)
        self._buf = buf[start:]
        if not out:
            return buf[:start] if start < len(buf) else buf
        out.append(buf[run:start])
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
