"""The OpenAI-compatible router: gateway app, model directory interface, keys, usage."""

from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelInfo, StaticDirectory
from llmgw_slurm.router.gateway import GATEWAY_KEY, Gateway, create_app, request_key
from llmgw_slurm.router.keys import KeyRecord, KeyRing, NewKey, add_key, list_keys, revoke_key
from llmgw_slurm.router.usage import UsageRecord, UsageStore, UsageSummary, query_usage

__all__ = [
    "GATEWAY_KEY",
    "Endpoint",
    "Gateway",
    "KeyRecord",
    "KeyRing",
    "ModelDirectory",
    "ModelInfo",
    "NewKey",
    "RouterConfig",
    "StaticDirectory",
    "UsageRecord",
    "UsageStore",
    "UsageSummary",
    "add_key",
    "create_app",
    "list_keys",
    "query_usage",
    "request_key",
    "revoke_key",
]
