"""slurmrestd's answers (OpenAPI v0.0.42 to v0.0.44) as the adapter's types.

Pure functions over the decoded JSON; the same shapes in every version this
backend speaks (checked against 25.11's generated specification: the fields
read here did not change between v0.0.42 and v0.0.44). Where slurmrestd and
squeue say the same thing differently, the adapter's types decide, as they
did for pyslurm (docs/slurm-backends.md):

- numbers come as ``{"set", "infinite", "number"}``: unset or infinite is None;
- a job's state is a list (``["PENDING", "REQUEUED"]``): the flag that
  squeue's long form would print wins over the base state, in Slurm's own
  order (``job_state_string``);
- a node's state is a list too (``["IDLE", "DRAIN"]``), turned into sinfo's
  long form (``drained``) as the pyslurm backend does;
- accounting job ids are sacct's: ``123+1`` for a heterogeneous component,
  ``123_4`` for an array's task.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from llmgw_slurm.base.errors import SlurmParseError
from llmgw_slurm.slurm import parse
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

Obj = Mapping[str, Any]

# The flags squeue prints instead of the base state, in job_state_string's order.
_STATE_FLAGS = (
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "EXPEDITING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
)


def number(value: Any) -> int | None:
    """A plain number, or Slurm's number with flags; None when unset or infinite."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return int(value)
    if isinstance(value, Mapping):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        return number(value.get("number"))
    raise SlurmParseError(f"expected a number, got {value!r}", command=["slurmrestd"])


def timestamp(value: Any) -> datetime | None:
    """Unix time (0 or unset: none), as local time like squeue prints it."""
    ts = number(value)
    return datetime.fromtimestamp(ts) if ts else None


def job_state(states: Any) -> JobState:
    """``["RUNNING", "COMPLETING"]`` -> COMPLETING, as squeue's %T would say."""
    if isinstance(states, str):
        states = [states]
    if not isinstance(states, Sequence) or not states:
        return JobState.parse("UNKNOWN")
    words = {str(s).upper() for s in states}
    flag = next((f for f in _STATE_FLAGS if f in words), None)
    return JobState.parse(flag or str(states[0]))


def _text(value: Any) -> str:
    return "" if value is None else str(value)


# ------------------------------------------------------------------------- jobs


def _component(j: Obj) -> JobComponent:
    return JobComponent(
        offset=number(j.get("het_job_offset")) or 0,
        job_id=str(j["job_id"]),
        state=job_state(j.get("job_state")),
        nodes=expand(_text(j.get("nodes"))),
        node_count=number(j.get("node_count")) or 0,
        tres_per_node=parse.tres_per_node(_text(j.get("tres_per_node"))),
    )


def _end_time(head: Obj, state: JobState, start: datetime | None, limit_s: int | None) -> Any:
    if state is JobState.PENDING:
        return None  # the scheduler's guess, which squeue's parser drops too
    if not state.is_finished and limit_s is None:
        # Slurm fills start + a year; squeue prints NONE: no end is coming.
        return None
    end = timestamp(head.get("end_time"))
    if end is None and start is not None and limit_s is not None:
        end = start + timedelta(seconds=limit_s)
    return end


def _array_job_id(j: Obj) -> str:
    """As squeue's ArrayJobID: the array's id on a task, "" on the array's own id and
    outside an array."""
    array = number(j.get("array_job_id")) or 0
    return str(array) if array and str(array) != str(j["job_id"]) else ""


def job_from_components(key: str, members: Sequence[Obj]) -> Job:
    pairs = sorted(((_component(m), m) for m in members), key=lambda p: p[0].offset)
    comps = tuple(c for c, _ in pairs)
    head_comp, head = pairs[0]
    nodes: list[str] = []
    for c in comps:
        nodes.extend(n for n in c.nodes if n not in nodes)
    minutes = number(head.get("time_limit"))
    limit_s = minutes * 60 if minutes is not None else None
    pending = head_comp.state is JobState.PENDING
    start = None if pending else timestamp(head.get("start_time"))
    reason = _text(head.get("state_reason"))
    return Job(
        job_id=key,
        name=_text(head.get("name")),
        state=head_comp.state,
        reason="" if reason == "None" else reason,
        partition=_text(head.get("partition")),
        user=_text(head.get("user_name")),
        comment=_text(head.get("comment")),
        nodes=tuple(nodes),
        submit_time=timestamp(head.get("submit_time")),
        start_time=start,
        time_limit_s=limit_s,
        end_time=_end_time(head, head_comp.state, start, limit_s),
        restarts=number(head.get("restart_cnt")) or 0,
        components=comps,
        array_job_id=_array_job_id(head),
    )


def group_jobs(records: Iterable[Obj], user: str, name_prefix: str) -> dict[str, list[Obj]]:
    """This user's records whose name has the prefix, by job (heterogeneous components
    under their het job's id), in the order listed."""
    groups: dict[str, list[Obj]] = {}
    for j in records:
        if j.get("user_name") != user or not _text(j.get("name")).startswith(name_prefix):
            continue
        het = number(j.get("het_job_id")) or 0
        groups.setdefault(str(het) if het else str(j.get("job_id")), []).append(j)
    return groups


def fingerprint(members: Sequence[Obj]) -> tuple[Any, ...]:
    """What a job's Job is made of: equal prints, equal Jobs (the row cache's key)."""
    return tuple(tuple(m.get(k) for k in _JOB_KEYS) for m in members)


_JOB_KEYS = (
    "job_id", "het_job_offset", "job_state", "nodes", "node_count", "tres_per_node",
    "time_limit", "start_time", "end_time", "state_reason", "name", "partition",
    "user_name", "comment", "submit_time", "restart_cnt", "array_job_id",
)  # fmt: skip


# ------------------------------------------------------------------------ nodes


def node_from_rest(n: Obj) -> NodeInfo:
    total = parse.parse_gres(_text(n.get("gres")))
    used = parse.parse_gres(_text(n.get("gres_used")))
    states = n.get("state") or []
    features = n.get("features")
    return NodeInfo(
        name=_text(n["name"]),
        state=parse.node_state("+".join(str(s) for s in states)),
        partitions=tuple(str(p) for p in n.get("partitions") or () if p),
        cpus_total=number(n.get("cpus")) or 0,
        cpus_alloc=number(n.get("alloc_cpus")) or 0,
        memory_mb=number(n.get("real_memory")) or 0,
        gpus=tuple(
            GpuCount(type=t, total=k, used=used.get(t, 0)) for t, k in sorted(total.items())
        ),
        address=_text(n.get("address")),
        reason=_text(n.get("reason")),
        features=tuple(str(f) for f in features if f) if isinstance(features, list) else None,
        memory_alloc_mb=number(n.get("alloc_memory")),
    )


def nodes_from_rest(nodes: Iterable[Obj]) -> list[NodeInfo]:
    out: list[NodeInfo] = []
    for n in nodes:
        try:
            out.append(node_from_rest(n))
        except (KeyError, SlurmParseError, TypeError, ValueError) as exc:
            log.warning("slurmrestd: skipping node %s: %s", n.get("name", "?"), exc)
    return out


# ------------------------------------------------------------------- accounting


def _sacct_id(j: Obj) -> str:
    """sacct's JobID: ``123+1`` for a het component, ``123_4`` for an array task."""
    het = j.get("het") or {}
    het_id = number(het.get("job_id")) or 0
    if het_id:
        return f"{het_id}+{number(het.get('job_offset')) or 0}"
    array = j.get("array") or {}
    array_id = number(array.get("job_id")) or 0
    task = number(array.get("task_id"))
    if array_id and task is not None:
        return f"{array_id}_{task}"
    return str(j["job_id"])


def alloc_tres(items: Any) -> str:
    """slurmdbd's TRES list as sacct's AllocTRES (``billing=1,cpu=1,gres/gpu=2,mem=500M``)."""
    out: list[tuple[str, str]] = []
    for t in items or ():
        count = number(t.get("count"))
        if count is None or count < 0:  # energy is -2 (not gathered), as sacct leaves it out
            continue
        kind, name = _text(t.get("type")), _text(t.get("name"))
        label = f"{kind}/{name}" if name else kind
        out.append((label, f"{count}M" if label == "mem" else str(count)))
    return ",".join(f"{k}={v}" for k, v in sorted(out))


def _exit_code(value: Any) -> str:
    """sacct's ExitCode ``RETURN:SIGNAL``."""
    value = value or {}
    code = number(value.get("return_code")) or 0
    sig = number((value.get("signal") or {}).get("id")) or 0
    return f"{code}:{sig}"


def accounting_from_rest(j: Obj) -> AccountingRecord:
    times = j.get("time") or {}
    tres = alloc_tres((j.get("tres") or {}).get("allocated"))
    comment = j.get("comment")
    state = (j.get("state") or {}).get("current")
    return AccountingRecord(
        job_id=_sacct_id(j),
        name=_text(j.get("name")),
        user=_text(j.get("user")),
        account=_text(j.get("account")),
        partition=_text(j.get("partition")),
        state=job_state(state),
        exit_code=_exit_code(j.get("exit_code")),
        comment=_text(comment.get("job") if isinstance(comment, Mapping) else comment),
        submit=timestamp(times.get("submission")),
        start=timestamp(times.get("start")),
        end=timestamp(times.get("end")),
        elapsed_s=number(times.get("elapsed")) or 0,
        nodes=number(j.get("allocation_nodes")) or 0,
        alloc_tres=tres,
        gpus=parse.gpus_in_tres(tres),
    )


def accounting_records(jobs: Iterable[Obj], name_prefix: str) -> list[AccountingRecord]:
    out: list[AccountingRecord] = []
    for j in jobs:
        if not _text(j.get("name")).startswith(name_prefix):
            continue
        try:
            out.append(accounting_from_rest(j))
        except (KeyError, SlurmParseError, TypeError, ValueError, AttributeError) as exc:
            log.warning("slurmrestd: skipping accounting record %s: %s", j.get("job_id"), exc)
    return out
