"""Fault 1: the daemon SIGKILLed and restarted under steady load."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path

from tests.faults.support import daemon_process, load, model_states, record
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, tiny_model

HEARTBEAT_S = 1.0  # the harness's agent.yaml


async def test_sigkilled_daemon_under_load_adopts_every_job_and_serves_again(
    tmp_path: Path, prefix: str
) -> None:
    h = Harness(tmp_path / "daemon", prefix)
    names = ["k0", "k1"]
    h.write([tiny_model(n, scaling={"min": 1, "max": 1, "idle_timeout": "5s"}) for n in names])
    with daemon_process(h, tmp_path / "daemon.log") as d:

        async def all_ready() -> bool:
            st = model_states(await d.status())
            return bool(st) and all(st.get(n) == "ready" for n in names)

        await eventually(all_ready, "both models ready", timeout=120)
        before = sorted(h.jobs())
        async with load(h.url, "k0", workers=3) as ld0, load(h.url, "k1", workers=3) as ld1:
            await asyncio.sleep(3)
            killed_at = time.time()
            d.kill()
            # Long enough for every agent to miss heartbeats (the daemon being away
            # is normal for them) and for the load to see the gateway gone.
            await asyncio.sleep(5)
            d.start()
            restarted_at = time.time()
            await eventually(d.status, "the restarted daemon to listen", timeout=60)
            listening_at = time.time()
            await eventually(all_ready, "both models ready after the restart", timeout=120)
            ready_again_s = time.time() - listening_at
            await asyncio.sleep(3)
        st = await d.status()
        assert st is not None
        actions = [(x["action"], x["model"], x["reason"]) for x in st["decisions"]]
        after = sorted(h.jobs())

    adopted = [a for a in actions if a[0] == "adopt"]
    # Every job adopted, none submitted twice, nothing stopped on unknown idleness.
    assert len(adopted) == len(before), actions
    assert not [a for a in actions if a[0] in ("submit", "evict", "drain", "cancel")], actions
    assert after == before
    # Ready on the first heartbeat after adoption: nothing refused the agents' word.
    assert not [a for a in actions if a[0] == "probe-failed"], actions
    loads = (ld0, ld1)
    # After the daemon came back and its replicas were ready, nothing failed.
    ready_at = listening_at + ready_again_s
    late = [o for ld in loads for o in ld.failed if o.t > ready_at]
    assert late == []
    assert all(ld.ok_since(ready_at) > 0 for ld in loads)
    # While no daemon listened, the gateway (it is the daemon) refused connections;
    # those and only those failed.
    outage = [o for ld in loads for o in ld.failed]
    assert all(killed_at - 1 <= o.t <= ready_at for o in outage)
    record(
        "1 daemon SIGKILL + restart",
        requests_sent=sum(ld.sent for ld in loads),
        requests_failed=len(outage),
        failed_after_one_retry=sum(len(ld.failed_twice) for ld in loads),
        failures=dict(
            sum((collections.Counter(ld.kinds()) for ld in loads), collections.Counter())
        ),
        replicas_lost=0,
        duplicate_jobs=len(after) - len(before),
        adopted=len(adopted),
        ready_again_s=round(ready_again_s, 2),
        restart_to_listening_s=round(listening_at - restarted_at, 2),
        heartbeat_s=HEARTBEAT_S,
        notes="failures: connection errors while no daemon process listened; ready_again_s from listening",
    )
