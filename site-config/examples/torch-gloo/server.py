#!/usr/bin/env python3
"""A site's own distributed engine: torch.distributed over gloo, one process per node.

An example of a ``command`` engine that spans the nodes of a multi-node
replica the way a torchrun-style server does, and what an admin copies to run
their own: it needs Python and torch (the CPU wheel will do), nothing else.
docs/job-side.md ("A site's own distributed engine") describes it; the catalog
entry to start it is models.yaml beside this file.

What it reads, all set by the llmgw agent on every node of the job:

- ``MASTER_ADDR`` ``MASTER_PORT``: the head node and the replica's distributed
  port (derived from the job id, or published by the head in
  ``rendezvous.dir``); rank 0 hosts torch's store there.
- ``NODE_RANK`` (0 on the head) and ``WORLD_SIZE`` (the node count; one
  process per node, so also the number of ranks). Without them: one node.
- ``LLMGW_ENGINE_PORT``: the head's HTTP port (never on a command line, where
  every user of the node could read it and take the port first);
  ``LLMGW_ENGINE_API_KEY``: the key every ``/v1`` request must carry.
- ``LLMGW_TLS_CERTFILE`` ``LLMGW_TLS_KEYFILE`` ``LLMGW_TLS_CA_CERTS``: with
  ``engine.tls`` (the default) the head serves HTTPS with the replica's key
  pair and lets in only clients whose certificate is in the CA file (the
  gateway and the agent).

What it does: every rank joins the process group and takes part in an
all-reduce before anything serves (each adds ``rank + 1``), and gathers the
node names. Rank 0 then serves an OpenAI-compatible API (``/health``,
``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``, plain or
streamed); each completion is one more collective: rank 0 broadcasts the
prompt's word count, every rank contributes ``(rank + 1) * words``, and the
answer reports both sums and the nodes, so a client sees that every node
took part. A real server would broadcast the batch and run its model shards
there. The other ranks serve nothing: they wait for rank 0's broadcasts.

How it ends, which is what makes it one replica rather than loose processes:
SIGTERM on rank 0 (the agent's stop) broadcasts "stop" and every rank exits 0;
a rank that dies breaks the group, and the others exit 1 at their next
collective (rank 0 at the next request, a waiting rank at once), so the
agent on that node reports the replica failed and Slurm ends the job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
import uuid
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

_STOP, _COMPLETE = 0, 1
# A waiting rank blocks in a broadcast until rank 0 has work or stops, which
# may be days: the group's timeout must outlast the job, not gloo's 30 minutes.
_GROUP_TIMEOUT = timedelta(days=30)


def _log(msg: str) -> None:
    print(f"torch-gloo-server: {msg}", file=sys.stderr, flush=True)


class Group:
    """This process's place in the replica and the collectives it runs."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE") or 1)
        self.rank = int(os.environ.get("NODE_RANK") or 0)
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.nodes = [self.node]
        self.startup_sum = 1
        # Collectives run one at a time, in the same order on every rank.
        self.lock = threading.Lock()

    def join(self) -> None:
        if self.world > 1:
            addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
            _log(f"rank {self.rank}/{self.world} on {self.node}: joining {addr}:{port}")
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{addr}:{port}",
                rank=self.rank,
                world_size=self.world,
                timeout=_GROUP_TIMEOUT,
            )
            names: list[Any] = [None] * self.world
            dist.all_gather_object(names, self.node)
            self.nodes = [str(n) for n in names]
        self.startup_sum = int(self._all_reduce(self.rank + 1))
        _log(f"rank {self.rank}: all_reduce of rank+1 over {self.nodes} = {self.startup_sum}")

    def _all_reduce(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    def _broadcast(self, op: int, arg: int) -> tuple[int, int]:
        t = torch.tensor([op, arg], dtype=torch.int64)
        if self.world > 1:
            dist.broadcast(t, src=0)
        return int(t[0].item()), int(t[1].item())

    def complete(self, words: int) -> int:
        """Rank 0: one collective step across every rank for one request."""
        with self.lock:
            self._broadcast(_COMPLETE, words)
            return int(self._all_reduce((self.rank + 1) * words))

    def stop(self) -> None:
        with self.lock:
            if self.world > 1:
                self._broadcast(_STOP, 0)
                dist.destroy_process_group()

    def follow(self) -> int:
        """A rank above 0: take part in rank 0's steps until it stops."""
        while True:
            op, arg = self._broadcast(0, 0)
            if op == _STOP:
                dist.destroy_process_group()
                _log(f"rank {self.rank}: rank 0 stopped")
                return 0
            self._all_reduce((self.rank + 1) * arg)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error"}})

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.api_key}":
            return True
        self._error(401, "missing or wrong API key")
        return False

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models" and self._authorized():
            model = {"id": self.server.served_name, "object": "model", "owned_by": "site"}
            self._json(200, {"object": "list", "data": [model]})
        elif not self.path.startswith("/v1/"):
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(404, f"no route {self.path}")
            return
        if not self._authorized():
            return
        try:
            body = json.loads(raw)
            chat = self.path == "/v1/chat/completions"
            prompt = _prompt(body, chat)
        except (ValueError, TypeError, KeyError) as err:
            self._error(400, f"bad request body: {err}")
            return
        if body.get("model") != self.server.served_name:
            self._error(404, f"model {body.get('model')!r} is not served here")
            return
        self._complete(body, chat, prompt)

    def _complete(self, body: dict[str, Any], chat: bool, prompt: str) -> None:
        g = self.server.group
        words = len(prompt.split())
        try:
            request_sum = g.complete(words)
        except RuntimeError as err:
            # A rank is gone: this replica cannot compute anything any more.
            # Exit, so the agent reports it failed and Slurm ends the job.
            _log(f"collective failed, exiting: {err}")
            os._exit(1)
        text = (
            f"world {g.world} nodes {','.join(g.nodes)} startup_sum {g.startup_sum} "
            f"request_sum {request_sum}"
        )
        tokens = text.split()[: max(1, int(body.get("max_tokens") or 16))]
        finish = "stop" if len(tokens) == len(text.split()) else "length"
        usage = {
            "prompt_tokens": words,
            "completion_tokens": len(tokens),
            "total_tokens": words + len(tokens),
        }
        answer = Answer(self.server.served_name, chat, tokens, finish, usage)
        if body.get("stream"):
            self._stream(answer, bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            self._json(200, answer.whole())

    def _stream(self, answer: Answer, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in answer.chunks(include_usage):
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def _prompt(body: dict[str, Any], chat: bool) -> str:
    if chat:
        return " ".join(str(m["content"]) for m in body["messages"])
    p = body["prompt"]
    return p if isinstance(p, str) else " ".join(map(str, p))


class Answer:
    """One completion, as a whole body or as stream chunks (OpenAI's shapes)."""

    def __init__(
        self, model: str, chat: bool, tokens: list[str], finish: str, usage: dict[str, int]
    ) -> None:
        self.model, self.chat, self.tokens, self.finish, self.usage = (
            model,
            chat,
            tokens,
            finish,
            usage,
        )
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, suffix: str) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj + suffix, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        text = " ".join(self.tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(""), "choices": [choice], "usage": self.usage}

    def chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        out = []
        for i, tok in enumerate(self.tokens):
            piece = tok if i == 0 else " " + tok
            last = i == len(self.tokens) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish if last else None}
            if self.chat:
                choice["delta"] = {"content": piece, **({"role": "assistant"} if i == 0 else {})}
            else:
                choice["text"] = piece
            out.append({**self._head(".chunk" if self.chat else ""), "choices": [choice]})
        if include_usage:
            out.append(
                {**self._head(".chunk" if self.chat else ""), "choices": [], "usage": self.usage}
            )
        return out


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, group: Group, served_name: str, api_key: str) -> None:
        self.group, self.served_name, self.api_key = group, served_name, api_key
        self.tls: ssl.SSLContext | None = None
        super().__init__((host, port), Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        if self.tls is not None:
            # The handshake happens in the request's thread, on its first read:
            # a slow client must not hold up accept().
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, addr


def _tls_context() -> ssl.SSLContext | None:
    files = [
        os.environ.get(n, "")
        for n in ("LLMGW_TLS_CERTFILE", "LLMGW_TLS_KEYFILE", "LLMGW_TLS_CA_CERTS")
    ]
    if not any(files):
        return None
    if not all(files):
        raise SystemExit("LLMGW_TLS_CERTFILE, LLMGW_TLS_KEYFILE and LLMGW_TLS_CA_CERTS go together")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(files[0], files[1])
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(files[2])
    return ctx


def serve(group: Group, host: str, served_name: str) -> int:
    port = int(os.environ.get("LLMGW_ENGINE_PORT") or 0)
    api_key = os.environ.get("LLMGW_ENGINE_API_KEY", "")
    if not port or not api_key:
        raise SystemExit(
            "rank 0 needs LLMGW_ENGINE_PORT and LLMGW_ENGINE_API_KEY (the agent sets them)"
        )
    server = Server(host, port, group, served_name, api_key)
    server.tls = _tls_context()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _log(f"rank 0 serves {served_name} on {host}:{port} (tls: {server.tls is not None})")
    stopping.wait()
    server.shutdown()
    group.stop()
    _log("rank 0 stopped")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="0.0.0.0")  # noqa: S104 - the agent passes {host}
    parser.add_argument("--served-name", required=True)
    args = parser.parse_args()
    group = Group()
    group.join()
    if group.rank > 0:
        try:
            return group.follow()
        except RuntimeError as err:
            _log(f"rank {group.rank}: rank 0 is gone ({err}); exiting")
            return 1
    return serve(group, args.host, args.served_name)


if __name__ == "__main__":
    sys.exit(main())
