"""Cost of one reconcile pass: the plan alone, and the whole pass against Slurm.

Part ``plan`` (no cluster): synthetic catalogs of 10, 100 and 500 models,
40, 400 and 2,000 replicas (a mix of ready, starting and pending, with a last
use) and 500 nodes of 8 GPUs; times ``plan()`` (median of repeats) and draws
how it grows (``docs/img/plan-scaling.png`` when matplotlib is installed).

Part ``pass`` (the dev cluster: ``eval "$(scripts/dev-cluster env)"``): a
Reconciler over a catalog whose replicas exist as HELD jobs (they cost the
cluster nothing) and whose ``min`` equals the jobs there are, so a pass changes
nothing. Times ``pass_once()`` with 0, 100 and 2,000 replicas, with no and with
5,000 foreign jobs of the same user (another name prefix: ``squeue -u`` loads
them all), against a bare ``squeue -u USER`` timed alternately; counts the
Slurm commands per pass and checks that a pass submits and cancels nothing.

    python3 bench/reconcile_pass.py [--part plan|pass|all] [--repeats 15] [--scale 1.0]

``--scale 0.05`` runs the ``pass`` part with 5% of the jobs (a dry run).
Every job it submits is cancelled at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import dataclasses
import getpass
import itertools
import json
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, median, print_table, result, write
from llmgw_slurm.catalog import Catalog, load_catalog
from llmgw_slurm.config import ReconcileConfig, ServerConfig, SlurmConfig
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.reconciler.plan import PlanConfig, ReplicaState, ReplicaView, plan
from llmgw_slurm.reconciler.replicas import view_of
from llmgw_slurm.slurm import JobSpec, parse
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import GpuCount, NodeInfo

TOP = Path(__file__).resolve().parents[1]
# Every service job of this benchmark starts with BASE, and the user's other jobs
# with FOREIGN (not the reconciler's prefix); --prefix changes both, so that a run
# never touches the jobs of someone else's run on a shared cluster.
BASE = "llmgwbench."
FOREIGN = "llmgwbenchother-"
HOLD = "#!/bin/bash\n#SBATCH --partition=llm\n#SBATCH --hold\n#SBATCH --output=/dev/null\ntrue\n"

# ---------------------------------------------------------------------- catalogs


def catalog_yaml(names: list[str], mins: dict[str, int]) -> str:
    """A catalog in the site's YAML form: each model's ``min`` from ``mins``, ``max`` 2 more."""
    out = [
        "defaults:",
        "  resources:",
        "    {partition: llm, gpu_type: a100, cpus: 4, memory: 32G, time_limit: '8:00:00'}",
        "  engine: {kind: vllm}",
        "models:",
    ]
    for i, name in enumerate(names):
        lo = mins[name]
        hi = max(lo, 1) + 2
        out += [
            f"  - name: {name}",
            f"    weights: {{source: 'hf:org/{name}'}}",
            f"    resources: {{gpus: {(1, 2, 4, 8)[i % 4]}}}",
            f"    scaling: {{min: {lo}, max: {hi}, idle_timeout: 30m, target_inflight: 8}}",
        ]
    return "\n".join(out) + "\n"


def load_yaml_catalog(text: str) -> Catalog:
    # Through a file, as the daemon loads it: the same parser and validation.
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_catalog(f.name)
    finally:
        Path(f.name).unlink()


# -------------------------------------------------------------------- plan alone


def synthetic_nodes(n: int, rng: random.Random) -> list[NodeInfo]:
    out = []
    for i in range(n):
        used = rng.choice((0, 0, 2, 4, 8, 8, 8))
        state = "idle" if used == 0 else "allocated" if used == 8 else "mixed"
        if i % 97 == 0:
            state = "drained"
        out.append(
            NodeInfo(
                name=f"gpu{i:04d}",
                state=state,
                partitions=("llm",) if i % 5 else ("llm", "research"),
                cpus_total=64,
                cpus_alloc=used * 8,
                memory_mb=512_000,
                gpus=(GpuCount("a100", 8, used),),
            )
        )
    return out


def synthetic_replicas(
    models: list[str], n: int, now: float, rng: random.Random
) -> list[ReplicaView]:
    out = []
    for i in range(n):
        model = models[i % len(models)]
        kind = rng.random()
        if kind < 0.7:
            state, reason, started = ReplicaState.READY, "", now - rng.uniform(600, 20_000)
        elif kind < 0.85:
            state, reason, started = ReplicaState.STARTING, "", now - rng.uniform(5, 300)
        else:
            state = ReplicaState.PENDING
            reason, started = rng.choice(("Resources", "Priority", "JobHeldUser")), None
        ready = state is ReplicaState.READY
        out.append(
            ReplicaView(
                replica_id=f"{i:08x}",
                model=model,
                job_id=str(100_000 + i),
                state=state,
                submitted_at=now - rng.uniform(10, 30_000),
                gpus_per_node=(1, 2, 4, 8)[i % 4],
                reason=reason,
                started_at=started,
                ready_at=started + 60 if ready and started else None,
                last_used=now - rng.uniform(0, 3_600) if ready else None,
                in_flight=rng.choice((0, 0, 0, 1, 3, 9)) if ready else 0,
                ends_at=None if state is ReplicaState.PENDING else now + rng.uniform(600, 28_000),
            )
        )
    return out


def time_plan(
    n_models: int, n_replicas: int, n_nodes: int, repeats: int, *, cold: bool = False
) -> tuple[float, dict[str, int]]:
    """Median plan() time and its actions by kind.

    Steady state (the default): each model's ``min`` is the replicas it has, so
    the plan's work is the per-replica and per-model checks, a few renewals
    (time limits within the margin) and the notes of queued models. Cold start
    (``cold``): every model has ``min: 1`` and no replica, so every model is
    placed on the nodes in one pass (a daemon started on an empty cluster).
    """
    rng = random.Random(n_models * 7919 + n_replicas)
    names = [f"m{i:03d}" for i in range(n_models)]
    now = 1_800_000_000.0
    replicas = [] if cold else synthetic_replicas(names, n_replicas, now, rng)
    counts = collections.Counter(r.model for r in replicas)
    mins = {n: 1 if cold else counts[n] for n in names}
    catalog = load_yaml_catalog(catalog_yaml(names, mins))
    models = {m.name: m for m in catalog.models}
    nodes = synthetic_nodes(n_nodes, rng)
    wanted = {n: now - 30 for n in names[::7]}
    cfg = PlanConfig(default_partition="llm")
    times = []
    kinds: dict[str, int] = {}
    for _ in range(repeats):
        new_id = map("{:08x}".format, itertools.count()).__next__
        t0 = time.perf_counter()
        res = plan(models, replicas, nodes, wanted, {}, cfg, now, new_id)
        times.append(time.perf_counter() - t0)
        kinds = dict(collections.Counter(a.kind.value for a in res.actions))
    return median(times), kinds


def part_plan(repeats: int, n_nodes: int) -> list[dict[str, Any]]:
    grid: dict[tuple[int, int], float] = {}
    cold: dict[int, float] = {}
    rows = []
    for n_models in (10, 100, 500):
        for n_replicas in (40, 400, 2000):
            t, kinds = time_plan(n_models, n_replicas, n_nodes, repeats)
            grid[(n_models, n_replicas)] = t
            rows.append((f"steady, {n_models} models, {n_replicas} replicas", t, kinds))
            print(
                f"plan steady: {n_models:>4} models {n_replicas:>5} replicas {n_nodes} nodes: "
                f"{t * 1000:8.2f} ms, actions {kinds}",
                flush=True,
            )
    for n_models in (10, 100, 500):
        t, kinds = time_plan(n_models, 0, n_nodes, repeats, cold=True)
        cold[n_models] = t
        rows.append((f"cold start, {n_models} models, 0 replicas", t, kinds))
        print(
            f"plan cold start: {n_models:>4} models, min 1 each, no replica, {n_nodes} nodes: "
            f"{t * 1000:8.2f} ms, actions {kinds}",
            flush=True,
        )
    out = [
        {
            "name": f"plan(), {label}, {n_nodes} nodes",
            "value": round(t, 6),
            "unit": "s",
            "actions": kinds,
            "reference": "goal 100 ms",
            "reference_value": 0.1,
            "ratio": round(t / 0.1, 3),
        }
        for label, t, kinds in rows
    ]
    plot(grid, cold, n_nodes)
    return out


def plot(grid: dict[tuple[int, int], float], cold: dict[int, float], n_nodes: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 4), dpi=100, sharey=True)
    for n_models in sorted({m for m, _ in grid}):
        xs = sorted(r for m, r in grid if m == n_models)
        ys = [grid[(n_models, x)] * 1000 for x in xs]
        ax.plot(xs, ys, marker="o", label=f"{n_models} models")
    xs = sorted(cold)
    bx.plot(xs, [cold[x] * 1000 for x in xs], marker="s", color="tab:red", label="min 1 each")
    for a in (ax, bx):
        a.axhline(100, color="grey", linestyle="--", linewidth=1)
        a.set_xscale("log")
        a.set_yscale("log")
        a.grid(True, which="both", alpha=0.3)
        a.legend(loc="upper left")
    ax.text(2000, 110, "goal: 100 ms", color="grey", fontsize=8, ha="right")
    ax.set_xlabel("replicas")
    ax.set_ylabel("plan() median, ms")
    ax.set_title("steady state (min = replicas)")
    bx.set_xlabel("models (no replica yet)")
    bx.set_title("cold start (every model placed)")
    fig.suptitle(f"Reconcile plan time, {n_nodes} nodes of 8 GPUs")
    path = TOP / "docs" / "img" / "plan-scaling.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written: {path}")


# ---------------------------------------------------------------- the full pass


async def submit_held(backend: CliBackend, names: list[str]) -> list[str]:
    sem = asyncio.Semaphore(8)
    done = 0

    async def one(name: str) -> str:
        nonlocal done
        async with sem:
            jid = await backend.submit(JobSpec(name=name, script=HOLD))
        done += 1
        if done % 500 == 0:
            print(f"  submitted {done}/{len(names)}", flush=True)
        return jid

    t0 = time.perf_counter()
    ids = list(await asyncio.gather(*(one(n) for n in names)))
    if names:
        dt = time.perf_counter() - t0
        print(f"  {len(names)} held jobs in {dt:.1f}s ({len(names) / dt:.0f}/s)", flush=True)
    return ids


def cancel(ids: list[str]) -> None:
    for i in range(0, len(ids), 500):
        subprocess.run(["scancel", *ids[i : i + 500]], check=False)


async def bare_squeue() -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "squeue", "-u", getpass.getuser(), stdout=asyncio.subprocess.DEVNULL
    )
    await proc.wait()
    return time.perf_counter() - t0


def user_jobs() -> int:
    out = subprocess.run(
        ["squeue", "-h", "-u", getpass.getuser(), "-o", "%i"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(out.split())


def server_config(prefix: str, state_dir: Path) -> ServerConfig:
    return ServerConfig(
        slurm=SlurmConfig(partition="llm", job_prefix=prefix),
        state_dir=state_dir,
        # Held jobs pend for as long as the benchmark runs: that is not a failure here.
        reconcile=ReconcileConfig(max_pending_time=None),
    )


@dataclasses.dataclass
class Group:
    """Service jobs of the benchmark: ``per_model`` held jobs for each of ``models``."""

    prefix: str  # the reconciler's prefix that sees exactly these jobs
    models: list[str]  # model names as the reconciler with ``prefix`` sees them
    per_model: int
    id_base: int  # replica ids are unique across groups: the reconciler keys replicas by id
    ids: list[str] = dataclasses.field(default_factory=list)

    def names(self) -> list[str]:
        return [
            f"{self.prefix}{m}.{self.id_base + k * 4096 + j:08x}"
            for k, m in enumerate(self.models)
            for j in range(self.per_model)
        ]


async def measure_pass(
    backend: CliBackend,
    prefix: str,
    mins: dict[str, int],
    expect: int,
    repeats: int,
    state_dir: Path,
) -> dict[str, Any]:
    catalog = load_yaml_catalog(catalog_yaml(sorted(mins), mins))
    rec = Reconciler(
        catalog,
        server_config(prefix, state_dir),
        backend,
        b"k" * 32,
        "http://127.0.0.1:1",
    )
    first = await rec.pass_once()  # adopts every job: not the steady state
    if first or len(rec.replicas) != expect:
        raise SystemExit(
            f"the first pass should adopt {expect} replicas and do nothing; "
            f"got {len(rec.replicas)} and {[(a.kind.value, a.reason) for a in first]}"
        )
    # Two kinds of pass, alternating with the bare squeue: the usual one, which plans
    # on the last node listing (one squeue), and one whose listing is older than
    # reconcile.nodes_max_age (squeue and sinfo side by side), forced by forgetting
    # when the nodes were listed. At the defaults (10 s passes, nodes at most 60 s
    # old) one pass in six is of the second kind.
    ours, with_nodes, bare, calls, node_calls, acted = [], [], [], [], [], []

    async def timed(into: list[float], counts: list[dict[str, int]]) -> None:
        nonlocal acted
        before = dict(backend.call_counts)
        t0 = time.perf_counter()
        actions = await rec.pass_once()
        into.append(time.perf_counter() - t0)
        counts.append({k: v - before.get(k, 0) for k, v in backend.call_counts.items()})
        acted += actions

    for _ in range(repeats):
        await timed(ours, calls)
        bare.append(await bare_squeue())
        rec.table.nodes_listed_at = None
        await timed(with_nodes, node_calls)
    per_pass = {
        k: max(c.get(k, 0) for c in calls) for k in ("squeue", "sinfo", "sbatch", "scancel")
    }
    exact = all(c.get("squeue") == 1 and sum(c.values()) == 1 for c in calls) and all(
        c.get("squeue") == 1 and c.get("sinfo") == 1 and sum(c.values()) == 2 for c in node_calls
    )
    # Sanity check, not a test: with nothing to change a pass must submit and cancel nothing.
    nothing = not acted and per_pass["sbatch"] == 0 and per_pass["scancel"] == 0
    print(
        f"  check: {'OK' if nothing else 'FAILED'} nothing submitted or cancelled "
        f"({len(acted)} actions); calls per pass {per_pass}, exactly 1 squeue "
        f"(+ 1 sinfo when the nodes are due): {exact}",
        flush=True,
    )
    if len(rec.replicas) != expect:
        print(f"  WARNING: {len(rec.replicas)} replicas known, expected {expect}")
    return {
        "pass": median(ours),
        "pass_listing_nodes": median(with_nodes),
        "pass_at_defaults": (5 * median(ours) + median(with_nodes)) / 6,
        "bare": median(bare),
        "calls": per_pass,
        "exact_calls": exact,
        "nothing_changed": nothing,
        "pass_min": min(ours),
        "bare_min": min(bare),
    }


async def part_pass(
    repeats: int, scale: float, out_dir: Path, purge_wait: bool, foreign: bool = True
) -> list[dict[str, Any]]:
    backend = CliBackend(timeout=300)
    stale = [j.job_id for j in await backend.list_jobs(BASE)]
    stale += [j.job_id for j in await backend.list_jobs(FOREIGN)]
    if stale:
        print(f"cancelling {len(stale)} jobs left by an earlier run")
        cancel(stale)
        await asyncio.sleep(2)
    n_small = max(1, round(100 * scale))
    n_big = max(n_small + 1, round(2000 * scale))
    n_foreign = round(5000 * scale)
    # Model names may hold dots, so one set of jobs serves two prefixes: the
    # reconciler with prefix "llmgwbench.a." sees group a (the 100 replicas) as
    # models m00..m09; the one with "llmgwbench." sees groups a and b (2,000) as
    # models a.m00.., b.m00... No job is submitted twice.
    per_model = 10 if n_small >= 10 else 1
    a = Group(
        f"{BASE}a.", [f"m{i:02d}" for i in range(n_small // per_model)], per_model, 0x10000000
    )
    b_models = (n_big - len(a.models) * per_model) // 20
    b = Group(f"{BASE}b.", [f"m{i:03d}" for i in range(b_models)], 20, 0x20000000)
    empty_models = {f"m{i:03d}": 0 for i in range(100)}  # on demand, nothing running
    foreign_ids: list[str] = []
    results: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []

    async def run(label: str, prefix: str, mins: dict[str, int], expect: int) -> None:
        others = user_jobs() - expect
        print(f"{label}: {expect} replicas, {others} other jobs of the user queued", flush=True)
        m = await measure_pass(backend, prefix, mins, expect, repeats, out_dir)
        m.update(label=label, replicas=expect, models=len(mins), other_jobs=others)
        rows.append(m)
        print(
            f"  pass {m['pass'] * 1000:.1f} ms, bare squeue -u {m['bare'] * 1000:.1f} ms, "
            f"ratio {m['pass'] / m['bare']:.2f}; listing the nodes too "
            f"{m['pass_listing_nodes'] * 1000:.1f} ms ({m['pass_listing_nodes'] / m['bare']:.2f}); "
            f"one in six of those (the defaults) {m['pass_at_defaults'] / m['bare']:.2f}",
            flush=True,
        )
        results.append(
            result(
                f"pass, {expect} replicas, {others} other jobs",
                m["pass"],
                "s",
                "bare squeue -u",
                m["bare"],
            )
            | {
                k: m[k]
                for k in (
                    "calls",
                    "exact_calls",
                    "nothing_changed",
                    "models",
                    "pass_listing_nodes",
                    "pass_at_defaults",
                )
            }
        )

    try:
        big_mins = {f"a.{m}": a.per_model for m in a.models} | {
            f"b.{m}": b.per_model for m in b.models
        }
        small_mins = {m: a.per_model for m in a.models}
        await run("no foreign", f"{BASE}z.", empty_models, 0)
        a.ids = await submit_held(backend, a.names())
        await run("no foreign", a.prefix, small_mins, len(a.ids))
        if not foreign:
            # Only the rows without the user's other jobs: no MinJobAge wait.
            b.ids = await submit_held(backend, b.names())
            await run("no foreign", BASE, big_mins, len(a.ids) + len(b.ids))
            return results
        print(f"submitting {n_foreign} foreign jobs", flush=True)
        foreign_ids = await submit_held(backend, [f"{FOREIGN}{i:05d}" for i in range(n_foreign)])
        # Group a is foreign to this reconciler too: 5,000 + 100 others.
        await run("foreign", f"{BASE}z.", empty_models, 0)
        await run("foreign", a.prefix, small_mins, len(a.ids))
        b.ids = await submit_held(backend, b.names())
        await run("foreign", BASE, big_mins, len(a.ids) + len(b.ids))
        print("cancelling the foreign jobs; waiting for slurmctld to forget them", flush=True)
        cancel(foreign_ids)
        foreign_ids = []
        if purge_wait:
            await wait_purged()
        await run("no foreign", BASE, big_mins, len(a.ids) + len(b.ids))
    finally:
        cancel(a.ids + b.ids + foreign_ids)
        print()
        print(
            f"{'replicas':>8} {'models':>6} {'others':>6} {'pass ms':>8} "
            f"{'bare ms':>8} {'ratio':>6} {'+sinfo ms':>9} {'ratio':>6} {'1 in 6':>6} calls"
        )
        for m in rows:
            print(
                f"{m['replicas']:>8} {m['models']:>6} {m['other_jobs']:>6} "
                f"{m['pass'] * 1000:>8.1f} {m['bare'] * 1000:>8.1f} "
                f"{m['pass'] / m['bare']:>6.2f} {m['pass_listing_nodes'] * 1000:>9.1f} "
                f"{m['pass_listing_nodes'] / m['bare']:>6.2f} "
                f"{m['pass_at_defaults'] / m['bare']:>6.2f} {m['calls']}"
            )
    return results


async def part_breakdown(
    repeats: int, scale: float, out_dir: Path, profile: bool = False
) -> list[dict[str, Any]]:
    """Where a pass's time goes, with 2,000 replicas (held jobs) and nothing else queued."""
    backend = CliBackend(timeout=300)
    n = max(20, round(2000 * scale))
    g = Group(BASE, [f"m{i:03d}" for i in range(n // 20)], 20, 0x30000000)
    mins = {m: g.per_model for m in g.models}
    squeue = ["squeue", "--noheader", f"--user={backend.user}"]
    squeue.append("--Format=" + parse.format_arg(parse.SQUEUE_FIELDS))
    sinfo = ["sinfo", "--noheader", "--Node", "--Format=" + parse.format_arg(parse.SINFO_FIELDS)]
    steps: dict[str, list[float]] = collections.defaultdict(list)

    try:
        g.ids = await submit_held(backend, g.names())
        catalog = load_yaml_catalog(catalog_yaml(g.models, mins))
        rec = Reconciler(
            catalog, server_config(BASE, out_dir), backend, b"k" * 32, "http://127.0.0.1:1"
        )
        await rec.pass_once()
        # The adapter's own cache: the jobs it returns are then the very objects the
        # passes see, as in a daemon where every listing goes through it.
        row_cache = backend._squeue_cache.setdefault(BASE, parse.SqueueCache())
        for _ in range(repeats):
            t0 = time.perf_counter()
            await bare_squeue()
            steps["bare squeue -u USER"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*squeue, stdout=asyncio.subprocess.PIPE)
            raw = (await proc.communicate())[0].decode()
            steps["squeue, the adapter's format"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*sinfo, stdout=asyncio.subprocess.PIPE)
            raw_nodes = (await proc.communicate())[0].decode()
            steps["sinfo, the adapter's format"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            parse.parse_squeue(raw, BASE)
            steps["parse_squeue, no row cache"].append(time.perf_counter() - t0)
            # As the adapter parses: with its row cache, warm from the previous listing.
            t0 = time.perf_counter()
            jobs = parse.parse_squeue(raw, BASE, row_cache)
            steps["parse_squeue, the adapter's row cache"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            parse.parse_sinfo(raw_nodes)
            steps["parse_sinfo"].append(time.perf_counter() - t0)
            now = time.time()
            t0 = time.perf_counter()
            rec.pass_loop._observe(jobs, now, "bench")
            steps["_observe (join with the daemon's memory)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            views = [view_of(r) for r in rec.replicas.values()]
            steps["ReplicaViews (kept ones reused)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plan(rec.table.models(), views, rec.nodes, {}, rec.failures, rec.plan_cfg, now, str)
            steps["plan()"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await rec.pass_once()
            steps["pass_once() (squeue; nodes from an earlier pass)"].append(
                time.perf_counter() - t0
            )
            rec.table.nodes_listed_at = None  # due: this pass lists them beside the squeue
            t0 = time.perf_counter()
            await rec.pass_once()
            steps["pass_once() (squeue and sinfo concurrent)"].append(time.perf_counter() - t0)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(repeats):
                await rec.pass_once()
            prof.disable()
            print(f"\nprofile of {repeats} passes, {len(g.ids)} replicas:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        cancel(g.ids)
    print(f"\nwhere a pass's time goes, {len(g.ids)} replicas (medians of {repeats}):")
    out = []
    for k, v in steps.items():
        print(f"  {k:45} {median(v) * 1000:8.2f} ms")
        out.append(
            {
                "name": f"breakdown: {k}",
                "value": round(median(v), 6),
                "unit": "s",
                "reference": "",
                "reference_value": 0,
                "ratio": None,
            }
        )
    return out


async def wait_purged(limit: float = 600.0) -> None:
    """Cancelled jobs stay in slurmctld's memory for MinJobAge (300 s on the dev cluster).

    ``squeue -u`` does not print them but slurmctld still packs them into its
    answer, so a "no foreign jobs" figure must wait until they are purged.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-u", getpass.getuser(), "-o", "%j"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        left = sum(1 for n in out.split() if n.startswith(FOREIGN))
        if left == 0:
            print(f"  purged after {time.monotonic() - t0:.0f}s", flush=True)
            return
        await asyncio.sleep(10)
    print("  WARNING: cancelled jobs still in slurmctld's memory; measuring anyway")


async def main() -> None:
    global BASE, FOREIGN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--part", choices=("plan", "pass", "breakdown", "all"), default="all")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--nodes", type=int, default=500, help="synthetic nodes for the plan part")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the jobs to submit")
    ap.add_argument(
        "--no-foreign",
        action="store_true",
        help="pass part: only the rows without the user's other jobs (0, 100, 2,000 replicas)",
    )
    ap.add_argument(
        "--prefix",
        default=BASE,
        help=f"job name prefix of this run's jobs (default {BASE}); cleared of earlier runs' jobs",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="breakdown part: also print cProfile's top functions over the passes",
    )
    ap.add_argument(
        "--no-purge-wait",
        action="store_true",
        help="do not wait for cancelled foreign jobs to leave slurmctld (dry runs)",
    )
    args = ap.parse_args()
    if not args.prefix.endswith("."):
        ap.error("--prefix must end with a dot (the reconciler's prefix ends in one)")
    BASE, FOREIGN = args.prefix, args.prefix.rstrip(".") + "other-"
    print(json.dumps(machine()))
    results: list[dict[str, Any]] = []
    if args.part in ("plan", "all"):
        results += part_plan(args.repeats, args.nodes)
    if args.part in ("pass", "all"):
        with tempfile.TemporaryDirectory(prefix="llmgwbench-") as tmp:
            results += await part_pass(
                args.repeats, args.scale, Path(tmp), not args.no_purge_wait, not args.no_foreign
            )
    if args.part == "breakdown":
        with tempfile.TemporaryDirectory(prefix="llmgwbench-") as tmp:
            results += await part_breakdown(args.repeats, args.scale, Path(tmp), args.profile)
    print()
    print_table(results)
    path = write(f"reconcile_pass_{args.part}", results, vars(args))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    asyncio.run(main())
