"""Another, unprivileged user of the cluster, for tests that play one.

A shared login or compute node has users who are not the service: they can
bind free ports above 1024, read what is world-readable, and run anything.
Tests that check what such a user can and cannot do use :data:`INTRUDER`:

    from tests.hostile_user import INTRUDER, world_dir

    INTRUDER.ensure()                      # useradd once (needs root)
    r = INTRUDER.python("import os; print(os.getuid())")
    with squatting(INTRUDER, port, "/path/x.sock") as (tcp, unix):
        ...                                # whatever should send them nothing
    assert "secret" not in tcp.heard()

Commands run with ``setpriv`` as the user and its own group only (no
supplementary groups, no inherited capabilities), an empty environment but
PATH, HOME and LANG, and the system's Python (``/usr/bin/python3``, stdlib
only: the intruder cannot read root's interpreter or the project's venv,
which is realistic). Its scripts and files must be in folders the user can
traverse: pytest's ``tmp_path`` is under a 0700 folder of root's, so use
:func:`world_dir` for anything the intruder must reach.

Without root the fixture cannot create a user or switch to one, and a
security test that silently does not run proves nothing: :meth:`ensure`
fails the test with what to do.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "INTRUDER",
    "SQUATTER",
    "SYSTEM_PYTHON",
    "HostileUser",
    "Squatter",
    "squatting",
    "world_dir",
]

SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class HostileUser:
    name: str

    def ensure(self) -> pwd.struct_passwd:
        """The user's passwd entry, creating the user (no home, no login shell) if missing."""
        if os.geteuid() != 0:
            pytest.fail(
                f"tests acting as another user need root to create and become {self.name!r}"
            )
        for tool in ("useradd", "setpriv"):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} is not installed (Debian: passwd / util-linux)")
        try:
            return pwd.getpwnam(self.name)
        except KeyError:
            pass
        # --user-group: a group of its own, so it shares no group with the daemon.
        # A concurrent test may create it first; "exists" (9) is fine. Another
        # test level running beside this one (scripts/test) may hold the lock
        # on /etc/passwd or /etc/group for a moment: useradd then fails with 1
        # ("cannot lock") at once instead of waiting, so it is tried again.
        for _ in range(20):
            r = subprocess.run(
                ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir",
                 "/nonexistent", "--shell", "/usr/sbin/nologin", self.name],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if not (r.returncode == 1 and "lock" in r.stderr):
                break
            time.sleep(0.25)
        if r.returncode not in (0, 9):
            pytest.fail(f"useradd {self.name} failed: {r.stderr.strip()}")
        return pwd.getpwnam(self.name)

    @property
    def uid(self) -> int:
        return self.ensure().pw_uid

    @property
    def gid(self) -> int:
        return self.ensure().pw_gid

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` wrapped to run as the user (for subprocess calls of your own)."""
        pw = self.ensure()
        return [
            "setpriv",
            f"--reuid={pw.pw_uid}",
            f"--regid={pw.pw_gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--",
            *cmd,
        ]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/nonexistent",
            "LANG": "C.UTF-8",
            **(extra or {}),
        }

    def run(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path = "/",
        timeout: float = 60.0,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` as the user to its end; the result, whatever its exit code."""
        return subprocess.run(
            self.argv(cmd),
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            check=False,
        )

    def python(
        self, code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """``python3 -c code args...`` as the user (the system's Python, stdlib only)."""
        return self.run([SYSTEM_PYTHON, "-c", code, *args], env=env, timeout=timeout)

    @contextlib.contextmanager
    def spawn_python(
        self, code: str, *args: str, env: Mapping[str, str] | None = None
    ) -> Iterator[subprocess.Popen[str]]:
        """``python3 -c code args...`` as the user in the background; killed on exit.

        Its stdout is a pipe: a server it runs can print a line when it is
        ready (read it with ``p.stdout.readline()``) and what it saw at the end.
        """
        p = subprocess.Popen(
            self.argv([SYSTEM_PYTHON, "-u", "-c", code, *args]),
            env=self.env(env),
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            yield p
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


# Listens on TCP port argv[1] (127.0.0.1) or binds the Unix socket path argv[1],
# prints "up", then answers every connection with an empty 200 and prints
# repr() of what it was sent: what a squatter would keep.
SQUATTER = r"""
import os, socket, sys
what = sys.argv[1]
if what.isdigit():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(what)))
else:
    s = socket.socket(socket.AF_UNIX); s.bind(what); os.chmod(what, 0o777)
s.listen(16); print("up", flush=True)
while True:
    c, _ = s.accept(); c.settimeout(2); data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
        data += c.recv(65536) if b"Content-Length" in data else b""
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    except OSError:
        pass
    print(repr(data), flush=True); c.close()
"""


class Squatter:
    """A listener of the hostile user's on a port or socket path; :meth:`heard` ends it."""

    def __init__(self, user: HostileUser, target: int | str | Path) -> None:
        self.target = str(target)
        self.proc = subprocess.Popen(
            user.argv([SYSTEM_PYTHON, "-u", "-c", SQUATTER, self.target]),
            env=user.env(),
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        if first != "up":
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.proc.kill()
            raise AssertionError(f"the squatter could not take {self.target}: {err}")

    def heard(self) -> str:
        """Stop it; everything it was sent (one repr() per connection, a line each)."""
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=10)
        return out


@contextlib.contextmanager
def squatting(user: HostileUser, *targets: int | str | Path) -> Iterator[list[Squatter]]:
    """``user`` listening on every target (ports, socket paths); all stopped after."""
    got: list[Squatter] = []
    try:
        for t in targets:
            got.append(Squatter(user, t))
        yield got
    finally:
        for sq in got:
            sq.heard()


INTRUDER = HostileUser("llmgw-intruder")


@contextlib.contextmanager
def world_dir(prefix: str = "llmgw-hostile-") -> Iterator[Path]:
    """A fresh folder under /tmp that every user may traverse (0755); removed after."""
    # Not $TMPDIR: it may be private to the test runner.
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
