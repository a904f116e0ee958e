"""A batch's result files, as its jobs append to them and the daemon reads them.

One JSON line per request, in OpenAI's output shape, appended with one
``write`` each; a job killed in the middle of a write leaves at most one
partial last line, which :func:`repair` cuts before anything reads on. The
``custom_id``s already in the files are what a requeued or resubmitted job
skips, so that each appears once however often the batch was interrupted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ERRORS", "OUTPUT", "custom_ids", "repair"]

OUTPUT = "output.jsonl"
ERRORS = "errors.jsonl"


def repair(path: Path) -> None:
    """Cut a partial last line (a job killed mid-write); nothing when the file is whole."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        # Read back from the end to the last newline: the file may be large.
        pos, block = size, 65536
        while pos > 0:
            start = max(0, pos - block)
            chunk = os.pread(fd, pos - start, start)
            if start + len(chunk) == size and chunk.endswith(b"\n"):
                return
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                os.ftruncate(fd, start + nl + 1)
                return
            pos = start
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _lines(path: Path) -> Iterator[bytes]:
    try:
        with path.open("rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    yield line
    except FileNotFoundError:
        return


def custom_ids(path: Path) -> set[str]:
    """The ``custom_id`` of every whole line of a result file."""
    out: set[str] = set()
    for line in _lines(path):
        try:
            cid = json.loads(line).get("custom_id")
        except (ValueError, AttributeError):
            continue
        if isinstance(cid, str):
            out.add(cid)
    return out
