"""A tiny OpenAI-ish engine for agent tests: run as a script, not collected.

    python fake_engine.py --host H --port P --model-path DIR --served-name NAME
        [--startup-delay S] [--crash-at-start CODE]

The API key comes from LLMGW_ENGINE_API_KEY, as the agent gives it. /health
answers 503 until the startup delay has passed.

Multi-node, torchrun-style from MASTER_ADDR/MASTER_PORT/NODE_RANK/WORLD_SIZE:
rank 0 listens on MASTER_PORT and is healthy only once every other rank has
connected; a rank > 0 serves no HTTP, connects to the master (retrying) and
exits 0 when the master goes away, as a distributed worker does. A chat request may ask for a
delay (``"llmgw_test_delay_s"`` in the body) so that tests hold requests in
flight; /metrics reports them as vLLM does. Unknown paths are 404.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
import time
from pathlib import Path

from aiohttp import web


def build(args: argparse.Namespace) -> web.Application:
    key = os.environ["LLMGW_ENGINE_API_KEY"]
    started = time.monotonic()
    state = {"running": 0}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    peers: list[asyncio.StreamWriter] = []

    async def on_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer)
        print(f"fake engine: worker {len(peers)} joined", flush=True)

    def authorized(request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {key}"

    async def health(request: web.Request) -> web.Response:
        if time.monotonic() - started < args.startup_delay or len(peers) < world - 1:
            return web.Response(status=503, text="loading")
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response(
            {"object": "list", "data": [{"id": args.served_name, "object": "model"}]}
        )

    async def chat(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        if body.get("model") != args.served_name:
            return web.json_response({"error": {"message": "unknown model"}}, status=404)
        state["running"] += 1
        try:
            await asyncio.sleep(float(body.get("llmgw_test_delay_s", 0)))
        finally:
            state["running"] -= 1
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": args.served_name,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "ok"},
                    }
                ],
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{args.served_name}"}} '
            f"{float(state['running'])}\n"
        )
        return web.Response(text=text)

    async def listen(app: web.Application) -> None:
        if world > 1:
            port = int(os.environ["MASTER_PORT"])
            app["master"] = await asyncio.start_server(on_peer, "0.0.0.0", port)

    app = web.Application()
    app.on_startup.append(listen)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    return app


async def worker() -> None:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + 60
    while True:
        try:
            reader, _writer = await asyncio.open_connection(addr, port)
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"fake engine: no master at {addr}:{port}", file=sys.stderr, flush=True)
                sys.exit(3)
            await asyncio.sleep(0.1)
    print(f"fake engine: rank {os.environ['NODE_RANK']} joined {addr}:{port}", flush=True)
    await reader.read()  # until the master goes away
    print("fake engine: master gone, worker exits", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--served-name", required=True)
    ap.add_argument("--startup-delay", type=float, default=0.3)
    ap.add_argument("--crash-at-start", type=int, default=0)
    args = ap.parse_args()
    print(f"fake engine: pid {os.getpid()} loading {args.model_path}", flush=True)
    if not (Path(args.model_path) / "config.json").exists():
        print("fake engine: no config.json in the model path", file=sys.stderr, flush=True)
        sys.exit(2)
    if int(os.environ.get("NODE_RANK", "0")) > 0:
        asyncio.run(worker())
        return
    if args.crash_at_start:
        print("fake engine: CUDA out of memory (pretend)", file=sys.stderr, flush=True)
        sys.exit(args.crash_at_start)
    # TLS as the agent gives it: its pair, and client certificates required.
    ctx = None
    if os.environ.get("LLMGW_TLS_CERTFILE"):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(os.environ["LLMGW_TLS_CERTFILE"], os.environ["LLMGW_TLS_KEYFILE"])
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(os.environ["LLMGW_TLS_CA_CERTS"])
    web.run_app(build(args), host=args.host, port=args.port, print=None, ssl_context=ctx)
    print("fake engine: stopped", flush=True)


if __name__ == "__main__":
    main()
