"""What ``llmgw-admin status``, ``llmgw models`` and the status page show of the reconciler.

Read-only: built from the replica table and what the last pass left (its
notes, the failed starts), on request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw_slurm.catalog import Model
from llmgw_slurm.reconciler.clusters import ClusterSet
from llmgw_slurm.reconciler.plan import Failures, ReplicaState
from llmgw_slurm.reconciler.replicas import Replica, ReplicaTable, view_of
from llmgw_slurm.reconciler.svcjobs import ServiceJobs

__all__ = [
    "MODEL_STATES",
    "clusters_status",
    "model_state",
    "replica_status",
    "state_text",
    "status",
]


def status(
    table: ReplicaTable,
    *,
    notes: Mapping[str, str],
    failures: Mapping[str, Failures],
    give_up_after: int,
    passes: int,
    last_pass_error: str,
    service_jobs: ServiceJobs,
    clusters: ClusterSet | None = None,
    down_after: float = 120.0,
) -> dict[str, Any]:
    """The models, their replicas, the last decisions, the service's jobs and the
    clusters' health, for the API."""
    now = table.clock()
    models = []
    for m in table.catalog.models:
        reps = [r for r in table.replicas.values() if r.model == m.name]
        state, reason = model_state(m, reps, failures.get(m.name), give_up_after)
        models.append(
            {
                "name": m.name,
                "aliases": list(m.aliases),
                "description": m.description,
                "gpus": m.resources.gpus * m.resources.nodes,
                "min": m.scaling.min,
                "max": m.scaling.max,
                # One word, the counts and Slurm's reason beside it: scripts select
                # on .state == "ready" (state_text is what people read).
                "state": state,
                "ready_replicas": sum(1 for r in reps if r.state() is ReplicaState.READY),
                "reason": reason,
                "state_text": state_text(state, reps, reason),
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
        "clusters": clusters_status(clusters, table, now, down_after) if clusters else [],
    }


def clusters_status(
    clusters: ClusterSet, table: ReplicaTable, now: float, down_after: float
) -> list[dict[str, Any]]:
    """Each cluster: its health (up, not answering, down; since when and why), its
    GPUs as last listed, and its replicas by state."""
    out = []
    for c in clusters:
        free, total = c.gpus()
        states: dict[str, int] = {}
        for r in table.replicas.values():
            if r.cluster == c.name:
                states[r.state().value] = states.get(r.state().value, 0) + 1
        out.append(
            {
                "name": c.name,
                "label": c.label,
                "health": c.health(now, down_after).value,
                "health_text": c.health_text(now, down_after),
                "error": c.last_error,
                "unanswered_since": c.unanswered_since,
                "answered_at": c.answered_at,
                "nodes_listed_at": c.nodes_listed_at,
                "nodes": len(c.nodes),
                "gpus_free": free,
                "gpus_total": total,
                "replicas": states,
            }
        )
    return out


# Every word model_state answers with (the status page colours by it).
MODEL_STATES = ("ready", "failing", "starting", "queued", "backoff", "cold")


def model_state(
    m: Model, reps: list[Replica], f: Failures | None, give_up_after: int
) -> tuple[str, str]:
    """The model's state, one of MODEL_STATES, and Slurm's pending reason when queued."""
    states = [r.state() for r in reps]
    if ReplicaState.READY in states:
        return "ready", ""
    if f is not None and f.count >= give_up_after:
        return "failing", ""
    if ReplicaState.STARTING in states:
        return "starting", ""
    if ReplicaState.PENDING in states:
        return "queued", next((r.reason for r in reps if r.state() is ReplicaState.PENDING), "")
    if f is not None:
        return "backoff", ""
    return "cold", ""


def state_text(state: str, reps: list[Replica], reason: str) -> str:
    """The state as people read it: "ready 2" (ready replicas), "queued (Resources)"."""
    if state == "ready":
        return f"ready {sum(1 for r in reps if r.state() is ReplicaState.READY)}"
    if state == "queued" and reason:
        return f"queued ({reason})"
    return state


def replica_status(r: Replica, now: float) -> dict[str, Any]:
    last_used = view_of(r).last_used
    return {
        "id": r.replica_id,
        "cluster": r.cluster,
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
