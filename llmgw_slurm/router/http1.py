"""HTTP/1.1 as the gateway writes it, on both sides; reading is httptools' (llhttp).

Why httptools: it is llhttp, the parser under Node.js and uvicorn, kept up by
people who fix request smuggling for a living, strict by default (two
Content-Lengths, signed or underscored lengths, Content-Length with
Transfer-Encoding, obs-fold, bad status lines and chunk sizes are errors), and
the fastest of those measured here (docs/architecture.md). aiohttp's parser is
llhttp too, but reachable only through its private classes; h11 is pure Python
and eight times slower. The few checks llhttp leaves to its user are made by
the two readers (``server``, ``engine``): Host, the Transfer-Encoding an engine
may use, the HTTP version, the size of a head.

This module writes: a response head, a request head, and the one chunked encoder
(the one decoder is llhttp's, on both sides).
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Iterable
from http import HTTPStatus
from typing import ClassVar

import httptools

__all__ = ["LAST_CHUNK", "chunk", "request_head", "response_head", "unwrap"]

# The longest head either reader takes (aiohttp's own limit is 8190 bytes a
# line; an engine's head is a few hundred bytes).
MAX_HEAD = 64 * 1024
LAST_CHUNK = b"0\r\n\r\n"
# A dict, not HTTPStatus(status): an enum's lookup by value costs microseconds.
_REASONS = {s.value: s.phrase for s in HTTPStatus}


def unwrap(e: BaseException) -> BaseException:
    """What a parser callback raised (httptools wraps it), or ``e``."""
    if isinstance(e, httptools.HttpParserCallbackError) and e.__context__ is not None:
        return e.__context__
    return e


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (never empty: that is the last chunk)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Date:
    """The Date header's value, made at most once a second."""

    # State of the class, not of an instance (an instance is never made).
    second: ClassVar[int] = -1
    value: ClassVar[str] = ""

    @classmethod
    def now(cls) -> str:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, email.utils.formatdate(t, usegmt=True)
        return cls.value


def _lines(
    lines: list[str], headers: Iterable[tuple[str, str]], tail: tuple[str, ...] = ()
) -> bytes:
    """A head: its first lines, ``headers`` (never the framing ones: the writer's),
    then ``tail``."""
    pairs = [f"{n}: {v}" for n, v in headers]
    fields = "\n".join(pairs)
    # Values come from clients and engines (X-Request-Id): never split a line.
    if "\r" in fields or fields.count("\n") != max(len(pairs) - 1, 0):
        raise ValueError("a header with a line break")
    if pairs:
        lines.append(fields.replace("\n", "\r\n"))
    lines.extend(tail)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


def response_head(
    status: int,
    headers: Iterable[tuple[str, str]],
    length: int | None,
    keep_alive: bool = True,
    http11: bool = True,
) -> bytes:
    """An answer's head; ``length`` None: chunked (HTTP/1.1) or to the close (1.0),
    whose clients get their own version back."""
    lines = [f"HTTP/1.{int(http11)} {status} {_REASONS.get(status, 'Unknown')}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    elif http11:
        lines.append("Transfer-Encoding: chunked")
    lines.append(f"Date: {_Date.now()}")
    if not keep_alive:
        lines.append("Connection: close")
    elif not http11:
        lines.append("Connection: keep-alive")
    return _lines(lines, headers)


def request_head(
    method: str, target: str, netloc: str, headers: Iterable[tuple[str, str]], length: int | None
) -> bytes:
    """A request's head for an engine; ``length`` None: a chunked body."""
    framing: tuple[str, ...] = ()
    if length is None:
        framing = ("Transfer-Encoding: chunked",)
    elif length or method not in ("GET", "HEAD", "DELETE"):
        framing = (f"Content-Length: {length}",)
    return _lines([f"{method} {target} HTTP/1.1", f"Host: {netloc}"], headers, framing)
