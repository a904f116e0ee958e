"""Tracing: the reconciler's pass and start spans, the carriers, and telemetry that fails."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _router_support import engine, serve, serve_engine
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags

from llmgw_slurm.auth.secrets import engine_api_key, replica_secret
from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.config import ServerConfig, TracingConfig, load_server_config
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.reconciler.plan import Action, ActionKind
from llmgw_slurm.reconciler.spans import decision_of, traceparent_from_comment
from llmgw_slurm.router import ModelInfo, RouterConfig, StaticDirectory, create_app
from llmgw_slurm.router.directory import Endpoint, ModelDirectory
from llmgw_slurm.slurm.types import GpuCount, Job, JobComponent, JobSpec, JobState, NodeInfo
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app
from llmgw_slurm.tracing.otel import (
    RateLimitedExporter,
    context_from_traceparent,
    extract_env,
    inject_env,
    read_trace_marker,
    setup_tracing,
    traceparent_of,
    write_trace_marker,
)

KEY = b"k" * 32
MODELS = """
defaults:
  resources: {partition: llm, gpu_type: a100, cpus: 1, memory: 1G, time_limit: "1:00:00"}
models:
  - name: alpha
    engine: {kind: command, command: [python3, -m, x, --port, "{port}"]}
    resources: {gpus: 1}
    scaling: {min: 0, max: 1, idle_timeout: 1h}
  - name: beta
    engine: {kind: command, command: [python3, -m, x, --port, "{port}"]}
    resources: {gpus: 1}
    scaling: {min: 0, max: 1, idle_timeout: 1h}
"""


class FakeSlurm:
    """One node with one GPU. Rejects what it does not know (unknown job ids)."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.specs: dict[str, JobSpec] = {}
        self.next_id = 100
        self.gpus_used = 0

    async def submit(self, spec: JobSpec) -> str:
        self.next_id += 1
        jid = str(self.next_id)
        self.specs[jid] = spec
        self.jobs[jid] = job(jid, spec.name, JobState.PENDING, comment=spec.comment)
        return jid

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        return [j for j in self.jobs.values() if j.name.startswith(name_prefix)]

    async def list_nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo("n1", "mixed", ("llm",), 8, 0, 8000, (GpuCount("a100", 1, self.gpus_used),))
        ]

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        if job_id not in self.jobs:
            raise AssertionError(f"cancel of a job the fake never had: {job_id}")
        del self.jobs[job_id]
        self.gpus_used = 0

    def run(self, jid: str) -> None:
        self.jobs[jid] = dataclasses.replace(self.jobs[jid], state=JobState.RUNNING, nodes=("n1",))
        self.gpus_used = 1


def job(jid: str, name: str, state: JobState, *, comment: str = "", reason: str = "") -> Job:
    return Job(
        job_id=jid,
        name=name,
        state=state,
        reason=reason,
        partition="llm",
        user="me",
        comment=comment,
        nodes=(),
        submit_time=datetime(2026, 1, 1),
        start_time=None,
        time_limit_s=3600,
        end_time=None,
        restarts=0,
        components=(JobComponent(0, jid, state, (), 1, "gres/gpu:a100:1"),),
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class World:
    rec: Reconciler
    slurm: FakeSlurm
    exporter: InMemorySpanExporter
    clock: Clock

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]

    def report(self, rid: str, **body: Any) -> None:
        self.rec.report(rid, replica_secret(KEY, rid), body)

    async def ready(self, rid: str, event: str = "ready") -> str:
        """The agent reports ready; the daemon probes a real engine with the replica's key."""
        opts = EngineOptions(api_key=engine_api_key(KEY, rid), served_name="x")
        gateway = self.rec.engine_tls.identity
        async with serve_engine(create_engine_app(opts), gateway) as (url, cert):
            self.report(rid, event=event, url=url, cert=cert)
            await asyncio.wait_for(asyncio.gather(*self.rec.probe.tasks), 10)
        assert self.rec.replicas[rid].base_url == url
        return url


def server_config(tmp_path: Path, tracing: bool) -> ServerConfig:
    (tmp_path / "models.yaml").write_text(MODELS)
    (tmp_path / "agent.yaml").write_text("weights: {cache_dir: /tmp}\n")
    (tmp_path / "server.yaml").write_text(
        f"state_dir: {tmp_path / 'state'}\nslurm: {{partition: llm, job_prefix: t.}}\n"
        "reconcile: {eviction_grace: 5s, min_lifetime: 5s}\n"
        f"tracing: {{enabled: {'true' if tracing else 'false, keep_spans: 0'}}}\n"
    )
    return load_server_config(tmp_path / "server.yaml")


@pytest.fixture
async def w(tmp_path: Path) -> AsyncIterator[World]:
    world = make_world(tmp_path, tracing=True)
    yield world
    await world.rec.close()


def make_world(tmp_path: Path, tracing: bool) -> World:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = server_config(tmp_path, tracing)
    clock = Clock()
    slurm = FakeSlurm()
    rec = Reconciler(
        load_catalog(server.models),
        server,
        slurm,
        KEY,
        "http://127.0.0.1:1",
        clock=clock,
        tracer=provider.get_tracer("llmgw_slurm"),
    )
    return World(rec, slurm, exporter, clock)


def only(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


async def start_alpha(w: World) -> tuple[str, str]:
    """Ask for alpha, run a pass; returns (replica id, job id)."""
    w.rec.want("alpha")
    await w.rec.pass_once()
    (jid,) = w.slurm.specs
    rid = w.slurm.specs[jid].name.rsplit(".", 1)[1]
    return rid, jid


# ---- the daemon's spans ------------------------------------------------------------


async def test_pass_that_places_is_one_trace_with_start_span_into_the_job(w: World) -> None:
    rid, jid = await start_alpha(w)
    root = only(w.named("reconcile.pass"))
    assert root.parent is None
    assert root.attributes is not None and len(str(root.attributes["llmgw.pass_id"])) == 8
    for name in ("reconcile.observe", "reconcile.plan", "replica.place"):
        child = only(w.named(name))
        assert child.context.trace_id == root.context.trace_id
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    place = only(w.named("replica.place"))
    assert place.attributes is not None
    assert place.attributes["llmgw.decision"] == "scale_up"
    assert place.attributes["llmgw.placement.fits"] is True
    assert tuple(place.attributes["llmgw.placement.nodes"]) == ("n1",)  # type: ignore[arg-type]
    assert place.attributes["llmgw.job_id"] == jid
    assert place.attributes["llmgw.replica"] == rid
    # The start span is still open: nothing exported yet, but its context is in the job.
    assert not w.named("replica.start")
    spec = w.slurm.specs[jid]
    sc = context_from_traceparent(spec.env["TRACEPARENT"])
    assert sc is not None and sc.trace_id == root.context.trace_id
    assert "TRACEPARENT" not in spec.comment.split("trace=")[0]
    assert traceparent_from_comment(spec.comment) == spec.env["TRACEPARENT"]
    assert spec.comment.startswith(f"llmgw model=alpha replica={rid} gpus=1 trace=00-")

    # Pending with a reason, then running, then ready: the start span ends at ready.
    w.slurm.jobs[jid] = dataclasses.replace(w.slurm.jobs[jid], reason="Resources")
    await w.rec.pass_once()
    w.slurm.run(jid)
    await w.rec.pass_once()
    w.report(rid, event="step", step="weights", status="done", elapsed_s=1.5)
    await w.ready(rid)
    start = only(w.named("replica.start"))
    assert start.context.span_id == sc.span_id
    assert start.parent is not None and start.parent.span_id == place.context.span_id
    assert start.status.status_code is StatusCode.OK
    assert start.attributes is not None and start.attributes["llmgw.start.outcome"] == "ready"
    events = [e.name for e in start.events]
    assert events == ["slurm.pending", "placement.waiting", "slurm.running", "agent.step"]
    assert start.events[1].attributes == {"llmgw.note": "queued (Resources)"}
    assert start.events[0].attributes == {
        "llmgw.slurm.state": "PENDING",
        "llmgw.slurm.pending_reason": "Resources",
    }


async def test_pass_with_nothing_to_do_makes_no_trace(w: World) -> None:
    await w.rec.pass_once()
    assert w.spans() == []
    rid, jid = await start_alpha(w)
    n = len(w.spans())
    w.slurm.run(jid)
    await w.ready(rid)
    n += 1  # the start span ended
    await w.rec.pass_once()
    await w.rec.pass_once()
    assert len(w.spans()) == n
    assert len(w.named("reconcile.pass")) == 1


async def test_a_pass_says_whether_it_listed_the_nodes_and_when(w: World) -> None:
    # The first pass lists the nodes with the jobs.
    await start_alpha(w)
    first = only(w.named("reconcile.pass"))
    assert first.attributes is not None
    assert first.attributes["llmgw.slurm.nodes_listed"] == "with the jobs"
    observe = only(w.named("reconcile.observe"))
    assert observe.attributes is not None
    assert observe.attributes["llmgw.slurm.nodes_listed"] is True
    assert observe.attributes["llmgw.slurm.nodes"] == 1
    assert w.named("reconcile.list_nodes") == []
    w.exporter.clear()
    # The next one plans on that listing, then lists the nodes again before placing.
    w.rec.want("beta")
    await w.rec.pass_once()
    root = only(w.named("reconcile.pass"))
    assert root.attributes is not None
    assert root.attributes["llmgw.slurm.nodes_listed"] == "before acting"
    observe = only(w.named("reconcile.observe"))
    assert observe.attributes is not None
    assert observe.attributes["llmgw.slurm.nodes_listed"] is False
    assert "llmgw.slurm.nodes" not in observe.attributes
    plan = only(w.named("reconcile.plan"))
    listing = only(w.named("reconcile.list_nodes"))
    assert listing.parent is not None and listing.parent.span_id == plan.context.span_id
    assert listing.attributes is not None and listing.attributes["llmgw.slurm.nodes"] == 1
    assert plan.start_time is not None and listing.start_time is not None
    assert plan.end_time is not None and listing.end_time is not None
    assert plan.start_time <= listing.start_time <= listing.end_time <= plan.end_time


async def test_eviction_span_has_the_reference_attributes_and_placement_follows(
    w: World,
) -> None:
    rid, jid = await start_alpha(w)
    w.slurm.run(jid)
    await w.ready(rid)
    w.rec.request_started("alpha", rid)
    w.rec.request_finished("alpha", rid)
    w.clock.t += 60
    w.exporter.clear()
    w.rec.want("beta")
    await w.rec.pass_once()
    root = only(w.named("reconcile.pass"))
    evict = only(w.named("replica.evict"))
    assert evict.parent is not None and evict.parent.span_id == root.context.span_id
    a = evict.attributes
    assert a is not None
    assert a["llmgw.for"] == "beta"
    assert a["llmgw.replica"] == rid
    assert a["llmgw.model"] == "alpha"
    assert a["llmgw.idle_seconds"] == pytest.approx(60.0)
    assert a["llmgw.gpus"] == 1
    assert a["llmgw.candidates"] == 1
    assert a["llmgw.decision"] == "evict"
    place = only(w.named("replica.place"))
    p = place.attributes
    assert p is not None and p["llmgw.model"] == "beta"
    assert p["llmgw.placement.fits"] is False
    assert "n1: 0 gpu:a100 free" in tuple(p["llmgw.placement.refused"])  # type: ignore[arg-type]
    assert "evicting alpha" in str(p["llmgw.placement.detail"])


def test_placement_span_lists_each_eviction_candidate_turned_down(w: World) -> None:
    # A start that no single eviction makes room for: plan.py's note after the
    # refusals names candidates ("MODEL ID on NODE: why"), which are not nodes.
    placement = (
        "no room now: needs 1 node(s) with 1 free gpu:h100; n1: 0 gpu:h100 free; "
        "1 idle replica(s) could be stopped, none makes room (alpha 0a0a0a0a on a1: "
        "gpu type a100, needs h100); nearest candidate: alpha 0a0a0a0a"
    )
    turned_down = ("alpha 0a0a0a0a on a1: gpu type a100, needs h100",)
    a = Action(
        ActionKind.SUBMIT,
        "beta",
        "scale up to 1: a request is waiting",
        replica_id="0b0b0b0b",
        placement=placement,
        attrs={"evict.turned_down": turned_down},
    )
    with w.rec.tracing.action(a, {}):
        pass
    p = only(w.named("replica.place")).attributes
    assert p is not None
    assert tuple(p["llmgw.placement.refused"]) == ("n1: 0 gpu:h100 free",)  # type: ignore[arg-type]
    assert tuple(p["llmgw.evict.turned_down"]) == turned_down  # type: ignore[arg-type]
    assert "1 idle replica(s) could be stopped" in str(p["llmgw.placement.detail"])


async def test_reap_of_a_pending_replica_ends_its_start_with_the_cause(w: World) -> None:
    _, jid = await start_alpha(w)
    w.slurm.jobs[jid] = dataclasses.replace(w.slurm.jobs[jid], state=JobState.FAILED)
    await w.rec.pass_once()
    start = only(w.named("replica.start"))
    assert start.status.status_code is StatusCode.ERROR
    assert "FAILED" in str(start.status.description)
    reap = only(w.named("replica.reap"))
    assert reap.status.status_code is StatusCode.ERROR
    root = [s for s in w.named("reconcile.pass") if s.context.trace_id == reap.context.trace_id]
    assert len(root) == 1
    # The failed start counts toward the backoff: an event or a span says so.
    backoff = only(w.named("model.backoff"))
    assert backoff.attributes is not None and backoff.attributes["llmgw.restart.failures"] == 1


async def test_agent_failure_ends_the_start_span_as_an_error(w: World) -> None:
    rid, jid = await start_alpha(w)
    w.slurm.run(jid)
    w.report(rid, event="failed", message="engine exited with code 1")
    start = only(w.named("replica.start"))
    assert start.status.status_code is StatusCode.ERROR
    assert start.status.description == "engine exited with code 1"


async def test_adopted_replica_continues_the_start_trace_from_the_comment(w: World) -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    w.slurm.jobs["7"] = job(
        "7", "t.alpha.0a1b2c3d", JobState.RUNNING, comment=f"llmgw model=alpha trace={tp}"
    )
    w.slurm.jobs["8"] = job("8", "t.beta.0a1b2c3e", JobState.PENDING, comment="llmgw model=beta")
    w.rec.want("beta")  # or the pass cancels it: pending, and nobody waits for it
    await w.rec.pass_once()
    assert len(w.named("replica.adopt")) == 2
    await w.ready("0a1b2c3d", event="heartbeat")
    cont = only(w.named("replica.start (adopted)"))
    assert cont.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert cont.parent is not None and cont.parent.span_id == 0x00F067AA0BA902B7
    assert cont.attributes is not None
    assert cont.attributes["llmgw.start.recovered"] is True
    assert cont.attributes["llmgw.start.outcome"] == "serving (adopted)"
    # The other one has no trace in its comment: a new trace that says so, closed
    # honestly when the daemon stops.
    w.rec.tracing.close()
    fresh = [
        s for s in w.named("replica.start (adopted)") if s.context.span_id != cont.context.span_id
    ]
    other = only(fresh)
    assert other.parent is None
    assert other.attributes is not None
    assert other.attributes["llmgw.start.recovered"] is False
    assert "no trace context" in str(other.attributes["llmgw.start.unrecovered_reason"])
    assert other.attributes["llmgw.start.outcome"] == "daemon stopped"


@pytest.mark.parametrize(
    ("step", "what"), [("weights", "model_job"), ("engine_launch", "engine_install")]
)
async def test_a_trace_named_in_a_step_report_links_the_start(
    w: World, step: str, what: str
) -> None:
    # The agent found weights a model job fetched, or an engine an install job put
    # in place, and names that job's trace in the step's report.
    rid, _ = await start_alpha(w)
    tp = "00-11111111111111111111111111111111-2222222222222222-01"
    w.report(rid, event="step", step="rendezvous", status="done", message=f"x; trace={tp}")
    w.report(rid, event="step", step=step, status="done", message=f"job; trace={tp}")
    await w.ready(rid)
    start = only(w.named("replica.start"))
    # Linked once, from the step that names it (not from any step's message).
    (link,) = start.links
    assert link.context.trace_id == 0x11111111111111111111111111111111
    assert link.attributes is not None and link.attributes["llmgw.link"] == what


async def test_tracing_off_and_no_store_no_spans_and_no_trace_context_in_the_job(
    tmp_path: Path,
) -> None:
    w = make_world(tmp_path, tracing=False)
    rid, jid = await start_alpha(w)
    w.slurm.run(jid)
    await w.ready(rid)
    await w.rec.pass_once()
    assert w.spans() == []
    spec = w.slurm.specs[jid]
    assert "TRACEPARENT" not in spec.env and "TRACESTATE" not in spec.env
    assert "trace=" not in spec.comment
    assert w.rec.start_span_context("alpha") is None


FOREIGN_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("tracing", [False, True])
async def test_the_daemon_own_trace_context_reaches_no_replica_job(
    tmp_path: Path, tracing: bool
) -> None:
    """A daemon started from a traced shell or CI job has TRACEPARENT (and maybe
    TRACESTATE) itself; sbatch exports the submitting environment, so without care
    every job inherited them: tracing off, a trace context all the same; on, the
    daemon's TRACESTATE beside the start span's TRACEPARENT."""
    from llmgw_slurm.slurm.cli import CliBackend
    from llmgw_slurm.slurm.pyslurm_backend import submit_kwargs

    w = make_world(tmp_path, tracing=tracing)
    _, jid = await start_alpha(w)
    spec = w.slurm.specs[jid]
    daemon_env = {"PATH": "/usr/bin:/bin", "TRACEPARENT": FOREIGN_TP, "TRACESTATE": "k=v"}
    sbatch = tmp_path / "sbatch"
    sbatch.write_text(f"#!/bin/sh\nenv > {tmp_path}/sbatch.env; cat > /dev/null; echo 7\n")
    sbatch.chmod(0o755)
    await CliBackend(bin_dir=str(tmp_path), env=daemon_env).submit(spec)
    lines = (tmp_path / "sbatch.env").read_text().splitlines()
    exported = dict(line.split("=", 1) for line in lines if "=" in line)
    given = submit_kwargs(spec, "/s", daemon_env)["environment"]
    for env in (exported, given):
        assert "TRACESTATE" not in env  # the start span has none
        assert env["LLMGW_MODEL"] == "alpha"
        if tracing:
            (start,) = w.rec.tracing._starts.values()
            assert env["TRACEPARENT"] == traceparent_of(start.span.get_span_context())
        else:
            assert "TRACEPARENT" not in env
    await w.rec.close()


def test_decision_names() -> None:
    assert decision_of("scale up to 1: a request is waiting") == "scale_up"
    assert decision_of("drained (renewed by x)") == "drained"
    assert decision_of("something new") == "other"


# ---- setup, carriers, failing exporters ---------------------------------------------


def _batch_threads() -> int:
    return sum(1 for t in threading.enumerate() if "OtelBatchSpanProcessor" in t.name)


def test_setup_off_returns_none_and_starts_no_thread() -> None:
    before = _batch_threads()
    assert setup_tracing(TracingConfig(), "llmgw-daemon", set_global=False) is None
    assert _batch_threads() == before
    assert inject_env(trace.set_span_in_context(trace.INVALID_SPAN)) == {}
    assert inject_env() == {}


def test_setup_on_resource_and_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    cfg = TracingConfig(enabled=True, sampling_ratio=0.0, resource_attributes={"cluster": "c1"})
    exporter = InMemorySpanExporter()
    provider = setup_tracing(cfg, "llmgw-daemon", exporter=exporter, set_global=False)
    assert provider is not None
    try:
        attrs = provider.resource.attributes
        assert attrs["service.name"] == "llmgw-daemon"
        assert attrs["cluster"] == "c1"
        assert attrs["deployment.environment"] == "test"
        tracer = provider.get_tracer("t")
        # Ratio 0: a new trace is not sampled; a sampled parent still is (ParentBased).
        assert not tracer.start_span("root").is_recording()
        parent = SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        assert tracer.start_span("child", context=ctx).is_recording()
    finally:
        provider.shutdown()


def test_grpc_without_its_package_is_a_clear_config_error() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the grpc exporter is installed here")
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
        setup_tracing(TracingConfig(enabled=True, protocol="grpc"), "x", set_global=False)


class Raising(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise ConnectionError("collector down")

    def shutdown(self) -> None:
        raise RuntimeError("shutdown fails too")


def test_an_exporter_that_raises_breaks_nothing_and_logs_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = Raising()
    wrapped = RateLimitedExporter(inner, interval=3600)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(wrapped))
    tracer = provider.get_tracer("t")
    with caplog.at_level(logging.WARNING, logger="llmgw_slurm.tracing.otel"):
        for _ in range(5):
            with tracer.start_as_current_span("s"):
                pass
        provider.shutdown()
    assert inner.calls == 5
    assert wrapped.failures == 6  # five exports and the shutdown
    messages = [r.getMessage() for r in caplog.records if r.name == "llmgw_slurm.tracing.otel"]
    assert len(messages) == 1 and "collector down" in messages[0]


async def test_reconciler_serves_on_with_an_exporter_that_raises(tmp_path: Path) -> None:
    server = server_config(tmp_path, tracing=True)
    provider = setup_tracing(server.tracing, "llmgw-daemon", exporter=Raising(), set_global=False)
    assert provider is not None
    slurm = FakeSlurm()
    rec = Reconciler(
        load_catalog(server.models),
        server,
        slurm,
        KEY,
        "http://127.0.0.1:1",
        tracer=provider.get_tracer("llmgw_slurm"),
    )
    rec.want("alpha")
    await rec.pass_once()
    assert len(slurm.specs) == 1
    provider.force_flush()
    provider.shutdown()


def test_env_carrier_round_trip() -> None:
    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("s")
    env = inject_env(trace.set_span_in_context(span))
    assert set(env) == {"TRACEPARENT"}  # no trace state set: no empty variable
    got = trace.get_current_span(extract_env({**env, "PATH": "/bin"})).get_span_context()
    assert got.trace_id == span.get_span_context().trace_id
    assert got.span_id == span.get_span_context().span_id
    assert traceparent_of(span.get_span_context()) == env["TRACEPARENT"]
    assert not trace.get_current_span(extract_env({})).get_span_context().is_valid
    assert context_from_traceparent("00-garbage") is None


def test_trace_marker_round_trip(tmp_path: Path) -> None:
    sc = SpanContext(5, 6, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    path = tmp_path / "traces" / "m.traceparent"
    assert read_trace_marker(path) is None
    write_trace_marker(path, sc)
    got = read_trace_marker(path)
    assert got is not None and (got.trace_id, got.span_id) == (5, 6)
    path.write_text("not a traceparent")
    assert read_trace_marker(path) is None


# ---- the gateway -------------------------------------------------------------------


class StartingDirectory(StaticDirectory):
    """A directory that knows the start span of the replica it is starting."""

    def __init__(self, sc: SpanContext, url: str) -> None:
        super().__init__([ModelInfo("tiny")], on_want=self._start)
        self.sc = sc
        self.url = url

    def _start(self, model: str) -> None:
        self.add_endpoint(model, Endpoint("0a1b2c3d", self.url, "engine-key"))

    def start_span_context(self, model: str) -> SpanContext | None:
        return self.sc


async def test_held_request_links_to_the_replica_start() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    start = SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    async with engine() as eng:
        directory = StartingDirectory(start, eng)
        assert isinstance(directory, ModelDirectory)
        app = create_app(
            directory, RouterConfig(hold_timeout=30), tracer=provider.get_tracer("llmgw_slurm")
        )
        async with serve(app) as url, aiohttp.ClientSession() as s:
            incoming = "00-0000000000000000000000000000abcd-0000000000001234-01"
            async with s.post(
                f"{url}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                headers={"traceparent": incoming},
            ) as resp:
                assert resp.status == 200
    (req,) = [sp for sp in exporter.get_finished_spans() if sp.name == "llmgw.router.request"]
    assert req.context.trace_id == 0xABCD  # the client's trace is honoured
    assert [(lk.context.trace_id, lk.context.span_id) for lk in req.links] == [(0xABC, 0xDEF)]
    assert req.attributes is not None and "llmgw.held_seconds" in req.attributes
    # OpenTelemetry's HTTP server conventions, beside the service's own attributes.
    assert req.attributes["http.request.method"] == "POST"
    assert req.attributes["url.path"] == "/v1/chat/completions"
    assert req.attributes["http.response.status_code"] == 200


async def _gateway_spans(
    trace_requests: str, headers: dict[str, str], held: bool, served_in_a_span: bool = False
) -> tuple[list[ReadableSpan], dict[str, str]]:
    """Send one chat request; return the gateway's finished spans and the headers the engine got.

    ``served_in_a_span``: the gateway is started while a span of the server's
    own is current, which its handlers may inherit."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    start = SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    async with contextlib.AsyncExitStack() as stack:
        eng = await stack.enter_async_context(engine())
        directory = StartingDirectory(start, eng)
        if not held:
            directory.add_endpoint("tiny", Endpoint("0a1b2c3d", eng, "engine-key"))
        app = create_app(
            directory,
            RouterConfig(hold_timeout=30, trace_requests=trace_requests),
            tracer=provider.get_tracer("llmgw_slurm"),
        )
        outer = provider.get_tracer("test").start_as_current_span("outer")
        with outer if served_in_a_span else contextlib.nullcontext():
            server = await stack.enter_async_context(serve(app))
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{server}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                headers=headers,
            ) as resp:
                assert resp.status == 200
            async with s.get(
                f"{eng}/debug/last-headers", headers={"Authorization": "Bearer engine-key"}
            ) as r:
                assert r.status == 200
                seen = await r.json()
    return list(exporter.get_finished_spans()), seen


async def test_untraced_request_makes_no_span_by_default() -> None:
    spans, seen = await _gateway_spans("sampled", {}, held=False)
    assert spans == []
    assert "traceparent" not in {k.lower() for k in seen}


async def test_unsampled_client_context_is_forwarded_untouched() -> None:
    tp = "00-0000000000000000000000000000abcd-0000000000001234-00"
    spans, seen = await _gateway_spans("sampled", {"traceparent": tp}, held=False)
    assert spans == []
    assert {k.lower(): v for k, v in seen.items()}.get("traceparent") == tp, seen


async def test_baggage_alone_is_forwarded() -> None:
    spans, seen = await _gateway_spans("sampled", {"baggage": "project=phys"}, held=False)
    assert spans == []
    assert {k.lower(): v for k, v in seen.items()}.get("baggage") == "project=phys", seen


async def test_a_span_current_when_the_gateway_started_is_not_forwarded() -> None:
    # Only the client's context is the request's: the handler's inherited one
    # (here the span the server was started in) must not reach the engine.
    spans, seen = await _gateway_spans("sampled", {}, held=False, served_in_a_span=True)
    assert "traceparent" not in {k.lower() for k in seen}, seen
    assert [sp.name for sp in spans] == ["outer"]


async def test_all_gives_every_request_a_span() -> None:
    spans, _ = await _gateway_spans("all", {}, held=False)
    assert [sp.name for sp in spans] == ["llmgw.router.request"]


async def test_untraced_held_request_gets_a_held_span_linked_to_the_start() -> None:
    spans, _ = await _gateway_spans("sampled", {}, held=True)
    (held,) = spans
    assert held.name == "llmgw.router.held"
    assert [(lk.context.trace_id, lk.context.span_id) for lk in held.links] == [(0xABC, 0xDEF)]


# ---- model jobs: the replica's weights step links to the job that fetched them ------


def test_weights_from_a_model_job_link_the_replica_weights_span(tmp_path: Path) -> None:
    from test_agent_run import job_env, make_weights, spec_json

    from llmgw_slurm.agent.runner import Agent, job_context_from_env
    from llmgw_slurm.agent.weights import trace_marker_path
    from llmgw_slurm.config import AgentConfig, AgentWeightsConfig

    env = job_env("http://127.0.0.1:1", spec_json(make_weights(tmp_path)))
    job_ctx = job_context_from_env(env)
    settings = AgentConfig(weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agent = Agent(settings, job_ctx, env, tracer=provider.get_tracer("t"), hostname="n1")
    path = trace_marker_path(settings.weights.cache_dir, job_ctx.model, job_ctx.spec.weights)
    assert path is not None
    # No marker (weights fetched by the replica itself, or tracing was off): no link.
    with provider.get_tracer("t").start_as_current_span("w") as span:
        agent._link_model_job(span)
    model_job = SpanContext(0x77, 0x88, is_remote=False, trace_flags=TraceFlags(1))
    write_trace_marker(path, model_job)
    with provider.get_tracer("t").start_as_current_span("w2") as span:
        agent._link_model_job(span)
    plain, linked = exporter.get_finished_spans()
    assert plain.links == ()
    (link,) = linked.links
    assert (link.context.trace_id, link.context.span_id) == (0x77, 0x88)
    # And the daemon hears of it in the weights step's report (see the start-span test).
    assert agent._step_message is not None
    assert traceparent_from_comment(agent._step_message) == traceparent_of(model_job)


# ---- engine installs: the replica's engine launch links to the job that installed it ----


def test_an_engine_from_an_install_job_links_the_launch_span(tmp_path: Path) -> None:
    from test_agent_run import job_env, make_weights, spec_json

    from llmgw_slurm.agent.install import marker_path
    from llmgw_slurm.agent.runner import Agent, job_context_from_env
    from llmgw_slurm.config import AgentConfig, AgentWeightsConfig

    env = job_env("http://127.0.0.1:1", spec_json(make_weights(tmp_path)))
    settings = AgentConfig(weights=AgentWeightsConfig(cache_dir=tmp_path / "cache"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    agent = Agent(settings, job_context_from_env(env), env, tracer=provider.get_tracer("t"))
    venv = tmp_path / "engines" / "vllm"
    (venv / "bin").mkdir(parents=True)
    python = str(venv / "bin" / "python")
    # An engine nobody installed (no marker): no link, nothing said.
    with provider.get_tracer("t").start_as_current_span("a") as span:
        agent._link_engine_install(span, python)
    assert agent._step_message is None
    install = SpanContext(0x99, 0xAA, is_remote=False, trace_flags=TraceFlags(1))
    write_trace_marker(marker_path(venv), install)
    with provider.get_tracer("t").start_as_current_span("b") as span:
        agent._link_engine_install(span, python)
    plain, linked = exporter.get_finished_spans()
    assert plain.links == ()
    (link,) = linked.links
    assert (link.context.trace_id, link.context.span_id) == (0x99, 0xAA)
    assert link.attributes is not None and link.attributes["llmgw.link"] == "engine_install"
    assert agent._step_message is not None
    assert traceparent_from_comment(agent._step_message) == traceparent_of(install)
