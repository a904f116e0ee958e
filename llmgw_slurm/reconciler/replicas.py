"""What the daemon knows of each replica beyond Slurm's listing, and the table that holds it.

Slurm is the source of truth for what runs; this is the rest, in memory: what
each replica's agent reported (the engine's URL, its steps), what the router
saw (requests in flight, last use), and the drain or stop the daemon asked
for. The :class:`ReplicaTable` is shared by the reconciler's collaborators
(the directory, the report intake, the passes, admin requests and status):
each reads and writes the replicas through it, and records its decisions in
its one log.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmgw_slurm.catalog import Catalog, Model
from llmgw_slurm.reconciler.plan import ReplicaState, ReplicaView
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.slurm.types import Job, JobState, NodeInfo

__all__ = ["Decision", "Replica", "ReplicaTable", "build_view", "view_of"]

# Decisions keep the logger they were always logged under: log filters select on it.
log = logging.getLogger("llmgw_slurm.reconciler.core")


@dataclass
class Replica:
    """What the daemon knows about one replica beyond Slurm's listing."""

    replica_id: str
    model: str
    job_id: str
    submitted_at: float
    # The cluster its job was submitted to ("": the one cluster of a server.yaml
    # without clusters:); its job id means something only there.
    cluster: str = ""
    job_state: JobState = JobState.PENDING
    reason: str = ""
    nodes: tuple[str, ...] = ()
    node_count: int = 1
    gpus_per_node: int = 0
    restarts: int = 0
    ends_at: float | None = None  # Slurm's end time for the job (Unix time), None if unlimited
    started_at: float | None = None
    ready_at: float | None = None
    base_url: str = ""
    # The engine's certificate as its agent reported it (pinned); "" for plain HTTP.
    engine_cert: str = ""
    # Times the daemon has seen this replica become reachable (a requeued job's next
    # run is a new endpoint to the router, even at the same address).
    epoch: int = 0
    last_used: float | None = None
    in_flight: int = 0
    # The other gateways' requests in flight and last use (several daemons on one
    # database: llmgw_slurm.db.replicas), which the plan adds to this gateway's.
    remote_in_flight: int = 0
    remote_last_used: float | None = None
    # Requests the engine itself queues (vllm:num_requests_waiting), as last read
    # from its /metrics; only for models that scale on it.
    engine_waiting: int = 0
    draining_since: float | None = None
    drain_reason: str = ""
    stop_reason: str = ""
    agent_draining: str = ""
    agent_failed: str = ""
    replaces: str = ""
    step: str = ""
    # Seconds each agent step took, as the agent reported them (for status and cold-start figures).
    step_seconds: dict[str, float] = field(default_factory=dict)
    last_report: float | None = None
    first_report_at: float | None = None
    adopted: bool = False
    # When this daemon adopted the job: a start deadline runs from here, not from a
    # job start that may be hours older (the agent has yet to re-report).
    adopted_at: float | None = None
    # Seen back in the queue after running, and not yet seen running again: the
    # previous run's agent may live on (a node whose slurmd died) and still report.
    requeued: bool = False
    # Its cluster went down while it did not serve, and the plan replaced it
    # (plan.PlanResult.lost_with_cluster): if its cluster answers again, it goes first.
    stranded: bool = False
    # The listing's job last applied to the fields in _LISTED, while none of them has
    # been assigned since (then the next listing of that same job changes nothing).
    listed: Job | None = field(default=None, repr=False, compare=False)
    # This replica's plan view, while no field has been assigned since it was built.
    view: ReplicaView | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # Every assignment drops the cached view (and one to a listed field, the
        # listed job): a stale view is a wrong eviction or scale-down, so the caches
        # are dropped where the fields change rather than where someone remembers to.
        # Costs about 0.2 us an assignment; rebuilding a view costs 3 us.
        object.__setattr__(self, name, value)
        if name != "view" and name != "listed":
            object.__setattr__(self, "view", None)
            if name in _LISTED:
                object.__setattr__(self, "listed", None)

    def last_use(self) -> float | None:
        """The latest use by any gateway: this daemon's or another's on the database."""
        return _later(self.last_used, self.remote_last_used)

    def state(self) -> ReplicaState:
        if self.stop_reason:
            return ReplicaState.STOPPING
        if self.job_state is JobState.COMPLETING:
            # Ending without being asked: a crash (reaped next pass) or a preemption on
            # its way back to the queue. Counted as pending so that a requeue is not
            # taken for a loss and replaced by a second job.
            return ReplicaState.PENDING
        if self.draining_since is not None:
            return ReplicaState.DRAINING
        if self.job_state in (JobState.RUNNING, JobState.CONFIGURING):
            if self.agent_draining:
                return ReplicaState.DRAINING
            return ReplicaState.READY if self.base_url else ReplicaState.STARTING
        return ReplicaState.PENDING


# What _observe sets from the listing (and what it reads of the replica to decide it).
_LISTED = frozenset(
    (
        "job_state",
        "reason",
        "nodes",
        "node_count",
        "gpus_per_node",
        "restarts",
        "ends_at",
        "started_at",
        "requeued",
    )
)


@dataclass(frozen=True)
class Decision:
    at: float
    action: str
    model: str
    replica_id: str
    reason: str
    pass_id: str
    # Which daemon decided (several daemons on one database); "" for this one.
    daemon: str = ""


def view_of(r: Replica) -> ReplicaView:
    """The replica as the plan sees it: built from its fields alone, kept until one changes.

    Must not read anything but the replica's own fields (not the clock, not
    the reconciler): Replica.__setattr__ drops the kept view on any of those.
    """
    v = r.view
    if v is None:
        v = r.view = build_view(r)
    return v


def build_view(r: Replica) -> ReplicaView:
    return ReplicaView(
        replica_id=r.replica_id,
        model=r.model,
        job_id=r.job_id,
        state=r.state(),
        submitted_at=r.submitted_at,
        gpus_per_node=r.gpus_per_node,
        nodes=r.node_count,
        node_names=r.nodes,
        reason=r.reason,
        started_at=r.started_at,
        adopted_at=r.adopted_at,
        ready_at=r.ready_at,
        last_used=r.last_use(),
        in_flight=r.in_flight + r.remote_in_flight,
        engine_waiting=r.engine_waiting,
        draining_since=r.draining_since,
        drain_reason=r.drain_reason or r.agent_draining,
        self_draining=bool(r.agent_draining) and r.draining_since is None,
        ends_at=r.ends_at,
        agent_failed=r.agent_failed,
        replaces=r.replaces,
        stop_reason=r.stop_reason,
        cluster=r.cluster,
        last_report=r.last_report,
        # Once it serves, it is a replica like any other.
        stranded=r.stranded and r.ready_at is None,
    )


def _later(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


class ReplicaTable:
    """The replicas by id, the catalog and the nodes they are planned against, and the decisions.

    ``clock`` may be replaced (tests set a fake one after construction): read it
    through the table, never keep a copy. ``wake`` asks the pass loop for a pass
    before its interval ends.
    """

    def __init__(
        self, catalog: Catalog, clock: Callable[[], float], tracing: ReconcileTracing
    ) -> None:
        self.catalog = catalog
        self.clock = clock
        self.tracing = tracing
        self.replicas: dict[str, Replica] = {}
        self.nodes: list[NodeInfo] = []
        # When self.nodes was listed (the reconciler's clock); None: never.
        self.nodes_listed_at: float | None = None
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=200)
        self.wake = asyncio.Event()
        # Called when a replica may have changed (a pass, a report, a decision) and with
        # each decision: how the shared directory (llmgw_slurm.db.replicas) hears of it.
        self.on_change: list[Callable[[], None]] = []
        self.on_record: list[Callable[[Decision], None]] = []

    def changed(self) -> None:
        for f in self.on_change:
            f()

    def models(self) -> dict[str, Model]:
        return {m.name: m for m in self.catalog.models}

    def has_ready(self, model: str) -> bool:
        return any(
            r.model == model and r.state() is ReplicaState.READY for r in self.replicas.values()
        )

    def record(self, action: str, model: str, rid: str, reason: str, pass_id: str = "") -> None:
        d = Decision(self.clock(), action, model, rid, reason, pass_id)
        self.decisions.append(d)
        for f in self.on_record:
            f(d)
        self.changed()
        self.tracing.record(action, model, rid, reason, pass_id)
        # key=value, the reason quoted last: one grep finds a pass's decisions, and
        # the pass id is the trace's llmgw.pass_id.
        log.info(
            "decision action=%s model=%s replica=%s pass=%s reason=%s",
            action,
            model,
            rid or "-",
            pass_id or "-",
            json.dumps(reason),
        )
