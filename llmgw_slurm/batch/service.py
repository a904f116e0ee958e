"""The daemon's side of the Batch API: create, cancel, progress, and the poll that finishes batches.

Level-based, like the reconciler: every poll lists the batch jobs with one
``squeue`` (their name prefix) and decides from what is listed now and what
the result files hold, never from remembered events. So a restarted daemon
(records on disk, jobs in Slurm) carries on where the last one stopped.

Per unfinished batch, in order:

1. in progress without a job (submission failed, or a job ended short of
   the end): submit one, at most ``MAX_JOBS`` per batch;
2. past its ``expires_at``: cancel its job; once the job is gone it ends
   ``expired``, the requests not done written to the error file as
   ``batch_expired`` (OpenAI's semantics);
3. job gone (or finished): count the result files; everything answered ends
   ``completed``, a cancel ``cancelled``, anything else is resubmitted (rule 1)
   or, past MAX_JOBS, ``failed`` with how far it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmgw_slurm.batch import results
from llmgw_slurm.batch.jobs import BatchJobs, batch_job_prefix, shards_for
from llmgw_slurm.batch.model import (
    ENDPOINTS,
    BatchError,
    BatchRecord,
    BatchStatus,
    Checked,
    check_input,
    transition,
)
from llmgw_slurm.batch.store import BatchStore, new_batch_id
from llmgw_slurm.catalog import Catalog
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.durations import parse_duration
from llmgw_slurm.errors import SlurmError
from llmgw_slurm.reconciler.fence import Fence, Unfenced
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.secrets import batch_secret
from llmgw_slurm.slurm.types import Job, JobState, SlurmBackend

__all__ = ["MAX_JOBS", "BatchRefused", "BatchService"]

log = logging.getLogger(__name__)

# Jobs one batch may have (its first, plus resubmissions after time-outs or
# lost nodes); a batch that keeps failing must not keep a queue slot forever.
MAX_JOBS = 3
# What a job's report counts; the batch record has a field of each name.
_COUNTS = ("completed", "failed", "prompt_tokens", "completion_tokens")


class BatchRefused(Exception):
    """A request the API refuses: HTTP status, OpenAI error code, and a message that says why."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


class BatchService:
    def __init__(
        self,
        store: BatchStore,
        server: ServerConfig,
        backend: SlurmBackend,
        catalog: Callable[[], Catalog],
        jobs: BatchJobs,
        verifier: ReportVerifier,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.server = server
        self.backend = backend
        self._catalog = catalog
        self.jobs = jobs
        self.verifier = verifier
        self.clock = clock
        self.prefix = batch_job_prefix(server)
        self.last_poll_error = ""
        # Batches whose sbatch is under way: a poll meanwhile must not submit again.
        self._submitting: set[str] = set()
        # A sharded batch's shards' last reported counts: batch id -> shard -> counts.
        self._shard_counts: dict[str, dict[int, dict[str, int]]] = {}
        # Called with each batch once it ends (its tokens go to the usage store).
        self.on_usage: Callable[[BatchRecord], None] | None = None
        # Who may submit and cancel batch jobs (several daemons on one database: the
        # reconciler's lease holder, whose poll submits what another daemon created).
        self.fence: Fence = Unfenced()

    # ---- create and cancel ------------------------------------------------------------

    def _window(self, text: str) -> float:
        try:
            window = parse_duration(text)
        except ValueError:
            window = 0.0
        limit = self.server.batch.max_completion_window
        if not 0 < window <= limit:
            raise BatchRefused(
                400,
                "invalid_value",
                f"completion_window {text!r} is not valid: give a duration up to "
                f"{limit / 3600:g}h, e.g. 24h",
                "completion_window",
            )
        return window

    async def create(
        self,
        owner: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str],
        resolve: Callable[[str], str | None],
        key: tuple[str, str] = ("", ""),
    ) -> BatchRecord:
        """Check the input file, then (when it is valid) submit the batch's job.

        A refused request raises BatchRefused (nothing is recorded); a file with bad
        lines gives a batch that is ``failed`` with the lines' errors, and no job.
        ``key``: the creating key's id and project, for the usage store.
        """
        if endpoint not in ENDPOINTS:
            raise BatchRefused(
                400,
                "invalid_value",
                f"endpoint {endpoint!r} is not one a batch may use; valid: {', '.join(ENDPOINTS)}",
                "endpoint",
            )
        window = self._window(completion_window)
        self._check_active(owner)
        f = self.store.file(owner, input_file_id)
        if f is None:
            raise BatchRefused(
                404, "not_found", f"No file with id {input_file_id!r}.", "input_file_id"
            )
        if f.purpose != "batch":
            raise BatchRefused(
                400,
                "invalid_value",
                f"File {input_file_id} has purpose {f.purpose!r}; a batch input needs 'batch'.",
                "input_file_id",
            )
        now = self.clock()
        batch = BatchRecord(
            id=new_batch_id(),
            owner=owner,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            created_at=int(now),
            expires_at=int(now + window),
            metadata=dict(metadata),
            key_id=key[0],
            project=key[1],
        )
        path = self.store.data_path(input_file_id)
        checked = await asyncio.to_thread(self._check, path, endpoint, resolve)
        if not isinstance(checked, Checked):
            batch = transition(batch, BatchStatus.FAILED, now, errors=tuple(checked))
            self.store.save(batch)
            return batch
        batch = transition(
            batch,
            BatchStatus.IN_PROGRESS,
            now,
            model=checked.model,
            total=checked.total,
            shards=shards_for(self.server, checked.total),
        )
        self.store.save(batch)
        if not self.fence.acting():
            # Another daemon leads: its next poll submits the job (rule 1).
            return batch
        return await self._submit(batch)

    def _check_active(self, owner: str) -> None:
        limit = self.server.batch.max_active_per_user
        active = sum(1 for b in self.store.batches(owner) if not b.status.is_final)
        if active >= limit:
            raise BatchRefused(
                429,
                "too_many_active_batches",
                f"You have {active} unfinished batches, the most one user may have "
                f"(batch.max_active_per_user is {limit}); create this one when one of "
                "them has ended, or cancel one.",
            )

    def _check(
        self, path: Path, endpoint: str, resolve: Callable[[str], str | None]
    ) -> Checked | list[BatchError]:
        with path.open("rb") as lines:
            return check_input(lines, endpoint, resolve, self.server.batch.max_requests)

    async def cancel(self, owner: str, batch_id: str) -> BatchRecord:
        batch = self.store.batch(owner, batch_id)
        if batch is None:
            raise BatchRefused(404, "not_found", f"No batch with id {batch_id!r}.")
        if batch.status is BatchStatus.CANCELLING:
            return batch
        if batch.status.is_final:
            raise BatchRefused(
                409,
                "invalid_state",
                f"Batch {batch_id} is {batch.status.value}; only a running batch can be cancelled.",
            )
        batch = transition(batch, BatchStatus.CANCELLING, self.clock())
        self.store.save(batch)
        if batch.job_id and self.fence.acting():
            # Otherwise the leader's next poll cancels it (rule 2's cancel, every poll).
            await self._cancel_job(batch)
        return batch

    # ---- jobs -------------------------------------------------------------------------

    async def _submit(self, batch: BatchRecord) -> BatchRecord:
        """Submit the batch's next job, once at a time per batch, and record its id
        on the batch as it is then (a cancel may have come while sbatch ran)."""
        model = self._catalog().get(batch.model)
        if model is None:
            return self._fail(batch, "model_not_found", f"model {batch.model!r} left the catalog")
        if batch.id in self._submitting:
            return batch
        name = self.prefix + batch.id
        ticket = await self.fence.begin("batch-submit", batch.model, batch.id, name)
        if ticket is None:
            return batch
        spec = self.jobs.spec(
            batch,
            model,
            self.store.data_path(batch.input_file_id),
            self.store.work_dir(batch.id),
            lease_epoch=ticket.epoch,
        )
        self._submitting.add(batch.id)
        try:
            job_id = await self.backend.submit(spec)
        except SlurmError as err:
            await self.fence.end(ticket, f"failed: {err}")
            # Kept in progress without a job: the next poll tries again.
            log.warning("batch %s: submitting its job failed: %s", batch.id, err)
            current = self.store.get(batch.id) or batch
            current = replace(current, note=f"submitting its job failed: {err}")
            self.store.save(current)
            return current
        finally:
            self._submitting.discard(batch.id)
        await self.fence.end(ticket, f"job {job_id}")
        log.info("batch %s: job %s submitted (%s)", batch.id, job_id, batch.model)
        current = self.store.get(batch.id) or batch
        current = replace(
            current, job_id=job_id, jobs_submitted=current.jobs_submitted + 1, note="job queued"
        )
        self.store.save(current)
        if current.status is BatchStatus.CANCELLING:
            await self._cancel_job(current)
        return current

    async def _cancel_job(self, batch: BatchRecord) -> None:
        ticket = await self.fence.begin("batch-cancel", batch.model, batch.id, batch.job_id)
        if ticket is None:
            return
        try:
            await self.backend.cancel(batch.job_id)
        except SlurmError as err:
            log.warning("batch %s: cancelling job %s failed: %s", batch.id, batch.job_id, err)
        finally:
            await self.fence.end(ticket, "cancelled")

    def _fail(self, batch: BatchRecord, code: str, message: str) -> BatchRecord:
        now = self.clock()
        if batch.status is BatchStatus.CANCELLING:
            batch = transition(batch, BatchStatus.CANCELLED, now)
        else:
            batch = transition(batch, BatchStatus.FAILED, now, errors=(BatchError(code, message),))
        self.store.save(batch)
        return batch

    # ---- the poll ---------------------------------------------------------------------

    async def poll(self) -> None:
        """One look at every unfinished batch (one squeue for all their jobs)."""
        active = [b for b in self.store.unfinished() if b.status is not BatchStatus.VALIDATING]
        if not active:
            return
        listed: dict[str, list[Job]] = {}
        try:
            # A sharded batch's array tasks all bear its name: a list per name.
            for j in await self.backend.list_jobs(self.prefix):
                listed.setdefault(j.name, []).append(j)
        except SlurmError as err:
            # Acting on no listing could finish batches whose jobs still run.
            self.last_poll_error = str(err)
            log.warning("batch poll: Slurm did not answer: %s", err)
            return
        self.last_poll_error = ""
        # A new leader: batches whose sbatch an earlier leader began and never said it
        # finished wait until their job is listed (then adopted) or the action's deadline.
        waiting = {o.replica_id for o in await self.fence.open_submits(set(listed))}
        for b in active:
            # Read again: an earlier batch's await may have let a cancel or a report in.
            batch = self.store.get(b.id)
            if batch is None or batch.status.is_final or b.id in self._submitting:
                continue
            if b.id in waiting:
                continue
            if batch.job_id != b.job_id:
                # Its job was submitted while the listing was taken: the listing
                # cannot show it yet, and reading it as gone would submit again.
                continue
            await self._poll_one(batch, listed.get(self.prefix + batch.id, []))

    async def _poll_one(self, batch: BatchRecord, jobs: list[Job]) -> None:
        """``jobs``: those listed under the batch's name (a sharded batch's array
        tasks, each listed on its own; the batch is running while any one is)."""
        now = self.clock()
        active = [j for j in jobs if j.state.is_active]
        if active:
            # An array task's own id is not the array's: the array's is what sbatch
            # returned, what the record holds, and what scancel takes for all tasks.
            ids = {j.array_job_id or j.job_id for j in active}
            if batch.job_id not in ids:
                # Submitted by a daemon that died before it recorded the id (or a
                # record older than the job): adopted, never submitted twice.
                job_id = max(ids, key=lambda i: (len(i), i))
                log.info("batch %s: adopting job %s", batch.id, job_id)
                batch = replace(
                    batch,
                    job_id=job_id,
                    jobs_submitted=batch.jobs_submitted + (0 if batch.job_id else 1),
                )
                self.store.save(batch)
            expired = now >= batch.expires_at and batch.status is BatchStatus.IN_PROGRESS
            if expired or batch.status is BatchStatus.CANCELLING:
                # Again on every poll while the job is listed: a scancel that Slurm
                # did not take is retried, and one more to a dying job is harmless.
                await self._cancel_job(batch)
            else:
                pending = [j for j in active if j.state is JobState.PENDING and j.reason]
                if pending and len(pending) == len(active):
                    note = f"job {batch.job_id} pending ({pending[0].reason})"
                    self.store.save(replace(batch, note=note))
            return
        if batch.status is BatchStatus.IN_PROGRESS and not batch.job_id and now < batch.expires_at:
            await self._submit(batch)
            return
        await self._job_gone(batch, now)

    async def _job_gone(self, batch: BatchRecord, now: float) -> None:
        work = self.store.work_dir(batch.id)
        out, err = work / results.OUTPUT, work / results.ERRORS
        if batch.shards > 1:
            # No task runs now: the shards' files are whole, and merged afresh.
            await asyncio.to_thread(results.merge_shards, work, batch.shards)
        done, failed = await asyncio.to_thread(_read_counts, out, err)
        batch = replace(self.store.get(batch.id) or batch, completed=done, failed=failed)
        if batch.status is BatchStatus.CANCELLING:
            self._finish(batch, BatchStatus.CANCELLED, now)
        elif done + failed >= batch.total:
            batch = transition(batch, BatchStatus.FINALIZING, now)
            self._finish(batch, BatchStatus.COMPLETED, now)
        elif now >= batch.expires_at:
            await asyncio.to_thread(self._write_expired, batch, err)
            _, failed = await asyncio.to_thread(_read_counts, out, err)
            self._finish(replace(batch, failed=failed), BatchStatus.EXPIRED, now)
        elif batch.jobs_submitted < MAX_JOBS:
            # Timed out or lost its node: the next job skips what is done.
            log.info(
                "batch %s: job %s ended at %d/%d, resubmitting",
                batch.id,
                batch.job_id,
                done + failed,
                batch.total,
            )
            batch = replace(batch, job_id="")
            self.store.save(batch)
            await self._submit(batch)
        else:
            message = (
                f"the batch's {batch.jobs_submitted} jobs ended with {done + failed} of "
                f"{batch.total} requests answered; the last was job {batch.job_id} "
                f"(sacct -j {batch.job_id}, and its log in the batch's work folder)"
            )
            self._finish(
                replace(batch, errors=(BatchError("batch_job_failed", message),)),
                BatchStatus.FAILED,
                now,
            )

    def _write_expired(self, batch: BatchRecord, err: Path) -> None:
        """One ``batch_expired`` line per request nobody answered (OpenAI's error file)."""
        work = err.parent
        answered = results.custom_ids(work / results.OUTPUT) | results.custom_ids(err)
        lines = []
        with self.store.data_path(batch.input_file_id).open("rb") as f:
            for raw in f:
                with contextlib.suppress(ValueError, AttributeError):
                    cid = json.loads(raw).get("custom_id")
                    if isinstance(cid, str) and cid not in answered:
                        lines.append(_expired_line(cid))
        with err.open("ab") as out:
            out.write("".join(lines).encode())

    def _finish(self, batch: BatchRecord, to: BatchStatus, now: float) -> None:
        """The batch's end: its result files become file objects of its owner's."""
        work = self.store.work_dir(batch.id)
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, name in (("output_file_id", results.OUTPUT), ("error_file_id", results.ERRORS)):
            path = work / name
            if path.exists() and path.stat().st_size > 0:
                staged = self.store.new_upload()
                path.rename(staged)
                rec = self.store.add_file(batch.owner, f"{batch.id}_{name}", "batch_output", staged)
                ids[field] = rec.id
        batch = transition(batch, to, now, **ids)
        self.store.save(batch)
        self._shard_counts.pop(batch.id, None)
        for k in range(batch.shards if batch.shards > 1 else 0):
            # Merged into the files above: the shards' copies would double the disk.
            shutil.rmtree(work / f"shard-{k}", ignore_errors=True)
        log.info(
            "batch %s: %s (%d completed, %d failed)",
            batch.id,
            to.value,
            batch.completed,
            batch.failed,
        )
        if self.on_usage is not None:
            self.on_usage(batch)

    # ---- the job's reports ------------------------------------------------------------

    def report(
        self, batch_id: str, authorization: str, raw: bytes, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A batch job's signed progress report. Raises PermissionError on a bad signature."""
        secret = batch_secret(self.verifier.server_key, batch_id)
        self.verifier.verify(batch_id, authorization, raw, secret=secret)
        batch = self.store.get(batch_id)
        if batch is None or batch.status.is_final:
            return {"ok": True, "drain": True}
        changes: dict[str, Any] = self._counts(batch, body.get("counts"))
        event = body.get("event")
        if event == "step" and isinstance(body.get("step"), str):
            changes["note"] = f"job {body.get('job_id')}: {body['step']} {body.get('status')}"
        elif event == "failed":
            changes["note"] = f"job {body.get('job_id')} failed: {str(body.get('message'))[:500]}"
        elif event == "progress":
            changes["note"] = f"job {body.get('job_id')} running"
        if changes:
            self.store.save(replace(batch, **changes))
        return {"ok": True, "drain": batch.status is BatchStatus.CANCELLING}

    def _counts(self, batch: BatchRecord, counts: Any) -> dict[str, int]:
        """The batch's counts from one job's report: a sharded batch's are the sum of
        each shard's last report (kept in memory: after a restart, the next reports)."""
        out: dict[str, int] = {}
        if not isinstance(counts, dict):
            return out
        for key in _COUNTS:
            value = counts.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out[key] = value
        shard = counts.get("shard")
        if batch.shards <= 1 or not isinstance(shard, int) or not 0 <= shard < batch.shards:
            return out
        mine = self._shard_counts.setdefault(batch.id, {})
        mine[shard] = out
        return {key: sum(c.get(key, 0) for c in mine.values()) for key in _COUNTS}

    # ---- the loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        interval = self.server.batch.poll_interval
        while not stop.is_set():
            try:
                if self.fence.acting():
                    await self.poll()
            except Exception:
                # One bad batch must not stop every other batch's progress.
                log.exception("batch poll failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


def _read_counts(out: Path, err: Path) -> tuple[int, int]:
    results.repair(out)
    results.repair(err)
    done = results.custom_ids(out)
    return len(done), len(results.custom_ids(err) - done)


def _expired_line(custom_id: str) -> str:
    return (
        json.dumps(
            {
                "id": None,
                "custom_id": custom_id,
                "response": None,
                "error": {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the "
                    "completion window expired.",
                },
            }
        )
        + "\n"
    )
