"""The Batch API wired into the daemon (``daemon.build`` calls :func:`install`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from llmgw_slurm.accounting.usage import UsageRecord, UsageSink
from llmgw_slurm.batch.jobs import BatchJobs
from llmgw_slurm.batch.model import BatchRecord
from llmgw_slurm.batch.routes import add_batch_routes, add_internal_routes
from llmgw_slurm.batch.seam import BatchSeam, SlotShares
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.batch.store import BatchStore
from llmgw_slurm.catalog import Catalog, Model
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.guard.faults import Faults
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.router.directory import ModelDirectory
from llmgw_slurm.router.engine import EnginePool
from llmgw_slurm.router.gateway import GATEWAY_KEY
from llmgw_slurm.slurm.types import SlurmBackend

__all__ = ["ReconcilerSide", "install"]


@dataclass(frozen=True)
class ReconcilerSide:
    """What the Batch API takes of the reconciler, each part as it is (the daemon
    hands them over): the clusters' backends, the catalog as it is now, the jobs'
    renderer, the report verifier (batch jobs' nonces are the replicas'), where a
    model's job may go, the faults counter, and the directory a ride reads."""

    backends: SlurmBackend | Mapping[str, SlurmBackend]
    catalog: Callable[[], Catalog]
    jobs: BatchJobs
    verifier: ReportVerifier
    place: Callable[[Model], list[str]]
    faults: Faults
    directory: ModelDirectory


def install(
    gateway: web.Application,
    internal: web.Application,
    server: ServerConfig,
    rec: ReconcilerSide,
    usage: UsageSink | None,
    store: BatchStore | None = None,
) -> BatchService:
    """The Batch API on the daemon's apps. ``rec``: what it takes of the reconciler.
    ``store``: where the records are kept (default: files in batch.directory)."""
    store = store if store is not None else BatchStore(server.batch_directory)
    # The gateway's quota book: batches spend the same day and month budgets.
    quota = gateway[GATEWAY_KEY].quota
    svc = BatchService(
        store, server, rec.backends, rec.catalog, rec.jobs, rec.verifier,
        quota=quota, place=rec.place,
    )  # fmt: skip
    svc.faults = rec.faults
    svc.seam = seam(gateway, server, rec.directory, rec.catalog)
    if usage is not None:

        def record(batch: BatchRecord) -> None:
            # One record per batch, on the key that created it: tokens counted as
            # the online gateway counts them, under the endpoint "batch", and each
            # request it answered counted as one.
            total = batch.prompt_tokens + batch.completion_tokens
            if total:
                usage.record(
                    UsageRecord(
                        time.time(),
                        batch.key_id,
                        batch.owner,
                        batch.project,
                        batch.model,
                        "batch",
                        batch.prompt_tokens,
                        batch.completion_tokens,
                        total,
                        requests=batch.completed,
                    )
                )

        svc.on_usage = record
    add_batch_routes(gateway, svc)
    add_internal_routes(internal, svc, rec.faults)
    return svc


def seam(
    gateway: web.Application,
    server: ServerConfig,
    directory: ModelDirectory,
    catalog: Callable[[], Catalog],
) -> BatchSeam:
    """The gateway's batch seam: the replicas the directory lists, each one's online
    requests as the gateway counts them, its model's target_inflight as its capacity."""
    gw = gateway[GATEWAY_KEY]

    def capacity(model: str) -> int:
        m = catalog().get(model)
        return m.scaling.target_inflight if m is not None else 1

    s = BatchSeam(
        directory,
        # Read through the gateway each time: its count, and its word when an online
        # request begins (below), are the parts of it the seam depends on.
        lambda model, replica_id: gw.in_flight.get((model, replica_id), 0),
        capacity,
        SlotShares(
            busy=server.batch.warm_share,
            idle=server.batch.warm_idle_share,
            idle_after=server.batch.warm_idle_after,
        ),
        EnginePool(server.router.connect_timeout, server.router.read_timeout),
    )
    # An online request that begins on a replica calls back its batch requests
    # beyond the busy share.
    gw.replicas.on_started = s.online_started
    return s
