"""A worker's agent ends its engine once the head's engine is gone (agent/headwatch.py).

vLLM's headless worker does not end with its head; its agent watches the
head's distributed port (torch's store on rank 0) instead. Here the head is a
plain listener on that port and the worker's "vLLM" a process that never ends
by itself, as the headless worker did.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw_slurm.agent import rendezvous as rdzv
from llmgw_slurm.agent.headwatch import PortState, probe_port, wait_head_gone
from llmgw_slurm.agent.runner import Agent, job_context_from_env
from llmgw_slurm.config import (
    AgentConfig,
    AgentWeightsConfig,
    DrainConfig,
    EngineRuntime,
    EnginesConfig,
)
from tests.agent_support import FakeDaemon, fake_daemon
from tests.unit.test_agent_run import two_node_envs


def _scripted(states: list[PortState]) -> tuple[list[int], object]:
    calls = [0]

    async def probe(host: str, port: int) -> PortState:
        calls[0] += 1
        return states[min(calls[0], len(states)) - 1]

    return calls, probe


async def test_refusals_count_only_after_the_port_accepted_and_only_in_a_row() -> None:
    R, A, U = PortState.REFUSED, PortState.OPEN, PortState.UNKNOWN  # A: accepted
    # Refused while the head starts; a lone refusal, or one after a timeout, is not enough.
    calls, probe = _scripted([R, R, R, A, R, A, R, U, R, A, R, R])
    why = await asyncio.wait_for(wait_head_gone("head", 29500, 0, probe=probe), 5)  # type: ignore[arg-type]
    assert calls[0] == 12
    assert "head:29500 refuses connections" in why


async def test_a_port_never_seen_open_is_never_gone() -> None:
    calls, probe = _scripted([PortState.REFUSED])
    watch = asyncio.create_task(wait_head_gone("head", 1, 0, probe=probe))  # type: ignore[arg-type]
    while calls[0] < 50:
        await asyncio.sleep(0)
    assert not watch.done()
    watch.cancel()


async def test_probe_port_tells_open_from_refused() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    assert await probe_port("127.0.0.1", port) is PortState.OPEN
    server.close()
    await server.wait_closed()
    assert await probe_port("127.0.0.1", port) is PortState.REFUSED
    assert await probe_port("no-such-host.invalid", port) is PortState.UNKNOWN


# --- the worker's agent ---------------------------------------------------------


@pytest.fixture
async def daemon() -> AsyncIterator[FakeDaemon]:
    async with fake_daemon() as fake:
        yield fake


@pytest.fixture
def headless_vllm(tmp_path: Path) -> Iterator[Path]:
    """A stand-in for `vllm serve --headless`: it runs until it is stopped."""
    exe = tmp_path / "vllm"
    exe.write_text(f"#!{sys.executable}\nimport time\nwhile True:\n    time.sleep(1)\n")
    exe.chmod(0o755)
    yield exe


def worker_agent(
    daemon: FakeDaemon, tmp_path: Path, exe: Path, tracer: TracerProvider | None = None
) -> tuple[Agent, int]:
    """A vLLM worker's agent (node rank 1) and the head's distributed port it will watch."""
    _, env = two_node_envs(daemon, tmp_path)
    spec = json.loads(env["LLMGW_REPLICA_SPEC"])
    spec["engine"] = {"kind": "vllm"}
    env["LLMGW_REPLICA_SPEC"] = json.dumps(spec)
    settings = AgentConfig(
        weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"),
        bind_host="127.0.0.1",
        engines=EnginesConfig(vllm=EngineRuntime(executable=str(exe))),
        # Long timeout: a worker that waited it out would fail the test's own limit.
        drain=DrainConfig(poll_interval=0.05, timeout=120, stop_grace=5),
    )
    agent = Agent(
        settings,
        job_context_from_env(env),
        env,
        hostname="node-b",
        expand=lambda _: ["127.0.0.1"],
        tracer=tracer.get_tracer("t") if tracer else None,
    )
    role = rdzv.compute_role(env, lambda _: ["127.0.0.1"])
    return agent, rdzv.derived_port(settings.port_range.bounds, role)


async def fake_head(port: int) -> tuple[asyncio.Server, asyncio.Event]:
    accepted = asyncio.Event()

    def on_connect(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.set()
        w.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", port)
    return server, accepted


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def test_worker_stops_its_engine_when_the_head_is_gone(
    daemon: FakeDaemon, tmp_path: Path, headless_vllm: Path
) -> None:
    agent, port = worker_agent(daemon, tmp_path, headless_vllm)
    assert _free(port)
    head, accepted = await fake_head(port)
    run = asyncio.create_task(agent.run())
    await asyncio.wait_for(accepted.wait(), 30)
    assert agent.engine is not None and agent.engine.returncode is None
    head.close()
    await head.wait_closed()
    # Without the watch the worker serves on for ever: this would time out.
    assert await asyncio.wait_for(run, 60) == 0
    assert agent.engine.returncode is not None
    assert "the head's engine is gone" in agent.drain_reason
    # A worker never tells the replica's life cycle: no stopped, no failed.
    assert "failed" not in daemon.events() and "stopped" not in daemon.events()
    assert "--headless" in agent.engine.argv


async def test_draining_worker_ends_its_wait_when_the_head_is_gone(
    daemon: FakeDaemon, tmp_path: Path, headless_vllm: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agent, port = worker_agent(daemon, tmp_path, headless_vllm, provider)
    head, accepted = await fake_head(port)
    run = asyncio.create_task(agent.run())
    await asyncio.wait_for(accepted.wait(), 30)
    # The time limit's warning reaches both nodes; the head drains, then stops.
    agent.request_drain("SIGUSR1 (time limit near)")
    await daemon.wait_for(lambda: "drain:started" in daemon.events())
    head.close()
    await head.wait_closed()
    assert await asyncio.wait_for(run, 60) == 0
    (drain,) = [s for s in exporter.get_finished_spans() if s.name == "llmgw.agent.drain"]
    assert drain.attributes["llmgw.drain.worker_end"] == "head gone"  # type: ignore[index]
