"""Several daemons on one database and the one-machine cluster, each its own process.

Each peer is ``llmgw-admin serve`` with its own server.yaml, state directory
and ports, and the same job prefix, catalog, keys (in the database) and
database as the others: two login nodes, on one machine. A peer can be
killed with SIGKILL (a login node lost) or stopped with SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.ha.conftest import PgDatabase
from tests.ports import free_port
from tests.slurm.conftest import eventually

TOP = Path(__file__).resolve().parents[2]
# llmgw-admin from this checkout (PYTHONPATH), whatever the console script points at.
ADMIN = [sys.executable, "-c", "from llmgw_slurm.cli.admin import main; main()"]


@dataclass
class Peer:
    name: str
    folder: Path
    prefix: str
    db: dict[str, Any] | None
    gateway_port: int = field(default_factory=free_port)
    internal_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def server_yaml(self) -> Path:
        return self.folder / "server.yaml"

    @property
    def log(self) -> Path:
        return self.folder / "daemon.log"

    def write(self, shared: Path) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        server = {
            "slurm": {"partition": "llm", "job_prefix": self.prefix},
            "listen": {
                "gateway": f"127.0.0.1:{self.gateway_port}",
                "internal": f"127.0.0.1:{self.internal_port}",
                "daemon_url": f"http://127.0.0.1:{self.internal_port}",
            },
            "state_dir": str(self.folder / "state"),
            "models": str(shared / "models.yaml"),
            "agent_config": str(shared / "agent.yaml"),
            "reconcile": {
                "interval": "1s",
                "eviction_grace": "3s",
                "min_lifetime": "3s",
                "renewal_margin": "1m",
                "drain_timeout": "15s",
                "restart": {"initial_backoff": "2s", "max_backoff": "20s", "healthy_after": "3s"},
            },
            "router": {"hold_timeout": "90s", "keys_file": str(shared / "keys.json")},
            **({"database": self.db} if self.db is not None else {}),
            **self.extra,
        }
        self.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} runs already"
        env = {**os.environ, "PYTHONPATH": str(TOP)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*ADMIN, "serve", "--server", str(self.server_yaml)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def kill9(self) -> float:
        """A login node lost: SIGKILL, no goodbye. Returns the time (Unix) of the kill."""
        assert self.proc is not None
        t = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return t

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def get(self, path: str, timeout: float = 5.0) -> dict[str, Any] | None:
        """GET a JSON answer from this peer's gateway; None when it does not answer."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                data: dict[str, Any] = json.loads(r.read())
                return data
        except (urllib.error.URLError, OSError, ValueError):
            return None

    async def status(self) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.get, "/api/v1/status")

    async def cluster(self) -> dict[str, Any] | None:
        st = await self.status()
        return st.get("peers") if st else None

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def agent_yaml(folder: Path) -> str:
    return textwrap.dedent(
        f"""\
        weights: {{cache_dir: {folder / "weights"}}}
        readiness: {{poll_interval: 0.3s, timeout: 1m}}
        heartbeat_interval: 1s
        port_range: 22000-29999
        drain: {{timeout: 15s, poll_interval: 0.5s, grace: 1s, stop_grace: 3s}}
        """
    )


@dataclass
class Peers:
    """N daemons on one database, one job prefix, one catalog."""

    folder: Path
    prefix: str
    db: PgDatabase
    peers: list[Peer] = field(default_factory=list)

    @classmethod
    def make(
        cls,
        folder: Path,
        prefix: str,
        db: PgDatabase,
        models: list[dict[str, Any]],
        n: int = 2,
        **extra: Any,
    ) -> Peers:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "models.yaml").write_text(yaml.safe_dump({"models": models}, sort_keys=False))
        (folder / "agent.yaml").write_text(agent_yaml(folder))
        p = cls(folder, prefix, db)
        for i in range(n):
            name = "ab"[i] if n <= 2 else f"d{i}"
            peer = Peer(name, folder / name, prefix, db.server_yaml_block(name), extra=extra)
            peer.write(folder)
            p.peers.append(peer)
        return p

    def __getitem__(self, i: int) -> Peer:
        return self.peers[i]

    def start(self) -> None:
        for p in self.peers:
            p.start()

    def stop(self) -> None:
        for p in self.peers:
            p.stop()

    def jobs(self) -> list[tuple[str, str, str]]:
        """(job id, name, state) of these peers' jobs, from squeue."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i|%j|%T"], capture_output=True, text=True, check=True
        ).stdout
        rows = [tuple(line.split("|", 2)) for line in out.splitlines() if line]
        return [r for r in rows if r[1].startswith(self.prefix)]  # type: ignore[misc]

    def history(self) -> list[dict[str, str]]:
        """Every job these peers ever submitted, from sacct: id, name, comment, submit, state."""
        argv = ["sacct", "-X", "-n", "-P", "-S", "now-2hours", "-o"]
        argv.append("JobID,JobName%200,Comment%300,Submit,State")
        out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        keys = ("id", "name", "comment", "submit", "state")
        rows = [dict(zip(keys, line.split("|"), strict=False)) for line in out.splitlines()]
        rows = [r for r in rows if r.get("name", "").startswith(self.prefix)]
        # slurmdbd has a running job's comment only once it ends: squeue's for those.
        queued = subprocess.run(
            ["squeue", "-h", "-o", "%i|%k"], capture_output=True, text=True, check=True
        ).stdout
        comments = dict(line.split("|", 1) for line in queued.splitlines() if "|" in line)
        for r in rows:
            if not r["comment"] and r["id"] in comments:
                r["comment"] = comments[r["id"]]
        return rows

    def cancel_all(self) -> None:
        ids = [j[0] for j in self.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], check=False)

    async def leader(self, timeout: float = 60.0) -> Peer:
        """The one peer that leads, once one does (and says so in status) and every
        peer running answers (a test goes on to use the others too)."""

        async def probe() -> Peer | None:
            leading = []
            for p in self.peers:
                if p.proc is None or p.proc.poll() is not None:
                    continue
                c = await p.cluster()
                if c is None:
                    return None
                if c.get("leading"):
                    leading.append(p)
            return leading[0] if len(leading) == 1 else None

        return await eventually(probe, "one leader", timeout)
