"""A small OpenAI-compatible engine for tests and benchmarks.

It answers like vLLM's OpenAI server does, in the parts the gateway and the
agent rely on: ``/health``, ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` (plain and streamed as server-sent events ending with
``data: [DONE]``, with ``stream_options.include_usage``), ``/v1/embeddings``,
``/v1/responses`` (plain and streamed as vLLM's typed events; ``store`` and
``previous_response_id`` as vLLM keeps them, in this process's memory;
``background`` (not streamed), ``GET /v1/responses/{id}`` (a stream replay
cut, as vLLM's of a response not made streamed) and its ``/cancel``, and as
vLLM no DELETE and no ``input_items``),
``/v1/rerank`` and ``/rerank``, ``/v1/score``, ``/tokenize``, ``/detokenize``,
``/v1/audio/transcriptions`` and ``/translations`` (multipart, read as it
arrives: ``/debug/stats`` shows ``upload_bytes``, the file bytes received so
far), and the ``Authorization: Bearer KEY`` check. Its output is deterministic: the
completion repeats the words of the prompt, one word per token, so tests can
assert on exact text and token counts.

Two test hooks, absent from real engines:

- ``GET /debug/last-headers`` returns the headers of the last ``/v1`` request
  (so a test can see the ``traceparent`` and the key the gateway sent),
  ``GET /debug/last-body`` the last JSON body, ``GET /debug/stats`` request
  counters and the tokens it made (``prompt_tokens``, ``completion_tokens``,
  as vLLM's own metrics count them: a token streamed is counted whether
  anyone reads it or not).
- a request body field ``"test_abort_after": N`` makes a streamed answer drop
  the connection after N tokens, to test failures after the first byte.

With ``--rendezvous`` it takes part in a multi-node start the way a
torchrun-style engine does, from ``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK`` and ``WORLD_SIZE`` (what the agent sets for command engines):
rank 0 listens on ``MASTER_PORT`` and answers ``/health`` with 503 until every
other rank has connected and said its rank (a TCP barrier), and
``/debug/stats`` lists the ranks it saw; a rank above 0 serves no HTTP,
connects to the master (retrying), says its rank, and idles until the master
goes away, then exits 0.

Like a real engine, it rejects what it does not know: another model name is a
404, ``n`` other than 1 is a 400, a body that is not a JSON object is a 400.

Run: ``LLMGW_ENGINE_API_KEY=K python -m llmgw_slurm.testing.engine --port 8001 --served-name tiny``.
The key comes from ``--api-key`` or, without it, from ``LLMGW_ENGINE_API_KEY``
(what the agent sets): a command line is readable by every user of a node.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import ssl
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

from llmgw_slurm.agent.engine import API_KEY_ENV

__all__ = ["EngineOptions", "create_engine_app", "main"]

_DEFAULT_MAX_TOKENS = 8
_EMBEDDING_DIM = 8


class EngineOptions:
    """What one test engine serves and how slowly."""

    def __init__(
        self,
        *,
        api_key: str,
        served_name: str,
        token_delay: float = 0.0,
        first_token_delay: float | None = None,
        ready_after: float = 0.0,
        world_size: int = 1,
        master_port: int | None = None,
        usage_delay: float = 0.0,
        store_responses: bool = True,
    ) -> None:
        self.api_key = api_key
        self.served_name = served_name
        self.token_delay = token_delay
        # None: the first token comes after token_delay like the others. A
        # real model's first token costs the prompt's prefill, usually longer.
        self.first_token_delay = first_token_delay
        self.ready_after = ready_after
        # Rendezvous (rank 0 of a multi-node start): health waits for every rank.
        self.world_size = world_size
        self.master_port = master_port
        # Seconds between a stream's last chunk and its usage chunk: vLLM sends
        # usage separately, after the finish_reason, and a client may be gone by then.
        self.usage_delay = usage_delay
        # False: as vLLM without VLLM_ENABLE_RESPONSES_API_STORE, no response is
        # kept (``store`` ignored, the answer saying nothing of it).
        self.store_responses = store_responses

    def delay_before(self, i: int) -> float:
        """Seconds to wait before token ``i`` (0-based)."""
        if i == 0 and self.first_token_delay is not None:
            return self.first_token_delay
        return self.token_delay


class _EngineState:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self.last_headers: dict[str, str] = {}
        self.last_body: Any = None
        self.ranks: set[int] = {0}
        self.peers: list[asyncio.StreamWriter] = []
        # Stored responses (id -> their output text), as vLLM keeps them.
        self.responses: dict[str, str] = {}
        # And the objects, for GET /v1/responses/{id} and its cancel.
        self.stored: dict[str, dict[str, Any]] = {}
        self.background: dict[str, asyncio.Task[None]] = {}
        self.vocab: dict[str, int] = {}
        self.upload_bytes = 0
        self.last_form: dict[str, str] = {}


_OPTIONS = web.AppKey("options", EngineOptions)
_STATE = web.AppKey("state", _EngineState)


def _error(status: int, message: str, type_: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _words(text: str) -> list[str]:
    return text.split() or ["ok"]


def _prompt_text_chat(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for piece in content:
                if isinstance(piece, dict) and isinstance(piece.get("text"), str):
                    parts.append(piece["text"])
        elif content is not None:
            return None
    return " ".join(parts)


def _prompt_text_completion(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _tokens(prompt: str, max_tokens: int) -> list[str]:
    words = _words(prompt)
    out = [words[i % len(words)] for i in range(max_tokens)]
    # A leading space on every token but the first makes the joined text read
    # as the prompt's words, as a real tokenizer's detokenized output would.
    return [w if i == 0 else " " + w for i, w in enumerate(out)]


def _embedding(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((b - 128) / 128.0, 6) for b in digest[:_EMBEDDING_DIM]]


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    opts = request.app[_OPTIONS]
    if request.path == "/health":
        return await handler(request)  # type: ignore[no-any-return]
    if request.path.startswith("/v1/"):
        request.app[_STATE].last_headers = {k.lower(): v for k, v in request.headers.items()}
    if request.headers.get("Authorization", "") != f"Bearer {opts.api_key}":
        return _error(401, "Invalid or missing API key.", "authentication_error", "invalid_api_key")
    return await handler(request)  # type: ignore[no-any-return]


async def _health(request: web.Request) -> web.Response:
    opts = request.app[_OPTIONS]
    started = request.app[_STATE].started
    if time.monotonic() - started < opts.ready_after:
        return web.Response(status=503, text="starting")
    if len(request.app[_STATE].ranks) < opts.world_size:
        return web.Response(status=503, text="waiting for ranks")
    return web.Response(status=200, text="")


async def _models(request: web.Request) -> web.Response:
    name = request.app[_OPTIONS].served_name
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llmgw-test"}],
        }
    )


async def _debug_headers(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].last_headers)


async def _debug_body(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].last_body)


async def _debug_stats(request: web.Request) -> web.Response:
    st = request.app[_STATE]
    return web.json_response(
        {
            "requests": st.requests,
            "in_flight": st.in_flight,
            "ranks": sorted(st.ranks),
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens,
            "upload_bytes": st.upload_bytes,
            "last_form": st.last_form,
        }
    )


async def _barrier(app: web.Application) -> AsyncIterator[None]:
    """Rank 0's side of the rendezvous: count the ranks that connect to MASTER_PORT."""
    opts, st = app[_OPTIONS], app[_STATE]
    if opts.master_port is None:
        yield
        return

    async def on_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        try:
            rank = int(line.decode().removeprefix("rank ").strip())
        except ValueError:
            writer.close()
            return
        # Kept open: a worker's connection closing is how it learns the master is gone.
        st.peers.append(writer)
        st.ranks.add(rank)
        print(f"test engine: rank {rank} joined ({len(st.ranks)}/{opts.world_size})", flush=True)

    server = await asyncio.start_server(on_peer, "0.0.0.0", opts.master_port)  # noqa: S104
    yield
    for w in st.peers:
        w.close()
    server.close()
    await server.wait_closed()


async def _worker(addr: str, port: int, rank: int, timeout: float = 60.0) -> int:
    """A rank above 0: join the master, then idle until it goes away."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reader, writer = await asyncio.open_connection(addr, port)
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"test engine: no master at {addr}:{port}", file=sys.stderr, flush=True)
                return 3
            await asyncio.sleep(0.1)
    writer.write(f"rank {rank}\n".encode())
    await writer.drain()
    print(f"test engine: rank {rank} joined {addr}:{port}", flush=True)
    await reader.read()
    print("test engine: master gone, worker exits", flush=True)
    return 0


async def _read_body(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
        request.app[_STATE].last_body = body
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _error(400, "The body is not valid JSON.", "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, "The body must be a JSON object.", "invalid_request_error")
    name = request.app[_OPTIONS].served_name
    if body.get("model") != name:
        return _error(
            404,
            f"The model `{body.get('model')}` does not exist.",
            "NotFoundError",
            "model_not_found",
        )
    if body.get("n", 1) != 1:
        return _error(400, "Only n=1 is supported.", "invalid_request_error")
    return body


def _max_tokens(body: dict[str, Any]) -> int | web.Response:
    value = body.get("max_completion_tokens", body.get("max_tokens", _DEFAULT_MAX_TOKENS))
    if value is None:
        return _DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return _error(400, "max_tokens must be a positive integer.", "invalid_request_error")
    return value


def _stream_options(body: dict[str, Any]) -> tuple[bool, web.Response | None]:
    so = body.get("stream_options")
    if so is None:
        return False, None
    if not body.get("stream"):
        return False, _error(
            400, "stream_options is only allowed when stream is true.", "invalid_request_error"
        )
    if not isinstance(so, dict):
        return False, _error(400, "stream_options must be an object.", "invalid_request_error")
    return bool(so.get("include_usage")), None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    opts = request.app[_OPTIONS]
    st = request.app[_STATE]
    st.requests += 1
    st.in_flight += 1
    try:
        return await _generate_inner(request, kind, opts)
    finally:
        st.in_flight -= 1


@dataclass(frozen=True)
class _Generation:
    """One request's answer, decided before any of it is sent."""

    kind: str  # "chat" or "completion"
    rid: str
    created: int
    model: str
    tokens: list[str]
    usage: dict[str, int]
    include_usage: bool
    abort_after: Any

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


def _read_generation(
    body: dict[str, Any], kind: str, opts: EngineOptions
) -> _Generation | web.Response:
    if kind == "chat":
        prompt = _prompt_text_chat(body.get("messages"))
        if prompt is None:
            return _error(
                400, "messages must be a non-empty list of messages.", "invalid_request_error"
            )
    else:
        prompt = _prompt_text_completion(body.get("prompt"))
        if prompt is None:
            return _error(400, "prompt must be a string.", "invalid_request_error")
    max_tokens = _max_tokens(body)
    if isinstance(max_tokens, web.Response):
        return max_tokens
    include_usage, err = _stream_options(body)
    if err is not None:
        return err
    tokens = _tokens(prompt, max_tokens)
    return _Generation(
        kind=kind,
        rid=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:16],
        created=int(time.time()),
        model=opts.served_name,
        tokens=tokens,
        usage={
            "prompt_tokens": len(_words(prompt)),
            "completion_tokens": len(tokens),
            "total_tokens": len(_words(prompt)) + len(tokens),
        },
        include_usage=include_usage,
        abort_after=body.get("test_abort_after"),
    )


async def _generate_inner(
    request: web.Request, kind: str, opts: EngineOptions
) -> web.StreamResponse:
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    gen = _read_generation(body, kind, opts)
    if isinstance(gen, web.Response):
        return gen
    request.app[_STATE].prompt_tokens += gen.usage["prompt_tokens"]
    if not body.get("stream"):
        request.app[_STATE].completion_tokens += len(gen.tokens)
        return await _answer_whole(gen, opts)
    return await _answer_stream(request, gen, opts)


async def _answer_whole(gen: _Generation, opts: EngineOptions) -> web.Response:
    total = sum(opts.delay_before(i) for i in range(len(gen.tokens)))
    if total:
        await asyncio.sleep(total)
    text = "".join(gen.tokens)
    choice: dict[str, Any]
    if gen.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    return web.json_response(
        {
            "id": gen.rid,
            "object": "chat.completion" if gen.chat else "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": [choice],
            "usage": gen.usage,
        }
    )


def _chunk(gen: _Generation, delta_or_text: Any, finish: str | None) -> dict[str, Any]:
    c: dict[str, Any]
    if gen.chat:
        c = {"index": 0, "delta": delta_or_text, "finish_reason": finish, "logprobs": None}
    else:
        c = {"index": 0, "text": delta_or_text, "finish_reason": finish, "logprobs": None}
    out: dict[str, Any] = {
        "id": gen.rid,
        "object": "chat.completion.chunk" if gen.chat else "text_completion",
        "created": gen.created,
        "model": gen.model,
        "choices": [c],
    }
    if gen.include_usage:
        out["usage"] = None
    return out


async def _answer_stream(
    request: web.Request, gen: _Generation, opts: EngineOptions
) -> web.StreamResponse:
    # Tokens are due on a schedule from the request's arrival, as a GPU's
    # decode steps are: a sleep after each write would add the host's timer
    # lateness once a token, and a stream of 52 tokens drifted by
    # milliseconds with the CPU load of whatever else runs on the machine (a
    # proxy under test; the history is in git, CHANGELOG.md "streams on a schedule").
    loop = asyncio.get_running_loop()
    due = loop.time()
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    if gen.chat:
        await resp.write(_sse(_chunk(gen, {"role": "assistant", "content": ""}, None)))
    for i, tok in enumerate(gen.tokens):
        if gen.abort_after is not None and i >= gen.abort_after:
            # Drop the connection mid-stream, the way a crashed engine does.
            if request.transport is not None:
                request.transport.abort()
            return resp
        due += opts.delay_before(i)
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        request.app[_STATE].completion_tokens += 1
        await resp.write(_sse(_chunk(gen, {"content": tok} if gen.chat else tok, None)))
    await resp.write(_sse(_chunk(gen, {} if gen.chat else "", "length")))
    if gen.include_usage:
        if opts.usage_delay:
            await asyncio.sleep(opts.usage_delay)
        last = _chunk(gen, None, None)
        last["choices"], last["usage"] = [], gen.usage
        await resp.write(_sse(last))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _embeddings(request: web.Request) -> web.Response:
    request.app[_STATE].requests += 1
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    inp = body.get("input")
    if isinstance(inp, str):
        inputs = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(x, str) for x in inp):
        inputs = list(inp)
    else:
        return _error(
            400, "input must be a string or a non-empty list of strings.", "invalid_request_error"
        )
    n_tokens = sum(len(_words(x)) for x in inputs)
    return web.json_response(
        {
            "object": "list",
            "model": request.app[_OPTIONS].served_name,
            "data": [
                {"object": "embedding", "index": i, "embedding": _embedding(x)}
                for i, x in enumerate(inputs)
            ],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


def _response_input(body: dict[str, Any]) -> str | None:
    inp = body.get("input")
    if isinstance(inp, str):
        return inp
    if isinstance(inp, list):
        return _prompt_text_chat(
            [m if "role" in m else {"role": "user", **m} for m in inp if isinstance(m, dict)]
        )
    return None


def _response_obj(
    rid: str, model: str, text: str, usage: dict[str, int] | None, prev: Any
) -> dict[str, Any]:
    done = usage is not None
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "completed" if done else "in_progress",
        "output": [
            {
                "type": "message",
                "id": "msg_" + rid[5:],
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
        if done
        else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": prev,
        "usage": usage,
    }


def _event(type_: str, seq: int, **fields: Any) -> bytes:
    data = json.dumps({"type": type_, "sequence_number": seq, **fields}, separators=(",", ":"))
    return f"event: {type_}\ndata: {data}\n\n".encode()


async def _responses(request: web.Request) -> web.StreamResponse:
    """vLLM's /v1/responses, text only: the answer repeats the input's words, after
    the words of the previous response when ``previous_response_id`` is given."""
    opts, st = request.app[_OPTIONS], request.app[_STATE]
    st.requests += 1
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    prompt = _response_input(body)
    if prompt is None:
        return _error(400, "input must be a string or a list of messages.", "invalid_request_error")
    prev = body.get("previous_response_id")
    if prev is not None:
        if prev not in st.responses:
            return _error(404, f"Response with id '{prev}' not found.", "invalid_request_error")
        prompt = st.responses[prev] + " " + prompt
    max_tokens = body.get("max_output_tokens") or _DEFAULT_MAX_TOKENS
    tokens = _tokens(prompt, max_tokens)
    text = "".join(tokens)
    rid = "resp_" + uuid.uuid4().hex[:24]
    usage = {
        "input_tokens": len(_words(prompt)),
        "output_tokens": len(tokens),
        "total_tokens": len(_words(prompt)) + len(tokens),
    }
    st.prompt_tokens += usage["input_tokens"]
    st.completion_tokens += len(tokens)
    if body.get("background"):
        return _start_background(request, rid, text, usage, prev, body)
    if body.get("store", True) and opts.store_responses:
        st.responses[rid] = text
        st.stored[rid] = _response_obj(rid, opts.served_name, text, usage, prev)
    if not body.get("stream"):
        return web.json_response(_response_obj(rid, opts.served_name, text, usage, prev))
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    started = _response_obj(rid, opts.served_name, "", None, prev)
    await resp.write(_event("response.created", 0, response=started))
    item = "msg_" + rid[5:]
    for i, tok in enumerate(tokens):
        if opts.token_delay:
            await asyncio.sleep(opts.token_delay)
        await resp.write(
            _event(
                "response.output_text.delta",
                i + 1,
                item_id=item,
                output_index=0,
                content_index=0,
                delta=tok,
                logprobs=[],
            )
        )
    final = _response_obj(rid, opts.served_name, text, usage, prev)
    await resp.write(_event("response.completed", len(tokens) + 1, response=final))
    await resp.write_eof()
    return resp


def _start_background(
    request: web.Request,
    rid: str,
    text: str,
    usage: dict[str, int],
    prev: Any,
    body: dict[str, Any],
) -> web.Response:
    """vLLM's ``background``: answer ``queued`` at once, finish after a token delay per token."""
    opts, st = request.app[_OPTIONS], request.app[_STATE]
    if body.get("stream") or not body.get("store", True) or not opts.store_responses:
        return _error(
            400, "background can only be used when `store` is true", "invalid_request_error"
        )
    obj = {**_response_obj(rid, opts.served_name, "", None, prev), "status": "queued"}
    st.stored[rid] = obj

    async def finish() -> None:
        await asyncio.sleep(opts.token_delay * usage["output_tokens"])
        st.responses[rid] = text
        st.stored[rid] = _response_obj(rid, opts.served_name, text, usage, prev)
        st.background.pop(rid, None)

    st.background[rid] = asyncio.get_running_loop().create_task(finish())
    return web.json_response(obj)


def _not_found(rid: str) -> web.Response:
    return _error(404, f"Response with id '{rid}' not found.", "invalid_request_error")


async def _retrieve_response(request: web.Request) -> web.StreamResponse:
    """vLLM's GET /v1/responses/{id}.

    With ``stream=true`` vLLM replays the events of a response made with
    ``background`` and ``stream`` (which this engine does not make); for any
    other it fails after its 200 began, cutting the connection: so here."""
    st = request.app[_STATE]
    st.requests += 1
    rid = request.match_info["response_id"]
    obj = st.stored.get(rid)
    if obj is None:
        return _not_found(rid)
    if request.query.get("stream", "false").lower() != "true":
        return web.json_response(obj)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    if request.transport is not None:
        request.transport.abort()
    return resp


async def _cancel_response(request: web.Request) -> web.Response:
    """vLLM's POST /v1/responses/{id}/cancel: only a queued or running background response."""
    st = request.app[_STATE]
    st.requests += 1
    rid = request.match_info["response_id"]
    obj = st.stored.get(rid)
    if obj is None:
        return _not_found(rid)
    if obj["status"] not in ("queued", "in_progress"):
        return _error(400, "Cannot cancel a synchronous response.", "invalid_request_error")
    obj["status"] = "cancelled"
    task = st.background.pop(rid, None)
    if task is not None:
        task.cancel()
    return web.json_response(obj)


def _texts_of(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        return list(value)
    return None


def _similarity(a: str, b: str) -> float:
    """Shared words over all words: deterministic, and higher for closer texts."""
    wa, wb = set(_words(a.lower())), set(_words(b.lower()))
    return round(len(wa & wb) / len(wa | wb), 6)


async def _rerank(request: web.Request) -> web.Response:
    request.app[_STATE].requests += 1
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    query, docs = body.get("query"), _texts_of(body.get("documents"))
    if not isinstance(query, str) or docs is None:
        return _error(
            400, "query must be a string and documents a list of strings.", "invalid_request_error"
        )
    ranked = sorted(range(len(docs)), key=lambda i: -_similarity(query, docs[i]))
    top = body.get("top_n") or len(docs)
    n_tokens = sum(len(_words(query)) + len(_words(d)) for d in docs)
    return web.json_response(
        {
            "id": "rerank-" + uuid.uuid4().hex[:16],
            "model": request.app[_OPTIONS].served_name,
            "usage": {"total_tokens": n_tokens},
            "results": [
                {
                    "index": i,
                    "document": {"text": docs[i]},
                    "relevance_score": _similarity(query, docs[i]),
                }
                for i in ranked[:top]
            ],
        }
    )


async def _score(request: web.Request) -> web.Response:
    request.app[_STATE].requests += 1
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    t1, t2 = _texts_of(body.get("text_1")), _texts_of(body.get("text_2"))
    if t1 is None or t2 is None or (len(t1) != 1 and len(t1) != len(t2)):
        return _error(
            400,
            "text_1 and text_2 must be strings or lists (text_1 of one or as many as text_2).",
            "invalid_request_error",
        )
    pairs = [(t1[0] if len(t1) == 1 else t1[i], b) for i, b in enumerate(t2)]
    n_tokens = sum(len(_words(a)) + len(_words(b)) for a, b in pairs)
    return web.json_response(
        {
            "id": "score-" + uuid.uuid4().hex[:16],
            "object": "list",
            "created": int(time.time()),
            "model": request.app[_OPTIONS].served_name,
            "data": [
                {"index": i, "object": "score", "score": _similarity(a, b)}
                for i, (a, b) in enumerate(pairs)
            ],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


async def _tokenize(request: web.Request) -> web.Response:
    """One token per word; ids given in order of first sight, so /detokenize can undo them."""
    st = request.app[_STATE]
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    if "messages" in body:
        text = _prompt_text_chat(body.get("messages"))
    else:
        text = _prompt_text_completion(body.get("prompt"))
    if text is None:
        return _error(400, "prompt must be a string, or messages a list.", "invalid_request_error")
    ids = [st.vocab.setdefault(w, len(st.vocab)) for w in _words(text)]
    return web.json_response(
        {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    )


async def _detokenize(request: web.Request) -> web.Response:
    st = request.app[_STATE]
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    ids = body.get("tokens")
    words = {v: k for k, v in st.vocab.items()}
    if not isinstance(ids, list) or not all(isinstance(i, int) and i in words for i in ids):
        return _error(400, "tokens must be a list of known token ids.", "invalid_request_error")
    return web.json_response({"prompt": " ".join(words[i] for i in ids)})


async def _audio(request: web.Request) -> web.Response:
    """A transcription of the file's size: read as it arrives, never held."""
    st = request.app[_STATE]
    st.requests += 1
    st.last_form = {}
    size = 0
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or part.name is None:
            continue
        if part.filename is None:
            st.last_form[part.name] = (await part.read()).decode()
            continue
        while chunk := await part.read_chunk():
            size += len(chunk)
            st.upload_bytes += len(chunk)
    if st.last_form.get("model") != request.app[_OPTIONS].served_name:
        return _error(
            404, f"The model `{st.last_form.get('model')}` does not exist.", "NotFoundError"
        )
    if not size:
        return _error(400, "No audio file in the form.", "invalid_request_error")
    text = f"heard {size} bytes"
    if st.last_form.get("response_format") == "text":
        return web.Response(text=text)
    return web.json_response({"text": text, "usage": {"type": "duration", "seconds": 1}})


def create_engine_app(options: EngineOptions) -> web.Application:
    app = web.Application(middlewares=[_auth_middleware])
    app[_OPTIONS] = options
    app[_STATE] = _EngineState()
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_post("/v1/responses", _responses)
    # As vLLM 0.32: GET and cancel, no DELETE (aiohttp answers it 405) and no input_items.
    app.router.add_get("/v1/responses/{response_id}", _retrieve_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", _cancel_response)
    app.router.add_post("/v1/rerank", _rerank)
    app.router.add_post("/rerank", _rerank)
    app.router.add_post("/v1/score", _score)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_post("/v1/audio/transcriptions", _audio)
    app.router.add_post("/v1/audio/translations", _audio)
    app.router.add_get("/debug/last-headers", _debug_headers)
    app.router.add_get("/debug/last-body", _debug_body)
    app.router.add_get("/debug/stats", _debug_stats)
    app.cleanup_ctx.append(_barrier)
    return app


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmgw_slurm.testing.engine",
        description="A deterministic OpenAI-compatible engine for tests.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("LLMGW_ENGINE_PORT", "0")) or None,
        help="default: $LLMGW_ENGINE_PORT, which keeps it out of ps until the engine listens",
    )
    parser.add_argument(
        "--bind-after",
        type=float,
        default=0.0,
        help="seconds to wait before listening (as a real engine loads first; default 0)",
    )
    parser.add_argument(
        "--api-key",
        help=f"the key clients must send (default: ${API_KEY_ENV}, which keeps it out of ps)",
    )
    parser.add_argument("--served-name", required=True)
    parser.add_argument(
        "--token-delay", type=float, default=0.0, help="seconds between streamed tokens (default 0)"
    )
    parser.add_argument(
        "--first-token-delay",
        type=float,
        default=None,
        help="seconds before the first token (default: the token delay)",
    )
    parser.add_argument(
        "--usage-delay",
        type=float,
        default=0.0,
        help="seconds between a stream's last chunk and its usage chunk (default 0)",
    )
    parser.add_argument(
        "--ready-after",
        type=float,
        default=0.0,
        help="seconds /health answers 503 before 200 (default 0)",
    )
    for flag, env in (
        ("--ssl-certfile", "LLMGW_TLS_CERTFILE"),
        ("--ssl-keyfile", "LLMGW_TLS_KEYFILE"),
        ("--ssl-ca-certs", "LLMGW_TLS_CA_CERTS"),
    ):
        parser.add_argument(
            flag,
            default=os.environ.get(env, ""),
            help=f"serve TLS (all three, or none; default: ${env}); with --ssl-ca-certs, "
            "clients must present a certificate it holds",
        )
    parser.add_argument(
        "--rendezvous",
        action="store_true",
        help="join a multi-node start from MASTER_ADDR/MASTER_PORT/NODE_RANK/WORLD_SIZE",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    world, master_port = 1, None
    if args.rendezvous and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        try:
            world = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["NODE_RANK"])
            master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError) as err:
            parser.error(f"--rendezvous: MASTER_ADDR/MASTER_PORT/NODE_RANK/WORLD_SIZE: {err}")
        if rank > 0:
            return asyncio.run(_worker(master_addr, master_port, rank))
    # Only a rank that serves needs a port (a worker's LLMGW_ENGINE_PORT is 0).
    if args.port is None:
        parser.error("no port: give --port or set LLMGW_ENGINE_PORT")
    api_key = args.api_key or os.environ.get(API_KEY_ENV, "")
    if not api_key:
        parser.error(f"no API key: give --api-key or set {API_KEY_ENV}")
    app = create_engine_app(
        EngineOptions(
            api_key=api_key,
            served_name=args.served_name,
            token_delay=args.token_delay,
            first_token_delay=args.first_token_delay,
            ready_after=args.ready_after,
            world_size=world,
            master_port=master_port,
            usage_delay=args.usage_delay,
        )
    )
    tls = (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    if any(tls) and not all(tls):
        parser.error("--ssl-certfile, --ssl-keyfile and --ssl-ca-certs go together")
    ctx = _server_context(*tls) if all(tls) else None
    time.sleep(args.bind_after)
    # run_app turns SIGTERM and SIGINT into a graceful exit.
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, ssl_context=ctx)
    return 0


def _server_context(certfile: str, keyfile: str, ca_certs: str) -> ssl.SSLContext:
    """TLS as the agent asks of an engine: its own pair, and client certificates required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certfile, keyfile)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(ca_certs)
    return ctx


if __name__ == "__main__":
    sys.exit(main())
