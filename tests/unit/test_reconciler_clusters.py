"""The pass loop over two clusters without Slurm: one listing per cluster, adoption by
cluster, a controller that does not answer, and Slurm's word on where a replica
that fits nowhere starts first.

Each cluster is a fake of its own (test_reconciler_core's, refusing what it does not
know) with its own job ids: two clusters number their jobs each from 1. The same
against two real clusters is tests/clusters.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from test_reconciler_core import KEY, PREFIX, FakeSlurm, job, node  # type: ignore[import-not-found]

from llmgw_slurm.base.errors import SlurmError, SlurmUnavailable
from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.config import load_server_config
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.reconciler.jobs import job_name
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.slurm.types import GpuCount, JobSpec, JobState, NodeInfo


class Cluster(FakeSlurm):
    """A fake cluster that may stop answering, and says when a job would start."""

    def __init__(
        self, nodes: list[NodeInfo], clock: list[float], start_in: float | str = 60.0
    ) -> None:
        super().__init__()
        self.nodes = nodes
        self.clock = clock
        self.down = False
        self.start_in = start_in
        self.asked: list[str] = []
        self.checked = self.closed = 0

    def _answer(self) -> None:
        if self.down:
            raise SlurmUnavailable("no answer within 30s (is slurmctld up?)", command=["squeue"])

    async def check(self) -> None:
        self.checked += 1
        self._answer()

    async def close(self) -> None:
        self.closed += 1

    async def list_jobs(self, name_prefix: str = "") -> list[Any]:
        self._answer()
        return await super().list_jobs(name_prefix)

    async def list_nodes(self) -> list[NodeInfo]:
        self._answer()
        return await super().list_nodes()

    async def submit(self, spec: JobSpec) -> str:
        self._answer()
        return await super().submit(spec)

    async def will_start(self, spec: JobSpec) -> datetime:
        self.asked.append(spec.name)
        if isinstance(self.start_in, str):
            raise SlurmError("failed", command=["sbatch"], returncode=1, stderr=self.start_in)
        return datetime.fromtimestamp(self.clock[0]) + timedelta(seconds=self.start_in)


def l40s(name: str, used: int = 0) -> NodeInfo:
    return NodeInfo(name, "idle", ("llm",), 16, 0, 64000, (GpuCount("l40s", 4, used),))


def make(
    tmp_path: Path, models: list[dict[str, Any]], **reconcile: Any
) -> tuple[Reconciler, Cluster, Cluster, list[float]]:
    """A reconciler over clusters a (a100 nodes n0, n1) and b (l40s node n0: the same
    name), and the fake clock it runs on."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": models}))
    server = {
        "slurm": {"job_prefix": PREFIX, "partition": "llm"},
        "clusters": [{"name": "a"}, {"name": "b"}],
        "state_dir": str(tmp_path / "state"),
        "reconcile": {"cluster_down_after": "2m", **reconcile},
    }
    (tmp_path / "server.yaml").write_text(yaml.safe_dump(server))
    cfg = load_server_config(tmp_path / "server.yaml")
    now = [1_000_000.0]
    a, b = Cluster([node("n0", 0), node("n1", 0)], now), Cluster([l40s("n0")], now)
    rec = Reconciler(
        load_catalog(cfg.models, cfg.cluster_names),
        cfg,
        {"a": a, "b": b},  # type: ignore[dict-item]
        KEY,
        "http://127.0.0.1:1",
        clock=lambda: now[0],
    )
    return rec, a, b, now


def model(name: str, gpu_type: str = "a100", **scaling: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": {"kind": "command", "command": ["true", "{port}"]},
        "resources": {"gpus": 1, "gpu_type": gpu_type, "time_limit": "1h"},
        "scaling": {"min": 0, "max": 1, **scaling},
    }


def listed(cluster: Cluster, spec: JobSpec, job_id: str, state: JobState) -> None:
    """The cluster lists the job it was given, as squeue would."""
    model_, _, rest = spec.name[len(PREFIX) :].rpartition(".")
    j = job(job_id, model_, rest[:8], state)
    cluster.jobs.append(dataclasses.replace(j, name=spec.name))


async def test_each_cluster_is_listed_once_a_pass_and_a_model_goes_where_its_gpus_are(
    tmp_path: Path,
) -> None:
    rec, a, b, _ = make(tmp_path, [model("small", "l40s", min=1)])
    await rec.pass_once()
    assert (a.listings["jobs"], b.listings["jobs"]) == (1, 1)
    assert a.submitted == [] and len(b.submitted) == 1
    spec = b.submitted[0]
    assert spec.name.endswith("-b")
    (r,) = rec.replicas.values()
    assert (r.cluster, r.job_id) == ("b", spec.name and "101")
    (d,) = [d for d in rec.decisions if d.action == "submit"]
    assert "job 101 on b; room now on b: n0" in d.reason


async def test_adoption_after_a_restart_by_cluster_with_the_same_job_ids(tmp_path: Path) -> None:
    rec, a, b, _ = make(tmp_path, [model("m", min=2, max=2)])
    for c, name in ((a, "0a0a0a0a"), (b, "0b0b0b0b")):
        j = job("7", "m", name, JobState.RUNNING)  # the same job id on both clusters
        c.jobs = [dataclasses.replace(j, name=job_name(PREFIX, "m", name, "a" if c is a else "b"))]
    await rec.pass_once()
    got = sorted((r.replica_id, r.cluster, r.job_id) for r in rec.replicas.values())
    assert got == [("0a0a0a0a", "a", "7"), ("0b0b0b0b", "b", "7")]
    assert a.submitted == b.submitted == []
    # A job named for cluster a but listed by b (two entries reaching one Slurm) is not
    # adopted twice, and a job without a cluster (from before) is the listing cluster's.
    old = job("8", "m", "0c0c0c0c", JobState.PENDING)
    b.jobs.append(dataclasses.replace(a.jobs[0], job_id="9"))
    b.jobs.append(old)
    await rec.pass_once()
    assert rec.replicas["0c0c0c0c"].cluster == "b"
    assert rec.replicas["0a0a0a0a"].job_id == "7"


async def test_a_cluster_that_does_not_answer_keeps_its_replicas_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    rec, a, b, now = make(tmp_path, [model("m", min=1), model("small", "l40s", min=1)])
    await rec.pass_once()
    (spec_a,) = a.submitted
    listed(a, spec_a, "101", JobState.PENDING)
    listed(b, b.submitted[0], "101", JobState.RUNNING)
    await rec.pass_once()
    a.down = True
    now[0] += 10
    b.jobs = []  # small's job ended on b
    await rec.pass_once()
    on_a = next(r for r in rec.replicas.values() if r.cluster == "a")
    assert on_a.state() is ReplicaState.PENDING  # kept: its cluster did not say
    assert "small" in {d.model for d in rec.decisions if d.action == "reap"}
    assert rec.pass_loop.last_pass_error.startswith("a: squeue: no answer within 30s")
    st = rec.status()
    (ca, cb) = st["clusters"]
    assert (ca["name"], ca["health"], cb["health"]) == ("a", "not answering", "up")
    # Backed off on a alone: the next pass (just after) does not ask it again.
    calls = a.listings["jobs"]
    now[0] += 1
    await rec.pass_once()
    assert a.listings["jobs"] == calls and b.listings["jobs"] >= 4


async def test_a_cold_model_is_placed_on_the_other_cluster_after_the_bound_and_only_once(
    tmp_path: Path,
) -> None:
    # m fits on both; it goes to a first (the site's order).
    rec, a, b, now = make(tmp_path, [model("m", gpu_type="a100", max=1)], interval="1s")
    b.nodes = [node("n0", 0)]
    rec.want("m")
    await rec.pass_once()
    (spec,) = a.submitted
    listed(a, spec, "101", JobState.PENDING)
    await rec.pass_once()
    a.down = True
    now[0] += 30  # not answering, within cluster_down_after: it may fail over
    await rec.pass_once()
    rec.want("m")
    await rec.pass_once()
    assert b.submitted == []
    now[0] += 120  # down: the pending job there no longer counts
    rec.want("m")
    for _ in range(3):
        now[0] += 20
        await rec.pass_once()
    (spec_b,) = b.submitted
    assert [d.action for d in rec.decisions if d.action in ("stranded", "submit")] == [
        "submit",
        "stranded",
        "submit",
    ]
    listed(b, spec_b, "101", JobState.RUNNING)
    # a comes back with the job still pending: it is cancelled, b's stays.
    a.down = False
    now[0] += 300
    await rec.pass_once()
    assert a.cancelled == ["101"] and b.cancelled == []
    (c,) = [d for d in rec.decisions if d.action == "cancel"]
    assert c.reason == "scale down: replaced while cluster a did not answer"


async def test_fitting_nowhere_it_goes_where_slurm_says_it_starts_first(tmp_path: Path) -> None:
    rec, a, b, _ = make(tmp_path, [model("m", gpu_type="a100", min=1)])
    a.nodes = [node("n0", 4), node("n1", 4)]
    b.nodes = [node("n0", 4)]
    a.start_in, b.start_in = 3_600.0, 120.0
    await rec.pass_once()
    assert len(a.asked) == len(b.asked) == 1  # each asked once, nothing submitted there
    assert a.submitted == [] and len(b.submitted) == 1
    (d,) = [d for d in rec.decisions if d.action == "submit"]
    assert "on b;" in d.reason and "Slurm expects it soonest on b (a in 1h00m" in d.reason
    # A cluster that refuses the job outright is never chosen.
    rec2, a2, b2, _ = make(tmp_path / "2", [model("m", gpu_type="a100", min=1)])
    a2.nodes, b2.nodes = [node("n0", 4)], [node("n0", 4)]
    a2.start_in, b2.start_in = "Requested node configuration is not available", 99_999.0
    await rec2.pass_once()
    assert a2.submitted == [] and len(b2.submitted) == 1


async def test_a_cancel_slurm_does_not_take_leaves_the_replica_as_it_was(tmp_path: Path) -> None:
    rec, a, _, now = make(tmp_path, [model("m", min=1)], max_pending_time="1m")
    await rec.pass_once()
    listed(a, a.submitted[0], "101", JobState.PENDING)
    await rec.pass_once()

    async def refuse(job_id: str, **_: Any) -> None:
        raise SlurmUnavailable("no answer within 30s", command=["scancel"])

    a.cancel = refuse  # type: ignore[method-assign]
    now[0] += 120  # pending past max_pending_time: cancelled
    await rec.pass_once()
    (r,) = [r for r in rec.replicas.values() if r.job_id == "101"]
    assert r.stop_reason == "" and r.state() is ReplicaState.PENDING
    assert "error" in [d.action for d in rec.decisions]


async def test_the_router_sees_every_ready_replica_wherever_it_runs_a_down_clusters_too(
    tmp_path: Path,
) -> None:
    rec, a, b, now = make(tmp_path, [model("m", min=2, max=2)])
    b.nodes = [node("n0", 0)]
    for c, rid in ((a, "0a0a0a0a"), (b, "0b0b0b0b")):
        j = job("7", "m", rid, JobState.RUNNING)
        c.jobs = [dataclasses.replace(j, name=job_name(PREFIX, "m", rid, "a" if c is a else "b"))]
    await rec.pass_once()
    for rid in ("0a0a0a0a", "0b0b0b0b"):
        r = rec.replicas[rid]
        r.base_url, r.last_report = f"http://{rid}:1", now[0]  # as its agent reported
    assert sorted(e.replica_id for e in rec.endpoints("m")) == ["0a0a0a0a", "0b0b0b0b"]
    # a's controller goes away: its ready replica, whose agent still reports, serves on.
    a.down = True
    for _ in range(3):
        now[0] += 60
        rec.replicas["0a0a0a0a"].last_report = now[0]
        await rec.pass_once()
    assert rec.status()["clusters"][0]["health"] == "down"
    assert sorted(e.replica_id for e in rec.endpoints("m")) == ["0a0a0a0a", "0b0b0b0b"]
    assert not [d for d in rec.decisions if d.action in ("submit", "stranded")]


async def test_service_jobs_are_followed_per_cluster_though_their_ids_are_the_same(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from llmgw_slurm.cli.admin import main
    from llmgw_slurm.reconciler.svcjobs import ServiceJobBuilder, service_job_name

    rec, a, b, _ = make(tmp_path, [model("m")])
    # llmgw-admin fetch --cluster b: the job is built with b's defaults, b's name known.
    settings = rec.server.cluster_list[1]
    spec = ServiceJobBuilder(rec.server, cluster=settings).fetch(rec.catalog.models[0])
    assert "#SBATCH --partition=llm" in spec.script
    assert rec.service_jobs.expect("7", spec.name, "m", 1.0, "b")
    on_a = service_job_name(PREFIX, "install", "vllm", "0a1b2c3d")
    a.jobs = [dataclasses.replace(job("7", "m", "0a1b2c3d", JobState.RUNNING), name=on_a)]
    b.jobs = [dataclasses.replace(job("7", "m", "0a1b2c3d", JobState.PENDING), name=spec.name)]
    await rec.pass_once()
    got = sorted((j["cluster"], j["job_id"], j["kind"], j["state"]) for j in rec.status()["jobs"])
    assert got == [("a", "7", "install", "RUNNING"), ("b", "7", "fetch", "PENDING")]
    # A cluster server.yaml does not list is a usage error naming those it does.
    out = CliRunner().invoke(
        main, ["fetch", "m", "--cluster", "c", "--server", str(tmp_path / "server.yaml")]
    )
    assert out.exit_code == 2 and "no cluster 'c'; clusters: a, b" in out.output


async def test_every_clusters_backend_is_checked_at_start_and_closed_at_the_end(
    tmp_path: Path,
) -> None:
    # The daemon checked and closed the first cluster's backend alone.
    rec, a, b, _ = make(tmp_path, [model("m")])
    a.down = True
    unanswered = await rec.clusters.check()
    assert list(unanswered) == ["a"] and "slurmctld" in str(unanswered["a"])
    assert (a.checked, b.checked) == (1, 1)
    await rec.clusters.close()
    assert (a.closed, b.closed) == (1, 1)
