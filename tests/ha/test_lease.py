"""The reconciler's lease on a real PostgreSQL: one holder, epochs, fencing, hand-over."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from llmgw_slurm.config import DatabaseConfig
from llmgw_slurm.db.lease import Lease
from tests.ha.conftest import PgDatabase

pytestmark = pytest.mark.ha


class Clock:
    """A monotonic clock the test moves: a daemon's own sense of time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cfg(db: PgDatabase) -> DatabaseConfig:
    return db.config(lease_duration=1.0, lease_renew=0.2, lease_deadline=0.6)


def _lease(db: PgDatabase, name: str, clock: Clock | None = None) -> Lease:
    kw = {"clock": clock} if clock is not None else {}
    return Lease(db.info(name), name, _cfg(db), action_timeout=5.0, **kw)


async def _register(db: PgDatabase, *names: str) -> None:
    with contextlib.closing(db.connect()) as conn:
        for n in names:
            conn.execute(
                "INSERT INTO llmgw_daemons (name, host, pid, gateway_url, internal_url, version,"
                " started_at, last_seen) VALUES (%s, 'h', 1, '', '', 'v', now(), now())",
                (n,),
            )


async def test_one_of_two_leads_and_the_other_knows_who(pgdb: PgDatabase) -> None:
    a, b = _lease(pgdb, "a"), _lease(pgdb, "b")
    try:
        await a.tick()
        await b.tick()
        assert a.acting() and a.epoch == 1
        assert not b.acting() and b.epoch is None
        assert b.state.holder == a.holder and b.state.epoch == 1
        # Renewing keeps the epoch.
        await a.tick()
        assert a.epoch == 1
    finally:
        await a.release()
        await b.release()


async def test_a_leader_out_of_touch_stops_acting_by_its_own_clock(pgdb: PgDatabase) -> None:
    clock = Clock()
    a = _lease(pgdb, "a", clock)
    try:
        await a.tick()
        assert a.acting()
        clock.t += 0.59
        assert a.acting()
        # No renewal got through (the database is out of reach): past the deadline it
        # stops, while its lease still runs in the database for 0.4 s more.
        clock.t += 0.02
        assert not a.acting()
        assert await a.begin("submit", "m", "0a0a0a0a", "job") is None
    finally:
        await a.release()


async def test_two_that_both_believe_they_lead_only_one_acts(pgdb: PgDatabase) -> None:
    frozen = Clock()
    a, b = _lease(pgdb, "a", frozen), _lease(pgdb, "b")
    try:
        await a.tick()
        assert a.epoch == 1
        # a stops renewing; its clock stands still, so it still believes it leads.
        await asyncio.sleep(1.2)
        await b.tick()
        assert b.epoch == 2
        assert a.acting(), "a's own view: leading"
        # Its actions are refused by the database all the same (fenced by the epoch).
        assert await a.begin("submit", "m", "0a0a0a0a", "job-a") is None
        ticket = await b.begin("submit", "m", "0b0b0b0b", "job-b")
        assert ticket is not None and ticket.epoch == 2
        # Its next renewal tells a it lost.
        await a.tick()
        assert not a.acting()
        with contextlib.closing(pgdb.connect()) as conn:
            rows = conn.execute("SELECT holder, epoch, target FROM llmgw_actions").fetchall()
        assert rows == [(b.holder, 2, "job-b")]
    finally:
        await a.release()
        await b.release()


async def test_a_new_leader_waits_out_an_unfinished_submission(pgdb: PgDatabase) -> None:
    a, b = _lease(pgdb, "a"), _lease(pgdb, "b")
    try:
        await a.tick()
        ticket = await a.begin("submit", "tiny", "0a0a0a0a", "llmgw.tiny.0a0a0a0a")
        assert ticket is not None
        # a dies with its sbatch under way: nothing says how it ended.
        a._epoch = None
        await asyncio.sleep(1.1)
        await b.tick()
        assert b.epoch == 2
        open_ = await b.open_submits({"llmgw.other.0c0c0c0c"})
        assert [(o.model, o.replica_id) for o in open_] == [("tiny", "0a0a0a0a")]
        # Once the listing shows its job, it is closed (and adopted by the pass).
        assert await b.open_submits({"llmgw.tiny.0a0a0a0a"}) == []
        assert await b.open_submits(set()) == []
    finally:
        await a.release()
        await b.release()


async def test_a_clean_stop_hands_over_at_once_and_the_epoch_says_so(pgdb: PgDatabase) -> None:
    await _register(pgdb, "a", "b")
    a, b = _lease(pgdb, "a"), _lease(pgdb, "b")
    await a.tick()
    await b.tick()
    assert a.epoch == 1 and b.epoch is None
    await a.release()
    await b.tick()
    assert b.epoch == 2
    assert b.state.since is not None
    await b.release()


async def test_only_one_of_ten_started_at_once_leads(pgdb: PgDatabase) -> None:
    leases = [_lease(pgdb, f"d{i}") for i in range(10)]
    try:
        await asyncio.gather(*(x.tick() for x in leases))
        assert [x.epoch for x in leases if x.acting()] == [1]
    finally:
        for x in leases:
            await x.release()
