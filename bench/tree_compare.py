"""The same benchmark on two trees of the project, interleaved: this one against a commit.

A change that is meant to keep behaviour and speed (a restructuring) is judged
against the code before it, in the same run: a ``git worktree`` of the commit
is made under /tmp (kept for reruns), and each tree's own benchmark script runs
in turn, ``--rounds`` times each, alternating, so that a burst of load from
elsewhere on the machine falls on both. Each run's figures come from the
results file the script writes in its own tree.

Parts:

- ``plan``: each tree's own ``time_plan`` of ``bench/reconcile_pass.py`` (no
  cluster), every synthetic case of its ``--part plan``: the median ``plan()``
  time per case; the ratio is this tree's over the other's. Timed in CPU time
  of the process (``time.process_time``), not wall time: ``plan()`` is pure
  computation in one thread, and on a shared machine at a load average of 10
  the wall time of the same code moved by 2x between runs.

    python3 bench/tree_compare.py [--part plan] [--against 9f66138] [--rounds 3]

- ``pass`` (the dev cluster: ``eval "$(scripts/dev-cluster env)"``): each
  tree's ``bench/reconcile_pass.py --part pass --no-foreign`` at ``--scale``
  (held jobs: they cost the cluster nothing): per case, the pass's time over a
  bare ``squeue -u`` timed alternately in that run (the script's own ratio),
  so that slurmctld's load at the moment cancels; the ratio compared is this
  tree's over the other's. Each tree's results file is restored afterwards.

Writes ``bench/results/tree_compare_PART.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import result, worktree, write


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


_PLAN_CASES = [(m, r, False) for m in (10, 100, 500) for r in (40, 400, 2000)] + [
    (m, 0, True) for m in (10, 100, 500)
]

# Run in a child with one tree on sys.path: that tree's own plan() and synthetic
# cases, its clock swapped for CPU time.
_PLAN_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
time.perf_counter = time.process_time
import bench.reconcile_pass as rp
out = {}
for m, r, cold in json.loads(sys.argv[2]):
    t, _ = rp.time_plan(m, r, 500, 7, cold=cold)
    label = f"cold start, {m} models, 0 replicas" if cold else f"steady, {m} models, {r} replicas"
    out[f"plan(), {label}, 500 nodes"] = t
print(json.dumps(out))
"""


def _plan_run(tree: Path) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _PLAN_CHILD, str(tree), json.dumps(_PLAN_CASES)],
        cwd=tree,
        env={**_env(), "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: the plan timing failed:\n{proc.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


def _pass_run(tree: Path, scale: float) -> dict[str, float]:
    argv = ["bench/reconcile_pass.py", "--part", "pass", "--no-foreign", "--repeats", "9"]
    proc = subprocess.run(
        [sys.executable, *argv, "--scale", str(scale), "--prefix", "llmgwtree."],
        cwd=tree,
        env={**_env(), "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    results = tree / "bench" / "results" / "reconcile_pass_pass.json"
    try:
        if proc.returncode != 0:
            raise SystemExit(f"{tree}: the pass part failed:\n{proc.stderr[-2000:]}")
        rows = json.loads(results.read_text())["results"]
    finally:
        # The tree's committed figures stay what the docs quote.
        subprocess.run(["git", "-C", str(tree), "checkout", "--", str(results)], check=False)
    return {r["name"]: float(r["ratio"]) for r in rows if "ratio" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("plan", "pass"), default="plan")
    ap.add_argument("--scale", type=float, default=0.1, help="pass: fraction of the jobs")
    ap.add_argument("--against", default="9f66138", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    other = worktree(args.against)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for i in range(args.rounds):
        # Alternating who goes first, so that a burst of load falls on both.
        order = (("other", other), ("this", ROOT))
        for side, tree in order if i % 2 == 0 else order[::-1]:
            runs[side].append(
                _plan_run(tree) if args.part == "plan" else _pass_run(tree, args.scale)
            )
            print(f"round {i + 1}: {side} done", flush=True)
    out = []
    print(f"\n{'case':<62} {'this':>10} {'other':>10} {'ratio':>7}")
    for name in sorted(set(runs["this"][0]) & set(runs["other"][0])):
        mine = statistics.median(r[name] for r in runs["this"] if name in r)
        theirs = statistics.median(r[name] for r in runs["other"] if name in r)
        ratio = mine / theirs if theirs else float("nan")
        print(f"{name:<62} {mine:>10.4f} {theirs:>10.4f} {ratio:>7.3f}")
        unit = "s CPU" if args.part == "plan" else "x bare squeue -u"
        out.append(result(name, mine, unit, f"{args.against}, same run", theirs))
    write(f"tree_compare_{args.part}", out, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
