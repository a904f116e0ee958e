"""What ``llmgw-admin status``, ``llmgw models`` and the status page show of the reconciler.

Read-only: built from the replica table and what the last pass left (its
notes, the failed starts), on request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw_slurm.catalog import Model
from llmgw_slurm.reconciler.plan import Failures, ReplicaState
from llmgw_slurm.reconciler.replicas import Replica, ReplicaTable, view_of
from llmgw_slurm.svcjobs import ServiceJobs

__all__ = ["model_state", "replica_status", "status"]


def status(
    table: ReplicaTable,
    *,
    notes: Mapping[str, str],
    failures: Mapping[str, Failures],
    give_up_after: int,
    passes: int,
    last_pass_error: str,
    service_jobs: ServiceJobs,
) -> dict[str, Any]:
    """The models, their replicas, the last decisions and the service's jobs, for the API."""
    now = table.clock()
    models = []
    for m in table.catalog.models:
        reps = [r for r in table.replicas.values() if r.model == m.name]
        models.append(
            {
                "name": m.name,
                "aliases": list(m.aliases),
                "gpus": m.resources.gpus * m.resources.nodes,
                "min": m.scaling.min,
                "max": m.scaling.max,
                "state": model_state(m, reps, failures.get(m.name), give_up_after),
                "note": notes.get(m.name, ""),
                "replicas": [replica_status(r, now) for r in reps],
            }
        )
    return {
        "models": models,
        "passes": passes,
        "last_pass_error": last_pass_error,
        "decisions": [
            {
                "at": d.at,
                "action": d.action,
                "model": d.model,
                "replica": d.replica_id,
                "reason": d.reason,
                "pass": d.pass_id,
                **({"daemon": d.daemon} if d.daemon else {}),
            }
            # Sorted: other daemons' decisions arrive through the database a moment late.
            for d in sorted(table.decisions, key=lambda d: d.at)[-50:]
        ],
        "jobs": service_jobs.status(now),
    }


def model_state(m: Model, reps: list[Replica], f: Failures | None, give_up_after: int) -> str:
    states = [r.state() for r in reps]
    n_ready = states.count(ReplicaState.READY)
    if n_ready:
        return f"ready {n_ready}"
    if f is not None and f.count >= give_up_after:
        return "failing"
    if ReplicaState.STARTING in states:
        return "starting"
    if ReplicaState.PENDING in states:
        reason = next((r.reason for r in reps if r.state() is ReplicaState.PENDING), "")
        return f"queued ({reason})" if reason else "queued"
    if f is not None:
        return "backoff"
    return "cold"


def replica_status(r: Replica, now: float) -> dict[str, Any]:
    last_used = view_of(r).last_used
    return {
        "id": r.replica_id,
        "job_id": r.job_id,
        "state": r.state().value,
        "reason": r.reason,
        "nodes": list(r.nodes),
        "step": r.step,
        "step_seconds": dict(r.step_seconds),
        "started_at": r.started_at,
        "url": r.base_url,
        "in_flight": r.in_flight + r.remote_in_flight,
        "gpus": r.gpus_per_node * r.node_count,
        "submitted_at": r.submitted_at,
        "ready_since": r.ready_at,
        "last_used": last_used,
        "idle_s": None if last_used is None else round(now - last_used, 1),
        "time_left_s": None if r.ends_at is None else max(0, round(r.ends_at - now)),
        "adopted": r.adopted,
    }
