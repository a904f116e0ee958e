"""Per-key token usage, stored in SQLite in the daemon's state directory.

Why SQLite rather than an append-only JSONL file: the questions asked of this
data are aggregates ("tokens by key since Monday", "which model does project
X use"), and SQLite answers them with an index instead of a scan of every line
ever written; it is in the standard library; and its WAL journal keeps the
file consistent across a crash, where a JSONL file can end in a torn line.

Writes are batched: the request path only appends to a list, and a background
task commits the batch about once a second in a worker thread, so a slow disk
never stalls the event loop. The cost: a crash loses at most the last second
of records (a clean shutdown flushes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from llmgw_slurm.guard.faults import Faults

__all__ = [
    "USAGE_GROUPS",
    "SqliteUsage",
    "UsageQueries",
    "UsageRecord",
    "UsageSink",
    "UsageStore",
    "UsageSummary",
    "query_usage",
    "token_totals",
    "tokens_by",
    "usage_by",
]

_log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL,
    key_id TEXT NOT NULL,
    user TEXT NOT NULL,
    project TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    total_tokens INTEGER NOT NULL,
    -- A batch is one record of all its requests: requests counts them.
    requests INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key_id, ts);
-- Budgets start from the day's and month's totals over every key (accounting/quota.py).
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
"""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request's tokens, or a batch's (``requests``: how many it answered).
    ``key_id`` is "" when the gateway runs without keys."""

    ts: float
    key_id: str
    user: str
    project: str
    model: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    requests: int = 1


@dataclass(frozen=True, slots=True)
class UsageSummary:
    key_id: str
    user: str
    project: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Made 0600 before SQLite opens it, whatever the umask: SQLite gives the
    # -wal and -shm files the database's own mode, so they are private too.
    # Another user who could open -shm could lock it and stop every write.
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.chmod(path, 0o600)
    conn = sqlite3.connect(path, check_same_thread=False, timeout=10)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(_SCHEMA)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(usage)")}
    if "requests" not in columns:
        # A store written before batches counted their requests: each old row was one.
        with conn:
            conn.execute("ALTER TABLE usage ADD COLUMN requests INTEGER NOT NULL DEFAULT 1")
    return conn


def query_usage(
    path: Path,
    *,
    key_id: str | None = None,
    since: float | None = None,
    user: str | None = None,
    project: str | None = None,
) -> list[UsageSummary]:
    """Usage summed by key and model, optionally for one key, user or project (account),
    and since a time (epoch s)."""
    if not path.exists():
        return []
    sql = (
        "SELECT key_id, user, project, model, SUM(requests), SUM(prompt_tokens),"
        " SUM(completion_tokens), SUM(total_tokens) FROM usage WHERE 1=1"
    )
    args: list[object] = []
    for column, value in (("key_id", key_id), ("user", user), ("project", project)):
        if value is not None:
            sql += f" AND {column} = ?"
            args.append(value)
    if since is not None:
        sql += " AND ts >= ?"
        args.append(since)
    sql += " GROUP BY key_id, user, project, model ORDER BY key_id, model"
    with contextlib.closing(_connect(path)) as conn:
        rows = conn.execute(sql, args).fetchall()
    return [UsageSummary(*row) for row in rows]


def token_totals(path: Path, since: float) -> dict[tuple[str, str], int]:
    """Total tokens since ``since`` (epoch s) by (user, project): what budgets start from."""
    if not path.exists():
        return {}
    sql = "SELECT user, project, SUM(total_tokens) FROM usage WHERE ts >= ? GROUP BY user, project"
    with contextlib.closing(_connect(path)) as conn:
        rows = conn.execute(sql, (since,)).fetchall()
    return {(u, p): int(t or 0) for u, p, t in rows}


# What usage_by may group by: its name and the column.
USAGE_GROUPS = {"user": "user", "account": "project", "key": "key_id", "model": "model"}


def usage_by(path: Path, by: str, since: float | None = None) -> list[dict[str, object]]:
    """Requests and tokens grouped by user, account (the key's project), key or model."""
    column = USAGE_GROUPS[by]
    if not path.exists():
        return []
    # column is one of USAGE_GROUPS' fixed names, never the caller's text.
    sql = (
        f"SELECT {column}, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens),"  # noqa: S608
        " SUM(total_tokens) FROM usage WHERE ts >= ?"
        f" GROUP BY {column} ORDER BY SUM(total_tokens) DESC, {column}"
    )
    with contextlib.closing(_connect(path)) as conn:
        rows = conn.execute(sql, (since or 0.0,)).fetchall()
    names = ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
    return [{by: row[0], **dict(zip(names, row[1:], strict=True))} for row in rows]


def tokens_by(path: Path, by: str, model: str, since: float, until: float) -> dict[str, int]:
    """Total tokens of ``model`` in ``[since, until)`` (epoch s) by user or account.

    What ``llmgw-admin audit --by user|account`` apportions a replica's GPU hours by.
    Batches' tokens (endpoint "batch") are left out: their own jobs served them.
    """
    column = {"user": "user", "account": "project"}[by]
    if not path.exists():
        return {}
    # column is one of two fixed names, never the caller's text.
    sql = (
        f"SELECT {column}, SUM(total_tokens) FROM usage"  # noqa: S608
        f" WHERE model = ? AND ts >= ? AND ts < ? AND endpoint != 'batch' GROUP BY {column}"
    )
    with contextlib.closing(_connect(path)) as conn:
        rows = conn.execute(sql, (model, since, until)).fetchall()
    return {str(o): int(t or 0) for o, t in rows}


# Records kept for a retry while the database cannot be written (about 100 MB):
# past it the oldest are dropped, and the fault count in /metrics has said so.
_MAX_PENDING = 1_000_000


class UsageQueries(Protocol):
    """What is asked of the usage, wherever it is kept: :class:`SqliteUsage` (the
    state directory's SQLite) or the shared database's (llmgw_slurm.db.usage)."""

    def query(
        self,
        *,
        key_id: str | None = None,
        since: float | None = None,
        user: str | None = None,
        project: str | None = None,
    ) -> list[UsageSummary]: ...

    def totals(self, since: float) -> dict[tuple[str, str], int]: ...

    def by(self, by: str, since: float | None = None) -> list[dict[str, object]]: ...

    def tokens_by(self, by: str, model: str, since: float, until: float) -> dict[str, int]: ...


class UsageSink(Protocol):
    """Where the gateway puts each request's usage: :class:`UsageStore` (SQLite) or the
    shared database's (llmgw_slurm.db.usage.PgUsageStore). ``record`` is on the
    request's path: it must only append."""

    @property
    def queries(self) -> UsageQueries: ...

    def record(self, rec: UsageRecord) -> None: ...

    def start(self) -> None: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class SqliteUsage:
    """:class:`UsageQueries` over the SQLite file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def query(
        self,
        *,
        key_id: str | None = None,
        since: float | None = None,
        user: str | None = None,
        project: str | None = None,
    ) -> list[UsageSummary]:
        return query_usage(self.path, key_id=key_id, since=since, user=user, project=project)

    def totals(self, since: float) -> dict[tuple[str, str], int]:
        return token_totals(self.path, since)

    def by(self, by: str, since: float | None = None) -> list[dict[str, object]]:
        return usage_by(self.path, by, since)

    def tokens_by(self, by: str, model: str, since: float, until: float) -> dict[str, int]:
        return tokens_by(self.path, by, model, since, until)


class UsageStore:
    """Collects usage records on the event loop and commits them in batches."""

    def __init__(
        self, path: Path, *, flush_interval_s: float = 1.0, faults: Faults | None = None
    ) -> None:
        self.path = path
        self.queries: UsageQueries = SqliteUsage(path)
        self.flush_interval_s = flush_interval_s
        # Where a failed write is counted (the daemon's, for /metrics).
        self.faults = faults or Faults()
        self._pending: list[UsageRecord] = []
        self._conn = _connect(path)
        # One connection, used by one worker thread at a time.
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def record(self, rec: UsageRecord) -> None:
        self._pending.append(rec)

    def _write(self, batch: list[UsageRecord]) -> None:
        with self._lock, self._conn:
            self._conn.executemany(
                "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
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
                    for r in batch
                ],
            )

    async def flush(self) -> None:
        """Commit everything recorded so far; on a failure it stays pending (and raises)."""
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            await asyncio.to_thread(self._write, batch)
        except Exception:
            # Nothing of it was committed (one transaction): kept for the next try,
            # before what came meanwhile, unless that would hold too much.
            self._pending[:0] = batch[-_MAX_PENDING:]
            del self._pending[:-_MAX_PENDING]
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception as err:
                # Usage accounting must not take the gateway down, nor stop for good
                # (a full disk, EMFILE, a locked file): the records wait for the
                # next flush, which tries again.
                self.faults.record("usage", err)

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
        with self._lock:
            self._conn.close()

    def summary(
        self, *, key_id: str | None = None, since: float | None = None
    ) -> list[UsageSummary]:
        """What is committed (call :meth:`flush` first for the latest)."""
        return query_usage(self.path, key_id=key_id, since=since)
