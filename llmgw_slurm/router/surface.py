"""The endpoints beyond chat, completions and embeddings: their paths, bodies and state.

What each needs of the gateway that the first three did not:

- ``/v1/responses`` reports usage as ``input_tokens``/``output_tokens``, inside
  the ``response.completed`` event when streamed; and a response the engine
  stored (``store``) lives in that one engine's memory, so a request that
  continues it (``previous_response_id``) must go to the replica that made it.
  :class:`ResponseHomes` remembers where each response was made.
- ``/tokenize``, ``/detokenize``, ``/rerank`` sit outside ``/v1`` on vLLM.
- ``/v1/audio/*`` take ``multipart/form-data`` with the model as a form field
  and an audio file that may be large: :func:`read_model_field` reads only as
  far as the model field, and :class:`Upload` streams the rest on.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from llmgw_slurm.catalog import RESPONSES_STORE_ENV

__all__ = [
    "ROUTES",
    "ModelField",
    "ResponseHomes",
    "Route",
    "Upload",
    "UploadProblem",
    "read_model_field",
    "upstream_path",
]


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: its catalog name, the gateway's paths for it, the engine's path."""

    name: str
    paths: tuple[str, ...]
    upstream: str
    multipart: bool = False


ROUTES = (
    Route("responses", ("/v1/responses",), "/v1/responses"),
    # vLLM serves both, and Jina's and Cohere's clients use the one without /v1.
    Route("rerank", ("/v1/rerank", "/rerank"), "/v1/rerank"),
    Route("score", ("/v1/score",), "/v1/score"),
    Route("tokenize", ("/tokenize",), "/tokenize"),
    Route("detokenize", ("/detokenize",), "/detokenize"),
    Route(
        "audio/transcriptions",
        ("/v1/audio/transcriptions",),
        "/v1/audio/transcriptions",
        multipart=True,
    ),
    Route(
        "audio/translations", ("/v1/audio/translations",), "/v1/audio/translations", multipart=True
    ),
)
_UPSTREAM = {r.name: r.upstream for r in ROUTES}

# Which endpoints stream with OpenAI's chat chunks, where the gateway asks for
# the usage chunk (stream_options) and takes it out again.
STREAM_USAGE_ENDPOINTS = frozenset({"chat/completions", "completions"})


def upstream_path(endpoint: str) -> str:
    """The engine's path for an endpoint name."""
    return _UPSTREAM.get(endpoint) or f"/v1/{endpoint}"


@dataclass(frozen=True, slots=True)
class Home:
    """Where a response was made: its model, and one run of one replica."""

    model: str
    replica_id: str
    epoch: int
    # The key that made it (its key_id; "" without keys): only it may reach it.
    owner: str = ""
    # Whether its usage was recorded: not yet for a background response,
    # whose tokens count when a retrieval first shows it completed.
    counted: bool = True


class ResponseHomes:
    """Response id -> the replica run that holds it, the newest ``capacity`` kept.

    In memory only: an engine's stored responses die with it, and a gateway
    restart forgets where they were; both give the client a clear 400
    instead of a request sent to a replica that never saw the response.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, Home] = OrderedDict()

    def remember(self, response_id: str, home: Home) -> None:
        self._homes[response_id] = home
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def get(self, response_id: str) -> Home | None:
        return self._homes.get(response_id)

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._homes)


class Body(Protocol):
    """A request body read as it arrives (the server's ``BodyStream``)."""

    async def readany(self) -> bytes:
        """The next bytes of it; b"" at its end."""


class UploadProblem(Exception):
    """What is wrong with a multipart body, for a 4xx: ``status`` and the client's message."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class ModelField:
    """The start of a multipart body, as read: its model field and what came with it."""

    head: bytes
    model: str
    # Where the model's value is in ``head``, to put the model's own name in.
    start: int
    end: int

    def with_model(self, name: str) -> bytes:
        return self.head[: self.start] + name.encode() + self.head[self.end :]


_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_DISPOSITION = re.compile(
    rb'^content-disposition:[^\r\n]*;\s*name="?model"?\s*(?:;|\r?$)', re.IGNORECASE | re.MULTILINE
)


def multipart_boundary(content_type: str) -> bytes | None:
    if not content_type.lower().startswith("multipart/form-data"):
        return None
    m = _BOUNDARY.search(content_type)
    if m is None:
        return None
    return (m.group(1) or m.group(2)).encode()


def _find_model(buf: bytes, boundary: bytes) -> ModelField | None:
    """The model field, once ``buf`` holds all of it; None until then.

    Raises :class:`UploadProblem` when the body ended (its closing boundary
    seen) without one.
    """
    delim = b"--" + boundary
    pos = buf.find(delim)
    while pos >= 0:
        after = pos + len(delim)
        if buf[after : after + 2] == b"--":
            raise UploadProblem(
                400,
                "The form has no 'model' field; GET /v1/models lists the models.",
                "missing_model",
            )
        head_end = buf.find(b"\r\n\r\n", after)
        if head_end < 0:
            return None
        nxt = buf.find(b"\r\n" + delim, head_end)
        if nxt < 0:
            return None
        if _DISPOSITION.search(buf, after, head_end + 2):
            start, end = head_end + 4, nxt
            try:
                name = buf[start:end].decode("utf-8").strip()
            except UnicodeDecodeError:
                name = ""
            if not name:
                raise UploadProblem(
                    400, "The form's 'model' field is empty or not UTF-8.", "missing_model"
                )
            # All that was read, past the field too: the rest of the body follows it.
            return ModelField(buf, name, start, end)
        pos = nxt + 2
    return None


async def read_model_field(
    content: Body, boundary: bytes, limit: int, timeout: float
) -> ModelField:
    """Read a multipart body as far as its model field (at most ``limit`` bytes)."""
    buf = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await content.readany()
        except TimeoutError:
            raise UploadProblem(
                408,
                f"The form's 'model' field did not arrive within {timeout:g} s.",
                "request_timeout",
            ) from None
        if not chunk:
            raise UploadProblem(400, "The form ended without a 'model' field.", "missing_model")
        buf += chunk
        found = _find_model(buf, boundary)
        if found is not None:
            return found
        if len(buf) > limit:
            raise UploadProblem(
                400,
                f"No 'model' field in the form's first {limit} bytes: send the model "
                "before the file (OpenAI's clients do).",
                "missing_model",
            )


class Upload:
    """A multipart body sent on as it arrives: the head already read, then the rest.

    ``started``: the engine's connection began taking it, so it cannot be
    sent again elsewhere. ``problem``: why the stream was cut (too large, too
    slow), for the answer to the client.
    """

    def __init__(self, head: bytes, content: Body, limit: int, idle_timeout: float) -> None:
        self.head = head
        self._content = content
        self._limit = limit
        self._idle = idle_timeout
        self.started = False
        self.problem: UploadProblem | None = None

    async def stream(self) -> AsyncIterator[bytes]:
        self.started = True
        yield self.head
        sent = len(self.head)
        while True:
            try:
                async with asyncio.timeout(self._idle):
                    chunk = await self._content.readany()
            except TimeoutError:
                self.problem = UploadProblem(
                    408,
                    f"The upload stalled for {self._idle:g} s.",
                    "request_timeout",
                )
                raise self.problem from None
            if not chunk:
                return
            sent += len(chunk)
            if sent > self._limit:
                self.problem = UploadProblem(
                    413,
                    f"The upload is larger than {self._limit} bytes.",
                    "request_too_large",
                )
                raise self.problem
            yield chunk


def not_stored_message(rid: str, model: str) -> str:
    """Why a response of ``model`` (whose engine keeps none) cannot be had, and the fix."""
    return (
        f"Response '{rid}' was not kept by model '{model}': its engine, vLLM, keeps "
        f"responses only when started with {RESPONSES_STORE_ENV}=1, which the model's "
        f'catalog entry does not set (engine.env: {{{RESPONSES_STORE_ENV}: "1"}}); ask '
        "the admin to set it. Until then send the whole conversation as input (a "
        "response made with store: false is never kept either)."
    )
