"""aiohttp's application on the gateway's connections, one request at a time.

The routes that are not the request path's (the status page, the CLI's API,
files and batches, ``/v1/models``, ``/metrics``) are aiohttp handlers. A
client connection's request for one is written, as it was read, to an
aiohttp protocol (the application's ``web.Server``, which is a protocol
factory) through a :class:`_Pipe`: a transport that writes to the client's
own and answers ``get_extra_info`` from it (the peer, its credentials, TLS).
The answer goes to the client as aiohttp wrote it; it is read as it passes
(httptools) only to see where it ends, so that the connection's next request
goes on in order. aiohttp's protocol lives as long as its keep-alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import httptools

from llmgw_slurm.router import http1


class Flow(Protocol):
    """Reading of the client's connection, paused for a reason (``server.FlowControl``)."""

    def pause(self, why: str) -> None: ...

    def resume(self, why: str) -> None: ...


class Bridged(Protocol):
    """What the bridge uses of a request (``server.Request``)."""

    method: str
    url: bytes
    http11: bool
    raw_headers: list[tuple[bytes, bytes]]
    headers: dict[str, str]
    body: bytearray
    complete: bool
    keep_alive: bool
    answered: bool

    def finished(self) -> None: ...

__all__ = ["AppBridge"]


class _Pipe(asyncio.Transport):
    """The transport aiohttp's protocol writes to: the client's, with its ends watched."""

    def __init__(self, bridge: AppBridge) -> None:
        super().__init__()
        self._bridge = bridge
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closed:
            self._bridge.answered(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def is_closing(self) -> bool:
        return self._closed or self._bridge.client.is_closing()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._bridge.closed_by_app(self)

    def abort(self) -> None:
        self.close()
        self._bridge.client.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._bridge.client.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._bridge.flow.pause("app")

    def resume_reading(self) -> None:
        self._bridge.flow.resume("app")

    def is_reading(self) -> bool:
        return self._bridge.client.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._bridge.client.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._bridge.client.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._bridge.client.set_write_buffer_limits(high, low)

    def can_write_eof(self) -> bool:
        return False


class AppBridge:
    """One client connection's way to aiohttp's application."""

    def __init__(
        self, client: asyncio.Transport, flow: Flow,
        factory: Callable[[], asyncio.Protocol],
    ) -> None:
        self.client, self.flow, self._factory = client, flow, factory
        self._app: asyncio.Protocol | None = None
        self._pipe: _Pipe | None = None
        self._req: Bridged | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._chunked = False
        self._status = 0

    def begin(self, req: Bridged) -> None:
        """Hand ``req`` to aiohttp: its head as read, its body as it comes."""
        if self._app is None or self._pipe is None or self._pipe.is_closing():
            self._app, self._pipe = self._factory(), _Pipe(self)
            self._app.connection_made(self._pipe)
        self._req, self._status = req, 0
        self._parser = httptools.HttpResponseParser(self)
        self._chunked = "chunked" in req.headers.get("transfer-encoding", "").lower()
        version = "1.1" if req.http11 else "1.0"
        lines = [b"%s %s HTTP/%s" % (req.method.encode(), req.url, version.encode())]
        lines += [b"%s: %s" % nv for nv in req.raw_headers]
        self._app.data_received(b"\r\n".join(lines) + b"\r\n\r\n")
        if req.body:
            self.feed(bytes(req.body))
            req.body = bytearray()
        if req.complete:
            self.feed_eof()

    def feed(self, body: bytes) -> None:
        if self._app is not None:
            self._app.data_received(http1.chunk(body) if self._chunked else body)

    def feed_eof(self) -> None:
        if self._app is not None and self._chunked:
            self._app.data_received(http1.LAST_CHUNK)

    def pause_writing(self) -> None:
        if self._app is not None:
            self._app.pause_writing()

    def resume_writing(self) -> None:
        if self._app is not None:
            self._app.resume_writing()

    def lost(self) -> None:
        """The client's connection closed."""
        app, self._app = self._app, None
        if app is not None:
            app.connection_lost(None)

    # what aiohttp's protocol does

    def answered(self, data: bytes) -> None:
        """Bytes of aiohttp's answer: to the client, and read for where the answer ends."""
        self.client.write(data)
        if self._parser is None:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._parser = None  # aiohttp's answer is its own; the connection closes after it
            self.client.close()

    def closed_by_app(self, pipe: _Pipe) -> None:
        """aiohttp closed its side: after an answer that said so, or while
        idle (its keep-alive), or mid-answer. Only an idle close leaves the
        client's connection open (the next request gets a new protocol)."""
        if pipe is not self._pipe:
            return
        app, self._app = self._app, None
        if self._req is not None:
            self.client.close()
        if app is not None:
            app.connection_lost(None)

    # httptools' callbacks, on aiohttp's answer

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._status = self._parser.get_status_code()
        if self._req is not None and self._req.method == "HEAD" and self._status >= 200:
            self.on_message_complete()

    def on_message_complete(self) -> None:
        if self._status < 200 or self._req is None or self._parser is None:
            return  # 100 Continue: the answer follows
        req, keep = self._req, self._parser.should_keep_alive()
        self._req = self._parser = None
        if not keep:
            req.keep_alive = False
        req.answered = True
        req.finished()
