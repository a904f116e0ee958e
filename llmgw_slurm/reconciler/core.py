"""The reconciler: the pass loop (observe, plan, execute, once per pass), and the
:class:`Reconciler` that composes it with the other parts.

Slurm is the source of truth for what runs: every pass starts from one
``squeue`` of the service's jobs per cluster, and from the nodes of a ``sinfo``
at most ``reconcile.nodes_max_age`` old, listed again before any placement or
eviction (see ``PassLoop.pass_once``). A cluster that does not answer leaves
its replicas as they were, and the pass goes on with the others
(:mod:`.clusters`). What Slurm does not know is kept in
memory, per replica, in the replica table (:mod:`.replicas`): what its agent
reported (the engine's URL, its steps), what the router saw (requests in
flight, last use), and the drain or stop the daemon asked for. After a daemon
restart that memory is empty: jobs are adopted from the listing, their agents
re-report on their next heartbeat, and their last use is unknown (so they are
not idle).

The parts, each over the one table: :mod:`.directory` (the router's
ModelDirectory), :mod:`.reports` (who may report: signatures, nonces),
:mod:`.intake` (what a report does to its replica) with :mod:`.probes` (the
engine must answer the daemon before it gets traffic), :class:`PassLoop` here
(with :mod:`.plan`, pure, and :mod:`.jobs`, the job of a replica),
:mod:`.admin` (drain, stop) and :mod:`.status`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from opentelemetry import trace

from llmgw_slurm.auth.tls import PinnedContexts, load_or_create_identity
from llmgw_slurm.base.errors import LlmgwError, SlurmError
from llmgw_slurm.catalog import Access, Catalog, Model
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.guard.faults import Faults
from llmgw_slurm.reconciler import plan as planmod
from llmgw_slurm.reconciler import status as statusmod
from llmgw_slurm.reconciler.admin import AdminRequests
from llmgw_slurm.reconciler.clusters import Cluster, ClusterSet
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.fence import Fence, Unfenced
from llmgw_slurm.reconciler.intake import ReportIntake
from llmgw_slurm.reconciler.jobs import JobBuilder, JobIdent, new_replica_id, parse_job_ident
from llmgw_slurm.reconciler.plan import Action, ActionKind, Failures, PlanConfig, ReplicaState
from llmgw_slurm.reconciler.probes import EngineProbe
from llmgw_slurm.reconciler.replicas import Decision, Replica, ReplicaTable, view_of
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.reconciler.svcjobs import ServiceJobs
from llmgw_slurm.router.directory import Endpoint, ModelInfo, ModelRouting
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    Job,
    JobState,
    NodeInfo,
    SlurmBackend,
    StartEstimator,
)

log = logging.getLogger(__name__)

# How last_pass_error begins when the pass itself failed, not Slurm (see _pass_surviving).
ROUND_FAILED = "the pass failed: "


class PassLoop:
    """The passes: observe (one squeue, sinfo when due), reap, plan, execute."""

    def __init__(
        self,
        table: ReplicaTable,
        server: ServerConfig,
        clusters: ClusterSet,
        jobs: JobBuilder,
        plan_cfg: PlanConfig,
        intake: ReportIntake,
        wanted: Callable[[], Mapping[str, float]],
        held_since: Callable[[], Mapping[str, float]] | None = None,
        faults: Faults | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.table = table
        # What a pass did not foresee is logged and counted here, never raised.
        self.faults = faults or Faults()
        # Who may act on Slurm (several daemons on one database: the lease's holder).
        self.fence: Fence = fence or Unfenced()
        self.server = server
        self.clusters = clusters
        self.jobs = jobs
        self.plan_cfg = plan_cfg
        # Serving this long proves a start worked (reconcile.restart.healthy_after).
        self.healthy_after = server.reconcile.restart.healthy_after
        self.intake = intake
        # When a request last asked for each model (the directory's demand).
        self.wanted = wanted
        # When each model's oldest held request began waiting (who evicts first).
        self.held_since = held_since or wanted
        self.tracing = table.tracing
        self.prefix = server.slurm.job_prefix
        # Model jobs and engine installs (llmgw-admin fetch / install-engine), for status.
        self.service_jobs = ServiceJobs(server)
        # Job names listed on a cluster they do not name (two clusters: entries reach
        # one Slurm?): warned about once each, never adopted.
        self._misplaced: set[str] = set()
        self.failures: dict[str, Failures] = {}
        self.notes: dict[str, str] = {}
        # Job name -> (model, replica id), or None when not a replica's: a job keeps its
        # name, and parsing 2,000 names per pass cost 3 ms.
        self._idents: dict[str, JobIdent | None] = {}
        self.passes = 0
        # Under each lease epoch this daemon held, when its first pass began (Unix
        # time): a failover's end, for status and bench/ha.py.
        self.first_pass_at: dict[int, float] = {}
        self._consecutive_errors = 0
        # Why the last pass itself failed (a bug, EMFILE; ROUND_FAILED first), "" after
        # one that ran: shown before any cluster's own error.
        self._failed_pass = ""

    @property
    def backend(self) -> SlurmBackend:
        """The first cluster's backend (the only one, without ``clusters:``)."""
        return self.clusters.first.backend

    @backend.setter
    def backend(self, backend: SlurmBackend) -> None:
        self.clusters.first.backend = backend

    @property
    def last_pass_error(self) -> str:
        """Why the clusters that do not answer do not ("" when all do); one cluster's
        error alone, as it was before clusters had names; first, why the last pass
        itself failed, if it did."""
        if self._failed_pass:
            return self._failed_pass
        failing = [c for c in self.clusters if c.unanswered_since is not None]
        if not self.clusters.named:
            return failing[0].last_error if failing else ""
        return "; ".join(f"{c.name}: {c.last_error}" for c in failing)

    async def run(self, stop: asyncio.Event, on_pass: Callable[[], None] | None = None) -> None:
        """Pass after pass until ``stop`` is set; a want() or a report wakes it early.

        ``on_pass`` is called after every pass, a failed one included (the daemon
        tells systemd it is ready after the first).
        """
        interval = self.server.reconcile.interval
        while not stop.is_set():
            if self.fence.acting():
                epoch = self.fence.epoch
                if epoch is not None and epoch not in self.first_pass_at:
                    self.first_pass_at[epoch] = time.time()
                await self._pass_surviving()
            # Not leading (another daemon holds the lease): no squeue, no plan; the
            # directory follows the leader's table through the database.
            if on_pass is not None:
                with self.faults.caught("after_pass"):
                    on_pass()
            # Back off when Slurm does not answer: a storm of commands at a slurmctld
            # that is restarting helps nobody.
            delay = interval * min(2**self._consecutive_errors, 12)
            self.table.wake.clear()
            waits = [
                asyncio.ensure_future(stop.wait()),
                asyncio.ensure_future(self.table.wake.wait()),
            ]
            try:
                await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _pass_surviving(self) -> None:
        """One pass; whatever it raises ends the pass, never the daemon.

        Slurm not answering is foreseen (``_list``); this is for the rest: a
        bug, or the kernel refusing a resource (EMFILE in a spawn). It is
        logged and counted, the pass counts as failed for the backoff, and
        the next pass runs.
        """
        try:
            await self.pass_once()
        except Exception as err:
            self.faults.record("pass", err)
            self._consecutive_errors += 1
            self._failed_pass = f"{ROUND_FAILED}{type(err).__name__}: {err}"[:300]
        else:
            self._failed_pass = ""

    async def pass_once(self) -> list[Action]:
        pass_id = uuid.uuid4().hex[:8]
        self.tracing.begin_pass()
        listing = await self._list(pass_id)
        if listing is None:
            return []
        jobs, fresh, now = listing
        await self._reap(self._observe(jobs, now, pass_id), now, pass_id)
        self._forgive(now)
        self._scrape_waiting()
        answering = set(jobs)
        result = self._plan(now, answering)
        refreshed = False
        if result.nodes_decide and not answering <= fresh:
            result, refreshed = await self._plan_on_fresh_nodes(now, answering, fresh, pass_id)
        self._strand(result.lost_with_cluster, pass_id)
        actions = await self._unfenced(result.actions, jobs, pass_id)
        self.notes = result.notes
        self.tracing.notes(result.notes)
        with_nodes = bool(fresh) and answering <= fresh
        with self.tracing.pass_span(
            pass_id,
            actions,
            jobs=sum(len(js) for js in jobs.values()),
            nodes=len(self.table.nodes),
            nodes_listed="with the jobs" if with_nodes else "before acting" if refreshed else "",
        ):
            for action in actions:
                with self.tracing.action(action, self.failures):
                    await self._execute(action, pass_id)
        return actions

    async def _unfenced(
        self, actions: Sequence[Action], jobs: Mapping[str, Sequence[Job]], pass_id: str
    ) -> list[Action]:
        """The plan's actions less the submissions an earlier leader may have made already.

        A new leader's first passes: a replica whose sbatch an earlier leader began
        and never said it finished may be on its way to slurmctld, not yet listed;
        its model gets no new replica until the job is listed (then adopted) or the
        action's deadline passes.
        """
        if not any(a.kind is ActionKind.SUBMIT for a in actions):
            return list(actions)
        try:
            open_ = await self.fence.open_submits({j.name for js in jobs.values() for j in js})
        except (LlmgwError, OSError, TimeoutError) as exc:
            log.warning(
                "pass %s: earlier leaders' actions unknown, no submission: %s", pass_id, exc
            )
            return [a for a in actions if a.kind is not ActionKind.SUBMIT]
        waiting = {o.model: o for o in open_}
        out = []
        for a in actions:
            o = waiting.get(a.model) if a.kind is ActionKind.SUBMIT else None
            if o is None:
                out.append(a)
            else:
                self.table.record(
                    "wait-previous-leader",
                    a.model,
                    o.replica_id,
                    f"an earlier leader's submission of {o.target} is not listed yet",
                    pass_id,
                )
        return out

    async def _list(self, pass_id: str) -> tuple[dict[str, list[Job]], set[str], float] | None:
        """Each cluster's jobs (one listing each, the clusters at once), the clusters
        whose nodes were listed beside them, and the pass's time (when they were
        listed); None when no cluster answered.

        A cluster whose last listings failed is asked again only after its backoff
        (Cluster.due). Its nodes are listed with its jobs only when its last listing
        is too old; otherwise the pass plans with it and lists them again only if the
        plan says the nodes decide an action (_plan_on_fresh_nodes). A pass that
        changes nothing then costs one squeue per cluster: on a quiet cluster sinfo
        was half of a pass's cost.
        """
        asked_at = self.table.clock()
        # One cluster: the pass's own backoff (run()) is its backoff.
        due = [c for c in self.clusters if len(self.clusters) == 1 or c.due(asked_at)]
        got = await asyncio.gather(*(self._list_one(c, asked_at, pass_id) for c in due))
        now = self.table.clock()
        jobs: dict[str, list[Job]] = {}
        fresh: set[str] = set()
        for c, out in zip(due, got, strict=True):
            if out is None:
                continue
            c.answered(now)
            jobs[c.name], nodes = out
            if nodes is not None:
                c.nodes, c.nodes_listed_at = nodes, now
                fresh.add(c.name)
        if not jobs:
            self._consecutive_errors += bool(due)
            return None
        self.tracing.observed(nodes_listed=bool(fresh))
        self._consecutive_errors = 0
        self.passes += 1
        self._nodes_changed()
        return jobs, fresh, now

    async def _list_one(
        self, c: Cluster, asked_at: float, pass_id: str
    ) -> tuple[list[Job], list[NodeInfo] | None] | None:
        """One cluster's jobs, and its nodes when its listing of them is too old; None
        (its failure recorded) when it did not answer."""
        age = asked_at - c.nodes_listed_at if c.nodes_listed_at is not None else None
        with_nodes = age is None or not 0 <= age < self.server.reconcile.nodes_max_age
        try:
            if with_nodes:
                jobs, nodes = await asyncio.gather(
                    c.backend.list_jobs(self.prefix), c.backend.list_nodes()
                )
                return jobs, nodes
            return await c.backend.list_jobs(self.prefix), None
        except SlurmError as exc:
            self._unanswered(c, pass_id, exc)
            return None

    def _nodes_changed(self) -> None:
        """The table's view of the nodes (status, admin, report checks): every cluster's."""
        self.table.nodes = self.clusters.all_nodes()
        self.table.nodes_listed_at = self.clusters.oldest_listing()

    def _forgive(self, now: float) -> None:
        """Clear a model's failed starts once one of its replicas served ``healthy_after``.

        Ready is not yet proof that the engine stays up: one that dies at its first
        request would otherwise restart at once, forever.
        """
        for r in self.table.replicas.values():
            if (
                r.model in self.failures
                and r.ready_at is not None
                and r.base_url
                and not r.agent_failed
                and now - r.ready_at >= self.healthy_after
            ):
                self.failures.pop(r.model, None)

    async def _plan_on_fresh_nodes(
        self, now: float, answering: set[str], fresh: set[str], pass_id: str
    ) -> tuple[planmod.PlanResult, bool]:
        """The plan again on nodes listed now; (the plan, whether the nodes were listed).

        About to place or evict on an earlier pass's nodes: list the nodes of the
        ``answering`` clusters not listed ``fresh`` with the jobs now, and plan again
        (plan() is pure and cheap), so the decision follows what is free now. sinfo
        runs after squeue here, not beside it: only passes that would act pay for it
        (and every pass while a queued replica fits on the kept listing and something
        could be evicted for it).
        """
        self.tracing.listing_nodes()
        listed = [c for c in self.clusters if c.name in answering - fresh]
        got = await asyncio.gather(
            *(c.backend.list_nodes() for c in listed), return_exceptions=True
        )
        for c, nodes in zip(listed, got, strict=True):
            if isinstance(nodes, SlurmError):
                # The jobs are applied (and what they showed is traced), but acting on
                # nodes that may be wrong is what this listing prevents: nothing is done
                # this pass; the next one that would act tries again.
                self._unanswered(c, pass_id, nodes)
                self._consecutive_errors += 1
                return planmod.PlanResult(notes=self.notes), False
            if isinstance(nodes, BaseException):
                raise nodes
            c.nodes, c.nodes_listed_at = nodes, self.table.clock()
        self._nodes_changed()
        self.tracing.nodes_listed(len(self.table.nodes))
        return self._plan(now, answering), True

    def _unanswered(self, c: Cluster, pass_id: str, exc: SlurmError) -> None:
        c.failed(self.table.clock(), str(exc), self.server.reconcile.interval)
        # Status may be stale; acting on a stale view could cancel what is running.
        where = f" {c.name}" if c.name else ""
        log.warning("pass %s: Slurm%s did not answer, nothing done there: %s", pass_id, where, exc)

    def _strand(self, lost: Sequence[str], pass_id: str) -> None:
        """Mark the replicas the plan no longer counts because their cluster is down."""
        for rid in lost:
            r = self.table.replicas.get(rid)
            if r is not None and not r.stranded:
                r.stranded = True
                why = f"cluster {r.cluster} down: {self.clusters.of_replica(r.cluster).last_error}"
                self.table.record("stranded", r.model, rid, why, pass_id)

    def _scrape_waiting(self) -> None:
        """Start reading the engines' queues of the models that scale on them; the
        plan uses the last reading, a pass old (the pass does not wait on engines)."""
        scaled = {
            m.name for m in self.table.catalog.models if m.scaling.scale_on == "engine_waiting"
        }
        if not scaled:
            return
        for r in self.table.replicas.values():
            if r.model in scaled and r.base_url and r.state() is ReplicaState.READY:

                def done(n: int, r: Replica = r) -> None:
                    r.engine_waiting = n

                self.intake.probe.scrape_waiting(r.replica_id, r.base_url, r.engine_cert, done)

    def _plan(self, now: float, answering: set[str]) -> planmod.PlanResult:
        views = [view_of(r) for r in self.table.replicas.values()]
        wanted = self.wanted()
        return planmod.plan(
            self.table.models(),
            views,
            self.table.nodes,
            wanted,
            self.failures,
            self.plan_cfg,
            now,
            new_replica_id,
            held_since=self.held_since(),
            clusters=self.clusters.views(answering, now, self.server.reconcile.cluster_down_after),
        )

    def _observe(
        self, listing: Mapping[str, Sequence[Job]], now: float, pass_id: str
    ) -> list[Replica]:
        """Apply each answering cluster's listing to the table; returns the replicas whose
        jobs are gone.

        A job of the service's that the table does not know is adopted (a daemon
        restarted, or a submission raced the listing); a replica its cluster's listing
        no longer shows (or shows finished) leaves the table. A cluster that did not
        answer leaves its replicas as they were.
        """
        seen: set[str] = set()
        if len(self._idents) > 2 * sum(len(js) for js in listing.values()) + 64:
            # Names of jobs long gone: keep the memo the size of the queue.
            self._idents.clear()
        for cluster, jobs in listing.items():
            self.service_jobs.observe(jobs, now, cluster)
            for job in jobs:
                rid = self._observe_job(cluster, job, now, pass_id)
                if rid:
                    seen.add(rid)
        return self._unlisted(seen, set(listing), pass_id)

    def _observe_job(self, cluster: str, job: Job, now: float, pass_id: str) -> str:
        """Apply one listed job to its replica (adopted if new); its replica id, or ""."""
        ident = self._ident(job.name)
        if ident is None:
            return ""
        model, rid, named = ident
        r = self.table.replicas.get(rid)
        if (named and cluster and named != cluster) or (r is not None and r.cluster != cluster):
            self._misplaced_job(cluster, job)
            return ""
        if r is None:
            if job.state.is_finished:
                return ""
            r = self._adopt(job, model, rid, cluster, now, pass_id)
        if r.listed is job:
            # The very job applied last pass (the row cache returns the same object
            # for an unchanged row), and no listed field assigned since: applying it
            # again would change nothing.
            self.tracing.job_seen(rid, job)
        else:
            self._apply_listing(r, job, now, pass_id)
        if self.intake.early:
            self.intake.join_early(r, model, rid, pass_id)
        return rid

    def _misplaced_job(self, cluster: str, job: Job) -> None:
        """A replica's job listed on a cluster other than the one it was submitted to:
        two clusters: entries that reach one Slurm. Never adopted twice; said once."""
        if job.name not in self._misplaced:
            self._misplaced.add(job.name)
            log.warning(
                "job %s (%s) is listed on cluster %s but named for another: do two entries "
                "of clusters: reach the same Slurm? Left alone.",
                job.job_id,
                job.name,
                cluster,
            )

    def _ident(self, name: str) -> JobIdent | None:
        """(model, replica id, cluster) of a job name, None when not a replica's."""
        try:
            return self._idents[name]
        except KeyError:
            ident = self._idents[name] = parse_job_ident(self.prefix, name)
            return ident

    def _placed(self, r: Replica, job: Job, pass_id: str) -> None:
        """Where Slurm started the job: the submit decision only said where there was room."""
        if r.listed is None and r.adopted:
            return  # the adopt decision of this pass says it (a daemon restart adopts many)
        self.table.record(
            "running", r.model, r.replica_id, f"job {job.job_id} on {','.join(job.nodes)}", pass_id
        )

    def _adopt(
        self, job: Job, model: str, rid: str, cluster: str, now: float, pass_id: str
    ) -> Replica:
        r = Replica(
            replica_id=rid,
            model=model,
            job_id=job.job_id,
            submitted_at=job.submit_time.timestamp() if job.submit_time else now,
            cluster=cluster,
            adopted=True,
            adopted_at=now,
        )
        self.table.replicas[rid] = r
        self.tracing.adopt(rid, model, job)
        where = f" on {','.join(job.nodes)}" if job.nodes else ""
        if cluster:
            where += f" of cluster {cluster}" if job.nodes else f" on cluster {cluster}"
        reason = f"job {job.job_id} {job.state.value}{where}"
        self.table.record("adopt", model, rid, reason, pass_id)
        return r

    def _apply_listing(self, r: Replica, job: Job, now: float, pass_id: str) -> None:
        """Set the replica's listed fields (``replicas._LISTED``) from its job's row."""
        running = (JobState.RUNNING, JobState.CONFIGURING)
        if job.restarts > r.restarts or (r.job_state in running and job.state is JobState.PENDING):
            self._requeued(r, job, pass_id)
        self.tracing.job_seen(r.replica_id, job)
        if job.state in running and job.nodes and not r.nodes:
            # First seen running (again, after a requeue: a pending job lists no nodes).
            self._placed(r, job, pass_id)
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
        if job.state in running and r.started_at is None:
            r.started_at = job.start_time.timestamp() if job.start_time else now
        if r.requeued and job.state in running and job.nodes:
            r.requeued = False
        # Last: the assignments above drop it.
        r.listed = job

    def _requeued(self, r: Replica, job: Job, pass_id: str) -> None:
        """Preempted (or its node failed) and requeued: the same job, a new start."""
        reason = f"job {job.job_id} back in the queue ({job.reason})"
        self.table.record("requeued", r.model, r.replica_id, reason, pass_id)
        r.base_url = ""
        r.started_at = None
        r.ready_at = None
        r.draining_since = None
        r.agent_draining = ""
        r.step = ""
        r.requeued = True

    def _unlisted(self, seen: set[str], listed: set[str], pass_id: str) -> list[Replica]:
        """Drop the replicas whose job is no longer listed (or listed as finished) by
        their cluster, among the ``listed`` clusters (those that answered).

        Returns those the daemon did not stop, for _reap to find out why they ended.
        """
        gone = []
        for rid, r in list(self.table.replicas.items()):
            if r.cluster not in listed or (rid in seen and not r.job_state.is_finished):
                continue
            del self.table.replicas[rid]
            if r.stop_reason:
                self.table.record("gone", r.model, rid, r.stop_reason, pass_id)
            else:
                gone.append(r)
        return gone

    async def _reap(self, gone: Sequence[Replica], now: float, pass_id: str) -> None:
        """Record why replicas ended that the daemon did not stop, and count failed starts.

        squeue keeps a finished job (with its final state) for MinJobAge; one that
        has already left it is looked up in accounting, in one call per cluster for
        all of them, and only in a pass that has such a job there.
        """
        final: dict[tuple[str, str], str] = {}
        vanished = [r for r in gone if not r.job_state.is_finished]
        for c in self.clusters:
            final.update(await self._final_states(c, vanished, now, pass_id))
        for r in gone:
            if r.job_state.is_finished:
                cause = f"job {r.job_id} ended: {r.job_state.value}"
            elif (r.cluster, r.job_id) in final:
                cause = f"job {r.job_id} ended: {final[r.cluster, r.job_id]}"
            else:
                cause = f"job {r.job_id} left the queue (last seen {r.job_state.value})"
            if r.agent_failed:
                cause += f"; agent: {r.agent_failed}"
            lived = now - r.ready_at if r.ready_at is not None else None
            # A replica that never served, or died soon after it began to, is a failed
            # start: it feeds the restart backoff so a crash loop slows down.
            if lived is None or lived < self.healthy_after:
                self.fail(r.model, cause)
            self.table.record("reap", r.model, r.replica_id, cause, pass_id)

    async def _final_states(
        self, c: Cluster, vanished: Sequence[Replica], now: float, pass_id: str
    ) -> dict[tuple[str, str], str]:
        """The final states on cluster ``c`` of the replicas that left its queue, by
        (cluster, job id): job ids are per cluster. Service jobs that left its listing
        are settled by the same one call."""
        mine = [r for r in vanished if r.cluster == c.name]
        svc_since = self.service_jobs.unsettled_since(c.name)
        if not mine and svc_since is None:
            return {}
        starts = [r.submitted_at for r in mine] + ([svc_since] if svc_since else [])
        since = datetime.fromtimestamp(min(starts) - 60)
        records: list[AccountingRecord] | None = None
        try:
            records = await c.backend.accounting(since, name_prefix=self.prefix)
        except SlurmError as exc:
            log.warning("pass %s: accounting unreachable, causes unknown: %s", pass_id, exc)
        if svc_since is not None:
            self.service_jobs.settle(records, now, c.name)
        return {
            (c.name, rec.job_id): rec.state.value
            + (f" exit {rec.exit_code}" if rec.exit_code not in ("", "0:0") else "")
            for rec in records or ()
        }

    def fail(self, model: str, cause: str) -> None:
        prev = self.failures.get(model)
        f = self.failures[model] = Failures(
            (prev.count if prev else 0) + 1, self.table.clock(), cause
        )
        backoff = planmod.backoff_left(f, self.plan_cfg, f.last_at)
        self.tracing.failure(model, f, backoff, self.plan_cfg.give_up_after)

    async def _execute(self, a: Action, pass_id: str) -> None:
        try:
            if a.kind is ActionKind.SUBMIT:
                await self._submit(a, pass_id)
            elif a.kind is ActionKind.DRAIN:
                r = self.table.replicas.get(a.replica_id)
                if r is not None and r.draining_since is None:
                    r.draining_since = self.table.clock()
                    r.drain_reason = a.reason
                    self.table.record("drain", a.model, a.replica_id, a.reason, pass_id)
            elif a.kind in (ActionKind.CANCEL, ActionKind.EVICT):
                await self._stop(a, pass_id)
        except (LlmgwError, OSError) as exc:
            if a.kind is ActionKind.SUBMIT:
                self.fail(a.model, f"submit failed: {exc}")
            self.table.record("error", a.model, a.replica_id, f"{a.kind.value}: {exc}", pass_id)

    async def _submit(self, a: Action, pass_id: str) -> None:
        m = self.table.models()[a.model]
        cluster, chosen = await self._where(a, m)
        c = self.clusters.of_replica(cluster)
        ticket = await self.fence.begin(
            "submit", a.model, a.replica_id, self.jobs.name(m, a.replica_id, c.name)
        )
        if ticket is None:
            self.table.record("fenced", a.model, a.replica_id, "submit: not the leader", pass_id)
            return
        env, traceparent = self.tracing.open_start(a.replica_id, a.model)
        spec = self.jobs.spec(
            m, a.replica_id, env, traceparent=traceparent, cluster=c.settings,
            lease_epoch=ticket.epoch,
        )  # fmt: skip
        try:
            job_id = await c.backend.submit(spec)
        except BaseException as exc:
            await self.fence.end(ticket, f"failed: {exc}")
            raise
        await self.fence.end(ticket, f"job {job_id}")
        self.tracing.submitted(a.replica_id, job_id, cluster=c.name)
        self.table.replicas[a.replica_id] = Replica(
            replica_id=a.replica_id,
            model=a.model,
            job_id=job_id,
            submitted_at=self.table.clock(),
            cluster=c.name,
            gpus_per_node=m.resources.gpus,
            node_count=m.resources.nodes,
            replaces=a.replaces,
        )
        self.table.record(
            "submit", a.model, a.replica_id, _submit_reason(a, job_id, c.name, chosen), pass_id
        )

    async def _where(self, a: Action, m: Model) -> tuple[str, str]:
        """The cluster a SUBMIT goes to, and why when Slurm chose it: the plan's cluster,
        or, for a replica that fits on none now, the candidate where ``sbatch
        --test-only`` says it would start first (asked of all of them at once; a
        cluster that cannot say counts as never).

        Asked of Slurm here rather than planned: the estimate is Slurm's scheduler's
        (priorities, reservations, backfill), which no node listing shows, and it
        costs one call per candidate, only for a replica that would queue anyway.
        """
        if a.cluster or not a.candidates:
            return a.cluster, ""
        candidates = [self.clusters.of_replica(n) for n in a.candidates]
        got = await asyncio.gather(*(self._will_start(c, m, a.replica_id) for c in candidates))
        starts = dict(zip(a.candidates, got, strict=True))
        return planmod.earliest_start(a.candidates, starts, self.table.clock())

    async def _will_start(self, c: Cluster, m: Model, rid: str) -> float | str:
        if not isinstance(c.backend, StartEstimator):
            return "cannot say (its backend has no will-run query)"
        try:
            spec = self.jobs.spec(m, rid, cluster=c.settings)
            return (await c.backend.will_start(spec)).timestamp()
        except (LlmgwError, OSError) as exc:
            return f"refuses ({_first_line(exc)})"

    async def _stop(self, a: Action, pass_id: str) -> None:
        """Cancel (or evict) a replica's job on its cluster. A cancel that Slurm did not
        take leaves the replica as it was, for the next pass to decide again."""
        r = self.table.replicas.get(a.replica_id)
        if r is None or r.stop_reason:
            return
        ticket = await self.fence.begin(a.kind.value, a.model, a.replica_id, a.job_id)
        if ticket is None:
            self.table.record(
                "fenced", a.model, a.replica_id, f"{a.kind.value}: not the leader", pass_id
            )
            return
        url, r.stop_reason, r.base_url = r.base_url, a.reason, ""
        try:
            await self.clusters.of_replica(r.cluster).backend.cancel(a.job_id)
        except SlurmError:
            r.stop_reason, r.base_url = "", url
            raise
        finally:
            await self.fence.end(ticket, "cancelled")
        if a.failure:
            self.fail(a.model, a.reason)
        self.table.record(a.kind.value, a.model, a.replica_id, a.reason, pass_id)


def _first_line(exc: BaseException) -> str:
    text = (getattr(exc, "stderr", "") or str(exc)).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else str(exc))[:200]


class Reconciler:
    """Keeps each catalog model at the right number of replicas; implements ModelDirectory.

    A composition: the replica table all parts share; the router's directory
    over it; the verifier and the intake of agents' reports, with the engine
    probe; the pass loop; admin requests and status. Its methods are the ones
    the router (as a ``ModelDirectory``) and the daemon call; a caller that needs
    one part takes that part (the admin routes ``admin``, the span route
    ``verifier``, the charts ``clusters``, the shared database ``table``,
    ``directory`` and ``pass_loop``), handed over by the daemon, not this class.

    ``backend``: the one cluster's backend, or each cluster's by its name in
    server.yaml's clusters (``daemon.cluster_backends``).
    """

    def __init__(
        self,
        catalog: Catalog,
        server: ServerConfig,
        backend: SlurmBackend | Mapping[str, SlurmBackend],
        server_key: bytes,
        daemon_url: str,
        *,
        clock: Callable[[], float] = time.time,
        hold_timeout: float | None = None,
        agent_ready_timeout: float = 900.0,
        tracer: trace.Tracer | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.server = server
        self.server_key = server_key
        rc = server.reconcile
        plan_cfg = PlanConfig(
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
            cluster_down_after=rc.cluster_down_after,
            fair_share=server.scaling.fair_share,
            max_wait=server.scaling.max_wait,
            min_slice=server.scaling.min_slice,
        )
        backends = backend if isinstance(backend, Mapping) else {"": backend}
        if not isinstance(backend, Mapping) and server.clusters:
            backends = {c.name: backend for c in server.clusters}
        self.clusters = ClusterSet.of(server.cluster_list, backends)
        # Spans of passes and replica starts; no-ops (and no TRACEPARENT for jobs) when off.
        # On with an exporter, or with the daemon's trace store (whose tracer the
        # daemon passes); a reconciler given no tracer with tracing off makes none.
        self.tracing = ReconcileTracing(
            tracer,
            server.tracing.enabled or (server.tracing.keep_spans > 0 and tracer is not None),
        )
        self.table = ReplicaTable(catalog, clock, self.tracing)
        # The gateway's client identity: the only client, beside each replica's
        # own agent, that the replicas' engines let in (llmgw_slurm/auth/tls.py).
        self.engine_tls = PinnedContexts(load_or_create_identity(Path(server.state_dir)))
        self.directory = ReplicaDirectory(
            self.table, server_key, self.engine_tls, want_window=plan_cfg.want_window
        )
        self.verifier = ReportVerifier(server_key, Path(server.state_dir) / "report-nonces")
        self.probe = EngineProbe(server_key, self.engine_tls)
        self.intake = ReportIntake(self.table, self.probe, self.directory.signal_ready)
        # Failures the daemon survives (passes, reports, the usage writer), for /metrics.
        self.faults = Faults()
        self.pass_loop = PassLoop(
            self.table,
            server,
            self.clusters,
            JobBuilder(server, server_key, daemon_url, self.engine_tls.identity.cert_pem),
            plan_cfg,
            self.intake,
            self.directory.wanted_at,
            self.directory.held_since,
            self.faults,
            fence,
        )
        self.admin = AdminRequests(
            self.table, self.clusters, self.pass_loop.service_jobs, self.pass_loop.prefix
        )
        # The daemons sharing a database, the leader and its lease (for status);
        # None with one daemon alone.
        self.peers: Callable[[], dict[str, Any]] | None = None

    # ---- what the parts share ------------------------------------------------------

    @property
    def catalog(self) -> Catalog:
        return self.table.catalog

    @property
    def clock(self) -> Callable[[], float]:
        return self.table.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.table.clock = clock

    @property
    def backend(self) -> SlurmBackend:
        return self.pass_loop.backend

    @backend.setter
    def backend(self, backend: SlurmBackend) -> None:
        """Replace the first cluster's backend (the only one, without ``clusters:``)."""
        self.pass_loop.backend = backend

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.table.replicas

    @property
    def nodes(self) -> list[NodeInfo]:
        return self.table.nodes

    @property
    def nodes_listed_at(self) -> float | None:
        """When ``nodes`` was listed (a pass keeps it up to ``nodes_max_age``); None: never."""
        return self.table.nodes_listed_at

    @property
    def decisions(self) -> collections.deque[Decision]:
        return self.table.decisions

    @property
    def plan_cfg(self) -> PlanConfig:
        return self.pass_loop.plan_cfg

    @property
    def jobs(self) -> JobBuilder:
        return self.pass_loop.jobs

    @property
    def service_jobs(self) -> ServiceJobs:
        return self.pass_loop.service_jobs

    @property
    def failures(self) -> dict[str, Failures]:
        return self.pass_loop.failures

    @property
    def notes(self) -> dict[str, str]:
        return self.pass_loop.notes

    @property
    def passes(self) -> int:
        return self.pass_loop.passes

    @property
    def last_pass_error(self) -> str:
        return self.pass_loop.last_pass_error

    def clusters_for(self, model: Model) -> list[str]:
        """The clusters a job of ``model`` may go to, in order: those that answer, among
        its resources.clusters, where it fits now on their last node listing first (then
        in server.yaml's order). For batch jobs, which queue like any job."""
        ok = [
            c
            for c in self.clusters
            if c.unanswered_since is None and model.resources.may_run_on(c.name)
        ]

        def room(c: Cluster) -> bool:
            cfg = dataclasses.replace(self.plan_cfg, default_partition=c.settings.partition)
            return planmod.fits(model, c.nodes, cfg, {})[0]

        return [c.name for c in sorted(ok, key=lambda c: not room(c))]

    def set_catalog(self, catalog: Catalog) -> None:
        """Swap in a reloaded catalog; the next pass acts on it."""
        self.table.catalog = catalog
        self.table.wake.set()

    # ---- ModelDirectory (called on the event loop; cheap, no I/O) ----------------

    def resolve(self, name: str) -> str | None:
        return self.directory.resolve(name)

    def models(self) -> Sequence[ModelInfo]:
        return self.directory.models()

    def endpoints(self, model: str) -> Sequence[Endpoint]:
        return self.directory.endpoints(model)

    def access(self, model: str) -> Access | None:
        return self.directory.access(model)

    def routing(self, model: str) -> ModelRouting | None:
        return self.directory.routing(model)

    def request_started(self, model: str, replica_id: str) -> None:
        self.directory.request_started(model, replica_id)

    def request_finished(self, model: str, replica_id: str) -> None:
        self.directory.request_finished(model, replica_id)

    def idle_for(self, model: str, replica_id: str) -> float | None:
        return self.directory.idle_for(model, replica_id)

    def want(self, model: str) -> None:
        """Someone asked for ``model`` to start (``llmgw up``). A model with a ready
        replica needs nothing: recorded as a waiting request, the ask would start the
        model again after a drain, "for" a request nobody holds."""
        if self.table.has_ready(model):
            return
        self.directory.want(model)

    async def wait_ready(self, model: str) -> None:
        await self.directory.wait_ready(model)

    def start_span_context(self, model: str) -> trace.SpanContext | None:
        """The start span of a starting replica of ``model`` (held requests link to it)."""
        return self.directory.start_span_context(model)

    # ---- agent reports -------------------------------------------------------------

    def report(self, replica_id: str, secret: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """An agent's report, checked against its replica's secret, for in-process
        callers (the HTTP route takes only signed reports: ``report_signed``).
        Raises PermissionError on a bad secret."""
        self.verifier.check_secret(replica_id, secret)
        return self.intake.report(replica_id, body)

    def report_signed(
        self, replica_id: str, authorization: str, raw: bytes, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """An agent's signed report (``raw``: the body's exact bytes, ``body`` them parsed).

        Raises PermissionError, saying why, on a malformed, wrong, old or replayed
        signature.
        """
        self.verifier.verify(replica_id, authorization, raw)
        return self.intake.report(replica_id, body)

    # ---- the passes ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event, on_pass: Callable[[], None] | None = None) -> None:
        """Pass after pass until ``stop`` is set; a want() or a report wakes it early."""
        await self.pass_loop.run(stop, on_pass)

    async def pass_once(self) -> list[Action]:
        return await self.pass_loop.pass_once()

    async def close(self) -> None:
        await self.probe.close()
        self.verifier.close()

    # ---- admin requests (the admin routes take ``admin`` itself) and status ---------

    def request_drain(self, target: str = "", node: str = "", reason: str = "") -> list[str]:
        return self.admin.request_drain(target, node, reason)

    def status(self) -> dict[str, Any]:
        return statusmod.status(
            self.table,
            notes=self.pass_loop.notes,
            failures=self.pass_loop.failures,
            give_up_after=self.pass_loop.plan_cfg.give_up_after,
            passes=self.pass_loop.passes,
            last_pass_error=self.pass_loop.last_pass_error,
            service_jobs=self.pass_loop.service_jobs,
            clusters=self.clusters,
            down_after=self.server.reconcile.cluster_down_after,
        )


def _gpus_in(tres_per_node: str) -> int:
    # "gres:gpu:a100:2" or "gres/gpu:2" -> 2
    if "gpu" not in tres_per_node:
        return 0
    tail = tres_per_node.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


__all__ = ["Decision", "PassLoop", "Reconciler", "Replica"]


def _submit_reason(a: Action, job_id: str, cluster: str = "", chosen: str = "") -> str:
    """The submit decision's reason: why, the job (and its cluster), where the plan saw
    room, told as the plan's view: Slurm picks the node (the ``running`` decision says
    which); and, for a cluster Slurm's estimate chose, why that one (``chosen``)."""
    job = f"job {job_id} on {cluster}" if cluster else f"job {job_id}"
    if not a.placement or a.placement.startswith("no room now: "):
        placement = a.placement
    else:
        placement = f"room now on {a.placement}"
    return "; ".join(p for p in (a.reason, job, placement, chosen) if p)
