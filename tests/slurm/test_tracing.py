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

from llmgw_slurm.reconciler import plan as planmod
from llmgw_slurm.reconciler.replicas import view_of
from tests.slurm.conftest import eventually
from tests.slurm.harness import (
    Harness,
    fill_all_but_one_node,
    free_port,
    reservation,
    running,
    tiny_model,
)

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
    tmp_path: Path,
    prefix: str,
    models: list[dict[str, Any]],
    col: Collector,
    reservation: str | None = None,
) -> AsyncIterator[Harness]:
    """A daemon with tracing on, sending to ``col``; its spans flushed once it stopped."""
    provider = None
    try:
        configure = functools.partial(enable_tracing, endpoint=col.url)
        async with running(
            tmp_path, prefix, models, configure=configure, reservation=reservation
        ) as h:
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


def job_environments(job_id: str, name: str) -> dict[str, dict[str, str]]:
    """The environment every process of a Slurm job started with, by pid and command line.

    The dev cluster is this machine: the batch shell's srun, the agent and the
    engine are processes here, and /proc holds what each was started with. The
    job's name is matched too: another cluster on the machine (Slurm 25.11's,
    a colleague's) numbers its jobs from 1 as well.
    """
    found: dict[str, dict[str, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "environ").read_bytes().decode(errors="replace")
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone, or a kernel thread
        env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
        if env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_JOB_NAME") == name:
            found[f"{d.name} {cmd.strip()}"] = env
    return found


def agent_environment(job_id: str, name: str) -> dict[str, str]:
    """The environment of the agent the job's srun started (not srun's own)."""
    (env,) = [
        e
        for cmd, e in job_environments(job_id, name).items()
        if "llmgw_slurm.agent.main" in cmd and not cmd.split()[1].endswith("srun")
    ]
    return env


async def test_one_trace_from_placement_to_the_agent_steps_in_the_job(
    tmp_path: Path, prefix: str
) -> None:
    names = ("llmgw.agent.weights", "llmgw.agent.engine_launch", "llmgw.agent.readiness")
    async with (
        collector() as col,
        traced_daemon(tmp_path, prefix, [tiny_model("tiny")], col) as h,
    ):
        await chat(h, "tiny")
        # The held span ends with the answer, after the start's spans: it may reach
        # the collector in a later export, so it is waited for too.
        await spans_arrive(
            h,
            col,
            {"replica.start", "llmgw.agent", "llmgw.router.held", *names},
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
        agent_env = agent_environment(job[0], job[1])

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
    assert agent_env["TRACEPARENT"].startswith(f"00-{trace_id}-{start.span_id}-")

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


async def test_an_eviction_pass_is_one_trace_with_the_evict_span_and_the_placement_after_it(
    tmp_path: Path, prefix: str
) -> None:
    whole_node = {"gpus": 4}
    models = [
        tiny_model("first", resources=whole_node),
        tiny_model("second", resources=whole_node),
    ]
    # Room for one whole-node replica: "second" can only start if "first" (idle, on demand)
    # goes; in a reservation of the test's own (tests/slurm/harness.py says why).
    with reservation(prefix) as resv:
        await _evict_with_room_for_one(tmp_path, prefix, models, resv)


async def _evict_with_room_for_one(
    tmp_path: Path, prefix: str, models: list[dict[str, Any]], resv: str
) -> None:
    node, fillers = await fill_all_but_one_node(prefix, reservation=resv)
    try:
        async with (
            collector() as col,
            traced_daemon(tmp_path, prefix + "d.", models, col, reservation=resv) as h,
        ):
            await chat(h, "first")
            (first,) = h.rec.replicas.values()

            # Ask for "second" only once the plan would stop "first" for it (idle past
            # the eviction grace, ready past the minimum lifetime: 3 s each in the
            # harness), so that the pass that places it is the one that evicts.
            def candidates() -> list[str]:
                views = [view_of(r) for r in h.rec.replicas.values()]
                found = planmod.evictable(
                    "second", views, h.rec.table.models(), h.rec.plan_cfg, h.rec.clock()
                )
                return [v.replica_id for v in found]

            await eventually(
                lambda: asyncio.sleep(0, candidates() == [first.replica_id]),
                "'first' to be idle enough to evict",
            )
            await chat(h, "second")
            await spans_arrive(h, col, {"replica.evict"}, "the eviction's span")
            (second,) = [r for r in h.rec.replicas.values() if r.model == "second"]
    finally:
        subprocess.run(["scancel", *fillers], check=False)

    (evict,) = col.named("replica.evict")
    trace_id = evict.trace_id
    print(render(col.spans, trace_id))
    (pass_,) = [s for s in col.named("reconcile.pass") if s.trace_id == trace_id]
    assert pass_.parent_id == "" and evict.parent_id == pass_.span_id
    assert evict.service == "llmgw-daemon"
    a = evict.attrs
    assert a["llmgw.decision"] == "evict"
    assert a["llmgw.for"] == "second"
    assert a["llmgw.model"] == "first"
    assert a["llmgw.replica"] == first.replica_id
    assert a["llmgw.job_id"] == first.job_id
    assert a["llmgw.gpus"] == 4
    assert a["llmgw.candidates"] == 1
    assert a["llmgw.idle_seconds"] >= h.rec.plan_cfg.eviction_grace
    assert f"{node}: 0 gpu:a100 free" in a["llmgw.why"]

    # The placement that needed the room, in the same pass, and the start that followed.
    (place,) = [s for s in col.named("replica.place") if s.trace_id == trace_id]
    p = place.attrs
    assert place.parent_id == pass_.span_id
    assert p["llmgw.model"] == "second" and p["llmgw.replica"] == second.replica_id
    assert p["llmgw.placement.fits"] is False
    assert f"{node}: 0 gpu:a100 free" in p["llmgw.placement.refused"]
    assert f"evicting first replica {first.replica_id}" in p["llmgw.placement.detail"]
    (start,) = [s for s in col.named("replica.start") if s.trace_id == trace_id]
    assert start.parent_id == place.span_id
    assert start.attrs["llmgw.replica"] == second.replica_id
    assert start.attrs["llmgw.start.outcome"] == "ready"
    assert start.attrs["llmgw.nodes"] == [node]  # where "first" was
    # The evicted replica's own start was another trace, ended when it served.
    (first_start,) = [
        s for s in col.named("replica.start") if s.attrs["llmgw.replica"] == first.replica_id
    ]
    assert first_start.trace_id != trace_id
    assert first_start.attrs["llmgw.start.outcome"] == "ready"


def disable_tracing(h: Harness, endpoint: str) -> None:
    """Tracing off in both files, with a collector named: only the switch keeps spans away.

    The daemon's trace store off too (``keep_spans: 0``): with it on, jobs carry a
    trace context for their agents to send spans to the daemon, never to a collector.
    """
    enable_tracing(h, endpoint)
    for path in (h.server_yaml, h.folder / "agent.yaml"):
        cfg = yaml.safe_load(path.read_text())
        cfg["tracing"]["enabled"] = False
        if path == h.server_yaml:
            cfg["tracing"]["keep_spans"] = 0
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))


async def test_with_tracing_and_the_store_off_no_span_is_made_and_no_job_has_a_trace_context(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with collector() as col:
        # Whatever set-up the agent could make from the standard variables would
        # send to the collector too (the jobs inherit the daemon's environment),
        # and the daemon runs under a trace of its own, as one started from a
        # traced shell or CI job would: that context is no job's either.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.url)
        monkeypatch.setenv("TRACEPARENT", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        monkeypatch.setenv("TRACESTATE", "vendor=x")
        configure = functools.partial(disable_tracing, endpoint=col.url)
        async with running(tmp_path, prefix, [tiny_model("dark")], configure=configure) as h:
            assert h.d is not None and h.d.tracer_provider is None
            assert not h.rec.tracing.enabled
            await chat(h, "dark")
            (job,) = h.jobs()
            envs = job_environments(job[0], job[1])
            comment = subprocess.run(
                ["squeue", "-h", "-j", job[0], "-o", "%k"], capture_output=True, text=True
            ).stdout
        # The job was cancelled when the daemon stopped: an agent that traced
        # would have flushed its spans by the time it has left the queue.
        await eventually(lambda: asyncio.sleep(0, not h.jobs()), "the job to leave the queue")

    cmds = " | ".join(envs)
    assert "llmgw_slurm.agent.main" in cmds and "llmgw_slurm.testing.engine" in cmds, cmds
    for cmd, env in envs.items():
        assert "TRACEPARENT" not in env and "TRACESTATE" not in env, cmd
    assert comment.startswith("llmgw model=dark ") and "trace=" not in comment
    assert col.requests == 0 and col.spans == []


async def test_with_tracing_off_the_store_keeps_the_spans_and_none_reach_a_collector(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def store_only(h: Harness, endpoint: str) -> None:
        disable_tracing(h, endpoint)
        cfg = yaml.safe_load(h.server_yaml.read_text())
        del cfg["tracing"]["keep_spans"]  # the default: the store on
        h.server_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))

    async with collector() as col:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.url)
        configure = functools.partial(store_only, endpoint=col.url)
        async with running(tmp_path, prefix, [tiny_model("local")], configure=configure) as h:
            assert h.d is not None and h.d.trace_store is not None
            await chat(h, "local")
            store = h.d.trace_store

            async def agent_spans_in() -> bool:
                names = {s["name"] for st in store.starts() for s in store.spans(st["trace_id"])}
                return {"replica.start", "llmgw.agent", "llmgw.agent.readiness"} <= names

            await eventually(agent_spans_in, "the agent's spans in the daemon's store")
            (start,) = store.starts()
            (job,) = h.jobs()
            agent_env = agent_environment(job[0], job[1])
    assert agent_env["TRACEPARENT"].startswith(f"00-{start['trace_id']}-")
    (agent,) = [s for s in store.spans(start["trace_id"]) if s["name"] == "llmgw.agent"]
    assert agent["service"] == "llmgw-agent" and agent["parent_id"] == start["span_id"]
    assert col.requests == 0 and col.spans == []


async def test_a_model_job_is_a_trace_and_a_replica_using_its_weights_links_to_it(
    tmp_path: Path, prefix: str
) -> None:
    from tests.slurm.test_jobs import admin, ended_job, weights_folder

    src = weights_folder(tmp_path)
    models = [tiny_model("weighted", weights={"source": str(src), "method": "copy"})]
    async with collector() as col, traced_daemon(tmp_path, prefix, models, col) as h:
        rc, out, err = await admin("fetch", "weighted", "--server", str(h.server_yaml), "--wait")
        assert rc == 0 and out.strip().isdigit() and "(fetched," in err, out + err
        job = await eventually(lambda: ended_job(h, "fetch"), "the model job in status", 90)
        await chat(h, "weighted")
        await spans_arrive(
            h,
            col,
            {"replica.start", "llmgw.agent.weights", "llmgw.model_job"},
            "the model job's, the daemon's and the agent's spans",
        )

    (fetch,) = col.named("llmgw.model_job")
    assert fetch.service == "llmgw-agent" and fetch.parent_id == ""
    assert fetch.resource["test"] == "slurm"  # agent.yaml's resource_attributes
    assert fetch.attrs["llmgw.model"] == "weighted"
    assert fetch.attrs["llmgw.job_id"] == job["job_id"]
    print(render(col.spans, fetch.trace_id))
    steps = {s.name: s for s in col.spans if s.trace_id == fetch.trace_id}
    assert set(steps) == {"llmgw.model_job", "llmgw.model_job.spec", "llmgw.model_job.weights"}
    assert steps["llmgw.model_job.spec"].parent_id == fetch.span_id
    weights = steps["llmgw.model_job.weights"]
    assert weights.parent_id == fetch.span_id
    assert weights.attrs["llmgw.weights.fetched"] is True
    assert weights.attrs["llmgw.weights.method"] == "copy"
    assert weights.attrs["llmgw.weights.bytes"] > 0

    # The replica found the weights in the cache: its weights step and its start
    # link to the model job's trace, in a trace of their own.
    (found,) = col.named("llmgw.agent.weights")
    (start,) = col.named("replica.start")
    assert found.trace_id == start.trace_id != fetch.trace_id
    assert found.attrs["llmgw.weights.fetched"] is False
    assert found.attrs["llmgw.link.model_job"].startswith(f"00-{fetch.trace_id}-{fetch.span_id}-")
    for linked in (found, start):
        assert (fetch.trace_id, fetch.span_id) in linked.links, linked.name
