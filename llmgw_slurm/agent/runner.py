"""The agent's run: weights, rendezvous, engine, readiness, serve, drain.

Each step is logged with its duration, reported to the daemon, and wrapped
in a span that continues the replica's trace from ``TRACEPARENT``. The spans
of the start (``llmgw.agent`` and its steps: weights, rendezvous,
engine_launch, readiness, register) end once the replica serves, so that a
trace viewer shows the start whole while the job runs on; the end of the job
is a second group (``llmgw.agent.shutdown``: drain, stop) in the same trace.

Drain triggers, whatever the phase: SIGUSR1 (Slurm's warning before the time
limit), SIGTERM (scancel, preemption), SIGINT, or a heartbeat answer with
``drain: true``. Before the engine is ready a drain just stops what is under
way; after, in-flight requests get up to ``drain_timeout_s`` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from llmgw_slurm.agent import rendezvous as rdzv
from llmgw_slurm.agent.engine import (
    DistInfo,
    EngineProcess,
    LaunchParams,
    build_engine_command,
    check_port_owner,
    engine_env,
    in_flight_from_metrics,
    wait_ready,
)
from llmgw_slurm.agent.errors import AgentError, PortTaken, RendezvousError
from llmgw_slurm.agent.headwatch import wait_head_gone
from llmgw_slurm.agent.install import install_marker_for
from llmgw_slurm.agent.portowner import port_owner
from llmgw_slurm.agent.report import DaemonClient
from llmgw_slurm.agent.weights import ensure_weights, trace_marker_path
from llmgw_slurm.auth.tls import EngineTLS, PEMError, check_certificate, make_engine_tls
from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.catalog import Model, read_replica_spec
from llmgw_slurm.config import AgentConfig
from llmgw_slurm.tracing.otel import extract_env, read_trace_marker, traceparent_of

__all__ = ["Agent", "JobContext", "job_context_from_env"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
_HEAD_EVENTS = frozenset({"ready", "heartbeat", "draining", "stopped"})
_EXIT_SIGNAL_GRACE_S = 5.0
# Ports an engine may lose to other users in one start before it fails: each
# loss costs a restart of the engine, and more than a couple means someone
# watches this job's ports, whom the next start (a new job) may evade.
_PORT_TRIES = 3


@dataclass(frozen=True)
class JobContext:
    """What the daemon put in the job's environment."""

    replica_id: str
    model: str
    daemon_url: str
    replica_secret: str
    engine_api_key: str
    spec: Model
    # The gateway's client certificate (public): the one client, beside the
    # agent, that a TLS engine lets in. Empty from a daemon that predates TLS.
    gateway_cert: str = ""


_REPLICA_ID = re.compile(r"^[0-9a-f]{8}$")
# Not in the catalog: where vLLM and SGLang report their request gauges.
_METRICS_PATH = "/metrics"


def replica_spec(text: str | None) -> Model:
    """The job's model entry (LLMGW_REPLICA_SPEC), through the catalog's own types."""
    model, ignored = read_replica_spec(text)
    if ignored:
        # A newer daemon wrote keys this agent does not know: it validated them,
        # and this agent runs the model as it understands it.
        log.warning("LLMGW_REPLICA_SPEC: ignoring keys unknown to this agent: %s", ignored)
    return model


@dataclass(frozen=True)
class JobKind:
    """Which job an agent runs, as its environment says it: the variables that hold
    its id and its report secret, and what an id looks like."""

    id_var: str
    secret_var: str
    id_pattern: re.Pattern[str]
    id_help: str
    # Variables beside the common ones that this kind's daemon always sets.
    more: tuple[str, ...] = ()


REPLICA_JOB = JobKind(
    "LLMGW_REPLICA_ID", "LLMGW_REPLICA_SECRET", _REPLICA_ID, "is not 8 lowercase hex digits"
)


def job_context_from_env(env: Mapping[str, str], kind: JobKind = REPLICA_JOB) -> JobContext:
    """Read the LLMGW_* variables; ConfigError naming the first one missing or wrong.

    The one check of a job's environment, a replica's or (``kind``) a batch job's."""
    needed = (
        kind.id_var,
        "LLMGW_MODEL",
        "LLMGW_DAEMON_URL",
        kind.secret_var,
        "LLMGW_ENGINE_API_KEY",
        *kind.more,
    )
    for name in needed:
        if not env.get(name):
            raise ConfigError(
                "not set in the job environment (the daemon sets it when it submits the job)",
                field=name,
            )
    rid = env[kind.id_var]
    if not kind.id_pattern.fullmatch(rid):
        raise ConfigError(f"{rid!r} {kind.id_help}", field=kind.id_var)
    url = env["LLMGW_DAEMON_URL"]
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{url!r} is not an http(s) URL", field="LLMGW_DAEMON_URL")
    spec = replica_spec(env.get("LLMGW_REPLICA_SPEC"))
    if spec.name != env["LLMGW_MODEL"]:
        raise ConfigError(
            f"names model {spec.name!r} but LLMGW_MODEL is {env['LLMGW_MODEL']!r}",
            field="LLMGW_REPLICA_SPEC",
        )
    return JobContext(
        replica_id=rid,
        model=spec.name,
        daemon_url=url,
        replica_secret=env[kind.secret_var],
        engine_api_key=env["LLMGW_ENGINE_API_KEY"],
        spec=spec,
        gateway_cert=_gateway_cert(env, spec),
    )


def _gateway_cert(env: Mapping[str, str], spec: Model) -> str:
    gateway_cert = env.get("LLMGW_GATEWAY_CERT", "")
    if gateway_cert:
        try:
            check_certificate(gateway_cert)
        except PEMError as err:
            raise ConfigError(str(err), field="LLMGW_GATEWAY_CERT") from err
    elif spec.engine.tls:
        raise ConfigError(
            "not set, and the model's engine serves TLS (engine.tls, the default): the "
            "daemon sets it when it submits the job; a daemon older than this agent does "
            "not, so upgrade the daemon or set engine.tls: false for this model",
            field="LLMGW_GATEWAY_CERT",
        )
    return gateway_cert


class Agent:
    # Where its reports go: /internal/v1/KIND/ID/report (a batch job's agent: "batches").
    report_kind = "replicas"

    def __init__(
        self,
        config: AgentConfig,
        job: JobContext,
        env: Mapping[str, str],
        *,
        tracer: trace.Tracer | None = None,
        hostname: str | None = None,
        expand: Callable[[str], list[str]] = rdzv.expand_hostnames,
        flush: Callable[[], object] | None = None,
    ) -> None:
        self.config = config
        self.job = job
        self.env = dict(env)
        self.tracer = tracer or trace.get_tracer("llmgw_slurm")
        self.hostname = hostname or node_hostname(env)
        self._expand = expand
        self.engine: EngineProcess | None = None
        self.role: rdzv.NodeRole | None = None
        self.url: str | None = None
        self._drain = asyncio.Event()
        self.drain_reason = ""
        self._outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._client: DaemonClient | None = None
        self._published: Path | None = None
        self._log_files: list[IO[bytes]] = []
        # The engine's output files (one pair for every start of it in this job).
        self._log_pair: tuple[IO[bytes] | None, IO[bytes] | None] = (None, None)
        self._metrics_url = ""
        self._tls: EngineTLS | None = None
        # Only the job's user may enter it (mkdtemp makes it 0700): the engine's
        # TLS files and what it must not take from its command line.
        self._private: Path | None = None
        self._engine_ssl: ssl.SSLContext | None = None
        # Sends the start's spans right away once the replica serves (the batch
        # exporter would otherwise hold them for seconds); None: nothing to flush.
        self._flush = flush
        self._parent: Context = extract_env(self.env)
        self._step_message: str | None = None
        # This node's llmgw.agent span while it starts.
        self._start_span: trace.Span | None = None
        self._queued = 0
        self._handled = 0
        self._progress = asyncio.Event()
        # A worker's watch on its head's engine (agent/headwatch.py); None on the head.
        self._head_gone: asyncio.Task[str] | None = None

    # --- drain triggers -------------------------------------------------------

    def request_drain(self, reason: str) -> None:
        if not self._drain.is_set():
            log.info("drain requested: %s", reason)
            self.drain_reason = reason
            self._drain.set()

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        names = {
            signal.SIGUSR1: "SIGUSR1 (time limit near)",
            signal.SIGTERM: "SIGTERM",
            signal.SIGINT: "SIGINT",
        }
        for sig, why in names.items():
            loop.add_signal_handler(sig, self.request_drain, why)

    # --- reporting ------------------------------------------------------------

    def _emit(self, event: str, **fields: Any) -> int:
        """Queue a report; one sender keeps them in order and retries each.

        Returns its place in the queue, for :meth:`_delivered` (-1 when not queued).
        A worker node reports its steps and its failure, never the replica's
        life cycle (ready, draining, stopped): that is the head's to tell.
        """
        if self.role is not None and not self.role.is_head and event in _HEAD_EVENTS:
            return -1
        if self._client is not None:
            self._outbox.put_nowait(self._client.body(event, **fields))
            self._queued += 1
        return self._queued

    async def _delivered(self, seq: int, timeout: float) -> bool:
        """Wait until the report at ``seq`` was handled (sent, or given up)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self._handled < seq:
                    self._progress.clear()
                    await self._progress.wait()
        return self._handled >= seq

    async def _sender(self) -> None:
        assert self._client is not None
        while True:
            body = await self._outbox.get()
            if body is None:
                return
            delay = 1.0
            for attempt in range(5):
                if await self._client.send_once(body) is not None:
                    break
                if attempt < 4:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30.0)
            self._handled += 1
            self._progress.set()

    @asynccontextmanager
    async def _step(self, name: str, **attrs: Any) -> AsyncIterator[trace.Span]:
        log.info("step %s: started", name)
        self._emit("step", step=name, status="started")
        t0 = time.monotonic()
        with self.tracer.start_as_current_span(
            f"llmgw.agent.{name}", record_exception=False, set_status_on_exception=False
        ) as span:
            for k, v in attrs.items():
                span.set_attribute(f"llmgw.{k}", v)
            try:
                yield span
            except (Exception, asyncio.CancelledError) as err:
                elapsed = time.monotonic() - t0
                if isinstance(err, asyncio.CancelledError):
                    log.info("step %s: interrupted by drain after %.1fs", name, elapsed)
                    span.set_attribute("llmgw.interrupted", True)
                else:
                    log.error("step %s: failed after %.1fs: %s", name, elapsed, err)
                    span.record_exception(err)
                    span.set_status(Status(StatusCode.ERROR, str(err)[:500]))
                    self._emit(
                        "step", step=name, status="failed", message=str(err), elapsed_s=elapsed
                    )
                raise
            elapsed = time.monotonic() - t0
            span.set_attribute("llmgw.elapsed_s", elapsed)
        log.info("step %s: done in %.1fs", name, elapsed)
        message, self._step_message = self._step_message, None
        self._emit("step", step=name, status="done", elapsed_s=elapsed, message=message)

    # --- the run --------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signals(loop)
        async with aiohttp.ClientSession() as session:
            self._client = DaemonClient(
                session,
                self.job.daemon_url,
                self.job.replica_id,
                self.job.replica_secret,
                node=self.hostname,
                job_id=self.env.get("SLURM_JOB_ID", ""),
                timeout_s=self.config.report_timeout,
                kind=self.report_kind,
            )
            sender = asyncio.create_task(self._sender())
            try:
                return await self._run(session)
            finally:
                self._cleanup()
                self._outbox.put_nowait(None)
                # Final reports get a bounded chance: the job is ending, and
                # Slurm's KillWait will not wait for an absent daemon.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sender, self.config.report_timeout)
                if not sender.done():
                    log.warning("daemon away: %d report(s) not delivered", self._outbox.qsize())
                for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)

    def _span_attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "llmgw.replica_id": self.job.replica_id,
            "llmgw.model": self.job.model,
            "llmgw.node": self.hostname,
            "llmgw.job_id": self.env.get("SLURM_JOB_ID", ""),
        }
        started = process_start()
        if started is not None:
            # The start waterfall tells the job's launch from the agent's own start-up.
            attrs["llmgw.process_start"] = started
        return attrs

    @contextlib.contextmanager
    def _group(self, name: str) -> Iterator[trace.Span]:
        """A span directly under the replica's start (TRACEPARENT), for one phase."""
        with self.tracer.start_as_current_span(
            name,
            context=self._parent,
            attributes=self._span_attrs(),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except asyncio.CancelledError:
                span.set_attribute("llmgw.interrupted", True)
                raise
            except Exception as err:
                span.set_status(Status(StatusCode.ERROR, str(err)[:500]))
                raise

    async def _flush_spans(self) -> None:
        if self._flush is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._flush)

    async def _run(self, session: aiohttp.ClientSession) -> int:
        t0 = time.monotonic()
        startup = asyncio.create_task(self._startup(session))
        drain_wait = asyncio.create_task(self._drain.wait())
        await asyncio.wait({startup, drain_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not startup.done():
            startup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await startup
            await self._stop_engine(traced=True)
            self._emit(
                "stopped",
                message=f"stopped before ready: {self.drain_reason}",
                elapsed_s=time.monotonic() - t0,
            )
            return EXIT_OK
        drain_wait.cancel()
        try:
            startup.result()
        except Exception as err:
            if isinstance(err, (AgentError, ConfigError)):
                message = str(err)
            else:
                log.exception("startup failed unexpectedly")
                message = f"{type(err).__name__}: {err}"
            await self._stop_engine()
            self._emit("failed", message=message, elapsed_s=time.monotonic() - t0)
            return EXIT_FAILED
        try:
            return await self._serve(session)
        finally:
            await self._stop_engine()

    async def _startup(self, session: aiohttp.ClientSession) -> None:
        with self._group("llmgw.agent") as span:
            self._start_span = span
            await self._startup_steps(session)
        await self._flush_spans()

    async def _weights_step(self) -> str:
        """The model's weights on this node; the path the engine loads."""
        spec = self.job.spec
        method = spec.weights.method if spec.weights else "none"
        async with self._step("weights", method=method) as span:
            result = await asyncio.to_thread(
                ensure_weights, spec.name, spec.weights, self.config.weights
            )
            span.set_attribute("llmgw.weights.fetched", result.fetched)
            span.set_attribute("llmgw.weights.bytes", result.bytes)
            if not result.fetched:
                self._link_model_job(span)
        return result.model_path

    async def _startup_steps(self, session: aiohttp.ClientSession) -> None:
        model_path = await self._weights_step()
        role, dist, port, private = await self._rendezvous_step()
        lost: set[int] = set()
        while True:
            await self._launch_step(model_path, role, dist, port, private)
            if not role.is_head:
                self._watch_head(dist)
                return
            try:
                await self._readiness_step(session, port)
                break
            except PortTaken as err:
                port = await self._another_port(err, role, lost)
        await self._register_step()

    async def _another_port(self, err: PortTaken, role: rdzv.NodeRole, lost: set[int]) -> int:
        """After a port was taken: the engine stopped, and a port to start it on again.

        Raises ``err`` when the start cannot go on: a multi-node replica (its
        workers have joined this engine), the tries used up, or no free port left.
        """
        lost.add(err.port)
        await self._stop_engine()
        if role.multi_node or len(lost) >= _PORT_TRIES:
            raise err
        try:
            port = rdzv.pick_free_port(
                self.config.port_range.bounds,
                secrets.randbelow(1 << 30),
                self.config.bind_host,
                lost,
            )
        except RendezvousError:
            raise err from None
        log.warning("engine: %s; starting it again on port %d", err, port)
        self._step_message = f"port {err.port} was taken by another user; moved to {port}"
        return port

    async def _launch_step(
        self,
        model_path: str,
        role: rdzv.NodeRole,
        dist: DistInfo | None,
        port: int,
        private: Path,
    ) -> None:
        spec = self.job.spec
        s = self.config
        async with self._step("engine_launch", engine=spec.engine.kind) as span:
            binds = (model_path,) if model_path.startswith("/") else ()
            launch = LaunchParams(
                model_path=model_path,
                served_name=spec.name,
                host=s.bind_host,
                port=port,
                python=s.interpreter,
                runtime=s.engines.of(spec.engine.kind),
                dist=dist,
                apptainer=s.apptainer.binary,
                apptainer_binds=s.apptainer.binds,
                binds=binds,
                tls=self._tls,
                private_dir=str(private),
            )
            cmd = build_engine_command(spec.engine, launch, self.job.engine_api_key)
            for name, text in cmd.files.items():
                (private / name).write_text(text)
            self._link_engine_install(span, spec.engine.apptainer_image or cmd.argv[0])
            log.info("engine: %s", _redact(cmd.argv, self.job.engine_api_key))
            if self.engine is None:
                self._log_pair = self._engine_log_files(role)
            out, err = self._log_pair
            self.engine = EngineProcess(
                cmd.argv,
                engine_env(self.env, cmd.env),
                tail_lines=s.log_tail_lines,
                stdout=out,
                stderr=err,
            )
            await self.engine.start()

    async def _readiness_step(self, session: aiohttp.ClientSession, port: int) -> None:
        assert self.engine is not None
        spec = self.job.spec
        s = self.config
        poll_host = "127.0.0.1" if s.bind_host in ("0.0.0.0", "") else s.bind_host  # noqa: S104
        scheme = "https" if self._tls is not None else "http"
        health = f"{scheme}://{poll_host}:{port}{spec.engine.health_path}"
        timeout = spec.engine.ready_timeout or s.readiness.timeout
        uid = os.getuid()
        async with self._step("readiness", timeout_s=timeout, tls=self._tls is not None):
            await wait_ready(
                session,
                health,
                self.engine,
                timeout,
                s.readiness.poll_interval,
                self.job.engine_api_key,
                ssl_ctx=self._engine_ssl,
                port_ok=lambda: check_port_owner(port, uid, port_owner(port)),
            )
        self.url = f"{scheme}://{s.advertise_host or self.hostname}:{port}"
        self._metrics_url = f"{scheme}://{poll_host}:{port}{_METRICS_PATH}"

    async def _register_step(self) -> None:
        async with self._step("register", url=self.url) as span:
            log.info("ready: %s serves %s", self.url, self.job.spec.name)
            seq = self._emit("ready", url=self.url, cert=self._cert())
            # Heartbeats carry the URL too: a daemon that is away learns it later,
            # so this waits a bounded time and never fails the start.
            delivered = await self._delivered(seq, self.config.report_timeout)
            span.set_attribute("llmgw.register.delivered", delivered)

    def _cert(self) -> str | None:
        """The engine's certificate, which the daemon pins; None for a plain-HTTP engine."""
        return self._tls.identity.cert_pem if self._tls is not None else None

    def _link_model_job(self, span: trace.Span) -> None:
        """Weights a model job put in the cache: link to that job's trace."""
        spec = self.job.spec
        path = trace_marker_path(self.config.weights.cache_dir, spec.name, spec.weights)
        self._link_marker(span, path, "model_job", "weights from a model job")

    def _link_engine_install(self, span: trace.Span, program: str) -> None:
        """An engine an install job put in place: link to that job's trace."""
        path = install_marker_for(program)
        self._link_marker(span, path, "engine_install", "engine from an install job")

    def _link_marker(self, span: trace.Span, path: Path | None, what: str, said: str) -> None:
        """Link ``span`` to the trace a marker file names, if there is one."""
        sc = read_trace_marker(path) if path is not None else None
        if sc is None:
            return
        span.add_link(sc, {"llmgw.link": what})
        tp = traceparent_of(sc)
        span.set_attribute(f"llmgw.link.{what}", tp)
        # The daemon links the replica's start span to it too (it reads trace=...).
        self._step_message = f"{said}; trace={tp}"

    async def _rendezvous_step(self) -> tuple[rdzv.NodeRole, DistInfo | None, int, Path]:
        """This node's role, where the nodes meet, the engine's API port, and
        the engine's private directory."""
        s = self.config
        async with self._step("rendezvous") as span:
            role = rdzv.compute_role(self.env, self._expand)
            self.role = role
            # On the node's start span too: a multi-node start has one per node.
            for sp in (span, self._start_span):
                if sp is not None:
                    sp.set_attribute("llmgw.node_rank", role.rank)
                    sp.set_attribute("llmgw.nnodes", role.nnodes)
            t0 = time.monotonic()
            dist, taken = await self._rendezvous(role)
            if dist is not None:
                # A worker with rendezvous.dir waits here for the head's file;
                # with a derived port nobody waits here: the worker's engine
                # waits for the head's inside its own start (engine_launch and
                # the head's readiness hold that time).
                span.set_attribute("llmgw.rendezvous.waited_s", time.monotonic() - t0)
                span.set_attribute(
                    "llmgw.rendezvous.via", "dir" if s.rendezvous.dir else "derived_port"
                )
                span.set_attribute("llmgw.master_addr", dist.master_addr)
                span.set_attribute("llmgw.master_port", dist.master_port)
            # A random start, not one derived from the job id: a port anyone can
            # compute is a port someone can take first (see check_port_owner).
            seed = secrets.randbelow(1 << 30)
            ports = s.port_range.bounds
            port = rdzv.pick_free_port(ports, seed, s.bind_host, taken) if role.is_head else 0
            if role.is_head and self.job.spec.engine.tls:
                self._tls = make_engine_tls(self.job.gateway_cert, self.job.replica_id)
                self._engine_ssl = self._tls.agent_context()
                self._private = self._tls.directory
            else:
                self._private = Path(tempfile.mkdtemp(prefix=f"llmgw-engine-{role.job_id}-"))
        return role, dist, port, self._private

    async def _rendezvous(self, role: rdzv.NodeRole) -> tuple[DistInfo | None, set[int]]:
        """Where the nodes meet, and ports the engine's API must not take."""
        s = self.config
        if not role.multi_node:
            return None, set()
        if s.rendezvous.dir is not None:
            path = rdzv.rendezvous_path(s.rendezvous.dir, role)
            if role.is_head:
                seed = int(re.sub(r"\D", "", role.job_id) or "0")
                mport = rdzv.pick_free_port(s.port_range.bounds, seed + 1, s.bind_host)
                rdzv.publish(path, role, role.head_host, mport)
                self._published = path
            else:
                _, mport = await rdzv.await_published(path, role, s.rendezvous.timeout)
        else:
            mport = rdzv.derived_port(s.port_range.bounds, role)
            if role.is_head:
                rdzv.check_port_free(mport, s.bind_host)
        return DistInfo(role.nnodes, role.rank, role.head_host, mport), {mport}

    def _watch_head(self, dist: DistInfo | None) -> None:
        """On a worker of vLLM or SGLang, whose engines meet at torch's store on the
        head: notice when the head's engine is gone (agent/headwatch.py). A
        ``command`` engine's own processes decide how they end with their head."""
        if dist is None or self.job.spec.engine.kind not in ("vllm", "sglang"):
            return
        self._head_gone = asyncio.create_task(
            wait_head_gone(dist.master_addr, dist.master_port, self.config.drain.poll_interval)
        )

    def _engine_log_files(self, role: rdzv.NodeRole) -> tuple[IO[bytes] | None, IO[bytes] | None]:
        if self.config.log_dir is None:
            return None, None
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.job.model}.{self.job.replica_id}.{role.job_id}.{self.hostname}.log"
        f = (self.config.log_dir / name).open("ab")
        self._log_files.append(f)
        log.info("engine output goes to %s", self.config.log_dir / name)
        return f, f

    async def _serve(self, session: aiohttp.ClientSession) -> int:
        assert self.engine is not None and self.role is not None
        t_ready = time.monotonic()
        exit_task = asyncio.create_task(self.engine.wait())
        drain_task = asyncio.create_task(self._drain.wait())
        watched: set[asyncio.Future[Any]] = {exit_task, drain_task}
        if self._head_gone is not None:
            watched.add(self._head_gone)
        try:
            while True:
                done, _ = await asyncio.wait(
                    watched,
                    timeout=self.config.heartbeat_interval,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if self._head_gone in done and exit_task not in done:
                    # A worker without its head serves nothing: it ends as in a drain.
                    self.request_drain(self._head_gone.result())
                    break
                if exit_task in done:
                    rc = exit_task.result()
                    if rc == 0 and not self.role.is_head:
                        # A worker's engine that ends cleanly was stopped by its
                        # head, which is stopping: no failure, and nobody may be
                        # left to signal this node (its slurmd lost).
                        self.request_drain("the engine ended with its head (exit 0)")
                    if not self._drain.is_set():
                        # The engine may end just before this agent hears why:
                        # on scancel slurmstepd sends SIGTERM to the engine as
                        # well, and a worker's engine ends with the head's,
                        # whose agent may have been signalled first (the nodes
                        # are not signalled in step). Give the signal a moment.
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._drain.wait(), _EXIT_SIGNAL_GRACE_S)
                    if self._drain.is_set():
                        log.info("engine exited (code %s) as the job drains", rc)
                        break
                    tail = "\n".join(self.engine.tail()[-20:])
                    msg = f"engine exited with code {rc} while serving; last lines:\n{tail}"
                    log.error("%s", msg)
                    with self.tracer.start_as_current_span(
                        "llmgw.agent.engine_exit",
                        context=self._parent,
                        attributes=self._span_attrs(),
                    ) as span:
                        span.set_status(Status(StatusCode.ERROR, f"exit {rc}"))
                    self._emit("failed", message=msg, elapsed_s=time.monotonic() - t_ready)
                    return EXIT_FAILED
                if drain_task in done:
                    break
                if self.role.is_head:
                    await self._heartbeat()
        finally:
            drain_task.cancel()
        exit_task.cancel()
        await self._drain_and_stop(session)
        self._emit(
            "stopped", message=f"drained: {self.drain_reason}", elapsed_s=time.monotonic() - t_ready
        )
        return EXIT_OK

    async def _heartbeat(self) -> None:
        assert self._client is not None
        body = self._client.body("heartbeat", url=self.url, cert=self._cert())
        answer = await self._client.send_once(body)
        if answer is not None and answer.drain:
            self.request_drain("the daemon asked (drain=true)")

    async def _drain_and_stop(self, session: aiohttp.ClientSession) -> None:
        assert self.engine is not None and self.role is not None
        s = self.config
        if self.role.is_head:
            # First, so that the daemon stops routing here before anything else.
            self._emit("draining", url=self.url, message=self.drain_reason)
        with self._group("llmgw.agent.shutdown") as group:
            group.set_attribute("llmgw.reason", self.drain_reason)
            async with self._step("drain", reason=self.drain_reason) as span:
                if self.role.is_head:
                    waited = await self._wait_in_flight(session)
                    span.set_attribute("llmgw.drain.waited_s", waited)
                else:
                    await self._wait_for_head(span)
            async with self._step("stop") as span:
                rc = await self.engine.stop(s.drain.stop_grace)
                span.set_attribute("llmgw.engine.exit_code", rc)

    async def _wait_for_head(self, span: trace.Span) -> None:
        """A worker's engine is part of the head's: it must not go first. It ends
        when the head's engine does, or once the head watch sees that one gone;
        at most the head's drain and stop."""
        assert self.engine is not None
        s = self.config
        ended = asyncio.create_task(self.engine.wait())
        waits: set[asyncio.Future[Any]] = {ended}
        if self._head_gone is not None:
            waits.add(self._head_gone)
        done, _ = await asyncio.wait(
            waits, timeout=s.drain.timeout + s.drain.stop_grace, return_when=asyncio.FIRST_COMPLETED
        )
        if not ended.done():
            ended.cancel()
        how = "engine ended" if ended in done else "head gone" if done else "timeout"
        span.set_attribute("llmgw.drain.worker_end", how)
        log.info("drain: worker's wait for its head ended (%s)", how)

    async def _wait_in_flight(self, session: aiohttp.ClientSession) -> float:
        """Until no request is running, or the drain limit; returns seconds waited."""
        s = self.config
        t0 = time.monotonic()
        headers = {"Authorization": f"Bearer {self.job.engine_api_key}"}
        while True:
            elapsed = time.monotonic() - t0
            if self.engine is None or self.engine.returncode is not None:
                log.info(
                    "drain: engine exited by itself (code %s)",
                    self.engine.returncode if self.engine else None,
                )
                return elapsed
            if elapsed >= s.drain.timeout:
                log.warning(
                    "drain: limit of %.0fs reached with requests in flight", s.drain.timeout
                )
                return elapsed
            count: int | None = None
            try:
                async with session.get(
                    self._metrics_url,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=5.0),
                    ssl=self._engine_ssl if self._engine_ssl is not None else True,
                ) as resp:
                    if resp.status == 200:
                        count = in_flight_from_metrics(await resp.text())
            except (aiohttp.ClientError, TimeoutError):
                count = None
            if count is None:
                # No request metric (or the engine is already shutting down,
                # as it does on a SIGTERM from slurmstepd): a fixed grace, cut
                # short if the engine exits by itself.
                grace = max(0.0, min(s.drain.grace, s.drain.timeout - elapsed))
                log.info("drain: engine reports no request count, waiting %.1fs", grace)
                exited = asyncio.create_task(self.engine.wait())
                done, _ = await asyncio.wait({exited}, timeout=grace)
                if not done:
                    exited.cancel()
                    return time.monotonic() - t0
                continue
            if count == 0:
                log.info("drain: no requests in flight")
                return time.monotonic() - t0
            log.info("drain: %d request(s) in flight", count)
            await asyncio.sleep(s.drain.poll_interval)

    async def _stop_engine(self, *, traced: bool = False) -> None:
        if self.engine is None or self.engine.returncode is not None:
            return
        if not traced:
            await self.engine.stop(self.config.drain.stop_grace)
            return
        with self._group("llmgw.agent.shutdown") as group:
            group.set_attribute("llmgw.reason", self.drain_reason)
            async with self._step("stop") as span:
                rc = await self.engine.stop(self.config.drain.stop_grace)
                span.set_attribute("llmgw.engine.exit_code", rc)

    def _cleanup(self) -> None:
        if self._head_gone is not None:
            self._head_gone.cancel()
        for f in self._log_files:
            with contextlib.suppress(OSError):
                f.close()
        if self._published is not None:
            with contextlib.suppress(OSError):
                self._published.unlink()
        if self._private is not None:
            # The TLS key dies with the job: nothing else may ever serve as this replica.
            shutil.rmtree(self._private, ignore_errors=True)


def _redact(argv: list[str], secret: str) -> list[str]:
    return [a.replace(secret, "***") if secret else a for a in argv]


def process_start(proc: Path = Path("/proc")) -> float | None:
    """When this process started (epoch seconds, to a clock tick); None off Linux."""
    try:
        stat = (proc / "self" / "stat").read_text()
        # The uptime, not /proc/stat's btime, which is whole seconds.
        uptime = float((proc / "uptime").read_text().split()[0])
        now = time.time()
        # Field 22, counted after the command name (which may hold spaces).
        ticks = float(stat.rsplit(")", 1)[1].split()[19])
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def node_hostname(env: Mapping[str, str]) -> str:
    """The name this node is reached by: Slurm's node name when it resolves.

    Several slurmd may share one machine (the dev cluster, or sites with
    multiple-slurmd), where the machine's hostname is the same for all of them
    and only the node name tells them apart. A node name that does not resolve
    falls back to the hostname (agent.yaml's advertise_host overrides both).
    """
    name = env.get("SLURMD_NODENAME", "")
    if name:
        try:
            socket.getaddrinfo(name, None)
            return name
        except OSError:
            pass
    return socket.gethostname()
