"""Eviction on a synthetic site: the old policy and this one on the same day of requests.

A site of 64 nodes (three GPU types, nodes of 2, 4 and 8 GPUs, four service
partitions), most of its GPUs held by other users' jobs, and 40 on-demand
models (1 to 8 GPUs, some of one GPU type or partition, two on two nodes),
asked for over 24 simulated hours (a seeded trace, busier by day). The real
``plan()`` runs every 15 simulated seconds with a fake clock against a fake
Slurm that places pending jobs as Slurm would (in submission order, the first
nodes of the job's partition with its GPU type and enough free GPUs and CPUs,
later jobs passing one that does not fit, except on nodes it will fit on once
the jobs being killed there are gone), starts a replica's engine a load
time after its job starts, and frees a cancelled job's GPUs 20 s after the
cancel. A request for a model with no ready replica is held (its client
retries for up to an hour); a ready replica's last use is its last request.

Each policy runs in its own process, ``llmgw_slurm`` imported from its
checkout: the old one from a ``git worktree`` of main before issue 15
(a60312a, made here if missing), the new one from this checkout. Reported, new
against old: evictions that did not lead to a placement (the model they were
made for did not start on a node they freed within 30 minutes), evictions per
hour, a cold request's wait until its model serves (p50, p95; a request that
gave up after an hour counts as an hour), and idle GPU-hours (GPUs of ready
replicas unused for 5 minutes or more).

    python3 bench/eviction_site.py [--old /tmp/old-policy] [--seed 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "a60312a"
HOURS = 24.0
TICK = 15.0  # the pass interval, simulated seconds
KILL_DELAY = 20.0  # a cancelled job holds its GPUs this long (the agent drains, Slurm ends it)
GIVE_UP = 3600.0  # a held request's client retries this long
IDLE_AFTER = 300.0  # unused this long: the GPUs count as idle
USEFUL_WITHIN = 1800.0
VERBOSE = False


def say(what: str) -> None:
    if VERBOSE:
        print(what, file=sys.stderr)


# ---------------------------------------------------------------- the site and its trace


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpu_type: str
    gpus: int
    cpus: int
    partitions: tuple[str, ...]
    # GPUs and CPUs held all day by other users' jobs.
    busy_gpus: int
    busy_cpus: int


def site_nodes(rng: random.Random) -> list[NodeSpec]:
    """64 nodes: 24 l40s x2 (small), 24 a100 x4 (mid), 16 h100 x8 (big); all in `all`."""
    out = []
    for kind, count, gpus, part in (
        ("l40s", 24, 2, "small"),
        ("a100", 24, 4, "mid"),
        ("h100", 16, 8, "big"),
    ):
        for i in range(count):
            # Other users hold all of most nodes, half of some; a quarter are theirs to share.
            busy = rng.choices((gpus, gpus // 2, 0), weights=(70, 15, 15))[0]
            cpus = 16 * gpus
            out.append(
                NodeSpec(f"{kind}-{i:02d}", kind, gpus, cpus, ("all", part), busy, busy * 16)
            )
    return out


def site_catalog() -> str:
    """40 on-demand models: (name, gpus, nodes, gpu type, partition)."""
    kinds: list[tuple[str, int, int, str, str]] = []
    kinds += [(f"any1-{i}", 1, 1, "", "all") for i in range(12)]
    kinds += [(f"any4-{i}", 4, 1, "", "all") for i in range(4)]
    kinds += [(f"l40s-{i}", 1 + i % 2, 1, "l40s", "small") for i in range(6)]
    kinds += [(f"a100-{i}", 2 + 2 * (i % 2), 1, "a100", "mid") for i in range(8)]
    kinds += [(f"h100-{i}", 4 + 4 * (i % 2), 1, "h100", "big") for i in range(8)]
    kinds += [(f"wide-{i}", 8, 2, "h100", "big") for i in range(2)]
    lines = ["models:"]
    for name, gpus, nodes, gtype, part in kinds:
        res = f"gpus: {gpus}, nodes: {nodes}, cpus: {4 * gpus}, partition: {part}"
        if gtype:
            res += f", gpu_type: {gtype}"
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
            t += rng.expovariate(rate)  # thinned below to the day's curve
            if t >= HOURS * 3600:
                break
            day = 0.55 + 0.45 * math.sin((t / 3600.0 - 8.0) / 24.0 * 2 * math.pi)
            if rng.random() < day:
                out.append((t, name))
    out.sort()
    return out


# ---------------------------------------------------------------- the fake Slurm


@dataclass
class SimJob:
    rid: str
    model: str
    gpus: int
    cpus: int
    nodes: int
    submitted: float
    replaces: str = ""
    started: float | None = None
    on: tuple[str, ...] = ()
    ready: float | None = None
    last_used: float | None = None
    draining_since: float | None = None
    stop_reason: str = ""
    stop_at: float | None = None


@dataclass
class Sim:
    """The fake cluster, the held requests and the figures, for one policy."""

    nodes: list[NodeSpec]
    models: Mapping[str, Any]
    load_s: Callable[[SimJob], float]
    jobs: dict[str, SimJob] = field(default_factory=dict)
    held: dict[str, list[float]] = field(default_factory=dict)  # model -> arrivals waiting
    waits: list[float] = field(default_factory=list)
    gave_up: int = 0
    evictions: list[tuple[float, str, tuple[str, ...]]] = field(default_factory=list)
    starts: list[tuple[float, str, tuple[str, ...]]] = field(default_factory=list)
    idle_gpu_s: float = 0.0

    def used(self) -> tuple[dict[str, int], dict[str, int]]:
        gpus = {n.name: n.busy_gpus for n in self.nodes}
        cpus = {n.name: n.busy_cpus for n in self.nodes}
        for j in self.jobs.values():
            for n in j.on:
                gpus[n] += j.gpus
                cpus[n] += j.cpus
        return gpus, cpus

    def schedule(self, now: float, cfg: Any) -> None:
        """Slurm's part: end killed jobs, start pending ones in submission order where they
        fit. One that does not fit now but will once the jobs being killed are gone holds
        those nodes (backfill reserves them: those jobs end within seconds), so a later
        job does not take them."""
        for rid in [r for r, j in self.jobs.items() if j.stop_at is not None and j.stop_at <= now]:
            del self.jobs[rid]
        gpus, cpus = self.used()
        soon: dict[str, int] = {}  # GPUs of jobs being killed, per node
        for j in self.jobs.values():
            for n in j.on if j.stop_reason else ():
                soon[n] = soon.get(n, 0) + j.gpus
        for j in sorted(self.jobs.values(), key=lambda j: j.submitted):
            if j.started is not None or j.stop_reason:
                continue
            good = self._nodes_for(j, gpus, cpus, {}, cfg)
            if good:
                j.started, j.on = now, good
                self.starts.append((now, j.model, j.on))
            else:
                good = self._nodes_for(j, gpus, cpus, soon, cfg)
            for n in good:
                gpus[n] += j.gpus
                cpus[n] += j.cpus
        for j in self.jobs.values():
            if j.started is not None and j.ready is None and now >= j.started + self.load_s(j):
                j.ready = j.last_used = now
                self._served(j.model, now)

    def _nodes_for(
        self,
        j: SimJob,
        gpus: Mapping[str, int],
        cpus: Mapping[str, int],
        soon: Mapping[str, int],
        cfg: Any,
    ) -> tuple[str, ...]:
        """The first nodes of the job's partition and GPU type with room for it, or ()."""
        m = self.models[j.model]
        part = m.resources.partition or cfg.default_partition
        gtype = m.resources.gpu_type or ""
        good = [
            n.name
            for n in self.nodes
            if part in n.partitions
            and (not gtype or n.gpu_type == gtype)
            and n.gpus - gpus[n.name] + soon.get(n.name, 0) >= j.gpus
            and n.cpus - cpus[n.name] >= j.cpus
        ][: j.nodes]
        return tuple(good) if len(good) == j.nodes else ()

    def _served(self, model: str, now: float) -> None:
        for t in self.held.pop(model, []):
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
            if len(ts) > len(keep):
                say(f"gave up: {now:.0f} s, {len(ts) - len(keep)} request(s) for {model}")
            self.waits += [GIVE_UP] * (len(ts) - len(keep))
            if keep:
                self.held[model] = keep
            else:
                del self.held[model]

    def count_idle(self, now: float) -> None:
        for j in self.jobs.values():
            used = j.last_used
            if j.ready is not None and not j.stop_reason and used is not None:
                self.idle_gpu_s += j.gpus * j.nodes * TICK if now - used >= IDLE_AFTER else 0


# ---------------------------------------------------------------- the plan, either policy's


def views(sim: Sim, pm: Any, has_node_names: bool) -> list[Any]:
    """The jobs as the policy's ReplicaView (the old one has no node_names)."""
    out = []
    for j in sim.jobs.values():
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
        kw: dict[str, Any] = {}
        if has_node_names:
            kw["node_names"] = j.on
        out.append(
            pm.ReplicaView(
                replica_id=j.rid,
                model=j.model,
                job_id=j.rid,
                state=state,
                submitted_at=j.submitted,
                gpus_per_node=j.gpus,
                nodes=j.nodes,
                reason="" if j.started is not None else "Resources",
                started_at=j.started,
                ready_at=j.ready,
                last_used=j.last_used,
                draining_since=j.draining_since,
                drain_reason="idle" if j.draining_since is not None else "",
                replaces=j.replaces,
                stop_reason=j.stop_reason,
                **kw,
            )
        )
    return out


def listing(sim: Sim, types: Any) -> list[Any]:
    gpus, cpus = sim.used()
    return [
        types.NodeInfo(
            name=n.name,
            state="mixed" if gpus[n.name] else "idle",
            partitions=n.partitions,
            cpus_total=n.cpus,
            cpus_alloc=cpus[n.name],
            memory_mb=512_000,
            gpus=(types.GpuCount(n.gpu_type, n.gpus, gpus[n.name]),),
        )
        for n in sim.nodes
    ]


def execute(sim: Sim, res: Any, pm: Any, now: float) -> None:
    for a in res.actions:
        if a.kind is pm.ActionKind.SUBMIT:
            m = sim.models[a.model]
            sim.jobs[a.replica_id] = SimJob(
                a.replica_id,
                a.model,
                m.resources.gpus,
                m.resources.cpus,
                m.resources.nodes,
                now,
                replaces=a.replaces,
            )
            continue
        j = sim.jobs[a.replica_id]
        if a.kind is pm.ActionKind.DRAIN:
            j.draining_since = now
            continue
        j.stop_reason, j.stop_at = a.reason, now + KILL_DELAY
        if j.started is None:
            j.stop_at = now  # a pending job leaves at once
        if a.kind is pm.ActionKind.EVICT:
            sim.evictions.append((now, str(a.attrs["for"]), j.on))


def run_policy(seed: int) -> dict[str, float]:
    """One day on the site with the ``llmgw_slurm`` this process imports."""
    from llmgw_slurm import catalog as cat
    from llmgw_slurm.reconciler import plan as pm
    from llmgw_slurm.slurm import types

    rng = random.Random(seed)
    nodes = site_nodes(rng)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "models.yaml"
        path.write_text(site_catalog())
        models = {m.name: m for m in cat.load_catalog(path)}
    arrivals = trace(rng, list(models))
    cfg = pm.PlanConfig(default_partition="all")
    has_node_names = "node_names" in {f.name for f in dataclasses.fields(pm.ReplicaView)}
    has_held = "held_since" in inspect.signature(pm.plan).parameters
    sim = Sim(nodes, models, lambda j: 60.0 + 20.0 * j.gpus * j.nodes)
    ids = iter(range(1, 10**9))
    now, i = 0.0, 0
    while now < HOURS * 3600:
        while i < len(arrivals) and arrivals[i][0] <= now:
            sim.request(*arrivals[i])
            i += 1
        sim.give_up(now)
        sim.schedule(now, cfg)
        # A held request's client retries until it gives up: the model stays wanted.
        wanted = {m: now for m in sim.held}
        kw = {"held_since": {m: min(ts) for m, ts in sim.held.items()}} if has_held else {}
        res = pm.plan(
            models,
            views(sim, pm, has_node_names),
            listing(sim, types),
            wanted,
            {},
            cfg,
            now,
            lambda: f"{next(ids):08x}",
            **kw,
        )
        execute(sim, res, pm, now)
        sim.count_idle(now)
        now += TICK
    return figures(sim, len(arrivals))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def figures(sim: Sim, requests: int) -> dict[str, float]:
    useless = 0
    for t, model, freed in sim.evictions:
        if not any(
            m == model and t <= ts <= t + USEFUL_WITHIN and set(on) & set(freed)
            for ts, m, on in sim.starts
        ):
            useless += 1
            say(f"no placement: eviction at {t:.0f} s for {model} freed {','.join(freed)}")
    return {
        "requests": requests,
        "cold_requests": len(sim.waits),
        "gave_up": sim.gave_up,
        "evictions": len(sim.evictions),
        "evictions_without_placement": useless,
        "evictions_per_hour": len(sim.evictions) / HOURS,
        "cold_wait_p50_s": _pct(sim.waits, 0.50),
        "cold_wait_p95_s": _pct(sim.waits, 0.95),
        "idle_gpu_hours": sim.idle_gpu_s / 3600.0,
        "replica_starts": len(sim.starts),
    }


# ---------------------------------------------------------------- the two processes


def old_checkout(path: Path) -> Path:
    """The old policy's checkout: a git worktree of main before issue 15 (made if missing)."""
    if not (path / "llmgw_slurm" / "reconciler" / "plan.py").exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), OLD_COMMIT],
            check=True,
        )
    return path


def in_process(root: Path, seed: int, verbose: bool) -> dict[str, float]:
    """run_policy in a child whose ``llmgw_slurm`` is the one under ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, __file__, "--child", "--seed", str(seed), "--root", str(root)]
    if verbose:
        argv.append("--verbose")
        print(f"--- {root}", file=sys.stderr)
    out = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--old", type=Path, default=Path("/tmp/old-policy"))
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--verbose", action="store_true", help="name each miss and give-up")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        global VERBOSE
        VERBOSE = args.verbose
        import llmgw_slurm

        # The policy under test, not an installed copy: say which one ran.
        got = Path(llmgw_slurm.__file__).resolve().parents[1]
        if args.root is not None and got != args.root.resolve():
            sys.exit(f"imported llmgw_slurm from {got}, not {args.root}")
        print(json.dumps(run_policy(args.seed)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.common import print_table, result, write

    old = in_process(old_checkout(args.old), args.seed, args.verbose)
    new = in_process(ROOT, args.seed, args.verbose)
    ref = f"old policy ({OLD_COMMIT})"
    units = {
        "evictions_without_placement": "evictions",
        "evictions_per_hour": "1/h",
        "cold_wait_p50_s": "s",
        "cold_wait_p95_s": "s",
        "idle_gpu_hours": "GPU-h",
        "evictions": "evictions",
        "gave_up": "requests",
        "cold_requests": "requests",
        "replica_starts": "starts",
    }
    results = [result(f"site: {k}", new[k], u, ref, old[k]) for k, u in units.items()]
    print_table(results)
    print(f"\n{int(new['requests'])} requests over {HOURS:g} h, seed {args.seed}")
    print(f"written {write('eviction_site', results, vars(args))}")


if __name__ == "__main__":
    main()
