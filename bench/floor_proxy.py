"""The least a proxy on the gateway's own stack can do: the floor under its CPU.

On uvloop's loop with httptools (llhttp) on both sides, as ``router.server``
and ``router.engine`` are, and nothing else: a request parsed, sent on a kept
engine connection with the engine's key, the answer parsed and written back
(a whole one with its length, a streamed one chunk by chunk as it comes). No
keys, no checks, no JSON, no accounting, no metrics, no timers, no failover,
no flow control: what any Python proxy built this way spends before it does
any of a gateway's work, to set the gateway's CPU and nginx's against.

A floor for whole answers; for streams, a little above one: each event is
written as llhttp hands it over, where the gateway writes a read's events
as one (``engine.Conn._deliver``).

Not a server to run: it trusts its clients and its engine, and a malformed
message ends the connection without an answer.

    python3 bench/floor_proxy.py PORT ENGINE_URL ENGINE_KEY
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools
import uvloop


class Engine(asyncio.Protocol):
    """A kept connection to the engine: one request at a time, its answer to ``client``."""

    def __init__(self, pool: deque[Engine]) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.chunked = False
        self.parts: list[bytes] = []
        self.ctype = b"application/json"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:
            self.client.transport.close()

    def cut(self) -> None:
        """The client left mid-answer: this connection's answer is dropped with it."""
        self.client = None
        assert self.transport is not None
        self.transport.close()

    def on_message_begin(self) -> None:
        self.chunked, self.parts, self.ctype = False, [], b"application/json"

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        if self.ctype.startswith(b"text/event-stream"):
            self.chunked = True
            assert self.client is not None
            self.client.transport.write(
                b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
                % (self.parser.get_status_code(), self.ctype)
            )

    def on_body(self, body: bytes) -> None:
        assert self.client is not None
        if self.chunked:
            self.client.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        else:
            self.parts.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        assert client is not None
        client.engine = None
        if self.chunked:
            client.transport.write(b"0\r\n\r\n")
        else:
            answer = b"".join(self.parts)
            client.transport.write(
                b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (self.parser.get_status_code(), self.ctype, len(answer), answer)
            )
        self.pool.append(self)


class Client(asyncio.Protocol):
    """One client connection: each request to an idle engine connection, or a new one."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.url = b""
        self.parts: list[bytes] = []
        self.engine: Engine | None = None  # answering this client now

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.engine is not None:
            self.engine.cut()

    def on_message_begin(self) -> None:
        self.url, self.parts = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        if self.url == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        body = b"".join(self.parts)
        request = self.proxy.head % (self.url, len(body)) + body
        if self.proxy.idle:
            self.proxy.send(self.proxy.idle.pop(), self, request)
        else:
            asyncio.get_running_loop().create_task(self.proxy.connect(self, request))


class Proxy:
    def __init__(self, engine_url: str, key: str) -> None:
        url = urlsplit(engine_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.head = (
            b"POST %s HTTP/1.1\r\nHost: " + url.netloc.encode() + b"\r\nAuthorization: Bearer "
            + key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        )
        self.idle: deque[Engine] = deque()

    def send(self, engine: Engine, client: Client, request: bytes) -> None:
        assert engine.transport is not None
        engine.client, client.engine = client, engine
        engine.transport.write(request)

    async def connect(self, client: Client, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, engine = await loop.create_connection(lambda: Engine(self.idle), self.host, self.port)
        self.send(engine, client, request)


async def serve(port: int, engine_url: str, key: str) -> None:
    proxy = Proxy(engine_url, key)
    server = await asyncio.get_running_loop().create_server(
        lambda: Client(proxy), "127.0.0.1", port
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
