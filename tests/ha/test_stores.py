"""The shared stores on a real PostgreSQL, without Slurm: usage spooled while the
database is away and written once (never twice), batch records that cannot go back
from final, stored responses' homes seen by another daemon."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from psycopg import conninfo as pgconninfo

from llmgw_slurm.accounting.usage import UsageRecord
from llmgw_slurm.auth.keys import KeyRing, new_key
from llmgw_slurm.batch.model import BatchRecord, BatchStatus
from llmgw_slurm.db.batches import BatchesPart, PgBatchStore
from llmgw_slurm.db.connect import make_conninfo
from llmgw_slurm.db.hub import Hub
from llmgw_slurm.db.keys import KeysPart
from llmgw_slurm.db.responses import SharedResponseHomes
from llmgw_slurm.db.usage import PgUsageStore
from llmgw_slurm.router.surface import Home
from tests.ha.conftest import PgDatabase
from tests.ha.proxy import Proxy

pytestmark = [pytest.mark.ha]


@contextlib.asynccontextmanager
async def hub(db: PgDatabase, name: str, dsn: str | None = None) -> AsyncIterator[Hub]:
    cfg = db.config(dsn=dsn or db.dsn, connect_timeout=2.0)
    h = Hub(make_conninfo(cfg, name), name, cfg)
    await h.start("http://g", "http://i")
    try:
        yield h
    finally:
        await h.close()


def rec(n: int) -> UsageRecord:
    return UsageRecord(time.time(), "0a0a0a0a", "erin", "acct", "m", "chat", n, 1, n + 1)


def totals(db: PgDatabase) -> tuple[int, int, int]:
    with contextlib.closing(db.connect()) as conn:
        rows, tokens = conn.execute(
            "SELECT count(*), coalesce(sum(total_tokens), 0) FROM llmgw_usage"
        ).fetchone() or (0, 0)
        spend = conn.execute(
            "SELECT coalesce(sum(tokens), 0) FROM llmgw_spend WHERE kind = 'user'"
            " AND period LIKE 'day:%%'"
        ).fetchone()
    return int(rows), int(tokens), int(spend[0]) if spend else 0


async def test_usage_is_spooled_while_the_database_is_away_and_written_once(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    proxy = Proxy(int(pgconninfo.conninfo_to_dict(pgdb.dsn)["port"]))
    await proxy.start()
    async with hub(pgdb, "a", pgconninfo.make_conninfo(pgdb.dsn, port=proxy.port)) as h:
        store = PgUsageStore(h, tmp_path)
        for n in (1, 2, 3):
            store.record(rec(n))
        await store.flush()
        assert totals(pgdb) == (3, 9, 9)
        await proxy.cut()
        for n in (4, 5):
            store.record(rec(n))
        await store.flush()
        assert store.spool.exists() and store.spooled == 2
        assert totals(pgdb) == (3, 9, 9)
        # The same batch spooled twice (as after an answer lost past the commit).
        store.spool.write_text(store.spool.read_text() * 2)
        await proxy.mend()
        await store.flush()
        assert totals(pgdb) == (5, 20, 20)
        assert not store.spool.exists()
        # What llmgw-admin usage, audit and /api/v1/usage ask of it (synchronous: in a
        # thread, as the daemon asks, since the proxy runs on this loop).
        q = store.queries
        assert await asyncio.to_thread(q.by, "user") == [
            {
                "user": "erin",
                "requests": 5,
                "prompt_tokens": 15,
                "completion_tokens": 5,
                "total_tokens": 20,
            }
        ]
        [summary] = await asyncio.to_thread(lambda: q.query(user="erin"))
        assert (summary.key_id, summary.project, summary.requests) == ("0a0a0a0a", "acct", 5)
        assert await asyncio.to_thread(q.totals, 0.0) == {("erin", "acct"): 20}
        by_account = await asyncio.to_thread(q.tokens_by, "account", "m", 0.0, time.time() + 1)
        assert by_account == {"acct": 20}
    await proxy.cut()


async def test_a_final_batch_is_not_undone_by_a_late_write(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    async with hub(pgdb, "a") as ha, hub(pgdb, "b") as hb:
        sa, sb = PgBatchStore(tmp_path / "ba", ha), PgBatchStore(tmp_path / "bb", hb)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(s.run(stop)) for s in (sa, sb)]
        try:
            b = BatchRecord(
                "batch_" + "0" * 24,
                "erin",
                "/v1/chat/completions",
                "file-x",
                "24h",
                1,
                2,
                status=BatchStatus.IN_PROGRESS,
            )
            sb.save(b)
            assert await sb.synced()
            sa.save(replace(b, status=BatchStatus.COMPLETED, completed=3))
            assert await sa.synced()
            # b's late progress, written from its stale copy.
            sb.save(replace(b, completed=2, note="job 7 running"))
            assert await sb.synced()
            part = BatchesPart(hb, sb)
            await part.pull()
            got = sb.get(b.id)
            assert got is not None and got.status is BatchStatus.COMPLETED and got.completed == 3
        finally:
            stop.set()
            await asyncio.gather(*tasks)


async def test_a_stored_response_made_on_one_daemon_is_found_on_the_other(pgdb: PgDatabase) -> None:
    async with hub(pgdb, "a") as ha, hub(pgdb, "b") as hb:
        ra, rb = SharedResponseHomes(ha, every=0.01), SharedResponseHomes(hb)
        stop = asyncio.Event()
        task = asyncio.create_task(ra.run(stop))
        try:
            home = Home("m", "0a0a0a0a", 1, "0b0b0b0b", counted=False)
            ra.remember("resp_1", home)
            for _ in range(100):
                await rb.pull()
                if rb.get("resp_1") is not None:
                    break
                await asyncio.sleep(0.05)
            assert rb.get("resp_1") == home
            ra.forget("resp_1")
            for _ in range(100):
                await rb.pull()
                if rb.get("resp_1") is None:
                    break
                await asyncio.sleep(0.05)
            assert rb.get("resp_1") is None
        finally:
            stop.set()
            await task


async def test_a_key_unknown_here_makes_the_copy_read_the_table_again(pgdb: PgDatabase) -> None:
    async with hub(pgdb, "a") as h:
        ring = KeyRing(None)
        part = KeysPart(h, ring)
        h.add(part)
        await part.pull()
        # Made elsewhere, its notification missed (this daemon was not listening).
        new = new_key("gail", "", set())
        r = new.record
        with contextlib.closing(pgdb.connect()) as conn:
            conn.execute(
                "INSERT INTO llmgw_keys (key_id, user_name, project, sha256, created)"
                " VALUES (%s, %s, %s, %s, %s)",
                (r.key_id, r.user, r.project, r.sha256, r.created),
            )
        assert ring.lookup(new.key) is None
        for _ in range(100):
            await asyncio.sleep(0.05)
            if ring.lookup(new.key) is not None:
                break
        found = ring.lookup(new.key)
        assert found is not None and found.user == "gail"
