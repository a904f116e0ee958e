"""The Batch API end to end on the real cluster, through the official openai client (issue 19).

One daemon for the module's one test (a daemon and its engines cost seconds
each): a batch runs in its own Slurm job with the test engine and completes
with each custom_id once; a slow batch goes on across a daemon restart and
is cancelled mid-way, keeping what was done; a file with bad lines fails at create time and submits nothing;
another user's file is a 404.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import openai
import yaml

from llmgw_slurm.auth.keys import add_key
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, Harness, research_job, running, tiny_model

FAST = tiny_model("fast", scaling={"min": 0, "max": 1})
# 0.2 s a token, 10 tokens: two seconds a request, so a cancel lands mid-way.
SLOW = tiny_model(
    "slow",
    engine={"kind": "command", "command": [*TINY_ENGINE, "--token-delay", "0.2"]},
    scaling={"min": 0, "max": 1},
)


def lines(model: str, n: int, max_tokens: int = 3) -> bytes:
    out = []
    for i in range(n):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": max_tokens,
        }
        out.append(
            {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return "".join(json.dumps(o) + "\n" for o in out).encode()


def client(h: Harness, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0, timeout=60)


def with_batch_section(h: Harness) -> None:
    server = yaml.safe_load(h.server_yaml.read_text())
    server["batch"] = {"partition": "llm", "concurrency": 2, "poll_interval": "1s"}
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))


async def wait_status(c: openai.AsyncOpenAI, batch_id: str, *statuses: str) -> Any:
    async def probe() -> Any:
        b = await c.batches.retrieve(batch_id)
        return b if b.status in statuses else None

    return await eventually(probe, f"batch {batch_id} to be {' or '.join(statuses)}", timeout=120)


async def test_a_batch_runs_as_a_slurm_job_and_a_cancelled_one_keeps_its_results(
    tmp_path: Path, prefix: str
) -> None:
    keys = tmp_path / "keys.json"
    alice, bob = add_key(keys, "alice").key, add_key(keys, "bob").key
    async with running(
        tmp_path,
        prefix,
        [FAST, SLOW],
        router={"keys_file": str(keys)},
        configure=with_batch_section,
    ) as h:
        c = client(h, alice)
        # A file with a duplicate id and an unknown model: failed at once, no job.
        bad = lines("fast", 3) + lines("nope", 1)
        f_bad = await c.files.create(file=("bad.jsonl", io.BytesIO(bad)), purpose="batch")
        b_bad = await c.batches.create(
            input_file_id=f_bad.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert b_bad.status == "failed"
        assert b_bad.errors is not None
        assert [(e.code, e.line) for e in b_bad.errors.data] == [("duplicate_custom_id", 4)]

        # Another user's file is not there for bob.
        f_ok = await c.files.create(
            file=("ok.jsonl", io.BytesIO(lines("fast", 5))), purpose="batch"
        )
        with_bob = client(h, bob)
        try:
            await with_bob.batches.create(
                input_file_id=f_ok.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            raise AssertionError("bob used alice's file")
        except openai.NotFoundError:
            pass
        assert h.jobs() == []

        batch = await c.batches.create(
            input_file_id=f_ok.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "in_progress"
        assert [j[1] for j in h.jobs()] == [f"{prefix}_batch.{batch.id}"]
        done = await wait_status(c, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
        assert done.output_file_id is not None and done.error_file_id is None
        content = (await c.files.content(done.output_file_id)).read()
        out = [json.loads(line) for line in content.splitlines()]
        assert sorted(o["custom_id"] for o in out) == [f"q{i}" for i in range(5)]
        assert {o["response"]["status_code"] for o in out} == {200}
        with_bob_files = await with_bob.files.list()
        assert with_bob_files.data == []

        # A slow batch, cancelled once some requests are done: those are kept.
        f_slow = await c.files.create(
            file=("slow.jsonl", io.BytesIO(lines("slow", 30, max_tokens=10))), purpose="batch"
        )
        slow = await c.batches.create(
            input_file_id=f_slow.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def some_done() -> bool:
            b = await c.batches.retrieve(slow.id)
            return b.request_counts is not None and b.request_counts.completed >= 2

        await eventually(some_done, "the slow batch to answer two requests", timeout=120)
        # A daemon that stops (as a crash leaves things: the job runs on) and starts
        # again finds the batch on disk and its job in Slurm, and the job's reports
        # keep coming.
        before = (await c.batches.retrieve(slow.id)).request_counts
        assert before is not None
        await h.stop()
        await h.start()

        async def more_done() -> bool:
            b = await c.batches.retrieve(slow.id)
            assert b.status == "in_progress", b
            return b.request_counts is not None and b.request_counts.completed > before.completed

        await eventually(more_done, "progress after the daemon's restart", timeout=60)
        cancelling = await c.batches.cancel(slow.id)
        assert cancelling.status == "cancelling"
        cancelled = await wait_status(c, slow.id, "cancelled")
        assert cancelled.request_counts is not None
        kept = cancelled.request_counts.completed
        assert 2 <= kept < 30
        assert cancelled.output_file_id is not None
        content = (await c.files.content(cancelled.output_file_id)).read()
        ids = [json.loads(line)["custom_id"] for line in content.splitlines()]
        assert len(ids) == len(set(ids)) == kept


# A whole node (4 GPUs), so that a research job pinned to its node preempts it.
WHOLE_NODE = tiny_model(
    "whole",
    engine={"kind": "command", "command": [*TINY_ENGINE, "--token-delay", "0.1"]},
    resources={"gpus": 4},
    scaling={"min": 0, "max": 1},
)


def node_of(job_name: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-n", job_name, "-o", "%T|%N"], capture_output=True, text=True, check=True
    ).stdout.strip()
    state, _, node = out.partition("|")
    return node if state == "RUNNING" else ""


async def test_a_preempted_batch_job_is_requeued_and_answers_each_custom_id_once(
    tmp_path: Path, prefix: str
) -> None:
    async with running(tmp_path, prefix, [WHOLE_NODE], configure=with_batch_section) as h:
        c = client(h, "unused")
        n = 40
        f = await c.files.create(
            file=("p.jsonl", io.BytesIO(lines("whole", n, max_tokens=10))), purpose="batch"
        )
        batch = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def some_done() -> bool:
            b = await c.batches.retrieve(batch.id)
            return b.request_counts is not None and b.request_counts.completed >= 4

        await eventually(some_done, "the batch to answer some requests", timeout=120)
        node = node_of(f"{prefix}_batch.{batch.id}")
        assert node, "the batch job is not running"
        research = research_job(prefix, node)
        try:

            async def requeued() -> bool:
                out = subprocess.run(
                    ["squeue", "-h", "-n", f"{prefix}_batch.{batch.id}", "-o", "%T"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
                return out == "PENDING"

            await eventually(requeued, "the batch job to be preempted and requeued")
        finally:
            subprocess.run(["scancel", research], check=False)
        # Slurm holds a requeued job back for a while (its begin time); the test does
        # not wait for that, as an admin would not.
        subprocess.run(
            ["scontrol", "update", f"JobName={prefix}_batch.{batch.id}", "StartTime=now"],
            check=False,
        )
        done = await wait_status(c, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert done.output_file_id is not None and done.request_counts is not None
        assert done.request_counts.completed == n
        content = (await c.files.content(done.output_file_id)).read()
        ids = [json.loads(line)["custom_id"] for line in content.splitlines()]
        assert sorted(ids) == sorted(f"q{i}" for i in range(n))


def with_shards(h: Harness) -> None:
    with_batch_section(h)
    server = yaml.safe_load(h.server_yaml.read_text())
    server["batch"]["shard_lines"] = 20
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))


def tasks_of(job_name: str) -> list[tuple[str, str, str]]:
    """(array task id as squeue prints it, state, node) of each task listed under the name."""
    out = subprocess.run(
        ["squeue", "-h", "-n", job_name, "-o", "%i|%T|%N"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line]  # type: ignore[misc]


async def test_a_sharded_batch_runs_as_an_array_and_a_preempted_shard_repeats_nothing(
    tmp_path: Path, prefix: str
) -> None:
    async with running(tmp_path, prefix, [WHOLE_NODE], configure=with_shards) as h:
        c = client(h, "unused")
        n = 40  # two shards of 20, a whole node each
        f = await c.files.create(
            file=("s.jsonl", io.BytesIO(lines("whole", n, max_tokens=10))), purpose="batch"
        )
        batch = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        name = f"{prefix}_batch.{batch.id}"

        async def both_running() -> list[tuple[str, str, str]] | None:
            listed = [t for t in tasks_of(name) if t[1] == "RUNNING"]
            return listed if len(listed) == 2 else None

        running_tasks = await eventually(both_running, "both shards to run", timeout=60)
        assert sorted(t[0].rsplit("_", 1)[1] for t in running_tasks) == ["0", "1"]

        async def some_done() -> bool:
            b = await c.batches.retrieve(batch.id)
            return b.request_counts is not None and b.request_counts.completed >= 4

        await eventually(some_done, "the shards to answer some requests", timeout=120)
        victim = next(t for t in tasks_of(name) if t[1] == "RUNNING")
        research = research_job(prefix, victim[2])
        try:

            async def requeued() -> bool:
                return any(t[0] == victim[0] and t[1] == "PENDING" for t in tasks_of(name))

            await eventually(requeued, f"shard {victim[0]} to be preempted and requeued")
        finally:
            subprocess.run(["scancel", research], check=False)
        subprocess.run(["scontrol", "update", f"JobName={name}", "StartTime=now"], check=False)
        done = await wait_status(c, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert done.output_file_id is not None and done.request_counts is not None
        assert done.request_counts.completed == n
        content = (await c.files.content(done.output_file_id)).read()
        ids = [json.loads(line)["custom_id"] for line in content.splitlines()]
        assert sorted(ids) == sorted(f"q{i}" for i in range(n))
        # The shards' own copies are gone once merged.
        assert not list((h.folder / "state" / "batch" / "work" / batch.id).glob("shard-*"))
