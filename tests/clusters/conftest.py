"""Fixtures for the two-cluster level: the first cluster is SLURM_CONF's (as for every
Slurm test), the second ``LLMGW_TEST_SECOND_SLURM_CONF``'s (``scripts/test clusters``
starts it: ``LLMGW_DEV_SITE=second``, sharing the first one's slurmdbd).

Tests here stop the first cluster's slurmctld: the ``restore`` fixture brings it
back whatever happens (``dev-cluster up`` is idempotent).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.support import restore_cluster
from tests.slurm.conftest import prefix, slurm_conf

__all__ = ["prefix", "slurm_conf"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/clusters/" in str(item.path):
            item.add_marker(pytest.mark.clusters)


@pytest.fixture(scope="session")
def second_conf(slurm_conf: str) -> str:
    """The second cluster's slurm.conf; the level fails (not skips) without it."""
    conf = os.environ.get("LLMGW_TEST_SECOND_SLURM_CONF", "")
    if not conf or not Path(conf).is_file():
        pytest.fail(
            "LLMGW_TEST_SECOND_SLURM_CONF must name the second cluster's slurm.conf "
            "(scripts/test clusters starts it)"
        )
    env = {**os.environ, "SLURM_CONF": conf}
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=env)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        pytest.fail(f"the second cluster ({conf}) is not up:\n{ping.stdout}{ping.stderr}")
    if Path(conf).resolve() == Path(slurm_conf).resolve():
        pytest.fail("LLMGW_TEST_SECOND_SLURM_CONF names the first cluster's slurm.conf")
    return conf


@pytest.fixture
def restore() -> Iterator[None]:
    """For tests that stop the first cluster's slurmctld: it is up again after."""
    yield None
    restore_cluster()
