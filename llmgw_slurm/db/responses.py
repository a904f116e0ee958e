"""Where each stored response lives, shared: ``previous_response_id`` and the stored
response's own routes work through any gateway, not only the one that made it.

Each gateway keeps the newest homes in memory
(:class:`~llmgw_slurm.router.surface.ResponseHomes`), reads the others' from
``llmgw_responses`` on their notification, and writes its own behind the
answer (a batch every ``every`` seconds at most). So a response is found
through another gateway a moment after it was made; a client that
continues it through another gateway within that moment gets the same 400
as for a response made before a restart. A background response's usage is
counted once, whichever gateway retrieves it finished: ``counted`` is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import psycopg

from llmgw_slurm.db.hub import DB_ERRORS, Hub
from llmgw_slurm.router.surface import Home, ResponseHomes

__all__ = ["SharedResponseHomes"]

log = logging.getLogger(__name__)

_WRITE_LOCK = 0x6C6C6D6705
# Rows older than this are dropped (an engine keeps a stored response until its
# replica stops; a replica lives hours, not weeks).
_KEEP_S = 14 * 86400.0


class SharedResponseHomes(ResponseHomes):
    """:class:`ResponseHomes` kept in step with the other gateways'."""

    topic = "responses"

    def __init__(self, hub: Hub, capacity: int = 100_000, every: float = 0.1) -> None:
        super().__init__(capacity)
        self.hub = hub
        self.every = every
        self.last_seq = 0
        self._out: dict[str, Home | None] = {}
        self._wake = asyncio.Event()

    def remember(self, response_id: str, home: Home) -> None:
        super().remember(response_id, home)
        self._out[response_id] = home
        self._wake.set()

    def forget(self, response_id: str) -> None:
        super().forget(response_id)
        self._out[response_id] = None
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            if not self._out:
                continue
            out, self._out = self._out, {}

            async def write(conn: psycopg.AsyncConnection[Any], out: Any = out) -> None:
                await self._write(conn, out)

            try:
                await self.hub.run_sql(write)
            except DB_ERRORS as exc:
                log.debug("stored responses: not written yet: %s", exc)
                self._out = {**out, **self._out}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every)

    async def _write(self, conn: psycopg.AsyncConnection[Any], out: dict[str, Home | None]) -> None:
        now = time.time()
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
            async with conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO llmgw_responses (id, model, replica_id, epoch, owner, counted,"
                    " gone, created) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (id) DO UPDATE SET counted = EXCLUDED.counted,"
                    " gone = EXCLUDED.gone, seq = nextval('llmgw_change_seq')",
                    [
                        (rid, h.model, h.replica_id, h.epoch, h.owner, h.counted, False, now)
                        if h is not None
                        else (rid, "", "", 0, "", True, True, now)
                        for rid, h in out.items()
                    ],
                )
                await cur.execute(
                    "DELETE FROM llmgw_responses WHERE created < %s", (now - _KEEP_S,)
                )
            await self.hub.notify(conn, self.topic)

    async def pull(self) -> None:
        async def read(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            cur = await conn.execute(
                "SELECT id, model, replica_id, epoch, owner, counted, gone, seq"
                " FROM llmgw_responses WHERE seq > %s ORDER BY seq",
                (self.last_seq,),
            )
            return await cur.fetchall()

        for rid, model, replica_id, epoch, owner, counted, gone, seq in await self.hub.run_sql(
            read
        ):
            self.last_seq = max(self.last_seq, int(seq))
            if gone:
                ResponseHomes.forget(self, rid)
            else:
                ResponseHomes.remember(self, rid, Home(model, replica_id, epoch, owner, counted))
