"""``llmgw`` against a real daemon (gateway + status API) with no Slurm behind it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_support import RunningDaemon, free_port, run_daemon
from click.testing import CliRunner

from llmgw_slurm.accounting.usage import UsageRecord
from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.cli import settings
from llmgw_slurm.cli.charts import bar
from llmgw_slurm.cli.researcher import _phase, main


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    yield from run_daemon(tmp_path)


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("LLMGW_URL", raising=False)
    monkeypatch.delenv("LLMGW_API_KEY", raising=False)


def llmgw(*args: str, url: str | None = None, input: str | None = None) -> tuple[int, str]:
    argv = (["--url", url] if url else []) + list(args)
    res = CliRunner().invoke(main, argv, input=input)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


def assert_fits_80(out: str) -> None:
    for line in out.splitlines():
        assert len(line) <= 80, line


def test_daemon_unreachable_is_one_line_exit_1() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (
        ["models"],
        ["models", "--json"],
        ["up", "tiny"],
        ["usage"],
        ["chat", "tiny", "hi"],
    ):
        code, out = llmgw(*args, url=url)
        assert code == 1, (args, out)
        if args[0] == "chat":
            # A prompt goes only to a server proven the daemon: here nothing is there.
            assert out.startswith(f"Error: refusing to send your prompt to {url}"), out
        else:
            assert out.startswith(f"Error: cannot reach the llmgw daemon at {url}"), (args, out)
        assert "Traceback" not in out
        assert len(out.strip().splitlines()) == 1


def test_url_from_env_and_from_config_file(
    rd: RunningDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "xdg" / "llmgw" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f"url: {rd.url}\n")
    code, out = llmgw("models")
    assert code == 0 and "tiny" in out
    cfg.write_text(f"url: {rd.url}\nurl_typo: 1\n")
    code, out = llmgw("models")
    assert code == 1 and "unknown setting(s) url_typo" in out and str(cfg) in out
    cfg.write_text("url: [unclosed\n")
    code, out = llmgw("models")
    assert code == 1 and "not valid YAML" in out
    cfg.write_bytes(b"url: http://caf\xe9:8000\n")  # Latin-1, not UTF-8
    code, out = llmgw("models")
    assert code == 1 and f"Error: {cfg}: not UTF-8 text (byte 15)" in out
    cfg.unlink()
    monkeypatch.setenv("LLMGW_URL", rd.url)
    code, out = llmgw("models")
    assert code == 0 and "tiny" in out
    code, out = llmgw("models", url="ftp://x")
    assert code == 2 and "Invalid value for '--url': 'ftp://x' must start with http://" in out
    cfg.write_text("url: login1:8000\n")
    monkeypatch.delenv("LLMGW_URL")
    code, out = llmgw("models")
    # From the config file: not a usage error, and the file is named.
    assert code == 1 and "must start with http://" in out and str(cfg) in out


def test_a_url_that_is_not_one_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = llmgw("models", url="notaurl")
    assert code == 2 and "Invalid value for '--url': 'notaurl' must start with http://" in out
    monkeypatch.setenv("LLMGW_URL", "notaurl")
    code, out = llmgw("usage")
    assert code == 2 and "'notaurl' must start with http://" in out
    # --help still works, whatever the URL.
    code, out = llmgw("--help")
    assert code == 0 and "Usage:" in out


def test_models_table_states_and_endpoint(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", nodes=("gpunode1",))
    rd.add_replica("big-model", "0000bbbb", "pending", reason="Resources")
    code, out = llmgw("models", url=rd.url)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["MODEL", "ALIASES", "STATE", "REPLICAS", "GPUS", "DESCRIPTION"]
    tiny = next(ln for ln in lines if ln.startswith("tiny"))
    assert "test/tiny-chat" in tiny and "ready 1" in tiny and " 1/1 " in tiny
    big = next(ln for ln in lines if ln.startswith("big-model"))
    assert "queued (Resources)" in big and big.split()[-2:] == ["8", "-"]
    assert f"Endpoint (OpenAI API): {rd.url}/v1" in out
    assert_fits_80(out)


def test_models_json_shape(rd: RunningDaemon) -> None:
    code, out = llmgw("models", "--json", url=rd.url)
    assert code == 0
    data = json.loads(out)
    assert [m["name"] for m in data] == ["tiny", "big-model"]
    assert set(data[0]) == {
        "name",
        "aliases",
        "description",
        "state",
        "reason",
        "ready_replicas",
        "note",
        "gpus",
        "replicas",
        "endpoint",
    }
    assert data[0]["state"] == "cold" and data[0]["endpoint"] == rd.url + "/v1"
    assert data[0]["aliases"] == ["test/tiny-chat"]


def test_up_unknown_model_lists_known(rd: RunningDaemon) -> None:
    code, out = llmgw("up", "nope", url=rd.url)
    assert code == 1
    assert out.strip() == "Error: unknown model 'nope' (known: tiny, big-model)"


def test_up_ready_model_returns_at_once_and_asks_for_nothing(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    res = CliRunner().invoke(main, ["--url", rd.url, "up", "test/tiny-chat"])
    assert res.exit_code == 0, res.output
    assert "] ready" in res.stderr and res.stdout == f"tiny is ready: {rd.url}/v1 (model 'tiny')\n"
    # Nothing waits for a ready model: a drain right after must not start it again
    # "because a request is waiting" (the daemon's plan reads held_since).
    assert rd.call(lambda: rd.rec.directory.held_since().get("tiny")) is None


def test_up_timeout_says_it_goes_on(rd: RunningDaemon) -> None:
    rd.add_replica("big-model", "0000bbbb", "pending", reason="Priority")
    code, out = llmgw("up", "big-model", "--timeout", "0", url=rd.url)
    assert code == 1
    assert "queued (Priority)" in out
    assert "Error: big-model is not ready after" in out and "goes on starting" in out


def test_ctrl_c_during_up_stops_waiting_and_leaves_the_start_going(rd: RunningDaemon) -> None:
    # A real process and a real SIGINT: CliRunner cannot deliver one.
    rd.add_replica("big-model", "0000bbbb", "pending", reason="Priority")
    cli = [sys.executable, "-c", "from llmgw_slurm.cli.researcher import main; main()"]
    proc = subprocess.Popen(
        [*cli, "--url", rd.url, "up", "big-model"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the first progress line: it is waiting now
        assert "queued (Priority)" in first, first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Stopped waiting; big-model goes on starting (`llmgw models` shows it)." in err
    assert "Traceback" not in err
    # Nothing was withdrawn: the daemon still has the request for it.
    assert rd.call(lambda: rd.rec.directory.wanted_at().get("big-model")) is not None
    assert rd.backend.cancelled == []


def test_phase_words() -> None:
    assert _phase({"state": "ready", "ready_replicas": 2, "replicas": []}) == "ready"
    assert _phase({"state": "cold", "replicas": []}) == "requested"
    assert (
        _phase(
            {
                "state": "queued",
                "reason": "Resources",
                "replicas": [{"state": "pending", "reason": "Resources"}],
            }
        )
        == "queued (Resources)"
    )
    starting = {"state": "starting", "replicas": [{"state": "starting", "step": "weights started"}]}
    assert _phase(starting) == "fetching weights"
    starting["replicas"][0]["step"] = "readiness started"  # type: ignore[index]
    assert _phase(starting) == "loading the engine"
    # Ready on the job's side, not yet reached by the gateway: not "job started" again.
    starting["replicas"][0]["step"] = "ready"  # type: ignore[index]
    assert _phase(starting) == "the engine is up; the gateway checks it"
    starting["replicas"][0]["step"] = "engine_launch failed"  # type: ignore[index]
    assert _phase(starting) == "launching the engine failed"
    assert _phase({"state": "failing", "note": "engine exited 1", "replicas": []}) == (
        "failing: engine exited 1"
    )


def test_chat_streams_through_the_gateway(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    code, out = llmgw("chat", "tiny", "hello small world", url=rd.url)
    assert code == 0, out
    # The test engine repeats the prompt's words.
    assert out.startswith("hello small world")


def test_chat_prompt_from_stdin(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready")
    code, out = llmgw("chat", "tiny", url=rd.url, input="from stdin\n")
    assert code == 0, out
    assert out.startswith("from stdin")


def test_chat_unknown_model_and_empty_prompt(rd: RunningDaemon) -> None:
    code, out = llmgw("chat", "nope", "hi", url=rd.url)
    assert code == 1 and out == "Error: unknown model 'nope' (known: tiny, big-model)\n"
    code, out = llmgw("chat", "tiny", url=rd.url, input="  \n")
    assert code == 2 and "the prompt is empty" in out


def test_usage_without_keys_shows_the_gateways_totals(rd: RunningDaemon) -> None:
    store = rd.d.gateway[researcher_gateway_key()].usage
    assert store is not None
    now = time.time()
    # Keys off: records carry no key; an old one from when keys were on counts too.
    for key_id, model, toks in (("", "tiny", 10), ("", "tiny", 5), ("ab12cd34", "big-model", 7)):
        store.record(UsageRecord(now, key_id, "", "", model, "completions", toks, 1, toks + 1))
    store.record(UsageRecord(now - 3 * 86400, "", "", "", "tiny", "completions", 1000, 1, 1001))
    code, out = llmgw("usage", "--since", "1d", "--json", url=rd.url)
    assert code == 0, out
    data = json.loads(out)
    assert data["scope"] == "gateway" and "key_id" not in data and "user" not in data
    assert data["models"] == [
        {
            "model": "big-model",
            "requests": 1,
            "prompt_tokens": 7,
            "completion_tokens": 1,
            "total_tokens": 8,
        },
        {
            "model": "tiny",
            "requests": 2,
            "prompt_tokens": 15,
            "completion_tokens": 2,
            "total_tokens": 17,
        },
    ]
    code, out = llmgw("usage", url=rd.url)
    assert code == 0, out
    assert out.startswith("Usage of the whole gateway (it has no API keys) since 30d:")
    total = next(ln for ln in out.splitlines() if ln.startswith("total"))
    assert total.split() == ["total", "4", "1022", "4", "1026"]
    assert_fits_80(out)


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[RunningDaemon, str, str]]:
    keys_file = tmp_path / "keys.json"
    mine = add_key(keys_file, "alice", "proj1")
    other = add_key(keys_file, "bob")
    for rd in run_daemon(tmp_path, keys_file=keys_file):
        store = rd.d.gateway[researcher_gateway_key()].usage
        assert store is not None
        now = time.time()
        for key, model, toks in ((mine, "tiny", 10), (mine, "tiny", 5), (other, "tiny", 99)):
            store.record(
                UsageRecord(
                    now,
                    key.record.key_id,
                    key.record.user,
                    key.record.project,
                    model,
                    "chat/completions",
                    toks,
                    1,
                    toks + 1,
                )
            )
        yield rd, mine.key, mine.record.key_id


def researcher_gateway_key():  # type: ignore[no-untyped-def]
    from llmgw_slurm.router.gateway import GATEWAY_KEY

    return GATEWAY_KEY


def test_usage_is_the_callers_own(keyed: tuple[RunningDaemon, str, str]) -> None:
    rd, key, key_id = keyed
    code, out = llmgw("--key", key, "usage", "--json", url=rd.url)
    assert code == 0, out
    data = json.loads(out)
    assert data["key_id"] == key_id and data["user"] == "alice"
    assert data["models"] == [
        {
            "model": "tiny",
            "requests": 2,
            "prompt_tokens": 15,
            "completion_tokens": 2,
            "total_tokens": 17,
        }
    ]
    code, out = llmgw("--key", key, "usage", url=rd.url)
    assert code == 0 and "alice" in out and "total" in out
    assert_fits_80(out)


def test_usage_bad_or_missing_key(keyed: tuple[RunningDaemon, str, str]) -> None:
    rd, _, _ = keyed
    code, out = llmgw("usage", url=rd.url)
    assert code == 1 and "no valid API key" in out
    code, out = llmgw("--key", "llmgw-00000000-" + "x" * 43, "usage", url=rd.url)
    assert code == 1 and "no valid API key" in out


def test_usage_since_that_is_not_a_time_is_a_usage_error() -> None:
    res = CliRunner().invoke(main, ["--url", "http://127.0.0.1:9", "usage", "--since", "soon"])
    assert res.exit_code == 2
    assert "'soon': use now, a duration ago" in res.output


def test_completion_script_mentions_the_env_var() -> None:
    res = CliRunner().invoke(main, [], env={"_LLMGW_COMPLETE": "bash_source"}, prog_name="llmgw")
    assert res.exit_code == 0
    assert "_LLMGW_COMPLETE=bash_complete" in res.output


def test_help_works_with_a_broken_config(tmp_path: Path) -> None:
    cfg = tmp_path / "xdg" / "llmgw" / "config.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("::: not yaml [")
    code, out = llmgw("--help")
    assert code == 0 and "models" in out
    assert settings.config_path() == cfg


def test_usage_chart_is_bars_as_wide_as_the_terminal(
    rd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = rd.d.gateway[researcher_gateway_key()].usage
    assert store is not None
    now = time.time()
    store.record(UsageRecord(now, "", "", "", "tiny", "completions", 30, 10, 40))
    store.record(UsageRecord(now, "", "", "", "big-model", "completions", 5, 5, 10))
    monkeypatch.setenv("COLUMNS", "60")
    code, out = llmgw("usage", "--since", "1d", "--chart", "--no-color", url=rd.url)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1] == "tokens by model (prompt + completion)"
    tiny, big = lines[2], lines[3]
    assert tiny.split()[:2] == ["tiny", "40"] and big.split()[:2] == ["big-model", "10"]
    # Scaled to the largest, to an eighth of a cell.
    assert big.split()[2] == bar(10, 40, len(tiny.split()[2])) and "\x1b[" not in out
    assert all(len(ln) <= 60 for ln in lines)
