"""``llmgw-admin db import``: one daemon's state directory into the shared database.

A daemon without a database runs a batch to its end (its records, its key, its
usage in its state directory); it stops; its state is imported; a daemon on
the database (another login node, with the same shared batch folder) then
serves the batch's results to the same key, and the usage is all there.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import sqlite3
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.cli.admin import main as admin
from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peer, Peers, agent_yaml
from tests.slurm.conftest import eventually
from tests.slurm.harness import tiny_model
from tests.slurm.test_batch import lines

pytestmark = [pytest.mark.ha]

FAST = tiny_model("fast", scaling={"min": 0, "max": 1})


def _client(p: Peer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=p.url + "/v1", api_key=key, max_retries=0, timeout=60)


async def test_import_then_the_batch_through_the_other_daemon(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    prefix = "ha" + secrets.token_hex(3) + "."
    peers = Peers.make(tmp_path, prefix, pgdb, [FAST], n=1)
    batch = {"partition": "llm", "concurrency": 2, "poll_interval": "1s"}
    batch_dir = tmp_path / "shared-batch"
    alone = Peer(
        "alone",
        tmp_path / "alone",
        prefix,
        None,
        extra={"batch": {**batch, "directory": str(batch_dir)}},
    )
    alone.write(tmp_path)
    (tmp_path / "agent.yaml").write_text(agent_yaml(tmp_path))
    key = add_key(tmp_path / "keys.json", "alice").key
    b = peers[0]
    b.extra["batch"] = {**batch, "directory": str(batch_dir)}
    b.write(tmp_path)
    try:
        alone.start()
        c = _client(alone, key)

        async def up() -> bool:
            return alone.get("/healthz") is not None

        await eventually(up, "the daemon without a database to answer")
        f = await c.files.create(file=("in.jsonl", io.BytesIO(lines("fast", 4))), purpose="batch")
        created = await c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def completed() -> bool:
            return (await c.batches.retrieve(created.id)).status == "completed"

        await eventually(completed, "the batch to complete", 180)
        alone.stop()
        usage_db = alone.folder / "state" / "usage.sqlite3"
        with contextlib.closing(sqlite3.connect(usage_db)) as db:
            row = db.execute("SELECT count(*), sum(total_tokens) FROM usage").fetchone()
        assert row[0] >= 1 and row[1] > 0, row

        runner = CliRunner()
        argv = ["db", "import", str(alone.folder / "state"), "--server", str(b.server_yaml)]
        first = runner.invoke(admin, argv)
        assert first.exit_code == 0, first.output
        assert "keys: 1" in first.output and "batches: 1" in first.output, first.output
        # Again: nothing counted twice.
        again = runner.invoke(admin, argv)
        assert again.exit_code == 0 and "usage records: 0" in again.output, again.output
        with contextlib.closing(pgdb.connect()) as conn:
            got = conn.execute("SELECT count(*), sum(total_tokens) FROM llmgw_usage").fetchone()
        assert got is not None and (got[0], int(got[1])) == (row[0], row[1])

        b.start()
        await peers.leader()
        cb = _client(b, key)
        done = await cb.batches.retrieve(created.id)
        assert done.status == "completed" and done.output_file_id is not None
        content = (await cb.files.content(done.output_file_id)).read()
        out = [json.loads(line) for line in content.splitlines()]
        assert sorted(o["custom_id"] for o in out) == [f"q{i}" for i in range(4)]
    finally:
        alone.stop()
        peers.stop()
        peers.cancel_all()
