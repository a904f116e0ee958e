"""The typed vocabulary of the Slurm adapter, shared by every backend."""

from __future__ import annotations

import enum
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    """A job's state, as one enum whatever backend or command reported it.

    Slurm's long names (squeue ``%T``, sacct ``State``) and short codes
    (squeue ``%t``) both translate through :func:`JobState.parse`; a code we
    do not know becomes UNKNOWN with a warning instead of an exception, so a
    newer Slurm never stops the daemon.

    ========== ===================================================================
    PENDING     queued (also REQUEUED/REQUEUE_HOLD/REQUEUE_FED: back in the queue)
    CONFIGURING nodes allocated, being readied (boot, prolog)
    RUNNING     running
    COMPLETING  ending: epilog or processes being killed
    SUSPENDED   suspended (by an admin, or preemption in SUSPEND mode)
    STOPPED     sent SIGSTOP
    SIGNALING   being signaled
    RESIZING    changing size
    STAGE_OUT   staging out after it ended
    COMPLETED   ended with exit 0
    CANCELLED   scancel, by a user or an admin
    FAILED      non-zero exit or launch failure
    TIMEOUT     reached its time limit
    NODE_FAIL   a node it ran on failed
    PREEMPTED   preempted (with REQUEUE, sacct shows this on the old attempt)
    BOOT_FAIL   a node failed to boot
    DEADLINE    missed its deadline
    OUT_OF_MEMORY killed by the OOM handler
    REVOKED     sibling of a federated job
    SPECIAL_EXIT requeued in hold after a special exit code
    UNKNOWN     anything else; logged once per code
    ========== ===================================================================
    """

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    RESIZING = "RESIZING"
    STAGE_OUT = "STAGE_OUT"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REVOKED = "REVOKED"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, code: str) -> JobState:
        """Translate a Slurm state code; ``"CANCELLED by 0"`` reads as CANCELLED."""
        word = code.strip().split(" ", 1)[0].rstrip("+").upper()
        state = _STATE_CODES.get(word)
        if state is None:
            if word not in _warned:
                _warned.add(word)
                log.warning("unknown Slurm job state %r, treated as UNKNOWN", code)
            return cls.UNKNOWN
        return state

    @property
    def is_active(self) -> bool:
        """Queued or holding (or about to hold) resources."""
        return self in _ACTIVE

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_warned: set[str] = set()

_STATE_CODES: dict[str, JobState] = {s.value: s for s in JobState if s is not JobState.UNKNOWN}
_STATE_CODES.update(
    {
        # Requeued jobs go back to the queue: for us they are pending again.
        "REQUEUED": JobState.PENDING,
        "REQUEUE_HOLD": JobState.PENDING,
        "REQUEUE_FED": JobState.PENDING,
        "RESV_DEL_HOLD": JobState.PENDING,
        "PD": JobState.PENDING,
        "RQ": JobState.PENDING,
        "RH": JobState.PENDING,
        "RF": JobState.PENDING,
        "RD": JobState.PENDING,
        "CF": JobState.CONFIGURING,
        "R": JobState.RUNNING,
        "CG": JobState.COMPLETING,
        "S": JobState.SUSPENDED,
        "ST": JobState.STOPPED,
        "SI": JobState.SIGNALING,
        "RS": JobState.RESIZING,
        "SO": JobState.STAGE_OUT,
        "CD": JobState.COMPLETED,
        "CA": JobState.CANCELLED,
        "F": JobState.FAILED,
        "TO": JobState.TIMEOUT,
        "NF": JobState.NODE_FAIL,
        "PR": JobState.PREEMPTED,
        "BF": JobState.BOOT_FAIL,
        "DL": JobState.DEADLINE,
        "OOM": JobState.OUT_OF_MEMORY,
        "RV": JobState.REVOKED,
        "SE": JobState.SPECIAL_EXIT,
    }
)

_ACTIVE = frozenset(
    {
        JobState.PENDING,
        JobState.CONFIGURING,
        JobState.RUNNING,
        JobState.COMPLETING,
        JobState.SUSPENDED,
        JobState.STOPPED,
        JobState.SIGNALING,
        JobState.RESIZING,
    }
)
_FINISHED = frozenset(
    {
        JobState.COMPLETED,
        JobState.CANCELLED,
        JobState.FAILED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.OUT_OF_MEMORY,
        JobState.REVOKED,
        JobState.STAGE_OUT,
        JobState.SPECIAL_EXIT,
    }
)


@dataclass(frozen=True)
class JobSpec:
    """What to submit.

    ``script`` is the whole batch script, ``#SBATCH`` lines included (for a
    heterogeneous job, components separated by ``#SBATCH hetjob``).
    ``name`` and ``comment`` are also given to sbatch as options so that the
    job's identity holds even if a site's template forgets them; both are
    visible to every user of the cluster, so never a secret.
    ``env`` is added to the sbatch process's environment (sbatch exports it to
    the job): the channel for secrets and trace context, never argv.
    ``unset_env`` names what the job must not inherit from the submitting
    process's own environment (taken out before ``env`` is added).
    """

    name: str
    script: str
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    comment: str = ""
    workdir: str | None = None

    @property
    def heterogeneous(self) -> bool:
        return any(
            line.split()[:2] in (["#SBATCH", "hetjob"], ["#SBATCH", "packjob"])
            for line in self.script.splitlines()
        )


@dataclass(frozen=True)
class JobComponent:
    """One component of a job (a plain job has exactly one, offset 0)."""

    offset: int
    job_id: str
    state: JobState
    nodes: tuple[str, ...]
    node_count: int
    tres_per_node: str  # TRES form, "gres/gpu:a100:2" on every Slurm version; "" when none


@dataclass(frozen=True)
class Job:
    """A job as listed by the queue, heterogeneous components folded in.

    ``job_id`` is the id sbatch returned (for a heterogeneous job, the id of
    component 0, which is also the het job's id).
    """

    job_id: str
    name: str
    state: JobState
    reason: str
    partition: str
    user: str
    comment: str
    nodes: tuple[str, ...]
    submit_time: datetime | None
    start_time: datetime | None
    time_limit_s: int | None
    # When Slurm will end it: start plus time limit, moved by suspensions and limit
    # changes. None while pending or without a limit. A time, not a time left, so
    # that a running job's listing does not change every second.
    end_time: datetime | None
    restarts: int
    components: tuple[JobComponent, ...]
    # For a task of a job array: the array's id (what sbatch returned; scancel of
    # it cancels every task). "" for a job outside an array.
    array_job_id: str = ""

    @property
    def heterogeneous(self) -> bool:
        return len(self.components) > 1


@dataclass(frozen=True)
class GpuCount:
    type: str  # "" when the gres has no type
    total: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # Slurm's long state, e.g. "idle", "mixed", "down*", "drained"
    partitions: tuple[str, ...]
    cpus_total: int
    cpus_alloc: int
    memory_mb: int
    gpus: tuple[GpuCount, ...]
    address: str = ""
    reason: str = ""
    # Its features (sinfo %f), for a model's constraint; None: the listing has none.
    features: tuple[str, ...] | None = None
    # Memory allocated to jobs (sinfo AllocMem); None: the listing does not say.
    memory_alloc_mb: int | None = None

    @functools.cached_property
    def usable(self) -> bool:
        """Can take new work (not down, drained, failing or unresponsive).

        Cached: a pass asks it of every node for every model it places
        (250,000 times for 500 models on 500 nodes), and a listing never changes.
        """
        s = self.state.lower()
        bad = ("down", "drain", "fail", "maint", "reboot", "unknown", "inval", "future", "power")
        return not s.endswith("*") and not any(b in s for b in bad)

    def gpus_free(self, gpu_type: str = "") -> int:
        return self._free_by_type.get(gpu_type, 0)

    @functools.cached_property
    def _free_by_type(self) -> dict[str, int]:
        # Cached like ``usable``: placement asks every node once per model it
        # places, and fit-aware eviction asks again per candidate.
        out: dict[str, int] = {}
        for g in self.gpus:
            if g.type:
                out[g.type] = out.get(g.type, 0) + g.free
        out[""] = sum(g.free for g in self.gpus)
        return out

    def gpus_total(self, gpu_type: str = "") -> int:
        return sum(g.total for g in self.gpus if not gpu_type or g.type == gpu_type)


@dataclass(frozen=True)
class AccountingRecord:
    """One job (allocation, not steps) from ``sacct``."""

    job_id: str
    name: str
    user: str
    account: str
    partition: str
    state: JobState
    exit_code: str
    comment: str
    submit: datetime | None
    start: datetime | None
    end: datetime | None
    elapsed_s: int
    nodes: int
    alloc_tres: str
    gpus: int
    restarts: int = 0
    # The cluster it ran on, by its name in server.yaml's clusters ("" with one
    # cluster). Set by whoever asked which cluster, not by the backend.
    cluster: str = ""

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.elapsed_s / 3600.0


@dataclass(frozen=True)
class Associations:
    """A user's associations in slurmdbd: who may charge which account."""

    user: str
    accounts: frozenset[str]
    default: str  # the user's default account; "" when slurmdbd knows the user not


class SlurmBackend(Protocol):
    """What the rest of llmgw-slurm may ask of Slurm. One place talks to Slurm."""

    async def submit(self, spec: JobSpec) -> str:
        """Submit; returns the job id. Raises SlurmError."""

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        """This user's jobs whose name starts with ``name_prefix``, in one call.

        Jobs that ended recently (while slurmctld still keeps them, MinJobAge)
        are listed too, with their final state.
        """

    async def list_nodes(self) -> list[NodeInfo]:
        """Every node with total and used GPUs per type, in one call."""

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        """Cancel (or, with ``signal``, only signal) a job. A job already gone is not an error."""

    async def requeue(self, job_id: str) -> None:
        """Put a running job back in the queue."""

    async def accounting(
        self,
        start: datetime,
        end: datetime | None = None,
        name_prefix: str = "",
        all_users: bool = False,
        duplicates: bool = False,
    ) -> list[AccountingRecord]:
        """Finished and running jobs from the accounting database.

        ``duplicates``: every run of a requeued job, one record each (a
        preempted run ends PREEMPTED, the next one has the same job id); by
        default only each job's latest run, as ``sacct`` lists them.
        """

    @property
    def calls(self) -> int:
        """How many Slurm commands or API calls this backend has made (for load figures)."""

    async def check(self) -> None:
        """Before the first pass: ConfigError for a setting Slurm shows cannot work (the
        daemon stops, saying what to change), SlurmError when Slurm does not answer
        (the passes try again). Nothing to check for the command-line tools."""

    async def close(self) -> None:
        """Let go of what the backend holds open (connections), at the daemon's stop."""


@runtime_checkable
class StartEstimator(Protocol):
    """A backend that can say when Slurm would start a job, without submitting it."""

    async def will_start(self, spec: JobSpec) -> datetime:
        """Slurm's expected start (``sbatch --test-only``). Raises SlurmError when the
        cluster could never run the job or does not answer."""


# What Slurm says of a job that has already ended or never was, in each of its
# interfaces: scancel's stderr, slurm_strerror's words through pyslurm, slurmrestd's
# errors (whose codes say it too). Cancelling it again is done, not failed: the
# executor is idempotent, and a pass that cancels what just ended goes on.
_GONE_WORDS = re.compile(
    r"Invalid job id|already completing or completed|Job/step already|does not exist",
    re.IGNORECASE,
)
_GONE_CODES = frozenset({2017, 2021})  # ESLURM_INVALID_JOB_ID, ESLURM_ALREADY_DONE


def already_gone(job_id: str, message: str, code: int = 0) -> bool:
    """Whether Slurm's refusal to cancel ``job_id`` says it is gone already (logged
    then: every backend's ``cancel`` returns instead of raising)."""
    gone = code in _GONE_CODES or _GONE_WORDS.search(message) is not None
    if gone:
        log.info("cancel %s: already gone", job_id)
    return gone


__all__: Sequence[str] = (
    "AccountingRecord",
    "Associations",
    "GpuCount",
    "Job",
    "JobComponent",
    "JobSpec",
    "JobState",
    "NodeInfo",
    "SlurmBackend",
    "StartEstimator",
    "already_gone",
)
