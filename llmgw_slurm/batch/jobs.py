"""From a batch to its Slurm job: name, script, environment.

The job name is ``PREFIX_batch.BATCH_ID``: the reconciler's name parser
refuses it (``_batch`` is no model name), and a restarted daemon finds the job
again by it. Everything else (the input and output paths, the model spec,
the secrets) reaches the job in the sbatch process's environment.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from llmgw_slurm import sbatch
from llmgw_slurm.auth.secrets import batch_secret, engine_api_key
from llmgw_slurm.batch import results
from llmgw_slurm.batch.model import BatchRecord
from llmgw_slurm.batch.results import ERRORS, OUTPUT
from llmgw_slurm.catalog import Model, TimeLimit
from llmgw_slurm.config import ClusterConfig, ServerConfig
from llmgw_slurm.slurm.types import JobSpec

__all__ = ["BatchJobs", "batch_comment", "batch_job_prefix", "shards_for"]

# The lead of the USR1 before the time limit: long enough for the requests in
# flight to finish and the last progress report to go out.
_SIGNAL_BEFORE_S = 120


def batch_job_prefix(server: ServerConfig) -> str:
    return f"{server.slurm.job_prefix}_batch."


def batch_comment(batch: BatchRecord, model: str, gpus: int) -> str:
    """The job's comment, which sacct keeps (AccountingStoreFlags=job_comment).

    ``llmgw-admin audit`` reads it: batch jobs' GPU hours apart from replicas',
    and (Slurm charges every job to the service's account) whose batch it is.
    User and account are names keys allow (letters, digits, ``._@-``: no
    blanks, which would split the fields); with keys off they are left out.
    """
    who = "".join(f" {k}={v}" for k, v in (("user", batch.owner), ("account", batch.project)) if v)
    return f"llmgw batch={batch.id} model={model} gpus={gpus}{who}"


def shards_for(server: ServerConfig, total: int) -> int:
    """How many shards (array tasks) a batch of ``total`` requests is split into."""
    per = server.batch.shard_lines
    if per <= 0 or total <= per:
        return 1
    return min(-(-total // per), server.batch.max_shards)


@dataclass(frozen=True)
class BatchJobs:
    """Renders batch jobs for one server configuration."""

    server: ServerConfig
    server_key: bytes
    daemon_url: str
    # The gateway's client certificate (public): a TLS engine's job needs it to start.
    gateway_cert: str
    python: str = sys.executable

    def spec(
        self,
        batch: BatchRecord,
        model: Model,
        input_path: Path,
        work: Path,
        cluster: ClusterConfig | None = None,
        lease_epoch: int | None = None,
    ) -> JobSpec:
        """The batch's job on ``cluster`` (default: the first of server.yaml's), whose
        partition, account and QOS fill what the model leaves unset; ``lease_epoch``:
        the reconciler lease's epoch its submission is fenced by (two login nodes)."""
        cfg = self.server
        name = batch_job_prefix(cfg) + batch.id
        where = cluster or cfg.cluster_list[0]
        r = model.resources.with_slurm_defaults(
            partition=where.partition, account=where.account, qos=where.qos
        )
        # The batch's partition and QOS win over the model's: batches go where the
        # site sends them (its preemptible partition), not where replicas run.
        r = replace(r, partition=cfg.batch.partition or r.partition, qos=cfg.batch.qos or r.qos)
        limit = int(cfg.batch.time_limit)
        job = sbatch.JobOptions(
            job_name=name,
            time=TimeLimit.from_seconds(limit).slurm,
            output=str(work / "job-%j.out"),
            python=self.python,
            partition=r.partition,
            account=r.account,
            qos=r.qos,
            reservation=where.reservation,
        )
        lead = max(1, min(_SIGNAL_BEFORE_S, limit // 2))
        script = sbatch.render_batch(
            sbatch.ReplicaParams(job, r, str(cfg.agent_config), lead),
            cfg.templates_dir,
            batch.shards,
        )
        env = {
            "LLMGW_BATCH_ID": batch.id,
            "LLMGW_MODEL": model.name,
            "LLMGW_DAEMON_URL": self.daemon_url,
            "LLMGW_BATCH_SECRET": batch_secret(self.server_key, batch.id),
            "LLMGW_ENGINE_API_KEY": engine_api_key(self.server_key, batch.id),
            "LLMGW_REPLICA_SPEC": model.to_spec_json(),
            "LLMGW_GATEWAY_CERT": self.gateway_cert,
            "LLMGW_BATCH_INPUT": str(input_path),
            "LLMGW_BATCH_OUTPUT": str(work / OUTPUT),
            "LLMGW_BATCH_ERRORS": str(work / ERRORS),
            "LLMGW_BATCH_ENDPOINT": batch.endpoint,
            "LLMGW_BATCH_CONCURRENCY": str(cfg.batch.concurrency),
            "LLMGW_BATCH_RUNNER": cfg.batch.runner,
        }
        if batch.shards > 1:
            # Each array task takes lines [k*size, (k+1)*size) of the input and
            # keeps its results in work/shard-K/ (results.shard_paths).
            env["LLMGW_BATCH_SHARDS"] = str(batch.shards)
            env["LLMGW_BATCH_SHARD_SIZE"] = str(results.shard_size(batch.total, batch.shards))
        gpus = model.resources.gpus
        return JobSpec(
            name=name,
            script=script,
            env=env,
            comment=batch_comment(batch, model.name, gpus)
            # Several daemons on one database: the leader's lease epoch it was submitted under.
            + (f" epoch={lease_epoch}" if lease_epoch is not None else ""),
            unset_env=("TRACEPARENT", "TRACESTATE"),
        )
