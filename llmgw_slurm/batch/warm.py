"""A batch riding warm replicas: its requests through the gateway's batch seam (issue 37).

A batch job loads its model before its first request; a replica of the same
model that is up and idle has paid for that already. So a batch whose model
has ready replicas with room first rides them (``batch.warm``): the daemon
sends its requests through the gateway's batch seam
(llmgw_slurm/batch/seam.py), which admits them into each replica's batch
slots only, below online requests, and appends each answer to the batch's
result files exactly as a batch job would (one line, one ``write``, on an
``O_APPEND`` file). The service (service.py) hands what is left to a Slurm job,
as before, once the ride would not finish before the batch's deadline, or
stops it for a cancel or the deadline itself.

Resume without repeats: a ride skips the ``custom_id``s already in the files,
as a job does, and a ride and a job of one batch never run at once (the
service waits for a stopped ride's requests in flight before it submits).
A request the seam could not get answered is written nowhere: it is sent again
(up to ``TRIES`` times a ride), or left to the job. One the seam called back
for an online request is sent again first, as often as that happens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmgw_slurm.batch import results
from llmgw_slurm.batch.model import BatchRecord
from llmgw_slurm.batch.seam import BatchSeam, BatchSlot, BatchUnreached, BatchYielded

__all__ = ["PACE_WINDOW_S", "WarmRide"]

log = logging.getLogger(__name__)

# How long a ride with no slot free waits before it looks again, unless one of its
# own requests ends first: online requests free slots too, and the seam is not
# told when.
WAIT_S = 0.05
# Tries per request in one ride: an engine that never answers one is left to the job.
TRIES = 3
# The pace is the answers of the last this many seconds.
PACE_WINDOW_S = 60.0


class WarmRide:
    """One batch's requests not answered yet, sent through ``seam`` until done or stopped."""

    def __init__(
        self,
        batch: BatchRecord,
        input_path: Path,
        work: Path,
        seam: BatchSeam,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.batch = batch
        self.input_path = input_path
        self.output = work / results.OUTPUT
        self.errors = work / results.ERRORS
        self.seam = seam
        self.clock = clock
        self.started = clock()
        self.stopping = asyncio.Event()
        # This ride's own answers (what the files held before is not counted here).
        self.completed = 0
        self.failed = 0
        self.unreached = 0
        # Requests called back for online ones (sent again; not a try).
        self.yielded = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        # Requests not answered yet when the ride ended (for the job that follows).
        self.left = 0
        # What the files held when the ride began (answered, failed).
        self.completed_before = batch.completed
        self.failed_before = batch.failed
        self._answered_at: collections.deque[float] = collections.deque()
        # Set when one of the ride's requests ends: its slot is free again.
        self._freed = asyncio.Event()

    def stop(self) -> None:
        """No new request; those in flight finish (their answers are written)."""
        self.stopping.set()

    def pace(self) -> float | None:
        """Answers per second over the last PACE_WINDOW_S, or None while the ride is
        younger than that (too early to judge)."""
        now = self.clock()
        while self._answered_at and now - self._answered_at[0] > PACE_WINDOW_S:
            self._answered_at.popleft()
        if now - self.started < PACE_WINDOW_S:
            return None
        return len(self._answered_at) / PACE_WINDOW_S

    async def run(self) -> None:
        done = await asyncio.to_thread(self._done)
        # The input is read as the ride goes (it may be 200 MB); a request sent again
        # after its engine failed it comes first.
        source = _unanswered(self.input_path, done, self.batch.model)
        again: collections.deque[tuple[str, bytes]] = collections.deque()
        tries: dict[str, int] = {}
        tasks: set[asyncio.Task[None]] = set()
        out = os.open(self.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        err = os.open(self.errors, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        nxt = next(source, None)
        try:
            while not self.stopping.is_set() and (nxt or again or tasks):
                ticket = self.seam.admit(self.batch.model) if (nxt or again) else None
                if ticket is None:
                    self._freed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), WAIT_S)
                    continue
                if again:
                    cid, body = again.popleft()
                else:
                    assert nxt is not None
                    (cid, body), nxt = nxt, next(source, None)
                t = asyncio.create_task(self._one(ticket, cid, body, out, err, again, tries))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                t.add_done_callback(lambda _: self._freed.set())
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            os.close(out)
            os.close(err)
        rest = [nxt] if nxt is not None else []
        self.left = len(again) + len(rest) + await asyncio.to_thread(_count, source)
        log.info(
            "batch %s: warm ride ended: %d answered, %d failed, %d left, %d not reached,"
            " %d called back for online requests",
            self.batch.id,
            self.completed,
            self.failed,
            self.left,
            self.unreached,
            self.yielded,
        )

    def _done(self) -> set[str]:
        for path in (self.output, self.errors):
            results.repair(path)
        answered = results.custom_ids(self.output)
        failed = results.custom_ids(self.errors) - answered
        self.completed_before, self.failed_before = len(answered), len(failed)
        return answered | failed

    async def _one(
        self,
        ticket: BatchSlot,
        cid: str,
        body: bytes,
        out: int,
        err: int,
        todo: collections.deque[tuple[str, bytes]],
        tries: dict[str, int],
    ) -> None:
        try:
            got = await self.seam.forward(ticket, self.batch.endpoint, body)
        except BatchYielded:
            self.yielded += 1
            todo.appendleft((cid, body))
            return
        except BatchUnreached as e:
            self.unreached += 1
            tries[cid] = tries.get(cid, 0) + 1
            if tries[cid] < TRIES:
                todo.append((cid, body))
            log.warning("batch %s: %s not answered on a warm replica (%s)", self.batch.id, cid, e)
            return
        try:
            answer: Any = json.loads(got.body)
        except ValueError:
            answer = {"error": {"message": got.body[:2000].decode(errors="replace")}}
        good = 200 <= got.status < 300
        os.write(out if good else err, results.answer_line(cid, got.status, got.request_id, answer))
        self._answered_at.append(self.clock())
        if not good:
            self.failed += 1
            return
        self.completed += 1
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict):
            self.prompt_tokens += _int(usage.get("prompt_tokens"))
            self.completion_tokens += _int(usage.get("completion_tokens"))


def _unanswered(path: Path, done: set[str], model: str) -> Iterator[tuple[str, bytes]]:
    """(custom_id, the body for the engine) of each line not in ``done``, in file order."""
    with path.open("rb") as f:
        for raw in f:
            try:
                line = json.loads(raw)
                cid, body = line["custom_id"], line["body"]
            except (ValueError, KeyError, TypeError):
                continue  # checked at create time
            if cid not in done:
                # The model's own name, as the gateway sends it: an alias means
                # nothing to the engine.
                yield cid, json.dumps({**body, "model": model}).encode()


def _count(rest: Iterator[tuple[str, bytes]]) -> int:
    n = 0
    for _ in rest:
        n += 1
    return n


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
