"""The agent's own settings, as plain typed values.

Filled from ``agent.yaml`` (``llmgw_slurm.config.AgentConfig``, where each
knob's default and reason are documented) by
:func:`llmgw_slurm.agent.main.settings_from_agent_config`, then the
command-line options; the agent's pieces take these explicitly and never
read files themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmgw_slurm.config import EngineRuntime

__all__ = ["AgentSettings", "FetchSettings"]


@dataclass(frozen=True)
class FetchSettings:
    """How weights reach the cache.

    ``cache_dir``: node-local by default in agent.yaml; may be shared. Locks
    and temporary directories live inside it so that renames stay on one
    filesystem. ``method``: ``auto`` (each model's own) or one forced for the
    site. ``enabled`` False: weights must already be in the cache (a model job
    put them there). ``allow_hf``: `hf download` may reach the hub from here.
    ``verify``: ``size`` (cheap, every start) or ``sha256`` (reads every byte:
    minutes for a large model).
    """

    cache_dir: Path
    method: str = "auto"
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
    - ``port_range`` 20000-29999: clear of well-known and ephemeral ports.
    - ``rendezvous_dir`` None: multi-node replicas derive the head's port from
      the job id (see rendezvous.py); a directory every node of a job sees
      lets the head choose any free port and publish it there instead.
    - ``ready_timeout_s`` 900: large weights from a shared FS take minutes.
    - ``heartbeat_interval_s`` 15: the daemon marks a replica lost after a few.
    - ``drain_timeout_s`` 120: within the default --signal lead of 300 s.
    - ``stop_grace_s`` 20: vLLM stops in a few seconds on SIGTERM.
    - ``drain_grace_s`` 10: waited when the engine has no request metric.
    - ``rendezvous_timeout_s`` 600: workers wait this long for the head.
    - ``log_dir`` None: engine output goes to the job's output file.
    """

    fetch: FetchSettings
    python: str = field(default_factory=lambda: sys.executable)
    engines: Mapping[str, EngineRuntime] = field(default_factory=dict)
    apptainer: str = "apptainer"
    apptainer_binds: tuple[str, ...] = ()
    bind_host: str = "0.0.0.0"  # noqa: S104
    advertise_host: str | None = None
    port_range: tuple[int, int] = (20000, 29999)
    rendezvous_dir: Path | None = None
    ready_timeout_s: float = 900.0
    ready_poll_s: float = 2.0
    heartbeat_interval_s: float = 15.0
    drain_timeout_s: float = 120.0
    drain_poll_s: float = 2.0
    drain_grace_s: float = 10.0
    stop_grace_s: float = 20.0
    rendezvous_timeout_s: float = 600.0
    report_timeout_s: float = 10.0
    log_tail_lines: int = 40
    log_dir: Path | None = None

    def runtime(self, kind: str) -> EngineRuntime:
        return self.engines.get(kind, EngineRuntime())
