"""The guard's figures for ``/metrics``, read at scrape time."""

from __future__ import annotations

import resource
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw_slurm.guard.accept import Acceptor
from llmgw_slurm.guard.faults import Faults
from llmgw_slurm.guard.fds import open_fds

__all__ = ["GuardCollector"]


class GuardCollector(Collector):
    """Faults survived, connections and their bounds per listener, open files."""

    def __init__(self, faults: Faults, acceptors: Iterable[Acceptor]) -> None:
        self._faults = faults
        # The listeners: the daemon sets them once it listens.
        self.acceptors = list(acceptors)

    def collect(self) -> Iterator[Metric]:
        faults = CounterMetricFamily(
            "llmgw_daemon_faults",
            "Unexpected failures the daemon logged and survived, by where: pass (a "
            "reconcile pass), report (an agent's report), usage (the usage writer), ...",
            labels=["where"],
        )
        for where, n in sorted(self._faults.counts.items()):
            faults.add_metric([where], n)
        yield faults
        yield from self._connections()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        yield GaugeMetricFamily(
            "llmgw_open_files", "File descriptors the daemon holds.", value=open_fds()
        )
        yield GaugeMetricFamily(
            "llmgw_open_files_limit", "The daemon's soft open-files limit.", value=soft
        )

    def _connections(self) -> Iterator[Metric]:
        open_ = GaugeMetricFamily(
            "llmgw_connections", "Open connections, by listener.", labels=["listener"]
        )
        bound = GaugeMetricFamily(
            "llmgw_connections_limit",
            "Connections a listener takes before it stops accepting.",
            labels=["listener"],
        )
        peers = GaugeMetricFamily(
            "llmgw_connection_peers",
            "Peers (local uids, remote addresses) with open connections.",
            labels=["listener"],
        )
        refused = CounterMetricFamily(
            "llmgw_connections_refused",
            "Connections closed unserved: reason peer (its peer at connections.per_peer), "
            "total (the listener full), head_timeout (no whole request head in time), "
            "closed (closed by its client before it was accepted).",
            labels=["listener", "reason"],
        )
        pauses = CounterMetricFamily(
            "llmgw_accept_pauses",
            "Times a listener stopped accepting: full, or accept() out of descriptors.",
            labels=["listener", "why"],
        )
        queue = GaugeMetricFamily(
            "llmgw_accept_queue",
            "Connections the kernel completed that wait for the daemon to accept them.",
            labels=["listener"],
        )
        queue_limit = GaugeMetricFamily(
            "llmgw_accept_queue_limit",
            "Connections the kernel queues for the daemon before it drops new ones "
            "(the listen backlog).",
            labels=["listener"],
        )
        for acc in self.acceptors:
            lim = acc.limiter
            waiting, limit = acc.accept_queue()
            queue.add_metric([lim.name], waiting)
            queue_limit.add_metric([lim.name], limit)
            open_.add_metric([lim.name], lim.open)
            bound.add_metric([lim.name], lim.total)
            peers.add_metric([lim.name], lim.peers())
            for reason in ("peer", "total", "head_timeout", "closed"):
                refused.add_metric([lim.name, reason], lim.refused.get(reason, 0))
            pauses.add_metric([lim.name, "full"], lim.pauses)
            pauses.add_metric([lim.name, "accept_error"], lim.accept_errors)
        yield from (open_, bound, peers, refused, pauses, queue, queue_limit)
