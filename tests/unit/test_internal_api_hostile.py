"""The internal API under hostile reports: secrets, other replicas' endpoints, stale agents.

The daemon's internal app (the one agents report to) on a real local port, in
front of a reconciler whose Slurm is the fake from test_reconciler_core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _router_support import serve, serve_engine  # type: ignore[import-not-found]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reconciler_core import KEY, job, make  # type: ignore[import-not-found]

from llmgw_slurm.auth.secrets import engine_api_key, replica_secret, sign_report
from llmgw_slurm.daemon import internal_app
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.slurm.types import JobState
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app

A, B = "0a1b2c3d", "0b1c2d3e"
HOSTILE_URLS = [
    "http://",
    "http://[::1",
    "ftp://x",
    "http://127.0.0.1:0",
    "http://a b",
    "\x00",
    "http://127.0.0.1:99999",
    "http://[zz]:1",
    "/relative",
    "http://127.0.0.1:1/%%",
]


async def _listed(tmp_path: Path) -> tuple[Reconciler, Any]:
    rec, fake = make(tmp_path, {"min": 0, "max": 2})
    fake.jobs = [job("7", "m", A, JobState.RUNNING), job("8", "m", B, JobState.RUNNING)]
    await rec.pass_once()
    return rec, fake


def _report(**over: Any) -> dict[str, Any]:
    body = {
        "event": "heartbeat",
        "step": None,
        "status": None,
        "url": None,
        "node": "n0",
        "job_id": "7",
        "message": None,
        "elapsed_s": None,
    }
    return {**body, **over}


async def _post(
    url: str, rid: str, body: Any, auth: str | None, raw: bytes | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": auth} if auth is not None else {}
    async with aiohttp.ClientSession() as s:
        kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with s.post(f"{url}/internal/v1/replicas/{rid}/report", headers=headers, **kw) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, text


def _signed(rid: str, raw: bytes) -> str:
    return sign_report(replica_secret(KEY, rid), rid, int(time.time()), raw)


async def test_unsigned_reports_are_refused_even_with_the_right_secret(tmp_path: Path) -> None:
    # A secret sent as a bearer token could be copied off the network and replayed:
    # only signed reports are taken, whatever the secret.
    rec, _ = await _listed(tmp_path)
    async with serve(internal_app(rec)) as url:
        body = _report(event="step", step="weights", status="started")
        assert (await _post(url, A, body, None))[0] == 401
        assert (await _post(url, A, body, "Basic " + replica_secret(KEY, A)))[0] == 401
        assert (await _post(url, A, body, "Bearer "))[0] == 401
        assert (await _post(url, A, body, f"Bearer {replica_secret(KEY, B)}"))[0] == 401
        status, answer = await _post(url, A, body, f"Bearer {replica_secret(KEY, A)}")
        assert status == 401 and answer["error"] == "missing signature (LLMGW-HMAC)"
        assert rec.replicas[A].step == ""
        raw = json.dumps(body).encode()
        status, answer = await _post(url, A, None, _signed(A, raw), raw=raw)
        assert status == 200 and answer == {"ok": True, "drain": False}
        assert rec.replicas[A].step == "weights started"


async def test_signed_reports_wrong_old_tampered_and_replayed_are_refused(
    tmp_path: Path,
) -> None:
    rec, _ = await _listed(tmp_path)
    secret = replica_secret(KEY, A)
    raw = json.dumps(_report(event="step", step="weights", status="started")).encode()
    now = int(time.time())

    async def post(auth: str, data: bytes = raw, rid: str = A) -> tuple[int, Any]:
        return await _post(url, rid, None, auth, raw=data)

    async with serve(internal_app(rec)) as url:
        good = sign_report(secret, A, now, raw)
        # Signed with B's secret, or for B's path, or another server key's: refused.
        assert (await post(sign_report(replica_secret(KEY, B), A, now, raw)))[0] == 401
        assert (await post(sign_report(secret, B, now, raw)))[0] == 401
        assert (await post(sign_report(replica_secret(b"x" * 64, A), A, now, raw)))[0] == 401
        # The body changed after signing (a heartbeat turned into "failed").
        tampered = raw.replace(b'"step"', b'"failed"', 1)
        status, answer = await post(good, tampered)
        assert status == 401 and answer["error"] == "bad signature"
        # Signed ten minutes ago or ahead: refused, saying why.
        status, answer = await post(sign_report(secret, A, now - 600, raw))
        assert status == 401 and "from the daemon's clock" in answer["error"]
        assert (await post(sign_report(secret, A, now + 600, raw)))[0] == 401
        for malformed in ("LLMGW-HMAC ts=1", "LLMGW-HMAC ts=x,nonce=y,sig=z", "LLMGW-HMAC"):
            assert (await post(malformed))[0] == 401
        assert rec.replicas[A].step == ""
        status, answer = await post(good)
        assert status == 200 and answer == {"ok": True, "drain": False}
        assert rec.replicas[A].step == "weights started"
        # The same report again, copied off the network: refused.
        status, answer = await post(good)
        assert status == 401 and answer["error"] == "replayed report"
        # A retry of it is signed anew (a fresh nonce): taken.
        assert (await post(sign_report(secret, A, now, raw)))[0] == 200


async def test_malformed_and_oversized_reports_are_4xx_never_5xx(tmp_path: Path) -> None:
    rec, _ = await _listed(tmp_path)
    async with serve(internal_app(rec)) as url:
        for raw in (b"{not json", b"\xff\xfe", b"[1, 2]"):
            assert (await _post(url, A, None, _signed(A, raw), raw=raw))[0] == 400
        big = b"x" * (1024 * 1024)
        assert (await _post(url, A, None, _signed(A, big), raw=big))[0] == 413
        # An id that is not one: the route does not exist.
        raw = json.dumps(_report()).encode()
        assert (await _post(url, "../../x", None, _signed(A, raw), raw=raw))[0] == 404


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.dictionaries(
        st.sampled_from(
            ["event", "step", "status", "url", "node", "job_id", "message", "elapsed_s", "x"]
        ),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats()
            | st.text(max_size=30)
            | st.sampled_from([*HOSTILE_URLS, "ready", "heartbeat", "failed", "draining"]),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
            max_leaves=6,
        ),
    )
)
async def test_reports_of_any_shape_never_break_the_daemon(
    tmp_path: Path, body: dict[str, Any]
) -> None:
    rec, _ = await _listed(tmp_path)
    # Whatever the fields hold, the report is answered and the next pass runs.
    answer = rec.report(A, replica_secret(KEY, A), body)
    assert answer["ok"] is True
    await rec.pass_once()
    # A probe of whatever URL the report held ends as a recorded failure, not an
    # exception nobody retrieves.
    for got in await asyncio.gather(*rec.probe.tasks, return_exceptions=True):
        assert got is None, repr(got)
    await rec.close()


async def test_a_replica_cannot_register_another_replicas_endpoint(tmp_path: Path) -> None:
    rec, _ = await _listed(tmp_path)
    b_engine = EngineOptions(api_key=engine_api_key(KEY, B), served_name="m")
    gateway = rec.engine_tls.identity
    async with serve_engine(create_engine_app(b_engine), gateway) as (b_url, b_cert):
        # A, with its own valid secret, claims B's engine (and its certificate, which
        # B's reports carried in the open) as its endpoint: the daemon probes it with
        # A's engine key, B's engine refuses, nothing is routed to it.
        rec.report(A, replica_secret(KEY, A), _report(event="ready", url=b_url, cert=b_cert))
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert rec.endpoints("m") == []
        assert rec.decisions[-1].action == "probe-failed"
    await rec.close()


@pytest.mark.parametrize(
    "stale",
    [
        {"job_id": "6"},  # an agent of another job (an earlier run, an impostor's copy)
        {"node": "n1"},  # the job was requeued onto another node; the old agent lives on
    ],
)
async def test_reports_from_where_the_job_is_not_are_not_routed(
    tmp_path: Path, stale: dict[str, str]
) -> None:
    rec, _ = await _listed(tmp_path)
    good = EngineOptions(api_key=engine_api_key(KEY, A), served_name="m")
    async with serve_engine(create_engine_app(good), rec.engine_tls.identity) as (url, cert):
        rec.report(A, replica_secret(KEY, A), _report(event="ready", url=url, cert=cert, **stale))
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert rec.endpoints("m") == []
        assert rec.decisions[-1].action == "stale-report"
        # The same report from where Slurm says the job runs is routed.
        rec.report(A, replica_secret(KEY, A), _report(event="ready", url=url, cert=cert))
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert [e.base_url for e in rec.endpoints("m")] == [url]
    await rec.close()


async def test_a_host_name_slurm_does_not_know_is_not_taken_for_a_stale_agent(
    tmp_path: Path,
) -> None:
    # Where node names do not resolve the agent reports its host name: no proof either way.
    rec, _ = await _listed(tmp_path)
    good = EngineOptions(api_key=engine_api_key(KEY, A), served_name="m")
    async with serve_engine(create_engine_app(good), rec.engine_tls.identity) as (url, cert):
        body = _report(event="ready", url=url, cert=cert, node="login-7")
        rec.report(A, replica_secret(KEY, A), body)
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert [e.base_url for e in rec.endpoints("m")] == [url]
    await rec.close()


async def test_after_a_requeue_only_the_agent_on_the_new_node_is_routed(
    tmp_path: Path,
) -> None:
    """Fault 3: a node's slurmd dies, Slurm requeues the job elsewhere, but the old
    run's agent and engine live on (the node is down only to Slurm) and keep reporting."""
    rec, fake = make(tmp_path, {"min": 1, "max": 1})
    fake.jobs = [job("7", "m", A, JobState.RUNNING)]  # on n0
    await rec.pass_once()
    good = EngineOptions(api_key=engine_api_key(KEY, A), served_name="m")
    gateway = rec.engine_tls.identity
    async with (
        serve_engine(create_engine_app(good), gateway) as (old, old_cert),
        serve_engine(create_engine_app(good), gateway) as (new, new_cert),
    ):
        secret = replica_secret(KEY, A)
        rec.report(A, secret, _report(event="ready", url=old, cert=old_cert))
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert [e.base_url for e in rec.endpoints("m")] == [old]
        fake.jobs = [job("7", "m", A, JobState.PENDING, restarts=1)]
        await rec.pass_once()
        assert rec.endpoints("m") == []
        # The old agent heartbeats on: not routed, not taken for a running job.
        assert rec.report(A, secret, _report(url=old, cert=old_cert)) == {
            "ok": True,
            "drain": False,
        }
        assert rec.probe.tasks == set() and rec.endpoints("m") == []
        assert rec.replicas[A].job_state is JobState.PENDING
        # The job runs again, on n1; its new agent reports before the listing shows it.
        rec.report(A, secret, _report(event="ready", url=new, cert=new_cert, node="n1"))
        assert rec.endpoints("m") == []
        running = job("7", "m", A, JobState.RUNNING, restarts=1)
        fake.jobs = [dataclasses.replace(running, nodes=("n1",))]
        await rec.pass_once()
        await asyncio.wait_for(asyncio.gather(*rec.probe.tasks), 10)
        assert [e.base_url for e in rec.endpoints("m")] == [new]
        # The old agent is told to drain, and never routed to again.
        assert rec.report(A, secret, _report(url=old, cert=old_cert)) == {
            "ok": True,
            "drain": True,
        }
        assert rec.decisions[-1].action == "stale-report"
        assert [e.base_url for e in rec.endpoints("m")] == [new]
    await rec.close()


async def test_deeply_nested_json_is_a_400_not_a_500(tmp_path: Path) -> None:
    rec, _ = await _listed(tmp_path)
    deep = b"[" * 20_000 + b"]" * 20_000  # under the 64 KiB limit
    async with serve(internal_app(rec)) as url:
        # With or without a valid signature: nothing about the body may break the handler.
        assert (await _post(url, A, None, "Bearer x", raw=deep))[0] == 401
        status, _ = await _post(url, A, None, _signed(A, deep), raw=deep)
        assert status == 400


async def test_nonces_are_forgotten_once_their_reports_are_too_old_anyway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw_slurm.reconciler import reports

    rec, _ = await _listed(tmp_path)
    secret = replica_secret(KEY, A)
    raw = json.dumps(_report()).encode()
    t0 = 1_900_000_000
    monkeypatch.setattr(reports.time, "time", lambda: float(t0))
    first = sign_report(secret, A, t0, raw)
    rec.report_signed(A, first, raw, json.loads(raw))
    assert rec.verifier.nonces_kept == 1
    later = t0 + 2 * int(reports.REPORT_MAX_AGE_S) + 1
    monkeypatch.setattr(reports.time, "time", lambda: float(later))
    rec.report_signed(A, sign_report(secret, A, later, raw), raw, json.loads(raw))
    assert rec.verifier.nonces_kept == 1
    # The forgotten one is still refused: by its age.
    with pytest.raises(PermissionError, match="from the daemon's clock"):
        rec.report_signed(A, first, raw, json.loads(raw))
