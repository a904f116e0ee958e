"""The Slurm adapter's contract, against the real one-machine cluster.

Every case runs on every backend (``cli`` always; ``pyslurm`` where the cluster
runs Slurm 25.11 and pyslurm imports; ``rest`` where the cluster runs
slurmrestd; skipped with the reason otherwise): the adapter's types say what
each field means, and every backend must agree.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from llmgw_slurm.slurm import (
    BACKENDS,
    Job,
    JobSpec,
    JobState,
    SlurmBackend,
    SlurmError,
    make_backend,
)
from llmgw_slurm.slurm.cli import CliBackend, show_hostnames
from llmgw_slurm.slurm.rest import RestBackend
from tests.slurm.conftest import backend_options, eventually, need_backend
from tests.slurm.harness import SITE

KINDS: dict[str, str] = {}


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[SlurmBackend]:
    need_backend(request.param)
    b = make_backend(request.param, timeout=60, **backend_options(request.param))
    KINDS[type(b).__name__] = request.param
    # Before the counts the cases read: the rest backend's version check is two calls.
    await b.check()
    yield b
    jobs = await b.list_jobs(prefix)
    if jobs:
        subprocess.run(["scancel", *[j.job_id for j in jobs]], check=False)
    await b.close()


def script(*lines: str, directives: tuple[str, ...] = ()) -> str:
    if not any(d.startswith("--output") for d in directives):
        # Otherwise Slurm writes slurm-JOBID.out into the directory the tests run from.
        directives = (*directives, "--output=/dev/null")
    return "\n".join(["#!/bin/bash", *[f"#SBATCH {d}" for d in directives], *lines]) + "\n"


async def finished(backend: SlurmBackend, job_id: str, prefix: str) -> bool:
    return all(j.job_id != job_id for j in await backend.list_jobs(prefix)) or any(
        j.job_id == job_id and j.state.is_finished for j in await backend.list_jobs(prefix)
    )


async def wait_state(backend: SlurmBackend, prefix: str, job_id: str, *states: JobState) -> Job:
    async def probe() -> Job | None:
        for j in await backend.list_jobs(prefix):
            if j.job_id == job_id and j.state in states:
                return j
        return None

    return await eventually(probe, f"job {job_id} in {states}")


async def test_gpu_job_sees_its_gpus_and_env_not_argv(
    backend: SlurmBackend, prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    job_id = await backend.submit(
        JobSpec(
            name=prefix + "gpu.00000001",
            script=script(
                'echo "CVD=$CUDA_VISIBLE_DEVICES"',
                'echo "SECRET=$LLMGW_REPLICA_SECRET"',
                directives=("--partition=llm", "--gres=gpu:a100:2", f"--output={out}"),
            ),
            env={"LLMGW_REPLICA_SECRET": "not-on-argv-123"},
        )
    )
    assert job_id.isdigit()
    await eventually(lambda: finished(backend, job_id, prefix), "the GPU job to end")
    await eventually(
        lambda: asyncio.sleep(0, result=out.exists() and "SECRET" in out.read_text()), "output"
    )
    text = out.read_text()
    cvd = text.split("CVD=")[1].split()[0]
    assert len(cvd.split(",")) == 2, text
    assert "SECRET=not-on-argv-123" in text
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=False
    ).stdout
    assert "not-on-argv-123" not in shown


async def test_heterogeneous_job_is_one_job_with_components_on_two_nodes(
    backend: SlurmBackend, prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "het.txt"
    job_id = await backend.submit(
        JobSpec(
            name=prefix + "het.00000002",
            script=script(
                "srun --het-group=0,1 bash -c 'echo node=$(hostname -s) $SLURMD_NODENAME'",
                "sleep 30",
                directives=(
                    "--partition=llm",
                    "--nodes=1",
                    "--gres=gpu:a100:1",
                    f"--output={out}",
                    "hetjob",
                    "--partition=llm",
                    "--nodes=1",
                    "--gres=gpu:a100:1",
                ),
            ),
        )
    )
    job = await wait_state(backend, prefix, job_id, JobState.RUNNING)
    assert job.heterogeneous
    assert len(job.components) == 2
    assert job.components[0].job_id == job_id
    assert len(set(job.nodes)) == 2
    assert all(c.nodes for c in job.components)

    async def both_reported() -> str | None:
        text = out.read_text() if out.exists() else ""
        return text if text.count("node=") == 2 else None

    text = await eventually(both_reported, "both components to run srun")
    names = {line.split()[-1] for line in text.splitlines() if line.startswith("node=")}
    assert names == set(job.nodes)


async def test_cancel_is_idempotent(backend: SlurmBackend, prefix: str) -> None:
    job_id = await backend.submit(
        JobSpec(
            name=prefix + "cancel.00000003",
            script=script("sleep 300", directives=("--partition=llm",)),
        )
    )
    await wait_state(backend, prefix, job_id, JobState.RUNNING)
    await backend.cancel(job_id)

    async def gone() -> bool:
        return all(
            j.job_id != job_id or j.state in (JobState.CANCELLED, JobState.COMPLETING)
            for j in await backend.list_jobs(prefix)
        )

    await eventually(gone, "the job to be cancelled")
    await backend.cancel(job_id)  # already gone: no error
    await backend.cancel("999999")  # never existed: no error


async def test_an_arrays_tasks_carry_its_id_and_its_cancel_ends_them_all(
    backend: SlurmBackend, prefix: str
) -> None:
    name = prefix + "_batch.array"
    array_id = await backend.submit(
        JobSpec(
            name=name, script=script("sleep 300", directives=("--partition=llm", "--array=0-2"))
        )
    )

    async def all_running() -> list[Job] | None:
        tasks = [j for j in await backend.list_jobs(prefix) if j.state is JobState.RUNNING]
        return tasks if len(tasks) == 3 else None

    tasks = await eventually(all_running, "the array's three tasks to run")
    # One task keeps the array's own id (Slurm's), the others have ids of their own.
    assert {j.array_job_id or j.job_id for j in tasks} == {array_id}
    assert len({j.job_id for j in tasks}) == 3 and {j.name for j in tasks} == {name}
    await backend.cancel(array_id)

    async def none_active() -> bool:
        return not any(j.state.is_active for j in await backend.list_jobs(prefix))

    await eventually(none_active, "every task to be cancelled")


async def running_ten_minutes(backend: SlurmBackend, prefix: str, name: str) -> Job:
    """A job with a 10-minute limit, once it runs (the backend fixture cancels it)."""
    script_ = script("sleep 300", directives=("--partition=llm", "--time=10"))
    job_id = await backend.submit(JobSpec(name=prefix + name, script=script_))
    return await wait_state(backend, prefix, job_id, JobState.RUNNING)


async def test_a_running_jobs_row_repeats_until_its_limit_moves(
    backend: SlurmBackend, prefix: str
) -> None:
    # The listing gives an end time, not a time left: a running job's row must repeat
    # from one pass to the next (the row cache hands back the same job), and a limit
    # an admin extends must move the end the renewal rule reads.
    job = await running_ten_minutes(backend, prefix, "end.00000009")
    job_id = job.job_id
    assert job.start_time is not None and job.end_time is not None
    assert job.end_time - job.start_time == timedelta(minutes=10)
    await asyncio.sleep(1.1)  # a time left would have moved by now
    (again,) = [j for j in await backend.list_jobs(prefix) if j.job_id == job_id]
    assert again == job
    if isinstance(backend, CliBackend | RestBackend):
        assert again is job  # the row cache's hit
    subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", "TimeLimit=20"], check=True, timeout=30
    )
    (moved,) = [j for j in await backend.list_jobs(prefix) if j.job_id == job_id]
    assert moved.end_time is not None
    assert moved.end_time - job.end_time == timedelta(minutes=10)
    assert moved.time_limit_s == 1200


async def test_a_daemon_started_from_a_customised_shell_lists_the_same(
    backend: SlurmBackend, prefix: str
) -> None:
    # An admin's SLURM_TIME_FORMAT=relative would turn every time into "01:16:29"
    # and SQUEUE_STATES=PENDING would hide running replicas: neither may reach squeue.
    job = await running_ten_minutes(backend, prefix, "env.0000000a")
    job_id = job.job_id
    kind = KINDS[type(backend).__name__]
    customised = make_backend(
        kind,
        env={**os.environ, "SLURM_TIME_FORMAT": "relative", "SQUEUE_STATES": "PENDING"},
        **backend_options(kind),
    )
    (seen,) = [j for j in await customised.list_jobs(prefix) if j.job_id == job_id]
    await customised.close()
    assert seen.state is JobState.RUNNING
    assert (seen.start_time, seen.end_time) == (job.start_time, job.end_time)


async def test_signal_reaches_the_batch_shell(
    backend: SlurmBackend, prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "sig.txt"
    job_id = await backend.submit(
        JobSpec(
            name=prefix + "sig.00000004",
            script=script(
                "trap 'echo got-usr1; exit 0' USR1",
                "echo started",
                "for i in $(seq 600); do sleep 0.1; done",
                directives=("--partition=llm", f"--output={out}"),
            ),
        )
    )
    await wait_state(backend, prefix, job_id, JobState.RUNNING)
    await eventually(
        lambda: asyncio.sleep(0, result=out.exists() and "started" in out.read_text()), "the trap"
    )
    await backend.cancel(job_id, signal="USR1", batch_only=True)
    await eventually(
        lambda: asyncio.sleep(0, result=out.exists() and "got-usr1" in out.read_text()),
        "the batch shell to get USR1",
    )


async def test_research_job_preempts_a_service_job_which_is_requeued(
    backend: SlurmBackend, prefix: str
) -> None:
    # Pin both to one node and ask for all its GPUs so that only preemption can start the second.
    free = [n.name for n in await backend.list_nodes() if n.usable and n.gpus_free("a100") == 4]
    assert free, "no node with 4 free GPUs: is something else running on the dev cluster?"
    node = free[-1]
    svc = await backend.submit(
        JobSpec(
            name=prefix + "svc.00000005",
            script=script(
                "sleep 600",
                directives=(
                    "--partition=llm",
                    f"--nodelist={node}",
                    "--gres=gpu:a100:4",
                    "--requeue",
                ),
            ),
        )
    )
    await wait_state(backend, prefix, svc, JobState.RUNNING)
    research = await backend.submit(
        JobSpec(
            name=prefix + "research.00000006",
            script=script(
                "sleep 600",
                directives=("--partition=research", f"--nodelist={node}", "--gres=gpu:a100:4"),
            ),
        )
    )
    await wait_state(backend, prefix, research, JobState.RUNNING)

    async def requeued() -> Job | None:
        for j in await backend.list_jobs(prefix):
            if j.job_id == svc and j.state is JobState.PENDING and j.restarts >= 1:
                return j
        return None

    job = await eventually(requeued, "the service job to be requeued")
    assert job.restarts == 1

    # Accounting with duplicates lists the preempted run (the faults level shows it
    # beside the next run, once that one has started: tests/faults/test_replica_faults.py).
    since = datetime.now() - timedelta(hours=1)

    async def runs() -> list[JobState] | None:
        recs = await backend.accounting(since, name_prefix=prefix, duplicates=True)
        states = [r.state for r in recs if r.job_id == svc]
        return states if JobState.PREEMPTED in states else None

    await eventually(runs, "accounting to list the preempted run")


async def test_accounting_keeps_the_comment(backend: SlurmBackend, prefix: str) -> None:
    comment = "model=m1 replica=0000abcd|with pipe"
    job_id = await backend.submit(
        JobSpec(
            name=prefix + "acct.00000007",
            script=script("true", directives=("--partition=llm", "--gres=gpu:a100:1")),
            comment=comment,
        )
    )

    async def recorded() -> list[object] | None:
        recs = await backend.accounting(datetime.now() - timedelta(hours=1), name_prefix=prefix)
        hits = [r for r in recs if r.job_id == job_id and r.state is JobState.COMPLETED]
        return hits or None  # type: ignore[return-value]

    (rec,) = await eventually(recorded, "sacct to record the job")
    assert rec.comment == comment  # type: ignore[attr-defined]
    assert rec.gpus == 1  # type: ignore[attr-defined]
    assert rec.partition == "llm"  # type: ignore[attr-defined]


async def test_hostile_name_and_comment_are_passed_literally(
    backend: SlurmBackend, prefix: str
) -> None:
    name = prefix + "it's $(touch /tmp/llmgw-pwned) `id`;x"
    comment = "\"quoted\" 'single' $(whoami) ; rm -rf /"
    job_id = await backend.submit(
        JobSpec(
            name=name, script=script("sleep 60", directives=("--partition=llm",)), comment=comment
        )
    )
    (job,) = [j for j in await backend.list_jobs(prefix) if j.job_id == job_id]
    assert job.name == name
    assert job.comment == comment
    assert not Path("/tmp/llmgw-pwned").exists()


async def test_nodes_show_free_and_total_gpus(backend: SlurmBackend) -> None:
    before = backend.calls
    nodes = await backend.list_nodes()
    assert backend.calls == before + 1
    assert sorted(n.name for n in nodes) == sorted(SITE)
    for n in nodes:
        site = SITE[n.name]
        assert n.gpus_total(site.gpu_type) == n.gpus_total() == site.gpus
        assert 0 <= n.gpus_free(site.gpu_type) <= site.gpus
        assert set(n.partitions) == set(site.partitions)
        assert (n.cpus_total, n.memory_mb) == (site.cpus, site.memory_mb)
        assert tuple(n.features or ()) == site.features
        assert n.address == "127.0.10." + n.name.removeprefix("gpunode")


async def test_listing_500_jobs_is_one_call(backend: SlurmBackend, prefix: str) -> None:
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> str:
        async with sem:
            return await backend.submit(
                JobSpec(
                    name=f"{prefix}many.{i:08x}",
                    # Held: they never run, so 500 of them cost the cluster nothing.
                    script=script("true", directives=("--partition=llm", "--hold")),
                )
            )

    ids = await asyncio.gather(*(one(i) for i in range(500)))
    assert len(set(ids)) == 500
    before = backend.calls
    jobs = await backend.list_jobs(prefix)
    assert backend.calls == before + 1
    assert {j.job_id for j in jobs} >= set(ids)
    assert all(j.state is JobState.PENDING for j in jobs if j.job_id in set(ids))
    subprocess.run(["scancel", *ids], check=True)


def test_show_hostnames_expands_what_slurm_writes() -> None:
    # The agent's one Slurm call (multi-node rendezvous), against the real scontrol.
    assert show_hostnames("gpunode[1-2],gpunode4") == ["gpunode1", "gpunode2", "gpunode4"]


async def test_requeue_puts_a_running_job_back_in_the_queue(
    backend: SlurmBackend, prefix: str
) -> None:
    job = await running_ten_minutes(backend, prefix, "requeue.0000000b")
    if isinstance(backend, RestBackend):
        # slurmrestd has no requeue call: the backend says so, naming the way out.
        with pytest.raises(SlurmError, match=r"no requeue call.*scontrol requeue"):
            await backend.requeue(job.job_id)
        return
    await backend.requeue(job.job_id)

    async def queued() -> Job | None:
        for j in await backend.list_jobs(prefix):
            if j.job_id == job.job_id and j.state is JobState.PENDING and j.restarts == 1:
                return j
        return None

    again = await eventually(queued, "the requeued job back in the queue")
    # A queued job has neither started nor an end, whatever its last run had.
    assert (again.start_time, again.end_time) == (None, None)
    assert again.submit_time is not None


async def test_a_running_gpu_job_shows_as_used_gpus_on_its_node(
    backend: SlurmBackend, prefix: str
) -> None:
    job_id = await backend.submit(
        JobSpec(
            name=prefix + "used.0000000c",
            script=script("sleep 300", directives=("--partition=llm", "--gres=gpu:a100:2")),
        )
    )
    job = await wait_state(backend, prefix, job_id, JobState.RUNNING)
    assert job.components[0].tres_per_node == "gres/gpu:a100:2"
    (node,) = [n for n in await backend.list_nodes() if n.name == job.nodes[0]]
    # Other tests' jobs may share the node: at least ours is counted, per type.
    assert 2 <= node.gpus_total("a100") - node.gpus_free("a100") <= 4
    assert node.state in ("mixed", "allocated")
