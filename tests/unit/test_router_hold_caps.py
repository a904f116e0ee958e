"""One key, one user or one account cannot fill a cold model's hold queue (issue 13, item 7;
issue 33, item 5; issue 37, item 3)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from _router_support import eventually
from test_router import stack  # type: ignore[import-not-found]

from llmgw_slurm.auth.keys import KeyRing, add_key
from llmgw_slurm.config import load_server_config
from llmgw_slurm.router import Endpoint, RouterConfig


async def test_a_key_over_its_cap_gets_429_while_other_keys_are_still_held(
    tmp_path: Path,
) -> None:
    keyfile = tmp_path / "keys.json"
    alice, bob = add_key(keyfile, "alice"), add_key(keyfile, "bob")
    # The default cap: a quarter of the model's queue.
    cfg = RouterConfig(max_held=8, hold_timeout=30)
    async with stack(config=cfg, keys=KeyRing(keyfile), start_ready=False) as st:
        a, b = st.client(alice.key), st.client(bob.key)
        held = [
            asyncio.create_task(a.completions.create(model="tiny", prompt=f"a{i}", max_tokens=1))
            for i in range(2)
        ]
        await eventually(lambda: st.gateway.held.get("tiny") == 2, "alice's two held requests")
        with pytest.raises(openai.RateLimitError) as ei:
            await a.completions.create(model="tiny", prompt="a3")
        err = ei.value
        assert err.status_code == 429 and err.response.headers["Retry-After"] == "30"
        body = err.response.json()["error"]
        assert body["type"] == "rate_limit_error"
        assert body["code"] == "too_many_held_requests_for_key"
        assert "2 requests waiting for model 'tiny'" in body["message"]
        # Bob is not refused for Alice's queue.
        held += [
            asyncio.create_task(b.completions.create(model="tiny", prompt=f"b{i}", max_tokens=1))
            for i in range(2)
        ]
        await eventually(lambda: st.gateway.held.get("tiny") == 4, "bob's held requests too")
        st.directory.add_endpoint("tiny", Endpoint("r0", st.engines["r0"], "key-r0"))
        outs = await asyncio.gather(*held)
        assert sorted(o.choices[0].text for o in outs) == ["a0", "a1", "b0", "b1"]
        assert st.gateway.held_total == 0
        assert st.gateway.holds.waiting("key", alice.record.key_id, "tiny") == 0


async def test_the_cap_is_configurable_and_freed_when_a_held_request_ends(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys.json"
    alice = add_key(keyfile, "alice")
    cfg = RouterConfig(max_held=8, max_held_per_key=1, hold_timeout=0.3)
    async with stack(config=cfg, keys=KeyRing(keyfile), start_ready=False) as st:
        a = st.client(alice.key)
        first = asyncio.create_task(a.completions.create(model="tiny", prompt="a"))
        await eventually(lambda: st.gateway.held.get("tiny") == 1, "one held request")
        with pytest.raises(openai.RateLimitError):
            await a.completions.create(model="tiny", prompt="b")
        with pytest.raises(openai.InternalServerError):
            await first  # 503 at the deadline: its slot is free again
        with pytest.raises(openai.InternalServerError) as ei:
            await a.completions.create(model="tiny", prompt="c")
        assert ei.value.status_code == 503


def test_server_yaml_max_held_per_key_user_and_account(tmp_path: Path) -> None:
    p = tmp_path / "server.yaml"
    p.write_text("router: {max_held_per_key: 3, max_held_per_user: 4, max_held_per_account: 5}\n")
    r = load_server_config(p).router
    assert (r.max_held_per_key, r.max_held_per_user, r.max_held_per_account) == (3, 4, 5)
    p.write_text("router: {}\n")
    r = load_server_config(p).router
    assert (r.max_held_per_key, r.max_held_per_user, r.max_held_per_account) == (None,) * 3


async def hold(c: openai.AsyncOpenAI, prompt: str) -> asyncio.Task[object]:
    return asyncio.create_task(c.completions.create(model="tiny", prompt=prompt, max_tokens=1))


async def test_a_user_with_many_keys_gets_one_users_share(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys.json"
    # As `llmgw login` gives them: three keys of alice's, one of bob's.
    alices = [add_key(keyfile, "alice", "phys") for _ in range(3)]
    bob = add_key(keyfile, "bob", "chem")
    cfg = RouterConfig(max_held=8, hold_timeout=30)  # a key's and a user's share: 2
    async with stack(config=cfg, keys=KeyRing(keyfile), start_ready=False) as st:
        a = [st.client(k.key) for k in alices]
        held = [await hold(a[0], "a0"), await hold(a[1], "a1")]
        await eventually(lambda: st.gateway.held.get("tiny") == 2, "alice's two")
        with pytest.raises(openai.RateLimitError) as ei:
            await a[2].completions.create(model="tiny", prompt="a2", max_tokens=1)
        body = ei.value.response.json()["error"]
        assert body["code"] == "too_many_held_requests_for_user"
        assert body["message"].startswith("User alice has 2 requests waiting for model 'tiny'")
        assert "router.max_held_per_user" in body["message"]
        assert ei.value.response.headers["Retry-After"] == "30"
        held.append(await hold(st.client(bob.key), "b0"))  # bob's share is his own
        await eventually(lambda: st.gateway.held.get("tiny") == 3, "bob's too")
        st.directory.add_endpoint("tiny", Endpoint("r0", st.engines["r0"], "key-r0"))
        assert len(await asyncio.gather(*held)) == 3


async def test_one_account_cannot_take_all_of_a_cold_models_queue(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys.json"
    phys = [add_key(keyfile, f"p{i}", "phys") for i in range(3)]
    chem = add_key(keyfile, "c0", "chem")
    cfg = RouterConfig(max_held=8, hold_timeout=30)  # an account's share: half, 4
    async with stack(config=cfg, keys=KeyRing(keyfile), start_ready=False) as st:
        p = [st.client(k.key) for k in phys]
        held = [await hold(p[i // 2], f"p{i}") for i in range(4)]
        await eventually(lambda: st.gateway.held.get("tiny") == 4, "four of phys")
        with pytest.raises(openai.RateLimitError) as ei:
            await p[2].completions.create(model="tiny", prompt="p4", max_tokens=1)
        body = ei.value.response.json()["error"]
        assert body["code"] == "too_many_held_requests_for_account"
        assert body["message"].startswith("Slurm account phys has 4 requests waiting")
        assert "router.max_held_per_account" in body["message"]
        # Another account still finds room, up to the model's queue.
        held += [await hold(st.client(chem.key), f"c{i}") for i in range(2)]
        await eventually(lambda: st.gateway.held.get("tiny") == 6, "chem's two")
        st.directory.add_endpoint("tiny", Endpoint("r0", st.engines["r0"], "key-r0"))
        assert len(await asyncio.gather(*held)) == 6
        assert st.gateway.holds.waiting("account", "phys", "tiny") == 0
