"""A Batch API batch run by vLLM's offline runner (run_batch, CPU build) in a Slurm job,
through the official openai client (issue 19): files.create, batches.create, poll,
files.content, the output checked line by line against the input's custom_ids.

200 requests of 4 tokens: the model loads once per job (about 40 s here),
and the requests together take a few seconds more.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

from llmgw_slurm.slurm.cli import CliBackend
from tests.engine.conftest import FIGURES
from tests.engine.test_vllm_e2e import (
    MODEL,
    START_TIMEOUT,
    daemon,
    gateway_listening,
    tail,
    write_configs,
)
from tests.slurm.conftest import eventually

# 200 as the issue asks: enough that run_batch schedules many at once, and few
# enough (4 tokens each) that the job's time is the model's load, not the requests.
REQUESTS = 200


def batch_input() -> bytes:
    lines = []
    for i in range(REQUESTS):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Question {i}?"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


async def test_a_batch_runs_through_vllms_offline_runner_in_a_slurm_job(
    tmp_path: Path, vllm_python: str, tiny_model: Path
) -> None:
    prefix = f"llmgwTvb{os.getpid() % 100000}."
    server = write_configs(tmp_path, prefix, vllm_python, tiny_model)
    cfg = json.loads(server.read_text())
    cfg["batch"] = {"poll_interval": "2s"}
    server.write_text(json.dumps(cfg))
    gw = "http://" + cfg["listen"]["gateway"]
    dlog = tmp_path / "daemon.log"
    work = Path(cfg["state_dir"]) / "batch" / "work"

    def diagnose() -> str:
        logs = "\n".join(f"--- {p}\n{tail(p)}" for p in sorted(work.glob("*/job-*.out")))
        return f"daemon log:\n{tail(dlog)}\njob logs:\n{logs}"

    try:
        async with daemon(server, dlog) as proc, aiohttp.ClientSession() as s:
            await gateway_listening(proc, s, gw, dlog)
            c = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="none", max_retries=0)
            f = await c.files.create(file=("in.jsonl", io.BytesIO(batch_input())), purpose="batch")
            t0 = time.monotonic()
            b = await c.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert b.status == "in_progress", b

            async def ended() -> Any:
                got = await c.batches.retrieve(b.id)
                return got if got.status in ("completed", "failed") else None

            done = await eventually(ended, "the batch to end", timeout=START_TIMEOUT + 120)
            FIGURES[f"batch of {REQUESTS} through run_batch, create to completed"] = (
                f"{time.monotonic() - t0:.1f}s"
            )
            assert done.status == "completed", f"{done}\n{diagnose()}"
            assert done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (REQUESTS, 0)
            assert done.output_file_id is not None
            text = (await c.files.content(done.output_file_id)).read()
            wanted = [json.loads(line)["custom_id"] for line in batch_input().splitlines()]
            out = [json.loads(line) for line in text.splitlines()]
            seen: set[str] = set()
            for n, o in enumerate(out, start=1):
                cid = o["custom_id"]
                assert cid in wanted and cid not in seen, f"output line {n}: {cid!r}"
                seen.add(cid)
            assert len(out) == len(wanted) == REQUESTS
            for o in out:
                body = o["response"]["body"]
                assert o["response"]["status_code"] == 200
                assert body["model"] == MODEL and body["choices"][0]["message"]["content"]
                assert body["usage"]["completion_tokens"] == 4
            assert done.usage is not None and done.usage.output_tokens == 4 * REQUESTS
    finally:
        leftover = await CliBackend(timeout=60).list_jobs(prefix)
        if leftover:
            subprocess.run(["scancel", *[j.job_id for j in leftover]], check=False, timeout=30)
