"""The daemon's side of the Batch API: create, cancel, progress, and the poll that finishes batches.

Level-based, like the reconciler: every poll lists the batch jobs with one
``squeue`` (their name prefix) and decides from what is listed now and what
the result files hold, never from remembered events. So a restarted daemon
(records on disk, jobs in Slurm) carries on where the last one stopped.

Per unfinished batch, in order:

0. riding warm replicas (warm.py, ``batch.warm``): its progress recorded; a
   cancel or the deadline stops the ride; so does a pace at which the rest
   would end past ``expires_at - batch.warm_margin``. Once the ride has
   stopped (its requests in flight answered), it is treated as a job gone
   (rule 3): what is left goes to a job;
1. in progress without a job (a new batch, a submission that failed, a daemon
   restarted during a ride): ride the model's ready replicas when they have
   room, else submit a job, at most ``MAX_JOBS`` per batch;
2. past its ``expires_at``: cancel its job; once the job is gone it ends
   ``expired``, the requests not done written to the error file as
   ``batch_expired`` (OpenAI's semantics);
3. job gone (or finished): count the result files; everything answered ends
   ``completed``, a cancel ``cancelled``, anything else is resubmitted (rule 1)
   or, past MAX_JOBS, ``failed`` with how far it got.

Quotas (with a :class:`QuotaBook`): a batch is let in only if the most its
requests may spend, all of its lines together (each as an online request's:
its prompt estimated, its max_tokens or the model's context length), fits its
creator's day and month budgets beside what was spent and what is held; that
much is held from its creation to its end, then settled to what it used.
A batch that does not fit is ``failed`` at once with ``insufficient_quota``
and runs nothing, as OpenAI fails a batch past its enqueued-token limit: a
refusal before any GPU is spent, rather than lines failing part-way, which
would leave a half-done batch the user has to sort out and resubmit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from llmgw_slurm.accounting.quota import Ask, QuotaBook, Refusal, Reservation, ask_of
from llmgw_slurm.auth.secrets import batch_secret
from llmgw_slurm.base.durations import parse_duration
from llmgw_slurm.base.errors import SlurmError
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
from llmgw_slurm.batch.seam import BatchSeam
from llmgw_slurm.batch.store import BatchStore, new_batch_id
from llmgw_slurm.batch.warm import WarmRide
from llmgw_slurm.catalog import Catalog, Model
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.guard.faults import Faults
from llmgw_slurm.reconciler.fence import Fence, Unfenced
from llmgw_slurm.reconciler.reports import ReportVerifier
from llmgw_slurm.slurm.types import Job, JobState, SlurmBackend

__all__ = ["MAX_JOBS", "BatchRefused", "BatchService"]

log = logging.getLogger(__name__)

# Jobs one batch may have (its first, plus resubmissions after time-outs or
# lost nodes); a batch that keeps failing must not keep a queue slot forever.
MAX_JOBS = 3
# What a job's report counts; the batch record has a field of each name.
_COUNTS = ("completed", "failed", "prompt_tokens", "completion_tokens")


class _Payer(NamedTuple):
    """Whose budgets a batch spends: its creator's key, user and account."""

    key_id: str
    user: str
    project: str

    @classmethod
    def of(cls, batch: BatchRecord) -> _Payer:
        return cls(batch.key_id, batch.owner, batch.project)


class BatchRefused(Exception):
    """A request the API refuses: HTTP status, OpenAI error code, and a message that says why."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass
class _Riding:
    """A batch's ride on warm replicas, and its record's counts when it began."""

    ride: WarmRide
    task: asyncio.Task[None]
    base: BatchRecord


class BatchService:
    """``backend``: the one cluster's, or each cluster's by name (server.yaml's
    clusters). ``place``: for a batch's model, the clusters its job may go to, the
    ones with room for it now first (the reconciler's ``clusters_for``); default:
    every cluster in server.yaml's order."""

    def __init__(
        self,
        store: BatchStore,
        server: ServerConfig,
        backend: SlurmBackend | Mapping[str, SlurmBackend],
        catalog: Callable[[], Catalog],
        jobs: BatchJobs,
        verifier: ReportVerifier,
        clock: Callable[[], float] = time.time,
        quota: QuotaBook | None = None,
        place: Callable[[Model], Sequence[str]] | None = None,
    ) -> None:
        self.store = store
        self.server = server
        self.backends: dict[str, SlurmBackend] = (
            dict(backend)
            if isinstance(backend, Mapping)
            else {c.name: backend for c in server.cluster_list}
        )
        self.place = place or (lambda _m: list(self.backends))
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
        # The budgets batches spend (None: no quotas), and what each unfinished one holds.
        self.quota = quota
        self._holds: dict[str, Reservation] = {}
        self._hold_again()
        # Where a failed poll is counted (the daemon's, for /metrics; set by setup).
        self.faults = Faults()
        # The gateway's batch seam (warm rides); None: every batch runs as a job.
        self.seam: BatchSeam | None = None
        self._rides: dict[str, _Riding] = {}
        # Set when a ride ends: the loop polls at once.
        self._wake = asyncio.Event()
        # Who may submit and cancel batch jobs (several daemons on one database: the
        # reconciler's lease holder, whose poll submits what another daemon created).
        self.fence: Fence = Unfenced()

    @property
    def backend(self) -> SlurmBackend:
        """The first cluster's backend (the only one, without ``clusters:``)."""
        return next(iter(self.backends.values()))

    @backend.setter
    def backend(self, backend: SlurmBackend) -> None:
        self.backends[next(iter(self.backends))] = backend

    def _backend_of(self, batch: BatchRecord) -> SlurmBackend:
        return self.backends.get(batch.cluster) or self.backend

    def _cluster_for(self, batch: BatchRecord, model: Model) -> str:
        """Where the batch's next job goes: the first cluster with room for it now,
        with the batch's partition and QOS (batch.partition wins over the model's)."""
        res = model.resources
        as_run = replace(
            model, resources=replace(res, partition=self.server.batch.partition or res.partition)
        )
        order = [c for c in self.place(as_run) if c in self.backends]
        return order[0] if order else next(iter(self.backends))

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
        refused = await self._reserve(batch, checked)
        if refused is not None:
            batch = transition(batch, BatchStatus.FAILED, now, errors=(refused,))
            self.store.save(batch)
            return batch
        batch = transition(
            batch,
            BatchStatus.IN_PROGRESS,
            now,
            model=checked.model,
            total=checked.total,
            shards=shards_for(self.server, checked.total),
            reserved=checked.ask.tokens if batch.id in self._holds else 0,
        )
        self.store.save(batch)
        if not self.fence.acting():
            # Another daemon leads: its next poll starts it (a ride or a job), so
            # that one daemon alone decides, and a ride and a job never run at once.
            return batch
        return await self._start(batch)

    async def _reserve(self, batch: BatchRecord, checked: Checked) -> BatchError | None:
        """Hold what the batch may spend on its creator's budgets (agreed with the
        other gateways when near a budget's end); or the error that fails it,
        naming the budget it does not fit."""
        if self.quota is None or not (batch.key_id or batch.owner):
            return None
        got = self.quota.reserve(_Payer.of(batch), checked.ask, per_minute=False)
        if not isinstance(got, Refusal) and not self.quota.agreed(got):
            got = await self.quota.agree(got, checked.ask)
        if isinstance(got, Refusal):
            return BatchError(
                "insufficient_quota",
                f"The batch's {checked.total} requests may use up to {checked.ask.tokens} "
                f"tokens together, more than your budgets leave: {got.message}",
            )
        self._holds[batch.id] = got
        return None

    def _hold_again(self) -> None:
        """After a restart: unfinished batches hold their reservations again (the
        usage store has none of their tokens until they end)."""
        if self.quota is None:
            return
        for b in self.store.unfinished():
            if b.reserved and b.id not in self._holds:
                self._holds[b.id] = self.quota.hold(_Payer.of(b), b.reserved)

    def _ended(self, batch: BatchRecord) -> None:
        """A batch's end: its tokens to the usage store, its reservation settled."""
        if self.on_usage is not None:
            self.on_usage(batch)
        hold = self._holds.pop(batch.id, None)
        if hold is not None:
            hold.settle(batch.prompt_tokens + batch.completion_tokens)

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
        ask = self._line_ask(endpoint, resolve) if self.quota is not None else None
        with path.open("rb") as lines:
            return check_input(lines, endpoint, resolve, self.server.batch.max_requests, ask)

    def _line_ask(
        self, endpoint: str, resolve: Callable[[str], str | None]
    ) -> Callable[[Mapping[str, Any]], Ask]:
        """The most one line may spend: as an online request to its model would."""
        catalog, name = self._catalog(), endpoint.removeprefix("/v1/")
        default = self.server.quotas.default_max_tokens

        def ask(body: Mapping[str, Any]) -> Ask:
            model = catalog.get(resolve(str(body.get("model"))) or "")
            return ask_of(body, name, model.context_tokens if model else None, default)

        return ask

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
        riding = self._rides.get(batch.id)
        if riding is not None:
            riding.ride.stop()  # the next poll finishes it once its requests are answered
        if batch.job_id and self.fence.acting():
            # Otherwise the leader's next poll cancels it (rule 2's cancel, every poll).
            await self._cancel_job(batch)
        return batch

    # ---- warm rides -------------------------------------------------------------------

    async def _start(self, batch: BatchRecord) -> BatchRecord:
        """Ride the model's warm replicas when they have room, else submit a job."""
        seam = self.seam
        if not (self.server.batch.warm and seam is not None and seam.free(batch.model) > 0):
            return await self._submit(batch)
        ride = WarmRide(
            batch, self.store.data_path(batch.input_file_id), self.store.work_dir(batch.id), seam
        )
        self.store.work_dir(batch.id).mkdir(parents=True, exist_ok=True)
        task = asyncio.create_task(ride.run(), name=f"warm ride {batch.id}")
        task.add_done_callback(lambda _: self._wake.set())
        self._rides[batch.id] = _Riding(ride, task, batch)
        log.info("batch %s: riding warm replicas of %s", batch.id, batch.model)
        batch = replace(batch, note=f"riding warm replicas of {batch.model}")
        self.store.save(batch)
        return batch

    def _ride_progress(self, batch: BatchRecord, r: _Riding) -> BatchRecord:
        """The record with the ride's answers and tokens so far, saved."""
        ride, base = r.ride, r.base
        batch = replace(
            batch,
            completed=ride.completed_before + ride.completed,
            failed=ride.failed_before + ride.failed,
            prompt_tokens=base.prompt_tokens + ride.prompt_tokens,
            completion_tokens=base.completion_tokens + ride.completion_tokens,
            warm_completed=base.warm_completed + ride.completed,
            warm_failed=base.warm_failed + ride.failed,
            warm_prompt_tokens=base.warm_prompt_tokens + ride.prompt_tokens,
            warm_completion_tokens=base.warm_completion_tokens + ride.completion_tokens,
        )
        self.store.save(batch)
        return batch

    async def _steer(self, batch: BatchRecord, now: float) -> None:
        """Rule 0: a riding batch's progress; stop it for a cancel, its deadline or a
        pace too slow for it; once stopped, what is left is a job's (rule 3)."""
        r = self._rides[batch.id]
        batch = self._ride_progress(batch, r)
        if r.task.done():
            del self._rides[batch.id]
            if not r.task.cancelled() and r.task.exception() is not None:
                log.error("batch %s: warm ride failed", batch.id, exc_info=r.task.exception())
            await self._job_gone(batch, now)
            return
        if batch.status is BatchStatus.CANCELLING or now >= batch.expires_at:
            r.ride.stop()
            return
        why = self._too_slow(batch, r.ride, now)
        if why and not r.ride.stopping.is_set():
            log.info("batch %s: %s; the rest goes to a job", batch.id, why)
            self.store.save(replace(batch, note=f"{why}; handing the rest to a job"))
            r.ride.stop()

    def _too_slow(self, batch: BatchRecord, ride: WarmRide, now: float) -> str:
        """Why the ride would not finish in time ("" when it would, or when it is too
        early to tell)."""
        pace = ride.pace()
        if pace is None:
            return ""
        left = batch.total - batch.completed - batch.failed
        eta = left / pace if pace > 0 else math.inf
        deadline = batch.expires_at - self.server.batch.warm_margin
        if now + eta <= deadline:
            return ""
        if pace == 0:
            return "no warm replica answered in the last minute"
        return (
            f"at {pace:.1f} requests/s on warm replicas, {left} left would end "
            f"{now + eta - deadline:.0f} s past the deadline less batch.warm_margin"
        )

    async def _pause(self, stop: asyncio.Event, interval: float) -> None:
        """Until the next poll: ``interval``, or less when a ride ends (its batch is
        then finished, or handed to a job, at once rather than a poll later)."""
        self._wake.clear()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _stop_rides(self) -> None:
        """The daemon stops: rides end (their answers written stay; the next daemon
        resumes them), those in flight given a few seconds."""
        for r in self._rides.values():
            r.ride.stop()
        tasks = [r.task for r in self._rides.values()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=5.0)
            for t in late:
                t.cancel()
        self._rides.clear()

    # ---- jobs -------------------------------------------------------------------------

    async def _submit(self, batch: BatchRecord) -> BatchRecord:
        """Submit the batch's next job, once at a time per batch, and record its id
        on the batch as it is then (a cancel may have come while sbatch ran)."""
        model = self._catalog().get(batch.model)
        if model is None:
            return self._fail(batch, "model_not_found", f"model {batch.model!r} left the catalog")
        if batch.id in self._submitting:
            return batch
        cluster = self._cluster_for(batch, model)
        name = self.prefix + batch.id
        ticket = await self.fence.begin("batch-submit", batch.model, batch.id, name)
        if ticket is None:
            return batch
        spec = self.jobs.spec(
            batch,
            model,
            self.store.data_path(batch.input_file_id),
            self.store.work_dir(batch.id),
            self._settings(cluster),
            lease_epoch=ticket.epoch,
        )
        self._submitting.add(batch.id)
        try:
            job_id = await self.backends[cluster].submit(spec)
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
        where = f" on {cluster}" if cluster else ""
        log.info("batch %s: job %s%s submitted (%s)", batch.id, job_id, where, batch.model)
        current = self.store.get(batch.id) or batch
        current = replace(
            current,
            job_id=job_id,
            cluster=cluster,
            jobs_submitted=current.jobs_submitted + 1,
            note=f"job queued{where}",
        )
        self.store.save(current)
        if current.status is BatchStatus.CANCELLING:
            await self._cancel_job(current)
        return current

    def _settings(self, cluster: str) -> Any:
        return next((c for c in self.server.cluster_list if c.name == cluster), None)

    async def _cancel_job(self, batch: BatchRecord) -> None:
        ticket = await self.fence.begin("batch-cancel", batch.model, batch.id, batch.job_id)
        if ticket is None:
            return
        try:
            await self._backend_of(batch).cancel(batch.job_id)
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
        self._ended(batch)
        return batch

    # ---- the poll ---------------------------------------------------------------------

    async def poll(self) -> None:
        """One look at every unfinished batch (one squeue for all their jobs)."""
        # Rides first: they need no listing, and a cancel or a deadline must stop
        # them while Slurm does not answer too.
        steered = set(self._rides)
        for bid in steered:
            batch = self.store.get(bid)
            if batch is not None:
                await self._steer(batch, self.clock())
        active = [
            b
            for b in self.store.unfinished()
            if b.status is not BatchStatus.VALIDATING and b.id not in steered
        ]
        if not active:
            return
        listed, answered = await self._list_all()
        if not answered:
            return
        # A new leader: batches whose sbatch an earlier leader began and never said it
        # finished wait until their job is listed (then adopted) or the action's deadline.
        waiting = {o.replica_id for o in await self.fence.open_submits(set(listed))}
        for b in active:
            if b.job_id and b.cluster not in answered:
                # Its cluster did not answer: whether its job runs is not known now.
                continue
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

    async def _list_all(self) -> tuple[dict[str, list[tuple[str, Job]]], set[str]]:
        """Every cluster's batch jobs (one squeue each, at once), by job name with their
        cluster, and the clusters that answered."""
        names = list(self.backends)
        got = await asyncio.gather(
            *(self.backends[n].list_jobs(self.prefix) for n in names), return_exceptions=True
        )
        listed: dict[str, list[tuple[str, Job]]] = {}
        answered: set[str] = set()
        errors: list[str] = []
        for name, jobs in zip(names, got, strict=True):
            if isinstance(jobs, SlurmError):
                # Acting on no listing could finish batches whose jobs still run.
                errors.append(f"{name}: {jobs}" if name else str(jobs))
                log.warning("batch poll: Slurm %s did not answer: %s", name, jobs)
                continue
            if isinstance(jobs, BaseException):
                raise jobs
            answered.add(name)
            # A sharded batch's array tasks all bear its name: a list per name.
            for j in jobs:
                listed.setdefault(j.name, []).append((name, j))
        self.last_poll_error = "; ".join(errors)
        return listed, answered

    async def _poll_one(self, batch: BatchRecord, listed: list[tuple[str, Job]]) -> None:
        """``listed``: the jobs under the batch's name, with their cluster (a sharded
        batch's array tasks, each listed on its own; the batch is running while any one
        is)."""
        now = self.clock()
        active = [(c, j) for c, j in listed if j.state.is_active]
        if active:
            batch = self._adopt(batch, active)
            active_jobs = [j for _, j in active]
            expired = now >= batch.expires_at and batch.status is BatchStatus.IN_PROGRESS
            if expired or batch.status is BatchStatus.CANCELLING:
                # Again on every poll while the job is listed: a scancel that Slurm
                # did not take is retried, and one more to a dying job is harmless.
                await self._cancel_job(batch)
            else:
                pending = [j for j in active_jobs if j.state is JobState.PENDING and j.reason]
                if pending and len(pending) == len(active_jobs):
                    note = f"job {batch.job_id} pending ({pending[0].reason})"
                    self.store.save(replace(batch, note=note))
            return
        if batch.status is BatchStatus.IN_PROGRESS and not batch.job_id and now < batch.expires_at:
            await self._start(batch)
            return
        await self._job_gone(batch, now)

    def _adopt(self, batch: BatchRecord, active: list[tuple[str, Job]]) -> BatchRecord:
        """The batch with the job listed for it, when its record names another (or none):
        submitted by a daemon that died before it recorded the id, or a record older than
        the job. Adopted, never submitted twice."""
        # An array task's own id is not the array's: the array's is what sbatch
        # returned, what the record holds, and what scancel takes for all tasks.
        ids = {(c, j.array_job_id or j.job_id) for c, j in active}
        if (batch.cluster, batch.job_id) in ids:
            return batch
        cluster, job_id = max(ids, key=lambda cj: (len(cj[1]), cj[1]))
        log.info(
            "batch %s: adopting job %s%s", batch.id, job_id, f" on {cluster}" if cluster else ""
        )
        batch = replace(
            batch,
            job_id=job_id,
            cluster=cluster,
            jobs_submitted=batch.jobs_submitted + (0 if batch.job_id else 1),
        )
        self.store.save(batch)
        return batch

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
                "batch %s: %s ended at %d/%d, submitting a job",
                batch.id,
                f"job {batch.job_id}" if batch.job_id else "its warm ride",
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
        self._ended(batch)

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
            return _with_warm(batch, out, answers=False)
        mine = self._shard_counts.setdefault(batch.id, {})
        mine[shard] = out
        summed = {key: sum(c.get(key, 0) for c in mine.values()) for key in _COUNTS}
        return _with_warm(batch, summed, answers=True)

    # ---- the loop ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        interval = self.server.batch.poll_interval
        try:
            while not stop.is_set():
                try:
                    if self.fence.acting():
                        await self.poll()
                except Exception as err:
                    # One bad batch must not stop every other batch's progress.
                    self.faults.record("batch_poll", err)
                await self._pause(stop, interval)
        finally:
            await self._stop_rides()
            if self.seam is not None:
                await self.seam.close()


def _with_warm(batch: BatchRecord, counts: dict[str, int], *, answers: bool) -> dict[str, int]:
    """A job's reported counts with what warm rides did: their tokens always (a job
    reports its own run's), their answers for a sharded batch (a shard counts its
    own files; one job counts the batch's, which hold the rides' answers already)."""
    out = dict(counts)
    for key, warm in (
        ("prompt_tokens", batch.warm_prompt_tokens),
        ("completion_tokens", batch.warm_completion_tokens),
        ("completed", batch.warm_completed if answers else 0),
        ("failed", batch.warm_failed if answers else 0),
    ):
        if key in out:
            out[key] += warm
    return out


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
