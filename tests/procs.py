"""Processes of this machine's jobs, found as another user of the node would not.

Engines keep their port off their command line (a watcher of ``ps`` could
take it first), so tests find an engine by the socket it listens on: the
kernel's table gives the socket's inode, ``/proc/PID/fd`` the process that
holds it (root, as the tests run, may read every process's descriptors).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["listener_pid"]


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{f[9]}]")
    return inodes


def listener_pid(port: int, argv_has: str) -> int | None:
    """The pid of the process listening on ``port`` whose argv holds ``argv_has``."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if argv_has.encode() not in argv:
                continue
            if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                return int(d.name)
    return None
