"""The OpenAI-compatible gateway: an aiohttp app that routes requests to replicas.

What it does per request, in order: check the gateway key (401), read the
body within the size limit (413), parse it (400), resolve the model or alias
(404), pick the ready replica with the fewest requests in flight or hold the
request until the model has one (429 past the cap, 503 past the deadline),
send the body on with the replica's own engine key, and pass the answer back
chunk by chunk. Token usage from the engine's ``usage`` fields is recorded per
key.

Run it with ``handler_cancellation=True`` on the ``AppRunner`` (or
``web.run_app``): then a client that goes away cancels its handler at once.
A held request stops waiting; a stream's answer is read on from the engine,
within ``drain_after_disconnect``, so that its usage is counted, and then
the engine's connection closes (which stops a generation past the bound).
Without it, held requests still notice within ``disconnect_poll`` and
streams at their next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol, cast

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw_slurm.access import AccessGuard
from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router import balance, stored, surface
from llmgw_slurm.router._body import with_fields
from llmgw_slurm.router.directory import Endpoint, ModelDirectory, ModelRouting
from llmgw_slurm.router.keys import REQUEST_KEY, KeyRecord, KeyRing, request_key
from llmgw_slurm.router.metrics import GatewayMetrics
from llmgw_slurm.router.quota import (
    NOTHING,
    QUOTA_HEADERS,
    Ask,
    QuotaBook,
    Refusal,
    Reservation,
    add_quota_headers,
    ask_of,
)
from llmgw_slurm.router.relay import LaneSink, StreamClient, _Call, _Pipe, _SseRelay
from llmgw_slurm.router.upstream import (
    Answer,
    Conn,
    UpstreamBroken,
    UpstreamPool,
    UpstreamUnreachable,
)
from llmgw_slurm.router.usage import UsageRecord, UsageSink

__all__ = ["GATEWAY_KEY", "Client", "Deliver", "Gateway", "LanePlan", "create_app", "request_key"]

log = logging.getLogger(__name__)


def _error(
    status: int,
    message: str,
    type_: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _answer_headers(ep: Endpoint, engine: Mapping[str, str]) -> dict[str, str]:
    """The headers every answer from an engine carries: which replica, and the
    engine's request id if it gave one."""
    out = {"X-Llmgw-Replica": ep.replica_id}
    if "X-Request-Id" in engine:
        out["X-Request-Id"] = engine["X-Request-Id"]
    return out


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _parse_body(raw: bytes) -> dict[str, Any] | web.Response:
    """The body as a JSON object with a model name in it, or the 400 that says what is wrong."""
    try:
        # UTF-8 only, as OpenAI's API has it (json.loads would also take
        # UTF-16, which the splicing in with_fields does not handle).
        obj = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        return _error(
            400, f"The body is not valid JSON: {e}", "invalid_request_error", "invalid_json"
        )
    except RecursionError:
        # A few kilobytes of "[[[[..." exhaust the parser's stack.
        return _error(
            400,
            "The body's JSON is nested too deeply.",
            "invalid_request_error",
            "invalid_json",
        )
    if not isinstance(obj, dict):
        return _error(
            400, "The body must be a JSON object.", "invalid_request_error", "invalid_body"
        )
    name = obj.get("model")
    if not isinstance(name, str) or not name:
        return _error(
            400,
            "The 'model' field is missing; GET /v1/models lists the models.",
            "invalid_request_error",
            "missing_model",
        )
    return obj


def _upstream_body(
    raw: bytes, obj: dict[str, Any], model: str, endpoint: str
) -> tuple[bytes, bool, bool] | web.Response:
    """The body for the engine, whether it streams, whether to drop the usage chunk.

    The model's own name replaces an alias; a stream asks for usage so that
    it can be counted, and the usage-only chunk the client did not ask for is
    taken out again on the way back.
    """
    fields: dict[str, Any] = {}
    if obj["model"] != model:
        fields["model"] = model
    if obj.get("stream") is not None and not isinstance(obj.get("stream"), bool):
        # Engines read "yes" or 1 as true and would stream without the usage the
        # gateway asks for when it sees a stream coming: tokens nobody counts.
        return _error(
            400,
            "'stream' must be true or false.",
            "invalid_request_error",
            "invalid_type",
        )
    stream = obj.get("stream") is True
    strip_usage = False
    if stream and endpoint in surface.STREAM_USAGE_ENDPOINTS:
        so = obj.get("stream_options")
        if so is None or (isinstance(so, dict) and so.get("include_usage") is not True):
            fields["stream_options"] = {**(so or {}), "include_usage": True}
            strip_usage = True
    return (with_fields(raw, fields) if fields else raw), stream, strip_usage


class Client(Protocol):
    """What the whole-answer path needs of a client's request: aiohttp's
    ``web.Request``, or the fast lane's (``router.fastlane``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def transport(self) -> asyncio.BaseTransport | None: ...


# What sends a whole answer to the client, the answer once sent.
Deliver = Callable[[web.Response], Awaitable[web.Response]]


class LanePlan(NamedTuple):
    """A request the fast lane serves: checked, its replica picked, nothing spent yet.

    (A tuple: made once a request, and a frozen dataclass's __init__ costs
    several times a tuple's.)"""

    endpoint: str
    model: str
    key: KeyRecord | None
    ep: Endpoint
    body: bytes
    t0: float
    stream: bool = False
    strip_usage: bool = False  # the usage chunk the gateway asked for, not the client
    # The most it may spend, for the quotas (NOTHING without them).
    ask: Ask = NOTHING
    # Once let in: what the quotas hold for it, and the x-ratelimit-* headers
    # of its answer, as the limits stood then.
    hold: Reservation | None = None
    quota: Mapping[str, str] | None = None


class Whole(NamedTuple):
    """An engine's whole answer as the client gets it, before (or without) a
    ``web.Response``: the fast lane writes it as it is, and an aiohttp
    ``Response``'s making costs more than the rest of the answer's handling."""

    status: int
    headers: dict[str, str]
    body: bytes
    keep_alive: bool = True


class LaneClient(Client, StreamClient, Protocol):
    """What the fast lane's connection (``router.fastlane``) offers the gateway
    for a request it planned."""

    def answer(self, resp: web.Response | Whole, then: Callable[[], None] | None = None) -> None:
        """Send ``resp``: the request's answer, whichever it is; ``then`` once it is
        written, before the connection's next request is taken."""

    def fall_back(self, plan: LanePlan, failed: BaseException | None) -> None:
        """Serve the request with :meth:`Gateway.serve_lane`, in a task:
        ``failed``, how a try already made ended."""

    def crashed(self, plan: LanePlan) -> None:
        """Serving the request raised (a bug): answer 500, or close."""


class LaneCall:
    """A lane request under way on a kept-alive connection to its engine,
    answered from the connection's own callback (:meth:`Gateway.lane_send`)."""

    __slots__ = ("_got", "_gw", "_lane", "_plan", "conn")

    def __init__(self, gw: Gateway, plan: LanePlan, lane: LaneClient) -> None:
        self._gw, self._plan, self._lane = gw, plan, lane
        self.conn: Conn | None = None  # once sent
        self._got: Answer | None = None  # the answer, until it is counted

    def sent(self) -> None:
        """The request went to the engine: what its answer will need is worked
        out while the engine works on it, not between its answer and the client."""
        self._gw._request_started(self._plan.model, self._plan.ep.replica_id)

    def done(self, result: Answer | BaseException) -> None:
        """The engine's answer, or why there is none (see upstream.Conn)."""
        gw, plan = self._gw, self._plan
        if isinstance(result, Answer):
            self._answer(result)
            return
        gw._request_ended(plan.model, plan.ep.replica_id)
        if isinstance(result, UpstreamUnreachable) and not result.timed_out:
            # The engine closed the kept-alive connection as it was reused, and
            # took nothing: another connection, as UpstreamPool.post would.
            self._lane.fall_back(plan, None)
        else:
            # Handled as _forward handles its own try's end: another replica,
            # or the error's answer.
            self._lane.fall_back(plan, result)

    def _answer(self, got: Answer) -> None:
        gw, plan = self._gw, self._plan
        self._got = got
        # Nothing raised here may reach the engine connection's data_received:
        # it would cut that connection and leave the client unanswered.
        try:
            resp = gw._whole_answer(got.status, got.headers, got.body, plan.ep, plan.model)
            gw._lane_deliver(plan, self._lane, resp, time.monotonic(), self._settle)
        except Exception:
            self._lane.crashed(plan)
        self._settle()

    def _settle(self) -> None:
        """The request's end and its usage, once its answer is written (its
        client waits for none of this) and before the connection's next request
        is taken (which this request's tokens may bring over a limit)."""
        got, self._got = self._got, None
        if got is None:
            return  # settled already
        gw, plan = self._gw, self._plan
        gw._request_ended(plan.model, plan.ep.replica_id)
        try:
            gw._count_answer(
                got.status, got.headers, got.body, plan.ep, plan.endpoint, plan.model, plan.key,
                plan.hold,
            )  # fmt: skip
        except Exception:
            log.exception("counting the usage of an answer of %s failed", plan.model)
        finally:
            if plan.hold is not None:
                plan.hold.release()  # an answer without usage

    def cancel(self) -> None:
        """The client went away: as for a cancelled :meth:`Gateway._forward`,
        the engine's connection is cut (which stops its generation)."""
        assert self.conn is not None
        self.conn.abandon()
        plan = self._plan
        if plan.hold is not None:
            plan.hold.release()
        self._gw._request_ended(plan.model, plan.ep.replica_id)
        self._gw.metrics.answered_since(plan.model, 499, plan.t0, None)


def _carry_limits(quota: Mapping[str, str] | None, resp: web.Response | Whole) -> None:
    """Put a lane request's rate-limit headers on its answer: what add_quota_headers
    does for aiohttp's answers as they are prepared."""
    if quota is not None:
        resp.headers.update(quota)


def _response_of(got: Whole | web.Response) -> web.Response:
    """An answer as aiohttp's path sends it."""
    if isinstance(got, web.Response):
        return got
    return web.Response(status=got.status, body=got.body, headers=got.headers)


def _client_gone(request: Client) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


_TOKEN_FIELDS = frozenset(
    {"prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens"}
)
# A model the directory says nothing about: every endpoint, least outstanding.
_ANY_ROUTING = ModelRouting()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Gateway:
    """The state of one gateway app: in-flight counts, held requests, the HTTP client."""

    def __init__(
        self,
        directory: ModelDirectory,
        config: RouterConfig,
        *,
        keys: KeyRing | None,
        usage: UsageSink | None,
        registry: CollectorRegistry,
        quota: QuotaBook | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.directory = directory
        self.quota = quota
        # The daemon's own provider's tracer, not the process's global one, as the
        # reconciler's: only the first global provider of a process counts.
        self.tracer = tracer or trace.get_tracer("llmgw_slurm")
        self.config = config
        self.keys = keys
        self.usage = usage
        self.metrics = GatewayMetrics(directory, registry)
        self.access = AccessGuard(registry)
        self.in_flight: dict[tuple[str, str], int] = {}
        self.held: dict[str, int] = {}
        self.held_total = 0
        self.held_by_key: dict[tuple[str, str], int] = {}
        self._cold_since: dict[str, float] = {}
        self._rr = 0
        self._session: aiohttp.ClientSession | None = None
        # Answers read whole (no stream, no upload): a leaner client than aiohttp's.
        self._whole: UpstreamPool | None = None
        self.responses = surface.ResponseHomes()
        # Per model under policy prefix: which replica each active key lives on.
        self.placements: dict[str, balance.Placement] = {}

    # lifecycle

    async def _startup(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            # No pool limit: the engines' own queues are where requests
            # should wait, not a connection pool in front of them.
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.config.connect_timeout,
                sock_read=self.config.read_timeout,
            ),
            auto_decompress=False,
        )
        self._whole = UpstreamPool(self.config.connect_timeout, self.config.read_timeout)
        if self.usage is not None:
            self.usage.start()

    async def _cleanup(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        if self._whole is not None:
            self._whole.close()
        if self.usage is not None:
            await self.usage.close()

    # helpers

    def authenticate(self, request: web.Request) -> tuple[KeyRecord | None, web.Response | None]:
        """The request's key (None without keys), or the 401 to answer with; for
        other routes on the gateway app. :func:`request_key` gives the key later."""
        return self._authenticate(request)

    def _authenticate(self, request: web.Request) -> tuple[KeyRecord | None, web.Response | None]:
        if self.keys is None:
            return None, None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, _error(
                401,
                "No API key: send 'Authorization: Bearer <key>' (ask the admin for a key).",
                "authentication_error",
                "missing_api_key",
            )
        rec = self.keys.lookup(token.strip())
        if rec is None:
            return None, _error(
                401,
                "The API key is not valid or was revoked.",
                "authentication_error",
                "invalid_api_key",
            )
        request[REQUEST_KEY] = rec
        return rec, None

    def _too_large(self) -> web.Response:
        return _error(
            413,
            f"The request body is larger than {self.config.max_body_bytes} bytes.",
            "invalid_request_error",
            "request_too_large",
        )

    def may_use(self, model: str, key: KeyRecord | None) -> bool:
        """Whether ``key`` may use ``model`` by the catalog's access rules (a
        directory may have none: everyone)."""
        rules = getattr(self.directory, "access", None)
        return rules is None or self.access.allows(rules(model), key)

    def visible_to(self, request: web.Request) -> Callable[[str], bool]:
        """The models the request's key (or no key) may use, for the routes that list
        or chart models: a model hidden from it is left out, as if it did not exist."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        key = self.keys.lookup(token) if self.keys is not None and token else None
        return lambda model: self.may_use(model, key)

    def _model_for(self, name: str, key: KeyRecord | None) -> str | web.Response:
        """The catalog name of the model a request names, or its 404: a model the key may
        not use is answered as an unknown one, so that nobody learns what exists."""
        model = self.directory.resolve(name)
        if model is not None and not self.may_use(model, key):
            self.access.refused(model, key)
            model = None
        if model is None:
            return _error(
                404,
                f"The model '{name}' does not exist. Known models: {self._known_names(key)}.",
                "invalid_request_error",
                "model_not_found",
            )
        return model

    def _ask(self, obj: dict[str, Any], endpoint: str, model: str, key: KeyRecord | None) -> Ask:
        """The most a request may spend, for the quotas (NOTHING without them)."""
        if self.quota is None or key is None:
            return NOTHING
        context = self._routing(model).context_length
        return ask_of(obj, endpoint, context, self.quota.config.default_max_tokens)

    def _admit(
        self, key: KeyRecord | None, ask: Ask, call: _Call, request: web.Request | None = None
    ) -> web.Response | None:
        """The key's quota's 429, or None: let in (or no quotas), what it may spend
        held in ``call.hold`` until it ends, and ``request``'s answer to carry the
        rate-limit headers as the limits stood then (add_quota_headers)."""
        held = self._reserve(key, ask)
        if isinstance(held, web.Response):
            return held
        call.hold = held
        if held is not None and request is not None:
            request[QUOTA_HEADERS] = dict(held.headers)
        return None

    def _reserve(self, key: KeyRecord | None, ask: Ask) -> Reservation | web.Response | None:
        if self.quota is None or key is None:
            return None
        got = self.quota.reserve(key, ask)
        return got.response() if isinstance(got, Refusal) else got

    def _known_names(self, key: KeyRecord | None) -> str:
        parts = []
        for m in self.directory.models():
            if not self.may_use(m.name, key):
                continue
            parts.append(m.name + (f" (aliases: {', '.join(m.aliases)})" if m.aliases else ""))
        return "; ".join(parts) or "none"

    def _pick(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        unreachable: frozenset[tuple[str, str, int]] = frozenset(),
    ) -> Endpoint | None:
        ready = [e for e in self.directory.endpoints(model) if not e.draining]
        eps = [e for e in ready if e.replica_id not in exclude and e.identity not in unreachable]
        if not eps:
            return None
        key = balance.REQUEST_KEY.get()
        if key is not None:
            routing = self._routing(model)
            if routing.policy == "prefix":
                # The key is placed among every ready replica, not only those
                # left for this try: a retry elsewhere must not move it.
                home = self._placement(model, routing).place([e.replica_id for e in ready], key)
                ids = [e.replica_id for e in eps]
                counts = [self.in_flight.get((model, i), 0) for i in ids]
                return eps[balance.choose(ids, counts, key, routing.load_factor, home)]
        if len(eps) == 1:
            return eps[0]  # most models, most of the time: nothing to weigh
        counts = [self.in_flight.get((model, e.replica_id), 0) for e in eps]
        least = min(counts)
        ties = [e for e, c in zip(eps, counts, strict=True) if c == least]
        # Rotate among ties so that an idle model's replicas share the load.
        self._rr += 1
        return ties[self._rr % len(ties)]

    def _placement(self, model: str, routing: ModelRouting) -> balance.Placement:
        placement = self.placements.get(model)
        if placement is None or placement.key_factor != routing.key_factor:
            placement = self.placements[model] = balance.Placement(routing.key_factor)
        return placement

    def _routing(self, model: str) -> ModelRouting:
        get = getattr(self.directory, "routing", None)
        routing = get(model) if get is not None else None
        return routing if isinstance(routing, ModelRouting) else _ANY_ROUTING

    def _route(self, model: str, endpoint: str, obj: dict[str, Any] | None) -> web.Response | None:
        """The 400 for an endpoint the model does not serve; else set up its replica choice."""
        routing = self._routing(model)
        if routing.endpoints is not None and endpoint not in routing.endpoints:
            served = ", ".join(sorted(routing.endpoints)) or "none"
            return _error(
                400,
                f"Model '{model}' does not serve {endpoint} (it serves: {served}).",
                "invalid_request_error",
                "endpoint_not_served",
            )
        # Set on every request, None included: aiohttp gives each request a task
        # (a context) of its own today, and a key left over from another model's
        # request must never steer this one if that changes.
        key = None
        if routing.policy == "prefix" and obj is not None:
            key = balance.prefix_key(obj, routing.prefix_chars)
        balance.REQUEST_KEY.set(key)
        return None

    def _pinned(
        self, model: str, obj: dict[str, Any], key: KeyRecord | None
    ) -> Endpoint | web.Response | None:
        """The replica holding ``previous_response_id``, or the 400 saying it cannot be had."""
        prev = obj.get("previous_response_id")
        if not isinstance(prev, str):
            return None
        home = self.responses.get(prev)
        # Another key's response reads as one never seen: ids tell nothing.
        if home is None or home.owner != (key.key_id if key is not None else ""):
            return _error(
                400,
                f"Previous response '{prev}' is not known to this gateway: it was not "
                "made through it, or before its last restart. Send the whole conversation "
                "as input instead.",
                "invalid_request_error",
                "previous_response_not_found",
            )
        if home.model != model:
            return _error(
                400,
                f"Previous response '{prev}' was made by model '{home.model}', not '{model}'.",
                "invalid_request_error",
                "previous_response_other_model",
            )
        for e in self.directory.endpoints(model):
            if e.replica_id == home.replica_id and e.epoch == home.epoch:
                return e
        return _error(
            400,
            f"Previous response '{prev}' was held by replica {home.replica_id} of model "
            f"'{model}', which has stopped since, and its stored responses with it. Send "
            "the whole conversation as input instead.",
            "invalid_request_error",
            "previous_response_gone",
        )

    def _hold_timeout(self, model: str) -> float:
        for m in self.directory.models():
            if m.name == model and m.hold_timeout_s is not None:
                return m.hold_timeout_s
        return self.config.hold_timeout

    def _link_cold_start(self, model: str, linked: set[int]) -> None:
        # A held request links to the start span of the replica it waits for, so
        # that a slow request leads to the trace that says where the time went.
        # The directory may not offer it (the method is optional), and the start
        # span exists only once the reconciler's pass has placed the replica.
        get = getattr(self.directory, "start_span_context", None)
        if get is None:
            return
        sc = get(model)
        if not isinstance(sc, trace.SpanContext) or not sc.is_valid or sc.span_id in linked:
            return
        linked.add(sc.span_id)
        trace.get_current_span().add_link(sc, {"llmgw.link": "replica.start"})

    def _per_key_cap(self) -> int:
        cap = self.config.max_held_per_key
        return cap if cap is not None else max(1, self.config.max_held // 4)

    def _hold_refused(self, model: str, mine: tuple[str, str] | None) -> web.Response | None:
        """A 429 when the hold queue (the model's, all models', or this key's) is full."""
        cfg = self.config
        if self.held.get(model, 0) >= cfg.max_held or self.held_total >= cfg.max_held_total:
            return _error(
                429,
                f"Too many requests are waiting for model '{model}' to start; try again later.",
                "rate_limit_error",
                "too_many_held_requests",
            )
        if mine is not None and self.held_by_key.get(mine, 0) >= self._per_key_cap():
            return _error(
                429,
                f"Your key has {self.held_by_key[mine]} requests waiting for model '{model}' "
                "to start, the most one key may; try again when it is ready.",
                "rate_limit_error",
                "too_many_held_requests_for_key",
                headers={"Retry-After": str(cfg.retry_after)},
            )
        return None

    async def _hold(
        self,
        request: Client,
        model: str,
        unreachable: frozenset[tuple[str, str, int]] = frozenset(),
        key: KeyRecord | None = None,
    ) -> Endpoint | web.Response:
        cfg = self.config
        mine = (model, key.key_id) if key is not None else None
        refused = self._hold_refused(model, mine)
        if refused is not None:
            return refused
        if mine is not None:
            self.held_by_key[mine] = self.held_by_key.get(mine, 0) + 1
        loop = asyncio.get_running_loop()
        timeout = self._hold_timeout(model)
        deadline = loop.time() + timeout
        self.held[model] = self.held.get(model, 0) + 1
        self.held_total += 1
        self.metrics.held.labels(model).inc()
        self._cold_since.setdefault(model, time.monotonic())
        self.directory.want(model)
        waiter: asyncio.Future[None] = asyncio.ensure_future(self.directory.wait_ready(model))
        linked: set[int] = set()
        try:
            while True:
                self._link_cold_start(model, linked)
                ep = self._pick(model, unreachable=unreachable)
                if ep is not None:
                    began = self._cold_since.pop(model, None)
                    if began is not None:
                        self.metrics.cold_start.labels(model).observe(time.monotonic() - began)
                    return ep
                if _client_gone(request):
                    return _error(
                        499, "Client closed the request.", "client_closed", "client_closed"
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return _error(
                        503,
                        f"Model '{model}' has no ready replica after waiting {timeout:g} s; "
                        "it is starting, try again later.",
                        "server_error",
                        "model_not_ready",
                        headers={"Retry-After": str(cfg.retry_after)},
                    )
                step = min(remaining, cfg.disconnect_poll)
                if waiter.done():
                    waiter.result()  # a broken directory raises here
                    # Ready was signalled, yet nothing can be picked (the
                    # replica drained since): wait for the next change,
                    # without spinning.
                    await asyncio.sleep(step)
                    waiter = asyncio.ensure_future(self.directory.wait_ready(model))
                else:
                    await asyncio.wait({waiter}, timeout=step)
        finally:
            waiter.cancel()
            if mine is not None:
                self.held_by_key[mine] -= 1
                if not self.held_by_key[mine]:
                    del self.held_by_key[mine]
            self.held[model] -= 1
            self.held_total -= 1
            self.metrics.held.labels(model).dec()
            if self.held[model] == 0:
                # Nobody is waiting any more: a later start is a new cold start.
                self._cold_since.pop(model, None)

    def _record_usage(
        self, key: KeyRecord | None, model: str, endpoint: str, usage: dict[str, Any] | None,
        hold: Reservation | None = None,
    ) -> None:  # fmt: skip
        if usage is None or not _TOKEN_FIELDS.intersection(usage):
            # A transcription's usage is in seconds of audio: no tokens to count.
            return
        # The Responses API says input/output where the others say prompt/completion.
        prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = _int(usage.get("completion_tokens", usage.get("output_tokens")))
        total = _int(usage.get("total_tokens")) or prompt + completion
        self.metrics.counted(model, prompt, completion)
        if hold is not None and not hold.ended:
            hold.settle(total)
        elif self.quota is not None and key is not None:
            self.quota.spent(key, total)
        if self.usage is None:
            return
        self.usage.record(
            UsageRecord(
                ts=time.time(),
                key_id=key.key_id if key else "",
                user=key.user if key else "",
                project=key.project if key else "",
                model=model,
                endpoint=endpoint,
                prompt_tokens=prompt,
                completion_tokens=completion,
                total_tokens=total,
            )
        )

    def _remember_response(
        self,
        response_id: str,
        model: str,
        ep: Endpoint,
        key: KeyRecord | None,
        usage: dict[str, Any] | None,
    ) -> None:
        owner = key.key_id if key is not None else ""
        home = surface.Home(model, ep.replica_id, ep.epoch, owner, counted=usage is not None)
        self.responses.remember(response_id, home)

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client session to the engines (the app must have started)."""
        assert self._session is not None, "the gateway app was not started"
        return self._session

    def record_usage(
        self, key: KeyRecord | None, model: str, endpoint: str, usage: dict[str, Any] | None
    ) -> None:
        """Count an answer's tokens for its key (for other routes on the gateway app)."""
        self._record_usage(key, model, endpoint, usage)

    # handlers

    async def models(self, request: web.Request) -> web.Response:
        key, denied = self._authenticate(request)
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
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    def proxy(self, endpoint: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._proxy(request, endpoint)

        return handler

    def upload(self, endpoint: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The handler of a multipart endpoint (surface.ROUTES): streamed, not read whole."""

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._proxy(request, endpoint, self._upload_inner)

        return handler

    def instrumented(
        self,
        endpoint: str,
        inner: Callable[[web.Request, str, _Call], Awaitable[web.StreamResponse]],
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """A handler for another route on the gateway app with the proxied
        routes' span and metrics (``inner`` sets ``call.model`` once known)."""

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._proxy(request, endpoint, inner)

        return handler

    async def _proxy(
        self,
        request: web.Request,
        endpoint: str,
        inner: Callable[[web.Request, str, _Call], Awaitable[web.StreamResponse]] | None = None,
    ) -> web.StreamResponse:
        call = _Call(t0=time.monotonic())
        with self._request_span(request, endpoint) as span:
            try:
                resp = await (inner or self._proxy_inner)(request, endpoint, call)
                call.status = call.outcome or resp.status
                return resp
            except asyncio.CancelledError:
                call.status = 499
                raise
            finally:
                if not call.handed_off:
                    call.release()
                span.set_attribute("http.response.status_code", call.status)
                self.metrics.answered_since(
                    call.model or "_unknown", call.status, call.t0, call.first_byte
                )

    def _request_span(
        self, request: web.Request, endpoint: str
    ) -> contextlib.AbstractContextManager[trace.Span]:
        """A span of ours when the request is traced; else the client's context
        made current without one (so that it is forwarded as it came); else,
        with nothing to trace or forward, no span at all."""
        every = self.config.trace_requests == "all"
        if not every and not _carries_context(request.headers) and not otel_context.get_current():
            # Most requests. (A context inherited from the server's start is
            # not the client's: the path below masks it with the empty one.)
            return _NO_SPAN
        ctx = propagate.extract(request.headers)
        if not every and not _sampled(ctx):
            return _attached(ctx)
        return self.tracer.start_as_current_span(
            "llmgw.router.request",
            context=ctx,
            kind=trace.SpanKind.SERVER,
            attributes={
                "llmgw.endpoint": endpoint,
                "http.request.method": request.method,
                "url.path": request.path,
            },
        )

    def lane_plan(self, endpoint: str, headers: Mapping[str, str], raw: bytes) -> LanePlan | None:
        """The fast lane's plan for a request, or None: aiohttp's path serves it.

        The lane takes only what it can finish as aiohttp's path would: a valid
        key (or none needed), a JSON body naming a model the key may use, a
        ready replica, nothing to trace. Everything else (every refusal, a
        cold start, a traced request) goes to aiohttp untouched; so nothing
        is counted or spent here (the quota is charged in :meth:`lane_send`)."""
        if (
            self.config.trace_requests == "all"
            or _carries_context(headers)
            or otel_context.get_current()
        ):
            return None
        key = None
        if self.keys is not None:
            scheme, _, token = headers.get("Authorization", "").partition(" ")
            key = self.keys.lookup(token.strip()) if scheme.lower() == "bearer" else None
            if key is None:
                return None
        obj = _parse_body(raw)
        if isinstance(obj, web.Response):
            return None
        model = self.directory.resolve(obj["model"])
        if model is None or not self.may_use(model, key):
            return None
        prepared = _upstream_body(raw, obj, model, endpoint)
        if isinstance(prepared, web.Response):
            return None
        if endpoint == "responses" or self._route(model, endpoint, obj) is not None:
            return None
        ep = self._pick(model)
        if ep is None:
            return None
        body, stream, strip_usage = prepared
        ask = self._ask(obj, endpoint, model, key)
        return LanePlan(endpoint, model, key, ep, body, time.monotonic(), stream, strip_usage, ask)

    def lane_send(self, plan: LanePlan, lane: LaneClient) -> LaneCall | None:
        """Start a request the lane planned: admitted (the quota's refusal is
        the answer), then sent on a kept-alive connection to its replica if
        there is one, and answered from that connection's callback
        (:class:`LaneCall`): no task, no future, each of which costs a turn of
        the loop and tens of microseconds on a cold CPU. Otherwise it goes to
        ``lane.fall_back`` (a new connection, made in a task). None: no call
        under way here (answered, or the task's)."""
        held = self._reserve(plan.key, plan.ask)
        if isinstance(held, web.Response):
            lane.answer(held)  # with the headers of the limit it reached
            self.metrics.answered_since(plan.model, held.status, plan.t0, None)
            return None
        if held is not None:
            plan = plan._replace(hold=held, quota=held.headers)
        if plan.stream:
            # A second or more of answer: a task's turn of the loop is nothing
            # to it, and _forward's handling of a failed try is the path's own.
            lane.fall_back(plan, None)
            return None
        assert self._whole is not None, "the gateway app was not started"
        ep = plan.ep
        call = LaneCall(self, plan, lane)
        call.conn = self._whole.send_kept(
            ep.base_url, ep.ssl, surface.upstream_path(plan.endpoint),
            _upstream_headers(lane, ep, "application/json"), plan.body, call.done,
        )  # fmt: skip
        if call.conn is None:
            lane.fall_back(plan, None)
            return None
        # Counted once sent: the answer comes in a later turn of the loop, never
        # within send_kept.
        call.sent()
        return call

    def _request_started(self, model: str, replica_id: str) -> None:
        key_ = (model, replica_id)
        self.in_flight[key_] = self.in_flight.get(key_, 0) + 1
        self.directory.request_started(model, replica_id)

    def _request_ended(self, model: str, replica_id: str) -> None:
        key_ = (model, replica_id)
        self.in_flight[key_] -= 1
        if not self.in_flight[key_]:
            del self.in_flight[key_]
        self.directory.request_finished(model, replica_id)

    def _lane_deliver(
        self, plan: LanePlan, lane: LaneClient, resp: web.Response | Whole,
        first_byte: float | None, then: Callable[[], None],
    ) -> None:  # fmt: skip
        _carry_limits(plan.quota, resp)
        lane.answer(resp, then)
        self.metrics.answered_since(plan.model, resp.status, plan.t0, first_byte)

    async def serve_lane(
        self, plan: LanePlan, client: Client, deliver: Deliver, failed: BaseException | None
    ) -> None:
        """Answer an admitted request the lane planned, as :meth:`_proxy` does,
        with ``deliver`` sending the answer (whichever it is) to the client;
        ``failed``: how a try :meth:`lane_send` made ended."""
        call = _Call(t0=plan.t0, model=plan.model, quota=plan.quota, hold=plan.hold)
        sent: list[web.Response] = []

        async def once(resp: web.Response) -> web.Response:
            sent.append(resp)
            _carry_limits(plan.quota, resp)
            return await deliver(resp)

        try:
            resp = await self._forward(
                client, plan.endpoint, plan.model, plan.ep, plan.body, plan.stream,
                plan.strip_usage, plan.key, call, deliver=once, failed=failed,
            )  # fmt: skip
            # Not a Response: a stream, written as it came (see _answer_here).
            if isinstance(resp, web.Response) and not sent:
                await once(resp)
            call.status = call.outcome or resp.status
        except asyncio.CancelledError:
            call.status = 499
            raise
        finally:
            if not call.handed_off:
                call.release()
            self.metrics.answered_since(plan.model, call.status, call.t0, call.first_byte)

    async def _proxy_inner(
        self, request: web.Request, endpoint: str, call: _Call
    ) -> web.StreamResponse:
        key, denied = self._authenticate(request)
        if denied is not None:
            return denied
        raw = await self._read_body(request)
        if isinstance(raw, web.Response):
            return raw
        obj = _parse_body(raw)
        if isinstance(obj, web.Response):
            return obj
        model = self._model_for(obj["model"], key)
        if isinstance(model, web.Response):
            return model
        call.model = model
        trace.get_current_span().set_attribute("llmgw.model", model)
        refused = self._route(model, endpoint, obj) or self._admit(
            key, self._ask(obj, endpoint, model, key), call, request
        )
        if refused is not None:
            return refused
        prepared = _upstream_body(raw, obj, model, endpoint)
        if isinstance(prepared, web.Response):
            return prepared
        body, stream, strip_usage = prepared
        pinned = self._pinned(model, obj, key) if endpoint == "responses" else None
        if isinstance(pinned, web.Response):
            return pinned
        ep = pinned or await self._pick_or_hold(request, model, key)
        if isinstance(ep, web.Response):
            return ep
        return await self._forward(
            request,
            endpoint,
            model,
            ep,
            body,
            stream,
            strip_usage,
            key,
            call,
            pinned=pinned is not None,
        )

    async def _upload_inner(
        self, request: web.Request, endpoint: str, call: _Call
    ) -> web.StreamResponse:
        resp = await self._upload(request, endpoint, call)
        if not request.content.is_eof() and not resp.prepared:
            # Refused before the upload was read to its end: aiohttp would read
            # (and drop) the rest before the next request, up to a gigabyte.
            resp.force_close()
        return resp

    async def _upload(self, request: web.Request, endpoint: str, call: _Call) -> web.StreamResponse:
        """A multipart request: read up to its model field, then stream the rest to the engine."""
        key, denied = self._authenticate(request)
        if denied is not None:
            return denied
        ctype = request.headers.get("Content-Type", "")
        boundary = surface.multipart_boundary(ctype)
        if boundary is None:
            return _error(
                400,
                f"{request.path} takes multipart/form-data (a 'file' and a 'model' field); "
                f"got {ctype or 'no Content-Type'}.",
                "invalid_request_error",
                "invalid_content_type",
            )
        cfg = self.config
        if (request.content_length or 0) > cfg.max_upload_bytes:
            return _error(
                413,
                f"The upload is larger than {cfg.max_upload_bytes} bytes.",
                "invalid_request_error",
                "request_too_large",
            )
        try:
            field = await surface.read_model_field(
                request.content, boundary, cfg.max_body_bytes, cfg.body_timeout
            )
        except surface.UploadProblem as p:
            return _error(p.status, str(p), "invalid_request_error", p.code)
        model = self._model_for(field.model, key)
        if isinstance(model, web.Response):
            return model
        call.model = model
        trace.get_current_span().set_attribute("llmgw.model", model)
        refused = self._route(model, endpoint, None) or self._admit(key, NOTHING, call, request)
        if refused is not None:
            return refused
        head = field.head if field.model == model else field.with_model(model)
        body = surface.Upload(head, request.content, cfg.max_upload_bytes, cfg.body_timeout)
        ep = await self._pick_or_hold(request, model, key)
        if isinstance(ep, web.Response):
            return ep
        # A streamed transcription (stream=true in the form) is relayed as any
        # stream; its usage, if asked for, passes through as the client asked.
        return await self._forward(
            request, endpoint, model, ep, body, False, False, key, call, content_type=ctype
        )

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The request's body, or the answer for one too large or too slow to arrive."""
        if (request.content_length or 0) > self.config.max_body_bytes:
            return self._too_large()
        try:
            if request.content.is_eof():
                # All of it came with the headers (most requests): no timer to
                # arm, nor a read to wait for.
                raw = request.content.read_nowait()
                return self._too_large() if len(raw) > self.config.max_body_bytes else raw
            async with asyncio.timeout(self.config.body_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        except TimeoutError:
            resp = _error(
                408,
                f"The request body did not arrive within {self.config.body_timeout:g} s.",
                "invalid_request_error",
                "request_timeout",
            )
            resp.force_close()
            return resp

    async def _pick_or_hold(
        self, request: web.Request, model: str, key: KeyRecord | None
    ) -> Endpoint | web.Response:
        """A replica to send to at once, else one the request waited for (a cold start)."""
        ep = self._pick(model)
        if ep is not None:
            return ep
        t_hold = time.monotonic()
        outer = trace.get_current_span()
        if outer.is_recording() or outer.get_span_context().is_valid:
            # Traced already, or the client chose not to be (an unsampled parent).
            held = await self._hold(request, model, key=key)
        else:
            # Untraced so far: a cold start is worth a trace of its own (the
            # sampler decides), linked to the replica's start.
            with self.tracer.start_as_current_span(
                "llmgw.router.held",
                kind=trace.SpanKind.SERVER,
                attributes={"llmgw.model": model},
            ):
                held = await self._hold(request, model, key=key)
                trace.get_current_span().set_attribute(
                    "llmgw.held_seconds", time.monotonic() - t_hold
                )
        trace.get_current_span().set_attribute("llmgw.held_seconds", time.monotonic() - t_hold)
        return held

    async def _forward(
        self,
        request: Client,
        endpoint: str,
        model: str,
        ep: Endpoint,
        body: bytes | surface.Upload,
        stream: bool,
        strip_usage: bool,
        key: KeyRecord | None,
        call: _Call,
        *,
        pinned: bool = False,
        content_type: str = "application/json",
        deliver: Deliver | None = None,
        failed: BaseException | None = None,
    ) -> web.StreamResponse:
        """The engine's answer; a whole one sent from here (``deliver``: aiohttp's by
        default; ``failed``: how a first try, the fast lane's, ended)."""
        assert self._session is not None, "the gateway app was not started"
        upload = body if isinstance(body, surface.Upload) else None
        tried: set[str] = set()
        unreachable: set[tuple[str, str, int]] = set()
        while True:
            tried.add(ep.replica_id)
            headers = _upstream_headers(request, ep, content_type)
            trace.get_current_span().set_attribute("llmgw.replica_id", ep.replica_id)
            replica_id = ep.replica_id
            self._request_started(model, replica_id)
            try:
                try:
                    # ssl: the replica's pinned certificate (and the gateway's client
                    # one): a listener that took the engine's port fails the handshake
                    # before the request, its key or its prompt is sent.
                    # The lane's (deliver) streams on the gateway's own client too.
                    if upload is None and (not stream or deliver is not None):
                        if failed is not None:
                            first_try, failed = failed, None
                            raise first_try  # handled below as this try's own
                        return await self._answer_here(
                            request, ep, endpoint, model, headers, body, strip_usage if stream
                            else None, key, call, deliver or functools.partial(_sent, request),
                        )  # fmt: skip
                    assert isinstance(request, web.Request)
                    upstream = await self._session.post(
                        ep.base_url.rstrip("/") + surface.upstream_path(endpoint),
                        data=body if upload is None else upload.stream(),
                        headers=headers,
                        ssl=ep.ssl if ep.ssl is not None else True,
                    )
                except UpstreamBroken as e:
                    return self._broke_off(model, e.cause)
                except (aiohttp.ClientConnectionError, TimeoutError) as e:
                    if upload is not None and upload.problem is not None:
                        p = upload.problem
                        return _error(p.status, str(p), "invalid_request_error", p.code)
                    # Not for a request pinned to its replica, nor for an
                    # upload the engine began to take (it cannot be read again).
                    retryable = not pinned and not (upload is not None and upload.started)
                    nxt = await self._elsewhere(
                        request, model, ep, e, retryable, (tried, unreachable), key
                    )
                    if isinstance(nxt, web.Response):
                        return nxt
                    ep = nxt
                    continue
                try:
                    return await self._relay(
                        request, upstream, ep, endpoint, model, stream, strip_usage, key, call
                    )
                finally:
                    # A no-op after a complete read (the connection is back
                    # in the pool by then); otherwise it cuts the engine's
                    # connection, which stops a generation nobody will read,
                    # unless the pipe reads it on for its usage.
                    if not call.handed_off:
                        upstream.close()
            finally:
                self._request_ended(model, replica_id)

    async def _answer_here(
        self, client: Client, ep: Endpoint, endpoint: str, model: str, headers: dict[str, str],
        body: bytes | surface.Upload, strip_usage: bool | None, key: KeyRecord | None,
        call: _Call, deliver: Deliver,
    ) -> web.StreamResponse:  # fmt: skip
        """A try on the gateway's own client (upstream.UpstreamPool): the engine's
        answer read whole and delivered, or (``strip_usage`` not None: a stream
        of the fast lane's) relayed as it comes."""
        assert self._whole is not None, "the gateway app was not started"
        assert isinstance(body, bytes)  # not an upload
        sink = None
        if strip_usage is not None:
            lane = cast(LaneClient, client)
            sink = self._lane_sink(lane, ep, endpoint, model, key, call, strip_usage)
        try:
            answer = await self._whole.post(
                ep.base_url, ep.ssl, surface.upstream_path(endpoint), headers, body, sink
            )
        except UpstreamBroken as e:
            if sink is None or not sink.began:
                raise
            sink.cut_short(self._stream_failed(e.cause, model, call))
            return web.StreamResponse()
        if sink is not None and sink.began:
            # The engine's answer is whole: its usage counts whether the
            # client reads the end or not.
            self._record_usage(key, model, endpoint, sink.usage, call.hold)
            sink.finish()
            return web.StreamResponse()
        self._count_answer(
            answer.status, answer.headers, answer.body, ep, endpoint, model, key, call.hold
        )
        resp = _response_of(
            self._whole_answer(answer.status, answer.headers, answer.body, ep, model)
        )
        call.first_byte = time.monotonic()
        return await deliver(resp)

    def _lane_sink(
        self, lane: LaneClient, ep: Endpoint, endpoint: str, model: str,
        key: KeyRecord | None, call: _Call, strip_usage: bool,
    ) -> LaneSink:  # fmt: skip
        relay = _SseRelay(strip_usage)

        def head_of(headers: Mapping[str, str]) -> dict[str, str]:
            out = _answer_headers(ep, headers)
            out["Content-Type"] = headers.get("Content-Type", "text/event-stream")
            out["Cache-Control"] = "no-cache"
            if call.quota is not None:
                out.update(call.quota)
            return out

        def drained(whole: bool) -> None:
            # The end of an answer whose client went away.
            if whole:
                self._record_usage(key, model, endpoint, relay.usage, call.hold)
            else:
                self.metrics.upstream_errors.labels(model, "drain").inc()
            call.release()

        cfg = self.config
        drain = (cfg.drain_after_disconnect, cfg.drain_after_disconnect_bytes)
        return LaneSink(lane, relay, call, head_of, drain, drained)

    def _stream_failed(self, cause: str, model: str, call: _Call) -> bytes:
        """An answer the engine failed after it began, on either path: counted, and
        the error event to end it with (see :meth:`_cut_short`)."""
        self.metrics.upstream_errors.labels(model, "stream").inc()
        call.outcome = 502
        return _sse_error(
            f"The replica of model '{model}' failed after the answer "
            f"began ({cause}); the answer is incomplete.",
            "upstream_failed",
        )

    async def _elsewhere(
        self,
        request: Client,
        model: str,
        ep: Endpoint,
        e: BaseException,
        retryable: bool,
        seen: tuple[set[str], set[tuple[str, str, int]]],
        key: KeyRecord | None,
    ) -> Endpoint | web.Response:
        """After ``ep`` could not be reached: the replica to try next, or the answer."""
        tried, unreachable = seen
        # Nothing was received: the engine did not see the
        # request, or died before answering; one retry elsewhere.
        self.metrics.upstream_errors.labels(model, "connect").inc()
        trace.get_current_span().add_event(
            "llmgw.upstream_connect_failed",
            {"llmgw.replica_id": ep.replica_id, "error": repr(e)},
        )
        unreachable.add(ep.identity)
        retry = self.config.retry_once and len(tried) < 2 and retryable
        nxt = self._pick(model, frozenset(tried)) if retry else None
        if nxt is None and retry and len(unreachable) == 1:
            # No other replica: the one that failed is gone before the daemon
            # knew (preempted, crashed). The engine saw nothing, so the
            # request waits, as for a cold start, for another replica or
            # for this one's next run (back from the queue, often at the
            # same address: the endpoint's epoch tells the runs apart).
            return await self._hold(request, model, frozenset(unreachable), key)
        if nxt is None:
            return _error(
                502,
                f"Could not reach a replica of model '{model}' ({type(e).__name__}).",
                "server_error",
                "upstream_unavailable",
            )
        return nxt

    @staticmethod
    async def _pump(
        pipe: _Pipe, writer: AbstractStreamWriter, upstream: aiohttp.ClientResponse, call: _Call
    ) -> None:
        """Move the engine's answer to the client until it ends or the client goes."""
        try:
            te = upstream.headers.get("Transfer-Encoding", "")
            pipe.start(upstream_chunked=te.strip().lower() == "chunked")
            while not pipe.done and not pipe.draining:
                await pipe.wait()
                if pipe.paused and not pipe.done:
                    await writer.drain()
                    pipe.resume()
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (the runner cancels the handler then, or
            # a write found it gone): the engine's answer is read on.
            if pipe.begin_drain():
                call.handed_off = True
            raise
        finally:
            if not pipe.draining:
                pipe.detach()
        if pipe.draining:
            call.handed_off = True

    def _cut_short(
        self, e: BaseException, pipe: _Pipe, relay: _SseRelay, model: str, call: _Call
    ) -> None:
        """The engine failed after the answer began: pass that on, an answer cut
        short, instead of inventing an ending.

        First an error event, as vLLM sends when it fails mid-answer (OpenAI's
        clients raise it with its message, where a bare cut reads "Connection
        error"); the incomplete event before it is dropped, as no client could
        parse it and it would garble the error.
        """
        relay.rest()
        pipe.send(self._stream_failed(type(e).__name__, model, call))

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        relay: _SseRelay,
        endpoint: str,
        model: str,
        key: KeyRecord | None,
        call: _Call,
    ) -> web.StreamResponse:
        if request.version >= aiohttp.HttpVersion11:
            # Set here, not left to aiohttp, so that the pipe knows to frame.
            resp.enable_chunked_encoding()
        try:
            writer = await resp.prepare(request)
            transport = request.transport
            if writer is None or transport is None or transport.is_closing():
                call.outcome = 499
                return resp

            def drained(p: _Pipe) -> None:
                # The end of an answer whose client went away (in a callback:
                # the handler has returned or was cancelled by then).
                if p.error is None:
                    self._record_usage(key, model, endpoint, relay.usage, call.hold)
                else:
                    self.metrics.upstream_errors.labels(model, "drain").inc()
                call.release()
                upstream.close()

            cfg = self.config
            pipe = _Pipe(
                upstream,
                transport,
                relay,
                resp.chunked,
                call,
                cfg.read_timeout,
                (cfg.drain_after_disconnect, cfg.drain_after_disconnect_bytes),
                drained,
            )
            await self._pump(pipe, writer, upstream, call)
            if pipe.gone:
                call.outcome = call.outcome or 499
                if pipe.done and pipe.error is None and not pipe.draining:
                    # Ended before the client was missed: the usage is in.
                    self._record_usage(key, model, endpoint, relay.usage, call.hold)
                return resp
            e = pipe.error
            if e is not None:
                if not isinstance(
                    e, (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError)
                ):
                    raise e
                self._cut_short(e, pipe, relay, model, call)
                transport.abort()
                return resp
            pipe.send(relay.rest())
            # The engine's answer is whole: its usage counts whether the
            # client reads the end or not.
            self._record_usage(key, model, endpoint, relay.usage, call.hold)
            if pipe.gone:
                call.outcome = call.outcome or 499
                return resp
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away (aiohttp raises a subclass of this on
            # writes to a closed connection); unless the pipe reads on, the
            # engine's connection is cut by the caller, which stops the generation.
            call.outcome = call.outcome or 499
            return resp
        return resp

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ep: Endpoint,
        endpoint: str,
        model: str,
        stream: bool,
        strip_usage: bool,
        key: KeyRecord | None,
        call: _Call,
    ) -> web.StreamResponse:
        ctype = upstream.headers.get("Content-Type", "")
        out_headers = _answer_headers(ep, upstream.headers)
        if upstream.status == 200 and ctype.startswith("text/event-stream"):
            resp = web.StreamResponse(
                status=200,
                headers={**out_headers, "Content-Type": ctype, "Cache-Control": "no-cache"},
            )
            relay = surface.ResponsesRelay() if endpoint == "responses" else _SseRelay(strip_usage)
            try:
                return await self._relay_stream(
                    request, upstream, resp, relay, endpoint, model, key, call
                )
            finally:
                if isinstance(relay, surface.ResponsesRelay) and relay.response_id:
                    self._remember_response(relay.response_id, model, ep, key, relay.usage)

        try:
            data = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
            return self._broke_off(model, type(e).__name__)
        self._count_answer(
            upstream.status, upstream.headers, data, ep, endpoint, model, key, call.hold
        )
        got = self._whole_answer(upstream.status, upstream.headers, data, ep, model)
        call.first_byte = time.monotonic()
        return _response_of(got)

    def _engine_refused(self, model: str) -> web.Response:
        # The engine refused the replica's key: a deployment fault, never
        # the client's; passing the 401 on would tell the client that
        # their own key is wrong.
        self.metrics.upstream_errors.labels(model, "auth").inc()
        return _error(
            502,
            f"The replica of model '{model}' refused the gateway's engine key.",
            "server_error",
            "upstream_auth_failed",
        )

    def _broke_off(self, model: str, cause: str) -> web.Response:
        self.metrics.upstream_errors.labels(model, "stream").inc()
        return _error(
            502,
            f"The replica of model '{model}' failed while answering ({cause}).",
            "server_error",
            "upstream_failed",
        )

    def _whole_answer(
        self, status: int, headers: Mapping[str, str], data: bytes, ep: Endpoint, model: str
    ) -> Whole | web.Response:
        """The client's answer from the engine's whole one (the gateway's own
        error: a Response; see :func:`_response_of`); :meth:`_count_answer`
        counts its usage."""
        if status in (401, 403):
            return self._engine_refused(model)
        out_headers = _answer_headers(ep, headers)
        ctype = headers.get("Content-Type", "")
        if ctype:
            out_headers["Content-Type"] = ctype
        return Whole(status, out_headers, data)

    def _count_answer(
        self, status: int, headers: Mapping[str, str], data: bytes, ep: Endpoint,
        endpoint: str, model: str, key: KeyRecord | None, hold: Reservation | None = None,
    ) -> None:  # fmt: skip
        """Count the usage of an engine's whole answer (and remember a response
        of the Responses API, for the requests that continue it)."""
        if status == 200 and headers.get("Content-Type", "").startswith("application/json"):
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                self._record_usage(key, model, endpoint, parsed["usage"], hold)
            if (
                endpoint == "responses"
                and isinstance(parsed, dict)
                and isinstance(parsed.get("id"), str)
            ):
                usage = parsed.get("usage")
                self._remember_response(
                    parsed["id"], model, ep, key, usage if isinstance(usage, dict) else None
                )


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
        return _error(
            e.status,
            f"{e.reason}: {request.method} {request.path}",
            "invalid_request_error",
            "not_found" if e.status == 404 else "bad_request",
        )


GATEWAY_KEY = web.AppKey("llmgw.gateway", Gateway)


def _upstream_headers(request: Client, ep: Endpoint, content_type: str) -> dict[str, str]:
    headers = {
        # The replica's engine key, never the client's gateway key.
        "Authorization": f"Bearer {ep.api_key}",
        "Content-Type": content_type,
        "Accept": request.headers.get("Accept", "*/*"),
        "Accept-Encoding": "identity",
    }
    if "X-Request-Id" in request.headers:
        headers["X-Request-Id"] = request.headers["X-Request-Id"]
    if otel_context.get_current():
        # A span of ours or the client's context (_proxy attaches either): the
        # engine's spans join that trace. An empty context has nothing to send.
        propagate.inject(headers)
    return headers


def create_app(
    directory: ModelDirectory,
    config: RouterConfig | None = None,
    *,
    keys: KeyRing | None = None,
    usage: UsageSink | None = None,
    registry: CollectorRegistry | None = None,
    quota: QuotaBook | None = None,
    tracer: trace.Tracer | None = None,
) -> web.Application:
    """The gateway as an aiohttp app.

    ``keys``: None serves without keys (anyone who can reach the port may use
    it); otherwise every ``/v1`` request needs a key from the ring. ``usage``:
    where per-key token usage goes (started and closed with the app).
    ``registry``: the Prometheus registry for ``/metrics``; a new one when None.
    ``quota``: limits and budgets per key, user and account (with ``keys``).
    ``tracer``: where its spans go (default: the process's tracer provider).
    The daemon may add its own routes to the returned app before starting it;
    ``app[GATEWAY_KEY]`` is the :class:`Gateway` state.
    """
    config = config or RouterConfig()
    gw = Gateway(
        directory,
        config,
        keys=keys,
        usage=usage,
        registry=registry if registry is not None else CollectorRegistry(),
        quota=quota,
        tracer=tracer,
    )
    # aiohttp's own limit refuses larger bodies while reading; the
    # Content-Length check in the handler refuses most before reading.
    app = web.Application(
        client_max_size=max(config.max_body_bytes, 1), middlewares=[_openai_errors]
    )
    app[GATEWAY_KEY] = gw
    app.on_startup.append(gw._startup)
    app.on_cleanup.append(gw._cleanup)
    app.router.add_get("/v1/models", gw.models)
    app.router.add_post("/v1/chat/completions", gw.proxy("chat/completions"))
    app.router.add_post("/v1/completions", gw.proxy("completions"))
    app.router.add_post("/v1/embeddings", gw.proxy("embeddings"))
    for route in surface.ROUTES:
        handler = gw.upload(route.name) if route.multipart else gw.proxy(route.name)
        for path in route.paths:
            app.router.add_post(path, handler)
    for method, path, action in stored.ROUTES:
        app.router.add_route(method, path, gw.instrumented("responses", stored.handler(gw, action)))
    app.router.add_get("/metrics", gw.metrics_handler)
    if quota is not None:
        add_quota_headers(app, quota)
    return app


async def _sent(request: Client, resp: web.Response) -> web.Response:
    """``resp``, sent now from the handler rather than by aiohttp after it
    returns: what is left to do for the request (its metrics, the replica's
    count of requests in flight, the span's end) then comes after the client
    has its answer, not before. A client gone by then is left to aiohttp,
    which finishes the returned answer again and finds the connection gone."""
    assert isinstance(request, web.Request)  # the lane's requests have their own deliver
    with contextlib.suppress(ConnectionError):
        await resp.prepare(request)
        await resp.write_eof()
    return resp


# A span that is not recorded, for requests that are neither traced nor carry a context.
_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def _carries_context(headers: Mapping[str, str]) -> bool:
    """Whether the request has a header the propagator reads (traceparent,
    baggage, ...): without one, extracting gives an empty context, and that
    costs more than the look."""
    # The propagator is looked up each time: tracing's set-up may replace it
    # after the app is made.
    # A loop, not any(): the generator costs more than the look, on every request.
    for f in _fields(propagate.get_global_textmap()):  # noqa: SIM110
        if f in headers:
            return True
    return False


@functools.lru_cache(maxsize=1)
def _fields(textmap: TextMapPropagator) -> frozenset[str]:
    # A composite propagator builds its set of fields anew on every call.
    return frozenset(textmap.fields)


def _sampled(ctx: otel_context.Context) -> bool:
    sc = trace.get_current_span(ctx).get_span_context()
    return sc.is_valid and sc.trace_flags.sampled


@contextlib.contextmanager
def _attached(ctx: otel_context.Context) -> Iterator[trace.Span]:
    """Make the client's context current without a span of ours, so it is forwarded as is."""
    token = otel_context.attach(ctx)
    try:
        yield trace.get_current_span()
    finally:
        otel_context.detach(token)
