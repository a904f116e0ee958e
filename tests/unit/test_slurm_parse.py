"""Parsers against outputs recorded from the dev cluster's Slurm 22.05."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

import pytest

from llmgw_slurm.base.errors import SlurmParseError
from llmgw_slurm.slurm import JobState, parse
from llmgw_slurm.slurm.hostlist import expand

DATA = Path(__file__).parent / "data"


def test_squeue_folds_het_components_and_keeps_comment_with_separators() -> None:
    jobs = {j.name: j for j in parse.parse_squeue((DATA / "squeue.txt").read_text())}
    assert set(jobs) == {"llmgw.pend.55667788", "llmgw.m1.0a0b0c0d", "llmgw.big.11223344"}

    single = jobs["llmgw.m1.0a0b0c0d"]
    assert single.job_id == "9"
    assert single.state is JobState.RUNNING
    assert single.nodes == ("gpunode1",)
    assert single.comment == "model=m1|x\x1fy"
    assert single.time_limit_s == 365 * 86400
    assert single.end_time == datetime(2027, 12, 2, 16, 48, 54)
    assert single.components[0].tres_per_node == "gres/gpu:a100:2"
    assert not single.heterogeneous

    het = jobs["llmgw.big.11223344"]
    assert het.job_id == "10"
    assert het.heterogeneous
    assert [c.offset for c in het.components] == [0, 1]
    assert [c.job_id for c in het.components] == ["10", "11"]
    assert het.nodes == ("gpunode1", "gpunode2")
    assert het.time_limit_s is None
    assert het.end_time is None  # squeue prints NONE for a running job without a limit

    pending = jobs["llmgw.pend.55667788"]
    assert pending.state is JobState.PENDING
    assert pending.reason == "Resources"
    assert pending.nodes == ()
    # squeue prints an estimated start for pending jobs; it is not a start.
    assert pending.start_time is None
    assert pending.end_time is None


@pytest.mark.parametrize(
    ("printed", "want"),
    [
        ("gres:gpu:a100:2", "gres/gpu:a100:2"),  # Slurm 22.05
        ("gres/gpu:a100:2", "gres/gpu:a100:2"),  # Slurm 25.11
        ("gres:gpu:1,gres:shard:2", "gres/gpu:1,gres/shard:2"),
        ("cpu=2", "cpu=2"),
        ("N/A", ""),
    ],
)
def test_tres_per_node_reads_the_same_on_every_version(printed: str, want: str) -> None:
    assert parse.tres_per_node(printed) == want


def test_squeue_takes_no_end_time_for_a_pending_job() -> None:
    # The end of a pending job is start guess + limit: a guess, which must not make
    # the renewal rule think a queued replica is about to run out.
    s = parse.SEP
    text = (
        (DATA / "squeue.txt")
        .read_text()
        .replace(
            f"{s}UNLIMITED{s}N/A{s}2027-12-02T16:48:54",
            f"{s}1:00:00{s}2027-12-02T17:48:54{s}2027-12-02T16:48:54",
        )
    )
    (pending,) = [j for j in parse.parse_squeue(text) if j.job_id == "12"]
    assert pending.time_limit_s == 3600
    assert pending.end_time is None


def test_squeue_skips_a_malformed_line_and_keeps_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    good = (DATA / "squeue.txt").read_text()
    with caplog.at_level(logging.WARNING):
        jobs = parse.parse_squeue("garbage without separators\n" + good)
    assert len(jobs) == 3
    assert "skipping a line" in caplog.text


def test_sinfo_folds_partitions_and_counts_gpus() -> None:
    nodes = {n.name: n for n in parse.parse_sinfo((DATA / "sinfo.txt").read_text())}
    assert sorted(nodes) == ["gpunode1", "gpunode2", "gpunode3", "gpunode4"]
    n1 = nodes["gpunode1"]
    assert set(n1.partitions) == {"research", "llm"}
    assert n1.gpus_total("a100") == 4
    assert n1.gpus_free() == 4 - sum(g.used for g in n1.gpus)
    assert n1.address == "127.0.10.1"
    assert n1.usable
    assert n1.features == ()  # the listing has features, the node none: "(null)"
    assert n1.memory_alloc_mb == 0


def test_sinfo_features() -> None:
    sep = parse.SEP
    row = ["h1", "idle", "big", "0/64/0/64", "512000", "gpu:h100:8", "gpu:h100:0", "10.0.0.1"]
    line = sep.join([*row, "none", "nvlink,ib", "131072"]) + sep
    (n,) = parse.parse_sinfo(line + "\n")
    assert n.features == ("nvlink", "ib")
    assert (n.memory_mb, n.memory_alloc_mb) == (512_000, 131_072)
    assert parse.parse_features("(null)") == ()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("gpu:a100:4", {"a100": 4}),
        ("gpu:a100:4(S:0-1)", {"a100": 4}),
        ("gpu:a100:1(IDX:0,2),gpu:v100:2(IDX:0-1)", {"a100": 1, "v100": 2}),
        ("gpu:2", {"": 2}),
        ("(null)", {}),
        ("mps:100,gpu:h100:8", {"h100": 8}),
    ],
)
def test_parse_gres(text: str, want: dict[str, int]) -> None:
    assert parse.parse_gres(text) == want


def test_parse_gres_rejects_nonsense() -> None:
    with pytest.raises(SlurmParseError):
        parse.parse_gres("gpu:a100:lots")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1:00:00", 3600),
        ("30:00", 1800),
        ("5", 300),
        ("2-00:00:00", 172800),
        ("1-12", 129600),
        ("UNLIMITED", None),
        ("N/A", None),
        ("INVALID", None),
    ],
)
def test_parse_duration(text: str, want: int | None) -> None:
    assert parse.parse_duration(text) == want


def test_parse_duration_rejects_nonsense() -> None:
    with pytest.raises(SlurmParseError):
        parse.parse_duration("soon")


def test_state_codes() -> None:
    assert JobState.parse("CANCELLED by 0") is JobState.CANCELLED
    assert JobState.parse("PD") is JobState.PENDING
    assert JobState.parse("REQUEUED") is JobState.PENDING
    assert JobState.parse("PREEMPTED") is JobState.PREEMPTED
    assert JobState.parse("TO") is JobState.TIMEOUT
    assert JobState.RUNNING.is_active and not JobState.RUNNING.is_finished
    assert JobState.NODE_FAIL.is_finished


def test_unknown_state_is_unknown_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert JobState.parse("HOVERING") is JobState.UNKNOWN
    assert "HOVERING" in caplog.text


def test_sbatch_output() -> None:
    assert parse.parse_sbatch("123\n") == "123"
    assert parse.parse_sbatch("123;cluster\n") == "123"
    with pytest.raises(SlurmParseError, match="expected a job id"):
        parse.parse_sbatch("sbatch: error: something\n")


def test_gpus_in_tres() -> None:
    assert parse.gpus_in_tres("billing=1,cpu=1,gres/gpu:a100=2,gres/gpu=2,mem=500M") == 2
    assert parse.gpus_in_tres("billing=1,cpu=1,gres/gpu=3,mem=500M,node=1") == 3
    assert parse.gpus_in_tres("cpu=1") == 0


def test_sacct_keeps_comment_with_separators() -> None:
    sep = parse.SEP
    line = (
        sep.join(
            [
                "7",
                "7",
                "llmgw.m.00000000",
                "root",
                "root",
                "llm",
                "CANCELLED by 0",
                "0:0",
                "2026-12-02T16:46:29",
                "2026-12-02T16:46:29",
                "2026-12-02T16:46:43",
                "14",
                "1",
                "billing=1,cpu=1,gres/gpu=2,mem=500M,node=1",
                "a|b" + sep + "c",
            ]
        )
        + sep
    )
    (rec,) = parse.parse_sacct(line)
    assert rec.state is JobState.CANCELLED
    assert rec.comment == "a|b" + sep + "c"
    assert rec.gpus == 2
    assert rec.gpu_hours == pytest.approx(2 * 14 / 3600)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("gpunode[1-3]", ("gpunode1", "gpunode2", "gpunode3")),
        ("gpu[01-02,7],login1", ("gpu01", "gpu02", "gpu7", "login1")),
        ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
        ("(null)", ()),
        ("", ()),
    ],
)
def test_hostlist_expand(text: str, want: tuple[str, ...]) -> None:
    assert expand(text) == want


def test_hostlist_rejects_unbalanced() -> None:
    with pytest.raises(SlurmParseError):
        expand("gpu[1-2")


def test_squeue_prefix_drops_other_jobs_before_parsing() -> None:
    text = (DATA / "squeue.txt").read_text()
    jobs = parse.parse_squeue("not even a valid line but named otherwise\n" + text, "llmgw.big.")
    assert [j.name for j in jobs] == ["llmgw.big.11223344"]
    assert len(jobs[0].components) == 2


def test_squeue_cache_reuses_unchanged_rows() -> None:
    text = (DATA / "squeue.txt").read_text()
    cache = parse.SqueueCache()
    first = parse.parse_squeue(text, "", cache)
    assert len(cache.lines) == 2  # the two single-component jobs; het rows are not cached
    again = parse.parse_squeue(text, "", cache)
    assert again == parse.parse_squeue(text)  # what an uncached parse gives
    single = {j.job_id: j for j in first if not j.heterogeneous}
    for j in again:
        if not j.heterogeneous:
            assert j is single[j.job_id]  # reused, not re-parsed
    # The running job's limit extended (scontrol update TimeLimit): a new end, parsed afresh.
    sep = parse.SEP
    moved = text.replace(f"{sep}2027-12-02T16:48:54{sep}2026", f"{sep}2027-12-03T16:48:54{sep}2026")
    assert moved != text
    (m1,) = [j for j in parse.parse_squeue(moved, "", cache) if j.job_id == "9"]
    assert m1 is not single["9"]
    assert m1.end_time == datetime(2027, 12, 3, 16, 48, 54)
    assert single["9"].end_time == datetime(2027, 12, 2, 16, 48, 54)  # the cached job is untouched
    assert parse.parse_squeue(moved, "", cache) == parse.parse_squeue(moved)
    (m1b,) = [j for j in parse.parse_squeue(moved, "", cache) if j.job_id == "9"]
    assert m1b is m1
    # A changed state is parsed afresh.
    changed = moved.replace(
        f"{sep}RUNNING{sep}None{sep}gpunode1{sep}1{sep}llm{sep}gres:gpu:a100:2",
        f"{sep}COMPLETING{sep}None{sep}gpunode1{sep}1{sep}llm{sep}gres:gpu:a100:2",
    )
    (m2,) = [j for j in parse.parse_squeue(changed, "", cache) if j.job_id == "9"]
    assert m2.state is JobState.COMPLETING


@pytest.mark.parametrize(
    ("old", "new", "field", "want"),
    [
        ("{s}PENDING{s}Resources{s}", "{s}PENDING{s}Priority{s}", "reason", "Priority"),
        ("{s}PENDING{s}Resources{s}", "{s}RUNNING{s}None{s}", "state", JobState.RUNNING),
        (
            "{s}Resources{s}{s}4{s}",
            "{s}Resources{s}gpunode[1-2]{s}4{s}",
            "nodes",
            ("gpunode1", "gpunode2"),
        ),
        ("{s}UNLIMITED{s}N/A{s}2027", "{s}1:00:00{s}N/A{s}2027", "time_limit_s", 3600),
        (
            "{s}2026-12-02T16:48:54{s}0{s}root{s}12{s}(null){s}",
            "{s}2026-12-02T16:48:54{s}2{s}root{s}12{s}(null){s}",
            "restarts",
            2,
        ),
        ("llmgw.pend.55667788{s}", "llmgw.pend.99999999{s}", "name", "llmgw.pend.99999999"),
        ("{s}root{s}12{s}(null){s}", "{s}root{s}12{s}model=x{s}", "comment", "model=x"),
        ("{s}root{s}12{s}(null){s}", "{s}root{s}7{s}(null){s}", "array_job_id", "7"),
    ],
)
def test_squeue_cache_reparses_a_row_when_any_field_changes(
    old: str, new: str, field: str, want: object
) -> None:
    # A cached job handed back for a row that changed would be a stale listing: the
    # reconciler skips a job it has already applied, so it would never see the change.
    s = parse.SEP
    text = (DATA / "squeue.txt").read_text()
    old, new = old.format(s=s), new.format(s=s)
    lines = text.splitlines(keepends=True)
    (i,) = [k for k, ln in enumerate(lines) if ln.startswith("12" + s)]  # a single-row job
    assert lines[i].count(old) == 1
    cache = parse.SqueueCache()
    (before,) = [j for j in parse.parse_squeue(text, "", cache) if j.job_id == "12"]
    lines[i] = lines[i].replace(old, new)
    changed = "".join(lines)
    (after,) = [j for j in parse.parse_squeue(changed, "", cache) if j.job_id == "12"]
    assert getattr(after, field) == want != getattr(before, field)
    assert parse.parse_squeue(changed, "", cache) == parse.parse_squeue(changed)


def test_squeue_cache_keeps_only_the_last_listing_and_follows_the_prefix() -> None:
    text = (DATA / "squeue.txt").read_text()
    cache = parse.SqueueCache()
    parse.parse_squeue(text, "", cache)
    # A row seen under another prefix is not taken to have passed this one's filter.
    assert [j.name for j in parse.parse_squeue(text, "llmgw.m1.", cache)] == ["llmgw.m1.0a0b0c0d"]
    assert len(cache.lines) == 1
    # A job that left the listing leaves the cache.
    assert parse.parse_squeue("", "llmgw.m1.", cache) == []
    assert cache.lines == {}
    # And a row that did not parse is not kept to be handed back later.
    bad = text.replace("2026-12-02T16:48:54", "yesterday", 1)
    jobs = parse.parse_squeue(bad, "", cache)
    assert "12" not in [j.job_id for j in jobs]
    assert all(j.job_id != "12" for j in cache.lines.values())
