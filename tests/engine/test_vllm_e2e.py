"""The whole path with a real engine: the daemon starts vLLM (CPU build) as a
Slurm job on demand, and the official openai client gets answers through the
gateway.

One test, in steps, because the engine takes half a minute or more to start
and every step needs it running. The model is random noise: assertions are on
shapes, counts and repeatability (temperature 0), never on words.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import openai
import pytest

from llmgw_slurm.auth.secrets import engine_api_key, load_or_create_server_key
from llmgw_slurm.auth.tls import load_or_create_identity
from llmgw_slurm.slurm.cli import CliBackend
from tests.agent_support import as_gateway
from tests.engine.conftest import FIGURES, TOP
from tests.ports import free_port
from tests.procs import listener_pid
from tests.slurm.conftest import eventually

MODEL = "tiny-vllm"
# vLLM CPU flags that start fastest on a small machine (see DESIGN.md's engine facts).
VLLM_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
]
RERANK_MODEL = "tiny-rerank"
RERANK_ARGS = [
    "--runner",
    "pooling",
    "--convert",
    "classify",
    "--hf-overrides",
    json.dumps(
        {
            "architectures": ["LlamaForSequenceClassification"],
            "classifier_from_token": ["a", "b"],
            "method": "from_2_way_softmax",
        }
    ),
]
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
START_TIMEOUT = 300.0  # engine start to healthy takes 30-80 s here; generous for a slow CI


# Each model's resources and scaling: one GPU, started on demand, kept while the tests run.
ONE_GPU_ON_DEMAND: dict[str, object] = {
    "resources": {
        "partition": "llm",
        "gpu_type": "a100",
        "gpus": 1,
        "cpus": 2,
        "memory": "4G",
        "time_limit": "1:00:00",
    },
    "scaling": {"min": 0, "max": 1, "idle_timeout": "30m"},
}


def write_configs(tmp: Path, prefix: str, vllm_python: str, model_dir: Path) -> Path:
    gw, internal = free_port(), free_port()
    # A port block of our own for the engine, away from the dev config's 21000s.
    base = 24000 + (os.getpid() % 50) * 20
    state = tmp / "state"
    (tmp / "models.yaml").write_text(
        json.dumps(
            {
                "models": [
                    {
                        "name": MODEL,
                        "description": "a random-weight Llama for the engine test",
                        "engine": {
                            "kind": "vllm",
                            "args": VLLM_ARGS,
                            "ready_timeout": f"{int(START_TIMEOUT)}s",
                            # vLLM stores responses (GET, cancel,
                            # previous_response_id) only with this.
                            "env": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
                        },
                        # copy: the agent stages it into its cache, as for a
                        # model on a shared filesystem.
                        "weights": {"source": str(model_dir), "method": "copy"},
                        **ONE_GPU_ON_DEMAND,
                    },
                    {
                        # The same Llama as a reranker: vLLM's online conversion
                        # to a classifier, the score head from the LM head's rows
                        # of two tokens, as for Qwen3's rerankers.
                        "name": RERANK_MODEL,
                        "engine": {
                            "kind": "vllm",
                            "args": [*VLLM_ARGS, *RERANK_ARGS],
                            "ready_timeout": f"{int(START_TIMEOUT)}s",
                        },
                        "endpoints": ["rerank", "score"],
                        "weights": {"source": str(model_dir), "method": "copy"},
                        **ONE_GPU_ON_DEMAND,
                    },
                ]
            }
        )
    )
    (tmp / "agent.yaml").write_text(
        json.dumps(
            {
                "weights": {"cache_dir": str(tmp / "weights"), "method": "auto"},
                "engines": {
                    "vllm": {
                        "python": vllm_python,
                        "env": {
                            **VLLM_ENV,
                            "VLLM_CACHE_ROOT": str(TOP / ".dev-cluster" / "engines" / "vllm-cache"),
                        },
                    }
                },
                "readiness": {"poll_interval": "1s", "timeout": f"{int(START_TIMEOUT)}s"},
                "heartbeat_interval": "2s",
                "port_range": f"{base}-{base + 19}",
                "bind_host": "0.0.0.0",
                "drain": {"timeout": "10s", "stop_grace": "10s"},
            }
        )
    )
    server = tmp / "server.yaml"
    server.write_text(
        json.dumps(
            {
                "slurm": {"backend": "cli", "partition": "llm", "job_prefix": prefix},
                "listen": {
                    "gateway": f"127.0.0.1:{gw}",
                    "internal": f"127.0.0.1:{internal}",
                    "daemon_url": f"http://127.0.0.1:{internal}",
                },
                "state_dir": str(state),
                "models": str(tmp / "models.yaml"),
                "agent_config": str(tmp / "agent.yaml"),
                "reconcile": {
                    "interval": "2s",
                    "renewal_margin": "2m",
                    "restart": {"initial_backoff": "5s", "give_up_after_failures": 1},
                },
                "router": {"hold_timeout": f"{int(START_TIMEOUT) + 60}s"},
            }
        )
    )
    return server


@contextlib.asynccontextmanager
async def daemon(server: Path, log: Path) -> AsyncIterator[subprocess.Popen[bytes]]:
    env = dict(os.environ)
    # The jobs inherit this environment (sbatch --export=ALL): the agent in the
    # job imports this checkout, not whatever llmgw_slurm is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOP), env.get("PYTHONPATH")) if p)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from llmgw_slurm.cli.admin import main; main()",
                "serve",
                "--server",
                str(server),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def gateway_listening(
    proc: subprocess.Popen[bytes], s: aiohttp.ClientSession, gw: str, dlog: Path
) -> None:
    """Until the daemon's gateway answers its health check (fails if the daemon exits)."""

    async def gateway_up() -> bool:
        assert proc.poll() is None, f"the daemon exited:\n{tail(dlog)}"
        try:
            async with s.get(gw + "/healthz") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(gateway_up, "the gateway to listen", timeout=60)


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as err:
        return f"({path}: {err})"


def job_logs(state: Path) -> str:
    return "\n".join(f"--- {p}\n{tail(p)}" for p in sorted((state / "logs").glob("*.out")))


def step_seconds(log_text: str, step: str) -> float | None:
    m = re.search(rf"step {step}: done in ([0-9.]+)s", log_text)
    return float(m.group(1)) if m else None


def squeue_row(job_id: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id, "--Format=State:|,NodeList:|,tres-per-node:"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [f.strip() for f in out.strip().split("|")][:3]


def engine_process(port: int) -> int | None:
    """The pid of the vLLM server listening on ``port`` (by its socket: the port is
    kept off the command line, in a file vLLM reads with --config)."""
    return listener_pid(port, "serve")


async def test_vllm_cpu_served_by_a_slurm_job_through_the_gateway(
    tmp_path: Path, vllm_python: str, tiny_model: Path
) -> None:
    prefix = f"llmgwTvllm{os.getpid() % 100000}."
    server = write_configs(tmp_path, prefix, vllm_python, tiny_model)
    cfg = json.loads(server.read_text())
    gw = "http://" + cfg["listen"]["gateway"]
    state = Path(cfg["state_dir"])
    dlog = tmp_path / "daemon.log"
    backend = CliBackend(timeout=60)

    async def status(s: aiohttp.ClientSession) -> dict[str, Any]:
        async with s.get(gw + "/api/v1/status") as r:
            assert r.status == 200
            body: dict[str, Any] = await r.json()
        return next(m for m in body["models"] if m["name"] == MODEL)

    def diagnose() -> str:
        return f"daemon log:\n{tail(dlog)}\njob logs:\n{job_logs(state)}"

    try:
        async with daemon(server, dlog) as proc, aiohttp.ClientSession() as s:
            await gateway_listening(proc, s, gw, dlog)
            assert (await status(s))["replicas"] == [], "on demand: nothing runs before a request"

            client = openai.AsyncOpenAI(
                base_url=gw + "/v1", api_key="no-gateway-keys", max_retries=0, timeout=600
            )
            messages: list[Any] = [{"role": "user", "content": "Say hello."}]

            # 1. The first request starts the model: it is held until a Slurm
            # job's engine is ready. A failing start fails this test at once,
            # with the logs, rather than after the hold timeout.
            async def start_failed() -> str:
                while True:
                    await asyncio.sleep(2)
                    m = await status(s)
                    if m["state"] in ("failing", "backoff"):
                        return f"{MODEL} did not start ({m}):\n{diagnose()}"

            t0 = time.monotonic()
            first = asyncio.ensure_future(
                client.chat.completions.create(
                    model=MODEL, messages=messages, temperature=0, max_tokens=8
                )
            )
            watch = asyncio.ensure_future(start_failed())
            await asyncio.wait({first, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                first.cancel()
                pytest.fail(watch.result())
            watch.cancel()
            try:
                chat = first.result()
            except openai.APIError as err:
                pytest.fail(f"the first request failed: {err!r}\n{diagnose()}")
            FIGURES["cold request (job submit + engine start + answer)"] = (
                f"{time.monotonic() - t0:.2f}s"
            )

            assert isinstance(chat.choices[0].message.content, str)
            assert chat.choices[0].finish_reason in ("length", "stop")
            assert chat.usage is not None and chat.usage.completion_tokens > 0
            assert chat.usage.completion_tokens <= 8
            assert chat.model == MODEL

            # 2. Streamed, on the warm replica: chunks arrive one by one, and
            # the client ends the stream on data: [DONE] (it raises otherwise).
            t1 = time.monotonic()
            first_token: float | None = None
            pieces: list[str] = []
            finish: list[str] = []
            usage_tokens = 0
            chunks = 0
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                temperature=0,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                for c in chunk.choices:
                    if c.delta.content:
                        if first_token is None:
                            first_token = time.monotonic() - t1
                        pieces.append(c.delta.content)
                    if c.finish_reason:
                        finish.append(c.finish_reason)
            FIGURES["stream: first token through the gateway (warm)"] = f"{first_token or -1:.2f}s"
            FIGURES["stream: whole answer, 8 tokens (warm)"] = f"{time.monotonic() - t1:.2f}s"
            assert chunks >= 2 and first_token is not None
            assert finish and finish[-1] in ("length", "stop")
            assert usage_tokens == chat.usage.completion_tokens
            # Greedy decoding: the streamed text is the plain answer, cut nowhere.
            assert "".join(pieces) == chat.choices[0].message.content

            # 3. /v1/models through the gateway lists it.
            listed = [m.id async for m in client.models.list()]
            assert MODEL in listed

            # 3b. The Responses API, plain and streamed, and /tokenize and
            # /detokenize, through the gateway on the same warm replica.
            resp = await client.responses.create(
                model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0
            )
            assert resp.id.startswith("resp") and isinstance(resp.output_text, str)
            assert resp.usage is not None and 0 < resp.usage.output_tokens <= 8
            events = await client.responses.create(
                model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0, stream=True
            )
            kinds = [ev.type async for ev in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            # The stored response's own routes, at the replica that holds it.
            got = await client.responses.retrieve(resp.id)
            assert (got.id, got.output_text) == (resp.id, resp.output_text)
            chained = await client.responses.create(
                model=MODEL, input="Again.", previous_response_id=resp.id, max_output_tokens=2
            )
            assert chained.previous_response_id == resp.id
            with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous"):
                await client.responses.cancel(resp.id)
            # vLLM has no DELETE (it answers 405): the gateway forgets the response.
            assert await client.responses.delete(resp.id) is None
            with pytest.raises(openai.NotFoundError) as gone:
                await client.responses.retrieve(resp.id)
            assert gone.value.code == "response_not_found"
            async with s.post(
                gw + "/tokenize", json={"model": MODEL, "prompt": "hello world"}
            ) as r:
                assert r.status == 200, await r.text()
                tokens = (await r.json())["tokens"]
            async with s.post(gw + "/detokenize", json={"model": MODEL, "tokens": tokens}) as r:
                assert r.status == 200 and (await r.json())["prompt"] == "hello world"

            # 3c. Rerank and score, on the reranker (a cold start of its own),
            # /rerank without /v1 too; it serves nothing else.
            docs = ["a red apple", "blue sky"]
            for path, body in (
                ("/v1/rerank", {"model": RERANK_MODEL, "query": "apple", "documents": docs}),
                ("/rerank", {"model": RERANK_MODEL, "query": "apple", "documents": docs}),
            ):
                async with s.post(gw + path, json=body) as r:
                    assert r.status == 200, (path, await r.text(), diagnose())
                    got = await r.json()
                assert sorted(x["index"] for x in got["results"]) == [0, 1], got
                assert all(0 <= x["relevance_score"] <= 1 for x in got["results"]), got
                assert got["usage"]["prompt_tokens"] > 0, got
            score = {"model": RERANK_MODEL, "text_1": "apple", "text_2": docs}
            async with s.post(gw + "/v1/score", json=score) as r:
                assert r.status == 200, await r.text()
                assert [x["index"] for x in (await r.json())["data"]] == [0, 1]
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=RERANK_MODEL, messages=messages)
            assert refused.value.code == "endpoint_not_served", refused.value.body
            await client.close()

            # 4. The Slurm job is what serves: running on a GPU node, with a
            # GPU gres, and its node is the engine URL's host.
            m = await status(s)
            assert (m["state"], m["ready_replicas"]) == ("ready", 1), m
            (rep,) = m["replicas"]
            job_id, url = rep["job_id"], rep["url"]
            assert job_id and url, rep
            st, node, tres = squeue_row(job_id)
            assert st == "RUNNING", (st, node, tres)
            assert node.startswith("gpunode") and node == urlsplit(url).hostname, (node, url)
            assert "gpu" in tres, tres

            log_text = "\n".join(
                p.read_text(errors="replace")
                for p in sorted((state / "logs").glob(f"{prefix}{MODEL}.*.out"))
            )
            for step in ("weights", "engine_launch", "readiness"):
                secs = step_seconds(log_text, step)
                assert secs is not None, (
                    f"no 'step {step}: done' in the job log:\n{job_logs(state)}"
                )
                FIGURES[f"agent step {step}"] = f"{secs:.1f}s"

            # 5. The engine refuses whoever does not hold its key: nobody on a
            # node can go around the gateway. Its key is the one the daemon
            # derives for this replica, and it is in the engine's environment,
            # never in its command line.
            key = engine_api_key(load_or_create_server_key(state / "server.key"), rep["id"])
            assert url.startswith("https://"), url
            # Without the gateway's client certificate there is no TLS handshake, on
            # any path (vLLM's key guards only /v1; /invocations and /tokenize answer
            # without it).
            for path in ("/v1/models", "/invocations", "/tokenize", "/metrics"):
                try:
                    async with s.get(url + path, ssl=False) as r:
                        raise AssertionError(f"{path} answered {r.status} without a certificate")
                except aiohttp.ClientError:
                    pass
            async with as_gateway(load_or_create_identity(state)) as gw:
                for headers, want in (
                    ({}, 401),
                    ({"Authorization": "Bearer not-the-key"}, 401),
                    ({"Authorization": f"Bearer {key}"}, 200),
                ):
                    async with gw.get(url + "/v1/models", headers=headers) as r:
                        assert r.status == want, (headers.keys(), r.status)
            port = urlsplit(url).port
            assert port is not None
            pid = engine_process(port)
            assert pid is not None, "no `vllm serve` process listening on that port"
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert not any(key.encode() in a for a in argv)
            # Nor its port: a watcher of ps could take it before vLLM listens.
            assert str(port).encode() not in argv, argv
            # method copy: the engine reads the agent's cache, not the source folder.
            model_arg = Path(argv[argv.index(b"serve") + 1].decode())
            assert model_arg.is_relative_to(tmp_path / "weights"), model_arg
            assert (model_arg / "model.safetensors").is_file()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"VLLM_API_KEY={key}".encode() in environ
            assert not any(e.startswith(b"LLMGW_REPLICA_SECRET=") for e in environ)

            # 6. Cancelling the job stops the engine: nothing outlives it.
            rss_kb = int(
                next(
                    line.split()[1]
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
            )
            FIGURES["engine RSS"] = f"{rss_kb / 1024:.0f} MB"
            t_cancel = time.monotonic()
            subprocess.run(["scancel", job_id], check=True, timeout=30)

            async def engine_gone() -> bool:
                return engine_process(port) is None

            await eventually(engine_gone, "the engine to exit after scancel", timeout=90)
            FIGURES["scancel to engine gone"] = f"{time.monotonic() - t_cancel:.2f}s"
    finally:
        leftover = await backend.list_jobs(prefix)
        if leftover:
            subprocess.run(["scancel", *[j.job_id for j in leftover]], check=False, timeout=30)
