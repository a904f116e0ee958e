"""What the router needs to know about models and replicas, and how it says what it saw.

The router depends only on :class:`ModelDirectory`. The reconciler implements
it over its replica table; :class:`StaticDirectory` implements it in memory
for tests and benchmarks.

Optional: ``routing(model) -> ModelRouting``, which endpoints a model serves
and how its replicas are chosen; without it (or for None) a model serves
every endpoint, least outstanding first.

Optional: ``start_span_context(model) -> opentelemetry.trace.SpanContext | None``,
the start span of one of the model's starting replicas. A request held for a
cold start links to it. Not part of the protocol, so that directories written
before it (and :class:`StaticDirectory`) stay valid; the router looks it up
with ``getattr``.

Every method but :meth:`ModelDirectory.wait_ready` is called on the event
loop, once or more per request: they must be cheap and must not block (no
I/O, no Slurm calls). ``want`` is a request, not a command: the reconciler
decides on its next pass.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from llmgw_slurm.catalog import Access

__all__ = ["Endpoint", "ModelDirectory", "ModelInfo", "ModelRouting", "StaticDirectory"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A ready replica the router may send requests to.

    ``base_url`` is the engine's base URL as the agent reported it
    (``http://host:port``, no ``/v1``); ``api_key`` is the replica's own engine
    key, sent instead of the client's key. A ``draining`` replica finishes the
    requests it has and gets no new ones.

    ``epoch`` counts the times this replica became ready. A replica requeued
    after a preemption comes back under the same id, often at the same address
    (the same node, the same port); the router, which stops sending to an
    endpoint it could not reach, must not take the new run for the dead one.
    """

    replica_id: str
    base_url: str
    api_key: str
    draining: bool = False
    epoch: int = 0
    # The client context that pins the engine's certificate (llmgw_slurm/auth/tls.py);
    # None for a plain-HTTP engine.
    ssl: ssl.SSLContext | None = field(default=None, compare=False)

    @property
    def identity(self) -> tuple[str, str, int]:
        """One run of one replica at one address: what "unreachable" is said of."""
        return (self.replica_id, self.base_url, self.epoch)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One catalog model as ``/v1/models`` and the metrics show it.

    ``ready``: at least one replica is ready and not draining.
    ``replicas``: replica counts by state (``pending``, ``starting``, ``ready``,
    ``draining``), for the replicas-by-state gauge.
    ``hold_timeout_s``: how long a request may wait for this model to start;
    None means the router's default (a model whose weights take ten minutes
    to load needs a longer hold than a small one).
    """

    name: str
    aliases: tuple[str, ...] = ()
    ready: bool = False
    replicas: Mapping[str, int] = field(default_factory=dict)
    hold_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class ModelRouting:
    """What the gateway needs per request from a model's catalog entry.

    ``endpoints``: the endpoint names it serves (catalog.ENDPOINTS); None, every one.
    ``policy``, ``prefix_chars``, ``load_factor``, ``key_factor``: as catalog.Routing.
    ``context_length``: the most tokens one request may hold (None: unknown),
    what token quotas reserve for a request that sets no ``max_tokens``.
    ``stores_responses``: whether its engine keeps ``/v1/responses`` answers for
    ``GET`` (vLLM: only with VLLM_ENABLE_RESPONSES_API_STORE=1); None: not known.
    """

    endpoints: frozenset[str] | None = None
    policy: str = "least_outstanding"
    prefix_chars: int = 2048
    load_factor: float = 2.0
    key_factor: float = 1.0
    context_length: int | None = None
    stores_responses: bool | None = None


@runtime_checkable
class ModelDirectory(Protocol):
    """The router's view of the catalog and of the replicas that serve it."""

    def resolve(self, name: str) -> str | None:
        """The canonical model for a model name or alias; None when unknown."""
        ...

    def models(self) -> Sequence[ModelInfo]:
        """Every catalog model, with its aliases and readiness."""
        ...

    def endpoints(self, model: str) -> Sequence[Endpoint]:
        """The ready replicas of a canonical model, draining ones flagged."""
        ...

    def request_started(self, model: str, replica_id: str) -> None:
        """A request was sent to a replica: one more in flight, last use is now."""
        ...

    def request_finished(self, model: str, replica_id: str) -> None:
        """A request to a replica ended (any outcome): one fewer in flight, last use is now."""
        ...

    def idle_for(self, model: str, replica_id: str) -> float | None:
        """Seconds since the replica's last use (a request began or ended), None if
        it has none."""
        ...

    def want(self, model: str) -> None:
        """A request is waiting for a model with no ready replica; ask for one.

        Idempotent: called once per held request, it must not start a replica
        per call.
        """
        ...

    async def wait_ready(self, model: str) -> None:
        """Return once the model has a ready replica that is not draining.

        Returns at once when it already has one. Must be safe to cancel: the
        router cancels it on its deadline and when the client goes away.
        """
        ...


def _now() -> float:
    return time.time()


class StaticDirectory:
    """An in-memory :class:`ModelDirectory` whose replicas a test sets by hand.

    ``on_want`` is called (synchronously) on each :meth:`want`, which lets a
    test or a benchmark play the reconciler: add an endpoint when asked.
    """

    def __init__(
        self,
        models: Iterable[ModelInfo] = (),
        *,
        on_want: Callable[[str], None] | None = None,
    ) -> None:
        self._models: dict[str, ModelInfo] = {}
        self._aliases: dict[str, str] = {}
        self._endpoints: dict[str, list[Endpoint]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.on_want = on_want
        self.wanted: Counter[str] = Counter()
        self.in_flight: Counter[tuple[str, str]] = Counter()
        self.started: Counter[tuple[str, str]] = Counter()
        self.last_used: dict[str, float] = {}
        self._epochs = 0
        self._routing: dict[str, ModelRouting] = {}
        # Access rules by model name (the catalog's ``access``); none: everyone.
        self.rules: dict[str, Access] = {}
        for m in models:
            self.add_model(m.name, aliases=m.aliases, hold_timeout_s=m.hold_timeout_s)

    def add_model(
        self,
        name: str,
        *,
        aliases: Iterable[str] = (),
        hold_timeout_s: float | None = None,
        routing: ModelRouting | None = None,
    ) -> None:
        aliases = tuple(aliases)
        for a in (name, *aliases):
            if a in self._models or a in self._aliases:
                raise ValueError(f"model name or alias {a!r} is already in use")
        self._models[name] = ModelInfo(name, aliases=aliases, hold_timeout_s=hold_timeout_s)
        self._endpoints[name] = []
        for a in aliases:
            self._aliases[a] = name
        if routing is not None:
            self._routing[name] = routing

    def routing(self, model: str) -> ModelRouting | None:
        return self._routing.get(model)

    def _known(self, model: str) -> list[Endpoint]:
        try:
            return self._endpoints[model]
        except KeyError:
            raise KeyError(f"unknown model {model!r}") from None

    def add_endpoint(self, model: str, endpoint: Endpoint) -> None:
        eps = self._known(model)
        if any(e.replica_id == endpoint.replica_id for e in eps):
            raise ValueError(f"replica {endpoint.replica_id} of {model} already present")
        if not endpoint.epoch:
            # Added again after a removal is a new run, as the reconciler counts them.
            self._epochs += 1
            endpoint = replace(endpoint, epoch=self._epochs)
        eps.append(endpoint)
        self._changed(model)

    def remove_endpoint(self, model: str, replica_id: str) -> None:
        eps = self._known(model)
        self._endpoints[model] = [e for e in eps if e.replica_id != replica_id]
        self._changed(model)

    def set_draining(self, model: str, replica_id: str, draining: bool = True) -> None:
        eps = self._known(model)
        if not any(e.replica_id == replica_id for e in eps):
            raise KeyError(f"no replica {replica_id} of {model}")
        self._endpoints[model] = [
            replace(e, draining=draining) if e.replica_id == replica_id else e for e in eps
        ]
        self._changed(model)

    def _has_ready(self, model: str) -> bool:
        return any(not e.draining for e in self._endpoints.get(model, ()))

    def _event(self, model: str) -> asyncio.Event:
        ev = self._events.get(model)
        if ev is None:
            ev = self._events[model] = asyncio.Event()
            if self._has_ready(model):
                ev.set()
        return ev

    def _changed(self, model: str) -> None:
        ev = self._events.get(model)
        if ev is None:
            return
        if self._has_ready(model):
            ev.set()
        else:
            ev.clear()

    # ModelDirectory

    def resolve(self, name: str) -> str | None:
        if name in self._models:
            return name
        return self._aliases.get(name)

    def models(self) -> Sequence[ModelInfo]:
        out = []
        for name, m in self._models.items():
            eps = self._endpoints[name]
            draining = sum(1 for e in eps if e.draining)
            counts = {"ready": len(eps) - draining, "draining": draining}
            out.append(replace(m, ready=self._has_ready(name), replicas=counts))
        return out

    def endpoints(self, model: str) -> Sequence[Endpoint]:
        return tuple(self._endpoints.get(model, ()))

    def request_started(self, model: str, replica_id: str) -> None:
        self.in_flight[(model, replica_id)] += 1
        self.started[(model, replica_id)] += 1
        self.last_used[model] = _now()

    def request_finished(self, model: str, replica_id: str) -> None:
        if self.in_flight[(model, replica_id)] <= 0:
            raise AssertionError(f"request_finished without request_started: {model}/{replica_id}")
        self.in_flight[(model, replica_id)] -= 1
        self.last_used[model] = _now()

    def idle_for(self, model: str, replica_id: str) -> float | None:
        # Kept per model here: a use of any of its replicas counts.
        used = self.last_used.get(model)
        return None if used is None else _now() - used

    def access(self, model: str) -> Access | None:
        return self.rules.get(model)

    def want(self, model: str) -> None:
        self._known(model)
        self.wanted[model] += 1
        if self.on_want is not None:
            self.on_want(model)

    async def wait_ready(self, model: str) -> None:
        self._known(model)
        ev = self._event(model)
        while not self._has_ready(model):
            await ev.wait()
