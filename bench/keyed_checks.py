"""What keys, access rules and quotas cost the gateway per request, in CPU time.

The gateway benchmark (``bench/gateway.py --keyed``) measures the whole
request against the same gateway with them off; on a machine shared with
other work its wall-clock figures swing by more than these checks cost. This
one times the checks themselves, in the process's own CPU time (which other
processes' load disturbs far less than wall time), each over ``--n`` calls:

- ``lookup``: the key ring's check of a presented key (a stat of the key file,
  sha256 of the key, a constant-time compare), as with keys alone;
- ``access``: the catalog's access rule of the model against the key;
- ``ask``: what a chat request may spend, from its body (its prompt
  estimated from about 1 KB of text, its ``max_tokens``);
- ``reserve``: the quota book's check of that against every limit (per-minute
  requests and tokens, user and account budgets, one stat of the budgets
  file), the request counted and its maximum held, and the ``x-ratelimit-*``
  headers of its answer worked out;
- ``settle``: the answer's real count in place of what was held.

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

    from llmgw_slurm.accounting.quota import AccountBudgets, QuotaBook, Reservation, ask_of
    from llmgw_slurm.auth.access import AccessGuard
    from llmgw_slurm.auth.keys import KeyRing, add_key
    from llmgw_slurm.catalog import Access
    from llmgw_slurm.config import QuotaConfig

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
        words = " ".join(["token"] * 170)  # about 1 KB of prompt
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": words},
            ],
            "max_tokens": 200,
        }
        ask = ask_of(body, "chat/completions", 8192, 4096)
        held: list[Reservation] = []

        def reserve() -> None:
            got = book.reserve(new.record, ask)
            assert isinstance(got, Reservation)
            held.append(got)

        def settle() -> None:
            held.pop().settle(50)

        checks: dict[str, Callable[[], object]] = {
            "lookup": lambda: ring.lookup(new.key),
            "access": lambda: guard.allows(rule, new.record),
            "ask": lambda: ask_of(body, "chat/completions", 8192, 4096),
            "reserve": reserve,
            "settle": settle,
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
