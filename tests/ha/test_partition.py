"""The leader loses the database while the other daemon still reaches it: fencing.

The leader's way to the database is cut (a proxy, on loopback). It stops
acting by its own deadline; the other takes the lease with the next epoch.
Then the replica's job is cancelled behind both daemons' backs: either would
submit a new one. Only the new leader does, under its epoch: the job history
(sacct and the actions table) shows no action of the old epoch after the cut.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from psycopg import conninfo as pgconninfo

from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peers
from tests.ha.proxy import Proxy
from tests.ha.test_failover import ALWAYS, ready_on, replica_jobs
from tests.slurm.conftest import eventually

pytestmark = [pytest.mark.ha]


async def test_the_leader_cut_from_the_database_stops_acting_before_the_other_starts(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    port = int(pgconninfo.conninfo_to_dict(pgdb.dsn)["port"])
    proxy = Proxy(port)
    await proxy.start()
    peers = Peers.make(tmp_path, "ha" + secrets.token_hex(3) + ".", pgdb, [ALWAYS])
    a, b = peers[0], peers[1]
    a.db["dsn"] = pgconninfo.make_conninfo(pgdb.dsn, port=proxy.port)
    a.write(tmp_path)
    try:
        a.start()
        await peers.leader()
        b.start()
        first = await a.cluster()
        assert first is not None and first["leading"] and first["epoch"] == 1
        await ready_on(a, "tiny")
        [job] = peers.jobs()

        cut_at = time.time()
        await proxy.cut()

        async def b_leads() -> dict[str, Any] | None:
            c = await b.cluster()
            return c if c and c["leading"] and c["first_pass_at"] else None

        c = await eventually(b_leads, "b to take the lease", 60)
        assert c["epoch"] == 2
        # a knows by its own clock that it no longer leads.
        a_view = await a.cluster()
        assert a_view is not None and not a_view["leading"], a_view

        # The replica's job ends behind both daemons' backs: each would submit anew.
        subprocess.run(["scancel", job[0]], check=True)

        async def replaced() -> list[dict[str, str]] | None:
            jobs = [j for j in replica_jobs(peers, "tiny") if j["id"] != job[0]]
            return jobs or None

        new = await eventually(replaced, "a new job for the replica", 90)
        await ready_on(b, "tiny")
        jobs = replica_jobs(peers, "tiny")
        # One new job, by the new leader, under its epoch; none of the old epoch since.
        assert len(jobs) == 2, jobs
        assert [re.search(r"epoch=(\d+)", j["comment"]).group(1) for j in new] == ["2"]  # type: ignore[union-attr]
        with contextlib.closing(pgdb.connect()) as conn:
            rows = conn.execute(
                "SELECT epoch, holder, kind, extract(epoch FROM started_at) FROM llmgw_actions"
            ).fetchall()
            acquired = conn.execute(
                "SELECT extract(epoch FROM acquired_at) FROM llmgw_lease"
            ).fetchone()
        assert acquired is not None
        old = [r for r in rows if r[0] == 1]
        assert old and all(float(r[3]) < cut_at for r in old), rows
        assert all(float(r[3]) >= float(acquired[0]) for r in rows if r[0] == 2), rows
        # Mended, a follows the new leader.
        await proxy.mend()

        async def a_follows() -> bool:
            v = await a.cluster()
            return bool(v and v["leader"] == "b" and not v["leading"])

        await eventually(a_follows, "a to follow b once it reaches the database again", 60)
    finally:
        peers.stop()
        peers.cancel_all()
        await proxy.cut()
