"""Batches on warm replicas on the dev cluster (issue 37 item 2), through the openai client.

One daemon; model ``warm`` (the test engine, 0.1 s a token, target_inflight 4:
two batch slots a replica) is started by an online request. A batch created
then rides that replica: no batch job is ever submitted, online requests sent
meanwhile are answered, and the batch completes with each custom_id once. A
second batch, whose window less ``batch.warm_margin`` leaves it a minute, is
too slow for that at its pace: once its pace is judged (a minute in) the ride
stops, and a Slurm batch job does the rest, repeating nothing the ride answered.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import openai
import yaml

from llmgw_slurm.batch.routes import BATCH_KEY
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, Harness, running, tiny_model
from tests.slurm.test_batch import client, lines, wait_status

WARM = tiny_model(
    "warm",
    engine={"kind": "command", "command": [*TINY_ENGINE, "--token-delay", "0.1"]},
    scaling={"min": 0, "max": 1, "idle_timeout": "30m", "target_inflight": 4},
)


def warm_batches(h: Harness) -> None:
    server = yaml.safe_load(h.server_yaml.read_text())
    server["batch"] = {
        "partition": "llm",
        "concurrency": 2,
        "poll_interval": "1s",
        "runner": "server",
        "warm": True,
        "warm_share": 0.5,
        # Idle or not, 2 slots of the replica's 4: the late batch's pace below.
        "warm_idle_share": 0.5,
        "warm_margin": "59m",
    }
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))


async def chat(c: openai.AsyncOpenAI) -> str:
    r = await c.chat.completions.create(
        model="warm", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    return r.choices[0].finish_reason or ""


def batch_jobs(h: Harness) -> list[str]:
    return [name for _, name, _ in h.jobs() if "_batch." in name]


async def test_a_batch_rides_the_warm_replica_and_only_what_is_late_goes_to_a_job(
    tmp_path: Path, prefix: str
) -> None:
    async with running(tmp_path, prefix, [WARM], configure=warm_batches) as h:
        c = client(h, "unused")
        assert await chat(c) == "length"  # the replica starts, and is warm
        n = 20
        f = await c.files.create(
            file=("w.jsonl", io.BytesIO(lines("warm", n, max_tokens=4))), purpose="batch"
        )
        batch = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "in_progress"
        # Online requests while it rides: answered, none refused or held.
        online = await asyncio.gather(*(chat(c) for _ in range(6)))
        assert online == ["length"] * 6
        done = await wait_status(c, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert batch_jobs(h) == []  # never a job: the replica had room all along
        assert done.request_counts is not None and done.request_counts.completed == n
        assert done.usage is not None and done.usage.output_tokens == 4 * n
        assert done.output_file_id is not None
        content = (await c.files.content(done.output_file_id)).read()
        ids = [json.loads(x)["custom_id"] for x in content.splitlines()]
        assert sorted(ids) == sorted(f"q{i}" for i in range(n))

        # 2 slots, 1 s a request: 150 requests take over a minute, and the window
        # (1h) less the margin (59m) leaves one. The ride hands the rest to a job.
        n = 150
        f = await c.files.create(
            file=("late.jsonl", io.BytesIO(lines("warm", n, max_tokens=10))), purpose="batch"
        )
        late = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h"
        )

        async def handed_over() -> list[str]:
            return batch_jobs(h)

        assert await eventually(handed_over, "the rest to go to a batch job", timeout=180) == [
            f"{prefix}_batch.{late.id}"
        ]
        assert h.d is not None
        record = h.d.gateway[BATCH_KEY].store.get(late.id)
        assert record is not None and 0 < record.warm_completed < n and record.job_id
        done = await wait_status(c, late.id, "completed", "failed")
        assert done.status == "completed", done
        assert done.request_counts is not None and done.request_counts.completed == n
        assert done.output_file_id is not None
        content = (await c.files.content(done.output_file_id)).read()
        ids = [json.loads(x)["custom_id"] for x in content.splitlines()]
        assert sorted(ids) == sorted(f"q{i}" for i in range(n))  # each once
