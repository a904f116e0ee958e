"""A burst of connections from the gateway to one engine: opened in turns, or all at once.

A thousand streams begun together need a thousand connections to the
replica's engine. Opened all at once (the gateway's way before the turns of
``router.engine.MAX_CONNECTING``), they pile up on the engine's listen
backlog and its one event loop doing mutual-TLS handshakes, and the last of
them waits seconds: past the connect timeout (5 s), a live engine is taken for
a dead one (the CI failure of tests/faults/test_load.py on 2026-12-06: 212 of
1,000 streams). In turns, each connection waits for its turn, not for the
handshakes of all the others.

The engine is the test engine (aiohttp's server, backlog 128) with mutual TLS
as the agent starts it, in a process of its own; the gateway side is
``EnginePool.connect`` in this process, both on the same two cores. Each round
opens ``--connections`` at once, in turns and then all at once (interleaved),
and reports per policy: the longest single connect (the figure the connect
timeout is held to), connections that failed, and the whole burst's time.
``--busy N`` runs N busy loops meanwhile, as a loaded machine (CI's) would.

    python bench/engine_burst.py [--connections 1000] [--rounds 3] [--busy 3]

Writes bench/results/engine_burst.json.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import free_port, median, print_table, result, wait_http, write
from llmgw_slurm.auth.tls import client_context, make_identity
from llmgw_slurm.router.engine import MAX_CONNECTING, Conn, EnginePool, EngineUnreachable, Target

ALL_AT_ONCE = 1 << 30  # no turns: every connection opened at once


class TimedPool(EnginePool):
    """The pool, timing each connection from its turn to its handshake's end."""

    def __init__(self, max_connecting: int) -> None:
        super().__init__(connect_timeout=5.0, read_timeout=60.0, max_connecting=max_connecting)
        self.longest = 0.0

    async def _open(self, target: Target) -> Conn:
        t0 = time.monotonic()
        try:
            return await super()._open(target)
        finally:
            self.longest = max(self.longest, time.monotonic() - t0)


async def burst(url: str, ctx: ssl.SSLContext, turns: int, n: int) -> tuple[float, int, float]:
    """The longest connect, how many failed, and the burst's seconds."""
    pool = TimedPool(turns)
    target = pool.target(url, ctx)
    t0 = time.monotonic()
    got = await asyncio.gather(*(pool.connect(target) for _ in range(n)), return_exceptions=True)
    took = time.monotonic() - t0
    for c in got:
        if isinstance(c, Conn):
            c.abandon()
    failed = sum(isinstance(c, EngineUnreachable) for c in got)
    for c in got:
        if isinstance(c, BaseException) and not isinstance(c, EngineUnreachable):
            raise c
    await asyncio.sleep(2)  # the engine closes what was abandoned before the next burst
    return pool.longest, failed, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=3, help="busy loops meanwhile (default 3)")
    ap.add_argument("--turns", type=int, default=MAX_CONNECTING,
                    help=f"connections opened at once in turns (default {MAX_CONNECTING})")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-burst-"))
    engine = make_identity(work, "engine", "engine", 1)
    gateway = make_identity(work, "gateway", "gateway", 1)
    ctx = client_context(engine.cert_pem, gateway.cert_file, gateway.key_file)
    port = free_port()
    server = subprocess.Popen([
        sys.executable, "-m", "llmgw_slurm.testing.engine", "--host", "127.0.0.1",
        "--port", str(port), "--api-key", "bench", "--served-name", "m",
        "--ssl-certfile", str(engine.cert_file), "--ssl-keyfile", str(engine.key_file),
        "--ssl-ca-certs", str(gateway.cert_file),
    ])
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    got: dict[str, list[tuple[float, int, float]]] = {"in turns": [], "all at once": []}
    try:
        url = f"https://127.0.0.1:{port}"
        wait_http(f"{url}/health", server, context=ctx)
        for _ in range(args.rounds):
            for name, turns in (("in turns", args.turns), ("all at once", ALL_AT_ONCE)):
                got[name].append(asyncio.run(burst(url, ctx, turns, args.connections)))
                longest, failed, took = got[name][-1]
                print(f"{name}: longest {longest:.2f} s, {failed} failed, burst {took:.1f} s")
    finally:
        for p in (server, *busy):
            p.terminate()
    new, old = got["in turns"], got["all at once"]
    ref = f"all at once ({args.connections})"
    results = [
        result("longest connect, median over rounds (s)", median([r[0] for r in new]), "s",
               ref, median([r[0] for r in old])),
        result("connections failed, all rounds", sum(r[1] for r in new), "connections",
               ref, sum(r[1] for r in old)),
        result("burst, median over rounds (s)", median([r[2] for r in new]), "s",
               ref, median([r[2] for r in old])),
    ]
    print_table(results)
    print(write("engine_burst", results, vars(args)))


if __name__ == "__main__":
    main()
