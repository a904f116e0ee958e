"""A worker node's watch on its head: is the head's engine still there?

A multi-node engine's worker does not always end with its head: vLLM's
headless worker (checked on the CPU build, 2 nodes) waits on for a head that
has stopped, whether the head drained at the time limit or its node was lost,
and nothing else ends it until the job does, if anyone can signal the node's
processes at all (not when that node's slurmd is gone). The agents of one job
share no channel but Slurm's, so the worker's agent looks at what the engines
share: the head's distributed port. torch.distributed's store lives on rank 0
for the whole life of the process group (vLLM and SGLang both meet there), so
once that port has accepted connections, a refusal means the head's engine is
gone. A connect that times out proves nothing (a slow or partitioned network);
only refusals count, twice in a row.

A connection is opened and closed, nothing is sent: torch's store lets it go
without a word (checked on torch 2.13).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from enum import Enum

__all__ = ["PortState", "probe_port", "wait_head_gone"]

log = logging.getLogger(__name__)


class PortState(Enum):
    OPEN = "open"
    REFUSED = "refused"
    UNKNOWN = "unknown"  # a timeout or another error: proves nothing


async def probe_port(host: str, port: int, timeout_s: float = 3.0) -> PortState:
    """OPEN if any address of ``host`` accepts; REFUSED only if every one refuses."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return PortState.UNKNOWN
    states = [await _connect(str(info[4][0]), port, timeout_s) for info in infos]
    if PortState.OPEN in states:
        return PortState.OPEN
    if states and all(s is PortState.REFUSED for s in states):
        return PortState.REFUSED
    return PortState.UNKNOWN


async def _connect(addr: str, port: int, timeout_s: float) -> PortState:
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(addr, port)
    except ConnectionRefusedError:
        return PortState.REFUSED
    except (OSError, TimeoutError):
        return PortState.UNKNOWN
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return PortState.OPEN


async def wait_head_gone(
    host: str,
    port: int,
    poll_s: float,
    *,
    probe: Callable[[str, int], Awaitable[PortState]] = probe_port,
    refusals: int = 2,
) -> str:
    """Return once the head's port, after accepting, refuses ``refusals`` times in a row.

    Refusals before the first accept are the head's engine still starting.
    Returns why, for the log.
    """
    seen_open = False
    refused = 0
    while True:
        state = await probe(host, port)
        if state is PortState.OPEN:
            if not seen_open:
                log.info("head watch: %s:%d accepts; watching it", host, port)
            seen_open, refused = True, 0
        elif state is PortState.REFUSED and seen_open:
            refused += 1
            if refused >= refusals:
                return (
                    f"the head's engine is gone: its distributed port {host}:{port} "
                    "refuses connections"
                )
        else:
            refused = 0
        await asyncio.sleep(poll_s)
