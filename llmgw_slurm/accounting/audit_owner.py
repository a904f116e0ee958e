"""GPU hours of the service's jobs by the user or Slurm account they served.

Slurm charges every job of the service to the service's own account, so
``sacct`` alone cannot say whose work a job did. Two kinds of job, two rules:

- a **batch** job (Batch API) does one user's batch: its comment carries the
  batch's user and account (``llmgw batch=ID model=M gpus=N user=U
  account=A``, set at submission by :mod:`llmgw_slurm.batch.jobs`), and its
  GPU hours are that user's and account's, exactly;
- an **online** replica is shared: its GPU hours in the window are
  *apportioned* to the users (or accounts) by their share of the tokens its
  model served over the same stretch of time (the job's run clipped to
  ``[since, until)``), from the usage store. The store does not say which
  replica answered a request, so two replicas of one model running at once
  both split by the model's tokens then. A replica that served no tokens in
  its run is charged to ``(idle)``: the service's own cost, nobody's use.

What a row's figures mean is in :class:`OwnerRow`; the shares are exact
fractions of each job's hours, so the column sums equal the per-model audit's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from llmgw_slurm.accounting.audit import model_of
from llmgw_slurm.slurm.types import AccountingRecord

__all__ = ["IDLE", "UNKNOWN", "OwnerKind", "OwnerRow", "apportion", "by_owner", "owner_totals"]

OwnerKind = Literal["user", "account"]

# An online replica's hours when its model served no tokens during its run.
IDLE = "(idle)"
# A batch job submitted before comments named the user and account.
UNKNOWN = "(unknown)"
# Usage records of a gateway without keys have no user or account.
NO_KEY = "(no key)"

_FIELD = {k: re.compile(rf"(?:^|\s){k}=(\S+)") for k in ("user", "account")}

# (model, start, end) -> tokens by user or account in [start, end).
TokensIn = Callable[[str, datetime, datetime], Mapping[str, int]]


@dataclass(frozen=True)
class OwnerRow:
    """One user's (or account's) GPU hours on one model in the window.

    ``batch_gpu_hours``: of batch jobs that named them (exact);
    ``online_gpu_hours_apportioned``: their token share of online replicas' hours.
    """

    owner: str
    model: str
    batch_jobs: int = 0
    batch_gpu_hours: float = 0.0
    online_gpu_hours_apportioned: float = 0.0

    @property
    def gpu_hours(self) -> float:
        return round(self.batch_gpu_hours + self.online_gpu_hours_apportioned, 4)


def apportion(gpu_hours: float, tokens: Mapping[str, int]) -> dict[str, float]:
    """``gpu_hours`` split by each owner's share of ``tokens``; all to IDLE if none.

    Owners with no tokens (or a negative count, which a store never holds)
    get nothing; the parts sum to ``gpu_hours``.
    """
    used = {o: t for o, t in tokens.items() if t > 0}
    total = sum(used.values())
    if total == 0:
        return {IDLE: gpu_hours} if gpu_hours else {}
    return {o: gpu_hours * t / total for o, t in used.items()}


def batch_owner(comment: str, kind: OwnerKind) -> str:
    """The user or account a batch job's comment names (UNKNOWN for an older comment)."""
    m = _FIELD[kind].search(comment)
    return m.group(1) if m else UNKNOWN


def by_owner(
    records: Iterable[AccountingRecord],
    prefix: str,
    since: datetime,
    until: datetime,
    now: datetime,
    kind: OwnerKind,
    tokens_in: TokensIn,
) -> list[OwnerRow]:
    """Rows per (owner, model) over ``[since, until)``, most GPU hours first."""
    batch_h: dict[tuple[str, str], float] = {}
    online_h: dict[tuple[str, str], float] = {}
    batch_jobs: dict[tuple[str, str], set[str]] = {}
    for rec in records:
        model = model_of(rec, prefix)
        if model is None or rec.start is None or not rec.gpus:
            continue
        a, b = max(rec.start, since), min(rec.end or now, until)
        # Slurm's times are whole seconds: a batch job that ran for less than
        # one inside the window (start == end) is still a job, of no hours.
        if a > b or (a == b and not since <= rec.start < until):
            continue
        hours = rec.gpus * (b - a).total_seconds() / 3600.0
        if model.startswith("batch:"):
            k = (batch_owner(rec.comment, kind), model.removeprefix("batch:"))
            batch_h[k] = batch_h.get(k, 0.0) + hours
            batch_jobs.setdefault(k, set()).add(rec.job_id.split("+", 1)[0])
            continue
        for owner, part in apportion(hours, tokens_in(model, a, b)).items():
            k = (owner or NO_KEY, model)
            online_h[k] = online_h.get(k, 0.0) + part
    rows = [
        OwnerRow(
            owner=k[0],
            model=k[1],
            batch_jobs=len(batch_jobs.get(k, ())),
            batch_gpu_hours=round(batch_h.get(k, 0.0), 4),
            online_gpu_hours_apportioned=round(online_h.get(k, 0.0), 4),
        )
        for k in set(batch_h) | set(online_h)
    ]
    return sorted(rows, key=lambda r: (-r.gpu_hours, r.owner, r.model))


def owner_totals(rows: Iterable[OwnerRow]) -> dict[str, float]:
    """GPU hours by owner over every model (for the chart and the TOTAL lines)."""
    out: dict[str, float] = {}
    for r in rows:
        out[r.owner] = round(out.get(r.owner, 0.0) + r.gpu_hours, 4)
    return out
