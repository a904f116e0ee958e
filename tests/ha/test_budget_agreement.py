"""Two gateways' quota books on one database that never read each other's news:
no notification is listened to and nothing is pulled; each writes its usage and
its held rows, and asks the database when its allowance does not cover a
request. Their clients at once still never let in more than the day budget
between them (llmgw_slurm/db/quota.py), and spend most of it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw_slurm.accounting.quota import Ask, QuotaBook, Reservation
from llmgw_slurm.accounting.usage import UsageRecord
from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.config import QuotaConfig
from llmgw_slurm.db.hub import Hub
from llmgw_slurm.db.quota import SharedQuota
from llmgw_slurm.db.usage import PgUsageStore
from tests.ha.conftest import PgDatabase
from tests.ha.test_stores import hub

pytestmark = [pytest.mark.ha]

BUDGET = 700
ASK = Ask(3, 7)  # a request may spend 10 tokens
CLIENTS = 8  # per gateway
ALICE = KeyRecord("0a0a0a0a", "alice", "phys", "0" * 64, 0.0)


@contextlib.asynccontextmanager
async def gateway(db: PgDatabase, name: str, tmp: Path) -> AsyncIterator[Client]:
    """A gateway's book on the database: its usage written and its held rows pushed
    (``SharedQuota.run``), nothing read but by its agreements."""
    async with hub(db, name) as h:
        store = PgUsageStore(h, tmp / name, flush_interval_s=0.05)
        shared = SharedQuota(h)
        store.on_spend = shared.wrote
        book = QuotaBook(QuotaConfig(user_tokens_per_day=BUDGET), others=shared)
        shared.book = book
        store.start()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(shared.run(stop)), asyncio.create_task(seen(h, stop))]
        try:
            yield Client(book, store)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await store.close()


async def seen(h: Hub, stop: asyncio.Event) -> None:
    """The daemon's presence, as its lease keeps it: a gateway not seen for 10 s is
    counted out, its held rows with it."""
    while not stop.is_set():
        await h.run_sql(
            lambda conn: conn.execute(
                "UPDATE llmgw_daemons SET last_seen = now() WHERE name = %s", (h.name,)
            )
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


class Client:
    def __init__(self, book: QuotaBook, store: PgUsageStore) -> None:
        self.book, self.store = book, store

    async def spend(self) -> int:
        """Requests until one is refused, each spending all it may: the tokens let in."""
        book, let_in = self.book, 0
        while True:
            got = book.reserve(ALICE, ASK)
            if isinstance(got, Reservation) and not book.agreed(got):
                got = await book.agree(got, ASK)
            if not isinstance(got, Reservation):
                return let_in
            let_in += got.tokens
            await asyncio.sleep(0)  # the other clients go on meanwhile
            got.settle(got.tokens)
            self.store.record(
                UsageRecord(time.time(), ALICE.key_id, ALICE.user, ALICE.project, "m", "chat",
                            ASK.prompt, ASK.answer, got.tokens)
            )  # fmt: skip


async def test_two_gateways_never_let_in_more_than_the_budget(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    async with gateway(pgdb, "a", tmp_path) as a, gateway(pgdb, "b", tmp_path) as b:
        spent = await asyncio.gather(*(g.spend() for g in (a, b) for _ in range(CLIENTS)))
    total = sum(spent)
    through = (sum(spent[:CLIENTS]), sum(spent[CLIENTS:]))
    assert total <= BUDGET, f"let in {total} of {BUDGET}: {through}"
    # What stops each client: less left than its request may take, with what the
    # other gateway holds for its own (its last clients' requests, its allowance).
    assert total >= BUDGET - 2 * CLIENTS * ASK.tokens, f"let in {total} of {BUDGET}: {through}"
    assert all(through), through
    print(f"\nbudget {BUDGET}, two gateways x {CLIENTS} clients: let in {through}")
