"""The reconciler's parts on their own, each through its narrow interface.

test_reconciler_core.py drives them all through a Reconciler; these check the
probe, the report verifier and the directory without one, so that a change to
one part is tested where it is made.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import pytest
from _router_support import (  # type: ignore[import-not-found]
    eventually,
    free_port,
    serve_engine,
)
from aiohttp import web

from llmgw_slurm.auth.secrets import engine_api_key, replica_secret, sign_report
from llmgw_slurm.auth.tls import PinnedContexts, make_identity
from llmgw_slurm.catalog import Catalog
from llmgw_slurm.reconciler.directory import ReplicaDirectory
from llmgw_slurm.reconciler.probes import EngineProbe
from llmgw_slurm.reconciler.replicas import Replica, ReplicaTable
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.reconciler.spans import ReconcileTracing
from llmgw_slurm.slurm.types import JobState

KEY = b"p" * 64
RID = "0a0a0a0a"
GATEWAY = make_identity(Path(tempfile.mkdtemp(prefix="llmgw-test-gateway-")), "gw", "gw", 1)


class Engine:
    """Answers /v1/models with its replica's key once ``release`` is set; counts requests."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.keys: list[str] = []

    def app(self) -> web.Application:
        async def models(request: web.Request) -> web.Response:
            self.keys.append(request.headers.get("Authorization", ""))
            await self.release.wait()
            ok = request.headers.get("Authorization") == f"Bearer {engine_api_key(KEY, RID)}"
            return web.json_response({"data": []}, status=200 if ok else 401)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        return app


async def test_probe_runs_one_probe_per_url_at_a_time_with_the_engine_key() -> None:
    engine, probe = Engine(), EngineProbe(KEY, PinnedContexts(GATEWAY))
    results: list[tuple[bool, str]] = []
    async with serve_engine(engine.app(), GATEWAY) as (url, cert):
        probe.start(RID, url, cert, lambda ok, why: results.append((ok, why)))
        await eventually(lambda: len(engine.keys) == 1, "the first probe reaches the engine")
        # Under way: no second.
        probe.start(RID, url, cert, lambda ok, why: results.append((ok, why)))
        engine.release.set()
        await asyncio.wait_for(asyncio.gather(*probe.tasks), 10)
        assert results == [(True, "HTTP 200")]
        assert engine.keys == [f"Bearer {engine_api_key(KEY, RID)}"]
        # Once it has ended, the same URL is probed again (the next heartbeat's).
        probe.start(RID, url, cert, lambda ok, why: results.append((ok, why)))
        await asyncio.wait_for(asyncio.gather(*probe.tasks), 10)
        assert len(engine.keys) == 2
    await probe.close()


async def test_probe_says_why_an_engine_is_not_reachable() -> None:
    engine, probe = Engine(), EngineProbe(KEY, PinnedContexts(GATEWAY))
    engine.release.set()
    async with serve_engine(engine.app(), GATEWAY) as (url, cert):
        # Another replica's key:
        assert await probe.check("0b0b0b0b", url, cert) == (False, "HTTP 401")
        # Another engine's certificate (what a squatter's would be): no handshake.
        other = make_identity(Path(tempfile.mkdtemp()), "other", "other", 1).cert_pem
        ok, why = await probe.check(RID, url, other)
        assert not ok and "Certificate" in why, why
    assert engine.keys == [f"Bearer {engine_api_key(KEY, '0b0b0b0b')}"]
    ok, why = await probe.check(RID, f"http://127.0.0.1:{free_port()}")
    assert not ok and why.startswith("ClientConnectorError")
    await probe.close()


def test_verifier_accepts_a_signed_report_once() -> None:
    v = ReportVerifier(KEY)
    raw = json.dumps({"event": "heartbeat"}).encode()
    auth = sign_report(replica_secret(KEY, RID), RID, int(time.time()), raw)
    v.verify(RID, auth, raw)
    assert v.nonces_kept == 1
    with pytest.raises(PermissionError, match="replayed report"):
        v.verify(RID, auth, raw)
    with pytest.raises(PermissionError, match="bad signature"):
        v.verify("0b0b0b0b", auth, raw)  # signed for another replica
    with pytest.raises(PermissionError, match="bad signature"):
        v.verify(RID, sign_report(replica_secret(KEY, RID), RID, int(time.time()), raw), b"{}")
    with pytest.raises(PermissionError, match="malformed signature"):
        v.verify(RID, "Bearer x", raw)
    v.check_secret(RID, replica_secret(KEY, RID))
    with pytest.raises(PermissionError, match="bad replica secret"):
        v.check_secret(RID, replica_secret(KEY, "0b0b0b0b"))


def running(rid: str, **kw: object) -> Replica:
    r = Replica(replica_id=rid, model="m", job_id="7", submitted_at=1.0)
    r.job_state = JobState.RUNNING
    for k, v in kw.items():
        setattr(r, k, v)
    return r


async def test_directory_routes_to_ready_and_draining_replicas_only() -> None:
    table = ReplicaTable(Catalog(models=()), lambda: 100.0, ReconcileTracing(None, False))
    d = ReplicaDirectory(table, KEY, PinnedContexts(GATEWAY))
    for r in (
        running("0a0a0a0a", base_url="http://a"),
        running("0b0b0b0b"),  # starting: its engine has not answered the daemon yet
        running("0c0c0c0c", base_url="http://c", draining_since=50.0),
        running("0d0d0d0d", base_url="http://d", stop_reason="stopped by an admin"),
    ):
        table.replicas[r.replica_id] = r
    got = [(e.replica_id, e.draining, e.api_key) for e in d.endpoints("m")]
    assert got == [
        ("0a0a0a0a", False, engine_api_key(KEY, "0a0a0a0a")),
        ("0c0c0c0c", True, engine_api_key(KEY, "0c0c0c0c")),
    ]
    d.request_started("m", "0a0a0a0a")
    assert (table.replicas["0a0a0a0a"].in_flight, table.replicas["0a0a0a0a"].last_used) == (
        1,
        100.0,
    )
    assert not table.wake.is_set()
    d.want("m")
    assert table.wake.is_set() and d.wanted_at() == {"m": 100.0}


async def test_directory_keeps_when_the_oldest_held_request_began_waiting() -> None:
    now = [100.0]
    table = ReplicaTable(Catalog(models=()), lambda: now[0], ReconcileTracing(None, False))
    d = ReplicaDirectory(table, KEY, PinnedContexts(GATEWAY), want_window=300.0)
    d.want("m")
    now[0] = 250.0
    d.want("m")  # a later request: the oldest still waits since 100
    assert d.held_since() == {"m": 100.0} and d.wanted_at() == {"m": 250.0}
    # Every earlier request has had its 503 (past the window): a new wait begins.
    now[0] = 600.0
    d.want("m")
    assert d.held_since() == {"m": 600.0}
    # Ready: nobody waits any more.
    table.replicas["0a0a0a0a"] = running("0a0a0a0a", base_url="http://a")
    d.signal_ready("m")
    assert d.held_since() == {}
    # A request held while a replica is ready (it drains, say) waits from now.
    now[0] = 700.0
    d.want("m")
    assert d.held_since() == {"m": 700.0}


def test_report_nonces_survive_a_restart_of_the_daemon(tmp_path: Path) -> None:
    journal = tmp_path / "report-nonces"
    raw = json.dumps({"event": "heartbeat"}).encode()
    auth = sign_report(replica_secret(KEY, RID), RID, int(time.time()), raw)
    ReportVerifier(KEY, journal).verify(RID, auth, raw)
    assert journal.stat().st_mode & 0o777 == 0o600
    # A restarted daemon refuses the report captured before the restart...
    restarted = ReportVerifier(KEY, journal)
    with pytest.raises(PermissionError, match="replayed report"):
        restarted.verify(RID, auth, raw)
    # ...and takes the agent's next one.
    restarted.verify(RID, sign_report(replica_secret(KEY, RID), RID, int(time.time()), raw), raw)
    assert restarted.nonces_kept == 2


def test_old_nonces_are_dropped_from_the_journal_and_a_bad_one_is_no_failure(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "report-nonces"
    now = time.time()
    journal.write_text(f"{now - 3600:.3f} {RID}:old\nnot a line\n{now:.3f} {RID}:new\n")
    v = ReportVerifier(KEY, journal)
    assert v.nonces_kept == 1
    assert journal.read_text() == f"{now:.3f} {RID}:new\n"
    journal.write_bytes(b"\xff\xfe")
    assert ReportVerifier(KEY, journal).nonces_kept == 0
