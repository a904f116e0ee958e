"""The test engine answers like an OpenAI server, deterministically."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import openai
import pytest
from _router_support import engine, engine_client, free_port

KEY = "engine-key"


async def test_chat_non_stream_sync_client() -> None:
    async with engine() as url:
        with openai.OpenAI(api_key=KEY, base_url=url + "/v1", max_retries=0) as client:

            def call() -> openai.types.chat.ChatCompletion:
                return client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hello big world"}],
                    max_tokens=5,
                )

            out = await asyncio.to_thread(call)
    assert out.choices[0].message.content == "hello big world hello big"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)


async def test_completion_stream_one_token_per_chunk_with_usage() -> None:
    async with engine_client() as (_url, client):
        stream = await client.completions.create(
            model="tiny",
            prompt="a b",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts = []
        usage = None
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
    assert texts == ["a", " b", " a", ""]
    assert usage is not None and usage.completion_tokens == 3


async def test_chat_stream_without_usage_ends_with_done() -> None:
    async with engine() as url, aiohttp.ClientSession() as s:
        r = await s.post(
            url + "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "max_tokens": 2,
            },
            headers={"Authorization": f"Bearer {KEY}"},
        )
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"usage"' not in raw
    # role chunk, two tokens, finish chunk, [DONE]
    assert len(events) == 5


async def test_embeddings_are_deterministic() -> None:
    async with engine_client() as (_url, client):
        a = await client.embeddings.create(model="tiny", input=["one", "two"])
        b = await client.embeddings.create(model="tiny", input="one")
    assert a.data[0].embedding == b.data[0].embedding
    assert a.data[0].embedding != a.data[1].embedding
    assert a.usage.prompt_tokens == 2


async def test_rejects_wrong_key_unknown_model_and_n() -> None:
    async with engine_client(client_key="nope") as (url, bad):
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        async with openai.AsyncOpenAI(api_key=KEY, base_url=url + "/v1", max_retries=0) as good:
            with pytest.raises(openai.NotFoundError):
                await good.completions.create(model="other", prompt="x")
            with pytest.raises(openai.BadRequestError):
                await good.completions.create(model="tiny", prompt="x", n=2)
            models = await good.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_debug_last_headers_shows_traceparent() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with engine_client() as (url, client):
        await client.completions.create(model="tiny", prompt="x", extra_headers={"traceparent": tp})
        async with aiohttp.ClientSession() as s:
            r = await s.get(url + "/debug/last-headers", headers={"Authorization": f"Bearer {KEY}"})
            headers = await r.json()
    assert headers["traceparent"] == tp


async def test_abort_after_drops_the_stream() -> None:
    async with engine_client() as (_url, client):
        stream = await client.completions.create(
            model="tiny",
            prompt="a b c",
            max_tokens=5,
            stream=True,
            extra_body={"test_abort_after": 1},
        )
        got = []
        with pytest.raises(Exception):  # noqa: B017 - the transport's own error type
            async for chunk in stream:
                got.append(chunk.choices[0].text)
    assert got == ["a"]


async def test_health_waits_for_ready_after() -> None:
    async with engine(ready_after=3600) as url, aiohttp.ClientSession() as s:
        r = await s.get(url + "/health")
        assert r.status == 503
    async with engine(ready_after=0) as url, aiohttp.ClientSession() as s:
        r = await s.get(url + "/health")
        assert r.status == 200


def _serve(extra_args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw_slurm.testing.engine", *extra_args], env=env
    )


def _models_status(port: int, key: str | None) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(req) as r:
                return int(r.status)
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("key_in", ["argv", "env"])
def test_command_line_serves_until_sigterm(key_in: str) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_ENGINE_API_KEY"}
    args = ["--port", str(port), "--served-name", "tiny", "--ready-after", "0"]
    if key_in == "argv":
        args += ["--api-key", KEY]
    else:
        # What the agent does: the key in the environment, not in ps.
        env["LLMGW_ENGINE_API_KEY"] = KEY
    proc = _serve(args, env)
    try:
        assert _models_status(port, KEY) == 200
        assert _models_status(port, None) == 401
        assert _models_status(port, "other") == 401
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_first_token_delay_paces_the_first_token_apart() -> None:
    from llmgw_slurm.testing.engine import EngineOptions

    paced = EngineOptions(api_key="k", served_name="m", token_delay=0.005, first_token_delay=0.02)
    assert [paced.delay_before(i) for i in range(3)] == [0.02, 0.005, 0.005]
    even = EngineOptions(api_key="k", served_name="m", token_delay=0.005)
    assert [even.delay_before(i) for i in range(2)] == [0.005, 0.005]


def test_command_line_without_a_key_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_ENGINE_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmgw_slurm.testing.engine", "--port", "1", "--served-name", "t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "LLMGW_ENGINE_API_KEY" in proc.stderr


def test_command_line_port_from_the_environment_and_only_where_it_serves() -> None:
    # What the agent does: the port in LLMGW_ENGINE_PORT, not in ps.
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_ENGINE_")}
    env.update(LLMGW_ENGINE_API_KEY=KEY, LLMGW_ENGINE_PORT=str(port))
    proc = _serve(["--served-name", "tiny"], env)
    try:
        assert _models_status(port, KEY) == 200
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # A serving rank without any port is a usage error that says where one comes from.
    env["LLMGW_ENGINE_PORT"] = "0"
    no_port = subprocess.run(
        [sys.executable, "-m", "llmgw_slurm.testing.engine", "--served-name", "t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_port.returncode == 2 and "LLMGW_ENGINE_PORT" in no_port.stderr
