"""A batch's result files, as its jobs append to them and the daemon reads them.

A sharded batch's array tasks each append to their own pair of files
(``work/shard-K/``, :func:`shard_paths`); when the array is gone, the daemon
merges them into the batch's own pair (:func:`merge_shards`), each
``custom_id`` once.

One JSON line per request, in OpenAI's output shape, appended with one
``write`` each; a job killed in the middle of a write leaves at most one
partial last line, which :func:`repair` cuts before anything reads on. The
``custom_id``s already in the files are what a requeued or resubmitted job
skips, so that each appears once however often the batch was interrupted.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from llmgw_slurm.base.fsutil import atomic_file

__all__ = [
    "ERRORS",
    "OUTPUT",
    "answer_line",
    "custom_ids",
    "merge_shards",
    "repair",
    "shard_paths",
    "shard_size",
]

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
        cid = _custom_id(line)
        if cid is not None:
            out.add(cid)
    return out


def answer_line(custom_id: str, status: int, request_id: str, body: object) -> bytes:
    """One answer as a result file's line (OpenAI's output shape), newline included;
    it goes to ``OUTPUT`` for a 2xx ``status``, to ``ERRORS`` otherwise."""
    line = {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


def shard_size(total: int, shards: int) -> int:
    """Lines per shard: shard K takes input lines [K*size, (K+1)*size)."""
    return max(1, -(-total // max(1, shards)))


def shard_paths(output: Path, errors: Path, task: int) -> tuple[Path, Path]:
    """The result files of array task ``task``, beside the batch's own."""
    folder = output.parent / f"shard-{task}"
    return folder / output.name, folder / errors.name


def merge_shards(work: Path, shards: int) -> None:
    """The shards' result files as the batch's ``OUTPUT`` and ``ERRORS``, rebuilt whole.

    Run only while no task of the array runs and no warm ride writes. Each
    ``custom_id`` once: an answer in an output file wins over a failure of the
    same id. Rebuilt from the batch's own pair (what a ride on warm replicas
    wrote, and an earlier merge) and the shards on every call, so a call after a
    resubmitted array's tasks added more is right too.
    """
    seen: set[str] = set()
    pairs = [(work / OUTPUT, work / ERRORS)]
    pairs += [shard_paths(work / OUTPUT, work / ERRORS, k) for k in range(shards)]
    for index in (0, 1):
        # Replaced as every other file is (fsynced before the rename): after a
        # crash the batch's results are the old merge or the new, never empty.
        with atomic_file(work / (OUTPUT, ERRORS)[index]) as out:
            for pair in pairs:
                repair(pair[index])
                for line in _lines(pair[index]):
                    cid = _custom_id(line)
                    if cid is not None and cid not in seen:
                        seen.add(cid)
                        out.write(line)


def _custom_id(line: bytes) -> str | None:
    try:
        cid = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return cid if isinstance(cid, str) else None
