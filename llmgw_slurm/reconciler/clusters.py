"""The Slurm clusters a daemon places replicas on, and how each has answered lately.

A server.yaml without ``clusters:`` has one cluster (name ""), reached as
before through the daemon's own SLURM_CONF. Each :class:`Cluster` holds its
own backend (cli, pyslurm: ``clusters[].backend``), its last node listing,
and its health: a cluster whose controller does not answer is *not
answering* at once (nothing is placed there and nothing of it is acted on,
since acting on a stale view could cancel what runs), and *down* once that
has lasted ``reconcile.cluster_down_after``: the plan then replaces its
replicas that do not serve (``plan.ClusterView.down``). Each cluster is asked
again after a growing backoff, on its own: one controller that is down does
not slow the passes of the others.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.base.errors import SlurmError
from llmgw_slurm.config import ClusterConfig
from llmgw_slurm.reconciler.plan import ClusterView
from llmgw_slurm.slurm.types import NodeInfo, SlurmBackend

__all__ = ["Cluster", "ClusterSet", "Health"]


class Health(enum.Enum):
    UP = "up"  # its last listing answered
    NOT_ANSWERING = "not answering"  # its listings fail, for less than cluster_down_after
    DOWN = "down"  # its listings have failed for cluster_down_after or longer


@dataclass
class Cluster:
    """One cluster: how the daemon reaches it, its last node listing, how it answers."""

    settings: ClusterConfig
    backend: SlurmBackend
    nodes: list[NodeInfo] = field(default_factory=list)
    # When ``nodes`` was listed (the reconciler's clock); None: never.
    nodes_listed_at: float | None = None
    # Listings that failed in a row, the last one's error, and when the first of them failed.
    errors: int = 0
    last_error: str = ""
    unanswered_since: float | None = None
    answered_at: float | None = None
    # After failures, not asked again before this (its own backoff).
    next_try_at: float = 0.0

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def label(self) -> str:
        return self.settings.label

    def health(self, now: float, down_after: float) -> Health:
        if self.unanswered_since is None:
            return Health.UP
        if now - self.unanswered_since >= down_after:
            return Health.DOWN
        return Health.NOT_ANSWERING

    def due(self, now: float) -> bool:
        """May it be asked now (not in its backoff)?"""
        return now >= self.next_try_at

    def answered(self, now: float) -> None:
        self.errors, self.last_error = 0, ""
        self.unanswered_since, self.answered_at, self.next_try_at = None, now, 0.0

    def failed(self, now: float, error: str, interval: float) -> None:
        """A listing failed: asked again after ``interval`` doubled per failure (at most x12),
        so that a storm of commands does not meet a controller that is restarting."""
        self.errors += 1
        self.last_error = error
        if self.unanswered_since is None:
            self.unanswered_since = now
        self.next_try_at = now + interval * min(2 ** (self.errors - 1), 12)

    def gpus(self) -> tuple[int, int]:
        """(free, total) GPUs of its usable nodes, as last listed."""
        usable = [n for n in self.nodes if n.usable]
        return sum(n.gpus_free() for n in usable), sum(n.gpus_total() for n in self.nodes)

    def health_text(self, now: float, down_after: float) -> str:
        h = self.health(now, down_after)
        if h is Health.UP or self.unanswered_since is None:
            return h.value
        return f"{h.value} for {format_duration(now - self.unanswered_since)}: {self.last_error}"


class ClusterSet:
    """Every cluster of the daemon, in server.yaml's order (the site's preference)."""

    def __init__(self, clusters: Sequence[Cluster]) -> None:
        if not clusters:
            raise ValueError("a daemon needs at least one cluster")
        self.all = list(clusters)
        self._by_name = {c.name: c for c in self.all}

    @classmethod
    def of(
        cls, settings: Sequence[ClusterConfig], backends: Mapping[str, SlurmBackend]
    ) -> ClusterSet:
        return cls([Cluster(s, backends[s.name]) for s in settings])

    def __iter__(self) -> Iterator[Cluster]:
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def get(self, name: str) -> Cluster | None:
        return self._by_name.get(name)

    def of_replica(self, cluster: str) -> Cluster:
        """The cluster a replica runs on; a replica of a cluster no longer configured
        (server.yaml changed under a restart) is never listed, so never asked about."""
        return self._by_name.get(cluster) or self.all[0]

    @property
    def first(self) -> Cluster:
        return self.all[0]

    @property
    def named(self) -> bool:
        """server.yaml lists clusters (job names then carry the cluster's name)."""
        return bool(self.all[0].name)

    def backends(self) -> dict[str, SlurmBackend]:
        """Each cluster's backend by the cluster's name (for accounting across them)."""
        return {c.name: c.backend for c in self.all}

    async def check(self) -> dict[str, SlurmError]:
        """Each backend's own check at start (``SlurmBackend.check``), a backend shared
        by several clusters once. What did not answer comes back by cluster label (the
        passes try again); a setting that cannot work (ConfigError) raises."""
        unanswered: dict[str, SlurmError] = {}
        for label, backend in self._distinct():
            try:
                await backend.check()
            except SlurmError as exc:
                unanswered[label] = exc
        return unanswered

    async def close(self) -> None:
        """Each backend's own connections closed (a backend shared by clusters once)."""
        for _, backend in self._distinct():
            await backend.close()

    def _distinct(self) -> list[tuple[str, SlurmBackend]]:
        once = {id(c.backend): (c.label, c.backend) for c in reversed(self.all)}
        return list(reversed(once.values()))

    def all_nodes(self) -> list[NodeInfo]:
        """Every cluster's nodes, as last listed (for the node checks that span them)."""
        if len(self.all) == 1:
            return self.all[0].nodes
        return [n for c in self.all for n in c.nodes]

    def oldest_listing(self) -> float | None:
        """When the oldest of the clusters' node listings was made; None: one never was."""
        times = [c.nodes_listed_at for c in self.all]
        return None if any(t is None for t in times) else min(t for t in times if t is not None)

    def views(self, answering: set[str], now: float, down_after: float) -> list[ClusterView]:
        """What the plan sees of each cluster: its nodes, default partition, whether it
        answered this pass and whether it is down."""
        return [
            ClusterView(
                name=c.name,
                nodes=c.nodes,
                partition=c.settings.partition,
                answering=c.name in answering,
                down=c.health(now, down_after) is Health.DOWN,
            )
            for c in self.all
        ]
