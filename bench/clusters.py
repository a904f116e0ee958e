"""Two clusters behind one gateway against two independent gateways, over one synthetic day.

The site: cluster ``a100`` (10 nodes of 4 A100) and cluster ``h100`` (6 nodes of 4
H100), most GPUs held by other users' jobs, some of those jobs ending and new ones
starting through the day. 30 on-demand models: 12 that run on either GPU type, 9
on A100 only, 9 on H100 only (1 to 4 GPUs), asked for over 24 simulated hours (a
seeded trace, busier by day).

Both setups run the real ``plan()`` every 15 simulated seconds with a fake clock,
against one fake Slurm per cluster that starts pending jobs in submission order on
the first nodes with room (as eviction_site.py's), a replica serving a load time
after its job starts:

- one gateway over both clusters (``clusters:``): one catalog, one plan with
  both clusters; a replica that fits on neither goes where the fake Slurm's
  estimate (``sbatch --test-only``: the soonest end of a job on a node that would
  then fit it) is earliest, through the daemon's own ``earliest_start``;
- two gateways, one per cluster (the site's alternative today): each its own
  catalog (the models its GPU type runs), plan and held requests; a model both
  publish is asked of one or the other, each request by a fixed coin (researchers
  split between the two endpoints), so both may run a replica of it.

Reported, one gateway against two: a cold request's wait until its model serves
(p50, p95; a request that gave up after an hour counts as an hour), the mean
wait over every request (a warm one waited 0) and the requests that waited over
5 minutes, idle GPU-hours (GPUs of ready replicas unused for 5 minutes or more),
replica starts and requests given up. ``--busy`` sets the share of the GPUs
other users hold (0.5 by default: at 0.6 and more both setups give up on the
slowest twentieth of cold requests, and their p95 reads 3600 s either way).

    python3 bench/clusters.py [--seed 36]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw_slurm import catalog as cat
from llmgw_slurm.reconciler import plan as pm
from llmgw_slurm.slurm import types

HOURS = 24.0
TICK = 15.0  # the pass interval, simulated seconds
KILL_DELAY = 20.0  # a cancelled job holds its GPUs this long
GIVE_UP = 3600.0  # a held request's client retries this long
IDLE_AFTER = 300.0  # unused this long: the GPUs count as idle
TIME_LIMIT = 4 * 3600.0  # what Slurm's estimates count on for a job's end
CLUSTERS = {"a100": 10, "h100": 6}  # GPU type (and cluster name) -> nodes of 4 GPUs


# ---------------------------------------------------------------- the site and its trace


@dataclass
class Other:
    """Another user's job: GPUs on one node from ``start`` to ``end``."""

    node: str
    gpus: int
    start: float
    end: float


BUSY = 0.5  # the share of GPUs other users hold at any time (--busy)


def others(rng: random.Random, cluster: str, nodes: int) -> list[Other]:
    """Other users' jobs through the day: about BUSY of the GPUs held at any time."""
    out = []
    for i in range(nodes):
        name = f"{cluster}-{i:02d}"
        for _slot in range(4):
            t = -rng.uniform(0, 6 * 3600)
            while t < HOURS * 3600:
                length = rng.uniform(1, 8) * 3600
                if rng.random() < BUSY:
                    out.append(Other(name, 1, t, t + length))
                t += length
    return out


def catalog_text() -> str:
    kinds: list[tuple[str, int, str]] = []
    kinds += [(f"any-{i}", 1 + i % 2, "") for i in range(12)]
    kinds += [(f"a100-{i}", 1 + i % 4, "a100") for i in range(9)]
    kinds += [(f"h100-{i}", 1 + i % 4, "h100") for i in range(9)]
    lines = ["models:"]
    for name, gpus, gtype in kinds:
        res = f"gpus: {gpus}, cpus: {4 * gpus}" + (f", gpu_type: {gtype}" if gtype else "")
        lines.append(
            f"  - name: {name}\n    engine: {{kind: vllm}}\n    weights: {{source: /m/{name}}}\n"
            f"    resources: {{{res}}}\n    scaling: {{min: 0, max: 1, idle_timeout: 30m}}"
        )
    return "\n".join(lines) + "\n"


def trace(rng: random.Random, names: list[str]) -> list[tuple[float, str]]:
    """Request arrivals: each model a Poisson rate (0.1 to 6 per hour, skewed), busier by day."""
    out: list[tuple[float, str]] = []
    for name in names:
        rate = min(6.0, 0.1 * math.exp(rng.uniform(0.0, 4.1))) / 3600.0
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= HOURS * 3600:
                break
            day = 0.55 + 0.45 * math.sin((t / 3600.0 - 8.0) / 24.0 * 2 * math.pi)
            if rng.random() < day:
                out.append((t, name))
    out.sort()
    return out


# ---------------------------------------------------------------- one cluster's fake Slurm


@dataclass
class Job:
    rid: str
    model: str
    gpus: int
    cpus: int
    cluster: str
    submitted: float
    started: float | None = None
    on: str = ""
    ready: float | None = None
    last_used: float | None = None
    draining_since: float | None = None
    stop_reason: str = ""
    stop_at: float | None = None


@dataclass
class Cluster:
    name: str
    nodes: list[str]
    others: list[Other]

    def used(self, now: float, jobs: Sequence[Job]) -> dict[str, int]:
        gpus = dict.fromkeys(self.nodes, 0)
        for o in self.others:
            if o.start <= now < o.end:
                gpus[o.node] += o.gpus
        for j in jobs:
            if j.on and j.cluster == self.name:
                gpus[j.on] += j.gpus
        return gpus

    def listing(self, now: float, jobs: Sequence[Job]) -> list[types.NodeInfo]:
        gpus = self.used(now, jobs)
        return [
            types.NodeInfo(
                name=n,
                state="mixed" if gpus[n] else "idle",
                partitions=("llm",),
                cpus_total=64,
                cpus_alloc=4 * gpus[n],
                memory_mb=512_000,
                gpus=(types.GpuCount(self.name, 4, min(4, gpus[n])),),
            )
            for n in self.nodes
        ]

    def will_start(self, now: float, need: int, jobs: Sequence[Job]) -> float:
        """The soonest a job of ``need`` GPUs starts here, as Slurm's estimate goes: when
        running jobs reach their limit (another user's its end; ours TIME_LIMIT)."""
        gpus = self.used(now, jobs)
        best = math.inf
        for n in self.nodes:
            ends = sorted(
                [o.end for o in self.others if o.node == n and o.start <= now < o.end]
                + [
                    (j.started or now) + TIME_LIMIT
                    for j in jobs
                    if j.on == n and j.cluster == self.name
                ]
            )
            free, at = 4 - gpus[n], now
            for e in ends:
                if free >= need:
                    break
                free, at = free + 1, e
            if free >= need:
                best = min(best, at)
        return best


# ---------------------------------------------------------------- one gateway


@dataclass
class Gateway:
    """One daemon: its catalog, its clusters, its jobs and held requests."""

    models: Mapping[str, Any]
    clusters: list[Cluster]
    load_s: Callable[[Job], float]
    jobs: dict[str, Job] = field(default_factory=dict)
    held: dict[str, list[float]] = field(default_factory=dict)
    waits: list[float] = field(default_factory=list)
    gave_up: int = 0
    starts: int = 0
    idle_gpu_s: float = 0.0

    def schedule(self, now: float) -> None:
        """Slurm's part on each cluster: end killed jobs, start pending ones in order."""
        for rid in [r for r, j in self.jobs.items() if j.stop_at is not None and j.stop_at <= now]:
            del self.jobs[rid]
        for c in self.clusters:
            gpus = c.used(now, list(self.jobs.values()))
            for j in sorted(self.jobs.values(), key=lambda j: j.submitted):
                if j.cluster != c.name or j.started is not None or j.stop_reason:
                    continue
                good = [n for n in c.nodes if 4 - gpus[n] >= j.gpus]
                if good:
                    j.started, j.on = now, good[0]
                    gpus[good[0]] += j.gpus
                    self.starts += 1
        for j in self.jobs.values():
            if j.started is not None and j.ready is None and now >= j.started + self.load_s(j):
                j.ready = j.last_used = now
                for t in self.held.pop(j.model, []):
                    self.waits.append(now - t)

    def request(self, t: float, model: str) -> None:
        ready = [
            j for j in self.jobs.values() if j.model == model and j.ready and not j.stop_reason
        ]
        if ready and all(j.draining_since is None for j in ready):
            ready[0].last_used = t
        else:
            self.held.setdefault(model, []).append(t)

    def give_up(self, now: float) -> None:
        for model, ts in list(self.held.items()):
            keep = [t for t in ts if now - t < GIVE_UP]
            self.gave_up += len(ts) - len(keep)
            self.waits += [GIVE_UP] * (len(ts) - len(keep))
            if keep:
                self.held[model] = keep
            else:
                del self.held[model]

    def count_idle(self, now: float) -> None:
        for j in self.jobs.values():
            if j.ready is not None and not j.stop_reason and j.last_used is not None:
                self.idle_gpu_s += j.gpus * TICK if now - j.last_used >= IDLE_AFTER else 0

    def views(self) -> list[pm.ReplicaView]:
        out = []
        for j in self.jobs.values():
            if j.stop_reason:
                state = pm.ReplicaState.STOPPING
            elif j.draining_since is not None:
                state = pm.ReplicaState.DRAINING
            elif j.ready is not None:
                state = pm.ReplicaState.READY
            elif j.started is not None:
                state = pm.ReplicaState.STARTING
            else:
                state = pm.ReplicaState.PENDING
            out.append(
                pm.ReplicaView(
                    replica_id=j.rid,
                    model=j.model,
                    job_id=j.rid,
                    state=state,
                    submitted_at=j.submitted,
                    gpus_per_node=j.gpus,
                    node_names=(j.on,) if j.on else (),
                    reason="" if j.started is not None else "Resources",
                    started_at=j.started,
                    ready_at=j.ready,
                    last_used=j.last_used,
                    last_report=j.last_used,
                    draining_since=j.draining_since,
                    drain_reason="idle" if j.draining_since is not None else "",
                    stop_reason=j.stop_reason,
                    cluster=j.cluster,
                )
            )
        return out

    def pass_once(self, now: float, new_id: Callable[[], str]) -> None:
        jobs = list(self.jobs.values())
        views = [pm.ClusterView(c.name, c.listing(now, jobs), "llm") for c in self.clusters]
        wanted = {m: now for m in self.held}
        res = pm.plan(
            self.models,
            self.views(),
            (),
            wanted,
            {},
            pm.PlanConfig(default_partition="llm"),
            now,
            new_id,
            held_since={m: min(ts) for m, ts in self.held.items()},
            clusters=views,
        )
        for a in res.actions:
            self.execute(a, now)

    def execute(self, a: pm.Action, now: float) -> None:
        if a.kind is pm.ActionKind.SUBMIT:
            m = self.models[a.model]
            cluster = a.cluster or self.soonest(a, m.resources.gpus, now)
            self.jobs[a.replica_id] = Job(
                a.replica_id, a.model, m.resources.gpus, m.resources.cpus, cluster, now
            )
            return
        j = self.jobs[a.replica_id]
        if a.kind is pm.ActionKind.DRAIN:
            j.draining_since = now
            return
        j.stop_reason, j.stop_at = a.reason, now + (KILL_DELAY if j.started else 0.0)

    def soonest(self, a: pm.Action, gpus: int, now: float) -> str:
        """The daemon's choice among the candidates (its earliest_start), on the fake
        Slurm's estimates."""
        jobs = list(self.jobs.values())
        starts: dict[str, float | str] = {}
        for c in self.clusters:
            if c.name in a.candidates:
                at = c.will_start(now, gpus, jobs)
                starts[c.name] = at if at < math.inf else "refuses"
        return pm.earliest_start(a.candidates, starts, now)[0]


# ---------------------------------------------------------------- the day


def site(seed: int) -> tuple[dict[str, Cluster], dict[str, Any], list[tuple[float, str]]]:
    rng = random.Random(seed)
    clusters = {
        name: Cluster(name, [f"{name}-{i:02d}" for i in range(n)], others(rng, name, n))
        for name, n in CLUSTERS.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "models.yaml"
        path.write_text(catalog_text())
        models = {m.name: m for m in cat.load_catalog(path)}
    return clusters, models, trace(rng, list(models))


def run(
    gateways: list[Gateway], route: Callable[[str], Gateway], arrivals: Any
) -> dict[str, float]:
    ids = iter(range(1, 10**9))
    now, i = 0.0, 0
    while now < HOURS * 3600:
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, model = arrivals[i]
            route(model).request(t, model)
            i += 1
        for g in gateways:
            g.give_up(now)
            g.schedule(now)
            g.pass_once(now, lambda: f"{next(ids):08x}")
            g.count_idle(now)
        now += TICK
    waits = [w for g in gateways for w in g.waits]
    return {
        "requests": len(arrivals),
        "cold_requests": len(waits),
        "cold_wait_p50_s": _pct(waits, 0.50),
        "cold_wait_p95_s": _pct(waits, 0.95),
        # Over every request (one that found a replica ready waited 0): the cold
        # percentiles above are over each setup's own cold requests, and two gateways
        # have more of them (each starts its own replica of a model both publish).
        "wait_mean_s": sum(waits) / len(arrivals) if arrivals else 0.0,
        "waited_over_5m": sum(1 for w in waits if w > 300.0),
        "idle_gpu_hours": sum(g.idle_gpu_s for g in gateways) / 3600.0,
        "replica_starts": sum(g.starts for g in gateways),
        "gave_up": sum(g.gave_up for g in gateways),
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def load_s(j: Job) -> float:
    return 60.0 + 20.0 * j.gpus


def one_gateway(seed: int) -> dict[str, float]:
    clusters, models, arrivals = site(seed)
    g = Gateway(models, list(clusters.values()), load_s)
    return run([g], lambda _m: g, arrivals)


def two_gateways(seed: int) -> dict[str, float]:
    clusters, models, arrivals = site(seed)
    gws = {
        name: Gateway(
            {n: m for n, m in models.items() if m.resources.gpu_type in (None, name)},
            [c],
            load_s,
        )
        for name, c in clusters.items()
    }
    coin = random.Random(seed + 1)

    def route(model: str) -> Gateway:
        # A model only one cluster runs is on its gateway; one both run, on either:
        # each request to one endpoint or the other, as researchers split.
        on = [g for g in gws.values() if model in g.models]
        return on[0] if len(on) == 1 else coin.choice(on)

    return run(list(gws.values()), route, arrivals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=36)
    ap.add_argument("--busy", type=float, default=0.5, help="share of GPUs others hold")
    args = ap.parse_args()
    global BUSY
    BUSY = args.busy
    from bench.common import print_table, result, write

    one = one_gateway(args.seed)
    two = two_gateways(args.seed)
    ref = "two gateways"
    units = {
        "cold_wait_p50_s": "s",
        "cold_wait_p95_s": "s",
        "wait_mean_s": "s",
        "waited_over_5m": "requests",
        "idle_gpu_hours": "GPU-h",
        "replica_starts": "starts",
        "gave_up": "requests",
        "cold_requests": "requests",
    }
    results = [result(f"clusters: {k}", one[k], u, ref, two[k]) for k, u in units.items()]
    print_table(results)
    print(f"\n{int(one['requests'])} requests over {HOURS:g} h on two clusters, seed {args.seed}")
    print(f"written {write('clusters', results, vars(args))}")


if __name__ == "__main__":
    main()
