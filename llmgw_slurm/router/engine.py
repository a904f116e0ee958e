"""The engine side: kept-alive HTTP/1.1 connections to the engines, read strictly.

One request at a time on a connection; its answer goes, as it is read, to the
request's :class:`Sink` (its head, its body's pieces with the framing undone,
its end), from the connection's own callbacks. The pieces of one read go to the
sink as one: an engine that answers faster than the gateway reads (a burst of
tokens, many streams at once) sends a dozen chunks a read, and each piece costs
the stream's relay, a client chunk and a send() of its own. The answer is read by
httptools (llhttp), and strictly: an answer whose framing is in doubt (two
Content-Lengths, a signed one, Content-Length with Transfer-Encoding, a
Transfer-Encoding other than chunked, a folded header, a bad status line or
chunk, a head past :data:`http1.MAX_HEAD`, bytes nobody asked for) is an
:class:`EngineBroken`, and its connection is closed, never reused: the
request fails over as for any engine error. Nothing raises out of a callback.

How an answer ends, for the sink: ``end(None)`` whole; ``end(EngineUnreachable)``
no byte came back (the request may go elsewhere); ``end(EngineBroken)`` it
began and broke off.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from llmgw_slurm.router import http1

__all__ = ["Answer", "Conn", "EngineBroken", "EnginePool", "EngineUnreachable", "Sink"]

log = logging.getLogger(__name__)

# An idle connection older than this is closed, not reused: uvicorn (vLLM,
# SGLang) closes its idle connections after 5 s, and a request written as the
# engine closes is lost on the wire.
IDLE_S = 4.0
_MAX_IDLE = 256  # idle connections kept per engine
_MAX_TARGETS = 4096  # base URLs parsed and kept (far more than a site's replicas)
# Connections being opened to one engine at once; the rest wait their turn,
# and the wait is not the connect timeout's. A burst (a thousand streams begun
# together) opened all at once piles onto the engine's listen backlog
# (aiohttp's 128, asyncio's 100: past it the kernel drops SYNs, retried 1 and
# 3 s later) and onto its one event loop's TLS handshakes: the burst ends
# about as soon, but its last connections take seconds each, past the connect
# timeout on a loaded machine, and a live engine is taken for a dead one.
# In turns of 64 (two gateways' together within a backlog of 128), the
# longest connect of such a burst is under a fifth of that (bench/engine_burst.py).
MAX_CONNECTING = 64


class EngineUnreachable(Exception):
    """No byte of an answer came back: the engine did not take the request, or
    died (or was silent past the read timeout, ``timed_out``) before answering."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class EngineBroken(Exception):
    """The answer began and broke off, or was not HTTP read strictly; ``cause``
    names what happened, for the client's error message."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class Sink(Protocol):
    """Where an answer goes as it is read; called from the connection's callbacks."""

    def head(self, conn: Conn, status: int, headers: dict[str, str]) -> None:
        """The answer's head (``headers``: names in lower case, the last of a name's values)."""

    def data(self, data: bytes) -> None: ...

    def end(self, error: EngineUnreachable | EngineBroken | None) -> None:
        """The answer is whole (None) or failed; the connection is no longer the sink's."""


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's whole answer."""

    status: int
    headers: CIMultiDict[str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    ssl: ssl.SSLContext | None
    netloc: str
    path: str  # the base URL's own path, before the endpoint's


# One read buffer for every connection: a transport fills it and hands it over
# in one synchronous step (buffer_updated), so no two reads overlap. As a
# plain protocol, asyncio's TLS layer decrypts each read into a fresh 256 KiB
# bytes object: on a stream, a read an event.
_READ_BUFFER = memoryview(bytearray(64 * 1024))


class _Strict(Exception):
    """What llhttp accepts and the gateway does not (raised inside a parser callback)."""


# A closed connection's parser: it calls nothing back.
_CLOSED = httptools.HttpResponseParser(object())


class Conn(asyncio.BufferedProtocol):
    """One connection to an engine; see the module's docstring."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float | None) -> None:
        self._loop = loop
        self._read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self.idle_since = time.monotonic()
        self._sink: Sink | None = None
        self._headers: dict[str, str] = {}
        self._status = 0
        self._head_bytes = self._unfinished = 0
        self._in_head = False
        self._complete = False
        self._to_close = False  # framed by the connection's end
        self._got_bytes = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._writable: asyncio.Future[None] | None = None
        self._body: list[bytes] = []  # the body's pieces of the read being parsed
        # llhttp calls the list's own append for each piece (a chunked stream:
        # a piece an event), not a method of ours: a Python frame less per
        # piece, 4 % of a stream's instructions. httptools takes its callbacks
        # once, when the parser is made, so this comes first, and the list is
        # only ever cleared, never replaced.
        self.on_body: Callable[[bytes], None] = self._body.append
        self._parser = httptools.HttpResponseParser(self)

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return _READ_BUFFER

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(_READ_BUFFER[:nbytes].tobytes())

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        if self._sink is None:
            self._fail(EngineBroken("bytes from the engine with no request", "Unasked"))
            return
        self._got_bytes = True
        try:
            try:
                self._parser.feed_data(data)
                if self._in_head:  # a head not whole yet: the reads since the one it began in
                    self._unfinished = 0 if self._unfinished < 0 else self._unfinished + len(data)
                    if self._unfinished > http1.MAX_HEAD:
                        raise _Strict("the engine's head is too long")
            except (httptools.HttpParserError, _Strict):
                if not self._complete:
                    raise
                self.reusable = False  # bytes past a whole answer: never reused
            self._deliver()
        except Exception as raised:  # llhttp's errors, ours (_Strict), a sink's bug: never out
            self._body.clear()
            e = http1.unwrap(raised)
            if not isinstance(e, (httptools.HttpParserError, _Strict)):
                log.error("reading an engine's answer failed", exc_info=e)
            if not self._complete:
                why = f"the engine's answer is not HTTP as read here: {e}"
                self._fail(EngineBroken(why, _cause(e)))
                return
            self.reusable = False
        if self._complete:
            self._finish()

    def _deliver(self) -> None:
        """The body's pieces of this read, to the sink as one."""
        body = self._body
        if not body or self._sink is None:
            body.clear()
            return
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._sink.data(data)

    def eof_received(self) -> bool | None:
        return False  # close; connection_lost settles the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        self._cancel_timer()
        # The parser calls this connection back: left so, every closed engine
        # connection (a client gone mid-answer closes one) would wait for
        # Python's cycle collector. Nothing is read from here on.
        self._parser = _CLOSED
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self._sink is None:
            return
        if self._to_close and not self._in_head:
            self._finish()
        elif self._got_bytes:
            self._fail(EngineBroken("the engine closed the connection mid-answer", "Closed"))
        else:
            self._fail(EngineUnreachable(f"the engine closed the connection ({exc!r})"))

    def pause_writing(self) -> None:
        self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # httptools' callbacks

    def on_message_begin(self) -> None:
        if self._sink is None or self._complete:
            raise _Strict("bytes past the answer")
        self._in_head = True
        self._head_bytes, self._unfinished = 0, -1
        self._headers = {}

    def on_status(self, status: bytes) -> None:
        self._head_bytes += len(status) + 15

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > http1.MAX_HEAD:
            raise _Strict("the engine's head is too long")
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        if key == "transfer-encoding" and key in self._headers:
            text = self._headers[key] + ", " + text  # all of its codings, to be checked
        self._headers[key] = text

    def on_headers_complete(self) -> None:
        self._in_head = False
        status = self._status = self._parser.get_status_code()
        if self._parser.get_http_version() not in ("1.1", "1.0"):
            raise _Strict(f"HTTP/{self._parser.get_http_version()} is not HTTP/1")
        te = self._headers.get("transfer-encoding")
        if te is not None and te.strip().lower() != "chunked":
            raise _Strict(f"a Transfer-Encoding the gateway does not read: {te!r}")
        if status < 200:
            return  # 100 Continue: the answer's own head follows
        if not self._parser.should_keep_alive():
            self.reusable = False
        if te is None and "content-length" not in self._headers and status not in (204, 304):
            self._to_close = True  # read to the connection's end
            self.reusable = False
        if self._sink is not None:
            self._sink.head(self, status, self._headers)

    def on_message_complete(self) -> None:
        if self._status >= 200:
            self._complete = True

    # requests

    def send(self, request: bytes, sink: Sink) -> None:
        """Write ``request``; its answer goes to ``sink``."""
        assert self.transport is not None and self._sink is None
        self._sink = sink
        self._got_bytes = self._complete = self._to_close = False
        self._status = 0
        self._last_read = self._loop.time()
        self.transport.write(request)
        if self._read_timeout and self._timer is None:
            # A timer left by an earlier answer is reused: it re-arms itself
            # from _last_read when it fires early (see _idle).
            self._timer = self._loop.call_at(self._last_read + self._read_timeout, self._idle)

    async def send_body(self, body: AsyncIterable[bytes]) -> None:
        """Write a chunked body as it comes (after :meth:`send` of its head),
        at the engine's pace; stops once the answer ended or the connection closed."""
        async for piece in body:
            if self._sink is None or self.transport is None or self.transport.is_closing():
                return
            if piece:
                self.transport.write(http1.chunk(piece))
            if self._writable is not None:
                await self._writable
        if self._sink is not None and self.transport is not None:
            self.transport.write(http1.LAST_CHUNK)

    def pause(self) -> None:
        """Stop reading (the client's buffer is full): the engine waits on TCP."""
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self._last_read = self._loop.time()
            self.transport.resume_reading()

    def abandon(self) -> None:
        """Nobody waits for the answer: closing the connection stops the engine's work."""
        self._sink = None
        self.reusable = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # ends: each is the last thing its caller does (the sink may send the
    # connection's next request)

    def _finish(self) -> None:
        sink = self._sink
        self._sink = None
        self.idle_since = time.monotonic()
        self.resume()  # a connection back in the pool reads (and sees a close)
        if sink is not None:
            sink.end(None)

    def _fail(self, error: EngineUnreachable | EngineBroken) -> None:
        sink = self._sink
        self.abandon()
        if sink is not None:
            sink.end(error)

    def _idle(self) -> None:
        self._timer = None
        if self._sink is None or self._read_timeout is None:
            return
        due = self._last_read + self._read_timeout
        if self._paused:
            # Waiting on the client is not the engine's silence.
            due = self._loop.time() + self._read_timeout
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._idle)
            return
        what = f"no data from the engine for {self._read_timeout:g} s"
        if self._got_bytes:
            self._fail(EngineBroken(what, "TimeoutError"))
        else:
            self._fail(EngineUnreachable(what, timed_out=True))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _cause(e: BaseException) -> str:
    """What was wrong, in a word for the client's error message."""
    text = str(e)
    if isinstance(e, httptools.HttpParserInvalidStatusError) or text.startswith(
        ("Expected HTTP/", "HTTP/", "Invalid status", "Invalid HTTP")
    ):
        return "BadStatusLine"
    return "BadChunk" if "chunk" in text.lower() else "BadHeaders"


@functools.cache
def _system_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # one for all: a pool is per context


def target_of(base_url: str, pinned: ssl.SSLContext | None) -> Target:
    """Where ``base_url`` is, with its TLS context (None: plain HTTP); an https
    URL without a pinned context is checked against the system's CAs."""
    u = urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    https = u.scheme == "https"
    ctx = (pinned or _system_context()) if https else None
    port = u.port or (443 if https else 80)
    return Target(u.hostname, port, ctx, u.netloc, u.path.rstrip("/"))


class EnginePool:
    """Kept-alive connections to each engine. No limit on connections open: the
    engines' own queues are where requests should wait, not a pool in front;
    only on those being opened at once (:data:`MAX_CONNECTING`)."""

    def __init__(
        self, connect_timeout: float | None, read_timeout: float | None,
        max_connecting: int = MAX_CONNECTING,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_connecting = max_connecting
        self._idle: dict[Target, deque[Conn]] = {}
        self._targets: dict[tuple[str, ssl.SSLContext | None], Target] = {}
        self._gates: dict[Target, _Gate] = {}

    def target(self, base_url: str, pinned: ssl.SSLContext | None) -> Target:
        got = self._targets.get((base_url, pinned))
        if got is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()  # replicas come and go: forget the gone ones
            got = self._targets[(base_url, pinned)] = target_of(base_url, pinned)
        return got

    def kept(self, target: Target) -> Conn | None:
        """An idle connection to ``target`` that may be reused, if there is one."""
        idle = self._idle.get(target)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable and not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.abandon()
        return None

    async def connect(self, target: Target) -> Conn:
        """A new connection to ``target``, opened in its turn (:data:`MAX_CONNECTING`)."""
        gate = self._gates.get(target)
        if gate is None:
            gate = self._gates[target] = _Gate(self.max_connecting)
        gate.users += 1
        try:
            return await gate.open(functools.partial(self._open, target))
        finally:
            gate.users -= 1
            if not gate.users:
                del self._gates[target]

    async def _open(self, target: Target) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Conn(loop, self.read_timeout), target.host, target.port,
                    ssl=target.ssl, server_hostname=target.host if target.ssl else None,
                )
        except (OSError, TimeoutError) as e:
            # ssl.SSLError (a pin that does not match) is an OSError: the same as
            # an engine that is not there, and nothing was sent.
            raise EngineUnreachable(f"cannot connect to {target.netloc}: {e!r}") from e
        return conn

    def give_back(self, conn: Conn, target: Target) -> None:
        idle = self._idle.setdefault(target, deque())
        if not conn.reusable or conn.closed or len(idle) >= _MAX_IDLE:
            conn.abandon()
        else:
            idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abandon()
        self._idle.clear()

    async def fetch(
        self, base_url: str, pinned: ssl.SSLContext | None, method: str, path: str,
        headers: dict[str, str], body: bytes = b"", sink: Sink | None = None,
    ) -> Answer:
        """One request, its whole answer (``sink``: also hears it as it comes);
        for the routes that are not the request path's (stored responses)."""
        target = self.target(base_url, pinned)
        request = http1.request_head(method, target.path + path, target.netloc,
                                     headers.items(), len(body)) + body
        conn = self.kept(target)
        for attempt in (conn, None):
            got = _Collect(self, target, sink)
            c = attempt or await self.connect(target)
            c.send(request, got)
            try:
                return await got.answer
            except EngineUnreachable as e:
                if attempt is None or e.timed_out:
                    raise
            except asyncio.CancelledError:
                c.abandon()
                raise
        raise AssertionError("unreachable")


class _Gate:
    """The connections being opened to one engine, and how the last attempt ended.

    A connection that waited its turn while one to the same engine failed,
    with none opened since, fails as it did without trying: an engine that
    is down is known as such after one connect timeout, not after one per
    turn of the queue."""

    def __init__(self, limit: int) -> None:
        self.turns = asyncio.Semaphore(limit)
        self.users = 0  # waiting or opening
        self.failures = 0
        self.failed: EngineUnreachable | None = None  # the last, unless one opened since

    async def open(self, attempt: Callable[[], Awaitable[Conn]]) -> Conn:
        joined = self.failures
        async with self.turns:
            if self.failed is not None and self.failures > joined:
                raise EngineUnreachable(f"{self.failed} (another connection, while "
                                        "this one waited its turn)")
            try:
                conn = await attempt()
            except EngineUnreachable as e:
                self.failures += 1
                self.failed = e
                raise
            self.failed = None
            return conn


class _Collect:
    """A sink that collects a whole answer for :meth:`EnginePool.fetch`."""

    def __init__(self, pool: EnginePool, target: Target, also: Sink | None) -> None:
        self.answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pool, self._target, self._also = pool, target, also
        self._conn: Conn | None = None
        self._head: tuple[int, dict[str, str]] = (0, {})
        self._parts: list[bytes] = []

    def head(self, conn: Conn, status: int, headers: dict[str, str]) -> None:
        self._conn, self._head = conn, (status, headers)
        if self._also is not None:
            self._also.head(conn, status, headers)

    def data(self, data: bytes) -> None:
        if self._also is not None:
            self._also.data(data)
        else:
            self._parts.append(data)

    def end(self, error: EngineUnreachable | EngineBroken | None) -> None:
        if self._also is not None:
            self._also.end(error)
        if self.answer.done():
            return
        if error is not None:
            self.answer.set_exception(error)
            return
        assert self._conn is not None
        self._pool.give_back(self._conn, self._target)
        status, headers = self._head
        self.answer.set_result(Answer(status, CIMultiDict(headers), b"".join(self._parts)))

