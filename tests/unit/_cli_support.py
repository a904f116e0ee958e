"""A real daemon (gateway, status API, admin API) in a thread, with no Slurm behind it.

The CLIs under test call asyncio.run themselves, so the daemon's apps run on
their own event loop in a thread. The reconciler's loop never runs: tests set
its replicas, nodes and decisions directly, the way a pass would have, and
the one Slurm call the admin API makes (scancel, for ``stop``) goes to a fake
that rejects anything else.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw_slurm import daemon
from llmgw_slurm.auth.secrets import engine_api_key
from llmgw_slurm.config import load_server_config
from llmgw_slurm.reconciler.core import Decision, Replica
from llmgw_slurm.slurm.types import GpuCount, JobState, NodeInfo
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app
from tests.ports import free_port

MODELS_YAML = """\
models:
  - name: tiny
    aliases: [test/tiny-chat]
    description: The test engine (it echoes the prompt)
    engine:
      kind: command
      command: [python3, -m, llmgw_slurm.testing.engine, --port, "{port}"]
    resources: {gpus: 1, partition: llm}
    scaling: {min: 0, max: 2}
  - name: big-model
    engine:
      kind: command
      command: [python3, -m, llmgw_slurm.testing.engine, --port, "{port}"]
    resources: {gpus: 4, nodes: 2, partition: llm}
    scaling: {min: 0, max: 1}
"""


class StrictBackend:
    """Only ``cancel`` is expected from the admin routes; anything else is a test bug."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        assert signal is None and not batch_only
        self.cancelled.append(job_id)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(
            f"the admin API called backend.{name}, which this test does not expect"
        )


@dataclass
class RunningDaemon:
    d: daemon.Daemon
    server_path: Path
    url: str
    backend: StrictBackend
    loop: asyncio.AbstractEventLoop
    engine_url: str = ""
    runners: list[web.AppRunner] = field(default_factory=list)

    @property
    def rec(self) -> Any:
        return self.d.reconciler

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the daemon's loop (state changes race nothing there)."""
        done = threading.Event()
        out: list[Any] = []

        def go() -> None:
            out.append(fn())
            done.set()

        self.loop.call_soon_threadsafe(go)
        assert done.wait(10)
        return out[0]

    def add_replica(self, model: str, rid: str, state: str, **kw: Any) -> Replica:
        job_state = {"pending": JobState.PENDING}.get(state, JobState.RUNNING)
        r = Replica(
            replica_id=rid,
            model=model,
            job_id=kw.pop("job_id", str(1000 + len(self.rec.replicas))),
            submitted_at=time.time(),
            job_state=job_state,
            **kw,
        )
        if state == "ready":
            r.base_url = r.base_url or self.engine_url
            r.ready_at = time.time()
            r.step = "ready"
        self.call(lambda: self.rec.replicas.__setitem__(rid, r))
        return r


def write_config(
    tmp: Path, gateway: int, internal: int, keys_file: Path | None, extra: str = ""
) -> Path:
    (tmp / "models.yaml").write_text(MODELS_YAML)
    (tmp / "agent.yaml").write_text("heartbeat_interval: 2s\n")
    text = (
        "slurm: {job_prefix: llmgwTunit.}\n"
        f"listen: {{gateway: '127.0.0.1:{gateway}', internal: '127.0.0.1:{internal}'}}\n"
        "state_dir: state\nmodels: models.yaml\nagent_config: agent.yaml\n"
    )
    if keys_file is not None:
        text += f"router: {{keys_file: {keys_file}}}\n"
    text += extra
    p = tmp / "server.yaml"
    p.write_text(text)
    return p


@dataclass
class _Started:
    loop: asyncio.AbstractEventLoop
    runners: list[web.AppRunner]
    engine_url: str


def run_daemon(
    tmp: Path,
    *,
    keys_file: Path | None = None,
    runtime_dir: Path | None = None,
    extra: str = "",
) -> Iterator[RunningDaemon]:
    """Start the daemon's apps (not its reconcile loop); yields; stops them.

    ``extra``: more top-level server.yaml lines.
    """
    gw_port, int_port = free_port(), free_port()
    if runtime_dir is not None:
        extra += f"runtime_dir: {runtime_dir}\n"
    path = write_config(tmp, gw_port, int_port, keys_file, extra)
    server = load_server_config(path)
    d = daemon.build(server, path)
    backend = StrictBackend()
    d.reconciler.backend = backend  # type: ignore[assignment]
    # The one cluster's listing, as a pass leaves it: listed a while ago and kept
    # (reconcile.nodes_max_age).
    cluster = d.reconciler.clusters.first
    cluster.nodes = [
        NodeInfo("gpunode1", "mixed", ("llm",), 8, 2, 64000, (GpuCount("a100", 4, 1),)),
        NodeInfo("gpunode2", "idle", ("llm",), 8, 0, 64000, (GpuCount("a100", 4, 0),)),
    ]
    cluster.nodes_listed_at = time.time() - 125
    d.reconciler.table.nodes = cluster.nodes
    d.reconciler.table.nodes_listed_at = cluster.nodes_listed_at
    ready = threading.Event()
    holder: list[_Started] = []
    stop_box: list[asyncio.Event] = []

    async def main() -> None:
        eng_port = free_port()
        engine = create_engine_app(
            EngineOptions(
                api_key=engine_api_key(d.reconciler.server_key, "0000aaaa"), served_name="tiny"
            )
        )
        # The daemon's own three ways in (gateway, internal, admin socket) and daemon.json.
        listeners = await daemon.open_listeners(d, inherited=[])
        r = web.AppRunner(engine, handler_cancellation=True, access_log=None)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", eng_port).start()
        runners = [*listeners.runners, r]
        stop = asyncio.Event()
        stop_box.append(stop)
        holder.append(_Started(asyncio.get_running_loop(), runners, f"http://127.0.0.1:{eng_port}"))
        ready.set()
        await stop.wait()
        await r.cleanup()
        await listeners.close()

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(20), "the daemon's apps did not start"
    st = holder[0]
    scheme = "https" if server.tls.enabled else "http"
    rd = RunningDaemon(d, path, f"{scheme}://127.0.0.1:{gw_port}", backend, st.loop, st.engine_url)
    # Where llmgw looks for the daemon.json it checks the port's owner against
    # before it sends a key or a prompt (the default is the unit's /run/llmgw-slurm).
    saved = os.environ.get("LLMGW_DAEMON_INFO")
    os.environ["LLMGW_DAEMON_INFO"] = str(d.server.effective_runtime_dir() / "daemon.json")
    try:
        yield rd
    finally:
        if saved is None:
            os.environ.pop("LLMGW_DAEMON_INFO", None)
        else:
            os.environ["LLMGW_DAEMON_INFO"] = saved
        st.loop.call_soon_threadsafe(stop_box[0].set)
        t.join(20)


def add_decision(rd: RunningDaemon, action: str, model: str, rid: str, reason: str) -> None:
    rd.call(
        lambda: rd.rec.decisions.append(Decision(time.time() - 5, action, model, rid, reason, "p1"))
    )
