"""The gateway under hostile clients: wrong types, unknown fields, huge bodies, slow
clients, clients that vanish mid-stream, and a hypothesis fuzz of request bodies.

The gateway and a test engine run for real on localhost ports. "Not the
gateway's fault" is defined strictly: every answer below 500, except a 5xx the
engine itself sent (the test engine sends none for any of these inputs).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from _router_support import engine, eventually, free_port, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router import post, stack  # type: ignore[import-not-found]

from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
)
from llmgw_slurm.router.server import Runner

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    "body",
    [
        {"model": 5, "messages": []},
        {"model": ["tiny"], "messages": []},
        {"model": {"$ne": None}},
        {"model": None},
        {"model": "", "messages": []},
        {"model": "tiny", "messages": "hello"},
        {"model": "tiny", "messages": [{"role": 1, "content": "x"}]},
        {"model": "tiny", "messages": [{"role": "user", "content": {"a": 1}}]},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "10"},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3},
        # Engines read these as true (pydantic's lax bools) and stream without the
        # usage the gateway asks for when it knows a stream is coming.
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": 1},
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": "all",
        },
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": [],
        },
        {"model": "tiny-chat\u0000", "messages": []},
        {"model": "../../etc/passwd", "messages": []},
        {"model": "x" * 100_000, "messages": []},
    ],
)
async def test_wrong_types_are_client_errors(body: dict[str, Any]) -> None:
    async with stack() as st_:
        status, answer, _ = await post(st_.url + CHAT, body)
    assert 400 <= status < 500, (status, answer)
    assert isinstance(answer.get("error"), dict), answer
    assert isinstance(answer["error"].get("message"), str)


async def test_unknown_fields_pass_through_to_the_engine_untouched() -> None:
    async with stack() as st_:
        body = {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "hello there"}],
            "x_unknown": {"nested": [1, 2, 3]},
            "logit_bias": {"1": 5},
            "user": "\u202eevil",
        }
        status, answer, _ = await post(st_.url + CHAT, body)
        assert status == 200, answer
        seen = await st_.engine_get("r0", "/debug/last-body")
    assert seen["x_unknown"] == {"nested": [1, 2, 3]}  # type: ignore[index]
    assert seen["user"] == "\u202eevil"  # type: ignore[index]
    assert seen["model"] == "tiny"  # type: ignore[index]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"null",
        b'"tiny"',
        b"1e999999",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "tiny", "messages": [' + b"{" * 50_000,
        '{"model": "tiny"}'.encode("utf-16"),
        b'{"model": "\xff\xfe"}',
        b'{"model": "tiny", "messages": [], "a": NaN}',
    ],
    ids=["empty", "null", "string", "huge-number", "deep", "unclosed", "utf16", "bad-utf8", "nan"],
)
async def test_malformed_bodies_are_400(raw: bytes) -> None:
    async with stack() as st_, aiohttp.ClientSession() as s:
        r = await s.post(st_.url + CHAT, data=raw, headers={"Content-Type": "application/json"})
        status = r.status
        text = await r.text()
    assert 400 <= status < 500, (status, text[:300])
    assert isinstance(json.loads(text).get("error"), dict)


async def test_a_huge_body_is_refused_before_it_is_read_and_the_gateway_goes_on() -> None:
    cfg = RouterConfig(max_body_bytes=1024 * 1024)
    async with stack(config=cfg) as st_:
        huge = b'{"model": "tiny", "prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}'
        async with aiohttp.ClientSession() as s:
            # A Content-Length above the limit: 413 without reading the body.
            r = await s.post(st_.url + "/v1/completions", data=huge)
            assert r.status == 413

            async def trickle() -> Any:
                for i in range(0, len(huge), 1024 * 1024):
                    yield huge[i : i + 1024 * 1024]

            # Chunked, no length: refused once the limit is passed while reading.
            with contextlib.suppress(aiohttp.ClientError):
                r = await s.post(st_.url + "/v1/completions", data=trickle())
                assert r.status == 413
        ok = await st_.client().completions.create(model="tiny", prompt="still here")
    assert ok.choices[0].text


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


async def test_slow_loris_clients_do_not_hold_back_others() -> None:
    """Connections that send a request a byte at a time, or stop half way, while others
    are served; the gateway stays within its open files and answers everyone else."""
    async with stack() as st_:
        loop = asyncio.get_running_loop()
        socks: list[socket.socket] = []
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            'Content-Length: 100000\r\n\r\n{"model": "tiny", '
        ).encode()
        for i in range(200):
            s = await loop.run_in_executor(None, _connect, st_.url)
            # Half of them stop inside the headers, half inside the body.
            s.sendall(head[: 20 + i % 40] if i % 2 else head)
            socks.append(s)
        try:
            for _ in range(20):
                r = await st_.client().chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "fast client"}]
                )
                assert r.choices[0].message.content
            # Served while every slow client still waits, unanswered and connected:
            # the slow ones did not hold the fast ones back.
            for s in socks:
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    s.recv(1)
        finally:
            for s in socks:
                s.close()


async def test_client_vanishing_mid_stream_leaves_nothing_in_flight() -> None:
    # Draining off: the engine must be idle at once. By default a client gone is
    # read on for its usage first (test_router_usage_after_disconnect.py).
    async with stack(token_delay=0.02, config=RouterConfig(drain_after_disconnect=0)) as st_:
        for n in range(20):
            async with aiohttp.ClientSession() as s:
                r = await s.post(
                    st_.url + CHAT,
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "go on"}],
                        "stream": True,
                        "max_tokens": 10_000,
                    },
                )
                # Read a few chunks, then drop the connection without a goodbye.
                for _ in range(1 + n % 3):
                    await r.content.readany()
                r.connection.transport.abort()  # type: ignore[union-attr]
        await eventually(lambda: not st_.gateway.in_flight, "no request left in flight")

        async def engine_idle() -> bool:
            stats = await st_.engine_get("r0", "/debug/stats")
            return stats["in_flight"] == 0  # type: ignore[index, no-any-return]

        for _ in range(3000):
            if await engine_idle():
                break
            await asyncio.sleep(0.01)
        assert await engine_idle()
        assert st_.gateway.held_total == 0


# ---- the fuzz: a gateway and an engine in a thread of their own ---------------------


class _Served:
    def __init__(self) -> None:
        self.url = ""
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def main(self) -> None:
        directory = StaticDirectory([ModelInfo("tiny", aliases=("tiny-chat",))])
        directory.add_model("cold", hold_timeout_s=0.2)  # never ready: held, then 503
        app = create_app(directory, RouterConfig(max_body_bytes=64 * 1024))
        async with engine("tiny", key="k") as eurl, serve(app) as url:
            directory.add_endpoint("tiny", Endpoint("r0", eurl, "k"))
            self.gateway = app[GATEWAY_KEY]
            self.url = url
            self.stop = asyncio.Event()
            self.loop = asyncio.get_running_loop()
            self.ready.set()
            await self.stop.wait()


@pytest.fixture(scope="module")
def served() -> Iterator[_Served]:
    s = _Served()
    t = threading.Thread(target=asyncio.run, args=(s.main(),), daemon=True)
    t.start()
    assert s.ready.wait(30)
    yield s
    assert s.loop is not None and s.stop is not None
    s.loop.call_soon_threadsafe(s.stop.set)
    t.join(30)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | st.integers()},
    optional={"content": st.text(max_size=60) | _json, "name": _json},
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "tiny-chat", "cold", "nope", ""]) | _json,
        "messages": st.lists(_message, max_size=3) | _json,
        "prompt": st.text(max_size=60) | _json,
        "input": st.text(max_size=60) | _json,
        "stream": st.booleans() | _json,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json}) | _json,
        "max_tokens": st.integers(min_value=-5, max_value=50) | _json,
        "n": st.integers(min_value=0, max_value=3),
        "temperature": _json,
        "x_extra": _json,
    },
)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=_body,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
)
def test_fuzzed_requests_get_no_5xx_from_the_gateway(
    served: _Served, body: dict[str, Any], path: str
) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    # "cold" is held past its deadline: a 503 with Retry-After is the specified answer.
    if r.status == 503 and r.getheader("Retry-After"):
        return
    assert r.status < 500, (r.status, data[:500])
    if r.status >= 400:
        assert isinstance(json.loads(data).get("error"), dict), data[:500]


# ---- slow clients are cut off, not held forever ----------------------------------


async def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    got = b""
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            await asyncio.sleep(0.05)
            continue
        if not chunk:
            return got
        got += chunk
    return None


async def test_a_client_stalled_in_its_headers_is_disconnected() -> None:
    from llmgw_slurm.daemon import RUNNER_OPTIONS

    # The daemon's listeners close a connection that has not sent a whole request
    # within the keep-alive timeout (aiohttp's own default is an hour).
    assert 0 < RUNNER_OPTIONS["keepalive_timeout"] <= 120
    opts = {**RUNNER_OPTIONS, "keepalive_timeout": 1.0}
    app = create_app(StaticDirectory([ModelInfo("tiny")]), RouterConfig())
    runner = Runner(app, **opts)  # the daemon's, for the gateway
    await runner.setup()
    await runner.start("127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        assert await _closed_within(s, 30) is not None
        s.close()
        # One that sends nothing at all: the server's own keep-alive timer.
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert await _closed_within(s, 30) is not None
        s.close()
    finally:
        await runner.cleanup()


async def test_a_client_stalled_in_its_body_gets_a_408() -> None:
    async with stack(config=RouterConfig(body_timeout=1.0)) as st_:
        s = _connect(st_.url)
        s.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            'Content-Length: 1000\r\n\r\n{"model": "tiny", '.encode()
        )
        answer = await _closed_within(s, 30)
        s.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        # Everyone else is served meanwhile and after.
        r = await st_.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "fast"}]
        )
        assert r.choices[0].message.content


async def test_a_request_to_a_replica_that_just_died_is_held_for_the_next_one() -> None:
    """Fault 4 (preemption) on the cluster: the engine was gone before the daemon
    knew, and with no other replica every new request was a 502 at once."""
    async with stack(replicas=0, config=RouterConfig(hold_timeout=30)) as st_:
        dead = f"http://127.0.0.1:{free_port()}"
        st_.directory.add_endpoint("tiny", Endpoint("gone", dead, "k"))
        task = asyncio.create_task(
            post(st_.url + CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        )
        await eventually(lambda: st_.gateway.held_total == 1, "the request held")
        # The replica comes back (a requeued job: same id, a new address).
        async with engine("tiny", key="k") as url:
            st_.directory.remove_endpoint("tiny", "gone")
            st_.directory.add_endpoint("tiny", Endpoint("gone", url, "k"))
            status, body, headers = await asyncio.wait_for(task, 30)
    assert status == 200, body
    assert headers["X-Llmgw-Replica"] == "gone"
