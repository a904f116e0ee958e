"""How a CLI knows it talks to the daemon before it sends a key, a token or a prompt.

Ports above 1024 are open to every user of a login node: while the daemon
restarts, anyone may listen on its ports and collect what clients send. So
the CLIs send a secret only to a server that proves it is the daemon:

- **https**: the server holds the certificate's key (``tls:`` in
  server.yaml); the client verifies the certificate (the system's CAs, or
  ``--ca-file`` / ``LLMGW_CA_FILE``).
- **http to a loopback address**: the kernel says who listens. The daemon
  publishes ``daemon.json`` (its uid, pid and ports) in its runtime
  directory, a folder only its user may write; the CLI trusts the file only
  if it and every folder above it belong to root or that uid and nobody else
  may write them, then reads ``/proc/net/tcp`` and ``tcp6``: every socket
  listening on the port must belong to root (systemd's, under socket
  activation) or the daemon's uid. A squatter who binds the port while the
  daemon is down owns that socket under their own uid, and gets nothing;
  with no daemon.json (a clean stop removes it) nothing is sent either.
- **http to another host**: nothing proves anything; refused, with the fix.
- **the admin socket** (a Unix socket): the CLI asks the kernel for the
  server's credentials (``SO_PEERCRED``) before it sends a byte, and the
  daemon asks for the caller's.

What this cannot see: a listener in another network namespace (containers)
and the moment between the check and the connection (a daemon that dies in
that instant and a squatter that binds at once); socket activation closes
the second, as the port is never free.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from llmgw_slurm.auth.private import trusted_owner, write_atomic
from llmgw_slurm.base.errors import UnverifiedServerError

__all__ = [
    "DEFAULT_INFO",
    "INFO_NAME",
    "DaemonInfo",
    "bind_unix",
    "check_listener",
    "connect_unix",
    "is_loopback",
    "listening_uids",
    "peer_credentials",
    "publish",
    "read_info",
    "unpublish",
    "verify_url",
]

INFO_NAME = "daemon.json"
# Where the shipped unit's RuntimeDirectory= puts it.
DEFAULT_INFO = Path("/run/llmgw-slurm") / INFO_NAME
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


@dataclass(frozen=True)
class DaemonInfo:
    """What the daemon publishes about itself, world-readable."""

    uid: int
    pid: int
    gateway_port: int
    internal_port: int
    tls: bool
    admin_socket: str


def publish(folder: Path, info: DaemonInfo) -> Path:
    path = folder / INFO_NAME
    write_atomic(path, json.dumps(asdict(info), sort_keys=True).encode() + b"\n", 0o644)
    return path


def unpublish(folder: Path, pid: int) -> None:
    """Remove daemon.json if it is still this process's (a newer daemon may have replaced it)."""
    path = folder / INFO_NAME
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def read_info(path: Path) -> DaemonInfo:
    """The daemon's published info, if a file nobody but root or that uid could have written."""
    try:
        st = path.stat()
        data = json.loads(path.read_text())
        info = DaemonInfo(**{k: data[k] for k in DaemonInfo.__dataclass_fields__})
    except FileNotFoundError:
        raise UnverifiedServerError(
            f"{path} does not exist: is the daemon running? (a running daemon writes "
            "daemon.json in its runtime_dir; point LLMGW_DAEMON_INFO at it if it is elsewhere)"
        ) from None
    except OSError as exc:
        raise UnverifiedServerError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise UnverifiedServerError(f"{path} is not a daemon.json the daemon wrote") from None
    if not isinstance(info.uid, int) or st.st_uid not in (0, info.uid):
        raise UnverifiedServerError(
            f"{path} belongs to uid {st.st_uid} but names uid {info.uid}: not the daemon's"
        )
    problem = trusted_owner(path, info.uid)
    if problem is not None:
        raise UnverifiedServerError(f"{path} cannot be trusted: {problem}")
    return info


def listening_uids(port: int, proc_net: Path = Path("/proc/net")) -> list[int]:
    """The owner uid of every socket listening on TCP ``port`` (IPv4 and IPv6), any address."""
    uids = []
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
        for line in lines:
            cols = line.split()
            if len(cols) < 8 or cols[3] != _LISTEN:
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                uids.append(int(cols[7]))
    return uids


def check_listener(port: int, uid: int, proc_net: Path = Path("/proc/net")) -> None:
    """Raise unless something listens on ``port`` and every listener is root's or ``uid``'s."""
    uids = listening_uids(port, proc_net)
    if not uids:
        raise UnverifiedServerError(f"nothing listens on port {port}: is the daemon running?")
    others = sorted({u for u in uids if u not in (0, uid)})
    if others:
        raise UnverifiedServerError(
            f"port {port} is held by uid {', '.join(map(str, others))}, not by the daemon "
            f"(uid {uid}): another user may have taken it while the daemon was down; "
            "tell the admin"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def verify_url(url: str, info_path: Path, what: str) -> None:
    """Raise UnverifiedServerError unless ``url`` can prove it is the daemon (see the module doc).

    For https the proof is the certificate, which the HTTP client checks itself.
    """
    parts = urlsplit(url)
    if parts.scheme == "https":
        return
    host = parts.hostname or ""
    port = parts.port or 80

    def refuse(why: str) -> UnverifiedServerError:
        return UnverifiedServerError(f"refusing to send {what} to {url}: {why}")

    if not is_loopback(host):
        raise refuse(
            "over plain http nothing proves it is the llmgw daemon (another user can take "
            "its port while it restarts). Use https:// (the admin sets tls: in server.yaml; "
            "a private CA goes in --ca-file or LLMGW_CA_FILE), or run this on the daemon's "
            f"host against http://127.0.0.1:{port}"
        )
    try:
        info = read_info(info_path)
        if port not in (info.gateway_port, info.internal_port):
            raise UnverifiedServerError(
                f"the daemon ({info_path}) listens on ports {info.gateway_port} and "
                f"{info.internal_port}, not {port}"
            )
        check_listener(port, info.uid)
    except UnverifiedServerError as exc:
        raise refuse(f"cannot check that the llmgw daemon holds the port: {exc}") from None


# ---- Unix sockets ---------------------------------------------------------------------

_UCRED = struct.Struct("3i")
# sun_path holds 108 bytes with its NUL; longer paths go through the folder's fd.
_SUN_PATH_MAX = 107


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def _short(path: Path, dir_fd: int) -> str:
    return (
        str(path)
        if len(os.fsencode(path)) <= _SUN_PATH_MAX
        else f"/proc/self/fd/{dir_fd}/{path.name}"
    )


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` (a stale one from a dead daemon is replaced).

    Mode 0666: anyone may connect, and the daemon decides by the caller's
    credentials; the folder (0755, the daemon's) keeps others from replacing it.
    """
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        with_name = _short(path, dir_fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(with_name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(with_name)
            os.chmod(with_name, 0o666)  # noqa: S103 - see the docstring
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(dir_fd)


def connect_unix(path: Path, timeout: float) -> socket.socket:
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_short(path, dir_fd))
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(dir_fd)
