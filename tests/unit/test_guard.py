"""The daemon's guard: the open-files limit, connections bounded in total and per
peer (a local user's uid, told by the kernel), and closed without a request head in
time; a protocol handing its connection on keeps it counted."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import ssl
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import cast

import pytest

from llmgw_slurm.guard import (
    CLOSED_PEER,
    Acceptor,
    ConnectionLimiter,
    FdBudget,
    PeerIdentifier,
    bind_listeners,
    guard_of,
    hand_over,
    peer_of,
    raise_open_files_limit,
)
from tests.hostile_user import INTRUDER

# ---- the open-files limit ------------------------------------------------------------


def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_budget_keeps_a_reserve_and_gives_each_gateway_connection_two_files() -> None:
    b = FdBudget.share(limit=65536, reserve=512, in_use=40)
    assert b.internal == (65536 - 512 - 40) // 8
    assert b.gateway == (65536 - 512 - 40 - b.internal) // 2
    # Every connection at its bound, one engine connection per gateway one: the
    # reserve is still free.
    assert 40 + b.internal + 2 * b.gateway <= 65536 - 512
    # A limit too small for the reserve asked for: half of it stays for the work.
    small = FdBudget.share(limit=1024, reserve=4096, in_use=30)
    assert small.reserve == 512
    assert 30 + small.internal + 2 * small.gateway <= 1024 - 512


# ---- the bookkeeping ------------------------------------------------------------------


def test_a_peer_at_its_bound_is_refused_others_are_not() -> None:
    lim = ConnectionLimiter("gateway", total=10, per_peer=3, head_timeout=5)
    mine = [lim.admit("uid:1001") for _ in range(3)]
    assert all(mine)
    assert lim.admit("uid:1001") is None
    assert lim.refused["peer"] == 1
    assert lim.admit("uid:1002") is not None
    assert mine[0] is not None
    mine[0].release()
    mine[0].release()  # once only
    assert lim.held_by("uid:1001") == 2 and lim.open == 3
    assert lim.admit("uid:1001") is not None


def test_a_full_listener_refuses_and_says_when_there_is_room_again() -> None:
    lim = ConnectionLimiter("internal", total=2, per_peer=2, head_timeout=5)
    room: list[bool] = []
    lim.on_room(lambda: room.append(True))
    a, b = lim.admit("addr:10.0.0.1"), lim.admit("addr:10.0.0.2")
    assert a is not None and b is not None and lim.full and lim.pauses == 1
    assert lim.admit("addr:10.0.0.3") is None and lim.refused["total"] == 1
    a.release()
    assert room == [True] and not lim.full
    assert lim.peers() == 1


def test_bounds_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ConnectionLimiter("gateway", total=0, per_peer=1, head_timeout=1)


# ---- who is at the other end ------------------------------------------------------------


def test_a_local_clients_uid_comes_from_the_kernel() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with srv, socket.create_connection(srv.getsockname()) as c:
        conn, addr = srv.accept()
        with conn:
            assert peer_of(PeerIdentifier(), conn, addr) == "uid:0"
            # The client's end, asked for from the server's side: the same question.
            assert PeerIdentifier().uid(c.getsockname(), c.getpeername()) == 0


def test_another_local_users_connection_is_that_user(tmp_path: Path) -> None:
    intruder = INTRUDER.ensure()
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    code = f"import socket, time; s = socket.create_connection(('127.0.0.1', {port})); time.sleep(5)"
    with srv, INTRUDER.spawn_python(code):
        conn, addr = srv.accept()
        with conn:
            # Both are 127.0.0.1: only the uid tells them apart.
            assert addr[0] == "127.0.0.1"
            assert peer_of(PeerIdentifier(), conn, addr) == f"uid:{intruder.pw_uid}"


def test_a_connection_closed_before_it_was_accepted_is_nobodys() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with srv:
        socket.create_connection(srv.getsockname()).close()
        conn, addr = srv.accept()
        ident = PeerIdentifier()
        with conn:
            # What is left of the client socket the kernel reports as root's.
            assert peer_of(ident, conn, addr) == CLOSED_PEER
        ident.close()


def test_a_remote_client_is_its_address() -> None:
    ident = PeerIdentifier()
    # No socket on this host has that client address: the kernel says so.
    assert ident.uid(("192.0.2.7", 40000), ("127.0.0.1", 8000)) is None
    # What is not an address at all is nobody's; the kernel is still asked next time.
    assert ident.uid(("300.1.2.3", 40000), ("127.0.0.1", 8000)) is None
    srv = socket.create_server(("127.0.0.1", 0))
    with srv, socket.create_connection(srv.getsockname()) as c:
        assert ident.uid(c.getsockname(), c.getpeername()) == 0


class Hiccups(PeerIdentifier):
    """The kernel's netlink, but the first sockets opened are stuck: a query on
    one is sent and never answered (a socketpair end nobody reads), as when the
    kernel is short of memory under a flood."""

    def __init__(self, stuck: int, refuse: OSError | None = None) -> None:
        super().__init__()
        self.stuck, self.refuse, self.opened = stuck, refuse, 0
        self.pairs: list[socket.socket] = []

    def _open(self) -> socket.socket:
        self.opened += 1
        if self.refuse is not None:
            raise self.refuse
        if self.stuck:
            self.stuck -= 1
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.pairs.append(theirs)
            ours.settimeout(0.05)
            return ours
        return super()._open()

    def __enter__(self) -> Hiccups:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
        for theirs in self.pairs:
            theirs.close()


def test_a_query_the_kernel_leaves_unanswered_is_asked_again_on_a_fresh_socket() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with Hiccups(stuck=1) as ident, srv, socket.create_connection(srv.getsockname()) as c:
        assert ident.uid(c.getsockname(), c.getpeername()) == 0
        assert (ident.opened, ident.hiccups) == (2, 1)


def test_a_kernel_that_does_not_answer_twice_leaves_that_connection_unknown_only() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with Hiccups(stuck=2) as ident, srv, socket.create_connection(srv.getsockname()) as c:
        # That one connection is bounded by its address...
        assert ident.uid(c.getsockname(), c.getpeername()) is None
        # ...but the uids of the next are asked for again: a flood that made the
        # kernel stumble once must not leave every local user in one bound.
        assert ident.uid(c.getsockname(), c.getpeername()) == 0
        assert (ident.opened, ident.hiccups) == (3, 2)


def test_netlink_refused_outright_is_not_asked_for_again() -> None:
    refuse = PermissionError(13, "Permission denied")
    srv = socket.create_server(("127.0.0.1", 0))
    with (
        Hiccups(stuck=0, refuse=refuse) as ident,
        srv,
        socket.create_connection(srv.getsockname()) as c,
    ):
        assert ident.uid(c.getsockname(), c.getpeername()) is None
        assert ident.uid(c.getsockname(), c.getpeername()) is None
        assert (ident.opened, ident.hiccups) == (1, 0)


# ---- the accept loop ----------------------------------------------------------------------


class Echo(asyncio.Protocol):
    """Answers each whole request head with one line; records its end."""

    ended: list[str]

    def __init__(self, ended: list[str]) -> None:
        self.ended = ended
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            _, _, self.buf = self.buf.partition(b"\r\n\r\n")
            assert self.transport is not None
            self.transport.write(b"ok\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended.append("lost")


@contextlib.asynccontextmanager
async def accepting(
    lim: ConnectionLimiter,
    factory: Callable[[], asyncio.BaseProtocol] | None = None,
    ctx: ssl.SSLContext | None = None,
) -> AsyncIterator[tuple[Acceptor, int, list[str]]]:
    ended: list[str] = []
    acc = Acceptor(
        bind_listeners("127.0.0.1", 0), factory or (lambda: Echo(ended)), lim, ssl=ctx
    )
    acc.start()
    try:
        port = acc.port
        assert port is not None
        yield acc, port, ended
    finally:
        acc.stop_accepting()
        acc.abort_all()


async def eventually(pred: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def ask(port: int) -> bytes:
    """One request on a new connection; what came back before it closed (or 3 bytes)."""
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionResetError:  # reset before the connect call saw it made
        return b""
    w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        return await asyncio.wait_for(r.read(3), 30)
    except ConnectionResetError:
        return b""
    finally:
        w.close()


async def test_a_peer_past_its_bound_is_reset_and_others_are_served() -> None:
    lim = ConnectionLimiter("gateway", total=100, per_peer=4, head_timeout=60)
    async with accepting(lim) as (_acc, port, _):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await eventually(lambda: lim.open == 4, "four connections admitted")
        # This process is one peer (uid 0): its fifth connection is reset unserved.
        assert await ask(port) == b""
        assert lim.refused["peer"] >= 1 and lim.open == 4
        for _, w in held:
            w.close()
        await eventually(lambda: lim.open == 0, "their places released")
        assert await ask(port) == b"ok\n"


async def test_another_user_cannot_take_a_local_users_share() -> None:
    INTRUDER.ensure()
    lim = ConnectionLimiter("gateway", total=100, per_peer=8, head_timeout=60)
    flood = textwrap.dedent(
        """
        import socket, sys, time
        held = []
        for _ in range(50):
            held.append(socket.create_connection(("127.0.0.1", int(sys.argv[1]))))
        print("held", flush=True)
        time.sleep(60)
        """
    )
    async with accepting(lim) as (_, port, _):
        with INTRUDER.spawn_python(flood, str(port)) as p:
            assert p.stdout is not None
            assert await asyncio.to_thread(p.stdout.readline) == "held\n"
            await eventually(lambda: lim.refused["peer"] >= 50 - 8, "the intruder's rest reset")
            assert lim.open == 8
            # Root is another peer: served while the intruder holds its whole share.
            assert await ask(port) == b"ok\n"


async def test_another_users_connections_closed_before_accepted_do_not_spend_roots_share() -> None:
    INTRUDER.ensure()
    lim = ConnectionLimiter("gateway", total=100, per_peer=4, head_timeout=60)
    socks = bind_listeners("127.0.0.1", 0)
    port = socks[0].getsockname()[1]
    opener = textwrap.dedent(
        """
        import socket, sys
        for _ in range(20):
            socket.create_connection(("127.0.0.1", int(sys.argv[1]))).close()
        print("closed", flush=True)
        """
    )
    ended: list[str] = []
    acc = Acceptor(socks, lambda: Echo(ended), lim)
    try:
        with INTRUDER.spawn_python(opener, str(port)) as p:
            assert p.stdout is not None
            assert await asyncio.to_thread(p.stdout.readline) == "closed\n"
        # Root's request waits in the backlog behind the intruder's twenty.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        acc.start()
        # Counted as root's (uid 0, as the kernel reports them), the twenty would
        # take root's four places and root's own connection would be reset.
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        assert (lim.refused["closed"], lim.refused["peer"]) == (20, 0)
        w.close()
    finally:
        acc.stop_accepting()
        acc.abort_all()


async def test_connections_waiting_to_be_accepted_are_counted_against_the_queues_limit() -> None:
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=60)
    socks = bind_listeners("127.0.0.1", 0, backlog=8)
    acc = Acceptor(socks, lambda: Echo([]), lim)
    port = acc.port
    assert port is not None
    try:
        # The kernel completes the handshakes; nobody has accepted them yet.
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        assert acc.accept_queue() == (3, 8)
        acc.start()
        await eventually(lambda: lim.open == 3, "the three accepted")
        assert acc.accept_queue() == (0, 8)
        for c in clients:
            c.close()
    finally:
        acc.stop_accepting()
        acc.abort_all()
    # Its sockets closed: nothing to tell, and nothing raised.
    assert acc.accept_queue() == (0, 0)


async def test_no_request_head_in_time_closes_the_connection() -> None:
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=0.3)
    async with accepting(lim) as (_, port, ended):
        idle_r, _idle_w = await asyncio.open_connection("127.0.0.1", port)
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
        slow_w.write(b"GET / HTTP/1.1\r\nHost")  # a head that never ends
        # Closed by the daemon: EOF (or a reset) on both, with nothing written back.
        for r in (idle_r, slow_r):
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(r.read(), 30) == b""
        assert lim.refused["head_timeout"] == 2
        await eventually(lambda: lim.open == 0, "their places released")
        assert ended == ["lost", "lost"]
        # A whole head in time (its blank line split over two writes) stops the timer.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r")
        await asyncio.sleep(0.05)
        w.write(b"\n")
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        await asyncio.sleep(0.6)  # twice the head timeout: the connection stays
        w.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        assert lim.refused["head_timeout"] == 2
        w.close()


async def test_a_full_listener_stops_accepting_and_resumes_when_one_closes() -> None:
    lim = ConnectionLimiter("gateway", total=3, per_peer=10, head_timeout=60)
    async with accepting(lim) as (_, port, _):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await eventually(lambda: lim.open == 3, "three admitted")
        # The fourth waits in the kernel's backlog: not accepted, not refused.
        waiting = asyncio.create_task(ask(port))
        await asyncio.sleep(0.3)
        assert not waiting.done() and lim.open == 3 and lim.pauses == 1
        held[0][1].close()
        assert await asyncio.wait_for(waiting, 30) == b"ok\n"
        for _, w in held[1:]:
            w.close()


class HandsOver(asyncio.Protocol):
    """Gives its connection to another protocol at the first byte, as the fast lane
    gives one to aiohttp."""

    def __init__(self, to: asyncio.Protocol, plain: bool) -> None:
        self.to = to
        self.plain = plain
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.plain:
            self.transport.set_protocol(self.to)
        else:
            hand_over(self.transport, self.to)
        self.to.connection_made(self.transport)
        self.to.data_received(data)


async def test_a_connection_handed_to_another_protocol_stays_counted() -> None:
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=60)
    ended: list[str] = []
    async with accepting(lim, lambda: HandsOver(Echo(ended), plain=False)) as (_, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        assert lim.open == 1
        w.close()
        await eventually(lambda: lim.open == 0 and ended == ["lost"], "released and ended")


async def test_a_plain_set_protocol_is_caught_by_the_sweep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=0.2)
    ended: list[str] = []
    async with accepting(lim, lambda: HandsOver(Echo(ended), plain=True)) as (_, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        w.close()
        # The guard hears nothing more; the sweep releases the place once it closed.
        await eventually(lambda: lim.open == 0, "the sweep to release it")
    assert "took a connection with set_protocol" in caplog.text


async def test_guard_of_lets_a_protocol_time_every_head() -> None:
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=0.3)
    ended: list[str] = []

    class Strict(Echo):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            assert self.transport is not None
            guard = guard_of(self.transport)
            assert guard is not None and guard.peer == "uid:0"
            # Answered: the next head is due, within the same timeout.
            guard.head_started()

    async with accepting(lim, lambda: Strict(ended)) as (_, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        assert await asyncio.wait_for(r.read(), 30) == b""
        assert lim.refused["head_timeout"] == 1


def _tls_pair(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = folder / "c.pem", folder / "k.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
         "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    return server, client


async def test_tls_connections_are_bounded_and_a_stalled_handshake_ends(tmp_path: Path) -> None:
    server, client = _tls_pair(tmp_path)
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=0.3)
    async with accepting(lim, ctx=server) as (_, port, _):
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        w.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await asyncio.wait_for(r.read(3), 30) == b"ok\n"
        w.close()
        # A client that connects and never begins its handshake holds nothing for long.
        raw_r, raw_w = await asyncio.open_connection("127.0.0.1", port)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(raw_r.read(), 30) == b""
        raw_w.close()
        await eventually(lambda: lim.open == 0, "every place released")
