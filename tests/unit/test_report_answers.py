"""The daemon's answers to agents' reports are signed and bound to the report they
answer; an agent acts on none that does not check (issue 33, item 2).

The internal port is plain HTTP, and while the daemon is down anyone may listen on
it: before, a forged ``{"drain": true}`` drained every replica, and a forged
"cancelled" stopped a batch job."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _cli_support import RunningDaemon, run_daemon
from aiohttp import web
from test_batch import Backend, Clock, create, line, svc, upload  # type: ignore[import-not-found]

from llmgw_slurm.agent.report import DaemonClient
from llmgw_slurm.auth.secrets import (
    REPLY_HEADER,
    batch_secret,
    parse_report_auth,
    replica_secret,
    reply_signature,
    sign_report,
)
from llmgw_slurm.batch.routes import add_internal_routes
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.guard.faults import Faults

__all__ = ["svc"]  # the batch service fixture, from test_batch

RID = "0000aaaa"


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    yield from run_daemon(tmp_path)


async def _served(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class OnTheWay:
    """Between the agent and the daemon on the plain-HTTP internal port: passes
    reports on, and rewrites or replays answers."""

    def __init__(self, daemon_url: str) -> None:
        self.daemon_url = daemon_url
        self.mode = "pass"
        self.kept: tuple[bytes, str] | None = None

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        headers = {k: request.headers[k] for k in ("Authorization", "Content-Type")}
        async with (
            aiohttp.ClientSession() as s,
            s.post(self.daemon_url + request.path, data=raw, headers=headers) as r,
        ):
            body, sig, status = await r.read(), r.headers.get(REPLY_HEADER, ""), r.status
        if self.mode == "keep":
            self.kept = (body, sig)
        elif self.mode == "drain":
            # The answer rewritten, the daemon's signature kept.
            body = body.replace(b'"drain":false', b'"drain":true')
        elif self.mode == "replay":
            assert self.kept is not None
            body, sig = self.kept
        return web.Response(
            status=status, body=body, content_type="application/json", headers={REPLY_HEADER: sig}
        )


def _client(s: aiohttp.ClientSession, url: str, rid: str, secret: str, kind: str) -> DaemonClient:
    return DaemonClient(s, url, rid, secret, node="gpunode1", job_id="101", kind=kind)


async def test_the_daemon_signs_its_answer_for_the_report_it_answers(rd: RunningDaemon) -> None:
    secret = replica_secret(rd.rec.server_key, RID)
    url = f"http://127.0.0.1:{rd.d.server.listen.internal.port}"
    async with aiohttp.ClientSession() as s:
        client = _client(s, url, RID, secret, "replicas")
        raw = json.dumps(client.body("step", step="weights", status="started")).encode()
        auth = sign_report(secret, RID, int(time.time()), raw)
        headers = {"Authorization": auth, "Content-Type": "application/json"}
        async with s.post(client.url, data=raw, headers=headers) as r:
            body, sig = await r.read(), r.headers.get(REPLY_HEADER)
        assert r.status == 200
        parsed = parse_report_auth(auth)
        assert parsed is not None
        assert sig == reply_signature(secret, RID, parsed[1], 200, body)
        # A refused report's answer is not signed: that would sign a stranger's nonce.
        async with s.post(client.url, data=raw, headers=headers) as r:
            assert r.status == 401 and REPLY_HEADER not in r.headers


async def test_an_answer_rewritten_or_replayed_on_the_way_is_ignored(rd: RunningDaemon) -> None:
    secret = replica_secret(rd.rec.server_key, RID)
    way = OnTheWay(f"http://127.0.0.1:{rd.d.server.listen.internal.port}")
    app = web.Application()
    app.router.add_post("/internal/v1/replicas/{rid}/report", way.handle)
    async for url in _served(app):
        async with aiohttp.ClientSession() as s:
            client = _client(s, url, RID, secret, "replicas")
            body = client.body("step", step="weights", status="started")
            answer = await client.send_once(body)
            assert answer is not None and not answer.drain  # passed on untouched: taken
            way.mode = "drain"
            assert await client.send_once(body) is None
            way.mode = "keep"
            assert await client.send_once(body) is not None
            # The daemon's own signed answer, but to an earlier report.
            way.mode = "replay"
            assert await client.send_once(body) is None


async def test_a_batch_job_obeys_a_signed_cancel_and_ignores_a_forged_one(
    svc: tuple[BatchService, Backend, Clock],
) -> None:
    s, _, _ = svc
    b = await create(s, upload(s, "alice", line("a") + line("b")))
    internal = web.Application()
    add_internal_routes(internal, s, Faults())
    async for daemon_url in _served(internal):
        way = OnTheWay(daemon_url)
        proxy = web.Application()
        proxy.router.add_post("/internal/v1/batches/{bid}/report", way.handle)
        async for url in _served(proxy):
            secret = batch_secret(s.verifier.server_key, b.id)
            async with aiohttp.ClientSession() as http:
                client = _client(http, url, b.id, secret, "batches")
                progress: dict[str, Any] = client.body("progress", counts={"completed": 1})
                way.mode = "drain"  # "cancelled", forged on the way
                assert await client.send_once(progress) is None
                way.mode = "pass"
                answer = await client.send_once(progress)
                assert answer is not None and not answer.drain
                await s.cancel("alice", b.id)
                answer = await client.send_once(progress)
                assert answer is not None and answer.drain
