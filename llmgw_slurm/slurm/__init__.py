"""The one place that talks to Slurm. Everything else uses :class:`SlurmBackend`.

- :mod:`~llmgw_slurm.slurm.types`: the backend protocol and the values it
  deals in (jobs, their one state enum, nodes, accounting records);
- the backends: :mod:`~llmgw_slurm.slurm.cli` (Slurm's commands, the
  default; also the agent's ``scontrol show hostnames``),
  :mod:`~llmgw_slurm.slurm.pyslurm_backend` and :mod:`~llmgw_slurm.slurm.rest`
  (slurmrestd, with :mod:`~llmgw_slurm.slurm.rest_auth`,
  :mod:`~llmgw_slurm.slurm.rest_submit` and :mod:`~llmgw_slurm.slurm.rest_parse`);
- :mod:`~llmgw_slurm.slurm.parse`, :mod:`~llmgw_slurm.slurm.hostlist` and
  :mod:`~llmgw_slurm.slurm.directives`: pure readers of what Slurm prints and
  of a script's ``#SBATCH`` lines.

May import: base.
"""

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime
from os import PathLike
from typing import Any, Protocol

from llmgw_slurm.base.errors import ConfigError, SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    GpuCount,
    Job,
    JobComponent,
    JobSpec,
    JobState,
    NodeInfo,
    SlurmBackend,
    StartEstimator,
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


class ClusterSettings(Protocol):
    """How to reach one cluster (server.yaml's ``clusters[]``, ``config.ClusterConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def slurm_conf(self) -> PathLike[str] | None: ...
    @property
    def multi_cluster(self) -> str | None: ...
    @property
    def bin_dir(self) -> PathLike[str] | None: ...
    @property
    def rest(self) -> Any: ...  # config.SlurmRestConfig (with backend rest): its options()


def make_backends(clusters: Sequence[ClusterSettings], timeout: float) -> dict[str, SlurmBackend]:
    """One backend per cluster, by its name: each its own instance, reaching its
    cluster through its slurm.conf (SLURM_CONF), its -M name, its commands' folder."""
    out: dict[str, SlurmBackend] = {}
    for c in clusters:
        opts: dict[str, Any] = {"timeout": timeout}
        if c.backend == "rest":
            # slurmrestd reaches the cluster; its commands' settings do not apply.
            opts.update(c.rest.options())
        elif c.slurm_conf is not None:
            opts["slurm_conf"] = str(c.slurm_conf)
        if c.multi_cluster:
            opts["cluster"] = c.multi_cluster
        if c.bin_dir is not None:
            opts["bin_dir"] = str(c.bin_dir)
        try:
            out[c.name] = make_backend(c.backend or "cli", **opts)
        except ConfigError as exc:
            where = f"cluster {c.name}: " if c.name else ""
            raise ConfigError(f"{where}{exc}", field="clusters" if c.name else "slurm") from exc
    return out


async def accounting_of(
    backends: Mapping[str, SlurmBackend],
    start: datetime,
    end: datetime | None = None,
    **options: Any,
) -> list[AccountingRecord]:
    """Every cluster's accounting records (one ``sacct`` each, at once), each with its
    cluster's name (``AccountingRecord.cluster``). ``options``: as ``accounting``'s.
    Raises the first cluster's SlurmError, its cluster named, when one fails: an
    audit that leaves a cluster out must not look whole."""
    names = list(backends)
    got = await asyncio.gather(
        *(backends[n].accounting(start, end, **options) for n in names), return_exceptions=True
    )
    out: list[AccountingRecord] = []
    for name, recs in zip(names, got, strict=True):
        if isinstance(recs, SlurmError) and name:
            recs.message = f"cluster {name}: {recs.message}"
            raise recs
        if isinstance(recs, BaseException):
            raise recs
        out += [dataclasses.replace(r, cluster=name) for r in recs] if name else recs
    return out


__all__ = [
    "BACKENDS",
    "AccountingRecord",
    "ClusterSettings",
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
    "StartEstimator",
    "accounting_of",
    "make_backend",
    "make_backends",
]
