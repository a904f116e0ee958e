"""Quotas across the gateways that share a database: one day's budget, whichever gateway.

Each gateway's :class:`~llmgw_slurm.accounting.quota.QuotaBook` lets requests in
from memory, as with one gateway; what it adds are the other gateways'
figures (:class:`SharedQuota`, its ``others``):

- spent: ``llmgw_spend``, the tokens per user and account per UTC day and
  month, written with the usage (db/usage.py); this gateway's own share of
  it is taken out (it counts its own in memory), by what its usage store
  reports it wrote;
- held: ``llmgw_holds``, what each gateway's requests in flight reserve per
  user and account (their reservations), and what it spent that its usage
  store has not written yet (the usage is written about once a second),
  written by each gateway when it changes, at most every ``every`` seconds.

Both are read on every ``spend``/``holds`` notification and every ``every``
seconds. The bound this gives, stated in docs/operations.md and measured by
the ha level: a budget is over-spent by at most what the other gateways let
in for the same user or account before they heard of the spend and holds
that used it up, that is, within one round of this sync (a notification,
then one read; ``every`` at worst), each such request counted at the most it
may spend. Per-minute limits are counted by each gateway alone: behind G
gateways a key may get up to G times its per-minute limit.

Accounts' own budgets (``llmgw-admin quota``) are ``llmgw_budgets``, read the
same way (:class:`SharedBudgets`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import psycopg

from llmgw_slurm.accounting.quota import AccountBudget, QuotaBook
from llmgw_slurm.db.connect import Conninfo, connect, database_error
from llmgw_slurm.db.hub import CHANNEL, DB_ERRORS, Hub

__all__ = ["SharedBudgets", "SharedQuota", "set_budget"]

log = logging.getLogger(__name__)

_LIVE = 10.0  # seconds: a daemon's holds count while it was seen this recently


def _period(span: str, start: float) -> str:
    t = time.gmtime(start + 1)
    if span == "day":
        return f"day:{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
    return f"month:{t.tm_year:04d}-{t.tm_mon:02d}"


class SharedQuota:
    """The other gateways' spend and holds, for a :class:`QuotaBook` (its ``others``)."""

    topic = "spend"

    def __init__(self, hub: Hub, every: float = 0.2) -> None:
        self.hub = hub
        self.every = every
        self.book: QuotaBook | None = None
        self._spend: dict[tuple[str, str, str], int] = {}
        self._mine: Counter[tuple[str, str, str]] = Counter()
        self._held: dict[tuple[str, str], int] = {}
        self._sent: dict[tuple[str, str], int] = {}
        self._last_seq = 0

    # ---- OtherGateways ----------------------------------------------------------------

    def used(self, kind: str, name: str, span: str, start: float) -> int:
        key = (kind, name, _period(span, start))
        return max(0, self._spend.get(key, 0) - self._mine.get(key, 0))

    def held(self, kind: str, name: str) -> int:
        return self._held.get((kind, name), 0)

    # ---- what this gateway did -------------------------------------------------------------

    def wrote(self, spend: Mapping[tuple[str, str, str], int]) -> None:
        """This gateway's usage store wrote ``spend``: in the table, and in the book already."""
        self._mine.update(spend)

    # ---- sync ---------------------------------------------------------------------------

    async def pull(self) -> None:
        async def read(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Any], list[Any]]:
            cur = await conn.execute(
                "SELECT kind, name, period, tokens, seq FROM llmgw_spend WHERE seq > %s",
                (self._last_seq,),
            )
            spend = await cur.fetchall()
            cur = await conn.execute(
                "SELECT kind, name, sum(tokens) FROM llmgw_holds WHERE daemon <> %s AND daemon IN"
                " (SELECT name FROM llmgw_daemons"
                "  WHERE last_seen > now() - make_interval(secs => %s)) GROUP BY kind, name",
                (self.hub.name, _LIVE),
            )
            return spend, await cur.fetchall()

        spend, held = await self.hub.run_sql(read)
        for kind, name, period, tokens, seq in spend:
            self._spend[(kind, name, period)] = int(tokens)
            self._last_seq = max(self._last_seq, int(seq))
        self._held = {(k, n): int(t) for k, n, t in held}
        self._forget_old()

    def _forget_old(self) -> None:
        if len(self._spend) < 50_000:
            return
        now = time.time()
        keep = {_period("day", now), _period("month", now)}
        self._spend = {k: v for k, v in self._spend.items() if k[2] in keep}
        self._mine = Counter({k: v for k, v in self._mine.items() if k[2] in keep})

    def _in_flight(self) -> dict[tuple[str, str], int]:
        """What the others must count of this gateway's beyond the table's spend: its
        requests' holds, and what it spent that its usage store has not written yet."""
        assert self.book is not None
        out = self.book.holding()
        for kind in ("user", "account"):
            start, used = self.book.spent_in(kind, "day")
            period = _period("day", start)
            for name, tokens in used.items():
                pending = tokens - self._mine.get((kind, name, period), 0)
                if pending > 0:
                    out[(kind, name)] = out.get((kind, name), 0) + pending
        return out

    async def push(self) -> None:
        """This gateway's holds, where they changed since the last push."""
        if self.book is None:
            return
        now = self._in_flight()
        changed = {h: n for h, n in now.items() if self._sent.get(h) != n}
        gone = [h for h in self._sent if h not in now]
        if not changed and not gone:
            return

        async def write(conn: psycopg.AsyncConnection[Any]) -> None:
            async with conn.transaction(), conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO llmgw_holds (daemon, kind, name, tokens) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (daemon, kind, name) DO UPDATE SET tokens = EXCLUDED.tokens",
                    [(self.hub.name, k, n, t) for (k, n), t in changed.items()]
                    + [(self.hub.name, k, n, 0) for k, n in gone],
                )
                await self.hub.notify(conn, "holds")

        await self.hub.run_sql(write)
        self._sent = dict(now)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.push()
            except DB_ERRORS as exc:
                # The book goes on with what it knows; the next round tries again.
                log.debug("quota: holds not shared: %s", exc)
                self._sent = {}
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every)


class SharedBudgets:
    """The accounts' own budgets from ``llmgw_budgets`` (a :class:`Budgets` for the book)."""

    topic = "budgets"

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.budgets: dict[str, AccountBudget] = {}

    def refresh(self) -> None:
        # Kept in step by pull(): nothing to read on a request's path.
        return

    async def pull(self) -> None:
        async def read(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            cur = await conn.execute(
                "SELECT account, tokens_per_day, tokens_per_month FROM llmgw_budgets"
            )
            return await cur.fetchall()

        rows = await self.hub.run_sql(read)
        # A new dict: the book works its rules out again when the object changes.
        self.budgets = {a: AccountBudget(d, m) for a, d, m in rows}


def set_budget(info: Conninfo, account: str, budget: AccountBudget) -> None:
    """``llmgw-admin quota set`` with a database: the account's budgets (both None: none)."""
    with contextlib.closing(connect(info)) as conn:
        try:
            with conn.transaction():
                if budget.tokens_per_day is None and budget.tokens_per_month is None:
                    conn.execute("DELETE FROM llmgw_budgets WHERE account = %s", (account,))
                else:
                    conn.execute(
                        "INSERT INTO llmgw_budgets (account, tokens_per_day, tokens_per_month)"
                        " VALUES (%s, %s, %s) ON CONFLICT (account) DO UPDATE SET"
                        " tokens_per_day = EXCLUDED.tokens_per_day,"
                        " tokens_per_month = EXCLUDED.tokens_per_month",
                        (account, budget.tokens_per_day, budget.tokens_per_month),
                    )
                conn.execute("SELECT pg_notify(%s, 'budgets llmgw-admin')", (CHANNEL,))
        except psycopg.Error as exc:
            raise database_error(info, exc, "writing the budget") from None


def budgets_of(info: Conninfo) -> dict[str, AccountBudget]:
    with contextlib.closing(connect(info)) as conn:
        rows = conn.execute(
            "SELECT account, tokens_per_day, tokens_per_month FROM llmgw_budgets"
        ).fetchall()
    return {a: AccountBudget(d, m) for a, d, m in rows}
