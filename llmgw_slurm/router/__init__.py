"""The OpenAI-compatible request path: every OpenAI request, whole or streamed.

One direction, lower first: :mod:`~llmgw_slurm.router.http1`,
:mod:`~llmgw_slurm.router.answers`, :mod:`~llmgw_slurm.router.sse`,
:mod:`~llmgw_slurm.router.engine` (the engine side, strict); then
:mod:`~llmgw_slurm.router.replicas` (pick, hold), :mod:`~llmgw_slurm.router.account`
(each request's two ends, once), :mod:`~llmgw_slurm.router.admit` (a plan
or a refusal, no I/O), :mod:`~llmgw_slurm.router.forward`; then
:mod:`~llmgw_slurm.router.gateway`, :mod:`~llmgw_slurm.router.appbridge` and
:mod:`~llmgw_slurm.router.server` (the client side) on top. Beside them:
:mod:`~llmgw_slurm.router.directory` (the ``ModelDirectory`` protocol the
reconciler implements: the router's only view of it),
:mod:`~llmgw_slurm.router.balance` (replica choice by prefix),
:mod:`~llmgw_slurm.router.surface` (the endpoints beyond chat, completions
and embeddings), :mod:`~llmgw_slurm.router.stored` (stored responses' own
routes), :mod:`~llmgw_slurm.router.holdqueue` (the cap on held requests) and
:mod:`~llmgw_slurm.router.metrics`. Its functions are held to 60 lines.

Keys and logins are :mod:`llmgw_slurm.auth`'s, usage and quotas
:mod:`llmgw_slurm.accounting`'s: the request path uses them, and owns
none of their storage.

May import: base, guard, catalog, config, auth, accounting (nothing that talks to Slurm).
"""

from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelInfo, StaticDirectory
from llmgw_slurm.router.gateway import GATEWAY_KEY, Gateway, create_app, request_key

__all__ = [
    "GATEWAY_KEY",
    "Endpoint",
    "Gateway",
    "ModelDirectory",
    "ModelInfo",
    "RouterConfig",
    "StaticDirectory",
    "create_app",
    "request_key",
]
