"""Who is who in a replica's job: head address, node rank, node count, ports.

The role of a node is a pure function of the job environment (tested with
fake ``SLURM_*`` dicts); expanding a Slurm hostlist is the one place that asks
Slurm (``scontrol show hostnames``, through :func:`llmgw_slurm.slurm.cli.show_hostnames`),
hidden behind :func:`expand_hostnames`.

The head's distributed port, two ways:

- with a rendezvous directory that every node of the job sees (agent
  setting ``rendezvous_dir``), the head picks any free port of the range and
  publishes it in a file there; the workers wait for the file. The file is
  named by job id and restart count, so a requeued job never reads the port
  of its previous run. Preferred: the head can always find a free port.
- without one (the default: agent.yaml may sit on a shared filesystem, but
  nothing promises a writable one), every node derives the same port from
  the job id and restart count (:func:`derived_port`); the head checks that it
  is free and fails clearly if another process holds it, since it cannot tell
  the workers about a move. The daemon then restarts the replica as a new job
  with another id, hence another port.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmgw_slurm.agent.errors import RendezvousError
from llmgw_slurm.base.errors import SlurmError
from llmgw_slurm.base.fsutil import atomic_write
from llmgw_slurm.slurm.cli import show_hostnames

__all__ = [
    "NodeRole",
    "await_published",
    "check_port_free",
    "compute_role",
    "derived_port",
    "expand_hostnames",
    "pick_free_port",
    "publish",
    "rendezvous_path",
]

_PLAIN_HOSTLIST = re.compile(r"^[A-Za-z0-9._\-]+(,[A-Za-z0-9._\-]+)*$")


@dataclass(frozen=True)
class NodeRole:
    """This node's place in the replica. ``rank`` 0 is the head."""

    job_id: str
    restart: int
    rank: int
    nnodes: int
    head_host: str

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def expand_hostnames(
    nodelist: str, run: Callable[..., subprocess.CompletedProcess[str]] | None = None
) -> list[str]:
    """``node[01-03],gpu7`` -> ``[node01, node02, node03, gpu7]``.

    A list without brackets is split here; anything else goes to
    ``scontrol show hostnames``, which knows every form Slurm writes.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise RendezvousError("rendezvous: empty node list in the job environment")
    if _PLAIN_HOSTLIST.fullmatch(nodelist):
        return nodelist.split(",")
    try:
        return show_hostnames(nodelist, run=run)
    except SlurmError as err:
        raise RendezvousError(f"rendezvous: {err}") from err


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as err:
        raise RendezvousError(f"rendezvous: {name}={value!r} is not an integer") from err


def compute_role(env: Mapping[str, str], expand: Callable[[str], list[str]]) -> NodeRole:
    """This node's role, from the environment srun gives each agent.

    - job id: ``SLURM_HET_JOB_ID`` (a het job's components have ids of their
      own; the het id is the one every agent shares), else ``SLURM_JOB_ID``.
    - head: first host of ``SLURM_JOB_NODELIST_HET_GROUP_0``, else of
      ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``.
    - node count: the sum of ``SLURM_JOB_NUM_NODES_HET_GROUP_<i>`` over the
      ``SLURM_HET_SIZE`` components, else ``SLURM_STEP_NUM_NODES`` /
      ``SLURM_JOB_NUM_NODES`` / ``SLURM_NNODES``.
    - rank: ``SLURM_PROCID`` (the templates start one task per node, and a het
      step numbers its tasks across components); without it, the nodes of
      the components before ``SLURM_HET_JOB_OFFSET`` plus ``SLURM_NODEID``.
    """
    job_id = env.get("SLURM_HET_JOB_ID") or env.get("SLURM_JOB_ID")
    if not job_id:
        raise RendezvousError(
            "rendezvous: neither SLURM_HET_JOB_ID nor SLURM_JOB_ID is set: not inside a Slurm job"
        )
    restart = _int_env(env, "SLURM_RESTART_COUNT") or 0

    het_size = _int_env(env, "SLURM_HET_SIZE")
    group_nodes: list[int] = []
    if het_size:
        for i in range(het_size):
            n = _int_env(env, f"SLURM_JOB_NUM_NODES_HET_GROUP_{i}")
            if n is None:
                raise RendezvousError(
                    f"rendezvous: SLURM_HET_SIZE={het_size} but SLURM_JOB_NUM_NODES_HET_GROUP_{i} "
                    "is not set"
                )
            group_nodes.append(n)
        nnodes = sum(group_nodes)
    else:
        found = None
        for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
            found = _int_env(env, name)
            if found is not None:
                break
        nnodes = found if found is not None else 1

    head_list = (
        env.get("SLURM_JOB_NODELIST_HET_GROUP_0")
        or env.get("SLURM_JOB_NODELIST")
        or env.get("SLURM_NODELIST")
    )
    if not head_list:
        raise RendezvousError("rendezvous: no SLURM_JOB_NODELIST in the environment")
    head_host = expand(head_list)[0]

    rank = _int_env(env, "SLURM_PROCID")
    if rank is None:
        offset = _int_env(env, "SLURM_HET_JOB_OFFSET") or 0
        node_id = _int_env(env, "SLURM_NODEID") or 0
        rank = sum(group_nodes[:offset]) + node_id
    if not 0 <= rank < nnodes:
        raise RendezvousError(
            f"rendezvous: rank {rank} is outside 0..{nnodes - 1}; the job must run one "
            "agent task per node (srun --ntasks-per-node=1)"
        )
    return NodeRole(job_id=job_id, restart=restart, rank=rank, nnodes=nnodes, head_host=head_host)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the servers that will take the port do (uvicorn, aiohttp, torch's
        # store): a port whose last connection lingers in TIME_WAIT is free to
        # them, and only a listener makes the bind fail.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_port(
    port_range: tuple[int, int],
    seed: int,
    host: str = "0.0.0.0",  # noqa: S104 - probing the port on every interface
    exclude: Iterable[int] = (),
) -> int:
    """A port of ``port_range`` (inclusive) free on this node, trying from ``seed``.

    Starting from a seed (the job id) spreads jobs that share a node over the
    range, so they rarely race for the same port between check and use.
    """
    lo, hi = port_range
    if not 0 < lo <= hi <= 65535:
        raise RendezvousError(f"rendezvous: bad port range {lo}-{hi}")
    span = hi - lo + 1
    skip = set(exclude)
    for i in range(span):
        port = lo + (seed + i) % span
        if port not in skip and _port_free(host, port):
            return port
    raise RendezvousError(f"rendezvous: no free port in {lo}-{hi} on {socket.gethostname()}")


def derived_port(port_range: tuple[int, int], role: NodeRole) -> int:
    """The same port on every node of one job run, spread over the range."""
    lo, hi = port_range
    digest = hashlib.sha256(f"{role.job_id}.{role.restart}".encode()).digest()
    return lo + int.from_bytes(digest[:4], "big") % (hi - lo + 1)


def check_port_free(port: int, host: str) -> None:
    if not _port_free(host, port):
        raise RendezvousError(
            f"rendezvous: port {port} (derived from the job id) is taken on "
            f"{socket.gethostname()}; set a rendezvous directory in agent.yaml to let the "
            "head choose a free one"
        )


def rendezvous_path(shared_dir: Path, role: NodeRole) -> Path:
    return shared_dir / "rendezvous" / f"{role.job_id}.{role.restart}.json"


def publish(path: Path, role: NodeRole, master_addr: str, master_port: int) -> None:
    """The head writes its address and port; written whole, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "job_id": role.job_id,
        "restart": role.restart,
        "master_addr": master_addr,
        "master_port": master_port,
        "nnodes": role.nnodes,
        "published_at": time.time(),
    }
    atomic_write(path, json.dumps(doc))


async def await_published(
    path: Path, role: NodeRole, timeout_s: float, poll_s: float = 1.0
) -> tuple[str, int]:
    """A worker waits for the head's file; returns (master_addr, master_port)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            doc = json.loads(await asyncio.to_thread(path.read_text))
            if doc.get("job_id") != role.job_id or doc.get("restart") != role.restart:
                raise RendezvousError(f"rendezvous: {path} belongs to another job run")
            return str(doc["master_addr"]), int(doc["master_port"])
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as err:
            raise RendezvousError(f"rendezvous: {path} is unreadable: {err}") from err
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rendezvous: the head ({role.head_host}) did not publish {path} within "
                f"{timeout_s:.0f}s; is the shared directory shared between the nodes?"
            )
        await asyncio.sleep(poll_s)
