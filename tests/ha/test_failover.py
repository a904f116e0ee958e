"""Two daemons on one database and the dev cluster: one leads, the other takes over.

- kill -9 of the leader under load: the other leads (the next epoch), adopts the
  replica from one squeue, submits no second job (sacct), and not one request
  through it fails; the time from the kill to its first acting pass is printed;
- both started at the same instant, ten times: one leader each time, one job.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner

from llmgw_slurm.cli.admin import main as admin
from llmgw_slurm.db.keys import PgKeyStore
from tests.ha.conftest import PgDatabase
from tests.ha.peers import Peer, Peers
from tests.slurm.conftest import eventually
from tests.slurm.harness import tiny_model

pytestmark = [pytest.mark.ha]

ALWAYS = tiny_model("tiny", scaling={"min": 1, "max": 1})


@contextlib.contextmanager
def running(peers: Peers) -> Iterator[Peers]:
    try:
        yield peers
    finally:
        peers.stop()
        peers.cancel_all()


def _prefix() -> str:
    return "ha" + secrets.token_hex(3) + "."


async def ready_on(p: Peer, model: str, timeout: float = 120.0) -> None:
    async def probe() -> bool:
        st = await p.status()
        reps = [
            r for m in (st or {}).get("models", []) if m["name"] == model for r in m["replicas"]
        ]
        return any(r["state"] == "ready" for r in reps)

    await eventually(probe, f"a ready replica of {model} on {p.name}", timeout)


class Load:
    """Requests one after another from ``n`` clients through one gateway, until stopped."""

    def __init__(self, url: str, key: str, model: str, n: int = 4) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=key, max_retries=0, timeout=30
        )
        self.model = model
        self.n = n
        self.ok = 0
        self.tokens = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _one(self) -> None:
        while not self._stop.is_set():
            try:
                r = await self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
                self.ok += 1
                self.tokens += r.usage.total_tokens if r.usage else 0
            except openai.OpenAIError as exc:
                self.errors.append(repr(exc))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._one()) for _ in range(self.n)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self.client.close()


def replica_jobs(peers: Peers, model: str) -> list[dict[str, Any]]:
    return [h for h in peers.history() if h["name"].startswith(f"{peers.prefix}{model}.")]


async def test_kill_the_leader_under_load(
    pgdb: PgDatabase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = PgKeyStore(pgdb.info()).add("alice").key
    with running(Peers.make(tmp_path, _prefix(), pgdb, [ALWAYS])) as peers:
        peers.start()
        leader = await peers.leader()
        survivor = peers[1] if leader is peers[0] else peers[0]
        first = await leader.cluster()
        assert first is not None
        await ready_on(leader, "tiny")
        await ready_on(survivor, "tiny")

        async def nodes_on_follower() -> bool:
            # The follower lists nothing from Slurm: its page shows the leader's nodes.
            st = await survivor.status()
            return bool(st and {n["name"] for n in st["nodes"]} >= {"gpunode1", "gpunode5"})

        await eventually(nodes_on_follower, "the leader's node listing on the follower")
        load = Load(survivor.url, key, "tiny")
        load.start()
        await asyncio.sleep(2)
        killed_at = leader.kill9()

        async def took_over() -> dict[str, Any] | None:
            c = await survivor.cluster()
            ok = c and c["leading"] and c["epoch"] > first["epoch"] and c["first_pass_at"]
            return c if ok else None

        c = await eventually(took_over, "the survivor to lead and pass", 60)
        await asyncio.sleep(3)
        await load.stop()
        assert load.errors == [], load.errors[:5]
        assert load.ok > 0
        # Adopted, not replaced: one job for the model, ever, and it still serves.
        jobs = replica_jobs(peers, "tiny")
        assert len(jobs) == 1, jobs
        assert f"epoch={first['epoch']}" in jobs[0]["comment"]
        await ready_on(survivor, "tiny")
        await _said_everywhere(survivor, c["epoch"])
        with capsys.disabled():
            print(
                f"\nfailover: kill -9 of {leader.name} to {survivor.name}'s first pass as leader "
                f"(epoch {c['epoch']}): {c['first_pass_at'] - killed_at:.2f}s; "
                f"{load.ok} requests through {survivor.name} meanwhile, none failed"
            )


async def _said_everywhere(p: Peer, epoch: int) -> None:
    """The leader, its epoch and the daemons: in llmgw-admin status, the page, /metrics
    and /healthz."""
    # In a thread: the CLI runs its own event loop.
    argv = ["status", "--server", str(p.server_yaml)]
    out = await asyncio.to_thread(CliRunner().invoke, admin, argv)
    assert out.exit_code == 0, out.output
    assert f"leader: {p.name} (epoch {epoch}, since " in out.output, out.output
    assert re.search(r"^a +\S+ +http://\S+ +[\d.ms]+ ago", out.output, re.M), out.output
    page = await asyncio.to_thread(_text, p.url + "/")
    assert f"Leader: <b>{p.name}</b> (lease epoch {epoch}" in page
    metrics = await asyncio.to_thread(_text, p.url + "/metrics")
    assert f'llmgw_leader{{daemon="{p.name}"}} 1.0' in metrics
    assert f'llmgw_lease_epoch{{daemon="{p.name}"}} {float(epoch)}' in metrics
    health = p.get("/healthz")
    assert health is not None and health["leading"] and health["database"] == "ok", health


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


async def test_started_at_the_same_instant_ten_times(pgdb: PgDatabase, tmp_path: Path) -> None:
    with running(Peers.make(tmp_path, _prefix(), pgdb, [ALWAYS])) as peers:
        for round_ in range(10):
            peers.start()
            leader = await peers.leader()

            async def agreed(name: str = leader.name) -> bool:
                # Both name the same one leader (a daemon just started reads it soon).
                views = [await p.cluster() for p in peers.peers]
                return all(v and v["leader"] == name for v in views)

            await eventually(agreed, f"both daemons to name {leader.name} in round {round_}")

            async def one_job() -> bool:
                return len(peers.jobs()) == 1

            await eventually(one_job, f"one job in round {round_}", 60)
            # SIGTERM both at once, as a site's restart of both would.
            for p in peers.peers:
                assert p.proc is not None
                p.proc.terminate()
            peers.stop()
        assert len(replica_jobs(peers, "tiny")) == 1, replica_jobs(peers, "tiny")
        with contextlib.closing(pgdb.connect()) as conn:
            epochs = conn.execute("SELECT epoch FROM llmgw_lease").fetchone()
        # One taking of the lease a round: never two daemons leading one after the other.
        assert epochs is not None and epochs[0] == 10
