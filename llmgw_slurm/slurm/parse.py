"""Pure parsers for what Slurm's command-line tools print.

Kept apart from the code that runs the commands so that recorded outputs can be
tested without a cluster. Every parser either returns typed values or raises
SlurmParseError naming the command and the offending text; a single bad line in
a listing is skipped with a warning rather than hiding every other job.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime

from llmgw_slurm.base.durations import slurm_time
from llmgw_slurm.base.errors import SlurmParseError
from llmgw_slurm.slurm.hostlist import expand
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    GpuCount,
    Job,
    JobComponent,
    JobState,
    NodeInfo,
)

log = logging.getLogger(__name__)

# Field separator for every listing: ASCII unit separator. Job names and comments are
# free text ("|" is common in comments); this byte is not something anyone types.
SEP = "\x1f"

# squeue --Format fields, in order. Comment is last: it is the field most likely to
# hold surprises, and a surplus separator there is folded back into it.
SQUEUE_FIELDS = (
    "JobID",
    "HetJobID",
    "HetJobOffset",
    "Name",
    "State",
    "Reason",
    "NodeList",
    "NumNodes",
    "Partition",
    "tres-per-node",
    "TimeLimit",
    # Not TimeLeft: that moves every second, so no running job's row would ever
    # repeat and the row cache (below) would miss on every running replica.
    "EndTime",
    "StartTime",
    "SubmitTime",
    "RestartCnt",
    "UserName",
    # A job array's id on each of its tasks (JobID is the task's own); a job
    # outside an array prints its JobID here.
    "ArrayJobID",
    "Comment",
)

SINFO_FIELDS = (
    "NodeList",
    "StateLong",
    "Partition",
    "CPUsState",
    "Memory",
    "Gres",
    "GresUsed",
    "NodeAddr",
    "Reason",
    # The node's features, for a model's constraint (plan.fits): "(null)" when none.
    "Features",
    # Memory allocated to jobs, in MB (plan.fits, for a model that sets its memory).
    "AllocMem",
)

SACCT_FIELDS = (
    "JobID",
    "JobIDRaw",
    "JobName",
    "User",
    "Account",
    "Partition",
    "State",
    "ExitCode",
    "Submit",
    "Start",
    "End",
    "ElapsedRaw",
    "NNodes",
    "AllocTRES",
    "Comment",
)


def format_arg(fields: Iterable[str]) -> str:
    """``--Format`` value: each field with no width (no truncation) and SEP after it."""
    return ",".join(f"{f}:{SEP}" for f in fields)


def _none(text: str) -> bool:
    return text in ("", "N/A", "(null)", "None", "none", "Unknown", "NONE", "n/a")


def parse_time(text: str) -> datetime | None:
    text = text.strip()
    if _none(text):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError as exc:
        raise SlurmParseError(f"unexpected timestamp {text!r}") from exc


def parse_duration(text: str) -> int | None:
    """Slurm's ``[D-]HH:MM:SS`` / ``MM:SS`` / ``D-HH`` / minutes forms to seconds.

    UNLIMITED, INFINITE, NOT_SET and N/A are None (no limit, or not known).
    """
    text = text.strip()
    if _none(text) or text.upper() in ("UNLIMITED", "INFINITE", "NOT_SET", "INVALID"):
        return None
    try:
        return slurm_time(text)
    except ValueError as exc:
        raise SlurmParseError(f"unexpected duration: {exc}") from None


def _nothing_readable(command: str, bad: list[str]) -> SlurmParseError:
    # Output with lines and not one of them in the asked-for shape is not an empty
    # listing: taken as one, the reconciler would think every replica gone and start
    # new ones. (A site wrapper printing a banner, a changed Slurm, a bad locale.)
    return SlurmParseError(
        f"none of its {len(bad)} line(s) is in the format asked for; "
        f"the first: {bad[0].rstrip(SEP)[:200]!r}",
        command=[command],
    )


def _split(line: str, n: int, command: str) -> list[str] | None:
    # Every field ends with SEP, so a clean line splits into n fields and one empty tail.
    parts = line.split(SEP)
    if parts and parts[-1] == "":
        parts.pop()
    if len(parts) > n:
        # Only the last field (comment) may hold a stray SEP: fold it back.
        parts = [*parts[: n - 1], SEP.join(parts[n - 1 :])]
    if len(parts) != n:
        log.warning(
            "%s: skipping a line with %d fields, expected %d: %r",
            command,
            len(parts),
            n,
            line[:200],
        )
        return None
    return parts


def _int(text: str, default: int = 0) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else default


class SqueueCache:
    """The single-component jobs one caller's last ``parse_squeue`` built, to reuse.

    Owned by the caller (one per name prefix; a call with another prefix starts
    it afresh) and refilled by every call, so it holds only the last listing's
    rows and never grows past the queue.
    """

    __slots__ = ("lines", "prefix")

    def __init__(self) -> None:
        self.prefix: str | None = None
        self.lines: dict[str, Job] = {}


def parse_squeue(stdout: str, name_prefix: str = "", cache: SqueueCache | None = None) -> list[Job]:
    """Fold squeue rows (one per heterogeneous component) into jobs.

    With ``name_prefix``, other jobs are dropped before they are parsed: a user
    who is also the service account may have thousands of unrelated jobs.

    With ``cache``, a single-component row identical to one of the last call
    returns the very job parsed then: nothing is split or parsed. Rows carry a
    job's end time, not its time left, so a running job's row repeats until
    something about it changes. Jobs are frozen, so reusing one is safe, and a
    caller may take "the same object as last time" to mean "the same row".

    Raises SlurmParseError when no line of a non-empty answer is in the asked-for
    shape, or (with ``name_prefix``) when a job of the prefix cannot be read: the
    caller must not take a job it could not read for a job that has gone. Other
    unreadable lines (another job's multi-line comment, say) are logged and skipped.
    """
    rows: dict[str, list[list[str]]] = {}
    order: list[str | Job] = []
    readable = 0
    unreadable: list[str] = []
    if cache is not None and cache.prefix != name_prefix:
        cache.prefix, cache.lines = name_prefix, {}
    old_lines = cache.lines if cache is not None else {}
    new_lines: dict[str, Job] = {}
    for line in stdout.splitlines():
        hit = old_lines.get(line)
        if hit is not None:
            # Seen last time: it passed the prefix check then (same prefix) and parsed.
            new_lines[line] = hit
            order.append(hit)
            readable += 1
            continue
        if not line.strip():
            continue
        # The name is the 4th field: a cheap check before the whole line is parsed.
        ours = False
        if name_prefix:
            head = line.split(SEP, 4)
            if len(head) > 3 and not head[3].startswith(name_prefix):
                readable += 1
                continue
            ours = len(head) > 3
        f = _split(line, len(SQUEUE_FIELDS), "squeue")
        if f is None:
            if ours:
                raise SlurmParseError(
                    f"cannot read the row of a job named {head[3][:100]!r}", command=["squeue"]
                )
            unreadable.append(line)
            continue
        readable += 1
        het = f[1].strip()
        single = _none(het) or het == "0"
        if cache is not None and single:
            try:
                job = _job_from_rows(f[0].strip(), [f])
            except SlurmParseError as exc:
                _unreadable_job(f[0].strip(), exc, name_prefix)
                continue
            new_lines[line] = job
            order.append(job)
            continue
        key = f[0].strip() if single else het
        if key not in rows:
            rows[key] = []
            order.append(key)
        rows[key].append(f)
    if unreadable and not readable:
        raise _nothing_readable("squeue", unreadable)
    jobs = _jobs_in_order(order, rows, name_prefix)
    if cache is not None:
        cache.lines = new_lines
    return jobs


def _jobs_in_order(
    order: list[str | Job], rows: dict[str, list[list[str]]], name_prefix: str
) -> list[Job]:
    """Jobs in squeue's order: cached ones as they are, the others built from their rows."""
    jobs: list[Job] = []
    for item in order:
        if isinstance(item, Job):
            jobs.append(item)
            continue
        try:
            jobs.append(_job_from_rows(item, rows[item]))
        except SlurmParseError as exc:
            _unreadable_job(item, exc, name_prefix)
    return jobs


def _unreadable_job(job_id: str, exc: SlurmParseError, name_prefix: str) -> None:
    if name_prefix:
        # One of the service's own jobs: skipping it would look like its end.
        raise SlurmParseError(
            f"cannot read job {job_id}: {exc.message}; not guessing its state",
            command=["squeue"],
        ) from exc
    log.warning("squeue: skipping job %s: %s", job_id, exc)


def _job_from_rows(key: str, rows: list[list[str]]) -> Job:
    comps = []
    for f in rows:
        offset = _int(f[2], 0)
        comps.append(
            JobComponent(
                offset=offset,
                job_id=f[0].strip(),
                state=JobState.parse(f[4]),
                nodes=expand(f[6]),
                node_count=_int(f[7], 0),
                tres_per_node=tres_per_node(f[9]),
            )
        )
    comps.sort(key=lambda c: c.offset)
    head = next(f for f in rows if _int(f[2], 0) == comps[0].offset)
    nodes: list[str] = []
    for c in comps:
        nodes.extend(n for n in c.nodes if n not in nodes)
    pending = comps[0].state is JobState.PENDING
    # A het job's state is its head's; Slurm moves components together.
    return Job(
        job_id=key,
        name=head[3],
        state=comps[0].state,
        reason="" if _none(head[5].strip()) else head[5].strip(),
        partition=head[8].strip(),
        user=head[15].strip(),
        comment="" if head[17] == "(null)" else head[17],
        nodes=tuple(nodes),
        submit_time=parse_time(head[13]),
        start_time=parse_time(head[12]) if not pending else None,
        time_limit_s=parse_duration(head[10]),
        # A pending job's end time is the scheduler's guess; only a started job's counts.
        end_time=parse_time(head[11]) if not pending else None,
        restarts=_int(head[14], 0),
        components=tuple(comps),
        array_job_id=_array_job_id(head[16], head[0]),
    )


def _array_job_id(array: str, job_id: str) -> str:
    """The array's id for a task of a job array; "" for a job outside one."""
    array = array.strip()
    return "" if _none(array) or array == job_id.strip() or not array.isdigit() else array


def tres_per_node(text: str) -> str:
    """squeue's tres-per-node in TRES form: 22.05 prints ``gres:gpu:a100:2``, 25.11
    (and pyslurm) ``gres/gpu:a100:2``; both read as the latter."""
    text = text.strip()
    if _none(text):
        return ""
    return ",".join(
        "gres/" + item[len("gres:") :] if item.startswith("gres:") else item
        for item in text.split(",")
    )


_GRES_ITEM = re.compile(r"^gpu(?::([^:(]+))?:(\d+)(?:\(.*\))?$")


def parse_gres(text: str) -> dict[str, int]:
    """``gpu:a100:4(S:0-1),gpu:v100:2`` -> ``{"a100": 4, "v100": 2}``; non-GPU gres ignored."""
    out: dict[str, int] = {}
    text = text.strip()
    if _none(text):
        return out
    # Split on commas outside parentheses: "(IDX:0,2)" holds commas.
    depth = 0
    cur = ""
    items: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    for item in items:
        item = item.strip()
        if not item.startswith("gpu"):
            continue
        m = _GRES_ITEM.match(item)
        if not m:
            raise SlurmParseError(f"unexpected gres {item!r}")
        typ = m.group(1) or ""
        if typ.isdigit() and m.group(2) is None:  # pragma: no cover - regex needs count
            typ = ""
        out[typ] = out.get(typ, 0) + int(m.group(2))
    return out


def parse_sinfo(stdout: str) -> list[NodeInfo]:
    """sinfo -N prints a row per node and partition; fold partitions into one node."""
    nodes: dict[str, NodeInfo] = {}
    unreadable: list[str] = []
    readable = 0
    for line in stdout.splitlines():
        if not line.strip():
            continue
        f = _split(line, len(SINFO_FIELDS), "sinfo")
        if f is None:
            unreadable.append(line)
            continue
        readable += 1
        name = f[0].strip()
        part = f[2].strip().rstrip("*")
        if name in nodes:
            old = nodes[name]
            if part and part not in old.partitions:
                nodes[name] = _replace_partitions(old, (*old.partitions, part))
            continue
        try:
            total = parse_gres(f[5])
            used = parse_gres(f[6])
            cpu = f[3].split("/")  # allocated/idle/other/total
            alloc, total_cpus = (int(cpu[0]), int(cpu[3])) if len(cpu) == 4 else (0, 0)
        except (SlurmParseError, ValueError) as exc:
            log.warning("sinfo: skipping node %s: %s", name, exc)
            continue
        gpus = tuple(
            GpuCount(type=t, total=n, used=used.get(t, 0)) for t, n in sorted(total.items())
        )
        nodes[name] = NodeInfo(
            name=name,
            state=f[1].strip(),
            partitions=(part,) if part else (),
            cpus_total=total_cpus,
            cpus_alloc=alloc,
            memory_mb=_int(f[4], 0),
            gpus=gpus,
            address=f[7].strip(),
            reason="" if _none(f[8].strip()) else f[8].strip(),
            features=parse_features(f[9]),
            memory_alloc_mb=None if _none(f[10].strip()) else _int(f[10], 0),
        )
    if unreadable and not readable:
        raise _nothing_readable("sinfo", unreadable)
    return list(nodes.values())


# pyslurm and slurmrestd give a node's complete state ("MIXED+DRAIN",
# ["IDLE", "NOT_RESPONDING"]); NodeInfo holds sinfo's long form ("draining",
# "idle*"), so every backend feeds the same `usable` test. Suffixes as sinfo prints them.
_NODE_SUFFIX = (
    ("NOT_RESPONDING", "*"),
    ("POWERED_DOWN", "~"),
    ("POWERING_UP", "#"),
    ("POWERING_DOWN", "%"),
    ("POWER_DOWN", "!"),
    ("REBOOT_ISSUED", "^"),
    ("REBOOT_REQUESTED", "@"),
)
_BUSY = frozenset({"allocated", "mixed", "completing"})


def node_state(text: str) -> str:
    parts = [p for p in text.strip().upper().split("+") if p]
    if not parts:
        return "unknown"
    base, flags = parts[0].lower(), set(parts[1:])
    busy = base in _BUSY or "COMPLETING" in flags
    if "DRAIN" in flags:
        word = "draining" if busy else "drained"
    elif "FAIL" in flags:
        word = "failing" if busy else "fail"
    elif "MAINT" in flags:
        word = "maint"
    elif "INVALID_REG" in flags:
        word = "inval"
    else:
        word = base
    suffix = next((s for flag, s in _NODE_SUFFIX if flag in flags), "")
    return word + suffix


def parse_features(text: str) -> tuple[str, ...]:
    """A node's features as sinfo lists them ("nvlink,ib"; "(null)" when it has none)."""
    text = text.strip()
    return () if _none(text) else tuple(f for f in text.split(",") if f)


def _replace_partitions(n: NodeInfo, parts: tuple[str, ...]) -> NodeInfo:
    return replace(n, partitions=parts)


_TRES_GPU = re.compile(r"(?:^|,)gres/gpu(?::[^=,]+)?=(\d+)")


def gpus_in_tres(tres: str) -> int:
    """GPUs in an AllocTRES string. Typed entries repeat the untyped total, so use that."""
    untyped = re.search(r"(?:^|,)gres/gpu=(\d+)", tres)
    if untyped:
        return int(untyped.group(1))
    return sum(int(m) for m in _TRES_GPU.findall(tres))


def parse_sacct(stdout: str) -> list[AccountingRecord]:
    out: list[AccountingRecord] = []
    unreadable: list[str] = []
    readable = 0
    for line in stdout.splitlines():
        if not line.strip():
            continue
        f = _split(line, len(SACCT_FIELDS), "sacct")
        if f is None:
            unreadable.append(line)
            continue
        readable += 1
        try:
            out.append(
                AccountingRecord(
                    job_id=f[0].strip(),
                    name=f[2],
                    user=f[3].strip(),
                    account=f[4].strip(),
                    partition=f[5].strip(),
                    state=JobState.parse(f[6]),
                    exit_code=f[7].strip(),
                    submit=parse_time(f[8]),
                    start=parse_time(f[9]),
                    end=parse_time(f[10]),
                    elapsed_s=_int(f[11], 0),
                    nodes=_int(f[12], 0),
                    alloc_tres=f[13].strip(),
                    gpus=gpus_in_tres(f[13]),
                    comment="" if f[14] == "(null)" else f[14],
                )
            )
        except SlurmParseError as exc:
            log.warning("sacct: skipping a record: %s", exc)
    if unreadable and not readable:
        raise _nothing_readable("sacct", unreadable)
    return out


_SBATCH_ID = re.compile(r"^(\d+)(?:;\S+)?$")


def parse_sbatch(stdout: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if lines:
        m = _SBATCH_ID.match(lines[-1])
        if m:
            return m.group(1)
    raise SlurmParseError(
        f"expected a job id, got {stdout.strip()[:200]!r}", command=["sbatch", "--parsable"]
    )
