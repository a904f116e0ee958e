"""The reconcile plan: a pure function from what is observed now to what to do.

No I/O and no clock of its own: everything comes in as arguments (``now``
included), so every rule below is unit-tested with a fake clock. The
reconciler observes (one squeue, its last sinfo, agent reports, router
counters), calls :func:`plan` (again on a fresh sinfo when
``PlanResult.nodes_decide`` says the nodes matter), and executes the actions
idempotently.

Rules, in the order they are applied each pass:

1. Per replica: an agent that reported failure, a start that outlived its
   deadline, a job pending past ``max_pending_time``, and a drain that is done
   (nothing in flight) or timed out, each end in a cancel with its reason.
2. Per model: the desired count is ``max(min, ceil(in_flight / target), 1 if a
   request is waiting)`` capped at ``max``. Below it, replicas are submitted
   (unless the model is in restart backoff); above ``max``, or with pending
   replicas nobody waits for, the surplus is cancelled; a ready replica idle
   past ``idle_timeout`` is drained while the model is above ``min``.
3. Renewal: a ready replica whose time limit is within ``renewal_margin`` gets
   a replacement; once the replacement is ready, the old one is drained.
4. Placement: a new replica that fits nowhere (free GPUs of its type on enough
   usable nodes of its partition) may evict one idle replica (rules in
   :func:`evictable`), at most one per pass, and never while an earlier
   eviction's job is still being killed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw_slurm.catalog import Model
from llmgw_slurm.slurm.types import NodeInfo

__all__ = [
    "Action",
    "ActionKind",
    "Failures",
    "PlanConfig",
    "PlanResult",
    "ReplicaState",
    "ReplicaView",
    "evictable",
    "fits",
    "plan",
]


class ReplicaState(enum.Enum):
    PENDING = "pending"  # job queued
    STARTING = "starting"  # job running, agent steps under way
    READY = "ready"  # engine answers; the router sends traffic
    DRAINING = "draining"  # no new traffic; in-flight requests finish
    STOPPING = "stopping"  # cancel sent; the job is still listed

    @property
    def counts(self) -> bool:
        """Counts toward the model's replicas (will serve, or serves)."""
        return self in (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY)


@dataclass(frozen=True)
class ReplicaView:
    """One replica as this pass sees it.

    Slurm's listing joined with what the agents and the router reported.
    """

    replica_id: str
    model: str
    job_id: str
    state: ReplicaState
    submitted_at: float
    gpus_per_node: int = 0
    nodes: int = 1
    reason: str = ""  # Slurm's pending reason
    started_at: float | None = None  # first seen running
    adopted_at: float | None = None  # when a restarted daemon found the job (None: it placed it)
    ready_at: float | None = None  # first seen ready (after a restart: when adopted as ready)
    last_used: float | None = None  # None: nobody has reported a use (unknown is not idle)
    in_flight: int = 0
    draining_since: float | None = None
    drain_reason: str = ""
    ends_at: float | None = None  # when Slurm ends the job (Unix time), None when unlimited
    agent_failed: str = ""  # the agent's failure message, if it reported one
    replaces: str = ""  # the replica this one renews
    stop_reason: str = ""  # why it is stopping (for STOPPING)
    # The agent drains on its own (SIGTERM from a cancel or a preemption, SIGUSR1 before
    # the time limit): the job ends by itself, and a preempted one comes back, so the
    # daemon must not cancel it.
    self_draining: bool = False


@dataclass(frozen=True)
class Failures:
    """Consecutive failed starts of a model (reset when a replica becomes ready)."""

    count: int
    last_at: float
    cause: str


@dataclass(frozen=True)
class PlanConfig:
    eviction_grace: float = 300.0
    min_lifetime: float = 600.0
    renewal_margin: float = 1800.0
    drain_timeout: float = 120.0
    max_pending_time: float | None = None
    start_timeout: float = 1020.0  # agent readiness timeout plus a margin for the weights
    # A request asked for the model this recently: someone waits (the router's
    # hold deadline; a model's longer scaling.hold_timeout extends it).
    want_window: float = 300.0
    backoff_initial: float = 30.0
    backoff_max: float = 1800.0
    give_up_after: int = 5
    default_partition: str | None = None


class ActionKind(enum.Enum):
    SUBMIT = "submit"
    DRAIN = "drain"
    CANCEL = "cancel"
    EVICT = "evict"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    model: str
    reason: str
    replica_id: str = ""  # for SUBMIT: the new replica's id
    job_id: str = ""
    replaces: str = ""  # SUBMIT for a renewal
    failure: bool = False  # CANCEL that counts as a failed start
    placement: str = ""  # SUBMIT: where it fits, or why it does not
    attrs: Mapping[str, object] = field(default_factory=dict)


@dataclass
class PlanResult:
    actions: list[Action] = field(default_factory=list)
    # Per model, a short human status note for `llmgw models` and the status page
    # ("queued: Resources; nothing idle enough to stop", "backoff 2m: engine exited 1").
    notes: dict[str, str] = field(default_factory=dict)
    # The nodes decided an action, or could have: a submission (its placement), an
    # eviction, or a queued replica that fit on these nodes while an eviction for it
    # was possible (on nodes that say it does not fit, it would evict). The
    # reconciler plans with the last node listing and, when this is set and that
    # listing is older than the pass, lists the nodes again and plans anew, so that a
    # stale listing never drives an action. Notes alone do not set it.
    nodes_decide: bool = False

    def of(self, kind: ActionKind) -> list[Action]:
        return [a for a in self.actions if a.kind is kind]


def _partition(model: Model, cfg: PlanConfig) -> str | None:
    return model.resources.partition or cfg.default_partition


def fits(
    model: Model, nodes: Sequence[NodeInfo], cfg: PlanConfig, taken: Mapping[str, int]
) -> tuple[bool, str]:
    """Can a replica of ``model`` start now? Returns (fits, where or why not).

    ``taken`` holds GPUs this pass already promised to earlier submissions, so
    two new replicas do not both count the same free GPUs.
    """
    res = model.resources
    part = _partition(model, cfg)
    parts = part.split(",") if part else ()
    gpu_type = res.gpu_type or ""
    good: list[str] = []
    # A pass may call this for hundreds of models over hundreds of nodes: stop at
    # the first nodes that fit, and format only the refusals that are shown.
    refused: list[str] = []
    n_refused = 0
    for n in nodes:
        if parts and not any(p in n.partitions for p in parts):
            continue
        why = ""
        if not n.usable:
            why = "state"
        else:
            free = n.gpus_free(gpu_type) - taken.get(n.name, 0)
            if free < res.gpus:
                why = "gpus"
            elif n.cpus_total - n.cpus_alloc < res.cpus:
                why = "cpus"
        if not why:
            good.append(n.name)
            if len(good) >= res.nodes:
                return True, ",".join(good)
            continue
        n_refused += 1
        if n_refused > 8:
            continue
        if why == "state":
            refused.append(f"{n.name}: {n.state}")
        elif why == "gpus":
            what = f"gpu:{gpu_type}" if gpu_type else "gpu"
            refused.append(f"{n.name}: {max(free, 0)} {what} free")
        else:
            refused.append(f"{n.name}: {n.cpus_total - n.cpus_alloc} cpus free")
    if not n_refused:
        return False, f"no node in partition {part or '(default)'}"
    need = f"needs {res.nodes} node(s) with {res.gpus} free gpu{':' + gpu_type if gpu_type else ''}"
    return False, f"{need}; " + "; ".join(refused) + ("; ..." if n_refused > 8 else "")


def why_kept(r: ReplicaView, models: Mapping[str, Model], cfg: PlanConfig, now: float) -> str:
    """Why a ready replica may not be evicted now ("" if it may), in a status note's words."""
    if r.in_flight:
        return f"serving {r.in_flight} request(s)"
    m = models.get(r.model)
    if m is None:
        return "not in the catalog"
    if not m.scaling.on_demand:
        return f"min {m.scaling.min}"
    if r.last_used is None:
        return "last use unknown"
    idle = now - r.last_used
    if idle < cfg.eviction_grace:
        return f"used {_fmt_s(idle)} ago, grace {_fmt_s(cfg.eviction_grace)}"
    if r.ready_at is not None and now - r.ready_at < cfg.min_lifetime:
        return f"ready {_fmt_s(now - r.ready_at)}, min lifetime {_fmt_s(cfg.min_lifetime)}"
    if r.nodes > 1:
        return f"{r.nodes} nodes"
    return ""


def evictable(
    wanted_by: str,
    replicas: Sequence[ReplicaView],
    models: Mapping[str, Model],
    cfg: PlanConfig,
    now: float,
) -> list[ReplicaView]:
    """Replicas that could be stopped to make room for ``wanted_by``, longest idle first.

    Only ready replicas of on-demand models (``min: 0``; ``min >= 1`` is a promise
    that the model stays up). Only single-node replicas (a multi-node one frees
    many nodes and takes long to rebuild: a deliberate decision, not a side
    effect of one request). Unknown is not idle: a replica nobody has reported
    a use of (all of them, right after a daemon restart) is never a candidate.
    Idle less than the eviction grace, or ready for less than the minimum
    lifetime, is not a candidate either: two on-demand models that fit only one
    at a time must not take turns evicting each other, paying a load each time.
    """
    out: list[tuple[float, ReplicaView]] = []
    for r in replicas:
        if r.model == wanted_by or r.state is not ReplicaState.READY:
            continue
        if not why_kept(r, models, cfg, now):
            out.append((now - (r.last_used or now), r))
    out.sort(key=lambda t: t[0], reverse=True)
    return [r for _, r in out]


def backoff_left(f: Failures | None, cfg: PlanConfig, now: float) -> float:
    if f is None or f.count == 0:
        return 0.0
    if f.count >= cfg.give_up_after:
        wait = cfg.backoff_max
    else:
        wait = min(cfg.backoff_initial * 2 ** (f.count - 1), cfg.backoff_max)
    return max(0.0, f.last_at + wait - now)


def _fmt_s(s: float) -> str:
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def plan(
    models: Mapping[str, Model],
    replicas: Sequence[ReplicaView],
    nodes: Sequence[NodeInfo],
    wanted_at: Mapping[str, float],
    failures: Mapping[str, Failures],
    cfg: PlanConfig,
    now: float,
    new_id: Callable[[], str],
) -> PlanResult:
    out = PlanResult()
    stopping: set[str] = set()

    def cancel(r: ReplicaView, reason: str, *, failure: bool = False, **attrs: object) -> None:
        stopping.add(r.replica_id)
        out.actions.append(
            Action(
                ActionKind.CANCEL,
                r.model,
                reason,
                replica_id=r.replica_id,
                job_id=r.job_id,
                failure=failure,
                attrs=attrs,
            )
        )

    def drain(r: ReplicaView, reason: str, **attrs: object) -> None:
        stopping.add(r.replica_id)
        out.actions.append(
            Action(
                ActionKind.DRAIN,
                r.model,
                reason,
                replica_id=r.replica_id,
                job_id=r.job_id,
                attrs=attrs,
            )
        )

    # 1. Per replica.
    for r in replicas:
        m = models.get(r.model)
        if r.state is ReplicaState.STOPPING:
            continue
        if m is None and r.state is not ReplicaState.DRAINING:
            # One action per replica: the rules below would cancel it a second time.
            if r.state is ReplicaState.READY:
                drain(r, "model removed from the catalog")
            else:
                cancel(r, "model removed from the catalog")
            continue
        if r.agent_failed and r.state is not ReplicaState.DRAINING:
            cancel(r, f"start failed: {r.agent_failed}", failure=True)
            continue
        if r.state is ReplicaState.STARTING and r.started_at is not None:
            limit = cfg.start_timeout
            if m is not None and m.engine.ready_timeout:
                limit = m.engine.ready_timeout + 120.0
            # A restarted daemon gives an adopted job the whole deadline from the
            # adoption: its agent has not re-reported yet, and its start may be hours
            # old. Timed from the job's start, a restart would kill every replica
            # older than the deadline as a failed start.
            if r.adopted_at is not None and r.adopted_at > r.started_at:
                since, what = r.adopted_at, "it was adopted"
            else:
                since, what = r.started_at, "the job started"
            if now - since > limit:
                cancel(r, f"not ready {_fmt_s(now - since)} after {what}", failure=True)
                continue
        if (
            r.state is ReplicaState.PENDING
            and cfg.max_pending_time is not None
            and now - r.submitted_at > cfg.max_pending_time
        ):
            cancel(
                r, f"pending for {_fmt_s(now - r.submitted_at)} ({r.reason or 'no reason given'})"
            )
            continue
        if r.state is ReplicaState.DRAINING and not r.self_draining:
            since = r.draining_since if r.draining_since is not None else now
            if r.in_flight == 0:
                cancel(r, f"drained ({r.drain_reason or 'drain'})")
            elif now - since > cfg.drain_timeout:
                cancel(
                    r,
                    f"drain timed out with {r.in_flight} request(s) in flight ({r.drain_reason})",
                    in_flight=r.in_flight,
                )

    live = [r for r in replicas if r.state.counts and r.replica_id not in stopping]
    by_model: dict[str, list[ReplicaView]] = {}
    for r in live:
        by_model.setdefault(r.model, []).append(r)

    taken: dict[str, int] = {}
    evicted_this_pass = False
    eviction_in_progress = any(
        r.state is ReplicaState.STOPPING and r.stop_reason.startswith("evicted") for r in replicas
    )

    def candidates_for(m: Model) -> list[ReplicaView]:
        return [
            c for c in evictable(m.name, live, models, cfg, now) if c.replica_id not in stopping
        ]

    def try_evict(m: Model, why: str) -> str:
        nonlocal evicted_this_pass
        if evicted_this_pass or eviction_in_progress:
            return "waiting for an evicted replica to give its GPUs back"
        candidates = candidates_for(m)
        if not candidates:
            # Say what keeps each ready replica of another model: "nothing idle" alone
            # leaves an admin guessing which rule held.
            kept = [
                f"{r.model} {r.replica_id}: {why_kept(r, models, cfg, now)}"
                for r in live
                if r.model != m.name
                and r.state is ReplicaState.READY
                and r.replica_id not in stopping
            ]
            if not kept:
                return (
                    "nothing idle enough to stop "
                    "(no other model has a replica ready and not already stopping)"
                )
            more = "; ..." if len(kept) > 4 else ""
            return f"nothing idle enough to stop ({'; '.join(kept[:4])}{more})"
        best = candidates[0]
        evicted_this_pass = True
        out.nodes_decide = True
        stopping.add(best.replica_id)
        idle = now - (best.last_used or now)
        out.actions.append(
            Action(
                ActionKind.EVICT,
                best.model,
                f"evicted, idle {_fmt_s(idle)}, to make room for {m.name}",
                replica_id=best.replica_id,
                job_id=best.job_id,
                attrs={
                    "for": m.name,
                    "idle_seconds": idle,
                    "gpus": best.gpus_per_node * best.nodes,
                    "candidates": len(candidates),
                    "why": why,
                },
            )
        )
        return f"evicting {best.model} replica {best.replica_id} (idle {_fmt_s(idle)})"

    def submit(m: Model, reason: str, replaces: str = "") -> None:
        out.nodes_decide = True
        ok, where = fits(m, nodes, cfg, taken)
        note = ""
        if ok:
            for n in where.split(","):
                taken[n] = taken.get(n, 0) + m.resources.gpus
        else:
            note = try_evict(m, where)
        out.actions.append(
            Action(
                ActionKind.SUBMIT,
                m.name,
                reason,
                replica_id=new_id(),
                replaces=replaces,
                placement=where if ok else f"no room now: {where}; {note}",
            )
        )
        if not ok:
            out.notes[m.name] = f"no room: {where}; {note}"

    # 2. and 3. Per model.
    def count_once(mine: list[ReplicaView]) -> list[ReplicaView]:
        """A replica and its renewal count once."""
        present = {x.replica_id for x in mine}
        return [r for r in mine if not r.replaces or r.replaces not in present]

    for name, m in models.items():
        # An earlier model's eviction may have taken one of these: it is going
        # away and gets no second action (no drain, no renewal).
        mine = [r for r in by_model.get(name, []) if r.replica_id not in stopping]
        renewing = {r.replaces for r in mine if r.replaces}
        counted = count_once(mine)
        ready = [r for r in mine if r.state is ReplicaState.READY]
        in_flight = sum(r.in_flight for r in mine)
        w = wanted_at.get(name)
        # A request may wait as long as its model's hold deadline: a model that
        # holds for 30 min must not have its pending job cancelled after the
        # server's 5 min while requests still wait for it. A shorter hold keeps
        # the server's window: a client retrying after its 503 finds the job
        # still queued, not resubmitted at the back of the queue.
        window = max(cfg.want_window, m.scaling.hold_timeout or 0.0)
        waiting = w is not None and now - w < window and not ready
        target = math.ceil(in_flight / m.scaling.target_inflight) if in_flight else 0
        desired = min(m.scaling.max, max(m.scaling.min, target, 1 if waiting else 0))

        # Renewal first: hand over before the time limit.
        for r in ready:
            if r.ends_at is None or r.replica_id in renewing:
                continue
            left = r.ends_at - now
            if left < cfg.renewal_margin and len(counted) <= m.scaling.max:
                submit(
                    m,
                    f"renewal: {r.replica_id} has {_fmt_s(max(0.0, left))} left",
                    replaces=r.replica_id,
                )
        for r in ready:
            if r.replaces and any(
                o.replica_id == r.replaces and o.state is ReplicaState.READY for o in mine
            ):
                old = next(o for o in mine if o.replica_id == r.replaces)
                drain(old, f"renewed by {r.replica_id}")
        # A handed-over replica is draining now; its replacement counts in its
        # place, so the scale-down below does not drain the old one again.
        mine = [r for r in mine if r.replica_id not in stopping]
        counted = count_once(mine)

        fl = failures.get(name)
        failed_now = [a for a in out.actions if a.failure and a.model == name]
        if failed_now:
            # A start that failed in this very pass counts before any replacement is
            # planned; otherwise the first restart of every crash loop skips the backoff.
            fl = Failures((fl.count if fl else 0) + len(failed_now), now, failed_now[-1].reason)
        left = backoff_left(fl, cfg, now)
        if len(counted) < desired:
            if left > 0 and fl is not None:
                state = "failing" if fl.count >= cfg.give_up_after else "backoff"
                out.notes[name] = (
                    f"{state}: {fl.count} failed start(s), next try in {_fmt_s(left)}; "
                    f"last: {fl.cause}"
                )
            else:
                why = (
                    f"below min {m.scaling.min}"
                    if len(counted) < m.scaling.min
                    else "a request is waiting"
                    if waiting and not target
                    else f"{in_flight} in flight, target {m.scaling.target_inflight} per replica"
                )
                for _ in range(desired - len(counted)):
                    submit(m, f"scale up to {desired}: {why}")
        elif len(counted) > desired:
            surplus = len(counted) - desired
            # Pending ones nobody waits for go first (newest first), then idle ready ones.
            for r in sorted(
                (r for r in counted if r.state is ReplicaState.PENDING),
                key=lambda r: r.submitted_at,
                reverse=True,
            ):
                if surplus == 0:
                    break
                cancel(
                    r, "scale down: not needed (nobody waiting)" if not waiting else "scale down"
                )
                surplus -= 1
            idle = sorted(
                (r for r in counted if r.state is ReplicaState.READY and r.in_flight == 0),
                key=lambda r: r.last_used if r.last_used is not None else (r.ready_at or now),
            )
            for r in idle:
                if surplus == 0:
                    break
                since = r.last_used if r.last_used is not None else (r.ready_at or now)
                if len(counted) > m.scaling.max or now - since >= m.scaling.idle_timeout:
                    drain(r, f"scale down: idle {_fmt_s(now - since)}", idle_seconds=now - since)
                    surplus -= 1
                    # One idle scale-down per model per pass: the next pass sees the result.
                    break

        # Pending replicas that Slurm cannot start: say why and try to make room.
        for r in mine:
            # A job cancelled above is going away: stopping another replica to
            # make room for it would only throw that one away too.
            if (
                r.state is ReplicaState.PENDING
                and r.replica_id not in stopping
                and r.reason in ("Resources", "Priority")
                and name not in out.notes
            ):
                ok, where = fits(m, nodes, cfg, taken)
                if not ok:
                    out.notes[name] = f"queued ({r.reason}): {where}; {try_evict(m, where)}"
                else:
                    out.notes[name] = f"queued ({r.reason})"
                    if not (evicted_this_pass or eviction_in_progress) and candidates_for(m):
                        out.nodes_decide = True

    return out
