"""Faults 4-6: preemption, time limit renewal and an engine crash, each under steady load.

The daemon runs in the test's event loop (tests/slurm/harness.py) so that the
test can read its decisions directly; the load goes through its gateway with
the official openai client.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

from llmgw_slurm.slurm.cli import CliBackend
from tests.faults.support import load, record, with_router
from tests.procs import listener_pid
from tests.slurm.conftest import eventually
from tests.slurm.harness import RESTART, Harness, research_job, running, tiny_model


def ready(h: Harness, model: str) -> list[str]:
    return [
        r.replica_id
        for r in h.rec.replicas.values()
        if r.model == model and r.state().value == "ready"
    ]


def free_node() -> str | None:
    """An idle node with the a100s the replica below asks for (not the h100 node)."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", "llm", "-t", "idle", "-o", "%N %G"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    nodes = [line.split()[0] for line in out if "gpu:a100" in line]
    return nodes[-1] if nodes else None


async def test_preempted_replica_fails_in_flight_requests_at_most_once(
    tmp_path: Path, prefix: str
) -> None:
    node = free_node()
    assert node, "the preemption test needs one idle node"
    model = tiny_model(
        "preempted",
        resources={"gpus": 4},
        scaling={"min": 1, "max": 1},
        # Streams last a while, so that some are in flight when the preemption comes.
        engine={
            "kind": "command",
            "command": [*tiny_model("x")["engine"]["command"], "--token-delay", "0.2"],
            "ready_timeout": "1m",
        },
    )
    async with running(tmp_path, prefix, [model]) as h:
        # Held requests wait out the requeue's begin-time delay instead of a 503.
        await h.stop()
        with_router(h, hold_timeout="10m")
        await h.start()
        await eventually(lambda: asyncio.sleep(0, ready(h, "preempted")), "ready", timeout=120)
        (rep,) = h.rec.replicas.values()
        # An agent's report marks the job running before the listing says where.
        await eventually(lambda: asyncio.sleep(0, rep.nodes), "the node listed", timeout=60)
        first_job = rep.job_id
        async with load(h.url, "preempted", workers=4, max_tokens=10) as ld:
            await asyncio.sleep(4)
            research = research_job(prefix, rep.nodes[0])
            preempted_at = time.time()
            try:
                await eventually(
                    lambda: asyncio.sleep(0, h.decisions("requeued", "preempted")),
                    "the requeue",
                    timeout=120,
                )
            finally:
                subprocess.run(["scancel", research], check=False)
            await eventually(
                lambda: asyncio.sleep(0, ready(h, "preempted")),
                "ready after the preemption",
                timeout=400,
            )
            back_at = time.time()
            await asyncio.sleep(3)
        submits = h.decisions("submit", "preempted")
        jobs = h.jobs()
        # Accounting: the latest run only by default; every run (the audit's view) with
        # duplicates: the preempted one, and the one that serves again.
        since = datetime.fromtimestamp(preempted_at - 3600)

        async def runs() -> list[str] | None:
            recs = await CliBackend().accounting(since, name_prefix=prefix, duplicates=True)
            states = sorted(r.state.value for r in recs if r.job_id == first_job)
            return states if len(states) == 2 else None

        every_run = await eventually(runs, "accounting to list both runs", timeout=60)
        latest = await CliBackend().accounting(since, name_prefix=prefix)
    assert every_run == ["PREEMPTED", "RUNNING"]
    assert [r.state.value for r in latest if r.job_id == first_job] == ["RUNNING"]
    # Each request that failed failed once, with a retryable error, and its retry
    # (held until the replica came back) succeeded.
    assert all(o.retryable for o in ld.failed), [(o.kind, o.t - preempted_at) for o in ld.failed]
    assert ld.failed_twice == [], ld.kinds()
    assert all(o.t >= preempted_at - 1 for o in ld.failed)
    assert ld.ok_since(back_at) > 0
    # The same job came back: no second submission.
    assert len(submits) == 1
    assert [j[0] for j in jobs] == [first_job]
    record(
        "4 research job preempts a replica",
        **ld.figures(),
        replicas_lost=0,
        duplicate_jobs=len(submits) - 1,
        back_after_s=round(back_at - preempted_at, 1),
        notes="one replica: new requests were held until the requeued job served again",
    )


async def test_renewal_under_load_fails_no_request(tmp_path: Path, prefix: str) -> None:
    model = tiny_model("renewed", resources={"time_limit": "3m"}, scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model], renewal_margin="170s") as h:
        await eventually(lambda: asyncio.sleep(0, ready(h, "renewed")), "ready", timeout=120)
        async with load(h.url, "renewed", workers=4) as ld:

            async def handed_over() -> bool:
                return bool(h.decisions("gone", "renewed")) and len(ready(h, "renewed")) == 1

            await eventually(handed_over, "the old replica drained and gone", timeout=150)
        renewals = [d for d in h.decisions("submit", "renewed") if "renewal" in d.reason]
    assert ld.failed == []
    assert ld.sent > 0
    assert renewals
    record(
        "5 time-limit renewal",
        **ld.figures(),
        replicas_lost=0,
        duplicate_jobs=0,
        renewals=len(renewals),
    )


def engine_pid(port: int) -> int:
    """The test engine listening on ``port`` (every job runs on this one machine)."""
    pid = listener_pid(port, "llmgw_slurm.testing.engine")
    if pid is None:
        raise AssertionError(f"no test engine on port {port}")
    return pid


async def test_engine_crash_is_detected_restarted_with_backoff_and_a_loop_shown(
    tmp_path: Path, prefix: str
) -> None:
    model = tiny_model("crashes", scaling={"min": 1, "max": 1})
    # Healthy only after 10 minutes: an engine that dies this soon after serving is a
    # failed start, and three of them make the model "failing".
    restart = {**RESTART, "healthy_after": "10m"}
    async with running(tmp_path, prefix, [model], restart=restart) as h:
        await eventually(lambda: asyncio.sleep(0, ready(h, "crashes")), "ready", timeout=120)
        states: list[str] = []
        notes: list[str] = []
        async with load(h.url, "crashes", workers=2) as ld:
            for n in range(1, 4):
                (rep,) = [r for r in h.rec.replicas.values() if r.base_url]
                os.kill(engine_pid(int(rep.base_url.rsplit(":", 1)[1])), signal.SIGKILL)

                async def ended(n: int = n) -> bool:
                    return len(h.decisions("cancel", "crashes")) >= n

                await eventually(ended, f"crash {n} detected and its job ended", timeout=60)
                states.append(h.rec.status()["models"][0]["state"])
                notes.append(h.rec.notes.get("crashes", ""))
                if n < 3:
                    await eventually(
                        lambda: asyncio.sleep(0, ready(h, "crashes")),
                        f"ready after crash {n}",
                        timeout=120,
                    )
            await ld.stop()

        cancels = h.decisions("cancel", "crashes")
        submits = h.decisions("submit", "crashes")
        failures = h.rec.failures["crashes"]
    assert all("engine exited" in c.reason for c in cancels), [c.reason for c in cancels]
    assert failures.count == 3
    assert states[-1] == "failing", states
    assert notes[-1].startswith("failing: 3 failed start(s)"), notes
    # Backoff: each restart waited longer than the one before.
    gaps = [s.at - c.at for c, s in zip(cancels, submits[1:], strict=False)]
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[0] < gaps[1], gaps
    record(
        "6 engine crash inside the job (x3)",
        **ld.figures(),
        replicas_lost=len(cancels),
        duplicate_jobs=0,
        restart_gaps_s=[round(g, 1) for g in gaps],
        state_after_3=states[-1],
        note_after_3=notes[-1].split(";")[0],
        notes="lost = the crashed replicas, each replaced by a new job after the backoff",
    )
