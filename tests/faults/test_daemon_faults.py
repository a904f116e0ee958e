"""Faults inside the daemon itself (issue 33, item 1): the daemon serves on.

A real daemon on the dev cluster, run by ``daemon.serve`` as ``llmgw-admin
serve`` runs it, with a ready replica, under a steady load of chats:

1. it runs out of open files for real (its soft limit cut to what it holds): the
   passes' ``squeue`` cannot be spawned, new connections cannot be accepted; then
   the limit comes back. Before, the EMFILE left the pass loop, and with it
   ``serve``: the process ended.
2. an unexpected exception is injected into a pass, a report handler and the
   usage writer, EMFILE and a plain bug each: each is logged, counted in
   ``llmgw_daemon_faults_total{where}``, and the next pass, report and flush run.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import resource
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai

from llmgw_slurm import daemon as daemonmod
from llmgw_slurm.accounting.usage import query_usage
from llmgw_slurm.config import load_server_config
from llmgw_slurm.guard import open_fds
from llmgw_slurm.router import GATEWAY_KEY
from tests.faults.support import record
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, tiny_model


@contextlib.asynccontextmanager
async def serving(h: Harness) -> AsyncIterator[tuple[daemonmod.Daemon, asyncio.Task[None]]]:
    """The daemon as ``serve`` runs it (listeners, passes, systemd's notes)."""
    d = daemonmod.build(load_server_config(h.server_yaml), h.server_yaml)
    h.d = d
    stop = asyncio.Event()
    task = asyncio.create_task(daemonmod.serve(d, stop))
    try:
        yield d, task
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 60)


async def _chat(url: str) -> str:
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=60
    ) as c:
        r = await c.chat.completions.create(
            model="steady", messages=[{"role": "user", "content": "served"}]
        )
        return r.choices[0].message.content or ""


async def _fault_count(url: str, where: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    name = f'llmgw_daemon_faults_total{{where="{where}"}}'
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _failing(real: Callable[..., Any], faults: list[BaseException]) -> Callable[..., Any]:
    """``real``, raising each of ``faults`` on the next calls first."""

    def call(*args: Any, **kw: Any) -> Any:
        if faults:
            raise faults.pop(0)
        return real(*args, **kw)

    return call


async def _passes_after(d: daemonmod.Daemon, n: int) -> bool:
    return d.reconciler.passes > n


async def test_the_daemon_serves_through_emfile_and_exceptions_in_its_own_work(
    tmp_path: Path, prefix: str
) -> None:
    h = Harness(tmp_path / "daemon", prefix)
    h.write([tiny_model("steady", scaling={"min": 1, "max": 1})])
    async with serving(h) as (d, task):
        rec = d.reconciler

        async def ready() -> bool:
            return any(r.state().value == "ready" for r in rec.replicas.values())

        await eventually(ready, "a ready replica", timeout=180)
        assert (await _chat(h.url)).startswith("served")

        # 1. Out of open files, for real: nothing new can be opened for a while.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        passes = rec.passes
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 1, hard))
        said: set[str] = set()
        try:
            rec.want("steady")  # a pass now, not at the next interval
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5 or not said:
                assert not task.done(), task
                assert time.monotonic() - t0 < 60, "no pass tried while out of files"
                if rec.last_pass_error:
                    said.add(rec.last_pass_error)
                await asyncio.sleep(0.1)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # A pass that could not spawn squeue: Slurm not asked, nothing done, backoff.
        assert any("Too many open files" in e for e in said), said
        await eventually(lambda: _passes_after(d, passes), "a pass after the limit came back")
        assert (await _chat(h.url)).startswith("served")

        # 2. Exceptions where none was foreseen: a pass, a report handler, the usage writer.
        usage = d.gateway[GATEWAY_KEY].usage
        assert usage is not None
        backend = rec.pass_loop.backend
        backend.list_jobs = _failing(  # type: ignore[method-assign]
            backend.list_jobs, [OSError(errno.EMFILE, "Too many open files"), KeyError("bug")]
        )
        rec.intake.report = _failing(
            rec.intake.report, [OSError(errno.EMFILE, "Too many open files"), KeyError("bug")]
        )
        usage._write = _failing(  # type: ignore[method-assign]
            usage._write, [sqlite3.OperationalError("unable to open database file"), KeyError("bug")]
        )
        served = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            assert not task.done(), task
            assert (await _chat(h.url)).startswith("served")
            served += 1
        for where, n in (("pass", 2), ("report", 2), ("usage", 2)):

            async def counted(where: str = where, n: int = n) -> bool:
                return await _fault_count(h.url, where) >= n

            await eventually(counted, f"two faults counted in {where}")
        passes = rec.passes
        await eventually(lambda: _passes_after(d, passes), "passes after the faults")
        assert await ready()
        # Usage that could not be written waited for the next flush: every chat counted.
        await usage.flush()
        rows = query_usage(usage.path)
        assert sum(u.requests for u in rows) >= served + 2, rows
        assert not task.done()
    record("daemon-own-faults", requests_sent=served, requests_failed=0)
