"""Who listens on a TCP port of this node, from the kernel's socket tables.

Before the agent sends anything to its engine's port it checks that the
listener is a process of the job's own user: any user of a shared node may
listen on a free port, and one who got there before the engine would
otherwise be polled with the engine's key (and, without TLS, be registered as
the replica). ``/proc/net/tcp`` and ``tcp6`` list every socket of the
network namespace with its owner's uid, readable by every user.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["TABLES", "listeners", "port_owner"]

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"


def listeners(lines: Iterable[str], port: int) -> set[int]:
    """The uids of sockets listening on ``port`` in one table's lines (header skipped)."""
    uids: set[int] = set()
    for line in lines:
        fields = line.split()
        # sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
        if len(fields) < 8 or fields[3] != _LISTEN or ":" not in fields[1]:
            continue
        try:
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            uid = int(fields[7])
        except ValueError:
            continue
        if local_port == port:
            uids.add(uid)
    return uids


def port_owner(port: int, tables: Iterable[Path] = TABLES) -> set[int] | None:
    """The uids listening on ``port``; None when no table could be read.

    More than one uid is possible: sockets bound to different addresses of
    the node (one on 127.0.0.1, one on 0.0.0.0 where the kernel allows it).
    """
    uids: set[int] = set()
    read_any = False
    for table in tables:
        with contextlib.suppress(OSError):
            uids |= listeners(table.read_text().splitlines()[1:], port)
            read_any = True
    return uids if read_any else None
