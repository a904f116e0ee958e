"""``/v1/files`` and ``/v1/batches`` on the gateway, and the batch jobs' report route.

Shapes follow OpenAI's API so that the official ``openai`` client works
unchanged (``files.create``, ``batches.create``, ``retrieve``, ``list``,
``cancel``, ``files.content``). Errors use the gateway's OpenAI error body.

Who owns what: :func:`owner_of` is the one place that says which identity
owns a file or a batch; every lookup goes through it, and another owner's
object is a 404, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

from llmgw_slurm.auth.keys import KeyRecord
from llmgw_slurm.auth.secrets import batch_secret
from llmgw_slurm.batch.model import BatchRecord, FileRecord
from llmgw_slurm.batch.service import BatchRefused, BatchService
from llmgw_slurm.guard.faults import Faults
from llmgw_slurm.reconciler.reportroute import report_route
from llmgw_slurm.router.gateway import GATEWAY_KEY, Gateway

__all__ = ["BATCH_KEY", "add_batch_routes", "add_internal_routes", "owner_of"]

BATCH_KEY = web.AppKey("llmgw.batch", BatchService)

# The most a client may say about a file besides its bytes (the purpose field,
# the multipart headers).
_FORM_SLACK = 64 * 1024
_CHUNK = 1024 * 1024


def owner_of(key: KeyRecord | None) -> str:
    """The identity that owns the files and batches made with ``key``.

    Today the key's user (keys off: one anonymous owner, ""). When keys carry
    more (a per-user key store), this is the one line to change.
    """
    return key.user if key is not None else ""


def allowed_model(gw: Gateway, key: KeyRecord | None) -> Callable[[str], str | None]:
    """The catalog model a batch line's ``model`` names, if ``key`` may use it (None if not).

    The catalog's access rules, as for online requests: a model the key may not
    use reads as an unknown one (``model_not_found`` on its line).
    """

    def resolve(name: str) -> str | None:
        model = gw.directory.resolve(name)
        return model if model is not None and gw.may_use(model, key) else None

    return resolve


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        type_ = "rate_limit_error"  # as the gateway's own 429s
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key (None with keys off) and the owner it stands for."""

    key: KeyRecord | None
    owner: str


Handler = Callable[[web.Request, BatchService, Caller], Awaitable[web.StreamResponse]]


def _keyed(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        gw = request.app[GATEWAY_KEY]
        key, denied = gw.authenticate(request)
        if denied is not None:
            return denied
        try:
            return await handler(request, request.app[BATCH_KEY], Caller(key, owner_of(key)))
        except BatchRefused as err:
            return _error(err.status, str(err), err.code, err.param)

    return wrapped


def _page(items: list[dict[str, Any]], request: web.Request) -> dict[str, Any]:
    """OpenAI's cursor page: ``after`` an id, at most ``limit`` (1-10000, default 20)."""
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise BatchRefused(400, "invalid_value", "limit must be a number", "limit") from None
    if not 1 <= limit <= 10000:
        raise BatchRefused(400, "invalid_value", "limit must be between 1 and 10000", "limit")
    after = request.query.get("after")
    if after:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


# ---- files --------------------------------------------------------------------------


async def _upload(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    limit = svc.server.batch.max_file_bytes
    if (request.content_length or 0) > limit + _FORM_SLACK:
        raise BatchRefused(
            413, "file_too_large", f"The file is larger than {limit} bytes, the most allowed."
        )
    if not request.content_type.startswith("multipart/"):
        raise BatchRefused(
            400,
            "invalid_request",
            "Send the file as multipart/form-data with 'file' and 'purpose'.",
        )
    reader = await request.multipart()
    purpose: str | None = None
    staged = None
    filename = ""
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read_chunk(256)).decode("utf-8", "replace").strip()
            elif part.name == "file" and staged is None:
                filename = part.filename or ""
                staged = svc.store.new_upload()
                await _stream_to(part, staged, limit)
        if purpose != "batch":
            raise BatchRefused(
                400,
                "invalid_value",
                f"purpose {purpose!r} is not supported here; valid: 'batch'",
                "purpose",
            )
        if staged is None:
            raise BatchRefused(400, "missing_required_parameter", "No 'file' part.", "file")
        rec = svc.store.add_file(who.owner, filename, purpose, staged)
        staged = None
    finally:
        if staged is not None:
            staged.unlink(missing_ok=True)
    # Written where every daemon reads (several on one database) before the answer.
    await svc.store.synced()
    return web.json_response(rec.to_api())


async def _stream_to(part: BodyPartReader, path: os.PathLike[str], limit: int) -> None:
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while chunk := await part.read_chunk(_CHUNK):
            written += len(chunk)
            if written > limit:
                raise BatchRefused(
                    413,
                    "file_too_large",
                    f"The file is larger than {limit} bytes, the most allowed.",
                )
            await asyncio.to_thread(os.write, fd, chunk)
    finally:
        os.close(fd)


def _file_or_404(svc: BatchService, owner: str, file_id: str) -> FileRecord:
    rec = svc.store.file(owner, file_id)
    if rec is None:
        raise BatchRefused(404, "not_found", f"No file with id {file_id!r}.", "file_id")
    return rec


async def _list_files(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    files = sorted(
        svc.store.files(who.owner, request.query.get("purpose")),
        key=lambda f: (f.created_at, f.id),
        reverse=True,
    )
    return web.json_response(_page([f.to_api() for f in files], request))


async def _get_file(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    return web.json_response(_file_or_404(svc, who.owner, request.match_info["file_id"]).to_api())


async def _file_content(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    rec = _file_or_404(svc, who.owner, request.match_info["file_id"])
    path = svc.store.data_path(rec.id)
    # In pieces, not aiohttp's FileResponse: its sendfile needs a socket, and
    # the gateway's connections reach aiohttp through the gateway's own server.
    resp = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
    resp.content_length = path.stat().st_size
    await resp.prepare(request)
    with path.open("rb") as f:
        while piece := await asyncio.to_thread(f.read, _CHUNK):
            await resp.write(piece)
    await resp.write_eof()
    return resp


async def _delete_file(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    rec = _file_or_404(svc, who.owner, request.match_info["file_id"])
    busy = [b.id for b in svc.store.unfinished() if b.input_file_id == rec.id]
    if busy:
        raise BatchRefused(
            409,
            "file_in_use",
            f"File {rec.id} is the input of running batch {busy[0]}; cancel it first.",
        )
    svc.store.delete_file(who.owner, rec.id)
    await svc.store.synced()
    return web.json_response({"id": rec.id, "object": "file", "deleted": True})


# ---- batches ------------------------------------------------------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (ValueError, RecursionError):
        raise BatchRefused(400, "invalid_json", "The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BatchRefused(400, "invalid_body", "The body must be a JSON object.")
    return body


def _string(body: dict[str, Any], name: str, default: str | None = None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or not value:
        raise BatchRefused(400, "missing_required_parameter", f"'{name}' must be a string.", name)
    return value


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    meta = body.get("metadata") or {}
    ok = (
        isinstance(meta, dict)
        and len(meta) <= 16
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in meta.items()
        )
    )
    if not ok:
        raise BatchRefused(
            400,
            "invalid_value",
            "metadata must be at most 16 string pairs "
            "(keys up to 64, values up to 512 characters).",
            "metadata",
        )
    return dict(meta)


async def _create_batch(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    body = await _json_body(request)
    gw = request.app[GATEWAY_KEY]
    batch = await svc.create(
        who.owner,
        _string(body, "input_file_id"),
        _string(body, "endpoint"),
        _string(body, "completion_window", "24h"),
        _metadata(body),
        allowed_model(gw, who.key),
        (who.key.key_id, who.key.project) if who.key is not None else ("", ""),
    )
    await svc.store.synced()
    return web.json_response(batch.to_api())


def _batch_or_404(svc: BatchService, owner: str, batch_id: str) -> BatchRecord:
    rec = svc.store.batch(owner, batch_id)
    if rec is None:
        raise BatchRefused(404, "not_found", f"No batch with id {batch_id!r}.", "batch_id")
    return rec


async def _get_batch(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    return web.json_response(_batch_or_404(svc, who.owner, request.match_info["batch_id"]).to_api())


async def _list_batches(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    return web.json_response(_page([b.to_api() for b in svc.store.batches(who.owner)], request))


async def _cancel_batch(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    batch = await svc.cancel(who.owner, request.match_info["batch_id"])
    await svc.store.synced()
    return web.json_response(batch.to_api())


async def _delete_batch(request: web.Request, svc: BatchService, who: Caller) -> web.StreamResponse:
    """Not OpenAI's (its batches stay listed for ever): a finished batch leaves the list,
    with the output and error files it wrote."""
    batch = _batch_or_404(svc, who.owner, request.match_info["batch_id"])
    if not batch.status.is_final:
        raise BatchRefused(
            409,
            "invalid_state",
            f"Batch {batch.id} is {batch.status.value}; cancel it first "
            "(POST /v1/batches/ID/cancel, llmgw batch cancel).",
        )
    svc.store.delete_batch(who.owner, batch.id)
    return web.json_response({"id": batch.id, "object": "batch", "deleted": True})


def add_batch_routes(app: web.Application, svc: BatchService) -> None:
    """The Batch API on the gateway app (made by ``router.create_app``), and its poll task."""
    app[BATCH_KEY] = svc
    app.router.add_post("/v1/files", _keyed(_upload))
    app.router.add_get("/v1/files", _keyed(_list_files))
    app.router.add_get("/v1/files/{file_id}", _keyed(_get_file))
    app.router.add_delete("/v1/files/{file_id}", _keyed(_delete_file))
    app.router.add_get("/v1/files/{file_id}/content", _keyed(_file_content))
    app.router.add_post("/v1/batches", _keyed(_create_batch))
    app.router.add_get("/v1/batches", _keyed(_list_batches))
    app.router.add_get("/v1/batches/{batch_id}", _keyed(_get_batch))
    app.router.add_post("/v1/batches/{batch_id}/cancel", _keyed(_cancel_batch))
    app.router.add_delete("/v1/batches/{batch_id}", _keyed(_delete_batch))
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start(_: web.Application) -> None:
        stop.clear()
        tasks.append(asyncio.create_task(svc.run(stop)))

    async def end(_: web.Application) -> None:
        stop.set()
        for t in tasks:
            await t
        tasks.clear()

    app.on_startup.append(start)
    app.on_cleanup.append(end)


def add_internal_routes(app: web.Application, svc: BatchService, faults: Faults) -> None:
    """The route batch jobs report their progress to (signed, as replicas' agents do;
    answered signed, as replicas' agents are)."""
    report = report_route(
        "bid", svc.report, lambda bid: batch_secret(svc.verifier.server_key, bid), faults
    )
    app.router.add_post("/internal/v1/batches/{bid:batch_[0-9a-f]{24}}/report", report)
