"""The daemon's own accept loop: connections within bounds, heads within a time.

An asyncio server accepts whatever comes until ``accept()`` fails with
EMFILE; then the next ``squeue`` fails too. :class:`Acceptor` accepts on
the listening sockets itself (``loop.add_reader``, then
``loop.connect_accepted_socket``, both public), and before it builds a
protocol it asks a :class:`~llmgw_slurm.guard.limiter.ConnectionLimiter`:

- a peer (a local user's uid, or an address: :mod:`llmgw_slurm.guard.peers`)
  at its bound has the connection reset at once, and so does a connection
  its client closed before it was accepted;
- a listener at its total stops accepting until a connection closes (what
  arrives meanwhile waits in the kernel's backlog);
- ``accept()`` failing for lack of descriptors pauses the listener half a
  second instead of spinning on it.

Each accepted connection's protocol is wrapped (:class:`_Guarded`): the
wrapper stays the transport's protocol and passes every callback on; it
releases the connection's place when it closes, whatever protocol runs it
by then (a protocol that hands its connection to another, as the gateway's
fast lane hands one to aiohttp, does so with :func:`hand_over` instead of
``transport.set_protocol``), and closes a connection that has not sent a
whole request head (up to its blank line) within ``head_timeout`` of being
accepted. The wrapper knows nothing of HTTP beyond that blank line; a
protocol that parses requests itself can find its :class:`Guard` with
:func:`guard_of` and time every later head too (:meth:`Guard.head_started`
when it waits for one, :meth:`Guard.head_complete` when one is whole).

A connection whose protocol was swapped with a plain ``set_protocol`` (the
guard then hears nothing more of it) is found by a sweep, once a head
timeout, and its place released once its transport is closing; the swap is
logged as the bug it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl as ssl_
import struct
import time
from collections.abc import Callable
from typing import Any, cast

from llmgw_slurm.guard.limiter import ConnectionLimiter, Seat
from llmgw_slurm.guard.peers import CLOSED_PEER, PeerIdentifier, peer_of

__all__ = ["Acceptor", "Guard", "bind_listeners", "guard_of", "hand_over"]

log = logging.getLogger(__name__)

_HEAD_END = b"\r\n\r\n"
# How long a listener rests after accept() failed for lack of descriptors.
_ACCEPT_PAUSE_S = 0.5
# accept() per readable event, as asyncio's own server takes up to its backlog.
_ACCEPT_BATCH = 128
_WARN_EVERY_S = 60.0
# SO_LINGER on, 0 s: close() resets the connection and keeps no TIME_WAIT state.
_RESET = struct.pack("ii", 1, 0)
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# struct tcp_info up to tcpi_sacked: state and flags (8 bytes), rto, ato, snd_mss,
# rcv_mss, unacked, sacked. Of a listening socket the kernel puts its accept
# queue's length in unacked and the queue's limit in sacked.
_TCP_INFO_HEAD = struct.Struct("=8xIIIIII")


class Guard:
    """One connection's place among the listener's and its request-head timer."""

    __slots__ = ("_close", "_limiter", "_tail", "_ticket", "_timer")

    def __init__(self, limiter: ConnectionLimiter, ticket: Seat) -> None:
        self._limiter = limiter
        self._ticket = ticket
        self._timer: asyncio.TimerHandle | None = None
        self._close: Callable[[], None] | None = None
        # The last bytes of an unfinished head: its blank line may span two reads.
        self._tail = b""

    @property
    def peer(self) -> str:
        return self._ticket.peer

    def head_started(self) -> None:
        """A request head is due (the connection is new, or idle between requests)."""
        if self._timer is None and self._close is not None:
            self._timer = asyncio.get_running_loop().call_later(
                self._limiter.head_timeout, self._expired
            )

    def head_complete(self) -> None:
        """The head came whole: the timer stops until :meth:`head_started` again."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._tail = b""

    @property
    def awaiting_head(self) -> bool:
        return self._timer is not None

    def _scan(self, data: bytes) -> None:
        seen = self._tail + data[: 64 * 1024]
        if _HEAD_END in seen:
            self.head_complete()
        else:
            self._tail = seen[-3:]

    def _expired(self) -> None:
        self._timer = None
        self._limiter.refused["head_timeout"] += 1
        log.debug("connections: %s sent no whole request head in time; closed", self.peer)
        if self._close is not None:
            self._close()

    def _end(self) -> None:
        self.head_complete()
        self._close = None
        self._ticket.release()


def hand_over(transport: asyncio.BaseTransport, protocol: asyncio.BaseProtocol) -> None:
    """``transport.set_protocol(protocol)`` for a connection that may be guarded.

    The guard stays the transport's protocol and passes everything on to
    ``protocol`` from now on, so the connection's place is still released
    when it closes. A plain ``set_protocol`` on a guarded connection would
    leave the guard out (its place is then released only by the sweep).
    """
    current = transport.get_protocol()
    if isinstance(current, _Guarded):
        current.inner = protocol
    else:
        transport.set_protocol(protocol)


def guard_of(transport: asyncio.BaseTransport) -> Guard | None:
    """The Guard of a connection an :class:`Acceptor` accepted, None for another."""
    current = transport.get_protocol()
    return current.guard if isinstance(current, _Guarded) else None


class _Guarded(asyncio.Protocol):
    """Wraps one connection's protocol: its place, its head timer, its end.

    The inner protocol gets the real transport (no indirection on writes,
    sendfile works); it swaps protocols with :func:`hand_over`.
    """

    def __init__(self, inner: asyncio.BaseProtocol, guard: Guard, live: set[_Guarded]) -> None:
        self.inner = inner
        self.guard = guard
        self._live = live
        self.made = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both are streams.
        transport = cast(asyncio.Transport, transport)
        self.made = True
        self.transport = transport
        self._live.add(self)
        self.guard._close = transport.abort
        self.guard.head_started()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.guard._timer is not None:
            self.guard._scan(data)
        inner = self.inner
        if isinstance(inner, asyncio.Protocol):
            inner.data_received(data)
        elif isinstance(inner, asyncio.BufferedProtocol):
            _feed_buffered(inner, data)

    def eof_received(self) -> bool | None:
        inner = self.inner
        if isinstance(inner, (asyncio.Protocol, asyncio.BufferedProtocol)):
            return inner.eof_received()
        return None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.end()
        self.inner.connection_lost(exc)

    def end(self) -> None:
        self._live.discard(self)
        self.guard._end()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _feed_buffered(inner: asyncio.BufferedProtocol, data: bytes) -> None:
    view = memoryview(data)
    while view:
        buf = memoryview(inner.get_buffer(len(view)))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        inner.buffer_updated(n)
        view = view[n:]


class Acceptor:
    """Accepts on ``socks`` within ``limiter``'s bounds; each connection gets a
    protocol from ``factory`` (wrapped: see the module doc).

    ``ssl``: a server context, the TLS handshake bounded by the head timeout.
    """

    def __init__(
        self,
        socks: list[socket.socket],
        factory: Callable[[], asyncio.BaseProtocol],
        limiter: ConnectionLimiter,
        *,
        ssl: ssl_.SSLContext | None = None,
        peers: PeerIdentifier | None = None,
    ) -> None:
        self.socks = socks
        self._factory = factory
        self.limiter = limiter
        self._ssl = ssl
        self._peers = peers or PeerIdentifier()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading: set[socket.socket] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: set[_Guarded] = set()
        self._closed = False
        self._warned_at = -_WARN_EVERY_S
        self._swap_logged = False
        self._sweeper: asyncio.TimerHandle | None = None
        limiter.on_room(self._resume_all)

    @property
    def port(self) -> int | None:
        for s in self.socks:
            addr = s.getsockname()
            if isinstance(addr, tuple):
                return int(addr[1])
        return None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for s in self.socks:
            s.setblocking(False)
        self._resume_all()
        self._sweep()

    def stop_accepting(self) -> None:
        """No new connection from now on; the listening sockets are closed."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for s in list(self._reading):
            self._pause(s)
        for s in self.socks:
            s.close()
        for t in self._tasks:
            t.cancel()

    def abort_all(self) -> None:
        """Reset every connection still open (after the server's own shutdown)."""
        for g in list(self._live):
            g.abort()

    @property
    def connections(self) -> int:
        return self.limiter.open

    def accept_queue(self) -> tuple[int, int]:
        """Connections the kernel completed that wait for the daemon to accept
        them, and how many it queues before it drops new ones (the listen
        backlog), over the listener's sockets. A full queue drops or resets
        new connections before the daemon sees them, whoever made them."""
        waiting = limit = 0
        for s in self.socks:
            try:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_HEAD.size)
            except OSError:  # closed: no longer accepting
                continue
            *_, queued, queue_limit = _TCP_INFO_HEAD.unpack_from(info)
            waiting += queued
            limit += queue_limit
        return waiting, limit

    def _sweep(self) -> None:
        """Release the places of connections taken from the guard by a plain
        ``set_protocol`` once they close (it hears no ``connection_lost``)."""
        for g in list(self._live):
            t = g.transport
            if t is None or t.get_protocol() is g:
                continue
            if not self._swap_logged:
                self._swap_logged = True
                log.error(
                    "connections on %s: a protocol (%s) took a connection with set_protocol; "
                    "guard.hand_over keeps its place counted until it closes",
                    self.limiter.name,
                    type(t.get_protocol()).__name__,
                )
            if t.is_closing():
                g.end()
        assert self._loop is not None
        every = min(max(self.limiter.head_timeout, 1.0), 30.0)
        self._sweeper = self._loop.call_later(every, self._sweep)

    # accepting

    def _resume_all(self) -> None:
        for s in self.socks:
            self._resume(s)

    def _resume(self, s: socket.socket) -> None:
        if self._closed or self._loop is None or s in self._reading or self.limiter.full:
            return
        if s.fileno() < 0:
            return
        self._loop.add_reader(s, self._readable, s)
        self._reading.add(s)

    def _pause(self, s: socket.socket) -> None:
        if s in self._reading and self._loop is not None:
            self._reading.discard(s)
            self._loop.remove_reader(s)

    def _readable(self, s: socket.socket) -> None:
        for _ in range(_ACCEPT_BATCH):
            if self.limiter.full:
                for each in self.socks:
                    self._pause(each)
                return
            try:
                conn, addr = s.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as err:
                self._accept_failed(s, err)
                return
            self._take(conn, addr)

    def _accept_failed(self, s: socket.socket, err: OSError) -> None:
        self.limiter.accept_errors += 1
        if err.errno not in _OUT_OF_FILES:
            log.warning("connections: accept on %s failed: %s", self.limiter.name, err)
            return
        # The connection stays in the backlog and the socket readable: rest, or spin.
        self._warn(f"accept failed ({err.strerror}); pausing {_ACCEPT_PAUSE_S:g} s")
        self._pause(s)
        assert self._loop is not None
        self._loop.call_later(_ACCEPT_PAUSE_S, self._resume, s)

    def _take(self, conn: socket.socket, addr: object) -> None:
        peer = peer_of(self._peers, conn, addr)
        if peer == CLOSED_PEER:
            # Its client closed it before it was accepted: no one to answer, and
            # counted as any user's it would spend that user's bound.
            self.limiter.refused["closed"] += 1
            _reset(conn)
            return
        ticket = self.limiter.admit(peer)
        if ticket is None:
            held = self.limiter.held_by(peer)
            self._warn(f"{peer} holds {held} connections (bound {self.limiter.per_peer})")
            _reset(conn)
            return
        conn.setblocking(False)
        assert self._loop is not None
        task = self._loop.create_task(self._connect(conn, ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket, ticket: Seat) -> None:
        guarded = _Guarded(self._factory(), Guard(self.limiter, ticket), self._live)
        loop = asyncio.get_running_loop()
        try:
            if self._ssl is None:
                await loop.connect_accepted_socket(lambda: guarded, conn)
            else:
                await loop.connect_accepted_socket(
                    lambda: guarded,
                    conn,
                    ssl=self._ssl,
                    ssl_handshake_timeout=self.limiter.head_timeout,
                )
        except (OSError, ssl_.SSLError, TimeoutError, asyncio.CancelledError) as err:
            # A client gone before its handshake ended, or a failed handshake.
            log.debug("connections: %s: not connected: %r", ticket.peer, err)
        finally:
            if not guarded.made:
                ticket.release()
                conn.close()

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            lim = self.limiter
            log.warning(
                "connections on %s: %s; %d open (bound %d), refused so far: %s",
                lim.name,
                what,
                lim.open,
                lim.total,
                dict(lim.refused) or "none",
            )


def _reset(conn: socket.socket) -> None:
    """Close an accepted connection unserved, with a reset (no TIME_WAIT kept)."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    conn.close()


def bind_listeners(host: str, port: int, backlog: int = 1024) -> list[socket.socket]:
    """Listening sockets for ``host:port`` (every address the name has, as
    asyncio's ``create_server`` binds them); OSError saying which failed."""
    infos = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    socks: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # As asyncio: an IPv6 socket does not also take IPv4 (its own socket does).
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as err:
                why = f"cannot listen on {host}:{port}: {err.strerror}"
                raise OSError(err.errno, why) from None
            s.listen(backlog)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks
