"""What a pass keeps from the last one: each replica's plan view, and the job it last applied.

Both are kept only while nothing they were made from has changed; a kept one
that is stale would be a real fault (an idle replica evicted while it serves,
a scale-down counting a replica that left), so these tests change each input
and check that the next pass sees the change.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path
from typing import Any

from test_reconciler_core import KEY, job, make  # type: ignore[import-not-found]

from llmgw_slurm.auth.secrets import replica_secret
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.reconciler.replicas import Replica, build_view, view_of
from llmgw_slurm.slurm.types import JobState

RID = "0a1b2c3d"

# A value unlike the default for every field of Replica: a new field must be added
# here (the test below fails until it is), so that its effect on the view is checked.
OTHER: dict[str, Any] = {
    "replica_id": "ffffffff",
    "model": "other",
    "job_id": "999",
    "submitted_at": 123.0,
    "job_state": JobState.RUNNING,
    "reason": "Priority",
    "nodes": ("n1", "n2"),
    "node_count": 2,
    "gpus_per_node": 4,
    "restarts": 3,
    "ends_at": 42.0,
    "started_at": 5.0,
    "ready_at": 6.0,
    "base_url": "http://n1:9",
    "engine_cert": "a certificate",
    "epoch": 7,
    "last_used": 8.0,
    "in_flight": 9,
    "remote_in_flight": 3,
    "remote_last_used": 8.5,
    "engine_waiting": 4,
    "draining_since": 10.0,
    "drain_reason": "admin",
    "stop_reason": "stopped",
    "agent_draining": "SIGTERM",
    "agent_failed": "oom",
    "replaces": "eeeeeeee",
    "step": "weights done",
    "step_seconds": {"weights": 1.0},
    "last_report": 11.0,
    "first_report_at": 12.0,
    "adopted": True,
    "adopted_at": 13.0,
    "requeued": True,
    "cluster": "b",
    "stranded": True,
}
BOOKKEEPING = {"listed", "view"}


def fresh() -> Replica:
    return Replica(replica_id=RID, model="m", job_id="7", submitted_at=1.0)


def test_every_field_is_covered() -> None:
    names = {f.name for f in dataclasses.fields(Replica)} - BOOKKEEPING
    assert names == set(OTHER)


def test_a_kept_view_is_reused_until_any_field_changes() -> None:
    for name, value in OTHER.items():
        r = fresh()
        kept = view_of(r)
        assert view_of(r) is kept  # nothing changed: the same view
        setattr(r, name, value)
        now = view_of(r)
        # Whatever changed, the view is what a view built from scratch says.
        assert now == build_view(r), name
        assert view_of(r) is now


def test_each_input_of_the_view_reaches_it() -> None:
    # Guards the test above against a view that ignores its inputs: every field the
    # plan reads shows a change (state through job_state, base_url and the rest).
    reads = {
        "replica_id",
        "model",
        "job_id",
        "submitted_at",
        "job_state",
        "reason",
        "node_count",
        "gpus_per_node",
        "ends_at",
        "started_at",
        "adopted_at",
        "ready_at",
        "last_used",
        "in_flight",
        "engine_waiting",
        "draining_since",
        "drain_reason",
        "stop_reason",
        "agent_draining",
        "agent_failed",
        "replaces",
    }
    for name in reads:
        r = fresh()
        before = view_of(r)
        setattr(r, name, OTHER[name])
        assert view_of(r) != before, name


async def test_a_request_reaches_the_next_pass_view(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 0, "max": 1})
    fake.jobs = [job("7", "m", RID, JobState.RUNNING)]
    await rec.pass_once()
    r = rec.replicas[RID]
    r.base_url = "http://n0:1"
    await rec.pass_once()
    kept = r.view
    assert kept is not None and kept.state is ReplicaState.READY and kept.in_flight == 0
    await rec.pass_once()
    assert r.view is kept  # an unchanged replica keeps its view from pass to pass
    rec.request_started("m", RID)
    await rec.pass_once()
    assert r.view is not kept and r.view is not None
    assert r.view.in_flight == 1 and r.view.last_used == r.last_used
    rec.request_finished("m", RID)
    await rec.pass_once()
    assert r.view.in_flight == 0


async def test_the_same_listed_job_is_skipped_but_a_change_is_applied(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    pending = job("7", "m", RID, JobState.PENDING)
    fake.jobs = [pending]
    await rec.pass_once()
    r = rec.replicas[RID]
    assert r.listed is pending and r.job_state is JobState.PENDING
    kept = r.view
    await rec.pass_once()
    assert r.listed is pending and r.view is kept  # nothing assigned
    # An agent's report says it runs before the listing does: the same listed job must
    # be applied again next pass, not skipped, so the listing corrects the guess.
    rec.report(RID, replica_secret(KEY, RID), {"event": "step", "step": "weights"})
    assert r.job_state is JobState.RUNNING and r.listed is None
    await rec.pass_once()
    assert r.job_state is JobState.PENDING and r.reason == "Resources"
    assert rec.replicas[RID].view is not None
    assert rec.replicas[RID].view.state is ReplicaState.PENDING  # type: ignore[union-attr]
    # Any listed field assigned by someone else is put back by the next listing.
    for name, value, listed in (
        ("ends_at", 1.0, None),
        ("restarts", 5, pending.restarts),
        ("nodes", ("nX",), pending.nodes),
    ):
        setattr(r, name, value)
        await rec.pass_once()
        assert getattr(r, name) == listed, name
        assert r.listed is pending
    # A new listing of the job (its limit extended) is applied, and reaches the view.
    moved = dataclasses.replace(pending, end_time=datetime.fromtimestamp(100_000))
    fake.jobs = [moved]
    await rec.pass_once()
    assert r.listed is moved and r.ends_at == 100_000
    assert r.view is not None and r.view.ends_at == 100_000
    assert fake.submitted == [] and fake.cancelled == []


async def test_a_job_that_leaves_the_listing_is_reaped_though_skipped_before(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    fake.jobs = [job("7", "m", RID, JobState.PENDING)]
    await rec.pass_once()
    await rec.pass_once()
    assert RID in rec.replicas and fake.submitted == []
    fake.jobs = []
    await rec.pass_once()
    assert RID not in rec.replicas
    assert [(d.action, d.replica_id) for d in rec.decisions][1] == ("reap", RID)
    assert all(v.replica_id != RID for v in map(view_of, rec.replicas.values()))


async def test_job_names_are_remembered_but_not_forever(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, {"min": 0, "max": 100})
    fake.jobs = [job(str(i), "m", f"{i:08x}", JobState.PENDING) for i in range(200)]
    await rec.pass_once()
    assert len(rec.replicas) == 200
    fake.jobs = [job("1", "m", f"{1:08x}", JobState.PENDING)]
    await rec.pass_once()
    await rec.pass_once()
    assert len(rec.replicas) == 1
    assert len(rec.pass_loop._idents) <= 2 * len(fake.jobs) + 64
