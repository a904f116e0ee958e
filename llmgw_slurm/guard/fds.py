"""Open files: the daemon's limit, raised at start, and how it is shared out.

Every connection is a file descriptor, and so is every pipe of a Slurm
command, the usage database, the nonce journal and each engine connection.
Under systemd's default soft limit of 1,024, 1,100 idle connections were
enough to make the next ``squeue`` fail with EMFILE. So the daemon raises its
soft limit to the hard one at start (the shipped unit sets ``LimitNOFILE``),
and shares the descriptors out before any is used: a reserve for its own work
that no connection may take, then a bound for each listener
(:class:`FdBudget`), which :class:`llmgw_slurm.guard.limiter.ConnectionLimiter`
enforces.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

__all__ = ["FdBudget", "open_fds", "raise_open_files_limit"]

log = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit in force after.

    Never lowers it; a refusal (a hard limit of "unlimited" that the kernel's
    nr_open caps) is logged and the limit left as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        # The kernel refuses more than fs.nr_open; ask for that instead.
        hard = _nr_open() or soft
    if hard <= soft:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as err:
        log.warning("open files: cannot raise the soft limit %d to %d: %s", soft, hard, err)
        return soft
    log.info("open files: soft limit raised from %d to the hard limit %d", soft, hard)
    return hard


def _nr_open() -> int | None:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def open_fds() -> int:
    """Descriptors this process holds now (an estimate of 64 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


@dataclass(frozen=True)
class FdBudget:
    """How many connections each listener may hold, from the open-files limit.

    ``reserve`` descriptors are never given to connections: Slurm commands
    (three pipes each while they run), the state files, the admin socket and
    an engine connection per request beyond those counted below. Of the rest
    an eighth goes to the internal port (agents' reports and the batch jobs'
    progress), and the gateway gets half of what remains: each of its
    connections may open one to an engine while its request runs.
    """

    limit: int
    reserve: int
    in_use: int
    gateway: int
    internal: int

    @classmethod
    def share(cls, limit: int, reserve: int, in_use: int) -> FdBudget:
        # A limit too small for the reserve asked for keeps half for the work.
        reserve = min(reserve, limit // 2)
        free = max(0, limit - reserve - in_use)
        internal = max(16, free // 8)
        gateway = max(16, (free - internal) // 2)
        return cls(limit, reserve, in_use, gateway, internal)

    def describe(self) -> str:
        return (
            f"open files limit {self.limit}: {self.reserve} kept for Slurm commands and "
            f"state files, up to {self.gateway} gateway and {self.internal} internal "
            "connections"
        )
