"""``llmgw-agent batch``: one Batch API batch through the model's engine, inside its job.

The engine starts as a replica's does (weights, engine launch, readiness:
the :class:`~llmgw_slurm.agent.runner.Agent`'s own steps), but serves nobody
else: instead of registering, the agent sends the batch's requests to it,
``concurrency`` at a time, and appends each answer to the batch's output file
(2xx) or error file (anything else) as one line, in OpenAI's output shape.

Resume: the ``custom_id``s already in either file are skipped, so a job that
was preempted and requeued, or resubmitted after its time limit, does only
what is left, and each ``custom_id`` ends up in the files once. A request
whose engine could not be reached is written nowhere: the next job sends it.

Progress (completed, failed, tokens) goes to the daemon as signed reports,
``/internal/v1/batches/BATCH_ID/report``, every heartbeat interval; the
daemon's answer ``drain`` (the batch was cancelled) stops the run, as
SIGTERM (scancel, preemption) and SIGUSR1 (the time limit near) do: no new
request is sent, the ones in flight finish, and the job ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import ssl
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from llmgw_slurm.agent.engine import (
    EngineProcess,
    LaunchParams,
    build_run_batch_command,
    engine_env,
)
from llmgw_slurm.agent.runner import (
    EXIT_FAILED,
    EXIT_OK,
    Agent,
    JobContext,
    JobKind,
    job_context_from_env,
)
from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.batch import results

__all__ = ["BatchAgent", "BatchJob", "BatchRun", "batch_job_from_env"]

log = logging.getLogger(__name__)

_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# A request that takes longer than this is failed (written to the error file):
# one stuck request must not hold the batch until the job's time limit.
_REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class BatchJob:
    """What the daemon put in a batch job's environment, beside the replica-like context."""

    input: Path
    output: Path
    errors: Path
    endpoint: str
    concurrency: int
    # "auto": vLLM's offline runner for a vllm engine, the engine's server otherwise;
    # "server": always the server (server.yaml batch.runner).
    runner: str = "auto"
    # A shard (an array task): the input lines [first, stop) are its own; None: all.
    first: int = 0
    stop: int | None = None
    # Its array task's index, sent with its reports (the daemon sums the shards').
    shard: int | None = None
    # A shard's: the batch's own result files, where a ride on warm replicas wrote
    # the answers it had before the array ran (skipped, not counted: the daemon
    # adds them to the shards' sum).
    shared: tuple[Path, Path] | None = None


BATCH_JOB = JobKind(
    "LLMGW_BATCH_ID",
    "LLMGW_BATCH_SECRET",
    _BATCH_ID,
    "is not a batch id",
    more=("LLMGW_BATCH_INPUT", "LLMGW_BATCH_OUTPUT", "LLMGW_BATCH_ERRORS", "LLMGW_BATCH_ENDPOINT"),
)


def batch_job_from_env(env: Mapping[str, str]) -> tuple[JobContext, BatchJob]:
    """The job's context (checked as a replica's is); ConfigError naming the first
    variable missing or wrong."""
    job = job_context_from_env(env, BATCH_JOB)
    try:
        concurrency = max(1, int(env.get("LLMGW_BATCH_CONCURRENCY", "16")))
    except ValueError:
        raise ConfigError("not a number", field="LLMGW_BATCH_CONCURRENCY") from None
    batch = BatchJob(
        Path(env["LLMGW_BATCH_INPUT"]),
        Path(env["LLMGW_BATCH_OUTPUT"]),
        Path(env["LLMGW_BATCH_ERRORS"]),
        env["LLMGW_BATCH_ENDPOINT"],
        concurrency,
        env.get("LLMGW_BATCH_RUNNER", "auto"),
    )
    return job, _shard(batch, env)


def _shard(batch: BatchJob, env: Mapping[str, str]) -> BatchJob:
    """This array task's shard of ``batch`` (its lines, its own result files), or
    ``batch`` as it is when the batch has no shards."""
    if not env.get("LLMGW_BATCH_SHARDS"):
        return batch
    numbers = {}
    for name in ("LLMGW_BATCH_SHARDS", "LLMGW_BATCH_SHARD_SIZE", "SLURM_ARRAY_TASK_ID"):
        text = env.get(name, "")
        if not text.isdigit():
            why = "not set" if not text else f"{text!r} is not a number"
            raise ConfigError(
                f"{why}: a sharded batch runs as a job array, one task per shard "
                "(is the site's batch template missing its #SBATCH --array line?)",
                field=name,
            )
        numbers[name] = int(text)
    task, size = numbers["SLURM_ARRAY_TASK_ID"], max(1, numbers["LLMGW_BATCH_SHARD_SIZE"])
    if task >= numbers["LLMGW_BATCH_SHARDS"]:
        raise ConfigError(
            f"task {task} of a batch of {numbers['LLMGW_BATCH_SHARDS']} shards",
            field="SLURM_ARRAY_TASK_ID",
        )
    output, errors = results.shard_paths(batch.output, batch.errors, task)
    output.parent.mkdir(mode=0o700, exist_ok=True)
    return replace(
        batch,
        output=output,
        errors=errors,
        first=task * size,
        stop=(task + 1) * size,
        shard=task,
        shared=(batch.output, batch.errors),
    )


def done_before(batch: BatchJob) -> tuple[set[str], set[str]]:
    """The ``custom_id``s answered (output) and failed (errors) by earlier jobs,
    after cutting a partial last line that a killed job left."""
    for path in (batch.output, batch.errors):
        results.repair(path)
    answered = results.custom_ids(batch.output)
    return answered, results.custom_ids(batch.errors) - answered


def skipped(batch: BatchJob) -> set[str]:
    """The ``custom_id``s this job skips: answered or failed before, in its own files
    or (a shard's) the batch's."""
    answered, failed = done_before(batch)
    if batch.shared is not None:
        for path in batch.shared:
            results.repair(path)
            answered = answered | results.custom_ids(path)
    return answered | failed


def todo(batch: BatchJob, done: set[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(custom_id, body) of each request of this job's lines not done yet, in file order."""
    with batch.input.open("rb") as f:
        for n, raw in enumerate(f):
            if n < batch.first:
                continue
            if batch.stop is not None and n >= batch.stop:
                break
            try:
                line = json.loads(raw)
                cid, body = line["custom_id"], line["body"]
            except (ValueError, KeyError, TypeError):
                continue  # checked at create time; a changed file is not ours to fix
            if cid not in done:
                yield cid, body


class BatchRun:
    """Sends a batch's remaining requests to one engine and appends the answers."""

    def __init__(
        self,
        batch: BatchJob,
        session: aiohttp.ClientSession,
        base_url: str,
        api_key: str,
        served_name: str,
        ssl_ctx: ssl.SSLContext | None,
    ) -> None:
        self.batch = batch
        self._session = session
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._served = served_name
        self._ssl: ssl.SSLContext | bool = ssl_ctx if ssl_ctx is not None else True
        self.completed = 0
        self.failed = 0
        self.unreached = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.stopping = asyncio.Event()

    def counts(self) -> dict[str, int]:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }

    async def run(self) -> None:
        """Until every request was answered, or ``stopping`` was set (in-flight ones finish)."""
        b = self.batch
        answered, failed = done_before(b)
        self.completed, self.failed = len(answered), len(failed)
        done = skipped(b)
        log.info("batch: %d answered before, resuming", len(done))
        slots = asyncio.Semaphore(b.concurrency)
        out = os.open(b.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        err = os.open(b.errors, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        tasks: set[asyncio.Task[None]] = set()
        try:
            for cid, body in todo(b, done):
                await slots.acquire()
                if self.stopping.is_set():
                    slots.release()
                    break
                t = asyncio.create_task(self._one(cid, body, out, err))
                t.add_done_callback(lambda _: slots.release())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            os.close(out)
            os.close(err)

    async def _one(self, cid: str, body: dict[str, Any], out: int, err: int) -> None:
        body = {**body, "model": self._served}
        try:
            async with self._session.post(
                self._base + self.batch.endpoint,
                json=body,
                headers=self._headers,
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S),
            ) as resp:
                status = resp.status
                request_id = resp.headers.get("X-Request-Id", "")
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            # The engine did not answer: nothing written, the next job sends it again.
            self.unreached += 1
            log.warning("batch: %s not answered (%s)", cid, type(e).__name__)
            return
        try:
            answer: Any = json.loads(text)
        except ValueError:
            answer = {"error": {"message": text[:2000]}}
        data = results.answer_line(cid, status, request_id, answer)
        # One write per line on an O_APPEND file: a kill leaves whole lines and at
        # most one partial last line, which results.repair cuts.
        os.write(out if 200 <= status < 300 else err, data)
        if 200 <= status < 300:
            self.completed += 1
            usage = answer.get("usage") if isinstance(answer, dict) else None
            if isinstance(usage, dict):
                self.prompt_tokens += _int(usage.get("prompt_tokens"))
                self.completion_tokens += _int(usage.get("completion_tokens"))
        else:
            self.failed += 1


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _write_todo(batch: BatchJob, dest: Path, served: str) -> tuple[dict[str, int], int]:
    """The requests not done yet, as run_batch's input (the engine's served name in
    each body); returns the counts so far and how many were written."""
    answered, failed = done_before(batch)
    n = 0
    with dest.open("w") as f:
        for cid, body in todo(batch, skipped(batch)):
            line = {"custom_id": cid, "method": "POST", "url": batch.endpoint}
            f.write(json.dumps({**line, "body": {**body, "model": served}}) + "\n")
            n += 1
    return {"completed": len(answered), "failed": len(failed)}, n


def _append_run(batch: BatchJob, produced: Path, counts: dict[str, int]) -> dict[str, int]:
    """run_batch's answers appended to the batch's files, each custom_id once."""
    seen = skipped(batch)
    out = dict(counts, prompt_tokens=0, completion_tokens=0)
    with (
        produced.open("rb") as src,
        batch.output.open("ab") as ok,
        batch.errors.open("ab") as bad,
    ):
        for raw in src:
            try:
                line = json.loads(raw)
                cid, status = line["custom_id"], (line.get("response") or {}).get("status_code")
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if cid in seen:
                continue
            seen.add(cid)
            good = isinstance(status, int) and 200 <= status < 300
            (ok if good else bad).write(raw if raw.endswith(b"\n") else raw + b"\n")
            out["completed" if good else "failed"] += 1
            usage = ((line.get("response") or {}).get("body") or {}).get("usage")
            if good and isinstance(usage, dict):
                out["prompt_tokens"] += _int(usage.get("prompt_tokens"))
                out["completion_tokens"] += _int(usage.get("completion_tokens"))
    return out


class BatchAgent(Agent):
    """The agent's startup, then a batch run instead of serving."""

    report_kind = "batches"

    def __init__(self, batch: BatchJob, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch = batch
        self.run_: BatchRun | None = None
        self._done_before: dict[str, int] | None = None
        self._model_path = ""

    def _tag(self, counts: dict[str, int]) -> dict[str, int]:
        """``counts`` with this job's shard, so that the daemon can add up the shards'."""
        return counts if self.batch.shard is None else {**counts, "shard": self.batch.shard}

    @property
    def offline(self) -> bool:
        return self.batch.runner == "auto" and self.job.spec.engine.kind == "vllm"

    def _left(self) -> dict[str, int] | None:
        """The counts so far when nothing of this job's lines is left to do, else None."""
        answered, failed = done_before(self.batch)
        if next(todo(self.batch, skipped(self.batch)), None) is not None:
            return None
        return {"completed": len(answered), "failed": len(failed)}

    async def _startup_steps(self, session: aiohttp.ClientSession) -> None:
        self._done_before = await asyncio.to_thread(self._left)
        if self._done_before is not None:
            # A shard done in an array resubmitted for the others: no engine to load.
            return
        if not self.offline:
            await super()._startup_steps(session)
            return
        # vLLM's offline runner loads the model itself: no port, no TLS, no readiness.
        self._model_path = await self._weights_step()
        self._private = Path(tempfile.mkdtemp(prefix=f"llmgw-{self.job.replica_id}-"))

    async def _register_step(self) -> None:
        # Nobody routes to a batch job's engine: there is nothing to register.
        return

    async def _serve(self, session: aiohttp.ClientSession) -> int:
        if self._done_before is not None:
            counts = self._tag(self._done_before)
            self._emit("stopped", message="nothing left to do", counts=counts)
            return EXIT_OK
        if self.offline:
            return await self._serve_offline()
        assert self.engine is not None
        t0 = time.monotonic()
        base = self._metrics_url.rsplit("/", 1)[0]
        run = self.run_ = BatchRun(
            self.batch,
            session,
            base,
            self.job.engine_api_key,
            self.job.spec.name,
            self._engine_ssl,
        )
        work = asyncio.create_task(run.run())
        exited = asyncio.create_task(self.engine.wait())
        drain = asyncio.create_task(self._drain.wait())
        try:
            while not work.done():
                await asyncio.wait(
                    {work, exited, drain},
                    timeout=self.config.heartbeat_interval,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if drain.done() or exited.done():
                    run.stopping.set()
                    break
                await self._progress_report(run)
            await work
        finally:
            exited.cancel()
            drain.cancel()
        elapsed = time.monotonic() - t0
        if exited.done() and not exited.cancelled() and not self._drain.is_set():
            tail = "\n".join(self.engine.tail()[-20:])
            self._emit(
                "failed",
                message=f"engine exited during the batch:\n{tail}",
                counts=self._tag(run.counts()),
                elapsed_s=elapsed,
            )
            return EXIT_FAILED
        why = self.drain_reason or "every request answered"
        self._emit("stopped", message=why, counts=self._tag(run.counts()), elapsed_s=elapsed)
        return EXIT_OK

    async def _serve_offline(self) -> int:
        """vLLM's ``run_batch`` over the requests not done yet, then its answers appended.

        It writes its output only at its end: a job stopped before (cancel,
        preemption, time limit) leaves this run's requests to the next job.
        """
        assert self._private is not None
        t0 = time.monotonic()
        run_in, run_out = self._private / "input.jsonl", self._private / "output.jsonl"
        counts, left = await asyncio.to_thread(_write_todo, self.batch, run_in, self.job.spec.name)
        if left:
            rc = await self._run_batch(run_in, run_out, left, counts)
            if rc is None:
                self._emit("stopped", message=self.drain_reason, counts=self._tag(counts))
                return EXIT_OK
            if rc != 0:
                assert self.engine is not None
                tail = "\n".join(self.engine.tail()[-20:])
                self._emit(
                    "failed",
                    message=f"run_batch exited with {rc}:\n{tail}",
                    counts=self._tag(counts),
                    elapsed_s=time.monotonic() - t0,
                )
                return EXIT_FAILED
            counts = await asyncio.to_thread(_append_run, self.batch, run_out, counts)
        self._emit(
            "stopped",
            message="every request answered",
            counts=self._tag(counts),
            elapsed_s=time.monotonic() - t0,
        )
        return EXIT_OK

    async def _run_batch(
        self, run_in: Path, run_out: Path, left: int, counts: dict[str, int]
    ) -> int | None:
        """run_batch's exit code; None when the job was told to stop first."""
        s, spec = self.config, self.job.spec
        launch = LaunchParams(
            model_path=self._model_path,
            served_name=spec.name,
            host=s.bind_host,
            port=0,
            python=s.interpreter,
            runtime=s.engines.of("vllm"),
            apptainer=s.apptainer.binary,
            apptainer_binds=s.apptainer.binds,
            binds=(self._model_path,) if self._model_path.startswith("/") else (),
            private_dir=str(self._private),
        )
        cmd = build_run_batch_command(spec.engine, launch, str(run_in), str(run_out))
        async with self._step("run_batch", requests=left):
            self.engine = EngineProcess(
                cmd.argv, engine_env(self.env, cmd.env), tail_lines=s.log_tail_lines
            )
            await self.engine.start()
            exited = asyncio.create_task(self.engine.wait())
            drain = asyncio.create_task(self._drain.wait())
            try:
                while not exited.done():
                    await asyncio.wait(
                        {exited, drain},
                        timeout=s.heartbeat_interval,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if drain.done() and not exited.done():
                        await self.engine.stop(s.drain.stop_grace)
                        return None
                    await self._send_progress(counts)
            finally:
                drain.cancel()
            return exited.result()

    async def _progress_report(self, run: BatchRun) -> None:
        await self._send_progress(run.counts())

    async def _send_progress(self, counts: dict[str, int]) -> None:
        assert self._client is not None
        body = self._client.body("progress", counts=self._tag(counts))
        answer = await self._client.send_once(body)
        if answer is not None and answer.drain:
            self.request_drain("the batch was cancelled")
