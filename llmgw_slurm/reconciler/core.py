"""The reconciler: observe, plan, execute, once per pass; and the router's view of replicas.

Slurm is the source of truth for what runs: every pass starts from one
``squeue`` of the service's jobs, and from the nodes of a ``sinfo`` at most
``reconcile.nodes_max_age`` old, listed again before any placement or
eviction (see ``pass_once``). What Slurm does not know
is kept here, in memory, per replica: what its agent reported (the engine's
URL, its steps), what the router saw (requests in flight, last use), and the
drain or stop the daemon asked for. After a daemon restart that memory is
empty: jobs are adopted from the listing, their agents re-report on their
next heartbeat, and their last use is unknown (so they are not idle).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import ssl
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from opentelemetry import trace

from llmgw_slurm.catalog import Catalog, Model
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.errors import LlmgwError, SlurmError
from llmgw_slurm.reconciler import plan as planmod
from llmgw_slurm.reconciler.jobs import JobBuilder, new_replica_id, parse_job_name
from llmgw_slurm.reconciler.plan import (
    Action,
    ActionKind,
    Failures,
    PlanConfig,
    ReplicaState,
    ReplicaView,
)
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.router.directory import Endpoint, ModelInfo
from llmgw_slurm.secrets import (
    REPORT_SCHEME,
    constant_time_equal,
    engine_api_key,
    parse_report_auth,
    replica_secret,
    report_signature,
)
from llmgw_slurm.slurm.types import AccountingRecord, Job, JobState, NodeInfo, SlurmBackend
from llmgw_slurm.svcjobs import ServiceJobs
from llmgw_slurm.tls import PinnedContexts, engine_address_problem, load_or_create_identity

# How far a signed report's time may be from the daemon's clock (NTP keeps a
# cluster's clocks within a second; five minutes allows a slow one).
REPORT_MAX_AGE_S = 300.0

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """What the daemon knows about one replica beyond Slurm's listing."""

    replica_id: str
    model: str
    job_id: str
    submitted_at: float
    job_state: JobState = JobState.PENDING
    reason: str = ""
    nodes: tuple[str, ...] = ()
    node_count: int = 1
    gpus_per_node: int = 0
    restarts: int = 0
    ends_at: float | None = None  # Slurm's end time for the job (Unix time), None if unlimited
    started_at: float | None = None
    ready_at: float | None = None
    base_url: str = ""
    # The engine's certificate as its agent reported it (pinned); "" for plain HTTP.
    engine_cert: str = ""
    # Times the daemon has seen this replica become reachable (a requeued job's next
    # run is a new endpoint to the router, even at the same address).
    epoch: int = 0
    last_used: float | None = None
    in_flight: int = 0
    draining_since: float | None = None
    drain_reason: str = ""
    stop_reason: str = ""
    agent_draining: str = ""
    agent_failed: str = ""
    replaces: str = ""
    step: str = ""
    # Seconds each agent step took, as the agent reported them (for status and cold-start figures).
    step_seconds: dict[str, float] = field(default_factory=dict)
    last_report: float | None = None
    first_report_at: float | None = None
    adopted: bool = False
    # When this daemon adopted the job: a start deadline runs from here, not from a
    # job start that may be hours older (the agent has yet to re-report).
    adopted_at: float | None = None
    # Seen back in the queue after running, and not yet seen running again: the
    # previous run's agent may live on (a node whose slurmd died) and still report.
    requeued: bool = False
    # The listing's job last applied to the fields in _LISTED, while none of them has
    # been assigned since (then the next listing of that same job changes nothing).
    listed: Job | None = field(default=None, repr=False, compare=False)
    # This replica's plan view, while no field has been assigned since it was built.
    view: ReplicaView | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # Every assignment drops the cached view (and one to a listed field, the
        # listed job): a stale view is a wrong eviction or scale-down, so the caches
        # are dropped where the fields change rather than where someone remembers to.
        # Costs about 0.2 us an assignment; rebuilding a view costs 3 us.
        object.__setattr__(self, name, value)
        if name != "view" and name != "listed":
            object.__setattr__(self, "view", None)
            if name in _LISTED:
                object.__setattr__(self, "listed", None)

    def state(self) -> ReplicaState:
        if self.stop_reason:
            return ReplicaState.STOPPING
        if self.job_state is JobState.COMPLETING:
            # Ending without being asked: a crash (reaped next pass) or a preemption on
            # its way back to the queue. Counted as pending so that a requeue is not
            # taken for a loss and replaced by a second job.
            return ReplicaState.PENDING
        if self.draining_since is not None:
            return ReplicaState.DRAINING
        if self.job_state in (JobState.RUNNING, JobState.CONFIGURING):
            if self.agent_draining:
                return ReplicaState.DRAINING
            return ReplicaState.READY if self.base_url else ReplicaState.STARTING
        return ReplicaState.PENDING


# What _observe sets from the listing (and what it reads of the replica to decide it).
_LISTED = frozenset(
    (
        "job_state",
        "reason",
        "nodes",
        "node_count",
        "gpus_per_node",
        "restarts",
        "ends_at",
        "started_at",
        "requeued",
    )
)


@dataclass(frozen=True)
class Decision:
    at: float
    action: str
    model: str
    replica_id: str
    reason: str
    pass_id: str


@dataclass
class _ModelDemand:
    wanted_at: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class Reconciler:
    """Keeps each catalog model at the right number of replicas; implements ModelDirectory."""

    def __init__(
        self,
        catalog: Catalog,
        server: ServerConfig,
        backend: SlurmBackend,
        server_key: bytes,
        daemon_url: str,
        *,
        clock: Callable[[], float] = time.time,
        hold_timeout: float | None = None,
        agent_ready_timeout: float = 900.0,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.catalog = catalog
        self.server = server
        self.backend = backend
        self.server_key = server_key
        # The gateway's client identity: the only client, beside each replica's
        # own agent, that the replicas' engines let in (llmgw_slurm/tls.py).
        self.engine_tls = PinnedContexts(load_or_create_identity(Path(server.state_dir)))
        self.jobs = JobBuilder(
            server, server_key, daemon_url, gateway_cert=self.engine_tls.identity.cert_pem
        )
        self.clock = clock
        self.prefix = server.slurm.job_prefix
        rc = server.reconcile
        self.plan_cfg = PlanConfig(
            eviction_grace=rc.eviction_grace,
            min_lifetime=rc.min_lifetime,
            renewal_margin=rc.renewal_margin,
            drain_timeout=rc.drain_timeout,
            max_pending_time=rc.max_pending_time,
            start_timeout=agent_ready_timeout + 120.0,
            want_window=hold_timeout if hold_timeout is not None else server.router.hold_timeout,
            backoff_initial=rc.restart.initial_backoff,
            backoff_max=rc.restart.max_backoff,
            give_up_after=rc.restart.give_up_after_failures,
            default_partition=server.slurm.partition,
        )
        self.replicas: dict[str, Replica] = {}
        # Model jobs and engine installs (llmgw-admin fetch / install-engine), for status.
        self.service_jobs = ServiceJobs(server)
        self.failures: dict[str, Failures] = {}
        self.notes: dict[str, str] = {}
        self.nodes: list[NodeInfo] = []
        # When self.nodes was listed (the reconciler's clock); None: never.
        self._nodes_listed_at: float | None = None
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=200)
        self._demand: dict[str, _ModelDemand] = {}
        # Reports from agents whose job the daemon has not listed yet (right after a
        # restart, or a report racing the first listing): joined on the next pass.
        self._early_reports: dict[str, dict[str, Any]] = {}
        # Nonces of signed reports accepted lately: a replayed report is refused.
        self._nonces: set[str] = set()
        self._nonces_order: collections.deque[tuple[float, str]] = collections.deque()
        # Job name -> (model, replica id), or None when not a replica's: a job keeps its
        # name, and parsing 2,000 names per pass cost 3 ms.
        self._idents: dict[str, tuple[str, str] | None] = {}
        self._wake = asyncio.Event()
        self._adopted_once = False
        self.passes = 0
        self.last_pass_error = ""
        self.last_observed: float | None = None
        self._consecutive_errors = 0
        # Spans of passes and replica starts; no-ops (and no TRACEPARENT for jobs) when off.
        self.tracing = ReconcileTracing(tracer, server.tracing.enabled)
        self._http: aiohttp.ClientSession | None = None
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- catalog -----------------------------------------------------------------

    def set_catalog(self, catalog: Catalog) -> None:
        """Swap in a reloaded catalog; the next pass acts on it."""
        self.catalog = catalog
        self._wake.set()

    def _models(self) -> dict[str, Model]:
        return {m.name: m for m in self.catalog.models}

    # ---- ModelDirectory (called on the event loop; cheap, no I/O) ----------------

    def resolve(self, name: str) -> str | None:
        m = self.catalog.resolve(name)
        return m.name if m else None

    def models(self) -> Sequence[ModelInfo]:
        out = []
        for m in self.catalog.models:
            counts: dict[str, int] = collections.Counter(
                r.state().value for r in self.replicas.values() if r.model == m.name
            )
            out.append(
                ModelInfo(
                    name=m.name,
                    aliases=m.aliases,
                    ready=self._has_ready(m.name),
                    replicas=dict(counts),
                    hold_timeout_s=m.scaling.hold_timeout,
                )
            )
        return out

    def endpoints(self, model: str) -> Sequence[Endpoint]:
        out = []
        for r in self.replicas.values():
            if r.model != model or not r.base_url:
                continue
            st = r.state()
            if st not in (ReplicaState.READY, ReplicaState.DRAINING):
                continue
            out.append(
                Endpoint(
                    replica_id=r.replica_id,
                    base_url=r.base_url,
                    api_key=engine_api_key(self.server_key, r.replica_id),
                    draining=st is ReplicaState.DRAINING,
                    epoch=r.epoch,
                    ssl=self._engine_ssl(r.engine_cert),
                )
            )
        return out

    def request_started(self, model: str, replica_id: str) -> None:
        r = self.replicas.get(replica_id)
        if r is not None:
            r.in_flight += 1
            r.last_used = self.clock()

    def request_finished(self, model: str, replica_id: str) -> None:
        r = self.replicas.get(replica_id)
        if r is not None:
            r.in_flight = max(0, r.in_flight - 1)
            r.last_used = self.clock()

    def want(self, model: str) -> None:
        d = self._demand.setdefault(model, _ModelDemand())
        first = d.wanted_at is None or self.clock() - d.wanted_at > 1.0
        d.wanted_at = self.clock()
        if first:
            # An on-demand start should not wait for the next timed pass.
            self._wake.set()

    async def wait_ready(self, model: str) -> None:
        d = self._demand.setdefault(model, _ModelDemand())
        while not self._has_ready(model):
            d.event.clear()
            await d.event.wait()

    def start_span_context(self, model: str) -> trace.SpanContext | None:
        """The start span of a starting replica of ``model`` (held requests link to it)."""
        return self.tracing.start_context(model)

    def _has_ready(self, model: str) -> bool:
        return any(
            r.model == model and r.state() is ReplicaState.READY for r in self.replicas.values()
        )

    def _signal_ready(self, model: str) -> None:
        d = self._demand.get(model)
        if d is not None and self._has_ready(model):
            d.event.set()

    # ---- agent reports -------------------------------------------------------------

    def report(self, replica_id: str, secret: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """An agent's report, checked against its replica's secret, for in-process
        callers (the HTTP route takes only signed reports: ``report_signed``).
        Raises PermissionError on a bad secret."""
        if not constant_time_equal(secret, replica_secret(self.server_key, replica_id)):
            raise PermissionError("bad replica secret")
        return self._report(replica_id, body)

    def report_signed(
        self, replica_id: str, authorization: str, raw: bytes, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """An agent's signed report (``raw``: the body's exact bytes, ``body`` them parsed).

        Raises PermissionError, saying why, on a malformed, wrong, old or replayed
        signature: a report copied off the network is refused, and the secret that
        signs it was never on the network.
        """
        parsed = parse_report_auth(authorization)
        if parsed is None:
            raise PermissionError(
                f"malformed signature; expected '{REPORT_SCHEME} ts=,nonce=,sig='"
            )
        ts, nonce, sig = parsed
        now = time.time()
        if abs(now - ts) > REPORT_MAX_AGE_S:
            raise PermissionError(
                f"report signed at {ts}, {now - ts:+.0f} s from the daemon's clock "
                f"(limit {REPORT_MAX_AGE_S:g} s): are the login and compute nodes' clocks set?"
            )
        secret = replica_secret(self.server_key, replica_id)
        if not constant_time_equal(sig, report_signature(secret, replica_id, ts, nonce, raw)):
            raise PermissionError("bad signature")
        key = f"{replica_id}:{nonce}"
        # Forget nonces older than any report still accepted (in order of arrival,
        # which follows their times to within the allowed skew).
        while self._nonces_order and self._nonces_order[0][0] < now - 2 * REPORT_MAX_AGE_S:
            self._nonces.discard(self._nonces_order.popleft()[1])
        if key in self._nonces:
            raise PermissionError("replayed report")
        self._nonces.add(key)
        self._nonces_order.append((now, key))
        return self._report(replica_id, body)

    def _report(self, replica_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        r = self.replicas.get(replica_id)
        if r is None:
            # The secret proves the agent runs this replica; its job is simply not
            # listed yet. Keep the report for the next pass rather than refuse it.
            self._early_reports[replica_id] = dict(body)
            self._wake.set()
            return {"ok": True, "drain": False}
        stale = self._stale(r, body)
        if stale:
            # An agent the listing says is not this replica's: never routed to. One of
            # another job, or of an earlier run left behind on a node Slurm lost, is
            # told to drain so that its engine stops holding GPUs Slurm has handed on.
            self._record("stale-report", r.model, replica_id, stale)
            return {"ok": True, "drain": not stale.startswith("report from node") or r.restarts > 0}
        if r.requeued and body.get("event") in ("ready", "heartbeat"):
            # Back in the queue, not yet seen running again: this is the previous run's
            # agent, or the new run's before the listing says where it runs. The next
            # pass tells them apart by node; until then nothing is routed.
            self._early_reports[replica_id] = dict(body)
            self._wake.set()
            return {"ok": True, "drain": False}
        self._apply_report(r, body)
        return {"ok": True, "drain": r.state() in (ReplicaState.DRAINING, ReplicaState.STOPPING)}

    def _stale(self, r: Replica, body: Mapping[str, Any]) -> str:
        """Why this report cannot come from the replica's current job, or "" when it may."""
        jid = body.get("job_id")
        other_job = isinstance(jid, str | int) and not isinstance(jid, bool) and str(jid)
        if other_job and str(jid) != r.job_id:
            return f"report from job {jid}; the replica's job is {r.job_id}"
        node = body.get("node")
        if (
            isinstance(node, str)
            and node
            and r.nodes
            and r.job_state in (JobState.RUNNING, JobState.CONFIGURING)
        ):
            short = node.split(".", 1)[0]
            here = {n.split(".", 1)[0] for n in r.nodes}
            # A name Slurm does not know as a node (an agent that reports its host name
            # where node names do not resolve) proves nothing either way.
            known = {n.name.split(".", 1)[0] for n in self.nodes}
            if short not in here and short in known:
                return f"report from node {node}; job {r.job_id} runs on {','.join(r.nodes)}"
        return ""

    def _apply_report(self, r: Replica, body: Mapping[str, Any]) -> None:
        now = self.clock()
        r.last_report = now
        if r.first_report_at is None:
            r.first_report_at = now
        self.tracing.agent_report(r.replica_id, body)
        event = str(body.get("event") or "")
        step = body.get("step")
        status = body.get("status")
        if step:
            r.step = f"{step} {status}" if status else str(step)
            elapsed = body.get("elapsed_s")
            if status == "done" and isinstance(elapsed, int | float):
                r.step_seconds[str(step)] = float(elapsed)
        if event == "step":
            # A new run of the agent (after a requeue) is not the one that drained.
            r.agent_draining = ""
        if event in ("step", "ready", "heartbeat") and r.job_state is JobState.PENDING:
            # The agent runs, so the job does: do not wait for the next listing to say so
            # (a held request would wait a whole pass interval). The listing corrects it.
            r.job_state = JobState.RUNNING
            r.started_at = r.started_at or now
            # And have the listing catch up now (nodes, time left) rather than next interval.
            self._wake.set()
        url = body.get("url")
        if event in ("ready", "heartbeat") and isinstance(url, str) and url:
            cert = body.get("cert") or ""
            problem = engine_address_problem(url, cert, self._tls_required(r.model))
            if problem:
                self._record("probe-refused", r.model, r.replica_id, f"{url[:100]}: {problem}")
                return
            assert isinstance(cert, str)
            if (r.base_url != url or r.engine_cert != cert) and url not in self._probing:
                # Route only to what the daemon itself has reached, with the engine's key:
                # an agent's word that the engine is up is not proof the login node can
                # reach it (firewalls, a wrong advertised name).
                self._probing.add(url)
                task = asyncio.get_running_loop().create_task(self._probe(r, url, cert))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        elif event == "failed":
            r.agent_failed = str(body.get("message") or step or "agent reported failure")
            self.tracing.end_start(r.replica_id, "failed", error=r.agent_failed)
            self._wake.set()
        elif event == "draining" and not r.agent_draining:
            # The agent was signalled (cancel, preemption, time limit): no new requests,
            # but the job ends by itself; a preempted one is requeued and comes back.
            r.agent_draining = str(body.get("message") or "the agent is draining")
            self._record("agent-drain", r.model, r.replica_id, r.agent_draining)
        elif event == "stopped":
            r.base_url = ""

    def _tls_required(self, model: str) -> bool:
        m = self.catalog.get(model)
        return m is None or m.engine.tls

    def _engine_ssl(self, cert: str) -> ssl.SSLContext | None:
        return self.engine_tls.get(cert) if cert else None

    async def _probe(self, r: Replica, url: str, cert: str) -> None:
        try:
            if self._http is None or self._http.closed:
                self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            key = engine_api_key(self.server_key, r.replica_id)
            # The key goes only through a handshake with the pinned certificate: a
            # listener that took the engine's port fails it and hears nothing.
            ctx = self._engine_ssl(cert)
            async with self._http.get(
                url.rstrip("/") + "/v1/models",
                headers={"Authorization": f"Bearer {key}"},
                ssl=ctx if ctx is not None else True,
            ) as resp:
                ok = resp.status == 200
                why = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        finally:
            self._probing.discard(url)
        if self.replicas.get(r.replica_id) is not r or r.stop_reason:
            return
        if not ok:
            # The next heartbeat tries again.
            self._record("probe-failed", r.model, r.replica_id, f"{url}: {why}")
            return
        if not r.base_url:
            # An adopted replica may have served before this daemon started; its
            # start ends here all the same, said as such.
            self.tracing.end_start(
                r.replica_id, "serving (adopted)" if r.adopted else "ready", url=url
            )
            r.ready_at = r.ready_at or self.clock()
            r.epoch += 1
            self._record("ready", r.model, r.replica_id, f"serving at {url}")
        r.base_url = url
        r.engine_cert = cert
        r.step = "ready"
        self._signal_ready(r.model)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._http is not None:
            await self._http.close()

    # ---- the pass ----------------------------------------------------------------

    def _record(self, action: str, model: str, rid: str, reason: str, pass_id: str = "") -> None:
        self.decisions.append(Decision(self.clock(), action, model, rid, reason, pass_id))
        self.tracing.record(action, model, rid, reason, pass_id)
        # key=value, the reason quoted last: one grep finds a pass's decisions, and
        # the pass id is the trace's llmgw.pass_id.
        log.info(
            "decision action=%s model=%s replica=%s pass=%s reason=%s",
            action,
            model,
            rid or "-",
            pass_id or "-",
            json.dumps(reason),
        )

    async def run(self, stop: asyncio.Event, on_pass: Callable[[], None] | None = None) -> None:
        """Pass after pass until ``stop`` is set; a want() or a report wakes it early.

        ``on_pass`` is called after every pass, a failed one included (the daemon
        tells systemd it is ready after the first).
        """
        interval = self.server.reconcile.interval
        while not stop.is_set():
            await self.pass_once()
            if on_pass is not None:
                on_pass()
            # Back off when Slurm does not answer: a storm of commands at a slurmctld
            # that is restarting helps nobody.
            delay = interval * min(2**self._consecutive_errors, 12)
            self._wake.clear()
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def pass_once(self) -> list[Action]:
        pass_id = uuid.uuid4().hex[:8]
        self.tracing.begin_pass()
        # The nodes are listed with the jobs only when the last listing is too old;
        # otherwise the pass plans with it and lists them again only if the plan
        # says the nodes decide an action (below). A pass that changes nothing then
        # costs one squeue: on a quiet cluster sinfo was half of a pass's cost.
        listed_at = self._nodes_listed_at
        age = self.clock() - listed_at if listed_at is not None else None
        with_jobs = age is None or not 0 <= age < self.server.reconcile.nodes_max_age
        try:
            if with_jobs:
                jobs, nodes = await asyncio.gather(
                    self.backend.list_jobs(self.prefix), self.backend.list_nodes()
                )
            else:
                jobs, nodes = await self.backend.list_jobs(self.prefix), self.nodes
        except SlurmError as exc:
            return self._unanswered(pass_id, exc)
        self.tracing.observed(nodes_listed=with_jobs)
        self._consecutive_errors = 0
        self.last_pass_error = ""
        self.passes += 1
        now = self.clock()
        self.last_observed = now
        if with_jobs:
            self.nodes, self._nodes_listed_at = nodes, now
        await self._reap(self._observe(jobs, now, pass_id), now, pass_id)
        for r in self.replicas.values():
            # Ready is not yet proof that the engine stays up (one that dies at its
            # first request would otherwise restart at once, forever): a model's
            # failures are forgiven once a replica has served its minimum lifetime.
            if (
                r.model in self.failures
                and r.ready_at is not None
                and r.base_url
                and not r.agent_failed
                and now - r.ready_at >= self.plan_cfg.min_lifetime
            ):
                self.failures.pop(r.model, None)
        result = self._plan(now)
        refreshed = False
        if result.nodes_decide and not with_jobs:
            # About to place or evict on an earlier pass's nodes: list them now and
            # plan again (plan() is pure and cheap), so the decision follows what is
            # free now. sinfo runs after squeue here, not beside it: only passes that
            # would act pay for it (and every pass while a queued replica fits on
            # the kept listing and something could be evicted for it).
            self.tracing.listing_nodes()
            try:
                nodes = await self.backend.list_nodes()
            except SlurmError as exc:
                # The jobs are applied (and what they showed is traced below), but
                # acting on nodes that may be wrong is what this listing prevents:
                # nothing is done this pass; the next one that would act tries again.
                self._unanswered(pass_id, exc)
                result = planmod.PlanResult(notes=self.notes)
            else:
                self.nodes, self._nodes_listed_at = nodes, self.clock()
                self.tracing.nodes_listed(len(nodes))
                refreshed = True
                result = self._plan(now)
        self.notes = result.notes
        self.tracing.notes(result.notes)
        with self.tracing.pass_span(
            pass_id,
            result.actions,
            jobs=len(jobs),
            nodes=len(self.nodes),
            nodes_listed="with the jobs" if with_jobs else "before acting" if refreshed else "",
        ):
            for action in result.actions:
                with self.tracing.action(action, self.failures):
                    await self._execute(action, pass_id)
        return result.actions

    def _unanswered(self, pass_id: str, exc: SlurmError) -> list[Action]:
        self._consecutive_errors += 1
        self.last_pass_error = str(exc)
        # Status may be stale; acting on a stale view could cancel what is running.
        log.warning("pass %s: Slurm did not answer, nothing done: %s", pass_id, exc)
        return []

    def _plan(self, now: float) -> planmod.PlanResult:
        views = [self._view(r) for r in self.replicas.values()]
        wanted = {k: d.wanted_at for k, d in self._demand.items() if d.wanted_at is not None}
        return planmod.plan(
            self._models(),
            views,
            self.nodes,
            wanted,
            self.failures,
            self.plan_cfg,
            now,
            new_replica_id,
        )

    def _observe(self, jobs: Sequence[Job], now: float, pass_id: str) -> list[Replica]:
        self.service_jobs.observe(jobs, now)
        seen: set[str] = set()
        idents = self._idents
        if len(idents) > 2 * len(jobs) + 64:
            # Names of jobs long gone: keep the memo the size of the queue.
            idents.clear()
        for job in jobs:
            try:
                ident = idents[job.name]
            except KeyError:
                ident = idents[job.name] = parse_job_name(self.prefix, job.name)
            if ident is None:
                continue
            model, rid = ident
            r = self.replicas.get(rid)
            if r is not None and r.listed is job:
                # The very job applied last pass (the row cache returns the same object
                # for an unchanged row), and no listed field assigned since: applying it
                # again would change nothing.
                seen.add(rid)
                self.tracing.job_seen(rid, job)
                if self._early_reports:
                    self._join_early_report(r, model, rid, pass_id)
                continue
            if r is None:
                if job.state.is_finished:
                    continue
                r = Replica(
                    replica_id=rid,
                    model=model,
                    job_id=job.job_id,
                    submitted_at=job.submit_time.timestamp() if job.submit_time else now,
                    adopted=True,
                    adopted_at=now,
                )
                self.replicas[rid] = r
                self.tracing.adopt(rid, model, job)
                self._record("adopt", model, rid, f"job {job.job_id} {job.state.value}", pass_id)
            seen.add(rid)
            if job.restarts > r.restarts or (
                r.job_state in (JobState.RUNNING, JobState.CONFIGURING)
                and job.state is JobState.PENDING
            ):
                # Preempted (or failed node) and requeued: same job, a new start.
                self._record(
                    "requeued",
                    model,
                    rid,
                    f"job {job.job_id} back in the queue ({job.reason})",
                    pass_id,
                )
                r.base_url = ""
                r.started_at = None
                r.ready_at = None
                r.draining_since = None
                r.agent_draining = ""
                r.step = ""
                r.requeued = True
            self.tracing.job_seen(rid, job)
            r.restarts = job.restarts
            r.job_state = job.state
            r.reason = job.reason
            r.nodes = job.nodes
            r.node_count = (
                max(1, len(job.components))
                if job.heterogeneous
                else max(1, job.components[0].node_count if job.components else 1)
            )
            r.gpus_per_node = _gpus_in(job.components[0].tres_per_node) if job.components else 0
            r.ends_at = job.end_time.timestamp() if job.end_time is not None else None
            if job.state in (JobState.RUNNING, JobState.CONFIGURING) and r.started_at is None:
                r.started_at = job.start_time.timestamp() if job.start_time else now
            if r.requeued and job.state in (JobState.RUNNING, JobState.CONFIGURING) and job.nodes:
                r.requeued = False
            # Last: the assignments above drop it.
            r.listed = job
            if self._early_reports:
                self._join_early_report(r, model, rid, pass_id)
        # Reap: a replica whose job is no longer listed (or listed as finished) is gone.
        gone = []
        for rid, r in list(self.replicas.items()):
            if rid in seen and not r.job_state.is_finished:
                continue
            del self.replicas[rid]
            if r.stop_reason:
                self._record("gone", r.model, rid, r.stop_reason, pass_id)
            else:
                gone.append(r)
        return gone

    def _join_early_report(self, r: Replica, model: str, rid: str, pass_id: str) -> None:
        early = self._early_reports.pop(rid, None)
        if early is not None and not (r.requeued and early.get("event") in ("ready", "heartbeat")):
            stale = self._stale(r, early)
            if stale:
                self._record("stale-report", model, rid, stale, pass_id)
            else:
                self._apply_report(r, early)

    async def _reap(self, gone: Sequence[Replica], now: float, pass_id: str) -> None:
        """Record why replicas ended that the daemon did not stop, and count failed starts.

        squeue keeps a finished job (with its final state) for MinJobAge; one that
        has already left it is looked up in accounting, in one call for all of them,
        and only in a pass that has such a job.
        """
        final: dict[str, str] = {}
        vanished = [r for r in gone if not r.job_state.is_finished]
        # Service jobs that left the listing are settled by the same one call.
        svc_since = self.service_jobs.unsettled_since()
        if vanished or svc_since is not None:
            starts = [r.submitted_at for r in vanished] + ([svc_since] if svc_since else [])
            since = datetime.fromtimestamp(min(starts) - 60)
            records: list[AccountingRecord] | None = None
            try:
                records = await self.backend.accounting(since, name_prefix=self.prefix)
            except SlurmError as exc:
                log.warning("pass %s: accounting unreachable, causes unknown: %s", pass_id, exc)
            for rec in records or ():
                final[rec.job_id] = rec.state.value + (
                    f" exit {rec.exit_code}" if rec.exit_code not in ("", "0:0") else ""
                )
            if svc_since is not None:
                self.service_jobs.settle(records, now)
        for r in gone:
            if r.job_state.is_finished:
                cause = f"job {r.job_id} ended: {r.job_state.value}"
            elif r.job_id in final:
                cause = f"job {r.job_id} ended: {final[r.job_id]}"
            else:
                cause = f"job {r.job_id} left the queue (last seen {r.job_state.value})"
            if r.agent_failed:
                cause += f"; agent: {r.agent_failed}"
            lived = now - r.ready_at if r.ready_at is not None else None
            # A replica that never served, or died soon after it began to, is a failed
            # start: it feeds the restart backoff so a crash loop slows down.
            if lived is None or lived < self.plan_cfg.min_lifetime:
                self._fail(r.model, cause)
            self._record("reap", r.model, r.replica_id, cause, pass_id)

    def _fail(self, model: str, cause: str) -> None:
        prev = self.failures.get(model)
        f = self.failures[model] = Failures((prev.count if prev else 0) + 1, self.clock(), cause)
        backoff = planmod.backoff_left(f, self.plan_cfg, f.last_at)
        self.tracing.failure(model, f, backoff, self.plan_cfg.give_up_after)

    @staticmethod
    def _view(r: Replica) -> ReplicaView:
        """The replica as the plan sees it: built from its fields alone, kept until one changes.

        Must not read anything but the replica's own fields (not the clock, not
        the reconciler): Replica.__setattr__ drops the kept view on any of those.
        """
        v = r.view
        if v is None:
            v = r.view = Reconciler._build_view(r)
        return v

    @staticmethod
    def _build_view(r: Replica) -> ReplicaView:
        return ReplicaView(
            replica_id=r.replica_id,
            model=r.model,
            job_id=r.job_id,
            state=r.state(),
            submitted_at=r.submitted_at,
            gpus_per_node=r.gpus_per_node,
            nodes=r.node_count,
            reason=r.reason,
            started_at=r.started_at,
            adopted_at=r.adopted_at,
            ready_at=r.ready_at,
            last_used=r.last_used,
            in_flight=r.in_flight,
            draining_since=r.draining_since,
            drain_reason=r.drain_reason or r.agent_draining,
            self_draining=bool(r.agent_draining) and r.draining_since is None,
            ends_at=r.ends_at,
            agent_failed=r.agent_failed,
            replaces=r.replaces,
            stop_reason=r.stop_reason,
        )

    async def _execute(self, a: Action, pass_id: str) -> None:
        models = self._models()
        try:
            if a.kind is ActionKind.SUBMIT:
                m = models[a.model]
                env, traceparent = self.tracing.open_start(a.replica_id, a.model)
                spec = self.jobs.spec(m, a.replica_id, env, traceparent=traceparent)
                job_id = await self.backend.submit(spec)
                self.tracing.submitted(a.replica_id, job_id)
                self.replicas[a.replica_id] = Replica(
                    replica_id=a.replica_id,
                    model=a.model,
                    job_id=job_id,
                    submitted_at=self.clock(),
                    gpus_per_node=m.resources.gpus,
                    node_count=m.resources.nodes,
                    replaces=a.replaces,
                )
                self._record(
                    "submit",
                    a.model,
                    a.replica_id,
                    f"{a.reason}; job {job_id}; {a.placement}",
                    pass_id,
                )
            elif a.kind is ActionKind.DRAIN:
                r = self.replicas.get(a.replica_id)
                if r is not None and r.draining_since is None:
                    r.draining_since = self.clock()
                    r.drain_reason = a.reason
                    self._record("drain", a.model, a.replica_id, a.reason, pass_id)
            elif a.kind in (ActionKind.CANCEL, ActionKind.EVICT):
                r = self.replicas.get(a.replica_id)
                if r is None or r.stop_reason:
                    return
                r.stop_reason = a.reason
                r.base_url = ""
                if a.failure:
                    self._fail(a.model, a.reason)
                await self.backend.cancel(a.job_id)
                self._record(a.kind.value, a.model, a.replica_id, a.reason, pass_id)
        except (LlmgwError, OSError) as exc:
            if a.kind is ActionKind.SUBMIT:
                self._fail(a.model, f"submit failed: {exc}")
            self._record("error", a.model, a.replica_id, f"{a.kind.value}: {exc}", pass_id)

    # ---- admin requests (llmgw-admin drain / stop) ------------------------------------

    def find_replicas(self, target: str = "", node: str = "") -> list[Replica]:
        """The replicas ``target`` names (a replica id, a model or an alias), or those on ``node``.

        Raises LookupError naming what exists when the target or node is unknown.
        A known model or node with no replica is an empty list, not an error.
        """
        if node:
            known = sorted(
                {n.name for n in self.nodes} | {n for r in self.replicas.values() for n in r.nodes}
            )
            if node not in known:
                raise LookupError(f"no node {node!r}; nodes: {', '.join(known) or 'none seen yet'}")
            return [r for r in self.replicas.values() if node in r.nodes]
        if target in self.replicas:
            return [self.replicas[target]]
        model = self.resolve(target)
        if model is not None:
            return [r for r in self.replicas.values() if r.model == model]
        models = ", ".join(m.name for m in self.catalog.models) or "none"
        reps = ", ".join(sorted(self.replicas)) or "none"
        raise LookupError(f"no replica or model {target!r}; models: {models}; replicas: {reps}")

    def request_drain(self, target: str = "", node: str = "", reason: str = "") -> list[str]:
        """Stop routing to the named replicas; the plan cancels each once its requests finish.

        A model whose ``min`` is above what is left gets replacements on the next
        pass: a drain moves replicas, it does not take a model down.
        """
        reps = self.find_replicas(target, node)
        why = reason or "drained by an admin"
        now = self.clock()
        out = []
        for r in reps:
            if r.stop_reason or r.draining_since is not None:
                continue
            r.draining_since = now
            r.drain_reason = why
            self._record("drain", r.model, r.replica_id, why)
            out.append(r.replica_id)
        self._wake.set()
        return out

    async def request_stop(self, target: str = "", node: str = "", reason: str = "") -> list[str]:
        """Cancel the named replicas now, in-flight requests or not. Raises SlurmError."""
        reps = self.find_replicas(target, node)
        why = reason or "stopped by an admin"
        out = []
        for r in reps:
            if r.stop_reason:
                continue
            url, r.stop_reason, r.base_url = r.base_url, why, ""
            try:
                await self.backend.cancel(r.job_id)
            except SlurmError:
                # Not stopping after all: the next pass must still see it as it was.
                r.stop_reason, r.base_url = "", url
                raise
            self._record("stop", r.model, r.replica_id, why)
            out.append(r.replica_id)
        self._wake.set()
        return out

    # ---- status --------------------------------------------------------------------

    @property
    def nodes_listed_at(self) -> float | None:
        """When ``nodes`` was listed (a pass keeps it up to ``nodes_max_age``); None: never."""
        return self._nodes_listed_at

    def status(self) -> dict[str, Any]:
        now = self.clock()
        models = []
        for m in self.catalog.models:
            reps = [r for r in self.replicas.values() if r.model == m.name]
            models.append(
                {
                    "name": m.name,
                    "aliases": list(m.aliases),
                    "gpus": m.resources.gpus * m.resources.nodes,
                    "min": m.scaling.min,
                    "max": m.scaling.max,
                    "state": self._model_state(m, reps),
                    "note": self.notes.get(m.name, ""),
                    "replicas": [self._replica_status(r, now) for r in reps],
                }
            )
        return {
            "models": models,
            "passes": self.passes,
            "last_pass_error": self.last_pass_error,
            "decisions": [
                {
                    "at": d.at,
                    "action": d.action,
                    "model": d.model,
                    "replica": d.replica_id,
                    "reason": d.reason,
                    "pass": d.pass_id,
                }
                for d in list(self.decisions)[-50:]
            ],
            "jobs": self.service_jobs.status(now),
        }

    def _model_state(self, m: Model, reps: list[Replica]) -> str:
        states = [r.state() for r in reps]
        n_ready = states.count(ReplicaState.READY)
        if n_ready:
            return f"ready {n_ready}"
        f = self.failures.get(m.name)
        if f is not None and f.count >= self.plan_cfg.give_up_after:
            return "failing"
        if ReplicaState.STARTING in states:
            return "starting"
        if ReplicaState.PENDING in states:
            reason = next((r.reason for r in reps if r.state() is ReplicaState.PENDING), "")
            return f"queued ({reason})" if reason else "queued"
        if f is not None:
            return "backoff"
        return "cold"

    def _replica_status(self, r: Replica, now: float) -> dict[str, Any]:
        return {
            "id": r.replica_id,
            "job_id": r.job_id,
            "state": r.state().value,
            "reason": r.reason,
            "nodes": list(r.nodes),
            "step": r.step,
            "step_seconds": dict(r.step_seconds),
            "started_at": r.started_at,
            "url": r.base_url,
            "in_flight": r.in_flight,
            "gpus": r.gpus_per_node * r.node_count,
            "submitted_at": r.submitted_at,
            "ready_since": r.ready_at,
            "last_used": r.last_used,
            "idle_s": None if r.last_used is None else round(now - r.last_used, 1),
            "time_left_s": None if r.ends_at is None else max(0, round(r.ends_at - now)),
            "adopted": r.adopted,
        }


def _gpus_in(tres_per_node: str) -> int:
    # "gres:gpu:a100:2" or "gres/gpu:2" -> 2
    if "gpu" not in tres_per_node:
        return 0
    tail = tres_per_node.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


__all__ = ["Decision", "Reconciler", "Replica"]
