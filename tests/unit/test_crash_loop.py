"""An engine that crashes soon after it serves: restarted with backoff, and the loop shown.

Found by the fault suite (tests/faults, fault 6): the replacement was submitted
in the same pass that cancelled the crashed replica, and becoming ready again
cleared the failure count, so an engine that dies a second after it starts
serving was restarted at once, forever, and the model never showed "failing".
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from _router_support import serve_engine  # type: ignore[import-not-found]
from test_reconciler_core import KEY, job, make  # type: ignore[import-not-found]

from llmgw_slurm.auth.secrets import engine_api_key, replica_secret
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.reconciler.jobs import parse_job_name
from llmgw_slurm.slurm.types import JobState
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app

PREFIX = "llmgwunit."


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


async def _serve_ready(rec: Reconciler, fake: object, rid: str, job_id: str) -> None:
    """The job runs, its agent reports ready, the daemon probes and routes to it."""
    fake.jobs = [job(job_id, "m", rid, JobState.RUNNING)]  # type: ignore[attr-defined]
    await rec.pass_once()
    opts = EngineOptions(api_key=engine_api_key(KEY, rid), served_name="m")
    async with serve_engine(create_engine_app(opts), rec.engine_tls.identity) as (url, cert):
        rec.report(
            rid,
            replica_secret(KEY, rid),
            {"event": "ready", "url": url, "cert": cert, "node": "n0", "job_id": job_id},
        )
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
    assert rec.replicas[rid].base_url


async def test_a_crash_after_ready_is_restarted_with_growing_backoff_and_shown_failing(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    clock = Clock()
    rec.clock = clock
    cfg = rec.plan_cfg
    gaps = []
    await rec.pass_once()
    for n in range(1, cfg.give_up_after + 1):
        spec = fake.submitted[-1]
        _, rid = parse_job_name(PREFIX, spec.name) or ("", "")
        job_id = str(fake.next_id)
        await _serve_ready(rec, fake, rid, job_id)
        clock.t += 1.0  # serving for a second, then the engine dies
        rec.report(
            rid,
            replica_secret(KEY, rid),
            {
                "event": "failed",
                "message": "engine exited with code -9",
                "job_id": job_id,
                "node": "n0",
            },
        )
        submitted = len(fake.submitted)
        await rec.pass_once()
        # Cancelled, counted, and not replaced in the same pass.
        assert fake.cancelled[-1] == job_id
        assert len(fake.submitted) == submitted
        assert rec.failures["m"].count == n
        fake.jobs = []
        await rec.pass_once()
        assert len(fake.submitted) == submitted, "restarted inside the backoff"
        if n == cfg.give_up_after:
            break
        # The next start comes only once the backoff has passed.
        t0 = clock.t
        while len(fake.submitted) == submitted:
            clock.t += 1.0
            await rec.pass_once()
        gaps.append(clock.t - t0)
    assert gaps == sorted(gaps) and gaps[0] < gaps[-1], gaps
    (m,) = rec.status()["models"]
    assert m["state"] == "failing", m
    assert "failing" in m["note"] and "engine exited" in m["note"]
    await rec.close()


async def test_a_replica_that_served_its_minimum_lifetime_clears_the_failures(
    tmp_path: Path,
) -> None:
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    clock = Clock()
    rec.clock = clock
    rec.pass_loop.fail("m", "an earlier crash")
    clock.t += rec.plan_cfg.backoff_max + 1
    await rec.pass_once()
    _, rid = parse_job_name(PREFIX, fake.submitted[-1].name) or ("", "")
    await _serve_ready(rec, fake, rid, str(fake.next_id))
    assert rec.failures["m"].count == 1  # ready is not yet proof the engine stays up
    clock.t += rec.pass_loop.healthy_after + 1
    await rec.pass_once()
    assert "m" not in rec.failures
    await rec.close()
