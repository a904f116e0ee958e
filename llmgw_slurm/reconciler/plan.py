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
2. Per model, over the replicas rule 1 left: the models a request waits for
   first, the oldest held request first (``_in_turn``), then the rest in
   catalog order. The desired
   count is ``max(min, ceil(in_flight / target), 1 if a request is waiting)``
   capped at ``max`` (``_model_view``); with ``scale_on: engine_waiting`` the
   load term is the replicas in use plus ``ceil(engine waiting / target_waiting)``.

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
   not promised the GPUs yet; one that fits nowhere (free GPUs of its type,
   CPUs and memory on enough usable nodes of its partition, with its features) is
   submitted all the same (Slurm queues it) and may evict one idle replica of
   another model (rules in :func:`evictable`): only for a start its
   ``scaling.evict_for`` names (by default one a held request waits for:
   ``_purpose``), only a replica whose stop makes it fit on this listing
   (``_room_made_by``; the longest idle of those; the room is then promised
   to it) or, for a multi-node start, the first of the stops, one per node it
   lacks, that together would (``_first_of_several``), at most one per pass,
   and never while an earlier eviction's job is still being killed. When none
   makes room, the note says why for each (``_none_makes_room``).
4. Fair share (``_fair_share``), only when rule 3 finds nothing to evict for a
   start a held request waits for: once the model's oldest held request has
   waited ``max_wait`` (server.yaml's ``scaling.max_wait``, or the model's), a
   ready single-node replica of another on-demand model that has had its turn
   (served ``min_slice``, and ``min_lifetime``) and whose stop makes the model
   fit is drained for it (its requests in flight finish): one its users have
   left (idle since the model began to wait) before one in use, then the one
   furthest beyond its share (:func:`fair_share_candidates`). One stop a pass on each cluster,
   counting rule 3's; none while an eviction's job is being killed, and none for a model
   while a replica drained for it is still giving its GPUs back.
   The slice is the hold-down: two models that fit one at a time alternate,
   each turn at least ``min_slice`` long, instead of paying a start each pass.

Several clusters (``plan(clusters=...)``; without it, one cluster named "" of
``nodes``): each ``ClusterView`` has its nodes, its default partition, and
whether it answered this pass and whether it is down. Rule 1 and the
scale-down act on no replica of a cluster that did not answer (a cancel would
not reach it, and what is known of its job may be stale); a replica on a
cluster that is down and does not serve (not ready, or its agent silent for
``cluster_down_after``) does not count (``_PlanState.lost``,
``PlanResult.lost_with_cluster``), so its model is placed elsewhere; once its
cluster answers again such a stranded replica is the first the scale-down
cancels. A replica whose model's resources.clusters no longer names its
cluster is drained or cancelled (``_off_its_clusters``). Placement
(``_submit``) takes the clusters that answer and the model may use, those the
model already runs on first for a renewal, a scale-up to min or for load
(``_runs_on``), then the site's order; the first where it fits now takes it;
fitting nowhere, the first where an eviction makes room (eviction stays on
its cluster, one per cluster per pass: ``_queue_or_evict``), else the
submission names its candidates (those that could ever run it:
``_runnable``) and the executor asks Slurm when each would start it
(:func:`earliest_start`).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.catalog import EvictFor, Model
from llmgw_slurm.slurm.types import NodeInfo

__all__ = [
    "Action",
    "ActionKind",
    "ClusterView",
    "Failures",
    "PlanConfig",
    "PlanResult",
    "ReplicaState",
    "ReplicaView",
    "earliest_start",
    "evictable",
    "fair_share_candidates",
    "fits",
    "plan",
    "satisfies",
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
    # The nodes its job runs on (squeue's list): what an eviction of it frees.
    node_names: tuple[str, ...] = ()
    reason: str = ""  # Slurm's pending reason
    started_at: float | None = None  # first seen running
    adopted_at: float | None = None  # when a restarted daemon found the job (None: it placed it)
    ready_at: float | None = None  # first seen ready (after a restart: when adopted as ready)
    last_used: float | None = None  # None: nobody has reported a use (unknown is not idle)
    in_flight: int = 0
    engine_waiting: int = 0  # requests its engine queues (scaling.scale_on engine_waiting)
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
    # The cluster its job runs on (a ClusterView's name; "" for the one cluster of a
    # server.yaml without clusters:).
    cluster: str = ""
    # When its agent last reported (None: not since the daemon started).
    last_report: float | None = None
    # Lost with its cluster once (PlanResult.lost_with_cluster) and not ready since:
    # once that cluster answers again, the first to go if the model has one too many.
    stranded: bool = False


@dataclass(frozen=True)
class ClusterView:
    """One cluster as this pass sees it (a server.yaml without clusters: has one, name "")."""

    name: str
    nodes: Sequence[NodeInfo]
    # The partition of its jobs whose model names none (clusters[].partition, else
    # slurm.partition); None: Slurm's default.
    partition: str | None = None
    # Its controller answered this pass: replicas may be placed there, and its
    # replicas acted on (a stale view could cancel what runs).
    answering: bool = True
    # It has not answered for cluster_down_after: its replicas that do not serve (not
    # ready, or ready with an agent silent as long) no longer count, and are replaced
    # on another cluster.
    down: bool = False


@dataclass(frozen=True)
class Failures:
    """Consecutive failed starts of a model (reset when a replica becomes ready)."""

    count: int
    last_at: float
    cause: str


@dataclass(frozen=True)
class PlanConfig:
    eviction_grace: float = 300.0
    min_lifetime: float = 120.0
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
    # How long a replica on a cluster that is down may be silent and still count as
    # serving (reconcile.cluster_down_after).
    cluster_down_after: float = 120.0
    # Rule 4, fair share (server.yaml's scaling: block).
    fair_share: bool = True
    max_wait: float = 120.0
    min_slice: float = 120.0


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
    # The cluster it acts on; for a SUBMIT, "" while Slurm is to choose among ``candidates``.
    cluster: str = ""
    # SUBMIT that fits on no cluster now: the clusters it may queue on, in order; the
    # executor asks each when it would start (earliest_start) and submits there.
    candidates: tuple[str, ...] = ()


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
    # Replicas that no longer count because their cluster is down (ClusterView.down):
    # the reconciler marks them stranded (ReplicaView.stranded).
    lost_with_cluster: list[str] = field(default_factory=list)

    def of(self, kind: ActionKind) -> list[Action]:
        return [a for a in self.actions if a.kind is kind]


def _partition(model: Model, cfg: PlanConfig) -> str | None:
    return model.resources.partition or cfg.default_partition


@dataclass(frozen=True)
class _Freed:
    """What stopping one replica gives back on one of its nodes."""

    gpus: int
    gpu_type: str  # its model's gpu type; "" when the model names none
    cpus: int
    memory_mb: int | None  # its model's memory per node (0: all); None: unknown


def fits(
    model: Model,
    nodes: Sequence[NodeInfo],
    cfg: PlanConfig,
    taken: Mapping[str, int],
    freed: Mapping[str, _Freed] | None = None,
) -> tuple[bool, str]:
    """Can a replica of ``model`` start now? Returns (fits, where or why not).

    ``taken`` holds GPUs this pass already promised to earlier submissions, so
    two new replicas do not both count the same free GPUs; ``freed``, what an
    eviction would give back, per node (to ask whether it would fit then).
    """
    res = model.resources
    part = _partition(model, cfg)
    parts = part.split(",") if part else ()
    good: list[str] = []
    # A pass may call this for hundreds of models over hundreds of nodes: stop at
    # the first nodes that fit, and format only the refusals that are shown.
    refused: list[tuple[NodeInfo, str, _Freed | None]] = []
    n_refused = 0
    for n in nodes:
        if parts and not any(p in n.partitions for p in parts):
            continue
        fr = freed.get(n.name) if freed else None
        why = _refusal(n, model, taken.get(n.name, 0), fr)
        if not why:
            good.append(n.name)
            if len(good) >= res.nodes:
                return True, ",".join(good)
            continue
        n_refused += 1
        if n_refused <= 8:
            refused.append((n, why, fr))
    if not n_refused:
        return False, f"no node in partition {part or '(default)'}"
    gpu_type = res.gpu_type or ""
    need = f"needs {res.nodes} node(s) with {res.gpus} free gpu{':' + gpu_type if gpu_type else ''}"
    texts = [
        f"{n.name}: {_refusal_text(n, model, why, taken.get(n.name, 0), fr)}"
        for n, why, fr in refused
    ]
    return False, f"{need}; " + "; ".join(texts) + ("; ..." if n_refused > 8 else "")


def _refusal(n: NodeInfo, model: Model, taken: int, fr: _Freed | None) -> str:
    """Why one node of the model's partitions cannot take a replica: "" (it can), "state",
    "features", "gpus", "cpus" or "memory"."""
    res = model.resources
    if not n.usable:
        return "state"
    if res.constraint and n.features is not None and not satisfies(n.features, res.constraint):
        return "features"
    if _free_gpus(n, res.gpu_type or "", taken, fr) < res.gpus:
        return "gpus"
    if n.cpus_total - n.cpus_alloc + (fr.cpus if fr else 0) < res.cpus:
        return "cpus"
    need = res.memory_mb
    free = _free_memory(n, fr)
    if need is not None and free is not None and free < (need or n.memory_mb):
        return "memory"
    return ""


def _free_memory(n: NodeInfo, fr: _Freed | None) -> int | None:
    """MB of memory not allocated on ``n`` (plus what ``fr`` frees); None: not known, so
    not checked (a listing without it, or a replica whose model sets none)."""
    if n.memory_alloc_mb is None or (fr is not None and fr.memory_mb is None):
        return None
    freed = (fr.memory_mb or n.memory_mb) if fr is not None and fr.memory_mb is not None else 0
    return min(n.memory_mb, n.memory_mb - n.memory_alloc_mb + freed)


def _refusal_text(n: NodeInfo, model: Model, why: str, taken: int, fr: _Freed | None) -> str:
    gpu_type = model.resources.gpu_type or ""
    if why == "state":
        return n.state
    if why == "features":
        return f"features {','.join(n.features or ()) or '(none)'}"
    if why == "gpus":
        what = f"gpu:{gpu_type}" if gpu_type else "gpu"
        return f"{_free_gpus(n, gpu_type, taken, fr)} {what} free"
    if why == "memory":
        return f"{_free_memory(n, fr)} MB memory free"
    return f"{n.cpus_total - n.cpus_alloc + (fr.cpus if fr else 0)} cpus free"


def _free_gpus(n: NodeInfo, gpu_type: str, taken: int, fr: _Freed | None) -> int:
    free = n.gpus_free(gpu_type) - taken
    if fr is not None and _same_type(n, gpu_type, fr.gpu_type):
        free = min(free + fr.gpus, n.gpus_total(gpu_type) - taken)
    return max(free, 0)


def _same_type(n: NodeInfo, wanted: str, held: str) -> bool:
    """Are the GPUs a replica holds (its model's type ``held``) of the ``wanted`` type?

    A model that names no type holds whatever the node has: of the wanted type
    for sure only when the node has GPUs of no other type.
    """
    if not wanted or held == wanted:
        return True
    return not held and all(g.type == wanted for g in n.gpus if g.total)


_CONSTRAINT_TOKEN = re.compile(r"[()&|,]|[^()&|,]+")


def satisfies(features: Sequence[str], constraint: str) -> bool:
    """Do a node's features meet a Slurm constraint (``&`` and, ``|`` or ``,`` or, ``()``)?

    Brackets (one choice for all nodes) read as parentheses and ``*N`` counts
    are dropped: for one node, the question is only whether it could be one of them.
    """
    text = re.sub(r"\*\d+", "", constraint).replace("[", "(").replace("]", ")")
    tokens = [t.strip() for t in _CONSTRAINT_TOKEN.findall(text) if t.strip()]
    have = set(features)
    pos = 0

    def any_of() -> bool:
        nonlocal pos
        ok = all_of()
        while pos < len(tokens) and tokens[pos] in ("|", ","):
            pos += 1
            ok = all_of() or ok
        return ok

    def all_of() -> bool:
        nonlocal pos
        ok = one()
        while pos < len(tokens) and tokens[pos] == "&":
            pos += 1
            ok = one() and ok
        return ok

    def one() -> bool:
        nonlocal pos
        if pos >= len(tokens):
            return False
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            ok = any_of()
            pos += 1  # the ")"
            return ok
        return tok in have

    return any_of()


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
            out.append((_idle(r, now), r))
    out.sort(key=lambda t: t[0], reverse=True)
    return [r for _, r in out]


def _idle(r: ReplicaView, now: float) -> float:
    """Seconds since its last use (0 when nobody reported one; a last use at 0.0 is one)."""
    return 0.0 if r.last_used is None else now - r.last_used


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
    held_since: Mapping[str, float] | None = None,
    clusters: Sequence[ClusterView] | None = None,
) -> PlanResult:
    """What to do now: the rules of the module docstring, applied in its order.

    ``held_since``: per model, when its oldest request still held began waiting
    (default: ``wanted_at``); the longest waiting model goes first. A model asked for
    within its window but not in it (its requests were served by a replica since)
    waits for nothing: it is not started again for them.

    ``clusters``: the clusters to place on, in the site's order (server.yaml's
    clusters); ``nodes`` is then not read. None: one cluster (name "") whose nodes
    are ``nodes`` and whose default partition is ``cfg.default_partition``.
    """
    sites = _sites(clusters, cfg) if clusters is not None else []
    st = _PlanState(models, replicas, nodes, wanted_at, failures, cfg, now, new_id, sites)
    st.held_since = held_since if held_since is not None else wanted_at
    for r in replicas:
        _replica_rules(st, r)
    st.start_models()
    for m in _in_turn(st):
        mv = _model_view(st, m)
        if not mv.mine and not mv.desired:
            # No replica and none wanted: no rule below acts (most of a large
            # catalog of on-demand models, every pass).
            continue
        _renew(st, mv)
        # A handed-over replica is draining now; its replacement counts in its
        # place, so the scale-down below does not drain the old one again.
        mv = mv.without(st.stopping)
        if not _backoff(st, mv):
            _scale_up(st, mv)
        _scale_down(st, mv)
        _queued(st, mv)
    _fair_share_notes(st)
    return st.out


@dataclass
class _Site:
    """One cluster within a plan: its nodes, the plan's rules with its default
    partition, the GPUs per node promised to this plan's submissions there
    (``taken``), and whether this plan evicts there already (one eviction per
    cluster per pass) or an earlier pass's eviction is still being killed."""

    view: ClusterView
    cfg: PlanConfig
    taken: dict[str, int] = field(default_factory=dict)
    evicted: bool = False
    eviction_in_progress: bool = False
    # What the note of a model this pass stops nothing for here says gives GPUs back.
    making_room: str = "an evicted replica"

    @property
    def name(self) -> str:
        return self.view.name

    @property
    def nodes(self) -> Sequence[NodeInfo]:
        return self.view.nodes

    def label(self, several: bool) -> str:
        """ "CLUSTER: " before a note about it, where there are several."""
        return f"{self.name}: " if several else ""


def _sites(views: Sequence[ClusterView], cfg: PlanConfig) -> list[_Site]:
    return [
        _Site(
            v,
            cfg
            if v.partition == cfg.default_partition
            else replace(cfg, default_partition=v.partition),
        )
        for v in views
    ]


@dataclass
class _PlanState:
    """One plan's inputs, the actions and notes so far, and what the rules share.

    ``stopping`` holds every replica an action of this plan already stops (one
    action per replica); ``sites`` the clusters, each with the GPUs promised to
    this plan's submissions there and whether it evicts there already (default:
    one cluster, name "", of ``nodes``).
    """

    models: Mapping[str, Model]
    replicas: Sequence[ReplicaView]
    nodes: Sequence[NodeInfo]
    wanted_at: Mapping[str, float]
    failures: Mapping[str, Failures]
    cfg: PlanConfig
    now: float
    new_id: Callable[[], str]
    sites: list[_Site] = field(default_factory=list)
    out: PlanResult = field(default_factory=PlanResult)
    stopping: set[str] = field(default_factory=set)
    # The replicas that count (pending, starting, ready) and no rule stops, by model:
    # set by start_models() once the per-replica rules are done.
    live: list[ReplicaView] = field(default_factory=list)
    by_model: dict[str, list[ReplicaView]] = field(default_factory=dict)
    # Per model, when its oldest held request began waiting (plan()'s held_since).
    held_since: Mapping[str, float] = field(default_factory=dict)
    # Per model whose start found no eviction that makes room: each candidate turned
    # down ("MODEL ID on NODE: why"), for the placement span.
    turned_down: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The models an earlier pass's fair-share drain makes room for, while that replica
    # drains or its job ends (rule 4): they wait for its GPUs, and stop nothing else.
    room_coming: set[str] = field(default_factory=set)
    # Per model a fair-share drain was made for: "MODEL ID" of the replica drained.
    drained_for: dict[str, str] = field(default_factory=dict)
    # Per model, this plan's actions that end a failed start (what rule 2b counts),
    # so that each model does not scan every action of the pass.
    failed_now: dict[str, list[Action]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.sites:
            self.sites = _sites([ClusterView("", self.nodes, self.cfg.default_partition)], self.cfg)

    @property
    def several(self) -> bool:
        """More than one cluster: notes name the cluster they are about."""
        return len(self.sites) > 1

    def site(self, name: str) -> _Site | None:
        return next((s for s in self.sites if s.name == name), None)

    def start_models(self) -> None:
        self.live = [
            r
            for r in self.replicas
            if r.state.counts and r.replica_id not in self.stopping and not self.lost(r)
        ]
        for r in self.live:
            self.by_model.setdefault(r.model, []).append(r)
        for r in self.replicas:
            site = self.site(r.cluster)
            if r.state is ReplicaState.STOPPING and r.stop_reason.startswith("evicted"):
                if site is not None:
                    site.eviction_in_progress = True
            elif made_for := _drained_for(r):
                self.room_coming.add(made_for)

    def lost(self, r: ReplicaView) -> bool:
        """Does ``r`` no longer count because its cluster is down? Not when it serves:
        ready, with its agent heard from within cluster_down_after (its engine answers
        the gateway whatever its controller does). Recorded in the result."""
        site = self.site(r.cluster)
        if site is None or not site.view.down or not r.state.counts:
            return False
        heard = r.last_report is not None and self.now - r.last_report < self.cfg.cluster_down_after
        if r.state is ReplicaState.READY and heard:
            return False
        self.out.lost_with_cluster.append(r.replica_id)
        return True

    def wanted(self, m: Model) -> bool:
        """A request asked for ``m`` within its window."""
        w = self.wanted_at.get(m.name)
        return w is not None and self.now - w < self.window(m)

    def window(self, m: Model) -> float:
        # A request may wait as long as its model's hold deadline: a model that
        # holds for 30 min must not have its pending job cancelled after the
        # server's 5 min while requests still wait for it. A shorter hold keeps
        # the server's window: a client retrying after its 503 finds the job
        # still queued, not resubmitted at the back of the queue.
        return max(self.cfg.want_window, m.scaling.hold_timeout or 0.0)

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
        action = Action(
            kind,
            r.model,
            reason,
            replica_id=r.replica_id,
            job_id=r.job_id,
            failure=failure,
            attrs=attrs or {},
        )
        self.out.actions.append(action)
        if failure:
            self.failed_now.setdefault(r.model, []).append(action)

    def cancel(
        self, r: ReplicaView, reason: str, *, failure: bool = False, **attrs: object
    ) -> None:
        self.stop(ActionKind.CANCEL, r, reason, failure=failure, attrs=attrs)

    def drain(self, r: ReplicaView, reason: str, **attrs: object) -> None:
        self.stop(ActionKind.DRAIN, r, reason, attrs=attrs)


# ---- 1. per replica -----------------------------------------------------------------


def _replica_rules(st: _PlanState, r: ReplicaView) -> None:
    """Rule 1: the first of ``_REPLICA_RULES`` that applies acts on ``r`` (one action each).

    None acts on a replica whose cluster did not answer this pass: what the daemon
    knows of its job may be stale, and a cancel would not reach it anyway.
    """
    site = st.site(r.cluster)
    if r.state is ReplicaState.STOPPING or site is None or not site.view.answering:
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


def _off_its_clusters(st: _PlanState, r: ReplicaView, m: Model | None) -> bool:
    """Its model's resources.clusters no longer names the replica's cluster."""
    if m is None or m.resources.may_run_on(r.cluster) or r.state is ReplicaState.DRAINING:
        return False
    why = f"cluster {r.cluster} no longer in the model's clusters"
    if r.state is ReplicaState.READY:
        st.drain(r, why)
    else:
        st.cancel(r, why)
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
    _off_its_clusters,
    _start_failed,
    _start_timed_out,
    _pending_too_long,
    _drain_done,
)


# ---- 2. per model ---------------------------------------------------------------------


# Not frozen: a frozen dataclass sets each field through object.__setattr__,
# and one of these is made per model per pass (half of a steady pass's own time
# over 100 models). No rule assigns to one; a changed view is a new one.
@dataclass(slots=True)
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
        # Most models lose nothing: the copy (dataclasses.replace) was a
        # quarter of a steady pass's time over many models.
        if not any(r.replica_id in stopping for r in self.mine):
            return self
        mine = [r for r in self.mine if r.replica_id not in stopping]
        return replace(self, mine=mine, counted=_count_once(mine))


def _count_once(mine: list[ReplicaView]) -> list[ReplicaView]:
    """A replica and its renewal count once."""
    present = {x.replica_id for x in mine}
    return [r for r in mine if not r.replaces or r.replaces not in present]


def _in_turn(st: _PlanState) -> list[Model]:
    """The models in the order rule 2 takes them: those a request waits for first, the
    longest waiting first (it gets free GPUs and the pass's eviction first), then the
    rest in catalog order. Catalog order alone let the first listed model take every
    eviction while another's requests waited longer."""
    ms = list(st.models.values())

    def key(i: int) -> tuple[int, float, int]:
        m = ms[i]
        since = st.held_since.get(m.name)
        if since is None or not st.wanted(m):
            return (1, 0.0, i)
        return (0, since, i)

    return [ms[i] for i in sorted(range(len(ms)), key=key)]


def _load_target(m: Model, ready: list[ReplicaView], in_flight: int) -> int:
    """Replicas the model's load calls for (scaling.scale_on)."""
    if m.scaling.scale_on == "engine_waiting":
        # The replicas in use stay, and the engines' queues ask for more; an idle
        # replica is not counted, so that it can be scaled down after idle_timeout.
        waiting = sum(r.engine_waiting for r in ready)
        busy = sum(1 for r in ready if r.in_flight)
        return busy + math.ceil(waiting / m.scaling.target_waiting)
    return math.ceil(in_flight / m.scaling.target_inflight) if in_flight else 0


def _model_view(st: _PlanState, m: Model) -> _ModelView:
    # An earlier model's eviction may have taken one of these: it is going
    # away and gets no second action (no drain, no renewal).
    mine = [r for r in st.by_model.get(m.name, []) if r.replica_id not in st.stopping]
    ready = [r for r in mine if r.state is ReplicaState.READY]
    in_flight = sum(r.in_flight for r in mine)
    # Asked for lately is not enough: the requests of a model that was ready since
    # were served. Its replica evicted or gone, restarting it at once (evicting for
    # it, when its hold outlasts the eviction grace) would serve nobody.
    waiting = st.wanted(m) and m.name in st.held_since and not ready
    target = _load_target(m, ready, in_flight)
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
            _submit(st, m, reason, "renewal", replaces=r.replica_id, prefer=(r.cluster,))
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
    failed_now = st.failed_now.get(name, [])
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
    elif m.scaling.scale_on == "engine_waiting":
        waiting = sum(r.engine_waiting for r in mv.ready)
        why = f"{waiting} waiting in the engines, target {m.scaling.target_waiting} per replica"
    else:
        why = f"{mv.in_flight} in flight, target {m.scaling.target_inflight} per replica"
    purpose = _purpose(mv)
    # A held start has no replica to stay near; the others prefer the clusters the
    # model runs on (see _runs_on).
    prefer = () if purpose == "held" else _runs_on(mv)
    for _ in range(mv.desired - len(mv.counted)):
        _submit(st, m, f"scale up to {mv.desired}: {why}", purpose, prefer=prefer)


def _runs_on(mv: _ModelView) -> tuple[str, ...]:
    """The clusters the model's replicas run on, the one with most of them first.

    A scale-up to min or for load (and a renewal, on its replica's cluster) goes
    there first when it fits there now: the weights are already in that cluster's
    cache and file systems (a cold cluster loads them anew, minutes for a large
    model), and the same GPU type serves the same load per replica, which the
    scaling target assumes. Spread over clusters it would survive one cluster's
    failure better; a model that needs that lists the clusters, min per cluster,
    as models of their own.
    """
    counts: dict[str, int] = {}
    for r in mv.mine:
        counts[r.cluster] = counts.get(r.cluster, 0) + 1
    return tuple(sorted(counts, key=lambda c: -counts[c]))


def _purpose(mv: _ModelView, r: ReplicaView | None = None) -> EvictFor:
    """Why a replica of the model starts (``r``: one already queued), in scaling.evict_for's
    words: only a start that a held request waits for evicts by default."""
    if r is not None and r.replaces:
        return "renewal"
    if mv.waiting:
        return "held"
    mine = len(mv.counted) - (1 if r is not None else 0)
    return "min" if mine < mv.model.scaling.min else "load"


def _acts_on(st: _PlanState, r: ReplicaView) -> bool:
    """May this plan act on ``r``: its cluster answered this pass."""
    site = st.site(r.cluster)
    return site is not None and site.view.answering


def _scale_down(st: _PlanState, mv: _ModelView) -> None:
    """Rule 2d: above the desired count, pending ones nobody waits for go first (newest
    first), then one idle ready replica a pass (idle past ``idle_timeout``, or above max)."""
    m, now = mv.model, st.now
    surplus = len(mv.counted) - mv.desired
    if surplus <= 0:
        return
    # A replica its cluster's failure had replaced goes first, pending or starting: its
    # cluster answers again, and the model has its replacement (never both).
    stranded = [
        r
        for r in mv.counted
        if r.stranded and r.state is not ReplicaState.READY and _acts_on(st, r)
    ]
    for r in stranded[:surplus]:
        st.cancel(r, f"scale down: replaced while cluster {r.cluster} did not answer")
        surplus -= 1
    pending = (
        r
        for r in mv.counted
        if r.state is ReplicaState.PENDING and r.replica_id not in st.stopping and _acts_on(st, r)
    )
    for r in sorted(pending, key=lambda r: r.submitted_at, reverse=True):
        if surplus == 0:
            return
        st.cancel(r, "scale down" if mv.waiting else "scale down: not needed (nobody waiting)")
        surplus -= 1
    if surplus == 0:
        return

    def since(r: ReplicaView) -> float:
        if r.last_used is not None:
            return r.last_used
        return r.ready_at if r.ready_at is not None else now

    idle = (
        r
        for r in mv.counted
        if r.state is ReplicaState.READY and r.in_flight == 0 and _acts_on(st, r)
    )
    # Those this rule cancelled above no longer count toward max.
    left = sum(1 for r in mv.counted if r.replica_id not in st.stopping)
    for r in sorted(idle, key=since):
        if left > m.scaling.max or now - since(r) >= m.scaling.idle_timeout:
            idle_s = now - since(r)
            st.drain(r, f"scale down: idle {format_duration(idle_s)}", idle_seconds=idle_s)
            # One idle scale-down per model per pass: the next pass sees the result.
            return


def _queued(st: _PlanState, mv: _ModelView) -> None:
    """Rule 2e: a pending replica Slurm cannot start says why, and may evict (rule 3)
    on its own cluster."""
    m = mv.model
    for r in mv.mine:
        site = st.site(r.cluster)
        # A job cancelled above is going away: stopping another replica to
        # make room for it would only throw that one away too.
        if (
            r.state is not ReplicaState.PENDING
            or r.replica_id in st.stopping
            or r.reason not in ("Resources", "Priority")
            or m.name in st.out.notes
            or site is None
            or not site.view.answering
        ):
            continue
        ok, where = fits(m, site.nodes, site.cfg, site.taken)
        purpose = _purpose(mv, r)
        at = site.label(st.several)
        if not ok:
            note, _ = _evict(st, site, m, where, purpose)
            st.out.notes[m.name] = f"queued ({at}{r.reason}): {where}; {note}"
            continue
        st.out.notes[m.name] = f"queued ({at}{r.reason})"
        if (
            purpose in m.scaling.evict_for
            and not (site.evicted or site.eviction_in_progress or m.name in st.room_coming)
            and (_eviction_candidates(st, site, m) or _fair_share_due(st, site, m, purpose))
        ):
            # On nodes that say it does not fit, this would evict: only a fresh
            # listing may decide that it fits.
            st.out.nodes_decide = True


# ---- 3. placement ---------------------------------------------------------------------


def _sites_for(st: _PlanState, m: Model, prefer: Sequence[str]) -> list[_Site]:
    """The clusters a replica of ``m`` may go to now, in order: answering, among its
    resources.clusters, those in ``prefer`` first (in its order), then the site's order."""
    ok = [s for s in st.sites if s.view.answering and m.resources.may_run_on(s.name)]
    return sorted(ok, key=lambda s: prefer.index(s.name) if s.name in prefer else len(prefer))


def _could_run(site: _Site, m: Model) -> bool:
    """Has ``site`` enough nodes that could ever take a replica of ``m``, all jobs gone
    (its partitions, GPU type and count, CPUs, features)? What Slurm would refuse outright."""
    res = m.resources
    part = _partition(m, site.cfg)
    parts = part.split(",") if part else ()
    ok = 0
    for n in site.nodes:
        if parts and not any(p in n.partitions for p in parts):
            continue
        if n.gpus_total(res.gpu_type or "") < res.gpus or n.cpus_total < res.cpus:
            continue
        if res.constraint and n.features is not None and not satisfies(n.features, res.constraint):
            continue
        ok += 1
    return ok >= res.nodes


def _runnable(st: _PlanState, m: Model, sites: list[_Site]) -> list[_Site] | None:
    """Of ``sites``, those that could ever run ``m`` (all of them when none could: Slurm
    then says why); None when none could but a cluster that is not answering could, so
    that nothing is queued where it can never start while that cluster is away."""
    if not st.several:
        return sites
    could = [s for s in sites if _could_run(s, m)]
    if could:
        return could
    away = [s for s in st.sites if not s.view.answering and m.resources.may_run_on(s.name)]
    if any(_could_run(s, m) for s in away):
        return None
    return sites


def _no_cluster(st: _PlanState, m: Model) -> str:
    """Why no cluster may take a replica of ``m`` now (none answers, or none is its)."""
    why = [
        f"{s.name} "
        + (
            "not answering"
            if not s.view.answering
            else "not in its clusters"
            if not m.resources.may_run_on(s.name)
            else "has no node that could take it"
        )
        for s in st.sites
    ]
    return "no cluster to place it on: " + ", ".join(why)


def _submit(
    st: _PlanState,
    m: Model,
    reason: str,
    purpose: EvictFor,
    replaces: str = "",
    prefer: Sequence[str] = (),
) -> None:
    """A new replica of ``m``: placed where it fits now, on the first cluster (rule
    order: ``_sites_for``) with free GPUs this plan has not promised yet; fitting
    nowhere, on the first cluster where an eviction makes room (``_evict``), else
    queued where Slurm expects it to start first (``Action.candidates``)."""
    st.out.nodes_decide = True
    sites = _runnable(st, m, _sites_for(st, m, prefer))
    if not sites:
        st.out.notes[m.name] = _no_cluster(st, m)
        return
    action = Action(ActionKind.SUBMIT, m.name, reason, replica_id=st.new_id(), replaces=replaces)
    whys: list[str] = []
    for site in sites:
        ok, where = fits(m, site.nodes, site.cfg, site.taken)
        if ok:
            for n in where.split(","):
                site.taken[n] = site.taken.get(n, 0) + m.resources.gpus
            st.out.actions.append(
                replace(action, cluster=site.name, placement=site.label(st.several) + where)
            )
            return
        whys.append(site.label(st.several) + where)
    st.out.actions.append(_queue_or_evict(st, sites, m, purpose, action, "; ".join(whys)))


def _queue_or_evict(
    st: _PlanState, sites: list[_Site], m: Model, purpose: EvictFor, action: Action, why: str
) -> Action:
    """A submission that fits on no cluster now: on the first where an eviction makes
    room for it, else queued where Slurm says it would start first (or on the one
    cluster there is)."""
    notes: list[str] = []
    for site in sites:
        note, evicted = _evict(st, site, m, why, purpose)
        if evicted:
            action = replace(action, cluster=site.name)
            notes = [site.label(st.several) + note]
            break
        if note not in notes:
            notes.append(note)
    else:
        if len(sites) == 1:
            action = replace(action, cluster=sites[0].name)
        else:
            action = replace(action, candidates=tuple(s.name for s in sites))
    note = "; ".join(notes)
    attrs: dict[str, object] = {}
    if m.name in st.turned_down:
        attrs["evict.turned_down"] = st.turned_down[m.name]
    if m.name in st.drained_for:
        attrs["fair_share.drained"] = st.drained_for[m.name]
    st.out.notes[m.name] = f"no room: {why}; {note}"
    return replace(action, placement=f"no room now: {why}; {note}", attrs=attrs)


def earliest_start(
    candidates: Sequence[str], starts: Mapping[str, float | str], now: float
) -> tuple[str, str]:
    """The cluster where Slurm expects a replica that fits nowhere now to start first,
    and why, in a decision's words.

    ``starts``: per candidate, when its Slurm would start the job (Unix time, from
    ``sbatch --test-only``), or why it would not (its refusal: no such partition or
    GPU type, or no answer). Ties go to the earlier candidate (the site's order); a
    start already past counts as now. When every candidate refuses, the first is
    chosen all the same: its sbatch then says why, as a failed start.
    """
    said: list[str] = []
    best: tuple[float, int, str] | None = None
    for i, name in enumerate(candidates):
        got = starts.get(name, "not asked")
        if isinstance(got, str):
            said.append(f"{name} {got}")
            continue
        wait = max(0.0, got - now)
        said.append(f"{name} in {format_duration(wait)}")
        if best is None or (wait, i) < best[:2]:
            best = (wait, i, name)
    if best is None:
        return candidates[0], f"Slurm would start it on none ({'; '.join(said)}): {candidates[0]}"
    return best[2], f"Slurm expects it soonest on {best[2]} ({'; '.join(said)})"


def _eviction_candidates(st: _PlanState, site: _Site, m: Model) -> list[ReplicaView]:
    """What could be stopped on ``site`` to make room for ``m``, best first (see
    :func:`evictable`): eviction stays on the cluster whose room it makes."""
    return [
        c
        for c in evictable(m.name, st.live, st.models, st.cfg, st.now)
        if c.replica_id not in st.stopping and c.cluster == site.name
    ]


_PURPOSE_WORDS: Mapping[str, str] = {
    "held": "an on-demand start",
    "min": "a scale-up to min",
    "renewal": "a renewal",
    "load": "a load scale-up",
}


def _evict(st: _PlanState, site: _Site, m: Model, why: str, purpose: EvictFor) -> tuple[str, bool]:
    """Stop the best candidate on ``site`` for ``m`` (which fits nowhere: ``why``);
    the note to show, and whether it evicted.

    Only for a start its ``scaling.evict_for`` names (by default one that a held
    request waits for), only a candidate whose stop makes ``m`` fit (the longest
    idle of those), at most one eviction per cluster per pass, and none while an
    earlier one's job there is still being killed.
    """
    if purpose not in m.scaling.evict_for:
        allowed = ", ".join(m.scaling.evict_for) or "[]"
        return f"{_PURPOSE_WORDS[purpose]} queues in Slurm (scaling.evict_for: {allowed})", False
    if site.evicted or site.eviction_in_progress:
        return f"waiting for {site.making_room} to give its GPUs back", False
    if m.name in st.room_coming:
        return f"waiting for {_FAIR_SHARE_DRAIN} to give its GPUs back", False
    candidates = _eviction_candidates(st, site, m)
    if not candidates:
        return _and_fair_share(st, site, m, why, purpose, _nothing_to_evict(st, site, m))
    tried = ((c, _room_made_by(st, site, m, c)) for c in candidates)
    best, where = next(((c, w) for c, w in tried if w), (None, ""))
    needed = 1
    if best is None:
        best, where, needed = _first_of_several(st, site, m, candidates)
    if best is None:
        return _and_fair_share(
            st, site, m, why, purpose, _none_makes_room(st, site, m, candidates)
        )
    site.evicted = True
    st.out.nodes_decide = True
    # The room is promised to m: a later model of this pass must not count the
    # free nodes m fits on beside the evicted one (m would then wait for two).
    for n in where.split(","):
        site.taken[n] = site.taken.get(n, 0) + m.resources.gpus
    idle = _idle(best, st.now)
    attrs = {
        "for": m.name,
        "idle_seconds": idle,
        "gpus": best.gpus_per_node * best.nodes,
        "candidates": len(candidates),
        "nodes": ",".join(best.node_names),
        "fits_on": where,
        "why": why,
        "evictions_needed": needed,
    }
    reason = f"evicted, idle {format_duration(idle)}, to make room for {m.name}"
    st.stop(ActionKind.EVICT, best, reason, attrs=attrs)
    more = f"; 1 of {needed} evictions that make room" if needed > 1 else ""
    note = f"evicting {best.model} replica {best.replica_id} (idle {format_duration(idle)}{more})"
    return note, True


def _freed_by(st: _PlanState, c: ReplicaView) -> dict[str, _Freed]:
    cm = st.models.get(c.model)
    gpu_type = (cm.resources.gpu_type or "") if cm else ""
    cpus = cm.resources.cpus if cm else 0
    mem = cm.resources.memory_mb if cm else None
    return {n: _Freed(c.gpus_per_node, gpu_type, cpus, mem) for n in c.node_names}


def _room_made_by(st: _PlanState, site: _Site, m: Model, c: ReplicaView) -> str:
    """Where ``m`` would fit on ``site`` once ``c``'s job is gone (the same listing, every
    other job counted), "" if nowhere."""
    if not c.node_names:
        return ""  # where it runs is unknown: what it frees is too
    pool: Sequence[NodeInfo] = site.nodes
    if m.resources.nodes == 1:
        # Only its own nodes change: the others said no already.
        pool = [n for n in site.nodes if n.name in c.node_names]
    ok, where = fits(m, pool, site.cfg, site.taken, _freed_by(st, c))
    return where if ok else ""


def _first_of_several(
    st: _PlanState, site: _Site, m: Model, candidates: list[ReplicaView]
) -> tuple[ReplicaView | None, str, int]:
    """For a multi-node ``m`` that no single eviction makes fit: the first of the evictions
    that together would, the nodes ``m`` would then take, and how many evictions that is.

    Each node takes one node of ``m`` (a free one, or one whose replica is stopped),
    so the evictions needed are the nodes it lacks, each the longest idle candidate
    alone on a node of its own that fits ``m`` once it is gone. Only the first is made
    now (one a pass); each later pass judges again, and once the others are gone the
    last eviction is one that alone makes room. (None, "", 0) when the candidates
    are not enough.
    """
    res = m.resources
    part = _partition(m, site.cfg)
    parts = part.split(",") if part else ()

    def ok(n: NodeInfo, fr: _Freed | None) -> bool:
        in_part = not parts or any(p in n.partitions for p in parts)
        return in_part and not _refusal(n, m, site.taken.get(n.name, 0), fr)

    free = [n.name for n in site.nodes if ok(n, None)][: res.nodes]
    by_name = {n.name: n for n in site.nodes}
    useful: list[tuple[ReplicaView, str]] = []
    for c in candidates:
        if len(c.node_names) != 1:
            continue
        name = c.node_names[0]
        n = by_name.get(name)
        if n is None or name in free or any(name == u for _, u in useful):
            continue
        if ok(n, _freed_by(st, c)[name]):
            useful.append((c, name))
    needed = res.nodes - len(free)
    if not 1 < needed <= len(useful):
        return None, "", 0
    return useful[0][0], ",".join([*free, useful[0][1]]), needed


def _none_makes_room(st: _PlanState, site: _Site, m: Model, candidates: list[ReplicaView]) -> str:
    """Idle replicas could be stopped, but none makes ``m`` fit: each, on each of its
    nodes, and why that node would still be turned down; and the nearest one."""
    by_name = {n.name: n for n in site.nodes}
    down: list[str] = []
    nearest, best_free = candidates[0], -1
    for c in candidates:
        fr = _freed_by(st, c)
        for name in c.node_names or ("(nodes unknown)",):
            n = by_name.get(name)
            why, free = _turned_down(site, m, n, fr.get(name))
            down.append(f"{c.model} {c.replica_id} on {name}: {why}")
            if free > best_free:
                nearest, best_free = c, free
    # Each cluster's refusals, once (a model may be placed twice in a pass).
    st.turned_down[m.name] = tuple(dict.fromkeys((*st.turned_down.get(m.name, ()), *down)))
    more = "; ..." if len(down) > 4 else ""
    return (
        f"{len(candidates)} idle replica(s) could be stopped, none makes room "
        f"({'; '.join(down[:4])}{more}); nearest candidate: {nearest.model} {nearest.replica_id}"
    )


def _turned_down(site: _Site, m: Model, n: NodeInfo | None, fr: _Freed | None) -> tuple[str, int]:
    """Why node ``n`` could not take ``m`` even with ``fr`` freed, and the GPUs of
    ``m``'s type it would have free (-1: it could never take ``m``)."""
    res = m.resources
    if n is None:
        return "not in the node listing", -1
    part = _partition(m, site.cfg)
    if part and not any(p in n.partitions for p in part.split(",")):
        return f"partition {','.join(n.partitions) or '(none)'}, needs {part}", -1
    gpu_type = res.gpu_type or ""
    if gpu_type and not n.gpus_total(gpu_type):
        have = ",".join(sorted({g.type or "(untyped)" for g in n.gpus})) or "none"
        return f"gpu type {have}, needs {gpu_type}", -1
    why = _refusal(n, m, site.taken.get(n.name, 0), fr)
    free = _free_gpus(n, gpu_type, site.taken.get(n.name, 0), fr)
    if why == "state":
        return f"state {n.state}", -1
    if why == "features":
        return f"features {','.join(n.features or ()) or '(none)'}, needs {res.constraint}", -1
    what = f"gpu:{gpu_type}" if gpu_type else "gpu"
    if why == "gpus":
        return f"{free} {what} free once stopped, needs {res.gpus}", free
    if why == "cpus":
        cpus = n.cpus_total - n.cpus_alloc + (fr.cpus if fr else 0)
        return f"{cpus} cpus free once stopped, needs {res.cpus}", free
    if why == "memory":
        need = f"{res.memory_mb} MB" if res.memory_mb else "all of it"
        return f"{_free_memory(n, fr)} MB memory free once stopped, needs {need}", free
    return f"fits once stopped, but {res.nodes} such node(s) needed", free


def _nothing_to_evict(st: _PlanState, site: _Site, m: Model) -> str:
    # Say what keeps each ready replica of another model: "nothing idle" alone
    # leaves an admin guessing which rule held.
    kept = [
        f"{r.model} {r.replica_id}: {why_kept(r, st.models, st.cfg, st.now)}"
        for r in st.live
        if r.model != m.name
        and r.state is ReplicaState.READY
        and r.replica_id not in st.stopping
        and r.cluster == site.name
    ]
    if not kept:
        return (
            "nothing idle enough to stop "
            "(no other model has a replica ready and not already stopping)"
        )
    more = "; ..." if len(kept) > 4 else ""
    return f"nothing idle enough to stop ({'; '.join(kept[:4])}{more})"


# ---- 4. fair share --------------------------------------------------------------------

# A fair-share drain's reason begins with this: later passes know it by it (its GPUs
# are promised to the model it was made for until its job is gone).
FAIR_SHARE = "fair share"
_FAIR_SHARE_DRAIN = "a replica drained for fair share"
_MAKING_ROOM = f"{FAIR_SHARE}: making room for "


def _drained_for(r: ReplicaView) -> str:
    """The model a fair-share drain of ``r`` makes room for, while it drains or its job
    ends; "" if it is not one."""
    if r.state not in (ReplicaState.DRAINING, ReplicaState.STOPPING):
        return ""
    if not r.drain_reason.startswith(_MAKING_ROOM):
        return ""
    return r.drain_reason[len(_MAKING_ROOM) :].split(" ", 1)[0]


def _turn(cfg: PlanConfig) -> float:
    """The shortest turn on the GPUs: no replica is drained for fair share sooner."""
    return max(cfg.min_slice, cfg.min_lifetime)


def _sharers(
    wanted_by: str, replicas: Sequence[ReplicaView], models: Mapping[str, Model]
) -> list[ReplicaView]:
    """Ready single-node replicas of the other on-demand models, whatever their turn,
    in use or not, save one nobody has reported a use of (after a daemon restart,
    unknown is not idle)."""
    out = []
    for r in replicas:
        if r.model == wanted_by or r.state is not ReplicaState.READY or r.ready_at is None:
            continue
        m = models.get(r.model)
        if r.last_used is not None and m is not None and m.scaling.on_demand and r.nodes == 1:
            out.append(r)
    return out


def _left_since(r: ReplicaView, waiting_since: float) -> bool:
    """Its users left it before the model began to wait: nothing in flight, no use since.

    Such a replica goes before one in use. Rule 3 leaves it alone within the
    eviction grace (a pause must not cost a cold start), but once a model has
    waited ``max_wait`` someone loses a turn, and taking it cuts no work and
    costs at most its one paused user a start, where a replica in use costs
    every user now on it one.
    """
    return r.in_flight == 0 and r.last_used is not None and r.last_used < waiting_since


def _drain_order(
    r: ReplicaView, waiting_since: float, cfg: PlanConfig, now: float
) -> tuple[bool, float]:
    """The key of rule 4's choice, highest first: left by its users, then furthest
    beyond its share."""
    return _left_since(r, waiting_since), _beyond_share(r, cfg, now)


def _beyond_share(r: ReplicaView, cfg: PlanConfig, now: float) -> float:
    """GPU-seconds ``r`` has held its GPUs beyond its share (a turn), negative within it."""
    assert r.ready_at is not None
    return max(r.gpus_per_node, 1) * (now - r.ready_at - _turn(cfg))


def fair_share_candidates(
    wanted_by: str,
    waiting_since: float,
    replicas: Sequence[ReplicaView],
    models: Mapping[str, Model],
    cfg: PlanConfig,
    now: float,
) -> list[ReplicaView]:
    """Replicas that may be drained for ``wanted_by``, waiting since ``waiting_since``
    (rule 4), in the order they go: those idle since it began to wait, then those in
    use; each furthest beyond its share first.

    The share is an equal turn: each replica of an on-demand model may serve for
    ``min_slice`` (never less than ``min_lifetime``) from becoming ready; past it,
    it holds ``GPUs x (time ready - turn)`` GPU-seconds beyond its share, and the
    replica furthest beyond goes first. Equal turns, not a share weighted by
    demand: a model with one waiting user must not wait for ever behind one with
    fifty, which a demand-weighted share allows. Not GPU-time over a window either:
    the plan reads the state now, and a history would be lost with the daemon;
    and Slurm's own fair-share figures are per account, while every replica runs
    under the service's. Only single-node replicas of models with ``min: 0``
    (``min >= 1`` is a promise) whose last use is known (:func:`_sharers`).
    """
    out = [
        r
        for r in _sharers(wanted_by, replicas, models)
        if _beyond_share(r, cfg, now) >= 0
    ]
    out.sort(key=lambda r: _drain_order(r, waiting_since, cfg, now), reverse=True)
    return out


def _max_wait(st: _PlanState, m: Model) -> float:
    return m.scaling.max_wait if m.scaling.max_wait is not None else st.cfg.max_wait


def _fair_share_due(st: _PlanState, site: _Site, m: Model, purpose: EvictFor) -> bool:
    """May rule 4 drain for ``m`` on ``site`` now (the listing aside)?"""
    since = st.held_since.get(m.name)
    if not st.cfg.fair_share or purpose != "held" or since is None:
        return False
    if st.now - since < _max_wait(st, m):
        return False
    return any(
        r.replica_id not in st.stopping and r.cluster == site.name
        for r in fair_share_candidates(m.name, since, st.live, st.models, st.cfg, st.now)
    )


def _and_fair_share(
    st: _PlanState, site: _Site, m: Model, why: str, purpose: EvictFor, note: str
) -> tuple[str, bool]:
    """Rule 3's ``note`` (it evicts nothing for ``m`` on ``site``), what rule 4 does
    instead, and whether that drains a replica there (its room then goes to ``m``)."""
    more, drained = _fair_share(st, site, m, why, purpose)
    return (f"{note}; {more}" if more else note), drained


def _fair_share(
    st: _PlanState, site: _Site, m: Model, why: str, purpose: EvictFor
) -> tuple[str, bool]:
    """Rule 4: drain on ``site``, for ``m`` (which fits nowhere: ``why``), the replica
    furthest beyond its share whose stop makes ``m`` fit, once ``m``'s oldest held
    request has waited ``max_wait``; the note to add ("" when no replica in use would
    make room) and whether it drained one."""
    since = st.held_since.get(m.name)
    if not st.cfg.fair_share or purpose != "held" or since is None:
        return "", False
    sharers = _sharers(m.name, st.live, st.models)
    helps = [
        (r, w)
        for r in sharers
        if r.replica_id not in st.stopping
        and r.cluster == site.name
        and (w := _room_made_by(st, site, m, r))
    ]
    if not helps:
        return "", False
    waited, limit = st.now - since, _max_wait(st, m)
    due = [(r, w) for r, w in helps if _beyond_share(r, st.cfg, st.now) >= 0]
    if not due or waited < limit:
        return _fair_share_later(st, m, helps, waited, limit), False
    best, where = max(due, key=lambda t: _drain_order(t[0], since, st.cfg, st.now))
    return _drain_for(st, site, m, best, (where, why), (waited, limit), len(due)), True


def _fair_share_later(
    st: _PlanState, m: Model, helps: list[tuple[ReplicaView, str]], waited: float, limit: float
) -> str:
    """When rule 4 could drain for ``m``: the soonest of ``helps``, and what it waits for."""

    def turn_left(r: ReplicaView) -> float:
        return max(0.0, -_beyond_share(r, st.cfg, st.now) / max(r.gpus_per_node, 1))

    r = min(helps, key=lambda t: turn_left(t[0]))[0]
    wait_left = max(0.0, limit - waited)
    if turn_left(r) > wait_left:
        why = f"when its {format_duration(_turn(st.cfg))} turn ends"
    else:
        why = f"if {m.name} still waits then (max_wait {format_duration(limit)})"
    return (
        f"{FAIR_SHARE}: {r.model} {r.replica_id} may be drained for {m.name} in "
        f"{format_duration(max(turn_left(r), wait_left))}, {why}"
    )


def _drain_for(
    st: _PlanState,
    site: _Site,
    m: Model,
    r: ReplicaView,
    room: tuple[str, str],
    wait: tuple[float, float],
    candidates: int,
) -> str:
    """Drain ``r`` on ``site`` for ``m`` (rule 4), its room (``where`` ``m`` then fits,
    and ``why`` it fits nowhere now) promised to ``m``; ``wait``: how long ``m``'s
    oldest held request waited, and its max_wait. The note to add."""
    assert r.ready_at is not None and r.last_used is not None
    (where, why), (waited, limit) = room, wait
    site.evicted = True
    site.making_room = _FAIR_SHARE_DRAIN
    st.out.nodes_decide = True
    for n in where.split(","):
        site.taken[n] = site.taken.get(n, 0) + m.resources.gpus
    held, turn = st.now - r.ready_at, _turn(st.cfg)
    gpus = r.gpus_per_node * r.nodes
    reason = (
        f"{_MAKING_ROOM}{m.name} (waiting {format_duration(waited)}, max_wait "
        f"{format_duration(limit)}); held {gpus} GPU(s) {format_duration(held)}, past its "
        f"{format_duration(turn)} turn{_idle_for(r, st.now - waited, st.now)}"
    )
    st.drain(
        r,
        reason,
        **{
            "for": m.name,
            "waited_seconds": waited,
            "max_wait_seconds": limit,
            "held_seconds": held,
            "turn_seconds": turn,
            "gpus": gpus,
            "in_flight": r.in_flight,
            "idle_seconds": st.now - r.last_used,
            "candidates": candidates,
            "nodes": ",".join(r.node_names),
            "fits_on": where,
            "why": why,
        },
    )
    st.drained_for[m.name] = f"{r.model} {r.replica_id}"
    return (
        f"{FAIR_SHARE}: draining {r.model} {r.replica_id} (serving {format_duration(held)}, "
        f"past its {format_duration(turn)} turn; {r.in_flight} request(s) in flight finish first)"
    )


def _idle_for(r: ReplicaView, waiting_since: float, now: float) -> str:
    """", unused for 3m10s" of a replica its users left before the wait began, or ""."""
    if not _left_since(r, waiting_since):
        return ""
    assert r.last_used is not None
    return f", unused for {format_duration(now - r.last_used)}"


def _fair_share_notes(st: _PlanState) -> None:
    """A model whose replica drains for fair share says so in its note, and for whom."""
    draining = [
        (r.model, r.replica_id, r.drain_reason)
        for r in st.replicas
        if r.state is ReplicaState.DRAINING
        and r.drain_reason.startswith(FAIR_SHARE)
        and r.replica_id not in st.stopping
    ]
    draining += [
        (a.model, a.replica_id, a.reason)
        for a in st.out.actions
        if a.kind is ActionKind.DRAIN and a.reason.startswith(FAIR_SHARE)
    ]
    for model, rid, reason in draining:
        note = f"{rid} draining: {reason}"
        have = st.out.notes.get(model)
        st.out.notes[model] = f"{have}; {note}" if have else note
