"""The OpenAI-compatible router: gateway app, model directory interface, usage."""

from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelInfo, StaticDirectory
from llmgw_slurm.router.gateway import GATEWAY_KEY, Gateway, create_app, request_key
from llmgw_slurm.router.usage import UsageRecord, UsageStore, UsageSummary, query_usage

__all__ = [
    "GATEWAY_KEY",
    "Endpoint",
    "Gateway",
    "ModelDirectory",
    "ModelInfo",
    "RouterConfig",
    "StaticDirectory",
    "UsageRecord",
    "UsageStore",
    "UsageSummary",
    "create_app",
    "query_usage",
    "request_key",
]
