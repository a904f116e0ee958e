"""Usage equals the engine's own counters after streams cut after their last token
(issue 13, item 4), through a real replica on the dev cluster.

The test engine sends each stream's usage chunk a moment after the last token,
as vLLM does; the clients read to ``finish_reason`` and reset the connection
before it arrives, as the issue's did (20 streams: 800 tokens in vLLM, 280
counted).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from llmgw_slurm.auth.keys import add_key
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, Harness, running, tiny_model

STREAMS = 20
MAX_TOKENS = 40
PROMPT = " ".join(f"w{i}" for i in range(10))


async def cut_after_last_token(url: str, key: str) -> None:
    body = {
        "model": "counted",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": MAX_TOKENS,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("finish_reason"):
                    break
        conn = resp.connection
        if conn is not None and conn.transport is not None:
            conn.transport.abort()
        resp.close()


async def engine_stats(h: Harness) -> dict[str, Any]:
    (ep,) = h.rec.endpoints("counted")
    headers = {"Authorization": f"Bearer {ep.api_key}"}
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{ep.base_url}/debug/stats", headers=headers, ssl=ep.ssl) as resp,
    ):
        stats: dict[str, Any] = await resp.json()
        return stats


async def test_usage_equals_the_engines_counters_after_20_streams_cut_after_their_last_token(
    tmp_path: Path, prefix: str
) -> None:
    keys_file = tmp_path / "keys.json"
    key = add_key(keys_file, "alice").key
    model = tiny_model(
        "counted",
        engine={"kind": "command", "command": [*TINY_ENGINE, "--usage-delay", "0.5"]},
        scaling={"min": 1, "max": 1},
    )
    async with running(tmp_path, prefix, [model], router={"keys_file": str(keys_file)}) as h:

        async def ready() -> bool:
            return bool(h.rec.endpoints("counted"))

        await eventually(ready, "the replica to serve", timeout=120)
        await asyncio.gather(*(cut_after_last_token(h.url, key) for _ in range(STREAMS)))

        async def engine_done() -> dict[str, Any] | None:
            st = await engine_stats(h)
            return st if st["in_flight"] == 0 else None

        stats = await eventually(engine_done, "the engine's answers to end")
        assert stats["completion_tokens"] == STREAMS * MAX_TOKENS

        async def usage() -> dict[str, Any] | None:
            headers = {"Authorization": f"Bearer {key}"}
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"{h.url}/api/v1/usage", headers=headers) as resp,
            ):
                body = await resp.json()
            rows = [m for m in body["models"] if m["model"] == "counted"]
            return rows[0] if rows and rows[0]["requests"] == STREAMS else None

        row = await eventually(usage, f"{STREAMS} requests in the usage", timeout=60)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            stats["prompt_tokens"],
            stats["completion_tokens"],
        )
