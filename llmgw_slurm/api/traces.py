"""The trace store's two routes: agents' spans in, waterfalls out.

- ``POST /internal/v1/replicas/{id}/spans`` (internal port): an agent's spans,
  ``{"spans": [...]}``, signed with its replica's secret exactly as its
  reports are (a replayed or old batch is refused); taken only into that
  replica's own start trace.
- ``POST /internal/v1/admin/trace`` (admin socket, or the internal port with
  the admin token): ``{"target": MODEL | REPLICA | TRACE_ID}``, the newest
  start of that model or replica, or that trace, as a waterfall
  (:mod:`llmgw_slurm.tracing.waterfall`) with the spans it was built from.
"""

from __future__ import annotations

import re
import time
from typing import Any

from aiohttp import web

from llmgw_slurm.api.routes import Gate
from llmgw_slurm.reconciler.reportroute import read_signed
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.router.directory import ModelDirectory
from llmgw_slurm.tracing.store import SpanRejected, TraceStore
from llmgw_slurm.tracing.waterfall import find_start, generic, waterfall

__all__ = ["add_span_route", "add_trace_route", "trace_of"]

_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def _fail(status: int, message: str) -> web.Response:
    return web.json_response({"ok": False, "error": message}, status=status)


def add_span_route(
    app: web.Application, verifier: ReportVerifier, store: TraceStore | None
) -> None:
    """The agents' spans, taken as their reports are (``verifier``: the reports')."""

    async def spans(request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        signed = await read_signed(request)
        if isinstance(signed, web.Response):
            return signed
        auth, raw, body = signed
        if not isinstance(body.get("spans"), list):
            return _fail(400, 'body must be {"spans": [...]}')
        try:
            verifier.verify(rid, auth, raw)
        except PermissionError as err:
            return _fail(401, str(err))
        if store is None:
            # tracing.keep_spans: 0. Taken, so that the agent does not retry.
            return web.json_response({"ok": True, "kept": 0})
        try:
            kept = store.add_remote(rid, body["spans"])
        except SpanRejected as err:
            return _fail(400, str(err))
        return web.json_response({"ok": True, "kept": kept})

    app.router.add_post("/internal/v1/replicas/{rid:[0-9a-f]{8}}/spans", spans)


def trace_of(models: ModelDirectory, store: TraceStore, target: str) -> dict[str, Any] | None:
    """The waterfall for ``target`` (model, alias, replica id or trace id); None if none kept."""
    now = time.time()
    model = models.resolve(target)
    start = find_start(store.starts(), target, model)
    if start is not None:
        spans = store.spans(start["trace_id"])
        return {"waterfall": waterfall(spans, start, now).to_json(), "spans": spans}
    if _TRACE_ID.fullmatch(target):
        spans = store.spans(target)
        if spans:
            return {"waterfall": generic(spans, now).to_json(), "spans": spans}
    return None


def add_trace_route(
    app: web.Application, models: ModelDirectory, store: TraceStore | None, gate: Gate
) -> None:
    """Waterfalls out, behind ``gate``; ``models`` resolves a target's aliases."""

    async def trace(request: web.Request) -> web.Response:
        denied = gate(request)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            return _fail(400, "body is not JSON")
        target = str(body.get("target") or "") if isinstance(body, dict) else ""
        if not target:
            return _fail(400, "give a target: a model, a replica id or a trace id")
        if store is None:
            return _fail(
                404,
                "this daemon keeps no traces (tracing.keep_spans is 0 in server.yaml)",
            )
        found = trace_of(models, store, target)
        if found is None:
            kept = sorted({str(s["attrs"].get("llmgw.model", "")) for s in store.starts()})
            return _fail(
                404,
                f"no start of {target!r} among the traces kept "
                f"({len(kept)} model(s) with one: {', '.join(kept[:20]) or 'none'}); "
                f"give a model, a replica id (8 hex digits) or a trace id (32)",
            )
        found["ok"] = True
        found["store"] = store.stats()
        return web.json_response(found)

    app.router.add_post("/internal/v1/admin/trace", trace)
