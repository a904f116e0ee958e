"""``llmgw-admin`` status, drain, stop, reload and keys against a real in-thread daemon."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cli_support import RunningDaemon, add_decision, free_port, run_daemon, write_config
from click.testing import CliRunner

from llmgw_slurm.auth.keys import list_keys
from llmgw_slurm.cli.admin import main

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
    # Nothing proves a daemon there (no daemon.json): nothing is asked, nothing shown.
    assert code == 1 and out.startswith("Error: refusing to send the status request to http://")
    assert "is the daemon running?" in out
    code, out = admin("drain", "tiny", "--server", str(path))
    # No key yet: the daemon never ran with this config.
    assert code == 1 and "cannot look at state_dir" in out
    code, out = admin("status", "--server", str(tmp_path / "nope.yaml"))
    assert code == 1 and "does not exist" in out


def test_status_is_not_taken_from_a_squatter_on_the_gateway_port(tmp_path: Path) -> None:
    # The daemon crashed (its daemon.json left behind) and another user took its
    # port (issue 33, finding 9): before, llmgw-admin status showed what they answered.
    from llmgw_slurm.auth.identity import DaemonInfo, publish
    from llmgw_slurm.auth.private import public_dir
    from llmgw_slurm.config import load_server_config
    from tests.hostile_user import INTRUDER, squatting

    intruder = INTRUDER.ensure()
    gw, internal = free_port(), free_port()
    path = write_config(tmp_path, gw, internal, None)
    runtime = load_server_config(path).effective_runtime_dir()
    public_dir(runtime)
    publish(runtime, DaemonInfo(os.geteuid(), 1, gw, internal, False, ""))
    with squatting(INTRUDER, gw) as (sq,):
        code, out = admin("status", "--server", str(path))
        assert code == 1 and f"uid {intruder.pw_uid}" in out, out
        assert "Not showing a status that may not be the daemon's" in out
        os.environ["LLMGW_DAEMON_INFO"] = str(runtime / "daemon.json")
        try:
            code, out = admin("status", "--url", f"http://127.0.0.1:{gw}")
        finally:
            del os.environ["LLMGW_DAEMON_INFO"]
        assert code == 1 and f"uid {intruder.pw_uid}" in out, out
    assert sq.heard() == ""  # nothing was even asked


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
    assert code == 1 and "Error: nothing stopped (add --yes to skip the question)" in out
    assert "Cancel the replicas of 0000aaaa (0000aaaa) now" in out
    assert rd.backend.cancelled == []
    code, out = admin("stop", "0000aaaa", "--yes", *srv)
    assert code == 0, out
    assert "stopping 1 replica(s) of 0000aaaa: 0000aaaa" in out
    assert rd.backend.cancelled == ["777"]
    assert rd.rec.replicas["0000aaaa"].stop_reason == "stopped by an admin"


def test_stop_checks_the_target_before_asking(rd: RunningDaemon) -> None:
    rd.add_replica("tiny", "0000aaaa", "ready", job_id="777")
    srv = ["--server", str(rd.server_path)]
    # No input given: a prompt would abort, so the answers below come before any.
    code, out = admin("stop", "nope", *srv)
    assert code == 1 and "Cancel" not in out
    assert out.strip() == (
        "Error: no replica or model 'nope'; models: tiny, big-model; replicas: 0000aaaa"
    )
    code, out = admin("stop", "--node", "gpunode7", *srv)
    assert code == 1 and "Cancel" not in out and "no node 'gpunode7'" in out
    code, out = admin("stop", "big-model", *srv)
    assert code == 0 and out.strip() == "nothing to stop on big-model: no live replica there"
    assert rd.backend.cancelled == []
    assert [d.action for d in rd.rec.decisions] == []


def test_stop_asks_as_before_when_the_daemon_has_no_preview(
    rd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon older than the CLI (no stop-preview route): ask, then stop."""
    from llmgw_slurm.cli import admin as admin_mod
    from llmgw_slurm.cli.common import DaemonReply

    real = admin_mod._admin_request

    def old_daemon(server: Any, action: str, body: object = None) -> DaemonReply:
        if action == "stop-preview":
            return DaemonReply(404, None)  # aiohttp's own 404, not the API's
        return real(server, action, body)

    monkeypatch.setattr(admin_mod, "_admin_request", old_daemon)
    rd.add_replica("tiny", "0000aaaa", "ready", job_id="777")
    code, out = admin("stop", "tiny", "--server", str(rd.server_path), input="y\n")
    assert code == 0, out
    assert "Cancel the replicas of tiny now" in out and rd.backend.cancelled == ["777"]


def test_admin_routes_refuse_a_wrong_token(rd: RunningDaemon) -> None:
    import http.client

    port = rd.d.server.listen.internal.port
    for auth in ("Bearer wrong", "", "Bearer " + "x" * 64):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request(
            "POST", "/internal/v1/admin/drain", body=b"{}", headers={"Authorization": auth}
        )
        resp = conn.getresponse()
        assert (resp.status, b"bad or missing admin token" in resp.read()) == (401, True)
        conn.close()


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
    code, out = admin("keys", "add", "alice", "--account", "p1", *srv)
    assert code == 0, out
    key = next(ln for ln in out.splitlines() if ln.startswith("llmgw-"))
    assert "Shown once" in out
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
    assert code == 2 and "Invalid value for 'USER': user name 'bad name!' is not valid" in out


def test_keys_add_with_a_bad_name_is_a_usage_error_before_any_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    path = write_config(tmp_path, free_port(), free_port(), keys_file)
    srv = ["--server", str(path)]
    code, out = admin("keys", "add", "", *srv)
    assert code == 2 and "Invalid value for 'USER': user name '' is not valid" in out
    code, out = admin("keys", "add", "alice", "--account", "a b", *srv)
    assert code == 2 and "Invalid value for '--account': account name 'a b'" in out
    assert not keys_file.exists()


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
    assert "unknown model 'nope' (known: tiny)" in res.output


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
    res = CliRunner().invoke(main, ["config", "check"], env={"LLMGW_SERVER_CONFIG": ""})
    assert res.exit_code == 2 and "give --server, --models or --agent" in res.output


def test_status_from_llmgw_url_needs_no_server_yaml(
    rd: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the demo leaves a shell: LLMGW_URL set, LLMGW_SERVER_CONFIG not."""
    monkeypatch.delenv("LLMGW_SERVER_CONFIG", raising=False)
    monkeypatch.setenv("LLMGW_URL", rd.url + "/")
    code, out = admin("status")
    assert code == 0, out
    assert out.startswith(f"daemon {rd.url} · version") and "gpunode1" in out
    # A server.yaml given says which daemon, whatever LLMGW_URL says.
    monkeypatch.setenv("LLMGW_SERVER_CONFIG", str(rd.server_path.parent / "nope.yaml"))
    code, out = admin("status")
    assert code == 1 and "nope.yaml does not exist" in out
    code, out = admin("status", "--url", "notaurl", "--server", str(rd.server_path))
    assert code == 0, out
    monkeypatch.delenv("LLMGW_SERVER_CONFIG")
    code, out = admin("status", "--url", "notaurl")
    assert code == 2 and "'notaurl' must start with http:// or https://" in out


def test_nodes_count_the_replicas_started_since_the_listing(rd: RunningDaemon) -> None:
    """gpunode1 was listed with 3 of 4 GPUs free, 125 s ago (see _cli_support)."""
    listed = rd.rec.nodes_listed_at
    for rid, started in (("0000aaaa", listed + 30), ("0000bbbb", listed + 60)):
        rd.add_replica(
            "tiny", rid, "ready", nodes=("gpunode1",), started_at=started, gpus_per_node=1
        )
    # Running when the nodes were listed: sinfo counted it already.
    rd.add_replica(
        "tiny", "0000cccc", "ready", nodes=("gpunode1",), started_at=listed - 60, gpus_per_node=1
    )
    # A two-node replica with 2 GPUs a node, started since: 2 more on each.
    rd.add_replica(
        "big-model",
        "0000dddd",
        "ready",
        nodes=("gpunode1", "gpunode2"),
        started_at=listed + 1,
        gpus_per_node=2,
        node_count=2,
    )
    code, out = admin("status", "--json", "--server", str(rd.server_path))
    assert code == 0, out
    n1, n2 = json.loads(out)["nodes"]
    assert (n1["gpus_free_listed"], n1["gpus_placed_since_listing"], n1["gpus_free"]) == (3, 4, 0)
    assert (n2["gpus_free_listed"], n2["gpus_placed_since_listing"], n2["gpus_free"]) == (4, 2, 2)
    code, out = admin("status", "--server", str(rd.server_path))
    assert "ago, GPUs of the replicas started since counted in:" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("gpunode2"))
    assert row.split()[-1] == "2/4"
