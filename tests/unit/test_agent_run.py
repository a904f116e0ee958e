"""The agent end to end, without Slurm: a fake engine, a fake daemon, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw_slurm.agent.runner import Agent, job_context_from_env
from llmgw_slurm.auth.tls import client_context
from llmgw_slurm.config import (
    AgentConfig,
    AgentWeightsConfig,
    DrainConfig,
    PortRange,
    ReadinessConfig,
    RendezvousConfig,
)
from tests.agent_support import (
    KEY,
    RID,
    SECRET,
    FakeDaemon,
    fake_daemon,
    fake_engine_spec,
    gateway_identity,
)
from tests.hostile_user import INTRUDER
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
# The gateway's client identity these tests play: the certificate goes to the job.
GATEWAY = gateway_identity(Path(tempfile.mkdtemp(prefix="llmgw-test-gateway-")))


@pytest.fixture
async def daemon() -> AsyncIterator[FakeDaemon]:
    async with fake_daemon() as fake:
        yield fake


def make_weights(tmp_path: Path) -> Path:
    src = tmp_path / "weights-src"
    src.mkdir()
    (src / "config.json").write_text('{"hidden_size": 64}')
    (src / "model.safetensors").write_bytes(b"\0" * 4096)
    return src


def spec_json(weights: Path, *engine_extra: str) -> str:
    return fake_engine_spec(weights, *engine_extra, ready_timeout=60)


def job_env(daemon_url: str, spec: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LLMGW_"))}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        LLMGW_REPLICA_ID=RID,
        LLMGW_MODEL="tiny",
        LLMGW_DAEMON_URL=daemon_url,
        LLMGW_REPLICA_SECRET=SECRET,
        LLMGW_ENGINE_API_KEY=KEY,
        LLMGW_REPLICA_SPEC=spec,
        LLMGW_GATEWAY_CERT=GATEWAY.cert_pem,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        SLURM_PROCID="0",
        SLURM_JOB_NUM_NODES="1",
    )
    return env


AGENT_OPTS = [
    "--bind-host",
    "127.0.0.1",
    "--advertise-host",
    "127.0.0.1",
    "--heartbeat-interval",
    "0.2",
    "--ready-poll",
    "0.1",
    "--drain-poll",
    "0.1",
    "--drain-timeout",
    "30",
    "--stop-grace",
    "5",
    "--report-timeout",
    "2",
]


async def start_agent(
    tmp_path: Path, env: dict[str, str], name: str = "agent", extra: tuple[str, ...] = ()
) -> asyncio.subprocess.Process:
    argv = [
        sys.executable,
        "-m",
        "llmgw_slurm.agent.main",
        "--cache-dir",
        str(tmp_path / "cache"),
        *AGENT_OPTS,
        *extra,
        "run",
    ]
    out = (tmp_path / f"{name}.out").open("wb")
    err = (tmp_path / f"{name}.err").open("wb")
    return await asyncio.create_subprocess_exec(*argv, env=env, stdout=out, stderr=err)


async def wait_exit(proc: asyncio.subprocess.Process, tmp_path: Path, name: str = "agent") -> int:
    try:
        return await asyncio.wait_for(proc.wait(), 60)
    except TimeoutError:
        proc.kill()
        pytest.fail(f"{name} did not exit; stderr:\n" + (tmp_path / f"{name}.err").read_text())


def gateway_session(daemon: FakeDaemon, **kw: object) -> aiohttp.ClientSession:
    """A client as the gateway is: its certificate, pinning the one the agent reported."""
    cert = next(r["cert"] for r in daemon.reports if r["event"] == "ready")
    ctx = client_context(cert, GATEWAY.cert_file, GATEWAY.key_file)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx), **kw)  # type: ignore[arg-type]


def engine_answers(url: str) -> bool:
    host, port = url.removeprefix("https://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
async def test_ready_serve_and_drain_on_signal(
    daemon: FakeDaemon, tmp_path: Path, sig: signal.Signals
) -> None:
    env = job_env(daemon.url, spec_json(make_weights(tmp_path)))
    proc = await start_agent(tmp_path, env)
    try:
        await daemon.wait_for(lambda: "ready" in daemon.events())
        ready = next(r for r in daemon.reports if r["event"] == "ready")
        url = ready["url"]
        assert ready["job_id"] == "4242" and url.startswith("https://127.0.0.1:")
        await daemon.wait_for(lambda: daemon.events().count("heartbeat") >= 2)
        assert all(r["url"] == url for r in daemon.reports if r["event"] == "heartbeat")

        headers = {"Authorization": f"Bearer {KEY}"}
        async with gateway_session(daemon, headers=headers) as s:
            async with s.get(f"{url}/v1/models") as r:
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == "tiny"
            # A request in flight when the signal comes must finish.
            body = {"model": "tiny", "messages": [], "llmgw_test_delay_s": 1.5}
            slow = asyncio.create_task(s.post(f"{url}/v1/chat/completions", json=body))
            while True:
                async with s.get(f"{url}/metrics") as r:
                    if 'vllm:num_requests_running{model_name="tiny"} 1.0' in await r.text():
                        break
                await asyncio.sleep(0.05)
            # slurmstepd delivers srun's forwarded signals to every process of
            # the step, the engine's session included: do the same.
            out = (tmp_path / "agent.out").read_text()
            engine_pid = int(out.split("fake engine: pid ", 1)[1].split()[0])
            os.killpg(engine_pid, sig)
            proc.send_signal(sig)
            resp = await slow
            assert resp.status == 200
            resp.release()
        assert await wait_exit(proc, tmp_path) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    ev = daemon.events()
    assert ev[: ev.index("ready")] == [
        "weights:started",
        "weights:done",
        "rendezvous:started",
        "rendezvous:done",
        "engine_launch:started",
        "engine_launch:done",
        "readiness:started",
        "readiness:done",
        "register:started",
    ]
    after = [e for e in ev[ev.index("ready") :] if e != "heartbeat"]
    assert after == [
        "ready",
        "register:done",
        "draining",
        "drain:started",
        "drain:done",
        "stop:started",
        "stop:done",
        "stopped",
    ]
    stopped = daemon.reports[-1]
    assert sig.name in stopped["message"]
    assert not engine_answers(url)
    log = (tmp_path / "agent.err").read_text()
    if sig == signal.SIGUSR1:
        # The engine ignored the warning; the agent waited for the request.
        assert "drain: 1 request(s) in flight" in log
    else:
        # The engine got SIGTERM too and finished the request as it stopped.
        assert "drain: engine exited by itself" in log
    assert KEY not in log and SECRET not in log
    assert "fake engine: pid" in (tmp_path / "agent.out").read_text()


async def test_engine_crash_before_ready_is_reported(daemon: FakeDaemon, tmp_path: Path) -> None:
    env = job_env(daemon.url, spec_json(make_weights(tmp_path), "--crash-at-start", "7"))
    proc = await start_agent(tmp_path, env)
    assert await wait_exit(proc, tmp_path) == 1
    await daemon.wait_for(lambda: "failed" in daemon.events())
    failed = next(r for r in daemon.reports if r["event"] == "failed")
    assert "exited with code 7" in failed["message"]
    assert "CUDA out of memory (pretend)" in failed["message"]
    assert "readiness:failed" in daemon.events()
    assert "ready" not in daemon.events()


async def test_missing_weights_with_fetch_off(daemon: FakeDaemon, tmp_path: Path) -> None:
    env = job_env(daemon.url, spec_json(tmp_path / "no-such-weights"))
    argv = [
        sys.executable,
        "-m",
        "llmgw_slurm.agent.main",
        "--no-fetch",
        "--cache-dir",
        str(tmp_path / "cache"),
        *AGENT_OPTS,
        "run",
    ]
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 1
    failed = next(r for r in daemon.reports if r["event"] == "failed")
    assert "not in the cache" in failed["message"] and "fetching is off" in failed["message"]
    assert "weights:failed" in daemon.events()
    assert b"Traceback" not in err


async def test_daemon_away_never_stops_the_engine(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = job_env(dead_url, spec_json(make_weights(tmp_path)))
    proc = await start_agent(tmp_path, env)
    err_path = tmp_path / "agent.err"
    try:
        deadline = time.monotonic() + 60
        while "report heartbeat: daemon unreachable" not in err_path.read_text():
            assert proc.returncode is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            await asyncio.sleep(0.1)
        line = next(x for x in err_path.read_text().splitlines() if "ready: http" in x)
        url = line.split("ready: ", 1)[1].split()[0]
        # No daemon heard the certificate: present the gateway's, pin nothing.
        ctx = client_context(GATEWAY.cert_pem, GATEWAY.cert_file, GATEWAY.key_file)
        ctx.verify_mode = ssl.CERT_NONE
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
            s.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as r,
        ):
            assert r.status == 200
        assert proc.returncode is None
        proc.send_signal(signal.SIGTERM)
        assert await wait_exit(proc, tmp_path) == 0
    finally:
        if proc.returncode is None:
            proc.kill()


def test_cli_without_job_env_is_a_clear_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmgw_slurm.agent.main import main

    result = CliRunner().invoke(
        main,
        ["--cache-dir", str(tmp_path), "run"],
        env={
            "LLMGW_REPLICA_ID": "",
            "LLMGW_MODEL": "",
            "LLMGW_DAEMON_URL": "",
            "LLMGW_REPLICA_SECRET": "",
            "LLMGW_ENGINE_API_KEY": "",
            "LLMGW_REPLICA_SPEC": "",
        },
    )
    assert result.exit_code == 1
    assert "Error: LLMGW_REPLICA_ID: not set in the job environment" in result.output


def test_cli_fetch_copies_weights(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmgw_slurm.agent.main import main

    spec = spec_json(make_weights(tmp_path))
    args = ["--cache-dir", str(tmp_path / "cache"), "fetch"]
    first = CliRunner().invoke(main, args, env={"LLMGW_REPLICA_SPEC": spec})
    assert first.exit_code == 0, first.output
    assert "(fetched," in first.output
    second = CliRunner().invoke(main, args, env={"LLMGW_REPLICA_SPEC": spec})
    assert "(already there," in second.output


_SQUATTER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16); print("up", flush=True)
while True:
    c, _ = s.accept(); print(repr(c.recv(4096)), flush=True); c.close()
"""


async def test_a_port_taken_before_the_engine_binds_it_moves_the_start_to_another(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    INTRUDER.ensure()
    spec = json.loads(spec_json(make_weights(tmp_path)))
    # The engine listens 3 s after it starts, as a real one loads first.
    spec["engine"]["command"] = [
        sys.executable, "-m", "llmgw_slurm.testing.engine", "--host", "{host}",
        "--port", "{port}", "--served-name", "{served_name}", "--bind-after", "3",
    ]  # fmt: skip
    env = job_env(daemon.url, json.dumps(spec))
    lo = free_port()
    settings = AgentConfig(
        weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        port_range=PortRange(lo, lo + 50),
        heartbeat_interval=0.2,
        readiness=ReadinessConfig(poll_interval=0.1),
        drain=DrainConfig(poll_interval=0.1, stop_grace=5),
    )
    agent = Agent(settings, job_context_from_env(env), env)
    run = asyncio.create_task(agent.run())
    try:
        deadline = time.monotonic() + 60
        while agent.engine is None:
            assert time.monotonic() < deadline and not run.done()
            await asyncio.sleep(0.02)
        port = int(agent.engine.env["LLMGW_ENGINE_PORT"])
        # Another user takes it between the agent's choice and the engine's bind.
        with INTRUDER.spawn_python(_SQUATTER, str(port)) as squatter:
            assert squatter.stdout is not None and squatter.stdout.readline() == "up\n"
            await daemon.wait_for(lambda: "ready" in daemon.events())
            squatter.kill()
            heard, _ = squatter.communicate(timeout=10)
        ready = next(r for r in daemon.reports if r["event"] == "ready")
        # Before: the start failed ("held by uid ..."); now it goes on elsewhere.
        assert ready["url"].rsplit(":", 1)[1] != str(port)
        assert daemon.events().count("engine_launch:done") == 2
        assert "failed" not in daemon.events()
        moved = [r["message"] for r in daemon.reports if r.get("message")]
        assert any(f"port {port} was taken" in m for m in moved), moved
        assert heard == "", heard  # nothing was sent to the squatter
    finally:
        agent.request_drain("the test is over")
        assert await asyncio.wait_for(run, 60) == 0


async def test_an_unsigned_drain_answer_is_ignored_and_the_replica_keeps_serving(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    # What a squatter on the daemon's port (or a rewrite on the way) answers: a
    # drain without the daemon's signature. Before, the agent obeyed it.
    daemon.drain_after_ready = True
    daemon.sign_answers = False
    env = job_env(daemon.url, spec_json(make_weights(tmp_path)))
    settings = AgentConfig(
        weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        heartbeat_interval=0.2,
        report_timeout=1.0,
        readiness=ReadinessConfig(poll_interval=0.1),
        drain=DrainConfig(poll_interval=0.1, stop_grace=5),
    )
    agent = Agent(settings, job_context_from_env(env), env)
    run = asyncio.create_task(agent.run())
    try:
        await daemon.wait_for(lambda: daemon.events().count("heartbeat") >= 10)
        assert not run.done() and agent.drain_reason == ""
        assert agent.engine is not None and agent.engine.returncode is None
    finally:
        agent.request_drain("the test is over")
        assert await asyncio.wait_for(run, 60) == 0
    assert agent.drain_reason == "the test is over"


async def test_drain_asked_by_daemon_and_spans(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.drain_after_ready = True
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    env = job_env(daemon.url, spec_json(make_weights(tmp_path)))
    env["TRACEPARENT"] = f"00-{trace_id}-{parent_id}-01"
    settings = AgentConfig(
        weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        heartbeat_interval=0.2,
        readiness=ReadinessConfig(poll_interval=0.1),
        drain=DrainConfig(poll_interval=0.1, stop_grace=5),
    )
    agent = Agent(
        settings, job_context_from_env(env), env, tracer=provider.get_tracer("llmgw_slurm")
    )
    assert await asyncio.wait_for(agent.run(), 60) == 0
    assert "daemon asked" in agent.drain_reason
    assert daemon.events()[-1] == "stopped"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for name in (
        "llmgw.agent",
        "llmgw.agent.weights",
        "llmgw.agent.rendezvous",
        "llmgw.agent.engine_launch",
        "llmgw.agent.readiness",
        "llmgw.agent.drain",
    ):
        assert name in spans, sorted(spans)
        assert spans[name].context.trace_id == int(trace_id, 16)
    root = spans["llmgw.agent"]
    assert root.parent is not None and root.parent.span_id == int(parent_id, 16)
    assert spans["llmgw.agent.weights"].parent.span_id == root.context.span_id  # type: ignore[union-attr]
    assert spans["llmgw.agent"].attributes["llmgw.replica_id"] == RID  # type: ignore[index]


def two_node_envs(daemon: FakeDaemon, tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """What srun gives the head and the worker of `srun --het-group=0-1` over a 1 + 1 node het job."""
    spec = json.loads(spec_json(make_weights(tmp_path)))
    spec["resources"]["nodes"] = 2
    base = job_env(daemon.url, json.dumps(spec))
    for k in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"):
        del base[k]
    base.update(
        SLURM_HET_JOB_ID="777",
        SLURM_HET_SIZE="2",
        SLURM_JOB_NUM_NODES_HET_GROUP_0="1",
        SLURM_JOB_NUM_NODES_HET_GROUP_1="1",
        SLURM_JOB_NODELIST_HET_GROUP_0="localhost",
        SLURM_JOB_NODELIST_HET_GROUP_1="localhost",
    )
    head_env = {**base, "SLURM_JOB_ID": "777", "SLURM_PROCID": "0", "SLURM_HET_JOB_OFFSET": "0"}
    worker_env = {**base, "SLURM_JOB_ID": "778", "SLURM_PROCID": "1", "SLURM_HET_JOB_OFFSET": "1"}
    return head_env, worker_env


@pytest.mark.parametrize("rendezvous_dir", [False, True], ids=["derived-port", "port-file"])
async def test_two_node_replica(daemon: FakeDaemon, tmp_path: Path, rendezvous_dir: bool) -> None:
    head_env, worker_env = two_node_envs(daemon, tmp_path)
    extra = ("--rendezvous-dir", str(tmp_path / "rdzv")) if rendezvous_dir else ()
    worker = await start_agent(tmp_path, worker_env, "worker", extra)
    head = await start_agent(tmp_path, head_env, "head", extra)
    try:
        await daemon.wait_for(lambda: "ready" in daemon.events())
        url = next(r["url"] for r in daemon.reports if r["event"] == "ready")
        async with (
            gateway_session(daemon) as s,
            s.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as r,
        ):
            assert r.status == 200
        # The fake head is healthy only once the worker joined its master port.
        assert "rank 1 joined localhost:" in (tmp_path / "worker.out").read_text()
        # srun forwards the signal to every task, but not in step: here the
        # head gets it and stops its engine first, so the worker's engine
        # ends (its master is gone) before the worker's agent hears of it.
        # A worker's engine that ends cleanly was stopped by its head: the
        # worker ends with it, signalled or not (its node's slurmd may be lost).
        head.send_signal(signal.SIGTERM)
        assert await wait_exit(head, tmp_path, "head") == 0
        assert await wait_exit(worker, tmp_path, "worker") == 0
    finally:
        for proc in (head, worker):
            if proc.returncode is None:
                proc.kill()
    ev = daemon.events()
    # Only the head tells the replica's life cycle; the worker only its steps.
    assert ev.count("ready") == 1 and ev.count("stopped") == 1 and "failed" not in ev
    assert ev.count("rendezvous:done") == 2 and ev.count("engine_launch:done") == 2
    assert all(r["job_id"] in ("777", "778") for r in daemon.reports)
    assert "master gone, worker exits" in (tmp_path / "worker.out").read_text()
    assert "the engine ended with its head" in (tmp_path / "worker.err").read_text()
    if rendezvous_dir:
        assert list((tmp_path / "rdzv" / "rendezvous").iterdir()) == []  # the head cleaned up


async def test_two_node_start_trace_has_a_span_per_node_with_its_rank_and_wait(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    daemon.drain_after_ready = True
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    head_env, worker_env = two_node_envs(daemon, tmp_path)
    settings = AgentConfig(
        weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        heartbeat_interval=0.2,
        readiness=ReadinessConfig(poll_interval=0.1),
        drain=DrainConfig(poll_interval=0.1, stop_grace=5),
        rendezvous=RendezvousConfig(dir=tmp_path / "rdzv"),
    )
    agents = []
    for env, host in ((head_env, "node-a"), (worker_env, "node-b")):
        env["TRACEPARENT"] = f"00-{trace_id}-00f067aa0ba902b7-01"
        agents.append(
            Agent(
                settings,
                job_context_from_env(env),
                env,
                tracer=provider.get_tracer("llmgw_slurm"),
                hostname=host,
                expand=lambda _: ["localhost"],
            )
        )
    head, worker = agents
    # The worker first: it waits in the rendezvous until the head publishes.
    worker_run = asyncio.create_task(worker.run())
    await asyncio.sleep(0.5)
    try:
        assert await asyncio.wait_for(head.run(), 60) == 0
    finally:
        worker.request_drain("the head stopped")
        await asyncio.wait_for(worker_run, 60)
    spans = exporter.get_finished_spans()
    starts = {s.attributes["llmgw.node"]: s for s in spans if s.name == "llmgw.agent"}  # type: ignore[index]
    assert sorted(starts) == ["node-a", "node-b"]
    for node, rank in (("node-a", 0), ("node-b", 1)):
        start = starts[node]
        assert start.context.trace_id == int(trace_id, 16)
        assert start.attributes["llmgw.node_rank"] == rank  # type: ignore[index]
        assert start.attributes["llmgw.nnodes"] == 2  # type: ignore[index]
        (rdzv,) = [
            s
            for s in spans
            if s.name == "llmgw.agent.rendezvous"
            and s.parent is not None
            and s.parent.span_id == start.context.span_id
        ]
        assert rdzv.attributes["llmgw.rendezvous.via"] == "dir"  # type: ignore[index]
        waited = rdzv.attributes["llmgw.rendezvous.waited_s"]  # type: ignore[index]
        assert isinstance(waited, float) and waited >= 0
    # The worker's wait is the head's lateness: it began half a second earlier.
    w_rdzv = next(
        s
        for s in spans
        if s.name == "llmgw.agent.rendezvous" and s.attributes["llmgw.node_rank"] == 1  # type: ignore[index]
    )
    assert w_rdzv.attributes["llmgw.rendezvous.waited_s"] > 0  # type: ignore[index,operator]


async def test_shared_test_engine_without_metrics_drains_on_a_fixed_grace(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    # llmgw_slurm.testing.engine has no /metrics: the drain waits drain_grace.
    spec = {
        "name": "tiny",
        "engine": {
            "kind": "command",
            "command": [
                sys.executable,
                "-m",
                "llmgw_slurm.testing.engine",
                "--host",
                "{host}",
                "--port",
                "{port}",
                "--api-key",
                "{api_key}",
                "--served-name",
                "{served_name}",
                "--ready-after",
                "0.5",
            ],
        },
        "resources": {"gpus": 0},
    }
    env = job_env(daemon.url, json.dumps(spec))
    proc = await start_agent(tmp_path, env, extra=("--drain-grace", "0.5"))
    try:
        await daemon.wait_for(lambda: "ready" in daemon.events())
        url = next(r["url"] for r in daemon.reports if r["event"] == "ready")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}]}
        async with (
            gateway_session(daemon) as s,
            s.post(
                f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as r,
        ):
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await wait_exit(proc, tmp_path) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    assert "engine reports no request count, waiting 0.5s" in (tmp_path / "agent.err").read_text()
    assert daemon.events()[-1] == "stopped"
    assert "weights:done" in daemon.events()  # no weights: the step passes at once


async def test_engine_stopped_by_the_cancel_before_the_agent_hears_of_it(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    # scancel: slurmstepd sends SIGTERM to every process of the step; the
    # engine may be gone before the agent's own SIGTERM is handled.
    env = job_env(daemon.url, spec_json(make_weights(tmp_path)))
    proc = await start_agent(tmp_path, env)
    try:
        await daemon.wait_for(lambda: "ready" in daemon.events())
        url = next(r["url"] for r in daemon.reports if r["event"] == "ready")
        out = (tmp_path / "agent.out").read_text()
        os.killpg(int(out.split("fake engine: pid ", 1)[1].split()[0]), signal.SIGTERM)
        while engine_answers(url):
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert await wait_exit(proc, tmp_path) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
    ev = daemon.events()
    assert "failed" not in ev
    assert ev[-1] == "stopped" and "SIGTERM" in daemon.reports[-1]["message"]
