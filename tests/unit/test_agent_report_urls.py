"""An agent's reports with several daemons (LLMGW_DAEMON_URL=URL1,URL2): any takes them."""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw_slurm.agent.report import DaemonClient, daemon_urls
from tests.ports import free_port


def test_daemon_urls_reads_one_or_several() -> None:
    assert daemon_urls("http://a:1/") == ["http://a:1"]
    assert daemon_urls(" http://a:1, http://b:2 ,") == ["http://a:1", "http://b:2"]


async def test_a_report_goes_to_the_next_daemon_when_one_is_gone() -> None:
    seen: list[dict[str, object]] = []

    async def report(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.read()))
        return web.json_response({"ok": True, "drain": False})

    app = web.Application()
    app.router.add_post("/internal/v1/replicas/{rid}/report", report)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    gone = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    alive = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            client = DaemonClient(session, f"{gone},{alive}", "0a0a0a0a", "s" * 43, "n", "7")
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
