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
refused for a batch; batch ones yield (those already sent finish). A batch
request is no use of the replica in the reconciler's eyes (no last use, no
request in flight): riding a replica never keeps it up, scales its model up,
or keeps it from being evicted or drained; a draining replica takes none.

What the seam needs of the gateway is the online requests in flight on a
replica (``online(model, replica_id)``); how long ago one was last used is the
directory's (``ModelDirectory.idle_for``). It sends with an aiohttp
client of its own (made on first use, in the running loop), not the gateway's
request path, so that that path can change under it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from llmgw_slurm.router.directory import Endpoint, ModelDirectory

__all__ = ["BatchSeam", "BatchSlot", "BatchUnreached", "SeamAnswer", "SlotShares"]

# A replica that could not be reached is passed over this long: a dead engine
# would otherwise take every retry the moment it is made.
UNREACHABLE_S = 10.0


class BatchUnreached(Exception):
    """No whole answer came back (the engine could not be reached, went silent, or
    broke off): the request was not answered and may be sent again."""


@dataclass(frozen=True, slots=True)
class SlotShares:
    """How much of a replica's concurrency batch requests may take (``batch:`` in
    server.yaml): ``busy`` while online requests use it, ``idle`` once none has for
    ``idle_after`` seconds."""

    busy: float
    idle: float
    idle_after: float


@dataclass(frozen=True, slots=True)
class BatchSlot:
    """A batch slot taken on one replica: :meth:`BatchSeam.forward` uses and frees it."""

    model: str
    endpoint: Endpoint


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
        timeout: aiohttp.ClientTimeout,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.online = online
        self.capacity = capacity
        self.shares = shares
        self.timeout = timeout
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._batch: dict[tuple[str, str], int] = {}
        self._unreachable: dict[tuple[str, str, int], float] = {}

    def slots(self, model: str, ep: Endpoint) -> int:
        """Batch requests ``ep`` may take now, beyond those it has."""
        cap = max(1, self.capacity(model))
        online = self.online(model, ep.replica_id)
        mine = self._batch.get((model, ep.replica_id), 0)
        share = self.shares.busy if online else self._share_unused(model, ep.replica_id)
        return max(0, min(math.ceil(share * cap), cap - online) - mine)

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

    async def forward(self, t: BatchSlot, path: str, body: bytes) -> SeamAnswer:
        """POST ``body`` (JSON, its ``model`` the engine's) to ``path`` on the ticket's
        replica; its whole answer. Frees the slot. Raises :class:`BatchUnreached`."""
        ep = t.endpoint
        headers = {
            # The replica's own engine key: a batch's owner's gateway key never
            # leaves the gateway.
            "Authorization": f"Bearer {ep.api_key}",
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
        }
        if self._session is None or self._session.closed:
            # Connections kept per engine; no limit: the engines' queues are where
            # requests wait, and the slots bound how many a ride sends.
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        url = ep.base_url.rstrip("/") + path
        try:
            async with self._session.post(
                url, data=body, headers=headers, ssl=ep.ssl if ep.ssl is not None else True
            ) as resp:
                status, request_id = resp.status, resp.headers.get("X-Request-Id", "")
                data = await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            now = self.clock()
            if len(self._unreachable) > 256:
                # Replicas come and go: forget those passed over long ago.
                self._unreachable = {
                    k: v for k, v in self._unreachable.items() if now - v < UNREACHABLE_S
                }
            self._unreachable[ep.identity] = now
            raise BatchUnreached(f"replica {ep.replica_id}: {e}") from e
        finally:
            self._release(t)
        return SeamAnswer(status, data, request_id, ep.replica_id)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
