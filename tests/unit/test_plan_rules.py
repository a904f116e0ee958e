"""The plan's rules one at a time, each on a plan state built by hand.

test_plan.py checks what :func:`plan` returns as a whole; these check that each
rule function does its own part alone (and leaves the rest to the others), so
that a change to one rule is tested where it is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from test_plan import CFG, NOW, P, R, S, X, entry, ids, models_of, node, rv  # type: ignore[import-not-found]

from llmgw_slurm.catalog import EvictFor, Model
from llmgw_slurm.reconciler.plan import (
    ActionKind,
    Failures,
    ReplicaView,
    _backoff,
    _evict,
    _model_view,
    _PlanState,
    _renew,
    _replica_rules,
    _scale_down,
    _scale_up,
)
from llmgw_slurm.slurm.types import NodeInfo


def state(
    models: Mapping[str, Model],
    replicas: Sequence[ReplicaView] = (),
    nodes: Sequence[NodeInfo] = (),
    failures: Mapping[str, Failures] | None = None,
) -> _PlanState:
    st = _PlanState(models, replicas, nodes, {}, failures or {}, CFG, NOW, ids())
    st.start_models()
    return st


def evict(st: _PlanState, m: Model, why: str, purpose: EvictFor) -> str:
    """_evict on the plan's one cluster; its note."""
    note, _ = _evict(st, st.sites[0], m, why, purpose)
    return note


def test_replica_rules_act_once_per_replica_the_first_rule_winning(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    # Failed (rule: start failed) and also past its start deadline (rule: timed out).
    r = rv("a", "m", S, agent_failed="engine exited 1", started_at=NOW - 100_000.0)
    st = _PlanState(ms, [r], [], {}, {}, CFG, NOW, ids())
    _replica_rules(st, r)
    (a,) = st.out.actions
    assert (a.kind, a.reason, a.failure) == (
        ActionKind.CANCEL,
        "start failed: engine exited 1",
        True,
    )
    assert st.stopping == {"a"}


def test_replica_rules_leave_a_stopping_replica_alone(tmp_path: Path) -> None:
    r = rv("a", "gone", X, stop_reason="stopped by an admin")
    st = _PlanState({}, [r], [], {}, {}, CFG, NOW, ids())
    _replica_rules(st, r)
    assert st.out.actions == [] and st.stopping == set()


def test_renew_submits_a_replacement_and_drains_the_old_once_it_is_ready(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1, max: 1}"))
    old = rv("a", "m", R, time_left_s=60)
    st = state(ms, [old], [node()])
    _renew(st, _model_view(st, ms["m"]))
    (sub,) = st.out.actions
    assert (sub.kind, sub.replaces) == (ActionKind.SUBMIT, "a")
    # A pass later the replacement is ready: the old one is drained, nothing submitted.
    new = rv("b", "m", R, replaces="a")
    st = state(ms, [old, new], [node()])
    _renew(st, _model_view(st, ms["m"]))
    (drain,) = st.out.actions
    assert (drain.kind, drain.replica_id, drain.reason) == (ActionKind.DRAIN, "a", "renewed by b")


def test_backoff_counts_a_start_that_failed_in_this_plan(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1, max: 1}"))
    r = rv("a", "m", S, agent_failed="engine exited 1")
    st = state(ms, [r])
    _replica_rules(st, r)
    mv = _model_view(st, ms["m"])
    assert _backoff(st, mv) is True
    assert st.out.notes["m"].startswith("backoff: 1 failed start(s), next try in 30s")
    # No failure at all: no backoff, and scale-up is left to submit.
    st = state(ms)
    mv = _model_view(st, ms["m"])
    assert _backoff(st, mv) is False
    _scale_up(st, mv)
    assert [a.kind for a in st.out.actions] == [ActionKind.SUBMIT]


def test_scale_down_cancels_pending_first_and_drains_at_most_one_idle(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 0, max: 4, idle_timeout: 60s}"))
    reps = [
        rv("p", "m", P),
        rv("a", "m", R, last_used=NOW - 600.0),
        rv("b", "m", R, last_used=NOW - 900.0),
    ]
    st = state(ms, reps)
    _scale_down(st, _model_view(st, ms["m"]))
    assert [(a.kind, a.replica_id) for a in st.out.actions] == [
        (ActionKind.CANCEL, "p"),
        (ActionKind.DRAIN, "b"),  # the longest idle, and only one a pass
    ]


def test_evict_stops_one_replica_a_plan(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("big", resources="{gpus: 4}") + entry("x", "{min: 0}") + entry("y", "{min: 0}"),
    )
    idle = {"last_used": NOW - 3_600.0, "gpus_per_node": 4}
    reps = [
        rv("a", "x", R, node_names=("n1",), **idle),
        rv("b", "y", R, node_names=("n2",), **idle),
    ]
    nodes = [node("n1", gpus=4, used=4), node("n2", gpus=4, used=4)]
    st = state(ms, reps, nodes)
    note = evict(st, ms["big"], "needs 4 gpus", "held")
    (ev,) = st.out.actions
    assert (ev.kind, ev.replica_id, ev.attrs["for"]) == (ActionKind.EVICT, "a", "big")
    assert note == "evicting x replica a (idle 1h00m)" and st.out.nodes_decide
    # A second model short of room in the same plan waits for the GPUs to come back.
    assert (
        evict(st, ms["big"], "", "held") == "waiting for an evicted replica to give its GPUs back"
    )
    assert len(st.out.actions) == 1


def test_evict_waits_while_an_earlier_eviction_is_being_killed(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("big", resources="{gpus: 4}") + entry("x", "{min: 0}"))
    reps = [
        rv("a", "x", R, last_used=NOW - 3_600.0),
        rv("z", "x", X, stop_reason="evicted, idle 1h00m, to make room for big"),
    ]
    st = state(ms, reps)
    assert st.sites[0].eviction_in_progress
    assert (
        evict(st, ms["big"], "", "held") == "waiting for an evicted replica to give its GPUs back"
    )
    assert st.out.actions == []


def test_evict_with_nothing_to_stop_says_what_keeps_each_replica(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("big", resources="{gpus: 4}") + entry("x", "{min: 1}"))
    st = state(ms, [rv("a", "x", R)])
    assert evict(st, ms["big"], "", "held") == "nothing idle enough to stop (x a: min 1)"
    assert st.out.actions == [] and not st.sites[0].evicted


def test_evict_only_for_the_starts_the_model_allows(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("big", "{evict_for: [held, min]}", "{gpus: 4}") + entry("x", "{min: 0}"),
    )
    reps = [rv("a", "x", R, last_used=NOW - 3_600.0, node_names=("n1",), gpus_per_node=4)]
    st = state(ms, reps, [node("n1", gpus=4, used=4)])
    assert evict(st, ms["big"], "", "load") == (
        "a load scale-up queues in Slurm (scaling.evict_for: held, min)"
    )
    assert evict(st, ms["big"], "", "renewal").startswith("a renewal queues in Slurm")
    assert st.out.actions == []
    assert evict(st, ms["big"], "", "min") == "evicting x replica a (idle 1h00m)"
