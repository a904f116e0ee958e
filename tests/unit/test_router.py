"""The gateway, run for real against real test engines on localhost ports."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import openai
import pytest
from _router_support import engine, eventually, free_port, serve

from llmgw_slurm.accounting.usage import UsageStore, query_usage
from llmgw_slurm.auth.keys import KeyRing, add_key
from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelDirectory,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
)


@dataclass
class Stack:
    url: str
    directory: StaticDirectory
    gateway: Gateway
    engines: dict[str, str] = field(default_factory=dict)  # replica id -> engine url
    key: str = "unused"
    clients: list[openai.AsyncOpenAI | openai.OpenAI] = field(default_factory=list)

    def client(self, key: str | None = None) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(api_key=key or self.key, base_url=self.url + "/v1", max_retries=0)
        self.clients.append(c)
        return c

    def sync_client(self, key: str | None = None) -> openai.OpenAI:
        c = openai.OpenAI(api_key=key or self.key, base_url=self.url + "/v1", max_retries=0)
        self.clients.append(c)
        return c

    async def close_clients(self) -> None:
        for c in self.clients:
            if isinstance(c, openai.AsyncOpenAI):
                await c.close()
            else:
                c.close()

    async def engine_get(self, replica: str, path: str) -> object:
        async with aiohttp.ClientSession() as s:
            r = await s.get(
                self.engines[replica] + path, headers={"Authorization": f"Bearer key-{replica}"}
            )
            return await r.json()


@asynccontextmanager
async def stack(
    replicas: int = 1,
    *,
    config: RouterConfig | None = None,
    keys: KeyRing | None = None,
    usage: UsageStore | None = None,
    token_delay: float = 0.0,
    handler_cancellation: bool = True,
    start_ready: bool = True,
) -> AsyncIterator[Stack]:
    directory = StaticDirectory([ModelInfo("tiny", aliases=("tiny-chat", "small"))])
    directory.add_model("other")
    app = create_app(directory, config, keys=keys, usage=usage)
    async with AsyncExitStack() as es:
        url = await es.enter_async_context(serve(app, handler_cancellation=handler_cancellation))
        st = Stack(url, directory, app[GATEWAY_KEY])
        for i in range(replicas):
            rid = f"r{i}"
            eurl = await es.enter_async_context(
                engine("tiny", key=f"key-{rid}", token_delay=token_delay)
            )
            st.engines[rid] = eurl
            if start_ready:
                directory.add_endpoint("tiny", Endpoint(rid, eurl, f"key-{rid}"))
        try:
            yield st
        finally:
            await st.close_clients()


def replica_of(raw: object) -> str:
    return raw.headers["x-llmgw-replica"]  # type: ignore[attr-defined, no-any-return]


async def post(
    url: str, body: bytes | dict[str, object], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, object], dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await s.post(
            url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        return r.status, await r.json(), dict(r.headers)


def test_static_directory_satisfies_protocol() -> None:
    assert isinstance(StaticDirectory(), ModelDirectory)


async def test_chat_through_alias_with_sync_client() -> None:
    async with stack() as st:
        client = st.sync_client()

        def call() -> openai.types.chat.ChatCompletion:
            return client.chat.completions.create(
                model="tiny-chat",
                messages=[{"role": "user", "content": "hello there"}],
                max_tokens=3,
                extra_body={"top_k": 5},
            )

        out = await asyncio.to_thread(call)
        assert out.choices[0].message.content == "hello there hello"
        assert out.model == "tiny"
        body = await st.engine_get("r0", "/debug/last-body")
        headers = await st.engine_get("r0", "/debug/last-headers")
    # The body arrives unchanged but for the model name.
    assert body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "top_k": 5,
    }
    assert headers["authorization"] == "Bearer key-r0"  # type: ignore[index]


async def test_completions_and_embeddings_async_client() -> None:
    async with stack() as st:
        c = st.client()
        out = await c.completions.create(model="small", prompt="a b c", max_tokens=4)
        emb = await c.embeddings.create(model="tiny", input=["x", "y z"])
    assert out.choices[0].text == "a b c a"
    assert len(emb.data) == 2
    assert emb.usage.prompt_tokens == 3


async def test_stream_passes_chunks_and_strips_usage_client_did_not_ask_for() -> None:
    async with stack() as st:
        stream = await st.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "p q"}],
            max_tokens=3,
            stream=True,
        )
        chunks = [c async for c in stream]
        body = await st.engine_get("r0", "/debug/last-body")
    assert body["stream_options"] == {"include_usage": True}  # type: ignore[index]
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "p q p"


async def test_stream_keeps_usage_when_client_asks() -> None:
    async with stack() as st:
        stream = await st.client().completions.create(
            model="tiny",
            prompt="p q",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_raw_stream_ends_with_done_and_has_no_usage_only_event() -> None:
    async with stack() as st, aiohttp.ClientSession() as s:
        r = await s.post(
            st.url + "/v1/completions",
            json={"model": "tiny", "prompt": "a", "max_tokens": 2, "stream": True},
        )
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert not any('"choices":[]' in e for e in events)


async def test_models_lists_aliases_and_readiness() -> None:
    async with stack(start_ready=False) as st:
        models = await st.client().models.list()
        by_id = {m.id: m for m in models.data}
        assert set(by_id) == {"tiny", "tiny-chat", "small", "other"}
        assert by_id["tiny"].ready is False  # type: ignore[attr-defined]
        assert by_id["small"].alias_for == "tiny"  # type: ignore[attr-defined]
        st.directory.add_endpoint("tiny", Endpoint("r0", st.engines["r0"], "key-r0"))
        models = await st.client().models.list()
        by_id = {m.id: m for m in models.data}
    assert by_id["tiny"].ready is True  # type: ignore[attr-defined]
    assert by_id["tiny-chat"].ready is True  # type: ignore[attr-defined]
    assert by_id["other"].ready is False  # type: ignore[attr-defined]


async def test_unknown_model_is_404_listing_known_names() -> None:
    async with stack() as st:
        with pytest.raises(openai.NotFoundError) as ei:
            await st.client().chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
    err = ei.value.body
    assert isinstance(err, dict)
    assert err["code"] == "model_not_found"
    assert "tiny" in err["message"] and "tiny-chat" in err["message"]


async def test_malformed_json_and_missing_model_are_400() -> None:
    async with stack() as st:
        status, body, _ = await post(st.url + "/v1/chat/completions", b"{not json")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        status, body, _ = await post(st.url + "/v1/chat/completions", {"messages": []})
        assert status == 400 and body["error"]["code"] == "missing_model"  # type: ignore[index]
        status, body, _ = await post(st.url + "/v1/completions", b"[1, 2]")
        assert status == 400


async def test_body_over_limit_is_413() -> None:
    async with stack(config=RouterConfig(max_body_bytes=1000)) as st:
        big = {"model": "tiny", "prompt": "x" * 2000}
        status, body, _ = await post(st.url + "/v1/completions", big)
        assert status == 413
        assert body["error"]["code"] == "request_too_large"  # type: ignore[index]

        async def chunks() -> AsyncIterator[bytes]:
            # No Content-Length: the limit applies while reading.
            yield json.dumps(big).encode()

        async with aiohttp.ClientSession() as s:
            r = await s.post(st.url + "/v1/completions", data=chunks())
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"
        ok = await st.client().completions.create(model="tiny", prompt="fits")
    assert ok.choices[0].text


async def test_keys_401_and_usage_recorded_per_key(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys.json"
    alice = add_key(keyfile, "alice", "proj-a")
    bob = add_key(keyfile, "bob")
    usage = UsageStore(tmp_path / "usage.sqlite3", flush_interval_s=3600)
    async with stack(keys=KeyRing(keyfile), usage=usage) as st:
        with pytest.raises(openai.AuthenticationError):
            await st.client("llmgw-00000000-" + "x" * 43).models.list()
        status, body, _ = await post(st.url + "/v1/completions", {"model": "tiny", "prompt": "a"})
        assert status == 401 and body["error"]["code"] == "missing_api_key"  # type: ignore[index]
        a = st.client(alice.key)
        b = st.client(bob.key)
        await a.completions.create(model="tiny", prompt="one two", max_tokens=4)
        stream = await a.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "x y z"}],
            max_tokens=2,
            stream=True,
        )
        async for _ in stream:
            pass
        await b.embeddings.create(model="tiny", input="u v")
        # The engine never sees a gateway key.
        headers = await st.engine_get("r0", "/debug/last-headers")
        assert headers["authorization"] == "Bearer key-r0"  # type: ignore[index]
        await usage.flush()
        got_a = query_usage(usage.path, key_id=alice.record.key_id)
        got_b = query_usage(usage.path, key_id=bob.record.key_id)
    assert len(got_a) == 1
    assert (got_a[0].user, got_a[0].project, got_a[0].requests) == ("alice", "proj-a", 2)
    assert (got_a[0].prompt_tokens, got_a[0].completion_tokens) == (2 + 3, 4 + 2)
    assert (got_b[0].user, got_b[0].prompt_tokens, got_b[0].completion_tokens) == ("bob", 2, 0)


async def test_hold_releases_all_when_first_replica_ready() -> None:
    async with stack(start_ready=False) as st:
        c = st.client()
        tasks = [
            asyncio.create_task(c.completions.create(model="tiny", prompt=f"n{i}", max_tokens=1))
            for i in range(3)
        ]
        await eventually(lambda: st.gateway.held.get("tiny") == 3, "three held requests")
        assert st.directory.wanted["tiny"] == 3
        st.directory.add_endpoint("tiny", Endpoint("r0", st.engines["r0"], "key-r0"))
        outs = await asyncio.gather(*tasks)
        assert sorted(o.choices[0].text for o in outs) == ["n0", "n1", "n2"]
        assert st.gateway.held["tiny"] == 0
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(st.url + "/metrics")).text()
    assert 'llmgw_cold_start_duration_seconds_count{model="tiny"} 1.0' in text


async def test_hold_cap_429_and_deadline_503_with_retry_after() -> None:
    cfg = RouterConfig(max_held=1, hold_timeout=0.3, retry_after=7)
    async with stack(config=cfg, start_ready=False) as st:
        c = st.client()
        first = asyncio.create_task(c.completions.create(model="tiny", prompt="a"))
        await eventually(lambda: st.gateway.held.get("tiny") == 1, "one held request")
        with pytest.raises(openai.RateLimitError) as ei:
            await c.completions.create(model="tiny", prompt="b")
        assert ei.value.status_code == 429
        with pytest.raises(openai.InternalServerError) as ej:
            await first
    assert ej.value.status_code == 503
    assert ej.value.response.headers["Retry-After"] == "7"


async def test_per_model_hold_timeout_from_directory() -> None:
    directory = StaticDirectory([ModelInfo("tiny", hold_timeout_s=0.05)])
    app = create_app(directory, RouterConfig(hold_timeout=3600))
    async with serve(app) as url:
        status, _, headers = await post(url + "/v1/completions", {"model": "tiny", "prompt": "a"})
    assert status == 503 and "Retry-After" in headers


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_disconnecting_held_client_stops_being_held(handler_cancellation: bool) -> None:
    async with stack(start_ready=False, handler_cancellation=handler_cancellation) as st:
        session = aiohttp.ClientSession()
        task = asyncio.create_task(
            session.post(st.url + "/v1/completions", json={"model": "tiny", "prompt": "a"})
        )
        await eventually(lambda: st.gateway.held.get("tiny") == 1, "a held request")
        task.cancel()
        await session.close()
        await eventually(lambda: st.gateway.held.get("tiny") == 0, "the held request released")
        assert st.gateway.held_total == 0


async def test_least_outstanding_requests() -> None:
    # The long stream is cut when closed, not read on for its usage (10,000 tokens).
    cut = RouterConfig(drain_after_disconnect=0)
    async with stack(replicas=2, token_delay=0.05, config=cut) as st:
        c = st.client()
        # A long stream keeps one replica busy while it is open.
        busy = await c.completions.with_raw_response.create(
            model="tiny", prompt="a", max_tokens=10_000, stream=True
        )
        busy_replica = replica_of(busy)
        stream = busy.parse()
        await stream.__anext__()
        for _ in range(4):
            raw = await c.completions.with_raw_response.create(model="tiny", prompt="b")
            assert replica_of(raw) != busy_replica
        await stream.close()
        await eventually(lambda: not st.gateway.in_flight, "in-flight counts back to zero")
    assert sum(st.directory.in_flight.values()) == 0
    assert st.directory.started[("tiny", busy_replica)] == 1
    assert "tiny" in st.directory.last_used


async def test_idle_replicas_share_requests() -> None:
    async with stack(replicas=2) as st:
        seen = set()
        for _ in range(4):
            raw = await st.client().completions.with_raw_response.create(model="tiny", prompt="b")
            seen.add(replica_of(raw))
    assert seen == {"r0", "r1"}


async def test_draining_replica_gets_no_new_requests() -> None:
    async with stack(replicas=2, config=RouterConfig(hold_timeout=0.05)) as st:
        st.directory.set_draining("tiny", "r0")
        for _ in range(4):
            raw = await st.client().completions.with_raw_response.create(model="tiny", prompt="b")
            assert replica_of(raw) == "r1"
        st.directory.set_draining("tiny", "r1")
        with pytest.raises(openai.InternalServerError) as ei:
            await st.client().completions.create(model="tiny", prompt="b")
    assert ei.value.status_code == 503


async def test_connection_refused_is_retried_on_another_replica() -> None:
    async with stack(replicas=1, config=RouterConfig(hold_timeout=0.5)) as st:
        dead = f"http://127.0.0.1:{free_port()}"
        st.directory.add_endpoint("tiny", Endpoint("dead", dead, "k"))
        for _ in range(4):
            raw = await st.client().completions.with_raw_response.create(model="tiny", prompt="b")
            assert replica_of(raw) == "r0"
        async with aiohttp.ClientSession() as s:
            text = await (await s.get(st.url + "/metrics")).text()
        st.directory.remove_endpoint("tiny", "r0")
        status, body, _ = await post(st.url + "/v1/completions", {"model": "tiny", "prompt": "a"})
    assert 'llmgw_upstream_errors_total{model="tiny",phase="connect"}' in text
    # With no other replica, the request waited for one at another address (the
    # dead one coming back from the queue), here in vain: the hold's 503.
    assert status == 503 and body["error"]["code"] == "model_not_ready"  # type: ignore[index]


async def test_without_retry_once_a_refused_connection_is_a_502_at_once() -> None:
    # router.retry_once false: no second replica is tried and nothing is held,
    # although another replica is ready and the hold timeout is long.
    async with stack(replicas=1, config=RouterConfig(hold_timeout=60, retry_once=False)) as st:
        dead = f"http://127.0.0.1:{free_port()}"
        st.directory.add_endpoint("tiny", Endpoint("dead", dead, "k"))
        # The picker rotates among idle replicas: two requests in turn reach both.
        results = [
            await post(st.url + "/v1/completions", {"model": "tiny", "prompt": "a"})
            for _ in range(2)
        ]
        st.directory.remove_endpoint("tiny", "r0")
        alone = await post(st.url + "/v1/completions", {"model": "tiny", "prompt": "a"})
    assert sorted(status for status, _, _ in results) == [200, 502]
    assert alone[0] == 502
    assert alone[1]["error"]["code"] == "upstream_unavailable"  # type: ignore[index]
    assert st.gateway.held.get("tiny", 0) == 0


async def test_request_to_a_dead_replica_is_served_by_its_next_run_at_the_same_address() -> None:
    # A preempted replica is requeued: same replica id, same node, same port. The
    # request that found it dead waits, and must be sent to the new run, not
    # refused it as "the address that did not answer" until its hold runs out.
    port = free_port()
    addr = f"http://127.0.0.1:{port}"
    async with stack(replicas=0, config=RouterConfig(hold_timeout=60)) as st:
        st.directory.add_endpoint("tiny", Endpoint("r0", addr, "key-r0"))
        request = asyncio.create_task(
            post(st.url + "/v1/completions", {"model": "tiny", "prompt": "a"})
        )
        # Held after the refused connection; the daemon then sees the job requeued.
        await eventually(lambda: st.gateway.held.get("tiny") == 1, "the request held")
        st.directory.remove_endpoint("tiny", "r0")
        async with engine("tiny", key="key-r0", port=port):
            st.directory.add_endpoint("tiny", Endpoint("r0", addr, "key-r0"))
            status, body, headers = await request
    assert status == 200, body
    assert headers["X-Llmgw-Replica"] == "r0"


async def test_failure_after_first_byte_is_passed_on_not_retried() -> None:
    async with stack(replicas=2) as st:
        stream = await st.client().completions.create(
            model="tiny",
            prompt="a b c",
            max_tokens=5,
            stream=True,
            extra_body={"test_abort_after": 1},
        )
        got = []
        with pytest.raises(openai.APIError) as e:
            async for chunk in stream:
                got.append(chunk.choices[0].text)
        stats = [await st.engine_get(r, "/debug/stats") for r in ("r0", "r1")]
    assert got == ["a"]
    assert "replica of model 'tiny' failed after the answer began" in e.value.message
    assert e.value.code == "upstream_failed"
    assert sum(s["requests"] for s in stats) == 1  # type: ignore[index]


async def test_traceparent_reaches_engine() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with stack() as st:
        await st.client().completions.create(
            model="tiny", prompt="a", extra_headers={"traceparent": tp}
        )
        headers = await st.engine_get("r0", "/debug/last-headers")
    assert headers["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"  # type: ignore[index]


async def test_metrics_exposed() -> None:
    async with stack() as st:
        await st.client().completions.create(model="tiny", prompt="a")
        with pytest.raises(openai.NotFoundError):
            await st.client().completions.create(model="zzz", prompt="a")
        async with aiohttp.ClientSession() as s:
            r = await s.get(st.url + "/metrics")
            text = await r.text()
    assert 'llmgw_requests_total{model="tiny",status="200"} 1.0' in text
    assert 'llmgw_requests_total{model="_unknown",status="404"} 1.0' in text
    assert 'llmgw_request_duration_seconds_count{model="tiny"} 1.0' in text
    assert 'llmgw_time_to_first_byte_seconds_count{model="tiny"} 1.0' in text
    assert 'llmgw_replicas{model="tiny",state="ready"} 1.0' in text
    assert "llmgw_held_requests" in text
    assert 'llmgw_tokens_total{kind="completion",model="tiny"}' in text


async def test_unknown_v1_path_is_openai_shaped_404() -> None:
    async with stack() as st, aiohttp.ClientSession() as s:
        r = await s.post(st.url + "/v1/nope", json={})
        body = await r.json()
    assert r.status == 404 and "error" in body


async def test_two_apps_have_separate_registries() -> None:
    a = create_app(StaticDirectory())
    b = create_app(StaticDirectory())
    assert a[GATEWAY_KEY].metrics.registry is not b[GATEWAY_KEY].metrics.registry


async def test_engine_refusing_its_key_is_502_not_401() -> None:
    async with stack(replicas=0) as st, engine("tiny", key="right") as eurl:
        st.directory.add_endpoint("tiny", Endpoint("r9", eurl, "wrong"))
        status, body, _ = await post(st.url + "/v1/completions", {"model": "tiny", "prompt": "a"})
    assert status == 502 and body["error"]["code"] == "upstream_auth_failed"  # type: ignore[index]


async def test_client_leaving_mid_stream_stops_the_engine_request() -> None:
    # Draining off: this checks the cut itself. By default a client gone is
    # read on for its usage first (test_router_usage_after_disconnect.py).
    cut = RouterConfig(drain_after_disconnect=0)
    async with stack(token_delay=0.05, config=cut) as st:
        stream = await st.client().completions.create(
            model="tiny", prompt="a", max_tokens=10_000, stream=True
        )
        await stream.__anext__()
        assert st.gateway.in_flight == {("tiny", "r0"): 1}
        await stream.close()
        await eventually(lambda: not st.gateway.in_flight, "the gateway's request ended")

        async def engine_idle() -> bool:
            stats = await st.engine_get("r0", "/debug/stats")
            return stats["in_flight"] == 0  # type: ignore[index, no-any-return]

        for _ in range(3000):
            if await engine_idle():
                break
            await asyncio.sleep(0.01)
        assert await engine_idle()
    assert st.directory.in_flight[("tiny", "r0")] == 0


async def test_sync_client_completions_stream_and_embeddings() -> None:
    async with stack() as st:
        client = st.sync_client()

        def calls() -> tuple[str, list[str], int]:
            out = client.completions.create(model="small", prompt="u v", max_tokens=2)
            stream = client.chat.completions.create(
                model="tiny-chat",
                messages=[{"role": "user", "content": "s t"}],
                max_tokens=3,
                stream=True,
            )
            pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
            emb = client.embeddings.create(model="tiny", input="e")
            return out.choices[0].text, pieces, len(emb.data[0].embedding)

        text, pieces, dim = await asyncio.to_thread(calls)
    assert text == "u v"
    assert pieces == ["", "s", " t", " s", ""]
    assert dim == 8
