"""One key cannot fill a cold model's hold queue (issue 13, item 7)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from _router_support import eventually
from test_router import stack  # type: ignore[import-not-found]

from llmgw_slurm.config import load_server_config
from llmgw_slurm.router import Endpoint, RouterConfig
from llmgw_slurm.router.keys import KeyRing, add_key


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
        assert st.gateway.held_by_key == {}


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


def test_server_yaml_max_held_per_key(tmp_path: Path) -> None:
    p = tmp_path / "server.yaml"
    p.write_text("router: {max_held_per_key: 3}\n")
    assert load_server_config(p).router.max_held_per_key == 3
    p.write_text("router: {}\n")
    assert load_server_config(p).router.max_held_per_key is None
