"""The daemon's own HTTP API beyond the OpenAI one: status, usage, the status page, admin.

On the gateway port (what researchers reach):

- ``GET /api/v1/status``: models, replicas, recent decisions, nodes (no key
  needed: it says what runs, not who asked for what);
- ``GET /api/v1/usage``: the caller's own token usage, by the key it presents;
- ``GET /``: the status page.

On the internal port, behind the admin token (:func:`llmgw_slurm.secrets.admin_token`,
derived from the server key, so whoever can read the key file may use them):

- ``POST /internal/v1/admin/drain`` and ``.../stop``: ``{"target": replica|model,
  "node": str, "reason": str}``;
- ``POST /internal/v1/admin/reload``: re-read the catalog, answer with the error
  if the new one is refused.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llmgw_slurm import __version__
from llmgw_slurm.errors import LlmgwError
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.router.gateway import GATEWAY_KEY
from llmgw_slurm.router.usage import query_usage
from llmgw_slurm.secrets import constant_time_equal
from llmgw_slurm.status_page import render_page

__all__ = ["ADMIN_PREFIX", "add_admin_routes", "add_cli_routes", "status_json"]

ADMIN_PREFIX = "/internal/v1/admin"


def status_json(rec: Reconciler) -> dict[str, Any]:
    """``Reconciler.status()`` plus what the CLIs and the page show beside it."""
    out = rec.status()
    out["version"] = __version__
    out["now"] = time.time()
    # The nodes are what the last sinfo said, up to reconcile.nodes_max_age ago:
    # readers must be able to tell a minute-old listing from a fresh one.
    out["nodes_listed_at"] = rec.nodes_listed_at
    out["nodes"] = [
        {
            "name": n.name,
            "state": n.state,
            "reason": n.reason,
            "usable": n.usable,
            "cpus_free": n.cpus_total - n.cpus_alloc,
            "cpus_total": n.cpus_total,
            "partitions": sorted(n.partitions),
            "gpus_free": n.gpus_free(),
            "gpus_total": n.gpus_total(),
            "gpus": [dataclasses.asdict(g) for g in n.gpus],
        }
        for n in rec.nodes
    ]
    return out


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


def _bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def add_cli_routes(app: web.Application, rec: Reconciler) -> None:
    """The status page and ``/api/v1/usage`` on the gateway app (made by ``create_app``)."""

    async def usage(request: web.Request) -> web.Response:
        gw = app[GATEWAY_KEY]
        if gw.keys is None:
            return _error(
                409,
                "usage is counted per API key, and this gateway runs without keys "
                "(the admin sets router.keys_file to turn them on)",
                "keys_disabled",
            )
        token = _bearer(request)
        rec_key = gw.keys.lookup(token) if token else None
        if rec_key is None:
            return _error(
                401,
                "no valid API key: send 'Authorization: Bearer <key>' (llmgw --key, "
                "LLMGW_API_KEY, or api_key in ~/.config/llmgw/config.yaml)",
                "invalid_api_key",
            )
        since: float | None = None
        if "since" in request.query:
            try:
                since = float(request.query["since"])
            except ValueError:
                return _error(400, "since must be a Unix time in seconds", "bad_request")
        if gw.usage is None:
            rows = []
        else:
            # The store commits about once a second; the caller's last request counts.
            await gw.usage.flush()
            rows = query_usage(gw.usage.path, key_id=rec_key.key_id, since=since)
        models = [
            {
                "model": r.model,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "total_tokens": r.total_tokens,
            }
            for r in rows
        ]
        return web.json_response(
            {
                "key_id": rec_key.key_id,
                "user": rec_key.user,
                "project": rec_key.project,
                "since": since,
                "models": models,
            }
        )

    async def page(request: web.Request) -> web.Response:
        endpoint = f"{request.scheme}://{request.host}/v1"
        return web.Response(
            text=render_page(status_json(rec), endpoint),
            content_type="text/html",
            headers={
                # Belt and braces: everything is escaped, and even if something were
                # missed, no script runs and nothing loads from elsewhere.
                "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'",
                "X-Content-Type-Options": "nosniff",
                "Cache-Control": "no-store",
            },
        )

    app.router.add_get("/api/v1/usage", usage)
    app.router.add_get("/", page)


def _guarded(
    fn: Callable[[web.Request], Awaitable[web.Response]], token: str
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        if not constant_time_equal(_bearer(request), token):
            return _error(401, "bad or missing admin token", "unauthorized")
        return await fn(request)

    return handler


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object body, or the 400 to answer."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
        return _error(400, "body is not JSON", "bad_request")
    if not isinstance(body, dict):
        return _error(400, "body must be an object", "bad_request")
    return body


async def _admin_target(request: web.Request) -> tuple[str, str, str] | web.Response:
    """(target, node, reason) of a drain or stop, or the 400 to answer."""
    body = await _json_object(request)
    if isinstance(body, web.Response):
        return body
    target, node, reason = (str(body.get(k) or "") for k in ("target", "node", "reason"))
    if bool(target) == bool(node):
        return _error(400, "give exactly one of target (replica or model) and node", "usage")
    return target, node, reason


def add_admin_routes(
    app: web.Application,
    rec: Reconciler,
    token: str,
    reload: Callable[[], str | None],
) -> None:
    """Drain, stop, reload and job announcements on the internal app, behind the admin token."""

    async def drain(request: web.Request) -> web.Response:
        t = await _admin_target(request)
        if isinstance(t, web.Response):
            return t
        try:
            done = rec.request_drain(*t)
        except LookupError as exc:
            return _error(404, str(exc.args[0]), "not_found")
        return web.json_response({"ok": True, "replicas": done})

    async def stop(request: web.Request) -> web.Response:
        t = await _admin_target(request)
        if isinstance(t, web.Response):
            return t
        try:
            done = await rec.request_stop(*t)
        except LookupError as exc:
            return _error(404, str(exc.args[0]), "not_found")
        except LlmgwError as exc:
            return _error(502, f"scancel failed: {exc}", "slurm_error")
        return web.json_response({"ok": True, "replicas": done})

    async def do_reload(_: web.Request) -> web.Response:
        problem = reload()
        if problem is not None:
            return _error(422, problem, "catalog_refused")
        return web.json_response({"ok": True, "models": [m.name for m in rec.catalog.models]})

    app.router.add_post(f"{ADMIN_PREFIX}/drain", _guarded(drain, token))
    app.router.add_post(f"{ADMIN_PREFIX}/stop", _guarded(stop, token))

    async def jobs(request: web.Request) -> web.Response:
        # llmgw-admin fetch / install-engine announce what they submitted.
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        job_id, name, target = (str(body.get(k) or "") for k in ("job_id", "name", "target"))
        if not rec.service_jobs.expect(job_id, name, target, rec.clock()):
            return _error(
                400,
                f"job {job_id!r} named {name!r} is not a model job or engine install of "
                f"this daemon (prefix {rec.prefix!r})",
                "bad_request",
            )
        return web.json_response({"ok": True})

    app.router.add_post(f"{ADMIN_PREFIX}/reload", _guarded(do_reload, token))
    app.router.add_post(f"{ADMIN_PREFIX}/jobs", _guarded(jobs, token))
