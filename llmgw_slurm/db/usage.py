"""Per-key usage in the shared database, and what budgets count (``llmgw_spend``).

The gateway records as it does with SQLite (accounting/usage.py's UsageStore):
the request path appends to a list; about once a second the batch is
written, here in one transaction that inserts the records and adds their
tokens to the day's and month's spend per user and account. A record is
named by (origin, seq): this daemon's run and a number, so a batch written
twice (an answer lost after the commit) counts once.

A database that is slow or down does not slow serving: the batch that could
not be written is appended to a spool file in the state directory (fsynced),
and replayed, oldest first, on every later flush until the database takes it;
a daemon restarted meanwhile replays it too. So no usage is lost with the
database down, only counted late (budgets see it once it is written).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg

from llmgw_slurm.accounting.usage import USAGE_GROUPS, UsageRecord, UsageSummary
from llmgw_slurm.db.connect import Conninfo, connect
from llmgw_slurm.db.hub import DB_ERRORS, Hub

__all__ = ["PgUsage", "PgUsageStore", "period_keys", "spend_of"]

log = logging.getLogger(__name__)

_SPEND_LOCK = 0x6C6C6D6702  # llmgw_spend's writers, one at a time (seq order = commit order)
# Records one spool line holds at most (a line is one batch).
_SPOOL_NAME = "usage-spool.jsonl"


def period_keys(ts: float) -> tuple[str, str]:
    """The UTC day and month ``ts`` falls in, as llmgw_spend names them."""
    t = time.gmtime(ts)
    return (
        f"day:{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}",
        f"month:{t.tm_year:04d}-{t.tm_mon:02d}",
    )


Row = tuple[str, int, float, str, str, str, str, str, int, int, int, int]


def _row(origin: str, seq: int, r: UsageRecord) -> Row:
    return (
        origin,
        seq,
        r.ts,
        r.key_id,
        r.user,
        r.project,
        r.model,
        r.endpoint,
        r.prompt_tokens,
        r.completion_tokens,
        r.total_tokens,
        r.requests,
    )


def spend_of(rows: Iterable[tuple[float, str, str, int]]) -> Counter[tuple[str, str, str]]:
    """Tokens per (kind, name, period) of the records written."""
    out: Counter[tuple[str, str, str]] = Counter()
    for ts, user, project, total in rows:
        for period in period_keys(ts):
            if user:
                out[("user", user, period)] += total
            if project:
                out[("account", project, period)] += total
    return out


async def write_rows(
    conn: psycopg.AsyncConnection[Any], rows: Sequence[Row], hub: Hub
) -> tuple[int, Counter[tuple[str, str, str]]]:
    """Insert ``rows`` (those not written before) and their spend; (the number inserted,
    the spend they added)."""
    async with conn.transaction():
        async with conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO llmgw_usage (origin, seq, ts, key_id, user_name, project, model,"
                " endpoint, prompt_tokens, completion_tokens, total_tokens, requests)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (origin, seq) DO NOTHING"
                " RETURNING ts, user_name, project, total_tokens",
                list(rows),
                returning=True,
            )
            written: list[tuple[float, str, str, int]] = []
            while True:
                written.extend(await cur.fetchall())
                if not cur.nextset():  # the next record's RETURNING (sync: already read)
                    break
        spend = spend_of(written)
        if spend:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SPEND_LOCK,))
            async with conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO llmgw_spend (kind, name, period, tokens) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (kind, name, period) DO UPDATE SET"
                    " tokens = llmgw_spend.tokens + EXCLUDED.tokens,"
                    " seq = nextval('llmgw_change_seq')",
                    [(k, n, p, t) for (k, n, p), t in sorted(spend.items())],
                )
            await hub.notify(conn, "spend")
    return len(written), spend


class PgUsageStore:
    """The gateway's usage sink on the shared database: batched, spooled when it is down."""

    def __init__(self, hub: Hub, state_dir: Path, *, flush_interval_s: float = 1.0) -> None:
        self.hub = hub
        self.flush_interval_s = flush_interval_s
        self.spool = state_dir / _SPOOL_NAME
        # This run's name for its records: (origin, seq) is written once, whatever replays.
        self.origin = f"{hub.name}/{secrets.token_hex(6)}"
        self._seq = 0
        self._pending: list[UsageRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        # Called with the spend written (kind, name, period) -> tokens (for the quota book).
        self.written = 0
        self.spooled = 0
        self.queries = PgUsage(hub.info)
        # Told what this run's records added to llmgw_spend (the quota book counted
        # them already, as it spent them).
        self.on_spend: Callable[[Mapping[tuple[str, str, str], int]], None] | None = None

    def record(self, rec: UsageRecord) -> None:
        self._pending.append(rec)

    async def flush(self) -> None:
        """Write everything recorded so far, or spool it; then replay the spool."""
        async with self._lock:
            batch, self._pending = self._pending, []
            rows = []
            for r in batch:
                self._seq += 1
                rows.append(_row(self.origin, self._seq, r))
            if rows:
                try:
                    self.written += await self._write(rows)
                except DB_ERRORS as exc:
                    await asyncio.to_thread(_append, self.spool, rows)
                    self.spooled += len(rows)
                    log.warning(
                        "usage: database unreachable, %d records spooled: %s", len(rows), exc
                    )
                    return
            await self._replay()

    async def _write(self, rows: Sequence[Row]) -> int:
        async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[int, Any]:
            return await write_rows(conn, rows, self.hub)

        n, spend = await self.hub.run_sql(work)
        if self.on_spend is not None and rows and rows[0][0] == self.origin:
            self.on_spend(spend)
        return int(n)

    async def _replay(self) -> None:
        lines = await asyncio.to_thread(_read_spool, self.spool)
        if not lines:
            return
        done = 0
        try:
            for rows in lines:
                self.written += await self._write(rows)
                done += 1
        except DB_ERRORS as exc:
            log.warning("usage: replaying the spool stopped at batch %d: %s", done + 1, exc)
        finally:
            if done:
                await asyncio.to_thread(_drop_spooled, self.spool, done)
                log.info("usage: %d spooled batches written", done)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception:
                # Usage accounting must not take the gateway down.
                log.exception("usage: flush failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    def summary(
        self, *, key_id: str | None = None, since: float | None = None
    ) -> list[UsageSummary]:
        return self.queries.query(key_id=key_id, since=since)


def _append(path: Path, rows: Sequence[Row]) -> None:
    # One line a batch, fsynced: a crash loses no batch the gateway counted.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(rows) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_spool(path: Path) -> list[list[Row]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, TypeError):
            # A torn last line (a crash mid-write) is skipped; it was never counted.
            out.append([tuple(r) for r in json.loads(line)])
    return out


def _drop_spooled(path: Path, done: int) -> None:
    """Remove the first ``done`` batches (written); a batch spooled meanwhile stays."""
    lines = path.read_text().splitlines(keepends=True)
    rest = lines[done:]
    if rest:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(rest))
        os.chmod(tmp, 0o600)
        tmp.replace(path)
    else:
        path.unlink(missing_ok=True)


class PgUsage:
    """The usage queries of accounting/usage.py, on the shared database (for the CLIs,
    ``/api/v1/usage`` and ``llmgw-admin audit``)."""

    def __init__(self, info: Conninfo) -> None:
        self.info = info

    def _rows(self, sql: str, args: Sequence[object]) -> list[tuple[Any, ...]]:
        with contextlib.closing(connect(self.info)) as conn:
            return conn.execute(sql.encode(), args).fetchall()

    def query(
        self,
        *,
        key_id: str | None = None,
        since: float | None = None,
        user: str | None = None,
        project: str | None = None,
    ) -> list[UsageSummary]:
        sql = (
            "SELECT key_id, user_name, project, model, SUM(requests), SUM(prompt_tokens),"
            " SUM(completion_tokens), SUM(total_tokens) FROM llmgw_usage WHERE true"
        )
        args: list[object] = []
        for column, value in (("key_id", key_id), ("user_name", user), ("project", project)):
            if value is not None:
                sql += f" AND {column} = %s"
                args.append(value)
        if since is not None:
            sql += " AND ts >= %s"
            args.append(since)
        sql += " GROUP BY key_id, user_name, project, model ORDER BY key_id, model"
        return [
            UsageSummary(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), int(r[6]), int(r[7]))
            for r in self._rows(sql, args)
        ]

    def totals(self, since: float) -> dict[tuple[str, str], int]:
        sql = (
            "SELECT user_name, project, SUM(total_tokens) FROM llmgw_usage WHERE ts >= %s"
            " GROUP BY user_name, project"
        )
        return {(u, p): int(t or 0) for u, p, t in self._rows(sql, (since,))}

    def by(self, by: str, since: float | None = None) -> list[dict[str, object]]:
        column = {**USAGE_GROUPS, "user": "user_name"}[by]
        # column is one of fixed names, never the caller's text.
        sql = (
            f"SELECT {column}, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens),"  # noqa: S608
            " SUM(total_tokens) FROM llmgw_usage WHERE ts >= %s"
            f" GROUP BY {column} ORDER BY SUM(total_tokens) DESC, {column}"
        )
        names = ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
        return [
            {by: row[0], **dict(zip(names, (int(x or 0) for x in row[1:]), strict=True))}
            for row in self._rows(sql, (since or 0.0,))
        ]

    def tokens_by(self, by: str, model: str, since: float, until: float) -> dict[str, int]:
        column = {"user": "user_name", "account": "project"}[by]
        sql = (
            f"SELECT {column}, SUM(total_tokens) FROM llmgw_usage"  # noqa: S608
            f" WHERE model = %s AND ts >= %s AND ts < %s AND endpoint != 'batch' GROUP BY {column}"
        )
        return {str(o): int(t or 0) for o, t in self._rows(sql, (model, since, until))}
