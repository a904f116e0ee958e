"""The reconcile plan: every rule of llmgw_slurm.reconciler.plan with a fake clock.

``now`` is a plain number; models come from a catalog file written to tmp_path,
nodes are NodeInfo values, replicas ReplicaView values. Each test asserts the
exact actions (kind, model, replica id, reason) the plan returns.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from llmgw_slurm.catalog import Model, load_catalog
from llmgw_slurm.reconciler.plan import (
    Action,
    ActionKind,
    Failures,
    PlanConfig,
    PlanResult,
    ReplicaState,
    ReplicaView,
    evictable,
    fits,
    plan,
)
from llmgw_slurm.slurm.types import GpuCount, NodeInfo

NOW = 1_000_000.0
CFG = PlanConfig()

P = ReplicaState.PENDING
S = ReplicaState.STARTING
R = ReplicaState.READY
D = ReplicaState.DRAINING
X = ReplicaState.STOPPING


def models_of(tmp_path: Path, body: str) -> dict[str, Model]:
    """Models of a catalog whose ``models:`` list is ``body`` (one entry per model)."""
    p = tmp_path / "models.yaml"
    p.write_text("models:\n" + textwrap.indent(textwrap.dedent(body), "  "))
    return {m.name: m for m in load_catalog(p)}


def entry(name: str, scaling: str = "{}", resources: str = "{gpus: 1}", engine: str = "") -> str:
    eng = engine or "{kind: vllm}"
    return (
        f"- name: {name}\n  engine: {eng}\n  weights: {{source: /m/{name}}}\n"
        f"  resources: {resources}\n  scaling: {scaling}\n"
    )


def node(
    name: str = "n1",
    *,
    gpus: int = 4,
    used: int = 0,
    gpu_type: str = "a100",
    partitions: tuple[str, ...] = ("gpu",),
    state: str = "idle",
    cpus: int = 64,
    cpus_alloc: int = 0,
    more: tuple[GpuCount, ...] = (),
) -> NodeInfo:
    return NodeInfo(
        name=name,
        state=state,
        partitions=partitions,
        cpus_total=cpus,
        cpus_alloc=cpus_alloc,
        memory_mb=256_000,
        gpus=(GpuCount(gpu_type, gpus, used), *more),
    )


def rv(rid: str, model: str, state: ReplicaState, **kw: object) -> ReplicaView:
    """A replica; starting ones started just now, ready ones ready long ago and used just now.

    ``time_left_s`` (not a field) sets its job to end that long after NOW (None: no limit).
    """
    if "time_left_s" in kw:
        left = kw.pop("time_left_s")
        kw["ends_at"] = None if left is None else NOW + float(left)  # type: ignore[arg-type]
    defaults: dict[str, object] = {"job_id": f"j{rid}", "submitted_at": NOW - 10_000.0}
    if state is S:
        defaults["started_at"] = NOW - 10.0
    if state in (R, D):
        defaults["started_at"] = NOW - 9_000.0
    if state in (R, D):
        defaults["ready_at"] = NOW - 8_000.0
        defaults["last_used"] = NOW - 5.0
    defaults["gpus_per_node"] = 1
    defaults.update(kw)
    return ReplicaView(replica_id=rid, model=model, state=state, **defaults)  # type: ignore[arg-type]


def ids() -> Callable[[], str]:
    n = iter(range(1, 1000))
    return lambda: f"{next(n):08x}"


def run(
    models: Mapping[str, Model],
    replicas: Sequence[ReplicaView] = (),
    nodes: Sequence[NodeInfo] | None = None,
    wanted: Mapping[str, float] | None = None,
    failures: Mapping[str, Failures] | None = None,
    cfg: PlanConfig = CFG,
    now: float = NOW,
) -> PlanResult:
    return plan(
        models,
        replicas,
        [node()] if nodes is None else nodes,
        wanted or {},
        failures or {},
        cfg,
        now,
        ids(),
    )


def brief(res: PlanResult) -> list[tuple[str, str, str]]:
    """(kind, model, replica id) of every action, in order."""
    return [(a.kind.value, a.model, a.replica_id) for a in res.actions]


def only(res: PlanResult, kind: ActionKind) -> Action:
    acts = res.of(kind)
    assert len(acts) == 1, res.actions
    assert len(res.actions) == 1, res.actions
    return acts[0]


# ---------------------------------------------------------------- on demand


def test_on_demand_start_when_a_request_waits(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od"))
    res = run(ms, wanted={"od": NOW - 10})
    a = only(res, ActionKind.SUBMIT)
    assert (a.model, a.replica_id, a.replaces) == ("od", "00000001", "")
    assert a.reason == "scale up to 1: a request is waiting"
    assert a.placement == "n1"
    assert res.notes == {}


def test_no_start_when_the_request_is_stale(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od"))
    assert run(ms, wanted={"od": NOW - CFG.want_window}).actions == []
    assert run(ms, wanted={"od": NOW - CFG.want_window - 1}).actions == []
    assert run(ms).actions == []
    # Just inside the window it does start.
    assert brief(run(ms, wanted={"od": NOW - CFG.want_window + 1})) == [
        ("submit", "od", "00000001")
    ]


def test_a_longer_per_model_hold_keeps_the_request_waiting(tmp_path: Path) -> None:
    # The router holds requests for "big" an hour: past the server's window a
    # request may still be held, so its pending job stays and a start happens.
    long_hold = CFG.want_window * 12
    ms = models_of(tmp_path, entry("big", f"{{hold_timeout: {long_hold:g}}}"))
    assert ms["big"].scaling.hold_timeout == long_hold
    later = NOW - CFG.want_window - 1
    assert run(ms, [rv("aaaaaaaa", "big", P)], wanted={"big": later}).actions == []
    assert brief(run(ms, wanted={"big": later})) == [("submit", "big", "00000001")]
    # Past its own deadline nobody waits any more.
    stale = NOW - long_hold
    assert brief(run(ms, [rv("aaaaaaaa", "big", P)], wanted={"big": stale})) == [
        ("cancel", "big", "aaaaaaaa")
    ]
    assert run(ms, wanted={"big": stale}).actions == []


def test_a_shorter_per_model_hold_keeps_the_server_window(tmp_path: Path) -> None:
    # Its requests got their 503 already, but a client retrying after
    # Retry-After should find the job still queued, not resubmitted.
    ms = models_of(tmp_path, entry("quick", "{hold_timeout: 10s}"))
    later = NOW - 60
    assert run(ms, [rv("aaaaaaaa", "quick", P)], wanted={"quick": later}).actions == []
    stale = NOW - CFG.want_window
    assert brief(run(ms, [rv("aaaaaaaa", "quick", P)], wanted={"quick": stale})) == [
        ("cancel", "quick", "aaaaaaaa")
    ]


def test_a_waiting_request_with_a_pending_replica_submits_no_second(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od", "{max: 3}"))
    res = run(ms, [rv("aaaaaaaa", "od", P)], wanted={"od": NOW - 1})
    assert res.actions == []


def test_a_waiting_request_does_not_count_once_a_replica_is_ready(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od", "{max: 3}"))
    res = run(ms, [rv("aaaaaaaa", "od", R)], wanted={"od": NOW - 1})
    assert res.actions == []


# ---------------------------------------------------------------- min / max / demand


def test_min_replicas_are_kept(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 2, max: 3}"))
    res = run(ms, [rv("aaaaaaaa", "m", R)])
    a = only(res, ActionKind.SUBMIT)
    assert a.model == "m" and a.reason == "scale up to 2: below min 2"
    res = run(ms)
    assert brief(res) == [("submit", "m", "00000001"), ("submit", "m", "00000002")]
    # Two GPUs on one node: both placements count the first one's GPU.
    assert [a.placement for a in res.actions] == ["n1", "n1"]


def test_min_satisfied_submits_nothing(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 2, max: 3}"))
    assert run(ms, [rv("aaaaaaaa", "m", R), rv("bbbbbbbb", "m", S)]).actions == []


def test_scale_up_from_in_flight_against_target(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{max: 4, target_inflight: 10}"))
    reps = [rv("aaaaaaaa", "m", R, in_flight=15), rv("bbbbbbbb", "m", R, in_flight=10)]
    a = only(run(ms, reps), ActionKind.SUBMIT)
    assert a.reason == "scale up to 3: 25 in flight, target 10 per replica"
    # Exactly at the target: no new replica.
    reps = [rv("aaaaaaaa", "m", R, in_flight=10), rv("bbbbbbbb", "m", R, in_flight=10)]
    assert run(ms, reps).actions == []


def test_max_is_respected(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{max: 2, target_inflight: 16}"))
    res = run(ms, [rv("aaaaaaaa", "m", R, in_flight=100)])
    a = only(res, ActionKind.SUBMIT)
    assert a.reason.startswith("scale up to 2:")
    reps = [rv("aaaaaaaa", "m", R, in_flight=100), rv("bbbbbbbb", "m", R, in_flight=100)]
    assert run(ms, reps).actions == []


def test_above_max_drains_one_even_before_idle_timeout(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{max: 1, idle_timeout: 1h}"))
    reps = [
        rv("aaaaaaaa", "m", R, last_used=NOW - 20),
        rv("bbbbbbbb", "m", R, last_used=NOW - 10),
    ]
    a = only(run(ms, reps), ActionKind.DRAIN)
    assert (a.replica_id, a.job_id) == ("aaaaaaaa", "jaaaaaaaa")
    assert a.reason == "scale down: idle 20s"


# ---------------------------------------------------------------- idle scale-down


def test_idle_scale_down_after_idle_timeout(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{max: 2, idle_timeout: 10m}"))
    reps = [
        rv("aaaaaaaa", "m", R, last_used=NOW - 700),
        rv("bbbbbbbb", "m", R, last_used=NOW - 100),
    ]
    a = only(run(ms, reps), ActionKind.DRAIN)
    assert (a.model, a.replica_id) == ("m", "aaaaaaaa")
    assert a.reason == "scale down: idle 11m40s"
    assert a.attrs["idle_seconds"] == 700


def test_no_idle_scale_down_before_idle_timeout(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{max: 2, idle_timeout: 10m}"))
    reps = [rv("aaaaaaaa", "m", R, last_used=NOW - 599)]
    assert run(ms, reps).actions == []
    reps = [rv("aaaaaaaa", "m", R, last_used=NOW - 600)]
    assert brief(run(ms, reps)) == [("drain", "m", "aaaaaaaa")]


def test_idle_with_requests_in_flight_is_not_drained(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{max: 2, idle_timeout: 10m, target_inflight: 10}"))
    reps = [rv("aaaaaaaa", "m", R, last_used=NOW - 5000, in_flight=1)]
    assert run(ms, reps).actions == []


def test_unknown_last_use_counts_idle_from_ready(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{idle_timeout: 10m}"))
    fresh = rv("aaaaaaaa", "m", R, last_used=None, ready_at=NOW - 100)
    assert run(ms, [fresh]).actions == []
    old = rv("aaaaaaaa", "m", R, last_used=None, ready_at=NOW - 601)
    assert only(run(ms, [old]), ActionKind.DRAIN).reason == "scale down: idle 10m01s"


def test_idle_scale_down_never_below_min(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1, max: 3, idle_timeout: 10m}"))
    assert run(ms, [rv("aaaaaaaa", "m", R, last_used=NOW - 99_999)]).actions == []
    reps = [
        rv("aaaaaaaa", "m", R, last_used=NOW - 5000),
        rv("bbbbbbbb", "m", R, last_used=NOW - 9000),
    ]
    assert brief(run(ms, reps)) == [("drain", "m", "bbbbbbbb")]


def test_idle_scale_down_is_one_per_model_per_pass(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path, entry("m", "{max: 3, idle_timeout: 10m}") + entry("k", "{idle_timeout: 10m}")
    )
    reps = [
        rv("aaaaaaaa", "m", R, last_used=NOW - 5000),
        rv("bbbbbbbb", "m", R, last_used=NOW - 9000),
        rv("cccccccc", "m", R, last_used=NOW - 7000),
        rv("dddddddd", "k", R, last_used=NOW - 7000),
    ]
    # The longest idle of m, and k's own: one per model.
    assert brief(run(ms, reps)) == [("drain", "m", "bbbbbbbb"), ("drain", "k", "dddddddd")]


# ---------------------------------------------------------------- pending nobody waits for


def test_pending_replica_nobody_waits_for_is_cancelled(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od"))
    res = run(ms, [rv("aaaaaaaa", "od", P)], wanted={"od": NOW - 10_000})
    a = only(res, ActionKind.CANCEL)
    assert (a.model, a.replica_id, a.job_id) == ("od", "aaaaaaaa", "jaaaaaaaa")
    assert a.reason == "scale down: not needed (nobody waiting)"
    assert a.failure is False


def test_surplus_pending_replicas_go_newest_first(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1, max: 3}"))
    reps = [
        rv("aaaaaaaa", "m", P, submitted_at=NOW - 300),
        rv("bbbbbbbb", "m", P, submitted_at=NOW - 100),
        rv("cccccccc", "m", P, submitted_at=NOW - 200),
    ]
    assert brief(run(ms, reps)) == [("cancel", "m", "bbbbbbbb"), ("cancel", "m", "cccccccc")]


def test_starting_replica_nobody_waits_for_is_left_to_start(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od"))
    assert run(ms, [rv("aaaaaaaa", "od", S, started_at=NOW - 5)]).actions == []


# ---------------------------------------------------------------- drain


def test_drain_completes_when_nothing_is_in_flight(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    r = rv("aaaaaaaa", "m", D, draining_since=NOW - 5, drain_reason="renewed by bbbbbbbb")
    a = only(run(ms, [r]), ActionKind.CANCEL)
    assert (a.replica_id, a.job_id) == ("aaaaaaaa", "jaaaaaaaa")
    assert a.reason == "drained (renewed by bbbbbbbb)"
    assert a.failure is False


def test_drain_waits_for_in_flight_requests_until_drain_timeout(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    r = rv("aaaaaaaa", "m", D, in_flight=3, draining_since=NOW - 120, drain_reason="idle")
    assert run(ms, [r]).actions == []
    r = dataclasses.replace(r, draining_since=NOW - 121)
    a = only(run(ms, [r]), ActionKind.CANCEL)
    assert a.replica_id == "aaaaaaaa"
    assert a.reason == "drain timed out with 3 request(s) in flight (idle)"
    assert a.attrs["in_flight"] == 3


def test_stopping_replicas_get_no_action(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    r = rv("aaaaaaaa", "m", X, agent_failed="boom", stop_reason="drained (idle)")
    res = run(ms, [r])
    # It does not count toward min either.
    assert brief(res) == [("submit", "m", "00000001")]


# ---------------------------------------------------------------- failed starts


@pytest.mark.parametrize("state", [S, R, P])
def test_agent_failure_cancels_as_a_failed_start(tmp_path: Path, state: ReplicaState) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    res = run(ms, [rv("aaaaaaaa", "m", state, agent_failed="engine exited 1")])
    c = res.of(ActionKind.CANCEL)
    assert [(a.replica_id, a.failure, a.reason) for a in c] == [
        ("aaaaaaaa", True, "start failed: engine exited 1")
    ]
    # The failed one no longer counts, but its failure starts the backoff at once:
    # no replacement in the same pass (found on the real cluster).
    assert brief(res)[1:] == []
    assert res.notes["m"].startswith("backoff: 1 failed start(s), next try in 30s")


def test_agent_failure_while_draining_finishes_the_drain(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    r = rv("aaaaaaaa", "m", D, agent_failed="engine exited 1", drain_reason="idle")
    a = only(run(ms, [r]), ActionKind.CANCEL)
    assert a.failure is False and a.reason == "drained (idle)"


def test_start_timeout(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    ok = rv("aaaaaaaa", "m", S, started_at=NOW - CFG.start_timeout)
    assert run(ms, [ok]).actions == []
    late = rv("aaaaaaaa", "m", S, started_at=NOW - 1021)
    a = only(run(ms, [late]), ActionKind.CANCEL)
    assert a.failure is True
    assert a.reason == "not ready 17m01s after the job started"


def test_start_timeout_follows_the_models_ready_timeout(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", engine="{kind: vllm, ready_timeout: 60}"))
    assert run(ms, [rv("aaaaaaaa", "m", S, started_at=NOW - 180)]).actions == []
    a = only(run(ms, [rv("aaaaaaaa", "m", S, started_at=NOW - 181)]), ActionKind.CANCEL)
    assert a.failure is True and a.reason == "not ready 3m01s after the job started"


def test_max_pending_time(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    cfg = PlanConfig(max_pending_time=600)
    old = rv("aaaaaaaa", "m", P, submitted_at=NOW - 601, reason="Resources")
    res = run(ms, [old], cfg=cfg)
    a = res.of(ActionKind.CANCEL)[0]
    assert (a.replica_id, a.failure) == ("aaaaaaaa", False)
    assert a.reason == "pending for 10m01s (Resources)"
    no_reason = dataclasses.replace(old, reason="")
    assert run(ms, [no_reason], cfg=cfg).of(ActionKind.CANCEL)[0].reason == (
        "pending for 10m01s (no reason given)"
    )
    young = dataclasses.replace(old, submitted_at=NOW - 600)
    assert run(ms, [young], cfg=cfg).of(ActionKind.CANCEL) == []
    # Without a limit a job may pend for ever.
    assert run(ms, [old]).of(ActionKind.CANCEL) == []


# ---------------------------------------------------------------- restart backoff


@pytest.mark.parametrize(
    ("count", "wait"),
    [(1, 30.0), (2, 60.0), (3, 120.0), (4, 240.0)],
)
def test_backoff_is_exponential(tmp_path: Path, count: int, wait: float) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    blocked = {"m": Failures(count, NOW - wait + 1, "engine exited 1")}
    res = run(ms, failures=blocked)
    assert res.actions == []
    assert res.notes["m"] == (
        f"backoff: {count} failed start(s), next try in 1s; last: engine exited 1"
    )
    free = {"m": Failures(count, NOW - wait, "engine exited 1")}
    assert brief(run(ms, failures=free)) == [("submit", "m", "00000001")]


def test_backoff_is_capped(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    cfg = PlanConfig(backoff_max=100.0)
    # 30 * 2**3 = 240 uncapped; the cap makes it 100.
    res = run(ms, failures={"m": Failures(4, NOW - 99, "oom")}, cfg=cfg)
    assert res.actions == [] and "next try in 1s" in res.notes["m"]
    res = run(ms, failures={"m": Failures(4, NOW - 100, "oom")}, cfg=cfg)
    assert brief(res) == [("submit", "m", "00000001")]


def test_backoff_says_failing_after_give_up_after(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    res = run(ms, failures={"m": Failures(5, NOW - 60, "weights missing")})
    assert res.actions == []
    assert res.notes["m"] == (
        "failing: 5 failed start(s), next try in 29m00s; last: weights missing"
    )
    res = run(ms, failures={"m": Failures(4, NOW - 60, "weights missing")})
    assert res.notes["m"].startswith("backoff: 4 failed start(s), next try in 3m00s")
    # Still retried, at the slowest pace.
    assert brief(run(ms, failures={"m": Failures(9, NOW - 1800, "x")})) == [
        ("submit", "m", "00000001")
    ]


def test_backoff_also_blocks_on_demand_starts(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("od"))
    res = run(ms, wanted={"od": NOW - 1}, failures={"od": Failures(1, NOW - 1, "boom")})
    assert res.actions == [] and res.notes["od"].startswith("backoff: 1 failed start(s)")


def test_zero_failures_is_no_backoff(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    assert brief(run(ms, failures={"m": Failures(0, NOW, "")})) == [("submit", "m", "00000001")]


# ---------------------------------------------------------------- renewal


def test_renewal_submits_a_replacement_before_the_time_limit(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    old = rv("aaaaaaaa", "m", R, time_left_s=1000.0)
    a = only(run(ms, [old]), ActionKind.SUBMIT)
    assert (a.model, a.replica_id, a.replaces) == ("m", "00000001", "aaaaaaaa")
    assert a.reason == "renewal: aaaaaaaa has 16m40s left"


def test_no_renewal_with_time_enough_or_no_limit(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    assert run(ms, [rv("aaaaaaaa", "m", R, time_left_s=CFG.renewal_margin)]).actions == []
    assert run(ms, [rv("aaaaaaaa", "m", R, time_left_s=None)]).actions == []


@pytest.mark.parametrize("state", [P, S])
def test_renewal_never_submits_two_replacements(tmp_path: Path, state: ReplicaState) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    reps = [
        rv("aaaaaaaa", "m", R, time_left_s=600.0),
        rv("bbbbbbbb", "m", state, replaces="aaaaaaaa", started_at=NOW - 10),
    ]
    assert run(ms, reps).actions == []


def test_renewal_of_each_expiring_replica(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 2, max: 2}"))
    reps = [
        rv("aaaaaaaa", "m", R, time_left_s=600.0),
        rv("bbbbbbbb", "m", R, time_left_s=700.0),
    ]
    res = run(ms, reps)
    assert [(a.kind, a.replaces) for a in res.actions] == [
        (ActionKind.SUBMIT, "aaaaaaaa"),
        (ActionKind.SUBMIT, "bbbbbbbb"),
    ]


def test_failed_replacement_is_submitted_again(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    reps = [
        rv("aaaaaaaa", "m", R, time_left_s=600.0),
        rv("bbbbbbbb", "m", S, replaces="aaaaaaaa", agent_failed="oom"),
    ]
    res = run(ms, reps)
    assert [(a.kind, a.replica_id, a.replaces) for a in res.actions] == [
        (ActionKind.CANCEL, "bbbbbbbb", ""),
        (ActionKind.SUBMIT, "00000001", "aaaaaaaa"),
    ]


def test_renewal_drains_the_old_one_once_the_replacement_is_ready(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    reps = [
        rv("aaaaaaaa", "m", R, time_left_s=300.0),
        rv("bbbbbbbb", "m", R, replaces="aaaaaaaa", time_left_s=14_000.0),
    ]
    a = only(run(ms, reps), ActionKind.DRAIN)
    assert (a.model, a.replica_id, a.job_id) == ("m", "aaaaaaaa", "jaaaaaaaa")
    assert a.reason == "renewed by bbbbbbbb"


def test_renewal_handover_of_an_idle_on_demand_model_drains_once(tmp_path: Path) -> None:
    # The old replica is idle past idle_timeout too: it is drained once, for the
    # renewal, and the new one (just ready) is not drained in the same pass.
    ms = models_of(tmp_path, entry("od", "{idle_timeout: 10m}"))
    reps = [
        rv("aaaaaaaa", "od", R, time_left_s=300.0, last_used=NOW - 5000),
        rv("bbbbbbbb", "od", R, replaces="aaaaaaaa", ready_at=NOW - 5, last_used=None),
    ]
    a = only(run(ms, reps), ActionKind.DRAIN)
    assert (a.replica_id, a.reason) == ("aaaaaaaa", "renewed by bbbbbbbb")


def test_replacement_counts_once_its_old_replica_is_gone(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}"))
    reps = [
        rv("aaaaaaaa", "m", D, in_flight=2, draining_since=NOW - 5),
        rv("bbbbbbbb", "m", R, replaces="aaaaaaaa"),
    ]
    assert run(ms, reps).actions == []


def test_renewal_is_not_blocked_while_a_replacement_is_pending_for_another(
    tmp_path: Path,
) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 2, max: 2}"))
    reps = [
        rv("aaaaaaaa", "m", R, time_left_s=600.0),
        rv("bbbbbbbb", "m", R, time_left_s=600.0),
        rv("cccccccc", "m", P, replaces="aaaaaaaa"),
    ]
    res = run(ms, reps)
    assert [(a.kind, a.replaces) for a in res.actions] == [(ActionKind.SUBMIT, "bbbbbbbb")]


# ---------------------------------------------------------------- catalog changes


def test_model_removed_from_the_catalog(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("kept", "{min: 1}"))
    reps = [
        rv("kkkkkkkk", "kept", R),
        rv("aaaaaaaa", "gone", R),
        rv("bbbbbbbb", "gone", S, started_at=NOW - 10),
        rv("cccccccc", "gone", P),
        rv("dddddddd", "gone", D, in_flight=1, draining_since=NOW - 10),
    ]
    res = run(ms, reps)
    assert [(a.kind.value, a.replica_id, a.reason) for a in res.actions] == [
        ("drain", "aaaaaaaa", "model removed from the catalog"),
        ("cancel", "bbbbbbbb", "model removed from the catalog"),
        ("cancel", "cccccccc", "model removed from the catalog"),
    ]
    assert all(not a.failure for a in res.actions)


def test_removed_model_gets_one_action_per_replica(tmp_path: Path) -> None:
    # A replica of a removed model that would also time out, pend too long or
    # report a failure is still cancelled once, not once per rule.
    ms = models_of(tmp_path, entry("kept", "{min: 1}"))
    reps = [
        rv("kkkkkkkk", "kept", R),
        rv("aaaaaaaa", "gone", S, started_at=NOW - 99_999),
        rv("bbbbbbbb", "gone", P, submitted_at=NOW - 99_999),
        rv("cccccccc", "gone", S, agent_failed="oom"),
    ]
    res = run(ms, reps, cfg=PlanConfig(max_pending_time=60))
    assert [(a.kind.value, a.replica_id) for a in res.actions] == [
        ("cancel", "aaaaaaaa"),
        ("cancel", "bbbbbbbb"),
        ("cancel", "cccccccc"),
    ]
    assert {a.reason for a in res.actions} == {"model removed from the catalog"}


def test_removed_model_draining_replica_still_finishes(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("kept"))
    r = rv("aaaaaaaa", "gone", D, draining_since=NOW - 1, drain_reason="model removed")
    a = only(run(ms, [r]), ActionKind.CANCEL)
    assert (a.model, a.replica_id, a.reason) == ("gone", "aaaaaaaa", "drained (model removed)")


# ---------------------------------------------------------------- placement


def test_fits_partition(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("p", resources="{gpus: 1, partition: gpu}")
        + entry("q", resources="{gpus: 1, partition: 'big,gpu'}")
        + entry("d", resources="{gpus: 1}"),
    )
    nodes = [node("c1", partitions=("cpu",)), node("g1", partitions=("gpu", "all"))]
    assert fits(ms["p"], nodes, CFG, {}) == (True, "g1")
    assert fits(ms["q"], nodes, CFG, {}) == (True, "g1")
    assert fits(ms["p"], nodes[:1], CFG, {}) == (False, "no node in partition gpu")
    # No partition anywhere: every node is a candidate, first one wins.
    assert fits(ms["d"], nodes, CFG, {}) == (True, "c1")
    # The server's default partition applies when the model names none.
    assert fits(ms["d"], nodes, PlanConfig(default_partition="gpu"), {}) == (True, "g1")
    assert fits(ms["d"], nodes[:1], PlanConfig(default_partition="gpu"), {}) == (
        False,
        "no node in partition gpu",
    )


def test_fits_gpu_type(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("a", resources="{gpus: 2, gpu_type: a100}") + entry("any", resources="{gpus: 2}"),
    )
    v100 = node("v1", gpu_type="v100", gpus=4)
    mixed = node("m1", gpu_type="v100", gpus=1, more=(GpuCount("a100", 1, 0),))
    ok, why = fits(ms["a"], [v100, mixed], CFG, {})
    assert not ok
    assert why == "needs 1 node(s) with 2 free gpu:a100; v1: 0 gpu:a100 free; m1: 1 gpu:a100 free"
    # Untyped: any type counts, summed across types on one node.
    assert fits(ms["any"], [mixed], CFG, {}) == (True, "m1")
    a100 = node("a1", gpu_type="a100", gpus=2)
    assert fits(ms["a"], [v100, a100], CFG, {}) == (True, "a1")


def test_fits_skips_unusable_nodes(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    nodes = [
        node("d1", state="down*"),
        node("d2", state="drained"),
        node("d3", state="idle*"),
        node("ok", state="mixed"),
    ]
    assert fits(ms["m"], nodes, CFG, {}) == (True, "ok")
    ok, why = fits(ms["m"], nodes[:3], CFG, {})
    assert not ok
    assert why == "needs 1 node(s) with 1 free gpu; d1: down*; d2: drained; d3: idle*"


def test_fits_counts_cpus(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources="{gpus: 1, cpus: 8}"))
    assert fits(ms["m"], [node(cpus=64, cpus_alloc=56)], CFG, {}) == (True, "n1")
    ok, why = fits(ms["m"], [node(cpus=64, cpus_alloc=57)], CFG, {})
    assert not ok and why.endswith("; n1: 7 cpus free")


def test_fits_counts_used_gpus(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources="{gpus: 2}"))
    assert fits(ms["m"], [node(gpus=4, used=2)], CFG, {}) == (True, "n1")
    ok, why = fits(ms["m"], [node(gpus=4, used=3)], CFG, {})
    assert not ok
    assert why == "needs 1 node(s) with 2 free gpu; n1: 1 gpu free"


def test_fits_multi_node_needs_enough_nodes(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("big", resources="{gpus: 4, nodes: 3}"))
    nodes = [node("n1"), node("n2", used=1), node("n3"), node("n4")]
    assert fits(ms["big"], nodes, CFG, {}) == (True, "n1,n3,n4")
    ok, why = fits(ms["big"], nodes[:3], CFG, {})
    assert not ok
    assert why == "needs 3 node(s) with 4 free gpu; n2: 3 gpu free"


def test_fits_subtracts_gpus_taken_this_pass(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources="{gpus: 2}"))
    nodes = [node("n1", gpus=4), node("n2", gpus=4)]
    assert fits(ms["m"], nodes, CFG, {"n1": 3}) == (True, "n2")
    ok, why = fits(ms["m"], nodes, CFG, {"n1": 3, "n2": 4})
    assert not ok
    assert why == "needs 1 node(s) with 2 free gpu; n1: 1 gpu free; n2: 0 gpu free"


def test_fits_lists_at_most_eight_refusals(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m"))
    nodes = [node(f"n{i}", used=4) for i in range(10)]
    ok, why = fits(ms["m"], nodes, CFG, {})
    assert not ok and why.endswith("n7: 0 gpu free; ...") and "n8" not in why


def test_plan_places_later_submissions_on_gpus_not_yet_promised(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path, entry("a", "{min: 1}", "{gpus: 3}") + entry("b", "{min: 1}", "{gpus: 2}")
    )
    nodes = [node("n1", gpus=4), node("n2", gpus=4, used=1)]
    res = run(ms, nodes=nodes)
    assert [(a.model, a.placement) for a in res.actions] == [("a", "n1"), ("b", "n2")]
    # Two of a take n1 and n2: b finds 1 GPU left on n1 and none on n2.
    ms = models_of(
        tmp_path, entry("a", "{min: 2, max: 2}", "{gpus: 3}") + entry("b", "{min: 1}", "{gpus: 2}")
    )
    res = run(ms, nodes=nodes)
    subs = res.of(ActionKind.SUBMIT)
    assert [(a.model, a.placement.split(":")[0]) for a in subs] == [
        ("a", "n1"),
        ("a", "n2"),
        ("b", "no room now"),
    ]
    assert res.notes["b"].startswith("no room: needs 1 node(s) with 2 free gpu; n1: 1 gpu free")


# ---------------------------------------------------------------- eviction: candidates


# The idle models keep their replicas for a day: only eviction stops them here.
LONG = "{idle_timeout: 1d}"


def _eviction_catalog(tmp_path: Path, *, kept: bool = False) -> dict[str, Model]:
    """``kept`` adds a min 1 model (give it a replica, or the plan submits one)."""
    return models_of(
        tmp_path,
        entry("want", resources="{gpus: 4}")
        + entry("od1", LONG)
        + entry("od2", LONG)
        + (entry("kept", "{min: 1}") if kept else "")
        + entry("wide", LONG, resources="{gpus: 4, nodes: 2}"),
    )


def idle_rv(rid: str, model: str, idle: float, **kw: object) -> ReplicaView:
    """A ready replica holding all four GPUs of full_node()'s n1: stopping it makes room."""
    placed: dict[str, object] = {"node_names": ("n1",), "gpus_per_node": 4}
    return rv(rid, model, R, last_used=NOW - idle, **{**placed, **kw})


def test_evictable_only_ready_replicas_of_on_demand_models(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path, kept=True)
    reps = [
        idle_rv("aaaaaaaa", "od1", 1000),
        idle_rv("bbbbbbbb", "kept", 5000),
        rv("cccccccc", "od2", S, last_used=NOW - 5000),
        rv("dddddddd", "od2", P, last_used=NOW - 5000),
        rv("eeeeeeee", "od2", D, last_used=NOW - 5000),
        rv("ffffffff", "od2", X, last_used=NOW - 5000),
        idle_rv("11111111", "removed", 5000),
    ]
    assert [r.replica_id for r in evictable("want", reps, ms, CFG, NOW)] == ["aaaaaaaa"]


def test_evictable_never_min_one_models(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path, kept=True)
    assert evictable("want", [idle_rv("aaaaaaaa", "kept", 99_999)], ms, CFG, NOW) == []


def test_evictable_never_multi_node(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    wide = idle_rv("aaaaaaaa", "wide", 99_999, nodes=2, gpus_per_node=4)
    assert evictable("want", [wide], ms, CFG, NOW) == []


def test_evictable_never_unknown_last_use(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    unknown = rv("aaaaaaaa", "od1", R, last_used=None, ready_at=NOW - 99_999)
    assert evictable("want", [unknown], ms, CFG, NOW) == []


def test_evictable_respects_eviction_grace(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    assert evictable("want", [idle_rv("aaaaaaaa", "od1", 299)], ms, CFG, NOW) == []
    assert len(evictable("want", [idle_rv("aaaaaaaa", "od1", 300)], ms, CFG, NOW)) == 1
    cfg = PlanConfig(eviction_grace=1000)
    assert evictable("want", [idle_rv("aaaaaaaa", "od1", 999)], ms, cfg, NOW) == []


def test_evictable_respects_min_lifetime(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    cfg = dataclasses.replace(CFG, min_lifetime=600.0)
    young = idle_rv("aaaaaaaa", "od1", 400, ready_at=NOW - 599)
    assert evictable("want", [young], ms, cfg, NOW) == []
    grown = idle_rv("aaaaaaaa", "od1", 400, ready_at=NOW - 600)
    assert evictable("want", [grown], ms, cfg, NOW) == [grown]


def test_evictable_skips_busy_and_own_model(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    busy = idle_rv("aaaaaaaa", "od1", 5000, in_flight=1)
    own = idle_rv("bbbbbbbb", "od2", 5000)
    assert evictable("od2", [busy, own], ms, CFG, NOW) == []


def test_evictable_longest_idle_first(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [
        idle_rv("aaaaaaaa", "od1", 1000),
        idle_rv("bbbbbbbb", "od2", 3000),
        idle_rv("cccccccc", "od1", 2000),
    ]
    assert [r.replica_id for r in evictable("want", reps, ms, CFG, NOW)] == [
        "bbbbbbbb",
        "cccccccc",
        "aaaaaaaa",
    ]


# ---------------------------------------------------------------- eviction: in the plan


def full_node() -> list[NodeInfo]:
    return [node("n1", gpus=4, used=4)]


def test_no_room_evicts_the_longest_idle_replica(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [idle_rv("aaaaaaaa", "od1", 1000), idle_rv("bbbbbbbb", "od2", 2000)]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("evict", "od2", "bbbbbbbb"), ("submit", "want", "00000001")]
    ev = res.of(ActionKind.EVICT)[0]
    assert ev.job_id == "jbbbbbbbb"
    assert ev.reason == "evicted, idle 33m20s, to make room for want"
    assert ev.attrs["for"] == "want" and ev.attrs["candidates"] == 2
    assert ev.attrs["idle_seconds"] == 2000 and ev.attrs["gpus"] == 4
    sub = res.of(ActionKind.SUBMIT)[0]
    assert sub.placement.startswith("no room now: needs 1 node(s) with 4 free gpu; n1: 0 gpu")
    assert sub.placement.endswith("evicting od2 replica bbbbbbbb (idle 33m20s)")
    assert res.notes["want"].startswith("no room: ")


def test_at_most_one_eviction_per_pass(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("want", resources="{gpus: 4}")
        + entry("want2", resources="{gpus: 4}")
        + entry("od1", LONG)
        + entry("od2", LONG),
    )
    reps = [idle_rv("aaaaaaaa", "od1", 1000), idle_rv("bbbbbbbb", "od2", 2000)]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1, "want2": NOW - 1})
    assert [a.replica_id for a in res.of(ActionKind.EVICT)] == ["bbbbbbbb"]
    assert res.notes["want2"].endswith("waiting for an evicted replica to give its GPUs back")


def test_no_eviction_while_an_earlier_one_is_stopping(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("99999999", "od2", X, stop_reason="evicted, idle 40m00s, to make room for want"),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("submit", "want", "00000001")]
    assert res.notes["want"].endswith("waiting for an evicted replica to give its GPUs back")
    # A replica stopping for another reason does not hold evictions back.
    other = dataclasses.replace(reps[0], stop_reason="drained (idle)")
    res = run(ms, [other, reps[1]], nodes=full_node(), wanted={"want": NOW - 1})
    assert [a.replica_id for a in res.of(ActionKind.EVICT)] == ["aaaaaaaa"]


def test_nothing_idle_enough_to_stop(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path, kept=True)
    reps = [
        idle_rv("aaaaaaaa", "od1", 10),  # within the grace
        idle_rv("bbbbbbbb", "kept", 99_999),  # min 1
        rv("cccccccc", "od2", R, last_used=None, ready_at=NOW - 700),  # unknown
    ]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("submit", "want", "00000001")]
    # Each ready replica of another model, with the rule that keeps it.
    kept = (
        "; nothing idle enough to stop (od1 aaaaaaaa: used 10s ago, grace 5m00s; "
        "kept bbbbbbbb: min 1; od2 cccccccc: last use unknown)"
    )
    # And when fair share could take od1 (its users left before want's request; want
    # has not waited max_wait yet).
    later = "; fair share: od1 aaaaaaaa may be drained for want in 1m59s, if want still "
    later += "waits then (max_wait 2m00s)"
    assert res.notes["want"].endswith(kept + later)
    assert res.of(ActionKind.SUBMIT)[0].placement.endswith(kept + later)


def test_no_eviction_when_the_new_replica_fits(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [idle_rv("aaaaaaaa", "od1", 5000)]
    res = run(ms, reps, nodes=[node("n1", gpus=8, used=4)], wanted={"want": NOW - 1})
    assert brief(res) == [("submit", "want", "00000001")]
    assert res.notes == {}


def test_pending_for_resources_triggers_eviction(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("evict", "od1", "aaaaaaaa")]
    assert res.of(ActionKind.EVICT)[0].reason == "evicted, idle 1h23m, to make room for want"
    assert res.notes["want"].startswith("queued (Resources): needs 1 node(s) with 4 free gpu")
    assert res.notes["want"].endswith("evicting od1 replica aaaaaaaa (idle 1h23m)")


def test_pending_for_resources_that_would_fit_now_only_says_queued(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=[node("n1", gpus=4)], wanted={"want": NOW - 1})
    assert res.actions == []
    assert res.notes == {"want": "queued (Resources)"}


def test_pending_for_other_reasons_does_not_evict(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("pppppppp", "want", P, reason="QOSMaxGRESPerUser", gpus_per_node=4),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert res.actions == [] and res.notes == {}


def test_cancelled_pending_replica_evicts_nothing(tmp_path: Path) -> None:
    # Nobody waits for it any more: it is cancelled, and no idle replica is
    # stopped to make room for a job that is going away.
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 10_000})
    assert [(a.kind, a.replica_id) for a in res.actions] == [(ActionKind.CANCEL, "pppppppp")]


def test_evicted_replica_gets_no_other_action(tmp_path: Path) -> None:
    # od1 comes after `want` in the catalog and is idle past its idle_timeout
    # and near its time limit: once evicted it is neither drained nor renewed.
    ms = models_of(
        tmp_path,
        entry("want", resources="{gpus: 4}") + entry("od1", "{idle_timeout: 10m}"),
    )
    reps = [idle_rv("aaaaaaaa", "od1", 5000, time_left_s=60.0)]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("evict", "od1", "aaaaaaaa"), ("submit", "want", "00000001")]


def test_replica_stopped_this_pass_is_not_evicted(tmp_path: Path) -> None:
    # Rule 1 cancels od1's replica (its agent reported a failure) before `want`
    # looks for room: `want` then finds nothing else to stop. (A replica that its
    # own model drains this pass cannot be one: a waiting model goes first.)
    ms = models_of(
        tmp_path,
        entry("od1", "{idle_timeout: 10m}") + entry("want", resources="{gpus: 4}"),
    )
    reps = [idle_rv("aaaaaaaa", "od1", 5000, agent_failed="engine exited 1")]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("cancel", "od1", "aaaaaaaa"), ("submit", "want", "00000001")]
    assert res.notes["want"].endswith(
        "nothing idle enough to stop (no other model has a replica ready and not already stopping)"
    )


def test_a_waiting_model_evicts_before_the_idle_model_drains_itself(tmp_path: Path) -> None:
    # od1 is listed first and idle past its idle_timeout, but `want` waits: it
    # goes first and its eviction takes od1's replica, which gets no drain.
    ms = models_of(
        tmp_path,
        entry("od1", "{idle_timeout: 10m}") + entry("want", resources="{gpus: 4}"),
    )
    reps = [idle_rv("aaaaaaaa", "od1", 5000)]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("evict", "od1", "aaaaaaaa"), ("submit", "want", "00000001")]


def test_multi_node_replica_is_never_evicted_in_the_plan(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    wide = idle_rv("aaaaaaaa", "wide", 50_000, nodes=2, gpus_per_node=4)
    res = run(ms, [wide], nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("submit", "want", "00000001")]
    assert res.notes["want"].endswith("nothing idle enough to stop (wide aaaaaaaa: 2 nodes)")


# ---------------------------------------------------------------- when the nodes decide
# The reconciler plans on its last node listing and lists the nodes afresh (and plans
# again) only when nodes_decide says that listing chose or could have chosen an action.


def test_nodes_do_not_decide_a_pass_that_only_keeps_or_cancels(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [idle_rv("aaaaaaaa", "od1", 5000), rv("pppppppp", "od2", P, reason="JobHeldUser")]
    res = run(ms, reps, nodes=full_node())
    assert [(a.kind, a.replica_id) for a in res.actions] == [(ActionKind.CANCEL, "pppppppp")]
    assert res.nodes_decide is False


def test_nodes_decide_a_submission_whether_it_fits_or_not(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    for nodes in ([node("n1", gpus=4)], full_node()):
        res = run(ms, [], nodes=nodes, wanted={"want": NOW - 1})
        assert brief(res) == [("submit", "want", "00000001")]
        assert res.nodes_decide is True


def test_nodes_decide_an_eviction_for_a_queued_replica(tmp_path: Path) -> None:
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=full_node(), wanted={"want": NOW - 1})
    assert brief(res) == [("evict", "od1", "aaaaaaaa")]
    assert res.nodes_decide is True


def test_nodes_decide_a_queued_replica_that_fits_while_it_could_evict(tmp_path: Path) -> None:
    # No action: but on nodes that say it does not fit, the plan would evict od1.
    ms = _eviction_catalog(tmp_path)
    reps = [
        rv("pppppppp", "want", P, reason="Resources", gpus_per_node=4),
        idle_rv("aaaaaaaa", "od1", 5000),
    ]
    res = run(ms, reps, nodes=[node("n1", gpus=4)], wanted={"want": NOW - 1})
    assert res.actions == [] and res.nodes_decide is True
    # Nothing it could evict (od1 idle only a minute): no node listing changes a thing.
    reps[1] = idle_rv("aaaaaaaa", "od1", 60)
    for nodes in ([node("n1", gpus=4)], full_node()):
        res = run(ms, reps, nodes=nodes, wanted={"want": NOW - 1})
        assert res.actions == [] and res.nodes_decide is False
