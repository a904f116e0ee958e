"""A 2-node replica with a real distributed engine: vLLM's CPU build, the tiny
model split in two by tensor parallelism (one rank per node, over gloo), in a
heterogeneous Slurm job of two components, served through the gateway.

The head (node rank 0) runs ``vllm serve``; the worker runs ``vllm serve
--headless``. They meet at the head's distributed port, either derived from
the job id by every node, or chosen by the head and published in
``rendezvous.dir``. Each case costs one engine start of two ranks (40 s to
2.5 min on a 2-core machine); the derived case then kills the worker's
engine and waits for the replacement, a second start; the dir case ends
with a drain (the time limit's USR1), which stops both nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest

from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import Job, JobState
from tests.engine.conftest import FIGURES
from tests.engine.test_vllm_e2e import (
    MODEL,
    daemon,
    gateway_listening,
    job_logs,
    step_seconds,
    tail,
    write_configs,
)
from tests.procs import listener_pid
from tests.slurm.conftest import eventually

# The engine's start on two ranks: tensor parallel 2 needs the multiprocessing
# executor (uni is one process), which starts one worker per node.
TP_ARGS = ["--tensor-parallel-size", "2"]


def two_node_configs(
    tmp: Path, prefix: str, vllm_python: str, model_dir: Path, rendezvous: str
) -> Path:
    server = write_configs(tmp, prefix, vllm_python, model_dir)
    models = json.loads((tmp / "models.yaml").read_text())
    m = models["models"][0]
    args = list(m["engine"]["args"])
    args[args.index("--distributed-executor-backend") + 1] = "mp"
    m["engine"]["args"] = args + TP_ARGS
    m["resources"]["nodes"] = 2
    (tmp / "models.yaml").write_text(json.dumps(models))
    cfg = json.loads(server.read_text())
    # A replica that dies soon after it served counts as a failed start; the
    # failure case below wants the daemon to start another.
    cfg["reconcile"]["restart"]["give_up_after_failures"] = 3
    server.write_text(json.dumps(cfg))
    if rendezvous == "dir":
        agent = json.loads((tmp / "agent.yaml").read_text())
        shared = tmp / "rendezvous"
        shared.mkdir()
        agent["rendezvous"] = {"dir": str(shared), "timeout": "5m"}
        (tmp / "agent.yaml").write_text(json.dumps(agent))
    return server


async def first_answer(
    client: openai.AsyncOpenAI, s: aiohttp.ClientSession, gw: str, diagnose: Any
) -> Any:
    """The cold request; a failing start fails at once, with the logs."""

    async def start_failed() -> str:
        while True:
            await asyncio.sleep(2)
            async with s.get(gw + "/api/v1/status") as r:
                body = await r.json()
            m = next(m for m in body["models"] if m["name"] == MODEL)
            if m["state"] in ("failing", "backoff"):
                return f"{MODEL} did not start ({m}):\n{diagnose()}"

    first = asyncio.ensure_future(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            temperature=0,
            max_tokens=8,
        )
    )
    watch = asyncio.ensure_future(start_failed())
    await asyncio.wait({first, watch}, return_when=asyncio.FIRST_COMPLETED)
    if watch.done():
        first.cancel()
        pytest.fail(watch.result())
    watch.cancel()
    try:
        return first.result()
    except openai.APIError as err:
        pytest.fail(f"the first request failed: {err!r}\n{diagnose()}")


async def streamed_text(client: openai.AsyncOpenAI) -> tuple[str, int]:
    pieces: list[str] = []
    chunks = 0
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        max_tokens=8,
        stream=True,
    )
    async for chunk in stream:
        chunks += 1
        pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    return "".join(pieces), chunks


def all_logs(state: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((state / "logs").glob("*.out")))


async def active_jobs(backend: CliBackend, prefix: str) -> list[Job]:
    """Queued or running: the listing keeps finished jobs for a while (MinJobAge)."""
    return [j for j in await backend.list_jobs(prefix) if j.state.is_active]


def worker_engine(replica_id: str) -> int | None:
    """The pid of the headless vLLM a worker's agent started for this replica."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if b"--headless" not in argv:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
            ppid = next(
                line.split()[1]
                for line in (d / "status").read_text().splitlines()
                if line.startswith("PPid:")
            )
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except OSError:
            continue
        # Not one of the engine's own children: the process the agent started.
        if f"LLMGW_REPLICA_ID={replica_id}".encode() in env and b"llmgw_slurm.agent" in parent:
            return int(d.name)
    return None


async def worker_death_ends_the_replica(
    client: openai.AsyncOpenAI, backend: CliBackend, prefix: str, rep: dict[str, Any], state: Path
) -> None:
    """The worker's engine killed: the whole job ends (no half-alive head keeps
    taking requests), and the next request is served by a new job."""
    pid = worker_engine(rep["id"])
    assert pid is not None, f"no headless vLLM for replica {rep['id']}:\n{job_logs(state)}"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    async def job_gone() -> bool:
        # Its job id, not the prefix: the model was asked for moments ago, so
        # the daemon may already have submitted the replacement.
        return rep["job_id"] not in {j.job_id for j in await active_jobs(backend, prefix)}

    await eventually(job_gone, "the job to end after its worker's engine died", timeout=180)
    FIGURES["2-node: worker engine killed to job gone"] = f"{time.monotonic() - t0:.1f}s"
    port = urlsplit(rep["url"]).port
    assert port is not None and listener_pid(port, "serve") is None, "the head's engine lives on"
    # The worker's agent saw its engine die and failed the srun step
    # (--kill-on-bad-exit), which ended the head too.
    assert "engine exited with code -9 while serving" in all_logs(state), job_logs(state)

    t1 = time.monotonic()
    again = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Still there?"}],
        temperature=0,
        max_tokens=4,
    )
    FIGURES["2-node: request after the failure (backoff + new job)"] = (
        f"{time.monotonic() - t1:.1f}s"
    )
    assert again.usage is not None and again.usage.completion_tokens > 0
    (new_job,) = await active_jobs(backend, prefix)
    assert new_job.job_id != rep["job_id"]


def replica_processes(replica_id: str) -> list[int]:
    """Every process started for this replica: agents, engines and their workers."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"LLMGW_REPLICA_ID={replica_id}".encode() in env:
                pids.append(int(d.name))
    return pids


async def drain_stops_both_nodes(
    backend: CliBackend, prefix: str, rep: dict[str, Any], state: Path
) -> None:
    """The time limit's warning (USR1 to the batch shell, which srun forwards to
    every agent) drains the head and stops the worker: the job ends cleanly and
    nothing of the replica is left on either node."""
    assert replica_processes(rep["id"]), "no process of the replica to begin with"
    t0 = time.monotonic()
    subprocess.run(["scancel", "--batch", "--signal=USR1", rep["job_id"]], check=True, timeout=30)

    async def job_gone() -> bool:
        return rep["job_id"] not in {j.job_id for j in await active_jobs(backend, prefix)}

    await eventually(job_gone, "the job to end after the drain", timeout=180)
    FIGURES["2-node: drain (USR1) to job gone"] = f"{time.monotonic() - t0:.1f}s"
    # Both agents exited 0: srun's step, and so the job, completed.
    (final,) = [j for j in await backend.list_jobs(prefix) if j.job_id == rep["job_id"]]
    assert final.state is JobState.COMPLETED, (final.state, job_logs(state))
    # No engine died under its agent: each was stopped by it.
    assert "while serving" not in all_logs(state), job_logs(state)

    async def nothing_left() -> bool:
        return not replica_processes(rep["id"])

    await eventually(nothing_left, "every process of the replica to end", timeout=60)


@pytest.mark.parametrize("rendezvous", ["derived", "dir"])
async def test_two_node_tensor_parallel_replica_through_the_gateway(
    tmp_path: Path, vllm_python: str, tiny_model: Path, rendezvous: str
) -> None:
    # A prefix of each case's own ("derived" and "dir" share a first letter):
    # a daemon adopts the jobs of its prefix, the last case's still completing.
    prefix = f"llmgwTmn{rendezvous[:3]}{os.getpid() % 100000}."
    server = two_node_configs(tmp_path, prefix, vllm_python, tiny_model, rendezvous)
    cfg = json.loads(server.read_text())
    gw = "http://" + cfg["listen"]["gateway"]
    state = Path(cfg["state_dir"])
    dlog = tmp_path / "daemon.log"
    backend = CliBackend(timeout=60)

    def diagnose() -> str:
        return f"daemon log:\n{tail(dlog)}\njob logs:\n{job_logs(state)}"

    try:
        async with daemon(server, dlog) as proc, aiohttp.ClientSession() as s:
            await gateway_listening(proc, s, gw, dlog)
            client = openai.AsyncOpenAI(
                base_url=gw + "/v1", api_key="no-gateway-keys", max_retries=0, timeout=600
            )
            t0 = time.monotonic()
            chat = await first_answer(client, s, gw, diagnose)
            FIGURES[f"2-node cold request, rendezvous {rendezvous}"] = (
                f"{time.monotonic() - t0:.2f}s"
            )
            assert isinstance(chat.choices[0].message.content, str)
            assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8
            assert chat.model == MODEL

            # Streamed: the same greedy answer, in pieces, ended by [DONE]
            # (the client raises on a stream cut short).
            text, chunks = await streamed_text(client)
            assert chunks >= 2
            assert text == chat.choices[0].message.content

            async with s.get(gw + "/api/v1/status") as r:
                body = await r.json()
            m = next(m for m in body["models"] if m["name"] == MODEL)
            (rep,) = m["replicas"]
            jobs = await active_jobs(backend, prefix)
            assert len(jobs) == 1, jobs
            nodes = [n for c in jobs[0].components for n in c.nodes]
            # Two components, one node each, and two different nodes.
            assert len(jobs[0].components) == 2 and len(set(nodes)) == 2, jobs[0]
            assert rep["url"].split("//")[1].split(":")[0] == jobs[0].components[0].nodes[0]

            log_text = all_logs(state)
            # The worker ran vLLM headless: only `serve` honours --headless.
            assert "--headless" in log_text, job_logs(state)
            for step in ("rendezvous", "engine_launch", "readiness"):
                secs = step_seconds(log_text, step)
                assert secs is not None, f"no 'step {step}: done' in:\n{job_logs(state)}"
                FIGURES[f"2-node ({rendezvous}) agent step {step}"] = f"{secs:.1f}s"
            if rendezvous == "derived":
                # Once is enough: how the nodes met does not change how they fail.
                await worker_death_ends_the_replica(client, backend, prefix, rep, state)
            else:
                await drain_stops_both_nodes(backend, prefix, rep, state)
            await client.close()
    finally:
        leftover = await backend.list_jobs(prefix)
        if leftover:
            subprocess.run(["scancel", *[j.job_id for j in leftover]], check=False, timeout=30)
