"""The daemons' shared secrets: one server key and one gateway identity for all of them.

A replica's secret and its engine key derive from the server key, and its
engine lets in only the gateway's client certificate: every daemon must hold
the same ones, or an agent's report to another daemon is refused and that
daemon cannot reach the engine. The database keeps them (``llmgw_secrets``,
readable by the service's database role alone, like the state directory),
and each daemon's state directory holds a copy, written at start.

The first daemon to start on an empty database gives it its own (the ones
its running replicas were started with); ``llmgw-admin db import`` does the
same for an existing state directory. A daemon whose own copy differs from
the database's is refused with what to do: its running replicas, if any,
were started with another key, and silently replacing it would orphan them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from llmgw_slurm.auth.secrets import load_or_create_server_key
from llmgw_slurm.auth.tls import load_or_create_identity
from llmgw_slurm.base.errors import DatabaseError
from llmgw_slurm.base.fsutil import atomic_write

__all__ = ["SHARED_FILES", "offer_secrets", "share_secrets"]

# The state directory's files every daemon must hold the same copy of.
SHARED_FILES = ("server.key", "gateway-client.key", "gateway-client.crt")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def offer_secrets(conn: psycopg.Connection[Any], state_dir: Path) -> None:
    """Put ``state_dir``'s secrets in the database unless it holds some already
    (made first if the folder has none)."""
    load_or_create_server_key(state_dir / "server.key")
    load_or_create_identity(state_dir)
    with conn.transaction():
        for name in SHARED_FILES:
            value = _read(state_dir / name)
            if value is not None:
                conn.execute(
                    "INSERT INTO llmgw_secrets (name, value) VALUES (%s, %s)"
                    " ON CONFLICT (name) DO NOTHING",
                    (name, value),
                )


def share_secrets(conn: psycopg.Connection[Any], state_dir: Path) -> None:
    """Make ``state_dir`` hold the database's secrets (offering its own if the database
    has none); DatabaseError when its own differ."""
    # Made by this start (a new login node, or two daemons' first start at once): the
    # database's copy wins, silently; only one a daemon ran with is worth refusing for.
    existed = {name: (state_dir / name).exists() for name in SHARED_FILES}
    if not _stored(conn):
        offer_secrets(conn, state_dir)
    stored = _stored(conn)
    missing = [n for n in SHARED_FILES if n not in stored]
    if missing:
        raise DatabaseError(
            f"the database's llmgw_secrets lacks {', '.join(missing)}; "
            "run `llmgw-admin db import` with the state directory of the daemon that "
            "started the running replicas, or empty the table to let a daemon offer its own"
        )
    for name in SHARED_FILES:
        path = state_dir / name
        mine = _read(path)
        if mine is None or not existed[name]:
            atomic_write(path, stored[name], mode=0o600)
        elif mine.strip() != stored[name].strip():
            raise DatabaseError(
                f"{path} differs from the copy the daemons share in the database: replicas "
                "started by this daemon could not report to the others, nor the others reach "
                f"their engines. If this daemon ran alone before, move {path} aside only once "
                "its replicas have ended, or start from `llmgw-admin db import` of this state "
                "directory on an empty database; otherwise move it aside to take the shared one"
            )


def _stored(conn: psycopg.Connection[Any]) -> dict[str, bytes]:
    rows = conn.execute("SELECT name, value FROM llmgw_secrets").fetchall()
    return {str(n): bytes(v) for n, v in rows}
