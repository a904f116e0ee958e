"""The job side: what runs inside a replica's Slurm job (``llmgw-agent``)."""

from llmgw_slurm.agent.errors import AgentError, EngineError, RendezvousError, WeightsError
from llmgw_slurm.agent.settings import AgentSettings, FetchSettings

__all__ = [
    "AgentError",
    "AgentSettings",
    "EngineError",
    "FetchSettings",
    "RendezvousError",
    "WeightsError",
]
