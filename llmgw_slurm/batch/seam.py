"""Batch requests on warm replicas, below online ones: the gateway's batch seam (issue 37).

One call admits a batch request at batch priority and forwards it to a ready
replica of its model (:meth:`BatchSeam.admit`, then :meth:`BatchSeam.forward`);
the batch service (llmgw_slurm/batch/warm.py) is its only caller.

Admission is by slots. A replica takes at most ``ceil(share x capacity)``
batch requests at once, ``capacity`` being its model's
``scaling.target_inflight`` (what one replica is meant to carry), and fewer as
its online requests rise: batch and online together stay within the
capacity, so at ``capacity`` online requests a replica takes no batch request
at all. The share is :class:`SlotShares`' ``idle`` on a replica no online
request has used for ``idle_after`` (it would sit unused: the batch may have
all of it, and pays for its GPUs no more than online requests would), and its
``busy`` share while online requests use it (each batch request in flight
lengthens every step of the engine's, theirs too). The wait before the idle
share keeps a replica between two requests of a busy client from taking a
burst of batch requests its next online request would run beside.
Online requests do not come through here: they are never held or
refused for a batch; batch ones yield. New ones are not admitted past the
busy share, and when an online request begins on a replica that has more
batch requests in flight than that share allows (it was idle, and lent the
batch its idle share), the newest of them are called back
(:meth:`BatchSeam.online_started`): their connections are closed, so the
engine drops them at its next step, and the ride sends them again later
(:class:`BatchYielded`). That loses the tokens they had made; letting them
finish would have the online request share every step with up to the whole
idle share of batch requests until they end, which may be minutes. A batch
request is no use of the replica in the reconciler's eyes (no last use, no
request in flight): riding a replica never keeps it up, scales its model up,
or keeps it from being evicted or drained; a draining replica takes none.

What the seam needs of the gateway is the online requests in flight on a
replica (``online(model, replica_id)``); how long ago one was last used is the
directory's (``ModelDirectory.idle_for``). It sends with an engine client of
its own: an :class:`~llmgw_slurm.router.engine.EnginePool` (the gateway's strict
HTTP/1.1 to engines, with connections of its own), not the gateway's request
path, so that that path can change under it. Not aiohttp's client: on vLLM's
CPU build a ride's requests through it cost the engine's two cores enough that
a ride took 1.15 times the GPU-seconds of the same requests online
(bench/batch.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmgw_slurm.router.directory import Endpoint, ModelDirectory
from llmgw_slurm.router.engine import EngineBroken, EnginePool, EngineUnreachable

__all__ = [
    "BatchSeam",
    "BatchSlot",
    "BatchUnreached",
    "BatchYielded",
    "SeamAnswer",
    "SlotShares",
]

# A replica that could not be reached is passed over this long: a dead engine
# would otherwise take every retry the moment it is made.
UNREACHABLE_S = 10.0


class BatchUnreached(Exception):
    """No whole answer came back (the engine could not be reached, went silent, or
    broke off): the request was not answered and may be sent again."""


class BatchYielded(Exception):
    """Called back for an online request (:meth:`BatchSeam.online_started`): not
    answered, and no fault of the replica's; to be sent again."""


@dataclass(frozen=True, slots=True)
class SlotShares:
    """How much of a replica's concurrency batch requests may take (``batch:`` in
    server.yaml): ``busy`` while online requests use it, ``idle`` once none has for
    ``idle_after`` seconds."""

    busy: float
    idle: float
    idle_after: float


@dataclass(slots=True, eq=False)
class BatchSlot:
    """A batch slot taken on one replica: :meth:`BatchSeam.forward` uses and frees it."""

    model: str
    endpoint: Endpoint
    # While forward() sends it: the task sending it, cancelled to call it back.
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    called_back: bool = False


@dataclass(frozen=True, slots=True)
class SeamAnswer:
    status: int
    body: bytes
    request_id: str
    replica_id: str


class BatchSeam:
    """Batch slots on the ready replicas, and the forwarding of what they admit."""

    def __init__(
        self,
        directory: ModelDirectory,
        online: Callable[[str, str], int],
        capacity: Callable[[str], int],
        shares: SlotShares,
        pool: EnginePool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.online = online
        self.capacity = capacity
        self.shares = shares
        # Connections kept per engine; no limit: the engines' queues are where
        # requests wait, and the slots bound how many a ride sends.
        self.pool = pool
        self.clock = clock
        self._batch: dict[tuple[str, str], int] = {}
        # Per replica, the slots being sent now, oldest first.
        self._sending: dict[tuple[str, str], list[BatchSlot]] = {}
        self._unreachable: dict[tuple[str, str, int], float] = {}

    def slots(self, model: str, ep: Endpoint) -> int:
        """Batch requests ``ep`` may take now, beyond those it has."""
        online = self.online(model, ep.replica_id)
        mine = self._batch.get((model, ep.replica_id), 0)
        if online:
            return max(0, self._busy_limit(model, online) - mine)
        cap = max(1, self.capacity(model))
        share = self._share_unused(model, ep.replica_id)
        return max(0, math.ceil(share * cap) - mine)

    def _busy_limit(self, model: str, online: int) -> int:
        """Batch requests a replica may have in flight beside ``online`` online ones."""
        cap = max(1, self.capacity(model))
        return max(0, min(math.ceil(self.shares.busy * cap), cap - online))

    def online_started(self, model: str, replica_id: str) -> None:
        """An online request has begun on the replica (the gateway calls this for each,
        after counting it): call back its newest batch requests beyond the busy limit."""
        sending = self._sending.get((model, replica_id))
        if not sending:
            return  # nearly always: a dict lookup on the online request's path
        live = [t for t in sending if not t.called_back]
        excess = len(live) - self._busy_limit(model, self.online(model, replica_id))
        if excess <= 0:
            return
        # The newest: they have made the fewest tokens, which calling back loses.
        for t in live[-excess:]:
            t.called_back = True
            if t.task is not None:
                t.task.cancel()

    def _share_unused(self, model: str, replica_id: str) -> float:
        """The share of a replica with no online request in flight: the idle one once
        it has had none for ``idle_after``."""
        idle = self.directory.idle_for(model, replica_id)
        if idle is not None and idle < self.shares.idle_after:
            return self.shares.busy
        return self.shares.idle

    def _usable(self, model: str) -> list[Endpoint]:
        now = self.clock()
        out = []
        for ep in self.directory.endpoints(model):
            since = self._unreachable.get(ep.identity)
            if ep.draining or (since is not None and now - since < UNREACHABLE_S):
                continue
            out.append(ep)
        return out

    def ready(self, model: str) -> bool:
        """Has ``model`` a replica a batch could ride (whether or not it has room now)?"""
        return bool(self._usable(model))

    def free(self, model: str) -> int:
        """Batch requests the model's replicas may take now, all together."""
        return sum(self.slots(model, ep) for ep in self._usable(model))

    def in_flight(self, model: str) -> int:
        return sum(n for (m, _), n in self._batch.items() if m == model)

    def admit(self, model: str) -> BatchSlot | None:
        """A slot on the replica with the most room, or None: none has any now."""
        best, room = None, 0
        for ep in self._usable(model):
            n = self.slots(model, ep)
            if n > room:
                best, room = ep, n
        if best is None:
            return None
        key = (model, best.replica_id)
        self._batch[key] = self._batch.get(key, 0) + 1
        return BatchSlot(model, best)

    def _release(self, t: BatchSlot) -> None:
        key = (t.model, t.endpoint.replica_id)
        left = self._batch.get(key, 0) - 1
        if left > 0:
            self._batch[key] = left
        else:
            self._batch.pop(key, None)

    def _stop_sending(self, key: tuple[str, str], t: BatchSlot) -> None:
        sending = self._sending[key]
        sending.remove(t)
        if not sending:
            del self._sending[key]
        t.task = None

    async def forward(self, t: BatchSlot, path: str, body: bytes) -> SeamAnswer:
        """POST ``body`` (JSON, its ``model`` the engine's) to ``path`` on the ticket's
        replica; its whole answer. Frees the slot. Raises :class:`BatchUnreached`, or
        :class:`BatchYielded` when :meth:`online_started` called it back."""
        ep = t.endpoint
        headers = {
            # The replica's own engine key: a batch's owner's gateway key never
            # leaves the gateway.
            "Authorization": f"Bearer {ep.api_key}",
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
        }
        key = (t.model, ep.replica_id)
        t.task = asyncio.current_task()
        self._sending.setdefault(key, []).append(t)
        try:
            # A cancel closes the connection (the pool does not keep it): the engine
            # sees its client go and drops the request.
            got = await self.pool.fetch(ep.base_url, ep.ssl, "POST", path, headers, body)
        except asyncio.CancelledError:
            # Ours (online_started) unless someone else cancelled the task as well.
            if t.called_back and t.task is not None and t.task.uncancel() == 0:
                raise BatchYielded(f"replica {ep.replica_id}: called back") from None
            raise
        except (EngineUnreachable, EngineBroken) as e:
            now = self.clock()
            if len(self._unreachable) > 256:
                # Replicas come and go: forget those passed over long ago.
                self._unreachable = {
                    k: v for k, v in self._unreachable.items() if now - v < UNREACHABLE_S
                }
            self._unreachable[ep.identity] = now
            raise BatchUnreached(f"replica {ep.replica_id}: {e}") from e
        finally:
            self._stop_sending(key, t)
            self._release(t)
        request_id = got.headers.get("X-Request-Id", "")
        return SeamAnswer(got.status, got.body, request_id, ep.replica_id)

    async def close(self) -> None:
        self.pool.close()
