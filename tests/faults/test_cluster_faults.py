"""Faults 2, 3 and 7: Slurm's own daemons fail under the service.

These stop slurmctld, a slurmd and slurmdbd of the one-machine cluster: every
other user of the cluster sees the outage. Each test puts the cluster back
together whatever happens (the ``restore`` fixture: ``dev-cluster up`` starts
what is stopped, nodes left down are resumed).
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.support import (
    daemon_pid,
    kill_cluster_daemon,
    load,
    nodes_state,
    record,
    restore_cluster,
)
from tests.procs import listener_pid
from tests.slurm.conftest import eventually
from tests.slurm.harness import TOP, Harness, running, tiny_model

pytestmark = pytest.mark.usefixtures("restore")


def ready(h: Harness, model: str) -> list[str]:
    return [
        r.replica_id
        for r in h.rec.replicas.values()
        if r.model == model and r.state().value == "ready"
    ]


def slurm_answers() -> bool:
    p = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, check=False)
    return p.returncode == 0 and "UP" in p.stdout


async def test_slurmctld_down_for_a_minute(tmp_path: Path, prefix: str) -> None:
    model = tiny_model("steady", scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model]) as h:
        await eventually(lambda: asyncio.sleep(0, ready(h, "steady")), "ready", timeout=120)
        (job_before,) = h.jobs()
        calls = h.rec.backend.call_counts
        async with load(h.url, "steady", workers=4) as ld:
            await asyncio.sleep(3)
            passes_before = h.rec.passes
            n_decisions = len(h.rec.decisions)
            before = collections.Counter(calls)
            os.kill(daemon_pid("slurmctld"), signal.SIGTERM)
            down_at = time.time()
            # Slurm commands run in threads: the daemon and its gateway share this loop.
            await eventually(
                lambda: asyncio.to_thread(lambda: not slurm_answers()), "slurmctld down"
            )
            await asyncio.sleep(60)
            during = collections.Counter(calls) - before
            await asyncio.to_thread(restore_cluster)
            up_at = time.time()
            await eventually(lambda: asyncio.to_thread(slurm_answers), "slurmctld up")
            passes_at_up = h.rec.passes

            async def normal() -> bool:
                return h.rec.passes > passes_at_up and h.rec.last_pass_error == ""

            await eventually(normal, "a normal pass after slurmctld came back", timeout=60)
            normal_after_s = time.time() - up_at
            await asyncio.sleep(5)
        actions = [(d.action, d.reason) for d in list(h.rec.decisions)[n_decisions:]]
        jobs_after = h.jobs()
    # Served throughout: nothing failed.
    assert ld.failed == [], ld.kinds()
    assert ld.ok_since(down_at) > 0
    # Backed off: far fewer commands than one pass per interval would send (2 a pass).
    interval_passes = 60 / 1.0
    assert sum(during.values()) < interval_passes, during
    # Cancelled nothing, submitted nothing, and the same job serves.
    assert [a for a in actions if a[0] not in ("ready",)] == [], actions
    assert [j[0] for j in jobs_after] == [job_before[0]]
    assert h.rec.passes >= passes_before
    record(
        "2 slurmctld down 60 s",
        **ld.figures(),
        replicas_lost=0,
        duplicate_jobs=len(jobs_after) - 1,
        slurm_commands_during_outage=dict(during),
        commands_without_backoff=int(2 * interval_passes),
        normal_pass_after_s=round(normal_after_s, 1),
    )


def engine_alive(port: int) -> bool:
    return listener_pid(port, "llmgw_slurm.testing.engine") is not None


async def test_a_nodes_slurmd_killed(tmp_path: Path, prefix: str) -> None:
    # A whole node: the slurmd killed is one no other user's GPU job runs on.
    model = tiny_model("survivor", resources={"gpus": 4}, scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model]) as h:
        await eventually(lambda: asyncio.sleep(0, ready(h, "survivor")), "ready", timeout=120)
        (rid,) = ready(h, "survivor")
        rep = h.rec.replicas[rid]
        # An agent's report marks the job running before the listing says where.
        await eventually(lambda: asyncio.sleep(0, rep.nodes), "the node listed", timeout=60)
        node, job_id, old_url = rep.nodes[0], rep.job_id, rep.base_url
        old_port = int(old_url.rsplit(":", 1)[1])
        async with load(h.url, "survivor", workers=4) as ld:
            await asyncio.sleep(3)
            kill_cluster_daemon(f"slurmd-{node}")
            killed_at = time.time()

            async def lost() -> bool:
                states = await asyncio.to_thread(nodes_state)
                return "down" in states.get(node, "") or bool(
                    h.decisions("requeued", "survivor") or h.decisions("reap", "survivor")
                )

            # SlurmdTimeout is 30 s in the dev cluster.
            await eventually(lost, f"Slurm to notice {node} is gone", timeout=180)
            noticed_s = time.time() - killed_at

            async def elsewhere() -> bool:
                return any(
                    r.model == "survivor"
                    and r.state().value == "ready"
                    and r.nodes
                    and r.nodes[0] != node
                    for r in h.rec.replicas.values()
                )

            await eventually(elsewhere, "ready again on another node", timeout=300)
            replaced_s = time.time() - killed_at
            # The previous run's engine lives on (one machine): it is never routed to,
            # and its agent, told to drain, stops it.
            await eventually(
                lambda: asyncio.to_thread(lambda: not engine_alive(old_port)),
                "the orphaned engine stopped",
                timeout=120,
            )
            await asyncio.sleep(3)
        routed = collections.Counter(o.replica for o in ld.outcomes if o.ok and o.t > killed_at)
        endpoints = [e.base_url for e in h.rec.endpoints("survivor")]
        submits = h.decisions("submit", "survivor")
        stale = h.decisions("stale-report", "survivor")
        jobs = h.jobs()
    assert old_url not in endpoints
    assert len(jobs) == 1
    record(
        "3 slurmd of a node killed",
        **ld.figures(),
        replicas_lost=1,
        duplicate_jobs=max(0, len(jobs) - 1),
        noticed_after_s=round(noticed_s, 1),
        serving_elsewhere_after_s=round(replaced_s, 1),
        same_job_requeued=[j[0] for j in jobs] == [job_id],
        submits=len(submits),
        stale_reports_refused=len(stale),
        routed_after_kill=dict(routed),
    )


def audit(h: Harness) -> subprocess.CompletedProcess[str]:
    code = "import sys; from llmgw_slurm.cli.admin import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "audit", "--server", str(h.server_yaml), "--since", "1h"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TOP)},
        timeout=300,
        check=False,
    )


async def test_slurmdbd_down(tmp_path: Path, prefix: str) -> None:
    model = tiny_model("accounted", scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model]) as h:
        await eventually(lambda: asyncio.sleep(0, ready(h, "accounted")), "ready", timeout=120)
        assert (await asyncio.to_thread(audit, h)).returncode == 0
        (job,) = h.jobs()
        async with load(h.url, "accounted", workers=4) as ld:
            await asyncio.sleep(3)
            kill_cluster_daemon("slurmdbd")
            passes = h.rec.passes
            out = await asyncio.to_thread(audit, h)
            # Reconciling goes on: a job killed from outside is reaped and replaced.
            subprocess.run(["scancel", job[0]], check=True)
            await eventually(
                lambda: asyncio.sleep(0, h.decisions("reap", "accounted")), "the reap", timeout=60
            )
            await eventually(
                lambda: asyncio.sleep(0, ready(h, "accounted")), "ready again", timeout=120
            )
            await asyncio.sleep(3)
            assert h.rec.passes > passes and h.rec.last_pass_error == ""
        reap = h.decisions("reap", "accounted")[0].reason
        jobs = h.jobs()
    restore_cluster()
    assert out.returncode != 0
    assert "cannot reach accounting" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert len(jobs) == 1 and jobs[0][0] != job[0]
    # Requests in flight on the cancelled job may fail (that is the scancel, not
    # slurmdbd); none before it.
    record(
        "7 slurmdbd down",
        **ld.figures(),
        replicas_lost=1,
        duplicate_jobs=0,
        audit=out.stderr.strip().splitlines()[-1][:160],
        reap_reason=reap[:160],
        notes="lost = the job scancelled during the outage to show reconciling goes on",
    )
