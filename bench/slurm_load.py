"""Commands per minute the daemon sends to Slurm at steady state, against per-job polling.

With 0, 10 and 100 replicas (HELD jobs named as the reconciler names them, and
a catalog whose ``min`` equals them, so nothing changes), runs the
Reconciler's own loop (``Reconciler.run``) for ``--duration`` seconds at an
interval of ``--interval`` (1 s: the default 10 s would take ten times as
long for the same number of passes) and counts the commands it runs. The
reference is what a naive sbatch-script manager does: one ``squeue -j ID`` per
replica per interval, run one after the other, for the same time.

Both are reported as measured (commands per minute at the benchmark's
interval), and scaled to the default ``reconcile.interval`` of 10 s (commands
per interval x 6). The nodes' listing is due every sixth pass, as at the
defaults (``nodes_max_age`` 60 s), whatever ``--interval``. slurmctld's CPU
time over each window is read from /proc when slurmctld runs on this machine;
on the shared dev cluster it includes whatever else runs, so it is indicative
only.

    python3 bench/slurm_load.py [--duration 60] [--interval 1] [--sizes 0,10,100]

``--sizes 0,10`` is the small run: on a shared cluster, 11 held jobs instead
of 110.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, print_table, result, write
from bench.reconcile_pass import cancel, catalog_yaml, load_yaml_catalog, submit_held
from llmgw_slurm.config import ReconcileConfig, ServerConfig, SlurmConfig
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.slurm.cli import CliBackend

PREFIX = "llmgwload."
DEFAULT_INTERVAL = 10.0  # ReconcileConfig.interval's default
DEFAULT_NODES_MAX_AGE = 60.0  # ReconcileConfig.nodes_max_age's default


def slurmctld_cpu() -> float | None:
    """slurmctld's user+system CPU seconds so far, or None when it is not local."""
    out = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=False
    ).stdout
    pidfile = next(
        (
            ln.split("=", 1)[1].strip()
            for ln in out.splitlines()
            if ln.startswith("SlurmctldPidFile")
        ),
        "",
    )
    try:
        pid = Path(pidfile).read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields 14 and 15 of stat (utime, stime), counted after the ")" that ends the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def daemon_window(
    backend: CliBackend, mins: dict[str, int], expect: int, interval: float, duration: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llmgwload-") as tmp:
        server = ServerConfig(
            slurm=SlurmConfig(partition="llm", job_prefix=PREFIX),
            state_dir=Path(tmp),
            # The nodes are due as often, in passes, as at the defaults (every sixth
            # pass), so that commands per pass scale to the default interval.
            reconcile=ReconcileConfig(
                interval=interval,
                nodes_max_age=interval * DEFAULT_NODES_MAX_AGE / DEFAULT_INTERVAL,
                max_pending_time=None,
            ),
        )
        catalog = load_yaml_catalog(catalog_yaml(sorted(mins), mins))
        rec = Reconciler(catalog, server, backend, b"k" * 32, "http://127.0.0.1:1")
        await rec.pass_once()  # adopt the jobs: the steady state starts after this
        if len(rec.replicas) != expect:
            raise SystemExit(f"adopted {len(rec.replicas)} replicas, expected {expect}")
        before = dict(backend.call_counts)
        passes0 = rec.passes
        cpu0 = slurmctld_cpu()
        stop = asyncio.Event()
        t0 = time.perf_counter()
        task = asyncio.create_task(rec.run(stop))
        await asyncio.sleep(duration)
        stop.set()
        await task
        elapsed = time.perf_counter() - t0
        cpu1 = slurmctld_cpu()
    calls = {k: v - before.get(k, 0) for k, v in backend.call_counts.items()}
    calls = {k: v for k, v in calls.items() if v}
    changed = calls.get("sbatch", 0) + calls.get("scancel", 0)
    return {
        "commands": sum(calls.values()),
        "by_command": calls,
        "passes": rec.passes - passes0,
        "elapsed": elapsed,
        "ctld_cpu": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        "changed": changed,
    }


async def naive_window(ids: list[str], interval: float, duration: float) -> dict[str, Any]:
    """One ``squeue -j ID`` per job per interval, one after the other, as a shell loop would."""
    commands = 0
    rounds = 0
    cpu0 = slurmctld_cpu()
    t0 = time.perf_counter()
    next_round = t0
    while time.perf_counter() - t0 < duration:
        for jid in ids:
            proc = await asyncio.create_subprocess_exec(
                "squeue", "-h", "-j", jid, stdout=asyncio.subprocess.DEVNULL
            )
            await proc.wait()
            commands += 1
        rounds += 1
        next_round += interval
        await asyncio.sleep(max(0.0, min(next_round, t0 + duration) - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    cpu1 = slurmctld_cpu()
    return {
        "commands": commands,
        "rounds": rounds,
        "elapsed": elapsed,
        "ctld_cpu": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per window")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
    ap.add_argument(
        "--sizes",
        default="0,10,100",
        help="replica counts, multiples of 10, comma-separated (default 0,10,100)",
    )
    args = ap.parse_args()
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",")})
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: expected counts such as 0,10,100")
    if any(n < 0 or n % 10 for n in sizes):
        ap.error(f"--sizes {args.sizes!r}: each count is 0 or a positive multiple of 10")
    print(machine())
    backend = CliBackend(timeout=120)
    stale = [j.job_id for j in await backend.list_jobs(PREFIX)]
    if stale:
        cancel(stale)
        await asyncio.sleep(2)
    ids: list[str] = []
    results: list[dict[str, Any]] = []
    rows = []
    try:
        for n in sizes:
            # Ten replicas per model (one model for 0: on demand, nothing running).
            per_model = 10
            models = [f"m{i:02d}" for i in range(n // per_model)] or ["m00"]
            mins = {m: per_model if n else 0 for m in models}
            names = [
                f"{PREFIX}{m}.{k * 4096 + j:08x}"
                for k, m in enumerate(models)
                for j in range(n and per_model)
            ]
            ids += await submit_held(backend, names[len(ids) :])
            d = await daemon_window(backend, mins, n, args.interval, args.duration)
            nv = await naive_window(ids, args.interval, args.duration)
            d_min = d["commands"] / d["elapsed"] * 60
            n_min = nv["commands"] / nv["elapsed"] * 60
            per_pass = d["commands"] / max(1, d["passes"])
            d_default = per_pass * 60 / DEFAULT_INTERVAL
            n_default = n * 60 / DEFAULT_INTERVAL
            check = "OK" if d["changed"] == 0 else "FAILED"
            print(
                f"{n:>4} replicas: daemon {d['commands']} commands in {d['elapsed']:.0f}s "
                f"({d['passes']} passes, {d['by_command']}) = {d_min:.0f}/min; "
                f"per-job loop {nv['commands']} in {nv['elapsed']:.0f}s "
                f"({nv['rounds']} rounds) = {n_min:.0f}/min; "
                f"check {check}: nothing submitted or cancelled",
                flush=True,
            )
            rows.append((n, d, nv, d_min, n_min, d_default, n_default))
            results.append(
                result(
                    f"daemon commands/min, {n} replicas, {args.interval:g}s",
                    d_min,
                    "1/min",
                    "per-job squeue loop",
                    n_min,
                )
                | {
                    "passes": d["passes"],
                    "by_command": d["by_command"],
                    "slurmctld_cpu_s": d["ctld_cpu"],
                    "reference_slurmctld_cpu_s": nv["ctld_cpu"],
                    "reference_rounds": nv["rounds"],
                }
            )
            results.append(
                result(
                    f"daemon commands/min, {n} replicas, 10s (scaled)",
                    d_default,
                    "1/min",
                    "per-job squeue loop",
                    n_default,
                )
            )
    finally:
        cancel(ids)
    print()
    print(
        f"{'replicas':>8} {'daemon/min':>10} {'loop/min':>9} {'loop/daemon':>11} "
        f"{'@10s daemon':>11} {'@10s loop':>9} {'ctld cpu s d/l':>15}"
    )
    for n, d, nv, d_min, n_min, d_def, n_def in rows:
        cpu = (
            f"{d['ctld_cpu']:.1f}/{nv['ctld_cpu']:.1f}"
            if d["ctld_cpu"] is not None and nv["ctld_cpu"] is not None
            else "-"
        )
        print(
            f"{n:>8} {d_min:>10.0f} {n_min:>9.0f} {n_min / d_min:>11.2f} "
            f"{d_def:>11.0f} {n_def:>9.0f} {cpu:>15}"
        )
    print()
    print_table(results)
    path = write("slurm_load", results, vars(args))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    asyncio.run(main())
