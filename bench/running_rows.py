"""A reconcile pass's Python cost over running replicas, compared between trees.

    python3 bench/running_rows.py [--replicas 100,2000] [--passes 15] [--rounds 3] TREE [TREE ...]

Each TREE is a checkout of llmgw-slurm (for example one made with ``git worktree
add /tmp/old <commit>``); the first is the reference. For each tree, in a process
of its own that imports that tree, the daemon's ``Reconciler`` runs passes over
N running replicas listed by a synthetic ``squeue`` output in the tree's own
format, through the tree's own row cache, while each pass moves the clock 10 s.
No Slurm is involved (the listing is Slurm's work, not the pass's), and the
backend refuses any action, so only observing and planning are timed. Rounds
alternate the trees; medians of each tree's pass times are printed with their
ratio to the reference's.

Why: a listing whose running rows change every pass (a ``TimeLeft`` column)
defeats the row cache and the kept views for every running replica; held jobs
(what ``reconcile_pass.py`` lists, as the cluster here cannot run 2,000 jobs)
do not show it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]


def child(tree: str, n: int, passes: int) -> None:
    sys.path.insert(0, tree)
    from bench.reconcile_pass import Group, catalog_yaml, load_yaml_catalog, server_config
    from llmgw_slurm.reconciler.core import Reconciler
    from llmgw_slurm.slurm import parse
    from llmgw_slurm.slurm.types import GpuCount, NodeInfo

    fields = parse.SQUEUE_FIELDS
    g = Group("llmgwrows.", [f"m{i:03d}" for i in range(max(1, n // 20))], 20, 0x30000000)
    start = datetime.now().replace(microsecond=0) - timedelta(seconds=10)
    clock = [0]

    def left(s: int) -> str:
        d, s = divmod(s, 86400)
        h, s = divmod(s, 3600)
        m, s = divmod(s, 60)
        return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h}:{m:02d}:{s:02d}"

    def listing() -> str:
        out = []
        for i, name in enumerate(g.names()):
            row = {
                "JobID": str(100_000 + i),
                "HetJobID": "N/A",
                "HetJobOffset": "N/A",
                "Name": name,
                "State": "RUNNING",
                "Reason": "None",
                "NodeList": f"n{i % 500}",
                "NumNodes": "1",
                "Partition": "llm",
                "tres-per-node": "gres:gpu:a100:1",
                "TimeLimit": "8:00:00",
                "TimeLeft": left(8 * 3600 - 10 - clock[0]),
                "EndTime": (start + timedelta(hours=8)).isoformat(),
                "StartTime": start.isoformat(),
                "SubmitTime": start.isoformat(),
                "RestartCnt": "0",
                "UserName": "root",
                "ArrayJobID": str(100_000 + i),
                "Comment": "(null)",
            }
            out.append(parse.SEP.join(row[f] for f in fields) + parse.SEP)
        return "\n".join(out) + "\n"

    class Backend:
        user = "root"

        def __init__(self) -> None:
            self.cache = parse.SqueueCache()
            gpus = (GpuCount("a100", 8, 4),)
            self.nodes = [
                NodeInfo(f"n{i}", "mixed", ("llm",), 64, 8, 512_000, gpus) for i in range(500)
            ]
            self.raw = listing()

        async def list_jobs(self, name_prefix: str = "") -> list[Any]:
            return parse.parse_squeue(self.raw, name_prefix, self.cache)

        async def list_nodes(self, partition: str = "") -> list[Any]:
            return self.nodes

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"this benchmark takes no action, yet {name} was called")

    async def run() -> None:
        backend = Backend()
        mins = {m: g.per_model for m in g.models}
        rec = Reconciler(
            load_yaml_catalog(catalog_yaml(g.models, mins)),
            server_config(g.prefix, Path(tempfile.mkdtemp())),
            backend,  # type: ignore[arg-type]
            b"k" * 32,
            "http://127.0.0.1:1",
        )
        await rec.pass_once()
        times = []
        for _ in range(passes):
            clock[0] += 10
            backend.raw = listing()  # not timed: that is squeue's output
            t0 = time.perf_counter()
            await rec.pass_once()
            times.append(time.perf_counter() - t0)
        assert len(rec.replicas) == len(g.names())
        times.sort()
        print(times[len(times) // 2])

    asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trees", nargs="+", help="checkouts to compare; the first is the reference")
    ap.add_argument("--replicas", default="100,2000")
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    for tree in a.trees:
        if (
            not (Path(tree) / "llmgw_slurm").is_dir()
            or not (Path(tree) / "bench" / "reconcile_pass.py").is_file()
        ):
            ap.error(f"{tree}: not a checkout of llmgw-slurm (no llmgw_slurm/ or bench/)")
    sys.path.insert(0, str(HERE))
    from bench.common import machine, median, print_table, result, write

    print(machine())
    results = []
    for n in [int(x) for x in a.replicas.split(",")]:
        got: dict[str, list[float]] = {t: [] for t in a.trees}
        for k in range(a.rounds):
            order = a.trees if k % 2 == 0 else list(reversed(a.trees))
            for tree in order:
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", tree, str(n), str(a.passes)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode != 0:
                    sys.exit(f"running_rows: the pass in {tree} failed:\n{proc.stderr[-2000:]}")
                got[tree].append(float(proc.stdout.split()[-1]))
        ref = median(got[a.trees[0]])
        for tree in a.trees[1:]:
            results.append(
                result(
                    f"pass, {n} running: {Path(tree).name}",
                    median(got[tree]),
                    "s",
                    f"{Path(a.trees[0]).name}",
                    ref,
                )
            )
        if len(a.trees) == 1:
            results.append(result(f"pass, {n} running", ref, "s", "", 0))
    print_table(results)
    print(f"wrote {write('running_rows', results, vars(a))}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
