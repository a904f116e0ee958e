"""The gateway on the real cluster: the hold's cap and deadline, draining, a replica killed mid-stream.

Each test runs a real daemon (tests/slurm/harness.py) whose replicas are real
Slurm jobs running the agent and the test engine, and talks to it with the
official openai client.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw_slurm.router import GATEWAY_KEY
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, Harness, running, tiny_model


def client(h: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ready_replicas(h: Harness, model: str) -> list[str]:
    return sorted(
        r.replica_id
        for r in h.rec.replicas.values()
        if r.model == model and r.state().value == "ready"
    )


def held(h: Harness, model: str) -> int:
    assert h.d is not None
    return h.d.gateway[GATEWAY_KEY].held.get(model, 0)


# An engine that runs but never answers its health check: the model stays
# "starting" for as long as the test lasts, so its requests stay held.
NEVER_READY = tiny_model(
    "never",
    engine={"kind": "command", "command": ["sleep", "600"], "ready_timeout": "5m"},
)


# Streams slowly: 0.1 s a token, so a 100-token answer is in flight for 10 s.
SLOW_ENGINE = [*TINY_ENGINE, "--token-delay", "0.1"]


async def chat_raw(
    c: openai.AsyncOpenAI, model: str, text: str = "hello", **kw: Any
) -> tuple[str, str]:
    """(replica that answered, text of the answer)."""
    raw = await c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=3, **kw
    )
    content = raw.parse().choices[0].message.content
    assert isinstance(content, str)
    return raw.headers["x-llmgw-replica"], content


async def test_held_requests_past_the_cap_get_429(tmp_path: Path, prefix: str) -> None:
    async with (
        running(tmp_path, prefix, [NEVER_READY], router={"max_held": 1}) as h,
        client(h) as c,
    ):
        first = asyncio.create_task(chat_raw(c, "never"))
        await eventually(lambda: asyncio.sleep(0, held(h, "never") == 1), "the first to be held")
        with pytest.raises(openai.RateLimitError) as e:
            await chat_raw(c, "never")
        assert e.value.status_code == 429
        assert e.value.code == "too_many_held_requests"
        assert "never" in e.value.message
        assert not first.done()
        # A client that goes away stops being held, which frees the place.
        first.cancel()
        await eventually(lambda: asyncio.sleep(0, held(h, "never") == 0), "the hold to end")


async def test_held_request_past_the_deadline_gets_503_with_retry_after(
    tmp_path: Path, prefix: str
) -> None:
    async with (
        running(tmp_path, prefix, [NEVER_READY], router={"hold_timeout": "4s"}) as h,
        client(h) as c,
    ):
        with pytest.raises(openai.InternalServerError) as e:
            await chat_raw(c, "never")
        assert e.value.status_code == 503
        assert e.value.code == "model_not_ready"
        assert "after waiting 4 s" in e.value.message
        assert int(e.value.response.headers["retry-after"]) > 0
        # It was held for a start that was really asked for.
        assert h.decisions("submit", "never")
        assert held(h, "never") == 0


async def open_stream(c: openai.AsyncOpenAI, model: str) -> tuple[str, Any]:
    """A 100-token stream, begun: (replica, iterator over the rest of the chunks)."""
    raw = await c.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=100,
        stream=True,
    )
    it = raw.parse().__aiter__()
    await anext(it)  # the role chunk: the answer has begun
    return raw.headers["x-llmgw-replica"], it


async def words_of(it: Any) -> int:
    text = ""
    async for chunk in it:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return len(text.split())


async def test_a_draining_replica_gets_no_new_request(tmp_path: Path, prefix: str) -> None:
    model = tiny_model(
        "pair",
        engine={"kind": "command", "command": SLOW_ENGINE, "ready_timeout": "1m"},
        scaling={"min": 2, "max": 2},
    )
    # A long drain timeout: the drained replica stays, draining, while its stream runs.
    async with running(tmp_path, prefix, [model], drain_timeout="10m") as h, client(h) as c:
        await eventually(
            lambda: asyncio.sleep(0, len(ready_replicas(h, "pair")) == 2), "two ready", timeout=120
        )
        # Three long streams: two on one replica, one on the other (least
        # outstanding). The one with a single stream is drained: without the
        # drain, it is where every new request would go.
        streams = [await open_stream(c, "pair") for _ in range(3)]
        per = {rid: [it for r, it in streams if r == rid] for rid, _ in streams}
        assert sorted(len(v) for v in per.values()) == [1, 2]
        drained = next(rid for rid, v in per.items() if len(v) == 1)
        kept = next(rid for rid in per if rid != drained)
        assert h.rec.request_drain(drained, reason="test drain") == [drained]
        # At once, before the replacement the drain asks for (min 2) can be
        # ready: everything goes to the one replica left, the busier one.
        now = await asyncio.gather(*(chat_raw(c, "pair") for _ in range(3)))
        assert [rid for rid, _ in now] == [kept] * 3
        # And later too, when the replacement may be serving as well.
        later = [(await chat_raw(c, "pair"))[0] for _ in range(4)]
        assert drained not in later
        assert h.rec.replicas[drained].state().value == "draining"
        # The other replica's streams are untouched by the drain.
        for it in per[kept]:
            assert await words_of(it) == 100
        # The drained replica's own stream is not asserted on: the daemon's
        # drain reaches its agent, which waits for the engine's request count
        # (vLLM's /metrics) and, as the test engine has none, stops it after a
        # grace of 1 s, cutting the stream. Read to its end, to close it.
        with contextlib.suppress(openai.APIError):
            await words_of(per[drained][0])


async def test_a_replica_killed_mid_stream_fails_only_its_own_request(
    tmp_path: Path, prefix: str
) -> None:
    model = tiny_model(
        "duo",
        engine={"kind": "command", "command": SLOW_ENGINE, "ready_timeout": "1m"},
        scaling={"min": 2, "max": 2},
    )
    async with running(tmp_path, prefix, [model]) as h, client(h) as c:
        await eventually(
            lambda: asyncio.sleep(0, len(ready_replicas(h, "duo")) == 2), "two ready", timeout=120
        )

        # Two long streams, one on each replica (least outstanding requests).
        victim, doomed = await open_stream(c, "duo")
        survivor, healthy = await open_stream(c, "duo")
        assert victim != survivor
        job_id = h.rec.replicas[victim].job_id
        # SIGKILL to every process of the job: no drain, the engine dies mid-answer.
        subprocess.run(["scancel", "--signal=KILL", job_id], check=True)

        failures: list[openai.APIError] = []
        got = 0
        try:
            async for _ in doomed:
                got += 1
        except openai.APIError as exc:
            failures.append(exc)
        # It failed, once, cut short (not an answer that looks complete), and said why.
        assert len(failures) == 1, got
        assert "replica of model 'duo' failed after the answer began" in failures[0].message
        assert got < 100

        # New requests succeed right away, on the other replica, even before the
        # reconciler has seen the job go (a connection refused is retried once).
        for _ in range(6):
            rid, text = await chat_raw(c, "duo", "still here")
            assert rid == survivor
            assert "still" in text

        # The other stream went on untouched, to its end.
        assert await words_of(healthy) == 100
