"""An engine install, inside its Slurm job: a venv with pip, or an Apptainer image pulled.

``llmgw-agent install`` runs this (sbatch_templates/engine-install.sbatch.j2
execs it). Each install is a trace of its own, or continues ``TRACEPARENT``:
``llmgw.engine_install`` with a span per step (the lock, the venv, pip, the
pull). When it installed, it leaves its trace context beside the target
(``TARGET.traceparent``), and a replica whose engine runs from the target
links its engine launch to that trace (:func:`install_marker_for`).

Safe to run twice at once: a lock file beside the target serialises installs
of the same target, and completion is marked last (a venv's
``.llmgw-installed``, an image's atomic rename), so that a half-built target
is never taken for a finished one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from llmgw_slurm.agent.errors import AgentError
from llmgw_slurm.base.fsutil import atomic_write, locked
from llmgw_slurm.tracing.otel import extract_env, write_trace_marker

__all__ = ["InstallRequest", "InstallResult", "install_engine", "install_marker_for"]

INSTALLED = ".llmgw-installed"


@dataclass(frozen=True)
class InstallRequest:
    """What to install; the fields of sbatch.EngineInstallParams that reach the job."""

    kind: str  # "venv" or "apptainer"
    target: Path
    python: str = "python3"  # the interpreter a venv is built from
    packages: Sequence[str] = ()
    pip_args: Sequence[str] = ()
    system_site_packages: bool = False
    image_uri: str = ""
    apptainer: str = "apptainer"


@dataclass(frozen=True)
class InstallResult:
    installed: bool  # False: the target was already complete
    seconds: float


def marker_path(target: Path) -> Path:
    """Where an install leaves its trace context: beside the target, never inside an image."""
    return target.with_name(target.name + ".traceparent")


def install_marker_for(program: str) -> Path | None:
    """The trace marker of the install that ``program`` (an engine's argv[0] or image) is from.

    A venv's ``TARGET/bin/python`` is two levels below its target; an image is
    the target itself. Not resolved: a venv's python is a symbolic link to the
    interpreter it was built from, which no install of ours made.
    """
    if not program.startswith("/"):
        return None
    p = Path(program)
    for candidate in (p, p.parent, p.parent.parent):
        m = marker_path(candidate)
        if m.is_file():
            return m
    return None


def _run(argv: Sequence[str], what: str) -> None:
    # Output goes to the job's own output file, where an admin reads a failed pip.
    try:
        proc = subprocess.run(list(argv), check=False)
    except OSError as err:
        raise AgentError(f"engine install: {what}: cannot run {argv[0]}: {err}") from err
    if proc.returncode != 0:
        raise AgentError(
            f"engine install: {what} failed (exit {proc.returncode}); the job's output has its log"
        )


def _venv(req: InstallRequest, tracer: trace.Tracer) -> bool:
    target = req.target
    if (target / INSTALLED).is_file():
        return False
    # A venv cannot be moved once built (its scripts hold absolute paths), so it
    # is built in place, under the lock, and marked complete only at the end.
    with tracer.start_as_current_span("llmgw.engine_install.venv"):
        if target.exists() or target.is_symlink():
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        argv = [req.python, "-m", "venv"]
        if req.system_site_packages:
            argv.append("--system-site-packages")
        _run([*argv, "--", str(target)], "creating the venv")
    py = str(target / "bin" / "python")
    if req.packages:
        # pip as the venv ships it: upgrading it would ask an index that pip_args do
        # not name (list pip among the packages to upgrade it from the site's index).
        with tracer.start_as_current_span(
            "llmgw.engine_install.pip", attributes={"llmgw.install.packages": list(req.packages)}
        ):
            _run([py, "-m", "pip", "install", *req.pip_args, "--", *req.packages], "pip install")
    with tracer.start_as_current_span("llmgw.engine_install.mark"):
        proc = subprocess.run([py, "-m", "pip", "freeze"], stdout=subprocess.PIPE, check=False)
        if proc.returncode != 0:
            raise AgentError(
                f"engine install: pip freeze in {target} failed (exit {proc.returncode})"
            )
        atomic_write(target / INSTALLED, proc.stdout)
    return True


def _image(req: InstallRequest, tracer: trace.Tracer) -> bool:
    target = req.target
    if target.is_file():
        return False
    # Pulled beside the target, then renamed: a reader never sees half an image.
    run_id = os.environ.get("SLURM_JOB_ID") or str(os.getpid())
    partial = target.with_name(f"{target.name}.partial.{run_id}")
    partial.unlink(missing_ok=True)
    with tracer.start_as_current_span(
        "llmgw.engine_install.pull", attributes={"llmgw.install.image": req.image_uri}
    ):
        pull = [req.apptainer, "pull", "--force", "--", str(partial), req.image_uri]
        _run(pull, "apptainer pull")
        os.replace(partial, target)
    return True


def install_engine(req: InstallRequest, tracer: trace.Tracer | None = None) -> InstallResult:
    """Install ``req`` unless already complete; raises AgentError on failure."""
    tracer = tracer or trace.get_tracer("llmgw_slurm")
    if req.kind not in ("venv", "apptainer"):
        raise AgentError(f"engine install: kind {req.kind!r} refused; valid: venv, apptainer")
    if not req.target.is_absolute():
        raise AgentError(f"engine install: target {req.target} must be an absolute path")
    attrs = {
        "llmgw.install.kind": req.kind,
        "llmgw.install.target": str(req.target),
        "llmgw.job_id": os.environ.get("SLURM_JOB_ID", ""),
    }
    t0 = time.monotonic()
    with tracer.start_as_current_span(
        "llmgw.engine_install", context=extract_env(os.environ), attributes=attrs
    ) as root:
        try:
            req.target.parent.mkdir(parents=True, exist_ok=True)
            # lockf, not flock: installs go to shared storage (NFS, Lustre), where
            # only POSIX locks reach the file server and exclude other nodes' jobs.
            lock_path = req.target.with_name(req.target.name + ".lock")
            with contextlib.ExitStack() as held:
                with tracer.start_as_current_span("llmgw.engine_install.lock"):
                    held.enter_context(locked(lock_path))
                installed = _venv(req, tracer) if req.kind == "venv" else _image(req, tracer)
        except (AgentError, OSError) as err:
            root.set_status(Status(StatusCode.ERROR, str(err)[:500]))
            if isinstance(err, OSError):
                raise AgentError(f"engine install: {req.target}: {err}") from err
            raise
        root.set_attribute("llmgw.install.installed", installed)
        if installed:
            write_trace_marker(marker_path(req.target), root.get_span_context())
    return InstallResult(installed, time.monotonic() - t0)
