"""The OpenAI-compatible router: the gateway app and the model directory interface."""

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
