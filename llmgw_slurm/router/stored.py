"""A stored response's own routes: ``GET``, ``DELETE`` and ``POST .../cancel``.

A response the engine stored lives in that one replica's memory, so these go
to the replica that made it (the gateway's :class:`surface.ResponseHomes`,
as ``previous_response_id`` does), never by the model's balancing. Only the
key that made a response may reach it: another key, or one no longer allowed
the model, gets the same 404 as an id never seen, so that ids say nothing of
other keys' work. A response whose replica has stopped is a 404 saying so.

vLLM (0.32) serves ``GET`` (``?stream=true&starting_after=N`` replays a
background response's events) and ``/cancel``; it has no ``DELETE`` and no
``/input_items``. ``DELETE`` is passed on all the same, for engines that have
it; where the engine answers 405 (no such method), the gateway forgets the
response, which then reads as deleted to every client of the gateway (the
engine frees it when the replica stops). ``/input_items`` is not routed.

A background response (``background: true``) answers ``queued``, without
usage: its tokens count when a retrieval first shows it finished.

vLLM keeps no response at all unless started with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``store`` is ignored without it, and the
answer does not say so): a researcher's ``GET`` of their own response then
found "not found" and no reason. So an engine's 404 for a response the
gateway saw made, on a model whose catalog entry does not turn the store on,
is answered ``response_not_stored``, naming the setting.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from aiohttp import web

from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelRouting
from llmgw_slurm.router.engine import Conn, EngineBroken, EnginePool, EngineUnreachable
from llmgw_slurm.router.surface import Home, ResponseHomes, not_stored_message

if TYPE_CHECKING:
    from llmgw_slurm.auth.keys import KeyRecord
    from llmgw_slurm.router.account import Tally
    from llmgw_slurm.router.metrics import GatewayMetrics


class GatewayView(Protocol):
    """What these routes use of :class:`llmgw_slurm.router.gateway.Gateway`
    (named here, not imported: the gateway imports this module)."""

    directory: ModelDirectory
    responses: ResponseHomes
    metrics: GatewayMetrics

    pool: EnginePool

    def authenticate(
        self, request: web.Request
    ) -> tuple[KeyRecord | None, web.Response | None]: ...

    def may_use(self, model: str, key: KeyRecord | None) -> bool: ...

    def record_usage(
        self, key: KeyRecord | None, model: str, endpoint: str, usage: dict[str, Any] | None
    ) -> None: ...


__all__ = ["ROUTES", "handler", "not_stored_message"]

# (method, path, action)
ROUTES = (
    ("GET", "/v1/responses/{response_id}", "retrieve"),
    ("DELETE", "/v1/responses/{response_id}", "delete"),
    ("POST", "/v1/responses/{response_id}/cancel", "cancel"),
)


def _cut_event(why: str) -> bytes:
    """The gateway's error event for an answer cut short (as gateway._sse_error)."""
    message = f"The replica failed while replaying the response ({why}); it is incomplete."
    body = {"error": {"message": message, "type": "server_error", "param": None}}
    body["error"]["code"] = "upstream_failed"
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _error(status: int, message: str, code: str) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "response_id",
            "code": code,
        }
    }
    return web.json_response(body, status=status)


def _not_found(rid: str) -> web.Response:
    return _error(404, f"Response with id '{rid}' not found.", "response_not_found")


def _replica(gw: GatewayView, home: Home) -> Endpoint | None:
    for e in gw.directory.endpoints(home.model):
        if e.replica_id == home.replica_id and e.epoch == home.epoch:
            return e
    return None


def handler(
    gw: GatewayView, action: str
) -> Callable[[web.Request, str, Tally], Awaitable[web.StreamResponse]]:
    """The route's inner handler, for :meth:`Gateway.instrumented` (its span and metrics)."""

    async def handle(request: web.Request, endpoint: str, tally: Tally) -> web.StreamResponse:
        return await _handle(gw, request, action, tally)

    return handle


async def _handle(
    gw: GatewayView, request: web.Request, action: str, tally: Tally
) -> web.StreamResponse:
    key, denied = gw.authenticate(request)
    if denied is not None:
        return denied
    rid = request.match_info["response_id"]
    home = gw.responses.get(rid)
    owner = key.key_id if key is not None else ""
    if home is None or home.owner != owner or not gw.may_use(home.model, key):
        return _not_found(rid)
    tally.model = home.model
    tally.set("llmgw.model", home.model)
    tally.set("llmgw.replica_id", home.replica_id)
    ep = _replica(gw, home)
    if ep is None:
        return _error(
            404,
            f"Response '{rid}' was held by replica {home.replica_id} of model "
            f"'{home.model}', which has stopped since, and its stored responses with it.",
            "response_gone",
        )
    path = "/v1/responses/" + quote(rid, safe="") + ("/cancel" if action == "cancel" else "")
    if action == "retrieve" and request.query_string:
        path += "?" + request.query_string
    try:
        return await _forward(gw, request, action, home, ep, path)
    except (EngineUnreachable, EngineBroken) as e:
        gw.metrics.upstream_errors.labels(home.model, "connect").inc()
        return _upstream_error(
            f"Could not reach replica {home.replica_id} of model '{home.model}', which "
            f"holds response '{rid}' ({type(e).__name__}).",
            "upstream_unavailable",
        )


async def _forward(
    gw: GatewayView, request: web.Request, action: str, home: Home, ep: Endpoint, path: str
) -> web.StreamResponse:
    headers = {
        "Authorization": f"Bearer {ep.api_key}",
        "Accept": request.headers.get("Accept", "*/*"),
        "Accept-Encoding": "identity",
    }
    replay = _Replay()
    fetching = asyncio.ensure_future(
        gw.pool.fetch(ep.base_url, ep.ssl, request.method, path, headers, sink=replay)
    )
    gw.directory.request_started(home.model, ep.replica_id)
    try:
        await asyncio.wait((fetching, replay.headed), return_when=asyncio.FIRST_COMPLETED)
        out = {"X-Llmgw-Replica": ep.replica_id}
        if replay.streams:
            return await _stream(request, replay, out)
        answer = await fetching
    finally:
        gw.directory.request_finished(home.model, ep.replica_id)
        if not fetching.done():
            fetching.cancel()  # the client went away: the engine's connection is cut
    data = b"".join(replay.parts)
    rid = request.match_info["response_id"]
    if answer.status in (401, 403):
        return _upstream_error(
            f"The replica of model '{home.model}' refused the gateway's engine key.",
            "upstream_auth_failed",
        )
    if action == "delete" and answer.status in (200, 204, 404, 405):
        gw.responses.forget(rid)
        if answer.status == 405:
            return web.json_response(
                {"id": rid, "object": "response", "deleted": True}, headers=out
            )
    if answer.status == 404 and action != "delete" and _stores_none(gw, home.model):
        return _not_stored(rid, home.model)
    if answer.status == 200 and action == "retrieve":
        _count_background(gw, request, home, rid, data)
    if "Content-Type" in answer.headers:
        out["Content-Type"] = answer.headers["Content-Type"]
    return web.Response(status=answer.status, body=data, headers=out)


def _upstream_error(message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return web.json_response(body, status=502)


class _Replay:
    """An engine's answer as it comes (``engine.Sink``): read whole, or, a
    200 ``text/event-stream``, queued for the client as it arrives."""

    def __init__(self) -> None:
        self.headed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.streams = False
        self.parts: list[bytes] = []
        self.pieces: asyncio.Queue[bytes | EngineBroken | EngineUnreachable | None] = (
            asyncio.Queue()
        )

    def head(self, conn: Conn, status: int, headers: dict[str, str]) -> None:
        ctype = headers.get("content-type", "")
        self.streams = status == 200 and ctype.startswith("text/event-stream")
        if not self.headed.done():
            self.headed.set_result(None)

    def data(self, data: bytes) -> None:
        if self.streams:
            self.pieces.put_nowait(data)
        else:
            self.parts.append(data)

    def end(self, error: EngineUnreachable | EngineBroken | None) -> None:
        self.pieces.put_nowait(error)


def _stores_none(gw: GatewayView, model: str) -> bool:
    """Whether ``model``'s engine is known to keep no responses (vLLM without the store)."""
    get = getattr(gw.directory, "routing", None)
    routing = get(model) if get is not None else None
    return isinstance(routing, ModelRouting) and routing.stores_responses is False


def _not_stored(rid: str, model: str) -> web.Response:
    return _error(404, not_stored_message(rid, model), "response_not_stored")


def _count_background(
    gw: GatewayView, request: web.Request, home: Home, rid: str, data: bytes
) -> None:
    """A background response's usage, the first time the gateway sees it completed."""
    if home.counted:
        return
    try:
        obj = json.loads(data)
    except ValueError:
        return
    # Finished, however: completed, incomplete (vLLM's at max_output_tokens),
    # cancelled or failed, with what it used by then.
    if isinstance(obj, dict) and obj.get("status") not in (None, "queued", "in_progress"):
        _count(gw, request, home, rid, obj.get("usage"))


def _count(gw: GatewayView, request: web.Request, home: Home, rid: str, usage: Any) -> None:
    # Once: a retrieval since may have counted it already.
    if isinstance(usage, dict) and gw.responses.get(rid) == home:
        gw.responses.remember(rid, replace(home, counted=True))
        gw.record_usage(gw.authenticate(request)[0], home.model, "responses", usage)


async def _stream(
    request: web.Request, replay: _Replay, out: dict[str, str]
) -> web.StreamResponse:
    """A replayed background stream (``?stream=true``), passed through as it comes.

    Its usage is not read: vLLM replays only a response made with ``stream``,
    whose usage the gateway read as it made it."""
    resp = web.StreamResponse(
        headers={**out, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    while (piece := await replay.pieces.get()) is not None:
        if isinstance(piece, bytes):
            await resp.write(piece)
            continue
        # The answer began: an error event, not a second answer. vLLM 0.32
        # cuts the replay of a response not made streamed.
        cause = piece.cause if isinstance(piece, EngineBroken) else type(piece).__name__
        await resp.write(_cut_event(cause))
        break
    await resp.write_eof()
    return resp
