"""The replica directory shared by the daemons: one table, written field by field.

Every daemon keeps its own :class:`~llmgw_slurm.reconciler.replicas.ReplicaTable`
(the router reads it, no query on a request's path) and this part keeps it
in step with ``llmgw_replicas``:

- the leader (the lease's holder) runs the passes: it writes what its
  listing and plan change (job state, nodes, drains, stops), and marks a
  replica gone when it leaves the table; it never takes a replica from the
  database that its own ``squeue`` does not show;
- any daemon takes agents' reports: it writes what a report changed (the
  engine's address and certificate, readiness, steps), so a replica whose
  agent reported to one daemon is routable on every daemon within a moment
  (a notification, then one pull);
- followers take every replica from the database.

Writes are three-way merges, field by field: a daemon writes the fields it
changed since it last synced (its copy against ``base``), and takes from a
pull the fields another daemon changed (the row against ``base``), so two
daemons changing different fields of one replica at once lose neither. Writes
take one advisory lock, so sequence numbers commit in order and a pull by
``seq > last`` misses nothing.

Each gateway's requests in flight and last use per replica (``llmgw_load``)
and its held requests per model (``llmgw_demand``) are written by that
gateway and read by the leader's plan: load-based scaling, idleness and
on-demand starts see every gateway. Rows of a daemon not seen for
``_LIVE`` seconds are ignored (its requests died with it). Decisions go to
``llmgw_decisions`` with the daemon's name, and come back to every daemon's
status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from llmgw_slurm.base.errors import DatabaseError
from llmgw_slurm.db.hub import DB_ERRORS, Hub
from llmgw_slurm.reconciler.clusters import ClusterSet
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.reconciler.replicas import Decision, Replica, ReplicaTable
from llmgw_slurm.slurm.types import GpuCount, JobState, NodeInfo

__all__ = ["ReplicaSync"]

log = logging.getLogger(__name__)

# Per gateway, or caches: never shared as replica fields.
_LOCAL = frozenset(
    ("listed", "view", "in_flight", "last_used", "remote_in_flight", "remote_last_used")
)
_FIELDS = tuple(f.name for f in dataclasses.fields(Replica) if f.name not in _LOCAL)
_WRITE_LOCK = 0x6C6C6D6701  # pg_advisory_xact_lock: llmgw_replicas' writers, one at a time
# Seconds a daemon's load and demand rows count after its last contact.
_LIVE = 10.0

_LOAD = """
SELECT replica_id, sum(in_flight), max(last_used) FROM llmgw_load
WHERE daemon <> %s AND daemon IN (
    SELECT name FROM llmgw_daemons WHERE last_seen > now() - make_interval(secs => %s))
GROUP BY replica_id
"""
_DEMAND = """
SELECT model, max(wanted_at), min(held_since) FROM llmgw_demand
WHERE daemon <> %s AND daemon IN (
    SELECT name FROM llmgw_daemons WHERE last_seen > now() - make_interval(secs => %s))
GROUP BY model
"""


def _encode(value: Any) -> Any:
    if isinstance(value, JobState):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _decode(name: str, value: Any) -> Any:
    if name == "job_state":
        try:
            return JobState(value)
        except ValueError:
            return JobState.UNKNOWN
    if name == "nodes":
        return tuple(value or ())
    if name == "step_seconds":
        return dict(value or {})
    return value


def _node(d: dict[str, Any]) -> NodeInfo:
    return NodeInfo(
        **{
            **d,
            "partitions": tuple(d["partitions"]),
            "gpus": tuple(GpuCount(**g) for g in d["gpus"]),
            "features": tuple(d["features"]) if d.get("features") is not None else None,
        }
    )


def fields_of(r: Replica) -> dict[str, Any]:
    return {name: _encode(getattr(r, name)) for name in _FIELDS}


class ReplicaSync:
    """Keeps a daemon's replica table, load and demand in step with the database."""

    topic = "replicas"

    def __init__(
        self,
        hub: Hub,
        table: ReplicaTable,
        directory: ReplicaDirectory,
        leading: Callable[[], bool],
        clusters: ClusterSet,
    ) -> None:
        self.hub = hub
        self.table = table
        self.clusters = clusters
        self.directory = directory
        self.leading = leading
        self.base: dict[str, dict[str, Any]] = {}
        self.last_seq = 0
        self._kick = asyncio.Event()
        self._decisions: list[Decision] = []
        self._load_sent: dict[str, tuple[int, float | None]] = {}
        self._demand_dirty: set[str] = set()
        self.last_decision_id = 0
        # The node listing last written (leader) or taken (follower): its time.
        self._nodes_at: float | None = None
        # Each cluster's listing time when the leader last wrote them: a listing
        # is written when any cluster's is newer (the oldest may not move).
        self._listings_written: tuple[float | None, ...] = ()
        table.on_change.append(self._kick.set)
        table.on_record.append(self._record)
        directory.on_demand = self._demand

    def _record(self, d: Decision) -> None:
        if not d.daemon:
            self._decisions.append(d)

    def _demand(self, model: str) -> None:
        self._demand_dirty.add(model)
        self._kick.set()

    # ---- the loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, every: float = 0.5) -> None:
        """Push what changed here, at once when kicked, else every ``every`` seconds
        (the load); pull the others' load and demand while leading."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), every)
            self._kick.clear()
            try:
                await self.push()
                if self.leading():
                    await self.pull_load()
            except DB_ERRORS as exc:
                # Kept: the next round writes what this one could not.
                log.debug("db: replica sync failed: %s", exc)

    async def push(self) -> None:
        patches, gone = self._changes()
        decisions, self._decisions = self._decisions, []
        load = self._load_changes()
        demand = self._demand_rows()
        nodes = self._nodes_to_write()
        if not (patches or gone or decisions or load or demand or nodes):
            return
        try:
            await self.hub.run_sql(
                lambda conn: self._write(conn, patches, gone, decisions, load, demand, nodes)
            )
        except BaseException:
            # Written next time: put the decisions back, forget what was "sent".
            self._decisions[:0] = decisions
            for rid in patches:
                self.base.pop(rid, None)
            self._load_sent.clear()
            self._demand_dirty.update(m for m, *_ in demand)
            if nodes:
                self._nodes_at, self._listings_written = None, ()
            raise

    def _changes(self) -> tuple[dict[str, tuple[str, dict[str, Any]]], list[str]]:
        patches: dict[str, tuple[str, dict[str, Any]]] = {}
        for rid, r in self.table.replicas.items():
            now = fields_of(r)
            base = self.base.get(rid)
            patch = now if base is None else {k: v for k, v in now.items() if base.get(k) != v}
            if patch:
                patches[rid] = (r.model, patch)
                self.base[rid] = now
        gone = []
        if self.leading():
            gone = [rid for rid in self.base if rid not in self.table.replicas]
            for rid in gone:
                del self.base[rid]
        return patches, gone

    def _nodes_to_write(self) -> str:
        """The leader's node listings as JSON (each node with its cluster's name), when
        one of them is newer than the one written."""
        at = self.table.nodes_listed_at
        listings = tuple(c.nodes_listed_at for c in self.clusters)
        if not self.leading() or at is None or listings == self._listings_written:
            return ""
        self._nodes_at, self._listings_written = at, listings
        return json.dumps(
            [{**dataclasses.asdict(n), "cluster": c.name} for c in self.clusters for n in c.nodes]
        )

    def _load_changes(self) -> list[tuple[str, int, float | None]]:
        out = []
        for rid, r in self.table.replicas.items():
            sent = self._load_sent.get(rid)
            used = r.last_used
            if sent is None or sent[0] != r.in_flight or (used or 0) - (sent[1] or 0) >= 1.0:
                out.append((rid, r.in_flight, used))
                self._load_sent[rid] = (r.in_flight, used)
        for rid in [rid for rid in self._load_sent if rid not in self.table.replicas]:
            del self._load_sent[rid]
            out.append((rid, -1, None))
        return out

    def _demand_rows(self) -> list[tuple[str, float | None, float | None]]:
        rows = [(m, *self.directory.demand_of(m)) for m in sorted(self._demand_dirty)]
        self._demand_dirty.clear()
        return rows

    async def _write(
        self,
        conn: psycopg.AsyncConnection[Any],
        patches: dict[str, tuple[str, dict[str, Any]]],
        gone: list[str],
        decisions: list[Decision],
        load: list[tuple[str, int, float | None]],
        demand: list[tuple[str, float | None, float | None]],
        nodes: str,
    ) -> None:
        name = self.hub.name
        async with conn.transaction():
            if nodes:
                await conn.execute(
                    "INSERT INTO llmgw_nodes (id, listed_at, nodes) VALUES (1, %s, %s)"
                    " ON CONFLICT (id) DO UPDATE SET listed_at = EXCLUDED.listed_at,"
                    " nodes = EXCLUDED.nodes",
                    (self._nodes_at, nodes),
                )
                await self.hub.notify(conn, "nodes")
            if patches or gone:
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
                await self._write_replicas(conn, patches, gone)
                await self.hub.notify(conn, self.topic)
            async with conn.cursor() as cur:
                if decisions:
                    await cur.executemany(
                        "INSERT INTO llmgw_decisions (at, action, model, replica_id, reason,"
                        " pass_id, daemon) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                        [
                            (d.at, d.action, d.model, d.replica_id, d.reason, d.pass_id, name)
                            for d in decisions
                        ],
                    )
                    await self.hub.notify(conn, "decisions")
                    if self.leading():
                        # The recent decisions are what status shows: keep the last
                        # ten thousand, and the actions' history (fencing) a week.
                        await cur.execute(
                            "DELETE FROM llmgw_decisions"
                            " WHERE id < (SELECT max(id) - 10000 FROM llmgw_decisions)"
                        )
                        await cur.execute(
                            "DELETE FROM llmgw_actions"
                            " WHERE finished_at < now() - interval '7 days'"
                        )
                if load:
                    await cur.executemany(
                        "DELETE FROM llmgw_load WHERE daemon = %s AND replica_id = %s",
                        [(name, rid) for rid, n, _ in load if n < 0],
                    )
                    await cur.executemany(
                        "INSERT INTO llmgw_load (daemon, replica_id, in_flight, last_used)"
                        " VALUES (%s, %s, %s, %s) ON CONFLICT (daemon, replica_id) DO UPDATE"
                        " SET in_flight = EXCLUDED.in_flight, last_used = EXCLUDED.last_used",
                        [(name, rid, n, used) for rid, n, used in load if n >= 0],
                    )
                if demand:
                    await cur.executemany(
                        "INSERT INTO llmgw_demand (daemon, model, wanted_at, held_since)"
                        " VALUES (%s, %s, %s, %s) ON CONFLICT (daemon, model) DO UPDATE"
                        " SET wanted_at = EXCLUDED.wanted_at, held_since = EXCLUDED.held_since",
                        [(name, m, w, h) for m, w, h in demand],
                    )
                    await self.hub.notify(conn, "demand")

    async def _write_replicas(
        self,
        conn: psycopg.AsyncConnection[Any],
        patches: dict[str, tuple[str, dict[str, Any]]],
        gone: list[str],
    ) -> None:
        async with conn.cursor() as cur:
            if self.leading():
                # The leader's squeue is the truth: it may add a replica, or revive a row.
                await cur.executemany(
                    "INSERT INTO llmgw_replicas (replica_id, model, data) VALUES (%s, %s, %s)"
                    " ON CONFLICT (replica_id) DO UPDATE SET"
                    " data = llmgw_replicas.data || EXCLUDED.data, gone = false,"
                    " seq = nextval('llmgw_change_seq')",
                    [(rid, model, json.dumps(p)) for rid, (model, p) in patches.items()],
                )
            else:
                # A report taken here: only a replica the leader has put in the table.
                await cur.executemany(
                    "UPDATE llmgw_replicas SET data = data || %s::jsonb,"
                    " seq = nextval('llmgw_change_seq') WHERE replica_id = %s AND NOT gone",
                    [(json.dumps(p), rid) for rid, (_, p) in patches.items()],
                )
            if gone:
                await cur.execute(
                    "UPDATE llmgw_replicas SET gone = true, seq = nextval('llmgw_change_seq')"
                    " WHERE replica_id = ANY(%s)",
                    (gone,),
                )
                # A gone replica's row is kept a while for late pulls, then dropped.
                await cur.execute(
                    "DELETE FROM llmgw_replicas WHERE gone"
                    " AND seq < currval('llmgw_change_seq') - 10000"
                )

    # ---- pulls --------------------------------------------------------------------------

    async def pull(self) -> None:
        """Take the rows changed since the last pull (and the decisions)."""

        async def read(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Any], list[Any]]:
            cur = await conn.execute(
                "SELECT replica_id, model, data, gone, seq FROM llmgw_replicas"
                " WHERE seq > %s ORDER BY seq",
                (self.last_seq,),
            )
            rows = await cur.fetchall()
            cur = await conn.execute(
                "SELECT id, at, action, model, replica_id, reason, pass_id, daemon"
                " FROM llmgw_decisions WHERE id > %s AND daemon <> %s ORDER BY id DESC LIMIT 200",
                (self.last_decision_id, self.hub.name),
            )
            return rows, await cur.fetchall()

        rows, decisions = await self.hub.run_sql(read)
        if not self.leading():
            await self.pull_nodes()
        for rid, model, data, gone, seq in rows:
            self.last_seq = max(self.last_seq, int(seq))
            self.apply(rid, model, data, gone)
        for row in reversed(decisions):
            self.last_decision_id = max(self.last_decision_id, int(row[0]))
            at, action, model, rid, reason, pass_id, daemon = row[1:]
            self.table.decisions.append(
                Decision(at, action, model, rid, reason, pass_id, daemon or "?")
            )

    def apply(self, rid: str, model: str, data: dict[str, Any], gone: bool) -> None:
        """One row: the fields another daemon changed since this one last synced."""
        r = self.table.replicas.get(rid)
        if gone:
            self.base.pop(rid, None)
            if r is not None and not self.leading():
                del self.table.replicas[rid]
            return
        if r is None:
            if self.leading():
                # Its own listing decides what exists; a row it does not know is one it
                # has just dropped (its gone is on its way) or one its squeue will show.
                return
            try:
                r = Replica(**{k: _decode(k, v) for k, v in data.items() if k in _FIELDS})
            except TypeError as exc:
                log.warning("db: replica %s's row unreadable, skipped: %s", rid, exc)
                return
            self.table.replicas[rid] = r
            self.base[rid] = fields_of(r)
        else:
            base = self.base.setdefault(rid, fields_of(r))
            for k, v in data.items():
                if k in _FIELDS and base.get(k) != v:
                    setattr(r, k, _decode(k, v))
                    base[k] = v
        if r.base_url and r.state() is ReplicaState.READY:
            self.directory.signal_ready(model)

    async def pull_nodes(self) -> None:
        """A follower's node listing: the leader's last (no sinfo of its own)."""

        async def read(conn: psycopg.AsyncConnection[Any]) -> Any:
            cur = await conn.execute(
                "SELECT listed_at, nodes FROM llmgw_nodes WHERE id = 1 AND listed_at > %s",
                (self._nodes_at or 0.0,),
            )
            return await cur.fetchone()

        row = await self.hub.run_sql(read)
        if row is None:
            return
        try:
            by_cluster = self._listings_of(row[1])
        except (TypeError, KeyError, ValueError) as exc:
            log.warning("db: the shared node listing is unreadable, skipped: %s", exc)
            return
        self._nodes_at = float(row[0])
        for c in self.clusters:
            c.nodes, c.nodes_listed_at = by_cluster.get(c.name, []), self._nodes_at
        self.table.nodes, self.table.nodes_listed_at = self.clusters.all_nodes(), self._nodes_at

    def _listings_of(self, rows: list[dict[str, Any]]) -> dict[str, list[NodeInfo]]:
        """The leader's nodes by cluster. A node without a cluster (written by a daemon
        of the single-listing format, during an upgrade) is the first cluster's; one
        of a cluster this daemon does not know (its server.yaml differs) is left out."""
        out: dict[str, list[NodeInfo]] = {}
        for d in rows:
            name = d.pop("cluster", self.clusters.first.name)
            if self.clusters.get(name) is None:
                log.warning(
                    "db: the leader lists node %s of cluster %r, unknown here", d.get("name"), name
                )
                continue
            out.setdefault(name, []).append(_node(d))
        return out

    async def pull_load(self) -> None:
        """The other gateways' in-flight counts and last use (the leader's plan reads them)."""

        async def read(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Any], list[Any]]:
            cur = await conn.execute(_LOAD, (self.hub.name, _LIVE))
            load = await cur.fetchall()
            cur = await conn.execute(_DEMAND, (self.hub.name, _LIVE))
            return load, await cur.fetchall()

        load, demand = await self.hub.run_sql(read)
        seen = {rid: (int(n), used) for rid, n, used in load}
        for rid, r in self.table.replicas.items():
            n, used = seen.get(rid, (0, None))
            if r.remote_in_flight != n:
                r.remote_in_flight = n
            if used is not None and r.remote_last_used != used:
                r.remote_last_used = float(used)
        before = self.directory.wanted_at()
        self.directory.remote_demand = {m: (w, h) for m, w, h in demand}
        after = self.directory.wanted_at()
        if any(after.get(m, 0) > before.get(m, 0) for m in after):
            # A request waits on another gateway: an on-demand start now, not next interval.
            self.table.wake.set()


class DemandPart:
    """The ``demand`` notification: the leader reads the others' demand at once."""

    topic = "demand"

    def __init__(self, sync: ReplicaSync) -> None:
        self.sync = sync

    async def pull(self) -> None:
        if self.sync.leading():
            with contextlib.suppress(DatabaseError):
                await self.sync.pull_load()
