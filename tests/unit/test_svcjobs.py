"""Model jobs and engine installs: their names, and how the daemon follows them.

The reconciler's fake Slurm (from test_reconciler_core) rejects what it does
not know; the passes here check that service jobs share the one listing and
the one accounting call, and are never taken for replicas.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path

import pytest
from test_reconciler_core import PREFIX, job, make  # type: ignore[import-not-found]

from llmgw_slurm.reconciler.jobs import parse_job_name
from llmgw_slurm.reconciler.svcjobs import (
    ServiceJobBuilder,
    job_log_path,
    parse_service_job_name,
    service_job_name,
)
from llmgw_slurm.slurm.types import AccountingRecord, JobState


def test_service_job_names_round_trip_and_are_never_replicas() -> None:
    for kind, target in (("fetch", "llama-3.1-8b"), ("install", "vllm-0.6.3")):
        name = service_job_name(PREFIX, kind, target, "0a1b2c3d")
        assert parse_service_job_name(PREFIX, name) == (kind, target, "0a1b2c3d")
        assert parse_job_name(PREFIX, name) is None
    # A model may be called "job.fetch.x": its replicas stay replicas.
    assert parse_job_name(PREFIX, f"{PREFIX}job.fetch.x.0a1b2c3d") == ("job.fetch.x", "0a1b2c3d")
    assert parse_service_job_name(PREFIX, f"{PREFIX}job.fetch.x.0a1b2c3d") is None
    assert parse_service_job_name(PREFIX, f"{PREFIX}_job.delete.x.0a1b2c3d") is None
    assert parse_service_job_name(PREFIX, f"{PREFIX}_job.fetch.x.nothex00") is None
    with pytest.raises(ValueError, match="valid: fetch, install"):
        service_job_name(PREFIX, "delete", "x", "0a1b2c3d")


def test_builder_puts_the_spec_in_the_environment_and_the_target_in_the_comment(
    tmp_path: Path,
) -> None:
    rec, _ = make(tmp_path)
    b = ServiceJobBuilder(rec.server, python="/usr/bin/python3")
    spec = b.fetch(rec.catalog.models[0], time="30")
    assert parse_service_job_name(PREFIX, spec.name)[:2] == ("fetch", "m")  # type: ignore[index]
    assert '"name": "m"' in spec.env["LLMGW_REPLICA_SPEC"].replace('":"', '": "')
    assert "llmgw_slurm.agent.main" in spec.script and " fetch" in spec.script
    assert "LLMGW_REPLICA_SECRET" not in spec.env
    inst = b.install("venv", "/opt/engines/My Engine".replace(" ", "_"), packages=["x==1"])
    assert parse_service_job_name(PREFIX, inst.name)[:2] == ("install", "my_engine")  # type: ignore[index]
    assert inst.comment == "llmgw job=install kind=venv target=/opt/engines/My_Engine"


def svc_job(job_id: str, name: str, state: JobState, comment: str = "") -> object:
    return dataclasses.replace(job(job_id, "m", "0a1b2c3d", state), name=name, comment=comment)


def record(job_id: str, name: str, state: JobState) -> AccountingRecord:
    return AccountingRecord(
        job_id=job_id,
        name=name,
        user="root",
        account="root",
        partition="llm",
        state=state,
        exit_code="1:0" if state is JobState.FAILED else "0:0",
        comment="",
        submit=None,
        start=None,
        end=None,
        elapsed_s=12,
        nodes=1,
        alloc_tres="",
        gpus=0,
    )


async def test_status_follows_a_fetch_from_the_listing_to_its_final_state(tmp_path: Path) -> None:
    rec, fake = make(tmp_path)
    name = service_job_name(PREFIX, "fetch", "m", "0a1b2c3d")
    fake.jobs = [svc_job("9", name, JobState.RUNNING, "llmgw job=fetch target=m")]  # type: ignore[list-item]
    await rec.pass_once()
    assert fake.calls == 2  # the listing and sinfo: nothing more for the job
    (st,) = rec.status()["jobs"]
    assert (st["kind"], st["target"], st["state"], st["ended_at"]) == (
        "fetch",
        "m",
        "RUNNING",
        None,
    )
    assert not rec.replicas and fake.submitted == []
    log = job_log_path(rec.server, name, "9")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("llmgw: job 9 on n0\n\nError: weights: copy source /w does not exist\n\n")
    fake.jobs = []
    fake.accounting_records = [record("9", name, JobState.FAILED)]
    await rec.pass_once()
    assert fake.calls == 4  # listing and one accounting call (the nodes listed in the first)
    (st,) = rec.status()["jobs"]
    assert st["state"] == "FAILED" and st["exit_code"] == "1:0" and st["elapsed_s"] == 12
    assert st["message"] == "Error: weights: copy source /w does not exist"
    await rec.pass_once()
    assert fake.calls == 5  # settled: no more accounting
    assert not [d for d in rec.decisions if d.action in ("adopt", "reap")]


async def test_an_announced_job_that_ended_unlisted_is_settled_and_kept_for_an_hour(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    rec, fake = make(tmp_path)
    rec.clock = lambda: now[0]
    name = service_job_name(PREFIX, "install", "e", "0a1b2c3d")
    assert not rec.service_jobs.expect("5", "other.job", "", now[0])
    assert rec.service_jobs.expect("5", name, "/opt/e", now[0])
    fake.accounting_records = [record("5", name, JobState.COMPLETED)]
    await rec.pass_once()
    (st,) = rec.status()["jobs"]
    assert (st["state"], st["target"]) == ("COMPLETED", "/opt/e")
    now[0] += 3500
    await rec.pass_once()
    assert rec.status()["jobs"]
    now[0] += 200
    await rec.pass_once()
    assert rec.status()["jobs"] == []


async def test_a_job_accounting_never_ends_is_shown_as_unknown_not_asked_forever(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path)
    name = service_job_name(PREFIX, "fetch", "m", "0a1b2c3d")
    rec.service_jobs.expect("5", name, "m", datetime.now().timestamp())
    for _ in range(3):
        await rec.pass_once()
    (st,) = rec.status()["jobs"]
    assert st["state"] == "UNKNOWN" and "final state unknown" in st["reason"]
    before = fake.calls
    await rec.pass_once()
    assert fake.calls == before + 1  # the listing (nodes kept from the first pass), no sacct
