"""The forwarder: one admitted request to an engine, and its answer back.

An :class:`Exchange` goes through these steps, each a method below, in this
order; whole and streamed answers differ only where their bytes do:

1. ``start``: the replica (pinned, picked, or waited for: ``replicas.hold``);
2. ``send``: on a kept-alive connection to it, or a new one (``engine``);
3. ``head``: the engine's head; a 200 ``text/event-stream`` streams (events
   relayed as they complete, ``sse``), anything else is read whole;
4. ``data``: the body's pieces;
5. ``end``: the answer whole, or why not. No byte came back: once more
   elsewhere (a kept-alive connection the engine closed as it was reused:
   a new one to the same replica); the only replica: held for its next run;
   else a 502. It broke off: a 502, or for a stream its error event and a cut;
6. ``close``: the accounting (``account.Tally``) and the client's next request.

The client going away cuts the engine's connection, which stops the
generation, except for a stream, which is read on, within
``drain_after_disconnect``, so that its usage is counted.

Waiting (a hold, a connect, an upload's body) is a task; everything else runs
in the connections' callbacks. Nothing here raises into them: a bug ends the
request with a 500 (or a cut) and is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router import http1, surface
from llmgw_slurm.router.account import Accounting, Tally
from llmgw_slurm.router.admit import Plan
from llmgw_slurm.router.answers import Reply, error, sse_error
from llmgw_slurm.router.directory import Endpoint
from llmgw_slurm.router.engine import Conn, EngineBroken, EnginePool, EngineUnreachable, Target
from llmgw_slurm.router.metrics import GatewayMetrics
from llmgw_slurm.router.replicas import Replicas
from llmgw_slurm.router.sse import ResponsesRelay, SseRelay

__all__ = ["Client", "Exchange", "Parts"]

log = logging.getLogger(__name__)


class Client(Protocol):
    """The client's side of one request, as the server offers it."""

    http11: bool

    @property
    def headers(self) -> Mapping[str, str]: ...

    def gone(self) -> bool: ...

    def whole(self, status: int, headers: Mapping[str, str], body: bytes) -> None: ...

    def begin(self, status: int, headers: Mapping[str, str]) -> None:
        """A streamed answer's head."""

    def send(self, data: bytes) -> bool:
        """A piece of a streamed answer; False: the client is gone."""

    def end(self) -> None: ...

    def cut(self) -> None:
        """Close the connection, the answer incomplete."""

    def finished(self) -> None:
        """The request is over: the connection takes its next one."""

    def crashed(self) -> None:
        """A bug: a 500 if nothing was sent, else a cut."""


class Parts(Protocol):
    """What an exchange uses of the gateway (``gateway.Gateway``)."""

    config: RouterConfig
    metrics: GatewayMetrics
    replicas: Replicas
    pool: EnginePool
    accounting: Accounting


class Exchange:
    """One admitted request's way to an engine and back (an ``engine.Sink``)."""

    def __init__(
        self, gw: Parts, client: Client, plan: Plan, tally: Tally,
        upload: surface.Upload | None = None,
    ) -> None:
        self.gw, self.client, self.plan, self.tally, self.upload = gw, client, plan, tally, upload
        self.ep: Endpoint | None = None
        self.conn: Conn | None = None
        self._target: Target | None = None
        self._tried: set[str] = set()
        self._unreachable: set[tuple[str, str, int]] = set()
        self._task: asyncio.Task[None] | None = None
        self._status = 0
        self._headers: dict[str, str] | None = None
        self._parts: list[bytes] = []
        self._relay: SseRelay | None = None  # once the answer streams
        self._in_flight = False
        self._kept = False  # the try is on a kept-alive connection
        self._drain_left = -1  # bytes, while an answer is read on for a client gone
        self._drain_timer: asyncio.TimerHandle | None = None
        self._over = False

    # 1. the replica

    def start(self) -> None:
        try:
            ep = self.plan.pinned or self.gw.replicas.pick(self.plan.model, self.plan.prefix)
            if ep is None:
                self._spawn(self._hold())
            else:
                self._send(ep)
        except Exception:
            # As a step that fails later (_guarded): the request ends as a 500,
            # and what it held is released, or the key's tokens stay held.
            log.exception("forwarding a request of %s failed", self.plan.model)
            self._crash()

    async def _hold(self, unreachable: frozenset[tuple[str, str, int]] = frozenset()) -> None:
        tally, loop = self.tally, asyncio.get_running_loop()
        t0 = loop.time()
        span = tally.span or trace.get_current_span(tally.context or otel_context.Context())
        own = None
        if not span.get_span_context().is_valid:
            # Untraced so far: a cold start is worth a trace of its own (the
            # sampler decides), linked to the replica's start.
            own = span = self.gw.accounting.tracer.start_span(
                "llmgw.router.held", otel_context.Context(), trace.SpanKind.SERVER,
                {"llmgw.model": self.plan.model},
            )
        try:
            got = await self.gw.replicas.hold(
                self.plan.model, self.plan.key, self.plan.prefix, unreachable,
                self.client.gone, span,
            )
        finally:
            span.set_attribute("llmgw.held_seconds", loop.time() - t0)
            if own is not None:
                own.end()
        if isinstance(got, Reply):
            self.reply(got)
        else:
            self._send(got)

    # 2. the engine's connection

    def _send(self, ep: Endpoint) -> None:
        self.ep = ep
        self._tried.add(ep.replica_id)
        self.tally.set("llmgw.replica_id", ep.replica_id)
        self._target = self.gw.pool.target(ep.base_url, ep.ssl)
        conn = self.gw.pool.kept(self._target)
        self._kept = conn is not None
        if conn is None:
            self._spawn(self._connect())
        else:
            self._go(conn)

    async def _connect(self) -> None:
        assert self._target is not None
        self._kept = False
        try:
            conn = await self.gw.pool.connect(self._target)
        except EngineUnreachable as e:
            self._unreached(e)
            return
        self._go(conn)

    def _go(self, conn: Conn) -> None:
        assert self.ep is not None and self._target is not None
        self.conn, self._headers, self._status = conn, None, 0
        if not self._in_flight:
            self._in_flight = True
            self.gw.replicas.started(self.plan.model, self.ep.replica_id)
        target, plan = self._target, self.plan
        head = http1.request_head(
            "POST", target.path + surface.upstream_path(plan.endpoint), target.netloc,
            self._engine_headers(self.ep).items(), None if self.upload else len(plan.body),
        )
        conn.send(head if self.upload else head + plan.body, self)
        if self.upload is not None:
            self._spawn(self._upload(conn, self.upload))

    def _engine_headers(self, ep: Endpoint) -> dict[str, str]:
        got = self.client.headers
        out = {
            # The replica's engine key, never the client's gateway key.
            "Authorization": f"Bearer {ep.api_key}",
            "Content-Type": got.get("content-type", "") if self.upload else "application/json",
            "Accept": got.get("accept", "*/*"),
            "Accept-Encoding": "identity",
        }
        if "x-request-id" in got:
            out["X-Request-Id"] = got["x-request-id"]
        if self.tally.context is not None:
            # The span of ours, or the client's unsampled context as it came.
            propagate.inject(out, context=self.tally.context)
        return out

    async def _upload(self, conn: Conn, upload: surface.Upload) -> None:
        try:
            await conn.send_body(upload.stream())
        except surface.UploadProblem as p:
            conn.abandon()
            self._unplug()
            self.reply(error(p.status, str(p), "invalid_request_error", p.code))

    # 3-5. the answer (engine.Sink)

    def head(self, conn: Conn, status: int, headers: dict[str, str]) -> None:
        self._status, self._headers = status, headers
        if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
            plan = self.plan
            responses = plan.endpoint == "responses"
            self._relay = ResponsesRelay() if responses else SseRelay(plan.strip_usage)
            out = self._answer_headers(headers)
            out["Content-Type"] = headers["content-type"]
            out["Cache-Control"] = "no-cache"
            if self._drain_left < 0:
                self.client.begin(200, out)

    def data(self, data: bytes) -> None:
        if self._relay is None:
            self._parts.append(data)
            return
        out = self._relay.feed(data)
        if not out:
            return
        if self._drain_left >= 0:
            self._drain_left -= len(out)
            if self._drain_left < 0:
                self._drained(False)
        elif self.client.send(out):
            self.tally.began()
        else:
            self.client_gone()

    def end(self, err: EngineUnreachable | EngineBroken | None) -> None:
        try:
            if err is None:
                self._whole()
            elif isinstance(err, EngineUnreachable) and self._headers is None:
                self._unplug()
                self._unreached(err)
            else:
                self._broke(err)
        except Exception:
            log.exception("the answer of %s failed", self.plan.model)
            self._crash()

    def _whole(self) -> None:
        assert self.conn is not None and self._target is not None and self.ep is not None
        self.gw.pool.give_back(self.conn, self._target)
        self._unplug()
        relay = self._relay
        if relay is None:
            self._answer_whole(self.ep)
            return
        if self._drain_left >= 0:
            self._drained(True)
            return
        rest = relay.rest()
        if rest and self.client.send(rest):
            self.tally.began()
        self.client.end()
        if isinstance(relay, ResponsesRelay) and relay.response_id:
            self.gw.accounting.remember(relay.response_id, self.plan.model, self.ep,
                                        self.plan.key, relay.usage)
        self.tally.counted(relay.usage)
        self._close(200)

    def _answer_whole(self, ep: Endpoint) -> None:
        assert self._headers is not None
        status, headers, body = self._status, self._headers, b"".join(self._parts)
        if status in (401, 403):
            # The engine refused the replica's key: a deployment fault, never the
            # client's; passing the 401 on would tell the client their key is wrong.
            self.gw.metrics.upstream_errors.labels(self.plan.model, "auth").inc()
            self.reply(error(502, f"The replica of model '{self.plan.model}' refused the "
                             "gateway's engine key.", "server_error",
                             "upstream_auth_failed"))
            return
        out = self._answer_headers(headers)
        if "content-type" in headers:
            out["Content-Type"] = headers["content-type"]
        self.tally.began()
        self.client.whole(status, out, body)
        self.tally.count_whole(status, headers.get("content-type", ""), body, ep)
        self._close(status)

    def _answer_headers(self, engine: Mapping[str, str]) -> dict[str, str]:
        assert self.ep is not None
        out = {"X-Llmgw-Replica": self.ep.replica_id}
        if "x-request-id" in engine:
            out["X-Request-Id"] = engine["x-request-id"]
        if self.plan.limits is not None:
            out.update(self.plan.limits)
        return out

    def _unreached(self, e: EngineUnreachable) -> None:
        """No byte came back: the replica to try next, or the answer."""
        assert self.ep is not None
        upload = self.upload
        if upload is not None and upload.problem is not None:
            p = upload.problem
            self.reply(error(p.status, str(p), "invalid_request_error", p.code))
            return
        if self._kept and not e.timed_out:
            # The engine closed a kept-alive connection as it was reused, and
            # took nothing: another connection to the same replica.
            self._spawn(self._connect())
            return
        model = self.plan.model
        self.gw.metrics.upstream_errors.labels(model, "connect").inc()
        if self.tally.span is not None:
            self.tally.span.add_event(
                "llmgw.upstream_connect_failed",
                {"llmgw.replica_id": self.ep.replica_id, "error": repr(e)},
            )
        self._unreachable.add(self.ep.identity)
        # Not for a request pinned to its replica, nor for an upload the
        # engine began to take (it cannot be read again).
        retry = (self.gw.config.retry_once and len(self._tried) < 2 and self.plan.pinned is None
                 and not (upload is not None and upload.started))
        nxt = None
        if retry:
            nxt = self.gw.replicas.pick(model, self.plan.prefix, frozenset(self._tried))
        if nxt is not None:
            self._send(nxt)
        elif retry and len(self._unreachable) == 1:
            # No other replica: the one that failed is gone before the daemon
            # knew (preempted, crashed). The engine saw nothing, so the request
            # waits, as for a cold start, for another replica or this one's next
            # run (back from the queue, often at the same address: the
            # endpoint's epoch tells the runs apart).
            self._spawn(self._hold(frozenset(self._unreachable)))
        else:
            self.reply(error(502, f"Could not reach a replica of model '{model}' "
                             f"({type(e).__name__}).", "server_error",
                             "upstream_unavailable"))

    def _broke(self, e: EngineUnreachable | EngineBroken) -> None:
        """The engine failed after the answer began: that is passed on, never an ending made up."""
        self._unplug()
        cause = e.cause if isinstance(e, EngineBroken) else type(e).__name__
        model = self.plan.model
        self.gw.metrics.upstream_errors.labels(model, "stream").inc()
        if self._relay is None:
            self.reply(error(502, f"The replica of model '{model}' failed while answering "
                             f"({cause}).", "server_error", "upstream_failed"))
            return
        if self._drain_left >= 0:
            self._drained(False)
            return
        # The incomplete event before the error is dropped: no client could
        # parse it, and it would garble the error.
        self._relay.rest()
        self.client.send(sse_error(f"The replica of model '{model}' failed after the answer "
                                   f"began ({cause}); the answer is incomplete.",
                                   "upstream_failed"))
        self.client.cut()
        self.tally.counted(None)
        self._close(502)

    # the client's side

    def client_gone(self) -> None:
        """The client went away: a stream is read on for its usage, within the
        drain's bounds; anything else stops, and the engine's connection is cut."""
        if self._over or self._drain_left >= 0:
            return
        cfg = self.gw.config
        if self._relay is not None and self.conn is not None and cfg.drain_after_disconnect > 0:
            self._drain_left = cfg.drain_after_disconnect_bytes
            loop = asyncio.get_running_loop()
            self._drain_timer = loop.call_later(cfg.drain_after_disconnect, self._drained, False)
            self.conn.resume()  # nobody reads the client's side any more
            self._unplug()
            self._close(499, finished=False)
            return
        if self._task is not None:
            self._task.cancel()
        if self.conn is not None:
            self.conn.abandon()
        self._unplug()
        self.tally.counted(None)
        self._close(499)

    def client_paused(self) -> None:
        if self.conn is not None and self._drain_left < 0:
            self.conn.pause()

    def client_resumed(self) -> None:
        if self.conn is not None:
            self.conn.resume()

    def _drained(self, whole: bool) -> None:
        """The end of an answer read on for a client gone: its usage counts if it is whole."""
        if self._drain_timer is None:
            return
        self._drain_timer.cancel()
        self._drain_timer = None
        if whole and self._relay is not None:
            self.tally.counted(self._relay.usage)
            return
        self.gw.metrics.upstream_errors.labels(self.plan.model, "drain").inc()
        if self.conn is not None:
            self.conn.abandon()  # never back to the pool: not worth it for a client gone
        self.tally.counted(None)

    # 6. the end

    def reply(self, reply: Reply) -> None:
        """The gateway's own answer to the request (a refusal, an error)."""
        self.client.whole(reply.status, reply.headers, reply.body)
        self.tally.counted(None)
        self._close(reply.status)

    def _unplug(self) -> None:
        """The replica no longer has the request in flight."""
        if self._in_flight and self.ep is not None:
            self._in_flight = False
            self.gw.replicas.ended(self.plan.model, self.ep.replica_id)

    def _close(self, status: int, *, finished: bool = True) -> None:
        if self._over:
            return
        self._over = True
        try:
            self.tally.answered(status)
        finally:
            if finished:
                self.client.finished()

    def _crash(self) -> None:
        if self.conn is not None:
            self.conn.abandon()
        self._unplug()
        self._over = True
        self.client.crashed()
        self.tally.counted(None)
        self.tally.answered(500)

    def _spawn(self, step: Coroutine[Any, Any, None]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._guarded(step))

    async def _guarded(self, step: Coroutine[Any, Any, None]) -> None:
        try:
            await step
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("forwarding a request of %s failed", self.plan.model)
            self._crash()
