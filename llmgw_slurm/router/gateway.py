"""The gateway: its state, the request path's entry, and aiohttp's application.

One request path, for every OpenAI route (``server.ROUTES``), whole or
streamed, JSON or an upload; a newcomer can read it top to bottom:

    server.Connection  (HTTP/1.1 in, httptools)
      -> Gateway.serve        this module: the tally, the key, the body
      -> admit.Admission      the plan or the refusal (model, access, route, quota)
      -> forward.Exchange     replica (replicas: pick, hold), engine (engine: send,
                              read strictly), the answer back (sse for streams)
      -> account.Tally        metrics, usage, quota, span: once each

The rest of the gateway's routes (``/v1/models``, ``/metrics``, stored
responses, and the daemon's own: status, CLI, files, batches, login) are an
aiohttp application (:func:`create_app`), reached through ``appbridge``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from llmgw_slurm.accounting.quota import QuotaBook, Refusal, add_quota_headers
from llmgw_slurm.accounting.usage import UsageSink
from llmgw_slurm.auth.access import AccessGuard
from llmgw_slurm.auth.keys import REQUEST_KEY, KeyRecord, KeyRing, request_key
from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router import balance, stored, surface
from llmgw_slurm.router.account import Accounting, Tally
from llmgw_slurm.router.admit import Admission, Plan
from llmgw_slurm.router.answers import Reply, client_closed, error
from llmgw_slurm.router.directory import ModelDirectory
from llmgw_slurm.router.engine import EnginePool
from llmgw_slurm.router.forward import Client, Exchange
from llmgw_slurm.router.holdqueue import HoldQueue
from llmgw_slurm.router.metrics import GatewayMetrics
from llmgw_slurm.router.replicas import Replicas

__all__ = ["GATEWAY_KEY", "Gateway", "create_app", "request_key"]

log = logging.getLogger(__name__)


class Incoming(Client, Protocol):
    """A request as the server hands it over (``server.Request``)."""

    @property
    def endpoint(self) -> str | None: ...

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def body(self) -> bytearray: ...

    @property
    def stream(self) -> surface.Body | None:
        """An upload's body as it comes; None: read whole (``body``)."""

    @property
    def too_large(self) -> bool: ...


class Handling(Protocol):
    """What the server tells the handler of a request under way."""

    def client_gone(self) -> None: ...

    def client_paused(self) -> None: ...

    def client_resumed(self) -> None: ...


class _Before:
    """An answer waiting on a step before its exchange (an upload's model field, the
    database's word on a budget near its end): a task, then its exchange."""

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None

    def client_gone(self) -> None:
        if self.exchange is not None:
            self.exchange.client_gone()
        elif self.task is not None:
            self.task.cancel()

    def client_paused(self) -> None:
        if self.exchange is not None:
            self.exchange.client_paused()

    def client_resumed(self) -> None:
        if self.exchange is not None:
            self.exchange.client_resumed()


class Gateway:
    """The state of one gateway: its parts, each a module of its own."""

    def __init__(
        self, directory: ModelDirectory, config: RouterConfig, *, keys: KeyRing | None,
        usage: UsageSink | None, registry: CollectorRegistry, quota: QuotaBook | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.directory, self.config, self.keys, self.usage = directory, config, keys, usage
        self.quota = quota
        # The daemon's own provider's tracer, not the process's global one, as the
        # reconciler's: only the first global provider of a process counts.
        self.tracer = tracer or trace.get_tracer("llmgw_slurm")
        self.metrics = GatewayMetrics(directory, registry)
        self.access = AccessGuard(registry)
        self.responses = surface.ResponseHomes()
        self.admission = Admission(directory, keys, quota, self.access, self.responses)
        self.replicas = Replicas(directory, config, self.metrics, self.admission.routing)
        self.accounting = Accounting(self.metrics, usage, quota, self.responses, self.tracer,
                                     config.trace_requests == "all")
        self.pool = EnginePool(config.connect_timeout, config.read_timeout)
        # Whether a bearer token may see every series of /metrics (the daemon's
        # admin token, or router.metrics_token_file's); None: nobody.
        self.metrics_token: Callable[[str], bool] | None = None

    # what other parts of the daemon read

    @property
    def in_flight(self) -> dict[tuple[str, str], int]:
        return self.replicas.in_flight

    @property
    def holds(self) -> HoldQueue:
        return self.replicas.holds

    @property
    def held(self) -> dict[str, int]:
        """Requests waiting for each model to have a ready replica."""
        return self.replicas.holds.held

    @property
    def held_total(self) -> int:
        return self.replicas.holds.total

    @property
    def placements(self) -> dict[str, balance.Placement]:
        return self.replicas.placements

    def may_use(self, model: str, key: KeyRecord | None) -> bool:
        return self.admission.may_use(model, key)

    def visible_to(self, request: web.Request) -> Callable[[str], bool]:
        """The models the request's key (or no key) may use, for the routes that list them."""
        return self.admission.visible({"authorization": request.headers.get("Authorization", "")})

    def authenticate(self, request: web.Request) -> tuple[KeyRecord | None, web.Response | None]:
        """An aiohttp route's key (None without keys), or the 401 to answer with;
        :func:`request_key` gives the key later."""
        got = self.admission.key({"authorization": request.headers.get("Authorization", "")})
        if isinstance(got, Reply):
            return None, web.Response(status=got.status, body=got.body, headers=got.headers)
        if got is not None:
            request[REQUEST_KEY] = got
        return got, None

    def record_usage(self, key: KeyRecord | None, model: str, endpoint: str,
                     usage: dict[str, Any] | None) -> None:
        """Count an answer's tokens for its key (for other routes on the gateway app)."""
        self.accounting.record(key, model, endpoint, usage)

    # the request path

    def serve(self, req: Incoming) -> Handling | None:
        """Serve an OpenAI request (its body read whole, or ``req.stream``: an upload's)."""
        assert req.endpoint is not None
        tally = self.accounting.tally(req.endpoint, req.headers, req.method, req.path)
        key = self.admission.key(req.headers)
        if isinstance(key, Reply):
            self._refuse(req, tally, key)
            return None
        tally.key = key
        if req.stream is not None:
            return self._before(req, tally, self._upload_plan(req, key))
        if req.too_large:
            self._refuse(req, tally, self._too_large(self.config.max_body_bytes, "body"))
            return None
        plan = self.admission.json(key, req.endpoint, bytes(req.body))
        if isinstance(plan, Plan) and not self._agreed(plan):
            return self._before(req, tally, self._word(plan, None))
        return self._go(req, tally, plan)

    def _agreed(self, plan: Plan) -> bool:
        """Whether the plan's tokens are within what this gateway may hold without
        asking the others (always, on its own)."""
        return plan.hold is None or self.quota is None or self.quota.agreed(plan.hold)

    async def _word(
        self, plan: Plan | Reply, upload: surface.Upload | None
    ) -> tuple[Plan | Reply, surface.Upload | None]:
        """The plan once the other gateways agree there is room for it, or its 429."""
        if isinstance(plan, Reply) or self._agreed(plan):
            return plan, upload
        assert plan.hold is not None and self.quota is not None
        try:
            got = await self.quota.agree(plan.hold, plan.ask)
        except BaseException:
            plan.hold.release()  # the client left while the database was asked
            raise
        return (self.admission.refused(got) if isinstance(got, Refusal) else plan), upload

    def _before(
        self, req: Incoming, tally: Tally,
        step: Coroutine[Any, Any, tuple[Plan | Reply, surface.Upload | None] | Reply],
    ) -> _Before:
        handling = _Before()
        handling.task = asyncio.get_running_loop().create_task(
            self._then_go(req, tally, step, handling)
        )
        return handling

    async def _then_go(
        self, req: Incoming, tally: Tally,
        step: Coroutine[Any, Any, tuple[Plan | Reply, surface.Upload | None] | Reply],
        handling: _Before,
    ) -> None:
        try:
            got = await step
        except asyncio.CancelledError:
            tally.answered(499)
            raise
        except Exception:
            # A bug in a step: the client gets its 500, the daemon goes on.
            log.exception("the step before %s's exchange failed", req.path)
            req.crashed()
            tally.answered(500)
            return
        plan, upload = (got, None) if isinstance(got, Reply) else got
        if isinstance(plan, Reply):
            self._refuse(req, tally, plan)
            return
        handling.exchange = self._go(req, tally, plan, upload)

    def _go(self, req: Incoming, tally: Tally, plan: Plan | Reply,
            upload: surface.Upload | None = None) -> Exchange | None:
        if isinstance(plan, Reply):
            self._refuse(req, tally, plan)
            return None
        tally.model, tally.hold = plan.model, plan.hold
        tally.set("llmgw.model", plan.model)
        exchange = Exchange(self, req, plan, tally, upload)
        exchange.start()
        return exchange

    def _refuse(self, client: Client, tally: Tally, reply: Reply) -> None:
        """The request's answer is the gateway's own (a refusal)."""
        headers = reply.headers
        if self.quota is not None and tally.key is not None:
            # Every answer to a request with a valid key tells its limits.
            headers = {**self.quota.headers(tally.key), **headers}
        client.whole(reply.status, headers, reply.body)
        tally.answered(reply.status)
        client.finished()

    def _too_large(self, limit: int, what: str) -> Reply:
        return error(413, f"The request {what} is larger than {limit} bytes.",
                     "invalid_request_error", "request_too_large")

    async def _upload_plan(
        self, req: Incoming, key: KeyRecord | None
    ) -> tuple[Plan | Reply, surface.Upload | None] | Reply:
        assert req.stream is not None and req.endpoint is not None
        cfg, ctype = self.config, req.headers.get("content-type", "")
        boundary = surface.multipart_boundary(ctype)
        if boundary is None:
            return error(400, f"{req.path} takes multipart/form-data (a 'file' and a 'model' "
                         f"field); got {ctype or 'no Content-Type'}.", "invalid_request_error",
                         "invalid_content_type")
        if int(req.headers.get("content-length", "0")) > cfg.max_upload_bytes:
            return self._too_large(cfg.max_upload_bytes, "upload")
        try:
            field = await surface.read_model_field(req.stream, boundary, cfg.max_body_bytes,
                                                   cfg.body_timeout)
        except surface.UploadProblem as p:
            return error(p.status, str(p), "invalid_request_error", p.code)
        model = self.admission.model(field.model, key, req.endpoint)
        if isinstance(model, Reply):
            return model
        head = field.head if field.model == model else field.with_model(model)
        upload = surface.Upload(head, req.stream, cfg.max_upload_bytes, cfg.body_timeout)
        return await self._word(self.admission.let_in(Plan(req.endpoint, model, key, head)), upload)

    # aiohttp's routes

    async def _startup(self, app: web.Application) -> None:
        if self.usage is not None:
            self.usage.start()

    async def _cleanup(self, app: web.Application) -> None:
        self.pool.close()
        if self.usage is not None:
            await self.usage.close()

    async def models(self, request: web.Request) -> web.Response:
        key, denied = self.authenticate(request)
        if denied is not None:
            return denied
        data: list[dict[str, Any]] = []
        for m in self.directory.models():
            if not self.may_use(m.name, key):
                continue
            base = {"object": "model", "created": 0, "owned_by": "llmgw", "ready": m.ready}
            data.append({"id": m.name, **base, "aliases": list(m.aliases)})
            data.extend({"id": a, **base, "alias_for": m.name} for a in m.aliases)
        return web.json_response({"object": "list", "data": data})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        """Every series for the metrics token; otherwise those of the models the
        request's key (or no key) may use, and those that name no model."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        gate = self.metrics_token
        full = gate is not None and scheme.lower() == "bearer" and gate(token.strip())
        body = self.metrics.exposition(None if full else self.visible_to(request))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def instrumented(
        self, endpoint: str,
        inner: Callable[[web.Request, str, Tally], Awaitable[web.StreamResponse]],
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """A handler for another route on the gateway app with the request path's
        span and metrics (``inner`` sets ``tally.model`` once known)."""

        async def handler(request: web.Request) -> web.StreamResponse:
            headers = {k.lower(): v for k, v in request.headers.items()}
            tally = self.accounting.tally(endpoint, headers, request.method, request.path)
            status = 500
            try:
                resp = await inner(request, endpoint, tally)
                status = resp.status
                return resp
            except asyncio.CancelledError:
                status = client_closed().status
                raise
            finally:
                tally.answered(status)

        return handler


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Routing errors (unknown path, wrong method) in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or not request.path.startswith("/v1/"):
            raise
        code = "not_found" if e.status == 404 else "bad_request"
        got = error(e.status, f"{e.reason}: {request.method} {request.path}",
                    "invalid_request_error", code)
        return web.Response(status=got.status, body=got.body, headers=got.headers)


GATEWAY_KEY = web.AppKey("llmgw.gateway", Gateway)
_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


async def _not_here(request: web.Request) -> web.Response:
    got = error(500, "The gateway app is served by llmgw_slurm.router.server.Runner, "
                "whose request path answers this route.", "server_error",
                "misconfigured")
    return web.Response(status=got.status, body=got.body, headers=got.headers)


def create_app(
    directory: ModelDirectory, config: RouterConfig | None = None, *,
    keys: KeyRing | None = None, usage: UsageSink | None = None,
    registry: CollectorRegistry | None = None, quota: QuotaBook | None = None,
    tracer: trace.Tracer | None = None,
) -> web.Application:
    """The gateway as an aiohttp app, served by ``server.Runner``.

    ``keys``: None serves without keys (anyone who can reach the port may use
    it); otherwise every ``/v1`` request needs a key from the ring. ``usage``:
    where per-key token usage goes (started and closed with the app).
    ``registry``: the Prometheus registry for ``/metrics``; a new one when None.
    ``quota``: limits and budgets per key, user and account (with ``keys``).
    ``tracer``: where its spans go (default: the process's tracer provider).
    The daemon may add its own routes to the returned app before starting it;
    ``app[GATEWAY_KEY]`` is the :class:`Gateway`.
    """
    config = config or RouterConfig()
    gw = Gateway(directory, config, keys=keys, usage=usage, quota=quota, tracer=tracer,
                 registry=registry if registry is not None else CollectorRegistry())
    app = web.Application(client_max_size=max(config.max_body_bytes, 1),
                          middlewares=[_openai_errors])
    app[GATEWAY_KEY] = gw
    app.on_startup.append(gw._startup)
    app.on_cleanup.append(gw._cleanup)
    app.router.add_get("/v1/models", gw.models)
    # The request path's own (server.ROUTES): here so that another method is a 405.
    for route in (*_PATHS, *(p for r in surface.ROUTES for p in r.paths)):
        app.router.add_post(route, _not_here)
    for method, path, action in stored.ROUTES:
        app.router.add_route(method, path, gw.instrumented("responses", stored.handler(gw, action)))
    app.router.add_get("/metrics", gw.metrics_handler)
    if quota is not None:
        add_quota_headers(app, quota)
    return app
