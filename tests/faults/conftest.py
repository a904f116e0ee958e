"""Fixtures for the fault suite: the Slurm fixtures, the `faults` marker, cluster restore."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.support import restore_cluster
from tests.slurm.conftest import prefix, slurm_conf

__all__ = ["prefix", "slurm_conf"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.path):
            item.add_marker(pytest.mark.faults)


@pytest.fixture
def restore() -> Iterator[None]:
    """For tests that stop a Slurm daemon: whatever happens, the cluster is whole after."""
    yield None
    restore_cluster()
