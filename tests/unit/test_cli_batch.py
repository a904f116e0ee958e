"""``llmgw batch`` against a real daemon whose batch jobs a recording backend takes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_support import RunningDaemon, run_daemon
from click.testing import CliRunner

from llmgw_slurm.batch import results
from llmgw_slurm.batch.routes import BATCH_KEY
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.cli.researcher import main
from tests.unit.test_batch import Backend


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    # No timed poll during the test: it polls when the test says.
    yield from run_daemon(tmp_path, extra="batch: {poll_interval: 1h}\n")


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("LLMGW_URL", raising=False)
    monkeypatch.delenv("LLMGW_API_KEY", raising=False)


def llmgw(rd: RunningDaemon, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["--url", rd.url, *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


def requests(tmp_path: Path, *cids: str, model: str | None = None) -> Path:
    p = tmp_path / "in.jsonl"
    lines = []
    for c in cids:
        body: dict[str, object] = {"messages": [{"role": "user", "content": c}]}
        if model:
            body["model"] = model
        lines.append({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": body})
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def service(rd: RunningDaemon) -> BatchService:
    return rd.d.gateway[BATCH_KEY]


def test_submit_status_download_and_the_errors_of_a_bad_file(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    backend = Backend()
    service(rd).backend = backend  # type: ignore[assignment]
    code, out = llmgw(rd, "batch", "submit", str(requests(tmp_path, "a", "a", model="tiny")))
    assert code == 1
    assert "line 2: The custom_id 'a' is also on an earlier line" in out
    assert backend.submitted == []

    code, out = llmgw(rd, "batch", "submit", str(requests(tmp_path, "a", "b")), "--model", "tiny")
    assert code == 0, out
    batch_id, shown = out.splitlines()[:2]
    assert shown == "in_progress [" + "." * 30 + "] 0/2"
    assert len(backend.submitted) == 1

    svc = service(rd)
    work = svc.store.work_dir(batch_id)
    (work / results.OUTPUT).write_text(
        "".join(json.dumps({"custom_id": c, "response": {"status_code": 200}}) + "\n" for c in "ab")
    )
    asyncio.run_coroutine_threadsafe(svc.poll(), rd.loop).result(30)
    code, out = llmgw(rd, "batch", "status", batch_id)
    assert out.splitlines()[0] == "completed [" + "#" * 30 + "] 2/2", out
    code, out = llmgw(rd, "batch", "list")
    assert batch_id in out and "completed" in out and "2/2" in out
    target = tmp_path / "answers.jsonl"
    code, out = llmgw(rd, "batch", "download", batch_id, "-o", str(target))
    assert code == 0 and [json.loads(x)["custom_id"] for x in target.read_text().splitlines()] == [
        "a",
        "b",
    ]
    code, out = llmgw(rd, "batch", "download", batch_id, "--errors")
    assert code == 0 and out == f"batch {batch_id} (completed) has no error lines\n"
    code, out = llmgw(rd, "batch", "cancel", batch_id)
    assert code == 1 and "only a running batch can be cancelled. (HTTP 409)" in out
    code, out = llmgw(rd, "batch", "status", "batch_" + "0" * 24)
    assert code == 1 and "No batch with id" in out and "(HTTP 404)" in out
