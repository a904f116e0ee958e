"""The endpoints beyond chat, completions and embeddings, through the gateway to test engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from _router_support import engine, eventually, serve

from llmgw_slurm.accounting.usage import UsageStore
from llmgw_slurm.auth.keys import KeyRing, add_key
from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
)
from llmgw_slurm.router.directory import ModelRouting
from llmgw_slurm.router.surface import Home


@dataclass
class Stack:
    url: str
    directory: StaticDirectory
    gateway: Gateway
    engines: dict[str, str] = field(default_factory=dict)
    key: str = "unused"

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=self.key, base_url=self.url + "/v1", max_retries=0)

    async def engine_get(self, replica: str, path: str) -> Any:
        async with aiohttp.ClientSession() as s:
            r = await s.get(
                self.engines[replica] + path, headers={"Authorization": f"Bearer key-{replica}"}
            )
            return await r.json()

    async def add_replica(self, es: AsyncExitStack, rid: str, token_delay: float = 0.0) -> None:
        eurl = await es.enter_async_context(
            engine("tiny", key=f"key-{rid}", token_delay=token_delay)
        )
        self.engines[rid] = eurl
        self.directory.add_endpoint("tiny", Endpoint(rid, eurl, f"key-{rid}"))


@asynccontextmanager
async def stack(
    replicas: int = 1,
    *,
    config: RouterConfig | None = None,
    keys: KeyRing | None = None,
    usage: UsageStore | None = None,
    token_delay: float = 0.0,
) -> AsyncIterator[tuple[Stack, AsyncExitStack]]:
    directory = StaticDirectory([ModelInfo("tiny", aliases=("small",))])
    # A model that serves chat only: every other endpoint is refused for it.
    directory.add_model("chatonly", routing=ModelRouting(endpoints=frozenset({"chat/completions"})))
    app = create_app(directory, config, keys=keys, usage=usage)
    async with AsyncExitStack() as es:
        url = await es.enter_async_context(serve(app))
        st = Stack(url, directory, app[GATEWAY_KEY])
        for i in range(replicas):
            await st.add_replica(es, f"r{i}", token_delay)
        yield st, es


async def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=body)
        return r.status, await r.json(content_type=None), r.headers.get("X-Llmgw-Replica")


# /v1/responses


async def test_responses_through_the_openai_client_count_usage_per_key(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    new = add_key(keys_file, user="ada", project="p1")
    usage = UsageStore(tmp_path / "usage.sqlite")
    async with stack(keys=KeyRing(keys_file), usage=usage) as (st, _):
        st.key = new.key
        async with st.client() as client:
            plain = await client.responses.create(
                model="small", input="the cat sat", max_output_tokens=4
            )
            assert plain.output_text == "the cat sat the"
            assert plain.usage is not None and plain.usage.input_tokens == 3
            events = await client.responses.create(
                model="tiny", input="a b", max_output_tokens=3, stream=True
            )
            kinds, deltas = [], []
            async for ev in events:
                kinds.append(ev.type)
                if ev.type == "response.output_text.delta":
                    deltas.append(ev.delta)
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert "".join(deltas) == "a b a"
        await usage.flush()
        [row] = usage.summary()
        assert (row.key_id, row.model, row.requests) == (new.record.key_id, "tiny", 2)
        # Input 3 + 2 words, output 4 + 3 tokens: from the body and from the completed event.
        assert (row.prompt_tokens, row.completion_tokens) == (5, 7)


async def test_previous_response_id_goes_to_the_replica_that_holds_it() -> None:
    async with stack(replicas=3) as (st, _), st.client() as client:
        first = await client.responses.create(model="tiny", input="one two", max_output_tokens=2)
        holder = st.gateway.responses.get(first.id)
        assert holder is not None
        # The engines answer 404 for a response they do not hold: every
        # follow-up succeeding means each reached the holder, whatever the load.
        for _ in range(4):
            nxt = await client.responses.create(
                model="small", input="three", previous_response_id=first.id, max_output_tokens=3
            )
            assert nxt.output_text == "one two three"
        streamed = await client.responses.create(
            model="tiny", input="x", previous_response_id=first.id, stream=True
        )
        async for ev in streamed:
            if ev.type == "response.completed":
                chained = ev.response.id
        # A streamed response is remembered too, at its replica.
        home = st.gateway.responses.get(chained)
        assert home is not None and home.replica_id == holder.replica_id
        counts = [(await st.engine_get(r, "/debug/stats"))["requests"] for r in ("r0", "r1", "r2")]
        assert sorted(counts) == [0, 0, 6]


async def test_previous_response_id_unknown_or_gone_is_a_clear_400() -> None:
    async with stack(replicas=1) as (st, es), st.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="tiny", input="x", previous_response_id="resp_x")
        assert err.value.code == "previous_response_not_found"
        assert "resp_x" in str(err.value)
        st.gateway.responses.remember("resp_y", Home("chatonly", "c0", 1))
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="tiny", input="x", previous_response_id="resp_y")
        assert err.value.code == "previous_response_other_model"
        first = await client.responses.create(model="tiny", input="one")
        # The replica stops; a new one (another run, another address) takes its place.
        st.directory.remove_endpoint("tiny", "r0")
        await st.add_replica(es, "r1")
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="tiny", input="x", previous_response_id=first.id)
        assert err.value.code == "previous_response_gone"
        assert "r0" in str(err.value)
        stats = await st.engine_get("r1", "/debug/stats")
        assert stats["requests"] == 0


# GET, DELETE and cancel of a stored response


async def _stats(st: Stack) -> dict[str, int]:
    return {r: (await st.engine_get(r, "/debug/stats"))["requests"] for r in st.engines}


async def test_a_stored_response_is_retrieved_cancelled_and_deleted_at_its_replica(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.json"
    new = add_key(keys_file, user="ada")
    usage = UsageStore(tmp_path / "usage.sqlite")
    # A token delay for the background responses (the others are not streamed).
    async with stack(replicas=3, keys=KeyRing(keys_file), usage=usage, token_delay=0.5) as (
        st,
        _,
    ):
        st.key = new.key
        async with st.client() as client:
            first = await client.responses.create(
                model="tiny", input="one two", max_output_tokens=2
            )
            holder = st.gateway.responses.get(first.id)
            assert holder is not None
            # The engines answer 404 for a response they do not hold: each
            # retrieval succeeding means each reached the holder.
            for _ in range(3):
                got = await client.responses.retrieve(first.id)
                assert (got.id, got.output_text, got.status) == (first.id, "one two", "completed")
            with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous"):
                await client.responses.cancel(first.id)
            # A background response: queued at once, cancelled while it runs (at
            # its replica: the others would answer 404, as for the retrievals).
            slow = await client.responses.create(
                model="tiny", input="a b c d", max_output_tokens=4, background=True
            )
            assert slow.status == "queued"
            cancelled = await client.responses.cancel(slow.id)
            assert (cancelled.id, cancelled.status) == (slow.id, "cancelled")
            assert (await client.responses.retrieve(slow.id)).status == "cancelled"
            # One that finishes: its tokens count once, when first seen completed.
            quick = await client.responses.create(
                model="tiny", input="x y", max_output_tokens=1, background=True
            )
            async with asyncio.timeout(30):
                while (await client.responses.retrieve(quick.id)).status != "completed":
                    await asyncio.sleep(0.1)
            assert (await client.responses.retrieve(quick.id)).output_text == "x"
            # A stream replay that the engine cuts (vLLM replays only responses
            # made streamed): the client gets an error, not a garbled answer.
            replay = await client.responses.retrieve(quick.id, stream=True)
            with pytest.raises(openai.APIError, match="failed while replaying"):
                _ = [ev async for ev in replay]
            assert await client.responses.delete(first.id) is None
            with pytest.raises(openai.NotFoundError) as err:
                await client.responses.retrieve(first.id)
            assert err.value.code == "response_not_found"
            with pytest.raises(openai.BadRequestError) as bad:
                await client.responses.create(
                    model="tiny", input="x", previous_response_id=first.id
                )
            assert bad.value.code == "previous_response_not_found"
        await usage.flush()
        [row] = usage.summary()
        # Answers with usage: first (2 in, 2 out) and quick (2 in, 1 out), once
        # each however often retrieved; slow was cancelled with none.
        assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 4, 3)


async def test_another_keys_response_an_unknown_id_and_a_stopped_replica_are_404s(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.json"
    ada, bob = add_key(keys_file, user="ada"), add_key(keys_file, user="bob")
    async with stack(replicas=1, keys=KeyRing(keys_file)) as (st, es):
        st.key = ada.key
        async with st.client() as client:
            mine = await client.responses.create(
                model="tiny", input="secret words", max_output_tokens=2
            )
        st.key = bob.key
        async with st.client() as other:
            for call in (other.responses.retrieve, other.responses.delete, other.responses.cancel):
                with pytest.raises(openai.NotFoundError) as err:
                    await call(mine.id)
                # The same answer as for an id never made: nothing leaks.
                assert err.value.code == "response_not_found"
                assert err.value.body == {
                    "message": f"Response with id '{mine.id}' not found.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": "response_not_found",
                }
            with pytest.raises(openai.NotFoundError) as err:
                await other.responses.retrieve("resp_nobody")
            assert err.value.code == "response_not_found"
            with pytest.raises(openai.BadRequestError) as bad:
                await other.responses.create(model="tiny", input="x", previous_response_id=mine.id)
            assert bad.value.code == "previous_response_not_found"
        async with aiohttp.ClientSession() as s:
            r = await s.get(f"{st.url}/v1/responses/{mine.id}")
            assert r.status == 401
        assert (await _stats(st))["r0"] == 1
        st.key = ada.key
        async with st.client() as client:
            assert (await client.responses.retrieve(mine.id)).output_text == "secret words"
            # vLLM has no input_items: not routed, a 404 in OpenAI's shape.
            with pytest.raises(openai.NotFoundError):
                await client.responses.input_items.list(mine.id)
            st.directory.remove_endpoint("tiny", "r0")
            await st.add_replica(es, "r1")
            with pytest.raises(openai.NotFoundError) as err:
                await client.responses.retrieve(mine.id)
            assert err.value.code == "response_gone"
            assert "replica r0" in str(err.value)
        assert (await _stats(st))["r1"] == 0
        # Counted as every proxied request is: under the model once the id is
        # the caller's, else under none (the answer names no model either).
        async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as r:
            text = await r.text()
        assert 'llmgw_requests_total{model="_unknown",status="404"} 4.0' in text
        assert 'llmgw_requests_total{model="tiny",status="404"} 1.0' in text


# rerank, score, tokenize


async def test_rerank_score_tokenize_detokenize(tmp_path: Path) -> None:
    usage = UsageStore(tmp_path / "usage.sqlite")
    async with stack(usage=usage) as (st, _):
        docs = ["a red apple", "blue sky", "apple pie"]
        for path in ("/v1/rerank", "/rerank"):
            status, body, replica = await post_json(
                st.url + path, {"model": "small", "query": "apple", "documents": docs}
            )
            assert (status, replica) == (200, "r0")
            assert [r["index"] for r in body["results"]][2] == 1
        status, body, _ = await post_json(
            st.url + "/v1/score", {"model": "tiny", "text_1": "apple", "text_2": docs}
        )
        assert status == 200 and len(body["data"]) == 3
        status, tok, _ = await post_json(
            st.url + "/tokenize", {"model": "tiny", "prompt": "hello big world"}
        )
        assert status == 200 and tok["count"] == 3
        status, detok, _ = await post_json(
            st.url + "/detokenize", {"model": "tiny", "tokens": tok["tokens"]}
        )
        assert (status, detok["prompt"]) == (200, "hello big world")
        await usage.flush()
        [row] = usage.summary()
        # Two reranks and a score report tokens; tokenize and detokenize do not.
        assert row.requests == 3 and row.total_tokens > 0


async def test_an_endpoint_the_model_does_not_serve_is_a_400_naming_both() -> None:
    async with stack() as (st, _):
        status, body, _ = await post_json(
            st.url + "/v1/rerank", {"model": "chatonly", "query": "q", "documents": ["d"]}
        )
        assert status == 400
        assert body["error"]["code"] == "endpoint_not_served"
        assert "chatonly" in body["error"]["message"] and "rerank" in body["error"]["message"]
        async with st.client() as client:
            with pytest.raises(openai.BadRequestError, match="audio/transcriptions"):
                await client.audio.transcriptions.create(
                    model="chatonly", file=("a.wav", b"RIFF" * 100)
                )
        # Refused before anyone asked for a replica.
        assert st.directory.wanted["chatonly"] == 0


# audio


# The client marks translations deprecated; vLLM still serves them.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
async def test_transcription_through_the_openai_client_and_an_alias() -> None:
    async with stack() as (st, _), st.client() as client:
        out = await client.audio.transcriptions.create(
            model="small", file=("a.wav", b"x" * 1000), language="en"
        )
        assert out.text == "heard 1000 bytes"
        translated = await client.audio.translations.create(model="tiny", file=("a.wav", b"y" * 10))
        assert translated.text == "heard 10 bytes"
        stats = await st.engine_get("r0", "/debug/stats")
        # The alias became the model's own name in the form the engine read.
        assert stats["last_form"]["model"] == "tiny"


def _form(boundary: str, fields: list[tuple[str, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, value in fields:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


async def _send_form(url: str, body: bytes | AsyncIterator[bytes], boundary: str = "xyz") -> Any:
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            url + "/v1/audio/transcriptions",
            data=body,
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        return r.status, await r.json(content_type=None)


async def _engine_has_bytes(st: Stack) -> None:
    async with asyncio.timeout(30):  # stops a hung test; not a threshold
        while (await st.engine_get("r0", "/debug/stats"))["upload_bytes"] == 0:
            await asyncio.sleep(0.01)


async def test_an_upload_larger_than_the_body_limit_is_streamed_to_the_engine() -> None:
    cfg = RouterConfig(max_body_bytes=64 * 1024)
    async with stack(config=cfg) as (st, _):
        released = asyncio.Event()
        half = 2 * 1024 * 1024

        async def body() -> AsyncIterator[bytes]:
            yield _form("xyz", [("model", None, b"small")]).removesuffix(b"--xyz--\r\n")
            yield b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
            yield b"a" * half
            # The rest is sent only once the engine has some of the file: a
            # gateway that read the body whole first would wait here for ever.
            await released.wait()
            yield b"b" * half + b"\r\n--xyz--\r\n"

        sender = asyncio.create_task(_send_form(st.url, body()))
        await _engine_has_bytes(st)
        released.set()
        status, out = await sender
        assert status == 200 and out["text"] == f"heard {2 * half} bytes"


async def test_upload_limits_and_malformed_forms() -> None:
    cfg = RouterConfig(max_body_bytes=4096, max_upload_bytes=1_000_000)
    async with stack(config=cfg) as (st, _):
        big = _form("xyz", [("model", None, b"tiny"), ("file", "a.wav", b"z" * 2_000_000)])
        status, out = await _send_form(st.url, big)
        assert (status, out["error"]["code"]) == (413, "request_too_large")

        async def chunked() -> AsyncIterator[bytes]:
            # No Content-Length: refused once the stream passes the limit.
            yield big[:500_000]
            yield big[500_000:]

        status, out = await _send_form(st.url, chunked())
        assert (status, out["error"]["code"]) == (413, "request_too_large")

        status, out = await _send_form(st.url, _form("xyz", [("file", "a.wav", b"z")]))
        assert (status, out["error"]["code"]) == (400, "missing_model")
        late = _form("xyz", [("file", "a.wav", b"z" * 300_000), ("model", None, b"tiny")])
        status, out = await _send_form(st.url, late)
        assert status == 400 and "before the file" in out["error"]["message"]
        # Within the first max_body_bytes, a model after the file is found.
        early = _form("xyz", [("file", "a.wav", b"z" * 100), ("model", None, b"tiny")])
        status, out = await _send_form(st.url, early)
        assert (status, out["text"]) == (200, "heard 100 bytes")
        status, out = await _send_form(st.url, _form("xyz", [("model", None, b"nope")]))
        assert (status, out["error"]["code"]) == (404, "model_not_found")
        async with aiohttp.ClientSession() as s:
            # Refused with the file unread: the connection closes rather than
            # reading the rest of it for the next request.
            r = await s.post(
                st.url + "/v1/audio/transcriptions",
                data=_form("xyz", [("model", None, b"nope"), ("file", "a", b"z" * 500_000)]),
                headers={"Content-Type": "multipart/form-data; boundary=xyz"},
            )
            assert r.status == 404 and r.headers.get("Connection") == "close"
        async with aiohttp.ClientSession() as s:
            r = await s.post(st.url + "/v1/audio/transcriptions", json={"model": "tiny"})
            assert r.status == 400
            assert "multipart/form-data" in (await r.json())["error"]["message"]


async def test_an_upload_waits_for_a_cold_start() -> None:
    async with stack(replicas=0) as (st, es):
        form = _form("b1", [("model", None, b"tiny"), ("file", "a.wav", b"q" * 300)])
        sender = asyncio.create_task(_send_form(st.url, form, boundary="b1"))
        await eventually(lambda: st.directory.wanted["tiny"] > 0, "the upload held")
        await st.add_replica(es, "r0")
        status, out = await sender
        assert (status, out["text"]) == (200, "heard 300 bytes")


async def test_a_response_its_vllm_engine_did_not_keep_says_which_setting_keeps_it() -> None:
    # vLLM without VLLM_ENABLE_RESPONSES_API_STORE ignores store and keeps nothing;
    # its GET then answers only "not found" (checked on vLLM 0.32's CPU build).
    from llmgw_slurm.testing.engine import EngineOptions, create_engine_app

    directory = StaticDirectory()
    directory.add_model("vllm-default", routing=ModelRouting(stores_responses=False))
    app = create_app(directory)
    eng = create_engine_app(
        EngineOptions(api_key="k0", served_name="vllm-default", store_responses=False)
    )
    async with serve(eng) as eurl, serve(app) as url:
        directory.add_endpoint("vllm-default", Endpoint("r0", eurl, "k0"))
        async with openai.AsyncOpenAI(api_key="x", base_url=url + "/v1", max_retries=0) as c:
            made = await c.responses.create(model="vllm-default", input="a b", max_output_tokens=2)
            assert made.output_text == "a b"
            with pytest.raises(openai.NotFoundError) as err:
                await c.responses.retrieve(made.id)
            assert err.value.code == "response_not_stored"
            message = err.value.response.json()["error"]["message"]
            assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in message and "engine.env" in message
            with pytest.raises(openai.BadRequestError) as bad:
                await c.responses.create(
                    model="vllm-default", input="x", previous_response_id=made.id
                )
            assert bad.value.code == "previous_response_not_stored"


def test_a_vllm_model_keeps_responses_only_with_the_store_in_its_env(tmp_path: Path) -> None:
    from llmgw_slurm.catalog import load_catalog

    p = tmp_path / "models.yaml"
    p.write_text(
        "models:\n"
        "  - {name: plain, engine: {kind: vllm}, weights: {source: /m}}\n"
        "  - {name: kept, engine: {kind: vllm, env: {VLLM_ENABLE_RESPONSES_API_STORE: '1'}},"
        " weights: {source: /m}}\n"
        "  - {name: own, engine: {kind: command, command: [x]}}\n"
    )
    cat = load_catalog(p)
    assert [m.stores_responses for m in cat.models] == [False, True, None]
