"""The reconciler's lease: one daemon of those sharing the database acts on Slurm, fenced.

A lease row (``llmgw_lease``), not an advisory lock: a session lock lives as
long as its connection, which a half-dead network can keep open for minutes;
a row with an expiry in the database's own clock ends when it says. Timing
as Kubernetes' leader election does it (client-go): every ``lease_renew``
each daemon runs one statement that renews the lease if it holds it, takes
it if it has run out (the epoch goes up by one), and otherwise says who
holds it. A leader that has not renewed within ``lease_deadline`` of its own
monotonic clock (measured from before the statement was sent, so the
database's expiry is always later) stops acting by itself, before the lease
can run out for the others at ``lease_duration``.

Fencing (:class:`llmgw_slurm.reconciler.fence.Fence`): every sbatch and
scancel is first written to ``llmgw_actions`` by one statement that reads the
lease row ``FOR SHARE``, holder, epoch and expiry checked: a daemon that
cannot write it does not act. A takeover's ``UPDATE`` waits for that row
lock, so every action a leader recorded is committed before its successor
holds the lease, and the successor (:meth:`Lease.open_submits`) waits out
those it cannot see in Slurm's listing yet, until their deadline (the Slurm
command timeout and a margin). So no job is submitted twice, even by two
daemons that both believe they lead for a moment.

The holder is ``NAME#INSTANCE``: a restarted daemon is a new holder, and
waits for its old lease to run out (its old self's sbatch may still run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import psycopg

from llmgw_slurm.base.errors import DatabaseError
from llmgw_slurm.config import DatabaseConfig
from llmgw_slurm.db.connect import Conninfo, aconnect
from llmgw_slurm.reconciler.fence import OpenSubmit, Ticket

__all__ = ["Lease", "LeaseState"]

log = logging.getLogger(__name__)

# Renew or take the lease, and say who holds it (the second SELECT sees the row as
# it was before the UPDATE: the holder, when the UPDATE did not take it).
_TICK = """
WITH seen AS (
    UPDATE llmgw_daemons SET last_seen = now(), stopped_at = NULL WHERE name = %(name)s
), taken AS (
    UPDATE llmgw_lease SET
        epoch = CASE WHEN holder = %(me)s AND expires_at > now() THEN epoch ELSE epoch + 1 END,
        acquired_at = CASE WHEN holder = %(me)s AND expires_at > now()
                      THEN acquired_at ELSE now() END,
        holder = %(me)s, renewed_at = now(), expires_at = now() + make_interval(secs => %(secs)s)
    WHERE name = 'reconciler' AND (holder = %(me)s OR expires_at <= now())
    RETURNING holder, epoch, acquired_at, expires_at
)
SELECT holder, epoch, extract(epoch FROM acquired_at), extract(epoch FROM expires_at), true
FROM taken
UNION ALL
SELECT holder, epoch, extract(epoch FROM acquired_at), extract(epoch FROM expires_at), false
FROM llmgw_lease WHERE name = 'reconciler' AND NOT EXISTS (SELECT 1 FROM taken)
"""

_BEGIN = """
WITH held AS (
    SELECT epoch FROM llmgw_lease
    WHERE name = 'reconciler' AND holder = %(me)s AND epoch = %(epoch)s AND expires_at > now()
    FOR SHARE
)
INSERT INTO llmgw_actions (epoch, holder, kind, model, replica_id, target, deadline)
SELECT epoch, %(me)s, %(kind)s, %(model)s, %(rid)s, %(target)s,
       now() + make_interval(secs => %(secs)s)
FROM held
RETURNING id
"""

_OPEN = """
SELECT id, model, replica_id, target FROM llmgw_actions
WHERE finished_at IS NULL AND epoch < %(epoch)s AND deadline > now()
  AND kind IN ('submit', 'batch-submit')
ORDER BY id
"""


@dataclass(frozen=True)
class LeaseState:
    """The lease as this daemon last read it (for status and /metrics)."""

    holder: str = ""
    epoch: int = 0
    since: float | None = None  # when the holder took it (Unix time, the database's clock)
    expires: float | None = None


class Lease:
    """Holds (or waits for) the reconciler's lease; the reconciler's :class:`Fence`."""

    def __init__(
        self,
        info: Conninfo,
        name: str,
        cfg: DatabaseConfig,
        *,
        action_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self.name = name
        self.holder = f"{name}#{secrets.token_hex(4)}"
        self.cfg = cfg
        # How long an action may take before a successor stops waiting for it.
        self.action_timeout = action_timeout
        self.clock = clock
        self.state = LeaseState()
        # Called with True on taking the lease, False on losing it.
        self.on_change: Callable[[bool], None] | None = None
        self.last_contact: float | None = None  # monotonic
        self.last_error = ""
        self.taken = 0  # times this daemon took the lease
        self.fenced = 0  # actions refused by the fence
        self._epoch: int | None = None
        self._until = 0.0
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._actions: psycopg.AsyncConnection[Any] | None = None

    # ---- Fence ------------------------------------------------------------------------

    def acting(self) -> bool:
        return self._epoch is not None and self.clock() < self._until

    @property
    def epoch(self) -> int | None:
        return self._epoch if self.acting() else None

    async def begin(self, kind: str, model: str, replica_id: str, target: str) -> Ticket | None:
        epoch = self.epoch
        if epoch is None:
            self.fenced += 1
            return None
        params = {
            "me": self.holder,
            "epoch": epoch,
            "kind": kind,
            "model": model,
            "rid": replica_id,
            "target": target,
            "secs": self.action_timeout,
        }
        try:
            row = await self._on_actions(_BEGIN, params)
        except (DatabaseError, psycopg.Error, OSError, TimeoutError) as exc:
            log.warning(
                "lease: not acting (%s %s): the database did not answer: %s", kind, target, exc
            )
            row = None
        if row is None or not self.acting():
            self.fenced += 1
            log.warning("lease: %s of %s fenced off: epoch %d no longer held", kind, target, epoch)
            return None
        return Ticket(int(row[0]), epoch)

    async def end(self, ticket: Ticket, outcome: str) -> None:
        sql = "UPDATE llmgw_actions SET outcome = %(o)s, finished_at = now() WHERE id = %(id)s"
        try:
            await self._on_actions(sql, {"o": outcome[:500], "id": ticket.action_id}, fetch=False)
        except (DatabaseError, psycopg.Error, OSError, TimeoutError) as exc:
            # The successor waits it out to its deadline instead.
            log.warning("lease: could not record the end of action %d: %s", ticket.action_id, exc)

    async def open_submits(self, listed: Collection[str]) -> list[OpenSubmit]:
        epoch = self.epoch
        if epoch is None:
            return []
        rows = await self._on_actions(_OPEN, {"epoch": epoch}, many=True)
        out, seen = [], []
        for action_id, model, rid, target in rows or ():
            if target in listed:
                seen.append(action_id)
            else:
                out.append(OpenSubmit(model, rid, target))
        if seen:
            sql = (
                "UPDATE llmgw_actions SET outcome = 'listed by the next leader', "
                "finished_at = now() WHERE id = ANY(%(ids)s)"
            )
            await self._on_actions(sql, {"ids": seen}, fetch=False)
        return out

    async def _on_actions(
        self, sql: str, params: dict[str, Any], *, fetch: bool = True, many: bool = False
    ) -> Any:
        """One statement on the actions connection, bounded by the lease deadline."""

        async def run() -> Any:
            if self._actions is None or self._actions.closed:
                self._actions = await aconnect(self.info)
            cur = await self._actions.execute(sql.encode(), params)
            if not fetch:
                return None
            return await cur.fetchall() if many else await cur.fetchone()

        try:
            return await asyncio.wait_for(run(), self.cfg.lease_deadline)
        except BaseException:
            await _close(self._actions)
            self._actions = None
            raise

    # ---- the loop -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Renew or try to take the lease every ``lease_renew`` until ``stop``; then give it
        up, so that another daemon takes over at once rather than after its expiry."""
        try:
            while not stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.cfg.lease_renew)
        finally:
            await self.release()

    async def tick(self) -> None:
        sent = self.clock()
        params = {"name": self.name, "me": self.holder, "secs": self.cfg.lease_duration}
        try:
            row = await asyncio.wait_for(self._tick(params), self.cfg.lease_deadline)
        except (DatabaseError, psycopg.Error, OSError, TimeoutError) as exc:
            await _close(self._conn)
            self._conn = None
            if str(exc) != self.last_error:
                log.warning("lease: the database did not answer: %s", exc)
            self.last_error = str(exc) or type(exc).__name__
            self._check_lost()
            return
        self.last_contact = self.clock()
        self.last_error = ""
        if row is None:
            return
        holder, epoch, since, expires, mine = row
        self.state = LeaseState(holder or "", int(epoch), _float(since), _float(expires))
        if mine:
            self._until = sent + self.cfg.lease_deadline
            if self._epoch != int(epoch):
                self._epoch = int(epoch)
                self.taken += 1
                log.info("lease: this daemon (%s) leads, epoch %d", self.holder, self._epoch)
                self._changed(True)
        elif self._epoch is not None:
            log.warning("lease: lost to %s (epoch %d)", holder, epoch)
            self._epoch = None
            self._changed(False)

    async def _tick(self, params: dict[str, Any]) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = await aconnect(self.info)
        cur = await self._conn.execute(_TICK.encode(), params)
        return await cur.fetchone()

    def _check_lost(self) -> None:
        """Out of touch: past the deadline the leader stops acting (acting() says so
        already); say it once."""
        if self._epoch is not None and self.clock() >= self._until:
            log.warning(
                "lease: not renewed for %.1fs (deadline %.1fs): this daemon stops acting",
                self.clock() - (self._until - self.cfg.lease_deadline),
                self.cfg.lease_deadline,
            )
            self._epoch = None
            self._changed(False)

    def _changed(self, leading: bool) -> None:
        if self.on_change is not None:
            self.on_change(leading)

    async def release(self) -> None:
        """Give the lease up (a clean stop): the next daemon need not wait for its expiry."""
        if self._epoch is not None:
            self._epoch = None
            self._changed(False)
            sql = (
                "UPDATE llmgw_lease SET expires_at = now() "
                "WHERE name = 'reconciler' AND holder = %(me)s"
            )
            with contextlib.suppress(DatabaseError, psycopg.Error, OSError, TimeoutError):
                await self._on_actions(sql, {"me": self.holder}, fetch=False)
        for conn in (self._conn, self._actions):
            await _close(conn)
        self._conn = self._actions = None


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


async def _close(conn: psycopg.AsyncConnection[Any] | None) -> None:
    if conn is not None:
        with contextlib.suppress(Exception):
            await conn.close()
