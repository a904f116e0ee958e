"""What the fault tests share: a bounded load generator, a daemon in its own process,
figures recorded per fault, and putting the dev cluster back together.

Figures go to ``.faults/results.jsonl`` at the top of the repository (one line
per test run); ``python -m tests.faults.table`` turns the latest of each fault
into the table in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai

from tests.slurm.harness import TOP, Harness

RESULTS = TOP / ".faults" / "results.jsonl"


# ---- figures ----------------------------------------------------------------------


def record(fault: str, **figures: Any) -> None:
    """Append one run's figures; the table shows the latest run of each fault."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    row = {"fault": fault, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    with RESULTS.open("a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def latest_results() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out[row["fault"]] = row
    return out


# ---- the cluster --------------------------------------------------------------------


def cluster_dir() -> Path:
    """The dev cluster's folder, from SLURM_CONF (``D/etc/slurm.conf``)."""
    conf = os.environ.get("SLURM_CONF") or str(TOP / ".dev-cluster" / "etc" / "slurm.conf")
    return Path(conf).resolve().parents[1]


def daemon_pid(name: str) -> int:
    """The pid of one of the cluster's own daemons (munged, slurmctld, slurmd-gpunode1, ...)."""
    return int((cluster_dir() / "run" / f"{name}.pid").read_text().strip())


def kill_cluster_daemon(name: str) -> int:
    pid = daemon_pid(name)
    os.kill(pid, signal.SIGKILL)
    return pid


def nodes_state() -> dict[str, str]:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-p", "llm", "-o", "%N %T"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())


def restore_cluster() -> None:
    """Start whatever is stopped (``dev-cluster up`` is idempotent), resume nodes left down."""
    env = {**os.environ, "LLMGW_DEV_CLUSTER_DIR": str(cluster_dir())}
    subprocess.run([str(TOP / "scripts" / "dev-cluster"), "up"], env=env, check=False)
    for _ in range(60):
        if subprocess.run(["scontrol", "ping"], capture_output=True, check=False).returncode == 0:
            break
        time.sleep(1)
    for node, state in nodes_state().items():
        if any(s in state for s in ("down", "drain", "fail")):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)


# ---- the daemon in its own process ------------------------------------------------


@dataclass
class DaemonProcess:
    """``llmgw-admin serve`` from this checkout, as a process that can be SIGKILLed."""

    h: Harness
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    # Before the command: e.g. prlimit, for a daemon started under systemd's limits.
    wrap: tuple[str, ...] = ()

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(TOP)}
        code = "import sys; from llmgw_slurm.cli.admin import main; sys.exit(main())"
        self.proc = subprocess.Popen(
            [*self.wrap, sys.executable, "-c", code, "serve", "--server", str(self.h.server_yaml)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"),  # noqa: SIM115 - the child owns it
            env=env,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    async def status(self) -> dict[str, Any] | None:
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s,
                s.get(self.h.url + "/api/v1/status") as r,
            ):
                if r.status != 200:
                    return None
                got: dict[str, Any] = await r.json()
                return got
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None


@contextlib.contextmanager
def daemon_process(h: Harness, log: Path, wrap: tuple[str, ...] = ()) -> Iterator[DaemonProcess]:
    d = DaemonProcess(h, log, wrap=wrap)
    d.start()
    try:
        yield d
    finally:
        d.stop()
        ids = [j[0] for j in h.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], check=False)


def model_states(st: dict[str, Any] | None) -> dict[str, str]:
    return {m["name"]: m["state"] for m in st["models"]} if st else {}


# ---- load -------------------------------------------------------------------------


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, openai.APIConnectionError):  # includes timeouts
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    return False


def _kind(exc: BaseException) -> str:
    if isinstance(exc, openai.APIStatusError):
        code = ""
        body = exc.body
        if isinstance(body, dict):
            err = body.get("error", body)
            if isinstance(err, dict):
                code = str(err.get("code") or "")
        return f"HTTP {exc.status_code}" + (f" {code}" if code else "")
    return type(exc).__name__


@dataclass
class Outcome:
    t: float
    ok: bool
    kind: str = ""
    replica: str = ""
    retryable: bool = False
    # None: no retry was needed; else whether the one retry succeeded.
    retry_ok: bool | None = None


@dataclass
class Load:
    """A fixed number of clients, each sending one chat request after another.

    Bounded by construction: ``workers`` requests at most in flight, a short pause
    between them. A failed request is retried once when its error is retryable
    (as the openai client would), and both tries are recorded.
    """

    base_url: str
    model: str
    workers: int = 4
    pause: float = 0.05
    max_tokens: int = 5
    timeout: float = 300.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _one(self, c: openai.AsyncOpenAI, n: int) -> tuple[bool, str, str, bool]:
        try:
            raw = await c.chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": "user", "content": f"steady load {n}"}],
                max_tokens=self.max_tokens,
            )
            raw.parse()
            return True, "", raw.headers.get("x-llmgw-replica", ""), False
        except (openai.APIError, OSError) as exc:
            rep = ""
            if isinstance(exc, openai.APIStatusError):
                rep = exc.response.headers.get("x-llmgw-replica", "")
            return False, _kind(exc), rep, _retryable(exc)

    async def _worker(self, i: int) -> None:
        async with openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=self.timeout
        ) as c:
            n = 0
            while not self._stop.is_set():
                n += 1
                t = time.time()
                ok, kind, rep, retryable = await self._one(c, n)
                o = Outcome(t, ok, kind, rep, retryable)
                if not ok and retryable and not self._stop.is_set():
                    await asyncio.sleep(0.5)
                    o.retry_ok = (await self._one(c, n))[0]
                self.outcomes.append(o)
                await asyncio.sleep(self.pause)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def failed_twice(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok and o.retry_ok is not True]

    def kinds(self, since: float = 0.0) -> dict[str, int]:
        return dict(collections.Counter(o.kind for o in self.failed if o.t >= since))

    def ok_since(self, t: float) -> int:
        return sum(1 for o in self.outcomes if o.ok and o.t >= t)

    def figures(self) -> dict[str, Any]:
        return {
            "requests_sent": self.sent,
            "requests_failed": len(self.failed),
            "failed_after_one_retry": len(self.failed_twice),
            "failures": self.kinds(),
        }


@contextlib.asynccontextmanager
async def load(base_url: str, model: str, **kw: Any) -> AsyncIterator[Load]:
    ld = Load(base_url, model, **kw)
    ld.start()
    try:
        yield ld
    finally:
        if not ld._stop.is_set():
            await ld.stop()


def with_router(h: Harness, **router: Any) -> None:
    """Change the router section of a written server.yaml."""
    import yaml

    cfg = yaml.safe_load(h.server_yaml.read_text())
    cfg["router"] = {**cfg.get("router", {}), **router}
    h.server_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))


def job_ids_seen(h: Harness) -> set[str]:
    return {j[0] for j in h.jobs()}
