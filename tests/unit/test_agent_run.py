"""The agent end to end, without Slurm: a fake engine, a fake daemon, real signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw_slurm.agent.runner import Agent, job_context_from_env
from llmgw_slurm.agent.settings import AgentSettings, FetchSettings

ROOT = Path(__file__).resolve().parents[2]
FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
RID = "0123abcd"
SECRET = "replica-secret-xyz"
KEY = "engine-key-abc"
BODY_KEYS = {"event", "step", "status", "url", "node", "job_id", "message", "elapsed_s"}
EVENTS = {"step", "ready", "heartbeat", "draining", "failed", "stopped"}


class FakeDaemon:
    """Records reports; refuses what the protocol does not allow."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.refused: list[str] = []
        self.drain_after_ready = False
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {SECRET}":
            self.refused.append("bad secret")
            return web.json_response({"ok": False}, status=401)
        if request.match_info["rid"] != RID:
            self.refused.append("unknown replica")
            return web.json_response({"ok": False}, status=404)
        body = await request.json()
        problems = []
        if set(body) != BODY_KEYS:
            problems.append(f"keys {sorted(set(body) ^ BODY_KEYS)}")
        if body.get("event") not in EVENTS:
            problems.append(f"event {body.get('event')!r}")
        if body.get("status") not in (None, "started", "done", "failed"):
            problems.append(f"status {body.get('status')!r}")
        if body.get("event") in ("ready", "heartbeat") and not body.get("url"):
            problems.append("ready/heartbeat without url")
        if problems:
            self.refused.append("; ".join(problems))
            return web.json_response({"ok": False}, status=400)
        self.reports.append(body)
        ready_seen = any(r["event"] == "ready" for r in self.reports)
        return web.json_response({"ok": True, "drain": self.drain_after_ready and ready_seen})

    def events(self) -> list[str]:
        return [
            r["event"] if r["event"] != "step" else f"{r['step']}:{r['status']}"
            for r in self.reports
        ]

    async def wait_for(self, pred: Callable[[], bool], limit_s: float = 60) -> None:
        deadline = time.monotonic() + limit_s
        while not pred():
            assert time.monotonic() < deadline, f"timed out; reports: {self.events()}"
            await asyncio.sleep(0.05)


@pytest.fixture
async def daemon() -> AsyncIterator[FakeDaemon]:
    fake = FakeDaemon()
    app = web.Application()
    app.router.add_post("/internal/v1/replicas/{rid}/report", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    await runner.cleanup()
    assert fake.refused == [], f"the fake daemon refused reports: {fake.refused}"


def make_weights(tmp_path: Path) -> Path:
    src = tmp_path / "weights-src"
    src.mkdir()
    (src / "config.json").write_text('{"hidden_size": 64}')
    (src / "model.safetensors").write_bytes(b"\0" * 4096)
    return src


def spec_json(weights: Path, *engine_extra: str) -> str:
    return json.dumps(
        {
            "name": "tiny",
            "engine": {
                "kind": "command",
                "command": [
                    sys.executable,
                    str(FAKE_ENGINE),
                    "--host",
                    "{host}",
                    "--port",
                    "{port}",
                    "--model-path",
                    "{model_path}",
                    "--served-name",
                    "{served_name}",
                    *engine_extra,
                ],
                "ready_timeout": 60,
            },
            "weights": {"method": "copy", "source": str(weights)},
            "resources": {"nodes": 1, "gpus": 0},
        }
    )


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


async def start_agent(tmp_path: Path, env: dict[str, str]) -> asyncio.subprocess.Process:
    argv = [
        sys.executable,
        "-m",
        "llmgw_slurm.agent.main",
        "--cache-dir",
        str(tmp_path / "cache"),
        *AGENT_OPTS,
        "run",
    ]
    out = (tmp_path / "agent.out").open("wb")
    err = (tmp_path / "agent.err").open("wb")
    return await asyncio.create_subprocess_exec(*argv, env=env, stdout=out, stderr=err)


async def wait_exit(proc: asyncio.subprocess.Process, tmp_path: Path) -> int:
    try:
        return await asyncio.wait_for(proc.wait(), 60)
    except TimeoutError:
        proc.kill()
        pytest.fail("agent did not exit; stderr:\n" + (tmp_path / "agent.err").read_text())


def engine_answers(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
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
        assert ready["job_id"] == "4242" and url.startswith("http://127.0.0.1:")
        await daemon.wait_for(lambda: daemon.events().count("heartbeat") >= 2)
        assert all(r["url"] == url for r in daemon.reports if r["event"] == "heartbeat")

        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=headers) as s:
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
    assert "drain: 1 request(s) in flight" in log
    assert KEY not in log and SECRET not in log
    assert "fake engine: loading" in (tmp_path / "agent.out").read_text()


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
        async with (
            aiohttp.ClientSession() as s,
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


async def test_drain_asked_by_daemon_and_spans(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.drain_after_ready = True
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    env = job_env(daemon.url, spec_json(make_weights(tmp_path)))
    env["TRACEPARENT"] = f"00-{trace_id}-{parent_id}-01"
    settings = AgentSettings(
        fetch=FetchSettings(cache_dir=tmp_path / "cache"),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        heartbeat_interval_s=0.2,
        ready_poll_s=0.1,
        drain_poll_s=0.1,
        stop_grace_s=5,
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
