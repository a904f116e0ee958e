"""The reconciler's runtime without Slurm: reports, probing, adoption, requeue, reaping.

The Slurm side is a fake that holds a job list the test sets and records what
it is asked; it refuses any call it does not implement. The Slurm-level tests
(tests/slurm/test_reconciler.py) run the same code against the real cluster.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from _router_support import eventually, serve  # type: ignore[import-not-found]

from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.config import load_server_config
from llmgw_slurm.errors import SlurmUnavailable
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.reconciler.jobs import job_name, parse_job_name
from llmgw_slurm.router import GATEWAY_KEY, RouterConfig, create_app
from llmgw_slurm.secrets import engine_api_key, replica_secret
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
) -> tuple[Reconciler, FakeSlurm]:
    """A reconciler over a fake Slurm; ``scalings`` gives some models their own scaling."""
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
    assert d.reason.endswith("; n1")


async def evicting_world(tmp_path: Path, first: list[NodeInfo]) -> tuple[Reconciler, FakeSlurm]:
    """Models a and b, one 4-GPU node for either; a's replica ready and idle an hour."""
    # Idle for a day before a scale-down: only an eviction stops a here.
    rec, fake = make(tmp_path, {"min": 0, "max": 1, "idle_timeout": "1d"}, names=("a", "b"), gpus=4)
    rec.clock = clock = Clock()
    fake.nodes = first
    fake.jobs = [job("7", "a", "0a1b2c3d", JobState.RUNNING)]
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
    async with serve(create_engine_app(wrong)) as bad_url:
        rec.report(rid, replica_secret(KEY, rid), {"event": "ready", "url": bad_url})
        await asyncio.wait_for(asyncio.gather(*rec._tasks), 10)
        assert rec.endpoints("m") == []
        assert rec.decisions[-1].action == "probe-failed"
        assert "HTTP 401" in rec.decisions[-1].reason
    async with serve(create_engine_app(good)) as url:
        waiter = asyncio.create_task(rec.wait_ready("m"))
        rec.report(rid, replica_secret(KEY, rid), {"event": "heartbeat", "url": url})
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
    async with serve(app) as url:

        async def ready() -> Any:
            rec.report(rid, secret, {"event": "ready", "url": url, "job_id": "7", "node": "n0"})
            await asyncio.wait_for(asyncio.gather(*rec._tasks), 10)
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
    from llmgw_slurm.errors import SlurmUnavailable

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
    app = create_app(rec, RouterConfig(hold_timeout_s=rec.server.router.hold_timeout))
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
        assert r.headers["Retry-After"] == str(RouterConfig().retry_after_s)
        assert body["error"]["code"] == "model_not_ready"
        assert "after waiting 0.01 s" in body["error"]["message"]
        # The server's deadline still holds the other model's request.
        assert gateway.held.get("slow") == 1 and not slow.done()
        assert gateway.held.get("quick") == 0
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
    await rec.close()
