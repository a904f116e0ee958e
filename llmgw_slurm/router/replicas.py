"""Which replica a request goes to, and the hold for a model that has none ready.

Balancing: least outstanding requests among the ready replicas, rotating
among ties, or the model's prefix routing (``balance``). A request for a
model with no ready replica is held while the model starts: past the cap of
the model's queue, all models', or one key's, user's or account's share
(``holdqueue``), 429; past the deadline, 503 with ``Retry-After``. A held
request links to the replica's start span, so that a slow request leads to
the trace that says where the time went.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from opentelemetry import trace

from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router import balance
from llmgw_slurm.router.answers import Reply, client_closed, error
from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelRouting
from llmgw_slurm.router.holdqueue import HoldQueue
from llmgw_slurm.router.metrics import GatewayMetrics

__all__ = ["Replicas"]


class Replicas:
    """Requests in flight per replica, held requests per model and key."""

    def __init__(
        self, directory: ModelDirectory, config: RouterConfig, metrics: GatewayMetrics,
        routing: Callable[[str], ModelRouting],
    ) -> None:
        self.directory, self.config, self.metrics = directory, config, metrics
        self.routing = routing
        self.in_flight: dict[tuple[str, str], int] = {}
        self.holds = HoldQueue(config)
        # Per model under prefix routing: which replica each active key lives on.
        self.placements: dict[str, balance.Placement] = {}
        self._cold_since: dict[str, float] = {}
        self._rr = 0
        # Told of each request begun on a replica, once counted (the batch seam:
        # a replica's batch requests yield to it).
        self.on_started: Callable[[str, str], None] | None = None

    def started(self, model: str, replica_id: str) -> None:
        key = (model, replica_id)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self.directory.request_started(model, replica_id)
        if self.on_started is not None:
            self.on_started(model, replica_id)

    def ended(self, model: str, replica_id: str) -> None:
        key = (model, replica_id)
        self.in_flight[key] -= 1
        if not self.in_flight[key]:
            del self.in_flight[key]
        self.directory.request_finished(model, replica_id)

    def pick(
        self, model: str, prefix: str | None = None, exclude: frozenset[str] = frozenset(),
        unreachable: frozenset[tuple[str, str, int]] = frozenset(),
    ) -> Endpoint | None:
        """A ready replica for a request (``prefix``: its prefix routing key), or None."""
        every = self.directory.endpoints(model)
        if len(every) == 1 and prefix is None and not exclude and not unreachable:
            # Most models, most of the time: one replica and nothing to weigh.
            return None if every[0].draining else every[0]
        ready = [e for e in every if not e.draining]
        eps = [e for e in ready if e.replica_id not in exclude and e.identity not in unreachable]
        if not eps:
            return None
        if prefix is not None:
            routing = self.routing(model)
            # The key is placed among every ready replica, not only those left
            # for this try: a retry elsewhere must not move it.
            home = self._placement(model, routing).place([e.replica_id for e in ready], prefix)
            ids = [e.replica_id for e in eps]
            counts = [self.in_flight.get((model, i), 0) for i in ids]
            return eps[balance.choose(ids, counts, prefix, routing.load_factor, home)]
        if len(eps) == 1:
            return eps[0]  # most models, most of the time: nothing to weigh
        counts = [self.in_flight.get((model, e.replica_id), 0) for e in eps]
        least = min(counts)
        ties = [e for e, c in zip(eps, counts, strict=True) if c == least]
        self._rr += 1  # rotate among ties, so that an idle model's replicas share the load
        return ties[self._rr % len(ties)]

    def _placement(self, model: str, routing: ModelRouting) -> balance.Placement:
        placement = self.placements.get(model)
        if placement is None or placement.key_factor != routing.key_factor:
            placement = self.placements[model] = balance.Placement(routing.key_factor)
        return placement

    def _hold_timeout(self, model: str) -> float:
        for m in self.directory.models():
            if m.name == model and m.hold_timeout_s is not None:
                return m.hold_timeout_s
        return self.config.hold_timeout

    async def hold(
        self, model: str, key: KeyRecord | None, prefix: str | None,
        unreachable: frozenset[tuple[str, str, int]], gone: Callable[[], bool], span: trace.Span,
    ) -> Endpoint | Reply:
        """Wait for a ready replica of ``model`` (one not ``unreachable``): it, or the answer."""
        place = self.holds.take(model, key)
        if isinstance(place, Reply):
            return place
        self.metrics.held.labels(model).inc()
        self._cold_since.setdefault(model, time.monotonic())
        self.directory.want(model)
        try:
            return await self._wait(model, prefix, unreachable, gone, span)
        finally:
            place.release()
            self.metrics.held.labels(model).dec()
            if not self.holds.held[model]:
                # Nobody is waiting any more: a later start is a new cold start.
                self._cold_since.pop(model, None)

    async def _wait(
        self, model: str, prefix: str | None, unreachable: frozenset[tuple[str, str, int]],
        gone: Callable[[], bool], span: trace.Span,
    ) -> Endpoint | Reply:
        loop = asyncio.get_running_loop()
        timeout = self._hold_timeout(model)
        deadline = loop.time() + timeout
        waiter: asyncio.Future[None] = asyncio.ensure_future(self.directory.wait_ready(model))
        linked: set[int] = set()
        try:
            while True:
                _link_start(self.directory, model, span, linked)
                ep = self.pick(model, prefix, unreachable=unreachable)
                if ep is not None:
                    began = self._cold_since.pop(model, None)
                    if began is not None:
                        self.metrics.cold_start.labels(model).observe(time.monotonic() - began)
                    return ep
                if gone():
                    return client_closed()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return error(503, f"Model '{model}' has no ready replica after waiting "
                                 f"{timeout:g} s; it is starting, try again later.",
                                 "server_error", "model_not_ready",
                                 {"Retry-After": str(self.config.retry_after)})
                step = min(remaining, self.config.disconnect_poll)
                if not waiter.done():
                    await asyncio.wait({waiter}, timeout=step)
                    continue
                waiter.result()  # a broken directory raises here
                # Ready was signalled, yet nothing can be picked (the replica
                # drained since): wait for the next change, without spinning.
                await asyncio.sleep(step)
                waiter = asyncio.ensure_future(self.directory.wait_ready(model))
        finally:
            waiter.cancel()


def _link_start(directory: ModelDirectory, model: str, span: trace.Span, linked: set[int]) -> None:
    # The directory may not offer it (the method is optional), and the start
    # span exists only once the reconciler's pass has placed the replica.
    get = getattr(directory, "start_span_context", None)
    sc = get(model) if get is not None else None
    if isinstance(sc, trace.SpanContext) and sc.is_valid and sc.span_id not in linked:
        linked.add(sc.span_id)
        span.add_link(sc, {"llmgw.link": "replica.start"})
