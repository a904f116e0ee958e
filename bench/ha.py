"""Two login nodes: failover time, requests lost in it, and what the shared database adds.

On the dev cluster and the project's PostgreSQL (scripts/dev-cluster up,
scripts/dev-postgres up), with real daemons (``llmgw-admin serve``) and the
test engine in Slurm jobs:

- ``failover``: two daemons on one database; ``--rounds`` times, the leader
  is killed with SIGKILL while clients send requests through the other, and
  the time from the kill to the survivor's first reconcile pass as leader is
  taken (its status says when that pass began). The killed daemon is started
  again and follows; the next round kills whichever leads. Median and max;
  goal: median under 5 s.
- ``failed``: requests through the surviving gateway that failed during the
  rounds (from the kill to 3 s after the takeover); goal 0.
- ``p50``: one daemon with the database and one without (the embedded
  default), each with its replica of the same model, both with keys; one
  client sends keyed requests one at a time, alternating blocks between the
  two, so both see the same machine load; the p50 of each and their
  difference, the latency the shared database adds; goal: within 0.1 ms.

    eval "$(scripts/dev-cluster env)"; eval "$(scripts/dev-postgres env)"
    python bench/ha.py [--rounds 10] [--requests 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from bench.common import median, print_table, result, write
from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.db.keys import PgKeyStore
from tests.ha.conftest import fresh_database
from tests.ha.peers import Peer, Peers, agent_yaml
from tests.ha.test_failover import ALWAYS, Load, ready_on
from tests.slurm.conftest import eventually


async def one_failover(peers: Peers, key: str) -> tuple[float, int, int]:
    """Kill the leader under load; (seconds to the survivor's first pass, failed, ok)."""
    leader = await peers.leader()
    survivor = peers[1] if leader is peers[0] else peers[0]
    # The other may still be starting (the first round, or after its restart).
    before = await eventually(survivor.cluster, f"{survivor.name} to answer", 120)
    await ready_on(survivor, "tiny")
    load = Load(survivor.url, key, "tiny")
    load.start()
    await asyncio.sleep(1)
    killed = leader.kill9()

    async def took_over() -> dict[str, Any] | None:
        c = await survivor.cluster()
        ok = c and c["leading"] and c["epoch"] > before["epoch"] and c["first_pass_at"]
        return c if ok else None

    c = await eventually(took_over, "the survivor to lead", 120)
    await asyncio.sleep(3)
    await load.stop()
    leader.start()
    return c["first_pass_at"] - killed, len(load.errors), load.ok


async def failovers(folder: Path, rounds: int) -> tuple[list[float], int, int]:
    with fresh_database() as db:
        key = PgKeyStore(db.info()).add("bench").key
        peers = Peers.make(folder, "hab" + secrets.token_hex(2) + ".", db, [ALWAYS])
        try:
            peers.start()
            times, failed, ok = [], 0, 0
            for i in range(rounds):
                t, f, n = await one_failover(peers, key)
                print(f"  round {i + 1}: failover {t:.2f}s, {f} failed of {n + f}", flush=True)
                times.append(t)
                failed += f
                ok += n
            return times, failed, ok
        finally:
            peers.stop()
            peers.cancel_all()


async def latencies(url: str, key: str, n: int) -> list[float]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    out = []
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}")
            out.append(time.perf_counter() - t0)
    return out


async def p50s(folder: Path, requests: int, block: int = 200) -> tuple[float, float]:
    """(p50 with the database, p50 embedded), in seconds, alternating blocks."""
    with fresh_database() as db:
        shared = Peers.make(
            folder / "shared", "hap" + secrets.token_hex(2) + ".", db, [ALWAYS], n=1
        )
        key = PgKeyStore(db.info()).add("bench").key
        alone_dir = folder / "alone"
        alone_dir.mkdir(parents=True)
        (alone_dir / "agent.yaml").write_text(agent_yaml(alone_dir))
        import yaml

        (alone_dir / "models.yaml").write_text(yaml.safe_dump({"models": [ALWAYS]}))
        alone = Peer("alone", alone_dir / "d", "hae" + secrets.token_hex(2) + ".", None)
        alone.write(alone_dir)
        plain_key = add_key(alone_dir / "keys.json", "bench").key
        try:
            shared.start()
            alone.start()
            await ready_on(shared[0], "tiny")
            await ready_on(alone, "tiny")
            # Warm both: connections, caches, the engines' first requests.
            await latencies(shared[0].url, key, 200)
            await latencies(alone.url, plain_key, 200)
            with_db: list[float] = []
            without: list[float] = []
            for _ in range(max(1, requests // (2 * block))):
                with_db += await latencies(shared[0].url, key, block)
                without += await latencies(alone.url, plain_key, block)
            return statistics.median(with_db), statistics.median(without)
        finally:
            shared.stop()
            alone.stop()
            shared.cancel_all()
            Peers(alone_dir, alone.prefix, db).cancel_all()


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="llmgw-ha-bench-") as tmpd:
        tmp = Path(tmpd)
        print("p50 with the shared database against the embedded default...", flush=True)
        with_db, without = await p50s(tmp / "p50", args.requests)
        print(
            f"  p50 {with_db * 1000:.3f} ms with the database, {without * 1000:.3f} ms "
            f"embedded: {(with_db - without) * 1000:+.3f} ms",
            flush=True,
        )
        print(f"failover, {args.rounds} rounds...", flush=True)
        times, failed, ok = await failovers(tmp / "failover", args.rounds)
    return [
        result("failover median (kill to first pass)", median(times), "s", "goal 5 s", 5.0),
        result("failover max", max(times), "s", "goal 5 s", 5.0),
        result(
            "failed requests on the survivor", failed, "requests", f"of {failed + ok}", failed + ok
        ),
        result(
            "gateway p50 with the database", with_db * 1000, "ms", "embedded p50", without * 1000
        ),
        result(
            "added p50 (database - embedded)", (with_db - without) * 1000, "ms", "goal 0.1 ms", 0.1
        ),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=4000)
    args = p.parse_args()
    for var in ("SLURM_CONF", "LLMGW_TEST_PG_DSN"):
        if not os.environ.get(var):
            sys.exit(
                f'{var} is not set: eval "$(scripts/dev-cluster env)"; '
                'eval "$(scripts/dev-postgres env)"'
            )
    results = asyncio.run(run(args))
    print_table(results)
    path = write("ha", results, vars(args))
    print(f"written: {path}")
    with contextlib.suppress(KeyError):
        failover = next(r for r in results if r["name"].startswith("failover median"))["value"]
        print(f"goal: failover median {failover:.2f}s < 5 s: {'met' if failover < 5 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
