"""The one atomic write and the one lock (llmgw_slurm.base.fsutil)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_slurm.base.fsutil import LockTimeout, atomic_write, locked

# A second process, because POSIX locks of one process never exclude each other.
_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o664)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    atomic_write(target, '{"new": 1}')
    assert target.read_text() == '{"new": 1}'
    atomic_write(target, b"\x00bytes")
    assert target.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_atomic_write_of_a_secret_is_never_readable_by_others(tmp_path: Path) -> None:
    target = tmp_path / "server.key"
    old = os.umask(0)
    try:
        atomic_write(target, b"k", mode=0o600)
        atomic_write(tmp_path / "plain", b"p")
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o666


def test_a_failed_atomic_write_keeps_the_old_file_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "a-folder"
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(OSError):
        atomic_write(target, b"cannot replace a non-empty folder")
    assert (target / "inside").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder"]


def test_a_lock_held_by_another_process_is_waited_for_then_times_out(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "m.lock"
    lock.parent.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        said: list[str] = []
        with (
            pytest.raises(LockTimeout, match="held by another process"),
            locked(lock, timeout_s=0.2, on_wait=lambda: said.append("waiting")),
        ):
            pytest.fail("got a lock another process holds")
        assert said == ["waiting"]
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait()
    # Released with the holder's exit: free at once.
    with locked(lock, timeout_s=0):
        pass


def test_the_lock_is_a_posix_record_lock_seen_by_other_processes(tmp_path: Path) -> None:
    # lockf, not flock: only POSIX locks reach the server on NFS and Lustre. A
    # process probing with lockf sees ours.
    lock = tmp_path / "x.lock"
    probe = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except OSError:\n    sys.exit(3)\n"
    )
    with locked(lock):
        busy = subprocess.run([sys.executable, "-c", probe, str(lock)], check=False)
    free = subprocess.run([sys.executable, "-c", probe, str(lock)], check=False)
    assert (busy.returncode, free.returncode) == (3, 0)
