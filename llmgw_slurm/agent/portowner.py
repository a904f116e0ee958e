"""Who listens on a TCP port of this node, from the kernel's socket tables.

Before the agent sends anything to its engine's port it checks that the
listener is a process of the job's own user: any user of a shared node may
listen on a free port, and one who got there before the engine would
otherwise be polled with the engine's key (and, without TLS, be registered as
the replica). The tables are read by :func:`llmgw_slurm.auth.identity.listening_uids`,
which the CLIs use for the same question about the daemon's ports.
"""

from __future__ import annotations

from pathlib import Path

from llmgw_slurm.auth.identity import listening_uids

__all__ = ["port_owner"]


def port_owner(port: int, proc_net: Path = Path("/proc/net")) -> set[int] | None:
    """The uids listening on ``port``; None when the socket tables cannot be read.

    More than one uid is possible: sockets bound to different addresses of
    the node (one on 127.0.0.1, one on 0.0.0.0 where the kernel allows it).
    """
    if not (proc_net / "tcp").is_file():
        return None
    try:
        return set(listening_uids(port, proc_net))
    except OSError:
        return None
