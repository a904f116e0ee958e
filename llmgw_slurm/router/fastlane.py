"""The gateway's fast lane: the commonest request served without aiohttp's server.

A chat, completion or embedding request that finds a ready replica is most
of what the gateway serves, and aiohttp's per-request
machinery (a request object, a payload stream, a task per request, a response
prepared and written in pieces) cost it about 250 µs of CPU and 0.15 ms of
latency, against a bare asyncio protocol (docs/performance.md). The lane
parses the request itself, lets :meth:`Gateway.lane_plan` decide whether it
can serve it, and writes the answer in one piece: from the engine
connection's own callback when the request went on a kept-alive one
(:meth:`Gateway.lane_send`), else from a task (:meth:`Gateway.serve_lane`).
A stream is served from a task, its events written as the engine's
connection hands them over (``relay.LaneSink``).

It serves only what it can serve exactly as aiohttp's path would, and gives
every other connection to aiohttp, bytes and all, before it has read or
answered anything of the request in question: a head that did not come whole
or is not strictly the HTTP/1.1 the lane knows (chunked or encoded bodies,
``Expect``, ``Upgrade``, folded or non-ASCII headers, two Content-Lengths, no
Host or two), another method or path, and whatever :meth:`Gateway.lane_plan`
refuses (every refusal, a cold start, a traced request). Once given away, a
connection stays with aiohttp. So aiohttp's parser remains the judge of
anything unusual, and a request is never read two ways.

:class:`Runner` is an ``AppRunner`` whose server is the lane, with aiohttp's
server behind it.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from multidict import CIMultiDict

from llmgw_slurm.guard.accept import hand_over
from llmgw_slurm.router.gateway import GATEWAY_KEY, Gateway, LaneCall, LanePlan, Whole
from llmgw_slurm.router.relay import LaneSink

__all__ = ["Runner", "parse_head"]

log = logging.getLogger(__name__)

# The paths the lane serves, and their endpoint names (surface.upstream_path's).
_PATHS = {
    b"/v1/chat/completions": "chat/completions",
    b"/v1/completions": "completions",
    b"/v1/embeddings": "embeddings",
}
# Longest head the lane reads (aiohttp's own limit on one line is 8190 bytes).
MAX_HEAD = 8190
_MAX_FIELDS = 64
# The header fields, each line ended by CRLF: a name that is a token (RFC 9110
# 5.6.2), a colon, a value of printable ASCII and tabs. One match for all of
# them: a folded line (it starts with a space), a bare CR or LF, a control
# character or a byte past ASCII fails it.
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e]*\r\n)*")
# Headers that change how the body or the connection is read: aiohttp's.
_NOT_OURS = frozenset(
    {"transfer-encoding", "content-encoding", "expect", "upgrade", "te", "trailer"}
)


class Head:
    """A request head the lane takes: its endpoint, headers and body length."""

    __slots__ = ("endpoint", "headers", "length", "size")

    def __init__(self, endpoint: str, headers: CIMultiDict[str], length: int, size: int) -> None:
        self.endpoint = endpoint
        self.headers = headers
        self.length = length
        self.size = size  # the head's bytes, the blank line included


def parse_head(buf: bytes, max_body: int) -> Head | None:
    """The head at the start of ``buf`` (which holds it whole, up to and with
    its blank line), or None when it is not one the lane takes."""
    end = buf.find(b"\r\n\r\n")
    if end < 0 or end > MAX_HEAD:
        return None
    line_end = buf.find(b"\r\n")
    # The request line: exactly these bytes, so nothing else in it to check.
    method, _, rest = buf[:line_end].partition(b" ")
    target, _, version = rest.partition(b" ")
    endpoint = _PATHS.get(target)
    if method != b"POST" or endpoint is None or version != b"HTTP/1.1":
        return None
    fields = buf[line_end + 2 : end + 2]
    if not _FIELDS.fullmatch(fields):
        return None
    lines = fields.decode("ascii").split("\r\n")
    del lines[-1]  # after the last CRLF
    if len(lines) > _MAX_FIELDS:
        return None
    headers: CIMultiDict[str] = CIMultiDict()
    length: int | None = None
    hosts = 0  # HTTP/1.1 needs one (RFC 9112 3.2): aiohttp refuses none with a 400
    for line in lines:
        name, _, value = line.partition(":")
        lname = name.lower()
        value = value.strip(" \t")
        if lname in _NOT_OURS:
            return None
        if lname == "connection" and value.lower() != "keep-alive":
            return None
        if lname == "content-length":
            if length is not None or not value.isdigit() or len(value) > 18:
                return None
            length = int(value)
        elif lname == "host":
            if hosts:
                return None
            hosts = 1
        headers.add(name, value)
    if length is None or length > max_body or not hosts:
        return None
    return Head(endpoint, headers, length, end + 4)


_IDLE, _BODY, _BUSY, _GONE = range(4)


class _Lane(asyncio.Protocol):
    """One client connection, until it closes or is given to aiohttp."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._gw = runner.gateway
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._state = _IDLE
        self._head: Head | None = None
        self._timer: asyncio.TimerHandle | None = None
        # What the timer is for: _IDLE (the keep-alive), _BODY (the body timeout).
        self._timer_for: int | None = None
        # The request under way: on a kept-alive connection (Gateway.lane_send),
        # or in a task (Gateway.serve_lane).
        self._call: LaneCall | None = None
        self.task: asyncio.Task[None] | None = None
        self._stream: LaneSink | None = None  # a streamed answer under way
        self._served_waiter: asyncio.Future[None] | None = None
        self._advancing = False
        self._paused = False
        self._answered = False  # the request under way has had its answer
        self._idle_since = 0.0  # when the connection last became idle (the loop's clock)

    # what the gateway's whole-answer path asks of a client (gateway.Client)

    @property
    def headers(self) -> CIMultiDict[str]:
        assert self._head is not None
        return self._head.headers

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._runner.lanes.add(self)
        self._idle_since = self._loop.time()
        self._arm(self._runner.keepalive_timeout)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._state == _BUSY:
            if len(self._buf) > MAX_HEAD + self._gw.config.max_body_bytes and not self._paused:
                # A client that sends on before its answer: read on once it has it.
                self._paused = True
                self._transport().pause_reading()
            return
        self._advance()

    def eof_received(self) -> bool:
        return False  # close: connection_lost stops what is under way

    def pause_writing(self) -> None:
        # The client reads slower than the engine writes: the engine waits
        # (TCP), not the gateway's memory.
        if self._stream is not None:
            self._stream.pause()

    def resume_writing(self) -> None:
        if self._stream is not None:
            self._stream.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = _GONE
        self._stream = None
        self._runner.lanes.discard(self)
        self._disarm()
        # As aiohttp's handler_cancellation: the engine's connection is cut.
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._settle_served()

    # the request

    def _advance(self) -> None:
        """Take the requests the buffer holds, while each is answered at once."""
        if self._advancing:
            return  # an answer given within the loop below: the loop reads on
        self._advancing = True
        try:
            while True:
                self._take_request()
                if self._state != _IDLE or not self._buf:
                    return
        finally:
            self._advancing = False

    def _take_request(self) -> None:
        if self._state == _IDLE and self._buf:
            head = parse_head(bytes(self._buf[: MAX_HEAD + 4]), self._gw.config.max_body_bytes)
            if head is None:
                self._hand_off()
                return
            self._head, self._state = head, _BODY
        if self._state == _BODY:
            head = self._head
            assert head is not None
            end = head.size + head.length
            if len(self._buf) < end:
                if self._timer_for != _BODY:
                    self._arm(self._gw.config.body_timeout, _BODY)
                return
            raw = bytes(self._buf[head.size : end])
            plan = self._gw.lane_plan(head.endpoint, head.headers, raw)
            if plan is None:
                self._hand_off()
                return
            del self._buf[:end]
            if self._timer_for == _BODY:
                self._disarm()
            # A keep-alive timer is left to run (see _expired): cancelling it
            # and arming a new one each request costs more than the request's
            # own checks on a cold CPU.
            self._state = _BUSY
            self._answered = False
            self._call = self._gw.lane_send(plan, self)

    # what the gateway asks of the lane for a request it planned (gateway.LaneClient)

    def answer(self, resp: web.Response | Whole, then: Callable[[], None] | None = None) -> None:
        self._call = None
        self._send(resp)
        if then is not None:
            then()
        self._served()

    def fall_back(self, plan: LanePlan, failed: BaseException | None) -> None:
        self._call = None
        self.task = self._loop.create_task(self._serve(plan, failed))

    def crashed(self, plan: LanePlan) -> None:
        # A bug, not the client's doing: aiohttp would answer 500 (unless
        # the answer went out already: a second one would be read as the
        # next request's); the connection is in an unknown state, so it closes.
        log.exception("fast lane: %s failed", plan.endpoint)
        self._call = None
        if self._answered:
            self._state = _GONE
            self._transport().close()
            return
        failed = web.Response(status=500, text="500 Internal Server Error")
        self._write(_serialize(failed, keep_alive=False), keep_alive=False)

    async def _serve(self, plan: LanePlan, failed: BaseException | None) -> None:
        try:
            await self._gw.serve_lane(plan, self, self._deliver, failed)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.crashed(plan)
            return
        self._served()

    # a streamed answer (relay.StreamClient)

    def begin_stream(self, headers: dict[str, str], sink: LaneSink) -> None:
        self._stream = sink
        self._answered = True
        self._write(_head_bytes(200, "OK", headers, "Transfer-Encoding: chunked"), keep_alive=True)

    def write_chunk(self, data: bytes) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    def end_stream(self) -> None:
        self._stream = None
        self._write(b"0\r\n\r\n", keep_alive=True)

    def cut(self) -> None:
        self._stream = None
        self._state = _GONE
        self.close()

    def until_served(self) -> asyncio.Future[None] | None:
        """Done once the request under way is answered (or the client gone);
        None: no request is under way."""
        if self._state != _BUSY:
            return None
        if self._served_waiter is None:
            self._served_waiter = self._loop.create_future()
        return self._served_waiter

    def _settle_served(self) -> None:
        waiter, self._served_waiter = self._served_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _served(self) -> None:
        """The request's answer is out: on to the next one."""
        self._settle_served()
        if self._state != _BUSY:
            return
        self._state = _IDLE
        self._head = None
        self._idle_since = self._loop.time()
        if self._timer is None:
            self._arm(self._runner.keepalive_timeout)
        if self._paused:
            self._paused = False
            self._transport().resume_reading()
        if self._buf:
            self._advance()

    async def _deliver(self, resp: web.Response) -> web.Response:
        self._send(resp)
        return resp

    def _send(self, resp: web.Response | Whole) -> None:
        keep = resp.keep_alive is not False
        data = _serialize(resp, keep)
        self._answered = True
        self._write(data, keep_alive=keep)

    def _write(self, data: bytes, *, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if not keep_alive:
            self._state = _GONE
            transport.close()

    def _hand_off(self) -> None:
        """Give the connection, and every byte of it not yet answered, to aiohttp."""
        self._disarm()
        self._state = _GONE
        self._runner.lanes.discard(self)
        transport = self._transport()
        handler = self._runner.aiohttp_server()
        # Not set_protocol: the connection's guard (its place among the
        # gateway's connections) stays in between.
        hand_over(transport, handler)
        handler.connection_made(transport)
        if self._paused:
            transport.resume_reading()
        data, self._buf = bytes(self._buf), bytearray()
        if data:
            handler.data_received(data)

    # timers: a connection idle past the keep-alive timeout, or a body slower
    # than the body timeout

    def _arm(self, seconds: float | None, purpose: int = _IDLE) -> None:
        self._disarm()
        if seconds:
            self._timer = self._loop.call_later(seconds, self._expired)
            self._timer_for = purpose

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_for = None

    def _expired(self) -> None:
        purpose = self._timer_for
        self._timer = self._timer_for = None
        if self._state == _BODY and purpose == _BODY:
            timeout = self._gw.config.body_timeout
            self._write(_serialize(_body_timeout(timeout), keep_alive=False), keep_alive=False)
            return
        # The keep-alive timer, armed when the connection was idle once and
        # left running since: close only if it has been idle that long now.
        keepalive = self._runner.keepalive_timeout
        if self._state in (_BODY, _BUSY):
            self._arm(keepalive)
        elif self._state == _IDLE and self.transport is not None:
            left = self._idle_since + keepalive - self._loop.time()
            if left > 0:
                self._arm(left)
            else:
                self._state = _GONE
                self.transport.close()

    def _transport(self) -> asyncio.Transport:
        assert self.transport is not None
        return self.transport

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _body_timeout(seconds: float) -> web.Response:
    # The gateway's own 408 (Gateway._read_body's), for a body that stopped coming.
    body = {
        "error": {
            "message": f"The request body did not arrive within {seconds:g} s.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
    return web.json_response(body, status=408)


# A dict, not HTTPStatus(status): an enum's lookup by value costs a few
# microseconds a call, more on a cold CPU.
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class _Date:
    """The Date header's value, made at most once a second."""

    second = -1
    value = ""

    @classmethod
    def now(cls) -> str:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, email.utils.formatdate(t, usegmt=True)
        return cls.value


def _serialize(resp: web.Response | Whole, keep_alive: bool) -> bytes:
    """``resp`` as HTTP/1.1 bytes, with the headers aiohttp would give it."""
    body = resp.body
    if not isinstance(body, bytes):
        raise TypeError(f"the fast lane writes bytes bodies, not {type(body).__name__}")
    status = resp.status
    reason = (
        _REASONS.get(status)
        or (resp.reason if isinstance(resp, web.Response) else None)
        or "Unknown"
    )
    framing = f"Content-Length: {len(body)}"
    return _head_bytes(status, reason, resp.headers, framing, keep_alive) + body


def _head_bytes(
    status: int, reason: str, headers: Mapping[str, str], framing: str, keep_alive: bool = True
) -> bytes:
    """An answer's head: ``framing``, its Content-Length or Transfer-Encoding line."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"a header with a line break: {name!r}")
        if name.lower() in ("content-length", "connection", "date", "transfer-encoding"):
            continue
        lines.append(f"{name}: {value}")
    lines.append(framing)
    lines.append(f"Date: {_Date.now()}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


class Runner(web.AppRunner):
    """An ``AppRunner`` for the gateway app whose connections come to the lane
    first; its sites (``TCPSite``, ``SockSite``) are aiohttp's own."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.gateway: Gateway = app[GATEWAY_KEY]
        self.keepalive_timeout: float = kwargs.get("keepalive_timeout", 75.0)
        self.lanes: set[_Lane] = set()
        self._aiohttp: web.Server | None = None

    def aiohttp_server(self) -> RequestHandler:
        assert self._aiohttp is not None
        return self._aiohttp()

    async def _make_server(self) -> web.Server:
        self._aiohttp = await super()._make_server()
        if not self.gateway.config.fast_lane:
            return self._aiohttp
        return cast(web.Server, _LaneServer(self, self._aiohttp))

    async def shutdown(self) -> None:
        await super().shutdown()
        # As aiohttp's server: answers under way may finish, within the timeout.
        busy = [w for w in (lane.until_served() for lane in self.lanes) if w is not None]
        if busy:
            await asyncio.wait(busy, timeout=self._shutdown_timeout)
        for lane in list(self.lanes):
            lane.close()


class _LaneServer:
    """What a site serves: the lane as the protocol, aiohttp's server for the rest."""

    def __init__(self, runner: Runner, server: web.Server) -> None:
        self._runner = runner
        self._server = server

    def __call__(self) -> _Lane:
        return _Lane(self._runner)

    def __getattr__(self, name: str) -> Any:
        # pre_shutdown, shutdown, connections, requests_count: aiohttp's.
        return getattr(self._server, name)
