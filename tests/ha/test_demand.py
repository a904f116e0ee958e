"""A request held on the gateway that does not lead: the leader starts the model for it.

The request waits on the follower (its held request is in the database); the
leader, woken by the notification, submits the replica under its epoch; the
agent reports to whichever daemon answers; the follower routes the held
request as soon as the replica is ready there; and the leader's plan saw the
follower's requests in flight (the replica is not idle while they run).
"""

from __future__ import annotations

import asyncio
import re
import secrets
from pathlib import Path

import openai
import pytest

from llmgw_slurm.db.keys import PgKeyStore
from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peers
from tests.ha.test_failover import replica_jobs
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, tiny_model

pytestmark = [pytest.mark.ha]

COLD = tiny_model(
    "cold",
    engine={"kind": "command", "command": [*TINY_ENGINE, "--token-delay", "0.5"]},
    scaling={"min": 0, "max": 1},
)


async def test_a_request_held_on_the_follower_is_served(pgdb: PgDatabase, tmp_path: Path) -> None:
    key = PgKeyStore(pgdb.info()).add("dave").key
    peers = Peers.make(tmp_path, "ha" + secrets.token_hex(3) + ".", pgdb, [COLD])
    try:
        peers.start()
        leader = await peers.leader()
        follower = peers[1] if leader is peers[0] else peers[0]
        epoch = (await leader.cluster() or {})["epoch"]
        assert peers.jobs() == []
        c = openai.AsyncOpenAI(
            base_url=follower.url + "/v1", api_key=key, max_retries=0, timeout=120
        )
        # Slow answers (0.5 s a token): the leader's view of the follower's load is
        # checked while they run.
        asks = [
            asyncio.create_task(
                c.chat.completions.create(
                    model="cold", messages=[{"role": "user", "content": "hi"}], max_tokens=12
                )
            )
            for _ in range(2)
        ]

        async def busy_seen_by_leader() -> bool:
            st = await leader.status()
            reps = [r for m in (st or {}).get("models", []) for r in m["replicas"]]
            return any(r["in_flight"] >= 1 for r in reps)

        await eventually(busy_seen_by_leader, "the leader to see the follower's requests", 120)
        for r in await asyncio.gather(*asks):
            assert r.usage is not None and r.usage.completion_tokens > 0
        await c.close()
        [job] = replica_jobs(peers, "cold")
        assert re.search(rf"\bepoch={epoch}\b", job["comment"]), job
    finally:
        peers.stop()
        peers.cancel_all()
