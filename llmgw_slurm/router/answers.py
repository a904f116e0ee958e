"""The answers the gateway makes itself, in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["Reply", "client_closed", "error", "sse_error"]

_JSON = "application/json; charset=utf-8"


class Reply(NamedTuple):
    """A whole answer (a tuple: made once a request)."""

    status: int
    headers: dict[str, str]
    body: bytes


def _body(message: str, type_: str, code: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()


def error(
    status: int, message: str, type_: str, code: str, headers: Mapping[str, str] | None = None
) -> Reply:
    return Reply(status, {**(headers or {}), "Content-Type": _JSON},
                 _body(message, type_, code))


def sse_error(message: str, code: str) -> bytes:
    """The event that ends a stream cut short, as vLLM sends when it fails
    mid-answer: OpenAI's clients raise it with its message, where a bare cut
    reads "Connection error"."""
    return b"data: " + _body(message, "server_error", code) + b"\n\n"


def client_closed() -> Reply:
    return error(499, "Client closed the request.", "client_closed", "client_closed")
