"""The gateway's HTTP/1.1 server: one protocol per connection, on httptools (llhttp).

As uvicorn's: the parser's callbacks fill one :class:`Request` at a time;
pipelined requests queue in order and are answered in order (reading pauses
while one waits behind the request being answered); flow control is one
small class (:class:`FlowControl`); a request the parser refuses is answered
400 once the answers before it are out, and the connection closes. Nothing
raises out of a protocol callback. The checks llhttp leaves to its user are
made here: HTTP/1.1 needs exactly one Host (RFC 9112 3.2), a head is at most
:data:`http1.MAX_HEAD`, an upgrade is refused.

Every OpenAI request (``POST`` to a path of :data:`ROUTES`) goes to
:meth:`Gateway.serve`; any other request (the status page, the CLI's API,
files and batches, ``/v1/models``, ``/metrics``) goes to aiohttp's
application, one request at a time on the same connection (``appbridge``).

Timers: a connection idle, or inside a request's head, past the keep-alive
timeout is closed (a client stalled in its headers holds nothing); a body
that stops coming gets a 408 after ``body_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Any, cast

import httptools
from aiohttp import web

from llmgw_slurm.guard.accept import Guard, guard_of
from llmgw_slurm.router import http1, surface
from llmgw_slurm.router.answers import error
from llmgw_slurm.router.appbridge import AppBridge
from llmgw_slurm.router.gateway import GATEWAY_KEY, Gateway, Handling

__all__ = ["ROUTES", "Runner"]

log = logging.getLogger(__name__)

# POST paths served by the request path: path -> (endpoint, whether its body streams).
ROUTES: dict[str, tuple[str, bool]] = {
    "/v1/chat/completions": ("chat/completions", False),
    "/v1/completions": ("completions", False),
    "/v1/embeddings": ("embeddings", False),
    **{p: (r.name, r.multipart) for r in surface.ROUTES for p in r.paths},
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BUFFERED = 256 * 1024  # a streamed body's bytes buffered before reading pauses
_LINGER = 64 * 1024  # the most of a refused body read to keep its connection


class FlowControl:
    """Reading paused for any of several reasons, resumed once none is left."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._why: set[str] = set()

    def pause(self, why: str) -> None:
        if not self._why:
            self._transport.pause_reading()
        self._why.add(why)

    def resume(self, why: str) -> None:
        if why in self._why:
            self._why.discard(why)
            if not self._why and not self._transport.is_closing():
                self._transport.resume_reading()


class BodyStream:
    """A request body read as it arrives (uploads), at the reader's pace."""

    def __init__(self, flow: FlowControl) -> None:
        self._flow = flow
        self._parts: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._failed: surface.UploadProblem | None = None
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size > _BUFFERED:
            self._flow.pause("body")
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, why: str) -> None:
        self._failed = surface.UploadProblem(400, f"The request's body is malformed: {why}.",
                                             "bad_request")
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def readany(self) -> bytes:
        while not self._parts and not self._eof:
            if self._failed is not None:
                raise self._failed
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if not self._parts:
            return b""
        data = self._parts.popleft()
        self._size -= len(data)
        if self._size <= _BUFFERED:
            self._flow.resume("body")
        return data


class Request:
    """One request on a connection, and the client's side of its answer (``forward.Client``)."""

    def __init__(self, conn: Connection, url: bytes) -> None:
        self.conn, self.url = conn, url
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.raw_headers_done = False  # the head is whole
        self.headers: dict[str, str] = {}  # by lowercase name, each name's first value
        self.hosts = 0
        self.method = ""
        self.path = ""
        self.http11 = True
        self.keep_alive = True
        self.endpoint: str | None = None  # an OpenAI route's; None: aiohttp's
        self.body = bytearray()
        self.stream: BodyStream | None = None
        self.too_large = False
        self.complete = False  # the whole message was read
        self.received = 0  # the body's bytes so far
        self.discarding = False  # answered: the rest of its body is read and dropped
        self.started = False
        self.answered = False  # bytes of the answer went out
        self.handler: Handling | None = None

    # forward.Client

    def gone(self) -> bool:
        return self.conn.gone

    def lingers(self) -> bool:
        """Whether the rest of an answered request's body is read and dropped
        (a little of it), rather than the connection closed: a close with
        unread bytes makes the client's kernel see a reset, often before the
        answer (an upload refused after its model field)."""
        length = self.headers.get("content-length")
        return self.complete or (length is not None and int(length) - self.received <= _LINGER)

    def whole(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        keep = self.keep_alive = self.keep_alive and self.lingers()
        self.conn.write(http1.response_head(status, headers.items(), len(body), keep,
                                            self.http11) + body, keep)
        self.answered = True

    def begin(self, status: int, headers: Mapping[str, str]) -> None:
        # An HTTP/1.0 client gets the stream unframed, ended by the close.
        keep = self.keep_alive and self.complete and self.http11
        self.conn.write(http1.response_head(status, headers.items(), None, keep, self.http11), True)
        self.keep_alive = keep
        self.answered = True

    def send(self, data: bytes) -> bool:
        if self.conn.gone:
            return False
        self.conn.write(http1.chunk(data) if self.http11 else data, True)
        return True

    def end(self) -> None:
        self.conn.write(http1.LAST_CHUNK if self.http11 else b"", self.keep_alive)

    def cut(self) -> None:
        self.conn.close()

    def finished(self) -> None:
        self.conn.finished(self)

    def crashed(self) -> None:
        log.error("serving %s failed; the connection closes", self.path)
        if not self.answered:
            self.whole(500, {"Content-Type": "text/plain; charset=utf-8"},
                       b"500 Internal Server Error")
        self.conn.close()


# A closed connection's parser: it calls nothing back (data_received reads
# nothing once the connection is closing, so it is never fed).
_CLOSED = httptools.HttpRequestParser(object())


class Connection(asyncio.Protocol):
    """One client connection: see the module's docstring."""

    def __init__(self, runner: Runner) -> None:
        self.runner, self.gw = runner, runner.gateway
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.flow: FlowControl | None = None
        self.gone = False
        self._queue: deque[Request] = deque()
        self._req: Request | None = None  # the one being parsed
        self._unfinished = 0  # bytes read of a head not whole yet
        self._read_size = 0  # of the read being parsed
        self._feeding = False
        self._deferred: Request | None = None  # waits for a body the read may hold
        self._advancing = False
        self._closing = False  # no request after the one answered last
        # The keep-alive timer runs from the connection's start to its end, and
        # checks when it fires (cancelling and arming one a request costs more
        # than the request's own checks); a body's timer is armed only while
        # a request waits for its body.
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_for: Request | None = None
        self._bad: str | None = None  # why the connection's reading stopped
        self.bridge: AppBridge | None = None
        # The listener's guard (guard.Acceptor), which times the first request
        # head itself; a later one is timed from when the connection is idle
        # again, so a kept-alive connection cannot trickle a head forever.
        self._guard: Guard | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.flow = FlowControl(self.transport)
        self._guard = guard_of(transport)
        self.runner.connections.add(self)
        self._idle_since = self._loop.time()
        self._idle_check()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._read_size, self._feeding = len(data), True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgraded()
        except Exception as raised:  # llhttp's errors, and ours from the callbacks: never out
            e = http1.unwrap(raised)
            if not isinstance(e, (httptools.HttpParserError, ValueError)):
                log.error("reading a request failed", exc_info=e)
            self._refuse(f"not HTTP/1.1 as read here: {e}")
        self._feeding = False
        if self._deferred is not None:
            self._wait_deferred()
        if self._req is not None and not self._req.raw_headers_done:
            # A head not whole yet: the reads since the one it began in, all its
            # (the whole head is measured once it is in: _read_head).
            self._unfinished = 0 if self._unfinished < 0 else self._unfinished + len(data)
            if self._unfinished > http1.MAX_HEAD:
                self._refuse(f"the request's head is longer than {http1.MAX_HEAD} bytes")

    def eof_received(self) -> bool:
        return False  # close: connection_lost stops what is under way

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = self._closing = True
        self.runner.connections.discard(self)
        for timer in (self._idle_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        # The parser calls this connection back and the timers held it: left
        # so, every closed connection would wait for Python's cycle collector
        # (a client that connects a request would run it every 60 requests).
        self._parser, self._idle_timer, self._body_timer = _CLOSED, None, None
        queue, self._queue = self._queue, deque()
        for req in queue:
            handler, req.handler = req.handler, None  # the cycle finished() breaks (below)
            if handler is not None:
                handler.client_gone()
        if self.bridge is not None:
            self.bridge.lost()
        self.runner.settle(self)

    def pause_writing(self) -> None:
        if self._queue and self._queue[0].handler is not None:
            self._queue[0].handler.client_paused()
        elif self.bridge is not None:
            self.bridge.pause_writing()

    def resume_writing(self) -> None:
        if self._queue and self._queue[0].handler is not None:
            self._queue[0].handler.client_resumed()
        elif self.bridge is not None:
            self.bridge.resume_writing()

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._unfinished = -1  # begun in this read
        self._req = Request(self, b"")

    def on_url(self, url: bytes) -> None:
        assert self._req is not None
        self._req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._req
        assert req is not None
        # llhttp leaves a value's trailing spaces on; they are not part of it
        # (RFC 9110 5.5). Of a name given twice, the first value is taken.
        # Made here, header by header, not in a pass over them all at the
        # head's end: each pass is a loop of its own on the path of every request.
        value = value.rstrip(b" \t")
        req.raw_headers.append((name, value))
        key = name.lower().decode("latin-1")
        if key not in req.headers:
            req.headers[key] = value.decode("latin-1")
        if key == "host":
            req.hosts += 1

    def on_headers_complete(self) -> None:
        req = self._req
        assert req is not None
        req.raw_headers_done = True
        if self._guard is not None:
            self._guard.head_complete()
        self._read_head(req)
        self._queue.append(req)
        if len(self._queue) > 1:
            assert self.flow is not None
            self.flow.pause("pipelined")  # read on once the answer ahead is out
        self._advance()

    def on_body(self, body: bytes) -> None:
        req = self._req
        assert req is not None
        req.received += len(body)
        if req.discarding:
            return
        if req.stream is not None:
            req.stream.feed(body)
        elif req.endpoint is None:
            # aiohttp's: buffered until it begins (a read at most: reading
            # pauses while a request waits behind another).
            if req.started and self.bridge is not None:
                self.bridge.feed(body)
            else:
                req.body += body
        elif not req.too_large:
            req.body += body
            if len(req.body) > self.gw.config.max_body_bytes:
                req.too_large = True
                req.body = bytearray()

    def on_message_complete(self) -> None:
        req = self._req
        assert req is not None
        self._req = None
        req.complete = True
        if req.discarding:
            self.finished(req)
            return
        if req.stream is not None:
            req.stream.feed_eof()
        elif req.endpoint is None and req.started and self.bridge is not None:
            self.bridge.feed_eof()
        self._advance()

    # requests

    def _read_head(self, req: Request) -> None:
        parser = self._parser
        req.method = parser.get_method().decode("ascii")
        req.http11 = parser.get_http_version() == "1.1"
        req.keep_alive = parser.should_keep_alive()
        # Raised in a parser callback, these stop the reading there (see _refuse).
        if self._may_be_long() and _head_size(req) > http1.MAX_HEAD:
            raise ValueError(f"the request's head is longer than {http1.MAX_HEAD} bytes")
        if req.http11 and req.hosts != 1:
            raise ValueError("an HTTP/1.1 request needs exactly one Host header")
        req.path = req.url.partition(b"?")[0].partition(b"#")[0].decode("latin-1")
        route = ROUTES.get(req.path) if req.method == "POST" else None
        if route is not None:
            req.endpoint, streams = route
            length = req.headers.get("content-length")
            if streams:
                assert self.flow is not None
                req.stream = BodyStream(self.flow)
            elif length is not None and int(length) > self.gw.config.max_body_bytes:
                req.too_large = True

    def _may_be_long(self) -> bool:
        """Whether the head just read may be over :data:`http1.MAX_HEAD`: not
        when it began in this read and the read is shorter (most heads), which
        spares measuring it header by header."""
        return self._unfinished >= 0 or self._read_size > http1.MAX_HEAD

    def _advance(self) -> None:
        """Start the request at the head of the queue, and the next while each
        is answered at once (a loop: thousands pipelined are no recursion)."""
        if self._advancing:
            return
        self._advancing = True
        try:
            while self._queue:
                req = self._queue[0]
                if not req.started:
                    self._start(req)
                if self._queue and self._queue[0] is req:
                    return
            if self._bad is not None:
                self._answer_bad(self._bad)
        finally:
            self._advancing = False

    def _start(self, req: Request) -> None:
        if req.endpoint is None:
            req.started = True
            if self.bridge is None:
                assert self.transport is not None and self.flow is not None
                self.bridge = AppBridge(self.transport, self.flow, self.runner.app_server)
            self.bridge.begin(req)
            return
        if not req.complete and req.stream is None and not req.too_large:
            self._wait_for_body(req)
            return
        req.started = True
        if self._body_for is not None:
            self._body_wait(None)
        try:
            req.handler = self.gw.serve(req)
        except Exception:
            log.exception("serving %s failed", req.path)
            req.crashed()

    def _wait_for_body(self, req: Request) -> None:
        if self._feeding:
            # The body often came in the read with the head: the timer (and a
            # 100 Continue) only if it did not, once the read is parsed.
            self._deferred = req
            return
        if self._body_for is not req:
            if req.headers.get("expect", "").lower() == "100-continue":
                self.write(_CONTINUE, True)
            self._body_wait(req)

    def _wait_deferred(self) -> None:
        req, self._deferred = self._deferred, None
        if req is not None and not req.started and self._queue and self._queue[0] is req:
            self._wait_for_body(req)

    def finished(self, req: Request) -> None:
        """``req``'s answer is out: on to the next request."""
        if not self._queue or self._queue[0] is not req:
            return
        if not req.complete and req.keep_alive and req.lingers():
            req.discarding = True
            if req.stream is not None:
                req.stream.feed_eof()
            assert self.flow is not None
            self.flow.resume("body")
            self._body_wait(req)
            return
        self._queue.popleft()
        # A request and its handler refer to each other (the exchange's client):
        # left so, every request would wait for Python's cycle collector, whose
        # runs, one every hundred requests, cost more than a tenth of the CPU.
        req.handler = None
        if not req.complete or not req.keep_alive:
            # Its body was not read to its end (refused first, or too large):
            # what follows on the connection cannot be told from it.
            self.close()
            return
        assert self.flow is not None
        if len(self._queue) <= 1:
            self.flow.resume("pipelined")
        if not self._queue:
            self._idle_since = self._loop.time()
            if self._guard is not None:
                self._guard.head_started()
        self._advance()
        if not self._queue:
            self.runner.settle(self)

    def _refuse(self, why: str) -> None:
        """The parser (or a check) refused what was read: a 400 once the answers
        ahead are out, then the close. A request it was in the middle of is
        that 400, or if it began (a body streamed on), it is cut."""
        assert self.flow is not None
        self.flow.pause("refused")
        self._closing, self._bad = True, why
        req, self._req = self._req, None
        if req is not None and req in self._queue:
            if not req.started:
                self._queue.remove(req)
            elif req.stream is not None:
                req.stream.fail(why)
            else:
                self.close()  # aiohttp's, with its body cut short
        self._advance()

    def _upgraded(self) -> None:
        """llhttp stops at a request that asks to upgrade (h2c, websocket): it is
        served as if it had not asked (RFC 9110 7.8 lets a server ignore
        Upgrade), then the connection closes; one with a body is refused, as
        llhttp does not read it."""
        req = self._queue[-1] if self._queue else None
        assert self.flow is not None
        self.flow.pause("refused")
        self._closing = True
        if req is None:
            return
        if int(req.headers.get("content-length", "0")) or "transfer-encoding" in req.headers:
            if req.started:
                self.close()
                return
            self._queue.remove(req)
            self._bad = "an upgrade (h2c, websocket) is not served here: send plain HTTP/1.1"
            self._advance()
        else:
            req.keep_alive = False

    def _answer_bad(self, why: str) -> None:
        log.info("a request refused: %s", why)
        body = error(400, f"Bad request: {why}.", "invalid_request_error", "bad_request")
        self.write(http1.response_head(400, body.headers.items(), len(body.body), False)
                   + body.body, False)

    # writing, closing, timers

    def write(self, data: bytes, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if data:
            transport.write(data)
        if not keep_alive:
            self.close()

    def close(self) -> None:
        self._closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def _idle_check(self) -> None:
        """Idle, or inside a head, since the last answer: past the keep-alive, closed."""
        keepalive = self.runner.keepalive_timeout
        left = keepalive if self._queue else self._idle_since + keepalive - self._loop.time()
        if left > 0:
            self._idle_timer = self._loop.call_later(left, self._idle_check)
        else:
            self.close()

    def _body_wait(self, req: Request | None) -> None:
        """Wait for ``req``'s body (None: no request waits any more)."""
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_for, self._body_timer = req, None
        if req is not None:
            timeout = self.gw.config.body_timeout
            self._body_timer = self._loop.call_later(timeout, self._body_late, req)

    def _body_late(self, req: Request) -> None:
        self._body_for = self._body_timer = None
        if req.discarding:
            self.close()
        elif self._queue and self._queue[0] is req and not req.started:
            # A body that stopped coming: the gateway's own 408.
            body = error(408, f"The request body did not arrive within "
                         f"{self.gw.config.body_timeout:g} s.", "invalid_request_error",
                         "request_timeout")
            self.write(http1.response_head(408, body.headers.items(), len(body.body), False)
                       + body.body, False)


def _head_size(req: Request) -> int:
    """A head's size as read: its target, and each header as a line of its own."""
    return sum(len(n) + len(v) + 4 for n, v in req.raw_headers) + len(req.url)


class Runner:
    """The gateway app served: its connections to :class:`Connection`, aiohttp's
    application behind them for the routes that are not the request path's.

    ``**kwargs`` are aiohttp's ``AppRunner``'s (``handler_cancellation``,
    ``access_log``, ``keepalive_timeout``, ``shutdown_timeout``)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        self.gateway: Gateway = app[GATEWAY_KEY]
        self.keepalive_timeout: float = kwargs.get("keepalive_timeout", 75.0)
        self.shutdown_timeout: float = kwargs.get("shutdown_timeout", 60.0)
        self.app_runner = web.AppRunner(app, **kwargs)
        self.connections: set[Connection] = set()
        self._servers: list[asyncio.Server] = []
        self._quiet: asyncio.Future[None] | None = None

    async def setup(self) -> None:
        await self.app_runner.setup()

    def protocol(self) -> Connection:
        """A new connection's protocol (for a listener of the daemon's own, guard.Acceptor)."""
        return Connection(self)

    def app_server(self) -> asyncio.Protocol:
        """A new aiohttp protocol for the application's requests."""
        server = self.app_runner.server
        assert server is not None, "the runner was not set up"
        return server()

    async def start(self, host: str | None = None, port: int = 0,
                    ssl_context: ssl.SSLContext | None = None,
                    sock: socket.socket | None = None) -> None:
        """Listen on ``host``:``port`` (or a socket already bound, ``sock``)."""
        loop = asyncio.get_running_loop()
        if sock is not None:
            srv = await loop.create_server(lambda: Connection(self), sock=sock, ssl=ssl_context)
        else:
            srv = await loop.create_server(lambda: Connection(self), host, port, ssl=ssl_context,
                                           reuse_address=True)
        self._servers.append(srv)

    @property
    def addresses(self) -> list[Any]:
        return [s.getsockname() for srv in self._servers for s in srv.sockets]

    def settle(self, conn: Connection) -> None:
        quiet = self._quiet
        if quiet is not None and not quiet.done() and not any(c.busy for c in self.connections):
            quiet.set_result(None)

    async def cleanup(self) -> None:
        """Stop listening; answers under way may finish within the shutdown timeout."""
        for srv in self._servers:
            srv.close()
        self._servers.clear()
        if any(c.busy for c in self.connections):
            self._quiet = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.shutdown_timeout):
                    await self._quiet
        for conn in list(self.connections):
            conn.close()
        await self.app_runner.cleanup()
