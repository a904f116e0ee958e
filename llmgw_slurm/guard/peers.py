"""Who is at the other end of an accepted connection: a uid where the kernel
knows it, an address otherwise.

Every user of a login node connects from 127.0.0.1, so an address says
nothing about who is behind a local connection, and a bound per address
would let one user take every other local user's share. For a connection
from this very host the kernel knows the client socket's owner: the daemon
asks for it with one ``NETLINK_SOCK_DIAG`` query naming the socket exactly
(its four addresses and ports), the same table ``ss -e`` reads. Reading
``/proc/net/tcp`` instead would cost a pass over every socket of the host per
connection, which under a flood of 20,000 is what must not happen.

A connection from another host is known by its address; one whose owner the
kernel does not tell (netlink refused, or the client socket gone entirely) is
too. A client socket closed before the daemon accepted its connection is
held by no process any more, and the kernel reports what is left of it (a
FIN_WAIT2 or TIME_WAIT remnant) as root's: counted so, another user's flood
of connections closed at once would spend root's bound. Such a connection is
:data:`CLOSED_PEER`, refused unserved: its client can read no answer.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time

__all__ = ["CLOSED_PEER", "NO_OWNER", "PeerIdentifier", "peer_of"]

log = logging.getLogger(__name__)

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid.
_REQ = struct.Struct("=BBBBI")
# inet_diag_msg after its sockid: expires, rqueue, wqueue, uid, inode.
_MSG_TAIL = struct.Struct("=IIIII")
_SOCKID_LEN = 48
_NO_COOKIE = b"\xff" * 8
_WARN_EVERY_S = 60.0
# What uid() answers for a client socket no process holds any more (its inode 0).
NO_OWNER = -1
CLOSED_PEER = "closed"
# Errors after which the next query may well be answered: the kernel short of
# memory or the daemon of files for a moment, a signal, a slow answer.
_TRANSIENT_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.ENOBUFS, errno.ENOMEM, errno.EMFILE, errno.ENFILE}
)


def _transient(err: OSError) -> bool:
    return isinstance(err, TimeoutError) or err.errno in _TRANSIENT_ERRNOS


def _sockid(family: int, src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    """inet_diag_sockid: ports big-endian, addresses in 16 bytes, any interface, no cookie."""

    def addr(host: str) -> bytes:
        return socket.inet_pton(family, host).ljust(16, b"\0")

    ports = struct.pack(">HH", src[1], dst[1])
    return ports + addr(src[0]) + addr(dst[0]) + struct.pack("=I", 0) + _NO_COOKIE


def _unmapped(host: str) -> tuple[int, str]:
    """The family and address a client socket has: ``::ffff:a.b.c.d`` is an IPv4 one's.

    By the text's shape, not ``ipaddress`` (ten times slower, per connection):
    the names come from the kernel (getpeername), in its canonical forms.
    """
    if ":" not in host:
        return socket.AF_INET, host
    host = host.split("%", 1)[0]
    if host.startswith("::ffff:") and "." in host:
        return socket.AF_INET, host[len("::ffff:") :]
    return socket.AF_INET6, host


class PeerIdentifier:
    """Asks the kernel for the uid of a local client's socket; one netlink socket, reused."""

    def __init__(self) -> None:
        self._nl: socket.socket | None = None
        self._broken = False
        self._seq = 0
        # Queries the kernel left unanswered for a moment (a timeout, no buffer).
        self.hiccups = 0
        self._warned_at = -_WARN_EVERY_S

    def uid(self, client: tuple[str, int], server: tuple[str, int]) -> int | None:
        """The uid owning the TCP socket ``client`` -> ``server`` on this host, or None.

        :data:`NO_OWNER` for a client socket its process has closed. None for
        a client on another host (no such socket here), when the
        kernel does not answer (netlink unavailable: logged once, not asked
        again), or when it did not answer twice running for a moment.
        """
        if self._broken:
            return None
        family, src = _unmapped(client[0])
        dfamily, dst = _unmapped(server[0])
        if family != dfamily:
            return None
        try:
            sockid = _sockid(family, (src, client[1]), (dst, server[1]))
        except OSError:  # inet_pton: not an address of that family
            return None
        return self._ask_twice(family, sockid)

    def _ask_twice(self, family: int, sockid: bytes) -> int | None:
        """The kernel's answer; a query it left unanswered (a timeout, no buffer
        or no file free under a flood) is asked again once, on a fresh socket.

        Were netlink given up on at such a hiccup, every local user would share
        one address's bound from then on, and the user whose flood caused it
        would hold that bound.
        """
        for attempt in (1, 2):
            try:
                return self._ask(family, sockid)
            except OSError as err:
                # A late answer must not be read as the next query's.
                self.close()
                if not _transient(err):
                    self._give_up(err)
                    return None
                self.hiccups += 1
                if attempt == 2:
                    self._hiccup(err)
        return None

    def _give_up(self, err: OSError) -> None:
        """Netlink refused outright (not here, not allowed): never asked again."""
        self._broken = True
        log.warning(
            "connections: the kernel does not tell local clients' uids (%s); local "
            "connections are bounded per address instead, which all local users share",
            err,
        )
        self.close()

    def _hiccup(self, err: OSError) -> None:
        """Asked twice, no answer: this one connection is known by its address."""
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "connections: the kernel did not tell a local client's uid twice running (%s); "
                "that connection is bounded per address (%d such hiccups so far)",
                str(err) or type(err).__name__,
                self.hiccups,
            )

    def _ask(self, family: int, sockid: bytes) -> int | None:
        if self._nl is None:
            self._nl = self._open()
        self._seq += 1
        req = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
        self._nl.send(_NLMSG.pack(_NLMSG.size + len(req), _SOCK_DIAG_BY_FAMILY,
                                  _NLM_F_REQUEST, self._seq, 0) + req)  # fmt: skip
        data = self._nl.recv(8192)
        if len(data) < _NLMSG.size:
            return None
        _, kind, _, _, _ = _NLMSG.unpack_from(data)
        if kind == _NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, _NLMSG.size)
            if -code == errno.ENOENT:
                return None  # no such socket here: a remote client, or one gone
            raise OSError(-code, os.strerror(-code))
        offset = _NLMSG.size + 4 + _SOCKID_LEN
        if len(data) < offset + _MSG_TAIL.size:
            return None
        _, _, _, uid, inode = _MSG_TAIL.unpack_from(data, offset)
        return int(uid) if inode else NO_OWNER

    def _open(self) -> socket.socket:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
        # The kernel answers within the call; a bound keeps a stuck one off the loop.
        nl.settimeout(0.2)
        return nl

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None


def peer_of(ident: PeerIdentifier, sock: socket.socket, addr: object) -> str:
    """``uid:N`` for a client on this host whose owner the kernel tells,
    :data:`CLOSED_PEER` for one whose socket is closed already, else
    ``addr:IP`` (every port of one address is one peer)."""
    if not isinstance(addr, tuple) or len(addr) < 2:
        return "unix"
    try:
        server = sock.getsockname()
    except OSError:
        server = None
    if isinstance(server, tuple):
        uid = ident.uid((str(addr[0]), int(addr[1])), (str(server[0]), int(server[1])))
        if uid == NO_OWNER:
            return CLOSED_PEER
        if uid is not None:
            return f"uid:{uid}"
    return f"addr:{addr[0]}"
