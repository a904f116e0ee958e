"""The status page's render time with charts against the tables-only page, in one run.

    python3 bench/status_page.py [--models 500] [--replicas 2000] [--rounds 15]

No daemon and no Slurm: a status snapshot of N models and M replicas (as
``GET /api/v1/status`` gives it), a :class:`~llmgw_slurm.api.history.History` over
the real gateway metrics with a full hour (60 points) for every model, a
:class:`~llmgw_slurm.tracing.store.TraceStore` holding a start trace per model
(the pass, the start with its Slurm events, an agent with five steps) and
GPU hours for every model and 20 accounts. Each round renders the page both
ways, alternating; the charts' side includes everything a page view computes
(the history's live point, the latest cold starts' waterfalls from the store,
the SVG geometry). Medians are printed and written to
bench/results/status_page.json, with the page sizes and the memory the trace
store (filled to its bound) and the history take.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from bench.common import median, print_table, result, write
from llmgw_slurm.api.charts import Charts
from llmgw_slurm.api.history import History
from llmgw_slurm.api.status_page import render_page
from llmgw_slurm.router.metrics import GatewayMetrics
from llmgw_slurm.tracing.store import TraceStore


class _Dir:
    def models(self) -> list[Any]:
        return []


class _Clock:
    t = time.time() - 3600

    def __call__(self) -> float:
        return self.t


def status(models: int, replicas: int) -> dict[str, Any]:
    per = max(1, replicas // models)
    ms = []
    for i in range(models):
        reps = [
            {
                "id": f"{i:04x}{j:04x}",
                "job_id": str(100_000 + i * per + j),
                "state": "ready",
                "reason": "",
                "nodes": [f"gpunode{(i * per + j) % 500}"],
                "step": "ready",
                "in_flight": j,
                "idle_s": 3,
            }
            for j in range(per)
        ]
        ms.append(
            {
                "name": f"org/model-{i:03d}",
                "aliases": [f"m{i}"],
                "state": f"ready {per}",
                "gpus": 1,
                "min": 0,
                "max": per,
                "note": "",
                "replicas": reps,
            }
        )
    decisions = [
        {
            "at": time.time(),
            "action": "submit",
            "model": "org/model-000",
            "replica": "x",
            "reason": "scale up",
        }
        for _ in range(30)
    ]
    nodes = [
        {
            "name": f"gpunode{n}",
            "state": "mixed",
            "reason": "",
            "partitions": ["llm"],
            "gpus_free": 1,
            "gpus_total": 4,
        }
        for n in range(500)
    ]
    return {
        "models": ms,
        "decisions": decisions,
        "nodes": nodes,
        "now": time.time(),
        "passes": 1,
        "version": "bench",
        "nodes_listed_at": time.time(),
    }


def history(models: int) -> History:
    m = GatewayMetrics(_Dir(), CollectorRegistry())  # type: ignore[arg-type]
    clock = _Clock()
    names = [f"org/model-{i:03d}" for i in range(models)]
    h = History(m, lambda: dict.fromkeys(names, 4), clock=clock)
    for _ in range(61):
        for i, name in enumerate(names):
            m.requests.labels(name, "200").inc(i % 7)
            m.tokens.labels(name, "completion").inc(100 * (i % 5))
            m.ttfb.labels(name).observe(0.05 * (1 + i % 9))
        h.sample()
        clock.t += 60
    return h


def store(models: int, max_spans: int = 20_000) -> TraceStore:
    st = TraceStore(max_spans=max_spans)
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(st)
    tracer = provider.get_tracer("bench")
    for i in range(models):
        name = f"org/model-{i:03d}"
        with tracer.start_as_current_span("reconcile.pass", attributes={"llmgw.pass_id": "p"}):
            with tracer.start_as_current_span("reconcile.observe"):
                pass
            with tracer.start_as_current_span("replica.place") as place:
                place.set_attribute("llmgw.reason", "scale up to 1: a request is waiting" * 3)
                start = tracer.start_span(
                    "replica.start", attributes={"llmgw.model": name, "llmgw.replica": f"{i:08x}"}
                )
        for reason in ("Resources", "Priority", "None"):
            start.add_event(
                "slurm.pending",
                {"llmgw.slurm.state": "PENDING", "llmgw.slurm.pending_reason": reason},
            )
        start.add_event("slurm.running", {"llmgw.slurm.state": "RUNNING"})
        with tracer.start_as_current_span(
            "llmgw.agent",
            context=__import__("opentelemetry").trace.set_span_in_context(start),
            attributes={"llmgw.replica_id": f"{i:08x}", "llmgw.node": "gpunode1"},
        ):
            for step in ("weights", "rendezvous", "engine_launch", "readiness", "register"):
                with tracer.start_as_current_span(f"llmgw.agent.{step}"):
                    pass
        start.set_attribute("llmgw.start.outcome", "ready")
        start.end()
    return st


def worst_store(spans: int) -> TraceStore:
    """Spans as big as the store keeps: 32 attributes of 300 characters, 64 events."""
    st = TraceStore(max_spans=spans)
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(st)
    tracer = provider.get_tracer("bench")
    for i in range(spans):
        # Strings of their own (shared ones would be counted once).
        attrs = {f"llmgw.k{k:02d}": f"{i}-{k}" + "a" * 290 for k in range(32)}
        with tracer.start_as_current_span("replica.start", attributes=attrs) as sp:
            for j in range(64):
                sp.add_event("slurm.pending", {"llmgw.note": f"{i}{j}" + "x" * 295})
    return st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=500)
    ap.add_argument("--replicas", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    snap = status(args.models, args.replicas)
    hist = history(args.models)
    charts = Charts(hist, store(args.models))
    charts.gpu_hours = {
        "at": time.time(),
        "since": time.time() - 7 * 86400,
        "by_model": {f"org/model-{i:03d}": float(i) for i in range(args.models)},
        "by_account": {f"acct{i}": float(i) for i in range(20)},
    }

    def with_charts() -> str:
        # What the page handler does (charts.page_data): the hour's small
        # multiples are built once per sample (a minute), the rest every view.
        return render_page(snap, "http://x/v1", charts.page())

    def tables() -> str:
        return render_page(snap, "http://x/v1")

    t_tables: list[float] = []
    t_charts: list[float] = []
    with_charts()
    tables()
    for _ in range(args.rounds):
        for fn, out in ((tables, t_tables), (with_charts, t_charts)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    size_t, size_c = len(tables().encode()), len(with_charts().encode())

    tracemalloc.start()
    full = store(1400)  # 14 spans a start: about 20,000 spans, the default bound
    st_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tracemalloc.start()
    worst = worst_store(5000)
    worst_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    worst_spans = worst.stats()["spans"]
    tracemalloc.start()
    history(args.models)
    h_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    spans = full.stats()["spans"]

    label = f"{args.models} models, {args.replicas} replicas"
    results = [
        result(
            f"page with charts ({label})",
            median(t_charts),
            "s",
            "tables-only page",
            median(t_tables),
        ),
        result("page bytes with charts", size_c, "bytes", "tables-only page bytes", size_t),
        result(f"trace store at its bound ({spans} spans)", st_bytes / spans, "bytes/span", "-", 0),
        result(
            f"trace store, largest spans ({worst_spans})",
            worst_bytes / worst_spans,
            "bytes/span",
            "-",
            0,
        ),
        result(f"history, {args.models} models x 60 points", h_bytes / 1e6, "MB", "-", 0),
    ]
    print_table(results)
    print("written", write("status_page", results, vars(args)))


if __name__ == "__main__":
    main()
