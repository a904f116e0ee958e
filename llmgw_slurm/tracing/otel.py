"""OpenTelemetry set-up for the daemon and the agent, and the trace-context carriers.

One ``tracing:`` block (:class:`llmgw_slurm.config.TracingConfig`) configures
both processes. Off (the default), :func:`setup_tracing` does nothing at all:
the API's no-op tracer stays in place, no exporter thread starts, and
:func:`inject_env` gives an empty mapping, so no job's environment carries a
trace context. On, spans go through a batch processor to an OTLP exporter.

The standard variables work as the OpenTelemetry SDK defines them, with the
config file winning where both say something: ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS`` /
``..._TRACES_HEADERS``, timeouts, certificates and compression.

Telemetry never breaks the work: an exporter that raises or fails is logged,
at most once a minute, and its spans are dropped.

The job side: the daemon puts the replica's start span in the job's
environment as ``TRACEPARENT``/``TRACESTATE`` (OpenTelemetry's convention for
environment carriers: the W3C trace-context header names, upper case), and
the agent continues from there with :func:`extract_env`.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.base.fsutil import atomic_write
from llmgw_slurm.config import TracingConfig

__all__ = [
    "RateLimitedExporter",
    "context_from_traceparent",
    "extract_env",
    "inject_env",
    "link_from_traceparent",
    "read_trace_marker",
    "setup_tracing",
    "traceparent_of",
    "write_trace_marker",
]

log = logging.getLogger(__name__)

_propagator = TraceContextTextMapPropagator()

# The exporters log every failed export themselves (a collector that is down
# means one warning per batch, every five seconds, forever): these loggers get
# the same once-a-minute limit as our own message.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk._shared_internal",
)


class _RateLimit:
    """At most one message per ``interval`` seconds; counts what it held back."""

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._last = -float("inf")
        self.suppressed = 0
        self._lock = threading.Lock()

    def allow(self) -> tuple[bool, int]:
        with self._lock:
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                held, self.suppressed = self.suppressed, 0
                return True, held
            self.suppressed += 1
            return False, 0


class _RateLimitFilter(logging.Filter):
    def __init__(self, interval: float) -> None:
        super().__init__()
        self._limit = _RateLimit(interval)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        ok, held = self._limit.allow()
        if ok and held:
            record.msg = f"{record.msg} ({held} similar message(s) suppressed)"
        return ok


class RateLimitedExporter(SpanExporter):
    """Wraps an exporter so that its failures are logged (rate-limited), never raised.

    The batch processor calls ``export`` on its own thread; an exception
    there would be logged by the SDK on every batch, and a hanging collector
    must not fill the log of a daemon that serves requests.
    """

    def __init__(self, inner: SpanExporter, *, interval: float = 60.0) -> None:
        self.inner = inner
        self._limit = _RateLimit(interval)
        self.failures = 0

    def _warn(self, what: str) -> None:
        self.failures += 1
        ok, held = self._limit.allow()
        if ok:
            more = f" ({held} more failure(s) since the last message)" if held else ""
            log.warning("tracing: span export failed, spans dropped: %s%s", what, more)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # telemetry must never break the work
            self._warn(f"{type(exc).__name__}: {exc}")
            return SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._warn(f"{len(spans)} span(s) refused or collector unreachable")
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception as exc:
            self._warn(f"shutdown: {exc}")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return bool(self.inner.force_flush(timeout_millis))
        except Exception as exc:
            self._warn(f"flush: {exc}")
            return False


def _http_endpoint(url: str) -> str:
    # Like OTEL_EXPORTER_OTLP_ENDPOINT: a bare collector address gets the
    # signal's path; an address with a path is used as it is.
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        return url.rstrip("/") + "/v1/traces"
    return url


def _make_exporter(cfg: TracingConfig) -> SpanExporter:
    headers = dict(cfg.headers) or None
    if cfg.protocol == "grpc":
        try:
            mod = importlib.import_module("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
        except ImportError:
            raise ConfigError(
                "protocol grpc needs the package opentelemetry-exporter-otlp-proto-grpc, "
                "which is not installed; install it, or use protocol: http/protobuf "
                "(the collector's port 4318)",
                field="tracing.protocol",
            ) from None
        exporter: SpanExporter = mod.OTLPSpanExporter(endpoint=cfg.endpoint, headers=headers)
        return exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = _http_endpoint(cfg.endpoint) if cfg.endpoint else None
    return OTLPSpanExporter(endpoint=endpoint, headers=headers)


def _resource(cfg: TracingConfig, service: str) -> Resource:
    # Precedence: the config file's service_name, then OTEL_SERVICE_NAME, then
    # service.name in OTEL_RESOURCE_ATTRIBUTES, then the process's own name.
    attrs: dict[str, Any] = dict(cfg.resource_attributes)
    env_attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    name = (
        cfg.service_name
        or os.environ.get("OTEL_SERVICE_NAME")
        or ("" if "service.name=" in env_attrs else service)
    )
    if name:
        attrs["service.name"] = name
    return Resource.create(attrs)


def setup_tracing(
    cfg: TracingConfig,
    service: str,
    *,
    exporter: SpanExporter | None = None,
    set_global: bool = True,
    error_interval: float = 60.0,
    local: SpanProcessor | None = None,
) -> TracerProvider | None:
    """Configure tracing from the ``tracing:`` block; None (and nothing done) when off.

    ``service`` names the process when neither the block nor
    ``OTEL_SERVICE_NAME`` does. ``exporter`` replaces the OTLP one (tests).
    ``local`` is a processor that gets every span whether or not the block
    exports (the daemon's trace store, an agent's export to its daemon):
    with one, spans are made even when the block is off. With ``set_global``
    the provider becomes the process's tracer provider, which every
    ``trace.get_tracer("llmgw_slurm")`` then uses. Call ``shutdown()`` on the
    result before exiting, so the last spans leave.
    """
    if not cfg.enabled and local is None:
        return None
    provider = TracerProvider(
        # The ratio is the exporter's business; with no exporter every trace
        # is kept locally (the daemon makes few, and the store is bounded).
        sampler=ParentBased(TraceIdRatioBased(cfg.sampling_ratio if cfg.enabled else 1.0)),
        resource=_resource(cfg, service),
    )
    if local is not None:
        provider.add_span_processor(local)
    if not cfg.enabled:
        log.info("tracing: no exporter; spans kept by %s", type(local).__name__)
        if set_global:
            trace.set_tracer_provider(provider)
        return provider
    inner = exporter if exporter is not None else _make_exporter(cfg)
    provider.add_span_processor(
        BatchSpanProcessor(RateLimitedExporter(inner, interval=error_interval))
    )
    for name in _EXPORTER_LOGGERS:
        lg = logging.getLogger(name)
        if not any(isinstance(f, _RateLimitFilter) for f in lg.filters):
            lg.addFilter(_RateLimitFilter(error_interval))
    if set_global:
        trace.set_tracer_provider(provider)
    log.info(
        "tracing on: service %s, %s to %s, sampling %g",
        provider.resource.attributes.get("service.name"),
        cfg.protocol,
        cfg.endpoint or "the OTEL_EXPORTER_OTLP_* default",
        cfg.sampling_ratio,
    )
    return provider


# ------------------------------------------------------------------- carriers


def inject_env(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """``{"TRACEPARENT": ..., "TRACESTATE": ...}`` for a job's environment.

    Empty when the context holds no valid span (tracing off: the no-op
    tracer's spans are invalid), so that nothing is added to a job.
    """
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return {k.upper(): v for k, v in carrier.items() if v}


def extract_env(environ: Mapping[str, str]) -> otel_context.Context:
    """The context carried by ``TRACEPARENT``/``TRACESTATE`` (an empty one if none)."""
    carrier = {k.lower(): v for k, v in environ.items() if k in ("TRACEPARENT", "TRACESTATE")}
    return _propagator.extract(carrier)


def traceparent_of(span_context: SpanContext) -> str:
    """The W3C ``traceparent`` of a span; "" when it is not a valid one."""
    if not span_context.is_valid:
        return ""
    flags = int(span_context.trace_flags) & 0xFF
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}"


def context_from_traceparent(traceparent: str) -> SpanContext | None:
    """The span context a ``traceparent`` names; None when it does not parse."""
    ctx = _propagator.extract({"traceparent": traceparent})
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None


def link_from_traceparent(traceparent: str, **attrs: str) -> Link | None:
    sc = context_from_traceparent(traceparent)
    return Link(sc, attributes=attrs or None) if sc is not None else None


# A trace marker is a small file that remembers which trace produced
# something on disk (a model job's weights, an engine install), so that a
# replica start that uses it can link to that trace.


def write_trace_marker(path: Path, span_context: SpanContext) -> None:
    """Write ``span_context``'s traceparent to ``path`` (atomic; errors logged, not raised)."""
    tp = traceparent_of(span_context)
    if not tp:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, tp + "\n")
    except OSError as exc:
        log.warning("tracing: cannot write trace marker %s: %s", path, exc)


def read_trace_marker(path: Path) -> SpanContext | None:
    """The span context in a trace marker; None when absent or unreadable."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return context_from_traceparent(text)
