"""The daemon: one process holding the reconciler, the gateway and the internal API.

Two listeners: the gateway (OpenAI API, ``/metrics``, the status API for the
``llmgw`` CLI) and the internal API that agents on compute nodes report to.
They are separate ports so that a site can open the one to researchers and the
other to compute nodes only. The reconciler runs as a task on the same event
loop; Slurm calls are subprocesses awaited asynchronously, so a slow slurmctld
never blocks a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import gc
import logging
import os
import resource
import signal
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from llmgw_slurm.accounting.quota import QuotaBook, quota_book
from llmgw_slurm.accounting.usage import UsageSink, UsageStore
from llmgw_slurm.api import charts, routes, traces
from llmgw_slurm.auth import identity, private
from llmgw_slurm.auth.keys import KeyRing
from llmgw_slurm.auth.login import add_login_routes, login_settings, sacctmgr_associations
from llmgw_slurm.auth.secrets import AdminToken, load_or_create_server_key, replica_secret
from llmgw_slurm.base import sdnotify
from llmgw_slurm.base.errors import LlmgwError
from llmgw_slurm.base.sdnotify import Notifier
from llmgw_slurm.batch.jobs import BatchJobs
from llmgw_slurm.batch.setup import ReconcilerSide
from llmgw_slurm.batch.setup import install as install_batch_api
from llmgw_slurm.catalog import Catalog, load_catalog
from llmgw_slurm.config import ConnectionsConfig, HostPort, ServerConfig, load_agent_config
from llmgw_slurm.guard import (
    Acceptor,
    ConnectionLimiter,
    Faults,
    FdBudget,
    bind_listeners,
    open_fds,
    raise_open_files_limit,
)
from llmgw_slurm.guard.heap import HeapTrimmer, glibc_heap
from llmgw_slurm.guard.metrics import GuardCollector
from llmgw_slurm.reconciler.core import ROUND_FAILED, Reconciler
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.reconciler.reportroute import report_route
from llmgw_slurm.router import create_app
from llmgw_slurm.router.gateway import GATEWAY_KEY
from llmgw_slurm.router.metrics import tokens_gate
from llmgw_slurm.router.server import Runner as GatewayRunner
from llmgw_slurm.slurm import make_backends
from llmgw_slurm.tracing.otel import setup_tracing
from llmgw_slurm.tracing.store import TraceStore

if TYPE_CHECKING:
    from llmgw_slurm.db.setup import Shared

log = logging.getLogger(__name__)

RECONCILER_KEY = web.AppKey("reconciler", Reconciler)

# How both listeners run. handler_cancellation: a client that goes away stops
# being held at once. keepalive_timeout: a connection that has not sent a whole
# request (a slow-loris client, or one idle between requests) is closed after
# it; aiohttp's own default is an hour, which lets stalled connections pile up
# until the process runs out of files. A body that stalls is the gateway's
# body timeout's (router.body_timeout in server.yaml).
RUNNER_OPTIONS: dict[str, Any] = {
    "handler_cancellation": True,
    "access_log": None,
    "keepalive_timeout": 75.0,
}


def internal_app(rec: Reconciler) -> web.Application:
    app = web.Application(client_max_size=64 * 1024)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    report = report_route(
        "rid", rec.report_signed, lambda rid: replica_secret(rec.server_key, rid), rec.faults
    )
    app.router.add_post("/internal/v1/replicas/{rid:[0-9a-f]{8}}/report", report)
    app.router.add_get("/healthz", health)
    return app


def add_status_routes(app: web.Application, rec: Reconciler, shared: Shared | None = None) -> None:
    async def status(request: web.Request) -> web.Response:
        out = routes.status_json(rec, routes.caller_may_see(app, request))
        out["auth"] = routes.auth_json(app)
        return web.json_response(out)

    async def want(request: web.Request) -> web.Response:
        # A start can evict other keys' idle replicas on a full cluster: with keys
        # on, it takes one, like every other route that changes something.
        denied = routes.key_required(app, request)
        if denied is not None:
            return denied
        name = request.match_info["model"]
        canonical = rec.resolve(name)
        may_see = routes.caller_may_see(app, request)
        if canonical is not None and not may_see(canonical):
            # As for /v1: a model the key may not use is one that does not exist.
            canonical = None
        if canonical is None:
            known = ", ".join(m.name for m in rec.catalog.models if may_see(m.name))
            return web.json_response(
                {"error": {"message": f"unknown model {name!r}; known: {known}", "code": 404}},
                status=404,
            )
        rec.want(canonical)
        return web.json_response({"ok": True, "model": canonical})

    async def health(request: web.Request) -> web.Response:
        return health_answer(rec, shared, strict=request.query.get("strict") == "1")

    app.router.add_get("/api/v1/status", status)
    app.router.add_post("/api/v1/models/{model}/up", want)
    app.router.add_get("/healthz", health)


def health_answer(rec: Reconciler, shared: Shared | None, *, strict: bool) -> web.Response:
    """``/healthz``: 200 while this daemon serves. With a database: whether it reaches
    it, whether it leads; ``?strict=1`` answers 503 while it is out of touch with the
    database (a load balancer that would rather send everything to another daemon
    then; with the database down for all, every daemon is out of touch)."""
    body: dict[str, Any] = {"ok": True, "passes": rec.passes}
    if shared is None:
        return web.json_response(body)
    st = shared.status()
    ok = shared.healthy()
    body.update(
        database="ok" if ok else f"out of touch ({st['last_contact_s']}s; {st['last_error']})",
        daemon=st["this"],
        leading=st["leading"],
        leader=st["leader"],
        epoch=st["epoch"],
    )
    if strict and not ok:
        body["ok"] = False
        return web.json_response(body, status=503)
    return web.json_response(body)


@dataclass
class Daemon:
    server: ServerConfig
    server_path: Path
    catalog: Catalog
    reconciler: Reconciler
    gateway: web.Application
    internal: web.Application
    # The admin routes on the admin Unix socket (no token; the caller's uid decides).
    admin: web.Application
    admin_token: AdminToken
    # None when tracing is off (no exporter thread exists then).
    tracer_provider: TracerProvider | None = None
    # The recent traces (tracing.keep_spans); None when it is 0.
    trace_store: TraceStore | None = None
    # systemd's Type=notify; a no-op outside systemd.
    notifier: Notifier = field(default_factory=Notifier)
    # The last reload's refusal, kept in systemd's status line until a good reload.
    reload_error: str = ""
    # Returns a burst's freed heap to the kernel after a pass; None in tests
    # that build a Daemon by hand.
    heap: HeapTrimmer | None = None
    # Faults survived and connections per listener, for /metrics.
    guard: GuardCollector = field(default_factory=lambda: GuardCollector(Faults(), ()))
    # Several daemons on one database (server.yaml's database:); None: this one alone.
    shared: Shared | None = None

    def reload(self) -> str | None:
        """Re-read the catalog; a bad one is refused (its errors returned), the last good kept.

        systemd is told (RELOADING=1, then READY=1) whether it came from SIGHUP
        or from ``llmgw-admin reload``: either way the unit is reloading.
        """
        # Before the first READY=1 systemd is still starting the unit: a READY=1
        # from a reload would end the start before the first pass.
        announce = self.notifier.readied
        if announce:
            self.notifier.reloading()
        try:
            try:
                catalog = load_catalog(self.server.models, self.server.cluster_names)
            except LlmgwError as exc:
                log.error("catalog reload refused, keeping the last good one:\n%s", exc)
                self.reload_error = "last catalog reload refused (see the log)"
                return f"catalog reload refused, keeping the last good one:\n{exc}"
            self.catalog = catalog
            self.reconciler.set_catalog(catalog)
            self.reload_error = ""
            log.info("catalog reloaded: %d models", len(catalog.models))
            return None
        finally:
            if announce:
                self.notifier.ready(status_line(self))


def build(server: ServerConfig, server_path: Path) -> Daemon:
    # The models' resources.clusters must name clusters of this server.yaml.
    catalog = load_catalog(server.models, server.cluster_names)
    # Before anything makes a tracer: the global provider is set once per process.
    store = TraceStore(server.tracing.keep_spans) if server.tracing.keep_spans else None
    provider = setup_tracing(server.tracing, "llmgw-daemon", local=store)
    agent_timeout = _readiness_timeout(server)
    backends = make_backends(server.cluster_list, server.slurm.command_timeout)
    state = Path(server.state_dir).expanduser()
    # Before anything is written there: 0700 and its files 0600 whatever the
    # umask, or a clear refusal of a folder other users could write.
    private.private_dir(state)
    shared = _shared(server)
    # With a database, the key (and the gateway's identity) are the ones every
    # daemon shares, taken into the state directory by _shared.
    key = load_or_create_server_key(state / "server.key")
    daemon_url = server.listen.advertised_daemon_url(socket.getfqdn())
    # The provider's own tracer, not the global one: only the first global
    # provider of a process counts (a second daemon in one test process).
    tracer = provider.get_tracer("llmgw_slurm") if provider is not None else None
    rec = Reconciler(
        catalog,
        server,
        backends,
        key,
        daemon_url,
        hold_timeout=server.router.hold_timeout,
        agent_ready_timeout=agent_timeout,
        tracer=tracer,
        fence=shared.lease if shared is not None else None,
    )
    if shared is not None:
        shared.attach(rec.table, rec.directory, rec.pass_loop)
        rec.peers = shared.status
    keys, usage = _keys_and_usage(server, state, shared, rec.faults)
    quota = _quota(server, usage, shared) if keys is not None else None
    gateway = create_app(rec, server.router, keys=keys, usage=usage, quota=quota, tracer=tracer)
    gateway[RECONCILER_KEY] = rec
    if shared is not None:
        gateway[GATEWAY_KEY].responses = shared.response_homes()
    add_status_routes(gateway, rec, shared)
    routes.add_cli_routes(gateway, rec)
    if keys is not None and server.login.enabled:
        _add_login(gateway, server, keys, shared)
    token = AdminToken(state / "admin.token")
    token.ensure()
    scrape = (
        [AdminToken(server.router.metrics_token_file)] if server.router.metrics_token_file else []
    )
    gateway[GATEWAY_KEY].metrics_token = tokens_gate(token, *scrape)
    d = Daemon(
        server,
        server_path,
        catalog,
        rec,
        gateway,
        internal_app(rec),
        web.Application(client_max_size=64 * 1024),
        token,
        provider,
    )
    batches = shared.batch_store(server.batch_directory) if shared is not None else None
    side = ReconcilerSide(
        backends,
        lambda: rec.catalog,
        BatchJobs(server, key, daemon_url, rec.jobs.gateway_cert),
        rec.verifier,
        rec.clusters_for,
        rec.faults,
        rec.directory,
    )
    svc = install_batch_api(gateway, d.internal, server, side, usage, batches)
    if shared is not None:
        shared.share_batches(svc)
    routes.add_admin_routes(d.internal, rec.admin, routes.token_gate(token), d.reload)
    routes.add_admin_routes(d.admin, rec.admin, routes.peer_gate(server.admin_group), d.reload)
    _add_observers(d, store, shared)
    return d


def _readiness_timeout(server: ServerConfig) -> float:
    """How long an agent waits for its engine (agent.yaml), for the reconciler's own wait."""
    try:
        return load_agent_config(server.agent_config).readiness.timeout
    except LlmgwError as exc:
        log.warning(
            "agent config %s: %s (assuming a 15 min readiness timeout)", server.agent_config, exc
        )
        return 900.0


def _add_observers(d: Daemon, store: TraceStore | None, shared: Shared | None) -> None:
    """Charts, traces and the metrics beyond the gateway's own (faults, connections,
    the heap, the shared database's lease)."""
    rec, gateway, admin_gate = d.reconciler, d.gateway, routes.peer_gate(d.server.admin_group)
    prefix = d.server.slurm.job_prefix
    charts.add_chart_routes(gateway, rec.directory, rec.clusters, rec.decisions, prefix, store)
    traces.add_span_route(d.internal, rec.verifier, store)
    traces.add_trace_route(d.internal, rec, store, routes.token_gate(d.admin_token))
    traces.add_trace_route(d.admin, rec, store, admin_gate)
    d.trace_store = store
    registry = gateway[GATEWAY_KEY].metrics.registry
    d.heap = HeapTrimmer(registry, glibc_heap())
    d.guard = GuardCollector(rec.faults, ())
    registry.register(d.guard)
    d.shared = shared
    if shared is not None:
        shared.register_metrics(registry)


def _add_login(
    gateway: web.Application, server: ServerConfig, keys: KeyRing, shared: Shared | None
) -> None:
    settings = login_settings(server)
    if shared is not None:
        # Keys made and revoked in the database; known here at once, elsewhere soon.
        learned = shared.keys.learn if shared.keys is not None else None
        settings = dataclasses.replace(settings, store=shared.key_store(), learned=learned)
    add_login_routes(gateway, settings, keys.lookup, sacctmgr_associations(server))


def _keys_and_usage(
    server: ServerConfig, state: Path, shared: Shared | None, faults: Faults
) -> tuple[KeyRing | None, UsageSink]:
    """The gateway's keys (None: keys off) and usage: the state directory's, or the
    shared database's with a database: block (router.keys_file then only turns keys on)."""
    keys_on = server.router.keys_file is not None
    if shared is not None:
        return (shared.key_ring() if keys_on else None), shared.usage_store(state)
    keys = KeyRing(server.router.keys_file) if server.router.keys_file else None
    return keys, UsageStore(state / "usage.sqlite3", faults=faults)


def _quota(server: ServerConfig, usage: UsageSink, shared: Shared | None) -> QuotaBook:
    """The quota book: on its own, or counting the other gateways' spend and holds."""
    if shared is None:
        return quota_book(server, usage.queries)
    budgets, others = shared.quota_parts(usage)
    book = quota_book(server, usage.queries, budgets=budgets, others=others)
    others.book = book
    return book


def _shared(server: ServerConfig) -> Shared | None:
    """The daemon's share of the database (checked now: a daemon that cannot use it
    does not start); None without a database: block."""
    if server.database is None:
        return None
    # Imported here: psycopg is needed only with a database.
    from llmgw_slurm.db.setup import prepare

    return prepare(server, server.listen.gateway.port, server.slurm.command_timeout)


@dataclass
class Listeners:
    """The daemon's three ways in, open; :meth:`close` ends them and withdraws daemon.json."""

    runners: list[web.AppRunner | GatewayRunner]
    runtime_dir: Path
    admin_socket: Path
    socket_inode: int = 0
    # The gateway's and the internal port's accept loops, with their bounds.
    acceptors: list[Acceptor] = field(default_factory=list)

    async def close(self) -> None:
        # First: from here on a CLI finds no daemon.json and sends nothing.
        identity.unpublish(self.runtime_dir, os.getpid())
        for a in self.acceptors:
            a.stop_accepting()
        for r in self.runners:
            await r.cleanup()
        for a in self.acceptors:
            a.abort_all()
        with contextlib.suppress(OSError):
            # Only ours: a newer daemon may have bound the path since.
            if self.admin_socket.stat().st_ino == self.socket_inode:
                self.admin_socket.unlink()


def _tls_context(server: ServerConfig) -> ssl.SSLContext | None:
    tls = server.tls
    if tls.cert is None or tls.key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise LlmgwError(
            f"tls: cannot load the certificate {tls.cert} with the key {tls.key}: {exc}; "
            "give a PEM certificate (chain) and its private key, readable by the daemon's user"
        ) from None
    return ctx


def _inherited(
    sockets: list[tuple[str, socket.socket]], name: str, hp: HostPort
) -> socket.socket | None:
    """The socket systemd passed for ``name``: by its FileDescriptorName, else by its port."""
    for label, sock in sockets:
        if label == name:
            return sock
    # One .socket unit with two ListenStream= gives both the unit's name: told apart by port.
    for label, sock in sockets:
        addr = sock.getsockname()
        if label not in ("gateway", "internal") and isinstance(addr, tuple) and addr[1] == hp.port:
            return sock
    return None


async def open_listeners(
    d: Daemon, inherited: list[tuple[str, socket.socket]] | None = None
) -> Listeners:
    """Listen on the gateway and internal ports (systemd's sockets when it passed them),
    within the connection bounds, and on the admin socket; then publish daemon.json
    for the CLIs' checks."""
    server = d.server
    inherited = sdnotify.listen_fds() if inherited is None else inherited
    runtime = server.effective_runtime_dir()
    private.public_dir(runtime)
    admin_path = server.effective_admin_socket()
    tls = _tls_context(server)
    out = Listeners([], runtime, admin_path)
    try:
        limiters = connection_limiters(server.connections)
        # The gateway's connections meet its own server (router.server), aiohttp's
        # application behind it; the internal API is aiohttp's alone.
        gateway = GatewayRunner(d.gateway, **RUNNER_OPTIONS)
        await gateway.setup()
        out.runners.append(gateway)
        out.acceptors.append(
            _accept("gateway", gateway.protocol, inherited, server.listen.gateway,
                    limiters["gateway"], tls)
        )
        internal = web.AppRunner(d.internal, **RUNNER_OPTIONS)
        await internal.setup()
        out.runners.append(internal)
        factory = internal.server
        assert factory is not None, "the runner is set up"
        out.acceptors.append(
            _accept("internal", factory, inherited, server.listen.internal,
                    limiters["internal"], None)
        )
        d.guard.acceptors = list(out.acceptors)
        runner = web.AppRunner(d.admin, **RUNNER_OPTIONS)
        await runner.setup()
        out.runners.append(runner)
        admin_sock = identity.bind_unix(admin_path)
        out.socket_inode = admin_path.stat().st_ino
        await web.SockSite(runner, admin_sock).start()
        identity.publish(
            runtime,
            identity.DaemonInfo(
                uid=os.geteuid(),
                pid=os.getpid(),
                gateway_port=out.acceptors[0].port or server.listen.gateway.port,
                internal_port=out.acceptors[1].port or server.listen.internal.port,
                tls=tls is not None,
                admin_socket=str(admin_path),
            ),
        )
    except BaseException:
        await out.close()
        raise
    return out


def connection_limiters(cfg: ConnectionsConfig) -> dict[str, ConnectionLimiter]:
    """The gateway's and the internal port's bounds, from the open-files limit now."""
    budget = FdBudget.share(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0], cfg.reserve_fds, open_fds()
    )
    gateway = cfg.max_gateway or budget.gateway
    internal = cfg.max_internal or budget.internal
    log.info(
        "connections: %s; gateway %d, internal %d, %d per peer, %gs for a request head",
        budget.describe(),
        gateway,
        internal,
        cfg.per_peer,
        cfg.head_timeout,
    )
    return {
        "gateway": ConnectionLimiter("gateway", gateway, cfg.per_peer, cfg.head_timeout),
        "internal": ConnectionLimiter("internal", internal, cfg.per_peer, cfg.head_timeout),
    }


def _accept(
    name: str,
    factory: Callable[[], asyncio.BaseProtocol],
    inherited: list[tuple[str, socket.socket]],
    hp: HostPort,
    limiter: ConnectionLimiter,
    ctx: ssl.SSLContext | None,
) -> Acceptor:
    """Accept on the port ``name`` (systemd's socket, else one bound here), each
    connection served by a protocol ``factory`` makes."""
    sock = _inherited(inherited, name, hp)
    if sock is not None:
        log.info("%s: the socket systemd passed (%s)", name, sock.getsockname())
        socks = [sock]
    else:
        try:
            socks = bind_listeners(hp.host, hp.port)
        except OSError as err:
            raise LlmgwError(f"listen.{name}: {err.strerror or err}") from None
    acceptor = Acceptor(socks, factory, limiter, ssl=ctx)
    acceptor.start()
    return acceptor


async def _start_shared(
    d: Daemon, listeners: Listeners, stop: asyncio.Event
) -> asyncio.Task[None] | None:
    """Say this daemon is here, then hold or wait for the lease and follow the others."""
    if d.shared is None:
        return None
    scheme = "https" if d.server.tls.enabled else "http"
    port = listeners.acceptors[0].port or d.server.listen.gateway.port
    gateway_url = f"{scheme}://{socket.getfqdn()}:{port}"
    await d.shared.start(gateway_url, d.reconciler.jobs.daemon_url)
    return asyncio.create_task(d.shared.run(stop), name="llmgw-shared")


def status_line(d: Daemon) -> str:
    """One line for ``systemctl status``: models, ready replicas, what is wrong."""
    rec = d.reconciler
    states = [(r.model, r.state()) for r in rec.replicas.values()]
    ready = collections.Counter(m for m, st in states if st is ReplicaState.READY)
    coming = sum(1 for _, st in states if st in (ReplicaState.PENDING, ReplicaState.STARTING))
    n = len(rec.catalog.models)
    parts = [f"{n} model{'s' if n != 1 else ''}", f"{sum(ready.values())} ready"]
    if ready:
        parts[-1] += " (" + ", ".join(f"{m} {k}" for m, k in sorted(ready.items())) + ")"
    if coming:
        parts.append(f"{coming} starting")
    if rec.last_pass_error:
        failed = rec.last_pass_error.startswith(ROUND_FAILED)
        parts.append(("" if failed else "Slurm not answering: ") + rec.last_pass_error)
    if d.reload_error:
        parts.append(d.reload_error)
    return "; ".join(parts)


def event_loop() -> asyncio.AbstractEventLoop:
    """The daemon's event loop: uvloop's when it is installed, asyncio's otherwise.

    uvloop takes about a seventh off the gateway's CPU per proxied request
    and 0.17 ms off its added latency at 64 clients (docs/performance.md);
    the daemon uses nothing uvloop lacks (the unit tests pass on both).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def check_slurm(d: Daemon) -> None:
    """Before the listeners open: a Slurm setting that cannot work (slurmrestd without
    the configured OpenAPI version) stops the daemon with what to change; Slurm not
    answering yet is a warning, and the passes try again with their backoff. Every
    cluster's backend is checked, not only the first's."""
    for label, exc in (await d.reconciler.clusters.check()).items():
        log.warning("cluster %s did not answer at start (each pass tries again): %s", label, exc)


def run(d: Daemon) -> None:
    """Serve until SIGTERM or SIGINT, on :func:`event_loop`.

    First the open-files limit goes up to the hard limit: at systemd's default
    soft limit of 1,024 a thousand idle connections were enough to starve the
    Slurm commands (the listeners then share out what it gives).
    """
    raise_open_files_limit()
    with asyncio.Runner(loop_factory=event_loop) as runner:
        runner.run(serve(d))


async def serve(d: Daemon, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM or SIGINT (or ``stop``, for tests), telling systemd each stage."""
    if stop is None:
        stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def shutdown() -> None:
        # At once, not after the pass in progress: systemd's stop timeout runs from here.
        d.notifier.stopping()
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, shutdown)
    loop.add_signal_handler(signal.SIGINT, shutdown)
    loop.add_signal_handler(signal.SIGHUP, d.reload)
    first = True

    def after_pass() -> None:
        # READY=1 only now: both ports answer and the first pass has looked at Slurm
        # (or said why it could not), so `systemctl start` returning means the
        # gateway serves with a real view of the cluster.
        nonlocal first
        if d.heap is not None:
            # Here, between passes: the trim blocks the loop for a few ms.
            d.heap.maybe_trim(idle=not d.gateway[GATEWAY_KEY].in_flight)
        if first:
            first = False
            # What start-up allocated lives as long as the daemon: out of the
            # collector's sight, so that the heap trimmer's collections when
            # idle walk only what was made since (guard/heap.py).
            gc.freeze()
            d.notifier.ready(status_line(d))
        else:
            d.notifier.status(status_line(d))

    listeners: Listeners | None = None
    shared_task: asyncio.Task[None] | None = None
    try:
        await check_slurm(d)
        listeners = await open_listeners(d)
        log.info(
            "serving: gateway %s://%s:%d, internal http://%s:%d, admin socket %s, %d models",
            "https" if d.server.tls.enabled else "http",
            d.server.listen.gateway.host,
            d.server.listen.gateway.port,
            d.server.listen.internal.host,
            d.server.listen.internal.port,
            listeners.admin_socket,
            len(d.catalog.models),
        )
        shared_task = await _start_shared(d, listeners, stop)
        await d.reconciler.run(stop, on_pass=after_pass)
    finally:
        d.notifier.stopping()
        for sig in handled:
            loop.remove_signal_handler(sig)
        if shared_task is not None:
            stop.set()
            await shared_task
        if d.shared is not None:
            await d.shared.close()
        await d.reconciler.close()
        await d.reconciler.clusters.close()
        if listeners is not None:
            await listeners.close()
        # Open replica starts are ended as such ("daemon stopped"): the next
        # daemon adopts the jobs and continues their traces from the job comment.
        d.reconciler.tracing.close()
        if d.tracer_provider is not None:
            # Blocking (the last export, bounded by the exporter's timeout).
            await asyncio.to_thread(d.tracer_provider.shutdown)
