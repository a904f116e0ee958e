"""Fixtures for tests against the one-machine cluster (scripts/dev-cluster up)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from llmgw_slurm.slurm.cli import CliBackend

TOP = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/slurm/" in str(item.path):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session", autouse=True)
def slurm_conf() -> str:
    conf = os.environ.get("SLURM_CONF") or str(TOP / ".dev-cluster" / "etc" / "slurm.conf")
    os.environ["SLURM_CONF"] = conf
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, check=False)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        # Not a skip: a Slurm test that silently does not run proves nothing.
        pytest.fail(
            f"the dev cluster is not up (SLURM_CONF={conf}): run scripts/dev-cluster up\n"
            + ping.stdout
            + ping.stderr
        )
    return conf


@pytest.fixture
def prefix() -> str:
    return f"llmgwtest-{secrets.token_hex(3)}."


@pytest.fixture
async def backend(prefix: str) -> AsyncIterator[CliBackend]:
    b = CliBackend(timeout=60)
    yield b
    jobs = await b.list_jobs(prefix)
    if jobs:
        subprocess.run(["scancel", *[j.job_id for j in jobs]], check=False)


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, timeout: float = 60.0
) -> T:
    """Poll until ``probe`` returns something truthy; fail with ``what`` past the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = await probe()
        if got:
            return got
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.5)
