"""``llmgw-admin audit --by user|account``: batch jobs by their comment, replicas apportioned."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw_slurm.accounting.audit import aggregate, totals
from llmgw_slurm.accounting.audit_owner import (
    IDLE,
    UNKNOWN,
    apportion,
    batch_owner,
    by_owner,
    owner_totals,
)
from llmgw_slurm.accounting.usage import UsageRecord, UsageStore, tokens_by
from llmgw_slurm.batch.jobs import batch_comment
from llmgw_slurm.batch.model import BatchRecord
from llmgw_slurm.slurm.types import AccountingRecord, JobState
from tests.unit.test_audit import P, rec

D = datetime(2024, 5, 6, 8)
H = timedelta(hours=1)
SINCE, UNTIL, NOW = D - 10 * H, D + 10 * H, D + 10 * H
BATCH_ID = "batch_" + "0" * 24


def batch_rec(job_id: str, comment: str, start: datetime, end: datetime, gpus: int = 1) -> AccountingRecord:
    return replace(
        rec(job_id, "m1", start, end, gpus=gpus, name=f"{P}_batch.{BATCH_ID}"), comment=comment
    )


def test_apportion_splits_by_token_share_and_sums_to_the_hours() -> None:
    parts = apportion(6.0, {"alice": 300, "bob": 100, "carol": 0})
    assert parts == {"alice": 4.5, "bob": 1.5}
    assert sum(parts.values()) == 6.0


def test_apportion_gives_a_replica_that_served_nothing_to_idle() -> None:
    assert apportion(2.0, {}) == {IDLE: 2.0}
    assert apportion(2.0, {"alice": 0}) == {IDLE: 2.0}
    assert apportion(0.0, {}) == {}


def test_a_batch_jobs_comment_names_its_user_and_account() -> None:
    b = BatchRecord(
        id=BATCH_ID, owner="alice", endpoint="/v1/chat/completions", input_file_id="f",
        completion_window="24h", created_at=0, expires_at=1, project="t18phys",
    )  # fmt: skip
    comment = batch_comment(b, "m1", 2)
    assert comment == f"llmgw batch={BATCH_ID} model=m1 gpus=2 user=alice account=t18phys"
    assert (batch_owner(comment, "user"), batch_owner(comment, "account")) == ("alice", "t18phys")
    # Keys off: no owner to name; an older job's comment names none either.
    assert batch_comment(replace(b, owner="", project=""), "m1", 2).endswith("gpus=2")
    assert batch_owner(f"llmgw batch={BATCH_ID} model=m1 gpus=2", "user") == UNKNOWN


def test_by_owner_attributes_batches_exactly_and_apportions_replicas_by_their_window() -> None:
    seen: list[tuple[str, datetime, datetime]] = []

    def tokens_in(model: str, a: datetime, b: datetime) -> Mapping[str, int]:
        seen.append((model, a, b))
        return {"alice": 30, "bob": 10} if b <= D + 2 * H else {}

    recs = [
        # A 2-GPU replica for two hours, before the window opens for its first hour.
        rec("1", "m1", D - 11 * H, D - 8 * H, gpus=2),
        # A replica that served nobody.
        rec("2", "m1", D + 5 * H, D + 6 * H),
        batch_rec("3", f"llmgw batch={BATCH_ID} model=m1 gpus=4 user=bob account=t18chem",
                  D, D + H, gpus=4),
        batch_rec("4", f"llmgw batch={BATCH_ID} model=m1 gpus=1", D, D + H),
        rec("5", "m1", D, D + H, name="someone-elses-job"),
    ]  # fmt: skip
    rows = by_owner(recs, P, SINCE, UNTIL, NOW, "user", tokens_in)
    # Tokens are asked for the job's run clipped to the window, not the whole run.
    assert seen[0] == ("m1", SINCE, D - 8 * H)
    got = {(r.owner, r.batch_jobs, r.batch_gpu_hours, r.online_gpu_hours_apportioned) for r in rows}
    assert got == {
        ("bob", 1, 4.0, 1.0),  # his batch, and a quarter of 2 GPUs x 2 h
        ("alice", 0, 0.0, 3.0),
        (IDLE, 0, 0.0, 1.0),
        (UNKNOWN, 1, 1.0, 0.0),
    }
    assert [r.owner for r in rows][:1] == ["bob"]  # most GPU hours first
    # Every hour the audit by period counts is someone's (or idle's): nothing lost.
    by_period = totals(aggregate(recs, P, SINCE, UNTIL, "day", NOW))["gpu_hours"]
    assert sum(owner_totals(rows).values()) == by_period == 10.0


def test_a_batch_job_that_ran_for_less_than_a_second_is_counted_with_no_hours() -> None:
    # sacct gives start == end for a job under a second (seen on 25.11: a
    # two-line batch on the test engine); one outside the window is not counted.
    comment = f"llmgw batch={BATCH_ID} model=m1 gpus=1 user=alice"
    recs = [batch_rec("7", comment, D, D), batch_rec("8", comment, UNTIL, UNTIL)]
    rows = by_owner(recs, P, SINCE, UNTIL, NOW, "user", lambda *_: {})
    assert [(r.owner, r.batch_jobs, r.batch_gpu_hours) for r in rows] == [("alice", 1, 0.0)]


def test_tokens_by_counts_one_model_in_a_window_by_user_or_account(tmp_path: Path) -> None:
    store = UsageStore(tmp_path / "usage.sqlite3")
    store._write(
        [
            UsageRecord(100.0, "k1", "alice", "phys", "m1", "chat", 5, 5, 10),
            UsageRecord(150.0, "k2", "bob", "phys", "m1", "chat", 1, 1, 2),
            UsageRecord(150.0, "k2", "bob", "phys", "m2", "chat", 1, 1, 99),
            UsageRecord(200.0, "k1", "alice", "phys", "m1", "chat", 1, 1, 1000),
            # A batch's tokens: its own job served them, not the replicas.
            UsageRecord(150.0, "k1", "alice", "phys", "m1", "batch", 1, 1, 500),
        ]
    )
    assert tokens_by(store.path, "user", "m1", 100.0, 200.0) == {"alice": 10, "bob": 2}
    assert tokens_by(store.path, "account", "m1", 100.0, 200.0) == {"phys": 12}
    assert tokens_by(tmp_path / "none.sqlite3", "user", "m1", 0.0, 1.0) == {}


def test_admin_audit_by_user_and_account_reads_sacct_and_the_usage_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw_slurm.cli import admin

    server = tmp_path / "server.yaml"
    server.write_text(f"state_dir: {tmp_path / 'state'}\nslurm: {{job_prefix: '{P}'}}\n")
    start = datetime.now().replace(microsecond=0) - 2 * H
    store = UsageStore(tmp_path / "state" / "usage.sqlite3")
    store._write(
        [
            UsageRecord((start + H).timestamp(), "k1", "alice", "t18phys", "m1", "chat", 1, 2, 3),
            UsageRecord((start + H).timestamp(), "k2", "bob", "t18chem", "m1", "chat", 0, 1, 1),
        ]
    )
    comment = f"llmgw batch={BATCH_ID} model=m1 gpus=1 user=alice account=t18phys"
    recs = [
        rec("1", "m1", start, start + 2 * H, gpus=2, state=JobState.RUNNING),
        batch_rec("2", comment, start, start + H),
    ]
    monkeypatch.setattr(admin, "_accounting", lambda *a: recs)

    def audit(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(
            admin.main, ["audit", "--server", str(server), "--user", "llmgw", "--since", "1d", *args]
        )
        return res.exit_code, res.output

    code, out = audit("--by", "user", "--json")
    assert code == 0, out
    data = json.loads(out)
    rows = {r["owner"]: r for r in data["rows"]}
    assert (rows["alice"]["batch_gpu_hours"], rows["alice"]["online_gpu_hours_apportioned"]) == (
        1.0,
        3.0,
    )
    assert rows["bob"]["online_gpu_hours_apportioned"] == 1.0
    assert data["totals"] == {"alice": 4.0, "bob": 1.0} and data["by"] == "user"
    code, out = audit("--by", "account")
    assert code == 0, out
    assert "ONLINE GPU H (APPORTIONED)" in out and "apportioned" in out.splitlines()[-1]
    line = next(ln for ln in out.splitlines() if ln.startswith("t18phys"))
    assert line.split() == ["t18phys", "m1", "1", "1.00", "3.00", "4.00"]
    code, out = audit("--by", "account", "--chart", "--no-color")
    assert code == 0 and "GPU hours by account" in out and "4.00 h" in out
    code, out = audit("--by", "user", "--csv")
    assert code == 2 and "--csv is for --by day|week|month" in out
