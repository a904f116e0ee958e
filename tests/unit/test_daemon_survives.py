"""The daemon lives through what used to end it or wear it down: connections that
send nothing, a flood from one local user, an exception in a report handler, a
pass or the usage writer, a report whose nonce cannot be journalled; and /metrics
says so."""

from __future__ import annotations

import asyncio
import errno
import shutil
import socket
import sqlite3
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _cli_support import RunningDaemon, run_daemon
from test_reconciler_core import make  # type: ignore[import-not-found]

from llmgw_slurm.accounting.usage import UsageRecord, UsageStore, query_usage
from llmgw_slurm.agent.report import DaemonClient
from llmgw_slurm.auth.secrets import replica_secret
from tests.hostile_user import INTRUDER

LIMITS = "connections: {head_timeout: 0.5s, per_peer: 20}\n"
RID = "0000aaaa"


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    yield from run_daemon(tmp_path, extra=LIMITS)


def _ports(rd: RunningDaemon) -> tuple[int, int]:
    return rd.d.server.listen.gateway.port, rd.d.server.listen.internal.port


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(30)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def _metrics(rd: RunningDaemon) -> str:
    status, text = asyncio.run(_get(rd.url + "/metrics"))
    assert status == 200
    return text


def test_a_connection_that_sends_no_request_head_is_closed_on_both_ports(
    rd: RunningDaemon,
) -> None:
    for port in _ports(rd):
        idle = socket.create_connection(("127.0.0.1", port))
        trickle = socket.create_connection(("127.0.0.1", port))
        trickle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # its head never ends
        # Before: aiohttp waited for a head as long as the client liked.
        assert _closed_by_peer(idle) and _closed_by_peer(trickle)
        idle.close()
        trickle.close()
    text = _metrics(rd)
    for listener in ("gateway", "internal"):
        name = f'llmgw_connections_refused_total{{listener="{listener}",reason="head_timeout"}}'
        assert _sample(text, name) == 2


def test_one_local_users_flood_leaves_the_others_served(rd: RunningDaemon) -> None:
    INTRUDER.ensure()
    gw, internal = _ports(rd)
    flood = textwrap.dedent(
        """
        import socket, sys, time
        held = []
        for port in sys.argv[1:]:
            for _ in range(200):
                try:
                    held.append(socket.create_connection(("127.0.0.1", int(port))))
                except OSError:
                    pass
        print("held", flush=True)
        time.sleep(60)
        """
    )
    with INTRUDER.spawn_python(flood, str(gw), str(internal)) as p:
        assert p.stdout is not None and p.stdout.readline() == "held\n"
        # The intruder holds its 20 on each port; root, another user, is served.
        text = _metrics(rd)
        for listener in ("gateway", "internal"):
            refused = f'llmgw_connections_refused_total{{listener="{listener}",reason="peer"}}'
            assert _sample(text, refused) >= 200 - 20
        assert _sample(text, 'llmgw_connections{listener="gateway"}') <= 20 + 1
        # The listen backlog, as the kernel caps it.
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        for listener in ("gateway", "internal"):
            limit = _sample(text, f'llmgw_accept_queue_limit{{listener="{listener}"}}')
            assert limit == min(1024, somaxconn)
            assert 0 <= _sample(text, f'llmgw_accept_queue{{listener="{listener}"}}') <= limit
        status, _ = asyncio.run(_get(f"http://127.0.0.1:{internal}/healthz"))
        assert status == 200


async def _report(rd: RunningDaemon, event: str = "step") -> Any:
    async with aiohttp.ClientSession() as s:
        client = DaemonClient(
            s,
            f"http://127.0.0.1:{rd.d.server.listen.internal.port}",
            RID,
            replica_secret(rd.rec.server_key, RID),
            node="gpunode1",
            job_id="",
        )
        return await client.send_once(client.body(event, step="weights", status="started"))


def test_an_exception_in_a_report_handler_is_counted_and_the_next_report_is_taken(
    rd: RunningDaemon,
) -> None:
    real = rd.rec.intake.report
    calls: list[int] = []

    def failing_once(rid: str, body: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(rid, body)

    rd.call(lambda: setattr(rd.rec.intake, "report", failing_once))
    assert asyncio.run(_report(rd)) is None  # a 500: the agent sends it again
    answer = asyncio.run(_report(rd))
    assert answer is not None and answer.ok and not answer.drain
    assert _sample(_metrics(rd), 'llmgw_daemon_faults_total{where="report"}') == 1
    assert asyncio.run(_get(rd.url + "/healthz"))[0] == 200


def test_a_report_whose_nonce_cannot_be_journalled_is_refused_not_taken(
    rd: RunningDaemon,
) -> None:
    journal = Path(rd.d.server.state_dir) / "report-nonces"
    kept = rd.rec.verifier.nonces_kept
    # A folder where the journal should be: appending to it fails (EISDIR).
    journal.unlink()
    journal.mkdir()
    try:
        # Before: "cannot append" was logged and the report accepted unjournalled.
        assert asyncio.run(_report(rd)) is None
        assert rd.rec.verifier.nonces_kept == kept
        assert RID not in rd.rec.intake.early
    finally:
        shutil.rmtree(journal)
    answer = asyncio.run(_report(rd))
    assert answer is not None and answer.ok
    assert rd.rec.verifier.nonces_kept == kept + 1
    assert f"{RID}:" in journal.read_text()


async def test_a_pass_that_raises_does_not_end_the_loop(tmp_path: Path) -> None:
    rec, fake = make(tmp_path, reconcile={"interval": "0.05s"})
    failures = iter(
        [OSError(errno.EMFILE, "Too many open files"), RuntimeError("a bug in a pass")]
    )
    real = fake.list_jobs

    async def list_jobs(prefix: str = "") -> Any:
        fault = next(failures, None)
        if fault is not None:
            raise fault
        return await real(prefix)

    fake.list_jobs = list_jobs  # type: ignore[method-assign]
    stop = asyncio.Event()
    loop = asyncio.create_task(rec.run(stop))
    deadline = time.monotonic() + 60
    said: set[str] = set()
    # Before: the first exception left run() and, with it, the daemon.
    while rec.passes < 2:
        assert not loop.done(), loop
        assert time.monotonic() < deadline, "no pass after the faults"
        said.add(rec.last_pass_error)
        await asyncio.sleep(0.005)
    stop.set()
    await loop
    assert rec.faults.counts["pass"] == 2
    # Said as the pass's own failure, not as Slurm's (the status line tells them apart).
    assert "the pass failed: RuntimeError: a bug in a pass" in said, said


async def test_a_failed_usage_write_is_counted_and_written_at_the_next_flush(
    tmp_path: Path,
) -> None:
    store = UsageStore(tmp_path / "usage.sqlite3", flush_interval_s=0.05)
    real = store._write
    failed: list[int] = []

    def write(batch: list[UsageRecord]) -> None:
        if not failed:
            failed.append(len(batch))
            raise sqlite3.OperationalError("unable to open database file")
        real(batch)

    store._write = write  # type: ignore[method-assign]
    store.start()
    store.record(UsageRecord(time.time(), "k1", "alice", "", "m", "chat", 3, 4, 7))
    deadline = time.monotonic() + 60
    # Before: the writer's task caught only sqlite3.Error and dropped the batch.
    while not query_usage(store.path):
        assert time.monotonic() < deadline, "the kept record was never written"
        await asyncio.sleep(0.05)
    await store.close()
    assert failed == [1] and store.faults.counts["usage"] == 1
    assert [u.total_tokens for u in query_usage(store.path)] == [7]
