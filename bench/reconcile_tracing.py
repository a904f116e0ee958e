"""What tracing costs a reconcile pass: the same passes with tracing off and on.

The Slurm side is an in-memory listing (no squeue), so the figure is the
reconciler's own work, where tracing's share is largest; with a real squeue
(10-40 ms a call, see docs/performance.md) the share is smaller still.

Two kinds of pass, off and on alternating pass by pass so that machine
noise spreads over both:
- idle: 100 ready replicas, nothing to do (the common pass; makes no trace);
- acting: one model is asked for and a replica is submitted (a trace with
  observe, plan, place and an open start span; the job script is rendered
  as in production).
"Tracing on" is the SDK with the batch processor and an exporter that accepts
and drops (export runs on the processor's thread; its cost shows in the
gateway benchmark, which exports to a real OTLP receiver).

    python bench/reconcile_tracing.py [--passes 300]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from bench import common
from llmgw_slurm.auth.secrets import replica_secret
from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.config import load_server_config
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.slurm.types import (
    GpuCount,
    Job,
    JobComponent,
    JobSpec,
    JobState,
    NodeInfo,
)

KEY = b"b" * 32
N_MODELS = 20
PER_MODEL = 5


class Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Listing:
    """An in-memory Slurm: jobs as listed, 16 nodes with 8 GPUs each."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.n = 0

    async def submit(self, spec: JobSpec) -> str:
        self.n += 1
        jid = str(self.n)
        self.jobs[jid] = _job(jid, spec.name, JobState.PENDING)
        return jid

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        return list(self.jobs.values())

    async def list_nodes(self) -> list[NodeInfo]:
        return [
            NodeInfo(f"n{i}", "mixed", ("llm",), 64, 8, 500_000, (GpuCount("a100", 8, 6),))
            for i in range(16)
        ]

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        self.jobs.pop(job_id, None)


def _job(jid: str, name: str, state: JobState) -> Job:
    return Job(
        jid, name, state, "", "llm", "me", "", ("n0",), datetime(2026, 1, 1),
        datetime(2026, 1, 1), 3600 * 24, 3600 * 24, 0,
        (JobComponent(0, jid, state, ("n0",), 1, "gres/gpu:a100:1"),),
    )  # fmt: skip


_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(BatchSpanProcessor(Drop()))


def _write_config(folder: Path, tracing: bool) -> Path:
    models = "\n".join(
        f"  - name: m{i}\n    engine: {{kind: command, command: [x, '{{port}}']}}\n"
        f"    resources: {{gpus: 1, partition: llm, gpu_type: a100, time_limit: '1-00:00:00'}}\n"
        f"    scaling: {{min: 0, max: 10, idle_timeout: 10h}}"
        for i in range(N_MODELS + 1)
    )
    (folder / "models.yaml").write_text(f"models:\n{models}\n")
    (folder / "agent.yaml").write_text("weights: {cache_dir: /tmp}\n")
    (folder / f"server-{tracing}.yaml").write_text(
        f"state_dir: {folder / 'state'}\nslurm: {{partition: llm, job_prefix: b.}}\n"
        f"tracing: {{enabled: {str(tracing).lower()}}}\n"
    )
    return folder / f"server-{tracing}.yaml"


def _reconciler(folder: Path, tracing: bool) -> tuple[Reconciler, Listing]:
    server = load_server_config(_write_config(folder, tracing))
    # One provider for every reconciler of the run (as in the daemon): each
    # provider starts an exporter thread.
    tracer = _PROVIDER.get_tracer("llmgw_slurm") if tracing else None
    listing = Listing()
    rec = Reconciler(load_catalog(server.models), server, listing, KEY, "http://x:1", tracer=tracer)
    return rec, listing


async def _idle_world(folder: Path, tracing: bool) -> Reconciler:
    rec, listing = _reconciler(folder, tracing)
    for i in range(N_MODELS * PER_MODEL):
        rid = f"{i:08x}"
        listing.jobs[str(10_000 + i)] = _job(
            str(10_000 + i), f"b.m{i % N_MODELS}.{rid}", JobState.RUNNING
        )
    await rec.pass_once()
    for r in list(rec.replicas.values()):
        rec.report(
            r.replica_id,
            replica_secret(KEY, r.replica_id),
            {"event": "ready", "url": "http://n0:1"},
        )
        rec.request_started(r.model, r.replica_id)  # busy: never idle
    await rec.pass_once()
    return rec


async def _time_pass(rec: Reconciler) -> float:
    t0 = time.perf_counter()
    await rec.pass_once()
    return time.perf_counter() - t0


async def run(passes: int) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmpd:
        folder = Path(tmpd)
        worlds = {t: await _idle_world(folder, t) for t in (False, True)}
        idle: dict[bool, list[float]] = {False: [], True: []}
        acting: dict[bool, list[float]] = {False: [], True: []}
        # Off and on alternate pass by pass, so that noise from elsewhere on the
        # machine lands on both alike.
        for i in range(passes):
            order = (False, True) if i % 2 else (True, False)
            for t in order:
                idle[t].append(await _time_pass(worlds[t]))
            for t in order:
                rec, listing = _reconciler(folder, t)
                rec.want(f"m{N_MODELS}")
                acting[t].append(await _time_pass(rec))
                assert len(listing.jobs) == 1
    med = {k: {t: common.median(v[t]) * 1000 for t in (False, True)} for k, v in
           (("idle", idle), ("acting", acting))}  # fmt: skip
    return [
        common.result(f"reconcile pass, {kind}, tracing on", med[kind][True], "ms",
                      "tracing off", med[kind][False])
        for kind in ("idle", "acting")
    ]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=300)
    args = p.parse_args()
    results = asyncio.run(run(args.passes))
    common.print_table(results)
    print("written:", common.write("reconcile_tracing", results, vars(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
