"""The reconcile plan: a pure function from what is observed now to what to do.

No I/O and no clock of its own: everything comes in as arguments (``now``
included), so every rule below is unit-tested with a fake clock. The
reconciler observes (one squeue, its last sinfo, agent reports, router
counters), calls :func:`plan` (again on a fresh sinfo when
``PlanResult.nodes_decide`` says the nodes matter), and executes the actions
idempotently.

Rules, in the order they are applied each pass (each a function of this module
over one ``_PlanState``: the actions and notes so far, and what the rules share):

1. Per replica (``_replica_rules``), the first of ``_REPLICA_RULES`` that
   applies, one action per replica: a model removed from the catalog drains
   its ready replicas and cancels the others; an agent that reported failure, a start that outlived
   its deadline, a job pending past ``max_pending_time``, and a drain that is
   done (nothing in flight) or timed out, each end in a cancel with its reason.
2. Per model, in catalog order, over the replicas rule 1 left. The desired
   count is ``max(min, ceil(in_flight / target), 1 if a request is waiting)``
   capped at ``max`` (``_model_view``).

   a. Renewal (``_renew``): a ready replica whose time limit is within
      ``renewal_margin`` gets a replacement; once the replacement is ready,
      the old one is drained.
   b. Backoff (``_backoff``): below the desired count while the model is in
      restart backoff (a start that failed in this plan counts), nothing is
      submitted and the note says when the next try is.
   c. Scale up (``_scale_up``): otherwise, below it, replicas are submitted.
   d. Scale down (``_scale_down``): above it, pending replicas are cancelled
      (newest first), then one ready replica idle past ``idle_timeout`` (or
      any idle one while above ``max``) is drained a pass.
   e. Queued (``_queued``): a replica Slurm keeps pending for Resources or
      Priority says why, and, if it fits nowhere, may evict (rule 3).
3. Placement (``_submit``, ``_evict``): a new replica goes where this plan has
   not promised the GPUs yet; one that fits nowhere (free GPUs of its type on
   enough usable nodes of its partition) is submitted all the same (Slurm
   queues it) and may evict one idle replica of another model (rules in
   :func:`evictable`), at most one per pass, and never while an earlier
   eviction's job is still being killed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from llmgw_slurm.catalog import Model
from llmgw_slurm.durations import format_duration
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
        return f"used {format_duration(idle)} ago, grace {format_duration(cfg.eviction_grace)}"
    if r.ready_at is not None and now - r.ready_at < cfg.min_lifetime:
        ready, lifetime = format_duration(now - r.ready_at), format_duration(cfg.min_lifetime)
        return f"ready {ready}, min lifetime {lifetime}"
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
    """What to do now: the rules of the module docstring, applied in its order."""
    st = _PlanState(models, replicas, nodes, wanted_at, failures, cfg, now, new_id)
    for r in replicas:
        _replica_rules(st, r)
    st.start_models()
    for m in models.values():
        mv = _model_view(st, m)
        _renew(st, mv)
        # A handed-over replica is draining now; its replacement counts in its
        # place, so the scale-down below does not drain the old one again.
        mv = mv.without(st.stopping)
        if not _backoff(st, mv):
            _scale_up(st, mv)
        _scale_down(st, mv)
        _queued(st, mv)
    return st.out


@dataclass
class _PlanState:
    """One plan's inputs, the actions and notes so far, and what the rules share.

    ``stopping`` holds every replica an action of this plan already stops (one
    action per replica); ``taken`` the GPUs per node promised to this plan's
    submissions; ``evicted`` whether this plan evicts already (one per pass).
    """

    models: Mapping[str, Model]
    replicas: Sequence[ReplicaView]
    nodes: Sequence[NodeInfo]
    wanted_at: Mapping[str, float]
    failures: Mapping[str, Failures]
    cfg: PlanConfig
    now: float
    new_id: Callable[[], str]
    out: PlanResult = field(default_factory=PlanResult)
    stopping: set[str] = field(default_factory=set)
    taken: dict[str, int] = field(default_factory=dict)
    # The replicas that count (pending, starting, ready) and no rule stops, by model:
    # set by start_models() once the per-replica rules are done.
    live: list[ReplicaView] = field(default_factory=list)
    by_model: dict[str, list[ReplicaView]] = field(default_factory=dict)
    evicted: bool = False
    # An earlier pass's eviction whose job is still being killed: its GPUs are not free yet.
    eviction_in_progress: bool = False

    def start_models(self) -> None:
        self.live = [
            r for r in self.replicas if r.state.counts and r.replica_id not in self.stopping
        ]
        for r in self.live:
            self.by_model.setdefault(r.model, []).append(r)
        self.eviction_in_progress = any(
            r.state is ReplicaState.STOPPING and r.stop_reason.startswith("evicted")
            for r in self.replicas
        )

    def stop(
        self,
        kind: ActionKind,
        r: ReplicaView,
        reason: str,
        *,
        failure: bool = False,
        attrs: Mapping[str, object] | None = None,
    ) -> None:
        """A DRAIN, CANCEL or EVICT of ``r``; no later rule acts on it."""
        self.stopping.add(r.replica_id)
        self.out.actions.append(
            Action(
                kind,
                r.model,
                reason,
                replica_id=r.replica_id,
                job_id=r.job_id,
                failure=failure,
                attrs=attrs or {},
            )
        )

    def cancel(
        self, r: ReplicaView, reason: str, *, failure: bool = False, **attrs: object
    ) -> None:
        self.stop(ActionKind.CANCEL, r, reason, failure=failure, attrs=attrs)

    def drain(self, r: ReplicaView, reason: str, **attrs: object) -> None:
        self.stop(ActionKind.DRAIN, r, reason, attrs=attrs)


# ---- 1. per replica -----------------------------------------------------------------


def _replica_rules(st: _PlanState, r: ReplicaView) -> None:
    """Rule 1: the first of ``_REPLICA_RULES`` that applies acts on ``r`` (one action each)."""
    if r.state is ReplicaState.STOPPING:
        return
    m = st.models.get(r.model)
    for rule in _REPLICA_RULES:
        if rule(st, r, m):
            return


def _removed_from_catalog(st: _PlanState, r: ReplicaView, m: Model | None) -> bool:
    if m is not None or r.state is ReplicaState.DRAINING:
        return False
    if r.state is ReplicaState.READY:
        st.drain(r, "model removed from the catalog")
    else:
        st.cancel(r, "model removed from the catalog")
    return True


def _start_failed(st: _PlanState, r: ReplicaView, m: Model | None) -> bool:
    if not r.agent_failed or r.state is ReplicaState.DRAINING:
        return False
    st.cancel(r, f"start failed: {r.agent_failed}", failure=True)
    return True


def _start_timed_out(st: _PlanState, r: ReplicaView, m: Model | None) -> bool:
    if r.state is not ReplicaState.STARTING or r.started_at is None:
        return False
    limit = st.cfg.start_timeout
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
    if st.now - since <= limit:
        return False
    st.cancel(r, f"not ready {format_duration(st.now - since)} after {what}", failure=True)
    return True


def _pending_too_long(st: _PlanState, r: ReplicaView, m: Model | None) -> bool:
    limit = st.cfg.max_pending_time
    if r.state is not ReplicaState.PENDING or limit is None or st.now - r.submitted_at <= limit:
        return False
    why = r.reason or "no reason given"
    st.cancel(r, f"pending for {format_duration(st.now - r.submitted_at)} ({why})")
    return True


def _drain_done(st: _PlanState, r: ReplicaView, m: Model | None) -> bool:
    """A drain the daemon asked for ends once nothing is in flight, or at its timeout."""
    if r.state is not ReplicaState.DRAINING or r.self_draining:
        return False
    since = r.draining_since if r.draining_since is not None else st.now
    if r.in_flight == 0:
        st.cancel(r, f"drained ({r.drain_reason or 'drain'})")
    elif st.now - since > st.cfg.drain_timeout:
        st.cancel(
            r,
            f"drain timed out with {r.in_flight} request(s) in flight ({r.drain_reason})",
            in_flight=r.in_flight,
        )
    return True


# In the order they are tried: each returns whether it applied to the replica.
_REPLICA_RULES: tuple[Callable[[_PlanState, ReplicaView, Model | None], bool], ...] = (
    _removed_from_catalog,
    _start_failed,
    _start_timed_out,
    _pending_too_long,
    _drain_done,
)


# ---- 2. per model ---------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelView:
    """One model's replicas and demand as rule 2 sees them."""

    model: Model
    mine: list[ReplicaView]  # live, and not stopped by this plan
    counted: list[ReplicaView]  # mine, a replica and its renewal counted once
    ready: list[ReplicaView]
    in_flight: int
    waiting: bool  # a request waits, and no replica is ready
    target: int  # replicas the requests in flight call for
    desired: int

    def without(self, stopping: set[str]) -> _ModelView:
        mine = [r for r in self.mine if r.replica_id not in stopping]
        return replace(self, mine=mine, counted=_count_once(mine))


def _count_once(mine: list[ReplicaView]) -> list[ReplicaView]:
    """A replica and its renewal count once."""
    present = {x.replica_id for x in mine}
    return [r for r in mine if not r.replaces or r.replaces not in present]


def _model_view(st: _PlanState, m: Model) -> _ModelView:
    # An earlier model's eviction may have taken one of these: it is going
    # away and gets no second action (no drain, no renewal).
    mine = [r for r in st.by_model.get(m.name, []) if r.replica_id not in st.stopping]
    ready = [r for r in mine if r.state is ReplicaState.READY]
    in_flight = sum(r.in_flight for r in mine)
    w = st.wanted_at.get(m.name)
    # A request may wait as long as its model's hold deadline: a model that
    # holds for 30 min must not have its pending job cancelled after the
    # server's 5 min while requests still wait for it. A shorter hold keeps
    # the server's window: a client retrying after its 503 finds the job
    # still queued, not resubmitted at the back of the queue.
    window = max(st.cfg.want_window, m.scaling.hold_timeout or 0.0)
    waiting = w is not None and st.now - w < window and not ready
    target = math.ceil(in_flight / m.scaling.target_inflight) if in_flight else 0
    desired = min(m.scaling.max, max(m.scaling.min, target, 1 if waiting else 0))
    return _ModelView(m, mine, _count_once(mine), ready, in_flight, waiting, target, desired)


def _renew(st: _PlanState, mv: _ModelView) -> None:
    """Rule 2a: hand over before the time limit; drain the old once its renewal is ready."""
    m = mv.model
    renewing = {r.replaces for r in mv.mine if r.replaces}
    for r in mv.ready:
        if r.ends_at is None or r.replica_id in renewing:
            continue
        left = r.ends_at - st.now
        if left < st.cfg.renewal_margin and len(mv.counted) <= m.scaling.max:
            reason = f"renewal: {r.replica_id} has {format_duration(max(0.0, left))} left"
            _submit(st, m, reason, replaces=r.replica_id)
    for r in mv.ready:
        if r.replaces and any(
            o.replica_id == r.replaces and o.state is ReplicaState.READY for o in mv.mine
        ):
            old = next(o for o in mv.mine if o.replica_id == r.replaces)
            st.drain(old, f"renewed by {r.replica_id}")


def _backoff(st: _PlanState, mv: _ModelView) -> bool:
    """Rule 2b: a model short of replicas whose starts keep failing waits; says so."""
    name = mv.model.name
    fl = st.failures.get(name)
    failed_now = [a for a in st.out.actions if a.failure and a.model == name]
    if failed_now:
        # A start that failed in this very pass counts before any replacement is
        # planned; otherwise the first restart of every crash loop skips the backoff.
        fl = Failures((fl.count if fl else 0) + len(failed_now), st.now, failed_now[-1].reason)
    left = backoff_left(fl, st.cfg, st.now)
    if len(mv.counted) >= mv.desired or left <= 0 or fl is None:
        return False
    state = "failing" if fl.count >= st.cfg.give_up_after else "backoff"
    st.out.notes[name] = (
        f"{state}: {fl.count} failed start(s), next try in {format_duration(left)}; "
        f"last: {fl.cause}"
    )
    return True


def _scale_up(st: _PlanState, mv: _ModelView) -> None:
    """Rule 2c: below the desired count, submit the missing replicas."""
    m = mv.model
    if len(mv.counted) >= mv.desired:
        return
    if len(mv.counted) < m.scaling.min:
        why = f"below min {m.scaling.min}"
    elif mv.waiting and not mv.target:
        why = "a request is waiting"
    else:
        why = f"{mv.in_flight} in flight, target {m.scaling.target_inflight} per replica"
    for _ in range(mv.desired - len(mv.counted)):
        _submit(st, m, f"scale up to {mv.desired}: {why}")


def _scale_down(st: _PlanState, mv: _ModelView) -> None:
    """Rule 2d: above the desired count, pending ones nobody waits for go first (newest
    first), then one idle ready replica a pass (idle past ``idle_timeout``, or above max)."""
    m, now = mv.model, st.now
    surplus = len(mv.counted) - mv.desired
    if surplus <= 0:
        return
    pending = (r for r in mv.counted if r.state is ReplicaState.PENDING)
    for r in sorted(pending, key=lambda r: r.submitted_at, reverse=True):
        if surplus == 0:
            return
        st.cancel(r, "scale down" if mv.waiting else "scale down: not needed (nobody waiting)")
        surplus -= 1
    if surplus == 0:
        return

    def since(r: ReplicaView) -> float:
        return r.last_used if r.last_used is not None else (r.ready_at or now)

    idle = (r for r in mv.counted if r.state is ReplicaState.READY and r.in_flight == 0)
    for r in sorted(idle, key=since):
        if len(mv.counted) > m.scaling.max or now - since(r) >= m.scaling.idle_timeout:
            idle_s = now - since(r)
            st.drain(r, f"scale down: idle {format_duration(idle_s)}", idle_seconds=idle_s)
            # One idle scale-down per model per pass: the next pass sees the result.
            return


def _queued(st: _PlanState, mv: _ModelView) -> None:
    """Rule 2e: a pending replica Slurm cannot start says why, and may evict (rule 3)."""
    m = mv.model
    for r in mv.mine:
        # A job cancelled above is going away: stopping another replica to
        # make room for it would only throw that one away too.
        if (
            r.state is not ReplicaState.PENDING
            or r.replica_id in st.stopping
            or r.reason not in ("Resources", "Priority")
            or m.name in st.out.notes
        ):
            continue
        ok, where = fits(m, st.nodes, st.cfg, st.taken)
        if not ok:
            st.out.notes[m.name] = f"queued ({r.reason}): {where}; {_evict(st, m, where)}"
            continue
        st.out.notes[m.name] = f"queued ({r.reason})"
        if not (st.evicted or st.eviction_in_progress) and _eviction_candidates(st, m):
            # On nodes that say it does not fit, this would evict: only a fresh
            # listing may decide that it fits.
            st.out.nodes_decide = True


# ---- 3. placement ---------------------------------------------------------------------


def _submit(st: _PlanState, m: Model, reason: str, replaces: str = "") -> None:
    """A new replica of ``m``: placed on free GPUs this plan has not promised yet, or,
    fitting nowhere, submitted all the same (Slurm queues it) and making room (``_evict``)."""
    st.out.nodes_decide = True
    ok, where = fits(m, st.nodes, st.cfg, st.taken)
    if ok:
        for n in where.split(","):
            st.taken[n] = st.taken.get(n, 0) + m.resources.gpus
        placement = where
    else:
        note = _evict(st, m, where)
        placement = f"no room now: {where}; {note}"
        st.out.notes[m.name] = f"no room: {where}; {note}"
    st.out.actions.append(
        Action(
            ActionKind.SUBMIT,
            m.name,
            reason,
            replica_id=st.new_id(),
            replaces=replaces,
            placement=placement,
        )
    )


def _eviction_candidates(st: _PlanState, m: Model) -> list[ReplicaView]:
    """What could be stopped to make room for ``m``, best first (see :func:`evictable`)."""
    return [
        c
        for c in evictable(m.name, st.live, st.models, st.cfg, st.now)
        if c.replica_id not in st.stopping
    ]


def _evict(st: _PlanState, m: Model, why: str) -> str:
    """Stop the best candidate for ``m`` (which fits nowhere: ``why``); the note to show.

    At most one eviction per pass, and none while an earlier one's job is still
    being killed.
    """
    if st.evicted or st.eviction_in_progress:
        return "waiting for an evicted replica to give its GPUs back"
    candidates = _eviction_candidates(st, m)
    if not candidates:
        return _nothing_to_evict(st, m)
    best = candidates[0]
    st.evicted = True
    st.out.nodes_decide = True
    idle = st.now - (best.last_used or st.now)
    attrs = {
        "for": m.name,
        "idle_seconds": idle,
        "gpus": best.gpus_per_node * best.nodes,
        "candidates": len(candidates),
        "why": why,
    }
    reason = f"evicted, idle {format_duration(idle)}, to make room for {m.name}"
    st.stop(ActionKind.EVICT, best, reason, attrs=attrs)
    return f"evicting {best.model} replica {best.replica_id} (idle {format_duration(idle)})"


def _nothing_to_evict(st: _PlanState, m: Model) -> str:
    # Say what keeps each ready replica of another model: "nothing idle" alone
    # leaves an admin guessing which rule held.
    kept = [
        f"{r.model} {r.replica_id}: {why_kept(r, st.models, st.cfg, st.now)}"
        for r in st.live
        if r.model != m.name and r.state is ReplicaState.READY and r.replica_id not in st.stopping
    ]
    if not kept:
        return (
            "nothing idle enough to stop "
            "(no other model has a replica ready and not already stopping)"
        )
    more = "; ..." if len(kept) > 4 else ""
    return f"nothing idle enough to stop ({'; '.join(kept[:4])}{more})"
