"""Cold start: from the first request for a cold model to its first token.

On the dev cluster (``eval "$(scripts/dev-cluster env)"``), with a real daemon
whose replicas are real Slurm jobs running the agent and the test engine:

- total: request sent (streaming) -> first token received;
- its parts as the daemon saw them: request -> sbatch returned, sbatch ->
  the agent's first report, each agent step (as the agent timed it), the
  agent's ready -> routed (the daemon's own probe), routed -> first token;
- two references measured alone in the same run: Slurm's dispatch (a bare
  ``sbatch`` of a job that only writes a timestamp: submit -> script runs)
  and the engine's own start (the test engine started directly -> healthy).

The control plane's share is total - Slurm dispatch - engine start. Goal of the
project: under 1 s.

    python3 bench/cold_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

from bench.common import median, print_table, result, write
from tests.slurm.harness import free_port, running, tiny_model


async def bare_dispatch(folder: Path) -> float:
    """Submit -> the batch script writes its first line, for a job that does nothing else."""
    stamp = folder / f"stamp-{secrets.token_hex(3)}"
    t0 = time.time()
    proc = await asyncio.create_subprocess_exec(
        "sbatch",
        "--parsable",
        "-p",
        "llm",
        "--gres=gpu:a100:1",
        "--job-name=llmgwbench.dispatch",
        "-o",
        "/dev/null",
        "--wrap",
        f"date +%s.%N > {stamp}",
        stdout=asyncio.subprocess.DEVNULL,
    )
    await proc.wait()
    while not stamp.exists() or not stamp.read_text().strip():
        await asyncio.sleep(0.01)
    return float(stamp.read_text()) - t0


async def engine_alone() -> float:
    port = free_port()
    t0 = time.time()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw_slurm.testing.engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        "k",
        "--served-name",
        "m",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as s:
            while True:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            return time.time() - t0
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.01)
    finally:
        proc.terminate()
        await proc.wait()


async def one_cold_start(folder: Path) -> dict[str, float]:
    prefix = f"llmgwbench{secrets.token_hex(2)}."
    async with running(folder, prefix, [tiny_model("cold")], interval="10s") as h:
        client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
        t0 = time.time()
        stream = await client.chat.completions.create(
            model="cold",
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=3,
            stream=True,
        )
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.time()
        await client.close()
        assert first is not None
        (rep,) = h.rec.replicas.values()
        submit = next(d for d in h.decisions("submit")).at
        ready = next(d for d in h.decisions("ready")).at
        steps = dict(rep.step_seconds)
        first_report = rep.first_report_at
        return {
            "total": first - t0,
            "request_to_submit": submit - t0,
            "submit_to_agent": first_report - submit,
            "agent_steps": sum(steps.values()),
            **{f"step_{k}": v for k, v in steps.items()},
            "agent_ready_to_routed": ready - first_report - sum(steps.values()),
            "routed_to_first_token": first - ready,
        }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit('set SLURM_CONF first: eval "$(scripts/dev-cluster env)"')
    runs: list[dict[str, float]] = []
    dispatch: list[float] = []
    alone: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            dispatch.append(await bare_dispatch(Path(tmp)))
            alone.append(await engine_alone())
            runs.append(await one_cold_start(Path(tmp) / f"run{i}"))
    subprocess.run(["scancel", "--name=llmgwbench.dispatch"], check=False)
    keys = sorted({k for r in runs for k in r})
    med = {k: median([r[k] for r in runs if k in r]) for k in keys}
    d, e = median(dispatch), median(alone)
    results: list[dict[str, Any]] = [
        result(
            "cold start: request -> first token",
            med["total"],
            "s",
            "Slurm dispatch + engine start",
            d + e,
        ),
        result(
            "control plane share (total - dispatch - engine)",
            med["total"] - d - e,
            "s",
            "goal",
            1.0,
        ),
    ]
    print_table(results)
    print(f"\nparts (medians of {len(runs)} runs):")
    for k in keys:
        print(f"  {k:32} {med[k] * 1000:8.1f} ms")
    print(f"  {'ref: bare Slurm dispatch':32} {d * 1000:8.1f} ms")
    print(f"  {'ref: engine start alone':32} {e * 1000:8.1f} ms")
    results += [
        result(f"part: {k}", med[k], "s", "total", med["total"]) for k in keys if k != "total"
    ]
    print(f"\nwritten {write('cold_start', results)}")


if __name__ == "__main__":
    asyncio.run(main())
