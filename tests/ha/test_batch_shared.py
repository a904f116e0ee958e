"""A batch created through the daemon that does not lead: the leader's poll submits its
job (fenced, under its epoch), any gateway tells its progress, and its results are
fetched through the other gateway."""

from __future__ import annotations

import io
import json
import re
import secrets
from pathlib import Path

import openai
import pytest

from llmgw_slurm.db.keys import PgKeyStore
from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peers
from tests.slurm.conftest import eventually
from tests.slurm.harness import tiny_model
from tests.slurm.test_batch import lines

pytestmark = [pytest.mark.ha]

FAST = tiny_model("fast", scaling={"min": 0, "max": 1})


async def test_a_batch_made_on_the_follower_runs_and_is_read_on_the_leader(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    key = PgKeyStore(pgdb.info()).add("frank").key
    batch = {"partition": "llm", "concurrency": 2, "poll_interval": "1s"}
    batch["directory"] = str(tmp_path / "shared-batch")
    peers = Peers.make(tmp_path, "ha" + secrets.token_hex(3) + ".", pgdb, [FAST], batch=batch)
    try:
        peers.start()
        leader = await peers.leader()
        follower = peers[1] if leader is peers[0] else peers[0]
        epoch = (await leader.cluster() or {})["epoch"]

        def client(url: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)

        cf, cl = client(follower.url), client(leader.url)
        f = await cf.files.create(file=("in.jsonl", io.BytesIO(lines("fast", 3))), purpose="batch")
        created = await cf.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        # Found through the other gateway at once (the create waited for its write).
        assert (await cl.batches.retrieve(created.id)).id == created.id

        async def completed() -> bool:
            return (await cl.batches.retrieve(created.id)).status == "completed"

        await eventually(completed, "the batch to complete", 180)
        done = await cf.batches.retrieve(created.id)
        assert done.status == "completed" and done.output_file_id is not None
        out = [
            json.loads(x) for x in (await cl.files.content(done.output_file_id)).read().splitlines()
        ]
        assert sorted(o["custom_id"] for o in out) == ["q0", "q1", "q2"]
        async def in_history() -> list[dict[str, str]] | None:
            # slurmdbd records a job a moment after slurmctld ran it.
            jobs = [h for h in peers.history() if h["name"].endswith(created.id)]
            return jobs if jobs and all(j["comment"] for j in jobs) else None

        [job] = await eventually(in_history, "the batch job in sacct")
        assert re.search(rf"\bepoch={epoch}\b", job["comment"]), job
        await cf.close()
        await cl.close()
    finally:
        peers.stop()
        peers.cancel_all()
