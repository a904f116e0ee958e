"""Load: 1,000 concurrent streams through the gateway for a minute, twice; the held cap.

The daemon runs as its own process (llmgw-admin serve) so that its resident
memory and open files can be read from /proc; the replica is a real Slurm job
running the test engine with a delay between tokens, so each stream lasts
about a minute. Everything is on localhost and bounded: exactly STREAMS
requests at once, each with a fixed number of tokens.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from llmgw_slurm.guard.heap import IDLE_MIN_GROWTH
from tests.faults.support import daemon_process, model_states, record, with_router
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, tiny_model

STREAMS = 1000
TOKENS = 60
TOKEN_DELAY = 1.0  # TOKENS x TOKEN_DELAY: each stream is held about a minute
MAX_HELD = 50


def _engine(*extra: str) -> dict[str, Any]:
    cmd = [*tiny_model("x")["engine"]["command"], *extra]
    return {"kind": "command", "command": cmd, "ready_timeout": "1m"}


async def _stream(s: aiohttp.ClientSession, url: str, n: int) -> str:
    """One streamed chat; "" when it ended as specified, else what went wrong."""
    body = {
        "model": "loaded",
        "messages": [{"role": "user", "content": f"stream {n}"}],
        "stream": True,
        "max_tokens": TOKENS,
    }
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return f"HTTP {r.status}"
            tokens, done = 0, False
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        tokens += 1
            if not done:
                return "no [DONE]"
            return "" if tokens == TOKENS else f"{tokens} tokens"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__


async def _round(url: str) -> tuple[collections.Counter[str], float]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=TOKENS * TOKEN_DELAY * 4)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        got = await asyncio.gather(*(_stream(s, url, n) for n in range(STREAMS)))
    return collections.Counter(got), time.monotonic() - t0


async def test_a_thousand_streams_for_a_minute_leave_no_growth_and_the_held_cap_holds(
    tmp_path: Path, prefix: str
) -> None:
    h = Harness(tmp_path / "daemon", prefix)
    h.write(
        [
            tiny_model(
                "loaded",
                engine=_engine("--token-delay", str(TOKEN_DELAY)),
                scaling={"min": 1, "max": 1, "idle_timeout": "30m"},
            ),
            # Never ready within the test: its requests are held.
            tiny_model("cold", engine=_engine("--ready-after", "3600")),
        ]
    )
    with_router(h, max_held=MAX_HELD, hold_timeout="10m")
    # The 1,000 streams come from one user: above the per-peer connection bound's
    # default (256, issue 33), which tests/slurm/test_hostile_load.py checks.
    server = yaml.safe_load(h.server_yaml.read_text())
    server["connections"] = {"per_peer": 2 * STREAMS}
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))
    with daemon_process(h, tmp_path / "daemon.log") as d:

        async def loaded_ready() -> bool:
            return model_states(await d.status()).get("loaded") == "ready"

        await eventually(loaded_ready, "the loaded model ready", timeout=120)
        # Warm up (the first requests allocate what every later one reuses).
        warm, _ = await _round_small(h.url)
        assert warm == {"": 10}
        base = (d.rss_kib(), d.open_fds())

        async def settled() -> bool:
            # The gateway's idle connections to the engine close after the client
            # pool's keep-alive (15 s): then the files open are what they were.
            return d.open_fds() <= base[1] + 5

        async def trimmed() -> bool:
            # What the round's connections freed is back with the kernel: after a
            # pass with no request in flight, the daemon has collected Python's
            # cyclic garbage (what a connection held stays allocated until then)
            # and trimmed its heap from 1 MiB freed. Resident memory is then what
            # is in use, not garbage or where glibc's free chunks happened to land.
            return await _metric(h.url, "llmgw_heap_untrimmed_bytes") < IDLE_MIN_GROWTH

        async def idle_passes() -> None:
            # Two passes ended after the last connection closed: at least one ran
            # its collection and trim whole with nothing in flight.
            seen = (await d.status() or {}).get("passes", 0)

            async def two_more() -> bool:
                return (await d.status() or {}).get("passes", 0) >= seen + 2

            await eventually(two_more, "two passes with nothing in flight", timeout=60)

        first, secs1 = await _round(h.url)
        ended = time.monotonic()
        await eventually(settled, "open files back after round 1", timeout=120)
        settle1 = time.monotonic() - ended
        await idle_passes()
        await eventually(trimmed, "the heap trimmed after round 1", timeout=60)
        after1 = (d.rss_kib(), d.open_fds())
        trims1 = await _metric(h.url, "llmgw_heap_trims_total")
        second, secs2 = await _round(h.url)
        ended = time.monotonic()
        await eventually(settled, "open files back after round 2", timeout=120)
        settle2 = time.monotonic() - ended
        await idle_passes()
        await eventually(trimmed, "the heap trimmed after round 2", timeout=60)
        after2 = (d.rss_kib(), d.open_fds())
        trims2 = await _metric(h.url, "llmgw_heap_trims_total")

        # The held cap: MAX_HELD wait for "cold", every one past them is a 429 at once.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            body = {"model": "cold", "messages": [{"role": "user", "content": "wait"}]}
            held = [
                asyncio.create_task(s.post(h.url + "/v1/chat/completions", json=body))
                for _ in range(MAX_HELD)
            ]

            await eventually(lambda: _metric_held(h.url, MAX_HELD), "every request held")
            over = []
            for _ in range(10):
                async with s.post(h.url + "/v1/chat/completions", json=body) as r:
                    over.append((r.status, (await r.json())["error"]["code"]))
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)

    assert first == {"": STREAMS}, first
    assert second == {"": STREAMS}, second
    assert over == [(429, "too_many_held_requests")] * 10
    # No growth from one round to the next: what the first round allocated, the
    # second reused (memory within 10 %; open files came back above).
    assert after2[0] <= after1[0] * 1.10, (base, after1, after2)
    record(
        "load: 1,000 concurrent streams x2",
        requests_sent=2 * STREAMS + 10,
        requests_failed=sum(n for k, n in (first + second).items() if k),
        failures=dict((first + second) - collections.Counter({"": 2 * STREAMS})),
        round_seconds=[round(secs1, 1), round(secs2, 1)],
        rss_kib=[base[0], after1[0], after2[0]],
        open_fds=[base[1], after1[1], after2[1]],
        held_cap=MAX_HELD,
        over_cap_answers=dict(collections.Counter(str(s) for s, _ in over)),
        replicas_lost=0,
        duplicate_jobs=0,
        fds_back_after_s=[round(settle1, 1), round(settle2, 1)],
        heap_trims=[trims1, trims2],
        notes="rss/fds: before, after round 1, after round 2 (each once idle connections "
        "closed and the heap trimmed)",
    )


async def _round_small(url: str) -> tuple[collections.Counter[str], float]:
    async with aiohttp.ClientSession() as s:
        body = {
            "model": "loaded",
            "messages": [{"role": "user", "content": "warm"}],
            "max_tokens": 1,
        }
        got = []
        for _ in range(10):
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                got.append("" if r.status == 200 else f"HTTP {r.status}")
    return collections.Counter(got), 0.0


async def _scrape(url: str) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return (await r.text()).splitlines()


async def _metric_held(url: str, n: int) -> bool:
    for line in await _scrape(url):
        if line.startswith("llmgw_held_requests{") and 'model="cold"' in line:
            try:
                return float(line.rsplit(" ", 1)[1]) >= n
            except ValueError:
                return False
    return False


async def _metric(url: str, name: str) -> float:
    for line in await _scrape(url):
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
