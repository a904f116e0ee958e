"""The plan's rules across several clusters, with a fake clock.

Two clusters as server.yaml would list them, ``a`` first (the site's preferred)
and ``b``: a node listing each, whether each answered this pass, whether it is
down. Each test asserts the exact actions and where they go.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from test_plan import CFG, NOW, D, P, R, S, X, entry, ids, models_of, node, rv  # type: ignore[import-not-found]

from llmgw_slurm.catalog import Model
from llmgw_slurm.reconciler.plan import (
    ActionKind,
    ClusterView,
    PlanConfig,
    PlanResult,
    ReplicaView,
    earliest_start,
    plan,
)
from llmgw_slurm.slurm.types import NodeInfo

A100 = "{gpus: 1, gpu_type: a100}"
L40S = "{gpus: 1, gpu_type: l40s}"


def site(
    a: Sequence[NodeInfo] | None = None,
    b: Sequence[NodeInfo] | None = None,
    *,
    answering: Sequence[str] = ("a", "b"),
    down: Sequence[str] = (),
) -> list[ClusterView]:
    """Cluster a (a100 nodes) and cluster b (an l40s node and an a100 one), by default empty."""
    a_nodes = [node("n1")] if a is None else a
    b_nodes = [node("n1", gpu_type="l40s"), node("n2")] if b is None else b
    return [
        ClusterView("a", a_nodes, "gpu", answering="a" in answering, down="a" in down),
        ClusterView("b", b_nodes, "gpu", answering="b" in answering, down="b" in down),
    ]


def run(
    models: Mapping[str, Model],
    clusters: Sequence[ClusterView],
    replicas: Sequence[ReplicaView] = (),
    wanted: Sequence[str] = (),
    now: float = NOW,
    cfg: PlanConfig = CFG,
) -> PlanResult:
    held = {m: now - 1.0 for m in wanted}
    return plan(models, replicas, (), held, {}, cfg, now, ids(), held_since=held, clusters=clusters)


def placed(res: PlanResult) -> list[tuple[str, str, tuple[str, ...]]]:
    """(model, cluster, candidates) of each submission."""
    return [(a.model, a.cluster, a.candidates) for a in res.of(ActionKind.SUBMIT)]


# ---- where a replica goes ------------------------------------------------------------


def test_a_gpu_type_only_the_second_cluster_has_goes_there(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("small", resources=L40S))
    res = run(ms, site(), wanted=["small"])
    (a,) = res.of(ActionKind.SUBMIT)
    assert (a.cluster, a.candidates) == ("b", ())
    assert a.placement == "b: n1"


def test_a_model_that_fits_on_both_goes_where_gpus_are_free(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources=A100))
    assert placed(run(ms, site(), wanted=["m"])) == [("m", "a", ())]  # both free: the first
    full = [node("n1", used=4)]
    res = run(ms, site(a=full), wanted=["m"])
    (a,) = res.of(ActionKind.SUBMIT)
    assert (a.cluster, a.placement) == ("b", "b: n2")


def test_two_replicas_in_one_pass_do_not_count_the_same_gpus_on_a_cluster(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 2, max: 2}", "{gpus: 4, gpu_type: a100}"))
    res = run(ms, site())
    # One whole node on each cluster: the second is not promised a's node again.
    assert [(a.cluster, a.placement) for a in res.of(ActionKind.SUBMIT)] == [
        ("a", "a: n1"),
        ("b", "b: n2"),
    ]


def test_resources_clusters_keeps_a_model_off_the_others(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources="{gpus: 1, gpu_type: a100, clusters: [b]}"))
    assert placed(run(ms, site(), wanted=["m"])) == [("m", "b", ())]
    # b full: queued on b, the one cluster it may use, although a has room.
    res = run(ms, site(b=[node("n2", used=4)]), wanted=["m"])
    assert placed(res) == [("m", "b", ())]
    assert res.notes["m"].startswith("no room: b: needs 1 node(s) with 1 free gpu:a100")


def test_fitting_nowhere_it_is_left_to_slurm_to_say_where_it_starts_first(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}", A100))
    full = site(a=[node("n1", used=4)], b=[node("n2", used=4)])
    res = run(ms, full)
    (a,) = res.of(ActionKind.SUBMIT)
    assert (a.cluster, a.candidates) == ("", ("a", "b"))
    assert "a: needs 1 node(s)" in a.placement and "b: needs 1 node(s)" in a.placement


def test_a_cluster_that_does_not_answer_is_not_placed_on(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources=A100) + entry("small", resources=L40S))
    res = run(ms, site(answering=["a"]), wanted=["m", "small"])
    # small's GPU type is only on b: nothing is queued on a, where it could never start.
    assert placed(res) == [("m", "a", ())]
    assert res.notes["small"] == (
        "no cluster to place it on: a has no node that could take it, b not answering"
    )
    res = run(ms, site(answering=[]), wanted=["m"])
    assert res.actions == []
    assert res.notes["m"] == "no cluster to place it on: a not answering, b not answering"


# ---- the clusters a model runs on ------------------------------------------------------


def test_a_renewal_stays_on_its_replicas_cluster(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1, max: 1}", A100))
    old = rv("r1", "m", R, cluster="b", time_left_s=60.0)
    res = run(ms, site(), [old])
    (a,) = res.of(ActionKind.SUBMIT)
    assert (a.cluster, a.replaces) == ("b", "r1")


def test_a_load_scale_up_prefers_where_the_model_runs_a_held_start_the_first(
    tmp_path: Path,
) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 0, max: 2, target_inflight: 1}", A100))
    busy = rv("r1", "m", R, cluster="b", in_flight=2)
    assert placed(run(ms, site(), [busy])) == [("m", "b", ())]
    # Where it runs is full: the next cluster with room.
    res = run(ms, site(b=[node("n1", gpu_type="l40s"), node("n2", used=4)]), [busy])
    assert placed(res) == [("m", "a", ())]


def test_a_model_taken_off_a_cluster_leaves_it(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 0, max: 2}", "{gpus: 1, clusters: [a]}"))
    reps = [rv("r1", "m", R, cluster="b"), rv("r2", "m", P, cluster="b")]
    res = run(ms, site(), reps)
    assert [(a.kind, a.replica_id, a.reason) for a in res.actions] == [
        (ActionKind.DRAIN, "r1", "cluster b no longer in the model's clusters"),
        (ActionKind.CANCEL, "r2", "cluster b no longer in the model's clusters"),
    ]


# ---- eviction stays on a cluster --------------------------------------------------------


def test_eviction_only_on_the_cluster_whose_room_it_makes(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("small", resources=L40S)
        + entry("x", "{min: 0}", A100)
        + entry("y", "{min: 0}", L40S),
    )
    idle = {"last_used": NOW - 3_600.0, "gpus_per_node": 4, "node_names": ("n1",)}
    reps = [rv("on-a", "x", R, cluster="a", **idle), rv("on-b", "y", R, cluster="b", **idle)]
    full = site(a=[node("n1", used=4)], b=[node("n1", gpu_type="l40s", used=4), node("n2", used=4)])
    res = run(ms, full, reps, wanted=["small"])
    (ev,) = res.of(ActionKind.EVICT)
    assert (ev.replica_id, ev.attrs["for"]) == ("on-b", "small")
    assert placed(res) == [("small", "b", ())]


def test_one_eviction_per_cluster_per_pass(tmp_path: Path) -> None:
    ms = models_of(
        tmp_path,
        entry("big", resources="{gpus: 4, gpu_type: a100}")
        + entry("small", resources="{gpus: 4, gpu_type: l40s}")
        + entry("x", "{min: 0}", "{gpus: 4, gpu_type: a100}")
        + entry("y", "{min: 0}", "{gpus: 4, gpu_type: l40s}"),
    )
    idle = {"last_used": NOW - 3_600.0, "gpus_per_node": 4, "node_names": ("n1",)}
    reps = [rv("on-a", "x", R, cluster="a", **idle), rv("on-b", "y", R, cluster="b", **idle)]
    full = site(a=[node("n1", used=4)], b=[node("n1", gpu_type="l40s", used=4)])
    res = run(ms, full, reps, wanted=["big", "small"])
    assert sorted(a.replica_id for a in res.of(ActionKind.EVICT)) == ["on-a", "on-b"]
    assert sorted(placed(res)) == [("big", "a", ()), ("small", "b", ())]


def test_an_eviction_being_killed_holds_only_its_own_cluster(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", resources=A100) + entry("x", "{min: 0}", A100))
    dying = rv("z", "x", X, cluster="a", stop_reason="evicted, idle 1h, to make room for m")
    idle = {"last_used": NOW - 3_600.0, "gpus_per_node": 4, "node_names": ("n2",)}
    res = run(
        ms,
        site(a=[node("n1", used=4)], b=[node("n2", used=4)]),
        [dying, rv("c", "x", R, cluster="b", **idle)],
        wanted=["m"],
    )
    assert [a.replica_id for a in res.of(ActionKind.EVICT)] == ["c"]
    assert placed(res) == [("m", "b", ())]


# ---- a cluster that fails ---------------------------------------------------------------


def test_nothing_is_done_to_the_replicas_of_a_cluster_that_does_not_answer(tmp_path: Path) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 0, max: 3}", A100))
    cfg = PlanConfig(max_pending_time=60.0)
    reps = [
        rv("old", "m", P, cluster="a", submitted_at=NOW - 3_600.0),  # pending past the limit
        rv("done", "m", D, cluster="a", in_flight=0),  # drained
    ]
    assert run(ms, site(answering=["b"]), reps, cfg=cfg).actions == []
    kinds = [(a.kind, a.replica_id) for a in run(ms, site(), reps, cfg=cfg).actions]
    assert kinds == [(ActionKind.CANCEL, "old"), (ActionKind.CANCEL, "done")]


def test_a_pending_replica_on_a_cluster_that_is_down_is_replaced_elsewhere(
    tmp_path: Path,
) -> None:
    ms = models_of(tmp_path, entry("m", resources=A100))
    stuck = rv("r1", "m", P, cluster="a")
    # Not answering, not yet down: it counts, nothing is submitted (a failover may keep it).
    res = run(ms, site(answering=["b"]), [stuck], wanted=["m"])
    assert placed(res) == [] and res.lost_with_cluster == []
    # Down (cluster_down_after passed): it no longer counts; a replica goes to b.
    res = run(ms, site(answering=["b"], down=["a"]), [stuck], wanted=["m"])
    assert res.lost_with_cluster == ["r1"]
    assert placed(res) == [("m", "b", ())]
    assert res.of(ActionKind.CANCEL) == []  # a cancel would not reach it


def test_a_ready_replica_on_a_cluster_that_is_down_serves_while_its_agent_reports(
    tmp_path: Path,
) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}", A100))
    cfg = PlanConfig(cluster_down_after=120.0)
    down = site(answering=["b"], down=["a"])
    heard = rv("r1", "m", R, cluster="a", last_report=NOW - 30.0)
    res = run(ms, down, [heard], cfg=cfg)
    assert res.actions == [] and res.lost_with_cluster == []
    # Its agent silent as long as the cluster: its node may be gone too; replaced.
    res = run(ms, down, [heard], now=NOW + 100.0, cfg=cfg)
    assert res.lost_with_cluster == ["r1"]
    assert placed(res) == [("m", "b", ())]


def test_when_the_cluster_answers_again_the_replaced_replica_goes_not_the_new_one(
    tmp_path: Path,
) -> None:
    ms = models_of(tmp_path, entry("m", "{min: 1}", A100))
    back = [
        rv("r1", "m", P, cluster="a", stranded=True, submitted_at=NOW - 600.0),
        rv("r2", "m", P, cluster="b", submitted_at=NOW - 60.0),
    ]
    res = run(ms, site(), back)
    (c,) = res.of(ActionKind.CANCEL)
    assert (c.replica_id, c.reason) == ("r1", "scale down: replaced while cluster a did not answer")
    # Started already when its cluster came back: it goes all the same, before it serves.
    back[0] = rv("r1", "m", S, cluster="a", stranded=True)
    (c,) = run(ms, site(), back).of(ActionKind.CANCEL)
    assert c.replica_id == "r1"


# ---- Slurm's word, when it fits nowhere ---------------------------------------------------


def test_earliest_start_takes_the_soonest_ties_to_the_site_order() -> None:
    starts: dict[str, float | str] = {"a": NOW + 600.0, "b": NOW + 60.0}
    assert earliest_start(["a", "b"], starts, NOW) == (
        "b",
        "Slurm expects it soonest on b (a in 10m00s; b in 1m00s)",
    )
    assert earliest_start(["a", "b"], {"a": NOW + 60.0, "b": NOW + 60.0}, NOW)[0] == "a"
    # A start already past (Slurm said "now" a moment ago) counts as now.
    assert earliest_start(["a", "b"], {"a": NOW + 5.0, "b": NOW - 30.0}, NOW)[0] == "b"


def test_earliest_start_skips_a_cluster_that_refuses_and_falls_back_to_the_first() -> None:
    starts: dict[str, float | str] = {"a": "refuses (no such partition)", "b": NOW + 3_600.0}
    assert earliest_start(["a", "b"], starts, NOW)[0] == "b"
    name, why = earliest_start(["a", "b"], {"a": "refuses (x)", "b": "cannot say"}, NOW)
    assert name == "a"
    assert why == "Slurm would start it on none (a refuses (x); b cannot say): a"


def test_the_replaced_replica_cancelled_leaves_its_replacement_serving(tmp_path: Path) -> None:
    # On demand, nobody waiting now (the replacement served them): the model wants none,
    # but its one ready replica is within max once the stranded one goes, and not idle
    # for idle_timeout: it stays.
    ms = models_of(tmp_path, entry("m", "{min: 0, max: 1, idle_timeout: 10m}", A100))
    back = [
        rv("r1", "m", P, cluster="a", stranded=True),
        rv("r2", "m", R, cluster="b", last_used=NOW - 1.0),
    ]
    res = run(ms, site(), back)
    assert [(a.kind, a.replica_id) for a in res.actions] == [(ActionKind.CANCEL, "r1")]
