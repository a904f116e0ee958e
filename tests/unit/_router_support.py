"""Real servers on localhost ports for the engine and gateway tests."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import openai
from aiohttp import web

from llmgw_slurm.auth.tls import Identity, make_engine_tls
from llmgw_slurm.router import GATEWAY_KEY
from llmgw_slurm.router.server import Runner
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app
from tests.ports import free_port


@asynccontextmanager
async def serve(
    app: web.Application,
    port: int | None = None,
    *,
    handler_cancellation: bool = True,
    ssl_context: ssl.SSLContext | None = None,
    keepalive_timeout: float | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1; yields its base URL."""
    # handler_cancellation as the daemon runs it: a client that goes away
    # cancels its handler.
    opts: dict[str, Any] = {"handler_cancellation": handler_cancellation, "access_log": None}
    if keepalive_timeout is not None:
        opts["keepalive_timeout"] = keepalive_timeout
    port = port or free_port()
    runner: Runner | web.AppRunner
    if GATEWAY_KEY in app:  # a gateway app, on the daemon's runner (router.server)
        runner = Runner(app, **opts)
        await runner.setup()
        await runner.start("127.0.0.1", port, ssl_context)
    else:
        runner = web.AppRunner(app, **opts)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
    scheme = "https" if ssl_context is not None else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serve_engine(
    app: web.Application, gateway: Identity, port: int | None = None
) -> AsyncIterator[tuple[str, str]]:
    """Serve an engine ``app`` as an agent starts one: TLS with a fresh key pair of its
    own, letting in only ``gateway``'s client certificate; yields its URL and certificate."""
    tls = make_engine_tls(gateway.cert_pem, "0000test")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.identity.cert_file, tls.identity.key_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(tls.ca_file)
    try:
        async with serve(app, port, ssl_context=ctx) as url:
            yield url, tls.identity.cert_pem
    finally:
        shutil.rmtree(tls.directory, ignore_errors=True)


@asynccontextmanager
async def engine(
    name: str = "tiny",
    key: str = "engine-key",
    token_delay: float = 0.0,
    ready_after: float = 0.0,
    port: int | None = None,
) -> AsyncIterator[str]:
    app = create_engine_app(
        EngineOptions(
            api_key=key, served_name=name, token_delay=token_delay, ready_after=ready_after
        )
    )
    async with serve(app, port) as url:
        yield url


async def eventually(cond: Callable[[], bool], what: str) -> None:
    """Wait until ``cond()`` holds; the limit only stops a hung test, it is not a threshold."""
    try:
        async with asyncio.timeout(30):
            while not cond():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for: {what}") from None


@asynccontextmanager
async def engine_client(
    key: str = "engine-key", client_key: str | None = None, **kw: Any
) -> AsyncIterator[tuple[str, openai.AsyncOpenAI]]:
    """A test engine and an async OpenAI client for it (closed on exit)."""
    async with (
        engine(key=key, **kw) as url,
        openai.AsyncOpenAI(
            api_key=client_key or key, base_url=url + "/v1", max_retries=0
        ) as client,
    ):
        yield url, client
