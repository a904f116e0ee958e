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
seconds: what the book shows and refuses by. They are not what lets a
request in, because a read is always a little old: two gateways that each
saw room for one more request would both let theirs in. What lets a request
in is an *allowance*: tokens this gateway told the others it may hold, under
a lock of the user's (or account's) budget in the database, before holding
them. Its held row in ``llmgw_holds`` is the larger of what its requests
hold (with its unwritten spend) and its allowance, so the others count an
allowance as if spent. A request whose user's allowance covers it is let in
from memory; one it does not cover waits for :meth:`SharedQuota.agree`: one
transaction that takes the lock, reads the spend and every live gateway's
held row, and either refuses or raises the allowance by a share of the room
left (the room divided among the live gateways, so near a budget's end the
shares shrink and every request asks). Since each gateway's own requests
stay within an allowance the others counted before it was used, the
gateways together never let in more than the budget, however late a read
or a notification: over-spent only by what answers use beyond their
reservation (a prompt larger than its estimate). An allowance no request
used for ``_IDLE`` seconds is given back. While the database cannot be
reached, a request goes in on the figures last read (as with one gateway:
requests keep working), and the bound holds again once it is back.
Per-minute limits are counted by each gateway alone: behind G gateways a
key may get up to G times its per-minute limit.

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
from typing import Any, NamedTuple

import psycopg

from llmgw_slurm.accounting.quota import AccountBudget, Budget, QuotaBook
from llmgw_slurm.db.connect import Conninfo, connect, database_error
from llmgw_slurm.db.hub import CHANNEL, DB_ERRORS, Hub

__all__ = ["SharedBudgets", "SharedQuota", "set_budget"]

log = logging.getLogger(__name__)

_LIVE = 10.0  # seconds: a daemon's holds count while it was seen this recently
_IDLE = 2.0  # seconds: an allowance no request used for this long is given back
# Seconds a request waits for the database's word on its budget before it goes in
# on the figures last read (a slow database slows no request by more).
_WORD_WITHIN = 1.0
# pg_advisory_xact_lock's first key for a budget's lock ("llmgw" "Q"); the second
# is hashtext of its kind and name. One budget's agreements go one at a time.
_BUDGET_LOCK = 0x6C6C6D51


class _Allowance:
    """What a gateway may let in for one user or account without asking: its gross
    for the ``day`` (held, and spent through it) up to ``gross``."""

    __slots__ = ("day", "gross", "used_at")

    def __init__(self, day: float, gross: int, used_at: float) -> None:
        self.day, self.gross, self.used_at = day, gross, used_at


class _Seen(NamedTuple):
    """What an agreement read under its budgets' locks."""

    spent: dict[tuple[str, str, str], int]  # (kind, name, period) -> tokens, all gateways
    held: dict[tuple[str, str], int]  # the other live gateways' held rows
    live: int  # gateways alive, this one among them

    def room(self, key: tuple[str, str], mine: int, budgets: list[Budget]) -> int:
        """What is left of ``key``'s tightest budget once everyone's counted (below
        zero: this gateway's requests hold more than there is)."""
        left = [
            limit - self.spent.get((kind, name, _period(span, start)), 0)
            - self.held.get(key, 0) - mine
            for kind, name, span, start, limit in budgets
            if (kind, name) == key
        ]
        return min(left)


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
        # (kind, name) -> what this gateway may let in without asking again.
        self._allowed: dict[tuple[str, str], _Allowance] = {}
        # Writes of this gateway's held rows, one at a time: a push that read its
        # figures before an agreement raised them must not write after it.
        self._writing = asyncio.Lock()
        self._warned_at = -60.0
        self._spend_written = asyncio.Event()

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
        self._spend_written.set()

    # ---- allowances ---------------------------------------------------------------------

    def covers(self, kind: str, name: str) -> bool:
        """Whether this gateway's allowance for ``kind`` ``name`` covers what its
        requests hold now (the one just held among them)."""
        allowed = self._allowed.get((kind, name))
        if allowed is None:
            return False
        day, gross, _ = self._gross_of(kind, name)
        if allowed.day != day or gross > allowed.gross:
            return False
        allowed.used_at = time.monotonic()
        return True

    async def agree(self, budgets: list[Budget]) -> bool | None:
        """Ask the database for room for what this gateway's requests hold now, on
        ``budgets`` (one key's): True (the allowances raised and told the others),
        False (no room: the book refuses), None (the database did not answer: the
        book lets the request in on the figures it last read)."""
        if not self.hub.healthy(_WORD_WITHIN * 10):
            return None  # known unreachable: no request waits to find it out again
        try:
            # The wait for a push under way counts too. Cut after the commit, the
            # table says more than this gateway knows: safe, it only counts more.
            async with asyncio.timeout(_WORD_WITHIN), self._writing:
                room: bool = await self.hub.run_sql(lambda conn: self._agree(conn, budgets))
        except DB_ERRORS as exc:
            self._no_word(budgets, exc)
            return None
        return room

    def _no_word(self, budgets: list[Budget], exc: BaseException) -> None:
        # Once a minute at most: a slow database would otherwise log every request.
        now = time.monotonic()
        if now - self._warned_at < 60.0:
            return
        self._warned_at = now
        names = ", ".join(sorted({f"{b[0]} {b[1]}" for b in budgets}))
        log.warning("quota: no word from the database on %s within %g s; requests go in on "
                    "the figures last read: %s", names, _WORD_WITHIN, exc or type(exc).__name__)

    async def _agree(self, conn: psycopg.AsyncConnection[Any], budgets: list[Budget]) -> bool:
        names = sorted({(kind, name) for kind, name, _, _, _ in budgets})
        async with conn.transaction():
            # In one order: two agreements on the same budgets never wait on each other.
            for kind, name in names:
                await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                                   (_BUDGET_LOCK, f"{kind} {name}"))
            # What this gateway wrote, taken before the read: a write that commits
            # while the read is under way is then still in this gateway's figure if
            # it is not in the table's (counted twice at worst, never nowhere). The
            # gross is taken after: requests let in meanwhile are in it.
            written = {key: self._gross_of(*key)[2] for key in names}
            seen = await self._read_budgets(conn, budgets, names)
            mine = {key: self._gross_of(*key)[:2] for key in names}
            room = {key: seen.room(key, gross - written[key], budgets)
                    for key, (_, gross) in mine.items()}
            if any(r < 0 for r in room.values()):
                return False
            now = time.monotonic()
            grant = {key: _Allowance(day, gross + room[key] // seen.live, now)
                     for key, (day, gross) in mine.items()}
            rows = {key: grant[key].gross - written[key] for key in names}
            async with conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO llmgw_holds (daemon, kind, name, tokens) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (daemon, kind, name) DO UPDATE SET tokens = EXCLUDED.tokens",
                    [(self.hub.name, k, n, t) for (k, n), t in rows.items()],
                )
            await self.hub.notify(conn, "holds")
        self._allowed.update(grant)
        self._sent.update(rows)
        return True

    async def _read_budgets(
        self, conn: psycopg.AsyncConnection[Any], budgets: list[Budget],
        names: list[tuple[str, str]],
    ) -> _Seen:
        """Under the budgets' locks: their spend, the other live gateways' held rows,
        and how many gateways live; the figures the book shows are brought up to them.

        One statement, so one snapshot: a gateway writes its spend to the table
        before it lowers its held row by it, and two reads could see the row
        lowered but not the spend (counted nowhere). A transaction's snapshot
        will not do either: it would be taken before the lock was granted."""
        periods = sorted({(k, n, _period(span, start)) for k, n, span, start, _ in budgets})
        cur = await conn.execute(
            "SELECT 's', kind, name, period, tokens FROM llmgw_spend WHERE (kind, name, period)"
            "  IN (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))"
            " UNION ALL"
            " SELECT 'h', kind, name, '', sum(tokens) FROM llmgw_holds WHERE daemon <> %s"
            "  AND daemon IN (SELECT name FROM llmgw_daemons"
            "   WHERE last_seen > now() - make_interval(secs => %s))"
            "  AND (kind, name) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
            "  GROUP BY kind, name"
            " UNION ALL"
            " SELECT 'n', '', '', '', count(*) FROM llmgw_daemons WHERE name <> %s"
            "  AND stopped_at IS NULL AND last_seen > now() - make_interval(secs => %s)",
            (
                *(list(column) for column in zip(*periods, strict=True)),
                self.hub.name, _LIVE, [k for k, _ in names], [n for _, n in names],
                self.hub.name, _LIVE,
            ),
        )
        spent: dict[tuple[str, str, str], int] = {}
        held: dict[tuple[str, str], int] = {}
        live = 1
        for what, kind, name, period, tokens in await cur.fetchall():
            if what == "s":
                spent[(kind, name, period)] = int(tokens)
            elif what == "h":
                held[(kind, name)] = int(tokens)
            else:
                live += int(tokens)
        for period_key, tokens in spent.items():
            self._spend[period_key] = max(self._spend.get(period_key, 0), tokens)
        for key in names:
            self._held[key] = held.get(key, 0)
        return _Seen(spent, held, live)

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

    def _gross_of(self, kind: str, name: str) -> tuple[float, int, int]:
        """The day, what this gateway holds and spent in it for ``kind`` ``name``, and
        how much of that spend its usage store wrote to the table. An allowance
        bounds the gross, which a write does not change: a bound on what is not
        written yet would have to shrink with each write, and one granted while a
        write was under way would count that write twice."""
        assert self.book is not None
        day, used = self.book.spent_of(kind, name, "day")
        written = self._mine.get((kind, name, _period("day", day)), 0)
        return day, self.book.holding_of(kind, name) + max(used, written), written

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

    def _held_rows(self) -> dict[tuple[str, str], int]:
        """What this gateway's held rows say: its in-flight figure, or its allowance
        where that is more (an allowance idle for ``_IDLE`` seconds given back)."""
        out = self._in_flight()
        idle = time.monotonic() - _IDLE
        for key, allowed in list(self._allowed.items()):
            day, _, written = self._gross_of(*key)
            if allowed.used_at < idle or allowed.day != day:
                del self._allowed[key]
            elif allowed.gross - written > out.get(key, 0):
                out[key] = allowed.gross - written
        return out

    async def push(self) -> None:
        """This gateway's held rows, where they changed since the last push."""
        if self.book is None:
            return
        async with self._writing:
            await self._push()

    async def _push(self) -> None:
        now = self._held_rows()
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
            # Cleared before the push: a write while it runs wakes the next at once.
            self._spend_written.clear()
            try:
                await self.push()
            except DB_ERRORS as exc:
                # The book goes on with what it knows; the next round tries again.
                log.debug("quota: holds not shared: %s", exc)
                self._sent = {}
            # Until the next round, or at once when written spend left the held
            # rows counting it twice (the table has it now): near a budget's end
            # the others would refuse on that double count.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.every):
                    await _first(stop, self._spend_written)


async def _first(*events: asyncio.Event) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


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
