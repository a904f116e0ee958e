"""What a request waits for when its gateway's allowance does not cover it (several
gateways on one database, day or month budgets: llmgw_slurm/db/quota.py).

Against the project's PostgreSQL (scripts/dev-postgres up), one gateway's quota
book on a database of its own: ``--n`` times, a request's tokens are held and
the book asks (``QuotaBook.agree``: the budget's lock, one read, the held row
written, a notification, the commit), each time for another user, as a
user's first request after a while does. The reference, on the same pool in
the same run: a bare ``SELECT 1`` round trip. Medians; the ratio tells how many
round trips an agreement costs.

    eval "$(scripts/dev-postgres env)"
    python bench/budget_agreement.py [--n 500]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import median, print_table, result, write
from llmgw_slurm.accounting.quota import Ask, QuotaBook, Reservation
from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.config import QuotaConfig
from llmgw_slurm.db.connect import make_conninfo
from llmgw_slurm.db.hub import Hub
from llmgw_slurm.db.quota import SharedQuota
from tests.ha.conftest import fresh_database

ASK = Ask(3, 7)
_USERS = itertools.count()  # a user of its own for each request: none has an allowance


async def timed(hub: Hub, book: QuotaBook, n: int) -> tuple[list[float], ...]:
    """Interleaved, so both see the same load: (agreements, round trips) in seconds."""
    agree: list[float] = []
    trip: list[float] = []

    async def select_one(conn: Any) -> None:
        await conn.execute("SELECT 1")

    for i in range(n):
        user = KeyRecord(f"{i:08x}", f"user{next(_USERS)}", "phys", "0" * 64, 0.0)
        got = book.reserve(user, ASK)
        assert isinstance(got, Reservation) and not book.agreed(got)
        t = time.perf_counter()
        word = await book.agree(got, ASK)
        agree.append(time.perf_counter() - t)
        assert word is got, word
        got.release()
        t = time.perf_counter()
        await hub.run_sql(select_one)
        trip.append(time.perf_counter() - t)
    return agree, trip


async def run(n: int) -> list[dict[str, Any]]:
    with fresh_database() as db:
        cfg = db.config(connect_timeout=2.0)
        hub = Hub(make_conninfo(cfg, "bench"), "bench", cfg)
        await hub.start("http://gateway", "http://internal")
        try:
            shared = SharedQuota(hub)
            book = QuotaBook(QuotaConfig(user_tokens_per_day=10**12), others=shared)
            shared.book = book
            await timed(hub, book, 20)  # the pool's connections made, caches warm
            agree, trip = await timed(hub, book, n)
        finally:
            await hub.close()
    a, r = median(agree) * 1e3, median(trip) * 1e3
    print(f"agreement: median {a:.2f} ms; a bare round trip (SELECT 1): {r:.2f} ms")
    return [result("budget_agreement.p50", a, "ms", "select_1.p50", r)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500, help="agreements (and round trips) timed")
    args = ap.parse_args()
    results = asyncio.run(run(args.n))
    print_table(results)
    path = write("budget_agreement", results, vars(args))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
