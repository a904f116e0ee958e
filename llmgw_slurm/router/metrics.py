"""The gateway's Prometheus metrics, in a registry of its own.

Each app gets its own ``CollectorRegistry``: the default global one would make
two gateways in one process (tests, benchmarks) collide on metric names.

``/metrics`` tells nobody what they may not see (:meth:`GatewayMetrics.exposition`):
a series whose ``model`` label names a model the caller may not use (the
catalog's access rules) is left out, as the model is left out of
``/v1/models``; the admin token or ``router.metrics_token_file``'s token
sees every series (what Prometheus should scrape with).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from llmgw_slurm.auth.secrets import AdminToken
from llmgw_slurm.router.directory import ModelDirectory

__all__ = ["GatewayMetrics", "tokens_gate"]

log = logging.getLogger(__name__)

# From 5 ms (a warm short answer) to 10 min (a long generation or a held
# request that waited for a cold start).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Cold starts: queueing in Slurm plus loading weights, seconds to an hour.
_COLD_START_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class _ReplicaCollector(Collector):
    """Replicas by model and state, read from the directory at scrape time."""

    def __init__(self, directory: ModelDirectory) -> None:
        self._directory = directory

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "llmgw_replicas", "Replicas by model and state.", labels=["model", "state"]
        )
        for m in self._directory.models():
            for state, n in sorted(m.replicas.items()):
                g.add_metric([m.name, state], n)
        yield g


def tokens_gate(*tokens: AdminToken) -> Callable[[str], bool]:
    """Whether a presented bearer token is one of ``tokens`` (files read as they
    change; one that cannot be read matches nothing, and says why in the log)."""

    def gate(presented: str) -> bool:
        for t in tokens:
            try:
                if t.matches(presented):
                    return True
            except OSError as exc:
                log.warning("metrics: cannot read the token file %s: %s", t.path, exc)
        return False

    return gate


class _Visible:
    """The registry as one caller may see it: series of models it may not use left out."""

    def __init__(self, registry: CollectorRegistry, visible: Callable[[str], bool]) -> None:
        self._registry = registry
        self._visible = visible

    def collect(self) -> Iterator[Metric]:
        seen: dict[str, bool] = {}
        for family in self._registry.collect():
            kept = []
            for sample in family.samples:
                model = sample.labels.get("model")
                if model is not None and model not in seen:
                    seen[model] = self._visible(model)
                if model is None or seen[model]:
                    kept.append(sample)
            family.samples = kept
            yield family


class _Counts(Collector):
    """A counter family, by label values, counted in plain numbers and made into
    Prometheus's family only when scraped.

    prometheus_client's own counters take a lock on every increment, and its
    histograms walk their buckets in Python: on the request path, about a
    tenth of the instructions a proxied request costs the gateway (35k of
    362k, callgrind). These are written on the event loop's thread only.
    The exposition is the same as prometheus_client's (``_total`` and
    ``_created`` samples)."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self._name, self._doc, self._labels = name, documentation, labels
        self._values: dict[tuple[str, ...], float] = {}
        self._created: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        if key in self._values:
            self._values[key] += amount
        else:
            self._values[key], self._created[key] = float(amount), time.time()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labels)
        for key, value in self._values.items():
            family.add_metric(key, value, created=self._created[key])
        yield family


class _Timings(Collector):
    """A histogram family, by label values, as :class:`_Counts` is a counter's."""

    def __init__(
        self, name: str, documentation: str, labels: list[str], buckets: tuple[float, ...]
    ) -> None:
        self._name, self._doc, self._labels = name, documentation, labels
        self._bounds = buckets
        # prometheus_client's own spelling of a bound (its Histogram's), untyped there.
        self._les = [floatToGoString(b) for b in buckets] + ["+Inf"]  # type: ignore[no-untyped-call]
        # Per label values: each bucket's own count (not cumulative), then the sum.
        self._counts: dict[tuple[str, ...], list[float]] = {}
        self._created: dict[tuple[str, ...], float] = {}

    def observe(self, key: tuple[str, ...], seconds: float | None) -> None:
        """Count ``seconds`` (None: nothing, though the series exists from now on,
        as a labelled child of prometheus_client's does)."""
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = [0.0] * (len(self._bounds) + 2)
            self._created[key] = time.time()
        if seconds is not None:
            # A value on a bound counts in that bound's bucket (le: less or equal).
            counts[bisect.bisect_left(self._bounds, seconds)] += 1
            counts[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labels)
        for key, counts in self._counts.items():
            cumulative = itertools.accumulate(counts[:-1])
            family.add_metric(key, list(zip(self._les, cumulative, strict=True)), counts[-1])
            labels = dict(zip(self._labels, key, strict=True))
            family.samples.append(Sample(f"{self._name}_created", labels, self._created[key]))
        yield family


class GatewayMetrics:
    def __init__(self, directory: ModelDirectory, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Counted on every request: the gateway's own families (see _Counts).
        self.requests = _Counts(
            "llmgw_requests", "Requests answered, by model and HTTP status.", ["model", "status"]
        )
        self.latency = _Timings(
            "llmgw_request_duration_seconds",
            "Time from request to the end of the answer, held time included.",
            ["model"], _LATENCY_BUCKETS,
        )
        self.ttfb = _Timings(
            "llmgw_time_to_first_byte_seconds",
            "Time from request to the first byte of the answer sent to the client.",
            ["model"], _LATENCY_BUCKETS,
        )
        for family in (self.requests, self.latency, self.ttfb):
            registry.register(family)
        self.held = Gauge(
            "llmgw_held_requests",
            "Requests waiting for a model to have a ready replica.",
            ["model"],
            registry=registry,
        )
        self.cold_start = Histogram(
            "llmgw_cold_start_duration_seconds",
            "Time from the first request held for a model until it had a ready replica.",
            ["model"],
            buckets=_COLD_START_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "llmgw_upstream_errors",
            "Failed calls to engines; phase: connect (retried), stream (passed on), auth, "
            "drain (an answer read on after its client left, cut at the drain bound).",
            ["model", "phase"],
            registry=registry,
        )
        self.tokens = _Counts(
            "llmgw_tokens", "Tokens reported by engines, by model and kind (prompt, completion).",
            ["model", "kind"],
        )
        registry.register(self.tokens)
        registry.register(_ReplicaCollector(directory))

    def exposition(self, visible: Callable[[str], bool] | None = None) -> bytes:
        """The Prometheus text: every series, or (``visible``) only those of the models
        ``visible`` allows and those that name no model."""
        if visible is None:
            return generate_latest(self.registry)
        return generate_latest(_Visible(self.registry, visible))

    def answered(self, model: str, status: int, seconds: float, first_byte: float | None) -> None:
        """One request answered: its status, its duration and (when it began
        to answer) its time to the first byte."""
        self.requests.inc((model, str(status)))
        self.latency.observe((model,), seconds)
        self.ttfb.observe((model,), first_byte)

    def answered_since(
        self, model: str, status: int, t0: float, first_byte: float | None
    ) -> None:
        """:meth:`answered` for a request that came at ``t0`` and began to be
        answered at ``first_byte`` (None: never), both on the monotonic clock."""
        now = time.monotonic()
        self.answered(model, status, now - t0, None if first_byte is None else first_byte - t0)

    def counted(self, model: str, prompt: int, completion: int) -> None:
        """Tokens an engine reported for one answer."""
        self.tokens.inc((model, "prompt"), prompt)
        self.tokens.inc((model, "completion"), completion)
