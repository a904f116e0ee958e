"""API keys in the shared database: the store (``llmgw-admin keys``, ``llmgw login``) and
every gateway's copy of it.

A gateway checks keys against its :class:`~llmgw_slurm.auth.keys.KeyRing` in
memory, as with the keys file: nothing on a request's path queries the
database. The copy is the whole table, read at start and then the rows
changed since (a ``keys`` notification after each change: a key made or
revoked on one login node holds on the others within a moment). With the
database down, the keys already known keep working, revocations made
elsewhere meanwhile hold once it is back, and a new login is a clear 503.

The store's writes are the keys file's rules in one transaction each: a
user's count of active keys is read under a lock of that user, so two logins
at once on two login nodes cannot both pass the cap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import psycopg

from llmgw_slurm.auth.keys import KeyRecord, KeyRing, NewKey, check_limit, check_names, new_key
from llmgw_slurm.base.errors import LlmgwError
from llmgw_slurm.db.connect import Conninfo, connect, database_error
from llmgw_slurm.db.hub import CHANNEL, Hub

__all__ = ["KeysPart", "PgKeyStore"]

_INSERT = (
    "INSERT INTO llmgw_keys (key_id, user_name, project, sha256, created, revoked)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
)
_SELECT = "SELECT key_id, user_name, project, sha256, created, revoked, seq FROM llmgw_keys"
_WRITE_LOCK = 0x6C6C6D6703  # llmgw_keys' writers, one at a time (seq order = commit order)


def _record(row: tuple[Any, ...]) -> KeyRecord:
    return KeyRecord(row[0], row[1], row[2], row[3], float(row[4]), row[5])


class PgKeyStore:
    """:class:`~llmgw_slurm.auth.keys.KeyStore` on the shared database (synchronous:
    the CLI calls it, the daemon from a worker thread)."""

    def __init__(self, info: Conninfo, sender: str = "llmgw-admin") -> None:
        self.info = info
        self.sender = sender

    @contextlib.contextmanager
    def _tx(self) -> Any:
        with contextlib.closing(connect(self.info)) as conn:
            try:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
                    yield conn
            except psycopg.Error as exc:
                raise database_error(self.info, exc, "writing keys") from None

    def _notify(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"keys {self.sender}"))

    def add(
        self,
        user: str,
        project: str = "",
        *,
        limit: int | None = None,
        revoked_within: float = 0.0,
    ) -> NewKey:
        check_names(user, project)
        with self._tx() as conn:
            if limit is not None:
                rows = conn.execute(_SELECT + " WHERE user_name = %s", (user,)).fetchall()
                check_limit([_record(r) for r in rows], user, limit, revoked_within)
            taken = {r[0] for r in conn.execute("SELECT key_id FROM llmgw_keys").fetchall()}
            new = new_key(user, project, taken)
            r = new.record
            conn.execute(
                _INSERT,
                (r.key_id, r.user, r.project, r.sha256, r.created, r.revoked),
            )
            self._notify(conn)
        return new

    def list(self) -> list[KeyRecord]:
        with contextlib.closing(connect(self.info)) as conn:
            try:
                rows = conn.execute(_SELECT + " ORDER BY created").fetchall()
            except psycopg.Error as exc:
                raise database_error(self.info, exc, "reading keys") from None
        return [_record(r) for r in rows]

    def _revoke(self, key_id: str, user: str | None) -> KeyRecord | None:
        with self._tx() as conn:
            row = conn.execute(_SELECT + " WHERE key_id = %s", (key_id,)).fetchone()
            if row is None:
                if user is not None:
                    return None
                raise LlmgwError(f"no key with id {key_id!r} in the database")
            rec = _record(row)
            if user is not None and rec.user != user:
                return None
            if rec.revoked is None:
                now = time.time()
                conn.execute(
                    "UPDATE llmgw_keys SET revoked = %s, seq = nextval('llmgw_change_seq')"
                    " WHERE key_id = %s",
                    (now, key_id),
                )
                self._notify(conn)
                rec = KeyRecord(rec.key_id, rec.user, rec.project, rec.sha256, rec.created, now)
            return rec

    def revoke(self, key_id: str) -> KeyRecord:
        rec = self._revoke(key_id, None)
        assert rec is not None
        return rec

    def revoke_own(self, key_id: str, user: str) -> KeyRecord | None:
        return self._revoke(key_id, user)


class KeysPart:
    """A gateway's copy of the keys: the rows changed since the last pull, into the ring."""

    topic = "keys"

    def __init__(
        self, hub: Hub, ring: KeyRing, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hub = hub
        self.ring = ring
        self.last_seq = 0
        self.clock = clock
        self._asked = -1.0
        ring.on_unknown = self._unknown

    def _unknown(self) -> None:
        # At most once a second: a stream of made-up keys must not become queries.
        now = self.clock()
        if now - self._asked >= 1.0:
            self._asked = now
            self.hub.pull_soon(self.topic)

    async def pull(self) -> None:
        async def read(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            cur = await conn.execute(
                _SELECT + " WHERE seq > %s ORDER BY seq",
                (self.last_seq,),
            )
            return await cur.fetchall()

        rows = await self.hub.run_sql(read)
        if not rows:
            return
        records = dict(self.ring.records)
        for row in rows:
            rec = _record(row)
            records[rec.key_id] = rec
            self.last_seq = max(self.last_seq, int(row[6]))
        self.ring.update(records)

    def learn(self, rec: KeyRecord) -> None:
        """A key this daemon just made: known here at once (its own notification is skipped)."""
        self.ring.update({**self.ring.records, rec.key_id: rec})
