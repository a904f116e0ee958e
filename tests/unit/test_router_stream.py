"""Streamed answers through the gateway, from an engine whose every byte the test writes.

The engine here is a bare asyncio server that speaks just enough HTTP/1.1 to
answer the gateway (keep-alive, a chunked event stream), so that each test
chooses where the chunks split, when the engine stops, and whether the
terminating chunk ever comes.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from _router_support import eventually, serve

from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
)

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text(t: str) -> bytes:
    return event({"choices": [{"index": 0, "text": t}], "usage": None})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

@dataclass
class Engine:
    """Answers each request with the next script (the last one repeats)."""

    scripts: list[Script]
    url: str = ""
    connections: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode("latin-1").split("\r\n")
                assert lines[0].startswith("POST /v1/"), lines[0]
                headers = dict(line.split(": ", 1) for line in lines[1:] if line)
                body = json.loads(await reader.readexactly(int(headers["Content-Length"])))
                self.requests.append(body)
                script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]
                await script(reader, writer)
                if writer.is_closing():
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self.closed.set()
            writer.close()


@dataclass
class Stack:
    url: str
    gateway: Gateway
    engine: Engine

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


@asynccontextmanager
async def stack(
    *scripts: Script, config: RouterConfig | None = None, handler_cancellation: bool = True
) -> AsyncIterator[Stack]:
    eng = Engine(list(scripts))
    server = await asyncio.start_server(eng.serve, "127.0.0.1", 0)
    eng.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    directory = StaticDirectory([ModelInfo("tiny")])
    directory.add_endpoint("tiny", Endpoint("r0", eng.url, "k"))
    app = create_app(directory, config or RouterConfig())
    async with AsyncExitStack() as es:
        es.push_async_callback(server.wait_closed)
        es.callback(server.close)
        url = await es.enter_async_context(serve(app, handler_cancellation=handler_cancellation))
        yield Stack(url, app[GATEWAY_KEY], eng)


BODY = {"model": "tiny", "prompt": "a", "stream": True}


async def head_alone(w: asyncio.StreamWriter) -> None:
    """The headers in a read of their own, as engines send them before the first token.

    The gateway's own way to undo the chunked framing then takes over after
    the first chunk (a body that begins in the headers' read: after the first
    read that ends a chunk); it is also tested with the framing as aiohttp's
    parser stops in every place.
    """
    w.write(HEAD)
    await w.drain()
    await asyncio.sleep(0.01)


async def test_events_split_across_chunks_pass_whole_with_nothing_held_back() -> None:
    go = asyncio.Event()

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await head_alone(w)
        w.write(chunk(text("a")))
        # The rest only once the client has the first event: a gateway that
        # waited for more before passing it on would hang here.
        await go.wait()
        a, b = text("b"), USAGE
        for piece in (a[:7], a[7:] + b[:20], b[20:-1], b[-1:] + DONE):
            w.write(chunk(piece))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(END)

    async with stack(script) as st, aiohttp.ClientSession() as s:
        r = await s.post(st.url + "/v1/completions", json=BODY)
        got = b""
        while got != text("a"):
            got += await r.content.readany()
        go.set()
        got += await r.content.read()
        assert r.status == 200
        # The usage event the client did not ask for is taken out, and counted.
        assert got == text("a") + text("b") + DONE
        assert st.engine.requests[0]["stream_options"] == {"include_usage": True}
        assert st.metric("llmgw_tokens_total", model="tiny", kind="completion") == 4
        assert st.metric("llmgw_requests_total", model="tiny", status="200") == 1
        assert st.metric("llmgw_time_to_first_byte_seconds_count", model="tiny") == 1


async def test_usage_is_kept_when_the_client_asked_for_it() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(HEAD + chunk(text("a") + USAGE[:9]) + chunk(USAGE[9:] + DONE) + END)

    async with stack(script) as st, aiohttp.ClientSession() as s:
        body = {**BODY, "stream_options": {"include_usage": True}}
        r = await s.post(st.url + "/v1/completions", json=body)
        assert await r.read() == text("a") + USAGE + DONE
        assert st.metric("llmgw_tokens_total", model="tiny", kind="prompt") == 3


@pytest.mark.parametrize("one_write", [True, False], ids=["with-headers", "event-by-event"])
async def test_streams_reuse_the_engine_connection(one_write: bool) -> None:
    events = [text(t) for t in "abc"] + [USAGE, DONE]

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if one_write:
            # The whole answer in the headers' segment: aiohttp may have read
            # it all, and put the connection back, before the relay starts.
            w.write(HEAD + b"".join(chunk(e) for e in events) + END)
            return
        await head_alone(w)
        for e in events:
            w.write(chunk(e))
            await asyncio.sleep(0.005)
        w.write(END)

    async with stack(script) as st, aiohttp.ClientSession() as s:
        for _ in range(3):
            r = await s.post(st.url + "/v1/completions", json=BODY)
            assert await r.read() == b"".join(events[:3]) + DONE
        assert st.engine.connections == 1
        assert st.metric("llmgw_tokens_total", model="tiny", kind="completion") == 12
        assert not st.gateway.in_flight


async def _read_error_event(r: aiohttp.ClientResponse) -> tuple[bytes, dict[str, Any]]:
    """The events before the error, and the error; then the gateway must cut the answer."""
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        while True:
            data = await r.content.readany()
            if not data:
                break
            got += data
    before, _, err = got.rpartition(b"data: ")
    return before, json.loads(err)["error"]


@pytest.mark.parametrize("with_headers", [True, False])
async def test_engine_closing_without_the_last_chunk_gives_an_error_event_and_a_cut(
    with_headers: bool,
) -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        # A complete event, then half of one, then the connection closes.
        if with_headers:
            w.write(HEAD + chunk(text("a")) + chunk(text("b"))[:10])
        else:
            await head_alone(w)
            w.write(chunk(text("a")))
            await w.drain()
            await asyncio.sleep(0.01)
            w.write(chunk(text("b"))[:10])
        await w.drain()
        w.close()

    async with stack(script) as st, aiohttp.ClientSession() as s:
        r = await s.post(st.url + "/v1/completions", json=BODY)
        before, err = await _read_error_event(r)
        assert before == text("a")
        assert err["code"] == "upstream_failed"
        assert "failed after the answer began" in err["message"]
        await eventually(lambda: not st.gateway.in_flight, "the request ended")
        assert st.metric("llmgw_upstream_errors_total", model="tiny", phase="stream") == 1
        assert st.metric("llmgw_requests_total", model="tiny", status="502") == 1
        assert st.metric("llmgw_tokens_total", model="tiny", kind="completion") == 0


@pytest.mark.parametrize(
    "garbage",
    [
        b"zz\r\nnot a chunk\r\n",
        b"-1\r\n",
        b"0x5\r\nhello\r\n",
        b"5\r\nhelloXX",
        b"f" * 20 + b"\r\n",
        b"1" * 5000,
    ],
    ids=["not-hex", "negative", "0x", "no-crlf", "too-big", "endless-line"],
)
@pytest.mark.parametrize("with_headers", [True, False])
async def test_engine_sending_garbage_framing_gives_an_error_event(
    garbage: bytes, with_headers: bool
) -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if with_headers:
            w.write(HEAD + chunk(text("a")))
        else:
            await head_alone(w)
            w.write(chunk(text("a")))
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(garbage)

    async with stack(script) as st, aiohttp.ClientSession() as s:
        r = await s.post(st.url + "/v1/completions", json=BODY)
        before, err = await _read_error_event(r)
        assert before == text("a") and err["code"] == "upstream_failed"
        await st.engine.closed.wait()


async def test_framing_split_anywhere_is_undone() -> None:
    events = [text(t) for t in ("a", "bb", "c" * 300)] + [USAGE, DONE]
    raw = b"".join(chunk(e) for e in events[:2]) + chunk(b"".join(events[2:])) + END

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await head_alone(w)
        # A read every few bytes: size lines, data and CRLFs cut everywhere.
        for i in range(0, len(raw), 3):
            w.write(raw[i : i + 3])
            await w.drain()
            await asyncio.sleep(0.001)

    async with stack(script) as st, aiohttp.ClientSession() as s:
        for _ in range(2):
            r = await s.post(st.url + "/v1/completions", json=BODY)
            assert await r.read() == b"".join(events[:3]) + DONE
        assert st.metric("llmgw_tokens_total", model="tiny", kind="completion") == 8
        assert st.engine.connections == 1


async def test_a_body_begun_in_any_place_with_the_headers_is_undone() -> None:
    """The gateway goes on from wherever aiohttp's parser stopped, for every place it can stop."""
    # Chunk data holding "\n\r\n" in its middle, and one ending with it.
    data = [text("a"), b": x\n\r\n" + text("b"), b"data: c\n\r\n", DONE]
    body = b"".join(chunk(d) for d in data) + END
    cuts = list(range(len(body) - len(END)))

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        k = cuts[len(st.engine.requests) - 1]
        w.write(HEAD + body[:k])
        await w.drain()
        await asyncio.sleep(0.005)
        w.write(body[k:])

    async with stack(script) as st, aiohttp.ClientSession() as s:
        for _ in cuts:
            r = await s.post(st.url + "/v1/completions", json=BODY)
            assert await r.read() == b"".join(data)
        assert st.engine.connections == 1


async def test_chunk_extensions_and_trailers_are_understood() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await head_alone(w)
        a = text("a")
        w.write(b"%x;name=value\r\n%b\r\n" % (len(a), a) + chunk(DONE))
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(b"0\r\nX-Trailer: 1\r\n\r\n")

    async with stack(script) as st, aiohttp.ClientSession() as s:
        for _ in range(2):
            r = await s.post(st.url + "/v1/completions", json=BODY)
            assert await r.read() == text("a") + DONE
        assert st.engine.connections == 1


async def test_engine_gone_silent_mid_stream_times_out_and_is_cut() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await head_alone(w)
        w.write(chunk(text("a")))
        await r.read()  # until the gateway closes the connection

    config = RouterConfig(read_timeout=0.3)
    async with stack(script, config=config) as st, aiohttp.ClientSession() as s:
        r = await s.post(st.url + "/v1/completions", json=BODY)
        before, err = await _read_error_event(r)
        assert before == text("a")
        # aiohttp's client says SocketTimeoutError, the gateway's own TimeoutError.
        assert "TimeoutError)" in err["message"]
        await st.engine.closed.wait()


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_client_leaving_mid_stream_closes_the_engine_connection(
    handler_cancellation: bool,
) -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await head_alone(w)
        while True:  # until writing fails: the gateway closed the connection
            w.write(chunk(text("x")))
            await w.drain()
            await asyncio.sleep(0.01)

    # Draining off: this checks the cut itself. By default a client gone is
    # read on for its usage first (test_router_usage_after_disconnect.py).
    cut = RouterConfig(drain_after_disconnect=0)
    async with stack(script, config=cut, handler_cancellation=handler_cancellation) as st:
        async with aiohttp.ClientSession() as s:
            r = await s.post(st.url + "/v1/completions", json=BODY)
            assert (await r.content.readany()).startswith(b"data: ")
            r.connection.transport.abort()  # type: ignore[union-attr]
        await st.engine.closed.wait()
        await eventually(lambda: not st.gateway.in_flight, "the request ended")
        assert st.metric("llmgw_requests_total", model="tiny", status="499") == 1


@pytest.mark.parametrize("read_timeout_s", [600.0, 0.3])
async def test_a_client_that_does_not_read_makes_the_engine_wait(read_timeout_s: float) -> None:
    """Backpressure: the gateway stops reading from the engine, it does not buffer the answer.

    With a short read timeout: waiting on the client is not the engine's
    silence, and the answer is not cut.
    """
    piece = text("x" * 65_536)
    # 128 MiB: several times what the socket buffers on the way can hold
    # (Linux grows a receive buffer up to net.ipv4.tcp_rmem's maximum, 32 MiB).
    total = 2048
    state = {"sent": 0, "waiting": False}

    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await head_alone(w)
        w.write(chunk(text("first")))
        await w.drain()
        await asyncio.sleep(0.01)
        for _i in range(total):
            w.write(chunk(piece))
            state["waiting"] = True
            await w.drain()
            state["waiting"] = False
            state["sent"] += 1
        w.write(chunk(USAGE + DONE) + END)

    async with stack(script, config=RouterConfig(read_timeout=read_timeout_s)) as st:
        body = json.dumps(BODY).encode()
        reader, writer = await asyncio.open_connection(*st.url[7:].split(":"))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        await reader.readuntil(b"\r\n\r\n")
        assert await reader.readexactly(len(chunk(text("first")))) == chunk(text("first"))

        # Not reading: the engine must end up waiting on its socket, with the
        # answer nowhere near sent. A gateway that kept reading would take it
        # all in (and hold it in memory) instead.
        seen = -1
        while True:
            await eventually(lambda: bool(state["waiting"]), "the engine waiting to send")
            await asyncio.sleep(0.5)
            if state["waiting"] and state["sent"] == seen:
                break
            seen = state["sent"]
        assert state["sent"] < total // 2

        # Reading again, the client gets all of it, in order.
        length = len(piece) * total + len(DONE)
        pos = 0
        while size := int(await reader.readuntil(b"\r\n"), 16):
            data = await reader.readexactly(size + 2)
            assert data == _periodic(piece, total, DONE, pos, size) + b"\r\n"
            pos += size
        assert pos == length
        writer.close()
        assert st.metric("llmgw_tokens_total", model="tiny", kind="completion") == 4


def _periodic(piece: bytes, count: int, tail: bytes, pos: int, size: int) -> bytes:
    """``(piece * count + tail)[pos : pos + size]`` without building it."""
    out = b""
    body = len(piece) * count
    while size > 0:
        if pos < body:
            k = pos % len(piece)
            part = piece[k : k + min(size, body - pos)]
        else:
            part = tail[pos - body : pos - body + size]
            assert part, "read past the end"
        out += part
        pos += len(part)
        size -= len(part)
    return out


async def test_an_http_1_0_client_gets_the_stream_unframed_then_the_close() -> None:
    async def script(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(HEAD + chunk(text("a")) + chunk(USAGE) + chunk(DONE) + END)

    async with stack(script) as st:
        body = json.dumps(BODY).encode()
        host, port = st.url[7:].split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            raw = b""
            while data := await asyncio.to_thread(sock.recv, 65536):
                raw += data
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200")
    assert b"transfer-encoding" not in head.lower()
    assert rest == text("a") + DONE
