"""What an agent's report means for its replica: steps, readiness, failure, drain.

A report reaches here once :mod:`llmgw_slurm.reconciler.reports` has checked
its signature. One for a replica whose job is not listed yet (right after a
daemon restart, or a report racing the first listing) is kept and joined on
the next pass. One that cannot come from the replica's current job (another
job id, another node) is never routed to. A replica becomes routable only
once the daemon's own probe (:mod:`llmgw_slurm.reconciler.probes`) reaches its
engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmgw_slurm.auth.tls import engine_address_problem
from llmgw_slurm.reconciler.plan import ReplicaState
from llmgw_slurm.reconciler.probes import EngineProbe
from llmgw_slurm.reconciler.replicas import Replica, ReplicaTable
from llmgw_slurm.slurm.types import JobState

__all__ = ["ReportIntake"]


class ReportIntake:
    """Applies agents' reports to the replica table; keeps those not yet joinable."""

    def __init__(
        self, table: ReplicaTable, probe: EngineProbe, on_ready: Callable[[str], None]
    ) -> None:
        self.table = table
        self.probe = probe
        # Called with the model when one of its replicas becomes routable.
        self.on_ready = on_ready
        # Reports from agents whose job the daemon has not listed yet (right after a
        # restart, or a report racing the first listing): joined on the next pass.
        self.early: dict[str, dict[str, Any]] = {}

    def report(self, replica_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A verified report's effect; the answer to the agent (``drain``: stop serving)."""
        r = self.table.replicas.get(replica_id)
        if r is None:
            # The secret proves the agent runs this replica; its job is simply not
            # listed yet. Keep the report for the next pass rather than refuse it.
            self.early[replica_id] = dict(body)
            self.table.wake.set()
            return {"ok": True, "drain": False}
        stale = self.stale(r, body)
        if stale:
            # An agent the listing says is not this replica's: never routed to. One of
            # another job, or of an earlier run left behind on a node Slurm lost, is
            # told to drain so that its engine stops holding GPUs Slurm has handed on.
            self.table.record("stale-report", r.model, replica_id, stale)
            return {"ok": True, "drain": not stale.startswith("report from node") or r.restarts > 0}
        if r.requeued and body.get("event") in ("ready", "heartbeat"):
            # Back in the queue, not yet seen running again: this is the previous run's
            # agent, or the new run's before the listing says where it runs. The next
            # pass tells them apart by node; until then nothing is routed.
            self.early[replica_id] = dict(body)
            self.table.wake.set()
            return {"ok": True, "drain": False}
        self.apply(r, body)
        return {"ok": True, "drain": r.state() in (ReplicaState.DRAINING, ReplicaState.STOPPING)}

    def stale(self, r: Replica, body: Mapping[str, Any]) -> str:
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
            known = {n.name.split(".", 1)[0] for n in self.table.nodes}
            if short not in here and short in known:
                return f"report from node {node}; job {r.job_id} runs on {','.join(r.nodes)}"
        return ""

    def apply(self, r: Replica, body: Mapping[str, Any]) -> None:
        now = self.table.clock()
        r.last_report = now
        if r.first_report_at is None:
            r.first_report_at = now
        self.table.tracing.agent_report(r.replica_id, body)
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
            self.table.wake.set()
        url = body.get("url")
        if event in ("ready", "heartbeat") and isinstance(url, str) and url:
            self._engine_address(r, url, body.get("cert"))
        elif event == "failed":
            r.agent_failed = str(body.get("message") or step or "agent reported failure")
            self.table.tracing.end_start(r.replica_id, "failed", error=r.agent_failed)
            self.table.wake.set()
        elif event == "draining" and not r.agent_draining:
            # The agent was signalled (cancel, preemption, time limit): no new requests,
            # but the job ends by itself; a preempted one is requeued and comes back.
            r.agent_draining = str(body.get("message") or "the agent is draining")
            self.table.record("agent-drain", r.model, r.replica_id, r.agent_draining)
        elif event == "stopped":
            r.base_url = ""

    def _engine_address(self, r: Replica, url: str, cert: object) -> None:
        """Probe a newly reported engine address, if it is one the daemon may use."""
        m = self.table.catalog.get(r.model)
        problem = engine_address_problem(url, cert, m is None or m.engine.tls)
        if problem:
            self.table.record("probe-refused", r.model, r.replica_id, f"{url[:100]}: {problem}")
            return
        pin = cert if isinstance(cert, str) else ""
        if r.base_url != url or r.engine_cert != pin:
            # Route only to what the daemon itself has reached, with the engine's key:
            # an agent's word that the engine is up is not proof the login node can
            # reach it (firewalls, a wrong advertised name).
            self.probe.start(
                r.replica_id, url, pin, lambda ok, why: self._probed(r, url, pin, ok, why)
            )

    def join_early(self, r: Replica, model: str, rid: str, pass_id: str) -> None:
        """Apply a report kept for ``r`` before its job was listed (a pass calls this)."""
        early = self.early.pop(rid, None)
        if early is not None and not (r.requeued and early.get("event") in ("ready", "heartbeat")):
            stale = self.stale(r, early)
            if stale:
                self.table.record("stale-report", model, rid, stale, pass_id)
            else:
                self.apply(r, early)

    def _probed(self, r: Replica, url: str, cert: str, ok: bool, why: str) -> None:
        """The probe of ``url`` ended: the replica is routable from now on, if it still
        is the replica probed and nobody is stopping it."""
        if self.table.replicas.get(r.replica_id) is not r or r.stop_reason:
            return
        if not ok:
            # The next heartbeat tries again.
            self.table.record("probe-failed", r.model, r.replica_id, f"{url}: {why}")
            return
        if not r.base_url:
            # An adopted replica may have served before this daemon started; its
            # start ends here all the same, said as such.
            self.table.tracing.end_start(
                r.replica_id, "serving (adopted)" if r.adopted else "ready", url=url
            )
            r.ready_at = r.ready_at or self.table.clock()
            r.epoch += 1
            self.table.record("ready", r.model, r.replica_id, f"serving at {url}")
        r.base_url = url
        r.engine_cert = cert
        r.step = "ready"
        self.on_ready(r.model)
