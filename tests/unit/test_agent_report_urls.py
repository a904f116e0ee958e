"""An agent's reports with several daemons (LLMGW_DAEMON_URL=URL1,URL2): any takes them."""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw_slurm.agent.report import DaemonClient, daemon_urls
from llmgw_slurm.auth.secrets import REPLY_HEADER, parse_report_auth, reply_signature
from tests.ports import free_port

SECRET = "s" * 43


def _signed(request: web.Request, body: bytes, secret: str = SECRET) -> web.Response:
    """The answer as the daemon makes it: signed for the report it answers."""
    parsed = parse_report_auth(request.headers["Authorization"])
    assert parsed is not None
    sig = reply_signature(secret, request.match_info["rid"], parsed[1], 200, body)
    return web.Response(body=body, content_type="application/json", headers={REPLY_HEADER: sig})


def test_daemon_urls_reads_one_or_several() -> None:
    assert daemon_urls("http://a:1/") == ["http://a:1"]
    assert daemon_urls(" http://a:1, http://b:2 ,") == ["http://a:1", "http://b:2"]


async def test_a_report_goes_to_the_next_daemon_when_one_is_gone() -> None:
    seen: list[dict[str, object]] = []

    async def report(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        return _signed(request, json.dumps({"ok": True, "drain": False}).encode())

    app = web.Application()
    app.router.add_post("/internal/v1/replicas/{rid}/report", report)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    gone = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    alive = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            client = DaemonClient(session, f"{gone},{alive}", "0a0a0a0a", SECRET, "n", "7")
            first = await client.send_once(client.body("heartbeat"))
            assert first is not None and first.ok
            assert client.url.startswith(alive)
            # The next report goes straight to the one that answered.
            assert await client.send_once(client.body("heartbeat")) is not None
        assert len(seen) == 2
    finally:
        await server.close()


async def test_no_daemon_answering_is_none_not_an_error() -> None:
    urls = f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        client = DaemonClient(session, urls, "0a0a0a0a", "s" * 43, "n", "7", timeout_s=2)
        assert await client.send_once(client.body("heartbeat")) is None


async def test_an_unsigned_answer_on_one_daemons_port_sends_the_report_to_the_next() -> None:
    # Another user holds one login node's internal port (its daemon is down) and
    # answers "drain": the agent ignores it and reports to the other daemon.
    seen: list[str] = []

    async def squatter(request: web.Request) -> web.Response:
        seen.append("squatter")
        return web.json_response({"ok": True, "drain": True})

    async def daemon(request: web.Request) -> web.Response:
        seen.append("daemon")
        return _signed(request, json.dumps({"ok": True, "drain": False}).encode())

    servers = []
    for handler in (squatter, daemon):
        app = web.Application()
        app.router.add_post("/internal/v1/replicas/{rid}/report", handler)
        servers.append(TestServer(app, host="127.0.0.1"))
        await servers[-1].start_server()
    urls = ",".join(f"http://127.0.0.1:{s.port}" for s in servers)
    try:
        async with aiohttp.ClientSession() as session:
            client = DaemonClient(session, urls, "0a0a0a0a", SECRET, "n", "7")
            got = await client.send_once(client.body("heartbeat"))
        assert got is not None and got.ok and not got.drain
        assert seen == ["squatter", "daemon"]
    finally:
        for s in servers:
            await s.close()
