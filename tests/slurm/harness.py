"""A real daemon in the test's event loop, on the one-machine cluster.

Each harness writes its own server.yaml, models.yaml and agent.yaml to a temp
folder with a job prefix of its own, so tests never touch each other's jobs,
and runs the daemon exactly as `llmgw-admin serve` does (daemon.build and the
same apps), only on free ports and with a stop the test controls.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import textwrap
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmgw_slurm import daemon as daemonmod
from llmgw_slurm.config import load_server_config
from llmgw_slurm.slurm.cli import CliBackend
from tests.ports import free_port
from tests.slurm.conftest import backend_options, daemon_backend, eventually, need_backend

TOP = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SiteNode:
    """One node of the dev cluster as scripts/dev-cluster's NODE_TABLE makes it."""

    gpu_type: str
    gpus: int
    cpus: int
    memory_mb: int
    features: tuple[str, ...]
    partitions: tuple[str, ...]


_BIG = ("research", "llm", "llm-big")
# The site scripts/dev-cluster models (keep the two in step): llm over every node,
# llm-big over the nvlink nodes only; Slurm fills gpunode3-4 first (node weights).
SITE = {
    "gpunode1": SiteNode("a100", 4, 16, 64000, ("nvlink",), _BIG),
    "gpunode2": SiteNode("a100", 4, 16, 64000, ("nvlink",), _BIG),
    "gpunode3": SiteNode("a100", 4, 16, 32000, (), ("research", "llm")),
    "gpunode4": SiteNode("a100", 4, 16, 32000, (), ("research", "llm")),
    "gpunode5": SiteNode("h100", 2, 8, 48000, ("nvlink",), _BIG),
}


TINY_ENGINE = [
    "python3",
    "-m",
    "llmgw_slurm.testing.engine",
    "--host",
    "{host}",
    # The port and key come from LLMGW_ENGINE_PORT and LLMGW_ENGINE_API_KEY: on argv,
    # every node user would see them (and could listen on the port first).
    "--served-name",
    "{served_name}",
    # TLS as every engine serves it (llmgw_slurm/tls.py): the agent's files.
    "--ssl-certfile",
    "{tls_certfile}",
    "--ssl-keyfile",
    "{tls_keyfile}",
    "--ssl-ca-certs",
    "{tls_ca_certs}",
]


def tiny_model(name: str, **over: Any) -> dict[str, Any]:
    """A test-engine model entry; ``over`` replaces top-level sections."""
    m: dict[str, Any] = {
        "name": name,
        "engine": {"kind": "command", "command": TINY_ENGINE, "ready_timeout": "1m"},
        "resources": {
            "gpus": 1,
            "gpu_type": "a100",
            "cpus": 1,
            "memory": "500M",
            "partition": "llm",
            "time_limit": "30m",
        },
        "scaling": {"min": 0, "max": 1, "idle_timeout": "10m"},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(m.get(k), dict):
            m[k] = {**m[k], **v}
        else:
            m[k] = v
    return m


@dataclass
class Harness:
    folder: Path
    prefix: str
    gateway_port: int = field(default_factory=free_port)
    internal_port: int = field(default_factory=free_port)
    reconcile: dict[str, Any] = field(default_factory=dict)
    router: dict[str, Any] = field(default_factory=dict)
    # LLMGW_TEST_SLURM_BACKEND: the same reconciler tests on either backend.
    backend: str = field(default_factory=daemon_backend)
    d: daemonmod.Daemon | None = None
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event | None = None
    _listeners: daemonmod.Listeners | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def server_yaml(self) -> Path:
        return self.folder / "server.yaml"

    def write(self, models: list[dict[str, Any]]) -> None:
        need_backend(self.backend)
        self.folder.mkdir(parents=True, exist_ok=True)
        reconcile = {
            "interval": "1s",
            "eviction_grace": "3s",
            "min_lifetime": "3s",
            "renewal_margin": "1m",
            "drain_timeout": "15s",
            "restart": {"initial_backoff": "2s", "max_backoff": "20s", "give_up_after_failures": 3},
            **self.reconcile,
        }
        server = {
            "slurm": {
                "backend": self.backend,
                "partition": "llm",
                "job_prefix": self.prefix,
                **({"rest": backend_options("rest")} if self.backend == "rest" else {}),
            },
            "listen": {
                "gateway": f"127.0.0.1:{self.gateway_port}",
                "internal": f"127.0.0.1:{self.internal_port}",
                "daemon_url": f"http://127.0.0.1:{self.internal_port}",
            },
            "state_dir": str(self.folder / "state"),
            "models": "models.yaml",
            "agent_config": "agent.yaml",
            "reconcile": reconcile,
            "router": {"hold_timeout": "90s", **self.router},
        }
        self.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))
        self.write_models(models)
        (self.folder / "agent.yaml").write_text(
            textwrap.dedent(
                f"""\
                weights: {{cache_dir: {self.folder / "weights"}}}
                readiness: {{poll_interval: 0.3s, timeout: 1m}}
                heartbeat_interval: 1s
                port_range: 22000-29999
                drain: {{timeout: 15s, poll_interval: 0.5s, grace: 1s, stop_grace: 3s}}
                """
            )
        )

    def write_models(self, models: list[dict[str, Any]]) -> None:
        (self.folder / "models.yaml").write_text(
            yaml.safe_dump({"models": models}, sort_keys=False)
        )

    async def start(self) -> None:
        server = load_server_config(self.server_yaml)
        self.d = daemonmod.build(server, self.server_yaml)
        await daemonmod.check_slurm(self.d)
        self._stop = asyncio.Event()
        # As serve() does: both ports, the admin socket, and daemon.json published.
        self._listeners = await daemonmod.open_listeners(self.d, inherited=[])
        self._task = asyncio.create_task(self.d.reconciler.run(self._stop))

    async def stop(self) -> None:
        """Stop the daemon as a crash would leave things: jobs keep running."""
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.d is not None:
            await self.d.reconciler.close()
            await self.d.reconciler.backend.close()
        if self._listeners is not None:
            await self._listeners.close()
        self._listeners = None
        self._task = None

    @property
    def rec(self) -> Any:
        assert self.d is not None
        return self.d.reconciler

    def decisions(self, action: str | None = None, model: str | None = None) -> list[Any]:
        return [
            d
            for d in self.rec.decisions
            if (action is None or d.action == action) and (model is None or d.model == model)
        ]

    def jobs(self) -> list[tuple[str, str, str]]:
        """(job id, name, state) of this harness's jobs, straight from squeue."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i|%j|%T"], capture_output=True, text=True, check=True
        ).stdout
        rows = [tuple(line.split("|", 2)) for line in out.splitlines() if line]
        return [r for r in rows if r[1].startswith(self.prefix)]  # type: ignore[misc]


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path,
    prefix: str,
    models: list[dict[str, Any]],
    *,
    router: dict[str, Any] | None = None,
    configure: Callable[[Harness], None] | None = None,
    **reconcile: Any,
) -> AsyncIterator[Harness]:
    """A started daemon; ``router`` and ``reconcile`` override server.yaml's sections,
    ``configure`` may change the written files before it starts."""
    h = Harness(tmp_path / "daemon", prefix, reconcile=reconcile, router=router or {})
    h.write(models)
    if configure is not None:
        configure(h)
    await h.start()
    try:
        yield h
    finally:
        await h.stop()
        ids = [j[0] for j in h.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], check=False)


def filler(prefix: str, gres: str, *where: str) -> str:
    """Somebody else's job holding ``gres`` for a quarter of an hour; returns its id."""
    argv = ["sbatch", "--parsable", "-p", "llm", *where, f"--job-name={prefix}filler"]
    argv += [f"--gres={gres}", "--output=/dev/null", "--wrap", "sleep 900"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def research_job(prefix: str, node: str) -> str:
    """A job of the research partition taking all four GPUs of ``node``: it preempts
    (requeues) what the llm partition runs there. Returns its id; scancel it after."""
    argv = ["sbatch", "--parsable", "-p", "research", f"--nodelist={node}", "--gres=gpu:a100:4"]
    argv += [f"--job-name={prefix}research", "--output=/dev/null", "--wrap", "sleep 600"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def fill_nodes(prefix: str, count: int) -> list[str]:
    """Occupy ``count`` whole nodes (4 GPUs each) with somebody else's jobs; returns their ids."""
    return [filler(prefix, "gpu:a100:4") for _ in range(count)]


async def fill_all_but_one_node(prefix: str, gpu_type: str = "a100") -> tuple[str, list[str]]:
    """Occupy every free GPU of the llm partition but one whole free node's with somebody
    else's jobs, running: room for exactly one whole-node replica, whatever else shares the
    cluster. Returns (that node, the fillers' job ids)."""
    nodes = [n for n in await CliBackend().list_nodes() if "llm" in n.partitions and n.usable]
    whole = [n.name for n in nodes if n.gpus_free(gpu_type) == n.gpus_total(gpu_type) > 0]
    assert whole, f"no node with all its GPUs free to leave: {nodes}"
    keep = whole[0]
    ids = [
        filler(prefix, f"gpu:{gpu_type}:{n.gpus_free(gpu_type)}", f"--nodelist={n.name}")
        for n in nodes
        if n.name != keep and n.gpus_free(gpu_type) > 0
    ]

    async def running_all() -> bool:
        out = await asyncio.to_thread(
            subprocess.run,
            ["squeue", "-h", "-o", "%T", "-j", ",".join(ids)],
            capture_output=True,
            text=True,
        )
        states = out.stdout.split()
        return len(states) == len(ids) and set(states) <= {"RUNNING"}

    try:
        if ids:
            await eventually(running_all, "the filler jobs to run")
    except BaseException:
        subprocess.run(["scancel", *ids], check=False)
        raise
    return keep, ids
