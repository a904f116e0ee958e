"""Service jobs that are not replicas: model jobs (weights ahead of use) and engine installs.

``llmgw-admin fetch`` and ``llmgw-admin install-engine`` submit them through
the Slurm adapter as the service's user, under the daemon's job prefix so
that they show in the same single ``squeue`` listing the reconciler makes each
pass, but with a name no replica can have:

    {prefix}_job.fetch.{model}.{8 hex}       a model job
    {prefix}_job.install.{name}.{8 hex}      an engine install (name: the target's last part)

A model name starts with a lowercase letter or digit, so ``_job...`` never
parses as a replica (``reconciler.jobs.parse_job_name`` checks the model part)
and the reconciler never adopts, counts or reaps one of these.

:class:`ServiceJobs` follows them for the daemon's status from that listing.
A finished job leaves the default ``squeue`` listing at once, so its final
state comes from accounting, asked once in a pass where one has left (the
same call that settles vanished replicas); its cause is the last line of its
log (the agent's one-line ``Error: ...`` for a failed fetch). Ended jobs stay
in the status for ``keep_s`` (an hour); after a daemon restart only running
and queued ones are known again.
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw_slurm import sbatch
from llmgw_slurm.catalog import Model
from llmgw_slurm.config import ClusterConfig, ServerConfig
from llmgw_slurm.slurm.types import AccountingRecord, Job, JobSpec, JobState

__all__ = [
    "KINDS",
    "ServiceJob",
    "ServiceJobBuilder",
    "ServiceJobs",
    "job_log_path",
    "last_log_line",
    "parse_service_job_name",
    "service_job_name",
]

KINDS = ("fetch", "install")
_MARK = "_job."
_UID = re.compile(r"[0-9a-f]{8}")
_COMMENT_TARGET = re.compile(r"(?:^|\s)target=(\S+)")
_SLUG_BAD = re.compile(r"[^a-z0-9._-]+")


def service_job_name(prefix: str, kind: str, target: str, uid: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"job kind {kind!r}; valid: {', '.join(KINDS)}")
    return f"{prefix}{_MARK}{kind}.{target}.{uid}"


def parse_service_job_name(prefix: str, name: str) -> tuple[str, str, str] | None:
    """``llmgw._job.fetch.tiny.0a1b2c3d`` -> ``("fetch", "tiny", "0a1b2c3d")``; None if not one."""
    if not name.startswith(prefix + _MARK):
        return None
    kind, dot, rest = name[len(prefix) + len(_MARK) :].partition(".")
    target, dot2, uid = rest.rpartition(".")
    if kind not in KINDS or not dot or not dot2 or not target or not _UID.fullmatch(uid):
        return None
    return kind, target, uid


def _slug(target: str) -> str:
    """The last part of a target path as a job-name word (for squeue; the comment has it all)."""
    base = _SLUG_BAD.sub("-", Path(target).name.lower()).strip("-.") or "engine"
    return base[:48]


def job_log_path(server: ServerConfig, name: str, job_id: str) -> Path:
    """Where a service job's output goes (``%x-%j.out`` in the state folder's logs)."""
    return Path(server.state_dir) / "logs" / f"{name}-{job_id}.out"


def last_log_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a job's log, or "" when there is none to read.

    Only the tail is read: a pip install's log can be long.
    """
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


@dataclass(frozen=True)
class ServiceJobBuilder:
    """Renders model jobs and engine installs for one server configuration."""

    server: ServerConfig
    python: str = sys.executable
    # The cluster the job goes to (its partition, account, QOS); default the first.
    cluster: ClusterConfig | None = None

    def _options(self, name: str, time: str | None) -> sbatch.JobOptions:
        cfg = self.server
        where = self.cluster or cfg.cluster_list[0]
        log_dir = Path(cfg.state_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        return sbatch.JobOptions(
            job_name=name,
            time=time,
            output=str(log_dir / "%x-%j.out"),
            python=self.python,
            partition=where.partition,
            account=where.account,
            qos=where.qos,
            reservation=where.reservation,
        )

    def fetch(
        self, model: Model, *, time: str | None = None, allow_download: bool = False
    ) -> JobSpec:
        """A model job: ``llmgw-agent fetch`` of the model's weights into agent.yaml's cache."""
        name = service_job_name(self.server.slurm.job_prefix, "fetch", model.name, _uid())
        script = sbatch.render_model_job(
            sbatch.ModelJobParams(
                self._options(name, time),
                str(self.server.agent_config),
                allow_download=allow_download,
            ),
            self.server.templates_dir,
        )
        return JobSpec(
            name=name,
            script=script,
            # The spec, like a replica's, travels in the environment, not the script.
            env={"LLMGW_REPLICA_SPEC": model.to_spec_json(), "LLMGW_MODEL": model.name},
            comment=f"llmgw job=fetch target={model.name}",
        )

    def install(
        self,
        kind: str,
        target: str,
        *,
        packages: Sequence[str] = (),
        pip_args: Sequence[str] = (),
        system_site_packages: bool = False,
        image_uri: str = "",
        apptainer: str = "apptainer",
        time: str | None = None,
    ) -> JobSpec:
        """An engine install: a venv at ``target`` with pip, or an Apptainer image pulled there."""
        name = service_job_name(self.server.slurm.job_prefix, "install", _slug(target), _uid())
        script = sbatch.render_engine_install(
            sbatch.EngineInstallParams(
                self._options(name, time),
                kind,
                target,
                packages=tuple(packages),
                pip_args=tuple(pip_args),
                image_uri=image_uri,
                apptainer=apptainer,
                system_site_packages=system_site_packages,
                agent_config=str(self.server.agent_config),
            ),
            self.server.templates_dir,
        )
        return JobSpec(
            name=name, script=script, comment=f"llmgw job=install kind={kind} target={target}"
        )


def _uid() -> str:
    return secrets.token_hex(4)


@dataclass
class ServiceJob:
    """What the daemon last saw of one model job or engine install."""

    kind: str
    target: str
    job_id: str
    name: str
    state: JobState
    reason: str
    submitted_at: float | None
    started_at: float | None
    seen_at: float
    ended_at: float | None = None
    elapsed_s: float | None = None
    exit_code: str = ""
    message: str = ""
    # Left the listing; the final state is still to be asked of accounting.
    unsettled: bool = False
    lookups: int = 0
    # The cluster it runs on ("": the one cluster of a server.yaml without clusters:).
    cluster: str = ""


class ServiceJobs:
    """The service's non-replica jobs, from the reconciler's listing of each pass.

    Keyed by cluster and job id: two clusters number their jobs each from 1.
    """

    def __init__(self, server: ServerConfig, *, keep_s: float = 3600.0, lookups: int = 3) -> None:
        self.server = server
        self.prefix = server.slurm.job_prefix
        self.keep_s = keep_s
        self.max_lookups = lookups
        self.jobs: dict[tuple[str, str], ServiceJob] = {}

    def expect(self, job_id: str, name: str, target: str, now: float, cluster: str = "") -> bool:
        """A job ``llmgw-admin`` just submitted; False when it is not a service job of ours.

        A short job can start and end between two passes and never be listed:
        known from its submission, it is settled from accounting like any other.
        """
        ident = parse_service_job_name(self.prefix, name)
        if ident is None or not job_id.isdigit():
            return False
        if (cluster, job_id) not in self.jobs:
            kind, short, _ = ident
            shown = target if target and target.isprintable() and len(target) <= 1024 else short
            self.jobs[cluster, job_id] = ServiceJob(
                kind=kind,
                target=shown,
                job_id=job_id,
                name=name,
                state=JobState.PENDING,
                reason="",
                submitted_at=now,
                started_at=None,
                seen_at=now,
                cluster=cluster,
            )
        return True

    def observe(self, jobs: Sequence[Job], now: float, cluster: str = "") -> None:
        """Update from one cluster's ``squeue`` listing (the one the pass already made)."""
        listed: set[tuple[str, str]] = set()
        for job in jobs:
            ident = parse_service_job_name(self.prefix, job.name)
            if ident is None:
                continue
            kind, target, _ = ident
            m = _COMMENT_TARGET.search(job.comment)
            listed.add((cluster, job.job_id))
            sj = self.jobs.get((cluster, job.job_id))
            if sj is None:
                sj = self.jobs[cluster, job.job_id] = ServiceJob(
                    kind=kind,
                    target=m.group(1) if m else target,
                    job_id=job.job_id,
                    name=job.name,
                    state=job.state,
                    reason=job.reason,
                    submitted_at=job.submit_time.timestamp() if job.submit_time else None,
                    started_at=None,
                    seen_at=now,
                    cluster=cluster,
                )
            sj.state, sj.reason, sj.seen_at = job.state, job.reason, now
            sj.unsettled = False
            if m:
                sj.target = m.group(1)
            if job.start_time is not None and job.state is not JobState.PENDING:
                sj.started_at = job.start_time.timestamp()
            if sj.started_at is not None:
                sj.elapsed_s = max(0.0, now - sj.started_at)
            if job.state.is_finished:
                self._ended(sj, now)
        for jid, sj in list(self.jobs.items()):
            if jid in listed or sj.cluster != cluster:
                continue
            if sj.ended_at is None and not sj.unsettled:
                sj.unsettled = True
            elif sj.ended_at is not None and now - sj.ended_at > self.keep_s:
                del self.jobs[jid]

    def unsettled_since(self, cluster: str = "") -> float | None:
        """The earliest submission among the cluster's jobs that left its listing
        unsettled, or None."""
        left = [sj for sj in self.jobs.values() if sj.unsettled and sj.cluster == cluster]
        if not left:
            return None
        return min((sj.submitted_at or sj.seen_at) for sj in left)

    def settle(
        self, records: Sequence[AccountingRecord] | None, now: float, cluster: str = ""
    ) -> None:
        """Final states from one cluster's accounting (None: it could not be asked)."""
        by_id = {r.job_id: r for r in records or ()}
        for sj in self.jobs.values():
            if not sj.unsettled or sj.cluster != cluster:
                continue
            sj.lookups += 1
            rec = by_id.get(sj.job_id)
            if rec is not None and rec.state.is_finished:
                sj.state = rec.state
                sj.exit_code = rec.exit_code
                sj.elapsed_s = float(rec.elapsed_s)
                self._ended(sj, now)
            elif sj.lookups >= self.max_lookups or records is None:
                # Honest about what is not known rather than asking every pass.
                sj.reason = f"left the queue (last seen {sj.state.value}); final state unknown"
                sj.state = JobState.UNKNOWN
                self._ended(sj, now)

    def _ended(self, sj: ServiceJob, now: float) -> None:
        sj.unsettled = False
        if sj.ended_at is None:
            sj.ended_at = now
            sj.message = last_log_line(job_log_path(self.server, sj.name, sj.job_id))

    def status(self, now: float) -> list[dict[str, Any]]:
        out = []
        for sj in sorted(self.jobs.values(), key=lambda j: (j.submitted_at or 0.0, j.job_id)):
            out.append(
                {
                    "cluster": sj.cluster,
                    "kind": sj.kind,
                    "target": sj.target,
                    "job_id": sj.job_id,
                    "name": sj.name,
                    "state": sj.state.value,
                    "reason": sj.reason,
                    "elapsed_s": None if sj.elapsed_s is None else round(sj.elapsed_s, 1),
                    "submitted_at": sj.submitted_at,
                    "ended_at": sj.ended_at,
                    "exit_code": sj.exit_code,
                    "message": sj.message,
                    "log": str(job_log_path(self.server, sj.name, sj.job_id)),
                }
            )
        return out
