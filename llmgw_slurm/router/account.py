"""Accounting: what one request leaves behind, at one place for every answer.

Each request has a :class:`Tally`, and each of its two ends is closed exactly
once, whatever way the request ends:

- the answer's end (:meth:`Tally.answered`): its status as the client saw it
  (a stream cut short: 502; a client gone: 499), the metrics (count,
  duration, time to the first byte) and the span's end;
- the usage's end (:meth:`Tally.counted`): the tokens the engine reported,
  for the usage store, the token metrics and the key's quota, whose
  reservation is settled to them (or released, when no count came). For a stream
  whose client went away this comes later, when the engine's answer was read
  on to its end (or never, when that was cut: then nothing is counted).

Spans: a request gets one (``llmgw.router.request``) when its client sent a
sampled trace context, or with ``trace_requests: all``; a client's unsampled
context is passed on to the engine as it came, without a span of ours.
Telemetry never breaks the work: a failure to count is logged.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator

from llmgw_slurm.accounting.quota import QuotaBook, Reservation
from llmgw_slurm.accounting.usage import UsageRecord, UsageSink
from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.router import surface
from llmgw_slurm.router.directory import Endpoint
from llmgw_slurm.router.metrics import GatewayMetrics

__all__ = ["Accounting", "Tally"]

log = logging.getLogger(__name__)

_TOKEN_FIELDS = frozenset(
    {"prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens"}
)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Accounting:
    """Where tallies go: the metrics, the usage store, the quota book, the responses' homes."""

    def __init__(
        self, metrics: GatewayMetrics, usage: UsageSink | None, quota: QuotaBook | None,
        responses: surface.ResponseHomes, tracer: trace.Tracer, trace_all: bool,
    ) -> None:
        self.metrics, self.usage, self.quota = metrics, usage, quota
        self.responses, self.tracer, self.trace_all = responses, tracer, trace_all

    def tally(self, endpoint: str, headers: Mapping[str, str], method: str, path: str) -> Tally:
        """A request's tally, with its span (or the client's context to pass on)."""
        if not self.trace_all and not _carries_context(headers):
            return Tally(self, endpoint)  # most requests: nothing to trace or pass on
        ctx = propagate.extract(headers)
        if not self.trace_all and not _sampled(ctx):
            return Tally(self, endpoint, context=ctx)
        span = self.tracer.start_span(
            "llmgw.router.request", context=ctx, kind=trace.SpanKind.SERVER,
            attributes={
                "llmgw.endpoint": endpoint, "http.request.method": method, "url.path": path
            },
        )
        return Tally(self, endpoint, span, trace.set_span_in_context(span, ctx))

    def record(
        self, key: KeyRecord | None, model: str, endpoint: str, usage: dict[str, Any] | None,
        hold: Reservation | None = None,
    ) -> None:
        """Count an answer's tokens for its key (also for other routes on the gateway
        app); what ``hold`` held is settled to them, or released without a count."""
        if usage is None or not _TOKEN_FIELDS.intersection(usage):
            # A transcription's usage is in seconds of audio: no tokens to count.
            if hold is not None:
                hold.release()
            return
        # The Responses API says input/output where the others say prompt/completion.
        prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = _int(usage.get("completion_tokens", usage.get("output_tokens")))
        total = _int(usage.get("total_tokens")) or prompt + completion
        self.metrics.counted(model, prompt, completion)
        if hold is not None and not hold.ended:
            hold.settle(total)
        elif self.quota is not None and key is not None:
            self.quota.spent(key, total)
        if self.usage is not None:
            self.usage.record(UsageRecord(
                ts=time.time(), key_id=key.key_id if key else "", user=key.user if key else "",
                project=key.project if key else "", model=model, endpoint=endpoint,
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=total,
            ))

    def remember(
        self, rid: str, model: str, ep: Endpoint, key: KeyRecord | None, usage: Any
    ) -> None:
        """Where a response of the Responses API lives, for the requests that continue it."""
        owner = key.key_id if key is not None else ""
        counted = isinstance(usage, dict)
        self.responses.remember(rid, surface.Home(model, ep.replica_id, ep.epoch, owner, counted))


class Tally:
    """One request's ends (see the module's docstring)."""

    __slots__ = ("_book", "_counted", "context", "endpoint", "first_byte", "hold", "key",
                 "model", "span", "status", "t0")

    def __init__(
        self, book: Accounting, endpoint: str, span: trace.Span | None = None,
        context: otel_context.Context | None = None,
    ) -> None:
        self._book, self.endpoint, self.span, self.context = book, endpoint, span, context
        self.t0 = time.monotonic()
        self.model: str | None = None
        self.key: KeyRecord | None = None
        self.hold: Reservation | None = None  # what the quotas hold for it, once let in
        self.first_byte: float | None = None
        self.status: int | None = None  # once answered
        self._counted = False

    def set(self, name: str, value: str | float) -> None:
        if self.span is not None:
            self.span.set_attribute(name, value)

    def began(self) -> None:
        """The answer's first byte went to the client."""
        if self.first_byte is None:
            self.first_byte = time.monotonic()

    def answered(self, status: int) -> None:
        if self.status is not None:
            return
        self.status = status
        try:
            self._book.metrics.answered_since(self.model or "_unknown", status, self.t0,
                                              self.first_byte)
        finally:
            if self.span is not None:
                self.span.set_attribute("http.response.status_code", status)
                self.span.end()

    def counted(self, usage: dict[str, Any] | None) -> None:
        """The engine's answer ended (``usage``: its tokens, None: none known); what
        the request held is settled or released here, whatever way it ended."""
        if self._counted:
            return
        self._counted = True
        try:
            if self.model is not None:
                self._book.record(self.key, self.model, self.endpoint, usage, self.hold)
        except Exception:
            log.exception("counting the usage of an answer of %s failed", self.model)
        finally:
            if self.hold is not None:
                self.hold.release()  # no count came (or counting failed): nothing spent

    def count_whole(self, status: int, ctype: str, body: bytes, ep: Endpoint) -> None:
        """Count an engine's whole answer (and remember a response of the Responses API)."""
        parsed = None
        if status == 200 and ctype.startswith("application/json"):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        usage = parsed.get("usage") if isinstance(parsed, dict) else None
        rid = parsed.get("id") if isinstance(parsed, dict) else None
        if self.endpoint == "responses" and isinstance(rid, str) and self.model is not None:
            self._book.remember(rid, self.model, ep, self.key, usage)
        self.counted(usage if isinstance(usage, dict) else None)


def _carries_context(headers: Mapping[str, str]) -> bool:
    """Whether the request has a header the propagator reads (traceparent,
    baggage, ...): without one, extracting gives an empty context, and that
    costs more than the look."""
    # Looked up each time: tracing's set-up may replace the propagator after
    # the app is made. A loop, not any(): the generator costs more than the look.
    for f in _fields(propagate.get_global_textmap()):  # noqa: SIM110
        if f in headers:
            return True
    return False


@functools.lru_cache(maxsize=1)
def _fields(textmap: TextMapPropagator) -> frozenset[str]:
    # A composite propagator builds its set of fields anew on every call.
    return frozenset(f.lower() for f in textmap.fields)


def _sampled(ctx: otel_context.Context) -> bool:
    sc = trace.get_current_span(ctx).get_span_context()
    return sc.is_valid and sc.trace_flags.sampled
