"""``llmgw-admin db import``: an embedded daemon's state directory into the shared database.

What moves: the daemon's secrets (its running replicas' secrets and engine
keys derive from its server key, and their engines let in only its gateway
certificate: without them every running replica would be orphaned), the
keys file, every usage record (with the day's and month's spend budgets
count), the accounts' own budgets, and the Batch API's file and batch
records. The files' bytes stay where they are: batch.directory must then
be on a filesystem every login node sees, at the same path.

Safe to run again, and to stop half-way: a key, a usage record (named by
the state directory and its SQLite row id) or a batch already in the
database is left as it is, never counted twice. A database that already
holds other secrets (another daemon's) is refused: two sets of running
replicas cannot both keep reporting.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg

from llmgw_slurm.accounting.quota import AccountBudgets
from llmgw_slurm.auth.keys import list_keys
from llmgw_slurm.base.errors import DatabaseError, LlmgwError
from llmgw_slurm.batch.store import BatchStore
from llmgw_slurm.db.hub import CHANNEL
from llmgw_slurm.db.secrets import SHARED_FILES
from llmgw_slurm.db.usage import spend_of

__all__ = ["import_state"]

_CHUNK = 5000


def import_state(
    conn: psycopg.Connection[Any], state_dir: Path, keys_file: Path | None, batch_dir: Path
) -> dict[str, int]:
    """Import ``state_dir`` (and its keys file and batch folder); what was newly written."""
    if not state_dir.is_dir():
        raise LlmgwError(f"{state_dir} is not a folder: give the old daemon's state_dir")
    try:
        counts = {"secrets": _secrets(conn, state_dir)}
        counts["keys"] = _keys(conn, keys_file) if keys_file is not None else 0
        counts["usage records"] = _usage(conn, state_dir)
        counts["account budgets"] = _budgets(conn, state_dir / "quotas.json")
        counts["files"], counts["batches"] = _batches(conn, batch_dir)
        for topic in ("keys", "spend", "budgets", "batches"):
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{topic} llmgw-admin"))
    except psycopg.Error as exc:
        raise DatabaseError(
            f"database: the import failed (nothing of its last step kept): {exc}"
        ) from None
    return counts


def _secrets(conn: psycopg.Connection[Any], state_dir: Path) -> int:
    mine = {}
    for name in SHARED_FILES:
        with contextlib.suppress(FileNotFoundError):
            mine[name] = (state_dir / name).read_bytes()
    if not mine:
        return 0
    with conn.transaction():
        stored = {n: bytes(v) for n, v in conn.execute("SELECT name, value FROM llmgw_secrets")}
        differ = [n for n in mine if n in stored and stored[n].strip() != mine[n].strip()]
        if differ:
            raise DatabaseError(
                f"the database holds other daemons' secrets ({', '.join(differ)} differ from "
                f"{state_dir}'s): import into a database of its own, or let this daemon's "
                "replicas end first"
            )
        n = 0
        for name, value in mine.items():
            if name not in stored:
                conn.execute(
                    "INSERT INTO llmgw_secrets (name, value) VALUES (%s, %s)", (name, value)
                )
                n += 1
    return n


def _keys(conn: psycopg.Connection[Any], keys_file: Path) -> int:
    n = 0
    with conn.transaction():
        for r in list_keys(keys_file):
            cur = conn.execute(
                "INSERT INTO llmgw_keys (key_id, user_name, project, sha256, created, revoked)"
                " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key_id) DO NOTHING",
                (r.key_id, r.user, r.project, r.sha256, r.created, r.revoked),
            )
            n += cur.rowcount
    return n


def _usage_rows(path: Path) -> Iterator[list[tuple[Any, ...]]]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
        # A store from before batches counted their requests: each row was one.
        requests = "requests" if "requests" in columns else "1"
        cur = db.execute(
            "SELECT rowid, ts, key_id, user, project, model, endpoint, prompt_tokens,"  # noqa: S608
            f" completion_tokens, total_tokens, {requests} FROM usage ORDER BY rowid"
        )
        while rows := cur.fetchmany(_CHUNK):
            yield rows


def _usage(conn: psycopg.Connection[Any], state_dir: Path) -> int:
    path = state_dir / "usage.sqlite3"
    if not path.exists():
        return 0
    origin = f"import:{state_dir.resolve()}"
    n = 0
    for chunk in _usage_rows(path):
        with conn.transaction(), conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO llmgw_usage (origin, seq, ts, key_id, user_name, project, model,"
                " endpoint, prompt_tokens, completion_tokens, total_tokens, requests)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (origin, seq) DO NOTHING"
                " RETURNING ts, user_name, project, total_tokens",
                [(origin, *row) for row in chunk],
                returning=True,
            )
            written = []
            while True:
                written.extend(cur.fetchall())
                if not cur.nextset():
                    break
            for (kind, name, period), tokens in sorted(spend_of(written).items()):
                cur.execute(
                    "INSERT INTO llmgw_spend (kind, name, period, tokens) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (kind, name, period) DO UPDATE SET"
                    " tokens = llmgw_spend.tokens + EXCLUDED.tokens,"
                    " seq = nextval('llmgw_change_seq')",
                    (kind, name, period, tokens),
                )
            n += len(written)
    return n


def _budgets(conn: psycopg.Connection[Any], path: Path) -> int:
    budgets = AccountBudgets(path).budgets
    with conn.transaction():
        for account, b in budgets.items():
            conn.execute(
                "INSERT INTO llmgw_budgets (account, tokens_per_day, tokens_per_month)"
                " VALUES (%s, %s, %s) ON CONFLICT (account) DO NOTHING",
                (account, b.tokens_per_day, b.tokens_per_month),
            )
    return len(budgets)


def _batches(conn: psycopg.Connection[Any], batch_dir: Path) -> tuple[int, int]:
    if not batch_dir.is_dir():
        return 0, 0
    files, batches = BatchStore(batch_dir).all_records()
    nf = nb = 0
    with conn.transaction():
        for f in files:
            cur = conn.execute(
                "INSERT INTO llmgw_files (id, owner, record) VALUES (%s, %s, %s)"
                " ON CONFLICT (id) DO NOTHING",
                (f.id, f.owner, json.dumps(asdict(f))),
            )
            nf += cur.rowcount
        for b in batches:
            cur = conn.execute(
                "INSERT INTO llmgw_batches (id, owner, record) VALUES (%s, %s, %s)"
                " ON CONFLICT (id) DO NOTHING",
                (b.id, b.owner, json.dumps(b.to_json())),
            )
            nb += cur.rowcount
    return nf, nb
