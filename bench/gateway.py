"""What the gateway adds: latency and throughput through it against direct calls.

Starts the test engine (no token delay, so the engine's own cost is small and
the gateway's overhead shows), the gateway in front of it (its own process,
as the daemon runs it), a bare aiohttp proxy (what aiohttp alone costs, so the
gateway's own logic shows apart from the framework), and nginx as a reverse
proxy when it is installed (one worker, upstream keep-alive, buffering off: the
fair comparison for one Python process). Then, for 1, 64 and 256 concurrent clients, sends
non-streamed chat completions for a fixed time to each target and reports
p50/p99 latency and throughput, each as a ratio to direct calls.

The load generator runs in this process on the same machine: on a small
machine it competes with the servers for CPU, so the absolute numbers are
lower bounds; the ratios are what to compare. Other work on the machine adds
noise: the load average at the start is recorded with the results.

    python bench/gateway.py [--duration 2] [--rounds 2] [--out bench/results/gateway.json]
                            [--tracing]

``--tracing`` adds a second gateway with tracing on (sampling 1.0, every
request a span, OTLP/HTTP to a sink process that accepts and drops), to set
its cost against the gateway with tracing off.

Bounded in time: a few seconds of set-up plus ``rounds`` x 12 runs of
``duration + 0.5`` s: about 70 s with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
ENGINE_KEY = "bench-engine-key"
MODEL = "tiny"
CLIENTS = (1, 64, 256)
BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the quick brown fox jumps"}],
        "max_tokens": 8,
    }
).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {timeout} s: {e}") from None
            time.sleep(0.05)


def serve_gateway(port: int, engine_url: str, collector: str | None = None) -> None:
    """The gateway process: one model, one replica, no keys, as the daemon would run it."""
    from aiohttp import web

    from llmgw_slurm.router import Endpoint, ModelInfo, StaticDirectory, create_app

    if collector:
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        from llmgw_slurm.config import TracingConfig
        from llmgw_slurm.tracing import setup_tracing

        class _Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        # "drop": spans made and batched, never encoded or sent (what the spans
        # themselves cost, apart from the export).
        setup_tracing(
            TracingConfig(enabled=True, endpoint=None if collector == "drop" else collector),
            "llmgw-bench",
            exporter=_Drop() if collector == "drop" else None,
        )

    directory = StaticDirectory([ModelInfo(MODEL)])
    directory.add_endpoint(MODEL, Endpoint("bench0001", engine_url, ENGINE_KEY))
    app = create_app(directory)
    app.router.add_get("/health", lambda _: web.Response(text="ok"))  # type: ignore[arg-type, return-value]
    web.run_app(
        app, host="127.0.0.1", port=port, print=None, access_log=None, handler_cancellation=True
    )


def serve_sink(port: int) -> None:
    """An OTLP/HTTP receiver that accepts every export and keeps nothing."""
    from aiohttp import web

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_bare(port: int, engine_url: str) -> None:
    """The least an aiohttp proxy can do: what the gateway's own logic costs on top of it."""
    from aiohttp import web

    session: aiohttp.ClientSession | None = None

    async def startup(_: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def proxy(request: web.Request) -> web.Response:
        assert session is not None
        body = await request.read()
        headers = {"Authorization": f"Bearer {ENGINE_KEY}", "Content-Type": "application/json"}
        async with session.post(engine_url + request.path, data=body, headers=headers) as r:
            data = await r.read()
            return web.Response(status=r.status, body=data, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def cleanup(_: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application()
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


_NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream engine {{ server 127.0.0.1:{engine_port}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "Bearer {key}";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(tmp: Path, port: int, engine_port: int) -> subprocess.Popen[bytes] | None:
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )
    if nginx is None:
        return None
    conf = tmp / "nginx.conf"
    conf.write_text(_NGINX_CONF.format(dir=tmp, port=port, engine_port=engine_port, key=ENGINE_KEY))
    return subprocess.Popen(
        [nginx, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def load(url: str, clients: int, duration: float) -> tuple[list[float], int]:
    """``clients`` loops sending requests back to back; warm-up 0.5 s, then ``duration`` s.

    Returns the latencies (s) of the requests that began and ended in the
    measured window, and the number of errors.
    """
    headers = {"Authorization": f"Bearer {ENGINE_KEY}", "Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    t_measure = loop.time() + 0.5
    t_end = t_measure + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal errors
            while True:
                t0 = loop.time()
                if t0 >= t_end:
                    return
                try:
                    async with session.post(url, data=BODY, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                t1 = loop.time()
                if t0 >= t_measure and t1 <= t_end:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(clients)))
    return latencies, errors


def summarize(latencies: list[float], errors: int, seconds: float) -> dict[str, float]:
    if not latencies:
        raise RuntimeError(f"no successful request ({errors} errors)")
    latencies = sorted(latencies)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": q[98] * 1000,
        "rps": len(latencies) / seconds,
        "errors": float(errors),
    }


def _machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs {cpu}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=2.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per target and client count")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway.json")
    p.add_argument("--no-nginx", action="store_true")
    p.add_argument(
        "--serve-gateway", nargs=2, metavar=("PORT", "ENGINE_URL"), help=argparse.SUPPRESS
    )
    p.add_argument("--serve-bare", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--tracing", action="store_true", help="also a gateway with tracing on")
    p.add_argument("--serve-gateway-traced", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--serve-sink", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_gateway:
        serve_gateway(int(args.serve_gateway[0]), args.serve_gateway[1])
        return 0
    if args.serve_gateway_traced:
        port_s, engine, sink = args.serve_gateway_traced
        serve_gateway(int(port_s), engine, sink)
        return 0
    if args.serve_sink:
        serve_sink(int(args.serve_sink))
        return 0
    if args.serve_bare:
        serve_bare(int(args.serve_bare[0]), args.serve_bare[1])
        return 0

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmpd:
        try:
            e_port, g_port, n_port, b_port = (_free_port() for _ in range(4))
            engine_url = f"http://127.0.0.1:{e_port}"
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "llmgw_slurm.testing.engine",
                        "--port",
                        str(e_port),
                        "--api-key",
                        ENGINE_KEY,
                        "--served-name",
                        MODEL,
                    ],
                    env=env,
                )
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--serve-gateway", str(g_port), engine_url],
                    env=env,
                )
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--serve-bare", str(b_port), engine_url],
                    env=env,
                )
            )
            targets = {
                "direct": f"{engine_url}/v1/chat/completions",
                "gateway": f"http://127.0.0.1:{g_port}/v1/chat/completions",
                "aiohttp-bare": f"http://127.0.0.1:{b_port}/v1/chat/completions",
            }
            _wait_http(engine_url + "/health")
            _wait_http(f"http://127.0.0.1:{g_port}/health")
            _wait_http(f"http://127.0.0.1:{b_port}/health")
            if args.tracing:
                s_port, t_port = _free_port(), _free_port()
                sink = f"http://127.0.0.1:{s_port}"
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--serve-sink", str(s_port)], env=env
                    )
                )
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--serve-gateway-traced",
                            str(t_port),
                            engine_url,
                            sink,
                        ],
                        env=env,
                    )
                )
                _wait_http(sink + "/health")
                _wait_http(f"http://127.0.0.1:{t_port}/health")
                targets["gateway-traced"] = f"http://127.0.0.1:{t_port}/v1/chat/completions"
                d_port = _free_port()
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--serve-gateway-traced",
                            str(d_port),
                            engine_url,
                            "drop",
                        ],
                        env=env,
                    )
                )
                _wait_http(f"http://127.0.0.1:{d_port}/health")
                targets["gateway-spans-only"] = f"http://127.0.0.1:{d_port}/v1/chat/completions"
            ng = None if args.no_nginx else start_nginx(Path(tmpd), n_port, e_port)
            if ng is not None:
                procs.append(ng)
                _wait_http(f"http://127.0.0.1:{n_port}/health")
                targets["nginx"] = f"http://127.0.0.1:{n_port}/v1/chat/completions"

            # Rounds interleave the targets, so that a burst of load from
            # elsewhere on the machine spreads over all of them; each
            # target's latencies are pooled over the rounds.
            pooled: dict[tuple[str, int], tuple[list[float], int]] = {}
            for _ in range(args.rounds):
                for clients in CLIENTS:
                    for name, url in targets.items():
                        lat, err = asyncio.run(load(url, clients, args.duration))
                        prev = pooled.get((name, clients), ([], 0))
                        pooled[(name, clients)] = (prev[0] + lat, prev[1] + err)
            measured = {
                k: summarize(lat, err, args.duration * args.rounds)
                for k, (lat, err) in pooled.items()
            }
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    results: list[dict[str, Any]] = []
    rows = []
    for clients in CLIENTS:
        ref = measured[("direct", clients)]
        for name in targets:
            if name == "direct":
                continue
            m = measured[(name, clients)]
            for metric, unit in (("p50_ms", "ms"), ("p99_ms", "ms"), ("rps", "req/s")):
                results.append(
                    {
                        "name": f"{name}.clients{clients}.{metric.removesuffix('_ms')}",
                        "value": round(m[metric], 3),
                        "unit": unit,
                        "reference": f"direct.clients{clients}.{metric.removesuffix('_ms')}",
                        "reference_value": round(ref[metric], 3),
                        "ratio": round(m[metric] / ref[metric], 3),
                    }
                )
            rows.append((name, clients, m, ref))
    print(
        f"{'target':12s} {'clients':>7s} {'p50 ms':>9s} {'x direct':>9s} {'p99 ms':>9s} "
        f"{'x direct':>9s} {'req/s':>8s} {'x direct':>9s}"
    )
    for name, clients, m, ref in rows:
        print(
            f"{name:12s} {clients:7d} {m['p50_ms']:9.2f} {m['p50_ms'] / ref['p50_ms']:9.2f} "
            f"{m['p99_ms']:9.2f} {m['p99_ms'] / ref['p99_ms']:9.2f} {m['rps']:8.0f} "
            f"{m['rps'] / ref['rps']:9.2f}"
        )
    for clients in CLIENTS:
        ref = measured[("direct", clients)]
        print(
            f"{'direct':12s} {clients:7d} {ref['p50_ms']:9.2f} {'':9s} {ref['p99_ms']:9.2f} "
            f"{'':9s} {ref['rps']:8.0f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": _machine(),
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
