"""Usage is counted for every token an engine generated, whether the client stays or not
(issue 13, item 4).

vLLM sends a stream's usage in a chunk of its own after the last token. A
client that reads to ``finish_reason`` and hangs up used to leave before that
chunk, and the relay returned without counting anything: 20 such streams made
800 tokens in vLLM and were counted as 280. The engine here does what vLLM
does (the usage chunk comes a moment after the last token) and keeps its own
counters to compare with.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from _router_support import eventually, serve
from aiohttp import web

from llmgw_slurm.accounting.usage import UsageStore, query_usage
from llmgw_slurm.router import Endpoint, ModelInfo, RouterConfig, StaticDirectory, create_app

TOKENS = 40

@dataclass
class Counters:
    """What the engine generated and how its streams ended, as vLLM's own metrics would say."""

    completion_tokens: int = 0
    finished: int = 0
    cut: int = 0


def engine_app(
    c: Counters, usage_after: asyncio.Event | None, endless: bool = False, pace: float = 0.0
) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream_options"]["include_usage"] is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        made = 0
        try:
            for i in range(10**9 if endless else TOKENS):
                delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}], "usage": None}
                await resp.write(b"data: " + json.dumps({**base, **delta}).encode() + b"\n\n")
                made += 1
                c.completion_tokens += 1
                if endless or pace:
                    await asyncio.sleep(pace or 0.01)
            fin = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": None}
            await resp.write(b"data: " + json.dumps({**base, **fin}).encode() + b"\n\n")
            if usage_after is not None:
                # vLLM computes and sends the usage chunk after the last token.
                await usage_after.wait()
            usage = {"prompt_tokens": 3, "completion_tokens": made, "total_tokens": 3 + made}
            last = {**base, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            c.finished += 1
        except (ConnectionResetError, asyncio.CancelledError):
            c.cut += 1
            raise
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@asynccontextmanager
async def gateway(
    tmp_path: Path, c: Counters, usage_after: asyncio.Event | None, **cfg: float
) -> AsyncIterator[tuple[str, UsageStore]]:
    store = UsageStore(tmp_path / "usage.sqlite3", flush_interval_s=0.05)
    endless, pace = bool(cfg.pop("endless", 0)), cfg.pop("pace", 0.0)
    async with serve(engine_app(c, usage_after, endless, pace)) as eurl:
        directory = StaticDirectory([ModelInfo("m")])
        directory.add_endpoint("m", Endpoint("r0", eurl, "k"))
        config = RouterConfig(**cfg)  # type: ignore[arg-type]
        app = create_app(directory, config, usage=store)
        async with serve(app) as url:
            yield url, store


async def stream_and_hang_up(url: str, *, after_tokens: int | None = None) -> None:
    """Read the stream up to finish_reason (or ``after_tokens`` tokens), then reset the connection."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(url + "/v1/chat/completions", json=body)
        seen = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                obj = json.loads(line[6:])
                if obj["choices"] and obj["choices"][0].get("finish_reason"):
                    break
                seen += 1
                if after_tokens is not None and seen >= after_tokens:
                    break
        conn = resp.connection
        if conn is not None and conn.transport is not None:
            conn.transport.abort()  # a reset, as the client did
        resp.close()
    finally:
        await session.close()


def counted(store: UsageStore) -> int:
    return sum(r.completion_tokens for r in query_usage(store.path))


async def test_twenty_streams_cut_after_their_last_token_are_counted_as_the_engine_counts(
    tmp_path: Path,
) -> None:
    c = Counters()
    later = asyncio.Event()
    async with gateway(tmp_path, c, later) as (url, store):
        await asyncio.gather(*(stream_and_hang_up(url) for _ in range(20)))
        later.set()  # the engine sends the usage chunks now, to nobody
        await eventually(lambda: c.finished + c.cut == 20, "the engine's 20 answers to end")
        await store.flush()
        await eventually(lambda: counted(store) == c.completion_tokens, "usage as counted")
        assert (c.completion_tokens, c.finished, c.cut) == (20 * TOKENS, 20, 0)
        assert counted(store) == 800 and len(query_usage(store.path)) == 1
        assert query_usage(store.path)[0].requests == 20


async def test_a_client_gone_mid_answer_is_counted_once_the_answer_ends(tmp_path: Path) -> None:
    c = Counters()
    # Paced like a real engine, so that most of the answer is made after the client left.
    async with gateway(tmp_path, c, None, pace=0.02) as (url, store):
        await stream_and_hang_up(url, after_tokens=3)
        await eventually(lambda: c.finished + c.cut == 1, "the engine's answer to end")
        assert c.finished == 1
        await store.flush()
        await eventually(lambda: counted(store) == TOKENS, "the whole answer's usage")


async def test_the_drain_is_bounded_in_time_and_cuts_the_engine_then(tmp_path: Path) -> None:
    c = Counters()
    async with gateway(tmp_path, c, None, drain_after_disconnect=0.3, endless=1) as (url, _):
        await stream_and_hang_up(url, after_tokens=2)
        # The engine never ends on its own: the gateway cuts it after the drain time.
        await eventually(lambda: c.cut == 1, "the engine's connection cut")
        assert c.finished == 0


async def test_the_drain_is_bounded_in_bytes(tmp_path: Path) -> None:
    c = Counters()
    cfg = {"drain_after_disconnect_bytes": 2000, "endless": 1}
    async with gateway(tmp_path, c, None, **cfg) as (url, _):
        await stream_and_hang_up(url, after_tokens=2)
        await eventually(lambda: c.cut == 1, "the engine's connection cut")


async def test_without_a_drain_the_engine_is_cut_at_once(tmp_path: Path) -> None:
    c = Counters()
    async with gateway(tmp_path, c, None, drain_after_disconnect=0, endless=1) as (url, store):
        await stream_and_hang_up(url, after_tokens=2)
        await eventually(lambda: c.cut == 1, "the engine's connection cut")
        await store.flush()
        assert counted(store) == 0
