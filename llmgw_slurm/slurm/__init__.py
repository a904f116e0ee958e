"""The one place that talks to Slurm. Everything else uses :class:`SlurmBackend`."""

from typing import Any

from llmgw_slurm.errors import ConfigError, SlurmError, SlurmParseError, SlurmUnavailable
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

BACKENDS = ("cli", "pyslurm", "rest")


def make_backend(kind: str, **opts: Any) -> SlurmBackend:
    """The backend named by ``slurm.backend``: ``"cli"`` (default), ``"pyslurm"`` or
    ``"rest"``; ``opts`` are its constructor's (``SlurmConfig.backend_options()``).

    Each call makes a backend of its own: nothing is kept at module level, so
    one process may hold several (one per cluster). Imports are deferred so
    that choosing ``cli`` never loads pyslurm or aiohttp's client. A
    ``pyslurm`` backend whose module is missing raises SlurmUnavailable; a
    ``rest`` backend without its url or token, ConfigError.
    """
    name = kind.strip().lower()
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown Slurm backend {kind!r}; valid: {', '.join(BACKENDS)}", field="slurm.backend"
        )
    if name == "cli":
        from llmgw_slurm.slurm.cli import CliBackend

        factory: Any = CliBackend
    elif name == "pyslurm":
        from llmgw_slurm.slurm.pyslurm_backend import PyslurmBackend

        factory = PyslurmBackend
    else:
        from llmgw_slurm.slurm.rest import RestBackend

        factory = RestBackend
    try:
        backend: SlurmBackend = factory(**opts)
    except TypeError as exc:
        # An option the backend does not take: a config mistake, not a crash.
        raise ConfigError(f"{name} backend: {exc}", field="slurm") from exc
    return backend


__all__ = [
    "BACKENDS",
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
    "make_backend",
]
