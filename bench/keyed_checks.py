"""What keys, access rules and quotas cost the gateway per request, in CPU time.

The gateway benchmark (``bench/gateway.py --keyed``) measures the whole
request against the same gateway with them off; on a machine shared with
other work its wall-clock figures swing by more than these checks cost. This
one times the checks themselves, in the process's own CPU time (which other
processes' load disturbs far less than wall time), each over ``--n`` calls:

- ``lookup``: the key ring's check of a presented key (a stat of the key file,
  sha256 of the key, a constant-time compare), as with keys alone;
- ``access``: the catalog's access rule of the model against the key;
- ``admit``: the quota book's check and count of a request (every limit set:
  per-minute requests and tokens, user and account budgets, one stat of the
  budgets file);
- ``headers``: the ``x-ratelimit-*`` headers of the answer;
- ``spent``: counting the answer's tokens.

    python bench/keyed_checks.py [--n 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import median, result, write


def cpu_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Median over ``rounds`` of the CPU microseconds one call of ``fn`` takes."""
    per = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        per.append((time.process_time() - t0) / n * 1e6)
    return median(per)


def main() -> int:
    from prometheus_client import CollectorRegistry

    from llmgw_slurm.access import AccessGuard
    from llmgw_slurm.catalog import Access
    from llmgw_slurm.config import QuotaConfig
    from llmgw_slurm.router.keys import KeyRing, add_key
    from llmgw_slurm.router.quota import AccountBudgets, QuotaBook

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-keyed-") as tmpd:
        tmp = Path(tmpd)
        new = add_key(tmp / "keys.json", "bench", "bench")
        ring = KeyRing(tmp / "keys.json")
        big = 10**12
        book = QuotaBook(QuotaConfig(big, big, big, big, big, big), AccountBudgets(tmp / "q.json"))
        guard = AccessGuard(CollectorRegistry())
        rule = Access(accounts=("bench",), groups=("llm-users",))
        checks: dict[str, Callable[[], object]] = {
            "lookup": lambda: ring.lookup(new.key),
            "access": lambda: guard.allows(rule, new.record),
            "admit": lambda: book.admit(new.record),
            "headers": lambda: book.headers(new.record),
            "spent": lambda: book.spent(new.record, 50),
        }
        took = {name: cpu_us(fn, args.n, args.rounds) for name, fn in checks.items()}
        for name, us in took.items():
            print(f"{name:8s} {us:7.2f} us CPU per request")
        # Each against the key check the gateway made before (keys alone).
        results = [
            result(f"keyed.{n}", us, "us/request", "keyed.lookup", took["lookup"])
            for n, us in took.items()
        ]
        added = sum(us for n, us in took.items() if n != "lookup")
        print(f"access + quotas together: {added:.2f} us CPU per request (beside the key check)")
        # Against the gateway's goal for all it adds: 1 ms at the median.
        results.append(result("keyed.access_and_quotas", added, "us/request", "goal", 1000.0))
    path = write("keyed_checks", results, vars(args))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
