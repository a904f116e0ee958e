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

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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


class GatewayMetrics:
    def __init__(self, directory: ModelDirectory, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "llmgw_requests",
            "Requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "llmgw_request_duration_seconds",
            "Time from request to the end of the answer, held time included.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttfb = Histogram(
            "llmgw_time_to_first_byte_seconds",
            "Time from request to the first byte of the answer sent to the client.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
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
        self.tokens = Counter(
            "llmgw_tokens",
            "Tokens reported by engines, by model and kind (prompt, completion).",
            ["model", "kind"],
            registry=registry,
        )
        registry.register(_ReplicaCollector(directory))
        # Labelled children, kept: labels() validates and takes a lock on every
        # call, a few microseconds a request. Models and statuses are few.
        self._answered: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        self._tokens: dict[str, tuple[Any, Any]] = {}

    def exposition(self, visible: Callable[[str], bool] | None = None) -> bytes:
        """The Prometheus text: every series, or (``visible``) only those of the models
        ``visible`` allows and those that name no model."""
        if visible is None:
            return generate_latest(self.registry)
        return generate_latest(_Visible(self.registry, visible))

    def answered(self, model: str, status: int, seconds: float, first_byte: float | None) -> None:
        """One request answered: its status, its duration and (when it began
        to answer) its time to the first byte."""
        children = self._answered.get((model, status))
        if children is None:
            children = (
                self.requests.labels(model, str(status)),
                self.latency.labels(model),
                self.ttfb.labels(model),
            )
            self._answered[(model, status)] = children
        count, latency, ttfb = children
        count.inc()
        latency.observe(seconds)
        if first_byte is not None:
            ttfb.observe(first_byte)

    def answered_since(
        self, model: str, status: int, t0: float, first_byte: float | None
    ) -> None:
        """:meth:`answered` for a request that came at ``t0`` and began to be
        answered at ``first_byte`` (None: never), both on the monotonic clock."""
        now = time.monotonic()
        self.answered(model, status, now - t0, None if first_byte is None else first_byte - t0)

    def counted(self, model: str, prompt: int, completion: int) -> None:
        """Tokens an engine reported for one answer."""
        children = self._tokens.get(model)
        if children is None:
            children = self._tokens[model] = (
                self.tokens.labels(model, "prompt"),
                self.tokens.labels(model, "completion"),
            )
        children[0].inc(prompt)
        children[1].inc(completion)
