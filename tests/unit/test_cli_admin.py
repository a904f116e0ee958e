"""``llmgw-admin`` status, drain, stop, reload and keys against a real in-thread daemon."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_support import RunningDaemon, add_decision, free_port, run_daemon, write_config
from click.testing import CliRunner

from llmgw_slurm.cli.admin import main
from llmgw_slurm.router.keys import list_keys

DATA = Path(__file__).parent / "data"


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    yield from run_daemon(tmp_path)


def admin(*args: str, input: str | None = None) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args), input=input)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


def test_serve_refuses_an_unknown_log_level_with_the_valid_ones(tmp_path: Path) -> None:
    code, out = admin("serve", "--server", str(tmp_path / "none.yaml"), "--log-level", "bogus")
    assert code == 2
    assert "Invalid value for '--log-level': 'bogus' is not one of" in out and "'debug'" in out


def test_status_shows_models_replicas_nodes_and_decisions(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", nodes=("gpunode1",), job_id="4242")
    rd.add_replica("big-model", "0000bbbb", "pending", reason="Resources", job_id="4243")
    add_decision(rd, "submit", "big-model", "0000bbbb", "scale up to 1: a request is waiting")
    code, out = admin("status", "--server", str(rd.server_path))
    assert code == 0, out
    assert "ready 1" in out and "queued (Resources)" in out
    rep = next(ln for ln in out.splitlines() if ln.startswith("0000aaaa"))
    assert rep.split()[:5] == ["0000aaaa", "tiny", "4242", "ready", "gpunode1"]
    pend = next(ln for ln in out.splitlines() if ln.startswith("0000bbbb"))
    assert "Resources" in pend
    assert "gpunode2" in out and "4/4" in out
    assert "nodes as Slurm listed them 2m" in out  # kept from a pass 125 s ago
    assert "ago  submit big-model 0000bbbb: scale up to 1: a request is waiting" in out
    for line in out.splitlines():
        if "ago " not in line:  # decisions are free text, the tables fit
            assert len(line) <= 80, line


def test_status_json_has_nodes_and_decisions(rd: RunningDaemon) -> None:
    add_decision(rd, "reap", "tiny", "0000cccc", "job 1 ended (FAILED)")
    code, out = admin("status", "--json", "--server", str(rd.server_path))
    assert code == 0
    data = json.loads(out)
    assert {"models", "decisions", "nodes", "passes", "version", "now"} <= set(data)
    assert data["decisions"][-1]["reason"] == "job 1 ended (FAILED)"
    assert [n["name"] for n in data["nodes"]] == ["gpunode1", "gpunode2"]
    assert data["nodes"][0]["gpus_free"] == 3
    assert data["nodes_listed_at"] == rd.rec.nodes_listed_at


def test_daemon_down_and_missing_server_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, free_port(), free_port(), None)
    code, out = admin("status", "--server", str(path))
    assert code == 1 and out.startswith("Error: cannot reach the llmgw daemon at http://127.0.0.1:")
    code, out = admin("drain", "tiny", "--server", str(path))
    # No key yet: the daemon never ran with this config.
    assert code == 1 and "no server key at" in out
    code, out = admin("status", "--server", str(tmp_path / "nope.yaml"))
    assert code == 1 and "does not exist" in out


def test_drain_model_replica_and_node(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", nodes=("gpunode1",))
    rd.add_replica("tiny", "0000dddd", "ready", nodes=("gpunode2",))
    srv = ["--server", str(rd.server_path)]
    code, out = admin("drain", "--node", "gpunode2", "--reason", "maintenance", *srv)
    assert code == 0, out
    assert out.strip() == "draining 1 replica(s) of node gpunode2: 0000dddd"
    r = rd.rec.replicas["0000dddd"]
    assert r.draining_since is not None and r.drain_reason == "maintenance"
    assert rd.rec.replicas["0000aaaa"].draining_since is None
    code, out = admin("drain", "test/tiny-chat", *srv)
    assert code == 0 and "0000aaaa" in out and "0000dddd" not in out
    assert rd.rec.decisions[-1].action == "drain"
    code, out = admin("drain", "big-model", *srv)
    assert code == 0 and "nothing to drain on big-model" in out
    assert rd.backend.cancelled == []


def test_drain_unknowns_list_what_exists(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", nodes=("gpunode1",))
    srv = ["--server", str(rd.server_path)]
    code, out = admin("drain", "nope", *srv)
    assert code == 1
    assert out.strip() == (
        "Error: no replica or model 'nope'; models: tiny, big-model; replicas: 0000aaaa"
    )
    code, out = admin("drain", "--node", "gpunode7", *srv)
    assert code == 1 and out.strip() == "Error: no node 'gpunode7'; nodes: gpunode1, gpunode2"
    code, out = admin("drain", *srv)
    assert code == 2 and "give a REPLICA or MODEL, or --node NODE" in out
    code, out = admin("drain", "tiny", "--node", "gpunode1", *srv)
    assert code == 2


def test_stop_cancels_now_and_asks_first(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", job_id="777")
    srv = ["--server", str(rd.server_path)]
    code, out = admin("stop", "0000aaaa", *srv, input="n\n")
    assert code == 1 and "Aborted" in out
    assert rd.backend.cancelled == []
    code, out = admin("stop", "0000aaaa", "--yes", *srv)
    assert code == 0, out
    assert "stopping 1 replica(s) of 0000aaaa: 0000aaaa" in out
    assert rd.backend.cancelled == ["777"]
    assert rd.rec.replicas["0000aaaa"].stop_reason == "stopped by an admin"


def test_admin_routes_refuse_a_wrong_token(rd: RunningDaemon) -> None:
    (Path(rd.d.server.state_dir) / "server.key").write_text("x" * 64 + "\n")
    code, out = admin("drain", "tiny", "--server", str(rd.server_path))
    assert code == 1 and "refused the admin token" in out


def test_reload_reports_a_refused_catalog(rd: RunningDaemon) -> None:
    srv = ["--server", str(rd.server_path)]
    code, out = admin("reload", *srv)
    assert code == 0 and out.strip() == "catalog reloaded: 2 model(s): tiny, big-model"
    models = rd.server_path.parent / "models.yaml"
    models.write_text("models:\n  - name: Bad Name\n")
    code, out = admin("reload", *srv)
    assert code == 1 and "catalog reload refused" in out and "models.yaml" in out
    assert [m.name for m in rd.rec.catalog.models] == ["tiny", "big-model"]


def test_keys_add_list_revoke(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    path = write_config(tmp_path, free_port(), free_port(), keys_file)
    srv = ["--server", str(path)]
    code, out = admin("keys", "add", "alice", "--project", "p1", *srv)
    assert code == 0, out
    key = out.splitlines()[1]
    assert key.startswith("llmgw-") and "Shown once" in out
    (rec,) = list_keys(keys_file)
    assert key not in keys_file.read_text() and rec.user == "alice"
    code, out = admin("keys", "list", *srv)
    assert code == 0 and rec.key_id in out and "alice" in out and key not in out
    code, out = admin("keys", "list", "--json", *srv)
    data = json.loads(out)
    assert data[0]["key_id"] == rec.key_id and data[0]["active"] is True
    assert "key" not in data[0]
    code, out = admin("keys", "revoke", rec.key_id, *srv)
    assert code == 0 and "revoked" in out
    code, out = admin("keys", "revoke", "deadbeef", *srv)
    assert code == 1 and f"known ids: {rec.key_id}" in out
    code, out = admin("keys", "add", "bad name!", *srv)
    assert code == 1 and "is not valid" in out


def test_keys_when_keys_are_off(tmp_path: Path) -> None:
    path = write_config(tmp_path, free_port(), free_port(), None)
    code, out = admin("keys", "list", "--server", str(path))
    assert code == 1 and "no router.keys_file: keys are off" in out


def test_script_prints_the_job_without_secrets(tmp_path: Path) -> None:
    import shutil

    from click.testing import CliRunner

    from llmgw_slurm.cli.admin import main as admin_main

    dev = Path(__file__).resolve().parents[2] / "site-config" / "dev"
    for name in ("server.yaml", "models.yaml", "agent.yaml"):
        shutil.copy(dev / name, tmp_path / name)
    res = CliRunner().invoke(
        admin_main, ["script", "test/tiny-chat", "--server", str(tmp_path / "server.yaml")]
    )
    assert res.exit_code == 0, res.output
    assert "sbatch --parsable --job-name=llmgw.tiny.0123abcd" in res.output
    assert "#SBATCH --gres=gpu:a100:1" in res.output
    assert "LLMGW_REPLICA_SECRET='***'" in res.output
    assert "LLMGW_ENGINE_API_KEY='***'" in res.output
    res = CliRunner().invoke(
        admin_main, ["script", "nope", "--server", str(tmp_path / "server.yaml")]
    )
    assert res.exit_code == 1
    assert "unknown model 'nope'; known: tiny" in res.output


def _stub_sinfo(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/sh\n" + body + "\n")
    (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_nodes_lists_free_gpus_per_node_from_one_sinfo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stub_sinfo(tmp_path, f"cat {DATA / 'sinfo.txt'}", monkeypatch)
    code, out = admin("nodes")
    assert code == 0, out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("gpunode")}
    assert rows["gpunode1"][:4] == ["gpunode1", "mixed", "llm,research", "a100:1/4"]
    assert rows["gpunode3"][3] == "a100:4/4"
    assert out.rstrip().endswith("4 nodes, 12 of 16 GPUs free")
    code, out = admin("nodes", "--json")
    assert code == 0
    assert {n["name"]: n["gpus_free"] for n in json.loads(out)} == {
        "gpunode1": 1,
        "gpunode2": 3,
        "gpunode3": 4,
        "gpunode4": 4,
    }


def test_nodes_says_when_sinfo_answers_something_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stub_sinfo(tmp_path, 'echo "sinfo: error: Unable to contact slurm controller"', monkeypatch)
    code, out = admin("nodes")
    assert code == 1
    assert out.startswith("Error: sinfo: none of its 1 line(s) is in the format asked for")
    code, out = admin("nodes", "--timeout", "-1")
    assert code == 2 and "Invalid value for '--timeout': -1.0 is not in the range x>0" in out


def test_config_check_command_reports_every_error_and_exits_1(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - name: a\n    scaling: {min: 2, max: 1}\n    engin: {}\n")
    res = CliRunner().invoke(main, ["config", "check", "--models", str(models)])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert lines[-1] == f"{len(lines) - 1} error(s)" and len(lines) >= 3
    assert all(ln.startswith(f"{models}:") for ln in lines[:-1]), lines
    assert any("engin" in ln and "valid" in ln for ln in lines)
    site = Path(__file__).resolve().parents[2] / "site-config"
    res = CliRunner().invoke(main, ["config", "check", "--server", str(site / "server.yaml")])
    assert res.exit_code == 0 and res.output.startswith("ok: "), res.output
    res = CliRunner().invoke(main, ["config", "check"])
    assert res.exit_code == 2 and "give at least one of --models, --server, --agent" in res.output
