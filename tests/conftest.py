"""For every level: which event loop the tests run on.

``LLMGW_TEST_LOOP=uvloop`` runs them on uvloop's, the loop ``llmgw-admin
serve`` runs the daemon on (daemon.event_loop); asyncio's otherwise. The
Slurm 25.11 level runs on uvloop (scripts/test), the others on asyncio's.
"""

from __future__ import annotations

import asyncio
import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    loop = os.environ.get("LLMGW_TEST_LOOP", "asyncio")
    if loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    elif loop != "asyncio":
        raise pytest.UsageError(f"LLMGW_TEST_LOOP={loop!r}: valid are asyncio and uvloop")


def pytest_report_header(config: pytest.Config) -> str:
    return f"event loop policy: {type(asyncio.get_event_loop_policy()).__module__}"
