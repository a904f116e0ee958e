"""systemd integration without libsystemd: the notification protocol and log lines.

**Notifications** (``sd_notify``).
Under a unit with ``Type=notify`` systemd puts the path of a datagram socket in
``$NOTIFY_SOCKET`` and waits, before it calls the service started, for a
``READY=1`` datagram on it. The protocol is one datagram of newline-separated
``KEY=value`` lines; a path starting with ``@`` is in the abstract namespace
(its first byte is NUL on the wire). See sd_notify(3).

Notifying never breaks the daemon: outside systemd (no ``$NOTIFY_SOCKET``)
every call is a no-op, and a send that fails is logged once and dropped, as a
telemetry export would be.

**Sockets** (``sd_listen_fds``, :func:`listen_fds`). Under socket activation
systemd opens the listening sockets itself and keeps them open while the
service restarts, so no other user can take a port in between. It hands them
over as file descriptors 3, 4, ... with ``$LISTEN_FDS`` (how many),
``$LISTEN_PID`` (for whom: a child that inherited the variables must not take
them) and ``$LISTEN_FDNAMES`` (colon-separated names). See sd_listen_fds(3).

**Log lines** (:func:`log_handler`). Under systemd the journal stamps every
line itself, so the daemon's own timestamp is dropped; when stderr *is* the
journal's stream (``$JOURNAL_STREAM`` names its device and inode) each line
also starts with a ``<N>`` syslog priority, which journald strips and keeps,
so ``journalctl -p warning`` works.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, MutableMapping
from typing import TextIO

__all__ = ["Notifier", "listen_fds", "log_handler"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends state changes to systemd, if systemd asked for them."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        # Taken out of the environment (as sd_notify's unset_environment does): the
        # daemon's children inherit it otherwise, sbatch included, and would carry
        # the login node's socket path into every replica's job.
        raw = env.pop("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if raw.startswith("@"):
            self.address = b"\0" + raw[1:].encode()
        elif raw.startswith("/"):
            self.address = raw
        elif raw:
            # vsock:... (systemd 254+, for VMs) or garbage: not for a login-node daemon.
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying systemd", raw)
        self._last_status: str | None = None
        self._warned = False
        self._stopping = False
        # READY=1 has been sent (systemd considers the unit started).
        self.readied = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of ``KEY=value`` lines; False when not sent (never raises)."""
        if self.address is None:
            return False
        msg = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg, self.address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at %r: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        self.readied = True
        lines = ["READY=1"]
        if status is not None:
            self._last_status = status
            lines.append(f"STATUS={_one_line(status)}")
        return self.send(*lines)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets systemd 253+ match this RELOADING=1 to the reload it
        # started; older versions ignore the field. CLOCK_MONOTONIC is what it wants.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        """Say the daemon is shutting down (once; later calls send nothing)."""
        if self._stopping:
            return False
        self._stopping = True
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status`` shows; sent only when it changes."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.send(f"STATUS={_one_line(text)}")


SD_LISTEN_FDS_START = 3


def listen_fds(environ: MutableMapping[str, str] | None = None) -> list[tuple[str, socket.socket]]:
    """The sockets systemd passed to this process, with their names; [] outside socket activation.

    The variables are taken out of the environment (as sd_listen_fds'
    unset_environment does), so that sbatch and the jobs do not inherit them.
    """
    env = os.environ if environ is None else environ
    pid, count, names = (env.pop(k, "") for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"))
    if not pid or not count:
        return []
    if not (pid.isdigit() and count.isdigit()) or int(pid) != os.getpid():
        # Meant for another process (ours inherited the variables), or garbage.
        log.warning("LISTEN_PID=%r LISTEN_FDS=%r are not for this process; ignored", pid, count)
        return []
    labels = names.split(":") if names else []
    out = []
    for i in range(int(count)):
        fd = SD_LISTEN_FDS_START + i
        # systemd leaves them inheritable; the jobs the daemon starts must not hold them.
        os.set_inheritable(fd, False)
        out.append((labels[i] if i < len(labels) else "", socket.socket(fileno=fd)))
    return out


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value line in the datagram.
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:200]


_PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SYSTEMD = "%(levelname)s %(name)s: %(message)s"


def under_systemd(environ: Mapping[str, str]) -> bool:
    """Started by systemd (a service or ``systemd-run``): its journal adds the time."""
    return bool(environ.get("JOURNAL_STREAM") or environ.get("INVOCATION_ID"))


def stream_is_journal(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """``stream`` is connected to the journal (not a file or a pipe the unit redirected to)."""
    want = environ.get("JOURNAL_STREAM", "")
    if not want:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


class _JournalFormatter(logging.Formatter):
    """Prefixes each record with its syslog priority, as journald's stream reader wants."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.CRITICAL:
            prio = 2
        elif record.levelno >= logging.ERROR:
            prio = 3
        elif record.levelno >= logging.WARNING:
            prio = 4
        elif record.levelno >= logging.INFO:
            prio = 6
        else:
            prio = 7
        return f"<{prio}>{super().format(record)}"


def log_handler(stream: TextIO, environ: Mapping[str, str] | None = None) -> logging.Handler:
    """A handler writing to ``stream`` in the form that suits where it ends up."""
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler(stream)
    if stream_is_journal(stream, env):
        handler.setFormatter(_JournalFormatter(_SYSTEMD))
    elif under_systemd(env):
        handler.setFormatter(logging.Formatter(_SYSTEMD))
    else:
        handler.setFormatter(logging.Formatter(_PLAIN))
    return handler
