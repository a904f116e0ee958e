"""Errors of the agent's steps; each is an LlmgwError with a one-line message."""

from __future__ import annotations

from llmgw_slurm.base.errors import LlmgwError

__all__ = ["AgentError", "EngineError", "PortTaken", "RendezvousError", "WeightsError"]


class AgentError(LlmgwError):
    """A step of the agent failed; the message says which and why."""


class WeightsError(AgentError):
    """Weights are missing, corrupt, or could not be fetched."""


class EngineError(AgentError):
    """The engine could not be started, or exited before it was ready."""


class PortTaken(EngineError):
    """Another user's process listens on the engine's port: the start goes on
    on another port (a single-node replica), nothing is ever sent there."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


class RendezvousError(AgentError):
    """The nodes of a multi-node replica could not agree on head, ranks or port."""
