"""The reconciler's runtime without Slurm: reports, probing, adoption, requeue, reaping.

The Slurm side is a fake that holds a job list the test sets and records what
it is asked; it refuses any call it does not implement. The Slurm-level tests
(tests/slurm/test_reconciler.py) run the same code against the real cluster.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from _router_support import eventually, serve, serve_engine  # type: ignore[import-not-found]

from llmgw_slurm.auth.secrets import engine_api_key, replica_secret
from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.base.errors import SlurmUnavailable
from llmgw_slurm.catalog import Catalog, load_catalog
from llmgw_slurm.config import load_server_config
from llmgw_slurm.reconciler import plan as planmod
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.reconciler.jobs import job_name, parse_job_name
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.reconciler.replicas import view_of
from llmgw_slurm.router import GATEWAY_KEY, RouterConfig, create_app
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    GpuCount,
    Job,
    JobComponent,
    JobSpec,
    JobState,
    NodeInfo,
)
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app

KEY = b"k" * 64
PREFIX = "llmgwunit."


class FakeSlurm:
    """Holds jobs; records submits and cancels. Anything else is an AttributeError."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.submitted: list[JobSpec] = []
        self.cancelled: list[str] = []
        self.accounting_records: list[AccountingRecord] = []
        self.calls = 0
        self.listings: collections.Counter[str] = collections.Counter()
        self.next_id = 100
        self.nodes = [node(f"n{i}", used=0) for i in range(2)]

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        self.calls += 1
        self.listings["jobs"] += 1
        return [j for j in self.jobs if j.name.startswith(name_prefix)]

    async def list_nodes(self) -> list[NodeInfo]:
        self.calls += 1
        self.listings["nodes"] += 1
        return list(self.nodes)

    async def submit(self, spec: JobSpec) -> str:
        self.calls += 1
        self.submitted.append(spec)
        self.next_id += 1
        return str(self.next_id)

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        self.calls += 1
        assert signal is None
        self.cancelled.append(job_id)

    async def accounting(
        self,
        start: datetime,
        end: datetime | None = None,
        name_prefix: str = "",
        all_users: bool = False,
    ) -> list[AccountingRecord]:
        self.calls += 1
        return self.accounting_records


def node(name: str, used: int) -> NodeInfo:
    return NodeInfo(
        name=name,
        state="idle" if not used else "mixed",
        partitions=("llm",),
        cpus_total=16,
        cpus_alloc=0,
        memory_mb=64000,
        gpus=(GpuCount("a100", 4, used),),
    )


def job(job_id: str, model: str, rid: str, state: JobState, restarts: int = 0) -> Job:
    return Job(
        job_id=job_id,
        name=job_name(PREFIX, model, rid),
        state=state,
        reason="Resources" if state is JobState.PENDING else "",
        partition="llm",
        user="root",
        comment="",
        nodes=("n0",) if state is JobState.RUNNING else (),
        submit_time=datetime.now(),
        start_time=datetime.now() if state is JobState.RUNNING else None,
        time_limit_s=3600,
        end_time=datetime.now() + timedelta(seconds=3000) if state is JobState.RUNNING else None,
        restarts=restarts,
        components=(JobComponent(0, job_id, state, (), 1, "gres:gpu:a100:1"),),
    )


def make(
    tmp_path: Path,
    scaling: dict[str, Any] | None = None,
    *,
    names: tuple[str, ...] = ("m",),
    gpus: int = 1,
    reconcile: dict[str, Any] | None = None,
    scalings: dict[str, dict[str, Any]] | None = None,
    router: dict[str, Any] | None = None,
    site_scaling: dict[str, Any] | None = None,
) -> tuple[Reconciler, FakeSlurm]:
    """A reconciler over a fake Slurm; ``scalings`` gives some models their own scaling,
    ``site_scaling`` is server.yaml's ``scaling:``."""
    models = {
        "models": [
            {
                "name": name,
                "engine": {"kind": "command", "command": ["true", "{port}"]},
                "resources": {
                    "gpus": gpus,
                    "gpu_type": "a100",
                    "partition": "llm",
                    "time_limit": "1h",
                },
                "scaling": (scalings or {}).get(name, scaling or {"min": 0, "max": 1}),
            }
            for name in names
        ]
    }
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    (tmp_path / "server.yaml").write_text(
        yaml.safe_dump(
            {
                "slurm": {"job_prefix": PREFIX, "partition": "llm"},
                "state_dir": str(tmp_path / "state"),
                "reconcile": {"min_lifetime": "10m", **(reconcile or {})},
                "router": router or {},
                "scaling": site_scaling or {},
            }
        )
    )
    server = load_server_config(tmp_path / "server.yaml")
    fake = FakeSlurm()
    rec = Reconciler(load_catalog(server.models), server, fake, KEY, "http://127.0.0.1:1")  # type: ignore[arg-type]
    return rec, fake


def test_job_names_round_trip_and_foreign_names_are_not_ours() -> None:
    assert parse_job_name(PREFIX, job_name(PREFIX, "llama-3.1-8b", "0a1b2c3d")) == (
        "llama-3.1-8b",
        "0a1b2c3d",
    )
    assert parse_job_name(PREFIX, "llmgwunit.m.notahexid") is None
    assert parse_job_name(PREFIX, "other.m.0a1b2c3d") is None
    assert parse_job_name(PREFIX, "llmgwunit.0a1b2c3d") is None


async def test_submitted_job_carries_identity_in_name_and_secrets_in_env(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    await rec.pass_once()
    (spec,) = fake.submitted
    model, rid = parse_job_name(PREFIX, spec.name) or ("", "")
    assert model == "m"
    assert spec.env["LLMGW_REPLICA_SECRET"] == replica_secret(KEY, rid)
    assert spec.env["LLMGW_ENGINE_API_KEY"] == engine_api_key(KEY, rid)
    assert replica_secret(KEY, rid) not in spec.script
    assert replica_secret(KEY, rid) not in spec.comment
    assert spec.comment == f"llmgw model=m replica={rid} gpus=1"
    assert "--gres=gpu:a100:1" in spec.script
    assert fake.calls == 3  # squeue, sinfo, sbatch


async def test_a_pass_with_nothing_to_do_lists_the_jobs_only(tmp_path: Path) -> None:
    rec, fake = make(tmp_path)
    fake.jobs = [job("7", "m", "0a1b2c3d", JobState.PENDING)]
    rec.want("m")  # someone waits: the pending replica is kept
    for _ in range(3):
        assert await rec.pass_once() == []
    # The first pass after start lists the nodes; the next ones plan on that listing.
    assert fake.listings == {"jobs": 3, "nodes": 1}
    assert fake.calls == 4
    assert fake.submitted == [] and fake.cancelled == []
    assert [n.name for n in rec.nodes] == ["n0", "n1"]


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


async def test_the_nodes_are_listed_again_once_older_than_nodes_max_age(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, reconcile={"nodes_max_age": "1m"})
    rec.clock = clock = Clock()
    await rec.pass_once()
    fake.nodes = [node("n0", used=4)]
    clock.t += 59
    await rec.pass_once()
    assert fake.listings == {"jobs": 2, "nodes": 1}
    assert rec.nodes[0].gpus_free() == 4  # status still shows the first listing
    clock.t += 1
    await rec.pass_once()
    assert fake.listings == {"jobs": 3, "nodes": 2}
    assert [(n.name, n.gpus_free()) for n in rec.nodes] == [("n0", 0)]
    # A clock that went back proves nothing about the listing's age.
    clock.t -= 10
    await rec.pass_once()
    assert fake.listings == {"jobs": 4, "nodes": 3}


async def test_nodes_max_age_zero_lists_the_nodes_every_pass(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, reconcile={"nodes_max_age": 0})
    for _ in range(3):
        await rec.pass_once()
    assert fake.listings == {"jobs": 3, "nodes": 3}


async def test_a_pass_that_places_lists_the_nodes_afresh_before_submitting(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path)
    await rec.pass_once()  # lists n0 and n1, both free
    fake.nodes = [node("n0", used=4), node("n1", used=3)]
    listed_before_submit = []
    submit = fake.submit

    async def counting_submit(spec: JobSpec) -> str:
        listed_before_submit.append(fake.listings["nodes"])
        return await submit(spec)

    fake.submit = counting_submit  # type: ignore[method-assign]
    rec.want("m")
    (a,) = await rec.pass_once()
    assert fake.listings == {"jobs": 2, "nodes": 2}
    assert listed_before_submit == [2]
    # Placed with the fresh capacity: only n1 has a GPU left.
    assert a.placement == "n1"
    (d,) = [d for d in rec.decisions if d.action == "submit"]
    assert d.reason.endswith("; room now on n1")


async def evicting_world(tmp_path: Path, first: list[NodeInfo]) -> tuple[Reconciler, FakeSlurm]:
    """Models a and b, one 4-GPU node for either; a's replica ready and idle an hour."""
    # Idle for a day before a scale-down: only an eviction stops a here.
    rec, fake = make(tmp_path, {"min": 0, "max": 1, "idle_timeout": "1d"}, names=("a", "b"), gpus=4)
    rec.clock = clock = Clock()
    fake.nodes = first
    # a's job holds all four GPUs of n0: evicting it makes room for b.
    running = job("7", "a", "0a1b2c3d", JobState.RUNNING)
    whole = dataclasses.replace(running.components[0], tres_per_node="gres:gpu:a100:4")
    fake.jobs = [dataclasses.replace(running, components=(whole,))]
    await rec.pass_once()
    r = rec.replicas["0a1b2c3d"]
    r.base_url = "http://127.0.0.1:1"
    r.ready_at = r.last_used = clock.t - 3600
    assert fake.listings == {"jobs": 1, "nodes": 1}
    return rec, fake


async def test_an_eviction_planned_on_old_nodes_is_not_made_when_fresh_ones_have_room(
    tmp_path: Path,
) -> None:
    rec, fake = await evicting_world(tmp_path, [node("n0", used=4)])
    fake.nodes = [node("n0", used=0)]  # a's GPUs are free again (say, another job ended)
    rec.want("b")
    actions = await rec.pass_once()
    assert fake.listings == {"jobs": 2, "nodes": 2}
    assert [(x.kind.value, x.model, x.placement) for x in actions] == [("submit", "b", "n0")]
    assert fake.cancelled == []


async def test_an_eviction_the_old_nodes_did_not_call_for_is_made_when_fresh_ones_are_full(
    tmp_path: Path,
) -> None:
    rec, fake = await evicting_world(tmp_path, [node("n0", used=0)])
    fake.nodes = [node("n0", used=4)]
    rec.want("b")
    actions = await rec.pass_once()
    assert fake.listings == {"jobs": 2, "nodes": 2}
    assert [(x.kind.value, x.model) for x in actions] == [("evict", "a"), ("submit", "b")]
    assert fake.cancelled == ["7"]
    assert actions[1].placement.startswith("no room now: ")


async def test_no_action_when_the_fresh_node_listing_fails(tmp_path: Path) -> None:
    rec, fake = make(tmp_path)
    await rec.pass_once()
    list_nodes = fake.list_nodes

    async def unanswered() -> list[NodeInfo]:
        fake.listings["nodes"] += 1
        raise SlurmUnavailable("no answer within 30s", command=["sinfo"])

    fake.list_nodes = unanswered  # type: ignore[method-assign]
    rec.want("m")
    assert await rec.pass_once() == []
    assert fake.submitted == [] and fake.listings == {"jobs": 2, "nodes": 2}
    assert "sinfo" in rec.last_pass_error
    fake.list_nodes = list_nodes  # type: ignore[method-assign]
    (a,) = await rec.pass_once()
    assert a.kind.value == "submit" and len(fake.submitted) == 1
    assert rec.last_pass_error == ""


async def test_wrong_secret_is_refused_and_unknown_replicas_are_kept_for_later(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path)
    with pytest.raises(PermissionError):
        rec.report("0a1b2c3d", "not-the-secret", {"event": "heartbeat"})
    # A correct secret for a job not listed yet (right after a restart): kept, joined later.
    ok = rec.report(
        "0a1b2c3d",
        replica_secret(KEY, "0a1b2c3d"),
        {"event": "step", "step": "weights", "status": "started"},
    )
    assert ok == {"ok": True, "drain": False}
    fake.jobs = [job("7", "m", "0a1b2c3d", JobState.RUNNING)]
    await rec.pass_once()
    r = rec.replicas["0a1b2c3d"]
    assert r.adopted and r.step == "weights started"
    assert [d.action for d in rec.decisions] == ["adopt"]


async def test_ready_report_is_probed_with_the_engine_key_before_routing(tmp_path: Path) -> None:
    rec, fake = make(tmp_path)
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    good = EngineOptions(api_key=engine_api_key(KEY, rid), served_name="m")
    wrong = EngineOptions(api_key="someone-elses-key", served_name="m")
    gateway = rec.engine_tls.identity
    async with serve_engine(create_engine_app(wrong), gateway) as (bad_url, bad_cert):
        body = {"event": "ready", "url": bad_url, "cert": bad_cert}
        rec.report(rid, replica_secret(KEY, rid), body)
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert rec.endpoints("m") == []
        assert rec.decisions[-1].action == "probe-failed"
        assert "HTTP 401" in rec.decisions[-1].reason
    async with serve_engine(create_engine_app(good), gateway) as (url, cert):
        waiter = asyncio.create_task(rec.wait_ready("m"))
        body = {"event": "heartbeat", "url": url, "cert": cert}
        rec.report(rid, replica_secret(KEY, rid), body)
        await asyncio.wait_for(waiter, 10)
        (ep,) = rec.endpoints("m")
        assert ep.base_url == url and ep.api_key == engine_api_key(KEY, rid)
    await rec.close()


async def test_requeued_job_loses_its_endpoint_and_is_not_replaced(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    rec.replicas[rid].base_url = "http://n0:1"
    # The agent saw SIGTERM (preemption): it drains by itself; the daemon does not cancel.
    rec.report(rid, replica_secret(KEY, rid), {"event": "draining", "message": "SIGTERM"})
    fake.jobs = [job("7", "m", rid, JobState.COMPLETING)]
    await rec.pass_once()
    fake.jobs = [job("7", "m", rid, JobState.PENDING, restarts=1)]
    await rec.pass_once()
    assert fake.cancelled == [] and fake.submitted == []
    assert rec.replicas[rid].base_url == ""
    assert "requeued" in [d.action for d in rec.decisions]


async def test_a_requeued_replica_back_at_its_old_address_is_a_new_endpoint(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    rid = "0a1b2c3d"
    secret = replica_secret(KEY, rid)
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    app = create_engine_app(EngineOptions(api_key=engine_api_key(KEY, rid), served_name="m"))
    async with serve_engine(app, rec.engine_tls.identity) as (url, cert):

        async def ready() -> Any:
            body = {"event": "ready", "url": url, "cert": cert, "job_id": "7", "node": "n0"}
            rec.report(rid, secret, body)
            await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
            (ep,) = rec.endpoints("m")
            return ep

        first = await ready()
        fake.jobs = [job("7", "m", rid, JobState.PENDING, restarts=1)]
        await rec.pass_once()
        assert rec.endpoints("m") == []
        fake.jobs = [job("7", "m", rid, JobState.RUNNING, restarts=1)]
        await rec.pass_once()
        second = await ready()
        # A heartbeat of the same run is the same endpoint.
        again = await ready()
    assert (second.replica_id, second.base_url) == (first.replica_id, first.base_url)
    assert second.identity != first.identity
    assert again.identity == second.identity
    await rec.close()


async def test_reaped_job_names_its_final_state_from_accounting(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    fake.jobs = []
    fake.accounting_records = [
        AccountingRecord(
            job_id="7",
            name=job_name(PREFIX, "m", rid),
            user="root",
            account="root",
            partition="llm",
            state=JobState.NODE_FAIL,
            exit_code="0:0",
            comment="",
            submit=None,
            start=None,
            end=None,
            elapsed_s=10,
            nodes=1,
            alloc_tres="",
            gpus=1,
        )
    ]
    await rec.pass_once()
    reap = next(d for d in rec.decisions if d.action == "reap")
    assert reap.reason == "job 7 ended: NODE_FAIL"
    # Never served: a failed start, so the restart waits out the backoff.
    assert rec.failures["m"].count == 1
    assert fake.submitted == []


async def test_slurm_down_means_nothing_is_done(tmp_path: Path) -> None:
    from llmgw_slurm.base.errors import SlurmUnavailable

    rec, fake = make(tmp_path, {"min": 1, "max": 1})

    async def down(name_prefix: str = "") -> list[Job]:
        raise SlurmUnavailable("no answer within 30s", command=["squeue"])

    fake.list_jobs = down  # type: ignore[method-assign]
    assert await rec.pass_once() == []
    assert fake.submitted == [] and fake.cancelled == []
    assert "no answer" in rec.last_pass_error


async def test_an_agent_report_shows_the_job_runs_before_the_next_listing(tmp_path: Path) -> None:
    """A held request must not wait a whole pass interval for squeue to say RUNNING."""
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.PENDING)]
    await rec.pass_once()
    assert rec.replicas[rid].state().value == "pending"
    rec.report(
        rid, replica_secret(KEY, rid), {"event": "step", "step": "weights", "status": "started"}
    )
    assert rec.replicas[rid].state().value == "starting"
    assert rec.replicas[rid].started_at is not None


async def test_an_unreadable_listing_stops_the_pass_instead_of_emptying_it(
    tmp_path: Path,
) -> None:
    # squeue answering in another shape (a site wrapper's banner) must not read as
    # "every replica gone": that pass would submit a replacement for each.
    rec, _ = make(tmp_path, {"min": 1, "max": 1})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("squeue", 'echo "Maintenance tonight: please save your work"'),
        ("sinfo", f"cat {Path(__file__).parent / 'data' / 'sinfo.txt'}"),
        ("sbatch", f"touch {bin_dir}/sbatch-ran; echo 1"),
    ):
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    rec.backend = CliBackend(bin_dir=str(bin_dir))
    for _ in range(3):
        await rec.pass_once()
    assert not (bin_dir / "sbatch-ran").exists()
    assert "none of its 1 line(s) is in the format asked for" in rec.last_pass_error
    assert "Maintenance tonight" in rec.last_pass_error


async def test_each_decision_is_logged_as_key_values_with_its_pass_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec, _ = make(tmp_path, {"min": 1, "max": 1})
    with caplog.at_level(logging.INFO, logger="llmgw_slurm.reconciler.core"):
        await rec.pass_once()
    (d,) = [d for d in rec.decisions if d.action == "submit"]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decision ")]
    assert d.pass_id
    assert line == (
        f"decision action=submit model=m replica={d.replica_id} pass={d.pass_id} "
        f'reason="{d.reason}"'
    )


# ---------------------------------------------------------------- per-model hold


async def test_the_gateway_over_the_reconciler_reads_each_models_routing(tmp_path: Path) -> None:
    # The gateway looks up the directory's optional methods by name: one the
    # reconciler lacks is silently "any endpoint, least outstanding".
    rec, _ = make(tmp_path)
    routing = rec.routing("m")
    assert routing is not None and routing.endpoints is not None
    assert "rerank" not in routing.endpoints
    async with serve(create_app(rec)) as url, aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/rerank", json={"model": "m", "query": "q", "documents": []})
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "endpoint_not_served"
    # Nothing was wanted: the refusal comes before any start.
    assert rec.directory.wanted_at().get("m") is None


def test_models_carry_the_per_model_hold_timeout(tmp_path: Path) -> None:
    rec, _ = make(
        tmp_path, names=("big", "small"), scalings={"big": {"max": 1, "hold_timeout": "40m"}}
    )
    info = {m.name: m for m in rec.models()}
    assert info["big"].hold_timeout_s == 2400.0
    # Unset: None, and the router falls back to its own (the server's) deadline.
    assert info["small"].hold_timeout_s is None
    # A reloaded catalog's value is what the next request sees.
    path = tmp_path / "models.yaml"
    path.write_text(path.read_text().replace("hold_timeout: 40m", "hold_timeout: 1h"))
    rec.set_catalog(load_catalog(path))
    assert {m.name: m.hold_timeout_s for m in rec.models()} == {"big": 3600.0, "small": None}


async def test_a_model_with_a_short_hold_gets_503_while_the_server_holds_longer(
    tmp_path: Path,
) -> None:
    # The server holds for an hour; "quick" says 0.01 s in the catalog. Neither
    # has a replica: quick's request gets its 503 while slow's is still held.
    rec, _ = make(
        tmp_path,
        names=("quick", "slow"),
        scalings={"quick": {"max": 1, "hold_timeout": 0.01}},
        router={"hold_timeout": "1h"},
    )
    assert rec.server.router.hold_timeout == 3600.0
    app = create_app(rec, RouterConfig(hold_timeout=rec.server.router.hold_timeout))
    gateway = app[GATEWAY_KEY]
    async with serve(app) as url, aiohttp.ClientSession() as s:
        slow = asyncio.create_task(
            s.post(url + "/v1/completions", json={"model": "slow", "prompt": "a"})
        )
        await eventually(lambda: gateway.held.get("slow") == 1, "slow's request held")
        # The limit only stops a hung test (held for the server's hour), it is not a threshold.
        async with asyncio.timeout(30):
            r = await s.post(url + "/v1/completions", json={"model": "quick", "prompt": "a"})
            body = await r.json()
        assert r.status == 503
        assert r.headers["Retry-After"] == str(RouterConfig().retry_after)
        assert body["error"]["code"] == "model_not_ready"
        assert "after waiting 0.01 s" in body["error"]["message"]
        # The server's deadline still holds the other model's request.
        assert gateway.held.get("slow") == 1 and not slow.done()
        assert gateway.held.get("quick") == 0
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
    await rec.close()


# ---------------------------------------------------------------- eviction, pass by pass
# The eviction rules driven through the whole loop with a fake clock: the real
# Reconciler lists, plans and acts; a fake cluster starts what fits and ends what is
# cancelled; a replica becomes ready through its agent's report and the daemon's own
# probe of a test engine; uses reach the daemon as the gateway reports them.

MIN = 60.0


class FakeCluster(FakeSlurm):
    """Nodes of 4 GPUs that run what fits, first come first served.

    A submitted job is queued (Resources) and starts at a later listing on the
    first node with room; a cancelled running job is listed COMPLETING once, its
    GPUs still held, and is gone from the listing after. No time limits (so no
    renewal in these tests).
    """

    def __init__(self, clock: Clock, nodes: int = 1) -> None:
        super().__init__()
        self.clock = clock
        self.names = [f"n{i}" for i in range(nodes)]
        self.queue: dict[str, Job] = {}
        self.gpus: dict[str, int] = {}
        self.ending: set[str] = set()

    def running(self, model: str, rid: str, started_ago: float) -> str:
        """A job of ours that was running before the daemon (re)started."""
        self.next_id += 1
        job_id = str(self.next_id)
        self.gpus[job_id] = 4
        at = self.clock.t - started_ago
        self.queue[job_id] = self._job(job_id, job_name(PREFIX, model, rid), at, self._room(4), at)
        return job_id

    def _job(self, job_id: str, name: str, submitted: float, node: str, started: float) -> Job:
        state = JobState.RUNNING if node else JobState.PENDING
        nodes = (node,) if node else ()
        return Job(
            job_id=job_id,
            name=name,
            state=state,
            reason="" if node else "Resources",
            partition="llm",
            user="root",
            comment="",
            nodes=nodes,
            submit_time=datetime.fromtimestamp(submitted),
            start_time=datetime.fromtimestamp(started) if node else None,
            time_limit_s=None,
            end_time=None,
            restarts=0,
            components=(
                JobComponent(0, job_id, state, nodes, 1, f"gres/gpu:a100:{self.gpus[job_id]}"),
            ),
        )

    def _room(self, gpus: int) -> str:
        for n in self.names:
            if 4 - sum(self.gpus[j.job_id] for j in self.queue.values() if n in j.nodes) >= gpus:
                return n
        return ""

    async def submit(self, spec: JobSpec) -> str:
        job_id = await super().submit(spec)
        self.gpus[job_id] = int(spec.comment.split("gpus=")[1].split()[0])
        self.queue[job_id] = self._job(job_id, spec.name, self.clock.t, "", 0.0)
        return job_id

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        await super().cancel(job_id, signal=signal, batch_only=batch_only)
        j = self.queue[job_id]
        if j.state is JobState.RUNNING:
            self.queue[job_id] = dataclasses.replace(j, state=JobState.COMPLETING)
        else:
            del self.queue[job_id]

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        self.calls += 1
        self.listings["jobs"] += 1
        for job_id in self.ending:
            del self.queue[job_id]
        self.ending = {i for i, j in self.queue.items() if j.state is JobState.COMPLETING}
        for job_id, j in list(self.queue.items()):
            if j.state is JobState.PENDING:
                n = self._room(self.gpus[job_id])
                if n:
                    sub = j.submit_time.timestamp() if j.submit_time else self.clock.t
                    self.queue[job_id] = self._job(job_id, j.name, sub, n, self.clock.t)
        return [j for j in self.queue.values() if j.name.startswith(name_prefix)]

    async def list_nodes(self) -> list[NodeInfo]:
        self.calls += 1
        self.listings["nodes"] += 1
        return [
            node(n, used=sum(self.gpus[j.job_id] for j in self.queue.values() if n in j.nodes))
            for n in self.names
        ]


def on_demand_world(
    tmp_path: Path, nodes: int = 1, *, fair_share: bool = True
) -> tuple[Reconciler, FakeCluster, Clock]:
    """On-demand models a, b and c, each replica a whole 4-GPU node.

    Eviction grace 5 min, minimum lifetime 10 min; an idle timeout of a day, so
    that only an eviction (or a fair-share drain) stops a replica here.
    """
    rec, _ = make(
        tmp_path,
        {"min": 0, "max": 1, "idle_timeout": "1d"},
        names=("a", "b", "c"),
        gpus=4,
        reconcile={"eviction_grace": "5m", "min_lifetime": "10m"},
        site_scaling={"fair_share": fair_share},
    )
    assert rec.plan_cfg.fair_share is fair_share
    assert (rec.plan_cfg.eviction_grace, rec.plan_cfg.min_lifetime) == (5 * MIN, 10 * MIN)
    clock = Clock()
    rec.clock = clock
    fake = FakeCluster(clock, nodes)
    rec.backend = fake
    return rec, fake, clock


async def agent_reports(
    rec: Reconciler, stack: contextlib.AsyncExitStack, rid: str, event: str = "ready"
) -> None:
    """The replica's agent says its engine is up; the daemon probes it, then routes to it."""
    r = rec.replicas[rid]
    opts = EngineOptions(api_key=engine_api_key(KEY, rid), served_name=r.model)
    url, cert = await stack.enter_async_context(
        serve_engine(create_engine_app(opts), rec.engine_tls.identity)
    )
    body = {"event": event, "url": url, "cert": cert, "job_id": r.job_id, "node": r.nodes[0]}
    rec.report(rid, replica_secret(KEY, rid), body)
    await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
    assert r.state() is ReplicaState.READY


def passes(rec: Reconciler, clock: Clock) -> Callable[..., Awaitable[list[tuple[str, str]]]]:
    """``pass_at(t, *wanted)``: a pass ``t`` seconds after now (the clock's time when
    made), after a request for each of ``wanted``; its actions' (kind, model)."""
    t0 = clock.t

    async def pass_at(t: float, *wanted: str) -> list[tuple[str, str]]:
        clock.t = t0 + t
        for m in wanted:
            rec.want(m)
        return [(x.kind.value, x.model) for x in await rec.pass_once()]

    return pass_at


def served(rec: Reconciler, model: str) -> str:
    """One request served by the model's ready replica, reported as the gateway does."""
    (ep,) = rec.endpoints(model)
    rec.request_started(model, ep.replica_id)
    rec.request_finished(model, ep.replica_id)
    return ep.replica_id


async def a_used_until_9_min(
    rec: Reconciler,
    stack: contextlib.AsyncExitStack,
    clock: Clock,
    pass_at: Callable[..., Awaitable[list[tuple[str, str]]]],
) -> str:
    """a comes up for a request (ready at 1 min) and serves it; it is last used at 9
    min (from ``pass_at``'s start). Its replica id."""
    t0 = clock.t
    assert await pass_at(0, "a") == [("submit", "a")]
    assert await pass_at(10) == []
    clock.t = t0 + 1 * MIN
    (a,) = rec.replicas
    await agent_reports(rec, stack, a)
    served(rec, "a")
    clock.t = t0 + 9 * MIN
    served(rec, "a")
    return a


async def test_two_models_that_fit_one_at_a_time_do_not_evict_each_other_in_turn(
    tmp_path: Path,
) -> None:
    # Eviction's rules alone: fair share would drain a, idle within its grace, once b
    # has waited max_wait (tests/unit/test_plan_fair_share.py).
    rec, fake, clock = on_demand_world(tmp_path, fair_share=False)
    t0 = clock.t
    acted: list[tuple[float, str, str]] = []

    async def pass_at(t: float, *wanted: str) -> list[tuple[str, str]]:
        clock.t = t0 + t
        for m in wanted:
            rec.want(m)  # a request arrives (or its client retries after a 503)
        actions = [(a.kind.value, a.model) for a in await rec.pass_once()]
        acted.extend((t, kind, model) for kind, model in actions)
        return actions

    async with contextlib.AsyncExitStack() as stack:
        a = await a_used_until_9_min(rec, stack, clock, pass_at)
        assert rec.replicas[a].ready_at == t0 + 1 * MIN

        # A request for b, 1 min after a's last use, 9 min after it became ready:
        # b is queued, a is not evicted, and the placement says why.
        assert await pass_at(10 * MIN, "b") == [("submit", "b")]
        b_job = fake.submitted[-1]
        assert rec.notes["b"] == (
            "no room: needs 1 node(s) with 4 free gpu:a100; n0: 0 gpu:a100 free; "
            f"nothing idle enough to stop (a {a}: used 1m00s ago, grace 5m00s)"
        )
        (sub_b,) = [d for d in rec.decisions if d.action == "submit" and d.model == "b"]
        assert sub_b.reason.endswith(
            "no room now: needs 1 node(s) with 4 free gpu:a100; n0: 0 gpu:a100 free; "
            f"nothing idle enough to stop (a {a}: used 1m00s ago, grace 5m00s)"
        )
        # Its minimum lifetime is over, but a was used within the eviction grace.
        assert await pass_at(11 * MIN) == []
        assert rec.notes["b"] == (
            "queued (Resources): needs 1 node(s) with 4 free gpu:a100; n0: 0 gpu:a100 free; "
            f"nothing idle enough to stop (a {a}: used 2m00s ago, grace 5m00s)"
        )
        assert await pass_at(14 * MIN - 1) == []
        assert rec.notes["b"].endswith(
            f"; nothing idle enough to stop (a {a}: used 4m59s ago, grace 5m00s)"
        )
        # Idle the whole grace: a is evicted, once, for b.
        assert await pass_at(14 * MIN) == [("evict", "a")]
        (ev_a,) = [d for d in rec.decisions if d.action == "evict"]
        assert (ev_a.model, ev_a.replica_id) == ("a", a)
        assert ev_a.reason == "evicted, idle 5m00s, to make room for b"
        assert rec.notes["b"].endswith("; evicting a replica " + a + " (idle 5m00s)")
        # a's job is still ending: nothing else is stopped, b waits for its GPUs.
        assert await pass_at(14 * MIN + 10) == []
        assert rec.notes["b"].endswith("; waiting for an evicted replica to give its GPUs back")
        # a's job is gone; Slurm starts b on its node.
        assert await pass_at(14 * MIN + 20) == []
        assert a not in rec.replicas
        (b,) = rec.replicas
        assert rec.replicas[b].nodes == ("n0",) and "b" not in rec.notes
        assert fake.queue[rec.replicas[b].job_id].name == b_job.name

        # b becomes ready and serves the request that waited for it; right after, a
        # request for a. b is used once more, 2 min after it became ready.
        clock.t = t0 + 15 * MIN
        await agent_reports(rec, stack, b)
        served(rec, "b")
        assert await pass_at(15 * MIN + 10, "a") == [("submit", "a")]
        assert rec.notes["a"].endswith(
            f"; nothing idle enough to stop (b {b}: used 10s ago, grace 5m00s)"
        )
        clock.t = t0 + 17 * MIN
        served(rec, "b")
        # Idle the whole grace, but ready for only 7 min: the minimum lifetime alone
        # keeps b (the waiting client of a retries after each 503).
        assert await pass_at(22 * MIN, "a") == []
        assert rec.notes["a"] == (
            "queued (Resources): needs 1 node(s) with 4 free gpu:a100; n0: 0 gpu:a100 free; "
            f"nothing idle enough to stop (b {b}: ready 7m00s, min lifetime 10m00s)"
        )
        assert await pass_at(25 * MIN - 1, "a") == []
        assert await pass_at(25 * MIN, "a") == [("evict", "b")]
        assert [d.reason for d in rec.decisions if d.action == "evict"][-1] == (
            "evicted, idle 8m00s, to make room for a"
        )
        assert await pass_at(25 * MIN + 10, "a") == []
        assert await pass_at(25 * MIN + 20, "a") == []
        (a2,) = rec.replicas
        assert rec.replicas[a2].model == "a" and rec.replicas[a2].state() is ReplicaState.STARTING
    await rec.close()

    # Every action of every pass: one eviction each way, the second a whole minimum
    # lifetime after the first, and nothing cancelled or drained besides.
    evictions = [(t, m) for t, kind, m in acted if kind == "evict"]
    assert evictions == [(14 * MIN, "a"), (25 * MIN, "b")]
    assert evictions[1][0] - evictions[0][0] >= rec.plan_cfg.min_lifetime
    assert [(kind, m) for _, kind, m in acted] == [
        ("submit", "a"),
        ("submit", "b"),
        ("evict", "a"),
        ("submit", "a"),
        ("evict", "b"),
    ]
    assert len(fake.cancelled) == 2
    assert [s.comment.split()[1] for s in fake.submitted] == ["model=a", "model=b", "model=a"]


async def test_with_fair_share_a_replica_its_users_left_goes_once_the_other_waited(
    tmp_path: Path,
) -> None:
    # The same start as above, fair share on: a, idle inside its eviction grace, is
    # drained for b once b has waited max_wait (2 min) and a has had its turn (its
    # 10-minute minimum lifetime), 2 minutes before eviction could take it.
    rec, _, clock = on_demand_world(tmp_path)
    pass_at = passes(rec, clock)

    async with contextlib.AsyncExitStack() as stack:
        a = await a_used_until_9_min(rec, stack, clock, pass_at)
        assert await pass_at(10 * MIN, "b") == [("submit", "b")]
        # Not yet: b has waited 1 min; the note says when a may go.
        assert await pass_at(11 * MIN) == []
        assert rec.notes["b"].endswith(
            f"fair share: a {a} may be drained for b in 1m00s, if b still waits then "
            "(max_wait 2m00s)"
        )
        assert await pass_at(12 * MIN) == [("drain", "a")]
        (drain,) = [d for d in rec.decisions if d.model == "a" and d.replica_id == a][-1:]
        assert drain.reason == (
            "fair share: making room for b (waiting 2m00s, max_wait 2m00s); held 4 GPU(s) "
            "11m00s, past its 10m00s turn, unused for 3m00s"
        )
        assert rec.notes["a"] == f"{a} draining: {drain.reason}"
    await rec.close()


async def test_after_a_restart_nothing_is_evictable_until_a_use_is_reported(
    tmp_path: Path,
) -> None:
    # A daemon just restarted: a and c, on-demand, each run on a whole node (their jobs
    # started 5 min before), and a request for b arrives. Eviction alone (rule 3): with
    # fair share, a is drained for b once it serves while b waits (the next test).
    rec, fake, clock = on_demand_world(tmp_path, nodes=2, fair_share=False)
    t0 = clock.t
    a, c = "0a0a0a0a", "0c0c0c0c"
    a_job, c_job = fake.running("a", a, 5 * MIN), fake.running("c", c, 5 * MIN)
    # (Started within the start deadline: see the test below for older jobs.)

    async def pass_at(t: float, *wanted: str) -> list[tuple[str, str]]:
        clock.t = t0 + t
        for m in wanted:
            rec.want(m)
        return [(x.kind.value, x.model) for x in await rec.pass_once()]

    no_room = "needs 1 node(s) with 4 free gpu:a100; n0: 0 gpu:a100 free; n1: 0 gpu:a100 free; "
    async with contextlib.AsyncExitStack() as stack:
        assert await pass_at(0, "b") == [("submit", "b")]
        assert [(d.action, d.model) for d in rec.decisions] == [
            ("adopt", "a"),
            ("adopt", "c"),
            ("submit", "b"),
        ]
        # Not ready yet (no agent has reported to this daemon): no candidates at all.
        assert rec.notes["b"] == "no room: " + no_room + (
            "nothing idle enough to stop "
            "(no other model has a replica ready and not already stopping)"
        )
        assert [rec.replicas[r].state() for r in (a, c)] == [ReplicaState.STARTING] * 2
        # Their agents' next heartbeats: both serve again, adopted, last use unknown.
        clock.t = t0 + 10
        for rid in (a, c):
            await agent_reports(rec, stack, rid, event="heartbeat")
            r = rec.replicas[rid]
            assert (r.adopted, r.ready_at, r.last_used) == (True, t0 + 10, None)
        # Ready past the minimum lifetime and the eviction grace, for 50 min with no
        # use reported (b's job stays queued: under max_pending_time, 1h): unknown is
        # not idle, so nothing is evicted for b.
        for t in (1 * MIN, 11 * MIN, 16 * MIN, 50 * MIN):
            assert await pass_at(t, "b") == []
            assert rec.notes["b"] == "queued (Resources): " + no_room + (
                f"nothing idle enough to stop (a {a}: last use unknown; c {c}: last use unknown)"
            )
        assert fake.cancelled == []
        status = {m["name"]: m for m in rec.status()["models"]}
        assert [(x["adopted"], x["idle_s"]) for x in status["a"]["replicas"]] == [(True, None)]
        # The unknown last use, and nothing else, is what keeps them: the same views
        # with a last use at adoption would be candidates.
        views = [view_of(rec.replicas[r]) for r in (a, c)]
        now, models = clock.t, rec.table.models()
        assert planmod.evictable("b", views, models, rec.plan_cfg, now) == []
        known = [dataclasses.replace(v, last_used=v.ready_at) for v in views]
        assert planmod.evictable("b", known, models, rec.plan_cfg, now) == known

        # A request for a: a's last use is known now, c's still is not. a is a
        # candidate once idle the whole grace (its minimum lifetime is long over).
        clock.t = t0 + 51 * MIN
        assert served(rec, "a") == a
        assert await pass_at(51 * MIN + 10, "b") == []
        assert await pass_at(56 * MIN - 1, "b") == []
        assert await pass_at(56 * MIN, "b") == [("evict", "a")]
        assert rec.decisions[-1].reason == "evicted, idle 5m00s, to make room for b"
        assert fake.cancelled == [a_job]
        assert await pass_at(56 * MIN + 10, "b") == []
        assert await pass_at(56 * MIN + 20, "b") == []
        (b,) = [r for r in rec.replicas.values() if r.model == "b"]
        assert b.nodes == ("n0",)
        # c was never reported used: still not a candidate, whatever the clock says.
        assert rec.replicas[c].last_used is None and c_job not in fake.cancelled
    await rec.close()


async def test_after_a_restart_a_replica_in_use_while_a_model_waits_is_drained_for_it(
    tmp_path: Path,
) -> None:
    # The same restart with fair share (server.yaml's scaling, on by default): b waits
    # behind a and c, whose last use is unknown. Once a serves somebody while b has
    # waited past max_wait (2m) and a has had its turn (10m from its adoption), a is
    # drained for b; c, whose use nobody has reported, is not.
    rec, fake, clock = on_demand_world(tmp_path, nodes=2)
    t0 = clock.t
    a, c = "0a0a0a0a", "0c0c0c0c"
    a_job, c_job = fake.running("a", a, 5 * MIN), fake.running("c", c, 5 * MIN)
    pass_at = passes(rec, clock)

    async with contextlib.AsyncExitStack() as stack:
        assert await pass_at(0, "b") == [("submit", "b")]
        clock.t = t0 + 10
        for rid in (a, c):
            await agent_reports(rec, stack, rid, event="heartbeat")
        for t in (1 * MIN, 11 * MIN, 50 * MIN):
            assert await pass_at(t, "b") == []
        # a serves a request that is still in flight at the next passes. b's client
        # asked last at 11 min: its request of 50 min is a new wait (the hold window
        # is 5 min), which reaches max_wait at 52 min.
        clock.t = t0 + 51 * MIN
        (ep,) = rec.endpoints("a")
        rec.request_started("a", ep.replica_id)
        assert await pass_at(51 * MIN + 10, "b") == []
        assert rec.notes["b"].endswith(
            f"; fair share: a {a} may be drained for b in 50s, "
            "if b still waits then (max_wait 2m00s)"
        )
        assert await pass_at(52 * MIN, "b") == [("drain", "a")]
        (drain,) = [d for d in rec.decisions if d.action == "drain"]
        assert (drain.model, drain.replica_id) == ("a", a)
        assert drain.reason == (
            "fair share: making room for b (waiting 2m00s, max_wait 2m00s); "
            "held 4 GPU(s) 51m50s, past its 10m00s turn"
        )
        assert rec.notes["b"].endswith(
            f"; fair share: draining a {a} (serving 51m50s, past its 10m00s turn; "
            "1 request(s) in flight finish first)"
        )
        assert rec.notes["a"] == f"{a} draining: {drain.reason}"
        # Drained, not killed: while its request is in flight, a is not cancelled,
        # and nothing else is stopped for b.
        assert await pass_at(52 * MIN + 10, "b") == []
        assert fake.cancelled == []
        assert rec.notes["b"].endswith(
            "; waiting for a replica drained for fair share to give its GPUs back"
        )
        rec.request_finished("a", ep.replica_id)
        assert await pass_at(52 * MIN + 20, "b") == [("cancel", "a")]
        assert rec.decisions[-1].reason == f"drained ({drain.reason})"
        assert fake.cancelled == [a_job]
        assert await pass_at(52 * MIN + 30, "b") == []
        assert await pass_at(52 * MIN + 40, "b") == []
        (b,) = [r for r in rec.replicas.values() if r.model == "b"]
        assert b.nodes == ("n0",)
        assert c_job not in fake.cancelled
    await rec.close()


async def test_a_restart_does_not_cancel_a_job_that_started_long_before(tmp_path: Path) -> None:
    # DESIGN: adopted, never killed. The first pass after a restart runs before any
    # agent's next heartbeat (and a heartbeat only starts the probe), so an adopted
    # replica is STARTING. Timed from its job's start (two hours ago), the start
    # deadline (agent_ready_timeout + 120 s) had long passed, and every replica older
    # than it was cancelled as a failed start: the deadline now runs from adoption.
    rec, fake, clock = on_demand_world(tmp_path)
    fake.running("a", "0a0a0a0a", 120 * MIN)
    actions = await rec.pass_once()
    assert [(x.kind.value, x.reason) for x in actions] == []
    assert fake.cancelled == [] and "a" not in rec.failures
    # Its agent never comes back: the whole deadline, from the adoption, then a cancel.
    limit = rec.plan_cfg.start_timeout
    clock.t += limit - 1
    assert await rec.pass_once() == [] and fake.cancelled == []
    clock.t += 2
    (cancel,) = await rec.pass_once()
    assert cancel.kind.value == "cancel" and cancel.failure
    assert cancel.reason == f"not ready {format_duration(limit + 1)} after it was adopted"


async def test_an_engine_address_without_its_certificate_is_never_probed(tmp_path: Path) -> None:
    """The engine key goes only where a pinned handshake can succeed: an https address
    without a certificate, or plain http for a model whose engine serves TLS, is refused
    before any connection is made."""
    rec, fake = make(tmp_path)
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    opts = EngineOptions(api_key=engine_api_key(KEY, rid), served_name="m")
    async with serve(create_engine_app(opts)) as plain_url:
        for body in (
            {"event": "ready", "url": plain_url.replace("http:", "https:")},
            {"event": "ready", "url": plain_url},
            {"event": "heartbeat", "url": plain_url, "cert": "junk"},
        ):
            rec.report(rid, replica_secret(KEY, rid), body)
            assert rec.probe.tasks == set()  # no probe started
            assert rec.decisions[-1].action == "probe-refused"
    assert rec.endpoints("m") == []
    # The same engine behind TLS, named with its certificate, is routed, pinned.
    async with serve_engine(create_engine_app(opts), rec.engine_tls.identity) as (url, cert):
        rec.report(rid, replica_secret(KEY, rid), {"event": "ready", "url": url, "cert": cert})
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        (ep,) = rec.endpoints("m")
        assert ep.base_url == url and ep.ssl is rec.engine_tls.get(cert)
    await rec.close()


async def test_a_model_without_tls_is_routed_over_plain_http(tmp_path: Path) -> None:
    rec, fake = make(tmp_path)
    rec.set_catalog(
        Catalog(
            tuple(
                dataclasses.replace(m, engine=dataclasses.replace(m.engine, tls=False))
                for m in rec.catalog.models
            )
        )
    )
    rid = "0a1b2c3d"
    fake.jobs = [job("7", "m", rid, JobState.RUNNING)]
    await rec.pass_once()
    opts = EngineOptions(api_key=engine_api_key(KEY, rid), served_name="m")
    async with serve(create_engine_app(opts)) as url:
        rec.report(rid, replica_secret(KEY, rid), {"event": "ready", "url": url})
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        (ep,) = rec.endpoints("m")
        assert ep.base_url == url and ep.ssl is None
    await rec.close()


async def test_jobs_carry_the_gateways_certificate_and_never_its_key(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    await rec.pass_once()
    (spec,) = fake.submitted
    ident = rec.engine_tls.identity
    assert spec.env["LLMGW_GATEWAY_CERT"] == ident.cert_pem
    key_pem = ident.key_file.read_text()
    assert all(key_pem.strip() not in v for v in spec.env.values())
    assert key_pem.strip() not in spec.script


async def test_the_decision_log_says_where_slurm_ran_the_job_not_the_plans_guess(
    tmp_path: Path,
) -> None:
    """The submit decision tells where the plan saw room; a "running" decision tells where
    Slurm started the job (issue 40: "job 31; gpunode1", then "serving at gpunode3")."""
    rec, fake = make(tmp_path)
    rec.want("m")
    (a,) = await rec.pass_once()
    (sub,) = [d for d in rec.decisions if d.action == "submit"]
    assert sub.reason.endswith(f"; job {fake.next_id}; room now on {a.placement}")
    assert a.placement == "n0"
    listed = job(str(fake.next_id), "m", a.replica_id, JobState.RUNNING)
    fake.jobs = [dataclasses.replace(listed, nodes=("n1",))]
    await rec.pass_once()
    await rec.pass_once()
    (ran,) = [d for d in rec.decisions if d.action == "running"]
    assert (ran.replica_id, ran.reason) == (a.replica_id, f"job {fake.next_id} on n1")
