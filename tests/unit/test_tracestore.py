"""The daemon's trace store: its own spans, agents' spans over the internal API, the bound,
and the start waterfall built from them."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _router_support import serve
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_tracing import KEY, MODELS, Clock, FakeSlurm, start_alpha

from llmgw_slurm.agent.spansend import DaemonSpanExporter, batches
from llmgw_slurm.api.traces import add_span_route, add_trace_route, trace_of
from llmgw_slurm.auth.secrets import replica_secret, sign_report
from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.cli.charts import waterfall_lines
from llmgw_slurm.config import load_server_config
from llmgw_slurm.daemon import internal_app
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.tracing.otel import extract_env
from llmgw_slurm.tracing.store import MAX_EVENTS, MAX_SPAN_BYTES, SpanRejected, TraceStore
from llmgw_slurm.tracing.waterfall import generic, waterfall


@dataclasses.dataclass
class World:
    rec: Reconciler
    slurm: FakeSlurm
    store: TraceStore


@pytest.fixture
async def w(tmp_path: Path) -> AsyncIterator[World]:
    (tmp_path / "models.yaml").write_text(MODELS)
    (tmp_path / "agent.yaml").write_text("weights: {cache_dir: /tmp}\n")
    # Tracing off (no exporter): the store alone makes the daemon trace.
    (tmp_path / "server.yaml").write_text(
        f"state_dir: {tmp_path / 'state'}\nslurm: {{partition: llm, job_prefix: t.}}\n"
        "reconcile: {eviction_grace: 5s, min_lifetime: 5s}\n"
    )
    server = load_server_config(tmp_path / "server.yaml")
    store = TraceStore()
    provider = TracerProvider(resource=Resource.create({"service.name": "llmgw-daemon"}))
    provider.add_span_processor(store)
    slurm = FakeSlurm()
    rec = Reconciler(
        load_catalog(server.models),
        server,
        slurm,
        KEY,
        "http://127.0.0.1:1",
        clock=Clock(),
        tracer=provider.get_tracer("llmgw_slurm"),
    )
    yield World(rec, slurm, store)
    await rec.close()


def agent_start(env: dict[str, str], rid: str, steps: tuple[str, ...]) -> list[ReadableSpan]:
    """An agent's start spans, as the real one makes them, continuing the job's TRACEPARENT."""
    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "llmgw-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("llmgw_slurm")
    attrs = {"llmgw.replica_id": rid, "llmgw.node": "n1", "llmgw.model": "alpha"}
    with tracer.start_as_current_span("llmgw.agent", context=extract_env(env), attributes=attrs):
        for step in steps:
            with tracer.start_as_current_span(f"llmgw.agent.{step}"):
                time.sleep(0.002)
    return list(mem.get_finished_spans())


async def send(url: str, rid: str, body: Any, secret_of: str | None = None) -> tuple[int, Any]:
    raw = json.dumps(body).encode()
    auth = sign_report(replica_secret(KEY, secret_of or rid), rid, int(time.time()), raw)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{url}/internal/v1/replicas/{rid}/spans", data=raw, headers={"Authorization": auth}
        ) as r,
    ):
        return r.status, await r.json()


def counted_sum(wf: dict[str, Any]) -> float:
    return sum(r["duration_s"] for r in wf["rows"] if r["depth"] == 0 and r["counted"])


async def test_a_cold_start_is_one_waterfall_from_the_pass_to_serving(w: World) -> None:
    rid, jid = await start_alpha(w)
    # Open spans are in the store as they are now: the start is there before it ends.
    (start,) = w.store.starts()
    assert start["end"] is None and start["attrs"]["llmgw.replica"] == rid
    w.slurm.jobs[jid] = dataclasses.replace(w.slurm.jobs[jid], reason="Resources")
    await w.rec.pass_once()
    w.slurm.jobs[jid] = dataclasses.replace(w.slurm.jobs[jid], reason="Priority")
    await w.rec.pass_once()
    w.slurm.run(jid)
    await w.rec.pass_once()
    app = internal_app(w.rec)
    add_span_route(app, w.rec.verifier, w.store)
    steps = ("weights", "rendezvous", "engine_launch", "readiness", "register")
    async with serve(app) as url:
        exporter = DaemonSpanExporter(url, rid, replica_secret(KEY, rid))
        sent = agent_start(w.slurm.specs[jid].env, rid, steps)
        result = await asyncio.to_thread(exporter.export, sent)
        assert result.name == "SUCCESS"
    w.rec.intake.table.tracing.end_start(rid, "ready")
    found = trace_of(w.rec, w.store, "alpha")
    assert found is not None
    wf = found["waterfall"]
    labels = [(r["depth"], r["label"]) for r in wf["rows"]]
    assert labels[0][1].startswith("placed by pass ")
    assert (0, "queued in Slurm") in labels
    assert (1, "PENDING (Resources)") in labels and (1, "PENDING (Priority)") in labels
    assert (0, "job launch") in labels and (0, "agent start-up") in labels
    assert (0, "agent on n1") in labels
    assert [lb for d, lb in labels if d == 2] == list(steps)
    assert (0, "daemon: ready") in labels and labels[-1] == (0, "serving")
    # The rows at the left margin follow each other and add up to the time to serve.
    top = [r for r in wf["rows"] if r["depth"] == 0 and r["counted"]]
    for a, b in itertools.pairwise(top):
        assert a["end"] == b["start"]
    assert wf["time_to_serve_s"] == pytest.approx(counted_sum(wf), abs=1e-9)
    assert top[-1]["end"] == wf["ready_at"]
    # The same start by replica id and by trace id.
    by_rid = trace_of(w.rec, w.store, rid)
    by_tid = trace_of(w.rec, w.store, wf["trace_id"])
    assert by_rid is not None and by_tid is not None
    assert by_rid["waterfall"]["trace_id"] == by_tid["waterfall"]["trace_id"] == wf["trace_id"]
    text = waterfall_lines(wf, cols=100, color=False)
    assert all(len(line) <= 100 for line in text[2:]) and "\x1b" not in "".join(text)
    print("\n".join(text))


async def test_agents_may_add_spans_only_to_their_own_start_signed(w: World) -> None:
    rid, jid = await start_alpha(w)
    w.rec.want("beta")
    await w.rec.pass_once()
    other = next(j for j in w.slurm.specs if j != jid)
    other_rid = w.slurm.specs[other].name.rsplit(".", 1)[1]
    (tid,) = {s["trace_id"] for s in w.store.starts() if s["attrs"]["llmgw.replica"] == rid}
    span = {
        "trace_id": tid,
        "span_id": "1" * 16,
        "parent_id": "",
        "name": "llmgw.agent",
        "start": time.time(),
        "end": time.time(),
    }
    app = internal_app(w.rec)
    add_span_route(app, w.rec.verifier, w.store)
    async with serve(app) as url:
        # Into another replica's trace: refused, saying why; nothing taken.
        status, answer = await send(url, other_rid, {"spans": [span]})
        assert status == 400 and "not replica" in answer["error"]
        # Signed with another replica's secret: refused.
        status, _ = await send(url, rid, {"spans": [span]}, secret_of=other_rid)
        assert status == 401
        status, answer = await send(url, rid, {"spans": [span | {"trace_id": "zz"}]})
        assert status == 400 and "trace_id must be 32 lowercase hex digits" in answer["error"]
        status, answer = await send(url, rid, {"nope": 1})
        assert status == 400
        status, answer = await send(url, rid, {"spans": [span]})
        assert (status, answer) == (200, {"ok": True, "kept": 1})
    assert any(s["span_id"] == "1" * 16 for s in w.store.spans(tid))


def _span(tid: str, sid: str, name: str = "x", **over: Any) -> dict[str, Any]:
    return {
        "trace_id": tid,
        "span_id": sid,
        "parent_id": "",
        "name": name,
        "start": 1000.0,
        "end": 1001.0,
        "attrs": {},
        "events": [],
    } | over


def test_the_store_is_bounded_and_drops_passes_before_starts() -> None:
    store = TraceStore(max_spans=30, max_spans_per_trace=10)
    provider = TracerProvider()
    provider.add_span_processor(store)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("replica.start", attributes={"llmgw.replica": "aaaaaaaa"}):
        pass
    for _ in range(40):
        with tracer.start_as_current_span("reconcile.pass"), tracer.start_as_current_span("p"):
            pass
    st = store.stats()
    assert st["spans"] <= 30 and st["dropped"] > 0
    # The start outlived forty passes that came after it.
    assert [s["attrs"]["llmgw.replica"] for s in store.starts()] == ["aaaaaaaa"]
    # One trace holds at most max_spans_per_trace spans.
    with tracer.start_as_current_span("reconcile.pass"):
        for _ in range(20):
            with tracer.start_as_current_span("step"):
                pass
    tid = max(store._traces, key=lambda t: len(store.spans(t)))
    assert len(store.spans(tid)) == 10


def test_agent_spans_are_checked_and_cut_to_the_limits() -> None:
    store = TraceStore()
    provider = TracerProvider()
    provider.add_span_processor(store)
    with provider.get_tracer("t").start_as_current_span(
        "replica.start", attributes={"llmgw.replica": "aaaaaaaa"}
    ) as sp:
        tid = f"{sp.get_span_context().trace_id:032x}"
    many = [{"name": "e", "t": 1000.0, "attrs": {"k": "v" * 5000}}] * (MAX_EVENTS + 10)
    assert store.add_remote("aaaaaaaa", [_span(tid, "2" * 16, events=many)]) == 1
    (kept,) = [s for s in store.spans(tid) if s["span_id"] == "2" * 16]
    # Values cut to 300 characters, and as many of the latest events as fit the budget.
    assert len(kept["events"][0]["attrs"]["k"]) == 300
    assert 0 < len(kept["events"]) < MAX_EVENTS
    assert len(json.dumps(kept)) < MAX_SPAN_BYTES + 1000
    small = [{"name": "e", "t": 1000.0 + i, "attrs": {}} for i in range(MAX_EVENTS + 10)]
    # Slurm's state changes outlast a flood of other events.
    slurm = {"name": "slurm.pending", "t": 999.0, "attrs": {"r": "v" * 300}}
    noisy = [
        slurm,
        *[{"name": "note", "t": 1000.0 + i, "attrs": {"n": "v" * 300}} for i in range(60)],
    ]
    assert store.add_remote("aaaaaaaa", [_span(tid, "7" * 16, events=noisy)]) == 1
    (kept,) = [s for s in store.spans(tid) if s["span_id"] == "7" * 16]
    assert kept["events"][0] == slurm and kept["events"][-1]["t"] == 1059.0
    assert store.add_remote("aaaaaaaa", [_span(tid, "5" * 16, events=small)]) == 1
    (kept,) = [s for s in store.spans(tid) if s["span_id"] == "5" * 16]
    assert [e["t"] for e in kept["events"]] == [e["t"] for e in small[-MAX_EVENTS:]]
    huge = {f"k{i}": "v" * 300 for i in range(32)}
    assert store.add_remote("aaaaaaaa", [_span(tid, "6" * 16, attrs=huge)]) == 1
    (kept,) = [s for s in store.spans(tid) if s["span_id"] == "6" * 16]
    assert 0 < len(kept["attrs"]) < 32 and next(iter(kept["attrs"])) == "k0"
    # Sent twice (a retried batch): kept once.
    assert store.add_remote("aaaaaaaa", [_span(tid, "2" * 16)]) == 0
    for bad, why in (
        ("nope", "each span must be an object"),
        (_span(tid, "3" * 16, name=""), "a span needs a name"),
        (_span(tid, "3" * 16, start="x"), "start must be a time"),
        (_span(tid, "3" * 16, parent_id="G" * 16), "parent_id must be 16"),
    ):
        with pytest.raises(SpanRejected, match=why):
            store.add_remote("aaaaaaaa", [bad])
    with pytest.raises(SpanRejected, match="not replica bbbbbbbb's start"):
        store.add_remote("bbbbbbbb", [_span(tid, "4" * 16)])


def test_span_batches_stay_under_the_internal_api_body_limit() -> None:
    recs = [_span("a" * 32, f"{i:016x}", attrs={"k": "v" * 250}) for i in range(600)]
    bodies = list(batches(recs, limit=20_000))
    assert len(bodies) > 1 and all(len(b) <= 20_000 for b in bodies)
    assert sum(len(json.loads(b)["spans"]) for b in bodies) == 600


def test_a_start_still_queued_has_no_time_to_serve_and_a_bare_trace_is_a_tree() -> None:
    start = _span("a" * 32, "1" * 16, "replica.start", end=None, attrs={"llmgw.replica": "r"})
    wf = waterfall([start], start, now=1010.0)
    assert wf.time_to_serve is None
    assert [(r.label, r.depth, r.end) for r in wf.rows] == [
        ("queued in Slurm", 0, 1010.0),
        ("submitted, not yet seen in squeue", 1, 1010.0),
    ]
    tree = generic(
        [_span("a" * 32, "1" * 16, "p"), _span("a" * 32, "2" * 16, "c", parent_id="1" * 16)], 0
    )
    assert [(r.label, r.depth) for r in tree.rows] == [("p", 0), ("c", 1)]


async def test_the_admin_trace_route_says_what_it_has(w: World) -> None:
    rid, _ = await start_alpha(w)
    app = internal_app(w.rec)
    add_trace_route(app, w.rec, w.store, lambda _r: None)
    off = internal_app(w.rec)
    add_trace_route(off, w.rec, None, lambda _r: None)

    async def ask(url: str, body: Any) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{url}/internal/v1/admin/trace", json=body) as r,
        ):
            return r.status, await r.json()

    async with serve(app) as url, serve(off) as off_url:
        status, answer = await ask(url, {"target": "alpha"})
        assert status == 200 and answer["waterfall"]["replica"] == rid
        assert answer["store"]["spans"] == len(w.store.spans(answer["waterfall"]["trace_id"]))
        status, answer = await ask(url, {"target": "gamma"})
        assert status == 404
        assert answer["error"].startswith("no start of 'gamma' among the traces kept (1 model")
        assert (await ask(url, {}))[0] == 400
        status, answer = await ask(off_url, {"target": "alpha"})
        assert status == 404 and "tracing.keep_spans is 0" in answer["error"]


def test_a_requeued_start_begins_at_its_own_start_not_at_the_first_ones_pass() -> None:
    tid = "a" * 32
    first = _span(tid, "1" * 16, "replica.start", parent_id="2" * 16, attrs={"llmgw.replica": "r"})
    place = _span(tid, "2" * 16, "replica.place", parent_id="3" * 16)
    pass_ = _span(tid, "3" * 16, "reconcile.pass")
    again = _span(
        tid,
        "4" * 16,
        "replica.start (requeued)",
        parent_id="1" * 16,
        start=1005.0,
        end=None,
        attrs={"llmgw.replica": "r"},
    )
    wf = waterfall([pass_, place, first, again], again, now=1010.0)
    assert wf.t0 == 1005.0 and wf.rows[0].label == "queued in Slurm"


def test_an_agent_whose_daemon_is_away_drops_the_batch_without_raising() -> None:
    from _router_support import free_port

    from llmgw_slurm.agent.main import _to_daemon
    from llmgw_slurm.agent.runner import JobContext

    exporter = DaemonSpanExporter(f"http://127.0.0.1:{free_port()}", "aaaaaaaa", "s", 2.0)
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    with provider.get_tracer("t").start_as_current_span("llmgw.agent"):
        pass
    assert exporter.export(mem.get_finished_spans()).name == "FAILURE"
    # A job without a trace context sends no spans at all.
    job = JobContext("aaaaaaaa", "m", "http://127.0.0.1:1", "s", "k", None)  # type: ignore[arg-type]
    assert _to_daemon(job, {}) is None
    sender = _to_daemon(job, {"TRACEPARENT": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    assert sender is not None
    sender.shutdown()
