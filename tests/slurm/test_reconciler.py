"""The reconciler on the real cluster: place, scale, evict, drain, renew, reap, restart, adopt.

Each test runs a real daemon (tests/slurm/harness.py) whose replicas are real
Slurm jobs running the real agent and the test engine, and talks to it with the
official openai client.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import openai
import pytest

from tests.slurm.conftest import eventually
from tests.slurm.harness import (
    RESTART,
    Harness,
    fill_all_but,
    research_job,
    reservation,
    running,
    tiny_model,
)


def client(h: Harness, timeout: float = 120) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=timeout
    )


async def chat(
    h: Harness, model: str, text: str = "hello from a test", timeout: float = 120
) -> str:
    async with client(h, timeout) as c:
        r = await c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=5
        )
    content = r.choices[0].message.content
    assert isinstance(content, str)
    return content


def ready_replicas(h: Harness, model: str) -> list[str]:
    return [
        r.replica_id
        for r in h.rec.replicas.values()
        if r.model == model and r.state().value == "ready"
    ]


async def test_cold_model_starts_on_demand_and_answers(tmp_path: Path, prefix: str) -> None:
    async with running(tmp_path, prefix, [tiny_model("cold", aliases=["org/Cold-Model"])]) as h:
        assert h.jobs() == []  # min 0: nothing runs before a request
        text = await chat(h, "org/Cold-Model", "alpha beta gamma")
        assert "alpha" in text
        (job,) = h.jobs()
        assert job[1].startswith(prefix + "cold.")
        assert job[2] == "RUNNING"
        shown = subprocess.run(
            ["scontrol", "show", "job", job[0]], capture_output=True, text=True, check=True
        ).stdout
        assert "gres/gpu:a100=1" in shown or "gpu:a100:1" in shown
        assert f"Comment=llmgw model=cold replica={job[1].rsplit('.', 1)[1]}" in shown
        (submit,) = h.decisions("submit", "cold")
        assert "a request is waiting" in submit.reason
        # A second request goes to the same replica: no second job.
        await chat(h, "cold")
        assert len(h.jobs()) == 1


async def test_min_replicas_start_without_requests_and_idle_ones_scale_down(
    tmp_path: Path, prefix: str
) -> None:
    model = tiny_model("kept", scaling={"min": 1, "max": 2, "idle_timeout": "3s"})
    async with running(tmp_path, prefix, [model]) as h:
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "kept")), "min 1 to be ready")
        # Lower min to 0 and reload (what SIGHUP does): the idle replica is drained, then stopped.
        h.write_models([tiny_model("kept", scaling={"min": 0, "max": 2, "idle_timeout": "3s"})])
        assert h.d is not None
        h.d.reload()

        async def stopped() -> bool:
            return not h.jobs() and bool(h.decisions("gone", "kept"))

        await eventually(stopped, "the idle replica to be stopped")
        (drain,) = h.decisions("drain", "kept")
        assert "scale down: idle" in drain.reason


async def test_bad_catalog_reload_keeps_the_last_good_one(tmp_path: Path, prefix: str) -> None:
    async with running(tmp_path, prefix, [tiny_model("good")]) as h:
        (h.folder / "models.yaml").write_text(
            "models:\n  - name: Bad Name!\n    engine: {kind: vllm}\n"
        )
        assert h.d is not None
        h.d.reload()
        assert [m.name for m in h.rec.catalog.models] == ["good"]
        assert "good" in await chat(h, "good", "good")


async def test_eviction_makes_room_for_a_wanted_model(tmp_path: Path, prefix: str) -> None:
    whole_node = {"gpus": 4}
    models = [
        tiny_model("first", resources=whole_node),
        tiny_model("second", resources=whole_node),
        tiny_model("pinned", resources=whole_node, scaling={"min": 1, "max": 1}),
    ]
    # Somebody else's jobs on every a100 GPU but two whole nodes', so that only two
    # replicas fit, in a reservation of the test's own: whatever else runs on the
    # cluster (scripts/demo's replicas) keeps what it holds and starts nothing new on
    # the GPUs the eviction frees (tests/slurm/harness.py says why).
    with reservation(prefix) as resv:
        _, fillers = await fill_all_but(prefix, keep=2, reservation=resv)
        try:
            # The held request waits through a whole eviction (the evicted job's end,
            # then the new job's start and its engine's): with the other levels beside
            # this one on two cores (CI), that took more than the harness's 90 s once.
            hold = {"hold_timeout": "5m"}
            async with running(tmp_path, prefix + "d.", models, reservation=resv, router=hold) as h:
                await eventually(
                    lambda: asyncio.sleep(0, ready_replicas(h, "pinned")), "pinned ready"
                )
                await chat(h, "first")
                (first_replica,) = ready_replicas(h, "first")
                # Now the cluster is full; "second" can only start if "first" (idle, on
                # demand) goes. "pinned" has min 1: a promise, never evicted.
                try:
                    text = await chat(h, "second", "room please", timeout=330)
                except openai.APIError as exc:
                    log = [(d.action, d.model, d.reason) for d in h.rec.decisions]
                    pytest.fail(f"second not served: {exc}; decisions: {log}")
                assert "room" in text
                (evict,) = h.decisions("evict")
                assert evict.model == "first"
                assert evict.replica_id == first_replica
                assert "to make room for second" in evict.reason
                assert ready_replicas(h, "pinned")
                assert not ready_replicas(h, "first")
        finally:
            subprocess.run(["scancel", *fillers], check=False)


async def test_nothing_idle_enough_is_said_and_nothing_evicted(tmp_path: Path, prefix: str) -> None:
    whole_node = {"gpus": 4}
    models = [
        tiny_model("busy", resources=whole_node),
        tiny_model("waiting", resources=whole_node),
    ]
    # Room for one whole-node replica, whatever else runs (as above).
    with reservation(prefix) as resv:
        _, fillers = await fill_all_but(prefix, keep=1, reservation=resv)
        try:
            # A long eviction grace: "busy" was used too recently to be a candidate.
            async with running(
                tmp_path, prefix + "d.", models, eviction_grace="10m", reservation=resv
            ) as h:
                await chat(h, "busy")
                task = asyncio.create_task(chat(h, "waiting"))

                async def noted() -> str | None:
                    return h.rec.notes.get("waiting")

                note = await eventually(noted, "a placement note for 'waiting'")
                assert "nothing idle enough to stop" in note
                assert not h.decisions("evict")
                task.cancel()
        finally:
            subprocess.run(["scancel", *fillers], check=False)


async def test_restarted_daemon_adopts_jobs_and_never_submits_twice(
    tmp_path: Path, prefix: str
) -> None:
    model = tiny_model("adoptee", scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model]) as h:
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "adoptee")), "ready")
        (before,) = h.jobs()
        await h.stop()  # like a crash: the job keeps running
        await h.start()
        assert h.rec.replicas == {}
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "adoptee")), "ready again")
        (adopt,) = h.decisions("adopt", "adoptee")
        assert before[0] in adopt.reason
        assert h.jobs() == [before]
        assert not h.decisions("submit")
        (rep,) = h.rec.replicas.values()
        assert rep.adopted and rep.last_used is None  # unknown is not idle
        assert "adopt" in await chat(h, "adoptee", "adopt me")


async def test_crashing_engine_is_restarted_with_backoff_and_marked_failing(
    tmp_path: Path, prefix: str
) -> None:
    crash = tiny_model(
        "crashy",
        engine={"kind": "command", "command": ["python3", "-c", "import sys; sys.exit(3)"]},
        scaling={"min": 1, "max": 1},
    )
    async with running(tmp_path, prefix, [crash]) as h:

        async def failing() -> bool:
            return h.rec.failures.get("crashy") is not None and h.rec.failures["crashy"].count >= 3

        await eventually(failing, "three failed starts", timeout=120)
        submits = h.decisions("submit", "crashy")
        assert len(submits) >= 3
        status = h.rec.status()
        (m,) = status["models"]
        assert m["state"] in ("failing", "backoff") or m["note"].startswith("failing")
        f = h.rec.failures["crashy"]
        assert "exit" in f.cause or "failed" in f.cause
        # Backoff: no new submission while it lasts.
        n = len(h.decisions("submit", "crashy"))
        await asyncio.sleep(3)
        assert len(h.decisions("submit", "crashy")) <= n + 1


async def test_preempted_replica_is_requeued_and_serves_again(tmp_path: Path, prefix: str) -> None:
    model = tiny_model("preemptee", resources={"gpus": 4}, scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model]) as h:
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "preemptee")), "ready")
        (rep,) = h.rec.replicas.values()
        # Ready can come from the agent's report before the listing names the node.
        await eventually(lambda: asyncio.sleep(0, rep.nodes), "the listing to name the node")
        node = rep.nodes[0]
        research = research_job(prefix, node)
        try:
            await eventually(
                lambda: asyncio.sleep(0, h.decisions("requeued", "preemptee")), "the requeue"
            )
            assert not ready_replicas(h, "preemptee")
        finally:
            subprocess.run(["scancel", research], check=False)
        # The same job comes back (no second submission) and serves again.
        await eventually(
            lambda: asyncio.sleep(0, ready_replicas(h, "preemptee")),
            "ready after the preemption",
            timeout=180,
        )
        assert len(h.decisions("submit", "preemptee")) == 1, [
            (d.action, d.replica_id, d.reason) for d in h.rec.decisions
        ]
        assert "back" in await chat(h, "preemptee", "back again")


@pytest.mark.parametrize("clients", [4])
async def test_renewal_hands_over_without_failed_requests(
    tmp_path: Path, prefix: str, clients: int
) -> None:
    # A 3-minute time limit and a margin that makes the replica due for renewal at once.
    model = tiny_model("renewed", resources={"time_limit": "3m"}, scaling={"min": 1, "max": 1})
    async with running(tmp_path, prefix, [model], renewal_margin="170s") as h:
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "renewed")), "ready")
        failures: list[BaseException] = []
        done = asyncio.Event()
        sent = 0

        async def load() -> None:
            nonlocal sent
            while not done.is_set():
                try:
                    await chat(h, "renewed", "steady load")
                    sent += 1
                except Exception as exc:
                    failures.append(exc)

        workers = [asyncio.create_task(load()) for _ in range(clients)]
        try:

            async def handed_over() -> bool:
                return (
                    bool(h.decisions("gone", "renewed")) and len(ready_replicas(h, "renewed")) == 1
                )

            await eventually(handed_over, "the old replica to be drained and gone", timeout=150)
        finally:
            done.set()
            await asyncio.gather(*workers)
        assert failures == []
        assert sent > 0
        # With a 3-minute limit and a 170 s margin, the replacement is itself due for
        # renewal at once: look at the first handover.
        renew = next(d for d in h.decisions("submit", "renewed") if "renewal" in d.reason)
        drain = h.decisions("drain", "renewed")[0]
        assert drain.reason == f"renewed by {renew.replica_id}"
        original = h.decisions("submit", "renewed")[0].replica_id
        assert drain.replica_id == original


async def test_job_killed_from_outside_is_reaped_with_its_cause_and_restarted(
    tmp_path: Path, prefix: str
) -> None:
    model = tiny_model("victim", scaling={"min": 1, "max": 1})
    # Healthy only after 10 minutes: a replica that dies this soon after serving is a
    # failed start.
    restart = {**RESTART, "healthy_after": "10m"}
    async with running(tmp_path, prefix, [model], restart=restart) as h:
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "victim")), "ready")
        (job,) = h.jobs()
        subprocess.run(["scancel", job[0]], check=True)
        (reap,) = await eventually(lambda: asyncio.sleep(0, h.decisions("reap", "victim")), "reap")
        assert f"job {job[0]} ended: CANCELLED" in reap.reason
        assert h.rec.failures["victim"].count == 1
        # Restarted after the backoff (2 s here), as a new job.
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "victim")), "ready again")
        (again,) = h.jobs()
        assert again[0] != job[0]
        # Ready again, but not yet for its minimum lifetime: the failure still counts
        # (an engine that dies at its first request must back off, not loop).
        assert h.rec.failures["victim"].count == 1


async def test_a_job_submitted_just_before_the_daemon_died_is_adopted_not_duplicated(
    tmp_path: Path, prefix: str
) -> None:
    """sbatch returned, then the daemon died before it recorded the job."""
    from llmgw_slurm.auth.secrets import load_or_create_server_key
    from llmgw_slurm.auth.tls import load_or_create_identity
    from llmgw_slurm.catalog import load_catalog
    from llmgw_slurm.config import load_server_config
    from llmgw_slurm.reconciler.jobs import JobBuilder, new_replica_id
    from llmgw_slurm.slurm.cli import CliBackend

    h = Harness(tmp_path / "daemon", prefix)
    h.write([tiny_model("orphan", scaling={"min": 1, "max": 1})])
    server = load_server_config(h.server_yaml)
    key = load_or_create_server_key(server.state_dir / "server.key")
    (m,) = load_catalog(server.models).models
    rid = new_replica_id()
    cert = load_or_create_identity(server.state_dir).cert_pem
    spec = JobBuilder(server, key, f"http://127.0.0.1:{h.internal_port}", cert).spec(m, rid)
    job_id = await CliBackend().submit(spec)
    await h.start()
    try:
        await eventually(lambda: asyncio.sleep(0, ready_replicas(h, "orphan")), "ready")
        assert ready_replicas(h, "orphan") == [rid]
        assert [j[0] for j in h.jobs()] == [job_id]
        assert not h.decisions("submit")
    finally:
        await h.stop()
        subprocess.run(["scancel", job_id], check=False)


async def test_sigkilled_daemon_process_adopts_every_job_on_restart(
    tmp_path: Path, prefix: str
) -> None:
    import json
    import signal
    import urllib.request

    h = Harness(tmp_path / "daemon", prefix)
    h.write([tiny_model(f"k{i}", scaling={"min": 1, "max": 1}) for i in range(2)])

    def status() -> dict[str, object] | None:
        try:
            with urllib.request.urlopen(h.url + "/api/v1/status", timeout=5) as resp:
                return json.loads(resp.read())  # type: ignore[no-any-return]
        except OSError:
            return None

    def all_ready() -> bool:
        st = status()
        return st is not None and all(
            m["state"] == "ready" and m["ready_replicas"] == 1
            for m in st["models"]  # type: ignore[index,union-attr]
        )

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["llmgw-admin", "serve", "--server", str(h.server_yaml)],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "daemon.log", "ab"),
        )

    proc = start()
    try:
        await eventually(lambda: asyncio.sleep(0, all_ready()), "both models ready", timeout=90)
        before = sorted(h.jobs())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start()
        await eventually(
            lambda: asyncio.sleep(0, all_ready()), "ready after the restart", timeout=90
        )
        st = status()
        assert st is not None
        actions = [d["action"] for d in st["decisions"]]  # type: ignore[index,union-attr]
        assert actions.count("adopt") == 2
        assert "submit" not in actions
        assert sorted(h.jobs()) == before
    finally:
        proc.terminate()
        proc.wait()
        ids = [j[0] for j in h.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], check=False)
