"""Instructions a request costs the gateway, counted by callgrind: a figure the
machine's load does not move.

``bench/gateway.py`` measures CPU time, which on two shared cores moves by
tens of percent with what else runs (caches, the other core's neighbours).
The instructions a process executes for a fixed number of requests do not: a
rerun on a busy machine gives the same figure within a percent. This counts
them with valgrind's callgrind for each server in front of the instant test
engine (plain HTTP, the 50 tokens at once): this tree's gateway, the gateway
at ``--against COMMIT`` (a git worktree), the floor (``bench/floor_proxy.py``:
the least a proxy on the gateway's stack, uvloop and httptools, does) and
nginx as a reverse proxy (one process, ``master_process off``), and with
``--compiled`` this tree's gateway with its request path compiled to C by
mypyc (the compiler mypy ships: the same typed source, no other language),
the measure of what a compiled path would take off. Each server:
300 requests to warm it, the counters zeroed (``callgrind_control -z``), then
N requests, 16 at once, and the counters dumped; instructions / N, whole
answers and streams.

User space only: the kernel's part of a request (its reads, writes and
polls), which is most of nginx's CPU, is not counted, so the ratio to nginx
here is larger than the CPU-time ratio of ``bench/gateway.py``; between two
gateways, it is the change in the code's own work.

    python3 bench/gateway_instructions.py --against 039fa63   # ~6 minutes
    python3 bench/gateway_instructions.py --against 039fa63 --compiled   # ~8

Writes bench/results/gateway_instructions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, free_port, result, wait_http, worktree, write
from bench.gateway import _NGINX_HTTP, _NGINX_SERVER, ENGINE_KEY, find_nginx, gateway_spec

WARM = 300
AT_ONCE = 16
BODY = {"model": "instant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


async def _load(url: str, n: int, stream: bool) -> None:
    """``n`` requests, :data:`AT_ONCE` at a time, each read to its end; any
    answer but a 200 stops the run (a figure of errors is no figure)."""
    import aiohttp

    body = json.dumps({**BODY, "stream": stream}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ENGINE_KEY}"}
    left = n
    connector = aiohttp.TCPConnector(limit=AT_ONCE)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")

        await asyncio.gather(*(client() for _ in range(AT_ONCE)))


def _total(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def count(cmd: list[str], url: str, health: str, n: int, stream: bool, out: Path,
          env: dict[str, str] | None = None) -> float:
    """Instructions a request of the server ``cmd`` starts, run under callgrind."""
    for old in out.parent.glob(out.name + "*"):
        old.unlink()
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(health, proc, timeout=300)
        asyncio.run(_load(url, WARM, stream))
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], capture_output=True, check=True)
        asyncio.run(_load(url, n, stream))
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True, check=True)
        # The dump is written by the process itself, at its next instrumented step.
        end = time.monotonic() + 60
        while not (dumps := sorted(out.parent.glob(out.name + ".*"))):
            if time.monotonic() > end:
                raise RuntimeError(f"callgrind wrote no dump for {cmd[0]}")
            time.sleep(0.5)
        time.sleep(1)
        return _total(dumps[-1]) / n
    finally:
        proc.terminate()
        proc.wait()


# The request path's modules, as mypyc can compile them: all of them but
# gateway.py, whose aiohttp middleware is a function aiohttp marks with an
# attribute, which a compiled function cannot carry (it holds one call a
# request; the rest of the package, its callers, stays interpreted too).
COMPILED = ("_body", "account", "admit", "answers", "engine", "forward", "http1", "metrics",
            "replicas", "server", "sse")  # fmt: skip


def compiled_tree(dest: Path) -> Path:
    """This tree's files as they are now (uncommitted changes too), under
    ``dest``, with :data:`COMPILED` built to extension modules beside their
    source (which Python imports first)."""
    listed = subprocess.run(["git", "ls-files", "-z", "llmgw_slurm", "bench", "setup.cfg"],
                            cwd=ROOT, capture_output=True, check=True).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    sources = [f"llmgw_slurm/router/{m}.py" for m in COMPILED]
    built = subprocess.run([sys.executable, "-m", "mypyc", *sources], cwd=dest,
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode != 0:
        sys.exit(f"mypyc could not compile the request path:\n{built.stdout}{built.stderr}")
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, metavar="COMMIT",
                   help="the gateway at that commit, in a git worktree under /tmp")
    p.add_argument("--requests", type=int, default=1000, help="whole answers counted")
    p.add_argument("--streams", type=int, default=300, help="streams counted")
    p.add_argument("--no-nginx", action="store_true")
    p.add_argument("--compiled", action="store_true",
                   help="also this tree with its request path compiled by mypyc")
    args = p.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind not found: apt-get install valgrind (its callgrind counts them)")
    nginx = None if args.no_nginx else find_nginx(True)
    other = worktree(args.against)
    results = []
    with tempfile.TemporaryDirectory(prefix="llmgw-icount-") as tmpd:
        tmp = Path(tmpd)
        e_port = free_port()
        engine = subprocess.Popen(
            [sys.executable, "-m", "llmgw_slurm.testing.engine", "--port", str(e_port),
             "--api-key", ENGINE_KEY, "--served-name", "instant", "--token-delay", "0",
             "--first-token-delay", "0"],
            env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{e_port}/health", engine)
            spec = gateway_spec({"instant": f"http://127.0.0.1:{e_port}"}, None)
            names = ["gateway", f"gateway@{args.against}", "floor"] + (["nginx"] if nginx else [])
            if args.compiled:
                names.insert(1, "gateway-compiled")
                compiled_tree(tmp / "compiled")
            per: dict[tuple[str, str], float] = {}
            for name in names:
                port = free_port()
                if name == "nginx":
                    assert nginx is not None
                    conf = tmp / "nginx.conf"
                    server = _NGINX_SERVER.format(name="instant", port=port, engine_port=e_port,
                                                  key=ENGINE_KEY)  # fmt: skip
                    conf.write_text(_NGINX_HTTP.format(dir=tmp, servers=server))
                    argv = [nginx, "-c", str(conf), "-g", "daemon off; master_process off;"]
                    env = None
                elif name == "floor":
                    argv = [sys.executable, str(ROOT / "bench" / "floor_proxy.py"), str(port),
                            f"http://127.0.0.1:{e_port}", ENGINE_KEY]  # fmt: skip
                    env = None
                else:
                    tree = {"gateway": ROOT, "gateway-compiled": tmp / "compiled"}.get(name, other)
                    argv = [sys.executable, str(tree / "bench" / "gateway.py"), "--serve-gateway",
                            str(port), spec]  # fmt: skip
                    env = dict(os.environ, PYTHONPATH=str(tree))
                base = f"http://127.0.0.1:{port}"
                for mode, n in (("plain", args.requests), ("stream", args.streams)):
                    got = count(argv, f"{base}/v1/chat/completions", f"{base}/health", n,
                                mode == "stream", tmp / f"cg.{mode}", env)  # fmt: skip
                    per[(name, mode)] = got
                    print(f"{name:24} {mode:6} {got:>12,.0f} instructions a request", flush=True)
        finally:
            engine.terminate()
            engine.wait()
    theirs = f"gateway@{args.against}"
    for mode in ("plain", "stream"):
        results.append(result(f"gateway.{mode}.instructions", per[("gateway", mode)],
                              "instructions/request", f"{theirs}.{mode}.instructions",
                              per[(theirs, mode)]))  # fmt: skip
        compiled = ("gateway-compiled",) if ("gateway-compiled", mode) in per else ()
        for name in compiled:
            results.append(result(f"{name}.{mode}.instructions", per[(name, mode)],
                                  "instructions/request", f"gateway.{mode}.instructions",
                                  per[("gateway", mode)]))  # fmt: skip
        for name in ("gateway", *compiled, theirs):
            results.append(result(f"{name}.{mode}.instructions_vs_floor", per[(name, mode)],
                                  "instructions/request", f"floor.{mode}.instructions",
                                  per[("floor", mode)]))  # fmt: skip
        for name in ("gateway", *compiled, theirs, "floor"):
            if ("nginx", mode) in per:
                results.append(result(f"{name}.{mode}.instructions_vs_nginx", per[(name, mode)],
                                      "instructions/request", f"nginx.{mode}.instructions",
                                      per[("nginx", mode)]))  # fmt: skip
    for r in results:
        print(f"{r['name']:44} {r['value']:>12,.0f} / {r['reference']}: {r['ratio']}")
    print(f"wrote {write('gateway_instructions', results, vars(args))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
