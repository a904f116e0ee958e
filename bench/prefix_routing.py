"""Prefix-aware routing against least-outstanding, on two vLLM CPU replicas with prefix caching.

Two ``vllm serve`` processes of the tiny model, prefix caching on, each with a
KV cache of ``--blocks`` blocks of 128 tokens (36 by default: 4,608 tokens). The workload
is ``--prompts`` long system prompts (each about ``--prompt-tokens`` tokens,
measured through the gateway's /tokenize) times many short user turns, sent
by ``--clients`` concurrent clients through one gateway. The sizes are chosen
so that the system prompts fit in the two caches together but not in one:
least-outstanding balancing sends every prompt to both replicas, whose
caches then evict one another's prompts; prefix routing keeps each prompt on
one replica.

Both policies run in the same run, in alternating phases (``--rounds`` of
each), against the same two engines, whose prefix caches are emptied before
each phase (vLLM's /reset_prefix_cache, in its dev mode). Measured per phase:
the engines' prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, in tokens, from their /metrics) and the
requests' latency (p50, p99) through the gateway.

    python bench/prefix_routing.py [--requests 200] [--clients 6] [--rounds 2]
                                   [--prompt-tokens 1040] [--load-factors 1.25,2]
                                   [--key-factors 1,100] [--seeds 1,2,3] [--blocks 36]

Writes bench/results/prefix_routing.json (prefix_routing_Nblocks.json with
another ``--blocks``), with the run's settings. Takes 10 to 30 seconds per
phase of 200 requests here (more when the machine is shared), and one minute
for the engines to start: 6 minutes for the recorded run (``--load-factors 2
--seeds 1,2,3 --requests 400``: 18 phases). Prefix routing runs at each pair
of load factor and key factor given; key factor 100 never binds with 8
prompts (plain consistent hashing of keys, as before the key bound). Each
of ``--seeds`` gives other prompt words, and so other hashes: the luck of the split.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    TINY_LLAMA,
    VLLM_CACHE,
    VLLM_PYTHON,
    free_port,
    print_table,
    result,
    write,
)
from llmgw_slurm.agent.engine import _VLLM_SERVE_SHIM
from llmgw_slurm.router import GATEWAY_KEY, Endpoint, StaticDirectory, create_app
from llmgw_slurm.router.directory import ModelRouting

# 36 blocks of 128 tokens: 4 prompts of 8 blocks and the blocks of the 3
# requests each engine has in flight fit, with one block to spare; with 40,
# least-outstanding keeps more of the 8 prompts (docs/performance.md).
BLOCKS = 36
KEY = "bench-key"
# The engines serve the model under one name per policy (and load factor), so
# that the gateway routes the same engines under each (it sends the model's own name).
LO = "tiny-lo"


def policies(load_factors: list[float], key_factors: list[float]) -> dict[str, ModelRouting]:
    out = {LO: ModelRouting(policy="least_outstanding")}
    for kf in key_factors:
        for lf in load_factors:
            out[f"tiny-px{len(out)}"] = ModelRouting(
                policy="prefix", prefix_chars=512, load_factor=lf, key_factor=kf
            )
    return out


def label(name: str, routing: ModelRouting) -> str:
    if routing.policy != "prefix":
        return routing.policy
    return f"prefix (load_factor {routing.load_factor:g}, key_factor {routing.key_factor:g})"


WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


def start_engine(port: int, blocks: int, names: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # For /reset_prefix_cache between phases.
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CACHE_ROOT": str(VLLM_CACHE),
    }
    argv = [
        str(VLLM_PYTHON), "-c", _VLLM_SERVE_SHIM, "serve", str(TINY_LLAMA),
        "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
        "--served-model-name", *names,
        "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
        "--distributed-executor-backend", "uni",
        "--enable-prefix-caching", "--num-gpu-blocks-override", str(blocks),
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


async def wait_healthy(s: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm at {url} exited with {proc.returncode}")
        try:
            async with s.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"vllm at {url} not healthy in 600 s")


async def prefix_counters(s: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def system_prompts(
    s: aiohttp.ClientSession, gw: str, n: int, tokens: int, rng: random.Random
) -> list[str]:
    """``n`` distinct prompts of about ``tokens`` tokens each (counted by the engine)."""
    out = []
    for i in range(n):
        words = [f"[prompt {i}]"] + [rng.choice(WORDS) for _ in range(tokens)]
        text = " ".join(words)
        async with s.post(gw + "/tokenize", json={"model": "tiny-lo", "prompt": text}) as r:
            count = (await r.json())["count"]
        # Cut to size: words are one token or more each.
        text = " ".join(words[: max(8, len(words) * tokens // count)])
        out.append(text)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def phase(
    s: aiohttp.ClientSession,
    gw: str,
    engines: list[str],
    model: str,
    prompts: list[str],
    requests: int,
    clients: int,
    seed: int,
) -> dict[str, float]:
    for e in engines:
        async with s.post(e + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}):
            pass
    before = [await prefix_counters(s, e) for e in engines]
    rng = random.Random(seed)
    work = [
        (rng.randrange(len(prompts)), " ".join(rng.choice(WORDS) for _ in range(6)))
        for _ in range(requests)
    ]
    latencies: list[float] = []
    # Which replicas each prompt went to: one each under prefix routing.
    spread: dict[int, set[str]] = {}

    async def client() -> None:
        while work:
            p, turn = work.pop()
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": prompts[p]},
                    {"role": "user", "content": turn},
                ],
                "max_tokens": 4,
                "temperature": 0,
            }
            t0 = time.perf_counter()
            async with s.post(gw + "/v1/chat/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                spread.setdefault(p, set()).add(r.headers["X-Llmgw-Replica"])
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    after = [await prefix_counters(s, e) for e in engines]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "p50_s": pct(latencies, 0.5),
        "p99_s": pct(latencies, 0.99),
        "throughput_rps": requests / wall,
        "replicas_per_prompt": sum(len(v) for v in spread.values()) / len(spread),
        "prompts_on_r0": sum(1 for v in spread.values() if v == {"r0"}),
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ports = [free_port(), free_port()]
    pol = policies(
        [float(x) for x in args.load_factors.split(",")],
        [float(x) for x in args.key_factors.split(",")],
    )
    procs = [
        start_engine(p, args.blocks, list(pol), logs / f"vllm-{i}.log") for i, p in enumerate(ports)
    ]
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    per: dict[tuple[int, str], list[dict[str, float]]] = {}
    try:
        directory = StaticDirectory()
        for name, routing in pol.items():
            directory.add_model(name, routing=routing)
            for i, url in enumerate(engines):
                directory.add_endpoint(name, Endpoint(f"r{i}", url, KEY))
        app = create_app(directory)
        async with AsyncExitStack() as es:
            s = await es.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            )
            for url, proc in zip(engines, procs, strict=True):
                await wait_healthy(s, url, proc)
            from aiohttp import web

            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            es.push_async_callback(runner.cleanup)
            gport = free_port()
            await web.TCPSite(runner, "127.0.0.1", gport).start()
            gw = f"http://127.0.0.1:{gport}"
            for seed in [int(x) for x in args.seeds.split(",")]:
                # Another seed's prompts are another workload: the keys of the
                # last one would still count as active (KEY_WINDOW_S) and
                # halve the room for this one's.
                app[GATEWAY_KEY].placements.clear()
                rng = random.Random(seed)
                prompts = await system_prompts(s, gw, args.prompts, args.prompt_tokens, rng)
                # Warm both engines (first requests compile and allocate).
                await phase(s, gw, engines, LO, prompts, 16, 2, 0)
                for rnd in range(args.rounds):
                    for name, routing in pol.items():
                        got = await phase(
                            s, gw, engines, name, prompts, args.requests, args.clients, 100 + rnd
                        )
                        print(f"seed {seed} round {rnd} {label(name, routing)}: {got}", flush=True)
                        per.setdefault((seed, name), []).append(got)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()

    def mean(seed: int, name: str, key: str) -> float:
        xs = [r[key] for r in per[seed, name]]
        return sum(xs) / len(xs)

    out = []
    for seed in sorted({seed for seed, _ in per}):
        for name, routing in pol.items():
            if name == LO:
                continue
            for key, unit in (("hit_rate", "fraction"), ("p50_s", "s"), ("p99_s", "s"),
                              ("throughput_rps", "req/s"),
                              ("replicas_per_prompt", "replicas"),
                              ("prompts_on_r0", "prompts")):  # fmt: skip
                out.append(
                    result(
                        f"seed {seed} {label(name, routing)} {key}",
                        mean(seed, name, key),
                        unit,
                        f"least_outstanding {key}",
                        mean(seed, LO, key),
                    )
                )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="requests per phase")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients")
    p.add_argument("--rounds", type=int, default=2, help="phases of each policy")
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    p.add_argument("--prompt-tokens", type=int, default=1040, help="tokens per system prompt")
    p.add_argument("--load-factors", default="1.25,2", help="prefix load factors (comma list)")
    p.add_argument(
        "--key-factors", default="1,100", help="prefix key factors (comma list; 100: no key bound)"
    )
    p.add_argument("--seeds", default="1", help="seeds of the system prompts' words (comma list)")
    p.add_argument(
        "--blocks", type=int, default=BLOCKS, help="KV cache blocks per engine (128 tokens)"
    )
    p.add_argument("--logs", default="/tmp/llmgw-bench-prefix", help="where the engines log")
    p.add_argument("--no-write", action="store_true", help="do not write the results file")
    args = p.parse_args()
    results = asyncio.run(run(args))
    print_table(results)
    if not args.no_write:
        name = "prefix_routing" if args.blocks == BLOCKS else f"prefix_routing_{args.blocks}blocks"
        print(f"wrote {write(name, results, vars(args))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
