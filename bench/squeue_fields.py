"""What one squeue field costs Slurm: the adapter's listing with EndTime against TimeLeft.

    eval "$(scripts/dev-cluster env)"; python3 bench/squeue_fields.py [--calls 30]

The listing asks for each job's EndTime, not its TimeLeft (so that a running
job's row repeats between passes). This times ``squeue`` with the adapter's
format as it is and with TimeLeft in EndTime's place, alternated, over whatever
the user has queued (and slurmctld still holds), against a bare ``squeue -u``.
"""

from __future__ import annotations

import argparse
import getpass
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, median, print_table, result, write
from llmgw_slurm.slurm import parse


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=30)
    a = ap.parse_args()
    user = getpass.getuser()
    now = parse.format_arg(parse.SQUEUE_FIELDS)
    before = now.replace("EndTime", "TimeLeft")
    base = ["squeue", "--noheader", f"--user={user}", "--states=all"]
    listed = subprocess.run([*base, "-o", "%i"], capture_output=True, text=True, check=True)
    print(machine())
    print(f"{len(listed.stdout.split())} jobs listed with --states=all")
    got: dict[str, list[float]] = {"EndTime": [], "TimeLeft": [], "bare": []}
    for i in range(a.calls):
        pair = (("EndTime", now), ("TimeLeft", before))
        for name, fmt in pair if i % 2 else reversed(pair):
            got[name].append(timed([*base, "--Format=" + fmt]))
        got["bare"].append(timed(["squeue", "-u", user]))
    results = [
        result(
            "squeue, adapter's format with EndTime",
            median(got["EndTime"]),
            "s",
            "the same with TimeLeft",
            median(got["TimeLeft"]),
        ),
        result(
            "squeue, adapter's format with EndTime ",
            median(got["EndTime"]),
            "s",
            "bare squeue -u",
            median(got["bare"]),
        ),
    ]
    print_table(results)
    print(f"wrote {write('squeue_fields', results, vars(a))}")


if __name__ == "__main__":
    main()
