"""The daemon's own HTTP API beyond the OpenAI one: status, usage, the status page, admin.

On the gateway port (what researchers reach):

- ``GET /api/v1/status``: models, replicas, recent decisions, nodes (no key
  needed: it says what runs, not who asked for what);
- ``GET /api/v1/usage``: the caller's own token usage, by the key it presents
  (on a gateway without keys, the gateway's totals by model);
- ``GET /``: the status page.

The admin routes, on two ways in: the internal port behind the admin token
(:class:`llmgw_slurm.auth.secrets.AdminToken`, a file only the daemon's user and
root can read), and the admin Unix socket, where the kernel tells the daemon
who calls (root, the daemon's user, or ``admin_group``) and no token travels:

- ``POST /internal/v1/admin/drain`` and ``.../stop``: ``{"target": replica|model,
  "node": str, "reason": str}``;
- ``POST /internal/v1/admin/stop-preview``: the same body; the replicas ``stop``
  would cancel, cancelling nothing (404 for an unknown target), so that
  ``llmgw-admin stop`` checks the target before it asks for confirmation;
- ``POST /internal/v1/admin/reload``: re-read the catalog, answer with the error
  if the new one is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import os
import pwd
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llmgw_slurm import __version__
from llmgw_slurm.accounting.usage import UsageSummary
from llmgw_slurm.api import charts
from llmgw_slurm.api.status_page import render_page
from llmgw_slurm.auth.identity import peer_credentials
from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.auth.login import LOGIN_KEY
from llmgw_slurm.auth.secrets import AdminToken
from llmgw_slurm.base.errors import LlmgwError
from llmgw_slurm.reconciler.admin import AdminRequests
from llmgw_slurm.reconciler.core import Reconciler
from llmgw_slurm.router.gateway import GATEWAY_KEY
from llmgw_slurm.slurm.types import NodeInfo

__all__ = [
    "ADMIN_PREFIX",
    "add_admin_routes",
    "add_cli_routes",
    "auth_json",
    "key_required",
    "peer_gate",
    "status_json",
    "token_gate",
]

ADMIN_PREFIX = "/internal/v1/admin"


def status_json(rec: Reconciler, visible: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """``Reconciler.status()`` plus what the CLIs and the page show beside it.

    ``visible``: which models the caller may know of (the catalog's access
    rules); the others, and the decisions about them, are left out. Their
    GPUs still count on the nodes: a GPU taken is taken.
    """
    out = rec.status()
    if rec.peers is not None:
        out["peers"] = rec.peers()
    out["version"] = __version__
    out["now"] = time.time()
    # The nodes are what the last sinfo said, up to reconcile.nodes_max_age ago:
    # readers must be able to tell a minute-old listing from a fresh one.
    out["nodes_listed_at"] = rec.nodes_listed_at
    out["nodes"] = []
    for c in rec.clusters:
        # Each cluster's own listing time: GPUs placed since are counted in per cluster.
        placed = _placed_since(out["models"], c.nodes_listed_at, c.name)
        out["nodes"] += [_node_json(c.name, n, placed) for n in c.nodes]
    if visible is not None:
        out["models"] = [m for m in out["models"] if visible(m["name"])]
        out["decisions"] = [
            d for d in out["decisions"] if not d.get("model") or visible(d["model"])
        ]
    return out


def auth_json(app: web.Application) -> dict[str, bool]:
    """What a client needs to know before it asks for a key: whether the gateway takes
    keys at all, and whether ``llmgw login`` may issue one (``llmgw login``, ``llmgw keys``)."""
    return {"keys": app[GATEWAY_KEY].keys is not None, "login": LOGIN_KEY in app}
def _node_json(cluster: str, n: NodeInfo, placed: dict[str, int]) -> dict[str, Any]:
    return {
        "name": n.name,
        "cluster": cluster,
        "state": n.state,
        "reason": n.reason,
        "usable": n.usable,
        "cpus_free": n.cpus_total - n.cpus_alloc,
        "cpus_total": n.cpus_total,
        "partitions": sorted(n.partitions),
        "gpus_free": max(0, n.gpus_free() - placed.get(n.name, 0)),
        "gpus_free_listed": n.gpus_free(),
        "gpus_placed_since_listing": placed.get(n.name, 0),
        "gpus_total": n.gpus_total(),
        "gpus": [dataclasses.asdict(g) for g in n.gpus],
    }


def caller_may_see(app: web.Application, request: web.Request) -> Callable[[str], bool]:
    """The models the request's key (or no key) may use, for the status routes."""
    return app[GATEWAY_KEY].visible_to(request)


def _placed_since(
    models: list[dict[str, Any]], listed_at: float | None, cluster: str = ""
) -> dict[str, int]:
    """GPUs per node of ``cluster`` taken by the service's replicas that started after
    its nodes were listed.

    A kept listing (up to reconcile.nodes_max_age old) does not know them: a node
    shown as 3/4 free with two 1-GPU replicas started on it since is 1/4 free.
    Only the service's own replicas are counted in; other users' jobs show at
    the next listing. A replica that ended since is not counted back (its GPUs
    show as taken until then: the page errs towards less free).
    """
    out: dict[str, int] = {}
    if listed_at is None:
        return out
    for m in models:
        for r in m.get("replicas") or []:
            nodes, started = r.get("nodes") or [], r.get("started_at")
            if r.get("cluster", "") != cluster:
                continue
            if not nodes or not isinstance(started, int | float) or started <= listed_at:
                continue
            per_node = int(r.get("gpus") or 0) // len(nodes)
            for n in nodes:
                out[n] = out.get(n, 0) + per_node
    return out


def _by_model(rows: list[UsageSummary]) -> list[dict[str, Any]]:
    """Usage rows summed by model (one key's rows are one per model already)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        m = out.setdefault(
            r.model,
            {
                "model": r.model,
                "requests": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "total_tokens": 0,
            },
        )
        m["requests"] += r.requests
        m["prompt_tokens"] += r.prompt_tokens
        m["completion_tokens"] += r.completion_tokens
        m["total_tokens"] += r.total_tokens
    return sorted(out.values(), key=lambda m: str(m["model"]))


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


def _bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_required(app: web.Application, request: web.Request) -> web.Response | None:
    """The 401 for a request without a valid gateway key when keys are on; None to go on.

    For the gateway's own routes that change state (``/v1`` has its own check).
    """
    keys = app[GATEWAY_KEY].keys
    if keys is None:
        return None
    token = _bearer(request)
    if token and keys.lookup(token) is not None:
        return None
    return web.json_response(
        {
            "error": {
                "message": "no valid API key: send 'Authorization: Bearer <key>' (llmgw --key, "
                "LLMGW_API_KEY, or api_key in ~/.config/llmgw/config.yaml)",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
        status=401,
    )


def _usage_scope(rec_key: KeyRecord | None, by: str) -> dict[str, str] | web.Response:
    """Whose usage ``/api/v1/usage?by=`` asks for: the key's own, its user's (all their
    keys) or its account's (every key charged to it); nobody's in particular without keys."""
    if rec_key is None:
        return {}
    if by == "key":
        return {"key_id": rec_key.key_id}
    if by == "user":
        return {"user": rec_key.user}
    if by == "account" and rec_key.project:
        # The store's column is still named project (the older word for the account).
        return {"project": rec_key.project}
    if by == "account":
        return _error(400, "your key is charged to no account", "bad_request")
    return _error(400, f"by must be key, user or account, not {by!r}", "bad_request")


def add_cli_routes(app: web.Application, rec: Reconciler) -> None:
    """The status page and ``/api/v1/usage`` on the gateway app (made by ``create_app``)."""

    async def usage(request: web.Request) -> web.Response:
        gw = app[GATEWAY_KEY]
        rec_key: KeyRecord | None = None
        if gw.keys is not None:
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
        by = request.query.get("by", "key")
        scope = _usage_scope(rec_key, by)
        if isinstance(scope, web.Response):
            return scope
        rows = []
        if gw.usage is not None:
            # The store commits about once a second; the caller's last request counts.
            await gw.usage.flush()
            rows = await asyncio.to_thread(gw.usage.queries.query, since=since, **scope)
        if rec_key is None:
            # Without keys nobody's use is told apart: the gateway's totals, by
            # model (anyone who reaches the port may use it, and see this).
            return web.json_response(
                {"scope": "gateway", "since": since, "models": _by_model(rows)}
            )
        return web.json_response(
            {
                "scope": "key",
                "key_id": rec_key.key_id,
                "user": rec_key.user,
                "account": rec_key.project,
                "by": by,
                "since": since,
                "models": _by_model(rows),
            }
        )

    async def page(request: web.Request) -> web.Response:
        endpoint = f"{request.scheme}://{request.host}/v1"
        return web.Response(
            # A browser sends no key: models with access rules are not shown.
            text=render_page(
                status_json(rec, caller_may_see(app, request)),
                endpoint,
                charts.page_data(request.app, caller_may_see(app, request)),
            ),
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


Gate = Callable[[web.Request], "web.Response | None"]


def token_gate(token: AdminToken) -> Gate:
    """Admin calls over TCP: the bearer token in the file now (a rotated one is refused)."""

    def gate(request: web.Request) -> web.Response | None:
        if token.matches(_bearer(request)):
            return None
        return _error(401, "bad or missing admin token", "unauthorized")

    return gate


def peer_gate(admin_group: str | None) -> Gate:
    """Admin calls over the Unix socket: root, the daemon's own user, or ``admin_group``.

    The kernel's record of the caller (SO_PEERCRED), taken when it connected:
    nothing a caller sends can change it.
    """
    me = os.geteuid()
    gid = grp.getgrnam(admin_group).gr_gid if admin_group else None
    who = f"root, uid {me}" + (f" or group {admin_group}" if admin_group else "")

    def member(uid: int, primary: int) -> bool:
        if gid is None:
            return False
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            return primary == gid
        return gid in os.getgrouplist(name, primary)

    def gate(request: web.Request) -> web.Response | None:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None or sock.family != socket.AF_UNIX:
            return _error(403, "admin calls come over the admin socket", "forbidden")
        _, uid, primary = peer_credentials(sock)
        if uid in (0, me) or member(uid, primary):
            return None
        return _error(403, f"uid {uid} may not administer this daemon ({who} may)", "forbidden")

    return gate


def add_admin_routes(
    app: web.Application,
    admin: AdminRequests,
    gate: Gate,
    reload: Callable[[], str | None],
) -> None:
    """Drain, stop, reload and job announcements, each call let in by ``gate``."""

    def guarded(
        fn: Callable[[web.Request], Awaitable[web.Response]],
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            denied = gate(request)
            if denied is not None:
                return denied
            return await fn(request)

        return handler

    h = _AdminHandlers(admin, reload)
    app.router.add_post(f"{ADMIN_PREFIX}/drain", guarded(h.drain))
    app.router.add_post(f"{ADMIN_PREFIX}/stop", guarded(h.stop))
    app.router.add_post(f"{ADMIN_PREFIX}/stop-preview", guarded(h.stop_preview))
    app.router.add_post(f"{ADMIN_PREFIX}/reload", guarded(h.reload))
    app.router.add_post(f"{ADMIN_PREFIX}/jobs", guarded(h.jobs))


async def _read_target(request: web.Request) -> tuple[str, str, str] | web.Response:
    """(target, node, reason) from an admin request's body, or the 400 saying what is wrong."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
        return _error(400, "body is not JSON", "bad_request")
    if not isinstance(body, dict):
        return _error(400, "body must be an object", "bad_request")
    target, node, reason = (str(body.get(k) or "") for k in ("target", "node", "reason"))
    if bool(target) == bool(node):
        return _error(400, "give exactly one of target (replica or model) and node", "usage")
    return target, node, reason


class _AdminHandlers:
    """The admin routes' handlers (the admin token is checked before any of them runs)."""

    def __init__(self, admin: AdminRequests, reload: Callable[[], str | None]) -> None:
        self.admin = admin
        self._reload = reload

    async def drain(self, request: web.Request) -> web.Response:
        t = await _read_target(request)
        if isinstance(t, web.Response):
            return t
        try:
            done = self.admin.request_drain(*t)
        except LookupError as exc:
            return _error(404, str(exc.args[0]), "not_found")
        return web.json_response({"ok": True, "replicas": done})

    async def stop(self, request: web.Request) -> web.Response:
        t = await _read_target(request)
        if isinstance(t, web.Response):
            return t
        try:
            done = await self.admin.request_stop(*t)
        except LookupError as exc:
            return _error(404, str(exc.args[0]), "not_found")
        except LlmgwError as exc:
            return _error(502, f"scancel failed: {exc}", "slurm_error")
        return web.json_response({"ok": True, "replicas": done})

    async def stop_preview(self, request: web.Request) -> web.Response:
        t = await _read_target(request)
        if isinstance(t, web.Response):
            return t
        target, node, _ = t
        try:
            reps = self.admin.find_replicas(target, node)
        except LookupError as exc:
            return _error(404, str(exc.args[0]), "not_found")
        # As request_stop: a replica already being stopped is not stopped again.
        return web.json_response(
            {"ok": True, "replicas": [r.replica_id for r in reps if not r.stop_reason]}
        )

    async def reload(self, _: web.Request) -> web.Response:
        problem = self._reload()
        if problem is not None:
            return _error(422, problem, "catalog_refused")
        return web.json_response({"ok": True, "models": self.admin.model_names()})

    async def jobs(self, request: web.Request) -> web.Response:
        # llmgw-admin fetch / install-engine announce what they submitted.
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON", "bad_request")
        if not isinstance(body, dict):
            return _error(400, "body must be an object", "bad_request")
        job_id, name, target, cluster = (
            str(body.get(k) or "") for k in ("job_id", "name", "target", "cluster")
        )
        problem = self.admin.announce(job_id, name, target, cluster)
        if problem is not None:
            return _error(400, problem, "bad_request")
        return web.json_response({"ok": True})
