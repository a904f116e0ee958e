"""A real munged of the test's own, for login tests.

munged starts in milliseconds with a fresh key; a test gets its own socket
and replay cache, so replays and expiry are munge's real answers. A second
munged with another key makes credentials that are truly forged (they pass
every check but the MAC of the daemon's key).

Only root may start munged here (``--force`` past its refusal to run as
root) and make credentials for other uids (``munge --uid``); without root
or munge the tests fail, saying what is missing, rather than skip.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hostile_user import world_dir

__all__ = ["encode", "munged"]


def _need_munge() -> None:
    missing = [b for b in ("munged", "munge", "unmunge") if shutil.which(b) is None]
    if missing:
        pytest.fail(
            f"these tests need munge installed ({', '.join(missing)} not found): apt install munge"
        )
    if os.geteuid() != 0:
        pytest.fail("these tests start their own munged, which needs root here")


@contextlib.contextmanager
def munged(folder: Path | None = None) -> Iterator[Path]:
    """A munged with a fresh key; yields its socket.

    ``folder``: where its files go; by default a folder every user may
    traverse (``munge --uid`` connects as that uid, and so do other users).
    """
    _need_munge()
    if folder is None:
        with world_dir("llmgw-munge-") as folder, munged(folder) as sock:
            yield sock
        return
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock, pidfile = folder / "munge.socket", folder / "munged.pid"
    subprocess.run(
        [
            "munged",
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={pidfile}",
            f"--log-file={folder / 'munged.log'}",
            f"--seed-file={folder / 'seed'}",
        ],
        check=True,
        capture_output=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not (sock.is_socket() and pidfile.exists()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sock.is_socket(), f"munged did not start: {(folder / 'munged.log').read_text()}"
        yield sock
    finally:
        # munged's own stop, by its socket (it waits for the daemon to go); the
        # pid file only if that fails (it may be read before munged wrote it).
        stop = subprocess.run(
            ["munged", "--stop", f"--socket={sock}"], capture_output=True, check=False
        )
        if stop.returncode != 0:
            with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)


def encode(sock: Path, payload: str | None, *, uid: int | None = None, ttl: int = 60) -> str:
    """A credential from the munged at ``sock``, for ``uid`` and its primary group (root
    only), or for the caller."""
    argv = ["munge", f"--socket={sock}", f"--ttl={ttl}"]
    argv += ["--string", payload] if payload is not None else ["--no-input"]
    if uid is not None:
        argv += [f"--uid={uid}", f"--gid={pwd.getpwuid(uid).pw_gid}"]
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"{argv}: {r.stderr}"
    return r.stdout.strip()
