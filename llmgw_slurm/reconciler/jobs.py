"""From a catalog model to the Slurm job of one replica: names, scripts, environment.

The one place that builds a replica's job: identity in the job name (visible
to every user, so nothing secret), the script rendered from the site's
templates, and the secrets and the model spec in the sbatch process's
environment.
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from llmgw_slurm import sbatch
from llmgw_slurm.auth.secrets import engine_api_key, replica_secret
from llmgw_slurm.catalog import CLUSTER_NAME_RE, MODEL_NAME_RE, Model
from llmgw_slurm.config import ClusterConfig, ServerConfig
from llmgw_slurm.slurm.types import JobSpec

_RID = re.compile(r"[0-9a-f]{8}")
_CLUSTER = re.compile(CLUSTER_NAME_RE)


def new_replica_id() -> str:
    return secrets.token_hex(4)


def job_name(prefix: str, model: str, replica_id: str, cluster: str = "") -> str:
    """``PREFIX MODEL . ID``, and ``-CLUSTER`` after it when server.yaml names clusters."""
    return f"{prefix}{model}.{replica_id}" + (f"-{cluster}" if cluster else "")


class JobIdent(NamedTuple):
    """What a replica's job name says: its model, its replica id, and the cluster it
    was submitted to ("" in a name without one: a single cluster's, as before)."""

    model: str
    replica_id: str
    cluster: str


def parse_job_ident(prefix: str, name: str) -> JobIdent | None:
    """``llmgw.llama-8b.0a1b2c3d-h100`` -> ``("llama-8b", "0a1b2c3d", "h100")``;
    ``llmgw.llama-8b.0a1b2c3d`` -> ``(..., "")``; None when not a replica.

    The model part must be a valid model name: the service's other jobs
    (``{prefix}_job.fetch.MODEL.ID``, see llmgw_slurm.reconciler.svcjobs) share the prefix
    and end the same way, and a replica taken from one would be adopted and
    reaped as a replica of a model called ``_job.fetch.MODEL``. A cluster name
    has no '.', and a replica id no '-': the two read apart.
    """
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    model, dot, last = rest.rpartition(".")
    rid, dash, cluster = last.partition("-")
    if not dot or not MODEL_NAME_RE.fullmatch(model) or not _RID.fullmatch(rid):
        return None
    if dash and not _CLUSTER.fullmatch(cluster):
        return None
    return JobIdent(model, rid, cluster)


def parse_job_name(prefix: str, name: str) -> tuple[str, str] | None:
    """``llmgw.llama-8b.0a1b2c3d`` -> ``("llama-8b", "0a1b2c3d")``; None when not a
    replica (see :func:`parse_job_ident`, which also gives the cluster)."""
    ident = parse_job_ident(prefix, name)
    return None if ident is None else (ident.model, ident.replica_id)


@dataclass(frozen=True)
class JobBuilder:
    """Renders replica jobs for one server configuration."""

    server: ServerConfig
    server_key: bytes
    daemon_url: str
    # The gateway's client certificate (public, PEM), the one client beside its agent
    # that a replica's engine lets in: a job without it cannot start a TLS engine.
    gateway_cert: str
    python: str = sys.executable

    def name(self, model: Model, replica_id: str, cluster: str = "") -> str:
        """The job name of ``model``'s replica ``replica_id`` on ``cluster`` (how adoption
        finds it)."""
        return job_name(self.server.slurm.job_prefix, model.name, replica_id, cluster)

    def spec(
        self,
        model: Model,
        replica_id: str,
        extra_env: Mapping[str, str] | None = None,
        *,
        traceparent: str = "",
        cluster: ClusterConfig | None = None,
        lease_epoch: int | None = None,
    ) -> JobSpec:
        """The replica's job on ``cluster`` (default: the first of server.yaml's).
        ``extra_env`` carries TRACEPARENT/TRACESTATE when tracing is on; ``traceparent``
        (the start span's, not a secret) goes into the comment so that a restarted
        daemon can continue the start's trace. The cluster's partition, account and
        QOS fill what the model leaves unset; its name ends the job's. ``lease_epoch``:
        the epoch of the reconciler's lease it is submitted under (several daemons on
        one database), in the comment too, so that sacct shows which leader submitted it."""
        cfg = self.server
        where = cluster or cfg.cluster_list[0]
        name = self.name(model, replica_id, where.name)
        log_dir = Path(cfg.state_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        # Warn the agent ahead of the limit by the drain timeout plus a margin, so
        # that it can finish in-flight requests before Slurm kills the job (a short
        # job is warned at half its limit instead: replica_script caps it).
        signal_before = int(min(65535, max(60, cfg.reconcile.drain_timeout + 60)))
        script = sbatch.replica_script(
            model,
            job_name=name,
            python=self.python,
            agent_config=str(cfg.agent_config),
            output=str(log_dir / "%x-%j.out"),
            slurm=where,
            signal_before_s=signal_before,
            template_dir=cfg.templates_dir,
        )
        env = {
            "LLMGW_REPLICA_ID": replica_id,
            "LLMGW_MODEL": model.name,
            "LLMGW_DAEMON_URL": self.daemon_url,
            "LLMGW_REPLICA_SECRET": replica_secret(self.server_key, replica_id),
            "LLMGW_ENGINE_API_KEY": engine_api_key(self.server_key, replica_id),
            "LLMGW_REPLICA_SPEC": model.to_spec_json(),
            "LLMGW_GATEWAY_CERT": self.gateway_cert,
            **(extra_env or {}),
        }
        gpus = model.resources.gpus * model.resources.nodes
        # For sacct audits: which model and replica, in a form `audit` parses back.
        comment = f"llmgw model={model.name} replica={replica_id} gpus={gpus}"
        if where.name:
            comment += f" cluster={where.name}"
        if traceparent:
            comment += f" trace={traceparent}"
        if lease_epoch is not None:
            comment += f" epoch={lease_epoch}"
        # The trace context is the start span's or none: never the daemon's own
        # (a daemon started from a traced shell or CI job has TRACEPARENT too).
        return JobSpec(
            name=name,
            script=script,
            env=env,
            comment=comment,
            unset_env=("TRACEPARENT", "TRACESTATE"),
        )
