"""A daemon's link to the shared database: its connection pool, its presence among the
daemons, and the notifications that tell it what another daemon changed.

One channel, ``llmgw``; a payload is a topic (``replicas``, ``keys``,
``demand``, ...) and the name of the daemon that wrote, so that a daemon
skips its own. A notification only says "pull": each part of the shared state
(:class:`Part`) reads what changed since its last pull, by a sequence
number, so a lost or merged notification costs nothing but time. Every
``resync`` seconds, and after every reconnection of the listening session,
every part pulls anyway: notifications sent while a daemon was not listening
are gone, and the state they announced is not.

Nothing here is on a request's path: the gateway reads the parts' copies in
memory. A database that is slow or down slows only these pulls and pushes,
which retry; the daemon's health (:meth:`Hub.healthy`) says since when it has
been out of touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
import psycopg_pool

from llmgw_slurm import __version__
from llmgw_slurm.base.errors import DatabaseError
from llmgw_slurm.config import DatabaseConfig
from llmgw_slurm.db.connect import Conninfo, aconnect, database_error

__all__ = ["CHANNEL", "DaemonRow", "Hub", "Part"]

log = logging.getLogger(__name__)

CHANNEL = "llmgw"
# Errors a pull, a push or a notification may meet: all of them mean "not now".
DB_ERRORS = (psycopg.Error, psycopg_pool.PoolTimeout, DatabaseError, OSError, TimeoutError)


class Part(Protocol):
    """One piece of the shared state a daemon keeps a copy of."""

    topic: str

    async def pull(self) -> None:
        """Read what changed since the last pull into the daemon's copy."""
        ...


@dataclass(frozen=True)
class DaemonRow:
    name: str
    host: str
    pid: int
    gateway_url: str
    internal_url: str
    version: str
    started_at: float
    last_seen: float
    stopped_at: float | None


class Hub:
    """The pool, the listening session, presence, and the parts' pulls."""

    def __init__(
        self,
        info: Conninfo,
        name: str,
        cfg: DatabaseConfig,
        *,
        resync: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self.name = name
        self.cfg = cfg
        self.resync = resync
        self.clock = clock
        self.pool = psycopg_pool.AsyncConnectionPool(
            info.conninfo,
            kwargs={"autocommit": True, **info.kwargs()},
            min_size=1,
            max_size=cfg.pool_size,
            open=False,
            timeout=cfg.connect_timeout,
            check=psycopg_pool.AsyncConnectionPool.check_connection,
            reconnect_timeout=3600.0 * 24 * 365,
            name=f"llmgw-{name}",
        )
        self.parts: dict[str, Part] = {}
        self.daemons: list[DaemonRow] = []
        self.last_contact: float | None = None  # monotonic
        self.last_error = ""
        self.listening = False
        # Called after each read of the daemons' table.
        self.on_daemons: Callable[[list[DaemonRow]], None] | None = None
        self._kick: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add(self, part: Part, *also: str) -> None:
        """Pull ``part`` on its topic's notifications (and on those of ``also``)."""
        for topic in (part.topic, *also):
            self.parts[topic] = part

    # ---- queries ----------------------------------------------------------------------

    async def run_sql(
        self,
        work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]],
        *,
        timeout: float | None = None,
    ) -> Any:
        """``work`` on a pooled connection, bounded; a failure is a DatabaseError."""
        try:
            async with asyncio.timeout(timeout or self.cfg.connect_timeout * 2):
                async with self.pool.connection() as conn:
                    out = await work(conn)
        except DB_ERRORS as exc:
            self.last_error = str(exc) or type(exc).__name__
            if isinstance(exc, DatabaseError):
                raise
            raise database_error(self.info, exc, "a query") from None
        self.last_contact = self.clock()
        return out

    async def notify(self, conn: psycopg.AsyncConnection[Any], topic: str) -> None:
        """Tell the other daemons ``topic`` changed (inside the caller's transaction:
        sent when it commits)."""
        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{topic} {self.name}"))

    def healthy(self, within: float) -> bool:
        """Whether this daemon reached the database within the last ``within`` seconds."""
        return self.last_contact is not None and self.clock() - self.last_contact <= within

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self, gateway_url: str, internal_url: str) -> None:
        """Open the pool and say this daemon is here (raises DatabaseError: the daemon
        does not start without its database)."""
        await self.pool.open(wait=False)

        async def register(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(
                "INSERT INTO llmgw_daemons (name, host, pid, gateway_url, internal_url, version,"
                " started_at, last_seen) VALUES (%s, %s, %s, %s, %s, %s, now(), now())"
                " ON CONFLICT (name) DO UPDATE SET host = EXCLUDED.host, pid = EXCLUDED.pid,"
                " gateway_url = EXCLUDED.gateway_url, internal_url = EXCLUDED.internal_url,"
                " version = EXCLUDED.version, started_at = now(), last_seen = now(),"
                " stopped_at = NULL",
                (self.name, socket.getfqdn(), os.getpid(), gateway_url, internal_url, __version__),
            )

        await self.run_sql(register)

    async def run(self, stop: asyncio.Event) -> None:
        """Listen and pull until ``stop``."""
        self._tasks = [
            asyncio.create_task(self._listen(stop), name="llmgw-db-listen"),
            asyncio.create_task(self._resync(stop), name="llmgw-db-resync"),
        ]
        try:
            await stop.wait()
        finally:
            for t in self._tasks:
                t.cancel()
            for t in self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def close(self) -> None:
        async def gone(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(
                "UPDATE llmgw_daemons SET stopped_at = now() WHERE name = %s", (self.name,)
            )

        with contextlib.suppress(DatabaseError):
            await self.run_sql(gone, timeout=2.0)
        await self.pool.close(timeout=2.0)

    # ---- pulls --------------------------------------------------------------------------

    async def pull(self, topic: str) -> None:
        part = self.parts.get(topic)
        if part is None:
            return
        try:
            await part.pull()
        except DB_ERRORS as exc:
            log.debug("db: pulling %s failed: %s", topic, exc)
        except Exception:
            # One part's bug must not stop the others' sync.
            log.exception("db: pulling %s failed", topic)

    async def pull_all(self) -> None:
        done: set[int] = set()
        for topic, part in list(self.parts.items()):
            if id(part) not in done:
                done.add(id(part))
                await self.pull(topic)
        with contextlib.suppress(DatabaseError):
            self.daemons = await self.run_sql(_daemons)
            if self.on_daemons is not None:
                self.on_daemons(self.daemons)

    async def _resync(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.pull_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.resync)

    async def _listen(self, stop: asyncio.Event) -> None:
        """The listening session: reconnects after a second when it breaks, and pulls
        everything once listening again (what was announced meanwhile is not lost)."""
        while not stop.is_set():
            conn: psycopg.AsyncConnection[Any] | None = None
            try:
                conn = await aconnect(self.info)
                await conn.execute(f"LISTEN {CHANNEL}")
                self.listening = True
                self.last_contact = self.clock()
                await self.pull_all()
                async for n in conn.notifies():
                    self.last_contact = self.clock()
                    topic, _, sender = n.payload.partition(" ")
                    if sender != self.name:
                        self._schedule(topic)
            except DB_ERRORS as exc:
                if str(exc) != self.last_error:
                    log.warning("db: the notification session broke: %s", exc)
                self.last_error = str(exc) or type(exc).__name__
            finally:
                self.listening = False
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    def pull_soon(self, topic: str) -> None:
        """Pull ``topic`` soon (outside a notification: a part that knows it is behind)."""
        self._schedule(topic)

    def _schedule(self, topic: str) -> None:
        """Pull ``topic`` soon: a burst of notifications makes one pull, not one each."""
        ev = self._kick.get(topic)
        if ev is not None:
            ev.set()
            return
        ev = self._kick[topic] = asyncio.Event()
        ev.set()

        async def puller() -> None:
            try:
                while ev.is_set():
                    ev.clear()
                    await self.pull(topic)
            finally:
                self._kick.pop(topic, None)

        task = asyncio.create_task(puller(), name=f"llmgw-db-pull-{topic}")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)


async def _daemons(conn: psycopg.AsyncConnection[Any]) -> list[DaemonRow]:
    cur = await conn.execute(
        "SELECT name, host, pid, gateway_url, internal_url, version,"
        " extract(epoch FROM started_at), extract(epoch FROM last_seen),"
        " extract(epoch FROM stopped_at) FROM llmgw_daemons ORDER BY name"
    )
    return [
        DaemonRow(
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            float(r[6]),
            float(r[7]),
            float(r[8]) if r[8] is not None else None,
        )
        for r in await cur.fetchall()
    ]
