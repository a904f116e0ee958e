"""Fair share (plan rule 4, issue 37): a model kept busy does not starve the others.

With every GPU the service may use held by a busy on-demand replica, eviction
(rule 3) takes nothing: only idle replicas are its candidates. Once a model's
oldest held request has waited ``max_wait``, rule 4 drains (its requests in
flight finish) a replica of another on-demand model that has had its turn
(``min_slice``, and ``min_lifetime``) and whose stop makes the waiting model
fit. Same fake clock and helpers as test_plan.py; the first tests run the real
``plan()`` pass after pass over a one-GPU node, the others check each part of
the rule on one plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from test_plan import NOW, P, R, X, entry, models_of, node, rv  # type: ignore[import-not-found]

from llmgw_slurm.catalog import Model
from llmgw_slurm.reconciler.plan import (
    ActionKind,
    PlanConfig,
    PlanResult,
    ReplicaState,
    ReplicaView,
    fair_share_candidates,
    plan,
)
from llmgw_slurm.slurm.types import NodeInfo

D = ReplicaState.DRAINING
LONG = "{idle_timeout: 1d}"
MIN = 60.0
# 10-minute turns (the defaults are 2): the figures below are a turn's.
CFG = dataclasses.replace(PlanConfig(), min_slice=10 * MIN, min_lifetime=10 * MIN)


def run(
    models: Mapping[str, Model],
    replicas: Sequence[ReplicaView],
    nodes: Sequence[NodeInfo],
    held: Mapping[str, float],
    cfg: PlanConfig = CFG,
    now: float = NOW,
) -> PlanResult:
    """A plan in which every model of ``held`` is asked for now, held since its value."""
    n = iter(range(1, 1000))
    wanted = {k: now for k in held}
    return plan(
        models, replicas, nodes, wanted, {}, cfg, now, lambda: f"{next(n):08x}", held_since=held
    )


def busy(rid: str, model: str, ready_for: float, where: str = "n1", **kw: object) -> ReplicaView:
    """A ready replica serving a request now, ready for ``ready_for`` seconds."""
    kw = {
        "in_flight": 1,
        "last_used": NOW,
        "ready_at": NOW - ready_for,
        "node_names": (where,),
        **kw,
    }
    return rv(rid, model, R, **kw)


def one_gpu() -> list[NodeInfo]:
    return [node("n1", gpus=1, used=1)]


def kinds(res: PlanResult) -> list[tuple[str, str, str]]:
    return [(a.kind.value, a.model, a.replica_id) for a in res.actions]


def two(tmp_path: Path, *extra: str) -> dict[str, Model]:
    return models_of(tmp_path, entry("w1", LONG) + entry("w2", LONG) + "".join(extra))


# ---------------------------------------------------------------- pass after pass


@dataclass
class OneGpu:
    """One 1-GPU node and the real plan() every ``step`` seconds; a fake Slurm starts the
    oldest pending job once the GPU is free, its engine serves ``start_s`` after, and a
    cancelled job gives the GPU back ``kill_s`` after the cancel. Each model in ``asking``
    has a client that keeps one request in flight on its ready replica, and whose
    requests are held while it has none (so its oldest held request dates from when
    its replica stopped serving)."""

    models: Mapping[str, Model]
    cfg: PlanConfig
    asking: dict[str, float]  # model -> when its client began asking
    step: float = 10.0
    start_s: float = 90.0
    kill_s: float = 10.0
    t: float = NOW
    reps: list[ReplicaView] = field(default_factory=list)
    stop_at: dict[str, float] = field(default_factory=dict)
    held: dict[str, float] = field(default_factory=dict)
    # (model, ready at, drained at or None): each replica's turn on the GPU.
    turns: list[list[object]] = field(default_factory=list)
    # (model, held since, served at): each wait of a model's users.
    waits: list[tuple[str, float, float]] = field(default_factory=list)
    drains: list[str] = field(default_factory=list)  # reasons of the fair-share drains
    ids: int = 0

    def run_until(self, end: float) -> None:
        while self.t < end:
            self.slurm()
            self.clients()
            self.act(self.plan())
            self.t += self.step

    def slurm(self) -> None:
        t = self.t
        gone = {rid for rid, at in self.stop_at.items() if at <= t}
        self.reps = [r for r in self.reps if r.replica_id not in gone]
        holding = [r for r in self.reps if r.started_at is not None]
        pending = sorted((r for r in self.reps if r.state is P), key=lambda r: r.submitted_at)
        if not holding and pending:
            self.swap(pending[0], started_at=t, state=ReplicaState.STARTING, reason="")
        for r in list(self.reps):
            if r.state is ReplicaState.STARTING and t >= (r.started_at or t) + self.start_s:
                self.swap(r, state=R, ready_at=t, last_used=t, node_names=("n1",))
                self.turns.append([r.model, t, None])

    def clients(self) -> None:
        for model, since in self.asking.items():
            if self.t < since:
                continue
            ready = [r for r in self.reps if r.model == model and r.state is R]
            if ready:
                self.swap(ready[0], in_flight=1, last_used=self.t)
                if model in self.held:
                    self.waits.append((model, self.held.pop(model), self.t))
            else:
                self.held.setdefault(model, self.t)
        for r in list(self.reps):
            if r.state is D and r.in_flight:
                # The request in flight when the drain began finishes within a step.
                self.swap(r, in_flight=0, last_used=self.t)

    def plan(self) -> PlanResult:
        used = sum(1 for r in self.reps if r.started_at is not None)

        def new_id() -> str:
            self.ids += 1
            return f"{self.ids:08x}"

        wanted = {m: self.t for m, since in self.asking.items() if self.t >= since}
        return plan(
            self.models,
            self.reps,
            [node("n1", gpus=1, used=used)],
            wanted,
            {},
            self.cfg,
            self.t,
            new_id,
            held_since=dict(self.held),
        )

    def act(self, res: PlanResult) -> None:
        for a in res.actions:
            if a.kind is ActionKind.SUBMIT:
                self.reps.append(
                    rv(a.replica_id, a.model, P, reason="Resources", submitted_at=self.t)
                )
                continue
            r = next(r for r in self.reps if r.replica_id == a.replica_id)
            if a.kind is ActionKind.DRAIN:
                self.swap(r, state=D, draining_since=self.t, drain_reason=a.reason)
                self.drains.append(a.reason)
                for turn in self.turns:
                    if turn[0] == r.model and turn[1] == r.ready_at and turn[2] is None:
                        turn[2] = self.t
            else:
                self.swap(r, state=X, stop_reason=a.reason)
                self.stop_at[r.replica_id] = self.t + (self.kill_s if r.started_at else 0.0)

    def swap(self, r: ReplicaView, **kw: object) -> None:
        new = dataclasses.replace(r, **kw)  # type: ignore[arg-type]
        self.reps = [new if x.replica_id == r.replica_id else x for x in self.reps]


def starving(tmp_path: Path, cfg: PlanConfig) -> OneGpu:
    """w1 started for a request at NOW and kept busy; w2 asked for an hour later."""
    world = OneGpu(two(tmp_path), cfg, {"w1": NOW, "w2": NOW + 3600})
    world.run_until(NOW + 3600 + 3 * 3600)
    return world


def test_without_fair_share_a_busy_model_starves_the_other(tmp_path: Path) -> None:
    # The gap, as plan() had it: w2 waits three hours and is never served.
    world = starving(tmp_path, dataclasses.replace(CFG, fair_share=False))
    assert [w for w in world.waits if w[0] == "w2"] == []
    assert world.held["w2"] == NOW + 3600
    assert [turn[0] for turn in world.turns] == ["w1"]


def test_the_starved_model_is_served_within_max_wait_plus_one_start(tmp_path: Path) -> None:
    cfg = dataclasses.replace(CFG, max_wait=2 * MIN, min_slice=10 * MIN)
    world = starving(tmp_path, cfg)
    (since, served) = next((s, at) for m, s, at in world.waits if m == "w2")
    assert since == NOW + 3600
    # max_wait, then one start; beside them only the drain (the request in flight
    # finishes within a pass), the job's end (kill_s) and the passes' granularity.
    slack = 3 * world.step + world.kill_s
    assert served - since <= cfg.max_wait + world.start_s + slack
    # w1 was drained, not killed: its request in flight finished before its cancel.
    assert world.drains[0].startswith(
        "fair share: making room for w2 (waiting 2m00s, max_wait 2m00s); held 1 GPU(s) 1h00m"
    )


def test_two_busy_models_take_turns_of_at_least_the_slice(tmp_path: Path) -> None:
    cfg = dataclasses.replace(CFG, max_wait=2 * MIN, min_slice=15 * MIN, min_lifetime=5 * MIN)
    world = starving(tmp_path, cfg)
    models = [str(turn[0]) for turn in world.turns]
    # The turns alternate, and there are many: neither model keeps the GPU.
    assert len(models) >= 8
    assert all(a != b for a, b in itertools.pairwise(models)), models
    for model, ready, drained in world.turns[1:-1]:
        assert isinstance(ready, float) and isinstance(drained, float)
        assert drained - ready >= cfg.min_slice, (model, drained - ready)
    # Nor do they pay a start each pass: one turn is at most a pass past the slice.
    for _, ready, drained in world.turns[1:-1]:
        assert drained - ready <= cfg.min_slice + world.step  # type: ignore[operator]
    # Each wait is the other's start and turn, its drain, and a start of one's own.
    worst = max(served - since for _, since, served in world.waits)
    assert worst <= cfg.min_slice + 2 * world.start_s + 3 * world.step + 2 * world.kill_s


def test_the_turn_is_never_shorter_than_the_minimum_lifetime(tmp_path: Path) -> None:
    cfg = dataclasses.replace(CFG, max_wait=1 * MIN, min_slice=2 * MIN, min_lifetime=12 * MIN)
    world = starving(tmp_path, cfg)
    assert len(world.turns) >= 6
    for _, ready, drained in world.turns[1:-1]:
        assert drained - ready >= cfg.min_lifetime  # type: ignore[operator]


# ---------------------------------------------------------------- one plan


def test_no_drain_before_max_wait_and_the_note_says_when(tmp_path: Path) -> None:
    ms = two(tmp_path)
    res = run(ms, [busy("11111111", "w1", 3600)], one_gpu(), {"w2": NOW - 100})
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert res.notes["w2"].endswith(
        "nothing idle enough to stop (w1 11111111: serving 1 request(s)); "
        "fair share: w1 11111111 may be drained for w2 in 20s, "
        "if w2 still waits then (max_wait 2m00s)"
    )


def test_after_max_wait_the_busy_replica_is_drained_for_the_waiting_model(tmp_path: Path) -> None:
    ms = two(tmp_path)
    res = run(ms, [busy("11111111", "w1", 3600)], one_gpu(), {"w2": NOW - 130})
    assert kinds(res) == [("drain", "w1", "11111111"), ("submit", "w2", "00000001")]
    drain, submit = res.actions
    assert drain.reason == (
        "fair share: making room for w2 (waiting 2m10s, max_wait 2m00s); "
        "held 1 GPU(s) 1h00m, past its 10m00s turn"
    )
    assert dict(drain.attrs) == {
        "for": "w2",
        "waited_seconds": 130.0,
        "max_wait_seconds": 120.0,
        "held_seconds": 3600.0,
        "turn_seconds": 600.0,
        "gpus": 1,
        "in_flight": 1,
        "idle_seconds": 0.0,
        "candidates": 1,
        "nodes": "n1",
        "fits_on": "n1",
        "why": "needs 1 node(s) with 1 free gpu; n1: 0 gpu free",
    }
    # The waiting model's note and placement, and the drained model's note, say who
    # is drained for whom and why.
    assert res.notes["w2"].endswith(
        "; fair share: draining w1 11111111 (serving 1h00m, past its 10m00s turn; "
        "1 request(s) in flight finish first)"
    )
    assert "fair share: draining w1 11111111" in submit.placement
    assert submit.attrs["fair_share.drained"] == "w1 11111111"
    assert res.notes["w1"] == "11111111 draining: " + drain.reason
    assert res.nodes_decide


def test_a_replica_within_its_turn_is_not_drained(tmp_path: Path) -> None:
    ms = two(tmp_path)
    res = run(ms, [busy("11111111", "w1", 8 * MIN)], one_gpu(), {"w2": NOW - 30 * MIN})
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert res.notes["w2"].endswith(
        "fair share: w1 11111111 may be drained for w2 in 2m00s, when its 10m00s turn ends"
    )
    # Past it, it is.
    res = run(ms, [busy("11111111", "w1", 10 * MIN)], one_gpu(), {"w2": NOW - 30 * MIN})
    assert kinds(res)[0] == ("drain", "w1", "11111111")


def test_the_turn_is_the_longer_of_min_slice_and_min_lifetime(tmp_path: Path) -> None:
    ms = two(tmp_path)
    cfg = dataclasses.replace(CFG, min_slice=5 * MIN, min_lifetime=20 * MIN)
    res = run(ms, [busy("11111111", "w1", 19 * MIN)], one_gpu(), {"w2": NOW - 3600}, cfg)
    assert kinds(res) == [("submit", "w2", "00000001")]
    cfg = dataclasses.replace(CFG, min_slice=30 * MIN, min_lifetime=10 * MIN)
    res = run(ms, [busy("11111111", "w1", 29 * MIN)], one_gpu(), {"w2": NOW - 3600}, cfg)
    assert kinds(res) == [("submit", "w2", "00000001")]
    res = run(ms, [busy("11111111", "w1", 30 * MIN)], one_gpu(), {"w2": NOW - 3600}, cfg)
    assert kinds(res)[0] == ("drain", "w1", "11111111")


def test_a_min_model_is_never_drained_for_fair_share(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("w1", "{min: 1}") + entry("w2", LONG))
    res = run(ms, [busy("11111111", "w1", 5 * 3600)], one_gpu(), {"w2": NOW - 3600})
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert "fair share" not in res.notes["w2"]
    assert (
        fair_share_candidates("w2", NOW - 3600, [busy("11111111", "w1", 5 * 3600)], ms, CFG, NOW)
        == []
    )


def test_a_multi_node_replica_is_never_drained_for_fair_share(tmp_path: Path) -> None:
    ms = two(tmp_path)
    wide = busy("11111111", "w1", 3600, nodes=2, node_names=("n1", "n2"))
    res = run(
        ms, [wide], [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)], {"w2": NOW - 3600}
    )
    assert kinds(res) == [("submit", "w2", "00000001")]


def test_only_a_drain_that_makes_room_is_made(tmp_path: Path) -> None:
    # w1 holds an a100, w2 needs an h100: draining w1 would not help. h1 holds it.
    ms = models_of(
        tmp_path,
        entry("w1", LONG, "{gpus: 1, gpu_type: a100}")
        + entry("h1", LONG, "{gpus: 1, gpu_type: h100}")
        + entry("w2", LONG, "{gpus: 1, gpu_type: h100}"),
    )
    nodes = [node("a", gpus=1, used=1), node("h", gpus=1, used=1, gpu_type="h100")]
    w1 = busy("11111111", "w1", 5 * 3600, where="a")
    h1 = busy("22222222", "h1", 3600, where="h")
    res = run(ms, [w1], nodes, {"w2": NOW - 3600})
    assert kinds(res) == [("submit", "w2", "00000001")]
    res = run(ms, [w1, h1], nodes, {"w2": NOW - 3600})
    assert kinds(res)[0] == ("drain", "h1", "22222222")


def test_the_replica_furthest_beyond_its_share_goes_first(tmp_path: Path) -> None:
    # Beyond the 10-minute turn: w1 1 GPU x 50 min, w3 4 GPUs x 20 min (80 GPU-minutes).
    ms = two(tmp_path, entry("w3", LONG, "{gpus: 4}"))
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=4, used=4)]
    w1 = busy("11111111", "w1", 60 * MIN)
    w3 = busy("33333333", "w3", 30 * MIN, where="n2", gpus_per_node=4)
    got = fair_share_candidates("w2", NOW - 3600, [w1, w3], ms, CFG, NOW)
    assert [r.replica_id for r in got] == ["33333333", "11111111"]
    res = run(ms, [w1, w3], nodes, {"w2": NOW - 3600})
    assert kinds(res)[0] == ("drain", "w3", "33333333")


def test_a_replica_its_users_left_goes_before_one_in_use(tmp_path: Path) -> None:
    # w1 was last used before w2's request and is idle since, within the eviction grace
    # (rule 3 keeps it); w3 serves, and has held its GPU longer. Once w2 has waited
    # max_wait, w1 goes: that cuts no work, and costs only w1's paused user a start.
    ms = two(tmp_path, entry("w3", LONG))
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)]
    w1 = busy("11111111", "w1", 3600, in_flight=0, last_used=NOW - 200)
    w3 = busy("33333333", "w3", 2 * 3600, where="n2")
    got = fair_share_candidates("w2", NOW - 150, [w3, w1], ms, CFG, NOW)
    assert [r.replica_id for r in got] == ["11111111", "33333333"]
    res = run(ms, [w1, w3], nodes, {"w2": NOW - 150})
    assert kinds(res) == [("drain", "w1", "11111111"), ("submit", "w2", "00000001")]
    assert res.actions[0].reason == (
        "fair share: making room for w2 (waiting 2m30s, max_wait 2m00s); "
        "held 1 GPU(s) 1h00m, past its 10m00s turn, unused for 3m20s"
    )
    assert res.actions[0].attrs["idle_seconds"] == 200.0
    # Before max_wait, rule 3 leaves it in its grace, and the note says when it may go.
    res = run(ms, [w1, w3], nodes, {"w2": NOW - 100})
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert res.notes["w2"].endswith(
        "fair share: w1 11111111 may be drained for w2 in 20s, if w2 still waits then "
        "(max_wait 2m00s)"
    )
    # Used since w2 began waiting, w1 is in use too: w3, further beyond its share, goes.
    res = run(ms, [dataclasses.replace(w1, last_used=NOW - 100), w3], nodes, {"w2": NOW - 150})
    assert kinds(res)[0] == ("drain", "w3", "33333333")


def test_a_replica_nobody_reported_a_use_of_is_never_drained(tmp_path: Path) -> None:
    # After a daemon restart, unknown is not idle, nor in use: neither rule takes it.
    ms = two(tmp_path)
    w1 = busy("11111111", "w1", 3600, in_flight=0, last_used=None)
    res = run(ms, [w1], one_gpu(), {"w2": NOW - 3600})
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert "fair share" not in res.notes["w2"]
    assert fair_share_candidates("w2", NOW - 3600, [w1], ms, CFG, NOW) == []


def test_an_idle_replica_that_can_be_evicted_is_evicted_not_drained(tmp_path: Path) -> None:
    ms = two(tmp_path, entry("w3", LONG))
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)]
    idle = rv("33333333", "w3", R, last_used=NOW - 3600, node_names=("n2",))
    res = run(ms, [busy("11111111", "w1", 3600), idle], nodes, {"w2": NOW - 3600})
    assert kinds(res) == [("evict", "w3", "33333333"), ("submit", "w2", "00000001")]


def test_one_stop_a_pass_and_none_for_a_model_while_a_drain_for_it_goes_on(
    tmp_path: Path,
) -> None:
    ms = two(tmp_path, entry("w3", LONG), entry("w4", LONG))
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)]
    w1, w3 = busy("11111111", "w1", 3600), busy("33333333", "w3", 3600, where="n2")
    held = {"w2": NOW - 3600, "w4": NOW - 1800}
    res = run(ms, [w1, w3], nodes, held)
    # w2 waited longest: w1 drains for it; w4 waits for the next pass (one stop a pass).
    assert kinds(res) == [
        ("drain", "w1", "11111111"),
        ("submit", "w2", "00000001"),
        ("submit", "w4", "00000002"),
    ]
    assert res.notes["w4"].endswith(
        "waiting for a replica drained for fair share to give its GPUs back"
    )
    # Next pass: w1 still drains (its request still in flight). w2 waits for its GPUs and
    # stops nothing else; w4 has its own drain.
    draining = dataclasses.replace(
        w1, state=D, draining_since=NOW, drain_reason=res.actions[0].reason
    )
    queued = [
        rv("0000000a", "w2", P, reason="Resources"),
        rv("0000000b", "w4", P, reason="Resources"),
    ]
    res = run(ms, [draining, w3, *queued], nodes, held, now=NOW + 10)
    assert kinds(res) == [("drain", "w3", "33333333")]
    assert res.actions[0].reason.startswith("fair share: making room for w4 ")
    assert res.notes["w2"].endswith(
        "waiting for a replica drained for fair share to give its GPUs back"
    )
    # Its job being cancelled (drained) still holds the GPU: w2 still waits for it.
    stopping = dataclasses.replace(draining, state=X, stop_reason="drained (...)")
    w3_draining = dataclasses.replace(w3, state=D, drain_reason=res.actions[0].reason)
    res = run(ms, [stopping, w3_draining, *queued], nodes, held, now=NOW + 20)
    assert res.actions == []
    assert res.notes["w2"].endswith(
        "waiting for a replica drained for fair share to give its GPUs back"
    )
    assert res.notes["w4"].endswith(
        "waiting for a replica drained for fair share to give its GPUs back"
    )
    # An eviction's job being killed holds every model's stops back, as before.
    evicting = rv("55555555", "w3", X, stop_reason="evicted, idle 10m00s, to make room for w2")
    res = run(ms, [w1, evicting, queued[1]], nodes, {"w4": NOW - 1800}, now=NOW + 30)
    assert res.actions == []
    assert res.notes["w4"].endswith("waiting for an evicted replica to give its GPUs back")


def test_fair_share_off_or_evict_for_without_held_drains_nothing(tmp_path: Path) -> None:
    ms = two(tmp_path)
    reps = [busy("11111111", "w1", 3600)]
    res = run(ms, reps, one_gpu(), {"w2": NOW - 3600}, dataclasses.replace(CFG, fair_share=False))
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert "fair share" not in res.notes["w2"]
    never = models_of(tmp_path, entry("w1", LONG) + entry("w2", "{evict_for: []}"))
    res = run(never, reps, one_gpu(), {"w2": NOW - 3600})
    assert kinds(res) == [("submit", "w2", "00000001")]


def test_a_models_own_max_wait_wins(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("w1", LONG) + entry("w2", "{max_wait: 30m}"))
    reps = [busy("11111111", "w1", 3600)]
    res = run(ms, reps, one_gpu(), {"w2": NOW - 29 * MIN})
    assert kinds(res) == [("submit", "w2", "00000001")]
    assert res.notes["w2"].endswith("in 1m00s, if w2 still waits then (max_wait 30m00s)")
    res = run(ms, reps, one_gpu(), {"w2": NOW - 30 * MIN})
    assert kinds(res)[0] == ("drain", "w1", "11111111")


def test_a_queued_replica_that_fits_on_a_kept_listing_asks_for_fresh_nodes(
    tmp_path: Path,
) -> None:
    # The listing says the GPU is free, but w1 runs there: it may be stale, and on
    # nodes that say it does not fit, the pass would drain w1. Only a fresh one decides.
    ms = two(tmp_path)
    queued = rv("0000000a", "w2", P, reason="Resources")
    reps = [busy("11111111", "w1", 3600), queued]
    res = run(ms, reps, [node("n1", gpus=1, used=0)], {"w2": NOW - 3600})
    assert res.actions == [] and res.nodes_decide
    # Before max_wait it would not: the kept listing may plan.
    res = run(ms, reps, [node("n1", gpus=1, used=0)], {"w2": NOW - 60})
    assert res.actions == [] and not res.nodes_decide
