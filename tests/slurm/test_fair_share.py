"""Fair share on the dev cluster (issue 37): a model kept busy does not starve another.

Two on-demand models that fit only one at a time: both ask for an h100, which
only gpunode5 has (two), and the fixture holds one of them with somebody else's
job for the module (cancelled after), so exactly one GPU is theirs. ``w1`` is
started for a request and then kept busy by a client (two requests in flight at
all times, never idle): eviction never takes it. A request for ``w2`` is held;
once it has waited ``scaling.max_wait`` and ``w1`` has had its turn
(``scaling.min_slice``), ``w1`` is drained for it: its requests in flight
finish, then its job is cancelled, and ``w2`` starts on the GPU. Without fair
share the held request would get its 503 at the end of the hold (90 s).
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import pytest_asyncio
import yaml

from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, filler, running, tiny_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Each token takes a quarter second: a request of 12 tokens is in flight for 3 s,
# well within the drain timeout (15 s), so a drain never cuts one.
SLOW = [*tiny_model("x")["engine"]["command"], "--token-delay", "0.25"]
TOKENS = 12


def model(name: str) -> dict[str, Any]:
    return tiny_model(
        name,
        engine={"kind": "command", "command": SLOW, "ready_timeout": "1m"},
        resources={"gpus": 1, "gpu_type": "h100", "partition": "llm"},
        scaling={"min": 0, "max": 1, "idle_timeout": "10m"},
    )


def fair_share(h: Harness) -> None:
    """server.yaml's scaling: a short wait and slice, so the test takes a minute."""
    server = yaml.safe_load(h.server_yaml.read_text())
    server["scaling"] = {"fair_share": True, "max_wait": "10s", "min_slice": "20s"}
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))


@dataclass
class Answer:
    model: str
    sent: float
    done: float
    tokens: int
    finish: str


async def chat(h: Harness, name: str) -> Answer:
    sent = time.time()
    async with openai.AsyncOpenAI(
        base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=180
    ) as c:
        r = await c.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": f"hello {name}"}],
            max_tokens=TOKENS,
        )
    usage = r.usage.completion_tokens if r.usage else 0
    return Answer(name, sent, time.time(), usage, r.choices[0].finish_reason or "")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_gpu(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    prefix = f"llmgwtest-{secrets.token_hex(3)}."
    held = filler(prefix, "gpu:h100:1", "--nodelist=gpunode5")
    try:

        async def holding() -> bool:
            out = await asyncio.to_thread(
                subprocess.run,
                ["squeue", "-h", "-o", "%T", "-j", held],
                capture_output=True,
                text=True,
            )
            return out.stdout.strip() == "RUNNING"

        await eventually(holding, "the filler to hold one h100 of gpunode5")
        async with running(
            tmp_path_factory.mktemp("fair"),
            prefix,
            [model("w1"), model("w2")],
            configure=fair_share,
        ) as h:
            yield h
    finally:
        subprocess.run(["scancel", held], check=False)


async def test_a_held_request_is_answered_while_the_other_model_stays_busy(
    one_gpu: Harness,
) -> None:
    h = one_gpu
    assert (await chat(h, "w1")).tokens == TOKENS  # w1 starts for a request
    answers: list[Answer] = []
    errors: list[BaseException] = []
    stop = asyncio.Event()

    async def keep_busy() -> None:
        while not stop.is_set():
            try:
                answers.append(await chat(h, "w1"))
            except (openai.OpenAIError, OSError) as exc:
                errors.append(exc)
                return

    notes: dict[str, set[str]] = {"w1": set(), "w2": set()}

    async def watch_notes() -> None:
        while not stop.is_set():
            for name, seen in notes.items():
                seen.add(h.rec.notes.get(name, ""))
            await asyncio.sleep(0.2)

    clients = [asyncio.create_task(keep_busy()) for _ in range(2)]
    clients.append(asyncio.create_task(watch_notes()))
    try:
        await eventually(
            lambda: asyncio.sleep(0, sum(r.in_flight for r in h.rec.replicas.values()) >= 1),
            "w1 serving",
        )
        # w1 is busy all along: nothing is idle enough to evict, yet w2's request
        # is answered (a 503 after the 90 s hold would raise here).
        w2 = await chat(h, "w2")
        assert (w2.tokens, w2.finish) == (TOKENS, "length")
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    assert errors == []
    (drain,) = h.decisions("drain", "w1")
    assert drain.reason.startswith("fair share: making room for w2 (waiting ")
    assert "max_wait 10s" in drain.reason and "past its 20s turn" in drain.reason
    assert drain.at >= w2.sent
    # Drained, not killed: the cancel came once nothing was in flight, and every
    # request w1 was serving when the drain began was answered in full.
    (cancel,) = [d for d in h.decisions("cancel", "w1") if d.replica_id == drain.replica_id]
    assert cancel.reason == f"drained ({drain.reason})"
    in_flight = [a for a in answers if a.sent < drain.at < a.done]
    assert in_flight, "no request of w1 was in flight when it was drained"
    assert all((a.tokens, a.finish) == (TOKENS, "length") for a in answers)
    assert not h.decisions("evict", "w1")
    # The waiting model's note said which replica was drained for it, and the drained
    # model's note for whom.
    rid = drain.replica_id
    assert any(f"fair share: draining w1 {rid} (serving " in n for n in notes["w2"]), notes
    assert any(n.startswith(f"{rid} draining: fair share: making room for w2") for n in notes["w1"])
    # Both asked again after: w1's requests sent during its drain were held and served.
    assert [a for a in answers if a.sent > drain.at]
