"""Render the batch scripts of replicas, model jobs and engine installs.

Each ``render_*`` function is pure: typed parameters in, script text out, no
I/O beyond reading the template. Tests compare the text with recorded files.

Two kinds of values reach a script, and each has one rule:

- ``#SBATCH`` lines are read by sbatch, not by a shell, so shell quoting means
  nothing there: every value is checked against a strict pattern for its field
  (``--time`` looks like a Slurm time, a partition is a plain word, ...) and
  refused with :class:`TemplateError` otherwise. The ``sb`` filter repeats a
  generic check so that a site template cannot put an unchecked value there.
- Values in the script body pass through the ``q`` filter (``shlex.quote``).

Nothing from the catalog beyond these checked values is written into a
script: a replica's engine arguments travel in ``LLMGW_REPLICA_SPEC``, in the
job's environment.

A site overrides a template by putting a file of the same name in its own
directory (``template_dir``); the others still come from the defaults.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jinja2

from llmgw_slurm.base.durations import slurm_time
from llmgw_slurm.base.errors import TemplateError
from llmgw_slurm.catalog import Model, Resources

__all__ = [
    "DEFAULT_TEMPLATE_DIR",
    "EngineInstallParams",
    "HetComponent",
    "HetReplicaParams",
    "JobOptions",
    "ModelJobParams",
    "ReplicaParams",
    "default_template_dir",
    "render_batch",
    "render_engine_install",
    "render_model_job",
    "render_replica",
    "render_replica_hetjob",
    "replica_script",
    "time_limit_seconds",
]

REPLICA_TEMPLATE = "replica.sbatch.j2"
HETJOB_TEMPLATE = "replica-hetjob.sbatch.j2"
MODEL_JOB_TEMPLATE = "model-job.sbatch.j2"
ENGINE_INSTALL_TEMPLATE = "engine-install.sbatch.j2"
BATCH_TEMPLATE = "batch.sbatch.j2"


def default_template_dir() -> Path:
    """The templates shipped with the package.

    A source checkout (or an editable install) has them beside the package; a
    wheel install puts them under ``{prefix}/share/llmgw-slurm``.
    """
    here = Path(__file__).resolve().parent.parent / "sbatch_templates"
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "llmgw-slurm" / "sbatch_templates"


DEFAULT_TEMPLATE_DIR = default_template_dir()

# --- validation of #SBATCH values -------------------------------------------------

# A generic #SBATCH value: no whitespace (sbatch splits on it), no quotes or
# backslashes (sbatch's own unquoting differs between versions), no '#'
# (comment-like), nothing non-printable. What remains is enough for names,
# paths with Slurm's %j/%x patterns, lists, and constraint expressions with
# their ( ) grouping (a shell never reads an #SBATCH line).
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.,:=@%+/\-\[\]()|&!*]+$")
# Slurm names as the catalog accepts them (partition may be a comma list:
# Slurm takes the first that fits).
_WORD = re.compile(r"^[A-Za-z0-9_.+\-]{1,64}$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.+\-]{1,64}(,[A-Za-z0-9_.+\-]{1,64})*$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
# re.ASCII: \d would take any script's digits, which no #SBATCH line holds.
_TIME = re.compile(
    r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$",
    re.ASCII,
)
_MEM = re.compile(r"^\d+[KMGT]?$", re.ASCII)
# Slurm constraint syntax: features joined with & | , and [] () * ! digits.
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.\-&|,\[\]()*:!]{1,256}$")
_PATH = re.compile(r"^[A-Za-z0-9_.,%+/\-=@:]{1,1024}$")
# A pip requirement (name, extras, version spec) or an apptainer URI.
_REQUIREMENT = re.compile(r"^[A-Za-z0-9_.\-\[\],<>=!~]{1,200}$")
_IMAGE_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://[A-Za-z0-9_.\-/:@]{1,500}$")


def _check(value: str, pattern: re.Pattern[str], what: str, valid: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise TemplateError(f"{what}: {value!r} refused; valid: {valid}")
    return value


def _check_int(value: int, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TemplateError(f"{what}: {value!r} refused; valid: an integer >= {minimum}")
    return value


def _check_abs_path(value: str, what: str) -> str:
    _check(value, _PATH, what, "an absolute path of letters, digits and _ . , % + / - = @ :")
    if not value.startswith("/"):
        raise TemplateError(f"{what}: {value!r} refused; valid: an absolute path")
    return value


def _sbatch_filter(value: Any) -> str:
    """The ``sb`` filter: the last check before a value lands on an #SBATCH line."""
    text = str(value)
    if not _SBATCH_SAFE.fullmatch(text):
        raise TemplateError(
            f"value {text!r} cannot go on an #SBATCH line: no whitespace, quotes, "
            "backslashes, '#', '$' or control characters"
        )
    return text


def _quote_filter(value: Any) -> str:
    """The ``q`` filter: every value written into the script body."""
    if isinstance(value, (list, tuple)):
        return " ".join(shlex.quote(str(v)) for v in value)
    text = str(value)
    if "\0" in text:
        raise TemplateError(f"value {text!r} holds a NUL byte, which no shell argument can")
    return shlex.quote(text)


# --- parameters -------------------------------------------------------------------


class SlurmDefaults(Protocol):
    """The site's job defaults (server.yaml's ``slurm:`` block, ``config.SlurmConfig``).

    A protocol rather than the config class: config.py checks job paths with this
    module while loading, so this module must not import config.py back.
    """

    @property
    def partition(self) -> str | None: ...
    @property
    def account(self) -> str | None: ...
    @property
    def qos(self) -> str | None: ...
    @property
    def reservation(self) -> str | None: ...


def _check_resources(r: Resources, where: str) -> None:
    """What one node asks for, as #SBATCH lines take it. The catalog loader checked
    these already; parameters built in code (tests, tools) are checked here."""
    _check_int(r.gpus, f"{where}.gpus")
    if r.gpu_type:
        _check(r.gpu_type, _WORD, f"{where}.gpu_type", "letters, digits, _ . + -")
    _check_int(r.cpus, f"{where}.cpus", 1)
    if r.memory is not None:
        _check(r.memory, _MEM, f"{where}.memory", "a number with an optional K, M, G or T")
    if r.constraint is not None:
        _check(r.constraint, _CONSTRAINT, f"{where}.constraint", "Slurm feature syntax")


@dataclass(frozen=True)
class JobOptions:
    """Job-level options shared by every kind of job.

    ``time`` is Slurm's syntax (``minutes``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``).
    ``output``/``error`` may hold Slurm's patterns (``%j``, ``%x``); ``error``
    None writes both streams to ``output``. ``python`` is the interpreter that
    has llmgw_slurm installed on the compute nodes.
    """

    job_name: str
    time: str | None
    output: str
    python: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    error: str | None = None
    workdir: str | None = None
    reservation: str | None = None

    def validate(self) -> None:
        _check(self.job_name, _JOB_NAME, "job_name", "letters, digits, _ . - (at most 200)")
        if self.time is not None:
            _check(self.time, _TIME, "time", "minutes, HH:MM:SS, or D-HH:MM:SS")
        if self.partition is not None:
            _check(
                self.partition,
                _PARTITION,
                "partition",
                "Slurm names (letters, digits, _ . + -), comma-separated",
            )
        for name in ("account", "qos", "reservation"):
            value = getattr(self, name)
            if value is not None:
                _check(value, _WORD, name, "letters, digits, _ . + - (at most 64)")
        _check_abs_path(self.output, "output")
        if self.error is not None:
            _check_abs_path(self.error, "error")
        if self.workdir is not None:
            _check_abs_path(self.workdir, "workdir")
        if not self.python or "\0" in self.python or "\n" in self.python:
            raise TemplateError(f"python: {self.python!r} refused; valid: a path to an interpreter")


@dataclass(frozen=True)
class ReplicaParams:
    """A single-node replica.

    ``signal_before_s``: the agent gets SIGUSR1 this long before the time
    limit, time enough to drain. ``requeue``: the service partition may be
    preempted with REQUEUE, and a requeued replica should come back by itself.
    """

    job: JobOptions
    resources: Resources
    agent_config: str
    signal_before_s: int = 300
    requeue: bool = True

    def validate(self) -> None:
        self.job.validate()
        _check_resources(self.resources, "resources")
        _check_int(self.signal_before_s, "signal_before_s", 1)
        if self.signal_before_s > 65535:
            # Slurm stores the warning time in 16 bits.
            raise TemplateError(f"signal_before_s: {self.signal_before_s} refused; valid: 1..65535")
        _check_agent_config(self.agent_config)
        _check_signal_lead(self.signal_before_s, self.job.time)


@dataclass(frozen=True)
class HetComponent:
    """One component of a multi-node replica; component 0 is the head."""

    nodes: int = 1
    resources: Resources = field(default_factory=Resources)
    partition: str | None = None

    def validate(self, where: str) -> None:
        _check_int(self.nodes, f"{where}.nodes", 1)
        _check_resources(self.resources, f"{where}.resources")
        if self.partition is not None:
            _check(
                self.partition,
                _PARTITION,
                f"{where}.partition",
                "Slurm names (letters, digits, _ . + -), comma-separated",
            )


@dataclass(frozen=True)
class HetReplicaParams:
    """A multi-node replica as a heterogeneous job (at least two components)."""

    job: JobOptions
    components: Sequence[HetComponent]
    agent_config: str
    signal_before_s: int = 300
    requeue: bool = True

    def validate(self) -> None:
        self.job.validate()
        if len(self.components) < 2:
            raise TemplateError(
                f"components: {len(self.components)} given; a heterogeneous replica needs "
                "a head and at least one worker component (use render_replica for one node)"
            )
        for i, comp in enumerate(self.components):
            comp.validate(f"components[{i}]")
        if len({c.resources.cpus for c in self.components}) > 1:
            # Slurm 22.05's srun does not inherit --cpus-per-task from the job,
            # and one `srun --het-group=0-K` takes one value for every component.
            raise TemplateError(
                "components: cpus differs between components; a multi-node "
                "replica needs the same cpus on every component"
            )
        ReplicaParams(
            self.job,
            self.components[0].resources,
            self.agent_config,
            self.signal_before_s,
            self.requeue,
        ).validate()


@dataclass(frozen=True)
class ModelJobParams:
    """A job that fetches a model's weights into the cache ahead of use.

    The weights spec reaches the job as ``LLMGW_REPLICA_SPEC`` in its
    environment. Useful only with a cache every node sees (agent.yaml
    ``weights.cache_dir`` on a shared filesystem): the default cache is
    node-local.
    """

    job: JobOptions
    agent_config: str
    # None: Slurm's defaults (no GPU, one CPU); no #SBATCH resource lines.
    resources: Resources | None = None
    # Compute nodes often may not download (agent.yaml weights.allow_download
    # off); a model job sent where they may, says so for itself.
    allow_download: bool = False

    def validate(self) -> None:
        self.job.validate()
        if self.resources is not None:
            _check_resources(self.resources, "resources")
        _check_agent_config(self.agent_config)


@dataclass(frozen=True)
class EngineInstallParams:
    """A job that installs an engine version: a venv with pip, or an Apptainer pull.

    ``kind`` is ``"venv"`` (``target`` is the venv directory, ``packages`` the
    pip requirements, none for a bare venv, ``pip_args`` extra pip options such
    as an index, ``system_site_packages`` to see the interpreter's packages) or
    ``"apptainer"`` (``target`` is the .sif file, ``image_uri`` what to pull).
    The job runs ``llmgw-agent install`` (llmgw_slurm/agent/install.py), safe
    to run twice at once.
    """

    job: JobOptions
    kind: str
    target: str
    packages: Sequence[str] = ()
    pip_args: Sequence[str] = ()
    image_uri: str = ""
    apptainer: str = "apptainer"
    # None: Slurm's defaults (no GPU, one CPU); no #SBATCH resource lines.
    resources: Resources | None = None
    system_site_packages: bool = False
    # agent.yaml, for its tracing block: the install is a trace of its own.
    agent_config: str = ""

    def validate(self) -> None:
        self.job.validate()
        if self.resources is not None:
            _check_resources(self.resources, "resources")
        _check_abs_path(self.target, "target")
        if self.agent_config:
            _check_agent_config(self.agent_config)
        if self.kind == "venv":
            for i, req in enumerate(self.packages):
                _check(req, _REQUIREMENT, f"packages[{i}]", "a pip requirement like vllm==0.6.3")
            for i, arg in enumerate(self.pip_args):
                if not isinstance(arg, str) or "\n" in arg or "\0" in arg:
                    raise TemplateError(f"pip_args[{i}]: {arg!r} refused: one line per argument")
        elif self.kind == "apptainer":
            _check(self.image_uri, _IMAGE_URI, "image_uri", "a URI like docker://vllm/vllm:v0.6.3")
            if not self.apptainer or "\n" in self.apptainer:
                raise TemplateError(f"apptainer: {self.apptainer!r} refused")
        else:
            raise TemplateError(f"kind: {self.kind!r} refused; valid: venv, apptainer")


def check_job_path(path: str, what: str) -> None:
    """Raise TemplateError unless ``path`` can go into a job script as is."""
    _check_abs_path(path, what)


def time_limit_seconds(time: str) -> int:
    """Slurm's time syntax in seconds (``minutes``, ``M:S``, ``H:M:S``, ``D-H[:M[:S]]``)."""
    try:
        return slurm_time(time)
    except ValueError as err:
        raise TemplateError(f"time: {err}") from None


def _check_signal_lead(signal_before_s: int, time: str | None) -> None:
    if time is None:
        return  # the partition's DefaultTime, unknown here
    limit = time_limit_seconds(time)
    if limit and signal_before_s >= limit:
        # Slurm would send the warning at once, and the replica would drain
        # as soon as it started.
        raise TemplateError(
            f"signal_before_s: {signal_before_s}s is not less than the time limit "
            f"{time} ({limit}s); give the job more time or warn it later"
        )


def _check_agent_config(path: str) -> None:
    _check_abs_path(path, "agent_config")


# --- rendering --------------------------------------------------------------------


def _environment(template_dir: Path | str | None) -> jinja2.Environment:
    dirs = [str(DEFAULT_TEMPLATE_DIR)]
    if template_dir is not None:
        dirs.insert(0, str(template_dir))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(dirs),
        undefined=jinja2.StrictUndefined,
        # Shell scripts, not HTML: escaping would corrupt them; safety comes
        # from the q/sb filters and the checks above.
        autoescape=False,  # noqa: S701
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = _quote_filter
    env.filters["sb"] = _sbatch_filter
    return env


def _render(name: str, template_dir: Path | str | None, context: Mapping[str, Any]) -> str:
    env = _environment(template_dir)
    try:
        template = env.get_template(name)
        text = template.render(**context)
    except TemplateError:
        raise
    except jinja2.TemplateNotFound as err:
        where = template_dir or DEFAULT_TEMPLATE_DIR
        raise TemplateError(f"template {name} not found in {where}") from err
    except jinja2.TemplateError as err:
        where = (
            f"{err.filename or name}:{err.lineno}"
            if isinstance(err, jinja2.TemplateSyntaxError)
            else name
        )
        raise TemplateError(f"rendering {where}: {err}") from err
    if "\r" in text:
        raise TemplateError(f"rendering {name}: carriage return in the script")
    return text


def render_replica(params: ReplicaParams, template_dir: Path | str | None = None) -> str:
    """The batch script of a single-node replica."""
    params.validate()
    return _render(REPLICA_TEMPLATE, template_dir, {"p": params, "job": params.job})


def render_replica_hetjob(params: HetReplicaParams, template_dir: Path | str | None = None) -> str:
    """The batch script of a multi-node replica (a heterogeneous job)."""
    params.validate()
    return _render(
        HETJOB_TEMPLATE,
        template_dir,
        {
            "p": params,
            "job": params.job,
            "last_group": len(params.components) - 1,
            "cpus_per_task": params.components[0].resources.cpus,
        },
    )


# Slurm's default MaxArraySize is 1001 (task ids 0-1000); a site's may be lower.
MAX_BATCH_SHARDS = 1000


def render_batch(
    params: ReplicaParams, template_dir: Path | str | None = None, shards: int = 1
) -> str:
    """The batch script of a Batch API job: one node, the model's resources, the agent's
    ``batch`` command (its input, outputs and secrets reach it in the environment).

    ``shards`` > 1: a job array of that many tasks, one per shard of the batch.
    """
    params.validate()
    _check_int(shards, "shards", 1)
    if shards > MAX_BATCH_SHARDS:
        raise TemplateError(f"shards: {shards} refused; valid: 1..{MAX_BATCH_SHARDS}")
    text = _render(
        BATCH_TEMPLATE, template_dir, {"p": params, "job": params.job, "shards": shards}
    )
    if shards > 1 and f"#SBATCH --array=0-{shards - 1}\n" not in text:
        # A site's own batch template from before shards: its one job would run one
        # shard's lines and the batch would never finish.
        raise TemplateError(
            f"{BATCH_TEMPLATE} has no '#SBATCH --array=0-{{{{ shards - 1 }}}}' line, which a "
            "sharded batch needs (batch.shard_lines); add it as the shipped template has it, "
            "or set batch.shard_lines to 0"
        )
    return text


def render_model_job(params: ModelJobParams, template_dir: Path | str | None = None) -> str:
    """The batch script of a model job (fetch weights into the cache)."""
    params.validate()
    return _render(MODEL_JOB_TEMPLATE, template_dir, {"p": params, "job": params.job})


def render_engine_install(
    params: EngineInstallParams, template_dir: Path | str | None = None
) -> str:
    """The batch script of an engine install (venv or Apptainer image)."""
    params.validate()
    return _render(ENGINE_INSTALL_TEMPLATE, template_dir, {"p": params, "job": params.job})


def replica_script(
    model: Model,
    *,
    job_name: str,
    python: str,
    agent_config: str,
    output: str,
    slurm: SlurmDefaults | None = None,
    signal_before_s: int = 300,
    template_dir: Path | str | None = None,
) -> str:
    """The batch script of one replica of a catalog model.

    One node: a plain job. More: a heterogeneous job of one component per
    node, component 0 the head. The server's ``slurm`` defaults fill the
    partition, account and QOS a model leaves unset. A time limit shorter than
    twice ``signal_before_s`` gets its warning at half the limit instead, so a
    short job is not told to drain as it starts.
    """
    r = model.resources
    if slurm is not None:
        r = r.with_slurm_defaults(partition=slurm.partition, account=slurm.account, qos=slurm.qos)
    time = r.time_limit.slurm if r.time_limit is not None else None
    lead = signal_before_s
    if r.time_limit is not None:
        lead = max(1, min(signal_before_s, r.time_limit.seconds // 2))
    job = JobOptions(
        job_name=job_name,
        time=time,
        output=output,
        python=python,
        partition=r.partition,
        account=r.account,
        qos=r.qos,
        reservation=slurm.reservation if slurm is not None else None,
    )
    if r.nodes == 1:
        return render_replica(ReplicaParams(job, r, agent_config, lead), template_dir)
    components = [HetComponent(1, r) for _ in range(r.nodes)]
    return render_replica_hetjob(
        HetReplicaParams(job, components, agent_config, lead), template_dir
    )
