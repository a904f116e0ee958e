"""Folders and files that only the daemon's user may write (and, for state, read).

The state directory holds the server key, the admin token and the usage
database. A daemon started by hand inherits the shell's umask (often 022):
without the checks here its folder came out 0755 and the database 0644, so
every user of the login node could read everyone's usage, and one who held a
read lock on the database's ``-shm`` file made every usage write fail.

- :func:`private_dir`: the state directory. Made 0700, its files 0600,
  whatever the umask; one that another user owns, or that group or others
  may write, is refused (someone else may have put files in it), with the
  fix in the message.
- :func:`public_dir`: the runtime directory (the admin socket, the
  published ``daemon.json``). Anybody may read it, only the daemon's user
  (or root, for a parent) may write it, or the CLIs could be handed a
  forged socket or file.
- :func:`write_atomic`: fsutil's atomic write with an exact mode.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmgw_slurm.base.errors import UnsafePathError
from llmgw_slurm.base.fsutil import atomic_write

__all__ = ["private_dir", "public_dir", "trusted_owner", "write_atomic"]


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _check_owned(path: Path, what: str, st: os.stat_result) -> None:
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a folder; point it at a folder")
    if st.st_uid != uid:
        raise UnsafePathError(
            f"{what} {path} belongs to another user ({_describe(st)}; the daemon runs as uid "
            f"{uid}): whoever owns it can change what the daemon reads there. Use a folder "
            f"of the daemon's user (chown {uid} {path}, or another path in server.yaml)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(
            f"{what} {path} may be written by other users ({_describe(st)}): they could "
            f"have put files in it. Check what is in it, then chmod 700 {path}"
        )


def private_dir(path: Path, what: str = "state_dir") -> None:
    """Make ``path`` (and missing parents) the daemon's alone: 0700, its files 0600.

    Raises UnsafePathError for a folder another user owns or others may write.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owned(path, what, path.stat())
    # mkdir's mode goes through the umask, and an existing folder keeps its own.
    path.chmod(0o700)
    for entry in path.iterdir():
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            if stat.S_IMODE(st.st_mode) & 0o077:
                entry.chmod(0o600)
        elif stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            # The job logs: engine output may quote prompts.
            entry.chmod(0o700)


def public_dir(path: Path, what: str = "runtime_dir") -> None:
    """Make ``path`` a folder anyone may read and only the daemon's user may write (0755)."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    _check_owned(path, what, path.stat())
    path.chmod(0o755)


def trusted_owner(path: Path, uid: int) -> str | None:
    """Why ``path`` could have been put there by someone other than root or ``uid``; None if not.

    Every folder from ``/`` down and the file itself must belong to root or
    ``uid`` and be writable by nobody else, except a sticky folder like /tmp:
    there others may add names but not rename or remove ours, and what is
    under it is checked the same way.
    """
    p = path.absolute()
    chain = [*reversed(p.parents), p]
    for item in chain:
        try:
            st = item.lstat()
        except OSError as exc:
            return f"cannot look at {item}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{item} is a symbolic link"
        if st.st_uid not in (0, uid):
            return f"{item} belongs to uid {st.st_uid}"
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and item != p
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
            return f"{item} may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """:func:`llmgw_slurm.base.fsutil.atomic_write` with exactly ``mode``, whatever the umask.

    The umask only takes bits away, so the file is never more open than
    ``mode`` on its way; the chmod after the rename gives back what it took
    (daemon.json must be readable by all under the unit's UMask=0077).
    """
    atomic_write(path, data, mode=mode)
    os.chmod(path, mode)
