"""Batch and file records in the shared database; the files themselves stay on disk.

The bytes (uploads, inputs, results, the jobs' work folders) stay in
``batch.directory``, which with several login nodes must be a shared
filesystem every daemon and the batch jobs see at one path: a site's
``/home`` or project space. The records (``/v1/files`` and ``/v1/batches``
objects) are in ``llmgw_files`` and ``llmgw_batches``, so any gateway answers
for any batch.

A daemon keeps every record in memory, as :class:`~llmgw_slurm.batch.store.BatchStore`
does, and writes a change behind the request, in order, retried while the
database is away; the routes that create or cancel wait for their write
(:meth:`PgBatchStore.synced`), so a batch just created is found through
the other gateway. A record that is final is never replaced by one that is
not: a late progress report taken by another daemon cannot undo a batch's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg

from llmgw_slurm.batch.model import BatchRecord, BatchStatus, FileRecord
from llmgw_slurm.batch.store import BatchStore
from llmgw_slurm.db.hub import DB_ERRORS, Hub

__all__ = ["BatchesPart", "PgBatchStore"]

log = logging.getLogger(__name__)

_WRITE_LOCK = 0x6C6C6D6704  # batch records' writers, one at a time
_FINAL = [s.value for s in BatchStatus if s.is_final]


class PgBatchStore(BatchStore):
    """A :class:`BatchStore` whose records live in the shared database."""

    def __init__(self, root: Path, hub: Hub) -> None:
        self.hub = hub
        self._queue: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        super().__init__(root)

    def _load(self) -> None:
        # The records come from the database (BatchesPart), not from files.
        return

    # ---- writes, behind ---------------------------------------------------------------

    def _write_file(self, rec: FileRecord) -> None:
        self._enqueue("file", rec)

    def _forget_file(self, file_id: str) -> None:
        self._enqueue("delete", file_id)

    def _write_batch(self, batch: BatchRecord) -> None:
        self._enqueue("batch", batch)

    def _enqueue(self, kind: str, value: Any) -> None:
        self._queue.append((kind, value))
        self._idle.clear()
        self._wake.set()

    async def synced(self, timeout: float = 5.0) -> bool:
        """Wait until every change made so far is written (at most ``timeout`` s)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()

    async def run(self, stop: asyncio.Event) -> None:
        """Write the queued changes, in order; retried every second while they fail."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            if not self._queue:
                self._idle.set()
                continue
            todo = list(self._queue)

            async def write(conn: psycopg.AsyncConnection[Any], todo: list[Any] = todo) -> None:
                await self._write(conn, todo)

            try:
                await self.hub.run_sql(write)
            except DB_ERRORS as exc:
                log.warning("batch records: %d changes not written yet: %s", len(todo), exc)
                continue
            del self._queue[: len(todo)]
            if not self._queue:
                self._idle.set()

    async def _write(self, conn: psycopg.AsyncConnection[Any], todo: list[tuple[str, Any]]) -> None:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
            for kind, value in todo:
                if kind == "file":
                    await conn.execute(
                        "INSERT INTO llmgw_files (id, owner, record) VALUES (%s, %s, %s)"
                        " ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record,"
                        " deleted = false, seq = nextval('llmgw_change_seq')",
                        (value.id, value.owner, json.dumps(asdict(value))),
                    )
                elif kind == "delete":
                    await conn.execute(
                        "UPDATE llmgw_files SET deleted = true, seq = nextval('llmgw_change_seq')"
                        " WHERE id = %s",
                        (value,),
                    )
                else:
                    await conn.execute(
                        "INSERT INTO llmgw_batches (id, owner, record) VALUES (%s, %s, %s)"
                        " ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record,"
                        " seq = nextval('llmgw_change_seq')"
                        " WHERE NOT (llmgw_batches.record->>'status' = ANY(%s))"
                        " OR EXCLUDED.record->>'status' = ANY(%s)",
                        (value.id, value.owner, json.dumps(value.to_json()), _FINAL, _FINAL),
                    )
            await self.hub.notify(conn, "batches")

    # ---- reads, from the database -------------------------------------------------------

    def take_file(self, rec: FileRecord, deleted: bool) -> None:
        if deleted:
            self._files.pop(rec.id, None)
        else:
            self._files[rec.id] = rec

    def take_batch(self, batch: BatchRecord) -> None:
        mine = self._batches.get(batch.id)
        if mine is not None and mine.status.is_final and not batch.status.is_final:
            return
        self._batches[batch.id] = batch


class BatchesPart:
    """A daemon's copy of the records: the rows changed since the last pull."""

    topic = "batches"

    def __init__(self, hub: Hub, store: PgBatchStore) -> None:
        self.hub = hub
        self.store = store
        self.last_seq = 0

    async def pull(self) -> None:
        async def read(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Any], list[Any]]:
            cur = await conn.execute(
                "SELECT record, deleted, seq FROM llmgw_files WHERE seq > %s ORDER BY seq",
                (self.last_seq,),
            )
            files = await cur.fetchall()
            cur = await conn.execute(
                "SELECT record, seq FROM llmgw_batches WHERE seq > %s ORDER BY seq",
                (self.last_seq,),
            )
            return files, await cur.fetchall()

        files, batches = await self.hub.run_sql(read)
        top = self.last_seq
        for record, deleted, seq in files:
            top = max(top, int(seq))
            with contextlib.suppress(TypeError, ValueError):
                self.store.take_file(FileRecord(**record), bool(deleted))
        for record, seq in batches:
            top = max(top, int(seq))
            try:
                self.store.take_batch(BatchRecord.from_json(record))
            except (TypeError, ValueError, KeyError) as exc:
                log.warning("batch record unreadable, skipped: %s", exc)
        self.last_seq = top
