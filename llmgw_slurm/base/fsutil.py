"""Files shared between processes and nodes: the one atomic write and the one lock.

Both are used everywhere a file is replaced or a writer must be alone, because
each has a hazard that is easy to get half right:

- :func:`atomic_write` writes a temporary file beside the target, fsyncs it,
  renames it over the target and fsyncs the folder. A reader sees the old
  content or the new, never a part; after a crash or power loss the file is the
  old one or the new one, not empty (a rename without the fsync before it may
  reach the disk before the data does). :func:`atomic_file` is the same for a
  file written piece by piece (too large to hold in memory at once).
- :func:`locked` takes a POSIX record lock (``fcntl.lockf``). NFS and Lustre
  carry those to the file server, so jobs on different nodes exclude each other;
  ``flock`` may stay local to one node there. POSIX locks belong to the
  process: two threads of one process do not exclude each other, and closing
  any descriptor of the lock file releases the lock, so the lock file is used
  for locking only and never opened elsewhere.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["LockTimeout", "atomic_file", "atomic_write", "locked"]


def atomic_write(path: Path, data: bytes | str, *, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` (str as UTF-8), atomically and durably.

    ``mode`` is the new file's permission bits before the umask (0o600 for
    secrets: the temporary file has them from its creation, so the data is
    never readable by others, not even for a moment).
    """
    with atomic_file(path, mode=mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_file(path: Path, *, mode: int = 0o666) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` when the block ends without an exception,
    as :func:`atomic_write` does; on an exception ``path`` is left as it was."""
    # Unique per writer: two writers at once must not share a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # The rename itself is durable only once the folder is; some filesystems
    # (and every non-POSIX one) refuse to open or fsync a folder: best effort.
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class LockTimeout(TimeoutError):
    """Another process held the lock for longer than the caller would wait."""


@contextmanager
def locked(
    path: Path,
    *,
    timeout_s: float | None = None,
    on_wait: Callable[[], None] | None = None,
    mode: int = 0o664,
    poll_s: float = 0.2,
) -> Iterator[None]:
    """Hold an exclusive ``lockf`` lock on ``path`` (created, with its folder, if missing).

    ``timeout_s`` None waits as long as it takes; otherwise LockTimeout after it.
    ``on_wait`` is called once if the lock is busy (to say why we wait). The
    lock is polled: a blocking lockf cannot be given a deadline.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                if deadline is not None and time.monotonic() > deadline:
                    raise LockTimeout(f"{path} is held by another process") from err
                time.sleep(poll_s)
        yield
    finally:
        os.close(fd)  # closing releases the lock
