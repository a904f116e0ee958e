"""A fake daemon for the agent's tests (unit and Slurm level)."""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, TCPConnector, web

from llmgw_slurm.auth.secrets import (
    REPLY_HEADER,
    parse_report_auth,
    reply_signature,
    report_signature,
)
from llmgw_slurm.auth.tls import Identity, client_context, engine_address_problem, make_identity

RID = "0123abcd"
SECRET = "replica-secret-xyz"
KEY = "engine-key-abc"
BODY_KEYS = {"event", "step", "status", "url", "node", "job_id", "message", "elapsed_s", "cert"}
EVENTS = {"step", "ready", "heartbeat", "draining", "failed", "stopped"}
FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


def gateway_identity(folder: Path) -> Identity:
    """A gateway client identity for a test: the certificate a job gets, and its key."""
    folder.mkdir(parents=True, exist_ok=True)
    return make_identity(folder, "gateway-client", "test gateway", 1)


def as_gateway(identity: Identity, engine_cert: str | None = None, **kw: Any) -> ClientSession:
    """A client session that connects to engines as the gateway does: ``identity``'s
    client certificate, pinning ``engine_cert`` (None: checking no server certificate,
    for a test that has not heard it)."""
    if engine_cert is not None:
        ctx = client_context(engine_cert, identity.cert_file, identity.key_file)
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.load_cert_chain(identity.cert_file, identity.key_file)
    return ClientSession(connector=TCPConnector(ssl=ctx), **kw)


def fake_engine_spec(
    weights: Path,
    *engine_extra: str,
    nodes: int = 1,
    gpus: int = 0,
    ready_timeout: float | None = None,
) -> str:
    """LLMGW_REPLICA_SPEC of a command engine running tests/fake_engine.py on ``weights``."""
    engine: dict[str, Any] = {
        "kind": "command",
        "command": [
            sys.executable,
            str(FAKE_ENGINE),
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--model-path",
            "{model_path}",
            "--served-name",
            "{served_name}",
            *engine_extra,
        ],
    }
    if ready_timeout is not None:
        engine["ready_timeout"] = ready_timeout
    return json.dumps(
        {
            "name": "tiny",
            "engine": engine,
            "weights": {"method": "copy", "source": str(weights)},
            "resources": {"nodes": nodes, "gpus": gpus},
        }
    )


class FakeDaemon:
    """Records reports; refuses what the protocol does not allow."""

    def __init__(self, replica_id: str = RID, secret: str = SECRET) -> None:
        self.replica_id = replica_id
        self.secret = secret
        self.reports: list[dict[str, Any]] = []
        self.refused: list[str] = []
        self.drain_after_ready = False
        # False: answers as a squatter on the daemon's port would (unsigned).
        self.sign_answers = True
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        auth = request.headers.get("Authorization", "")
        parsed = parse_report_auth(auth)
        rid = request.match_info["rid"]
        # The secret signs the report and is never sent: not as a bearer, not anywhere.
        if self.secret in auth or self.secret.encode() in raw or parsed is None:
            self.refused.append("not signed, or the secret was sent")
            return web.json_response({"ok": False}, status=401)
        ts, nonce, sig = parsed
        if sig != report_signature(self.secret, rid, ts, nonce, raw):
            self.refused.append("bad signature")
            return web.json_response({"ok": False}, status=401)
        if rid != self.replica_id:
            self.refused.append("unknown replica")
            return web.json_response({"ok": False}, status=404)
        body = json.loads(raw)
        problems = []
        if set(body) != BODY_KEYS:
            problems.append(f"keys {sorted(set(body) ^ BODY_KEYS)}")
        if body.get("event") not in EVENTS:
            problems.append(f"event {body.get('event')!r}")
        if body.get("status") not in (None, "started", "done", "failed"):
            problems.append(f"status {body.get('status')!r}")
        if body.get("event") in ("ready", "heartbeat") and not body.get("url"):
            problems.append("ready/heartbeat without url")
        if body.get("event") in ("ready", "heartbeat") and body.get("url"):
            # The daemon pins what a ready or heartbeat report names.
            problem = engine_address_problem(body["url"], body.get("cert"), False)
            if problem:
                problems.append(problem)
        if problems:
            self.refused.append("; ".join(problems))
            return web.json_response({"ok": False}, status=400)
        self.reports.append(body)
        ready_seen = any(r["event"] == "ready" for r in self.reports)
        answer = json.dumps({"ok": True, "drain": self.drain_after_ready and ready_seen}).encode()
        # As the daemon does: the answer signed with the secret, bound to this report.
        headers = {REPLY_HEADER: reply_signature(self.secret, rid, nonce, 200, answer)}
        return web.Response(
            body=answer,
            content_type="application/json",
            headers=headers if self.sign_answers else {},
        )

    def events(self) -> list[str]:
        return [
            r["event"] if r["event"] != "step" else f"{r['step']}:{r['status']}"
            for r in self.reports
        ]

    async def wait_for(self, pred: Callable[[], bool], limit_s: float = 60) -> None:
        deadline = time.monotonic() + limit_s
        while not pred():
            assert time.monotonic() < deadline, f"timed out; reports: {self.events()}"
            await asyncio.sleep(0.05)


@asynccontextmanager
async def fake_daemon(host: str = "127.0.0.1") -> AsyncIterator[FakeDaemon]:
    """A FakeDaemon served on ``host``; on exit, fails if it refused any report."""
    fake = FakeDaemon()
    app = web.Application()
    app.router.add_post("/internal/v1/replicas/{rid}/report", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://{host}:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()
    assert fake.refused == [], f"the fake daemon refused reports: {fake.refused}"
