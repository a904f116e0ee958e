"""One trace from the pass that placed a replica to the agent's steps inside the Slurm job.

A tiny OTLP/HTTP collector runs in the test (protobuf bodies on /v1/traces,
decoded with opentelemetry-proto, which comes with the exporter). The daemon
and the agent in the job both send to it; the agent reaches it on localhost
because the dev cluster is one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, free_port, running, tiny_model

pytestmark = pytest.mark.slurm


@dataclass
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    attrs: dict[str, Any]
    links: list[tuple[str, str]]
    resource: dict[str, Any]
    start_ns: int = 0
    end_ns: int = 0


@dataclass
class Collector:
    url: str
    spans: list[Span] = field(default_factory=list)
    requests: int = 0

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@contextlib.asynccontextmanager
async def collector() -> AsyncIterator[Collector]:
    port = free_port()
    got = Collector(f"http://127.0.0.1:{port}")

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        got.requests += 1
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    got.spans.append(
                        Span(
                            name=sp.name,
                            service=str(res.get("service.name", "")),
                            trace_id=sp.trace_id.hex(),
                            span_id=sp.span_id.hex(),
                            parent_id=sp.parent_span_id.hex(),
                            attrs={a.key: _value(a.value) for a in sp.attributes},
                            links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in sp.links],
                            resource=res,
                            start_ns=sp.start_time_unix_nano,
                            end_ns=sp.end_time_unix_nano,
                        )
                    )
        # An empty ExportTraceServiceResponse.
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield got
    finally:
        await runner.cleanup()


def render(spans: list[Span], trace_id: str) -> str:
    """The trace as an indented tree: offset from its start, duration, service, name."""
    mine = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    ids = {s.span_id for s in mine}
    t0 = min(s.start_ns for s in mine)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in mine:
            if s.parent_id == parent or (depth == 0 and parent == "" and s.parent_id not in ids):
                off, dur = (s.start_ns - t0) / 1e9, (s.end_ns - s.start_ns) / 1e9
                lines.append(f"{off:7.3f}s {dur:7.3f}s  {'  ' * depth}{s.name}  [{s.service}]")
                walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def enable_tracing(h: Harness, endpoint: str) -> None:
    """Both config files get the same tracing block, as a site would write it."""
    block = {"enabled": True, "endpoint": endpoint, "resource_attributes": {"test": "slurm"}}
    server = yaml.safe_load(h.server_yaml.read_text())
    server["tracing"] = block
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))
    agent_yaml = h.folder / "agent.yaml"
    agent = yaml.safe_load(agent_yaml.read_text())
    agent["tracing"] = block
    agent_yaml.write_text(yaml.safe_dump(agent, sort_keys=False))


@contextlib.asynccontextmanager
async def traced_daemon(
    tmp_path: Path, prefix: str, models: list[dict[str, Any]], col: Collector
) -> AsyncIterator[Harness]:
    """A daemon with tracing on, sending to ``col``; its spans flushed once it stopped."""
    provider = None
    try:
        configure = functools.partial(enable_tracing, endpoint=col.url)
        async with running(tmp_path, prefix, models, configure=configure) as h:
            assert h.d is not None and h.d.tracer_provider is not None
            provider = h.d.tracer_provider
            yield h
    finally:
        if provider is not None:
            await asyncio.to_thread(provider.shutdown)


async def chat(h: Harness, model: str) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{h.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            timeout=aiohttp.ClientTimeout(total=120),
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def spans_arrive(h: Harness, col: Collector, names: set[str], what: str) -> None:
    assert h.d is not None and h.d.tracer_provider is not None
    provider = h.d.tracer_provider

    async def complete() -> bool:
        # In a thread: the collector answers on this event loop.
        await asyncio.to_thread(provider.force_flush)
        return names <= {s.name for s in col.spans}

    await eventually(complete, what)


async def test_one_trace_from_placement_to_the_agent_steps_in_the_job(
    tmp_path: Path, prefix: str
) -> None:
    names = ("llmgw.agent.weights", "llmgw.agent.engine_launch", "llmgw.agent.readiness")
    async with (
        collector() as col,
        traced_daemon(tmp_path, prefix, [tiny_model("tiny")], col) as h,
    ):
        await chat(h, "tiny")
        await spans_arrive(
            h,
            col,
            {"replica.start", "llmgw.agent", *names},
            "the daemon's and the agent's spans at the collector",
        )
        # The job's environment held the start's context, never its command line.
        (job,) = [j for j in h.jobs() if j[1].startswith(prefix + "tiny.")]
        comment = subprocess.run(
            ["squeue", "-h", "-j", job[0], "-o", "%k"], capture_output=True, text=True
        ).stdout
        command = subprocess.run(
            ["squeue", "-h", "-j", job[0], "-o", "%o"], capture_output=True, text=True
        ).stdout

    (start,) = col.named("replica.start")
    trace_id = start.trace_id
    (place,) = [s for s in col.named("replica.place") if s.trace_id == trace_id]
    (pass_,) = [s for s in col.named("reconcile.pass") if s.trace_id == trace_id]
    (agent,) = [s for s in col.named("llmgw.agent") if s.trace_id == trace_id]

    # The daemon's side: pass -> place -> start.
    assert pass_.parent_id == ""
    assert place.parent_id == pass_.span_id
    assert start.parent_id == place.span_id
    assert place.attrs["llmgw.placement.fits"] is True
    assert start.attrs["llmgw.start.outcome"] == "ready"
    assert start.attrs["llmgw.job_id"] == job[0]
    assert pass_.service == start.service == "llmgw-daemon"
    observe = [s for s in col.named("reconcile.observe") if s.trace_id == trace_id]
    assert [s.parent_id for s in observe] == [pass_.span_id]

    # The start's context is in the job comment (for adoption after a restart),
    # not on the job's command line.
    assert f"trace=00-{trace_id}-{start.span_id}-" in comment
    assert trace_id not in command

    # The agent's side, from inside the Slurm job: start -> agent -> steps.
    assert agent.parent_id == start.span_id
    assert agent.service == "llmgw-agent"
    assert agent.attrs["llmgw.job_id"] == job[0]
    for name in (*names, "llmgw.agent.register"):
        (step,) = [s for s in col.named(name) if s.trace_id == trace_id]
        assert step.parent_id == agent.span_id, name
        assert step.service == "llmgw-agent"
        assert step.resource["test"] == "slurm"  # agent.yaml's resource_attributes

    print(render(col.spans, trace_id))

    # The request came without a traceparent, so it has no request span of its own
    # (router.trace_requests: sampled); waiting for the cold start made a held span,
    # which links to the replica's start span.
    assert col.named("llmgw.router.request") == []
    (held,) = col.named("llmgw.router.held")
    assert (trace_id, start.span_id) in held.links


async def test_an_engine_install_is_a_trace_and_a_replica_running_it_links_to_it(
    tmp_path: Path, prefix: str
) -> None:
    from tests.slurm.test_jobs import install_bare_venv

    target = tmp_path / "engines" / "bare-1.0"
    engine_cmd = [str(target / "bin" / "python"), *tiny_model("x")["engine"]["command"][1:]]
    async with collector() as col:
        models = [tiny_model("installed", engine={"command": engine_cmd})]
        async with traced_daemon(tmp_path, prefix, models, col) as h:
            await install_bare_venv(h, target)
            await chat(h, "installed")
            await spans_arrive(
                h,
                col,
                {"replica.start", "llmgw.agent.engine_launch", "llmgw.engine_install"},
                "the install's, the daemon's and the agent's spans",
            )

    (install,) = col.named("llmgw.engine_install")
    assert install.service == "llmgw-agent" and install.parent_id == ""
    assert install.attrs["llmgw.install.installed"] is True
    steps = {s.name for s in col.spans if s.trace_id == install.trace_id} - {install.name}
    assert steps == {
        "llmgw.engine_install.lock",
        "llmgw.engine_install.venv",
        "llmgw.engine_install.mark",
    }
    print(render(col.spans, install.trace_id))
    (launch,) = col.named("llmgw.agent.engine_launch")
    (start,) = col.named("replica.start")
    for linked in (launch, start):
        assert (install.trace_id, install.span_id) in linked.links, linked.name
