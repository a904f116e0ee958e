"""The gateway's fast lane: what it serves itself, and that everything else
reaches aiohttp whole (router/fastlane.py). Every other router test runs
through the lane too: ``_router_support.serve`` serves a gateway app with it,
as the daemon does."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from _router_support import engine, eventually, serve

from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
)
from llmgw_slurm.router.fastlane import parse_head
from llmgw_slurm.router.gateway import Client, Deliver, LanePlan
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
        served = gw.serve_lane

        async def counting(plan: LanePlan, client: Client, deliver: Deliver) -> None:
            lane.served.append(plan.endpoint)
            await served(plan, client, deliver)

        gw.serve_lane = counting  # type: ignore[method-assign]
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


async def test_plain_chat_is_served_by_the_lane_and_a_stream_by_aiohttp() -> None:
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
        # A stream on the same client (the same kept-alive connection): aiohttp's.
        stream = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text
        assert lane.served == ["chat/completions"]
        emb = await c.embeddings.create(model="tiny", input="hi")
        assert emb.data


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
            writer.close()
            assert plain[0] == stream[0] == 200
            assert json.loads(plain[2])["choices"]
            assert stream[2].rstrip().endswith(b"data: [DONE]")
            assert lane.served == ["chat/completions"]
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


@pytest.mark.parametrize("after", [False, True], ids=["before-the-answer", "after-it"])
async def test_a_failure_in_the_lane_answers_once_and_closes(
    after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with lane_stack() as lane:

        def broken(*_: object) -> None:
            raise RuntimeError("a bug")

        # Before: the answer's usage is counted before it is sent; after: the
        # request's metrics are taken once it was.
        where = "answered" if after else "counted"
        monkeypatch.setattr(lane.gateway.metrics, where, broken)
        reader, writer = await asyncio.open_connection("127.0.0.1", lane.port)
        writer.write(request())
        status, _, body = await read_answer(reader)
        rest = await reader.read()
        writer.close()
        assert status == (200 if after else 500), body
        assert rest == b""  # nothing after the one answer, and the connection closed


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
        (b"\r\n\r\n", b"\r\n"),  # the head not whole
    ],
)
def test_parse_head_leaves_anything_else_to_aiohttp(old: bytes, new: bytes) -> None:
    assert old in HEAD
    assert parse_head(HEAD.replace(old, new, 1), 100) is None
