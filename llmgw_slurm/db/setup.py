"""Several daemons on one database, wired into a daemon (``daemon.build`` calls these).

:func:`prepare` runs before the reconciler is made: it checks the database
(reachable, PostgreSQL 15 or later, the schema this code knows) and takes
the shared secrets into the state directory, and it makes the lease that
fences the reconciler. :meth:`Shared.attach` joins the reconciler's table to
the shared directory once it exists. :meth:`Shared.run` holds the lease,
listens and syncs, on the daemon's event loop, until the daemon stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry

from llmgw_slurm.auth.keys import KeyRing
from llmgw_slurm.base.errors import DatabaseError
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.config import DatabaseConfig, ServerConfig
from llmgw_slurm.db.batches import BatchesPart, PgBatchStore
from llmgw_slurm.db.connect import Conninfo, connect, daemon_name, database_error, make_conninfo
from llmgw_slurm.db.hub import DaemonRow, Hub
from llmgw_slurm.db.keys import KeysPart, PgKeyStore
from llmgw_slurm.db.lease import Lease
from llmgw_slurm.db.metrics import SharedCollector
from llmgw_slurm.db.quota import SharedBudgets, SharedQuota
from llmgw_slurm.db.replicas import DemandPart, ReplicaSync
from llmgw_slurm.db.responses import SharedResponseHomes
from llmgw_slurm.db.schema import check_schema
from llmgw_slurm.db.secrets import share_secrets
from llmgw_slurm.db.usage import PgUsageStore
from llmgw_slurm.reconciler.core import PassLoop
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.replicas import ReplicaTable

__all__ = ["Shared", "check_database", "prepare"]

log = logging.getLogger(__name__)

# The oldest PostgreSQL this code is tested on (server_version_num).
_MIN_SERVER = 150000


def check_database(info: Conninfo) -> tuple[int, int]:
    """(the server's version number, the schema version), or a DatabaseError that says
    what is wrong: unreachable, too old, or a schema this code cannot use."""
    with contextlib.closing(connect(info)) as conn:
        try:
            server = conn.info.server_version
            if server < _MIN_SERVER:
                raise DatabaseError(
                    f"database ({info.where}): PostgreSQL {server // 10000} is too old; "
                    "llmgw-slurm needs 15 or later"
                )
            return server, check_schema(conn)
        except psycopg.Error as exc:
            raise database_error(info, exc, "reading the schema") from None


@dataclass
class Shared:
    """A daemon's share of the database: the lease, the notifications, the directory."""

    cfg: DatabaseConfig
    info: Conninfo
    name: str
    lease: Lease
    hub: Hub
    replicas: ReplicaSync | None = None
    keys: KeysPart | None = None
    passes: PassLoop | None = None
    batches: PgBatchStore | None = None
    quota: SharedQuota | None = None
    responses: SharedResponseHomes | None = None
    usage: PgUsageStore | None = None
    started_at: float = field(default_factory=time.time)
    # Told the daemons' internal URLs (this one's first) when they change: the
    # batch jobs' reports too go to any daemon.
    on_urls: list[Callable[[str], None]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def attach(self, table: ReplicaTable, directory: ReplicaDirectory, passes: PassLoop) -> None:
        """Share the reconciler's replica table (through its directory); a leader's first
        pass at once on taking the lease; every daemon's URL in the next jobs."""
        self.passes = passes
        self.replicas = ReplicaSync(self.hub, table, directory, self.lease.acting, passes.clusters)
        self.hub.add(self.replicas, "decisions", "nodes")
        self.hub.add(DemandPart(self.replicas))
        # Taking the lease wakes the passes (adoption from one squeue, at once).
        self.lease.on_change = lambda leading: table.wake.set()
        own = passes.jobs.daemon_url

        def advertise(daemons: list[DaemonRow]) -> None:
            # A job reports to this daemon first, then to the others alive now: the
            # daemon that started it may be gone for good (failover) while it runs.
            others = [
                d.internal_url
                for d in daemons
                if d.name != self.name and d.stopped_at is None and d.internal_url != own
            ]
            urls = ",".join(dict.fromkeys([own, *others]))
            if passes.jobs.daemon_url != urls:
                passes.jobs = dataclasses.replace(passes.jobs, daemon_url=urls)
                for f in self.on_urls:
                    f(urls)

        self.hub.on_daemons = advertise

    async def start(self, gateway_url: str, internal_url: str) -> None:
        await self.hub.start(gateway_url, internal_url)

    async def run(self, stop: asyncio.Event) -> None:
        """The lease, the notifications and the directory's sync, until ``stop``."""
        parts = [self.lease.run(stop), self.hub.run(stop)]
        if self.replicas is not None:
            parts.append(self.replicas.run(stop))
        if self.batches is not None:
            parts.append(self.batches.run(stop))
        if self.quota is not None:
            parts.append(self.quota.run(stop))
        if self.responses is not None:
            parts.append(self.responses.run(stop))
        self._tasks = [asyncio.create_task(p) for p in parts]
        try:
            await asyncio.gather(*self._tasks)
        finally:
            for t in self._tasks:
                t.cancel()

    async def close(self) -> None:
        if self.replicas is not None:
            # What the last moments changed (a drain, a decision) before leaving.
            with contextlib.suppress(DatabaseError, Exception):
                await self.replicas.push()
        await self.lease.release()
        await self.hub.close()

    # ---- the stores, on the database ---------------------------------------------------

    def key_ring(self) -> KeyRing:
        """The gateway's keys: the database's, kept in memory and in step."""
        ring = KeyRing(None)
        self.keys = KeysPart(self.hub, ring)
        self.hub.add(self.keys)
        return ring

    def key_store(self) -> PgKeyStore:
        # Not this daemon's own name: its hub must hear its own store's changes too.
        return PgKeyStore(self.info, f"{self.name}/store")

    def usage_store(self, state_dir: Path) -> PgUsageStore:
        self.usage = PgUsageStore(self.hub, state_dir)
        return self.usage

    def batch_store(self, root: Path) -> PgBatchStore:
        self.batches = PgBatchStore(root, self.hub)
        self.hub.add(BatchesPart(self.hub, self.batches))
        return self.batches

    def quota_parts(self, usage: Any) -> tuple[SharedBudgets, SharedQuota]:
        """The accounts' budgets and the other gateways' spend and holds, for the book;
        ``usage`` (this daemon's PgUsageStore) tells what it wrote itself."""
        budgets = SharedBudgets(self.hub)
        self.quota = SharedQuota(self.hub)
        self.hub.add(budgets)
        self.hub.add(self.quota, "holds")
        if isinstance(usage, PgUsageStore):
            usage.on_spend = self.quota.wrote
        return budgets, self.quota

    def share_batches(self, svc: BatchService) -> None:
        """The batch poll is the leader's (fenced); its jobs report to any daemon."""
        svc.fence = self.lease

        def advertise(urls: str) -> None:
            svc.jobs = dataclasses.replace(svc.jobs, daemon_url=urls)

        self.on_urls.append(advertise)

    def response_homes(self) -> SharedResponseHomes:
        """Where stored responses live, shared by the gateways."""
        self.responses = SharedResponseHomes(self.hub)
        self.hub.add(self.responses)
        return self.responses

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """The leader and lease figures on the gateway's /metrics."""
        registry.register(SharedCollector(self))

    def healthy(self) -> bool:
        """Whether this daemon has reached the database lately (for /healthz)."""
        return self.hub.healthy(max(5.0, 3 * self.cfg.lease_duration))

    def status(self) -> dict[str, Any]:
        """The daemons, the leader, its epoch and since when (for status and the page)."""
        now = time.monotonic()
        st = self.lease.state
        contact = self.hub.last_contact
        lease_contact = self.lease.last_contact
        last = max((c for c in (contact, lease_contact) if c is not None), default=None)
        return {
            "this": self.name,
            "leading": self.lease.acting(),
            "leader": st.holder.split("#", 1)[0] if st.holder else "",
            "leader_holder": st.holder,
            "epoch": st.epoch,
            "leader_since": st.since,
            # When this daemon's first pass under the current epoch began (it leads).
            "first_pass_at": (
                self.passes.first_pass_at.get(st.epoch) if self.passes is not None else None
            ),
            "lease_taken": self.lease.taken,
            "fenced": self.lease.fenced,
            "lease_expires": st.expires,
            "last_contact_s": None if last is None else round(now - last, 3),
            "last_error": self.hub.last_error or self.lease.last_error,
            "daemons": [dataclasses.asdict(d) for d in self.hub.daemons],
        }


def prepare(server: ServerConfig, gateway_port: int, command_timeout: float) -> Shared:
    """Check the database and take the shared secrets; raise DatabaseError (or
    ConfigError) with what to fix when the daemon cannot use it."""
    cfg = server.database
    assert cfg is not None, "prepare() is for a daemon with a database: block"
    name = daemon_name(cfg, gateway_port)
    info = make_conninfo(cfg, name)
    server_version, schema = check_database(info)
    with contextlib.closing(connect(info)) as conn:
        try:
            share_secrets(conn, Path(server.state_dir))
        except psycopg.Error as exc:
            raise database_error(info, exc, "reading the shared secrets") from None
    log.info(
        "database (%s): PostgreSQL %d, schema %d; this daemon is %s",
        info.where,
        server_version // 10000,
        schema,
        name,
    )
    # A successor waits this long for an action a dead leader began: the Slurm
    # command's own timeout, and a margin for slurmctld to take what it was sent.
    lease = Lease(info, name, cfg, action_timeout=command_timeout + 10.0)
    return Shared(cfg, info, name, lease, Hub(info, name, cfg))
