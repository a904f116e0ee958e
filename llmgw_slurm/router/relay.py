"""The stream relay: an engine's streamed answer passed on to the client as it arrives.

``_SseRelay`` splits the SSE stream into events, reads the token usage and
drops the usage-only chunk the client did not ask for; ``_Pipe`` moves the
bytes from the engine's connection to the client's in protocol callbacks, on
aiohttp's path; :class:`LaneSink` does the same for a stream the fast lane
took, from :class:`upstream.Conn`'s callbacks.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from multidict import CIMultiDict

from llmgw_slurm.router.quota import Reservation
from llmgw_slurm.router.upstream import CHUNK_SIZE as _CHUNK_SIZE
from llmgw_slurm.router.upstream import MAX_CHUNK_LINE as _MAX_CHUNK_LINE
from llmgw_slurm.router.upstream import Conn


@dataclass(slots=True)
class _Call:
    t0: float
    model: str | None = None
    status: int = 500
    # Set when the status sent is not what the client saw in the end (a
    # stream cut short: 502; a client gone: 499).
    outcome: int | None = None
    first_byte: float | None = None
    # The engine's answer is still being read after the client went away: the
    # pipe owns the engine's connection, not the handler.
    handed_off: bool = False
    # The x-ratelimit-* headers of a fast lane's request, as the limits stood
    # when it was let in (aiohttp's requests keep theirs in the request).
    quota: Mapping[str, str] | None = None
    # The tokens the quotas hold for it: settled with its usage, else released
    # when the request ends (by whoever reads its answer to the end: the
    # handler, or the drain once handed_off).
    hold: Reservation | None = None

    def release(self) -> None:
        """The request ended: what it held and did not settle is free again."""
        if self.hold is not None:
            self.hold.release()


_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')
# A "usage" key with something other than null: every event that can carry
# token counts has one (possessive, so that the spaces before "null" are not
# given back to let the lookahead pass).
_USAGE_SET = re.compile(rb'"usage"\s*+:\s*+(?!null)')


class _SseRelay:
    """Splits an SSE byte stream into events, reads usage, drops unasked usage chunks.

    Events go out as soon as they are complete; the only bytes held back are
    an event's incomplete tail, which the client could not use anyway.
    """

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if (
            not self._buf
            and chunk.endswith((b"\n\n", b"\r\n\r\n"))
            and _USAGE_SET.search(chunk) is None
        ):
            # The common case, a chunk of whole events with no usage in it
            # (or only "usage": null), passes as it is: splitting it into
            # events would cost more than the relay itself.
            return chunk
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        # Events are kept in runs: only one with a usage object in it is
        # looked at, and a dropped one ends a run (a burst of many events, the
        # whole answer in one read, has one usage event among dozens).
        run = 0
        m = _USAGE_SET.search(buf)
        u = m.start() if m else -1
        # The next separator of each kind, -1 for none: each is searched for
        # again only once passed, so that a chunk of many events is scanned
        # once, not once per event.
        i = buf.find(b"\n\n")
        j = buf.find(b"\r\n\r\n")
        while i >= 0 or j >= 0:
            end = i + 2 if j < 0 or (0 <= i < j) else j + 4
            if 0 <= u < end:
                if not self._keep(buf[start:end]):
                    out.append(buf[run:start])
                    run = end
                m = _USAGE_SET.search(buf, end)
                u = m.start() if m else -1
            start = end
            if 0 <= i < start:
                i = buf.find(b"\n\n", start)
            if 0 <= j < start:
                j = buf.find(b"\r\n\r\n", start)
        self._buf = buf[start:]
        if not out:
            return buf[:start] if start < len(buf) else buf
        out.append(buf[run:start])
        return b"".join(out)

    def rest(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        # Parsing every chunk's JSON would cost more than relaying it; only
        # events that carry a usage object are read.
        if b'"usage"' not in event or _USAGE_NULL.search(event):
            return True
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                return True
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if self.strip and obj.get("choices") == []:
                    return False
        return True


# Where every pipe's transport reads into (see _Pipe.get_buffer). One for all:
# a transport fills it and hands it over in one synchronous step, so no two
# reads overlap.
_READ_BUFFER = memoryview(bytearray(64 * 1024))


class _Pipe(asyncio.BufferedProtocol):
    """Moves one streamed answer from the engine's connection to the client's, in callbacks.

    For the length of the answer it stands in for aiohttp's protocol on the
    engine's connection, and each read is written on to the client's
    transport at once (through the SSE relay). The handler only waits for the
    end, or for the client to drain. Relaying with ``iter_any()`` and
    ``StreamResponse.write()`` cost two coroutine wake-ups and aiohttp's
    writer for every event (docs/performance.md, "Gateway").

    Two ways to read. Through aiohttp: each read goes to aiohttp's protocol
    first (its parser undoes the chunked framing), then what the parser gave
    is taken from the response's reader. Raw: once a read ended right after a
    whole chunk (see _at_chunk_end), the pipe undoes the framing itself and
    hands aiohttp only the last chunk, so that its parser ends the message
    and puts the connection back in the pool. Raw saves aiohttp's reader and
    parser, a few microseconds a read; a body that is not chunked is read
    through aiohttp to the end.

    A buffered protocol, so that the transport reads into one reused buffer.
    As a plain protocol, asyncio's TLS layer decrypts every record into a
    fresh 256 KiB bytes object, twice a read (the second read finds nothing
    and raises), and so does the plain socket transport's recv: with TLS to
    the engines that was about a quarter of the gateway's CPU on streams
    (docs/performance.md, "With TLS to the engines").

    Backpressure: when the client's write buffer passes its high-water mark,
    reading from the engine stops until the client drained it, so a slow
    reader makes the engine wait (TCP) instead of the gateway buffering.
    """

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        client: asyncio.Transport,
        relay: _SseRelay,
        framed: bool,
        call: _Call,
        read_timeout: float | None,
        drain: tuple[float, int] = (0.0, 0),
        on_drained: Callable[[_Pipe], None] | None = None,
    ) -> None:
        self._content = upstream.content
        conn = upstream.connection
        self._inner = conn.protocol if conn is not None else None
        self._upstream = self._inner.transport if self._inner is not None else None
        self._inner_timeout: float | None = None
        self._client = client
        self._relay = relay
        self._framed = framed
        self._call = call
        self._high = client.get_write_buffer_limits()[1]
        self._loop = asyncio.get_running_loop()
        self._read_timeout = read_timeout
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._installed = False
        # Raw mode: the unread part of a chunk-size line, and what is left of
        # the current chunk (its data, then its CRLF); 0: a size line is next.
        self._raw = False
        self._chunked = False
        self._rbuf = b""
        self._left = 0
        # What the handler reads once woken: the stream ended (cleanly, with
        # `error`, or with the client `gone`), or it is `paused` on the client.
        self.done = False
        self.paused = False
        self.gone = False
        self.error: BaseException | None = None
        # After the client went away: how long and how much more is read from
        # the engine, and what runs at the end (see begin_drain).
        self._drain_s, self._drain_bytes = drain
        self._on_drained = on_drained
        self.draining = False
        self._drain_timer: asyncio.TimerHandle | None = None

    def start(self, upstream_chunked: bool) -> None:
        inner, upstream = self._inner, self._upstream
        if inner is not None and upstream is not None and not upstream.is_closing():
            # aiohttp's own read timeout re-arms a timer for every read; the
            # pipe keeps one timer a stream instead (see _check_idle).
            self._inner_timeout = inner.read_timeout
            inner.read_timeout = None
            inner.start_timeout()  # drops the timer already armed
            upstream.set_protocol(self)
            self._installed = True
            # Never raw from the start: aiohttp's parser may have read part
            # of a chunk-size line with the headers, and shows no sign of it.
            self._chunked = upstream_chunked
            self._last_read = self._loop.time()
            if self._read_timeout:
                self._timer = self._loop.call_at(
                    self._last_read + self._read_timeout, self._check_idle
                )
        # Whatever arrived with the headers (all of a short answer, possibly,
        # the connection already back in the pool) is in the reader.
        self._pump()
        if not self.done and not self._installed:
            self._finish(aiohttp.ClientConnectionError("the engine's connection closed"))

    def detach(self) -> None:
        """Give the engine's connection back to aiohttp; safe to call more than once."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._installed:
            return
        self._installed = False
        assert self._inner is not None and self._upstream is not None
        if self._raw:
            # Ended inside the body while reading raw (an error, the client
            # gone): aiohttp's parser missed what was read raw, so the
            # connection must never go back to the pool.
            self._upstream.abort()
        self._inner.read_timeout = self._inner_timeout
        if self._upstream.get_protocol() is self:
            self._upstream.set_protocol(self._inner)
        if self.paused:
            self.paused = False
            # A connection back in the pool must be reading; one being closed
            # does not mind.
            self._upstream.resume_reading()

    async def wait(self) -> None:
        """Until the stream ended or paused."""
        if self.done or self.paused:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def resume(self) -> None:
        """The client drained its buffer: read from the engine again."""
        if self.paused and self._upstream is not None and not self.done:
            self.paused = False
            self._last_read = self._loop.time()
            self._upstream.resume_reading()

    def begin_drain(self) -> bool:
        """The client is gone: read the engine's answer on, bounded, for its usage.

        True when the pipe now owns the engine's connection (it calls
        ``on_drained`` at the end); False when there is nothing to drain (the
        answer ended, or draining is off), and the caller cuts the connection.
        """
        self.gone = True
        if self.draining:
            return True
        if self.done or not self._installed or self._on_drained is None or self._drain_s <= 0:
            return False
        self.draining = True
        if self.paused:
            # Nobody reads the client's side any more: nothing to wait for.
            self.paused = False
            assert self._upstream is not None
            self._upstream.resume_reading()
        self._drain_timer = self._loop.call_later(self._drain_s, self._drain_expired)
        self._wake()
        return True

    def _drain_expired(self) -> None:
        self._drain_timer = None
        if not self.done:
            self._finish(TimeoutError("the answer did not end within the drain time"))

    def send(self, data: bytes) -> None:
        """Write to the client (framed as the response is); notes a client gone."""
        if not data:
            return
        if self.draining:
            self._drain_bytes -= len(data)
            if self._drain_bytes < 0 and not self.done:
                self._finish(aiohttp.ClientPayloadError("the answer passed the drain limit"))
            return
        client = self._client
        if client.is_closing():
            # Writing to a closed transport is silently dropped (asyncio logs
            # after a few). Read on for the usage if the handler allows it;
            # otherwise stop, and let the engine's connection be cut, which
            # stops the generation.
            if not self.begin_drain():
                self._finish(None)
            return
        client.write(b"%x\r\n%b\r\n" % (len(data), data) if self._framed else data)
        if self._call.first_byte is None:
            self._call.first_byte = time.monotonic()
        if (
            not self.paused
            and not self.done
            and self._installed
            and client.get_write_buffer_size() > self._high
        ):
            assert self._upstream is not None
            self._upstream.pause_reading()
            self.paused = True
            self._wake()

    # asyncio.BufferedProtocol, on the engine's connection

    def get_buffer(self, sizehint: int) -> memoryview:
        return _READ_BUFFER

    def buffer_updated(self, nbytes: int) -> None:
        # A copy: the buffer is the next read's, and aiohttp's parser and the
        # client's transport may keep what they are given.
        self.data_received(_READ_BUFFER[:nbytes].tobytes())

    def data_received(self, data: bytes) -> None:
        assert self._inner is not None
        self._last_read = self._loop.time()
        if self._raw:
            self._unchunk(data)
            return
        self._inner.data_received(data)
        self._pump()
        if self._chunked and not self.done and data.endswith(b"\n\r\n"):
            # An aiohttp without the attribute read gets no raw mode.
            self._raw = self._at_chunk_end()

    def _at_chunk_end(self) -> bool:
        """Whether aiohttp's parser stopped right after a whole chunk, so the pipe can go on raw.

        Its reader records where each chunk ended (_http_chunk_splits, kept
        up to what was read): a chunk ends there. The read ended with
        "\n\r\n", which a chunk-size line cannot (its last byte before CRLF
        is a hex digit or part of an extension): so the parser is not past
        the next chunk's header. Events end with a blank line, so a chunk of
        whole events ends like this.
        """
        content = self._content
        splits = getattr(content, "_http_chunk_splits", None)
        if not splits:
            return False
        return bool(
            splits[-1] == content.total_bytes
            and not content.is_eof()
            and content.exception() is None
        )

    def eof_received(self) -> None:
        # None: the transport closes, and connection_lost follows.
        assert self._inner is not None
        self._inner.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        assert self._inner is not None
        self._inner.connection_lost(exc)
        # aiohttp has ended the body (read to the close) or failed it.
        self._pump()
        if not self.done:
            self._finish(aiohttp.ServerDisconnectedError())

    def pause_writing(self) -> None:
        assert self._inner is not None
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        assert self._inner is not None
        self._inner.resume_writing()

    # internals

    def _pump(self) -> None:
        if self.done:
            return
        content = self._content
        try:
            chunk = content.read_nowait()
        except Exception as e:  # the engine failed; an error aiohttp set on the body
            self._finish(e)
            return
        if chunk:
            self.send(self._relay.feed(chunk))
        if content.at_eof() and not self.done:
            self._finish(None)

    def _unchunk(self, data: bytes) -> None:
        buf = self._rbuf + data if self._rbuf else data
        self._rbuf = b""
        out: list[bytes] = []
        pos, n, left = 0, len(buf), self._left
        while pos < n:
            if left > 2:
                take = min(left - 2, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                left -= take
            elif left:
                # The CRLF after a chunk's data, possibly split across reads.
                take = min(left, n - pos)
                if buf[pos : pos + take] != b"\r\n"[2 - left : 2 - left + take]:
                    return self._bad_framing(out, "no CRLF after a chunk")
                pos += take
                left -= take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > _MAX_CHUNK_LINE:
                        return self._bad_framing(out, "a chunk-size line too long")
                    self._rbuf = buf[pos:]
                    break
                size = _CHUNK_SIZE.match(buf, pos, eol + 2)
                if size is None:
                    return self._bad_framing(out, "a malformed chunk-size line")
                length = int(buf[pos : size.end()], 16)
                if not length:
                    # The last chunk (and any trailers after it): aiohttp's
                    # parser takes it from here, ends the (to it, empty) body
                    # and puts the connection back in the pool.
                    self._left = 0
                    self._raw = False
                    if out:
                        self.send(self._relay.feed(b"".join(out)))
                    assert self._inner is not None
                    if not self.done:
                        self._inner.data_received(buf[pos:])
                        self._pump()
                    return None
                pos = eol + 2
                left = length + 2
        self._left = left
        if out:
            self.send(self._relay.feed(out[0] if len(out) == 1 else b"".join(out)))
        return None

    def _bad_framing(self, out: list[bytes], what: str) -> None:
        if out:
            self.send(self._relay.feed(b"".join(out)))
        self._finish(aiohttp.ClientPayloadError(f"The engine's chunked answer has {what}."))

    def _check_idle(self) -> None:
        self._timer = None
        if self.done or self._read_timeout is None:
            return
        now = self._loop.time()
        due = self._last_read + self._read_timeout
        if self.paused:
            # Waiting on the client is not the engine's silence (resume()
            # restarts the clock).
            due = now + self._read_timeout
        if now < due:
            self._timer = self._loop.call_at(due, self._check_idle)
            return
        self._finish(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))

    def _finish(self, error: BaseException | None) -> None:
        self.done = True
        self.error = error
        # At once: at a clean end aiohttp has put the connection back in the
        # pool, where the next request may take it before the handler runs.
        self.detach()
        self._wake()
        if self.draining:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
                self._drain_timer = None
            assert self._on_drained is not None
            self._on_drained(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class StreamClient(Protocol):
    """The client's side of a stream the fast lane took (``fastlane._Lane``)."""

    def begin_stream(self, headers: dict[str, str], sink: LaneSink) -> None:
        """Write the answer's head (200, chunked); ``sink`` hears of the
        client's backpressure (pause, resume) until the stream ends."""

    def write_chunk(self, data: bytes) -> bool:
        """Write one chunk of the answer; False: the client is gone."""

    def end_stream(self) -> None:
        """Write the last chunk: the answer is whole."""

    def cut(self) -> None:
        """Close the client's connection with the answer incomplete."""


class LaneSink:
    """A stream the fast lane took, moved from the engine's connection to the
    client's as it arrives (an :class:`upstream.Sink`), as :class:`_Pipe`
    does on aiohttp's path: events out as they complete, usage read,
    backpressure both ways, and a bounded read to the end once the client is
    gone, so that its usage is counted (``on_drained``: whether it ended).
    """

    def __init__(
        self,
        client: StreamClient,
        relay: _SseRelay,
        call: _Call,
        head_of: Callable[[CIMultiDict[str]], dict[str, str]],
        drain: tuple[float, int],
        on_drained: Callable[[bool], None],
    ) -> None:
        self._client = client
        self._relay = relay
        self._call = call
        self._head_of = head_of
        self._drain_s, self._drain_left = drain
        self._on_drained = on_drained
        # The engine's connection, from the head to the end of the answer:
        # after that it is the pool's, and may carry another request.
        self._conn: Conn | None = None
        self.began = False
        self._ended: bool | None = None  # whole or not, once the answer ended
        self._draining = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._relay.usage

    # upstream.Sink

    def head(self, conn: Conn, headers: CIMultiDict[str]) -> None:
        self._conn = conn
        self.began = True
        self._client.begin_stream(self._head_of(headers), self)

    def data(self, data: bytes) -> None:
        self.send(self._relay.feed(data))

    def end(self, whole: bool) -> None:
        conn, self._conn = self._conn, None
        if not self.began or self._ended is not None:
            return
        self._ended = whole
        if self._draining:
            self._drained(conn, whole)

    def keep_reading(self, conn: Conn) -> bool:
        if not self.began:
            return False
        if self._ended is not None:
            # The answer ended as the client went, before the gateway's
            # handling of that end ran (and it will not now).
            if self._ended:
                self._on_drained(True)
            return False
        if self._drain_s <= 0:
            return False
        self._draining = True
        self._call.handed_off = True  # the drain settles what the request holds
        conn.resume()  # nobody reads the client's side any more
        self._timer = asyncio.get_running_loop().call_later(self._drain_s, self._cut_drain)
        return True

    # the client's backpressure (the lane's pause_writing, resume_writing)

    def pause(self) -> None:
        if self._conn is not None and not self._draining:
            self._conn.pause()

    def resume(self) -> None:
        if self._conn is not None:
            self._conn.resume()

    # the stream's ends, as the gateway sees them

    def send(self, out: bytes) -> None:
        if not out:
            return
        if self._draining:
            self._drain_left -= len(out)
            if self._drain_left < 0:
                self._cut_drain()
            return
        if self._client.write_chunk(out) and self._call.first_byte is None:
            self._call.first_byte = time.monotonic()

    def finish(self) -> None:
        """The engine's answer ended: the rest out, then the last chunk."""
        self.send(self._relay.rest())
        self._client.end_stream()

    def cut_short(self, error_event: bytes) -> None:
        """The engine failed after the answer began: ``error_event`` (the
        incomplete event before it dropped), then the connection closed."""
        self._relay.rest()
        self.send(error_event)
        self._client.cut()

    def _cut_drain(self) -> None:
        """The drain's time or bytes ran out: the engine's connection is cut."""
        conn, self._conn = self._conn, None
        if self._ended is not None:
            return
        self._ended = False
        self._drained(conn, False)

    def _drained(self, conn: Conn | None, whole: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if conn is not None:
            # Never back to the pool: not worth the bookkeeping for a client gone.
            conn.abandon()
        self._on_drained(whole)
