"""The gateway's HTTP/1.1 server (router/server.py): pipelining, timers, the
client gone, failures answered once, the engine side reached from it, and its
framing of requests set against a reference parser's (h11). Every other router
test runs through it too: ``_router_support.serve`` serves a gateway app with
it, as the daemon does."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import shutil
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from _router_support import engine, eventually, free_port, serve
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_side import CRAFTED  # type: ignore[import-not-found]

from llmgw_slurm.accounting.quota import QuotaBook
from llmgw_slurm.auth.keys import KeyRing, add_key
from llmgw_slurm.auth.tls import client_context, load_or_create_identity, make_engine_tls
from llmgw_slurm.config import QuotaConfig
from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
    http1,
)
from llmgw_slurm.router.account import Tally
from llmgw_slurm.router.admit import Plan
from llmgw_slurm.router.engine import Conn
from llmgw_slurm.router.forward import Exchange
from llmgw_slurm.router.server import Connection, Request, Runner

CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()


@dataclass
class Stack:
    url: str
    port: int
    gateway: Gateway
    served: list[str] = field(default_factory=list)  # endpoints the request path answered


@asynccontextmanager
async def gateway_stack(
    config: RouterConfig | None = None,
    token_delay: float = 0.0,
    ssl_context: ssl.SSLContext | None = None,
    keepalive_timeout: float | None = None,
) -> AsyncIterator[Stack]:
    directory = StaticDirectory([ModelInfo("tiny")])
    app = create_app(directory, config or RouterConfig())
    gw = app[GATEWAY_KEY]
    async with AsyncExitStack() as es:
        url = await es.enter_async_context(
            serve(app, ssl_context=ssl_context, keepalive_timeout=keepalive_timeout)
        )
        eurl = await es.enter_async_context(engine("tiny", key="k", token_delay=token_delay))
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k"))
        st = Stack(url, int(url.rsplit(":", 1)[1]), gw)
        serve_ = gw.serve

        def counting(req: Request) -> Exchange | None:
            assert req.endpoint is not None
            st.served.append(req.endpoint)
            return serve_(req)

        gw.serve = counting  # type: ignore[method-assign]
        yield st


def request(body: bytes = CHAT, path: str = "/v1/chat/completions", extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += await reader.readexactly(size)
            await reader.readline()
        await reader.readline()
    else:
        body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


async def test_plain_chat_a_stream_and_a_traced_stream_are_served_alike() -> None:
    async with (
        gateway_stack() as st,
        openai.AsyncOpenAI(api_key="x", base_url=st.url + "/v1", max_retries=0) as c,
    ):
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
        answer = raw.parse()
        assert answer.choices[0].message.content and answer.usage is not None
        assert raw.headers["x-llmgw-replica"] == "r0"
        assert st.served == ["chat/completions"]

        async def streamed(headers: dict[str, str]) -> tuple[str, Any, dict[str, str]]:
            got = await c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True}, extra_headers=headers,
            )  # fmt: skip
            chunks = [ch async for ch in got.parse()]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            return text, chunks[-1].usage, dict(got.headers)

        # A stream on the same client (the same kept-alive connection).
        text, usage, headers = await streamed({})
        assert st.served == ["chat/completions"] * 2
        assert headers["x-llmgw-replica"] == "r0"
        assert headers["content-type"].startswith("text/event-stream")
        # A traced one (it carries a context): the same path, the same answer.
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        traced = await streamed({"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
        assert st.served == ["chat/completions"] * 3
        assert text and (text, usage.model_dump()) == (traced[0], traced[1].model_dump())
        emb = await c.embeddings.create(model="tiny", input="hi")
        assert emb.data


def _events(sse: bytes) -> list[Any]:
    """A stream's events, without what differs from one answer to the next."""
    out: list[Any] = []
    for event in sse.split(b"\n\n"):
        data = event.removeprefix(b"data: ")
        if data.startswith(b"{"):
            obj = json.loads(data)
            obj.pop("id"), obj.pop("created")
            out.append(obj)
        elif data:
            out.append(data)
    return out


async def test_the_request_path_and_aiohttps_routes_over_tls(tmp_path: Path) -> None:
    # The gateway's port may serve TLS (server.yaml's tls:): the server then
    # sits behind the TLS transport, and aiohttp's routes behind it too.
    client_id = load_or_create_identity(tmp_path)
    pair = make_engine_tls(client_id.cert_pem, "gateway")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pair.identity.cert_file, pair.identity.key_file)
    trust = client_context(pair.identity.cert_pem, client_id.cert_file, client_id.key_file)
    try:
        async with gateway_stack(ssl_context=server) as st:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", st.port, ssl=trust, server_hostname="127.0.0.1"
            )
            writer.write(request())
            plain = await read_answer(reader)
            streamed = json.dumps({**json.loads(CHAT), "stream": True}).encode()
            writer.write(request(streamed))
            stream = await read_answer(reader)
            assert st.served == ["chat/completions"] * 2
            # A traced stream, then one of aiohttp's routes, on the same connection.
            ctx = "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
            writer.write(request(streamed, extra=ctx))
            traced = await read_answer(reader)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
            models = await read_answer(reader)
            writer.write(request())
            again = await read_answer(reader)
            writer.close()
            assert plain[0] == stream[0] == traced[0] == models[0] == again[0] == 200
            assert json.loads(plain[2])["choices"]
            assert stream[2].rstrip().endswith(b"data: [DONE]")
            assert _events(stream[2]) == _events(traced[2])
            assert json.loads(models[2])["data"][0]["id"] == "tiny"
            assert st.served == ["chat/completions"] * 4
    finally:
        shutil.rmtree(pair.directory, ignore_errors=True)


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        completion = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
        writer.write(request() + request(completion, "/v1/completions"))
        first = await read_answer(reader)
        second = await read_answer(reader)
        writer.close()
        assert first[0] == second[0] == 200
        assert json.loads(first[2])["object"] == "chat.completion"
        assert json.loads(second[2])["object"] == "text_completion"
        assert st.served == ["chat/completions", "completions"]


async def test_a_body_sent_after_its_head_is_waited_for() -> None:
    # As the OpenAI client's HTTP library writes them: the head, then the body.
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        whole = request()
        writer.write(whole[: whole.index(b"\r\n\r\n") + 4])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(whole[whole.index(b"\r\n\r\n") + 4 :])
        status, _, body = await read_answer(reader)
        writer.close()
        assert status == 200 and json.loads(body)["choices"]
        assert st.served == ["chat/completions"]


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        # Chunked: read as any other body.
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(CHAT):x}\r\n".encode()
            + CHAT
            + b"\r\n0\r\n\r\n",
            200,
            None,
        ),
        (request(b'{"model": '), 400, "invalid_json"),
        (request(json.dumps({"model": "nope"}).encode()), 404, "model_not_found"),
        (request(CHAT, "/v1/nowhere"), 404, "not_found"),
    ],
    ids=["chunked", "bad-json", "unknown-model", "unknown-path"],
)
async def test_requests_of_every_shape_are_answered_and_the_connection_serves_on(
    data: bytes, status: int, code: str | None
) -> None:
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(data)
        got, _, body = await read_answer(reader)
        # The connection stays usable, whoever answered (aiohttp's app: the unknown path).
        writer.write(request())
        after, _, _ = await read_answer(reader)
        writer.close()
        assert got == status, body
        if code is not None:
            assert json.loads(body)["error"]["code"] == code
        assert after == 200
        ours = [] if code == "not_found" else ["chat/completions"]
        assert st.served == [*ours, "chat/completions"]


async def test_a_body_that_stops_coming_gets_408_and_the_connection_closes() -> None:
    async with gateway_stack(RouterConfig(body_timeout=0.2)) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(request()[:-5])
        status, headers, body = await read_answer(reader)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert headers["connection"] == "close"
        assert await reader.read() == b""
        writer.close()
        assert st.served == []


async def test_an_idle_connection_closes_a_keep_alive_after_its_last_answer() -> None:
    # The keep-alive counts from the last answer, not the first.
    async with gateway_stack(keepalive_timeout=1.0) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        for _ in range(3):
            writer.write(request())
            assert (await read_answer(reader))[0] == 200
            await asyncio.sleep(0.7)  # 1.4 s after the first answer, by the third request
        assert st.served == ["chat/completions"] * 3
        # Then idle: closed by the server's timer (the read sees the end).
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()


async def test_a_client_gone_mid_answer_frees_the_replica() -> None:
    async with gateway_stack(token_delay=0.2) as st:
        _, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(request())
        await eventually(lambda: bool(st.gateway.in_flight), "the request in flight")
        writer.close()
        await eventually(lambda: not st.gateway.in_flight, "the replica freed")
        assert st.served == ["chat/completions"]
        samples = {
            (s.labels.get("status"), s.name): s.value
            for m in st.gateway.metrics.registry.collect()
            for s in m.samples
        }
        assert samples[("499", "llmgw_requests_total")] == 1


async def warm(st: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection whose first request left a kept-alive engine connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
    writer.write(request())
    assert (await read_answer(reader))[0] == 200
    return reader, writer


async def test_a_kept_engine_connection_answers_without_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with gateway_stack() as st:
        tasks: list[str] = []
        spawn = Exchange._spawn

        def counting(self: Exchange, step: Any) -> None:
            tasks.append(step.__name__)
            spawn(self, step)

        monkeypatch.setattr(Exchange, "_spawn", counting)
        reader, writer = await warm(st)
        for _ in range(3):
            writer.write(request())
            status, headers, body = await read_answer(reader)
            assert status == 200 and json.loads(body)["choices"]
            assert headers["x-llmgw-replica"] == "r0"
        writer.close()
        # The first request made the engine connection (in a task); the rest
        # reused it, answered from its callbacks.
        assert tasks == ["_connect"]
        assert st.served == ["chat/completions"] * 4
        assert not st.gateway.in_flight


# The gateway's objects a request or a connection makes.
OURS = (Request, Exchange, Tally, Plan, Connection, Conn)


@contextmanager
def left_for_the_collector() -> Iterator[list[str]]:
    """The names of the gateway's objects (:data:`OURS`) made in the block that
    only Python's cycle collector would free, once the block ends; the
    collector is off meanwhile."""
    found: list[str] = []
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept, to be looked at
    try:
        yield found
        gc.collect()
        found += sorted({type(o).__name__ for o in gc.garbage if isinstance(o, OURS)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_an_answered_request_leaves_nothing_for_the_cycle_collector() -> None:
    """A request's objects go as its answer ends (reference counting), whole or
    streamed: left in a cycle, every request waited for Python's cycle collector,
    whose runs (one every hundred requests) cost more than a tenth of the
    gateway's CPU and held up every answer in flight meanwhile."""
    streamed = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           "stream": True}).encode()  # fmt: skip
    async with gateway_stack() as st:
        reader, writer = await warm(st)
        with left_for_the_collector() as left:
            for body in (CHAT, streamed, CHAT):
                writer.write(request(body))
                status, _, answer = await read_answer(reader)
                assert status == 200 and answer
        writer.close()
        assert st.served == ["chat/completions"] * 4
    assert left == []


async def test_a_closed_connection_leaves_nothing_for_the_cycle_collector() -> None:
    """A client that opens a connection a request (requests.post without a
    session): each closed connection's objects go as it closes."""
    async with gateway_stack() as st:
        _, writer = await warm(st)
        writer.close()
        with left_for_the_collector() as left:
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
                writer.write(request(extra="Connection: close\r\n"))
                status, _, answer = await read_answer(reader)
                assert status == 200 and answer
                assert await reader.read() == b""  # the gateway closed its side
                writer.close()
        assert st.served == ["chat/completions"] * 4
    assert left == []


async def test_a_request_whose_client_left_mid_answer_leaves_nothing_for_the_cycle_collector(
) -> None:
    """Nor does a client that leaves before its answer ends: its request, its
    connection, and the engine's connection cut for it."""
    cut = asyncio.Event()

    async def never_answers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        if await r.read(1) == b"":
            cut.set()

    async with raw_engine_gateway(never_answers) as (_, writer, gw):
        with left_for_the_collector() as left:
            writer.write(request())
            await eventually(lambda: bool(gw.in_flight), "the request in flight")
            writer.close()
            await eventually(lambda: not gw.in_flight, "the replica freed")
            await asyncio.wait_for(cut.wait(), 30)
    assert left == []


async def test_a_client_gone_mid_answer_on_a_kept_connection_cuts_the_engines() -> None:
    cut = asyncio.Event()

    async def slow_second(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await write_answer(w)
        await read_request(r)  # the second, never answered: the gateway must cut it
        if await r.read(1) == b"":
            cut.set()

    async with raw_engine_gateway(slow_second) as (reader, writer, gw):
        writer.write(request())
        assert (await read_answer(reader))[0] == 200
        writer.write(request())
        await eventually(lambda: bool(gw.in_flight), "the request in flight")
        writer.close()
        await eventually(lambda: not gw.in_flight, "the replica freed")
        await asyncio.wait_for(cut.wait(), 30)
        samples = {
            (s.labels.get("status"), s.name): s.value
            for m in gw.metrics.registry.collect()
            for s in m.samples
        }
        assert samples[("499", "llmgw_requests_total")] == 1
        assert samples[("200", "llmgw_requests_total")] == 1


ANSWER = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


async def read_request(r: asyncio.StreamReader) -> bool:
    """Read one request of the gateway's, as an engine would; False: the connection ended."""
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    await r.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
    return True


async def write_answer(w: asyncio.StreamWriter) -> None:
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    w.write(b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
    await w.drain()


@asynccontextmanager
async def raw_engine_gateway(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter, Gateway]]:
    """A gateway whose one replica is ``handler``'s server, and a client connection to it."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    eport = server.sockets[0].getsockname()[1]
    directory = StaticDirectory([ModelInfo("tiny")])
    app = create_app(directory, RouterConfig())
    directory.add_endpoint("tiny", Endpoint("r0", f"http://127.0.0.1:{eport}", "k"))
    async with server, serve(app) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            yield reader, writer, app[GATEWAY_KEY]
        finally:
            writer.close()


async def test_an_engine_that_closes_a_kept_connection_as_it_is_reused_gets_a_new_one() -> None:
    # As uvicorn closing an idle connection just as the next request is written
    # on it: nothing was taken, so the request goes on a new connection.
    connections: list[int] = []

    async def answer_once(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(1)
        await read_request(r)
        await write_answer(w)
        await r.readuntil(b"\r\n\r\n")  # the next request: closed unanswered
        w.close()

    async with raw_engine_gateway(answer_once) as (reader, writer, gw):
        for _ in range(3):
            writer.write(request())
            status, _, body = await read_answer(reader)
            assert (status, body) == (200, ANSWER)
    assert len(connections) == 3  # one for each request after the first
    assert not gw.in_flight


async def test_an_answer_that_breaks_off_on_a_kept_connection_is_a_502() -> None:
    # The failed try is handled as the task path handles its own: the 502
    # aiohttp's path gives, and the next request on a new engine connection.
    requests_seen: list[int] = []

    async def answer_then_break(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await read_request(r):
            requests_seen.append(1)
            if len(requests_seen) == 2:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n" + ANSWER[:10])
                await w.drain()
                w.close()
                return
            await write_answer(w)

    answers = []
    async with raw_engine_gateway(answer_then_break) as (reader, writer, gw):
        for _ in range(3):
            writer.write(request())
            answers.append(await read_answer(reader))
    assert [a[0] for a in answers] == [200, 502, 200]
    error = json.loads(answers[1][2])["error"]
    assert error["code"] == "upstream_failed" and "Closed" in error["message"]
    assert answers[2][2] == ANSWER
    assert len(requests_seen) == 3  # the broken answer's request was not sent again
    assert not gw.in_flight


async def test_pipelined_requests_refused_at_once_are_all_answered_in_order(
    tmp_path: Path,
) -> None:
    # Refused by the quota, each is answered within the read of the one
    # before: a loop, not a call per request (no recursion to overflow).
    keyfile = tmp_path / "keys.json"
    k = add_key(keyfile, "alice", "t18phys").key
    directory = StaticDirectory([ModelInfo("tiny")])
    book = QuotaBook(QuotaConfig(requests_per_minute=1))
    app = create_app(directory, keys=KeyRing(keyfile), quota=book)
    auth = f"Authorization: Bearer {k}\r\n"
    async with engine("tiny", key="k0") as eurl, serve(app) as url:
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k0"))
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(request(extra=auth))
        assert (await read_answer(reader))[0] == 200
        n = 3000
        writer.write(b"".join(request(extra=auth) for _ in range(n)))
        statuses = [(await read_answer(reader))[0] for _ in range(n)]
        writer.close()
        assert statuses == [429] * n


async def test_shutdown_waits_for_an_answer_under_way_on_a_kept_connection() -> None:
    directory = StaticDirectory([ModelInfo("tiny")])
    app = create_app(directory, RouterConfig())
    async with engine("tiny", key="k", token_delay=0.1) as eurl:
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k"))
        runner = Runner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await runner.start("127.0.0.1", port)
        st = Stack("", port, app[GATEWAY_KEY])
        reader, writer = await warm(st)
        writer.write(request())
        await eventually(lambda: bool(st.gateway.in_flight), "the request in flight")
        cleanup = asyncio.create_task(runner.cleanup())
        status, _, body = await read_answer(reader)
        await cleanup
        writer.close()
        assert status == 200 and json.loads(body)["choices"]


@pytest.mark.parametrize("kept", [False, True], ids=["new-engine-conn", "kept-engine-conn"])
@pytest.mark.parametrize("after", [False, True], ids=["before-the-answer", "after-it"])
async def test_a_failure_in_the_path_answers_once_and_closes(
    after: bool, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with gateway_stack() as st:
        if kept:
            (await warm(st))[1].close()

        def broken(*_: object) -> None:
            raise RuntimeError("a bug")

        # Before: the client's answer is made from the engine's; after: the
        # request's metrics are taken once it was sent.
        if after:
            monkeypatch.setattr(st.gateway.metrics, "answered", broken)
        else:
            monkeypatch.setattr(Exchange, "_answer_whole", broken)
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(request())
        status, _, body = await read_answer(reader)
        rest = await reader.read()
        writer.close()
        assert status == (200 if after else 500), body
        assert rest == b""  # nothing after the one answer, and the connection closed


async def test_a_failure_counting_an_answer_sent_leaves_the_answer_and_the_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # On a kept engine connection the usage is counted once the answer is
    # written: a bug there is logged, the client has its answer and the
    # connection serves on.
    async with gateway_stack() as st:
        reader, writer = await warm(st)

        def broken(*_: object) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(st.gateway.metrics, "counted", broken)
        writer.write(request())
        first = await read_answer(reader)
        monkeypatch.undo()
        writer.write(request())
        second = await read_answer(reader)
        writer.close()
    assert (first[0], second[0]) == (200, 200)
    assert json.loads(first[2])["usage"]["total_tokens"] > 0
    assert "counting the usage of an answer of tiny failed" in caplog.text
    assert "RuntimeError: a bug" in caplog.text


async def test_an_answers_tokens_count_before_the_next_pipelined_request_is_let_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Settled after its answer is written, before the server takes the
    # connection's next request: the budget holds for requests sent back to
    # back as for any others. Each request holds 8 tokens (about 4 for its
    # prompt, 4 by max_tokens) and uses 5 (1 + 4): of 13, the second fits only
    # once the first has settled (5 used, nothing held), and the third does
    # not (10 used). The answers tell the limits as they stood when each
    # request was let in.
    keyfile = tmp_path / "keys.json"
    alice = add_key(keyfile, "alice", "t18phys").key
    bob = add_key(keyfile, "bob", "t18phys").key
    directory = StaticDirectory([ModelInfo("tiny")])
    app = create_app(
        directory, keys=KeyRing(keyfile), quota=QuotaBook(QuotaConfig(user_tokens_per_day=13))
    )
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    ).encode()
    async with engine("tiny", key="k0") as eurl, serve(app) as url:
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k0"))
        tasks: list[str] = []
        spawn = Exchange._spawn

        def noting(self: Exchange, step: Any) -> None:
            tasks.append(step.__name__)
            spawn(self, step)

        monkeypatch.setattr(Exchange, "_spawn", noting)
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        # Bob's request leaves a kept-alive connection to the engine.
        writer.write(request(body, extra=f"Authorization: Bearer {bob}\r\n"))
        assert (await read_answer(reader))[0] == 200
        writer.write(3 * request(body, extra=f"Authorization: Bearer {alice}\r\n"))
        answers = [await read_answer(reader) for _ in range(3)]
        writer.close()
    assert tasks == ["_connect"]  # alice's: answered from bob's kept connection
    first, second, third = answers
    assert first[0] == 200 and json.loads(first[2])["usage"]["total_tokens"] == 5
    assert first[1]["x-ratelimit-remaining-tokens"] == "13"
    assert second[0] == 200, second
    assert second[1]["x-ratelimit-remaining-tokens"] == "8"
    assert third[0] == 429, third
    assert json.loads(third[2])["error"]["code"] == "insufficient_quota"
    assert third[1]["x-ratelimit-remaining-tokens"] == "3"


# ---- strict with engines, as the client sees it --------------------------------------


@pytest.mark.parametrize(
    "name", ["two-lengths", "plus-length", "length-and-chunked", "unknown-coding", "obs-fold",
             "non-ascii-digit", "oversized-head", "truncated-chunk"],
)  # fmt: skip
async def test_an_engine_answer_with_framing_in_doubt_is_a_502_and_its_connection_goes(
    name: str,
) -> None:
    connections: list[int] = []
    closed = asyncio.Event()

    async def crafted_first(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(1)
        while await read_request(r):
            if len(connections) == 1:
                w.write(CRAFTED[name])
                await w.drain()
                if name == "truncated-chunk":
                    w.close()
                    closed.set()
                elif await r.read(1) == b"":  # the gateway sends nothing more here
                    closed.set()
                return
            await write_answer(w)

    async with raw_engine_gateway(crafted_first) as (reader, writer, gw):
        writer.write(request())
        status, _, body = await read_answer(reader)
        await asyncio.wait_for(closed.wait(), 30)
        writer.write(request())
        after = await read_answer(reader)
    error = json.loads(body)["error"]
    assert status == 502 and error["code"] == "upstream_failed", body
    assert (after[0], after[2]) == (200, ANSWER)
    assert len(connections) == 2  # never reused
    assert gw.metrics.registry.get_sample_value(
        "llmgw_upstream_errors_total", {"model": "tiny", "phase": "stream"}
    ) == 1


# ---- the server's own refusals --------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", "Host"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: 2\r\n\r\n{}",
         "Host"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n"
         b"Content-Length: 2\r\n\r\n{}", "Content-Length"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n" + b"X: " + b"y" * 70_000 + b"\r\n\r\n",
         "longer"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\n"
         b"Upgrade: h2c\r\nContent-Length: 2\r\n\r\n{}", "upgrade"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"zz\r\n", "chunk"),
    ],
    ids=["no-host", "two-hosts", "two-lengths", "long-head", "upgrade", "bad-chunk"],
)  # fmt: skip
async def test_a_request_the_parser_refuses_is_a_400_after_the_answers_ahead_then_the_close(
    bad: bytes, why: str
) -> None:
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(request() + bad + request())
        first = await read_answer(reader)
        second = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert first[0] == 200 and json.loads(first[2])["choices"]
    assert second[0] == 400 and why in json.loads(second[2])["error"]["message"], second
    assert second[1]["connection"] == "close" and rest == b""
    assert st.served == ["chat/completions"]


async def test_an_upgrade_without_a_body_is_answered_as_plain_http_then_the_close() -> None:
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\n"
                     b"Upgrade: h2c\r\n\r\n" + request())  # fmt: skip
        status, _, body = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert status == 200 and json.loads(body)["data"] and rest == b""


async def test_expect_100_continue_gets_its_go_ahead() -> None:
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        whole = request(extra="Expect: 100-continue\r\n")
        writer.write(whole[: whole.index(b"\r\n\r\n") + 4])
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(whole[whole.index(b"\r\n\r\n") + 4 :])
        status, _, body = await read_answer(reader)
        writer.close()
    assert status == 200 and json.loads(body)["choices"]


async def test_the_go_ahead_is_not_sent_for_a_body_that_came_with_its_head() -> None:
    # RFC 9110 10.1.1: a server may omit the 100 once it has the content; the
    # body's timer is armed only for a body still to come (after the read).
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(request(extra="Expect: 100-continue\r\n"))
        status, _, body = await read_answer(reader)
        writer.close()
    assert status == 200 and json.loads(body)["choices"]


async def test_a_pipelined_body_that_stops_coming_gets_408_after_the_answer_ahead() -> None:
    # The second request's body is waited for from when the first is answered
    # (outside any read): its timer is armed there too.
    async with gateway_stack(RouterConfig(body_timeout=0.2)) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(request() + request()[:-5])
        first = await read_answer(reader)
        second = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    assert first[0] == 200 and json.loads(first[2])["choices"]
    assert second[0] == 408 and json.loads(second[2])["error"]["code"] == "request_timeout"
    assert rest == b"" and st.served == ["chat/completions"]


# ---- framing, set against a reference parser ------------------------------------------


class _Transport(asyncio.Transport):
    """A client's connection as the server sees it: what it wrote, whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_protocol(self) -> asyncio.BaseProtocol:
        # Not a guarded connection (guard.Acceptor's): the server times no heads.
        return asyncio.Protocol()


class _Framed:
    """A gateway that notes each request the server hands it and answers at once;
    anything else asked of it fails."""

    config = RouterConfig()

    def __init__(self) -> None:
        self.framed: list[tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]] = []

    def serve(self, req: Request) -> None:
        headers = [(n.lower(), v) for n, v in req.raw_headers]
        self.framed.append((req.method.encode(), req.url, headers, bytes(req.body)))
        req.whole(200, {}, b"")
        req.finished()

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the server has no business with Gateway.{name}")


class _Runner:
    keepalive_timeout = 75.0

    def __init__(self) -> None:
        self.gateway = _Framed()
        self.connections: set[Any] = set()

    def settle(self, conn: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the server has no business with Runner.{name}")


Frames = list[tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]]


def ours(pieces: list[bytes]) -> tuple[Frames, bool]:
    """The requests the gateway's server frames from ``pieces``, and whether it refused."""
    from llmgw_slurm.router.server import Connection

    async def run() -> tuple[Frames, bool]:
        runner = _Runner()
        conn = Connection(runner)  # type: ignore[arg-type]
        transport = _Transport()
        conn.connection_made(transport)
        for piece in pieces:
            conn.data_received(piece)
        conn.connection_lost(None)
        return runner.gateway.framed, b" 400 " in transport.out

    return asyncio.run(run())


def reference(data: bytes) -> tuple[Frames, bool]:
    """The same, by h11 (a reference HTTP/1.1 parser, pure Python)."""
    import h11

    c = h11.Connection(h11.SERVER)
    c.receive_data(data)
    out: Frames = []
    body = b""
    try:
        while True:
            ev = c.next_event()
            if ev is h11.NEED_DATA:
                return out, False
            if ev is h11.PAUSED:
                c.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                c.send(h11.EndOfMessage())
                c.start_next_cycle()
            elif isinstance(ev, h11.Request):
                out.append((ev.method, ev.target, list(ev.headers), b""))
                body = b""
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                method, target, headers, _ = out[-1]
                out[-1] = (method, target, headers, body)
    except h11.RemoteProtocolError:
        return out, True


# What a request is made of: (bytes, strict) pieces, where strict marks what the
# gateway refuses and h11 takes (RFC 9110/9112 let a recipient refuse each: a
# folded line, Content-Length beside Transfer-Encoding, a repeated
# Content-Length, a bare LF line end, a control character in a value).
_TARGETS = [b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings?x=1", b"/v1/chat/completions#f",
            b"/v1/completions sp", b"/v1/\x7fx"]  # fmt: skip
_NAMES = [b"Host", b"X-Request-Id", b"Accept", b"x", b"Ho st", b"X:Y", b"", b"\xc3\xa9"]
_VALUES = [b"a", b" a ", b"\ta", b"", b"a\x00b", b"\xc3\xa9", b"k=v; q=1", b"a\rb"]
# Control characters in a value: RFC 9110 5.5 lets a recipient refuse them; h11 takes some.
_CONTROLS = [b"a\x01", b"\x7fa", b"a\x1fb"]


@st.composite
def _request(draw: st.DrawFn) -> tuple[bytes, bool]:
    strict = False
    eol = b"\r\n"
    if draw(st.integers(0, 30)) == 0:
        eol, strict = b"\n", True
    target = draw(st.sampled_from(_TARGETS))
    lines = [b"POST " + target + b" HTTP/1.1"]
    hosts = draw(st.sampled_from([1, 1, 1, 1, 0, 2]))
    lines += [b"Host: gw%d" % i for i in range(hosts)]
    for _ in range(draw(st.integers(0, 3))):
        lines.append(draw(st.sampled_from(_NAMES)) + b":" + draw(st.sampled_from(_VALUES)))
        if draw(st.integers(0, 20)) == 0:
            lines.append(b"X-Control: " + draw(st.sampled_from(_CONTROLS)))
            strict = True
        if draw(st.integers(0, 20)) == 0:
            lines.append(b" folded")
            strict = True
    body = draw(st.binary(max_size=40))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "bad-length",
                                    "twice", "both", "bad-coding", "bad-chunk"]))  # fmt: skip
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(body[i : i + 7]), body[i : i + 7])
                      for i in range(0, len(body), 7)) + b"0\r\n\r\n"  # fmt: skip
    if framing in ("length", "twice", "both"):
        lines.append(b"Content-Length: %d" % len(body))
    if framing == "twice":
        lines.append(b"Content-Length: %d" % len(body))
        strict = True
    if framing == "bad-length":
        lines.append(draw(st.sampled_from([b"Content-Length: +1", b"Content-Length: 1_0",
                                           b"Content-Length: -1", b"Content-Length: 0x1"])))  # fmt: skip
    if framing in ("chunked", "both", "bad-chunk"):
        lines.append(b"Transfer-Encoding: chunked")
        strict = strict or framing == "both"
    if framing == "bad-coding":
        lines.append(b"Transfer-Encoding: gzip")
    payload = {"length": body, "twice": body, "both": chunks, "chunked": chunks,
               "bad-chunk": b"-1\r\nx\r\n0\r\n\r\n"}.get(framing, b"")  # fmt: skip
    return eol.join(lines) + eol + eol + payload, strict


@settings(max_examples=500, deadline=None)
@given(st.lists(_request(), min_size=1, max_size=4), st.lists(st.integers(1, 400), max_size=6))
def test_pipelined_requests_are_framed_as_the_reference_parser_frames_them(
    requests: list[tuple[bytes, bool]], cuts: list[int]
) -> None:
    """Whatever requests the gateway's server hands on, h11 reads the same
    (method, target, headers, body), in the same order, however the bytes
    are split across reads; what h11 refuses, the server refuses too, never
    later. Where the server stops before h11, it is on a request that has
    something RFC 9112 lets a server refuse (the strict pieces)."""
    data = b"".join(r for r, _ in requests)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in itertools.pairwise(points) if b > a]
    got, refused = ours(pieces)
    want, ref_refused = reference(data)
    assert got == want[: len(got)]
    if ref_refused:
        assert refused and len(got) <= len(want)
    elif len(got) < len(want) or refused:
        assert refused and requests[len(got)][1], (got, want)
    else:
        assert got == want


def _long_request(size: int) -> bytes:
    """A request whose head is about ``size`` bytes, in a header of its own."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
    pad = size - len(head) - len(b"X: \r\n\r\n")
    return head + b"X: " + b"y" * pad + b"\r\n\r\n{}"


@pytest.mark.parametrize("piece", [1 << 20, 4096, 100], ids=["one-read", "4k-reads", "100b-reads"])
def test_a_head_is_held_to_its_limit_however_it_is_read(piece: int) -> None:
    # A head in one read shorter than the limit is not measured header by
    # header (server._may_be_long); one that spans reads, or a read longer
    # than the limit, is.
    over, under = _long_request(http1.MAX_HEAD + 100), _long_request(http1.MAX_HEAD - 100)
    for data, refused in ((over, True), (under, False)):
        pieces = [data[i : i + piece] for i in range(0, len(data), piece)]
        framed, was_refused = ours(pieces)
        assert was_refused is refused and len(framed) == (0 if refused else 1), piece


def test_a_short_head_after_a_long_body_in_one_read_is_taken() -> None:
    # The read is longer than the limit, the head in it is not.
    body = b"x" * (http1.MAX_HEAD + 10)
    first = request(body, "/v1/embeddings")
    framed, refused = ours([first + request()])
    assert not refused and [f[3] for f in framed] == [body, CHAT]


def test_the_go_ahead_goes_only_to_a_body_still_to_come() -> None:
    from llmgw_slurm.router.server import Connection

    async def run(pieces: list[bytes]) -> bytes:
        conn = Connection(_Runner())  # type: ignore[arg-type]
        transport = _Transport()
        conn.connection_made(transport)
        for piece in pieces:
            conn.data_received(piece)
        conn.connection_lost(None)
        return bytes(transport.out)

    whole = request(extra="Expect: 100-continue\r\n")
    cut = whole.index(b"\r\n\r\n") + 4
    go_ahead = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert asyncio.run(run([whole])).startswith(b"HTTP/1.1 200 ")
    assert asyncio.run(run([whole[:cut], whole[cut:]])).startswith(go_ahead + b"HTTP/1.1 200 ")


async def test_aiohttps_routes_head_and_get_pipelined_with_the_request_path() -> None:
    # A HEAD's answer has no body to wait for; the requests behind it are
    # answered in order, by whichever side serves each.
    async with gateway_stack() as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.port)
        writer.write(
            b"HEAD /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
            + request()
            + b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
            + request()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        chat = await read_answer(reader)
        models = await read_answer(reader)
        again = await read_answer(reader)
        writer.close()
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length" in head
    assert chat[0] == again[0] == models[0] == 200
    assert json.loads(chat[2])["choices"] and json.loads(models[2])["data"]
    assert st.served == ["chat/completions"] * 2


async def test_behind_the_daemons_accept_loop_a_later_head_is_timed_too() -> None:
    # The accept loop (guard.Acceptor) times a connection's first head; the
    # server times each later one from when the connection is idle again, so a
    # kept-alive connection cannot hold a place by trickling a head forever.
    from llmgw_slurm.guard import Acceptor, ConnectionLimiter, bind_listeners

    directory = StaticDirectory([ModelInfo("tiny")])
    app = create_app(directory, RouterConfig())
    runner = Runner(app)
    await runner.setup()
    lim = ConnectionLimiter("gateway", total=100, per_peer=100, head_timeout=0.5)
    acc = Acceptor(bind_listeners("127.0.0.1", 0), runner.protocol, lim)
    acc.start()
    try:
        async with engine("tiny", key="k") as eurl:
            directory.add_endpoint("tiny", Endpoint("r0", eurl, "k"))
            assert acc.port is not None
            reader, writer = await asyncio.open_connection("127.0.0.1", acc.port)
            writer.write(request())
            status, _, _ = await read_answer(reader)
            assert status == 200
            # A second whole request on the kept connection is served as usual.
            writer.write(request())
            status, _, _ = await read_answer(reader)
            assert status == 200
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")  # never ends
            assert await asyncio.wait_for(reader.read(), 30) == b""
            assert lim.refused["head_timeout"] == 1
            writer.close()
    finally:
        acc.stop_accepting()
        await runner.cleanup()
        acc.abort_all()
