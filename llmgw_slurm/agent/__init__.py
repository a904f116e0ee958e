"""The job side: what runs inside a replica's Slurm job (``llmgw-agent``)."""

from llmgw_slurm.agent.errors import AgentError, EngineError, RendezvousError, WeightsError
from llmgw_slurm.agent.settings import AgentSettings, FetchSettings
from llmgw_slurm.agent.spec import EngineSpec, ReplicaSpec, WeightsSpec, parse_replica_spec

__all__ = [
    "AgentError",
    "AgentSettings",
    "EngineError",
    "EngineSpec",
    "FetchSettings",
    "RendezvousError",
    "ReplicaSpec",
    "WeightsError",
    "WeightsSpec",
    "parse_replica_spec",
]
