"""GPU use of the service's jobs, from Slurm's accounting (``sacct``), per model and period.

The input is what :meth:`SlurmBackend.accounting` returns: one record per
allocation (a heterogeneous job gives one per component, ``1234+0``,
``1234+1``). Which model a job served comes from its comment (``llmgw
model=X replica=Y gpus=N``, set at submission), or else from its name. A
Batch API job's comment (``llmgw batch=ID model=X gpus=N``) puts it under
``batch:X``, apart from the model's online replicas.

How each figure is counted:

- GPU hours: a job's GPUs times the part of its run that falls in the period
  (a job running from 23:00 to 01:00 gives one hour to each day), clipped to
  ``[since, until)``; a job still running counts up to ``now``;
- jobs: counted once (components together) in the period it started (or was
  submitted, if it never started);
- failed (FAILED, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE), timeout
  (TIMEOUT) and preempted (PREEMPTED): counted once per run of a job (the
  components of a heterogeneous job together) in the period the run ended. A
  requeued job runs more than once under one job id: with every run in the
  input (``sacct --duplicates``, which ``llmgw-admin audit`` asks for), a job
  preempted twice and then completed counts two preemptions, and the GPU
  hours of all three runs.

With several clusters each record carries its cluster (``AccountingRecord.cluster``)
and rows are per (period, model, cluster): job ids are per cluster.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Literal

from llmgw_slurm.catalog import MODEL_NAME_RE
from llmgw_slurm.slurm.types import AccountingRecord, JobState

__all__ = [
    "AuditRow",
    "Period",
    "aggregate",
    "model_of",
    "period_label",
    "period_start",
    "to_csv",
    "totals",
]

Period = Literal["day", "week", "month"]

FAILED_STATES = frozenset(
    {
        JobState.FAILED,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
    }
)

_COMMENT_MODEL = re.compile(r"(?:^|\s)model=([a-z0-9][a-z0-9._-]{0,47})(?:\s|$)")
_COMMENT_TAG = re.compile(r"^llmgw\s")
_COMMENT_BATCH = re.compile(r"(?:^|\s)batch=\S+")


@dataclass(frozen=True)
class AuditRow:
    period: str
    model: str
    jobs: int = 0
    gpu_hours: float = 0.0
    failed: int = 0
    timeout: int = 0
    preempted: int = 0
    # The cluster ("" with one cluster); last, so a one-cluster CSV keeps its columns first.
    cluster: str = ""


def model_of(rec: AccountingRecord, prefix: str) -> str | None:
    """The model a record's job served, or None when it is not one of the service's jobs."""
    if not rec.name.startswith(prefix):
        return None
    m = _COMMENT_MODEL.search(rec.comment) if _COMMENT_TAG.match(rec.comment) else None
    if m:
        return ("batch:" if _COMMENT_BATCH.search(rec.comment) else "") + m.group(1)
    # No comment (AccountingStoreFlags=job_comment is off): the name is
    # "{prefix}{model}.{replica_id}", "-{cluster}" after it with several clusters.
    rest = rec.name[len(prefix) :]
    model, dot, last = rest.rpartition(".")
    rid = last.partition("-")[0]
    # A model name never starts with "_": the service's model jobs and engine
    # installs ("{prefix}_job.KIND...") are not any model's.
    if dot and MODEL_NAME_RE.fullmatch(model) and re.fullmatch(r"[0-9a-f]{8}", rid):
        return model
    return None


def period_start(t: datetime, by: Period) -> datetime:
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if by == "day":
        return day
    if by == "week":
        return day - timedelta(days=day.weekday())
    return day.replace(day=1)


def _next(start: datetime, by: Period) -> datetime:
    if by == "day":
        return start + timedelta(days=1)
    if by == "week":
        return start + timedelta(days=7)
    return (start.replace(day=28) + timedelta(days=4)).replace(day=1)


def period_label(start: datetime, by: Period) -> str:
    if by == "day":
        return start.strftime("%Y-%m-%d")
    if by == "week":
        year, week, _ = start.isocalendar()
        return f"{year}-W{week:02d}"
    return start.strftime("%Y-%m")


def _base_id(job_id: str) -> str:
    # "1234+1" (het component) and "1234_5" (array task) belong to job 1234 / 1234_5.
    return job_id.split("+", 1)[0]


def aggregate(
    records: Iterable[AccountingRecord],
    prefix: str,
    since: datetime,
    until: datetime,
    by: Period,
    now: datetime,
) -> list[AuditRow]:
    """Rows per (period, model, cluster), sorted in that order; see the module docstring."""
    gpu_h: dict[tuple[str, str, str], float] = {}
    jobs: dict[tuple[str, str, str], set[str]] = {}
    # (period, model, cluster, job, end of the run) -> the states its components ended in.
    ended: dict[tuple[str, str, str, str, datetime], set[JobState]] = {}
    keys: set[tuple[str, str, str]] = set()

    def inside(t: datetime | None) -> bool:
        return t is not None and since <= t < until

    for rec in records:
        model = model_of(rec, prefix)
        if model is None:
            continue
        base = _base_id(rec.job_id)
        if rec.start is not None and rec.gpus:
            a = max(rec.start, since)
            b = min(rec.end or now, until)
            while a < b:
                p0 = period_start(a, by)
                p1 = min(_next(p0, by), b)
                k = (period_label(p0, by), model, rec.cluster)
                gpu_h[k] = gpu_h.get(k, 0.0) + rec.gpus * (p1 - a).total_seconds() / 3600.0
                keys.add(k)
                a = p1
        began = rec.start or rec.submit
        if inside(began):
            assert began is not None
            k = (period_label(period_start(began, by), by), model, rec.cluster)
            jobs.setdefault(k, set()).add(base)
            keys.add(k)
        if rec.state.is_finished and inside(rec.end):
            assert rec.end is not None
            label = period_label(period_start(rec.end, by), by)
            ended.setdefault((label, model, rec.cluster, base, rec.end), set()).add(rec.state)
            keys.add((label, model, rec.cluster))

    counts: dict[tuple[str, str, str], dict[str, int]] = {}
    for (label, model, cluster, _, _), seen in ended.items():
        c = counts.setdefault((label, model, cluster), {"failed": 0, "timeout": 0, "preempted": 0})
        # One run, one count, whichever component carries the state.
        if seen & FAILED_STATES:
            c["failed"] += 1
        if JobState.TIMEOUT in seen:
            c["timeout"] += 1
        if JobState.PREEMPTED in seen:
            c["preempted"] += 1

    rows = []
    for k in sorted(keys):
        c = counts.get(k, {})
        rows.append(
            AuditRow(
                period=k[0],
                model=k[1],
                jobs=len(jobs.get(k, ())),
                gpu_hours=round(gpu_h.get(k, 0.0), 4),
                failed=c.get("failed", 0),
                timeout=c.get("timeout", 0),
                preempted=c.get("preempted", 0),
                cluster=k[2],
            )
        )
    return rows


def totals(rows: Sequence[AuditRow]) -> dict[str, float | int]:
    return {
        "jobs": sum(r.jobs for r in rows),
        "gpu_hours": round(sum(r.gpu_hours for r in rows), 4),
        "failed": sum(r.failed for r in rows),
        "timeout": sum(r.timeout for r in rows),
        "preempted": sum(r.preempted for r in rows),
    }


def to_csv(rows: Sequence[AuditRow]) -> str:
    """The rows as CSV; a cluster column only where rows have clusters (a one-cluster
    site's CSV keeps its columns)."""
    buf = io.StringIO()
    fields = list(AuditRow.__dataclass_fields__)
    if not any(r.cluster for r in rows):
        fields.remove("cluster")
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()
