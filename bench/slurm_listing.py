"""Cost of the adapter's one-call job listing against a bare ``squeue``.

With 0, 100 and 2,000 of the service's jobs queued (held, so they cost the
cluster nothing), times ``list_jobs(prefix)`` of every backend that works here
(the CLI always; pyslurm on a Slurm 25.11 cluster where it imports; rest where
the cluster runs slurmrestd) and a bare ``squeue -u USER`` in the same run,
alternating, and prints medians and the ratio. The rest backend is timed
twice: asking for every job at each listing, as on a cluster where some job
always changed since the last pass, and with ``update_time``, its default,
which on a queue where nothing changed gets slurmctld's "no change". Needs
the dev cluster: ``eval "$(scripts/dev-cluster env)"`` (or
``LLMGW_SLURM=25.11 scripts/dev-cluster env`` for every backend).

    python3 bench/slurm_listing.py [--repeats 15] [--backends cli,pyslurm,rest]
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import median, print_table, result, write
from llmgw_slurm.base.errors import SlurmUnavailable
from llmgw_slurm.slurm import BACKENDS, JobSpec, SlurmBackend, make_backend
from llmgw_slurm.slurm.cli import CliBackend

PREFIX = "llmgwbench."


async def fill(backend: CliBackend, have: int, want: int) -> list[str]:
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> str:
        async with sem:
            return await backend.submit(
                JobSpec(
                    name=f"{PREFIX}bench.{i:08x}",
                    script="#!/bin/bash\n#SBATCH --partition=llm\n#SBATCH --hold\ntrue\n",
                )
            )

    return list(await asyncio.gather(*(one(i) for i in range(have, want))))


async def bare_squeue() -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "squeue", "-u", getpass.getuser(), stdout=asyncio.subprocess.DEVNULL
    )
    await proc.wait()
    return time.perf_counter() - t0


def rest_options() -> dict[str, str]:
    """The cluster's slurmrestd, as `scripts/dev-cluster env` exports it."""
    url, key = os.environ.get("LLMGW_DEV_RESTD_URL"), os.environ.get("LLMGW_DEV_JWT_KEY")
    return {"url": url, "jwt_key": key} if url and key else {}


async def make_listers(kinds: list[str]) -> dict[str, SlurmBackend]:
    """Each backend by the label its figures get; rest twice (every job, update_time)."""
    out: dict[str, SlurmBackend] = {}
    for kind in kinds:
        if kind != "rest":
            try:
                out[kind] = make_backend(kind, timeout=120)
            except SlurmUnavailable as exc:
                print(f"{kind}: skipped ({exc})")
            continue
        if not rest_options():
            print("rest: skipped (no LLMGW_DEV_RESTD_URL: not a 25.11 cluster with slurmrestd)")
            continue
        for label, incremental in (("rest, every job", False), ("rest, update_time", True)):
            b = make_backend("rest", timeout=120, incremental=incremental, **rest_options())
            await b.check()  # the version check is once per daemon, not per listing
            out[label] = b
    return out


async def adapter(backend: SlurmBackend, expect: int) -> float:
    t0 = time.perf_counter()
    jobs = [j for j in await backend.list_jobs(PREFIX) if j.state.is_active]
    dt = time.perf_counter() - t0
    assert len(jobs) == expect, (len(jobs), expect)
    return dt


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    args = ap.parse_args()
    backend = CliBackend(timeout=120)
    listers = await make_listers(args.backends.split(","))
    stale = [j.job_id for j in await backend.list_jobs(PREFIX)]
    if stale:
        subprocess.run(["scancel", *stale], check=False)
        await asyncio.sleep(1)
    ids: list[str] = []
    results = []
    try:
        for n in (0, 100, 2000):
            ids += await fill(backend, len(ids), n)
            ours: dict[str, list[float]] = {kind: [] for kind in listers}
            bare = []
            for _ in range(args.repeats):
                for kind, lister in listers.items():
                    ours[kind].append(await adapter(lister, n))
                bare.append(await bare_squeue())
            for kind in listers:
                results.append(
                    result(
                        f"list_jobs ({kind}), {n} service jobs queued",
                        median(ours[kind]),
                        "s",
                        "bare squeue -u",
                        median(bare),
                    )
                )
    finally:
        for i in range(0, len(ids), 500):
            subprocess.run(["scancel", *ids[i : i + 500]], check=False)
        for lister in listers.values():
            await lister.close()
    print_table(results)
    path = write("slurm_listing", results, {**vars(args), "jobs_queued": [0, 100, 2000]})
    print(f"\nwritten {path}")
    print(json.dumps([r["ratio"] for r in results]))


if __name__ == "__main__":
    asyncio.run(main())
