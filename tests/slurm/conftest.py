"""Fixtures for tests against the one-machine cluster (scripts/dev-cluster up).

``LLMGW_TEST_SLURM_BACKEND`` (``cli``, the default, ``pyslurm`` or ``rest``)
is the backend the harness's daemons use; with ``pyslurm`` or ``rest`` a
backend this cluster cannot use fails the tests instead of skipping them. The
adapter's contract tests run on every backend this cluster can use
(tests/slurm/test_adapter.py). ``rest`` talks to the 25.11 cluster's
slurmrestd, found through what ``scripts/dev-cluster env`` exports
(LLMGW_DEV_RESTD_URL, LLMGW_DEV_JWT_KEY), with tokens signed by that key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.slurm import BACKENDS, SlurmError, SlurmUnavailable, make_backend
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


def rest_options() -> dict[str, str]:
    """The rest backend's options for this cluster's slurmrestd (empty when it has none)."""
    url, key = os.environ.get("LLMGW_DEV_RESTD_URL"), os.environ.get("LLMGW_DEV_JWT_KEY")
    return {"url": url, "jwt_key": key} if url and key else {}


_rest_reason: list[str | None] = []


def rest_unusable() -> str | None:
    """Why the rest backend cannot run against this cluster, or None when it can."""
    if not _rest_reason:
        reason: str | None = None
        if not rest_options():
            reason = (
                "no slurmrestd here: LLMGW_DEV_RESTD_URL and LLMGW_DEV_JWT_KEY come from "
                "`LLMGW_SLURM=25.11 scripts/dev-cluster env`"
            )
        else:

            async def probe() -> None:
                b = make_backend("rest", timeout=30, **rest_options())
                try:
                    await b.check()
                finally:
                    await b.close()

            try:
                # In a thread of its own: callers may run inside the test's event loop.
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    pool.submit(asyncio.run, probe()).result()
            except (SlurmError, ConfigError) as exc:
                reason = f"slurmrestd is not usable here: {exc}"
        _rest_reason.append(reason)
    return _rest_reason[0]


def backend_options(kind: str) -> dict[str, str]:
    """What ``make_backend(kind, ...)`` needs besides its timeout on this cluster."""
    return rest_options() if kind == "rest" else {}


def need_backend(kind: str) -> None:
    """Skip a test of ``kind`` this cluster cannot run, unless the run asked for it."""
    if kind == "cli":
        return
    reason = pyslurm_unusable() if kind == "pyslurm" else rest_unusable()
    if reason is None:
        return
    if daemon_backend() == kind:
        pytest.fail(f"LLMGW_TEST_SLURM_BACKEND={kind}, but {reason}")
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
