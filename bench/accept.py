"""What the daemon's own accept loop costs: llmgw_slurm.guard against asyncio's server.

The daemon accepts on its ports itself (``guard.Acceptor``): each connection is
checked against its bounds, its peer's uid asked of the kernel (one netlink
query), its protocol wrapped (a head timer, its place released when it
closes). This measures that against ``loop.create_server`` with the same
protocol, in the same run, on uvloop's loop as the daemon runs:

- ``new connection``: a connection per request (connect, one request, the
  answer, close): what the accept path costs, per connection;
- ``kept-alive``: requests on open connections: what the wrapper costs per
  request (every read passes through it).

For each: requests per second and p50/p99 latency (the load generator, Python
on the same two cores, is most of what limits them), and the server process's
own CPU per request (user + system, from /proc): the least noisy figure of
what the accept path costs.

The server is a process of its own (a minimal HTTP/1.1 protocol answering each
request head with a fixed 200), pinned to the last CPU where there are two or
more; the load generator is this process, with ``--clients`` connections at
once. Rounds interleave the two servers; samples are pooled over rounds.

    python bench/accept.py [--duration 3] [--rounds 3] [--clients 32]

Writes bench/results/accept.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median, print_table, result, write

_SERVER = r"""
import asyncio, os, socket, sys
import uvloop
from llmgw_slurm.guard import Acceptor, ConnectionLimiter, bind_listeners

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"

class Answer(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            _, _, self.buf = self.buf.partition(b"\r\n\r\n")
            self.t.write(ANSWER)

async def main(kind):
    loop = asyncio.get_running_loop()
    if kind == "asyncio":
        server = await loop.create_server(Answer, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]
    else:
        lim = ConnectionLimiter("bench", total=100_000, per_peer=100_000, head_timeout=10)
        acc = Acceptor(bind_listeners("127.0.0.1", 0), Answer, lim)
        acc.start()
        port = acc.port
    print(port, flush=True)
    await asyncio.Event().wait()

uvloop.run(main(sys.argv[1]))
"""

_REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
_ANSWER_LEN = len(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")


def start_server(kind: str, pin: bool) -> tuple[subprocess.Popen[str], int]:
    argv = [sys.executable, "-c", _SERVER, kind]
    cpus = os.cpu_count() or 1
    if pin and cpus > 1:
        argv = ["taskset", "-c", str(cpus - 1), *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


async def one_per_connection(port: int, until: float, lat: list[float]) -> None:
    while time.monotonic() < until:
        t0 = time.perf_counter()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(_REQUEST)
        await r.readexactly(_ANSWER_LEN)
        w.close()
        lat.append(time.perf_counter() - t0)


async def kept_alive(port: int, until: float, lat: list[float]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    while time.monotonic() < until:
        t0 = time.perf_counter()
        w.write(_REQUEST)
        await r.readexactly(_ANSWER_LEN)
        lat.append(time.perf_counter() - t0)
    w.close()


async def load(port: int, mode: str, clients: int, seconds: float) -> list[float]:
    lat: list[float] = []
    client = one_per_connection if mode == "new connection" else kept_alive
    warm = time.monotonic() + 0.5
    await asyncio.gather(*(client(port, warm, []) for _ in range(clients)))
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(port, until, lat) for _ in range(clients)))
    return lat


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.99)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()
    servers = {k: start_server(k, not args.no_pin) for k in ("asyncio", "guard")}
    samples: dict[tuple[str, str], list[float]] = {}
    seconds: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    try:
        for _ in range(args.rounds):
            for mode in ("new connection", "kept-alive"):
                for kind, (proc, port) in servers.items():
                    before = cpu_s(proc.pid)
                    lat = asyncio.run(load(port, mode, args.clients, args.duration))
                    # The warm-up's CPU is counted too: a few percent more requests.
                    used = cpu_s(proc.pid) - before
                    samples.setdefault((kind, mode), []).extend(lat)
                    seconds[(kind, mode)] = seconds.get((kind, mode), 0.0) + args.duration
                    cpu[(kind, mode)] = cpu.get((kind, mode), 0.0) + used
    finally:
        for p, _ in servers.values():
            p.kill()
            p.wait()
    results = []
    for mode in ("new connection", "kept-alive"):
        ref, got = samples[("asyncio", mode)], samples[("guard", mode)]
        ref_s, got_s = seconds[("asyncio", mode)], seconds[("guard", mode)]
        ref_name = "asyncio server"
        results += [
            result(f"{mode}: requests/s", len(got) / got_s, "1/s", ref_name, len(ref) / ref_s),
            result(f"{mode}: p50 ms", median(got) * 1e3, "ms", ref_name, median(ref) * 1e3),
            result(f"{mode}: p99 ms", p99(got) * 1e3, "ms", ref_name, p99(ref) * 1e3),
            result(
                f"{mode}: server CPU us/request",
                cpu[("guard", mode)] / len(got) * 1e6,
                "us",
                ref_name,
                cpu[("asyncio", mode)] / len(ref) * 1e6,
            ),
        ]
    print(f"load average {os.getloadavg()}")
    print_table(results)
    print(write("accept", results, vars(args)))


if __name__ == "__main__":
    main()
