"""A real daemon in the test's event loop, on the one-machine cluster.

Each harness writes its own server.yaml, models.yaml and agent.yaml to a temp
folder with a job prefix of its own, so tests never touch each other's jobs,
and runs the daemon exactly as `llmgw-admin serve` does (daemon.build and the
same apps), only on free ports and with a stop the test controls.

Tests that count GPUs (evictions: "only two whole nodes are free") share the
cluster with whatever else runs on it: the README has `scripts/demo` leave its
daemon and a replica running before `scripts/test`, and a site's cluster always
has other jobs. They isolate themselves with :func:`reservation`: a Slurm
reservation over every node for the test's own jobs (its daemon's, through
server.yaml's slurm.reservation, and its fillers'). Why a reservation and not a
partition or a node list of its own: jobs that run already keep their GPUs
whatever the test does (the fillers and :func:`fill_all_but` count them as
taken), but no job that does not ask for the reservation can start on its nodes
while it lasts: another daemon's renewal or restart, or another user's job,
cannot take the GPUs the test has just freed by an eviction. A partition would
not keep them out, and a node list would still be shared. Created with
IGNORE_JOBS (jobs already running stay), over ALL nodes so that the test
daemon's view of free GPUs (every node of its partitions) is the view Slurm
schedules it by, and with a time limit, so that one a crashed test leaves
behind ends by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import subprocess
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmgw_slurm import daemon as daemonmod
from llmgw_slurm.config import load_server_config
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import NodeInfo
from tests.ports import free_port
from tests.slurm.conftest import backend_options, daemon_backend, eventually, need_backend

TOP = Path(__file__).resolve().parents[2]
# The harness's restart rules (a test passing restart= replaces them whole): short
# backoffs, and a replica that served 3 s is a start that worked.
RESTART = {
    "initial_backoff": "2s",
    "max_backoff": "20s",
    "give_up_after_failures": 3,
    "healthy_after": "3s",
}


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
    # TLS as every engine serves it (llmgw_slurm/auth/tls.py): the agent's files.
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
    # The Slurm reservation its jobs run in (reservation()), or None.
    reservation: str | None = None
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
            "restart": RESTART,
            **self.reconcile,
        }
        slurm: dict[str, Any] = {
            "backend": self.backend,
            "partition": "llm",
            "job_prefix": self.prefix,
        }
        if self.backend == "rest":
            slurm["rest"] = backend_options("rest")
        if self.reservation:
            slurm["reservation"] = self.reservation
        server = {
            "slurm": slurm,
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
    reservation: str | None = None,
    **reconcile: Any,
) -> AsyncIterator[Harness]:
    """A started daemon; ``router`` and ``reconcile`` override server.yaml's sections,
    ``configure`` may change the written files before it starts; ``reservation``: the
    Slurm reservation its jobs run in (:func:`reservation`)."""
    h = Harness(
        tmp_path / "daemon",
        prefix,
        reconcile=reconcile,
        router=router or {},
        reservation=reservation,
    )
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


@contextlib.contextmanager
def reservation(prefix: str, minutes: int = 60) -> Iterator[str]:
    """A Slurm reservation over every node for this user's jobs that ask for it; its name.

    Why (and why these flags): the module docstring. Removed on the way out;
    one left by a crashed run ends after ``minutes``.
    """
    name = prefix.rstrip(".") + "-isolated"
    argv = ["scontrol", "create", "reservation", f"ReservationName={name}", "StartTime=now"]
    argv += [f"Duration={minutes}", "Nodes=ALL", f"Users={getpass.getuser()}"]
    argv += ["Flags=IGNORE_JOBS"]
    made = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert made.returncode == 0, f"{' '.join(argv)}: {made.stdout}{made.stderr}"
    try:
        yield name
    finally:
        subprocess.run(
            ["scontrol", "delete", f"ReservationName={name}"], capture_output=True, check=False
        )


def filler(prefix: str, gres: str, *where: str, reservation: str | None = None) -> str:
    """Somebody else's job holding ``gres`` for a quarter of an hour; returns its id."""
    argv = ["sbatch", "--parsable", "-p", "llm", *where, f"--job-name={prefix}filler"]
    if reservation:
        argv.append(f"--reservation={reservation}")
    argv += [f"--gres={gres}", "--output=/dev/null", "--wrap", "sleep 900"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def research_job(prefix: str, node: str) -> str:
    """A job of the research partition taking all four GPUs of ``node``: it preempts
    (requeues) what the llm partition runs there. Returns its id; scancel it after."""
    argv = ["sbatch", "--parsable", "-p", "research", f"--nodelist={node}", "--gres=gpu:a100:4"]
    argv += [f"--job-name={prefix}research", "--output=/dev/null", "--wrap", "sleep 600"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


async def fill_all_but(
    prefix: str, keep: int = 1, gpu_type: str = "a100", reservation: str | None = None
) -> tuple[list[str], list[str]]:
    """Occupy every free GPU of the llm partition but ``keep`` whole free nodes' with
    somebody else's jobs, running: room for exactly ``keep`` whole-node replicas, whatever
    else shares the cluster. Returns (the nodes kept, the fillers' job ids)."""
    nodes = [n for n in await CliBackend().list_nodes() if "llm" in n.partitions and n.usable]
    whole = [n.name for n in nodes if n.gpus_free(gpu_type) == n.gpus_total(gpu_type) > 0]
    assert len(whole) >= keep, (
        f"{keep} node(s) with all their {gpu_type} GPUs free are needed, {len(whole)} are: "
        f"{[(n.name, n.gpus_free(gpu_type)) for n in nodes]}; squeue shows what holds them"
    )
    kept = whole[:keep]
    ids = await hold_free_gpus(
        prefix, [n for n in nodes if n.name not in kept], gpu_type, reservation
    )
    return kept, ids


async def fill_all_but_one_node(
    prefix: str, gpu_type: str = "a100", reservation: str | None = None
) -> tuple[str, list[str]]:
    """:func:`fill_all_but` one node; returns (that node, the fillers' job ids)."""
    kept, ids = await fill_all_but(prefix, 1, gpu_type, reservation)
    return kept[0], ids


async def hold_free_gpus(
    prefix: str, nodes: list[NodeInfo], gpu_type: str, reservation: str | None = None
) -> list[str]:
    """Somebody else's jobs on every free ``gpu_type`` GPU of ``nodes``, running; their ids."""
    ids = [
        filler(
            prefix,
            f"gpu:{gpu_type}:{n.gpus_free(gpu_type)}",
            f"--nodelist={n.name}",
            reservation=reservation,
        )
        for n in nodes
        if n.gpus_free(gpu_type) > 0
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
    return ids
