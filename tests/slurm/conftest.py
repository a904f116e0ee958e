"""Fixtures for tests against the one-machine cluster (scripts/dev-cluster up).

``LLMGW_TEST_SLURM_BACKEND`` (``cli``, the default, or ``pyslurm``) is the
backend the harness's daemons use; with ``pyslurm`` a missing or unusable
pyslurm fails the tests instead of skipping them. The adapter's contract tests
run on every backend this cluster can use (tests/slurm/test_adapter.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from llmgw_slurm.slurm import BACKENDS, SlurmUnavailable, make_backend
from llmgw_slurm.slurm.cli import CliBackend

TOP = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def daemon_backend() -> str:
    """The backend the harness's daemons use, from ``LLMGW_TEST_SLURM_BACKEND``."""
    kind = os.environ.get("LLMGW_TEST_SLURM_BACKEND", "cli").strip() or "cli"
    if kind not in BACKENDS:
        raise pytest.UsageError(
            f"LLMGW_TEST_SLURM_BACKEND={kind!r} is not a backend; valid: {', '.join(BACKENDS)}"
        )
    return kind


def controller_version() -> str:
    """The Slurm release slurmctld runs (not the client's: ``scontrol --version``)."""
    out = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=False
    ).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "SLURM_VERSION":
            return value.strip()
    return "?"


_pyslurm_reason: list[str | None] = []


def pyslurm_unusable() -> str | None:
    """Why the pyslurm backend cannot run against this cluster, or None when it can."""
    if not _pyslurm_reason:
        reason: str | None = None
        version = controller_version()
        if not version.startswith("25.11"):
            reason = f"pyslurm 25.11 needs a Slurm 25.11 cluster; this one runs {version}"
        else:
            try:
                make_backend("pyslurm")
            except SlurmUnavailable as exc:
                reason = f"pyslurm is not usable here: {exc}"
        _pyslurm_reason.append(reason)
    return _pyslurm_reason[0]


def need_backend(kind: str) -> None:
    """Skip a test of ``kind`` this cluster cannot run, unless the run asked for it."""
    if kind != "pyslurm":
        return
    reason = pyslurm_unusable()
    if reason is None:
        return
    if daemon_backend() == "pyslurm":
        pytest.fail(f"LLMGW_TEST_SLURM_BACKEND=pyslurm, but {reason}")
    pytest.skip(reason)


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
