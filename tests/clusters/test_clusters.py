"""One daemon over two real clusters: the first (SLURM_CONF: gpunode1-5, a100 and two
h100) and the second (LLMGW_TEST_SECOND_SLURM_CONF: gpunode11-13, h100 and l40s), which
share one slurmdbd (Slurm's multi-cluster mode: ``sacct -M``, ``squeue -M``).

Placement by GPU type and by free GPUs, the first cluster's slurmctld stopped (a cold
model served from the second, and no job twice on either once it is back), and a
daemon restart adopting replicas on both, one of them reached through ``-M``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.faults.support import daemon_pid, restore_cluster
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, running, tiny_model


def slurm(conf: str, *argv: str) -> str:
    """A Slurm command on the cluster of ``conf``; its output."""
    env = {**os.environ, "SLURM_CONF": conf}
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout


def cluster_name(conf: str) -> str:
    """Slurm's ClusterName of the cluster of ``conf``."""
    for line in Path(conf).read_text().splitlines():
        if line.startswith("ClusterName="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(f"no ClusterName in {conf}")


def jobs_on(conf: str, prefix: str) -> list[tuple[str, str, str]]:
    """(job id, name, state) of the test's jobs on one cluster, straight from squeue."""
    out = slurm(conf, "squeue", "-h", "-o", "%i|%j|%T")
    rows = [tuple(ln.split("|", 2)) for ln in out.splitlines() if ln]
    return [r for r in rows if r[1].startswith(prefix)]  # type: ignore[misc]


def filler(conf: str, prefix: str, gres: str, minutes: int, *where: str) -> str:
    """Somebody else's job holding ``gres``, with a time limit (Slurm's start estimates
    count on it); returns its id."""
    argv = ["sbatch", "--parsable", "-p", "llm", *where, f"--job-name={prefix}filler"]
    argv += [f"--gres={gres}", f"--time={minutes}", "--output=/dev/null", "--wrap", "sleep 900"]
    return slurm(conf, *argv).strip()


async def all_running(conf: str, ids: list[str]) -> None:
    async def check() -> bool:
        out = await asyncio.to_thread(slurm, conf, "squeue", "-h", "-o", "%T", "-j", ",".join(ids))
        return out.split() == ["RUNNING"] * len(ids)

    await eventually(check, "the filler jobs to run")


def configure(first: str, second: str, *, by_m: bool = False, **reconcile: Any) -> Any:
    """server.yaml's clusters: a (the first cluster) and b (the second, by its own
    slurm.conf, or by -M through the first's)."""

    def apply(h: Harness) -> None:
        cfg = yaml.safe_load(h.server_yaml.read_text())
        b: dict[str, Any] = {"name": "b", "slurm_conf": second}
        if by_m:
            b = {"name": "b", "slurm_conf": first, "multi_cluster": cluster_name(second)}
        cfg["clusters"] = [{"name": "a", "slurm_conf": first}, b]
        cfg["reconcile"] = {**cfg["reconcile"], "cluster_down_after": "10s", **reconcile}
        h.server_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))

    return apply


@contextlib.asynccontextmanager
async def daemon(
    tmp_path: Path,
    prefix: str,
    models: list[dict[str, Any]],
    first: str,
    second: str,
    **kw: Any,
) -> AsyncIterator[Harness]:
    """A daemon over both clusters; every job of the test's prefix on either is
    cancelled after (the harness cancels the first cluster's)."""
    router = kw.pop("router", {})
    try:
        async with running(
            tmp_path, prefix, models, router=router, configure=configure(first, second, **kw)
        ) as h:
            yield h
    finally:
        ids = [j[0] for j in jobs_on(second, prefix)]
        if ids:
            slurm(second, "scancel", *ids)


async def ask(h: Harness, model: str, text: str = "hello", timeout: float = 240.0) -> str:
    """One chat request (held while the model starts); the replica that answered."""
    async with openai.AsyncOpenAI(
        base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=timeout
    ) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=5
        )
    assert raw.parse().choices[0].message.content
    rid = raw.headers.get("x-llmgw-replica", "")
    assert rid
    return rid


def sacct_rows(
    conf: str, names: dict[str, str], since: str, job_prefix: str
) -> dict[str, list[str]]:
    """sacct over both clusters (one slurmdbd): each cluster's row of a job named
    job_prefix..., by the cluster's short name."""
    out = slurm(
        conf,
        "sacct",
        "-M",
        ",".join(names),
        "-X",
        "-n",
        "-P",
        "--format=Cluster,JobID,JobName,State,Start",
        f"--starttime={since}",
    )
    rows = [ln.split("|") for ln in out.splitlines() if job_prefix in ln]
    return {names[r[0]]: r for r in rows}


def ready(h: Harness, model: str) -> list[Any]:
    return [r for r in h.rec.replicas.values() if r.model == model and r.state().value == "ready"]


async def test_a_model_only_the_second_cluster_can_run_starts_there(
    tmp_path: Path, prefix: str, slurm_conf: str, second_conf: str
) -> None:
    model = tiny_model("l40s-only", resources={"gpu_type": "l40s"})
    async with daemon(tmp_path, prefix, [model], slurm_conf, second_conf) as h:
        rid = await ask(h, "l40s-only")
        r = h.rec.replicas[rid]
        assert r.cluster == "b" and r.nodes == ("gpunode13",)
        assert [j[1:] for j in jobs_on(second_conf, prefix)] == [
            (f"{prefix}l40s-only.{rid}-b", "RUNNING")
        ]
        assert jobs_on(slurm_conf, prefix) == []
        (submit,) = h.decisions("submit", "l40s-only")
        assert f"job {r.job_id} on b; room now on b: gpunode13" in submit.reason, submit.reason


async def test_a_model_that_fits_on_both_goes_to_the_one_with_free_gpus(
    tmp_path: Path, prefix: str, slurm_conf: str, second_conf: str
) -> None:
    # The first cluster's two h100 (gpunode5) taken by someone else; the second's free.
    taken = filler(slurm_conf, prefix, "gpu:h100:2", 15)
    await all_running(slurm_conf, [taken])
    first = tiny_model("h100-one", resources={"gpu_type": "h100"})
    second = tiny_model("h100-two", resources={"gpu_type": "h100"})
    async with daemon(tmp_path, prefix, [first, second], slurm_conf, second_conf) as h:
        rid = await ask(h, "h100-one")
        assert h.rec.replicas[rid].cluster == "b"
        assert h.rec.replicas[rid].nodes[0] in ("gpunode11", "gpunode12")
        # Freed: the next goes to the first cluster again, the site's first choice.
        slurm(slurm_conf, "scancel", taken)
        await eventually(
            lambda: asyncio.to_thread(lambda: not jobs_on(slurm_conf, prefix + "filler")),
            "the filler gone",
        )
        rid2 = await ask(h, "h100-two")
        assert (h.rec.replicas[rid2].cluster, h.rec.replicas[rid2].nodes) == ("a", ("gpunode5",))


@pytest.mark.usefixtures("restore")
async def test_first_controller_stopped_a_cold_model_is_served_from_the_second_and_never_twice(
    tmp_path: Path, prefix: str, slurm_conf: str, second_conf: str
) -> None:
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 60))
    # Both clusters full for h100:2: Slurm's estimates say the first one frees up sooner
    # (its filler's limit is 3 minutes, the second's an hour), so the replica queues there.
    a_filler = filler(slurm_conf, prefix, "gpu:h100:2", 3)
    b_fillers = [filler(second_conf, prefix, "gpu:h100:4", 60) for _ in range(2)]
    await all_running(slurm_conf, [a_filler])
    await all_running(second_conf, b_fillers)
    model = tiny_model("failover", resources={"gpu_type": "h100", "gpus": 2})
    async with daemon(
        tmp_path, prefix, [model], slurm_conf, second_conf, router={"hold_timeout": "5m"}
    ) as h:
        request = asyncio.create_task(ask(h, "failover", timeout=300))

        async def pending_on_a() -> list[Any]:
            return [r for r in h.rec.replicas.values() if r.cluster == "a"]

        (stuck,) = await eventually(pending_on_a, "the replica queued on the first cluster")
        (submit,) = h.decisions("submit", "failover")
        assert "Slurm expects it soonest on a" in submit.reason, submit.reason
        os.kill(daemon_pid("slurmctld"), signal.SIGTERM)
        # Room on the second cluster once the first is away.
        slurm(second_conf, "scancel", *b_fillers)
        rid = await asyncio.wait_for(request, 300)
        assert h.rec.replicas[rid].cluster == "b"
        (stranded,) = h.decisions("stranded", "failover")
        assert stranded.replica_id == stuck.replica_id
        await asyncio.to_thread(restore_cluster)

        async def cancelled() -> bool:
            return stuck.replica_id not in h.rec.replicas

        await eventually(cancelled, "the stranded replica cancelled", timeout=120)
        log = [(d.action, d.replica_id, d.reason) for d in h.rec.decisions]
        assert len(h.decisions("cancel", "failover")) == 1, log
        (cancel,) = h.decisions("cancel", "failover")
        assert cancel.reason == "scale down: replaced while cluster a did not answer"
        assert len(h.decisions("submit", "failover")) == 2  # one on each, never again
        assert await ask(h, "failover") == rid
        # sacct over both clusters (one slurmdbd): the model's one job on each, the
        # first's cancelled (Slurm may have started it as its controller came back,
        # before the daemon's next pass: it never served).
        assert stuck.ready_at is None
        names = {cluster_name(slurm_conf): "a", cluster_name(second_conf): "b"}

        # The first cluster's record reaches slurmdbd when its controller, back from
        # SIGTERM, sends what it had queued for the database: a while after the
        # cancel, and its end after its start.
        async def accounted() -> dict[str, list[str]] | None:
            by = await asyncio.to_thread(sacct_rows, slurm_conf, names, since, f"{prefix}failover.")
            ended = "a" in by and by["a"][3] not in ("PENDING", "RUNNING")
            return by if ended and sorted(by) == ["a", "b"] else None

        by = await eventually(
            accounted, "sacct's record of the job on each, ended on a", timeout=120
        )
        assert by["a"][3].startswith("CANCELLED")
        assert by["b"][3] == "RUNNING"


async def test_a_daemon_restart_adopts_the_replicas_on_both_clusters(
    tmp_path: Path, prefix: str, slurm_conf: str, second_conf: str
) -> None:
    models = [
        tiny_model("on-a", scaling={"min": 1, "max": 1}),  # a100: the first cluster's
        tiny_model("on-b", resources={"gpu_type": "l40s"}, scaling={"min": 1, "max": 1}),
        # Two GPUs of h100: one replica fits gpunode5, the other the second cluster.
        tiny_model("both", resources={"gpu_type": "h100", "gpus": 2}, scaling={"min": 2, "max": 2}),
    ]
    async with daemon(tmp_path, prefix, models, slurm_conf, second_conf) as h:

        async def all_ready() -> bool:
            return (
                len(ready(h, "on-a")) == len(ready(h, "on-b")) == 1 and len(ready(h, "both")) == 2
            )

        await eventually(all_ready, "four replicas ready", timeout=240)
        where = {r.replica_id: r.cluster for r in h.rec.replicas.values()}
        assert sorted(where.values()) == ["a", "a", "b", "b"]
        # Routing is cluster-blind: requests in flight at once spread over both of
        # "both"'s replicas, one on each cluster.
        served = await asyncio.gather(*(ask(h, "both", f"spread {i}") for i in range(12)))
        assert {where[r] for r in served} == {"a", "b"}
        before = {
            c: sorted(j[0] for j in jobs_on(conf, prefix))
            for c, conf in (("a", slurm_conf), ("b", second_conf))
        }
        await h.stop()  # like a crash: the jobs keep running
        # The new daemon reaches the second cluster by -M through the first's slurmdbd.
        configure(slurm_conf, second_conf, by_m=True)(h)
        await h.start()
        await eventually(all_ready, "the four adopted and ready again", timeout=180)
        assert {r.replica_id: r.cluster for r in h.rec.replicas.values()} == where
        assert len(h.decisions("adopt")) == 4 and not h.decisions("submit")
        after = {
            c: sorted(j[0] for j in jobs_on(conf, prefix))
            for c, conf in (("a", slurm_conf), ("b", second_conf))
        }
        assert after == before
        clusters = {c["name"]: c for c in h.rec.status()["clusters"]}
        assert clusters["b"]["health"] == "up" and clusters["b"]["replicas"] == {"ready": 2}
