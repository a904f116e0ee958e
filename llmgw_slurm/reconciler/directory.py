"""The router's view of the replica table: the reconciler's ModelDirectory.

Called on the event loop, once or more per request: cheap, no I/O. What the
router reports (requests in flight, last use, a request waiting) goes into the
table and the demand kept here, which the next pass plans with.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace

from llmgw_slurm.auth.secrets import engine_api_key
from llmgw_slurm.auth.tls import PinnedContexts
from llmgw_slurm.catalog import Access, Catalog
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.reconciler.replicas import ReplicaTable
from llmgw_slurm.router.directory import Endpoint, ModelInfo, ModelRouting

__all__ = ["ReplicaDirectory"]


@dataclass
class _ModelDemand:
    wanted_at: float | None = None
    # When the oldest request still held for the model began waiting: set by the
    # first request after the model was ready (or after every earlier request had
    # given up), cleared once it is ready.
    held_since: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class ReplicaDirectory:
    """Implements the router's ModelDirectory over a :class:`ReplicaTable`."""

    def __init__(
        self,
        table: ReplicaTable,
        server_key: bytes,
        engine_tls: PinnedContexts,
        want_window: float = 300.0,
    ) -> None:
        self.table = table
        # The server's hold deadline: a request older than it (or than the model's
        # longer hold_timeout) has had its 503 and waits no more.
        self.want_window = want_window
        self.server_key = server_key
        self.engine_tls = engine_tls
        self._demand: dict[str, _ModelDemand] = {}
        # The other gateways' demand (several daemons on one database): model ->
        # (when a request last asked for it, since when its oldest held request waits).
        self.remote_demand: dict[str, tuple[float | None, float | None]] = {}
        # Called with a model when this gateway's demand for it changed (to share it).
        self.on_demand: Callable[[str], None] | None = None
        # Per request, so built once per catalog (a reload makes a new one).
        self._routing: tuple[Catalog | None, dict[str, ModelRouting]] = (None, {})

    def resolve(self, name: str) -> str | None:
        m = self.table.catalog.resolve(name)
        return m.name if m else None

    def models(self) -> Sequence[ModelInfo]:
        out = []
        for m in self.table.catalog.models:
            counts: dict[str, int] = collections.Counter(
                r.state().value for r in self.table.replicas.values() if r.model == m.name
            )
            out.append(
                ModelInfo(
                    name=m.name,
                    aliases=m.aliases,
                    ready=self.table.has_ready(m.name),
                    replicas=dict(counts),
                    hold_timeout_s=m.scaling.hold_timeout,
                )
            )
        return out

    def routing(self, model: str) -> ModelRouting | None:
        """The model's served endpoints and balancing policy, from the catalog."""
        catalog, table = self._routing
        if catalog is not self.table.catalog:
            catalog = self.table.catalog
            table = {
                m.name: ModelRouting(
                    endpoints=frozenset(m.served_endpoints),
                    policy=m.routing.policy,
                    prefix_chars=m.routing.prefix_chars,
                    load_factor=m.routing.load_factor,
                    key_factor=m.routing.key_factor,
                    context_length=m.context_tokens,
                    stores_responses=m.stores_responses,
                )
                for m in catalog.models
            }
            self._routing = (catalog, table)
        return table.get(model)

    def access(self, model: str) -> Access | None:
        """The catalog's access rules of ``model``: the current catalog, so a reload
        that narrows them holds from the next request."""
        m = self.table.catalog.get(model)
        return m.access if m is not None else None

    def endpoints(self, model: str) -> Sequence[Endpoint]:
        out = []
        for r in self.table.replicas.values():
            if r.model != model or not r.base_url:
                continue
            st = r.state()
            if st not in (ReplicaState.READY, ReplicaState.DRAINING):
                continue
            out.append(
                Endpoint(
                    replica_id=r.replica_id,
                    base_url=r.base_url,
                    api_key=engine_api_key(self.server_key, r.replica_id),
                    draining=st is ReplicaState.DRAINING,
                    epoch=r.epoch,
                    ssl=self.engine_tls.get(r.engine_cert) if r.engine_cert else None,
                )
            )
        return out

    def request_started(self, model: str, replica_id: str) -> None:
        r = self.table.replicas.get(replica_id)
        if r is not None:
            r.in_flight += 1
            r.last_used = self.table.clock()

    def request_finished(self, model: str, replica_id: str) -> None:
        r = self.table.replicas.get(replica_id)
        if r is not None:
            r.in_flight = max(0, r.in_flight - 1)
            r.last_used = self.table.clock()

    def idle_for(self, model: str, replica_id: str) -> float | None:
        # Another daemon's gateway's use too (shared state): its online requests
        # are not in this gateway's count.
        r = self.table.replicas.get(replica_id)
        used = None if r is None else r.last_use()
        return None if used is None else self.table.clock() - used

    def want(self, model: str) -> None:
        d = self._demand.setdefault(model, _ModelDemand())
        now = self.table.clock()
        first = d.wanted_at is None or now - d.wanted_at > 1.0
        if (
            d.held_since is None
            or d.wanted_at is None
            or now - d.wanted_at >= self._window(model)
            or self.table.has_ready(model)
        ):
            d.held_since = now
        held_before = d.held_since
        d.wanted_at = now
        if first:
            # An on-demand start should not wait for the next timed pass.
            self.table.wake.set()
        if (first or held_before != d.held_since) and self.on_demand is not None:
            self.on_demand(model)

    async def wait_ready(self, model: str) -> None:
        d = self._demand.setdefault(model, _ModelDemand())
        while not self.table.has_ready(model):
            d.event.clear()
            await d.event.wait()

    def start_span_context(self, model: str) -> trace.SpanContext | None:
        """The start span of a starting replica of ``model`` (held requests link to it)."""
        return self.table.tracing.start_context(model)

    def signal_ready(self, model: str) -> None:
        """Wake the requests waiting for ``model`` if it has a ready replica now."""
        d = self._demand.get(model)
        if d is not None and self.table.has_ready(model):
            held, d.held_since = d.held_since, None
            d.event.set()
            if held is not None and self.on_demand is not None:
                self.on_demand(model)

    def _window(self, model: str) -> float:
        m = self.table.catalog.resolve(model)
        hold = m.scaling.hold_timeout if m is not None else None
        return max(self.want_window, hold or 0.0)

    def held_since(self) -> dict[str, float]:
        """When the oldest request still held for each model began waiting, on any
        gateway (for the plan)."""
        out = {k: d.held_since for k, d in self._demand.items() if d.held_since is not None}
        for model, (_, held) in self.remote_demand.items():
            if held is not None and (model not in out or held < out[model]):
                out[model] = held
        return out

    def wanted_at(self) -> dict[str, float]:
        """When a request last asked for each model, on any gateway (for the plan)."""
        out = {k: d.wanted_at for k, d in self._demand.items() if d.wanted_at is not None}
        for model, (wanted, _) in self.remote_demand.items():
            if wanted is not None and (model not in out or wanted > out[model]):
                out[model] = wanted
        return out

    def demand_of(self, model: str) -> tuple[float | None, float | None]:
        """This gateway's own (wanted at, held since) for ``model``."""
        d = self._demand.get(model)
        return (d.wanted_at, d.held_since) if d is not None else (None, None)
