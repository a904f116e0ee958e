"""A :class:`JobSpec` as slurmrestd's submission (``POST /slurm/VERSION/job/submit``).

slurmrestd does not read a script's ``#SBATCH`` lines: the job description
must say everything sbatch would have read from them. So the lines are read
here (:mod:`llmgw_slurm.slurm.directives`, as sbatch reads them) and each
option becomes the field sbatch itself would have set; an option with no
field here is refused, naming it, not dropped. A heterogeneous script
(``#SBATCH hetjob``) becomes one description per component (``jobs``), with
the script on the first, as sbatch sends it.

What sbatch adds on its own is added too: the environment (the daemon's,
less ``unset_env``, plus the spec's: sbatch's default ``--export=ALL``), a
working directory (sbatch's is the folder it runs in), and the spec's name,
comment and work dir over the script's on every component, as sbatch's own
command-line options apply to each component of a heterogeneous job.

Pure functions: tested without a server (tests/unit/test_rest_backend.py)
and against slurmrestd 25.11 by the adapter's contract tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from llmgw_slurm.base.durations import slurm_time
from llmgw_slurm.base.errors import SlurmError
from llmgw_slurm.slurm import directives
from llmgw_slurm.slurm.types import JobSpec

Fields = dict[str, Any]

_COMMAND = ["slurmrestd job/submit"]


def _error(message: str) -> SlurmError:
    return SlurmError(
        f"{message}; the rest backend reads these #SBATCH options: "
        f"{', '.join(sorted([*_FLAGS, *_VALUED]))} (or use slurm.backend: cli)",
        command=_COMMAND,
    )


# ---------------------------------------------------------------- value readers


def _text(field: str) -> Callable[[str], Fields]:
    return lambda v: {field: v}


def _number(field: str) -> Callable[[str], Fields]:
    def read(v: str) -> Fields:
        if not v.isascii() or not v.isdigit():
            raise ValueError(f"wants a number, got {v!r}")
        return {field: int(v)}

    return read


def _set(number: int) -> Fields:
    """Slurm's "number with flags" (``*_no_val_struct`` in the OpenAPI schema)."""
    return {"set": True, "infinite": False, "number": number}


def _minutes(field: str) -> Callable[[str], Fields]:
    """sbatch's time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``), in whole
    minutes rounded up as sbatch rounds; UNLIMITED or INFINITE for none."""

    def read(v: str) -> Fields:
        if v.strip().upper() in ("UNLIMITED", "INFINITE", "-1"):
            return {field: {"set": True, "infinite": True, "number": 0}}
        return {field: _set(-(-slurm_time(v) // 60))}

    return read


_MEM = re.compile(r"(\d+)([KMGT]?)B?", re.IGNORECASE | re.ASCII)
_MEM_FACTOR = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024}


def megabytes(value: str) -> int:
    """sbatch's memory size (``500``, ``500M``, ``64G``, ``1T``, ``512K``) in megabytes,
    rounded up as sbatch's str_to_mbytes rounds kilobytes."""
    m = _MEM.fullmatch(value.strip())
    if not m:
        raise ValueError(f"{value!r} is not a size like 500M, 64G or 1T")
    return -(-int(int(m.group(1)) * _MEM_FACTOR[m.group(2).upper()] * 1024) // 1024)


def _memory(field: str) -> Callable[[str], Fields]:
    return lambda v: {field: _set(megabytes(v))}


def _gpu_tres(field: str, *, mb: bool = False) -> Callable[[str], Fields]:
    """``--gpus=a100:2`` -> ``gres/gpu:a100:2``, as sbatch writes the TRES string."""

    def read(v: str) -> Fields:
        if mb:
            kind, _, size = v.rpartition(":")
            v = f"{kind}:{megabytes(size)}" if kind else str(megabytes(size))
        return {field: f"gres/gpu:{v}"}

    return read


def _gres(v: str) -> Fields:
    """``--gres=gpu:a100:2,nic:1`` -> ``gres/gpu:a100:2,gres/nic:1``; ``none`` asks for none."""
    items = [g.strip() for g in v.split(",") if g.strip() and g.strip().lower() != "none"]
    if not items:
        return {}
    return {"tres_per_node": ",".join(g if g.startswith("gres/") else f"gres/{g}" for g in items)}


def _signal(v: str) -> Fields:
    """sbatch's ``--signal=[{R|B}:]SIG[@SECONDS]`` (60 seconds when not given)."""
    flags, colon, rest = v.rpartition(":") if ":" in v else ("", "", v)
    sig, at, secs = rest.partition("@")
    if (colon and not set(flags.upper()) <= {"R", "B"}) or (at and not secs.isdigit()):
        raise ValueError("is not [{R|B}:]SIG[@SECONDS]")
    try:
        number = directives.signal_number(sig)
    except SlurmError as exc:
        raise ValueError(exc.message) from exc
    out: Fields = {
        "kill_warning_signal": str(number),
        "kill_warning_delay": _set(int(secs) if at else 60),
    }
    kinds = [k for f, k in (("B", "BATCH_JOB"), ("R", "RESERVATION_JOB")) if f in flags.upper()]
    if kinds:
        out["kill_warning_flags"] = kinds
    return out


def _words(field: str, *, upper: bool = True) -> Callable[[str], Fields]:
    return lambda v: {field: [w.upper() if upper else w for w in v.split(",") if w]}


# sbatch's options -> the job description's fields. Flags take no value.
_FLAGS: dict[str, Fields] = {
    "hold": {"hold": True},
    "requeue": {"requeue": True},
    "no-requeue": {"requeue": False},
    "exclusive": {"shared": ["none"]},
    "oversubscribe": {"shared": ["oversubscribe"]},
    "contiguous": {"contiguous": True},
}
_VALUED: dict[str, Callable[[str], Fields]] = {
    "account": _text("account"),
    "array": _text("array"),
    # Slurm's time words (now+1hour, 16:00, a date) are read by slurmrestd as sbatch reads them.
    "begin": _text("begin_time"),
    "chdir": _text("current_working_directory"),
    "comment": _text("comment"),
    "constraint": _text("constraints"),
    "cpus-per-gpu": _gpu_tres("cpus_per_tres"),
    "cpus-per-task": _number("cpus_per_task"),
    "deadline": _text("deadline"),
    "dependency": _text("dependency"),
    "error": _text("standard_error"),
    "exclude": _text("excluded_nodes"),
    "gpus": _gpu_tres("tres_per_job"),
    "gpus-per-task": _gpu_tres("tres_per_task"),
    "gres": _gres,
    "input": _text("standard_input"),
    "job-name": _text("name"),
    "licenses": _text("licenses"),
    "mail-type": _words("mail_type"),
    "mail-user": _text("mail_user"),
    "mem": _memory("memory_per_node"),
    "mem-per-cpu": _memory("memory_per_cpu"),
    "mem-per-gpu": _gpu_tres("memory_per_tres", mb=True),
    "nice": _number("nice"),
    "nodelist": _text("required_nodes"),
    "nodes": _text("nodes"),
    "ntasks": _number("tasks"),
    "ntasks-per-node": _number("tasks_per_node"),
    "open-mode": _words("open_mode"),
    "output": _text("standard_output"),
    "partition": _text("partition"),
    "qos": _text("qos"),
    "reservation": _text("reservation"),
    "signal": _signal,
    "time": _minutes("time_limit"),
    "time-min": _minutes("time_minimum"),
    "tmp": lambda v: {"temporary_disk_per_node": megabytes(v)},
    "wckey": _text("wckey"),
}


# ------------------------------------------------------------------ descriptions


def script_fields(script: str) -> list[Fields]:
    """Each component's job description fields from the script's ``#SBATCH`` lines
    (the last of an option wins, as in sbatch)."""
    out: list[Fields] = []
    for options in directives.components(script, frozenset(_VALUED), _error):
        fields: Fields = {}
        for opt in options:
            if opt.value is None:
                fields.update(_FLAGS[opt.name])
                continue
            try:
                fields.update(_VALUED[opt.name](opt.value))
            except ValueError as exc:
                raise _error(f"#SBATCH {opt.written}: {exc}") from exc
        out.append(fields)
    return out


def submit_body(spec: JobSpec, base_env: Mapping[str, str], workdir: str) -> dict[str, Any]:
    """The body of ``POST /slurm/VERSION/job/submit`` for ``spec``.

    ``base_env`` is the environment the job inherits before the spec's (the
    daemon's own, as sbatch's ``--export=ALL`` gives it); ``workdir`` is where
    the job runs when neither the spec nor the script says (sbatch's folder).
    """
    env = {k: v for k, v in base_env.items() if k not in spec.unset_env}
    env.update(spec.env)
    environment = [f"{k}={v}" for k, v in env.items()]
    jobs: list[Fields] = []
    for fields in script_fields(spec.script):
        fields.setdefault("current_working_directory", workdir)
        fields["name"] = spec.name
        if spec.comment:
            fields["comment"] = spec.comment
        if spec.workdir:
            fields["current_working_directory"] = spec.workdir
        fields["environment"] = environment
        jobs.append(fields)
    # The script goes once, on the first component: slurmctld runs it there.
    jobs[0]["script"] = spec.script
    if len(jobs) == 1:
        return {"job": jobs[0]}
    return {"jobs": jobs}
