"""Admin requests: ``llmgw-admin drain`` and ``stop`` on replicas, and the service
jobs ``llmgw-admin fetch`` and ``install-engine`` announce.

A drain only marks the replicas (the next pass cancels each once its requests
finish); a stop cancels their jobs at once.
"""

from __future__ import annotations

from llmgw_slurm.base.errors import SlurmError
from llmgw_slurm.reconciler.clusters import ClusterSet
from llmgw_slurm.reconciler.replicas import Replica, ReplicaTable
from llmgw_slurm.reconciler.svcjobs import ServiceJobs

__all__ = ["AdminRequests"]


class AdminRequests:
    """Finds the replicas an admin names; drains or stops them; takes the service jobs
    an admin's command submitted (``service_jobs``, named with ``prefix``)."""

    def __init__(
        self, table: ReplicaTable, clusters: ClusterSet, service_jobs: ServiceJobs, prefix: str
    ) -> None:
        self.table = table
        self.clusters = clusters
        self.service_jobs = service_jobs
        self.prefix = prefix

    def model_names(self) -> list[str]:
        """The catalog's models (what a reload answers with)."""
        return [m.name for m in self.table.catalog.models]

    def announce(self, job_id: str, name: str, target: str, cluster: str) -> str | None:
        """A model job or engine install ``llmgw-admin`` just submitted, followed from
        now on; what is wrong with it (an unknown cluster, a job not ours), or None."""
        if self.clusters.get(cluster) is None:
            names = ", ".join(c.name for c in self.clusters if c.name) or "none"
            return f"no cluster {cluster!r}; clusters: {names}"
        if not self.service_jobs.expect(job_id, name, target, self.table.clock(), cluster):
            return (
                f"job {job_id!r} named {name!r} is not a model job or engine install of "
                f"this daemon (prefix {self.prefix!r})"
            )
        return None

    def find_replicas(self, target: str = "", node: str = "") -> list[Replica]:
        """The replicas ``target`` names (a replica id, a model or an alias), or those on ``node``.

        ``node`` may be ``CLUSTER:NODE``: two clusters may have nodes of one name, and
        a bare name means that node on every cluster.
        Raises LookupError naming what exists when the target or node is unknown.
        A known model or node with no replica is an empty list, not an error.
        """
        if node:
            cluster, _, name = node.rpartition(":")
            if cluster and self.clusters.get(cluster) is None:
                names = ", ".join(c.name for c in self.clusters if c.name) or "none"
                raise LookupError(f"no cluster {cluster!r} (in {node!r}); clusters: {names}")
            on = [r for r in self.table.replicas.values() if not cluster or r.cluster == cluster]
            where = self.clusters.get(cluster)
            pool = where.nodes if where is not None and cluster else self.table.nodes
            known = sorted({n.name for n in pool} | {n for r in on for n in r.nodes})
            if name not in known:
                raise LookupError(f"no node {node!r}; nodes: {', '.join(known) or 'none seen yet'}")
            return [r for r in on if name in r.nodes]
        if target in self.table.replicas:
            return [self.table.replicas[target]]
        model = self.table.catalog.resolve(target)
        if model is not None:
            return [r for r in self.table.replicas.values() if r.model == model.name]
        models = ", ".join(m.name for m in self.table.catalog.models) or "none"
        reps = ", ".join(sorted(self.table.replicas)) or "none"
        raise LookupError(f"no replica or model {target!r}; models: {models}; replicas: {reps}")

    def request_drain(self, target: str = "", node: str = "", reason: str = "") -> list[str]:
        """Stop routing to the named replicas; the plan cancels each once its requests finish.

        A model whose ``min`` is above what is left gets replacements on the next
        pass: a drain moves replicas, it does not take a model down.
        """
        reps = self.find_replicas(target, node)
        why = reason or "drained by an admin"
        now = self.table.clock()
        out = []
        for r in reps:
            if r.stop_reason or r.draining_since is not None:
                continue
            r.draining_since = now
            r.drain_reason = why
            self.table.record("drain", r.model, r.replica_id, why)
            out.append(r.replica_id)
        self.table.wake.set()
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
                await self.clusters.of_replica(r.cluster).backend.cancel(r.job_id)
            except SlurmError:
                # Not stopping after all: the next pass must still see it as it was.
                r.stop_reason, r.base_url = "", url
                raise
            self.table.record("stop", r.model, r.replica_id, why)
            out.append(r.replica_id)
        self.table.wake.set()
        return out
