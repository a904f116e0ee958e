"""PostgreSQL restarted under load: serving goes on, no usage and no key is lost.

Both gateways serve one key while scripts/dev-postgres restarts the server
(every session cut). The gateways keep answering from what they hold in
memory; the usage they could not write meanwhile is spooled to disk and
written once the server is back: the tokens in the database are the tokens
the clients were answered with, neither fewer nor more.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
from pathlib import Path

import pytest

from llmgw_slurm.db.keys import PgKeyStore
from tests.ha.conftest import PgDatabase
from tests.ha.peers import TOP, Peers
from tests.ha.test_failover import ALWAYS, Load, ready_on
from tests.ha.test_shared_state import _spent, answers
from tests.slurm.conftest import eventually

pytestmark = [pytest.mark.ha]


async def test_postgres_restarted_under_load(pgdb: PgDatabase, tmp_path: Path) -> None:
    key = PgKeyStore(pgdb.info()).add("carol").key
    model = {**ALWAYS, "name": "slow"}
    peers = Peers.make(tmp_path, "ha" + secrets.token_hex(3) + ".", pgdb, [model])
    try:
        peers.start()
        await peers.leader()
        for p in peers.peers:
            await ready_on(p, "slow")
        loads = [Load(p.url, key, "slow", n=2) for p in peers.peers]
        for load in loads:
            load.start()
        await asyncio.sleep(2)
        await asyncio.to_thread(
            subprocess.run, [str(TOP / "scripts" / "dev-postgres"), "restart"], check=True
        )
        await asyncio.sleep(3)
        for load in loads:
            await load.stop()
        assert [load.errors for load in loads] == [[], []]
        answered = sum(load.tokens for load in loads)
        assert answered > 0

        async def all_written() -> bool:
            return await _spent(pgdb, "carol") == answered

        # Written within seconds once the server is back (the spool replayed).
        await eventually(all_written, f"{answered} tokens in the database", 60)
        assert [await answers(p.url, key) for p in peers.peers] == [200, 200]
        with contextlib.closing(pgdb.connect()) as conn:
            n = conn.execute("SELECT count(*) FROM llmgw_keys WHERE revoked IS NULL").fetchone()
        assert n == (1,)
    finally:
        peers.stop()
        peers.cancel_all()
