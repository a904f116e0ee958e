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
    """
    if stdin is not None:
        assert proc.stdin is not None, "started without a pipe for stdin"
        try:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass
        proc.stdin.close()
    return await proc.communicate()
