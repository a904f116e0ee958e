"""The job side of a batch (the agent's batch run against the test engine) and the
server.yaml ``batch:`` section."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import aiohttp
import pytest

from llmgw_slurm.agent.batch import (
    BatchJob,
    BatchRun,
    _append_run,
    _shard,
    _write_todo,
    batch_job_from_env,
    todo,
)
from llmgw_slurm.agent.engine import LaunchParams, build_run_batch_command
from llmgw_slurm.agent.errors import EngineError
from llmgw_slurm.base.errors import ConfigError, ConfigErrors
from llmgw_slurm.batch import results
from llmgw_slurm.config import load_server_config
from llmgw_slurm.testing.engine import EngineOptions, create_engine_app
from tests.unit._router_support import free_port, serve

CHAT = "/v1/chat/completions"


def request(cid: str, **body: object) -> str:
    b = {"model": "alias-of-tiny", "messages": [{"role": "user", "content": cid}], **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": b}) + "\n"


def job(tmp_path: Path, *lines: str) -> BatchJob:
    (tmp_path / "in.jsonl").write_text("".join(lines))
    return BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl", CHAT, 2)


def rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


async def test_a_run_skips_what_is_done_and_writes_each_answer_once(tmp_path: Path) -> None:
    b = job(tmp_path, *(request(f"q{i}") for i in range(6)), request("bad", max_tokens=-1))
    # An earlier job answered q0 and was killed writing q1.
    b.output.write_text(json.dumps({"custom_id": "q0"}) + "\n" + '{"custom_id": "q1", "resp')
    app = create_engine_app(EngineOptions(api_key="k", served_name="tiny"))
    async with serve(app) as url, aiohttp.ClientSession() as s:
        run = BatchRun(b, s, url, "k", "tiny", None)
        await run.run()
    out, err = rows(b.output), rows(b.errors)
    assert sorted(str(o["custom_id"]) for o in out) == [f"q{i}" for i in range(6)]
    assert [e["custom_id"] for e in err] == ["bad"]
    assert err[0]["response"]["status_code"] == 400  # type: ignore[index]
    # The alias was replaced by the engine's served name: every request was answered.
    assert (run.completed, run.failed) == (6, 1)
    assert run.prompt_tokens > 0


async def test_an_engine_that_does_not_answer_leaves_the_request_for_the_next_job(
    tmp_path: Path,
) -> None:
    b = job(tmp_path, request("q0"))
    async with aiohttp.ClientSession() as s:
        run = BatchRun(b, s, f"http://127.0.0.1:{free_port()}", "k", "tiny", None)
        await run.run()
    assert run.unreached == 1
    assert b.output.read_text() == "" and b.errors.read_text() == ""


def batch_env(**over: str) -> dict[str, str]:
    """What the daemon puts in a batch job's environment (``over`` replacing some)."""
    return {
        "LLMGW_BATCH_ID": "batch_" + "0" * 24,
        "LLMGW_MODEL": "tiny",
        "LLMGW_DAEMON_URL": "http://x:1",
        "LLMGW_BATCH_SECRET": "s",
        "LLMGW_ENGINE_API_KEY": "k",
        "LLMGW_BATCH_INPUT": "/i",
        "LLMGW_BATCH_OUTPUT": "/o",
        "LLMGW_BATCH_ERRORS": "/e",
        "LLMGW_BATCH_ENDPOINT": CHAT,
        **over,
    }


def test_a_job_without_its_batch_environment_says_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="LLMGW_BATCH_ID"):
        batch_job_from_env({})
    env = batch_env(LLMGW_BATCH_ID="../../x", LLMGW_MODEL="m")
    with pytest.raises(ConfigError, match="not a batch id"):
        batch_job_from_env(env)


def test_a_batch_jobs_environment_is_checked_as_a_replicas_is(tmp_path: Path) -> None:
    # One check of a job's environment: a batch job's daemon URL, model and the
    # gateway's certificate are held to what a replica's are.
    from tests.agent_support import fake_engine_spec, gateway_identity

    env = batch_env(
        LLMGW_REPLICA_SPEC=fake_engine_spec(tmp_path),
        LLMGW_GATEWAY_CERT=gateway_identity(tmp_path / "gw").cert_pem,
    )
    job, _ = batch_job_from_env(env)
    assert job.replica_id == env["LLMGW_BATCH_ID"] and job.model == "tiny"
    with pytest.raises(ConfigError, match="LLMGW_DAEMON_URL"):
        batch_job_from_env({**env, "LLMGW_DAEMON_URL": "x:1"})
    with pytest.raises(ConfigError, match="LLMGW_MODEL is 'other'"):
        batch_job_from_env({**env, "LLMGW_MODEL": "other"})
    with pytest.raises(ConfigError, match="LLMGW_GATEWAY_CERT"):
        batch_job_from_env({**env, "LLMGW_GATEWAY_CERT": "not a certificate"})


def test_the_batch_section_defaults_and_its_errors_name_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "server.yaml"
    p.write_text("state_dir: st\n")
    cfg = load_server_config(p)
    assert cfg.batch_directory == tmp_path / "st" / "batch"
    assert cfg.batch.max_requests == 50_000 and cfg.batch.time_limit == 4 * 3600
    assert (cfg.batch.max_active_per_user, cfg.batch.shard_lines, cfg.batch.max_shards) == (
        10,
        0,
        16,
    )
    p.write_text(
        textwrap.dedent(
            """\
            batch:
              directory: shared/batch
              partition: "bad partition"
              max_file_bytes: lots
              time_limit: 10s
              shard_lines: -1
              max_shards: 5000
              max_active_per_user: 0
            """
        )
    )
    with pytest.raises(ConfigErrors) as info:
        load_server_config(p)
    got = sorted(str(e).replace(str(p), "F") for e in info.value.errors)
    assert [g.split(":")[:3] for g in got] == [
        ["F", "3", " batch.partition"],
        ["F", "4", " batch.max_file_bytes"],
        ["F", "5", " batch.time_limit"],
        ["F", "6", " batch.shard_lines"],
        ["F", "7", " batch.max_shards"],
        ["F", "8", " batch.max_active_per_user"],
    ], got
    p.write_text("batch: {directory: \"sh ared\"}\n")
    with pytest.raises(ConfigError, match=r"batch\.directory"):
        load_server_config(p)


def test_the_offline_runner_gets_only_what_is_left_and_its_answers_land_once(
    tmp_path: Path,
) -> None:
    b = job(tmp_path, *(request(f"q{i}") for i in range(4)))
    b.output.write_text(json.dumps({"custom_id": "q0"}) + "\n")
    run_in = tmp_path / "run-in.jsonl"
    counts, left = _write_todo(b, run_in, "tiny")
    assert (counts, left) == ({"completed": 1, "failed": 0}, 3)
    sent = rows(run_in)
    assert [s["custom_id"] for s in sent] == ["q1", "q2", "q3"]
    assert {s["body"]["model"] for s in sent} == {"tiny"}  # type: ignore[index]
    produced = tmp_path / "run-out.jsonl"
    ok = {"status_code": 200, "body": {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}}
    produced.write_text(
        "".join(
            json.dumps(line) + "\n"
            for line in (
                {"custom_id": "q1", "response": ok},
                {"custom_id": "q2", "response": {"status_code": 400, "body": None}},
                {"custom_id": "q0", "response": ok},  # already answered: not again
                {"custom_id": "q3", "response": ok},
            )
        )
    )
    got = _append_run(b, produced, counts)
    assert got == {"completed": 3, "failed": 1, "prompt_tokens": 10, "completion_tokens": 4}
    assert [r["custom_id"] for r in rows(b.output)] == ["q0", "q1", "q3"]
    assert [r["custom_id"] for r in rows(b.errors)] == ["q2"]


def test_the_offline_runner_command_keeps_the_key_and_paths_as_arguments() -> None:
    from llmgw_slurm.catalog import EngineSpec
    from llmgw_slurm.config import EngineRuntime

    spec = EngineSpec(kind="vllm", args=("--dtype", "float32"), env={"A": "1"})
    p = LaunchParams(
        model_path="/w/m; rm -rf /",
        served_name="tiny",
        host="0.0.0.0",
        port=0,
        python="/venv/bin/python",
        runtime=EngineRuntime(env={"B": "2"}),
    )
    cmd = build_run_batch_command(spec, p, "/p/in.jsonl", "/p/out.jsonl")
    assert cmd.argv == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.run_batch",
        "-i", "/p/in.jsonl", "-o", "/p/out.jsonl", "--model", "/w/m; rm -rf /",
        "--served-model-name", "tiny", "--dtype", "float32",
    ]
    assert cmd.env == {"A": "1", "B": "2"}
    with pytest.raises(EngineError, match="no offline batch runner"):
        build_run_batch_command(EngineSpec(kind="command", command=("x",)), p, "/i", "/o")


def shard_env(task: str) -> dict[str, str]:
    return {"LLMGW_BATCH_SHARDS": "3", "LLMGW_BATCH_SHARD_SIZE": "2", "SLURM_ARRAY_TASK_ID": task}


def test_an_array_task_runs_its_own_lines_into_its_own_files(tmp_path: Path) -> None:
    whole = job(tmp_path, *(request(f"q{i}") for i in range(5)))
    assert _shard(whole, {}) is whole  # no shards: the batch's own files, all its lines
    got = {}
    for task in ("0", "1", "2"):
        b = _shard(whole, shard_env(task))
        assert b.output == tmp_path / f"shard-{task}" / "out.jsonl"
        assert b.errors.parent == b.output.parent and b.output.parent.is_dir()
        got[task] = [cid for cid, _ in todo(b, set())]
    assert got == {"0": ["q0", "q1"], "1": ["q2", "q3"], "2": ["q4"]}
    b = _shard(whole, shard_env("1"))
    assert [cid for cid, _ in todo(b, {"q2"})] == ["q3"]  # resumed: its own done skipped
    for task, says in (("", "not set"), ("x", "not a number"), ("3", "task 3 of")):
        with pytest.raises(ConfigError, match=says):
            _shard(whole, shard_env(task))


def test_the_shards_merge_into_one_pair_of_files_each_custom_id_once(tmp_path: Path) -> None:
    def put(path: Path, *cids: str) -> None:
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps({"custom_id": c}) + "\n" for c in cids)

    out, err = tmp_path / results.OUTPUT, tmp_path / results.ERRORS
    o0, e0 = results.shard_paths(out, err, 0)
    o1, _ = results.shard_paths(out, err, 1)
    put(o0, "a", "b")
    put(e0, "c", "a")  # failed once, answered after: the answer wins
    put(o1, "d")
    with o1.open("a") as f:
        f.write('{"custom_id": "e", "resp')  # a task killed mid-write
    results.merge_shards(tmp_path, 2)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "b", "d"]
    assert [json.loads(x)["custom_id"] for x in err.read_text().splitlines()] == ["c"]
    put(o1, "e")  # a resubmitted array's task answered more: merged afresh
    results.merge_shards(tmp_path, 2)
    assert results.custom_ids(out) == {"a", "b", "d", "e"}
    assert results.shard_size(5, 3) == 2 and results.shard_size(6, 3) == 2


def test_merged_results_are_on_disk_before_they_replace_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As every other file the daemon replaces: the data fsynced before the rename,
    # so a crash leaves the old merge or the new one, never an empty file.
    import os

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def synced(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def replaced(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", f"{src} {dst}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", replaced)
    out, err = tmp_path / results.OUTPUT, tmp_path / results.ERRORS
    o0, _ = results.shard_paths(out, err, 0)
    o0.parent.mkdir()
    o0.write_text(json.dumps({"custom_id": "a"}) + "\n")
    results.merge_shards(tmp_path, 1)
    for target in (out, err):
        done = [
            i
            for i, (what, arg) in enumerate(events)
            if what == "replace" and arg.endswith(f" {target}")
        ]
        assert len(done) == 1
        src = events[done[0]][1].split(" ")[0]
        assert ("fsync", src) in events[: done[0]]
    assert results.custom_ids(out) == {"a"}


async def test_a_job_with_nothing_left_in_its_lines_ends_without_an_engine(
    tmp_path: Path,
) -> None:
    from llmgw_slurm.agent.batch import BatchAgent
    from llmgw_slurm.agent.runner import EXIT_OK, JobContext, replica_spec
    from llmgw_slurm.config import AgentConfig, AgentWeightsConfig
    from tests.agent_support import fake_engine_spec

    b = job(tmp_path, request("q0"), request("q1"))
    spec = replica_spec(fake_engine_spec(tmp_path))
    ctx = JobContext("batch_" + "0" * 24, "m", "http://127.0.0.1:1", "s", "k", spec)
    settings = AgentConfig(weights=AgentWeightsConfig(cache_dir=tmp_path / "c"))
    agent = BatchAgent(b, settings, ctx, {})
    b.output.write_text(json.dumps({"custom_id": "q0"}) + "\n")
    assert agent._left() is None  # q1 is left: the engine would start
    b.errors.write_text(json.dumps({"custom_id": "q1"}) + "\n")
    await agent._startup_steps(None)  # type: ignore[arg-type]
    assert agent._done_before == {"completed": 1, "failed": 1}
    assert await agent._serve(None) == EXIT_OK  # type: ignore[arg-type]
    assert agent.engine is None
