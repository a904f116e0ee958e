"""The one place that talks to Slurm. Everything else uses :class:`SlurmBackend`."""

from llmgw_slurm.errors import SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    GpuCount,
    Job,
    JobComponent,
    JobSpec,
    JobState,
    NodeInfo,
    SlurmBackend,
)

__all__ = [
    "AccountingRecord",
    "GpuCount",
    "Job",
    "JobComponent",
    "JobSpec",
    "JobState",
    "NodeInfo",
    "SlurmBackend",
    "SlurmError",
    "SlurmParseError",
    "SlurmUnavailable",
]
