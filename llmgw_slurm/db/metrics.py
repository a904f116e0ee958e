"""``/metrics`` of a daemon on a shared database: who leads, the lease, the database.

Read when Prometheus scrapes (a custom collector), nothing kept beside the
figures the lease, the hub and the usage store hold already.

=================================  =====================================================
llmgw_leader                       1 while this daemon leads (acts on Slurm), else 0
llmgw_lease_epoch                  the lease's epoch as this daemon last read it
llmgw_lease_taken_total            times this daemon took the lease
llmgw_lease_fenced_total           Slurm actions this daemon's fence refused
llmgw_database_up                  1 while this daemon reaches the database lately
llmgw_database_contact_age_seconds seconds since this daemon last reached the database
llmgw_daemons_alive                daemons of this database seen in the last 15 s
llmgw_usage_spooled_total          usage records written to the disk spool (database away)
=================================  =====================================================
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw_slurm.db.hub import Hub
from llmgw_slurm.db.lease import Lease
from llmgw_slurm.db.usage import PgUsageStore

__all__ = ["SharedCollector"]


class SharedView(Protocol):
    """What the collector reads of llmgw_slurm.db.setup.Shared."""

    name: str
    lease: Lease
    hub: Hub
    usage: PgUsageStore | None

    def status(self) -> dict[str, Any]: ...

    def healthy(self) -> bool: ...


class SharedCollector(Collector):
    def __init__(self, shared: SharedView) -> None:
        self.shared = shared

    def collect(self) -> Iterator[Metric]:
        s = self.shared
        st = s.status()
        label = [s.name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=["daemon"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=["daemon"])
            c.add_metric(label, value)
            return c

        yield gauge("llmgw_leader", "1 while this daemon leads (acts on Slurm)", int(st["leading"]))
        yield gauge("llmgw_lease_epoch", "The reconciler lease's epoch, as last read", st["epoch"])
        yield counter("llmgw_lease_taken", "Times this daemon took the lease", s.lease.taken)
        yield counter("llmgw_lease_fenced", "Slurm actions refused by the fence", s.lease.fenced)
        yield gauge(
            "llmgw_database_up", "1 while the database was reached lately", int(s.healthy())
        )
        age = st["last_contact_s"]
        yield gauge(
            "llmgw_database_contact_age_seconds",
            "Seconds since this daemon last reached the database",
            age if age is not None else float("inf"),
        )
        now = time.time()
        alive = sum(1 for d in s.hub.daemons if d.stopped_at is None and now - d.last_seen < 15.0)
        yield gauge("llmgw_daemons_alive", "Daemons of this database seen in the last 15 s", alive)
        spooled = s.usage.spooled if s.usage is not None else 0
        yield counter("llmgw_usage_spooled", "Usage records spooled to disk", spooled)
