"""Two gateways on one database share keys, budgets and usage.

- a key made with ``llmgw-admin keys add`` works through both gateways at once,
  and one revoked is refused by both;
- one user's day budget of N tokens, spent through both gateways at once: the
  total is at most N (each gateway lets in only what the other counted first,
  llmgw_slurm/db/quota.py), and near it (what is left is printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from llmgw_slurm.cli.admin import main as admin
from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peers
from tests.ha.test_failover import ready_on
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, tiny_model

pytestmark = [pytest.mark.ha]

# 0.1 s a token: a request of 5 tokens takes about half a second, so that the
# clients of both gateways have requests in flight at once near the budget's end.
SLOW = tiny_model(
    "slow",
    engine={"kind": "command", "command": [*TINY_ENGINE, "--token-delay", "0.1"]},
    scaling={"min": 1, "max": 1},
)
BUDGET = 600
MAX_TOKENS = 5
CLIENTS = 3  # per gateway


def keys(peers: Peers, *args: str) -> str:
    result = CliRunner().invoke(admin, ["keys", *args, "--server", str(peers[0].server_yaml)])
    assert result.exit_code == 0, result.output
    return result.output


async def answers(url: str, key: str) -> int:
    """The HTTP status of one request with ``key``."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    try:
        await c.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code
    finally:
        await c.close()


async def test_keys_and_a_day_budget_hold_across_both_gateways(
    pgdb: PgDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "ha" + secrets.token_hex(3) + "."
    peers = Peers.make(tmp_path, prefix, pgdb, [SLOW], quotas={"user_tokens_per_day": BUDGET})
    try:
        peers.start()
        await peers.leader()
        for p in peers.peers:
            await ready_on(p, "slow")
        # A key made while both run: known by both within a moment, no restart.
        key = keys(peers, "add", "alice").splitlines()[1]

        async def both_let_in() -> bool:
            codes = [await answers(p.url, key) for p in peers.peers]
            return codes == [200, 200]

        await eventually(both_let_in, "the new key to work on both gateways", 10)
        spent_before = await _spent(pgdb, "alice")

        # The budget, spent through both gateways at once until both refuse.
        async def client(url: str) -> int:
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
            n = 0
            try:
                while True:
                    try:
                        await c.chat.completions.create(
                            model="slow",
                            messages=[{"role": "user", "content": "hi"}],
                            max_tokens=MAX_TOKENS,
                        )
                        n += 1
                    except openai.RateLimitError:
                        return n
            finally:
                await c.close()

        done = await asyncio.gather(*(client(p.url) for p in peers.peers for _ in range(CLIENTS)))
        assert all(done[:CLIENTS]) and all(done[CLIENTS:]), f"both gateways served: {done}"

        async def written() -> int | None:
            await asyncio.sleep(1.5)  # the usage of the last answers is written within a second
            return await _spent(pgdb, "alice")

        total = await written()
        assert total is not None
        # A request spends no more than its reservation (its prompt's estimate, 2
        # tokens, and max_tokens; the engine counts "hi" as 1 token): nothing goes over.
        assert total <= BUDGET, f"spent {total} of {BUDGET} through both gateways"
        # What stops the last clients: less left than their requests may spend, with
        # what the other gateway may still hold for its own (a few tokens a request).
        reservation = MAX_TOKENS + 4
        assert total >= BUDGET - 2 * CLIENTS * reservation, (total, spent_before)
        with capsys.disabled():
            print(
                f"\nbudget {BUDGET} through 2 gateways x {CLIENTS} clients: spent {total} "
                f"({BUDGET - total} left); requests per client {done}"
            )

        # Revoked on the command line: refused by both gateways.
        key_id = key.split("-")[1]
        keys(peers, "revoke", key_id)

        async def both_refuse() -> bool:
            return [await answers(p.url, key) for p in peers.peers] == [401, 401]

        await eventually(both_refuse, "the revoked key to be refused by both", 10)
    finally:
        peers.stop()
        peers.cancel_all()


async def _spent(db: PgDatabase, user: str) -> int:
    def read() -> int:
        with contextlib.closing(db.connect()) as conn:
            row = conn.execute(
                "SELECT coalesce(sum(total_tokens), 0) FROM llmgw_usage WHERE user_name = %s",
                (user,),
            ).fetchone()
        return int(row[0]) if row else 0

    return await asyncio.to_thread(read)
