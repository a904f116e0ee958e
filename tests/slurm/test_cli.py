"""The CLIs against a real daemon on the dev cluster, and the status page in headless chromium.

One daemon for the module (its own job prefix and ports), with the dev
catalog's ``tiny`` (the test engine). The tests run in order: start the model,
chat with it, look at it, drain it, then audit the jobs sacct recorded.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_port

TOP = Path(__file__).resolve().parents[2]


@dataclass
class Daemon:
    server: Path
    url: str
    prefix: str
    proc: subprocess.Popen[bytes]
    log: Path


def _cli(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    code = f"from llmgw_slurm.cli.{module} import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(TOP), **(env or {})},
        check=False,
    )


def llmgw(d: Daemon, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    # The daemon.json llmgw checks the port's owner against (default runtime_dir: state_dir/run).
    info = {"LLMGW_DAEMON_INFO": str(d.server.parent / "state" / "run" / "daemon.json")}
    return _cli("researcher", "--url", d.url, *args, env=info, timeout=timeout)


def admin(
    d: Daemon, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return _cli("admin", *args, "--server", str(d.server), env=env)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, slurm_conf: str) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("cli")
    prefix = f"llmgwTcli{os.getpid() % 10000}."
    gw, internal = free_port(), free_port()
    dev = TOP / "site-config" / "dev"
    server = tmp / "server.yaml"
    server.write_text(
        (dev / "server.yaml")
        .read_text()
        .replace("job_prefix: llmgw.", f"job_prefix: {prefix}")
        .replace("127.0.0.1:18000", f"127.0.0.1:{gw}")
        .replace("127.0.0.1:18001", f"127.0.0.1:{internal}")
        .replace("state_dir: ../../.dev-cluster/llmgw", f"state_dir: {tmp / 'state'}")
        .replace("models: models.yaml", f"models: {dev / 'models.yaml'}")
        .replace("agent_config: agent.yaml", f"agent_config: {dev / 'agent.yaml'}")
    )
    assert prefix in server.read_text() and str(gw) in server.read_text()
    log = tmp / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from llmgw_slurm.cli.admin import main; main()",
                "serve",
                "--server",
                str(server),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(TOP)},
        )
    d = Daemon(server, f"http://127.0.0.1:{gw}", prefix, proc, log)
    deadline = time.monotonic() + 30
    while llmgw(d, "models").returncode != 0:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the daemon did not answer:\n" + log.read_text()
        time.sleep(0.5)
    try:
        yield d
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        jobs = subprocess.run(
            ["squeue", "-h", "--me", "-o", "%i %j"], capture_output=True, text=True, check=False
        ).stdout
        mine = [
            ln.split()[0]
            for ln in jobs.splitlines()
            if ln.split()[1:] and ln.split()[1].startswith(prefix)
        ]
        if mine:
            subprocess.run(["scancel", *mine], check=False)


def test_1_models_lists_tiny_cold(daemon: Daemon) -> None:
    r = llmgw(daemon, "models", "--json")
    assert r.returncode == 0, r.stderr
    (tiny,) = json.loads(r.stdout)
    assert tiny["name"] == "tiny" and tiny["aliases"] == ["test/tiny-chat"]
    assert tiny["state"] == "cold" and tiny["endpoint"] == daemon.url + "/v1"


# The cold start of test_2, as the test saw it (epoch seconds): test_2b compares the trace.
COLD_START: dict[str, float] = {}


def test_2_up_waits_until_ready(daemon: Daemon) -> None:
    COLD_START["asked"] = time.time()
    r = llmgw(daemon, "up", "tiny", "--timeout", "150")
    COLD_START["ready"] = time.time()
    assert r.returncode == 0, r.stdout + r.stderr
    # Not a TTY: one line per phase on stderr, each with the time since the request;
    # the endpoint alone on stdout.
    lines = r.stderr.splitlines()
    assert lines and all(re.match(r"^\[\s*\d+[sm]", ln) for ln in lines), r.stderr
    assert lines[-1].endswith("] ready") and r.stdout.startswith("tiny is ready: ")
    r = llmgw(daemon, "models")
    assert re.search(r"^tiny\s+test/tiny-chat\s+ready 1\s+1/1\s+1\s", r.stdout, re.M), r.stdout


def _trace(d: Daemon, deadline: float) -> dict[str, Any]:
    """``llmgw-admin trace tiny --json`` once the agent's spans are in (it sends them
    as its start ends, beside the ready report)."""
    while True:
        r = admin(d, "trace", "tiny", "--json")
        assert r.returncode == 0, r.stderr
        data: dict[str, Any] = json.loads(r.stdout)
        wf = data["waterfall"]
        if any(row["label"].startswith("agent on ") for row in wf["rows"]):
            return data
        assert time.monotonic() < deadline, r.stdout
        time.sleep(0.5)


def test_2b_trace_shows_every_step_of_the_cold_start(daemon: Daemon) -> None:
    wf = _trace(daemon, time.monotonic() + 30)["waterfall"]
    rows = wf["rows"]
    top = [r for r in rows if r["depth"] == 0 and r["counted"]]
    labels = [r["label"] for r in top]
    assert labels[0].startswith("placed by pass ")
    assert labels[1:4] == ["queued in Slurm", "job launch", "agent start-up"]
    assert re.fullmatch(r"agent on gpunode\d", labels[4]) and labels[5] == "daemon: ready"
    steps = [r["label"] for r in rows if r["depth"] == 2]
    assert steps == ["weights", "rendezvous", "engine_launch", "readiness", "register"]
    assert rows[-1]["label"] == "serving" and not rows[-1]["counted"]
    # Every step on the node is within the agent's row, one after the other.
    agent = top[4]
    for a, b in itertools.pairwise([r for r in rows if r["depth"] == 2]):
        assert agent["start"] <= a["start"] <= a["end"] <= b["start"] <= agent["end"]
    # The rows follow each other and add up to the time to serve ...
    for a, b in itertools.pairwise(top):
        assert a["end"] == b["start"]
    tts = wf["time_to_serve_s"]
    assert sum(r["duration_s"] for r in top) == pytest.approx(tts, abs=1e-6)
    # ... which is within what the test measured around `llmgw up` (same clock:
    # the dev cluster is this machine): asked before the pass, ready after.
    assert COLD_START["asked"] <= wf["start"] and wf["ready_at"] <= COLD_START["ready"]
    measured = COLD_START["ready"] - COLD_START["asked"]
    print(f"time to serve {tts:.3f}s in the trace, {measured:.3f}s measured around llmgw up")
    r = admin(daemon, "trace", "tiny", "--no-color")
    assert r.returncode == 0, r.stderr
    assert f"time to serve: {tts:.3f}s" in r.stdout and "\x1b[" not in r.stdout
    print(r.stdout)
    r = admin(daemon, "trace", "nope")
    assert r.returncode == 1 and "no start of 'nope' among the traces kept" in r.stderr


def test_3_chat_answers(daemon: Daemon) -> None:
    r = llmgw(daemon, "chat", "tiny", "hi there")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hi there")


def test_4_admin_status_shows_the_replica_and_its_job(daemon: Daemon) -> None:
    r = admin(daemon, "status")
    assert r.returncode == 0, r.stderr
    rep = [ln for ln in r.stdout.splitlines() if re.match(r"^[0-9a-f]{8}\s+tiny\s+\d+\s+ready", ln)]
    assert len(rep) == 1, r.stdout
    job_id = rep[0].split()[2]
    sq = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%j"], capture_output=True, text=True, check=False
    ).stdout
    assert sq.strip().startswith(daemon.prefix + "tiny.")
    assert re.search(r"ago  submit tiny [0-9a-f]{8}: scale up", r.stdout)
    assert "gpunode" in r.stdout


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.tags: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.tags.append(tag)
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if not self._in_style:
            self.parts.append(data)


def test_5_status_page_in_headless_chromium(daemon: Daemon, tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: run scripts/install-deps"
    r = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            daemon.url + "/",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    page = _Text()
    page.feed(r.stdout)
    text = " ".join(" ".join(page.parts).split())
    # What a person sees: the model, its state, its replica, a decision with its reason.
    assert "llmgw-slurm" in text and "Models" in text
    assert re.search(r"tiny test/tiny-chat ready 1 1", text), text
    assert re.search(r"replica [0-9a-f]{8} · job \d+ · ready", text), text
    assert re.search(r"submit tiny [0-9a-f]{8} scale up to 1", text), text
    assert f"{daemon.url}/v1" in text
    assert "script" not in page.tags
    shot = tmp_path / "page.png"
    r = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            f"--user-data-dir={tmp_path / 'profile2'}",
            f"--screenshot={shot}",
            "--window-size=1200,900",
            daemon.url + "/",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]


class _Svgs(HTMLParser):
    """Every element of the page's SVGs with its attributes, and which chart it is in."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], dict[str, str]]] = []
        self._svg: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self._svg = a
        self.found.append((tag, a, self._svg))


def _num(v: float) -> str:
    return f"{v:.4g}"


def _chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: run scripts/install-deps"
    return subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            f"--user-data-dir={profile}",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _charts_api(d: Daemon) -> dict[str, Any]:
    with urllib.request.urlopen(d.url + "/api/v1/charts", timeout=30) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def _page_matches_api(d: Daemon, profile: Path) -> tuple[bool, str]:
    """Load the page in chromium; do its SVGs' numbers match the API's (asked just before)?"""
    api = _charts_api(d)
    r = _chromium(d.url + "/", profile, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    svgs = _Svgs()
    svgs.feed(r.stdout)
    # GPU hours by model: tiny's bar is accounting's number (running jobs count to now,
    # so a refresh between the two asks may change it: the caller asks again).
    gpu = {
        a["data-label"]: a["data-value"]
        for t, a, svg in svgs.found
        if t == "g" and svg.get("class") == "bars"
    }
    want_gpu = api["gpu_hours"]["by_model"].get("tiny")
    if want_gpu is None or gpu.get("tiny") != _num(want_gpu):
        return False, f"GPU hours: page {gpu}, API {api['gpu_hours']}"
    # The cold start's waterfall: each drawn row is the API's row.
    (wf,) = [w for w in api["cold_starts"] if w["model"] == "tiny"]
    want_rows = [
        (("   " if r["depth"] else "") + r["label"], _num(r["duration_s"]))
        for r in wf["rows"]
        if r["counted"] and r["depth"] in (0, 2)
    ]
    rows = [
        (a["data-label"], a["data-value"])
        for t, a, svg in svgs.found
        if t == "g" and svg.get("class") == "waterfall" and svg.get("data-model") == "tiny"
    ]
    assert rows == want_rows, (rows, want_rows)
    # The hour: the replicas line has the API's points, the live last one aside.
    lines = {
        (svg.get("data-panel"), a["data-series"]): a["data-values"].split()
        for t, a, svg in svgs.found
        if t == "polyline" and svg.get("data-model") == "tiny"
    }
    names = ["t", *api["history"]["series"]]
    pts = api["history"]["models"]["tiny"]
    want_reps = [_num(p[names.index("replicas")]) for p in pts]
    got_reps = lines[("replicas", "replicas")]
    if got_reps[:-1] != want_reps[:-1]:
        return False, f"replicas: page {got_reps}, API {want_reps}"
    assert set(lines) == {
        ("requests/s", "rps"),
        ("tokens/s", "tokens_per_s"),
        ("time to first byte p50, p95", "ttfb_p50"),
        ("time to first byte p50, p95", "ttfb_p95"),
        ("held requests", "held"),
        ("replicas", "replicas"),
    }
    assert "script" not in {t for t, _, _ in svgs.found}
    return True, ""


def test_6_drain_then_the_replica_goes(daemon: Daemon) -> None:
    r = admin(daemon, "drain", "tiny", "--reason", "test drain")
    assert r.returncode == 0, r.stderr
    assert re.match(r"draining 1 replica\(s\) of tiny: [0-9a-f]{8}$", r.stdout.strip())
    rid = r.stdout.strip().rsplit(" ", 1)[1]
    deadline = time.monotonic() + 60
    while True:
        st = json.loads(admin(daemon, "status", "--json").stdout)
        gone = [
            d for d in st["decisions"] if d["replica"] == rid and d["action"] in ("cancel", "gone")
        ]
        if gone:
            break
        assert time.monotonic() < deadline, st["decisions"]
        time.sleep(1)
    assert any(d["action"] == "drain" and d["reason"] == "test drain" for d in st["decisions"])
    r = admin(daemon, "drain", "nope")
    assert r.returncode == 1 and "no replica or model 'nope'; models: tiny" in r.stderr


def test_7_audit_reads_the_jobs_from_sacct(daemon: Daemon) -> None:
    # Jobs of this module only: ours are the only ones with this prefix.
    deadline = time.monotonic() + 90
    while True:
        r = admin(daemon, "audit", "--since", "2h", "--json")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        rows = [x for x in data["rows"] if x["model"] == "tiny"]
        if rows and sum(x["jobs"] for x in rows) >= 1 and sum(x["gpu_hours"] for x in rows) > 0:
            break
        assert time.monotonic() < deadline, r.stdout
        time.sleep(2)
    assert data["job_prefix"] == daemon.prefix and data["by"] == "day"
    today = datetime.now().strftime("%Y-%m-%d")
    assert rows[-1]["period"] in (today, (datetime.now() - timedelta(days=1)).strftime("%Y-%m-%d"))
    r = admin(daemon, "audit", "--since", "2h", "--csv")
    assert r.stdout.splitlines()[0] == "period,model,jobs,gpu_hours,failed,timeout,preempted"
    assert any(ln.split(",")[1] == "tiny" for ln in r.stdout.splitlines()[1:])
    r = admin(daemon, "audit", "--since", "2h", "--by", "month")
    assert r.returncode == 0 and re.search(r"^\d{4}-\d\d\s+tiny\s+\d+", r.stdout, re.M), r.stdout
    r = admin(daemon, "audit", "--since", "2h", "--chart", "--no-color", env={"COLUMNS": "70"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == "GPU hours by model" and lines[2].startswith("tiny ") and "█" in lines[2]
    assert "GPU hours by day" in lines and all(len(ln) <= 70 for ln in lines[1:])


def test_8_audit_with_slurmdbd_unreachable(daemon: Daemon, tmp_path: Path, slurm_conf: str) -> None:
    # The real sacct against a slurm.conf whose accounting port has nobody behind it.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        re.sub(
            r"(?m)^AccountingStoragePort=.*$",
            f"AccountingStoragePort={free_port()}",
            Path(slurm_conf).read_text(),
        )
    )
    r = admin(daemon, "audit", env={"SLURM_CONF": str(conf)})
    assert r.returncode == 1
    assert r.stderr.startswith("Error: cannot reach accounting (slurmdbd): ")
    assert "Traceback" not in r.stderr


def test_8b_status_page_charts_are_the_apis_numbers(daemon: Daemon, tmp_path: Path) -> None:
    # Accounting is asked within a minute of the last decision (the drain, by now).
    deadline = time.monotonic() + 150
    while True:
        ok, why = _page_matches_api(daemon, tmp_path / "profile")
        if ok:
            break
        assert time.monotonic() < deadline, why
        time.sleep(3)
    # docs/img/status-charts.png (shown in docs/operations.md) is refreshed only when
    # asked (LLMGW_UPDATE_DOCS_IMAGES=1): a test run must not change tracked files.
    shot = tmp_path / "status-charts.png"
    r = _chromium(
        daemon.url + "/",
        tmp_path / "profile2",
        f"--screenshot={shot}",
        "--window-size=1280,1500",
        "--hide-scrollbars",
    )
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]
    if os.environ.get("LLMGW_UPDATE_DOCS_IMAGES") == "1":
        shutil.copyfile(shot, TOP / "docs" / "img" / "status-charts.png")


def test_9_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    exe = shutil.which("llmgw-admin")
    if analyze is None or exe is None:
        pytest.skip("systemd-analyze or llmgw-admin not on PATH")
    unit = tmp_path / "llmgw-slurm.service"
    unit.write_text(
        (TOP / "site-config" / "llmgw-slurm.service")
        .read_text()
        .replace("/usr/local/bin/llmgw-admin", exe)
    )
    sock = tmp_path / "llmgw-slurm.socket"
    sock.write_text((TOP / "site-config" / "llmgw-slurm.socket").read_text())
    r = subprocess.run(
        [analyze, "verify", str(unit), str(sock)], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr
    # verify only warns about what it cannot parse: any line about the unit is a mistake.
    assert "llmgw-slurm.service" not in r.stderr, r.stderr
    assert "llmgw-slurm.socket" not in r.stderr, r.stderr
