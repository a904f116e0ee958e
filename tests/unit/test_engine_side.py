"""The gateway's engine side (router/engine.py), against real sockets: scripted
servers that answer as engines do, as broken ones do, and as a desync would
(the strict cases: each ends in a closed connection and a clean error, never
a reused connection)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmgw_slurm.auth.tls import client_context, make_identity
from llmgw_slurm.router import http1
from llmgw_slurm.router.engine import (
    Answer,
    Conn,
    EngineBroken,
    EnginePool,
    EngineUnreachable,
    Target,
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@dataclass
class Server:
    """What a scripted server saw: connections, and requests (head and body) on them."""

    url: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


async def read_request(reader: asyncio.StreamReader, server: Server) -> bool:
    """One request off the connection (False at its end)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length)
    server.requests.append(head + body)
    return True


@asynccontextmanager
async def serve(script: Script, tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    srv = Server()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        srv.connections += 1
        try:
            await script(reader, writer, srv)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    srv.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield srv
    finally:
        server.close()


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def keep_answering(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    while await read_request(r, s):
        w.write(answer(b'{"n": %d}' % len(s.requests), b"X-Request-Id: abc\r\n"))
        await w.drain()


class Pool(EnginePool):
    """The pool, with a POST as the request path sends one."""

    async def post(
        self, url: str, pinned: ssl.SSLContext | None, path: str, headers: dict[str, str],
        body: bytes,
    ) -> Answer:  # fmt: skip
        return await self.fetch(url, pinned, "POST", path, headers, body)


def pool(read_timeout: float | None = 5.0) -> Pool:
    return Pool(connect_timeout=5.0, read_timeout=read_timeout)


async def test_answers_by_content_length_on_one_kept_alive_connection() -> None:
    async with serve(keep_answering) as s:
        p = pool()
        first = await p.post(s.url, None, "/v1/x", {"Authorization": "Bearer k"}, b'{"a":1}')
        second = await p.post(s.url, None, "/v1/x", {}, b"{}")
        p.close()
    assert (first.status, first.body, second.body) == (200, b'{"n": 1}', b'{"n": 2}')
    assert first.headers["x-request-id"] == "abc" and first.headers["Content-Type"].startswith(
        "application/json"
    )
    assert s.connections == 1
    head = s.requests[0]
    assert head.startswith(b"POST /v1/x HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in head
    assert head.endswith(b'Content-Length: 7\r\n\r\n{"a":1}')


async def test_a_base_url_with_a_path_keeps_it() -> None:
    async with serve(keep_answering) as s:
        p = pool()
        await p.post(s.url + "/engine/", None, "/v1/x", {}, b"{}")
        p.close()
    assert s.requests[0].startswith(b"POST /engine/v1/x HTTP/1.1\r\n")


async def test_a_chunked_answer_sent_a_byte_at_a_time_with_extensions_and_trailers() -> None:
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n"
    )

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        while await read_request(r, s):
            for i in range(len(wire)):
                w.write(wire[i : i + 1])
                await w.drain()

    async with serve(script) as s:
        p = pool()
        got = [await p.post(s.url, None, "/x", {}, b"") for _ in range(2)]
        p.close()
    assert [g.body for g in got] == [b"hello world"] * 2
    assert s.connections == 1  # the trailer was read to its end: the connection is reused


async def test_an_answer_without_length_ends_with_the_connection_which_is_not_reused() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"HTTP/1.1 500 Oops\r\nContent-Type: text/plain\r\n\r\nall of it")
        await w.drain()

    async with serve(script) as s:
        p = pool()
        got = [await p.post(s.url, None, "/x", {}, b"") for _ in range(2)]
        p.close()
    assert [(g.status, g.body) for g in got] == [(500, b"all of it")] * 2
    assert s.connections == 2


async def test_a_100_continue_before_the_answer_is_skipped() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await w.drain()
        w.write(answer(b"ok"))
        await w.drain()

    async with serve(script) as s:
        p = pool()
        got = await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert (got.status, got.body) == (200, b"ok")


async def test_a_kept_alive_connection_the_engine_closed_is_replaced_unseen() -> None:
    # uvicorn closes idle connections after 5 s: the next request must not fail.
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(answer(b"ok"))
        await w.drain()
        # And then close, as an engine's keep-alive timeout does.

    async with serve(script) as s:
        p = pool()
        await p.post(s.url, None, "/x", {}, b"")
        await asyncio.sleep(0.05)
        got = await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert got.body == b"ok" and s.connections == 2 and len(s.requests) == 2


async def test_an_engine_that_takes_the_request_and_closes_is_unreachable() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)

    async with serve(script) as s:
        p = pool()
        with pytest.raises(EngineUnreachable) as e:
            await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert not e.value.timed_out
    assert len(s.requests) == 1  # a new connection is not tried again


async def test_an_answer_that_breaks_off_is_broken_not_unreachable() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")
        await w.drain()

    async with serve(script) as s:
        p = pool()
        with pytest.raises(EngineBroken) as e:
            await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert e.value.cause == "Closed"


@pytest.mark.parametrize(
    "wire,cause",
    [
        (b"SMTP ready\r\n\r\n", "BadStatusLine"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "BadHeaders"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n", "BadHeaders"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "BadChunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "BadChunk"),
        # int(x, 16) takes each of these three; a chunk size is hex digits only.
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", "BadChunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n", "BadChunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n 2\r\nab\r\n", "BadChunk"),
        # A size line that never ends is not waited on.
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000, "BadChunk"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000, "BadHeaders"),
    ],
)
async def test_what_is_not_http_is_broken(wire: bytes, cause: str) -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(wire)
        await w.drain()
        await asyncio.sleep(5)

    async with serve(script) as s:
        p = pool()
        with pytest.raises(EngineBroken) as e:
            await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert e.value.cause == cause


async def test_a_silent_engine_times_out_and_the_request_is_not_sent_again() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(answer(b"ok"))
        await w.drain()
        await read_request(r, s)
        await asyncio.sleep(5)  # generating, far past the read timeout

    async with serve(script) as s:
        p = pool(read_timeout=0.2)
        await p.post(s.url, None, "/x", {}, b"")
        with pytest.raises(EngineUnreachable) as e:
            await p.post(s.url, None, "/x", {}, b"")
        p.close()
    # A kept-alive connection, but silent, not closed: not resent on a new one.
    assert e.value.timed_out and len(s.requests) == 2 and s.connections == 1


async def test_each_request_on_a_kept_alive_connection_gets_its_whole_read_timeout() -> None:
    # The read timer is left running from one request to the next: it must
    # count from each request's own send, not from the first one's.
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(answer(b"1"))
        await w.drain()
        await read_request(r, s)
        await asyncio.sleep(0.5)  # past the first request's 1 s, within its own
        w.write(answer(b"2"))
        await w.drain()
        await read_request(r, s)
        await asyncio.sleep(5)  # silent: times out

    async with serve(script) as s:
        p = pool(read_timeout=1.0)
        assert (await p.post(s.url, None, "/x", {}, b"")).body == b"1"
        await asyncio.sleep(0.8)
        assert (await p.post(s.url, None, "/x", {}, b"")).body == b"2"
        with pytest.raises(EngineUnreachable) as e:
            await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert e.value.timed_out and s.connections == 1


async def test_a_cancelled_request_closes_its_connection() -> None:
    # The client went away: closing the engine's connection stops the generation.
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        if await r.read(1) == b"":
            s.closed_by_client.set()

    async with serve(script) as s:
        p = pool()
        task = asyncio.create_task(p.post(s.url, None, "/x", {}, b""))
        while not s.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(s.closed_by_client.wait(), 5)
        p.close()


async def test_no_engine_at_the_address_is_unreachable() -> None:
    async with serve(keep_answering) as s:
        url = s.url
    with pytest.raises(EngineUnreachable):
        await pool().post(url, None, "/x", {}, b"")


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async with serve(keep_answering) as s:
        p = pool()
        with pytest.raises(ValueError, match="line break"):
            await p.post(s.url, None, "/x", {"X-Request-Id": "a\r\nEvil: 1"}, b"")
        p.close()
    assert s.requests == []


async def test_a_squatter_without_the_pinned_certificate_gets_nothing(tmp_path: Path) -> None:
    engine = make_identity(tmp_path, "engine", "engine", 1)
    squatter = make_identity(tmp_path, "squatter", "squatter", 1)
    gateway = make_identity(tmp_path, "gw", "gw", 1)
    pinned = client_context(engine.cert_pem, gateway.cert_file, gateway.key_file)

    def server_ctx(cert: Path, key: Path) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        return ctx

    p = pool()
    async with serve(keep_answering, server_ctx(squatter.cert_file, squatter.key_file)) as s:
        with pytest.raises(EngineUnreachable, match="cannot connect"):
            await p.post(s.url, pinned, "/x", {"Authorization": "Bearer secret"}, b"prompt")
    assert s.requests == []
    async with serve(keep_answering, server_ctx(engine.cert_file, engine.key_file)) as s:
        got = [await p.post(s.url, pinned, "/x", {}, b"") for _ in range(2)]
    p.close()
    assert [g.status for g in got] == [200, 200] and s.connections == 1


# ---- strict: framing in doubt closes the connection ---------------------------------

OK_BODY = b'{"ok": true}'
CRAFTED = {
    "two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 12\r\n\r\n" + OK_BODY,
    "underscored-length": b"HTTP/1.1 200 OK\r\nContent-Length: 1_2\r\n\r\n" + OK_BODY,
    "plus-length": b"HTTP/1.1 200 OK\r\nContent-Length: +12\r\n\r\n" + OK_BODY,
    "minus-length": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n" + OK_BODY,
    "length-and-chunked": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"c\r\n" + OK_BODY + b"\r\n0\r\n\r\n"
    ),
    "unknown-coding": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunked\r\n\r\nc\r\n" + OK_BODY + b"\r\n0\r\n\r\n"
    ),
    "gzip-then-chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\nc\r\n" + OK_BODY
        + b"\r\n0\r\n\r\n"
    ),
    "obs-fold": b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 12\r\n\r\n" + OK_BODY,
    "status-99999": b"HTTP/1.1 99999 OK\r\nContent-Length: 12\r\n\r\n" + OK_BODY,
    "non-ascii-digit": "HTTP/1.1 2\u0660\u0660 OK\r\nContent-Length: 12\r\n\r\n".encode() + OK_BODY,
    "http-2-status-line": b"HTTP/2.0 200 OK\r\nContent-Length: 12\r\n\r\n" + OK_BODY,
    "truncated-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nc\r\n" + OK_BODY[:5],
    "oversized-head": b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 70_000 + b"\r\n\r\n",
}


def crafted_then_plain(wire: bytes, close: bool = False) -> Script:
    """The first request on the first connection gets ``wire`` (then the
    close, ``close``); everything after, plain."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        first = s.connections == 1
        while await read_request(r, s):
            if first:
                w.write(wire)
                await w.drain()
                first = False
                if close:
                    w.close()
                    s.closed_by_client.set()  # nothing to wait for
                    return
                # Whatever the gateway does next, it is not another request here.
                if await r.read(1) == b"":
                    s.closed_by_client.set()
                return
            w.write(answer(OK_BODY))
            await w.drain()

    return script


@pytest.mark.parametrize("name", list(CRAFTED))
async def test_an_answer_with_framing_in_doubt_is_broken_and_its_connection_closed(
    name: str,
) -> None:
    async with serve(crafted_then_plain(CRAFTED[name], close=name == "truncated-chunk")) as s:
        p = pool()
        with pytest.raises(EngineBroken) as e:
            await p.post(s.url, None, "/x", {}, b"")
        await asyncio.wait_for(s.closed_by_client.wait(), 10)
        # Never reused: the next request goes on a new connection.
        got = await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert e.value.cause in ("BadHeaders", "BadStatusLine", "BadChunk", "Closed"), e.value
    assert got.body == OK_BODY and s.connections == 2


async def test_bytes_past_a_whole_answer_leave_it_whole_and_the_connection_unused() -> None:
    # A second answer nobody asked for is a desync's sign: the first is the
    # answer, and the connection is never used again.
    wire = answer(OK_BODY) + answer(b'{"smuggled": 1}')
    async with serve(crafted_then_plain(wire)) as s:
        p = pool()
        first = await p.post(s.url, None, "/x", {}, b"")
        await asyncio.wait_for(s.closed_by_client.wait(), 10)
        second = await p.post(s.url, None, "/x", {}, b"")
        p.close()
    assert first.body == second.body == OK_BODY and s.connections == 2


class Pieces:
    """A sink that records the body's pieces as the connection hands them over."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.ended: list[object] = []

    def head(self, conn: object, status: int, headers: dict[str, str]) -> None:
        pass

    def data(self, data: bytes) -> None:
        self.pieces.append(data)

    def end(self, error: object) -> None:
        self.ended.append(error)


async def test_the_chunks_of_one_read_reach_the_sink_as_one_piece() -> None:
    # A stream's events that came in one read cost one relay pass and one client
    # chunk, not one each; those of a later read come as a piece of their own.
    events = [b'data: {"n": %d}\n\n' % i for i in range(12)]
    first = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
        http1.chunk(e) for e in events[:10]
    )
    rest = b"".join(http1.chunk(e) for e in events[10:]) + b"0\r\n\r\n"

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await read_request(r, s)
        w.write(first)
        await w.drain()
        await asyncio.sleep(0.2)  # the gateway reads the first ten before the rest is sent
        w.write(rest)
        await w.drain()

    sink = Pieces()
    async with serve(script) as s:
        p = pool()
        got = await p.fetch(s.url, None, "POST", "/x", {}, b"", sink)
        p.close()
    assert got.status == 200 and sink.ended == [None]
    assert sink.pieces == [b"".join(events[:10]), b"".join(events[10:])]


class Opening(EnginePool):
    """A pool whose connections open as the test says: each attempt waits for
    ``go`` and then fails with ``fail`` (if set) or yields a connection to nowhere."""

    def __init__(self, max_connecting: int) -> None:
        super().__init__(connect_timeout=5.0, read_timeout=5.0, max_connecting=max_connecting)
        self.go = asyncio.Event()
        self.fail: EngineUnreachable | None = None
        self.attempts = 0
        self.opening = 0
        self.most_at_once = 0

    async def _open(self, target: Target) -> Conn:
        assert target.host == "127.0.0.1", target  # the only engine these tests name
        self.attempts += 1
        self.opening += 1
        self.most_at_once = max(self.most_at_once, self.opening)
        try:
            await self.go.wait()
            if self.fail is not None:
                raise self.fail
            return Conn(asyncio.get_running_loop(), None)
        finally:
            self.opening -= 1


async def _burst(p: Opening, n: int) -> list[Conn | BaseException]:
    target = p.target("http://127.0.0.1:9", None)
    tasks = [asyncio.ensure_future(p.connect(target)) for _ in range(n)]
    while p.opening < min(n, p.max_connecting):
        await asyncio.sleep(0)
    p.go.set()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def test_a_burst_of_connections_to_one_engine_opens_a_few_at_a_time_and_all() -> None:
    # A thousand streams begun together must not overflow the engine's listen
    # backlog: the rest wait their turn, and every one is opened.
    p = Opening(max_connecting=3)
    got = await _burst(p, 20)
    assert all(isinstance(c, Conn) for c in got), got
    assert (p.attempts, p.most_at_once) == (20, 3)
    assert not p._gates  # nothing kept for an engine nobody is connecting to


async def test_connections_waiting_their_turn_fail_with_the_one_that_could_not_connect() -> None:
    # An engine that is down is known after one connect timeout, not one per
    # turn of the queue; who comes after the failure tries again.
    p = Opening(max_connecting=2)
    p.fail = EngineUnreachable("cannot connect to 127.0.0.1:9: TimeoutError()")
    got = await _burst(p, 10)
    assert all(isinstance(e, EngineUnreachable) for e in got), got
    assert p.attempts == 2
    assert sum("while this one waited its turn" in str(e) for e in got) == 8
    p.fail = None
    assert isinstance(await p.connect(p.target("http://127.0.0.1:9", None)), Conn)
    assert p.attempts == 3


async def test_a_connection_opened_after_a_failure_lets_the_later_ones_try() -> None:
    p = Opening(max_connecting=1)
    target = p.target("http://127.0.0.1:9", None)
    p.fail = EngineUnreachable("refused")
    first = asyncio.ensure_future(p.connect(target))
    while not p.opening:
        await asyncio.sleep(0)
    p.go.set()
    with pytest.raises(EngineUnreachable):
        await first
    p.go.clear()
    p.fail = None
    # Both join after the failure: each tries, in turn, and both open.
    got = await _burst(p, 2)
    assert all(isinstance(c, Conn) for c in got), got
    assert p.attempts == 3
