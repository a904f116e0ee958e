"""Audit aggregation over AccountingRecord lists (what sacct gives the adapter)."""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from datetime import datetime, timedelta

from llmgw_slurm.accounting.audit import (
    aggregate,
    model_of,
    period_label,
    period_start,
    to_csv,
    totals,
)
from llmgw_slurm.slurm.types import AccountingRecord, JobState

P = "llmgw."


def rec(
    job_id: str,
    model: str,
    start: datetime | None,
    end: datetime | None,
    gpus: int = 1,
    state: JobState = JobState.COMPLETED,
    *,
    comment: bool = True,
    name: str | None = None,
) -> AccountingRecord:
    return AccountingRecord(
        job_id=job_id,
        name=name or f"{P}{model}.0000abcd",
        user="llmgw",
        account="",
        partition="llm",
        state=state,
        exit_code="0:0",
        comment=f"llmgw model={model} replica=0000abcd gpus={gpus}" if comment else "",
        submit=start,
        start=start,
        end=end,
        elapsed_s=int(((end or start) - start).total_seconds()) if start else 0,
        nodes=1,
        alloc_tres=f"cpu=1,gres/gpu={gpus}",
        gpus=gpus,
    )


D = datetime(2024, 5, 6)  # a Monday
SINCE, UNTIL, NOW = D - timedelta(days=10), D + timedelta(days=10), D + timedelta(days=10)


def test_gpu_hours_split_across_days() -> None:
    r = rec("1", "m1", D + timedelta(hours=23), D + timedelta(days=1, hours=1), gpus=2)
    rows = aggregate([r], P, SINCE, UNTIL, "day", NOW)
    assert [(x.period, x.gpu_hours, x.jobs) for x in rows] == [
        ("2024-05-06", 2.0, 1),
        ("2024-05-07", 2.0, 0),
    ]


def test_window_clips_and_running_jobs_count_to_now() -> None:
    r = rec("1", "m1", D - timedelta(hours=2), None, gpus=1, state=JobState.RUNNING)
    rows = aggregate([r], P, D, D + timedelta(days=1), "day", D + timedelta(hours=3))
    (row,) = rows
    # Two hours before the window are not counted, three after it are; it began before.
    assert row.gpu_hours == 3.0 and row.jobs == 0


def test_failures_preemptions_timeouts_per_model_and_week() -> None:
    recs = [
        rec("1", "m1", D, D + timedelta(hours=1), state=JobState.FAILED),
        rec("2", "m1", D, D + timedelta(hours=1), state=JobState.PREEMPTED),
        rec(
            "3", "m1", D + timedelta(days=7), D + timedelta(days=7, hours=1), state=JobState.TIMEOUT
        ),
        rec("4", "m2", D, D + timedelta(hours=2), gpus=4, state=JobState.NODE_FAIL),
        rec("5", "m2", D, D + timedelta(hours=1), state=JobState.CANCELLED),
    ]
    rows = aggregate(recs, P, SINCE, UNTIL, "week", NOW)
    got = {
        (r.period, r.model): (r.jobs, r.gpu_hours, r.failed, r.timeout, r.preempted) for r in rows
    }
    assert got == {
        ("2024-W19", "m1"): (2, 2.0, 1, 0, 1),
        ("2024-W20", "m1"): (1, 1.0, 0, 1, 0),
        ("2024-W19", "m2"): (2, 9.0, 1, 0, 0),
    }
    assert totals(rows) == {"jobs": 5, "gpu_hours": 12.0, "failed": 2, "timeout": 1, "preempted": 1}


def test_het_job_components_count_as_one_job() -> None:
    recs = [
        rec("9+0", "big", D, D + timedelta(hours=1), gpus=4, state=JobState.FAILED),
        rec("9+1", "big", D, D + timedelta(hours=1), gpus=4, state=JobState.FAILED),
    ]
    (row,) = aggregate(recs, P, SINCE, UNTIL, "month", NOW)
    assert (row.period, row.jobs, row.gpu_hours, row.failed) == ("2024-05", 1, 8.0, 1)


def test_every_run_of_a_requeued_job_counts_its_hours_and_its_preemption() -> None:
    # sacct --duplicates: job 7 preempted twice, then run to its end; one job.
    h = timedelta(hours=1)
    recs = [
        rec("7", "m1", D, D + h, gpus=2, state=JobState.PREEMPTED),
        rec("7", "m1", D + 2 * h, D + 3 * h, gpus=2, state=JobState.PREEMPTED),
        rec("7", "m1", D + 4 * h, D + 6 * h, gpus=2, state=JobState.COMPLETED),
        # A heterogeneous job's two components, preempted in the same run: one count.
        rec("8+0", "m1", D, D + h, state=JobState.PREEMPTED),
        rec("8+1", "m1", D, D + h, state=JobState.PREEMPTED),
    ]
    (row,) = aggregate(recs, P, SINCE, UNTIL, "day", NOW)
    assert (row.jobs, row.gpu_hours, row.preempted, row.failed) == (2, 10.0, 3, 0)


def test_other_jobs_are_left_out_and_name_is_the_fallback() -> None:
    recs = [
        rec("1", "m1", D, D + timedelta(hours=1), name="research-job"),
        rec("2", "m1", D, D + timedelta(hours=1), comment=False),
        rec("3", "x", D, D + timedelta(hours=1), comment=False, name=f"{P}no-replica-id"),
    ]
    assert model_of(recs[0], P) is None
    assert model_of(recs[1], P) == "m1"
    assert model_of(recs[2], P) is None
    (row,) = aggregate(recs, P, SINCE, UNTIL, "day", NOW)
    assert row.model == "m1" and row.jobs == 1


def test_batch_jobs_gpu_hours_are_apart_from_the_models_replicas() -> None:
    h = timedelta(hours=1)
    batch = replace(
        rec("9", "m1", D, D + h, gpus=2, name=f"{P}_batch.batch_{'0' * 24}"),
        comment=f"llmgw batch=batch_{'0' * 24} model=m1 gpus=2",
    )
    rows = aggregate([rec("1", "m1", D, D + h), batch], P, SINCE, UNTIL, "day", NOW)
    assert sorted((r.model, r.gpu_hours) for r in rows) == [("batch:m1", 2.0), ("m1", 1.0)]


def test_never_started_job_counts_as_a_job_without_gpu_hours() -> None:
    r = rec("1", "m1", None, None, state=JobState.CANCELLED)
    r = AccountingRecord(**{**r.__dict__, "submit": D, "end": D + timedelta(minutes=5)})
    (row,) = aggregate([r], P, SINCE, UNTIL, "day", NOW)
    assert (row.jobs, row.gpu_hours) == (1, 0.0)


def test_periods() -> None:
    t = datetime(2024, 12, 31, 15, 30)
    assert period_label(period_start(t, "day"), "day") == "2024-12-31"
    assert period_start(t, "week") == datetime(2024, 12, 30)
    assert period_label(period_start(t, "week"), "week") == "2025-W01"
    assert period_label(period_start(t, "month"), "month") == "2024-12"
    # A month boundary inside a job: December's part and January's part.
    r = rec("1", "m", datetime(2024, 12, 31, 23), datetime(2025, 1, 1, 2))
    rows = aggregate([r], P, datetime(2024, 12, 1), datetime(2025, 2, 1), "month", NOW)
    assert [(x.period, x.gpu_hours) for x in rows] == [("2024-12", 1.0), ("2025-01", 2.0)]


def test_csv_has_a_header_and_one_line_per_row() -> None:
    rows = aggregate([rec("1", "m1", D, D + timedelta(hours=1))], P, SINCE, UNTIL, "day", NOW)
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert parsed == [
        {
            "period": "2024-05-06",
            "model": "m1",
            "jobs": "1",
            "gpu_hours": "1.0",
            "failed": "0",
            "timeout": "0",
            "preempted": "0",
        }
    ]
