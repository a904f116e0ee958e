"""The job side on the real one-machine cluster: rendered scripts, the agent, signals.

Each test renders a replica script with llmgw_slurm.sbatch, submits it with
the secrets in the sbatch environment (never argv), and watches the agent
report to a fake daemon on localhost. The engine is tests/fake_engine.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from llmgw_slurm.catalog import Resources
from llmgw_slurm.sbatch import (
    HetComponent,
    HetReplicaParams,
    JobOptions,
    ModelJobParams,
    ReplicaParams,
    render_model_job,
    render_replica,
    render_replica_hetjob,
)
from llmgw_slurm.slurm import JobSpec, JobState
from llmgw_slurm.slurm.cli import CliBackend
from tests.agent_support import (
    KEY,
    RID,
    SECRET,
    FakeDaemon,
    as_gateway,
    fake_daemon,
    fake_engine_spec,
    gateway_identity,
)
from tests.slurm.conftest import TOP, eventually

# The gateway these tests play: the job gets its certificate; it keeps the key.
GATEWAY = gateway_identity(Path(tempfile.mkdtemp(prefix="llmgw-test-gateway-")))

AGENT_YAML = """\
weights:
  cache_dir: {cache}
heartbeat_interval: 1s
readiness: {{poll_interval: 0.2s, timeout: 2m}}
drain: {{poll_interval: 0.2s, grace: 1s, stop_grace: 3s, timeout: 20s}}
report_timeout: 2s
"""


def setup_files(tmp_path: Path, nodes: int = 1) -> tuple[Path, str]:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(AGENT_YAML.format(cache=tmp_path / "cache"))
    return agent_yaml, fake_engine_spec(weights, nodes=nodes, gpus=1)


def job_env(daemon: FakeDaemon, spec: str) -> dict[str, str]:
    return {
        "LLMGW_REPLICA_ID": RID,
        "LLMGW_MODEL": "tiny",
        "LLMGW_DAEMON_URL": daemon.url,
        "LLMGW_REPLICA_SECRET": SECRET,
        "LLMGW_ENGINE_API_KEY": KEY,
        "LLMGW_REPLICA_SPEC": spec,
        "LLMGW_GATEWAY_CERT": GATEWAY.cert_pem,
        # The job must import this checkout's llmgw_slurm.
        "PYTHONPATH": str(TOP),
    }


def job_options(prefix: str, tmp_path: Path) -> JobOptions:
    return JobOptions(
        job_name=f"{prefix}tiny.{RID}",
        time="10",
        output=str(tmp_path / "job-%j.out"),
        python=sys.executable,
        partition="llm",
    )


def job_log(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("job-*.out")))


async def ended(backend: CliBackend, prefix: str, job_id: str) -> bool:
    jobs = [j for j in await backend.list_jobs(prefix) if j.job_id == job_id]
    return not jobs or jobs[0].state.is_finished


async def test_replica_serves_and_drains_on_the_time_limit_warning(
    backend: CliBackend, prefix: str, tmp_path: Path
) -> None:
    agent_yaml, spec = setup_files(tmp_path)
    script = render_replica(
        ReplicaParams(
            job_options(prefix, tmp_path),
            Resources(gpus=1, gpu_type="a100", cpus=2),
            str(agent_yaml),
            signal_before_s=60,
        )
    )
    async with fake_daemon() as daemon:
        job_id = await backend.submit(
            JobSpec(name=f"{prefix}tiny.{RID}", script=script, env=job_env(daemon, spec))
        )
        try:
            await daemon.wait_for(lambda: "ready" in daemon.events(), 120)
        except AssertionError:
            raise AssertionError(job_log(tmp_path)) from None
        ready = next(r for r in daemon.reports if r["event"] == "ready")
        assert ready["job_id"] == job_id
        assert ready["node"].startswith("gpunode")
        assert ready["url"].startswith(f"https://{ready['node']}:")
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=False
        ).stdout
        assert SECRET not in shown and KEY not in shown
        headers = {"Authorization": f"Bearer {KEY}"}
        async with as_gateway(GATEWAY, ready["cert"], headers=headers) as s:
            async with s.get(f"{ready['url']}/v1/models") as r:
                assert r.status == 200
            # A request in flight when the time-limit warning comes must finish:
            # slurmstepd delivers the USR1 to the engine too, which ignores it.
            body = {"model": "tiny", "messages": [], "llmgw_test_delay_s": 2}
            slow = asyncio.create_task(s.post(f"{ready['url']}/v1/chat/completions", json=body))
            while True:
                async with s.get(f"{ready['url']}/metrics") as r:
                    if "} 1.0" in await r.text():
                        break
                await asyncio.sleep(0.05)
            # What --signal=B:USR1 does ahead of the time limit, sent now.
            subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
            resp = await slow
            assert resp.status == 200
            resp.release()
        await daemon.wait_for(lambda: "stopped" in daemon.events(), 60)
        await eventually(lambda: ended(backend, prefix, job_id), "the job to end")
    stopped = daemon.reports[-1]
    assert stopped["event"] == "stopped" and "SIGUSR1" in stopped["message"]
    ev = daemon.events()
    assert ev.index("ready") < ev.index("draining") < ev.index("stopped")
    assert "drain: 1 request(s) in flight" in job_log(tmp_path)
    assert "llmgw_slurm.agent.runner: step drain: done" in job_log(tmp_path)


async def test_cancel_drains_within_killwait(
    backend: CliBackend, prefix: str, tmp_path: Path
) -> None:
    agent_yaml, spec = setup_files(tmp_path)
    script = render_replica(
        ReplicaParams(job_options(prefix, tmp_path), Resources(gpus=1), str(agent_yaml))
    )
    async with fake_daemon() as daemon:
        job_id = await backend.submit(
            JobSpec(name=f"{prefix}tiny.{RID}", script=script, env=job_env(daemon, spec))
        )
        await daemon.wait_for(lambda: "ready" in daemon.events(), 120)
        url = next(r["url"] for r in daemon.reports if r["event"] == "ready")
        subprocess.run(["scancel", job_id], check=True)
        # KillWait is 5 s on the dev cluster: the agent must report in time.
        await daemon.wait_for(lambda: "stopped" in daemon.events(), 30)
        await eventually(lambda: ended(backend, prefix, job_id), "the job to end")
    assert "SIGTERM" in daemon.reports[-1]["message"]
    host, port = url.removeprefix("https://").split(":")
    import socket

    with socket.socket() as sock:
        sock.settimeout(2)
        assert sock.connect_ex((host, int(port))) != 0, "the engine outlived its job"


async def test_two_node_replica_as_a_het_job(
    backend: CliBackend, prefix: str, tmp_path: Path
) -> None:
    agent_yaml, spec = setup_files(tmp_path, nodes=2)
    script = render_replica_hetjob(
        HetReplicaParams(
            job_options(prefix, tmp_path),
            [
                HetComponent(1, Resources(gpus=1, cpus=2)),
                HetComponent(1, Resources(gpus=1, cpus=2)),
            ],
            str(agent_yaml),
        )
    )
    async with fake_daemon() as daemon:
        job_id = await backend.submit(
            JobSpec(name=f"{prefix}tiny.{RID}", script=script, env=job_env(daemon, spec))
        )
        try:
            await daemon.wait_for(lambda: "ready" in daemon.events(), 120)
        except AssertionError:
            raise AssertionError(job_log(tmp_path)) from None
        jobs = [j for j in await backend.list_jobs(prefix) if j.job_id == job_id]
        assert jobs and jobs[0].heterogeneous and jobs[0].state is JobState.RUNNING
        head_node = jobs[0].components[0].nodes[0]
        ready = next(r for r in daemon.reports if r["event"] == "ready")
        assert ready["node"] == head_node
        # Both agents ran their steps; the fake head serves only once the
        # worker joined its master port, so ready proves the rendezvous.
        assert daemon.events().count("rendezvous:done") == 2
        nodes = {r["node"] for r in daemon.reports if r["event"] == "step"}
        assert len(nodes) == 2
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        await daemon.wait_for(lambda: "stopped" in daemon.events(), 60)
        await eventually(lambda: ended(backend, prefix, job_id), "the het job to end")
    ev = daemon.events()
    assert ev.count("ready") == 1 and ev.count("stopped") == 1 and "failed" not in ev
    assert "master gone, worker exits" in job_log(tmp_path)


async def test_model_job_fetches_into_the_cache_once(
    backend: CliBackend, prefix: str, tmp_path: Path
) -> None:
    agent_yaml, spec = setup_files(tmp_path)
    script = render_model_job(
        ModelJobParams(job_options(prefix, tmp_path), str(agent_yaml), Resources(gpus=0, cpus=1))
    )
    env = {"LLMGW_REPLICA_SPEC": spec, "PYTHONPATH": str(TOP)}
    for n in (1, 2):
        job_id = await backend.submit(JobSpec(name=f"{prefix}fetch.{RID}", script=script, env=env))
        await eventually(lambda j=job_id: ended(backend, prefix, j), "the model job to end")
        await eventually(
            lambda n=n: asyncio.sleep(0, result=job_log(tmp_path).count(f"tiny: {tmp_path}") == n),
            "its output",
        )
    log = job_log(tmp_path)
    assert log.count("(fetched,") == 1 and log.count("(already there,") == 1, log
    (copy,) = (tmp_path / "cache" / "models").iterdir()
    assert (copy / ".llmgw-manifest.json").exists() and (copy / "config.json").exists()


async def test_two_node_replica_ranks_meet_before_rank_0_serves_through_the_daemon(
    tmp_path: Path, prefix: str
) -> None:
    from tests.slurm.harness import TINY_ENGINE, running, tiny_model

    model = tiny_model(
        "duo",
        engine={"kind": "command", "command": [*TINY_ENGINE, "--rendezvous"]},
        resources={"nodes": 2, "cpus": 1},
    )
    async with running(tmp_path, prefix, [model]) as h, aiohttp.ClientSession() as s:
        body = {"model": "duo", "messages": [{"role": "user", "content": "two nodes"}]}
        async with s.post(f"{h.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert answer["choices"][0]["message"]["content"].startswith("two nodes")
        (ep,) = h.rec.endpoints("duo")
        headers = {"Authorization": f"Bearer {ep.api_key}"}
        async with s.get(f"{ep.base_url}/debug/stats", headers=headers, ssl=ep.ssl) as resp:
            stats = await resp.json()
        # Rank 0's health waited on this barrier: rank 1 really joined it.
        assert stats["ranks"] == [0, 1]
        (rep,) = h.rec.replicas.values()
        # Ready can come from the agent's report before the listing names the nodes.
        await eventually(
            lambda: asyncio.sleep(0, len(set(rep.nodes)) == 2), "the listing to name both nodes"
        )
        assert rep.node_count == 2


async def test_a_failed_weights_fetch_reaches_the_daemons_status_with_its_cause(
    tmp_path: Path, prefix: str
) -> None:
    from tests.slurm.harness import running, tiny_model

    missing = tmp_path / "no-weights-here"
    model = tiny_model(
        "unfetched",
        weights={"source": str(missing), "method": "copy"},
        scaling={"min": 1, "max": 1},
    )
    async with running(tmp_path, prefix, [model]) as h:

        async def failed() -> dict[str, Any] | None:
            for d in h.rec.status()["decisions"]:
                if d["model"] == "unfetched" and "does not exist" in d["reason"]:
                    return dict(d)
            return None

        # The agent reports the failed step; the daemon cancels the job as a failed start.
        d = await eventually(failed, "the fetch failure in the daemon's status", 120)
        assert d["action"] == "cancel", d
        assert d["reason"].startswith("start failed:"), d
        assert f"copy source {missing} does not exist" in d["reason"], d
        assert h.rec.failures["unfetched"].count >= 1
        assert "does not exist" in h.rec.failures["unfetched"].cause
