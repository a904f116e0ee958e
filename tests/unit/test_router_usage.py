"""Usage records: durable, batched, queryable by key and time."""

from __future__ import annotations

from pathlib import Path

from llmgw_slurm.accounting.usage import UsageRecord, UsageStore, query_usage


def _rec(ts: float, key: str, model: str, p: int, c: int) -> UsageRecord:
    return UsageRecord(ts, key, f"user-{key}", "", model, "completions", p, c, p + c)


async def test_records_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state" / "usage.sqlite3"
    store = UsageStore(path, flush_interval_s=3600)
    store.start()
    store.record(_rec(100.0, "k1", "m", 1, 2))
    store.record(_rec(200.0, "k1", "m", 3, 4))
    store.record(_rec(200.0, "k2", "m", 5, 6))
    store.record(_rec(300.0, "k1", "n", 7, 8))
    # Nothing is committed until a flush; close flushes.
    assert query_usage(path) == []
    await store.close()
    rows = query_usage(path, key_id="k1")
    assert [(r.model, r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        ("m", 2, 4, 6),
        ("n", 1, 7, 8),
    ]
    since = query_usage(path, key_id="k1", since=150.0)
    assert [(r.model, r.requests) for r in since] == [("m", 1), ("n", 1)]
    assert {r.key_id for r in query_usage(path)} == {"k1", "k2"}
    reopened = UsageStore(path)
    reopened.record(_rec(400.0, "k2", "m", 1, 1))
    await reopened.flush()
    assert reopened.summary(key_id="k2")[0].requests == 2
    await reopened.close()


def test_query_of_missing_database_is_empty(tmp_path: Path) -> None:
    assert query_usage(tmp_path / "nope.sqlite3") == []
