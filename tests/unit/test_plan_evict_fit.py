"""Eviction on a site with several GPU types, partitions and node sizes (issue 15).

The plan stops an idle replica only if that makes the waiting one fit, judged
from the node listing the placement uses; only for a start a held request
waits for (unless the model's ``scaling.evict_for`` says more); and the model
whose oldest held request has waited longest goes first. Same fake clock and
helpers as test_plan.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from test_plan import CFG, NOW, P, R, entry, models_of, node, rv  # type: ignore[import-not-found]

from llmgw_slurm.catalog import Model
from llmgw_slurm.reconciler.plan import (
    ActionKind,
    PlanConfig,
    PlanResult,
    ReplicaState,
    ReplicaView,
    fits,
    plan,
    satisfies,
)
from llmgw_slurm.slurm.types import GpuCount, NodeInfo

LONG = "{idle_timeout: 1d}"


def idle_on(
    rid: str, model: str, idle: float, where: str, gpus: int = 1, **kw: object
) -> ReplicaView:
    """A ready replica on node ``where``, last used ``idle`` seconds before NOW."""
    return rv(rid, model, R, last_used=NOW - idle, node_names=(where,), gpus_per_node=gpus, **kw)


def run(
    models: Mapping[str, Model],
    replicas: Sequence[ReplicaView],
    nodes: Sequence[NodeInfo],
    wanted: Mapping[str, float] | None = None,
    held: Mapping[str, float] | None = None,
    cfg: PlanConfig = CFG,
    now: float = NOW,
) -> PlanResult:
    n = iter(range(1, 1000))
    kw = {} if held is None else {"held_since": held}
    return plan(models, replicas, nodes, wanted or {}, {}, cfg, now, lambda: f"{next(n):08x}", **kw)


def evicted(res: PlanResult) -> list[str]:
    return [a.replica_id for a in res.of(ActionKind.EVICT)]


def site(tmp_path: Path, *extra: str) -> dict[str, Model]:
    """Idle on-demand models of each GPU type and partition, and the ``extra`` entries."""
    return models_of(
        tmp_path,
        entry("a100m", LONG, "{gpus: 1, gpu_type: a100}")
        + entry("h100m", LONG, "{gpus: 1, gpu_type: h100}")
        + entry("smallm", LONG, "{gpus: 1, partition: small}")
        + entry("anym", LONG)
        + "".join(extra),
    )


# ---------------------------------------------------------------- the first list


def test_an_h100_model_does_not_evict_an_a100_replica(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1, gpu_type: h100}"))
    nodes = [
        node("a1", gpus=1, used=1, gpu_type="a100"),
        node("h1", gpus=1, used=1, gpu_type="h100"),  # someone else's job
    ]
    res = run(ms, [idle_on("aaaaaaaa", "a100m", 5000, "a1")], nodes, {"want": NOW - 1})
    assert evicted(res) == []
    assert [a.kind for a in res.actions] == [ActionKind.SUBMIT]
    note = res.notes["want"]
    assert "1 idle replica(s) could be stopped, none makes room" in note
    assert "a100m aaaaaaaa on a1: gpu type a100, needs h100" in note
    assert note.endswith("nearest candidate: a100m aaaaaaaa")


def test_a_four_gpu_model_does_not_evict_a_one_gpu_replica_from_one_gpu_nodes(
    tmp_path: Path,
) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 4}"))
    nodes = [node(f"n{i}", gpus=1, used=1) for i in range(1, 5)]
    res = run(ms, [idle_on("aaaaaaaa", "anym", 5000, "n1")], nodes, {"want": NOW - 1})
    assert evicted(res) == []
    assert "anym aaaaaaaa on n1: 1 gpu free once stopped, needs 4" in res.notes["want"]


def test_a_model_in_partition_big_does_not_evict_a_replica_in_small(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1, partition: big}"))
    nodes = [
        node("b1", gpus=1, used=1, partitions=("big",)),
        node("s1", gpus=1, used=1, partitions=("small",)),
    ]
    res = run(ms, [idle_on("aaaaaaaa", "smallm", 5000, "s1")], nodes, {"want": NOW - 1})
    assert evicted(res) == []
    assert "smallm aaaaaaaa on s1: partition small, needs big" in res.notes["want"]


def _apply(
    res: PlanResult, reps: list[ReplicaView], nodes: list[NodeInfo]
) -> tuple[list[ReplicaView], list[NodeInfo]]:
    """The evicted replicas' jobs gone and their GPUs free again, as the next listing says."""
    gone = set(evicted(res))
    freed: dict[str, int] = {}
    for r in reps:
        if r.replica_id in gone:
            for n in r.node_names:
                freed[n] = freed.get(n, 0) + r.gpus_per_node
    nodes = [
        dataclasses.replace(
            n, gpus=tuple(GpuCount(g.type, g.total, g.used - freed.get(n.name, 0)) for g in n.gpus)
        )
        for n in nodes
    ]
    return [r for r in reps if r.replica_id not in gone], nodes


def test_passes_do_not_cancel_every_idle_replica_in_turn(tmp_path: Path) -> None:
    # Four 1-GPU nodes, each held by an idle replica; the waiting model needs 4 on one node.
    ms = site(tmp_path, entry("want", resources="{gpus: 4}"))
    nodes = [node(f"n{i}", gpus=1, used=1) for i in range(1, 5)]
    reps = [idle_on(f"{i:08d}", "anym", 5000 + i, f"n{i}") for i in range(1, 5)]
    pending = rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4)
    for _ in range(6):
        res = run(ms, [*reps, pending], nodes, {"want": NOW - 1})
        assert evicted(res) == []
        reps, nodes = _apply(res, reps, nodes)
    assert len(reps) == 4


def test_below_min_does_not_evict(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", "{min: 1}", "{gpus: 1}"))
    res = run(ms, [idle_on("aaaaaaaa", "anym", 5000, "n1")], [node("n1", gpus=1, used=1)])
    assert evicted(res) == []
    assert [a.kind for a in res.actions] == [ActionKind.SUBMIT]
    assert res.notes["want"].endswith("a scale-up to min queues in Slurm (scaling.evict_for: held)")


def test_a_renewal_does_not_evict(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", "{min: 1}", "{gpus: 1}"))
    reps = [
        idle_on("aaaaaaaa", "anym", 5000, "n1"),
        idle_on("rrrrrrrr", "want", 5, "n2", time_left_s=60.0),
    ]
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)]
    res = run(ms, reps, nodes)
    assert evicted(res) == []
    assert [(a.kind, a.replaces) for a in res.actions] == [(ActionKind.SUBMIT, "rrrrrrrr")]


def test_a_load_scale_up_does_not_evict(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", "{max: 2, target_inflight: 1}", "{gpus: 1}"))
    reps = [
        idle_on("aaaaaaaa", "anym", 5000, "n1"),
        idle_on("bbbbbbbb", "want", 0, "n2", in_flight=2),
    ]
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)]
    res = run(ms, reps, nodes, {"want": NOW - 1})
    assert evicted(res) == []
    assert [a.kind for a in res.actions] == [ActionKind.SUBMIT]


def test_the_longest_waiting_model_gets_the_eviction_not_the_first_listed(
    tmp_path: Path,
) -> None:
    ms = site(
        tmp_path, entry("first", resources="{gpus: 1}"), entry("second", resources="{gpus: 1}")
    )
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1")]
    wanted = {"first": NOW - 1, "second": NOW - 1}
    res = run(
        ms, reps, [node("n1", gpus=1, used=1)], wanted, {"first": NOW - 30, "second": NOW - 90}
    )
    assert [(a.kind.value, a.model) for a in res.actions] == [
        ("evict", "anym"),
        ("submit", "second"),
        ("submit", "first"),
    ]
    assert res.of(ActionKind.EVICT)[0].attrs["for"] == "second"


def test_a_model_whose_requests_were_served_is_not_restarted_to_evict_back(
    tmp_path: Path,
) -> None:
    # "back" was asked for 10 s ago; a replica served it and was then evicted for "anym",
    # whose replica is idle now. No request is held for "back": nothing is started for
    # it, and nothing evicted (it would only take turns, and serve nobody).
    ms = site(tmp_path, entry("back", resources="{gpus: 1}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1")]
    nodes = [node("n1", gpus=1, used=1)]
    res = run(ms, reps, nodes, {"back": NOW - 10}, held={})
    assert res.actions == [] and "back" not in res.notes
    # A request held for it again: started, and the idle replica makes room.
    res = run(ms, reps, nodes, {"back": NOW - 1}, held={"back": NOW - 1})
    assert evicted(res) == ["aaaaaaaa"] and res.of(ActionKind.SUBMIT)[0].model == "back"


def test_a_last_use_at_time_zero_is_idle_since_zero(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1}"))
    now = 10_000.0
    old = dataclasses.replace(
        idle_on("aaaaaaaa", "anym", 0, "n1"), last_used=0.0, ready_at=0.0, started_at=0.0
    )
    newer = dataclasses.replace(
        idle_on("bbbbbbbb", "a100m", 0, "n2"), last_used=5000.0, ready_at=0.0, started_at=0.0
    )
    nodes = [node("n1", gpus=1, used=1), node("n2", gpus=1, used=1)]
    res = run(ms, [newer, old], nodes, {"want": now - 1}, now=now)
    (ev,) = res.of(ActionKind.EVICT)
    assert ev.replica_id == "aaaaaaaa"
    assert ev.reason == "evicted, idle 2h46m, to make room for want"
    assert ev.attrs["idle_seconds"] == 10_000.0


# ---------------------------------------------------------------- which eviction helps


def test_the_longest_idle_of_the_replicas_that_make_room_goes(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1, gpu_type: a100}"))
    nodes = [
        node("a1", gpus=1, used=1, gpu_type="a100"),
        node("a2", gpus=1, used=1, gpu_type="a100"),
        node("h1", gpus=1, used=1, gpu_type="h100"),
    ]
    reps = [
        idle_on("hhhhhhhh", "h100m", 9000, "h1"),  # the longest idle, but an h100
        idle_on("aaaaaaaa", "a100m", 2000, "a1"),
        idle_on("bbbbbbbb", "anym", 4000, "a2"),  # no type of its own: holds a2's a100
    ]
    res = run(ms, reps, nodes, {"want": NOW - 1})
    (ev,) = res.of(ActionKind.EVICT)
    assert (ev.replica_id, ev.attrs["nodes"], ev.attrs["candidates"]) == ("bbbbbbbb", "a2", 3)


def test_stopping_counts_every_other_job_on_the_node(tmp_path: Path) -> None:
    # n1 has 4 GPUs: the idle replica holds 2, someone else's job the other 2.
    ms = site(tmp_path, entry("want", resources="{gpus: 4}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1", gpus=2)]
    res = run(ms, reps, [node("n1", gpus=4, used=4)], {"want": NOW - 1})
    assert evicted(res) == []
    assert "anym aaaaaaaa on n1: 2 gpu free once stopped, needs 4" in res.notes["want"]
    # Nobody else's job there: its 2 and the 2 free make 4.
    assert evicted(run(ms, reps, [node("n1", gpus=4, used=2)], {"want": NOW - 1})) == ["aaaaaaaa"]


def test_cpus_freed_count_and_cpus_held_by_others_do_not(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1, cpus: 8}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1")]  # anym: 1 gpu, 4 cpus (the default)
    # 2 GPUs, one free; 12 of 16 CPUs taken (4 of them by the idle replica).
    n1 = node("n1", gpus=2, used=1, cpus=16, cpus_alloc=12)
    assert evicted(run(ms, reps, [n1], {"want": NOW - 1})) == ["aaaaaaaa"]
    n1 = node("n1", gpus=2, used=1, cpus=16, cpus_alloc=16)
    res = run(ms, reps, [n1], {"want": NOW - 1})
    assert evicted(res) == []
    assert "anym aaaaaaaa on n1: 4 cpus free once stopped, needs 8" in res.notes["want"]


def test_features_decide_where_the_listing_has_them(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1, constraint: 'nvlink&ib'}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1")]
    plain = dataclasses.replace(node("n1", gpus=1, used=1), features=("nvlink",))
    res = run(ms, reps, [plain], {"want": NOW - 1})
    assert evicted(res) == []
    assert "anym aaaaaaaa on n1: features nvlink, needs nvlink&ib" in res.notes["want"]
    good = dataclasses.replace(plain, features=("ib", "nvlink"))
    assert evicted(run(ms, reps, [good], {"want": NOW - 1})) == ["aaaaaaaa"]
    # A listing without features (None) does not refuse on them.
    assert evicted(run(ms, reps, [node("n1", gpus=1, used=1)], {"want": NOW - 1})) == ["aaaaaaaa"]


@pytest.mark.parametrize(
    ("features", "constraint", "ok"),
    [
        (("a100",), "a100", True),
        (("a100",), "h100", False),
        (("a100", "ib"), "a100&ib", True),
        (("a100",), "a100&ib", False),
        (("h100",), "a100|h100", True),
        (("h100",), "a100,h100", True),
        (("h100", "ib"), "(a100|h100)&ib", True),
        (("h100",), "(a100|h100)&ib", False),
        (("ib", "a100"), "ib&(a100|h100)", True),
        (("a100",), "[a100|h100]*2", True),
        ((), "a100", False),
    ],
)
def test_satisfies_a_constraint(features: tuple[str, ...], constraint: str, ok: bool) -> None:
    assert satisfies(features, constraint) is ok


def test_a_node_down_or_drained_is_named(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1")]
    res = run(ms, reps, [node("n1", gpus=1, used=1, state="draining")], {"want": NOW - 1})
    assert evicted(res) == []
    assert "anym aaaaaaaa on n1: state draining" in res.notes["want"]


def test_a_multi_node_model_needs_enough_nodes_once_one_is_stopped(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 4, nodes: 2}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1", gpus=4)]
    free_n2 = [node("n1", gpus=4, used=4), node("n2", gpus=4, used=0)]
    assert evicted(run(ms, reps, free_n2, {"want": NOW - 1})) == ["aaaaaaaa"]
    full_n2 = [node("n1", gpus=4, used=4), node("n2", gpus=4, used=4)]
    res = run(ms, reps, full_n2, {"want": NOW - 1})
    assert evicted(res) == []
    assert "anym aaaaaaaa on n1: fits once stopped, but 2 such node(s) needed" in res.notes["want"]


def test_a_multi_node_model_evicts_across_passes_for_the_nodes_it_lacks(tmp_path: Path) -> None:
    # Every a100 node held by an idle replica, the h100 node by the longest idle one: a
    # 2-node a100 model needs two evictions, made one a pass, the longest idle first.
    ms = site(tmp_path, entry("want", resources="{gpus: 4, nodes: 2, gpu_type: a100}"))
    nodes = [
        node("n1", gpus=4, used=4),
        node("n2", gpus=4, used=4),
        node("h1", gpus=4, used=4, gpu_type="h100"),
    ]
    reps = [
        idle_on("aaaaaaaa", "a100m", 9000, "n1", gpus=4),
        idle_on("bbbbbbbb", "anym", 5000, "n2", gpus=4),
        idle_on("cccccccc", "h100m", 12000, "h1", gpus=4),
    ]
    res = run(ms, reps, nodes, {"want": NOW - 1})
    assert evicted(res) == ["aaaaaaaa"]
    (ev,) = res.of(ActionKind.EVICT)
    assert ev.attrs["evictions_needed"] == 2 and ev.attrs["fits_on"] == "n1"
    assert "(idle 2h30m; 1 of 2 evictions that make room)" in res.notes["want"]
    pending = rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4, nodes=2)
    reps, nodes = _apply(res, reps, nodes)
    # Still being killed: nothing more this pass.
    stopping = rv("aaaaaaaa", "a100m", ReplicaState.STOPPING, stop_reason="evicted, idle")
    assert evicted(run(ms, [*reps, stopping, pending], nodes, {"want": NOW - 1})) == []
    res = run(ms, [*reps, pending], nodes, {"want": NOW - 1})
    assert evicted(res) == ["bbbbbbbb"]
    assert res.of(ActionKind.EVICT)[0].attrs["evictions_needed"] == 1
    reps, nodes = _apply(res, reps, nodes)
    res = run(ms, [*reps, pending], nodes, {"want": NOW - 1})
    assert evicted(res) == [] and res.notes["want"] == "queued (Resources)"
    assert [r.replica_id for r in reps] == ["cccccccc"]


def test_a_multi_node_model_evicts_none_when_its_candidates_are_not_enough(
    tmp_path: Path,
) -> None:
    # Three nodes needed; two idle replicas on nodes that fit, the third node someone else's.
    ms = site(tmp_path, entry("want", resources="{gpus: 4, nodes: 3}"))
    nodes = [node(f"n{i}", gpus=4, used=4) for i in (1, 2, 3)]
    reps = [
        idle_on("aaaaaaaa", "anym", 9000, "n1", gpus=4),
        idle_on("bbbbbbbb", "anym", 5000, "n2", gpus=4),
    ]
    res = run(ms, reps, nodes, {"want": NOW - 1})
    assert evicted(res) == []
    assert "2 idle replica(s) could be stopped, none makes room" in res.notes["want"]


def test_the_nearest_candidate_is_the_one_leaving_most_room(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 4}"))
    nodes = [node("n1", gpus=4, used=4), node("n2", gpus=4, used=4)]
    reps = [
        idle_on("aaaaaaaa", "anym", 9000, "n1", gpus=1),
        idle_on("bbbbbbbb", "a100m", 5000, "n2", gpus=3),
    ]
    res = run(ms, reps, nodes, {"want": NOW - 1})
    assert evicted(res) == []
    assert res.notes["want"].startswith("no room: needs 1 node(s) with 4 free gpu; ")
    assert "2 idle replica(s) could be stopped, none makes room" in res.notes["want"]
    assert res.notes["want"].endswith("nearest candidate: a100m bbbbbbbb")


def test_a_queued_replica_waits_for_a_fitting_eviction_too(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", resources="{gpus: 1, gpu_type: h100}"))
    nodes = [
        node("a1", gpus=1, used=1, gpu_type="a100"),
        node("h1", gpus=1, used=1, gpu_type="h100"),
    ]
    pending = rv("pppppppp", "want", P, reason="Resources")
    reps = [idle_on("aaaaaaaa", "a100m", 9000, "a1"), pending]
    res = run(ms, reps, nodes, {"want": NOW - 1})
    assert res.actions == []
    assert res.notes["want"].startswith("queued (Resources): needs 1 node(s) with 1 free gpu:h100")
    reps.append(idle_on("hhhhhhhh", "h100m", 1000, "h1"))
    assert evicted(run(ms, reps, nodes, {"want": NOW - 1})) == ["hhhhhhhh"]


# ---------------------------------------------------------------- which starts evict


def test_evict_for_min_lets_a_scale_up_to_min_evict(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", "{min: 1, evict_for: [held, min]}", "{gpus: 1}"))
    res = run(ms, [idle_on("aaaaaaaa", "anym", 5000, "n1")], [node("n1", gpus=1, used=1)])
    assert evicted(res) == ["aaaaaaaa"]


def test_evict_for_empty_never_evicts_even_for_a_held_request(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", "{evict_for: []}", "{gpus: 1}"))
    res = run(
        ms,
        [idle_on("aaaaaaaa", "anym", 5000, "n1")],
        [node("n1", gpus=1, used=1)],
        {"want": NOW - 1},
    )
    assert evicted(res) == []
    assert res.notes["want"].endswith("an on-demand start queues in Slurm (scaling.evict_for: [])")


def test_a_queued_replica_of_a_min_model_does_not_evict(tmp_path: Path) -> None:
    ms = site(tmp_path, entry("want", "{min: 1}", "{gpus: 1}"))
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1"), rv("pppppppp", "want", P, reason="Resources")]
    res = run(ms, reps, [node("n1", gpus=1, used=1)])
    assert res.actions == [] and res.nodes_decide is False
    assert res.notes["want"].endswith("a scale-up to min queues in Slurm (scaling.evict_for: held)")


# ---------------------------------------------------------------- fair order over many passes


def _serve_in_turn(ms: Mapping[str, Model], wants_again: float) -> list[tuple[float, str, str]]:
    """One 1-GPU node, three on-demand models whose requests keep coming; a replica is
    ready (and used) as soon as its job starts. Returns (time, evicted for, evicted model)."""
    t, step = NOW, 60.0
    reps: list[ReplicaView] = []
    held: dict[str, float] = {name: t for name in ("w1", "w2", "w3")}
    gone_at: dict[str, float] = {}
    log: list[tuple[float, str, str]] = []
    n = iter(range(1, 10_000))
    for _ in range(400):
        for name, since in list(gone_at.items()):
            if t - since >= wants_again:  # evicted: its users ask again
                held[name] = t
                del gone_at[name]
        queued = [r for r in reps if r.state is P]
        if queued and not any(r.state is R for r in reps):
            first = min(queued, key=lambda r: r.submitted_at)  # Slurm: the oldest job first
            reps = [_start(r, t) if r is first else r for r in reps]
        wanted = {k: t for k in held}
        res = plan(
            ms,
            reps,
            [node("n1", gpus=1, used=sum(1 for r in reps if r.state is R))],
            wanted,
            {},
            CFG,
            t,
            lambda: f"{next(n):08x}",
            held_since=held,
        )
        for a in res.actions:
            if a.kind is ActionKind.EVICT:
                log.append((t, str(a.attrs["for"]), a.model))
                reps = [r for r in reps if r.replica_id != a.replica_id]
                gone_at[a.model] = t
            elif a.kind is ActionKind.CANCEL:
                reps = [r for r in reps if r.replica_id != a.replica_id]
            elif a.kind is ActionKind.SUBMIT:
                reps.append(rv(a.replica_id, a.model, P, reason="Resources", submitted_at=t))
        for r in reps:
            if r.state is R and r.model in held and r.ready_at == t:
                del held[r.model]
        t += step
    return log


def _start(r: ReplicaView, t: float) -> ReplicaView:
    return dataclasses.replace(
        r, state=R, started_at=t, ready_at=t, last_used=t, node_names=("n1",), reason=""
    )


def test_no_model_starves_while_others_keep_evicting(tmp_path: Path) -> None:
    ms = models_of(tmp_path, "".join(entry(f"w{i}", LONG) for i in (1, 2, 3)))
    log = _serve_in_turn(ms, wants_again=60.0)
    assert len(log) >= 12
    served = [f for _, f, _ in log]
    # Every model gets evictions all along, in turn: never twice in a row while another waits.
    for i in range(len(served) - 2):
        assert sorted(served[i : i + 3]) == ["w1", "w2", "w3"], served


def test_the_room_an_eviction_makes_is_promised_to_its_model(tmp_path: Path) -> None:
    # `wide` needs two 4-GPU nodes: n2 is free, n1 is held by an idle replica. Once
    # that is evicted for it, `later` (asked for after) must not take n2 as well.
    ms = site(
        tmp_path,
        entry("wide", resources="{gpus: 4, nodes: 2}"),
        entry("later", resources="{gpus: 4}"),
    )
    reps = [idle_on("aaaaaaaa", "anym", 5000, "n1", gpus=4)]
    nodes = [node("n1", gpus=4, used=4), node("n2", gpus=4, used=0)]
    held = {"wide": NOW - 60, "later": NOW - 30}
    res = run(ms, reps, nodes, {"wide": NOW - 1, "later": NOW - 1}, held)
    assert [(a.kind.value, a.model) for a in res.actions] == [
        ("evict", "anym"),
        ("submit", "wide"),
        ("submit", "later"),
    ]
    assert res.of(ActionKind.EVICT)[0].attrs["fits_on"] == "n1,n2"
    assert res.of(ActionKind.SUBMIT)[1].placement.startswith("no room now: ")


def test_memory_counts_where_the_listing_and_the_models_say(tmp_path: Path) -> None:
    ms = site(
        tmp_path,
        entry("want", resources="{gpus: 1, memory: 64G}"),
        entry("fat", LONG, "{gpus: 1, memory: 100G}"),
    )
    # 256,000 MB; all but 32,768 allocated; one GPU, held by the idle replica.
    n1 = dataclasses.replace(node("n1", gpus=1, used=1), memory_alloc_mb=256_000 - 32_768)
    fat = idle_on("ffffffff", "fat", 5000, "n1")  # frees its 102,400 MB
    assert evicted(run(ms, [fat], [n1], {"want": NOW - 1})) == ["ffffffff"]
    # anym sets no memory: what it frees is unknown, so memory decides nothing.
    anym = idle_on("aaaaaaaa", "anym", 5000, "n1")
    assert evicted(run(ms, [anym], [n1], {"want": NOW - 1})) == ["aaaaaaaa"]
    # Free GPUs but too little memory: no placement, and an eviction must free memory.
    n1 = dataclasses.replace(n1, gpus=(GpuCount("a100", 2, 1),))
    ok, why = fits(ms["want"], [n1], CFG, {})
    assert not ok and why.endswith("n1: 32768 MB memory free")
    tiny = models_of(tmp_path, entry("small", LONG, "{gpus: 1, memory: 1G}"))
    small = idle_on("ssssssss", "small", 5000, "n1")
    res = run({**ms, **tiny}, [small], [n1], {"want": NOW - 1})
    assert evicted(res) == []
    assert (
        "small ssssssss on n1: 33792 MB memory free once stopped, needs 65536 MB"
        in (res.notes["want"])
    )
