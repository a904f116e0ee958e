"""The last hour per model, for the status page's charts: a point a minute, kept in memory.

Read from the gateway's own Prometheus metrics (:mod:`llmgw_slurm.router.metrics`),
so that the request path has nothing more to do: every ``step`` seconds the
sampler takes the counters' change since the last sample (requests, tokens,
the time-to-first-byte histogram) and the gauges' values (held requests,
replicas), per model. Time to first byte is the gateway's time to first
token for a streamed answer (the first chunk is the first token); for an
answer that is not streamed it is the whole answer. Its p50 and p95 are
estimated from the histogram's buckets (linear within a bucket), so they are
as exact as the buckets are fine.

Bounded: ``points`` points of seven numbers per model in the catalog; a model
that leaves the catalog is forgotten at the next sample (about 0.6 MB for 500
models over the hour, bench/status_page.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw_slurm.router.metrics import GatewayMetrics

__all__ = ["SERIES", "History", "Point", "quantile"]

log = logging.getLogger(__name__)

SERIES = ("rps", "tokens_per_s", "ttfb_p50", "ttfb_p95", "held", "replicas")


@dataclass(frozen=True)
class Point:
    t: float
    rps: float
    tokens_per_s: float
    # None: no answer began in the interval.
    ttfb_p50: float | None
    ttfb_p95: float | None
    held: float
    replicas: float


@dataclass
class _Totals:
    requests: float = 0.0
    tokens: float = 0.0
    # Cumulative bucket counts of the time-to-first-byte histogram, by upper bound.
    buckets: tuple[tuple[float, float], ...] = ()


def quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a histogram given as (upper bound, cumulative count) pairs."""
    pairs = sorted(buckets)
    if not pairs or pairs[-1][1] <= 0:
        return None
    want = q * pairs[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in pairs:
        if count >= want:
            if bound == float("inf"):
                return lo_bound  # beyond the last finite bucket: its bound is all we know
            span = count - lo_count
            frac = (want - lo_count) / span if span > 0 else 1.0
            return lo_bound + (bound - lo_bound) * frac
        lo_bound, lo_count = bound, count
    return lo_bound


def _read(metrics: GatewayMetrics) -> dict[str, _Totals]:
    out: dict[str, _Totals] = collections.defaultdict(_Totals)
    for fam in metrics.requests.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.labels["model"]].requests += s.value
    for fam in metrics.tokens.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.labels["model"]].tokens += s.value
    buckets: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for fam in metrics.ttfb.collect():
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                buckets[s.labels["model"]].append((float(s.labels["le"]), s.value))
    for model, b in buckets.items():
        out[model].buckets = tuple(sorted(b))
    return out


def _held(metrics: GatewayMetrics) -> dict[str, float]:
    return {s.labels["model"]: s.value for fam in metrics.held.collect() for s in fam.samples}


class History:
    def __init__(
        self,
        metrics: GatewayMetrics,
        replicas: Callable[[], Mapping[str, int]],
        *,
        step: float = 60.0,
        points: int = 60,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.replicas = replicas
        self.step = step
        self.points = points
        self.clock = clock
        self._last: dict[str, _Totals] = {}
        self._last_t: float | None = None
        self._series: dict[str, collections.deque[Point]] = {}
        # How many samples were taken; what the cached JSON was built from.
        self.samples = 0
        self._json: tuple[int, dict[str, Any]] | None = None

    def _points(self, now: float) -> dict[str, Point]:
        """A point per model for the interval since the last sample (nothing stored)."""
        totals, held, reps = _read(self.metrics), _held(self.metrics), self.replicas()
        dt = max(1e-9, now - self._last_t) if self._last_t is not None else None
        out: dict[str, Point] = {}
        for model in reps:
            cur, prev = totals.get(model, _Totals()), self._last.get(model, _Totals())
            d_req = max(0.0, cur.requests - prev.requests)
            d_tok = max(0.0, cur.tokens - prev.tokens)
            before = dict(prev.buckets)
            delta = [(b, max(0.0, c - before.get(b, 0.0))) for b, c in cur.buckets]
            out[model] = Point(
                t=now,
                rps=d_req / dt if dt else 0.0,
                tokens_per_s=d_tok / dt if dt else 0.0,
                ttfb_p50=quantile(delta, 0.5) if dt else None,
                ttfb_p95=quantile(delta, 0.95) if dt else None,
                held=held.get(model, 0.0),
                replicas=float(reps[model]),
            )
        return out

    def sample(self) -> None:
        """Store a point per model (the sampler calls it every ``step`` seconds)."""
        now = self.clock()
        points = self._points(now)
        for model, p in points.items():
            self._series.setdefault(model, collections.deque(maxlen=self.points)).append(p)
        for gone in set(self._series) - set(points):
            del self._series[gone]
        self._last = _read(self.metrics)
        self._last_t = now
        self.samples += 1

    def series(self) -> dict[str, list[Point]]:
        """Per model, the points stored (no live one: reading every model's histogram
        costs more than the page's whole table, and a page refreshes every few seconds)."""
        return {m: list(d) for m, d in self._series.items()}

    def to_json(self) -> dict[str, Any]:
        """The points as lists (``[t, *SERIES]``), built once per sample."""
        if self._json is None or self._json[0] != self.samples:
            doc = {
                "step_s": self.step,
                "sampled_at": self._last_t,
                "series": SERIES,
                "models": {
                    m: [[p.t, *(getattr(p, k) for k in SERIES)] for p in pts]
                    for m, pts in self._series.items()
                },
            }
            self._json = (self.samples, doc)
        return self._json[1]

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every ``step`` seconds until ``stop`` is set (a failed sample is logged)."""
        while not stop.is_set():
            try:
                self.sample()
            except Exception:  # the page's charts must never take the daemon down
                log.exception("history: sample failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.step)
