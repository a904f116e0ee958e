"""The agent's spans to its daemon, which keeps them beside its own (no collector needed).

``POST {daemon_url}/internal/v1/replicas/{replica_id}/spans`` with
``{"spans": [...]}`` (the shape of :func:`llmgw_slurm.tracing.store.span_record`),
signed with the replica secret as reports are, so that only this replica's
agent can add to this replica's trace. The batch span processor calls
:meth:`DaemonSpanExporter.export` on its own thread: the call is a plain
blocking HTTP request, and a failure drops the batch (the agent's tracing
wrapper logs it, rate-limited); it never reaches the agent's work.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from llmgw_slurm.auth.secrets import sign_report
from llmgw_slurm.tracing.store import span_record

__all__ = ["MAX_BODY", "DaemonSpanExporter", "batches"]

# Under the internal API's 64 KiB body limit.
MAX_BODY = 60_000


def batches(records: Sequence[dict[str, object]], limit: int = MAX_BODY) -> Iterator[bytes]:
    """JSON bodies of at most ``limit`` bytes (a span alone over it is cut to its name)."""
    chunk: list[str] = []
    size = 20
    for rec in records:
        text = json.dumps(rec, separators=(",", ":"))
        if len(text) + 20 > limit:
            text = json.dumps(rec | {"attrs": {}, "events": []}, separators=(",", ":"))
        if chunk and size + len(text) + 1 > limit:
            yield ('{"spans":[' + ",".join(chunk) + "]}").encode()
            chunk, size = [], 20
        chunk.append(text)
        size += len(text) + 1
    if chunk:
        yield ('{"spans":[' + ",".join(chunk) + "]}").encode()


class DaemonSpanExporter(SpanExporter):
    def __init__(
        self, daemon_url: str, replica_id: str, secret: str, timeout_s: float = 10.0
    ) -> None:
        # The first daemon of several (spans are best effort; reports go to any).
        first = daemon_url.split(",", 1)[0].strip().rstrip("/")
        self.url = f"{first}/internal/v1/replicas/{replica_id}/spans"
        self.replica_id = replica_id
        self._secret = secret
        self._timeout = timeout_s

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = True
        for raw in batches([span_record(s) for s in spans]):
            auth = sign_report(self._secret, self.replica_id, int(time.time()), raw)
            req = urllib.request.Request(  # noqa: S310 (the daemon's own http(s) URL)
                self.url,
                data=raw,
                method="POST",
                headers={"Authorization": auth, "Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=self._timeout) as resp:  # noqa: S310
                    ok = ok and resp.status == 200
            except (urllib.error.URLError, OSError, ValueError):
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
