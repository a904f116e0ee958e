"""The daemon's recent traces, kept in memory so that no collector is needed to read them.

A span processor on the daemon's tracer provider (beside the OTLP exporter
when one is configured) records every span the daemon makes; agents send
theirs through the internal API (``POST /internal/v1/replicas/{id}/spans``,
signed as reports are), and :meth:`TraceStore.add_remote` takes them, but
only into the trace of that replica's own start: an agent cannot write into
another replica's trace.

The store is bounded, whatever the daemon runs for: at most ``max_spans``
spans in all (each with at most :data:`MAX_ATTRS` attributes of at most
:data:`MAX_VALUE` characters and the latest :data:`MAX_EVENTS` events, about
:data:`MAX_SPAN_BYTES` of them in all: with Python's overhead, 20,000 spans
are at most about 150 MB, and about 20 MB as the daemon and agents fill
them, bench/status_page.py) and at most ``max_spans_per_trace`` in one
trace. Over the bound, whole traces go, oldest
first, the reconcile passes that started no replica before the traces of
replica starts (those are what ``llmgw-admin trace`` and the status page show).

A span is a plain dict (the same shape over the wire and in ``--json``)::

    {"trace_id": hex32, "span_id": hex16, "parent_id": hex16 | "", "name": str,
     "service": str, "start": epoch s, "end": epoch s | None (still open),
     "status": "" | "ok" | "error", "attrs": {str: scalar | [str]},
     "events": [{"name": str, "t": epoch s, "attrs": {...}}]}
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import StatusCode

__all__ = [
    "MAX_ATTRS",
    "MAX_EVENTS",
    "MAX_SPAN_BYTES",
    "MAX_VALUE",
    "SpanRejected",
    "TraceStore",
    "span_record",
]

MAX_ATTRS = 32
MAX_EVENTS = 64
MAX_VALUE = 300
# About the most a span's attributes and events take, whatever is sent.
MAX_SPAN_BYTES = 4096
# A start trace is one whose spans include a replica's start.
START_NAMES = ("replica.start", "replica.start (adopted)", "replica.start (requeued)")
_HEX = frozenset("0123456789abcdef")


class SpanRejected(ValueError):
    """A span an agent sent that the store does not take (says why)."""


def _value(v: Any) -> Any:
    if isinstance(v, bool | int | float):
        return v
    if isinstance(v, str):
        return v[:MAX_VALUE]
    if isinstance(v, list | tuple):
        return [str(x)[:MAX_VALUE] for x in v[:16]]
    return str(v)[:MAX_VALUE]


def _attrs(a: Mapping[str, Any] | None) -> dict[str, Any]:
    if not a:
        return {}
    return {str(k)[:100]: _value(v) for k, v in list(a.items())[:MAX_ATTRS]}


def _size(attrs: Mapping[str, Any]) -> int:
    """About the bytes a record's attributes take (keys and text; 16 for a number)."""
    n = 0
    for k, v in attrs.items():
        n += len(k) + (
            sum(len(x) for x in v) if isinstance(v, list) else len(v) if isinstance(v, str) else 16
        )
    return n


def _fit(rec: dict[str, Any]) -> dict[str, Any]:
    """Cut a record to :data:`MAX_SPAN_BYTES`: events go first (Slurm's, then the
    latest, kept), then attributes (the first kept)."""
    budget = MAX_SPAN_BYTES - _size(rec["attrs"])
    if budget < 0:
        kept: dict[str, Any] = {}
        room = MAX_SPAN_BYTES
        for k, v in rec["attrs"].items():
            room -= _size({k: v})
            if room < 0:
                break
            kept[k] = v
        rec["attrs"], rec["events"], budget = kept, [], 0
    # Slurm's state changes before the rest (the start waterfall's queue rows),
    # then the latest first.
    order = sorted(
        range(len(rec["events"])),
        key=lambda i: (not rec["events"][i]["name"].startswith("slurm."), -i),
    )
    kept_i = []
    for i in order:
        e = rec["events"][i]
        budget -= len(e["name"]) + 16 + _size(e["attrs"])
        if budget < 0:
            break
        kept_i.append(i)
    rec["events"] = [rec["events"][i] for i in sorted(kept_i)]
    return rec


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A span (open or ended) as the store keeps it."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    code = span.status.status_code
    return _fit(
        {
            "trace_id": f"{ctx.trace_id:032x}",
            "span_id": f"{ctx.span_id:016x}",
            "parent_id": f"{parent.span_id:016x}" if parent is not None else "",
            "name": span.name,
            "service": str(span.resource.attributes.get("service.name", "")),
            "start": (span.start_time or 0) / 1e9,
            "end": span.end_time / 1e9 if span.end_time else None,
            "status": {StatusCode.OK: "ok", StatusCode.ERROR: "error"}.get(code, ""),
            "attrs": _attrs(span.attributes),
            "events": [
                {"name": e.name, "t": e.timestamp / 1e9, "attrs": _attrs(e.attributes)}
                for e in list(span.events)[-MAX_EVENTS:]
            ],
        }
    )


def _hex(v: object, n: int, what: str) -> str:
    if not isinstance(v, str) or len(v) != n or not set(v) <= _HEX:
        raise SpanRejected(f"{what} must be {n} lowercase hex digits, got {v!r:.60}")
    return v


def _time(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1e11:
        raise SpanRejected(f"{what} must be a time in seconds since the epoch, got {v!r:.60}")
    return float(v)


def _checked(raw: object) -> dict[str, Any]:
    """A span from an agent, validated and cut to the store's limits."""
    if not isinstance(raw, dict):
        raise SpanRejected("each span must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SpanRejected("a span needs a name")
    start = _time(raw.get("start"), "start")
    end = _time(raw.get("end"), "end")
    events = raw.get("events") or []
    if not isinstance(events, list):
        raise SpanRejected("events must be a list")
    parent = raw.get("parent_id") or ""
    return _fit(
        {
            "trace_id": _hex(raw.get("trace_id"), 32, "trace_id"),
            "span_id": _hex(raw.get("span_id"), 16, "span_id"),
            "parent_id": _hex(parent, 16, "parent_id") if parent else "",
            "name": name[:200],
            "service": str(raw.get("service") or "llmgw-agent")[:100],
            "start": start,
            "end": max(end, start),
            "status": raw.get("status") if raw.get("status") in ("ok", "error") else "",
            "attrs": _attrs(raw.get("attrs") if isinstance(raw.get("attrs"), dict) else None),
            "events": [
                {
                    "name": str(e.get("name"))[:200],
                    "t": _time(e.get("t"), "event time"),
                    "attrs": _attrs(e.get("attrs") if isinstance(e.get("attrs"), dict) else None),
                }
                for e in events[-MAX_EVENTS:]
                if isinstance(e, dict)
            ],
        }
    )


class _Trace:
    __slots__ = ("ended", "is_start", "open")

    def __init__(self) -> None:
        self.ended: dict[str, dict[str, Any]] = {}
        self.open: dict[str, ReadableSpan] = {}
        self.is_start = False


class TraceStore(SpanProcessor):
    """The recent traces of the daemon and its agents, bounded (see the module's text)."""

    def __init__(self, max_spans: int = 20_000, max_spans_per_trace: int = 500) -> None:
        self.max_spans = max_spans
        self.max_spans_per_trace = max_spans_per_trace
        self._traces: collections.OrderedDict[str, _Trace] = collections.OrderedDict()
        self._count = 0
        self.dropped = 0
        # Changes with every span taken, started or ended: readers cache by it.
        self.version = 0
        # The SDK ends spans on whichever thread ends them (the event loop's, and
        # the batch exporter's for none of ours), and the page reads on the loop.
        self._lock = threading.Lock()

    # ---- SpanProcessor ---------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        rec_ctx = span.get_span_context()
        if rec_ctx is None or not rec_ctx.trace_flags.sampled:
            return
        with self._lock:
            t = self._trace(f"{rec_ctx.trace_id:032x}")
            if t is None:
                return
            t.open[f"{rec_ctx.span_id:016x}"] = span
            self.version += 1
            t.is_start = t.is_start or span.name in START_NAMES
            self._count += 1
            self._bound()

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        if ctx is None or not ctx.trace_flags.sampled:
            return
        rec = span_record(span)
        with self._lock:
            t = self._traces.get(rec["trace_id"])
            if t is None or t.open.pop(rec["span_id"], None) is None:
                return  # its trace went over the bound meanwhile
            t.ended[rec["span_id"]] = rec
            self.version += 1

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    # ---- agents' spans ---------------------------------------------------------

    def add_remote(self, replica_id: str, spans: Iterable[object]) -> int:
        """Take an agent's spans into its replica's start trace; how many were taken.

        Raises SpanRejected (saying why) when one is malformed or belongs to a
        trace other than the replica's start (then none is taken).
        """
        checked = [_checked(s) for s in spans]
        with self._lock:
            allowed = self._start_traces_of(replica_id)
            for s in checked:
                if s["trace_id"] not in allowed:
                    raise SpanRejected(
                        f"span {s['name']!r} is in trace {s['trace_id']}, which is not "
                        f"replica {replica_id}'s start"
                    )
            taken = 0
            for s in checked:
                t = self._traces.get(s["trace_id"])
                if t is None or s["span_id"] in t.ended or s["span_id"] in t.open:
                    continue
                if len(t.ended) + len(t.open) >= self.max_spans_per_trace:
                    self.dropped += 1
                    continue
                t.ended[s["span_id"]] = s
                self._traces.move_to_end(s["trace_id"])
                self._count += 1
                self.version += 1
                taken += 1
            self._bound()
        return taken

    def _start_traces_of(self, replica_id: str) -> set[str]:
        out: set[str] = set()
        for tid, t in self._traces.items():
            if not t.is_start:
                continue
            for sp in self._spans_locked(t):
                if sp["name"] in START_NAMES and sp["attrs"].get("llmgw.replica") == replica_id:
                    out.add(tid)
                    break
        return out

    # ---- reading ---------------------------------------------------------------

    def spans(self, trace_id: str) -> list[dict[str, Any]]:
        """The trace's spans, open ones as they are now, by start time."""
        with self._lock:
            t = self._traces.get(trace_id)
            return sorted(self._spans_locked(t), key=lambda s: s["start"]) if t else []

    def starts(self) -> list[dict[str, Any]]:
        """Every replica start span kept (open or ended), oldest first."""
        with self._lock:
            return [
                sp
                for t in self._traces.values()
                if t.is_start
                for sp in self._spans_locked(t)
                if sp["name"] in START_NAMES
            ]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "traces": len(self._traces),
                "spans": self._count,
                "max_spans": self.max_spans,
                "dropped": self.dropped,
            }

    def _spans_locked(self, t: _Trace) -> list[dict[str, Any]]:
        return list(t.ended.values()) + [span_record(s) for s in t.open.values()]

    # ---- the bound -------------------------------------------------------------

    def _trace(self, trace_id: str) -> _Trace | None:
        t = self._traces.get(trace_id)
        if t is None:
            t = self._traces[trace_id] = _Trace()
        elif len(t.ended) + len(t.open) >= self.max_spans_per_trace:
            self.dropped += 1
            return None
        self._traces.move_to_end(trace_id)
        return t

    def _bound(self) -> None:
        if self._count <= self.max_spans:
            return
        # Passes that started nothing first, then the oldest starts; never the
        # trace just written (the last one), which may hold an open start.
        for want_start in (False, True):
            for tid in list(self._traces)[:-1]:
                if self._count <= self.max_spans:
                    return
                t = self._traces[tid]
                if t.is_start == want_start:
                    self._count -= len(t.ended) + len(t.open)
                    self.dropped += len(t.ended) + len(t.open)
                    del self._traces[tid]
