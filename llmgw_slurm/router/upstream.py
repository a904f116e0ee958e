"""Whole answers from the engines, over kept-alive HTTP/1.1 connections.

The gateway sends a request that will not stream (no ``"stream": true``, not
an upload) through here rather than through aiohttp's client: the answer is
read whole anyway, and aiohttp's client was most of what a proxied request
cost the gateway (a bare aiohttp proxy added as much as the whole gateway
did; with this pool and uvloop the gateway adds half what it did;
docs/performance.md). A stream the fast lane took comes through here too, its
body handed to a :class:`Sink` as it arrives; aiohttp's path streams on
aiohttp's client, whose connection the relay takes over.

HTTP/1.1 only as the engines speak it: one request at a time on a connection,
an answer framed by Content-Length, chunked, or the connection's end.
"""

from __future__ import annotations

import asyncio
import functools
import re
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

# Longest status line and headers accepted: an engine's are a few hundred bytes.
_MAX_HEAD = 64 * 1024
# An idle connection older than this is closed, not reused: uvicorn (vLLM,
# SGLang) closes its idle connections after 5 s, and a request written as the
# engine closes is lost on the wire.
IDLE_S = 4.0
# Idle connections kept per engine; more are closed when returned.
_MAX_IDLE = 256
# Base URLs parsed and kept (far more than a site's replicas at once).
_MAX_TARGETS = 4096
# A chunk-size line: hex digits, then optional extensions (ignored), as
# RFC 9112 7.1 has it; 64-bit sizes at most. int(x, 16) alone would take
# "-1", "0x5" and " 5".
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}(?=[;\t ]|\r\n)")
MAX_CHUNK_LINE = 4096


class UpstreamUnreachable(aiohttp.ClientConnectionError):
    """No byte of an answer came back: the engine did not take the request, or
    died (or went silent past the read timeout) before answering.

    ``timed_out``: the engine was silent past the read timeout (it may still be
    working on the request), rather than gone."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class UpstreamBroken(Exception):
    """The answer began and then broke off, or was not HTTP the pool can read.

    ``cause``: the name of what happened, for the client's error message."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's answer (``headers``: case-insensitive, as aiohttp's)."""

    status: int
    headers: CIMultiDict[str]
    body: bytes


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    ssl: ssl.SSLContext | None
    netloc: str


# What a connection gives whoever sent its request: the answer, or why there is none.
Done: TypeAlias = "Callable[[Answer | BaseException], None]"


class Sink(Protocol):
    """Where a streamed answer (200, ``text/event-stream``) goes as it
    arrives; its ``done`` gets an :class:`Answer` with an empty body at the
    end. All are called from the connection's callbacks: they must not raise."""

    def head(self, conn: Conn, headers: CIMultiDict[str]) -> None:
        """The answer streams (on ``conn``): its headers, before any of its body."""

    def data(self, data: bytes) -> None:
        """The next piece of the body, its framing undone."""

    def end(self, whole: bool) -> None:
        """The answer ended (``whole``, or it failed), just before ``done``
        hears of it: the connection is no longer the sink's to pause."""

    def keep_reading(self, conn: Conn) -> bool:
        """The caller stopped waiting (cancelled): True if the sink reads the
        answer on (it then owns ``conn``, and abandons it at the end); False,
        and the connection is cut."""


# One read buffer for every connection: a transport fills it and hands it
# over in one synchronous step (buffer_updated), so no two reads overlap. As a
# plain protocol, the TLS layer decrypts each read into a fresh 256 KiB bytes
# object (relay._Pipe, which reads the same way): on a stream, a read an event.
_READ_BUFFER = memoryview(bytearray(64 * 1024))


@functools.cache
def _system_context() -> ssl.SSLContext:
    # One for all: a connection pool is per context.
    return ssl.create_default_context()


def target_of(base_url: str, pinned: ssl.SSLContext | None) -> tuple[_Target, str]:
    """Where ``base_url`` is (with the TLS context for it, None: plain HTTP) and its path.

    An https URL without a pinned context is checked against the system's CAs."""
    u = urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    https = u.scheme == "https"
    ctx = (pinned or _system_context()) if https else None
    return _Target(u.hostname, u.port or (443 if https else 80), ctx, u.netloc), u.path.rstrip("/")


class Conn(asyncio.BufferedProtocol):
    """One connection: writes a request, parses its answer, and gives it (or
    the error) to the request's ``done`` callback.

    ``done`` is called from within the protocol's callbacks, once the
    connection is ready for its next request; so it must not raise, and the
    answer is handled in the same turn of the loop it came in. (A future
    awaited by a task, as :meth:`UpstreamPool.post`'s, takes one more turn;
    the fast lane's requests do without, :meth:`UpstreamPool.send_kept`.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float | None) -> None:
        self._loop = loop
        self._read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self.idle_since = time.monotonic()
        self._buf = bytearray()
        self._done: Done | None = None
        self._got_bytes = False
        self._head: tuple[int, CIMultiDict[str]] | None = None
        self._framing = ""  # "length", "chunked" or "close", once the head is in
        self._need = 0
        self._parts: list[bytes] = []
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # A streamed answer's body goes here, not into _parts (see Sink).
        self._sink: Sink | None = None
        self._paused = False

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not asyncio.Transport subclasses).
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return _READ_BUFFER

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(_READ_BUFFER[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        self._last_read = self._loop.time()
        if self._done is None:
            # Bytes nobody asked for (or after the answer): not HTTP as we know it.
            self.reusable = False
            self._close()
            return
        self._got_bytes = True
        self._buf += data
        try:
            self._parse()
        except UpstreamBroken as e:
            self._fail(e)

    def eof_received(self) -> bool | None:
        return False  # close; connection_lost settles the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        self._cancel_timer()
        if self._done is None:
            return
        if self._framing == "close":
            self._finish(bytes(self._buf))
        elif self._got_bytes:
            self._fail(UpstreamBroken("the engine closed the connection mid-answer", "Closed"))
        else:
            self._fail(UpstreamUnreachable(f"the engine closed the connection ({exc!r})"))

    # requests

    def send(self, request: bytes, done: Done, sink: Sink | None = None) -> None:
        """Write ``request``; ``done`` gets its answer (``sink``, the body of
        one that streams)."""
        assert self.transport is not None and self._done is None
        self._done = done
        self._sink = sink
        self._got_bytes = False
        self._last_read = self._loop.time()
        self.transport.write(request)
        if self._read_timeout and self._timer is None:
            # A timer left by an earlier answer is reused: it re-arms itself
            # from _last_read when it fires early (see _idle and _reset).
            self._timer = self._loop.call_at(self._last_read + self._read_timeout, self._idle)

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
        """The caller stopped waiting (cancelled): the engine may still be
        generating; closing the connection stops it."""
        self._done = None
        self.reusable = False
        self._close()

    # parsing

    def _parse(self) -> None:
        if self._head is None and not self._parse_head():
            return
        if self._sink is not None and self._framing != "chunked":
            self._pass_on()
        elif self._framing == "length":
            if len(self._buf) >= self._need:
                if len(self._buf) > self._need:
                    self.reusable = False  # bytes past the answer
                self._finish(bytes(self._buf[: self._need]))
        elif self._framing == "chunked":
            self._parse_chunks()

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                raise UpstreamBroken("the engine's headers are too long", "BadHeaders")
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise UpstreamBroken(f"not an HTTP/1 status line: {lines[0][:80]!r}", "BadStatusLine")
        status = int(parts[1])
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamBroken("a header line without a colon", "BadHeaders")
            headers[name.strip()] = value.strip()
        if 100 <= status < 200:
            return self._parse_head() if self._buf else False  # 100 Continue: the real head follows
        if headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0":
            self.reusable = False
        self._head = (status, headers)
        self._set_framing(status, headers)
        sink = self._sink
        if sink is not None:
            if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
                sink.head(self, headers)
            else:
                self._sink = None  # an error, or an answer that does not stream: read whole
        return True

    def _set_framing(self, status: int, headers: CIMultiDict[str]) -> None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = "chunked"
        elif "content-length" in headers:
            try:
                self._need = int(headers["content-length"])
            except ValueError:
                raise UpstreamBroken(
                    "a Content-Length that is not a number", "BadHeaders"
                ) from None
            self._framing = "length"
        elif status in (204, 304):
            self._framing, self._need = "length", 0
        else:
            self._framing = "close"
            self.reusable = False

    def _pass_on(self) -> None:
        """A streamed body not chunked: to the sink as it comes (to its
        Content-Length, or to the connection's end)."""
        sink = self._sink
        assert sink is not None
        if self._framing == "length":
            take = min(len(self._buf), self._need)
            if take:
                sink.data(bytes(self._buf[:take]))
                del self._buf[:take]
                self._need -= take
            if self._need == 0 and self._done is not None:
                if self._buf:
                    self.reusable = False  # bytes past the answer
                self._finish(b"")
        elif self._buf:
            sink.data(bytes(self._buf))
            self._buf.clear()

    def _parse_chunks(self) -> None:
        while True:
            line_end = self._buf.find(b"\r\n")
            if line_end < 0:
                if len(self._buf) > MAX_CHUNK_LINE:
                    raise UpstreamBroken("a chunk-size line without an end", "BadChunk")
                return
            got = CHUNK_SIZE.match(self._buf, 0, line_end + 2)
            if got is None:
                raise UpstreamBroken("a chunk size that is not hexadecimal", "BadChunk")
            size = int(got.group(), 16)
            if size == 0:
                # The last chunk, then trailers (ignored) up to an empty line.
                rest = self._buf[line_end + 2 :]
                if rest.startswith(b"\r\n"):
                    del self._buf[: line_end + 4]
                else:
                    trailer_end = rest.find(b"\r\n\r\n")
                    if trailer_end < 0:
                        return
                    del self._buf[: line_end + 2 + trailer_end + 4]
                if self._buf:
                    self.reusable = False  # bytes past the answer
                self._finish(b"".join(self._parts))
                return
            start = line_end + 2
            if len(self._buf) < start + size + 2:
                return
            if self._buf[start + size : start + size + 2] != b"\r\n":
                raise UpstreamBroken("a chunk not ended by CRLF", "BadChunk")
            piece = bytes(self._buf[start : start + size])
            del self._buf[: start + size + 2]
            if self._sink is None:
                self._parts.append(piece)
                continue
            self._sink.data(piece)
            if self._done is None:
                return  # the sink stopped the answer (abandon)

    # ends

    # Each is the last thing its caller does: ``done`` may send the
    # connection's next request.

    def _finish(self, body: bytes) -> None:
        done, head, sink = self._done, self._head, self._sink
        assert done is not None and head is not None
        self._reset()
        if sink is not None:
            sink.end(True)
        done(Answer(head[0], head[1], body))

    def _fail(self, exc: BaseException) -> None:
        done, sink = self._done, self._sink
        self._reset()
        self.reusable = False
        self._close()
        if sink is not None:
            sink.end(False)
        if done is not None:
            done(exc)

    def _reset(self) -> None:
        # The read timer is left to run: one that fires with no answer awaited
        # stops, and the next request reuses one still set. Cancelling it and
        # setting a new one each request costs more on a cold CPU than the
        # request's parse of the answer.
        self._done = None
        self._sink = None
        if self._paused:
            self.resume()  # a connection back in the pool reads (and sees a close)
        self._head = None
        self._framing = ""
        self._need = 0
        self._parts = []
        self._buf.clear()
        self.idle_since = time.monotonic()

    def _idle(self) -> None:
        self._timer = None
        if self._done is None or self._read_timeout is None:
            return
        due = self._last_read + self._read_timeout
        if self._paused:
            # Waiting on the client is not the engine's silence (resume
            # restarts the clock).
            due = self._loop.time() + self._read_timeout
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._idle)
            return
        what = f"no data from the engine for {self._read_timeout:g} s"
        if self._got_bytes:
            self._fail(UpstreamBroken(what, "TimeoutError"))
        else:
            self._fail(UpstreamUnreachable(what, timed_out=True))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class UpstreamPool:
    """Kept-alive connections to each engine, for requests whose answer is read whole.

    No limit on connections: the engines' own queues are where requests
    should wait, not a pool in front of them (as the aiohttp client's).
    """

    def __init__(self, connect_timeout: float | None, read_timeout: float | None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: dict[_Target, deque[Conn]] = {}
        # Parsed base URLs: a replica's lives as long as the replica run.
        self._targets: dict[tuple[str, ssl.SSLContext | None], tuple[_Target, str]] = {}

    async def post(
        self, base_url: str, pinned: ssl.SSLContext | None, path: str,
        headers: dict[str, str], body: bytes, sink: Sink | None = None,
    ) -> Answer:  # fmt: skip
        """POST ``body`` to ``base_url`` + ``path`` (which starts with a slash); the whole
        answer (``sink``: the body of one that streams, see :class:`Sink`).

        Raises :class:`UpstreamUnreachable` when no byte of an answer came back
        (the request may be sent elsewhere), :class:`UpstreamBroken` when the
        answer broke off."""
        target, base_path = self._target(base_url, pinned)
        request = _request_bytes(target, base_path + path, headers, body)
        conn = self._take_idle(target)
        if conn is not None:
            try:
                return await self._exchange(conn, target, request, sink)
            except UpstreamUnreachable as e:
                if e.timed_out:
                    raise
                # A kept-alive connection the engine closed as it was reused:
                # the request was not taken; once more on a new connection.
        return await self._exchange(await self._connect(target), target, request, sink)

    def _target(self, base_url: str, pinned: ssl.SSLContext | None) -> tuple[_Target, str]:
        got = self._targets.get((base_url, pinned))
        if got is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()  # replicas come and go: forget the gone ones
            got = self._targets[(base_url, pinned)] = target_of(base_url, pinned)
        return got

    async def _exchange(
        self, conn: Conn, target: _Target, request: bytes, sink: Sink | None
    ) -> Answer:
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        conn.send(request, functools.partial(_settle, waiter), sink)
        try:
            answer = await waiter
        except asyncio.CancelledError:
            if sink is None or not sink.keep_reading(conn):
                conn.abandon()
            raise
        self._give_back(conn, target)
        return answer

    def send_kept(
        self, base_url: str, pinned: ssl.SSLContext | None, path: str,
        headers: dict[str, str], body: bytes, done: Done,
    ) -> Conn | None:  # fmt: skip
        """POST on a kept-alive connection, if there is one, whose answer goes
        to ``done`` (see :class:`Conn`); the connection (``abandon`` it to stop
        waiting), or None: none idle, nothing sent (:meth:`post` connects).

        Unlike :meth:`post`, an engine that closed the connection as it was
        reused is not tried again here: ``done`` gets that
        :class:`UpstreamUnreachable`, and the caller tries again."""
        target, base_path = self._target(base_url, pinned)
        request = _request_bytes(target, base_path + path, headers, body)
        conn = self._take_idle(target)
        if conn is None:
            return None

        def give_back(result: Answer | BaseException) -> None:
            if isinstance(result, Answer):
                self._give_back(conn, target)
            done(result)

        conn.send(request, give_back)
        return conn

    async def _connect(self, target: _Target) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Conn(loop, self.read_timeout),
                    target.host,
                    target.port,
                    ssl=target.ssl,
                    server_hostname=target.host if target.ssl is not None else None,
                )
        except (OSError, TimeoutError) as e:
            # ssl.SSLError (a pin that does not match) is an OSError: the same as
            # an engine that is not there, and nothing was sent.
            raise UpstreamUnreachable(f"cannot connect to {target.netloc}: {e!r}") from e
        return conn

    def _take_idle(self, target: _Target) -> Conn | None:
        idle = self._idle.get(target)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable and not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.abandon()
        return None

    def _give_back(self, conn: Conn, target: _Target) -> None:
        if not conn.reusable or conn.closed:
            conn.abandon()
            return
        idle = self._idle.setdefault(target, deque())
        if len(idle) >= _MAX_IDLE:
            conn.abandon()
            return
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abandon()
        self._idle.clear()


def _settle(waiter: asyncio.Future[Answer], result: Answer | BaseException) -> None:
    if waiter.done():
        return  # cancelled: the connection was abandoned, and is closing
    if isinstance(result, Answer):
        waiter.set_result(result)
    else:
        waiter.set_exception(result)


def _request_bytes(target: _Target, path: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {target.netloc}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            # Header values come from the client (X-Request-Id): never split a line.
            raise ValueError(f"a header with a line break: {name!r}")
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body
