"""The agent's own settings, as plain typed values.

Filled from ``agent.yaml`` (llmgw_slurm.config.AgentConfig) by the CLI; the
agent's pieces take these explicitly and never read files themselves.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AgentSettings", "FetchSettings"]


@dataclass(frozen=True)
class FetchSettings:
    """How weights reach the cache.

    ``cache_dir``: shared by every job (and node) that may use a model; locks
    and temporary directories live inside it so that renames stay on one
    filesystem. ``enabled`` False: weights must already be there (a model job
    put them); ``allow_hf``: `hf download` may reach the hub from this node.
    ``verify``: ``"size"`` (cheap, every start) or ``"sha256"`` (reads every
    byte: minutes for a large model).
    """

    cache_dir: Path
    enabled: bool = True
    allow_hf: bool = False
    hf_command: tuple[str, ...] = ("hf",)
    verify: str = "size"
    # Another job may be fetching the same model: wait this long for its lock.
    lock_timeout_s: float = 6 * 3600.0


@dataclass(frozen=True)
class AgentSettings:
    """Everything the agent needs besides the model spec and the job environment.

    Defaults, and why:
    - ``bind_host`` 0.0.0.0: the daemon reaches the engine across the network.
    - ``advertise_host`` None: the node's hostname, as Slurm knows it.
    - ``port_range`` 20000-29999: high enough to miss system services; a
      site with a firewall narrows it.
    - ``ready_timeout_s`` 1800: large models on a slow filesystem take long.
    - ``heartbeat_interval_s`` 15: the daemon marks a replica stale after a few.
    - ``drain_timeout_s`` 120: within the default --signal lead of 300 s.
    - ``stop_grace_s`` 20: vLLM stops in a few seconds on SIGTERM.
    - ``drain_grace_s`` 10: waited when the engine has no request metric.
    - ``rendezvous_timeout_s`` 600: workers wait this long for the head.
    """

    fetch: FetchSettings
    shared_dir: Path
    python: str = field(default_factory=lambda: sys.executable)
    apptainer: str = "apptainer"
    bind_host: str = "0.0.0.0"  # noqa: S104
    advertise_host: str | None = None
    port_range: tuple[int, int] = (20000, 29999)
    ready_timeout_s: float = 1800.0
    ready_poll_s: float = 2.0
    heartbeat_interval_s: float = 15.0
    drain_timeout_s: float = 120.0
    drain_poll_s: float = 2.0
    drain_grace_s: float = 10.0
    stop_grace_s: float = 20.0
    rendezvous_timeout_s: float = 600.0
    report_timeout_s: float = 10.0
    log_tail_lines: int = 40
