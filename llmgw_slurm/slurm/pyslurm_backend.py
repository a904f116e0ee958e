"""The optional backend on pyslurm (Slurm's C API), for pyslurm 25.11 on Slurm 25.11.

Same interface as :class:`~llmgw_slurm.slurm.cli.CliBackend`; select it with
``slurm.backend: pyslurm``. What it costs and where it differs (also in
docs/slurm-backends.md):

- No fork per call: each call is one RPC to slurmctld (or slurmdbd), run in a
  worker thread because pyslurm's calls block.
- ``list_jobs`` loads EVERY job slurmctld holds (``pyslurm.Jobs.load`` has no
  user filter, unlike ``squeue -u``; libslurm's ``slurm_load_job_user`` is not
  offered to Python) and filters by user and name prefix here: 4 times a bare
  ``squeue -u`` at 2,000 jobs on the dev cluster, and it grows with the whole
  queue, not the service's part of it.
- pyslurm cannot submit a heterogeneous job: those go through ``sbatch``
  (a :class:`CliBackend`), logged each time; so do accounting queries for
  every run of requeued jobs (``sacct --duplicates``).
- The script's ``#SBATCH`` lines are read here (:func:`sbatch_options`), not by
  pyslurm's reader, which fails on ``-p`` in 25.11.2; the script goes to
  pyslurm as a private temporary file for the length of the submit call.

The translation from pyslurm objects to our types is kept in pure functions
that take any attribute-bearing object, so it is unit-tested without pyslurm;
the contract tests (tests/slurm/test_adapter.py) and the reconciler tests run
it against Slurm 25.11.7 with pyslurm 25.11.2. Attribute names that older
pyslurm releases spelled differently are still tried as fallbacks.
"""

from __future__ import annotations

import asyncio
import collections
import getpass
import logging
import os
import pwd
import signal as _signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

from llmgw_slurm.base.errors import SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm import directives, parse
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.directives import signal_number
from llmgw_slurm.slurm.hostlist import expand
from llmgw_slurm.slurm.parse import node_state
from llmgw_slurm.slurm.types import (
    AccountingRecord,
    GpuCount,
    Job,
    JobComponent,
    JobSpec,
    JobState,
    NodeInfo,
    already_gone,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

UNAVAILABLE = "pyslurm is not installed / built for a different Slurm; use slurm.backend: cli"


_MISSING = object()


def _attr(obj: object, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``obj`` has; ``default`` if it has none.

    pyslurm renamed attributes between releases (``alloc_cpus`` ->
    ``allocated_cpus``); trying each keeps one code path for the names we
    could not confirm on a real 25.11.
    """
    for name in names:
        val = getattr(obj, name, _MISSING)
        if val is not _MISSING:
            return val
    return default


def _items(collection: Any) -> list[Any]:
    """pyslurm collections are lists in some releases and maps (id -> object) in others."""
    values = getattr(collection, "values", None)
    if callable(values):
        return list(values())
    return list(collection)


def _text(val: Any) -> str:
    if val is None:
        return ""
    text = str(val)
    return "" if text in ("(null)", "None", "N/A") else text


def _int(val: Any, default: int = 0) -> int:
    if val is None or isinstance(val, bool):
        return default
    try:
        return int(val)
    except (TypeError, ValueError):
        return default


def _time(val: Any) -> datetime | None:
    """pyslurm gives Unix timestamps (0 or None when unset); squeue prints local time."""
    if val is None or isinstance(val, bool):
        return None
    if isinstance(val, datetime):
        return val
    try:
        ts = int(val)
    except (TypeError, ValueError) as exc:
        raise SlurmParseError(f"unexpected timestamp {val!r}", command=["pyslurm"]) from exc
    return datetime.fromtimestamp(ts) if ts > 0 else None


# ---------------------------------------------------------------- jobs (pyslurm.Job)


def _gres_text(gres: Any) -> str:
    """``{"gpu:a100": 2}`` -> ``"gres/gpu:a100:2"`` (the form squeue's tres-per-node prints)."""
    if isinstance(gres, str):
        return _text(gres)
    if not isinstance(gres, Mapping) or not gres:
        return ""
    parts = []
    for key, val in gres.items():
        count = val.get("count") if isinstance(val, Mapping) else val
        name = str(key) if str(key).startswith("gres/") else f"gres/{key}"
        parts.append(f"{name}:{count}")
    return ",".join(parts)


def _component(obj: Any) -> JobComponent:
    return JobComponent(
        offset=_int(_attr(obj, "heterogeneous_offset", "het_job_offset"), 0),
        job_id=str(obj.id),
        state=JobState.parse(_text(obj.state) or "UNKNOWN"),
        nodes=expand(_text(_attr(obj, "allocated_nodes", "nodes"))),
        node_count=_int(obj.num_nodes, 0),
        tres_per_node=_gres_text(_attr(obj, "gres_per_node", "tres_per_node")),
    )


def _job_from_components(key: str, objs: list[Any]) -> Job:
    pairs = sorted(((_component(o), o) for o in objs), key=lambda p: p[0].offset)
    comps = tuple(c for c, _ in pairs)
    head_comp, head = pairs[0]
    nodes: list[str] = []
    for c in comps:
        nodes.extend(n for n in c.nodes if n not in nodes)
    limit_min = head.time_limit
    limit_s = _int(limit_min) * 60 if limit_min is not None else None
    pending = head_comp.state is JobState.PENDING
    start = None if pending else _time(head.start_time)
    end = None if pending else _time(_attr(head, "end_time"))
    if not head_comp.state.is_finished and limit_s is None:
        # Slurm fills a running job without a limit with start + a year; squeue
        # prints NONE, and Job.end_time says None: no end is coming.
        end = None
    elif end is None and start is not None and limit_s is not None:
        end = start + timedelta(seconds=limit_s)
    return Job(
        job_id=key,
        name=_text(head.name),
        state=head_comp.state,
        reason=_text(_attr(head, "state_reason")),
        partition=_text(head.partition),
        user=_text(head.user_name),
        comment=_text(head.comment),
        nodes=tuple(nodes),
        submit_time=_time(head.submit_time),
        # Slurm fills an expected start time for pending jobs; squeue's parser drops it too.
        start_time=start,
        time_limit_s=limit_s,
        # As squeue's EndTime: a pending job's is the scheduler's guess, not used.
        end_time=end,
        restarts=_int(_attr(head, "requeue_count", "restart_cnt"), 0),
        components=comps,
        array_job_id=_array_job_id(head),
    )


def _array_job_id(obj: Any) -> str:
    """As squeue's ArrayJobID: the array's id on a task of a job array, "" otherwise."""
    array = _int(_attr(obj, "array_id", "array_job_id"), 0)
    return str(array) if array and array != _int(obj.id, 0) else ""


def jobs_from_pyslurm(
    objs: Iterable[Any], *, user: str = "", uid: int | None = None, name_prefix: str = ""
) -> list[Job]:
    """Fold pyslurm Job objects (one per heterogeneous component) into jobs.

    Filters first, on the cheap attributes: ``user_id`` (an int; ``user_name``
    costs a passwd lookup per job, and this sees every job on the cluster) and
    the name prefix. A component that cannot be read is skipped with a warning,
    as one bad squeue line is.
    """
    groups: dict[str, list[Any]] = {}
    for obj in objs:
        try:
            if uid is not None:
                if _attr(obj, "user_id") != uid:
                    continue
            elif user and _text(obj.user_name) != user:
                continue
            if name_prefix and not _text(obj.name).startswith(name_prefix):
                continue
            het = _int(_attr(obj, "heterogeneous_id", "het_job_id"), 0)
            key = str(het) if het else str(obj.id)
        except (AttributeError, SlurmError) as exc:
            log.warning("pyslurm: skipping a job: %s", exc)
            continue
        groups.setdefault(key, []).append(obj)
    jobs: list[Job] = []
    for key, members in groups.items():
        try:
            jobs.append(_job_from_components(key, members))
        except (AttributeError, SlurmError, TypeError, ValueError) as exc:
            log.warning("pyslurm: skipping job %s: %s", key, exc)
    return jobs


# ------------------------------------------------------------- nodes (pyslurm.Node)


def gpu_counts(gres: Any) -> dict[str, int]:
    """GPUs per type from pyslurm's gres dict; other gres ignored.

    ``configured_gres`` looks like ``{"gpu:a100": 4, "gpu": 2}``;
    ``allocated_gres`` (from the node's gres_used string) may hold
    ``{"gpu:a100": {"count": "2", "indexes": "0-1"}}`` with the count as a
    string, and an unused typeless GPU can show as type ``(null)``. A plain
    gres string (older releases) goes through the sinfo parser.
    """
    if isinstance(gres, str):
        return parse.parse_gres(gres)
    out: dict[str, int] = {}
    if not isinstance(gres, Mapping):
        return out
    for key, val in gres.items():
        name, _, typ = str(key).removeprefix("gres/").partition(":")
        if name != "gpu":
            continue
        if typ in ("(null)", "None", "null"):
            typ = ""
        count: Any = val.get("count") if isinstance(val, Mapping) else val
        try:
            n = int(count)
        except (TypeError, ValueError) as exc:
            raise SlurmParseError(f"unexpected gres count {key}={val!r}") from exc
        out[typ] = out.get(typ, 0) + n
    return out


def used_gpus(total: Mapping[str, int], used: Mapping[str, int]) -> dict[str, int]:
    """GPUs in use per configured type, from what pyslurm's ``allocated_gres`` says.

    pyslurm 25.11's Node has no ``gres_used`` (sinfo's GresUsed); its
    ``allocated_gres`` comes from the node's allocated TRES, which names a GPU
    type only where the site tracks it (``AccountingStorageTRES=gres/gpu:a100``);
    otherwise it is ``{"gpu": 2}``, and when typed counts are there, the untyped
    one is their sum. Untyped use goes to the node's one GPU type; a node with
    several types counts it against each (it could be any of them): fewer free
    GPUs than the truth, never more, so nothing is placed where it cannot run.
    """
    out = {t: n for t, n in used.items() if t in total}
    if "" in total:
        return out
    untyped = used.get("", 0) - sum(out.values())
    if untyped > 0:
        for t in total:
            out[t] = min(total[t], out.get(t, 0) + untyped)
    return out


def node_from_pyslurm(obj: Any) -> NodeInfo:
    total = gpu_counts(obj.configured_gres)
    used = used_gpus(total, gpu_counts(obj.allocated_gres))
    partitions = obj.partitions or []
    if isinstance(partitions, str):
        partitions = partitions.split(",")
    return NodeInfo(
        name=_text(obj.name),
        state=node_state(_text(obj.state)),
        partitions=tuple(p for p in partitions if p),
        cpus_total=_int(obj.total_cpus, 0),
        cpus_alloc=_int(_attr(obj, "allocated_cpus", "alloc_cpus"), 0),
        memory_mb=_int(obj.real_memory, 0),
        gpus=tuple(
            GpuCount(type=t, total=n, used=used.get(t, 0)) for t, n in sorted(total.items())
        ),
        address=_text(_attr(obj, "address")),
        reason=_text(_attr(obj, "reason")),
        features=_features(_attr(obj, "available_features", "features")),
        memory_alloc_mb=_opt_int(_attr(obj, "allocated_memory", "alloc_memory")),
    )


def _opt_int(val: Any) -> int | None:
    return None if val is None else _int(val, 0)


def _features(val: Any) -> tuple[str, ...] | None:
    """pyslurm's features (a list, or a comma string); None when it gives none at all."""
    if val is None:
        return None
    if isinstance(val, str):
        return tuple(f for f in val.split(",") if f and _text(f))
    return tuple(str(f) for f in val if f)


def nodes_from_pyslurm(objs: Iterable[Any]) -> list[NodeInfo]:
    out: list[NodeInfo] = []
    for obj in objs:
        try:
            out.append(node_from_pyslurm(obj))
        except (AttributeError, SlurmError, TypeError, ValueError) as exc:
            log.warning("pyslurm: skipping node %s: %s", _attr(obj, "name", default="?"), exc)
    return out


# ------------------------------------------------------- accounting (pyslurm.db.Job)


def _tres_text(tres: Any) -> str:
    """Allocated TRES as sacct's AllocTRES string (``billing=1,cpu=4,gres/gpu=2,mem=500M``).

    pyslurm 25.11's ``db.Job.allocated_tres`` is a TrackableResources whose
    ``to_dict()`` maps a kind to a resource (``cpu``) or to a dict of them
    (``gres``), each with ``type_and_name`` and ``count``; its ``raw_str`` is
    empty. Memory counts are in megabytes, which sacct prints with an M.
    """
    if isinstance(tres, str):
        return _text(tres)
    if isinstance(tres, Mapping):
        return ",".join(f"{k}={v}" for k, v in tres.items())
    to_dict = getattr(tres, "to_dict", None)
    if not callable(to_dict):
        return ""
    items: list[tuple[str, int]] = []
    for value in to_dict().values():
        for res in value.values() if isinstance(value, Mapping) else [value]:
            name = _text(_attr(res, "type_and_name"))
            count = _attr(res, "count")
            if name and isinstance(count, int):
                items.append((name, count))
    return ",".join(f"{n}={c}M" if n == "mem" else f"{n}={c}" for n, c in sorted(items))


def accounting_from_pyslurm(obj: Any) -> AccountingRecord:
    # Older pyslurm releases named the allocated TRES differently (or left it out);
    # without it, gpus (and GPU-hours) read 0.
    tres = _tres_text(_attr(obj, "allocated_tres", "tres_alloc_str", "tres_allocated"))
    return AccountingRecord(
        job_id=str(obj.id),
        name=_text(obj.name),
        user=_text(obj.user_name),
        account=_text(_attr(obj, "account")),
        partition=_text(obj.partition),
        state=JobState.parse(_text(obj.state) or "UNKNOWN"),
        exit_code=f"{_int(_attr(obj, 'exit_code'))}:{_int(_attr(obj, 'exit_code_signal'))}",
        # db.Job.comment reads the record's derived_es, where slurmdbd keeps the comment.
        comment=_text(_attr(obj, "comment")),
        submit=_time(obj.submit_time),
        start=_time(obj.start_time),
        end=_time(obj.end_time),
        elapsed_s=_int(_attr(obj, "elapsed_time"), 0),
        nodes=_int(_attr(obj, "num_nodes"), 0),
        alloc_tres=tres,
        gpus=parse.gpus_in_tres(tres),
    )


def accounting_from_pyslurm_all(
    objs: Iterable[Any], *, name_prefix: str = ""
) -> list[AccountingRecord]:
    out: list[AccountingRecord] = []
    for obj in objs:
        try:
            if name_prefix and not _text(obj.name).startswith(name_prefix):
                continue
            out.append(accounting_from_pyslurm(obj))
        except (AttributeError, SlurmError, TypeError, ValueError) as exc:
            log.warning("pyslurm: skipping a db record: %s", exc)
    return out


# --------------------------------------------------------------- submit and signal


# sbatch's options -> JobSubmitDescription attributes, for the options a batch
# script's #SBATCH lines may use here. pyslurm's own reader
# (load_sbatch_options) is not used: in 25.11.2 it sets ``partition``, which
# JobSubmitDescription does not have (AttributeError on every -p line), drops
# options it does not know without a word, and cuts values at any "#". Ours
# refuses what it cannot map, naming the option: a replica submitted without
# its --gres would run on no GPU. Value None: the option takes an argument.
_FLAGS: dict[str, tuple[str, object]] = {
    "hold": ("priority", 0),
    "requeue": ("is_requeueable", True),
    "no-requeue": ("is_requeueable", False),
    "exclusive": ("resource_sharing", "no"),
    "oversubscribe": ("resource_sharing", "yes"),
    "contiguous": ("requires_contiguous_nodes", True),
}
_VALUED: dict[str, str] = {
    "account": "account",
    "array": "array",
    "begin": "begin_time",
    "chdir": "working_directory",
    "comment": "comment",
    "constraint": "constraints",
    "cpus-per-gpu": "cpus_per_gpu",
    "cpus-per-task": "cpus_per_task",
    "deadline": "deadline",
    "dependency": "dependencies",
    "error": "standard_error",
    "exclude": "excluded_nodes",
    "gpus": "gpus",
    "gpus-per-task": "gpus_per_task",
    "gres": "gres_per_node",
    "input": "standard_in",
    "job-name": "name",
    "licenses": "licenses",
    "mail-type": "mail_types",
    "mail-user": "mail_user",
    "mem": "memory_per_node",
    "mem-per-cpu": "memory_per_cpu",
    "mem-per-gpu": "memory_per_gpu",
    "nice": "nice",
    "nodelist": "required_nodes",
    "nodes": "nodes",
    "ntasks": "ntasks",
    "ntasks-per-node": "ntasks_per_node",
    "open-mode": "log_files_open_mode",
    "output": "standard_output",
    "partition": "partitions",
    "qos": "qos",
    "reservation": "reservations",
    "signal": "signal",
    "time": "time_limit",
    "time-min": "time_limit_min",
    "tmp": "temporary_disk_per_node",
    "wckey": "wckey",
}
# pyslurm stores these through u16/u32 converters that take numbers, not text.
_NUMERIC = frozenset({"cpus_per_task", "cpus_per_gpu", "ntasks", "ntasks_per_node", "nice"})
# Times in minutes: pyslurm passes a value of digits on as it is, and then wants an int.
_MINUTES = frozenset({"time_limit", "time_limit_min"})


def _sbatch_error(message: str) -> SlurmError:
    return SlurmError(
        f"{message}; the pyslurm backend reads these #SBATCH options: "
        f"{', '.join(sorted([*_FLAGS, *_VALUED]))} (or use slurm.backend: cli)",
        command=["pyslurm.JobSubmitDescription"],
    )


def sbatch_options(script: str) -> dict[str, Any]:
    """``#SBATCH`` lines -> JobSubmitDescription keyword arguments (the last wins, as in sbatch)."""
    out: dict[str, Any] = {}
    read = directives.components(script, frozenset(_VALUED), _sbatch_error)
    if len(read) > 1:
        raise _sbatch_error("a heterogeneous job goes through sbatch, not here")
    for opt in read[0]:
        if opt.value is None:
            attr, flag = _FLAGS[opt.name]
            out[attr] = flag
            continue
        attr, given = _VALUED[opt.name], opt.value
        if attr in _NUMERIC:
            if not given.isdigit():
                raise _sbatch_error(f"#SBATCH {opt.written} wants a number, got {given!r}")
            out[attr] = int(given)
        elif attr in _MINUTES and given.isdigit():
            out[attr] = int(given)
        elif attr == "signal":
            out[attr] = _warn_signal(given)
        else:
            out[attr] = given
    return out


def _warn_signal(value: str) -> dict[str, Any]:
    """sbatch's ``--signal=[{R|B}:]SIG[@SECONDS]`` as pyslurm's signal dict.

    pyslurm's own reading of the string looks the name up without its SIG
    prefix ("Invalid Signal: USR1"), so the number is passed instead.
    """
    flags, colon, rest = value.rpartition(":") if ":" in value else ("", "", value)
    sig, at, secs = rest.partition("@")
    if (colon and not set(flags.upper()) <= {"R", "B"}) or (at and not secs.isdigit()):
        raise _sbatch_error(f"#SBATCH --signal={value} is not [{{R|B}}:]SIG[@SECONDS]")
    try:
        number = signal_number(sig)
    except SlurmError as exc:
        raise _sbatch_error(f"#SBATCH --signal={value}: {exc.message}") from exc
    out: dict[str, Any] = {"signal": number, "time": int(secs) if at else 60}
    if "B" in flags.upper():
        out["batch_only"] = True
    if "R" in flags.upper():
        out["allow_reservation_overlap"] = True
    return out


def submit_kwargs(spec: JobSpec, script_path: str, base_env: Mapping[str, str]) -> dict[str, Any]:
    """Keyword arguments for ``pyslurm.JobSubmitDescription``.

    The script's ``#SBATCH`` options (read by :func:`sbatch_options`), then the
    spec's name, comment and work dir over them, as sbatch's own options beat
    the script's in the CLI backend. ``environment`` is the whole submitting
    environment plus the spec's, which is what sbatch exports by default (an
    ``#SBATCH --export`` line is refused). ``script`` is a path: pyslurm reads
    the script from it.
    """
    kwargs: dict[str, Any] = {
        **sbatch_options(spec.script),
        "name": spec.name,
        "script": script_path,
        "environment": {
            **{k: v for k, v in base_env.items() if k not in spec.unset_env},
            **spec.env,
        },
    }
    if spec.comment:
        kwargs["comment"] = spec.comment
    if spec.workdir:
        kwargs["working_directory"] = spec.workdir
    return kwargs


def _job_number(job_id: str, what: str) -> int:
    if not job_id.strip().isdigit():
        raise SlurmError(f"not a plain job id: {job_id!r}", command=[what])
    return int(job_id)


# ------------------------------------------------------------------------- backend


class PyslurmBackend:
    """Talks to Slurm through pyslurm; heterogeneous submissions go through sbatch."""

    def __init__(
        self,
        *,
        user: str | None = None,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        cli: CliBackend | None = None,
        module: Any = None,
    ) -> None:
        """``module`` stands in for the pyslurm module in tests; ``cli`` takes het jobs."""
        if module is None:
            try:
                import pyslurm  # optional, and linked to one Slurm release: only on demand
            except (ImportError, OSError) as exc:
                # A pyslurm built for another Slurm fails here with an undefined
                # symbol or a missing libslurmfull.so: same advice either way.
                raise SlurmUnavailable(f"{UNAVAILABLE} ({exc})", command=["pyslurm"]) from exc
            module = pyslurm
            version = str(getattr(module, "__version__", ""))
            if not version.startswith("25.11"):
                log.warning("pyslurm %s found; this backend targets 25.11", version or "?")
        self._m = module
        self.user = user or getpass.getuser()
        try:
            self._uid: int | None = pwd.getpwnam(self.user).pw_uid
        except KeyError:
            self._uid = None  # not in passwd here: match on user_name instead
        self.timeout = timeout
        self._env = dict(env) if env is not None else None
        self._cli = cli or CliBackend(user=self.user, timeout=timeout, env=env)
        self.call_counts: collections.Counter[str] = collections.Counter()
        # libslurm's client side is not documented as thread-safe (it keeps
        # global config and cluster state); one call at a time costs little at
        # the reconciler's few calls per pass.
        self._lock = threading.Lock()
        errors = tuple(
            e
            for e in (getattr(module, "PyslurmError", None), getattr(module, "RPCError", None))
            if isinstance(e, type) and issubclass(e, BaseException)
        )
        self._errors: tuple[type[BaseException], ...] = (*errors, ValueError)

    @property
    def calls(self) -> int:
        return sum(self.call_counts.values()) + self._cli.calls

    async def check(self) -> None:
        """Nothing to check: the import in the constructor proved pyslurm fits this Slurm."""

    async def close(self) -> None:
        """Nothing held open between calls."""

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        self.call_counts[what] += 1

        def locked() -> T:
            with self._lock:
                return fn()

        try:
            # The C call cannot be interrupted: on a timeout we stop waiting, the
            # thread finishes on its own (Slurm's MessageTimeout bounds it).
            return await asyncio.wait_for(asyncio.to_thread(locked), self.timeout)
        except TimeoutError as exc:
            raise SlurmUnavailable(
                f"no answer within {self.timeout:g}s (is slurmctld up?)", command=[what]
            ) from exc
        except self._errors as exc:
            raise SlurmError(str(exc) or type(exc).__name__, command=[what]) from exc

    async def submit(self, spec: JobSpec) -> str:
        if spec.heterogeneous:
            log.info("pyslurm cannot submit heterogeneous jobs; %s goes through sbatch", spec.name)
            return await self._cli.submit(spec)
        base_env = self._env if self._env is not None else dict(os.environ)
        m = self._m

        def run() -> str:
            # 0600 file, gone when the call returns; the script holds no secrets
            # (those travel in the environment), but it is nobody else's business.
            fd, path = tempfile.mkstemp(prefix="llmgw-", suffix=".sbatch")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(spec.script)
                desc = m.JobSubmitDescription(**submit_kwargs(spec, path, base_env))
                return str(desc.submit())
            finally:
                os.unlink(path)

        job_id = await self._call("pyslurm.JobSubmitDescription.submit", run)
        if not job_id.isdigit():
            raise SlurmParseError(f"expected a job id, got {job_id!r}", command=["pyslurm"])
        return job_id

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        m = self._m
        objs = await self._call("pyslurm.Jobs.load", lambda: _items(m.Jobs.load()))
        return jobs_from_pyslurm(objs, user=self.user, uid=self._uid, name_prefix=name_prefix)

    async def list_nodes(self) -> list[NodeInfo]:
        m = self._m
        objs = await self._call("pyslurm.Nodes.load", lambda: _items(m.Nodes.load()))
        return nodes_from_pyslurm(objs)

    async def cancel(
        self, job_id: str, *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        m = self._m
        jid = _job_number(job_id, "pyslurm.Job.send_signal")
        # scancel without --signal sends SIGKILL; with one, it signals every step
        # except the batch shell unless --batch: pyslurm's "children" and "batch".
        sig = signal_number(signal) if signal else int(_signal.SIGKILL)
        steps = "batch" if batch_only else ("children" if signal else "all")
        try:
            await self._call(
                "pyslurm.Job.send_signal", lambda: m.Job(jid).send_signal(sig, steps=steps)
            )
        except SlurmUnavailable:
            raise
        except SlurmError as exc:
            if already_gone(job_id, exc.message):
                return
            raise

    async def requeue(self, job_id: str) -> None:
        m = self._m
        jid = _job_number(job_id, "pyslurm.Job.requeue")
        await self._call("pyslurm.Job.requeue", lambda: m.Job(jid).requeue())

    async def will_start(self, spec: JobSpec) -> datetime:
        """pyslurm offers no will-run query: ``sbatch --test-only``, as the CLI backend."""
        return await self._cli.will_start(spec)

    async def accounting(
        self,
        start: datetime,
        end: datetime | None = None,
        name_prefix: str = "",
        all_users: bool = False,
        duplicates: bool = False,
    ) -> list[AccountingRecord]:
        if duplicates:
            # pyslurm's db.Jobs is keyed by job id: one run of each job, the latest.
            # Every run (an audit's preemptions) is sacct's --duplicates.
            return await self._cli.accounting(
                start, end, name_prefix=name_prefix, all_users=all_users, duplicates=True
            )
        m = self._m
        filt: dict[str, Any] = {"start_time": start, "end_time": end or datetime.now()}
        if not all_users:
            filt["users"] = [self.user]

        def run() -> list[Any]:
            # Job names filter by exact match only in slurmdbd: prefix is ours.
            return _items(m.db.Jobs.load(m.db.JobFilter(**filt)))

        objs = await self._call("pyslurm.db.Jobs.load", run)
        return accounting_from_pyslurm_all(objs, name_prefix=name_prefix)
