"""The same benchmark on two trees of the project, interleaved: this one against a commit.

A change that is meant to keep behaviour and speed (a restructuring) is judged
against the code before it, in the same run: a ``git worktree`` of the commit
is made under /tmp (kept for reruns), and each tree's own benchmark script runs
in turn, ``--rounds`` times each, alternating, so that a burst of load from
elsewhere on the machine falls on both. Each run's figures come from the
results file the script writes in its own tree.

Parts:

- ``plan``: ``bench/reconcile_pass.py --part plan`` (no cluster): the median
  ``plan()`` time per synthetic case; the ratio is this tree's over the other's.

    python3 bench/tree_compare.py [--part plan] [--against 9f66138] [--rounds 3]

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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import result, write


def worktree(commit: str) -> Path:
    path = Path("/tmp") / f"llmgw-tree-{commit[:12]}"
    if not (path / "llmgw_slurm").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), commit],
            check=True,
            capture_output=True,
        )
    return path


def _run(tree: Path, argv: list[str], results: str) -> list[dict[str, Any]]:
    env_path = str(tree)
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=tree,
        env={**_env(), "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"{tree}: {' '.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    data = json.loads((tree / "bench" / "results" / results).read_text())
    rows = data["results"] if isinstance(data, dict) else data
    return list(rows)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _plan_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {
        r["name"]: float(r["value"]) for r in rows if str(r.get("name", "")).startswith("plan()")
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("plan",), default="plan")
    ap.add_argument("--against", default="9f66138", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    other = worktree(args.against)
    argv, results, figures = (
        ["bench/reconcile_pass.py", "--part", "plan", "--repeats", "7"],
        "reconcile_pass_plan.json",
        _plan_figures,
    )
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for i in range(args.rounds):
        for side, tree in (
            (("other", other), ("this", ROOT))
            if i % 2 == 0
            else (
                ("this", ROOT),
                ("other", other),
            )
        ):
            runs[side].append(figures(_run(tree, argv, results)))
            print(f"round {i + 1}: {side} done", flush=True)
    subprocess.run(
        ["git", "-C", str(ROOT), "checkout", "--", f"bench/results/{results}"], check=False
    )
    out = []
    print(f"\n{'case':<62} {'this':>10} {'other':>10} {'ratio':>7}")
    for name in sorted(set(runs["this"][0]) & set(runs["other"][0])):
        mine = statistics.median(r[name] for r in runs["this"] if name in r)
        theirs = statistics.median(r[name] for r in runs["other"] if name in r)
        ratio = mine / theirs if theirs else float("nan")
        print(f"{name:<62} {mine:>10.4f} {theirs:>10.4f} {ratio:>7.3f}")
        out.append(result(name, mine, "s", f"{args.against}, same run", theirs))
    write(f"tree_compare_{args.part}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
