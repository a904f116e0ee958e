"""The gateway's fast lane: what it serves itself, and that everything else
reaches aiohttp whole (router/fastlane.py). Every other router test runs
through the lane too: ``_router_support.serve`` serves a gateway app with it,
as the daemon does."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import openai
import pytest
from _router_support import engine, eventually, free_port, serve
from aiohttp import web
from aiohttp.http_parser import HttpRequestParser
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_slurm.config import QuotaConfig
from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
    fastlane,
)
from llmgw_slurm.router.fastlane import parse_head
from llmgw_slurm.router.gateway import LaneCall, LaneClient, LanePlan
from llmgw_slurm.router.keys import KeyRing, add_key
from llmgw_slurm.router.quota import QuotaBook
from llmgw_slurm.tls import client_context, load_or_create_identity, make_engine_tls

CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()


@dataclass
class Lane:
    url: str
    port: int
    gateway: Gateway
    served: list[str] = field(default_factory=list)  # endpoints the lane answered


@asynccontextmanager
async def lane_stack(
    config: RouterConfig | None = None,
    token_delay: float = 0.0,
    ssl_context: ssl.SSLContext | None = None,
    keepalive_timeout: float | None = None,
) -> AsyncIterator[Lane]:
    directory = StaticDirectory([ModelInfo("tiny")])
    app = create_app(directory, config or RouterConfig())
    gw = app[GATEWAY_KEY]
    async with AsyncExitStack() as es:
        url = await es.enter_async_context(
            serve(app, ssl_context=ssl_context, keepalive_timeout=keepalive_timeout)
        )
        eurl = await es.enter_async_context(engine("tiny", key="k", token_delay=token_delay))
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k"))
        lane = Lane(url, int(url.rsplit(":", 1)[1]), gw)
        sent = gw.lane_send

        def counting(plan: LanePlan, client: LaneClient) -> LaneCall | None:
            lane.served.append(plan.endpoint)
            return sent(plan, client)

        gw.lane_send = counting  # type: ignore[method-assign]
        yield lane


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


async def test_plain_chat_and_a_stream_are_served_by_the_lane_a_traced_stream_by_aiohttp() -> None:
    async with (
        lane_stack() as lane,
        openai.AsyncOpenAI(api_key="x", base_url=lane.url + "/v1", max_retries=0) as c,
    ):
        raw = await c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
        answer = raw.parse()
        assert answer.choices[0].message.content and answer.usage is not None
        assert raw.headers["x-llmgw-replica"] == "r0"
        assert lane.served == ["chat/completions"]

        async def streamed(headers: dict[str, str]) -> tuple[str, Any, dict[str, str]]:
            got = await c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True}, extra_headers=headers,
            )  # fmt: skip
            chunks = [ch async for ch in got.parse()]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            return text, chunks[-1].usage, dict(got.headers)

        # A stream on the same client (the same kept-alive connection): the lane's.
        text, usage, headers = await streamed({})
        assert lane.served == ["chat/completions"] * 2
        assert headers["x-llmgw-replica"] == "r0"
        assert headers["content-type"].startswith("text/event-stream")
        # A traced one (it carries a context): aiohttp's, with the same answer.
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        traced = await streamed({"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
        assert lane.served == ["chat/completions"] * 2
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


async def test_the_lane_and_the_hand_off_over_tls(tmp_path: Path) -> None:
    # The gateway's port may serve TLS (server.yaml's tls:): the lane then sits
    # behind the TLS transport, and a hand-off moves aiohttp behind it too.
    client_id = load_or_create_identity(tmp_path)
    pair = make_engine_tls(client_id.cert_pem, "gateway")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pair.identity.cert_file, pair.identity.key_file)
    trust = client_context(pair.identity.cert_pem, client_id.cert_file, client_id.key_file)
    try:
        async with lane_stack(ssl_context=server) as lane:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", lane.port, ssl=trust, server_hostname="127.0.0.1"
            )
            writer.write(request())
            plain = await read_answer(reader)
            streamed = json.dumps({**json.loads(CHAT), "stream": True}).encode()
            writer.write(request(streamed))
            stream = await read_answer(reader)
            assert lane.served == ["chat/completions"] * 2
            # A traced stream goes to aiohttp, on the same connection.
            ctx = "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
            writer.write(request(streamed, extra=ctx))
            traced = await read_answer(reader)
            writer.close()
            assert plain[0] == stream[0] == traced[0] == 200
            assert json.loads(plain[2])["choices"]
            assert stream[2].rstrip().endswith(b"data: [DONE]")
            assert _events(stream[2]) == _events(traced[2])
            assert lane.served == ["chat/completions"] * 2
    finally:
        shutil.rmtree(pair.directory, ignore_errors=True)


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with lane_stack() as lane:
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        completion = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
        writer.write(request() + request(completion, "/v1/completions"))
        first = await read_answer(reader)
        second = await read_answer(reader)
        writer.close()
        assert first[0] == second[0] == 200
        assert json.loads(first[2])["object"] == "chat.completion"
        assert json.loads(second[2])["object"] == "text_completion"
        assert lane.served == ["chat/completions", "completions"]


async def test_a_body_sent_after_its_head_is_waited_for() -> None:
    # As the OpenAI client's HTTP library writes them: the head, then the body.
    async with lane_stack() as lane:
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        whole = request()
        writer.write(whole[: whole.index(b"\r\n\r\n") + 4])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(whole[whole.index(b"\r\n\r\n") + 4 :])
        status, _, body = await read_answer(reader)
        writer.close()
        assert status == 200 and json.loads(body)["choices"]
        assert lane.served == ["chat/completions"]


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        # Chunked: aiohttp reads it (and the gateway answers it).
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
async def test_what_the_lane_does_not_take_reaches_aiohttp_whole(
    data: bytes, status: int, code: str | None
) -> None:
    async with lane_stack() as lane:
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        writer.write(data)
        got, _, body = await read_answer(reader)
        # The connection is aiohttp's now, and stays usable.
        writer.write(request())
        after, _, _ = await read_answer(reader)
        writer.close()
        assert got == status, body
        if code is not None:
            assert json.loads(body)["error"]["code"] == code
        assert after == 200
        assert lane.served == []


async def test_a_body_that_stops_coming_gets_408_and_the_connection_closes() -> None:
    async with lane_stack(RouterConfig(body_timeout=0.2)) as lane:
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        writer.write(request()[:-5])
        status, headers, body = await read_answer(reader)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert headers["connection"] == "close"
        assert await reader.read() == b""
        writer.close()
        assert lane.served == []


async def test_an_idle_connection_closes_a_keep_alive_after_its_last_answer() -> None:
    # The lane's keep-alive timer is armed once and left running across
    # requests: it must count from the last answer, not the first.
    async with lane_stack(keepalive_timeout=1.0) as lane:
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        for _ in range(3):
            writer.write(request())
            assert (await read_answer(reader))[0] == 200
            await asyncio.sleep(0.7)  # 1.4 s after the first answer, by the third request
        assert lane.served == ["chat/completions"] * 3
        # Then idle: closed by the lane's timer (the read sees the end).
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()


async def test_a_client_gone_mid_answer_frees_the_replica() -> None:
    async with lane_stack(token_delay=0.2) as lane:
        _, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        writer.write(request())
        await eventually(lambda: bool(lane.gateway.in_flight), "the request in flight")
        writer.close()
        await eventually(lambda: not lane.gateway.in_flight, "the replica freed")
        assert lane.served == ["chat/completions"]
        samples = {
            (s.labels.get("status"), s.name): s.value
            for m in lane.gateway.metrics.registry.collect()
            for s in m.samples
        }
        assert samples[("499", "llmgw_requests_total")] == 1


async def warm(lane: Lane) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection whose first request left a kept-alive engine connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
    writer.write(request())
    assert (await read_answer(reader))[0] == 200
    return reader, writer


async def test_a_kept_engine_connection_answers_without_the_task_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with lane_stack() as lane:
        served: list[LanePlan] = []
        task_path = lane.gateway.serve_lane

        async def counting(plan: LanePlan, *rest: Any) -> None:
            served.append(plan)
            await task_path(plan, *rest)

        monkeypatch.setattr(lane.gateway, "serve_lane", counting)
        reader, writer = await warm(lane)
        for _ in range(3):
            writer.write(request())
            status, headers, body = await read_answer(reader)
            assert status == 200 and json.loads(body)["choices"]
            assert headers["x-llmgw-replica"] == "r0"
        writer.close()
        # The first request made the engine connection (in a task); the rest reused it.
        assert len(served) == 1
        assert lane.served == ["chat/completions"] * 4
        assert not lane.gateway.in_flight


async def test_a_client_gone_mid_answer_on_a_kept_connection_cuts_the_engines() -> None:
    async with lane_stack(token_delay=0.2) as lane:
        _, writer = await warm(lane)
        assert lane.gateway._whole is not None
        (idle,) = lane.gateway._whole._idle.values()
        (conn,) = idle
        writer.write(request())
        await eventually(lambda: bool(lane.gateway.in_flight), "the request in flight")
        writer.close()
        await eventually(lambda: not lane.gateway.in_flight, "the replica freed")
        await eventually(lambda: conn.closed, "the engine's connection cut")
        samples = {
            (s.labels.get("status"), s.name): s.value
            for m in lane.gateway.metrics.registry.collect()
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
        runner = fastlane.Runner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        lane = Lane("", port, app[GATEWAY_KEY])
        reader, writer = await warm(lane)
        writer.write(request())
        await eventually(lambda: bool(lane.gateway.in_flight), "the request in flight")
        cleanup = asyncio.create_task(runner.cleanup())
        status, _, body = await read_answer(reader)
        await cleanup
        writer.close()
        assert status == 200 and json.loads(body)["choices"]


@pytest.mark.parametrize("kept", [False, True], ids=["new-engine-conn", "kept-engine-conn"])
@pytest.mark.parametrize("after", [False, True], ids=["before-the-answer", "after-it"])
async def test_a_failure_in_the_lane_answers_once_and_closes(
    after: bool, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with lane_stack() as lane:
        if kept:
            (await warm(lane))[1].close()

        def broken(*_: object) -> None:
            raise RuntimeError("a bug")

        # Before: the client's answer is made from the engine's; after: the
        # request's metrics are taken once it was sent.
        if after:
            monkeypatch.setattr(lane.gateway.metrics, "answered", broken)
        else:
            monkeypatch.setattr(lane.gateway, "_whole_answer", broken)
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
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
    async with lane_stack() as lane:
        reader, writer = await warm(lane)

        def broken(*_: object) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(lane.gateway.metrics, "counted", broken)
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
    tmp_path: Path,
) -> None:
    # Settled after its answer is written, before the lane takes the
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
        kept: list[bool] = []
        sent = app[GATEWAY_KEY].lane_send

        def noting(plan: LanePlan, client: LaneClient) -> LaneCall | None:
            call = sent(plan, client)
            kept.append(call is not None)
            return call

        app[GATEWAY_KEY].lane_send = noting  # type: ignore[method-assign]
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        # Bob's request leaves a kept-alive connection to the engine.
        writer.write(request(body, extra=f"Authorization: Bearer {bob}\r\n"))
        assert (await read_answer(reader))[0] == 200
        writer.write(3 * request(body, extra=f"Authorization: Bearer {alice}\r\n"))
        answers = [await read_answer(reader) for _ in range(3)]
        writer.close()
    assert kept[1:3] == [True, True]  # answered from the kept connection
    first, second, third = answers
    assert first[0] == 200 and json.loads(first[2])["usage"]["total_tokens"] == 5
    assert first[1]["x-ratelimit-remaining-tokens"] == "13"
    assert second[0] == 200, second
    assert second[1]["x-ratelimit-remaining-tokens"] == "8"
    assert third[0] == 429, third
    assert json.loads(third[2])["error"]["code"] == "insufficient_quota"
    assert third[1]["x-ratelimit-remaining-tokens"] == "3"


async def test_fast_lane_false_serves_everything_through_aiohttp() -> None:
    async with lane_stack(RouterConfig(fast_lane=False)) as lane:
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        writer.write(request())
        status, _, _ = await read_answer(reader)
        writer.close()
        assert status == 200
        assert lane.served == []


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"


def test_parse_head_takes_a_plain_request() -> None:
    head = parse_head(HEAD, 100)
    assert head is not None
    assert (head.endpoint, head.length, head.size) == ("chat/completions", 5, len(HEAD) - 5)
    assert head.headers["host"] == "x"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"POST", b"GET"),
        (b"HTTP/1.1", b"HTTP/1.0"),
        (b"/v1/chat/completions", b"/v1/chat/completions?x=1"),
        (b"Host: x", b"Host: x\r\n folded"),
        (b"Host: x", b"Transfer-Encoding: chunked"),
        (b"Host: x", b"Content-Length: 5"),  # two lengths
        (b"Host: x", b"Ho st: x"),
        (b"Host: x", b"Host: \xc3\xa9"),
        (b"Host: x\r\n", b"Host: x\n"),  # a bare LF
        (b"Host: x", b"Host: x\ry"),  # a bare CR
        (b"Host: x", b"Host: x\x01"),
        (b"Content-Length: 5", b"Content-Length: +5"),
        (b"Content-Length: 5", b"Content-Length: 500"),  # past max_body
        (b"Content-Length: 5\r\n", b""),  # no length
        (b"Host: x", b"Connection: close"),
        (b"Host: x", b"Expect: 100-continue"),
        (b"Host: x", b"Content-Encoding: gzip"),
        (b"Host: x", b"Upgrade: h2c"),
        (b"Host: x\r\n", b""),  # no Host: aiohttp's 400
        (b"Host: x", b"Host: x\r\nhost: y"),  # two
        (b"\r\n\r\n", b"\r\n"),  # the head not whole
    ],
)
def test_parse_head_leaves_anything_else_to_aiohttp(old: bytes, new: bytes) -> None:
    assert old in HEAD
    assert parse_head(HEAD.replace(old, new, 1), 100) is None


# Pieces a header line is made of in the property test below: names, values,
# and what aiohttp and the lane must both refuse or both read alike.
_PIECES = [
    b"Host", b"X-Request-Id", b"Authorization", b"Content-Length", b"Connection",
    b"Transfer-Encoding", b"Accept", b"a", b"5", b"+5", b"keep-alive", b"close",
    b"chunked", b"Bearer k", b":", b" ", b"\t", b"\r", b"\n", b"\x00", b"\x7f",
    b"\xc3\xa9", b"(", b"\"", b"/", b"=",
]  # fmt: skip


@settings(max_examples=1000)
@given(
    st.lists(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6), max_size=6),
    st.booleans(),
)
def test_a_head_the_lane_takes_is_read_by_aiohttp_alike(
    lines: list[list[bytes]], host: bool
) -> None:
    """Whatever head the lane takes, aiohttp's own parser (the one the rest of
    the gateway's requests go through) takes too, with the same headers."""
    fields = [b"".join(pieces) for pieces in lines] + [b"Content-Length: 5"]
    fields += [b"Host: gw"] if host else []
    head = b"POST /v1/chat/completions HTTP/1.1\r\n" + b"\r\n".join(fields) + b"\r\n\r\n"
    took = parse_head(head + b"hello", 100)
    if took is None:
        return
    loop = asyncio.new_event_loop()
    try:
        parser = HttpRequestParser(mock.Mock(), loop, 2**16)
        messages, _, _ = parser.feed_data(head + b"hello")
    finally:
        loop.close()
    ((message, _),) = messages
    assert message.method == "POST" and message.path == "/v1/chat/completions"
    # Names compared as the case-insensitive things they are: aiohttp's parser
    # spells a name it knows its own way (X-Request-ID for X-Request-Id).
    assert [(k.lower(), v) for k, v in message.headers.items()] == [
        (k.lower(), v) for k, v in took.headers.items()
    ]
    assert took.length == 5 and took.size == len(head)
