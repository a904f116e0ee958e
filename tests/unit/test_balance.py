"""Consistent hashing with bounded loads (router/balance.py), and the gateway using it."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack

import aiohttp
from _router_support import engine, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_slurm.router import GATEWAY_KEY, Endpoint, StaticDirectory, create_app
from llmgw_slurm.router.balance import Ring, bound, choose, prefix_key
from llmgw_slurm.router.directory import ModelRouting

KEYS = [f"system prompt {i}" for i in range(4000)]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 12),
    factor=st.floats(1.0, 3.0),
    keys=st.lists(st.text(max_size=20), min_size=1, max_size=200),
)
def test_no_replica_goes_above_the_bound(n: int, factor: float, keys: list[str]) -> None:
    ids = [f"r{i}" for i in range(n)]
    loads = [0] * n
    for k in keys:
        limit = bound(loads, factor)
        i = choose(ids, loads, k, factor)
        loads[i] += 1
        assert loads[i] <= limit
        # So no replica is ever above ceil(factor * mean load).
        assert max(loads) <= math.ceil(factor * sum(loads) / n)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 10))
def test_adding_one_replica_moves_about_one_in_n_plus_1(n: int) -> None:
    before = Ring([f"r{i}" for i in range(n)])
    after = Ring([f"r{i}" for i in range(n + 1)])
    moved = [k for k in KEYS if next(before.walk(k)) != next(after.walk(k))]
    # Only keys that now belong to the new replica moved: none between old ones.
    assert all(next(after.walk(k)) == f"r{n}" for k in moved)
    share = len(moved) / len(KEYS)
    # 1/(n+1), within what 100 points a replica leaves to chance.
    assert 0.5 / (n + 1) < share < 1.6 / (n + 1)


def test_removing_a_replica_moves_only_its_keys() -> None:
    ids = [f"r{i}" for i in range(6)]
    before = Ring(ids)
    after = Ring([r for r in ids if r != "r3"])
    for k in KEYS:
        owner = next(before.walk(k))
        if owner != "r3":
            assert next(after.walk(k)) == owner


def test_a_key_stays_put_while_its_replica_is_within_bound_and_spills_in_ring_order() -> None:
    ids = ["a", "b", "c"]
    home = choose(ids, [0, 0, 0], "shared system prompt", 1.25)
    # The same key, any loads that leave its replica room: the same replica.
    loads = [2, 2, 2]
    assert choose(ids, loads, "shared system prompt", 1.25) == home
    # Its replica full: the next one clockwise, not the least loaded one.
    loads = [0, 0, 0]
    loads[home] = 10
    walk = list(Ring(ids).walk("shared system prompt"))
    assert walk[0] == ids[home]
    second = ids.index(walk[1])
    assert choose(ids, loads, "shared system prompt", 1.25) == second


def test_prefix_key_reads_the_prompt_in_order_and_stops_at_the_length() -> None:
    system = {"role": "system", "content": "S" * 50}
    chat_a = {"messages": [system, {"role": "user", "content": "hello"}], "model": "m"}
    chat_b = {"messages": [system, {"role": "user", "content": "other"}], "model": "x"}
    assert prefix_key(chat_a, 40) == prefix_key(chat_b, 40)
    assert prefix_key(chat_a, 200) != prefix_key(chat_b, 200)
    assert len(prefix_key(chat_a, 40) or "") == 40
    assert prefix_key({"prompt": "abcdef"}, 3) == "abc"
    assert prefix_key({"prompt": [1, 2, 3]}, 100) == "1\x002\x003"
    assert prefix_key({"instructions": "be brief", "input": "hi"}, 100) == "be brief\x00hi"
    assert prefix_key({"model": "m"}, 100) is None


async def test_the_gateway_keeps_a_prefix_on_one_replica_under_policy_prefix() -> None:
    directory = StaticDirectory()
    directory.add_model("tiny", routing=ModelRouting(policy="prefix", prefix_chars=64))
    app = create_app(directory)
    async with AsyncExitStack() as es:
        url = await es.enter_async_context(serve(app))
        for i in range(4):
            eurl = await es.enter_async_context(engine("tiny", key=f"k{i}"))
            directory.add_endpoint("tiny", Endpoint(f"r{i}", eurl, f"k{i}"))
        seen: dict[str, set[str]] = {}
        async with aiohttp.ClientSession() as s:
            for p in range(4):
                for turn in range(6):
                    body = {
                        "model": "tiny",
                        "messages": [
                            {"role": "system", "content": f"prompt {p} " + "x" * 80},
                            {"role": "user", "content": f"turn {turn}"},
                        ],
                    }
                    r = await s.post(url + "/v1/chat/completions", json=body)
                    assert r.status == 200
                    seen.setdefault(str(p), set()).add(r.headers["X-Llmgw-Replica"])
        # One at a time, so loads never bind: each prefix on exactly one replica.
        assert all(len(v) == 1 for v in seen.values())
        assert app[GATEWAY_KEY].in_flight == {}
