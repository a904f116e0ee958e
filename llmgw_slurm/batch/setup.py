"""The Batch API wired into the daemon (``daemon.build`` calls :func:`install`)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from llmgw_slurm.batch.jobs import BatchJobs
from llmgw_slurm.batch.model import BatchRecord
from llmgw_slurm.batch.routes import add_batch_routes, add_internal_routes
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.batch.store import BatchStore
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.router.usage import UsageRecord, UsageSink
from llmgw_slurm.slurm.types import SlurmBackend

__all__ = ["install"]


def install(
    gateway: web.Application,
    internal: web.Application,
    server: ServerConfig,
    backend: SlurmBackend,
    rec: Any,
    server_key: bytes,
    daemon_url: str,
    usage: UsageSink | None,
    store: BatchStore | None = None,
) -> BatchService:
    """The Batch API on the daemon's apps. ``rec``: the reconciler (catalog, report
    nonces, the gateway's certificate), taken as is so this package does not import it.
    ``store``: where the records are kept (default: files in batch.directory)."""
    store = store if store is not None else BatchStore(server.batch_directory)
    jobs = BatchJobs(server, server_key, daemon_url, rec.engine_tls.identity.cert_pem)
    svc = BatchService(store, server, backend, lambda: rec.catalog, jobs, rec.verifier)
    if usage is not None:

        def record(batch: BatchRecord) -> None:
            # One record per batch, on the key that created it: tokens counted as
            # the online gateway counts them, under the endpoint "batch".
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
                    )
                )

        svc.on_usage = record
    add_batch_routes(gateway, svc)
    add_internal_routes(internal, svc)
    return svc
