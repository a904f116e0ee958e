"""What the gateway adds: latency and throughput through it against direct calls.

Three test engines on localhost: a paced one that streams as a real model
does with 64 requests in flight on one GPU (50 ms to the first token, then a
token every 20 ms, 50 tokens: 1,030 ms a request; an 8B model decodes at
about 50 tokens/s per sequence at that batch size), a fast one (20 ms, then
a token every 5 ms: 265 ms a request; four times a GPU's pace, which on two
shared cores saturates the load generator and the engines themselves) and
an instant one (the same 50 tokens at once, so that only the proxies' own
cost shows). In front of both, each as one process with one
worker: the gateway (as the daemon runs it), nginx as a plain reverse proxy
(upstream keep-alive, buffering off: the near-zero-cost reference; Debian's
nginx-light is installed if no nginx is found), LiteLLM's proxy (installed
into .dev-cluster/bench-venv, not into the project's environment) and, with
``--bare``, the least an aiohttp proxy can do (what the framework alone costs)
and, with ``--floor``, the least a proxy on the gateway's own stack can do
(uvloop and httptools, ``bench/floor_proxy.py``: the floor under the
gateway's CPU, what any Python proxy built this way spends before its work).

The gateway reaches its engines as it does in production: over mutual TLS.
Each engine runs twice, once plain and once serving TLS with a key pair from
``tls.make_engine_tls`` and requiring the gateway's client certificate (made
by ``tls.load_or_create_identity`` in a temporary directory); the gateway
pins each engine's certificate (``tls.client_context``). ``direct``, nginx,
LiteLLM and the bare proxy call the plain engines: the goals are measured
against ``direct``, so the gateway's added latency includes the TLS hop and
what TLS costs the engine. ``direct-tls`` (the load generator calling the TLS
engines with the gateway's certificate) shows that cost on its own, and
``--engine-plain`` adds ``gateway-plain``, the gateway on the plain engines
(as before engines served TLS), so that gateway against gateway-plain is what
TLS costs the gateway, in the same run. The engines share their CPU with the
load generator: what TLS costs an engine slows the load generator too, which
on a cluster (the engine on a GPU node) it would not.

For each engine, non-streamed and streamed, at 1, 64 and 256 concurrent
clients, each target gets ``duration`` seconds of closed-loop load after a
0.5 s warm-up: p50/p99 latency, p50/p99 time to the first token (streams) and
requests per second, each against direct calls to the engine in the same run.
Rounds interleave the targets, so that a burst of load from elsewhere on the
machine spreads over all of them; a target's samples are pooled over rounds.

On a machine with two or more CPUs the proxies are pinned to the last CPU and
the engines and this load generator to the others (``--no-pin`` to turn it
off): the proxy on a core of its own, so that what it costs shows as its own
saturation, not as CPU taken from the engine. The load generator is Python on
the same machine: the absolute numbers are lower bounds, the ratios are what
to compare; the load average at the start is printed.

    python bench/gateway.py [--duration 2] [--rounds 2] [--bare] [--tracing]
                            [--engine-plain] [--no-litellm] [--no-nginx]

``--tracing`` adds gateways with tracing on, exported over OTLP/HTTP to a
sink process that accepts and drops: every request a span, sampled at 1.0
(``gateway-traced``) and at 0.05 (``gateway-traced-5pct``); as shipped, where
only a request whose client asks for a trace gets a span
(``gateway-traced-default``); and one whose spans are made and batched but
never exported (``gateway-spans-only``), to set their cost against the
gateway with tracing off (all of them on the TLS engines).

Bounded: about 40 s of set-up the first time (LiteLLM's install takes longer,
once), then rounds x 18 x targets runs (a run: the clients' staggered start,
one answer, then duration, at least four answers) plus a settling pause
after each: about 15 minutes with the defaults (17 with --engine-plain);
``--engines paced --clients 64`` for the goals alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import free_port, result, wait_http, worktree, write
from llmgw_slurm.auth.tls import (
    EngineTLS,
    Identity,
    client_context,
    load_or_create_identity,
    make_engine_tls,
)

if TYPE_CHECKING:
    import ssl

    from llmgw_slurm.router import Endpoint

ENGINE_KEY = "bench-engine-key"
# LiteLLM refuses to start without a master key (it must start with sk-).
LITELLM_KEY = "sk-bench-litellm-master-key"
CLIENTS = (1, 64, 256)
TOKENS = 50
# name -> test engine options (first token delay, token delay)
ENGINES = {"paced": (0.050, 0.020), "fast": (0.020, 0.005), "instant": (0.0, 0.0)}
MODES = ("plain", "stream")
VENV = ROOT / ".dev-cluster" / "bench-venv"
# Goals from the issue, at 64 clients with the paced engine.
GOAL_ADDED_P50_MS = 1.0
GOAL_ADDED_P99_MS = 5.0
GOAL_THROUGHPUT = 0.95
# Issue 35: the instant engine's most requests and streams a second at least
# nginx's, and CPU a request and a stream at most 1.5 times nginx's (plain engines).
GOAL_MAX_RPS_VS_NGINX = 1.0
GOAL_CPU_VS_NGINX = 1.5


def answer_seconds(engine: str) -> float:
    """How long one answer of ``engine`` takes, without any proxy or load."""
    first, delay = ENGINES[engine]
    return first + delay * (TOKENS - 1)


def run_seconds(engine: str, duration: float) -> float:
    """At least four answers a client in a run: a paced answer takes a second,
    and a 2 s window would give p99 from a handful of samples."""
    return max(duration, 4 * answer_seconds(engine))


def body(model: str, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "the quick brown fox jumps"}],
            "max_tokens": TOKENS,
            "stream": stream,
        }
    ).encode()


@dataclass(frozen=True)
class BenchTLS:
    """The gateway's client identity and each TLS engine's key pair (one a model)."""

    gateway: Identity
    engines: dict[str, EngineTLS]

    @classmethod
    def make(cls, directory: Path, names: list[str]) -> BenchTLS:
        gateway = load_or_create_identity(directory / "gateway")
        engines = {n: make_engine_tls(gateway.cert_pem, n, parent=directory) for n in names}
        return cls(gateway, engines)

    def client(self, name: str) -> ssl.SSLContext:
        """What the gateway connects to engine ``name`` with: its pin and the gateway's cert."""
        ident = self.engines[name].identity
        return client_context(ident.cert_pem, self.gateway.cert_file, self.gateway.key_file)

    def engine_args(self, name: str) -> list[str]:
        t = self.engines[name]
        return [
            "--ssl-certfile", str(t.identity.cert_file), "--ssl-keyfile", str(t.identity.key_file),
            "--ssl-ca-certs", str(t.ca_file),
        ]  # fmt: skip


# ---- the servers (each its own process) ------------------------------------------------


def gateway_spec(
    engines: dict[str, str], tls: BenchTLS | None, keyed: dict[str, str] | None = None
) -> str:
    """What ``--serve-gateway`` receives: the engines' URLs and, for TLS engines,
    the certificate files to pin and to present (paths: the process reads them);
    ``keyed``: the key and budgets files of ``gateway-keyed``."""
    spec: dict[str, Any] = {"engines": engines, "tls": None, "keyed": keyed}
    if tls is not None:
        spec["tls"] = {
            "engine_certs": {n: str(t.identity.cert_file) for n, t in tls.engines.items()},
            "cert": str(tls.gateway.cert_file),
            "key": str(tls.gateway.key_file),
        }
    return json.dumps(spec)


def _endpoints(spec: dict[str, Any]) -> list[tuple[str, Endpoint]]:
    """(model, endpoint) for each engine of a ``gateway_spec``, pinned as the daemon pins."""
    from llmgw_slurm.router import Endpoint

    tls = spec["tls"]
    out = []
    for i, (name, url) in enumerate(spec["engines"].items()):
        ctx = None
        if tls is not None:
            pem = Path(tls["engine_certs"][name]).read_text()
            ctx = client_context(pem, Path(tls["cert"]), Path(tls["key"]))
        out.append((name, Endpoint(f"bench{i:04d}", url, ENGINE_KEY, ssl=ctx)))
    return out


def serve_gateway(port: int, spec: dict[str, Any], profile: str = "", collector: str = "") -> None:
    """The gateway process: one replica a model, no keys, as the daemon would run it.

    ``spec``: from ``gateway_spec``; with its "tls", every engine's certificate
    is pinned and the gateway presents its own, as in production.

    ``collector``: tracing on, every request a span, exported over OTLP/HTTP
    to that URL; "drop": spans made and batched, never encoded or sent (what
    the spans themselves cost, apart from the export); "sampled:URL": tracing
    on as shipped (only requests that ask for a trace get a span); "ratio:R:URL":
    every request a span, sampled at ratio R (a busy site's setting).
    """
    from aiohttp import web

    from llmgw_slurm.daemon import event_loop
    from llmgw_slurm.router import ModelInfo, RouterConfig, StaticDirectory, create_app

    policy, ratio = "all", 1.0
    if collector.startswith("sampled:"):
        policy, collector = "sampled", collector.removeprefix("sampled:")
    elif collector.startswith("ratio:"):
        r, collector = collector.removeprefix("ratio:").split(":", 1)
        ratio = float(r)
    if collector:
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        from llmgw_slurm.config import TracingConfig
        from llmgw_slurm.tracing.otel import setup_tracing

        class _Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        setup_tracing(
            TracingConfig(
                enabled=True,
                endpoint=None if collector == "drop" else collector,
                sampling_ratio=ratio,
            ),
            "llmgw-bench",
            exporter=_Drop() if collector == "drop" else None,
        )

    directory = StaticDirectory([ModelInfo(name) for name in spec["engines"]])
    for name, endpoint in _endpoints(spec):
        directory.add_endpoint(name, endpoint)
    # The load sends no traceparent: "all" gives every request its span when traced.
    config = RouterConfig(trace_requests=policy if collector else "sampled")
    app = create_app(directory, config, **_keyed(spec, directory))

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    prof = None
    if profile:
        import cProfile

        # CPU time, not wall time: on a shared machine a function that was
        # preempted would otherwise be charged for the time others ran.
        prof = cProfile.Profile(time.process_time)
        prof.enable()
    # On the daemon's runner (router.server) and loop (uvloop's).
    asyncio.Runner(loop_factory=event_loop).run(_serve(app, port))
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)


async def _serve(app: Any, port: int) -> None:
    from llmgw_slurm.daemon import RUNNER_OPTIONS
    from llmgw_slurm.router.server import Runner

    runner = Runner(app, **RUNNER_OPTIONS)
    await runner.setup()
    await runner.start("127.0.0.1", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _keyed(spec: dict[str, Any], directory: Any) -> dict[str, Any]:
    """For ``gateway-keyed``: keys, an access rule on every model and quotas that
    count everything and refuse nothing, as a site with all three on runs it."""
    keyed = spec.get("keyed")
    if not keyed:
        return {}
    from llmgw_slurm.accounting.quota import AccountBudgets, QuotaBook
    from llmgw_slurm.auth.keys import KeyRing
    from llmgw_slurm.catalog import Access
    from llmgw_slurm.config import QuotaConfig

    for name in spec["engines"]:
        directory.rules[name] = Access(accounts=("bench",), groups=("llm-users",))
    big = 10**12
    quotas = QuotaConfig(big, big, big, big, big, big)
    budgets = AccountBudgets(Path(keyed["budgets_file"]))
    return {"keys": KeyRing(Path(keyed["keys_file"])), "quota": QuotaBook(quotas, budgets)}


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
    """The least an aiohttp proxy can do (on the daemon's event loop), with
    aiohttp's client: what the gateway's own logic and client cost on top of it."""
    from aiohttp import web

    from llmgw_slurm.daemon import event_loop

    session: aiohttp.ClientSession | None = None

    async def startup(_: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def proxy(request: web.Request) -> web.StreamResponse:
        assert session is not None
        data = await request.read()
        headers = {"Authorization": f"Bearer {ENGINE_KEY}", "Content-Type": "application/json"}
        async with session.post(engine_url + request.path, data=data, headers=headers) as r:
            ctype = r.headers.get("Content-Type", "application/json")
            resp = web.StreamResponse(status=r.status, headers={"Content-Type": ctype})
            # A client cut at the end of a run: not worth a traceback each.
            with contextlib.suppress(ConnectionResetError):
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            return resp

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
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=event_loop())


_NGINX_HTTP = """
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
{servers}
}}
"""

_NGINX_SERVER = """
    upstream {name} {{ server 127.0.0.1:{engine_port}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://{name};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Authorization "Bearer {key}";
            proxy_buffering off;
        }}
    }}
"""


def _nginx_path() -> str | None:
    # /usr/sbin is not on every PATH (a non-root shell).
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )


def find_nginx(install: bool) -> str | None:
    found = _nginx_path()
    if found or not install or not shutil.which("apt-get"):
        return found
    print("nginx not found: installing Debian's nginx-light", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "check": False}
    subprocess.run(["apt-get", "update", "-q"], **quiet)  # type: ignore[call-overload]
    light = subprocess.run(["apt-get", "install", "-y", "-q", "nginx-light"], **quiet)  # type: ignore[call-overload]
    if light.returncode:
        # nginx-light is gone from newer Debian releases; plain nginx is as light.
        subprocess.run(["apt-get", "install", "-y", "-q", "nginx"], **quiet)  # type: ignore[call-overload]
    return _nginx_path()


def litellm_binary(install: bool) -> Path | None:
    exe = VENV / "bin" / "litellm"
    if exe.exists() or not install:
        return exe if exe.exists() else None
    print(f"installing LiteLLM's proxy into {VENV} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
        check=True,
    )
    return exe if exe.exists() else None


def litellm_config(engines: dict[str, str]) -> str:
    lines = ["model_list:"]
    for name, url in engines.items():
        lines += [
            f"  - model_name: {name}",
            "    litellm_params:",
            f"      model: openai/{name}",
            f"      api_base: {url}/v1",
            f"      api_key: {ENGINE_KEY}",
        ]
    # No retries, no callbacks: the least LiteLLM does per request.
    lines += ["litellm_settings:", "  num_retries: 0", "  telemetry: false"]
    lines += ["general_settings:", f"  master_key: {LITELLM_KEY}", ""]
    return "\n".join(lines)


# ---- the load -----------------------------------------------------------------------------

_FIRST_TOKEN = re.compile(rb'"content":\s*"[^"]')


@dataclass
class Samples:
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    # Over the whole run, warm-up included: requests answered, and the CPU
    # time the server (the proxy, or the engine for direct calls) spent.
    answered: int = 0
    cpu_s: float = 0.0

    def add(self, other: Samples) -> None:
        self.latency += other.latency
        self.ttft += other.ttft
        self.errors += other.errors
        self.seconds += other.seconds
        self.answered += other.answered
        self.cpu_s += other.cpu_s


async def load(
    url: str,
    data: bytes,
    stream: bool,
    clients: int,
    duration: float,
    key: str = ENGINE_KEY,
    warmup: float = 0.5,
    tls: ssl.SSLContext | None = None,
    answer_s: float = 0.0,
) -> Samples:
    """``clients`` loops sending requests back to back, then ``duration`` s measured.

    Clients start at random within ``warmup`` or one answer (``answer_s``),
    whichever is longer; the measured window opens one answer after that,
    when every client's first request has ended: the first request of a
    client opens the proxy's connection to the engine (with TLS, a
    handshake: about a millisecond of the gateway's CPU each, 64 at once),
    which a client at a steady load does not pay again.
    Counts the requests that ended in the measured window:
    in a closed loop at a steady state that is the throughput, and their
    latencies are what a client saw. Requests still running at the end are
    cut; a proxy that falls far behind (LiteLLM at 256 streams) shows as few
    completions, not as a run that never ends. ``tls``: the client context
    for an https URL (``direct-tls``).
    """
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    out = Samples(seconds=duration)
    loop = asyncio.get_running_loop()
    # Starts spread over one answer at least: clients started within 0.5 s
    # of a 1 s answer would finish in step, in half of every second.
    spread = max(warmup, answer_s)
    t_measure = loop.time() + spread + answer_s
    t_end = t_measure + duration
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def one() -> None:
            t0 = loop.time()
            first: float | None = None
            try:
                async with session.post(
                    url, data=data, headers=headers, ssl=tls if tls is not None else True
                ) as r:
                    if stream:
                        async for chunk in r.content.iter_any():
                            if first is None and _FIRST_TOKEN.search(chunk):
                                first = loop.time()
                    else:
                        await r.read()
                    ok = r.status == 200 and (first is not None or not stream)
            except aiohttp.ClientError:
                ok = False
            t1 = loop.time()
            out.answered += ok
            if t_measure <= t1 <= t_end:
                if ok:
                    out.latency.append(t1 - t0)
                    if first is not None:
                        out.ttft.append(first - t0)
                else:
                    out.errors += 1

        async def worker() -> None:
            # Clients that all start at once stay in step with a paced engine
            # (265 ms a request, fast): each then answers 7 or 8 times in a 2 s
            # window depending on the phase, and the throughput jumps by 14 %
            # with a millisecond of latency. Random starts within the warm-up
            # spread them out.
            await asyncio.sleep(random.uniform(0, spread))
            while loop.time() < t_end:
                await one()

        tasks = [asyncio.create_task(worker()) for _ in range(clients)]
        await asyncio.wait(tasks, timeout=max(0.0, t_end - loop.time()) + 0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def _tree(pid: int) -> list[int]:
    """A process and its descendants (nginx's worker, LiteLLM's)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            for child in task.read_text().split():
                out += _tree(int(child))
    return out


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def settle(pids: list[int], limit: float = 15.0) -> None:
    """Wait until the servers are idle: a proxy still working off the requests
    cut at the end of a run would take CPU from the next run's target."""
    deadline = time.monotonic() + limit
    before = _cpu_ticks(pids)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _cpu_ticks(pids)
        if now - before <= 1:  # 10 ms of CPU in 200 ms
            return
        before = now


def pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(sorted(xs), n=100, method="inclusive")[q - 1]


def round_order(targets: list[str], rnd: int) -> list[str]:
    """The targets in another order each round (the first as given), the same
    in every run of the benchmark. In one fixed order a target had the same
    slot in every round, after the same neighbour on a shared engine, so
    whatever the machine did at that moment was always its own: two runs in
    that order put gateway-plain@039fa63 0.3 ms below gateway-plain at 64 paced
    clients, and below nginx and the floor, where six alternating rounds of
    the two gateways alone put them 0.01 ms apart."""
    if rnd == 0:
        return list(targets)
    order = list(targets)
    random.Random(rnd).shuffle(order)
    return order


def summarize(s: Samples) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(s.latency) * 1000 if s.latency else float("nan"),
        "p99_ms": pct(s.latency, 99) * 1000,
        "ttft_p50_ms": statistics.median(s.ttft) * 1000 if s.ttft else float("nan"),
        "ttft_p99_ms": pct(s.ttft, 99) * 1000,
        "rps": len(s.latency) / s.seconds if s.seconds else 0.0,
        "errors": float(s.errors),
        "n": float(len(s.latency)),
        "cpu_us": s.cpu_s / s.answered * 1e6 if s.answered else float("nan"),
    }


# ---- the run ------------------------------------------------------------------------------


def _pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    if not cpus:
        return None

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--duration", type=float, default=2.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per target and case")
    p.add_argument("--bare", action="store_true", help="also a bare aiohttp proxy")
    p.add_argument("--floor", action="store_true",
                   help="also the floor: the least a proxy on the gateway's own stack "
                   "(uvloop, httptools) does (bench/floor_proxy.py)")
    p.add_argument("--no-nginx", action="store_true")
    p.add_argument("--no-litellm", action="store_true")
    p.add_argument("--no-install", action="store_true", help="use nginx/LiteLLM only if present")
    p.add_argument("--no-pin", action="store_true", help="do not pin proxies to a CPU of their own")
    p.add_argument("--only", default="", help="comma-separated targets to run (and direct)")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="engines to run (paced,fast,instant)"
    )
    p.add_argument("--modes", default=",".join(MODES), help="modes to run (plain,stream)")
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="client counts")
    p.add_argument(
        "--profile",
        default="",
        help="write the gateway's cProfile stats (CPU time) here (gateway-plain's: "
        "PATH.plain, gateway-keyed's: PATH.keyed)",
    )
    p.add_argument(
        "--engine-plain",
        action="store_true",
        help="also the gateway on plain-HTTP engines (gateway-plain): what TLS to the "
        "engines costs it",
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also a gateway with tracing on (every request a span, exported to a sink "
        "process that drops them) and one whose spans are made but never exported",
    )
    p.add_argument(
        "--against",
        default="",
        metavar="COMMIT",
        help="also that commit's gateway (a git worktree under /tmp) in each form this run "
        "has (gateway, gateway-plain, gateway-keyed), as FORM@COMMIT, each compared with "
        "this tree's in the same form (implies --engine-plain)",
    )
    p.add_argument(
        "--keyed",
        action="store_true",
        help="also gateway-keyed: keys, access rules and quotas on (results: gateway_keyed)",
    )
    p.add_argument(
        "--gateway-python",
        default="",
        metavar="PYTHON",
        help="also the gateway on the TLS engines run by that interpreter (one with "
        "the project's requirements installed), as gateway@pyX.Y",
    )
    p.add_argument("--collector", default="", help=argparse.SUPPRESS)
    p.add_argument("--serve-sink", help=argparse.SUPPRESS)
    p.add_argument("--serve-gateway", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--serve-bare", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_gateway:
        serve_gateway(
            int(args.serve_gateway[0]),
            json.loads(args.serve_gateway[1]),
            args.profile,
            args.collector,
        )
        return 0
    if args.serve_sink:
        serve_sink(int(args.serve_sink))
        return 0
    if args.serve_bare:
        serve_bare(int(args.serve_bare[0]), args.serve_bare[1])
        return 0

    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus: set[int] | None = None
    other_cpus: set[int] | None = None
    if len(cpus) >= 2 and not args.no_pin:
        proxy_cpus, other_cpus = {cpus[-1]}, set(cpus[:-1])
        os.sched_setaffinity(0, other_cpus)
    load_avg = os.getloadavg()[0]

    nginx = None if args.no_nginx else find_nginx(not args.no_install)
    litellm = None if args.no_litellm else litellm_binary(not args.no_install)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs: list[subprocess.Popen[bytes]] = []
    # target -> engine name -> chat completions URL
    targets: dict[str, dict[str, str]] = {}
    # target -> engine name -> the client context for an https URL (direct-tls).
    target_tls: dict[str, dict[str, ssl.SSLContext]] = {}
    # (target, engine) -> the process that serves it, for its CPU time.
    server_pid: dict[tuple[str, str], int] = {}

    def start(cmd: list[str], cpus_: set[int] | None, **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=kw.pop("env", env), preexec_fn=_pinned(cpus_), **kw)
        procs.append(proc)
        return proc

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmpd:
        tmp = Path(tmpd)
        try:
            tls = BenchTLS.make(tmp, list(ENGINES))
            # The same engines twice: plain (the references) and TLS (the gateway's).
            engines: dict[str, str] = {}
            tls_engines: dict[str, str] = {}
            waits: list[tuple[str, subprocess.Popen[bytes], ssl.SSLContext | None]] = []
            for name, (first, delay) in ENGINES.items():
                for target, urls, ctx in (
                    ("direct", engines, None),
                    ("direct-tls", tls_engines, tls.client(name)),
                ):
                    port = free_port()
                    urls[name] = f"{'https' if ctx else 'http'}://127.0.0.1:{port}"
                    cmd = [
                        sys.executable, "-m", "llmgw_slurm.testing.engine", "--port", str(port),
                        "--api-key", ENGINE_KEY, "--served-name", name,
                        "--token-delay", str(delay), "--first-token-delay", str(first),
                    ]  # fmt: skip
                    cmd += tls.engine_args(name) if ctx else []
                    # Its stderr is noise: a traceback for each stream cut at the end of a run.
                    proc = start(cmd, other_cpus, stderr=subprocess.DEVNULL)
                    server_pid[(target, name)] = proc.pid
                    waits.append((urls[name] + "/health", proc, ctx))
            targets["direct"] = {n: f"{u}/v1/chat/completions" for n, u in engines.items()}
            targets["direct-tls"] = {n: f"{u}/v1/chat/completions" for n, u in tls_engines.items()}
            target_tls["direct-tls"] = {n: tls.client(n) for n in ENGINES}

            gateways = [("gateway", gateway_spec(tls_engines, tls))]
            if args.engine_plain or args.against:
                gateways.append(("gateway-plain", gateway_spec(engines, None)))
            bench_key = ENGINE_KEY
            if args.keyed:
                from llmgw_slurm.auth.keys import add_key

                bench_key = add_key(tmp / "keys.json", "bench", "bench").key
                files = {"keys_file": str(tmp / "keys.json"), "budgets_file": str(tmp / "q.json")}
                gateways.append(("gateway-keyed", gateway_spec(tls_engines, tls, files)))
            python = {t: sys.executable for t, _ in gateways}
            if args.gateway_python:
                target = "gateway@py" + python_version(args.gateway_python)
                gateways.append((target, gateway_spec(tls_engines, tls)))
                python[target] = args.gateway_python
            for target, spec in gateways:
                g_port = free_port()
                cmd = [python[target], __file__, "--serve-gateway", str(g_port), spec]
                if args.profile:
                    # gateway-plain's and gateway-keyed's beside it, to set what TLS and
                    # keys cost function by function (PATH.plain, PATH.keyed).
                    out = Path(args.profile).resolve()
                    suffix = target.removeprefix("gateway").replace("-", ".")
                    cmd += ["--profile", str(out.with_name(out.name + suffix))]
                gw = start(cmd, proxy_cpus)
                waits.append((f"http://127.0.0.1:{g_port}/health", gw, None))
                server_pid |= {(target, n): gw.pid for n in engines}
                targets[target] = {
                    n: f"http://127.0.0.1:{g_port}/v1/chat/completions" for n in engines
                }
            # The other commit's gateway in each form of this tree's (plain, TLS,
            # keyed), served by that tree's own script.
            for target, spec in gateways if args.against else []:
                if "@py" in target:
                    continue
                other = f"{target}@{args.against}"
                g_port = free_port()
                gw = start(
                    other_gateway_cmd(args.against, g_port, spec),
                    proxy_cpus,
                    env=dict(os.environ, PYTHONPATH=str(worktree(args.against))),
                )
                waits.append((f"http://127.0.0.1:{g_port}/health", gw, None))
                server_pid |= {(other, n): gw.pid for n in engines}
                targets[other] = {
                    n: f"http://127.0.0.1:{g_port}/v1/chat/completions" for n in engines
                }

            if args.tracing:
                s_port = free_port()
                sink = f"http://127.0.0.1:{s_port}"
                cmd = [sys.executable, __file__, "--serve-sink", str(s_port)]
                waits.append((sink + "/health", start(cmd, other_cpus), None))
                for target, collector in (
                    ("gateway-traced", sink),
                    ("gateway-spans-only", "drop"),
                    # Tracing on as shipped: router.trace_requests "sampled".
                    ("gateway-traced-default", "sampled:" + sink),
                    # Every request a span, one trace in twenty kept.
                    ("gateway-traced-5pct", "ratio:0.05:" + sink),
                ):
                    t_port = free_port()
                    cmd = [
                        sys.executable, __file__, "--serve-gateway", str(t_port),
                        gateway_spec(tls_engines, tls), "--collector", collector,
                    ]  # fmt: skip
                    traced = start(cmd, proxy_cpus)
                    waits.append((f"http://127.0.0.1:{t_port}/health", traced, None))
                    server_pid |= {(target, n): traced.pid for n in engines}
                    targets[target] = {
                        n: f"http://127.0.0.1:{t_port}/v1/chat/completions" for n in engines
                    }

            if args.bare:
                targets["aiohttp-bare"] = {}
                for name, url in engines.items():
                    b_port = free_port()
                    cmd = [sys.executable, __file__, "--serve-bare", str(b_port), url]
                    bare = start(cmd, proxy_cpus)
                    server_pid[("aiohttp-bare", name)] = bare.pid
                    waits.append((f"http://127.0.0.1:{b_port}/health", bare, None))
                    targets["aiohttp-bare"][name] = f"http://127.0.0.1:{b_port}/v1/chat/completions"

            if args.floor:
                targets["floor"] = {}
                for name, url in engines.items():
                    f_port = free_port()
                    cmd = [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), str(f_port),
                           url, ENGINE_KEY]  # fmt: skip
                    floor = start(cmd, proxy_cpus)
                    server_pid[("floor", name)] = floor.pid
                    waits.append((f"http://127.0.0.1:{f_port}/health", floor, None))
                    targets["floor"][name] = f"http://127.0.0.1:{f_port}/v1/chat/completions"

            if nginx is not None:
                servers, urls = [], {}
                for name, url in engines.items():
                    n_port = free_port()
                    servers.append(
                        _NGINX_SERVER.format(
                            name=name,
                            port=n_port,
                            engine_port=url.rsplit(":", 1)[1],
                            key=ENGINE_KEY,
                        )
                    )
                    urls[name] = f"http://127.0.0.1:{n_port}"
                conf = tmp / "nginx.conf"
                conf.write_text(_NGINX_HTTP.format(dir=tmp, servers="".join(servers)))
                ng = start(
                    [nginx, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"],
                    proxy_cpus,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                waits += [(url + "/health", ng, None) for url in urls.values()]
                server_pid |= {("nginx", n): ng.pid for n in engines}
                targets["nginx"] = {n: f"{u}/v1/chat/completions" for n, u in urls.items()}

            if litellm is not None:
                l_port = free_port()
                cfg = tmp / "litellm.yaml"
                cfg.write_text(litellm_config(engines))
                l_env = dict(
                    os.environ,
                    # The model price map ships with the package: no fetch at start-up.
                    LITELLM_LOCAL_MODEL_COST_MAP="True",
                    LITELLM_LOG="ERROR",
                    DISABLE_SCHEMA_UPDATE="True",
                )
                l_env.pop("PYTHONPATH", None)
                lp = start(
                    [str(litellm), "--config", str(cfg), "--host", "127.0.0.1",
                     "--port", str(l_port), "--num_workers", "1"],
                    proxy_cpus,
                    env=l_env,
                    stdout=open(tmp / "litellm.log", "wb"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
                waits.append((f"http://127.0.0.1:{l_port}/health/liveliness", lp, None))
                server_pid |= {("litellm", n): lp.pid for n in engines}
                targets["litellm"] = {
                    n: f"http://127.0.0.1:{l_port}/v1/chat/completions" for n in engines
                }

            for url, proc, ctx in waits:
                try:
                    wait_http(url, proc, timeout=120, context=ctx)
                except RuntimeError:
                    log = tmp / "litellm.log"
                    if proc is procs[-1] and log.exists():
                        print(log.read_text()[-3000:], file=sys.stderr)
                    raise
            if args.only:
                keep = {"direct", *args.only.split(",")}
                targets = {k: v for k, v in targets.items() if k in keep}

            pids = [pr.pid for pr in procs]
            print(
                f"targets: {', '.join(targets)}; {len(cpus)} CPUs"
                + (f", proxies on CPU {sorted(proxy_cpus)}" if proxy_cpus else "")
                + f"; load average {load_avg:.2f}",
                flush=True,
            )
            pooled: dict[tuple[str, str, str, int], Samples] = {}
            t_start = time.monotonic()
            for rnd in range(args.rounds):
                for engine in args.engines.split(","):
                    for mode in args.modes.split(","):
                        for clients in map(int, args.clients.split(",")):
                            for target in round_order(list(targets), rnd):
                                urls = targets[target]
                                data = body(engine, mode == "stream")
                                key = LITELLM_KEY if target == "litellm" else ENGINE_KEY
                                key = bench_key if target.startswith("gateway-keyed") else key
                                tree = _tree(server_pid[(target, engine)])
                                cpu0 = _cpu_ticks(tree)
                                s = asyncio.run(
                                    load(urls[engine], data, mode == "stream", clients,
                                         run_seconds(engine, args.duration), key,
                                         tls=target_tls.get(target, {}).get(engine),
                                         answer_s=answer_seconds(engine))
                                )  # fmt: skip
                                s.cpu_s = (_cpu_ticks(tree) - cpu0) * _TICK_S
                                pooled.setdefault((target, engine, mode, clients), Samples()).add(s)
                                settle(pids)
                print(
                    f"round {rnd + 1}/{args.rounds} done at {time.monotonic() - t_start:.0f} s",
                    flush=True,
                )
        finally:
            # Last started first: the traced gateways flush to the sink as they stop.
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    measured = {k: summarize(v) for k, v in pooled.items()}
    report(measured, list(targets), load_avg)
    return 0


def report(
    measured: dict[tuple[str, str, str, int], dict[str, float]], targets: list[str], load_avg: float
) -> None:
    results: list[dict[str, Any]] = []
    print(
        f"\n{'target':18s} {'engine':7s} {'mode':6s} {'clients':>7s} {'p50 ms':>8s} {'+ms':>7s} "
        f"{'p99 ms':>8s} {'+ms':>7s} {'ttft50':>7s} {'+ms':>7s} {'ttft99':>7s} {'+ms':>7s} "
        f"{'req/s':>7s} {'x direct':>8s} {'cpu us':>7s} {'err':>4s}"
    )
    for engine in ENGINES:
        for mode in MODES:
            for clients in CLIENTS:
                if ("direct", engine, mode, clients) not in measured:
                    continue
                ref = measured[("direct", engine, mode, clients)]
                for target in targets:
                    m = measured[(target, engine, mode, clients)]
                    case = f"{engine}.{mode}.c{clients}"
                    d = {
                        k: m[k] - ref[k] for k in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms")
                    }
                    ratio = m["rps"] / ref["rps"] if ref["rps"] else float("nan")
                    print(
                        f"{target:18s} {engine:7s} {mode:6s} {clients:7d} {m['p50_ms']:8.2f} "
                        f"{d['p50_ms']:7.2f} {m['p99_ms']:8.2f} {d['p99_ms']:7.2f} "
                        f"{m['ttft_p50_ms']:7.2f} {d['ttft_p50_ms']:7.2f} {m['ttft_p99_ms']:7.2f} "
                        f"{d['ttft_p99_ms']:7.2f} {m['rps']:7.0f} {ratio:8.2f} "
                        f"{m['cpu_us']:7.0f} {m['errors']:4.0f}"
                    )
                    if target == "direct":
                        continue
                    metrics = [
                        ("p50_ms", "p50"),
                        ("p99_ms", "p99"),
                        ("rps", "rps"),
                        ("cpu_us", "cpu"),
                    ]
                    if mode == "stream":
                        metrics += [("ttft_p50_ms", "ttft_p50"), ("ttft_p99_ms", "ttft_p99")]
                    for key, short in metrics:
                        if m[key] == m[key] and ref[key] == ref[key]:  # not NaN
                            unit = {"rps": "req/s", "cpu_us": "us/request"}.get(key, "ms")
                            results.append(
                                result(f"{target}.{case}.{short}", m[key], unit,
                                       f"direct.{case}.{short}", ref[key])
                            )  # fmt: skip
                    if engine == "paced" and clients == 64:
                        for key, goal in (
                            ("p50_ms", GOAL_ADDED_P50_MS),
                            ("p99_ms", GOAL_ADDED_P99_MS),
                        ):
                            results.append(
                                result(f"{target}.{case}.added_{key}", d[key], "ms", "goal", goal)
                            )
            print()
    # (b): the most requests per second each proxy sustains with the instant engine.
    best: dict[str, float] = {}
    for target in targets:
        for mode, sfx in (("plain", ""), ("stream", ".stream")):
            best[target + sfx] = max(
                (
                    measured[k]["rps"]
                    for c in CLIENTS
                    if (k := (target, "instant", mode, c)) in measured
                ),
                default=float("nan"),
            )
    if "nginx" in targets:
        for target in targets:
            if target in ("direct", "nginx"):
                continue
            for sfx in ("", ".stream"):
                results.append(
                    result(f"{target}.instant{sfx}.max_rps", best[target + sfx], "req/s",
                           f"nginx.instant{sfx}.max_rps", best["nginx" + sfx])
                )  # fmt: skip
    print("most req/s with the instant engine (plain, stream): " + "; ".join(
        f"{t} {best[t]:.0f}, {best[t + '.stream']:.0f}" for t in targets
    ))  # fmt: skip

    for target in targets:
        if target in ("gateway", "gateway-plain", "gateway-keyed") or "@py" in target:
            print_goals(measured, best, target, "nginx" in targets)
    if "gateway-plain" in targets:
        results += tls_cost(measured)
    for other in targets:
        if other.startswith("gateway") and "@" in other and "@py" not in other:
            results += against_other(measured, other)
    # Tracing's cost: each traced gateway against the untraced one, same cases.
    traced = [t for t in targets if t.startswith(("gateway-traced", "gateway-spans"))]
    if traced and "gateway" in targets:
        print("\ntracing (req/s and CPU per request, against the gateway with tracing off):")
        for (target, engine, mode, clients), m in sorted(measured.items()):
            if target not in traced:
                continue
            off = measured[("gateway", engine, mode, clients)]
            case = f"{engine}.{mode}.c{clients}"
            print(
                f"  {target:24s} {case:20s} req/s {m['rps'] / off['rps']:.3f}, "
                f"CPU/request {m['cpu_us'] / off['cpu_us']:.3f}"
            )
            results.append(result(f"{target}.{case}.rps_vs_off", m["rps"], "req/s",
                                  f"gateway.{case}.rps", off["rps"]))  # fmt: skip
    if "gateway-keyed" in targets and "gateway" in targets:
        print("\nkeys, access rules and quotas on (against the gateway with them off):")
        for (target, engine, mode, clients), m in sorted(measured.items()):
            if target != "gateway-keyed":
                continue
            off = measured[("gateway", engine, mode, clients)]
            case = f"{engine}.{mode}.c{clients}"
            print(
                f"  {case:20s} req/s {m['rps'] / off['rps']:.3f}, "
                f"CPU/request {m['cpu_us'] / off['cpu_us']:.3f}, "
                f"p50 {m['p50_ms'] - off['p50_ms']:+.2f} ms"
            )
            results.append(result(f"gateway-keyed.{case}.rps_vs_off", m["rps"], "req/s",
                                  f"gateway.{case}.rps", off["rps"]))  # fmt: skip
            results.append(result(f"gateway-keyed.{case}.cpu_vs_off", m["cpu_us"], "us/request",
                                  f"gateway.{case}.cpu", off["cpu_us"]))  # fmt: skip
    for target in targets:
        for mode in MODES:
            g = measured.get((target, "instant", mode, 64))
            n = measured.get(("nginx", "instant", mode, 64))
            if target.startswith(("gateway", "floor")) and g is not None and n is not None:
                results.append(result(f"{target}.instant.{mode}.c64.cpu_vs_nginx", g["cpu_us"],
                                      "us/request", f"nginx.instant.{mode}.c64.cpu", n["cpu_us"]))
            f = measured.get(("floor", "instant", mode, 64))
            if target.startswith("gateway") and g is not None and f is not None:
                print(f"CPU {'a request' if mode == 'plain' else 'a stream'} (instant, 64): "
                      f"{target} {g['cpu_us'] / f['cpu_us']:.2f}x the floor's"
                      + (f", the floor {f['cpu_us'] / n['cpu_us']:.2f}x nginx's" if n else ""))
                results.append(result(f"{target}.instant.{mode}.c64.cpu_vs_floor", g["cpu_us"],
                                      "us/request", f"floor.instant.{mode}.c64.cpu", f["cpu_us"]))
    # A run against another commit is the whole comparison (docs/performance.md quotes it).
    name = "gateway_keyed" if "gateway-keyed" in targets else "gateway"
    name = "gateway_floor" if "floor" in targets else name
    path = write(
        "gateway" if any("@" in t and "@py" not in t for t in targets) else name,
        results,
        {"argv": sys.argv[1:], "targets": targets},
    )
    print(f"wrote {path} (load average at start {load_avg:.2f})")


def python_version(python: str) -> str:
    """X.Y of an interpreter, for the name of the gateway it runs."""
    out = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def print_goals(
    measured: dict[tuple[str, str, str, int], dict[str, float]],
    best: dict[str, float],
    target: str,
    nginx: bool,
) -> None:
    """The goals for one gateway target: paced engine, 64 clients, against direct."""
    if not any((target, "paced", m, 64) in measured for m in MODES):
        return
    print(f"\ngoals ({target}, paced engine, 64 clients, against direct):")
    for mode in MODES:
        if (target, "paced", mode, 64) not in measured:
            continue
        g = measured[(target, "paced", mode, 64)]
        r = measured[("direct", "paced", mode, 64)]
        added = g["p50_ms"] - r["p50_ms"]
        print(
            f"  {mode:6s}: added p50 {added:+.2f} ms (goal < {GOAL_ADDED_P50_MS}), "
            f"added p99 {g['p99_ms'] - r['p99_ms']:+.2f} ms (goal < {GOAL_ADDED_P99_MS}), "
            f"throughput {g['rps'] / r['rps']:.3f} of direct (goal >= {GOAL_THROUGHPUT})"
        )
        t = measured.get(("direct-tls", "paced", mode, 64))
        if t is not None and target == "gateway":
            print(
                f"  {'':6s}  against direct-tls: added p50 {g['p50_ms'] - t['p50_ms']:+.2f} ms, "
                f"p99 {g['p99_ms'] - t['p99_ms']:+.2f} ms, throughput {g['rps'] / t['rps']:.3f}"
            )
    if nginx:
        for sfx in ("", ".stream"):
            print(
                f"  instant{sfx or '.plain'}: {best[target + sfx]:.0f} req/s = "
                f"{best[target + sfx] / best['nginx' + sfx]:.2f} of nginx's "
                f"{best['nginx' + sfx]:.0f} (goal >= {GOAL_MAX_RPS_VS_NGINX})"
            )
        for mode in MODES:
            g = measured.get((target, "instant", mode, 64))
            n = measured.get(("nginx", "instant", mode, 64))
            if g is not None and n is not None:
                print(
                    f"  instant.{mode}: CPU {g['cpu_us']:.0f} us a request = "
                    f"{g['cpu_us'] / n['cpu_us']:.2f} of nginx's {n['cpu_us']:.0f} "
                    f"(goal <= {GOAL_CPU_VS_NGINX}, like for like on plain engines)"
                )


def other_gateway_cmd(commit: str, port: int, spec: str) -> list[str]:
    """That tree's own gateway process, as its bench script serves it (``spec``:
    this tree's ``gateway_spec``, which that script reads alike since it has one).

    Before the engines served TLS, the script took the plain engines' URLs
    where it now takes a spec with them.
    """
    script = worktree(commit) / "bench" / "gateway.py"
    if "def gateway_spec" not in script.read_text():
        spec = json.dumps(json.loads(spec)["engines"])
    return [sys.executable, str(script), "--serve-gateway", str(port), spec]


def against_other(
    measured: dict[tuple[str, str, str, int], dict[str, float]], other: str
) -> list[dict[str, Any]]:
    """This tree's gateway against another commit's (``other``: TARGET@COMMIT),
    in the same form, same cases."""
    mine = other.partition("@")[0]
    print(f"\nthis tree against {other} ({mine}, same run; ratios this / other):")
    out = []
    for (target, engine, mode, clients), m in sorted(measured.items()):
        if target != mine or (other, engine, mode, clients) not in measured:
            continue
        o = measured[(other, engine, mode, clients)]
        d = measured[("direct", engine, mode, clients)]
        case = f"{engine}.{mode}.c{clients}"
        print(
            f"  {case:20s} added p50 {m['p50_ms'] - d['p50_ms']:+.2f} vs "
            f"{o['p50_ms'] - d['p50_ms']:+.2f} ms, "
            f"req/s {m['rps'] / (o['rps'] or float('nan')):.3f}, "
            f"CPU/request {m['cpu_us'] / (o['cpu_us'] or float('nan')):.3f}"
        )
        for key, short, unit in (
            ("rps", "rps", "req/s"),
            ("cpu_us", "cpu", "us/request"),
            ("p50_ms", "p50", "ms"),
            ("p99_ms", "p99", "ms"),
        ):
            out.append(result(f"{mine}.{case}.{short}_vs_other", m[key], unit,
                              f"{other}.{case}.{short}", o[key]))  # fmt: skip
    return out


def tls_cost(measured: dict[tuple[str, str, str, int], dict[str, float]]) -> list[dict[str, Any]]:
    """What TLS to the engines costs the gateway: gateway against gateway-plain, same cases."""
    print("\nTLS to the engines (gateway against gateway-plain, same run):")
    out = []
    for (target, engine, mode, clients), m in sorted(measured.items()):
        if target != "gateway" or ("gateway-plain", engine, mode, clients) not in measured:
            continue
        plain = measured[("gateway-plain", engine, mode, clients)]
        case = f"{engine}.{mode}.c{clients}"
        print(
            f"  {case:20s} p50 {m['p50_ms'] - plain['p50_ms']:+.2f} ms, "
            f"p99 {m['p99_ms'] - plain['p99_ms']:+.2f} ms, "
            f"req/s {m['rps'] / (plain['rps'] or float('nan')):.3f}, "
            f"CPU/request {m['cpu_us']:.0f} vs {plain['cpu_us']:.0f} us"
        )
        for key, short, unit in (("rps", "rps", "req/s"), ("cpu_us", "cpu", "us/request")):
            out.append(result(f"gateway.{case}.{short}_vs_plain", m[key], unit,
                              f"gateway-plain.{case}.{short}", plain[key]))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
