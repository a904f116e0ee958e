"""The CLIs as researchers and admins script them (issue 40), against a real daemon.

One test (or a few) per way the CLIs got in the way: the endpoint `llmgw models`
prints as the URL, login and keys on a gateway without keys, progress while a
cold model starts, --json with stable fields, ids alone on standard output,
exit codes (--watch included), errors that name the fix, help with examples,
one word for the Slurm account, and what the daemon counts and logs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import pytest
from _cli_support import RunningDaemon, free_port, run_daemon, write_config
from click.shell_completion import ShellComplete
from click.testing import CliRunner, Result

from llmgw_slurm.accounting.usage import UsageRecord
from llmgw_slurm.auth import munge
from llmgw_slurm.auth.keys import list_keys
from llmgw_slurm.batch import results
from llmgw_slurm.batch.routes import BATCH_KEY
from llmgw_slurm.batch.service import BatchService
from llmgw_slurm.cli import settings
from llmgw_slurm.cli.admin import main as admin_main
from llmgw_slurm.cli.researcher import main
from llmgw_slurm.router.gateway import GATEWAY_KEY
from tests.unit.test_batch import Backend

CLI = [sys.executable, "-c", "from llmgw_slurm.cli.researcher import main; main()"]


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    # No timed batch poll: a test polls when it says.
    yield from run_daemon(tmp_path, extra="batch: {poll_interval: 1h}\n")


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in ("LLMGW_URL", "LLMGW_API_KEY", "LLMGW_SERVER_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def llmgw(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    res = CliRunner().invoke(main, list(args), input=input, env=env)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


def admin(*args: str, input: str | None = None) -> Result:
    res = CliRunner().invoke(admin_main, list(args), input=input)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


def jsonl(tmp_path: Path, *cids: str, model: str | None = None) -> Path:
    p = tmp_path / "in.jsonl"
    lines = []
    for c in cids:
        body: dict[str, object] = {"messages": [{"role": "user", "content": c}]}
        if model:
            body["model"] = model
        lines.append({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": body})
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def service(rd: RunningDaemon) -> BatchService:
    svc: BatchService = rd.d.gateway[BATCH_KEY]
    svc.backend = Backend()  # type: ignore[assignment]
    return svc


def finish(rd: RunningDaemon, svc: BatchService, batch_id: str, cids: str) -> None:
    """The batch's job answered every line; the next poll ends the batch."""
    (svc.store.work_dir(batch_id) / results.OUTPUT).write_text(
        "".join(json.dumps({"custom_id": c, "response": {"status_code": 200}}) + "\n" for c in cids)
    )
    import asyncio

    asyncio.run_coroutine_threadsafe(svc.poll(), rd.loop).result(30)


# ---- 1. the endpoint `llmgw models` prints is a URL llmgw takes ---------------------------


def test_the_printed_endpoint_works_as_the_url(
    rd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    endpoint = json.loads(llmgw("--url", rd.url, "models", "--json").stdout)[0]["endpoint"]
    assert endpoint == rd.url + "/v1"
    res = llmgw("--url", endpoint, "chat", "tiny", "hello small world")
    assert res.exit_code == 0 and res.stdout.startswith("hello small world"), res.output
    monkeypatch.setenv("LLMGW_URL", endpoint + "/")
    res = llmgw("models")
    assert res.exit_code == 0 and f"Endpoint (OpenAI API): {rd.url}/v1\n" in res.stdout
    assert "/v1/v1" not in res.stdout
    res = admin("status")
    assert res.exit_code == 0 and res.stdout.startswith(f"daemon {rd.url} · "), res.output


def test_a_config_file_url_with_v1_works_too(rd: RunningDaemon, tmp_path: Path) -> None:
    cfg = tmp_path / "xdg" / "llmgw" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f"url: {rd.url}/v1\n")
    res = llmgw("models", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)[0]["endpoint"] == rd.url + "/v1"


# ---- 2. login and keys on a gateway without keys ----------------------------------------


def test_login_and_keys_on_a_gateway_without_keys_say_it_needs_none(
    rd: RunningDaemon, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[object] = []

    async def spy(*a: object, **k: object) -> str:
        made.append(a)
        return "MUNGE:x"

    monkeypatch.setattr(munge, "encode", spy)
    res = llmgw("--url", rd.url, "login")
    assert res.exit_code == 0, res.output
    assert res.stdout == "" and "needs no key: it has no API keys" in res.stderr
    assert not made and not (tmp_path / "xdg").exists()
    res = llmgw("--url", rd.url, "keys")
    assert res.exit_code == 0 and "has no API keys: there are none to list" in res.stderr
    assert "llmgw login" not in res.output
    res = llmgw("--url", rd.url, "keys", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout) == {"user": None, "keys": []}


def test_login_on_a_gateway_with_keys_but_no_login_names_who_gives_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[object] = []

    async def spy(*a: object, **k: object) -> str:
        made.append(a)
        return "MUNGE:x"

    monkeypatch.setattr(munge, "encode", spy)
    for rd in run_daemon(tmp_path, keys_file=tmp_path / "keys.json"):
        res = llmgw("--url", rd.url, "login")
        assert res.exit_code == 1 and not made
        assert res.output == (
            f"Error: login is off on the gateway at {rd.url} (login.enabled in its server.yaml): "
            "ask the admin for a key (llmgw-admin keys add YOU), then set LLMGW_API_KEY\n"
        )
        res = llmgw("--url", rd.url, "--key", "llmgw-00000000-" + "x" * 43, "keys")
        assert res.exit_code == 1 and "(llmgw-admin keys)" in res.output, res.output


# ---- 3. chat on a cold model shows its steps on standard error --------------------------


def _line(stream: Any, want: str) -> str:
    """Read lines until one holds ``want``; the lines read, for a failure message."""
    seen = ""
    while True:
        line = stream.readline()
        assert line, f"the stream ended before {want!r}: {seen!r}"
        seen += line
        if want in line:
            return seen


def test_chat_on_a_cold_model_shows_its_steps_on_stderr_and_the_answer_alone_on_stdout(
    rd: RunningDaemon,
) -> None:
    # A real process: the steps are read as they come, and the test moves the start on.
    proc = subprocess.Popen(
        [*CLI, "--url", rd.url, "chat", "tiny", "hello cold start"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        err = _line(proc.stderr, "tiny is not running: the gateway holds your request")
        err += _line(proc.stderr, "] requested")
        rd.add_replica("tiny", "0000bbbb", "pending", reason="Resources")
        err += _line(proc.stderr, "] queued (Resources)")
        # The test engine takes the key of replica 0000aaaa.
        rd.call(lambda: rd.rec.replicas.pop("0000bbbb"))
        rd.add_replica("tiny", "0000aaaa", "ready")
        rd.call(lambda: rd.rec.directory.signal_ready("tiny"))
        out, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, (out, err + rest)
    assert out.startswith("hello cold start") and "queued" not in out
    assert "Traceback" not in err + rest


def test_chat_on_a_ready_model_prints_nothing_but_the_answer(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    res = llmgw("--url", rd.url, "chat", "tiny", "just this")
    assert res.exit_code == 0 and res.stderr == "" and res.stdout.startswith("just this")


# ---- 4. no traceback for a path that cannot be written ----------------------------------


def test_batch_download_to_a_missing_folder_is_one_error_line(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    svc = service(rd)
    bid = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", model="tiny"))).stdout
    finish(rd, svc, bid.strip(), "a")
    target = tmp_path / "nonexistent" / "dir" / "x.jsonl"
    res = llmgw("--url", rd.url, "batch", "download", bid.strip(), "-o", str(target))
    assert res.exit_code == 1
    assert res.output == (
        f"Error: cannot write {target}: the folder {target.parent} does not exist\n"
    )


# ---- 5. batches from a script -----------------------------------------------------------


def test_batch_submit_prints_the_id_alone_and_json_everywhere(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    svc = service(rd)
    res = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", "b", model="tiny")))
    assert res.exit_code == 0, res.output
    bid = res.stdout.strip()
    assert res.stdout == bid + "\n" and bid.startswith("batch_")
    assert res.stderr.startswith("in_progress [")
    res = llmgw("--url", rd.url, "batch", "status", bid, "--json")
    data = json.loads(res.stdout)
    assert data["id"] == bid and data["status"] == "in_progress"
    assert data["request_counts"]["total"] == 2
    finish(rd, svc, bid, "ab")
    listed = json.loads(llmgw("--url", rd.url, "batch", "list", "--json").stdout)
    assert [(b["id"], b["status"]) for b in listed] == [(bid, "completed")]
    res = llmgw(
        "--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "c", model="tiny")), "--json"
    )
    assert json.loads(res.stdout)["status"] == "in_progress"


def test_batch_watch_exit_code_tells_completed_from_failed(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    svc = service(rd)
    bid = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", model="tiny")))
    finish(rd, svc, bid.stdout.strip(), "a")
    res = llmgw("--url", rd.url, "batch", "status", bid.stdout.strip(), "--watch")
    assert res.exit_code == 0 and res.stdout.startswith("completed ["), res.output
    # A model nobody has: the batch is failed at once.
    bad = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", model="nope")))
    assert bad.exit_code == 1
    bad_id = bad.stdout.strip()
    res = llmgw("--url", rd.url, "batch", "status", bad_id, "--watch")
    assert res.exit_code == 1 and f"Error: batch {bad_id} ended failed" in res.stderr
    res = llmgw("--url", rd.url, "batch", "status", bad_id)
    assert res.exit_code == 0 and res.stdout.startswith("failed")


def test_ctrl_c_on_batch_watch_stops_watching_like_up(rd: RunningDaemon, tmp_path: Path) -> None:
    service(rd)
    bid = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", model="tiny")))
    bid_ = bid.stdout.strip()
    proc = subprocess.Popen(
        [*CLI, "--url", rd.url, "batch", "status", bid_, "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _line(proc.stderr, "in_progress [")  # it is watching now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert f"Stopped watching; batch {bid_} goes on (llmgw batch status {bid_})." in err
    assert "Aborted" not in err and "Traceback" not in err


def test_batch_submit_without_a_model_is_a_usage_error_before_any_upload(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    svc = service(rd)
    path = jsonl(tmp_path, "a", "b")
    res = llmgw("--url", rd.url, "batch", "submit", str(path))
    assert res.exit_code == 2
    assert f"{path}:1: the request names no model (body.model): give --model M" in res.output
    assert svc.store.files("") == [] and svc.store.batches("") == []


def test_finished_batches_can_be_deleted_and_running_ones_are_refused(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    svc = service(rd)
    bad = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", model="nope")))
    running = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "b", model="tiny")))
    bad_id, run_id = bad.stdout.strip(), running.stdout.strip()
    res = llmgw("--url", rd.url, "batch", "delete", run_id)
    assert res.exit_code == 1 and "in_progress; cancel it first" in res.output
    res = llmgw("--url", rd.url, "batch", "delete", bad_id)
    assert res.exit_code == 0 and res.stderr == f"deleted {bad_id}\n"
    listed = json.loads(llmgw("--url", rd.url, "batch", "list", "--json").stdout)
    assert [b["id"] for b in listed] == [run_id]
    finish(rd, svc, run_id, "b")
    out_file = svc.store.batch("", run_id).output_file_id  # type: ignore[union-attr]
    assert llmgw("--url", rd.url, "batch", "delete", run_id).exit_code == 0
    assert svc.store.batches("") == [] and out_file and svc.store.file("", out_file) is None
    res = llmgw("--url", rd.url, "batch", "delete", run_id)
    assert res.exit_code == 1 and "No batch with id" in res.output


def test_batch_download_errors_of_a_clean_batch_is_empty_and_succeeds(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    svc = service(rd)
    bid = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", model="tiny")))
    bid_ = bid.stdout.strip()
    res = llmgw("--url", rd.url, "batch", "download", bid_, "--errors")
    assert res.exit_code == 1 and "no error file yet: wait with" in res.output
    finish(rd, svc, bid_, "a")
    target = tmp_path / "errors.jsonl"
    res = llmgw("--url", rd.url, "batch", "download", bid_, "--errors", "-o", str(target))
    assert res.exit_code == 0 and target.read_bytes() == b"", res.output


# ---- 6. models --json: state and count apart, and the description ------------------------


def test_models_json_keeps_state_and_count_apart_and_shows_the_description(
    rd: RunningDaemon,
) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    rd.add_replica("tiny", "0000cccc", "ready")
    rd.add_replica("big-model", "0000bbbb", "pending", reason="Resources")
    res = llmgw("--url", rd.url, "models", "--json")
    tiny, big = json.loads(res.stdout)
    assert (tiny["state"], tiny["ready_replicas"], tiny["replicas"]) == ("ready", 2, 2)
    assert tiny["description"] == "The test engine (it echoes the prompt)"
    assert (big["state"], big["reason"], big["ready_replicas"]) == ("queued", "Resources", 0)
    table = llmgw("--url", rd.url, "models").stdout
    assert "The test engine" in table
    status = json.loads(admin("status", "--json", "--server", str(rd.server_path)).stdout)
    assert [(m["state"], m["ready_replicas"]) for m in status["models"]] == [
        ("ready", 2),
        ("queued", 0),
    ]


# ---- 7. completion from LLMGW_URL and --url ----------------------------------------------


def _complete(args: list[str], incomplete: str) -> list[str]:
    comp = ShellComplete(main, {}, "llmgw", "_LLMGW_COMPLETE")
    return [c.value for c in comp.get_completions(args, incomplete)]


def test_model_names_complete_from_llmgw_url_and_url(
    rd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _complete(["--url", rd.url, "chat"], "ti") == ["tiny"]
    monkeypatch.setenv("LLMGW_URL", rd.url)
    assert _complete(["up"], "") == ["tiny", "test/tiny-chat", "big-model"]


# ---- 8. the default URL is not a silent trap ---------------------------------------------


def test_the_default_url_says_it_is_the_default_and_how_to_set_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(settings, "DEFAULT_URL", url)
    res = llmgw("models")
    assert res.exit_code == 1
    assert res.output.startswith(f"Error: cannot reach the llmgw daemon at {url}: connection")
    assert f"{url} is llmgw's default; give your site's gateway with" in res.output
    assert "LLMGW_URL" in res.output and "ssl:default" not in res.output
    assert len(res.output.strip().splitlines()) == 1


# ---- 9. help: whole summaries, examples --------------------------------------------------


def _commands(group: click.Group, path: str) -> Iterator[tuple[str, click.Command]]:
    for name, cmd in group.commands.items():
        yield f"{path} {name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{path} {name}")


@pytest.mark.parametrize("prog,group", [("llmgw", main), ("llmgw-admin", admin_main)])
def test_help_summaries_are_whole_and_every_command_has_an_example(
    prog: str, group: click.Group
) -> None:
    for path, cmd in [(prog, group), *_commands(group, prog)]:
        args = path.split()[1:]
        res = CliRunner().invoke(group, [*args, "--help"], terminal_width=80)
        assert res.exit_code == 0, (path, res.output)
        assert "Example" in res.output, f"`{path} --help` shows no example"
        if isinstance(cmd, click.Group):
            listed = res.output.split("Commands:", 1)[1]
            assert "..." not in listed, f"`{path} --help` cuts a summary:\n{listed}"


# ---- 10. the admin commands agree --------------------------------------------------------


def test_config_check_reads_llmgw_server_config_like_every_other_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path, free_port(), free_port(), None)
    monkeypatch.setenv("LLMGW_SERVER_CONFIG", str(path))
    res = admin("config", "check")
    assert res.exit_code == 0 and res.stdout == f"ok: {path}\n", res.output
    (tmp_path / "models.yaml").write_text("models:\n  - name: Bad Name\n")
    res = admin("config", "check")
    assert res.exit_code == 1 and "models.yaml" in res.output and "Bad Name" in res.output


def test_stop_without_a_terminal_names_yes(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", job_id="777")
    srv = ["--server", str(rd.server_path)]
    res = admin("stop", "tiny", *srv)  # standard input: empty, as </dev/null
    assert res.exit_code == 1 and rd.backend.cancelled == []
    assert "Error: nothing stopped: no answer to the question on standard input; add --yes" in (
        res.output
    )
    assert "Aborted" not in res.output
    res = admin("stop", "tiny", "-y", "--json", *srv)
    assert res.exit_code == 0 and json.loads(res.stdout)["replicas"] == ["0000aaaa"]


def test_keys_are_charged_to_an_account_and_project_still_works_with_a_note(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.json"
    srv = ["--server", str(write_config(tmp_path, free_port(), free_port(), keys_file))]
    res = admin("keys", "add", "alice", "--account", "proj42", *srv)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("llmgw-") and res.stdout.count("\n") == 1
    assert "key " in res.stderr and "(account proj42)" in res.stderr
    res = admin("keys", "add", "bob", "--project", "proj7", *srv)
    assert res.exit_code == 0
    assert "--project is deprecated: it is the Slurm account; use --account" in res.stderr
    assert [r.project for r in list_keys(keys_file)] == ["proj42", "proj7"]
    table = admin("keys", "list", *srv).stdout
    assert table.splitlines()[0].split() == ["ID", "USER", "ACCOUNT", "CREATED", "REVOKED"]
    rows = json.loads(admin("keys", "list", "--json", *srv).stdout)
    assert [(r["user"], r["account"]) for r in rows] == [("alice", "proj42"), ("bob", "proj7")]
    assert all("project" not in r for r in rows)


def test_a_mistyped_keys_file_is_an_error_not_an_empty_list_or_a_new_file(
    tmp_path: Path,
) -> None:
    typo = tmp_path / "kyes.json"
    res = admin("keys", "list", "--keys-file", str(typo))
    assert res.exit_code == 1 and f"no key file at {typo} (from --keys-file)" in res.output
    res = admin("keys", "add", "alice", "--keys-file", str(typo))
    assert res.exit_code == 1 and "does not exist: a typo?" in res.output and "--create" in (
        res.output
    )
    assert not typo.exists()
    res = admin("keys", "add", "alice", "--keys-file", str(typo), "--create")
    assert res.exit_code == 0 and typo.exists() and "made it" in res.stderr


def test_admin_usage_has_since_and_totals_like_the_researchers(
    rd: RunningDaemon, tmp_path: Path
) -> None:
    store = rd.d.gateway[GATEWAY_KEY].usage
    assert store is not None
    now = time.time()
    for model, toks in (("tiny", 10), ("tiny", 5), ("big-model", 7)):
        store.record(UsageRecord(now, "", "", "", model, "completions", toks, 1, toks + 1))
    import asyncio

    asyncio.run_coroutine_threadsafe(store.flush(), rd.loop).result(30)
    res = admin("usage", "--by", "model", "--since", "1d", "--json", "--server", str(rd.server_path))
    data = json.loads(res.stdout)
    assert set(data) == {"since", "by", "rows", "totals"}
    assert data["totals"] == {
        "requests": 3,
        "prompt_tokens": 22,
        "completion_tokens": 3,
        "total_tokens": 25,
    }
    assert _is_iso(data["since"])
    table = admin("usage", "--by", "model", "--server", str(rd.server_path)).stdout
    assert next(ln for ln in table.splitlines() if ln.startswith("total")).split() == [
        "total",
        "3",
        "22",
        "3",
        "25",
    ]
    mine = json.loads(llmgw("--url", rd.url, "usage", "--since", "1d", "--json").stdout)
    assert _is_iso(mine["since"]) and mine["totals"] == data["totals"]


def _is_iso(text: str) -> bool:
    from datetime import datetime

    return datetime.fromisoformat(text).tzinfo is not None


def test_up_and_chat_word_an_unknown_model_alike_and_suggest_the_near_name(
    rd: RunningDaemon,
) -> None:
    want = "Error: unknown model 'tinny'; did you mean 'tiny'? (known: tiny, big-model)\n"
    for cmd in (["up", "tinny"], ["chat", "tinny", "hi"]):
        res = llmgw("--url", rd.url, *cmd)
        assert res.exit_code == 1 and res.output == want, (cmd, res.output)
    res = llmgw("--url", rd.url, "chat", "test/tiny-chta", "hi")
    assert "did you mean 'test/tiny-chat'?" in res.output


# ---- 11. the decision log does not invent a waiting request ------------------------------


def test_up_on_a_ready_model_leaves_nothing_waiting_for_a_drain_to_restart(
    rd: RunningDaemon,
) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    assert llmgw("--url", rd.url, "up", "tiny").exit_code == 0
    # The plan starts a model "because a request is waiting" from held_since.
    assert rd.call(lambda: rd.rec.directory.held_since()) == {}


# ---- 12. usage counts a batch's requests ---------------------------------------------------


def test_usage_counts_each_request_of_a_batch(rd: RunningDaemon, tmp_path: Path) -> None:
    svc = service(rd)
    bid = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", "b", "c", model="t")))
    assert bid.exit_code == 1  # "t" is no model: a failed batch counts nothing
    bid = llmgw("--url", rd.url, "batch", "submit", str(jsonl(tmp_path, "a", "b", "c", model="tiny")))
    bid_ = bid.stdout.strip()
    batch = svc.store.get(bid_)
    assert batch is not None
    # The job's last report: three answered, their tokens.
    svc.store.save(replace(batch, completed=3, prompt_tokens=30, completion_tokens=6))
    finish(rd, svc, bid_, "abc")
    store = rd.d.gateway[GATEWAY_KEY].usage
    assert store is not None
    import asyncio

    asyncio.run_coroutine_threadsafe(store.flush(), rd.loop).result(30)
    data = json.loads(llmgw("--url", rd.url, "usage", "--since", "1d", "--json").stdout)
    assert data["models"] == [
        {
            "model": "tiny",
            "requests": 3,
            "prompt_tokens": 30,
            "completion_tokens": 6,
            "total_tokens": 36,
        }
    ]


def test_a_usage_store_from_before_counts_each_old_row_once(tmp_path: Path) -> None:
    import sqlite3

    from llmgw_slurm.accounting.usage import query_usage

    db = tmp_path / "usage.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute(
            "CREATE TABLE usage (ts REAL NOT NULL, key_id TEXT NOT NULL, user TEXT NOT NULL,"
            " project TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL,"
            " prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,"
            " total_tokens INTEGER NOT NULL)"
        )
        conn.execute("INSERT INTO usage VALUES (1, '', '', '', 'm', 'completions', 1, 1, 2)")
    conn.close()
    (row,) = query_usage(db)
    assert row.requests == 1 and row.total_tokens == 2
