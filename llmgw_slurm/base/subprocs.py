"""Feeding a child process its input when it may exit before reading it."""

from __future__ import annotations

import asyncio

__all__ = ["communicate"]


async def communicate(proc: asyncio.subprocess.Process, stdin: bytes | None) -> tuple[bytes, bytes]:
    """``proc.communicate(stdin)``, where a child that exits before it reads its
    input is not an error: its exit status and stderr say why (sbatch refusing
    an option, munge with munged away).

    asyncio's own ``communicate`` ignores the broken pipe; on uvloop's loop, the
    daemon's, writing to a child's stdin that is already closed raises
    RuntimeError ("the handler is closed") instead, which reached the user as a
    traceback. ``stdin`` None: the child was started without a pipe for it.

    The input is fed while the output is read, as asyncio's own does: a child
    that writes as it reads would otherwise fill its output pipe and stop
    reading, and both sides would wait for ever.
    """
    if stdin is None:
        return await proc.communicate()
    _, (out, err) = await asyncio.gather(_feed(proc, stdin), proc.communicate())
    return out, err


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None, "started without a pipe for stdin"
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError, RuntimeError):
        pass
    proc.stdin.close()
