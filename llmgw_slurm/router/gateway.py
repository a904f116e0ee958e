"""The OpenAI-compatible gateway: an aiohttp app that routes requests to replicas.

What it does per request, in order: check the gateway key (401), read the
body within the size limit (413), parse it (400), resolve the model or alias
(404), pick the ready replica with the fewest requests in flight or hold the
request until the model has one (429 past the cap, 503 past the deadline),
send the body on with the replica's own engine key, and pass the answer back
chunk by chunk. Token usage from the engine's ``usage`` fields is recorded per
key.

Run it with ``handler_cancellation=True`` on the ``AppRunner`` (or
``web.run_app``): then a client that goes away cancels its handler at once,
which closes the engine connection and stops the generation. Without it,
held requests still notice within ``disconnect_poll`` and streams at their
next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw_slurm.config import RouterConfig
from llmgw_slurm.router._body import with_fields
from llmgw_slurm.router.directory import Endpoint, ModelDirectory
from llmgw_slurm.router.keys import KeyRecord, KeyRing
from llmgw_slurm.router.metrics import GatewayMetrics
from llmgw_slurm.router.usage import UsageRecord, UsageStore

__all__ = ["GATEWAY_KEY", "Gateway", "create_app"]

_tracer = trace.get_tracer("llmgw_slurm")


@dataclass(slots=True)
class _Call:
    t0: float
    model: str | None = None
    status: int = 500
    # Set when the status sent is not what the client saw in the end (a
    # stream cut short: 502; a client gone: 499).
    outcome: int | None = None
    first_byte: float | None = None


def _error(
    status: int,
    message: str,
    type_: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')
# A "usage" key with something other than null: every event that can carry
# token counts has one (possessive, so that the spaces before "null" are not
# given back to let the lookahead pass).
_USAGE_SET = re.compile(rb'"usage"\s*+:\s*+(?!null)')
# A chunk-size line: hex digits, then optional extensions (ignored), as
# RFC 9112 7.1 has it; 64-bit sizes at most.
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}(?=[;\t ]|\r\n)")
_MAX_CHUNK_LINE = 4096


class _SseRelay:
    """Splits an SSE byte stream into events, reads usage, drops unasked usage chunks.

    Events go out as soon as they are complete; the only bytes held back are
    an event's incomplete tail, which the client could not use anyway.
    """

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if (
            not self._buf
            and chunk.endswith((b"\n\n", b"\r\n\r\n"))
            and _USAGE_SET.search(chunk) is None
        ):
            # The common case, a chunk of whole events with no usage in it
            # (or only "usage": null), passes as it is: splitting it into
            # events would cost more than the relay itself.
            return chunk
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        start = 0
        # Events are kept in runs: only one with a usage object in it is
        # looked at, and a dropped one ends a run (a burst of many events, the
        # whole answer in one read, has one usage event among dozens).
        run = 0
        m = _USAGE_SET.search(buf)
        u = m.start() if m else -1
        # The next separator of each kind, -1 for none: each is searched for
        # again only once passed, so that a chunk of many events is scanned
        # once, not once per event.
        i = buf.find(b"\n\n")
        j = buf.find(b"\r\n\r\n")
        while i >= 0 or j >= 0:
            end = i + 2 if j < 0 or (0 <= i < j) else j + 4
            if 0 <= u < end:
                if not self._keep(buf[start:end]):
                    out.append(buf[run:start])
                    run = end
                m = _USAGE_SET.search(buf, end)
                u = m.start() if m else -1
            start = end
            if 0 <= i < start:
                i = buf.find(b"\n\n", start)
            if 0 <= j < start:
                j = buf.find(b"\r\n\r\n", start)
        self._buf = buf[start:]
        if not out:
            return buf[:start] if start < len(buf) else buf
        out.append(buf[run:start])
        return b"".join(out)

    def rest(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        # Parsing every chunk's JSON would cost more than relaying it; only
        # events that carry a usage object are read.
        if b'"usage"' not in event or _USAGE_NULL.search(event):
            return True
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                return True
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if self.strip and obj.get("choices") == []:
                    return False
        return True


class _Pipe(asyncio.Protocol):
    """Moves one streamed answer from the engine's connection to the client's, in callbacks.

    For the length of the answer it stands in for aiohttp's protocol on the
    engine's connection, and each read is written on to the client's
    transport at once (through the SSE relay). The handler only waits for the
    end, or for the client to drain. Relaying with ``iter_any()`` and
    ``StreamResponse.write()`` cost two coroutine wake-ups and aiohttp's
    writer for every event (docs/performance.md, "Gateway").

    Two ways to read. Through aiohttp: each read goes to aiohttp's protocol
    first (its parser undoes the chunked framing), then what the parser gave
    is taken from the response's reader. Raw: once a read ended right after a
    whole chunk (see _at_chunk_end), the pipe undoes the framing itself and
    hands aiohttp only the last chunk, so that its parser ends the message
    and puts the connection back in the pool. Raw saves aiohttp's reader and
    parser, a few microseconds a read; a body that is not chunked is read
    through aiohttp to the end.

    Backpressure: when the client's write buffer passes its high-water mark,
    reading from the engine stops until the client drained it, so a slow
    reader makes the engine wait (TCP) instead of the gateway buffering.
    """

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        client: asyncio.Transport,
        relay: _SseRelay,
        framed: bool,
        call: _Call,
        read_timeout: float | None,
    ) -> None:
        self._content = upstream.content
        conn = upstream.connection
        self._inner = conn.protocol if conn is not None else None
        self._upstream = self._inner.transport if self._inner is not None else None
        self._inner_timeout: float | None = None
        self._client = client
        self._relay = relay
        self._framed = framed
        self._call = call
        self._high = client.get_write_buffer_limits()[1]
        self._loop = asyncio.get_running_loop()
        self._read_timeout = read_timeout
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._installed = False
        # Raw mode: the unread part of a chunk-size line, and what is left of
        # the current chunk (its data, then its CRLF); 0: a size line is next.
        self._raw = False
        self._chunked = False
        self._rbuf = b""
        self._left = 0
        # What the handler reads once woken: the stream ended (cleanly, with
        # `error`, or with the client `gone`), or it is `paused` on the client.
        self.done = False
        self.paused = False
        self.gone = False
        self.error: BaseException | None = None

    def start(self, upstream_chunked: bool) -> None:
        inner, upstream = self._inner, self._upstream
        if inner is not None and upstream is not None and not upstream.is_closing():
            # aiohttp's own read timeout re-arms a timer for every read; the
            # pipe keeps one timer a stream instead (see _check_idle).
            self._inner_timeout = inner.read_timeout
            inner.read_timeout = None
            inner.start_timeout()  # drops the timer already armed
            upstream.set_protocol(self)
            self._installed = True
            # Never raw from the start: aiohttp's parser may have read part
            # of a chunk-size line with the headers, and shows no sign of it.
            self._chunked = upstream_chunked
            self._last_read = self._loop.time()
            if self._read_timeout:
                self._timer = self._loop.call_at(
                    self._last_read + self._read_timeout, self._check_idle
                )
        # Whatever arrived with the headers (all of a short answer, possibly,
        # the connection already back in the pool) is in the reader.
        self._pump()
        if not self.done and not self._installed:
            self._finish(aiohttp.ClientConnectionError("the engine's connection closed"))

    def detach(self) -> None:
        """Give the engine's connection back to aiohttp; safe to call more than once."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._installed:
            return
        self._installed = False
        assert self._inner is not None and self._upstream is not None
        if self._raw:
            # Ended inside the body while reading raw (an error, the client
            # gone): aiohttp's parser missed what was read raw, so the
            # connection must never go back to the pool.
            self._upstream.abort()
        self._inner.read_timeout = self._inner_timeout
        if self._upstream.get_protocol() is self:
            self._upstream.set_protocol(self._inner)
        if self.paused:
            self.paused = False
            # A connection back in the pool must be reading; one being closed
            # does not mind.
            self._upstream.resume_reading()

    async def wait(self) -> None:
        """Until the stream ended or paused."""
        if self.done or self.paused:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def resume(self) -> None:
        """The client drained its buffer: read from the engine again."""
        if self.paused and self._upstream is not None and not self.done:
            self.paused = False
            self._last_read = self._loop.time()
            self._upstream.resume_reading()

    def send(self, data: bytes) -> None:
        """Write to the client (framed as the response is); notes a client gone."""
        if not data:
            return
        client = self._client
        if client.is_closing():
            # Writing to a closed transport is silently dropped (asyncio logs
            # after a few); stop instead, and let the engine's connection be
            # cut, which stops the generation.
            self.gone = True
            self._finish(None)
            return
        client.write(b"%x\r\n%b\r\n" % (len(data), data) if self._framed else data)
        if self._call.first_byte is None:
            self._call.first_byte = time.monotonic()
        if (
            not self.paused
            and not self.done
            and self._installed
            and client.get_write_buffer_size() > self._high
        ):
            assert self._upstream is not None
            self._upstream.pause_reading()
            self.paused = True
            self._wake()

    # asyncio.Protocol, on the engine's connection

    def data_received(self, data: bytes) -> None:
        assert self._inner is not None
        self._last_read = self._loop.time()
        if self._raw:
            self._unchunk(data)
            return
        self._inner.data_received(data)
        self._pump()
        if self._chunked and not self.done and data.endswith(b"\n\r\n"):
            # An aiohttp without the attribute read gets no raw mode.
            self._raw = self._at_chunk_end()

    def _at_chunk_end(self) -> bool:
        """Whether aiohttp's parser stopped right after a whole chunk, so the pipe can go on raw.

        Its reader records where each chunk ended (_http_chunk_splits, kept
        up to what was read): a chunk ends there. The read ended with
        "\n\r\n", which a chunk-size line cannot (its last byte before CRLF
        is a hex digit or part of an extension): so the parser is not past
        the next chunk's header. Events end with a blank line, so a chunk of
        whole events ends like this.
        """
        content = self._content
        splits = getattr(content, "_http_chunk_splits", None)
        if not splits:
            return False
        return bool(
            splits[-1] == content.total_bytes
            and not content.is_eof()
            and content.exception() is None
        )

    def eof_received(self) -> None:
        # None: the transport closes, and connection_lost follows.
        assert self._inner is not None
        self._inner.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        assert self._inner is not None
        self._inner.connection_lost(exc)
        # aiohttp has ended the body (read to the close) or failed it.
        self._pump()
        if not self.done:
            self._finish(aiohttp.ServerDisconnectedError())

    def pause_writing(self) -> None:
        assert self._inner is not None
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        assert self._inner is not None
        self._inner.resume_writing()

    # internals

    def _pump(self) -> None:
        if self.done:
            return
        content = self._content
        try:
            chunk = content.read_nowait()
        except Exception as e:  # the engine failed; an error aiohttp set on the body
            self._finish(e)
            return
        if chunk:
            self.send(self._relay.feed(chunk))
        if content.at_eof() and not self.done:
            self._finish(None)

    def _unchunk(self, data: bytes) -> None:
        buf = self._rbuf + data if self._rbuf else data
        self._rbuf = b""
        out: list[bytes] = []
        pos, n, left = 0, len(buf), self._left
        while pos < n:
            if left > 2:
                take = min(left - 2, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                left -= take
            elif left:
                # The CRLF after a chunk's data, possibly split across reads.
                take = min(left, n - pos)
                if buf[pos : pos + take] != b"\r\n"[2 - left : 2 - left + take]:
                    return self._bad_framing(out, "no CRLF after a chunk")
                pos += take
                left -= take
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > _MAX_CHUNK_LINE:
                        return self._bad_framing(out, "a chunk-size line too long")
                    self._rbuf = buf[pos:]
                    break
                size = _CHUNK_SIZE.match(buf, pos, eol + 2)
                if size is None:
                    return self._bad_framing(out, "a malformed chunk-size line")
                length = int(buf[pos : size.end()], 16)
                if not length:
                    # The last chunk (and any trailers after it): aiohttp's
                    # parser takes it from here, ends the (to it, empty) body
                    # and puts the connection back in the pool.
                    self._left = 0
                    self._raw = False
                    if out:
                        self.send(self._relay.feed(b"".join(out)))
                    assert self._inner is not None
                    if not self.done:
                        self._inner.data_received(buf[pos:])
                        self._pump()
                    return None
                pos = eol + 2
                left = length + 2
        self._left = left
        if out:
            self.send(self._relay.feed(out[0] if len(out) == 1 else b"".join(out)))
        return None

    def _bad_framing(self, out: list[bytes], what: str) -> None:
        if out:
            self.send(self._relay.feed(b"".join(out)))
        self._finish(aiohttp.ClientPayloadError(f"The engine's chunked answer has {what}."))

    def _check_idle(self) -> None:
        self._timer = None
        if self.done or self._read_timeout is None:
            return
        now = self._loop.time()
        due = self._last_read + self._read_timeout
        if self.paused:
            # Waiting on the client is not the engine's silence (resume()
            # restarts the clock).
            due = now + self._read_timeout
        if now < due:
            self._timer = self._loop.call_at(due, self._check_idle)
            return
        self._finish(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))

    def _finish(self, error: BaseException | None) -> None:
        self.done = True
        self.error = error
        # At once: at a clean end aiohttp has put the connection back in the
        # pool, where the next request may take it before the handler runs.
        self.detach()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


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
        usage: UsageStore | None,
        registry: CollectorRegistry,
    ) -> None:
        self.directory = directory
        self.config = config
        self.keys = keys
        self.usage = usage
        self.metrics = GatewayMetrics(directory, registry)
        self.in_flight: dict[tuple[str, str], int] = {}
        self.held: dict[str, int] = {}
        self.held_total = 0
        self._cold_since: dict[str, float] = {}
        self._rr = 0
        self._session: aiohttp.ClientSession | None = None

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
        if self.usage is not None:
            self.usage.start()

    async def _cleanup(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        if self.usage is not None:
            await self.usage.close()

    # helpers

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
        return rec, None

    def _too_large(self) -> web.Response:
        return _error(
            413,
            f"The request body is larger than {self.config.max_body_bytes} bytes.",
            "invalid_request_error",
            "request_too_large",
        )

    def _known_names(self) -> str:
        parts = []
        for m in self.directory.models():
            parts.append(m.name + (f" (aliases: {', '.join(m.aliases)})" if m.aliases else ""))
        return "; ".join(parts) or "none"

    def _pick(
        self,
        model: str,
        exclude: frozenset[str] = frozenset(),
        unreachable: frozenset[tuple[str, str, int]] = frozenset(),
    ) -> Endpoint | None:
        eps = [
            e
            for e in self.directory.endpoints(model)
            if not e.draining and e.replica_id not in exclude and e.identity not in unreachable
        ]
        if not eps:
            return None
        counts = [self.in_flight.get((model, e.replica_id), 0) for e in eps]
        least = min(counts)
        ties = [e for e, c in zip(eps, counts, strict=True) if c == least]
        # Rotate among ties so that an idle model's replicas share the load.
        self._rr += 1
        return ties[self._rr % len(ties)]

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

    async def _hold(
        self,
        request: web.Request,
        model: str,
        unreachable: frozenset[tuple[str, str, int]] = frozenset(),
    ) -> Endpoint | web.Response:
        cfg = self.config
        if self.held.get(model, 0) >= cfg.max_held or self.held_total >= cfg.max_held_total:
            return _error(
                429,
                f"Too many requests are waiting for model '{model}' to start; try again later.",
                "rate_limit_error",
                "too_many_held_requests",
            )
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
            self.held[model] -= 1
            self.held_total -= 1
            self.metrics.held.labels(model).dec()
            if self.held[model] == 0:
                # Nobody is waiting any more: a later start is a new cold start.
                self._cold_since.pop(model, None)

    def _record_usage(
        self, key: KeyRecord | None, model: str, endpoint: str, usage: dict[str, Any] | None
    ) -> None:
        if usage is None:
            return
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
        total = _int(usage.get("total_tokens")) or prompt + completion
        self.metrics.tokens.labels(model, "prompt").inc(prompt)
        self.metrics.tokens.labels(model, "completion").inc(completion)
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

    # handlers

    async def models(self, request: web.Request) -> web.Response:
        _, denied = self._authenticate(request)
        if denied is not None:
            return denied
        data: list[dict[str, Any]] = []
        for m in self.directory.models():
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

    async def _proxy(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        call = _Call(t0=time.monotonic())
        ctx = propagate.extract(request.headers)
        span_cm: contextlib.AbstractContextManager[trace.Span]
        if self.config.trace_requests == "all" or _sampled(ctx):
            span_cm = _tracer.start_as_current_span(
                "llmgw.router.request",
                context=ctx,
                kind=trace.SpanKind.SERVER,
                attributes={
                    "llmgw.endpoint": endpoint,
                    "http.request.method": request.method,
                    "url.path": request.path,
                },
            )
        else:
            span_cm = _attached(ctx)
        with span_cm as span:
            try:
                resp = await self._proxy_inner(request, endpoint, call)
                call.status = call.outcome or resp.status
                return resp
            except asyncio.CancelledError:
                call.status = 499
                raise
            finally:
                label = call.model or "_unknown"
                span.set_attribute("http.response.status_code", call.status)
                self.metrics.requests.labels(label, str(call.status)).inc()
                now = time.monotonic()
                self.metrics.latency.labels(label).observe(now - call.t0)
                if call.first_byte is not None:
                    self.metrics.ttfb.labels(label).observe(call.first_byte - call.t0)

    async def _proxy_inner(
        self, request: web.Request, endpoint: str, call: _Call
    ) -> web.StreamResponse:
        key, denied = self._authenticate(request)
        if denied is not None:
            return denied
        if (request.content_length or 0) > self.config.max_body_bytes:
            return self._too_large()
        try:
            async with asyncio.timeout(self.config.body_timeout):
                raw = await request.read()
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
        try:
            # UTF-8 only, as OpenAI's API has it (json.loads would also take
            # UTF-16, which the splicing below does not handle).
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
        model = self.directory.resolve(name)
        if model is None:
            return _error(
                404,
                f"The model '{name}' does not exist. Known models: {self._known_names()}.",
                "invalid_request_error",
                "model_not_found",
            )
        call.model = model
        trace.get_current_span().set_attribute("llmgw.model", model)

        fields: dict[str, Any] = {}
        if name != model:
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
        if stream and endpoint != "embeddings":
            so = obj.get("stream_options")
            if so is None or (isinstance(so, dict) and so.get("include_usage") is not True):
                # Ask for usage so that it can be counted; the usage-only
                # chunk the client did not ask for is taken out again.
                fields["stream_options"] = {**(so or {}), "include_usage": True}
                strip_usage = True
        body = with_fields(raw, fields) if fields else raw

        ep = self._pick(model)
        if ep is None:
            t_hold = time.monotonic()
            outer = trace.get_current_span()
            if outer.is_recording() or outer.get_span_context().is_valid:
                # Traced already, or the client chose not to be (an unsampled parent).
                held = await self._hold(request, model)
            else:
                # Untraced so far: a cold start is worth a trace of its own (the
                # sampler decides), linked to the replica's start.
                with _tracer.start_as_current_span(
                    "llmgw.router.held",
                    kind=trace.SpanKind.SERVER,
                    attributes={"llmgw.model": model},
                ):
                    held = await self._hold(request, model)
                    trace.get_current_span().set_attribute(
                        "llmgw.held_seconds", time.monotonic() - t_hold
                    )
            trace.get_current_span().set_attribute("llmgw.held_seconds", time.monotonic() - t_hold)
            if isinstance(held, web.Response):
                return held
            ep = held
        return await self._forward(
            request, endpoint, model, ep, body, stream, strip_usage, key, call
        )

    async def _forward(
        self,
        request: web.Request,
        endpoint: str,
        model: str,
        ep: Endpoint,
        body: bytes,
        stream: bool,
        strip_usage: bool,
        key: KeyRecord | None,
        call: _Call,
    ) -> web.StreamResponse:
        assert self._session is not None, "the gateway app was not started"
        tried: set[str] = set()
        unreachable: set[tuple[str, str, int]] = set()
        while True:
            tried.add(ep.replica_id)
            headers = _upstream_headers(request, ep)
            span = trace.get_current_span()
            span.set_attribute("llmgw.replica_id", ep.replica_id)
            key_ = (model, ep.replica_id)
            self.in_flight[key_] = self.in_flight.get(key_, 0) + 1
            self.directory.request_started(model, ep.replica_id)
            try:
                try:
                    # ssl: the replica's pinned certificate (and the gateway's client
                    # one): a listener that took the engine's port fails the handshake
                    # before the request, its key or its prompt is sent.
                    upstream = await self._session.post(
                        f"{ep.base_url.rstrip('/')}/v1/{endpoint}",
                        data=body,
                        headers=headers,
                        ssl=ep.ssl if ep.ssl is not None else True,
                    )
                except (aiohttp.ClientConnectionError, TimeoutError) as e:
                    # Nothing was received: the engine did not see the
                    # request, or died before answering; one retry elsewhere.
                    self.metrics.upstream_errors.labels(model, "connect").inc()
                    span.add_event(
                        "llmgw.upstream_connect_failed",
                        {"llmgw.replica_id": ep.replica_id, "error": repr(e)},
                    )
                    unreachable.add(ep.identity)
                    retry = self.config.retry_once and len(tried) < 2
                    nxt = self._pick(model, frozenset(tried)) if retry else None
                    if nxt is None and retry and len(unreachable) == 1:
                        # No other replica: the one that failed is gone before the daemon
                        # knew (preempted, crashed). The engine saw nothing, so the
                        # request waits, as for a cold start, for another replica or
                        # for this one's next run (back from the queue, often at the
                        # same address: the endpoint's epoch tells the runs apart).
                        held = await self._hold(request, model, frozenset(unreachable))
                        if isinstance(held, web.Response):
                            return held
                        nxt = held
                    if nxt is None:
                        return _error(
                            502,
                            f"Could not reach a replica of model '{model}' ({type(e).__name__}).",
                            "server_error",
                            "upstream_unavailable",
                        )
                    ep = nxt
                    continue
                try:
                    return await self._relay(
                        request, upstream, ep, endpoint, model, stream, strip_usage, key, call
                    )
                finally:
                    # A no-op after a complete read (the connection is back
                    # in the pool by then); otherwise it cuts the engine's
                    # connection, which stops a generation nobody will read.
                    upstream.close()
            finally:
                self.in_flight[key_] -= 1
                if not self.in_flight[key_]:
                    del self.in_flight[key_]
                self.directory.request_finished(*key_)

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
            pipe = _Pipe(upstream, transport, relay, resp.chunked, call, self.config.read_timeout)
            try:
                te = upstream.headers.get("Transfer-Encoding", "")
                pipe.start(upstream_chunked=te.strip().lower() == "chunked")
                while not pipe.done:
                    await pipe.wait()
                    if pipe.paused and not pipe.done:
                        await writer.drain()
                        pipe.resume()
            finally:
                pipe.detach()
            if pipe.gone:
                call.outcome = call.outcome or 499
                return resp
            e = pipe.error
            if e is not None:
                if not isinstance(
                    e, (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError)
                ):
                    raise e
                # The engine failed after the answer began: pass that on, an
                # answer cut short, instead of inventing an ending. First an
                # error event, as vLLM sends when it fails mid-answer
                # (OpenAI's clients raise it with its message, where a bare
                # cut reads "Connection error"); the incomplete event before
                # it is dropped, as no client could parse it and it would
                # garble the error.
                self.metrics.upstream_errors.labels(model, "stream").inc()
                call.outcome = 502
                relay.rest()
                pipe.send(
                    _sse_error(
                        f"The replica of model '{model}' failed after the answer "
                        f"began ({type(e).__name__}); the answer is incomplete.",
                        "upstream_failed",
                    )
                )
                transport.abort()
                return resp
            pipe.send(relay.rest())
            if pipe.gone:
                call.outcome = call.outcome or 499
                return resp
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away (aiohttp raises a subclass of this on
            # writes to a closed connection); the engine's connection is cut
            # by the caller, which stops the generation.
            call.outcome = call.outcome or 499
            return resp
        self._record_usage(key, model, endpoint, relay.usage)
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
        out_headers = {"X-Llmgw-Replica": ep.replica_id}
        if "X-Request-Id" in upstream.headers:
            out_headers["X-Request-Id"] = upstream.headers["X-Request-Id"]
        if upstream.status == 200 and ctype.startswith("text/event-stream"):
            resp = web.StreamResponse(
                status=200,
                headers={**out_headers, "Content-Type": ctype, "Cache-Control": "no-cache"},
            )
            return await self._relay_stream(
                request, upstream, resp, _SseRelay(strip_usage), endpoint, model, key, call
            )

        if upstream.status in (401, 403):
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
        try:
            data = await upstream.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
            self.metrics.upstream_errors.labels(model, "stream").inc()
            return _error(
                502,
                f"The replica of model '{model}' failed while answering ({type(e).__name__}).",
                "server_error",
                "upstream_failed",
            )
        if upstream.status == 200 and ctype.startswith("application/json"):
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                self._record_usage(key, model, endpoint, parsed["usage"])
        if ctype:
            out_headers["Content-Type"] = ctype
        call.first_byte = time.monotonic()
        return web.Response(status=upstream.status, body=data, headers=out_headers)


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


def _upstream_headers(request: web.Request, ep: Endpoint) -> dict[str, str]:
    headers = {
        # The replica's engine key, never the client's gateway key.
        "Authorization": f"Bearer {ep.api_key}",
        "Content-Type": "application/json",
        "Accept": request.headers.get("Accept", "*/*"),
        "Accept-Encoding": "identity",
    }
    if "X-Request-Id" in request.headers:
        headers["X-Request-Id"] = request.headers["X-Request-Id"]
    propagate.inject(headers)
    return headers


def create_app(
    directory: ModelDirectory,
    config: RouterConfig | None = None,
    *,
    keys: KeyRing | None = None,
    usage: UsageStore | None = None,
    registry: CollectorRegistry | None = None,
) -> web.Application:
    """The gateway as an aiohttp app.

    ``keys``: None serves without keys (anyone who can reach the port may use
    it); otherwise every ``/v1`` request needs a key from the ring. ``usage``:
    where per-key token usage goes (started and closed with the app).
    ``registry``: the Prometheus registry for ``/metrics``; a new one when None.
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
    app.router.add_get("/metrics", gw.metrics_handler)
    return app


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
