"""systemd integration: the notify protocol on a socket the test binds, and log lines.

The daemon tests run the real ``daemon.serve`` (both listeners, the reconciler
loop, the signal handlers) with the Slurm backend swapped for a fake, and read
what systemd would read from ``$NOTIFY_SOCKET``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest
import yaml

from llmgw_slurm import daemon
from llmgw_slurm.base.errors import SlurmUnavailable
from llmgw_slurm.base.sdnotify import Notifier, log_handler
from llmgw_slurm.config import load_server_config
from llmgw_slurm.reconciler.jobs import job_name
from llmgw_slurm.slurm.types import Job, JobComponent, JobState, NodeInfo
from tests.ports import free_port

PREFIX = "llmgwnotify."


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket in the abstract namespace, as systemd binds its own."""
    name = f"llmgw-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.setblocking(False)
    try:
        yield "@" + name, s
    finally:
        s.close()


async def recv(s: socket.socket) -> str:
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(s, 4096), 30)
    return data.decode()


def test_sends_to_a_path_socket_and_takes_the_variable_out_of_the_environment(
    tmp_path: Path,
) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        env = {"NOTIFY_SOCKET": str(path), "OTHER": "x"}
        n = Notifier(env)
        assert env == {"OTHER": "x"}  # sbatch, a child, must not carry it into jobs
        assert n.ready("2 models; 0 ready")
        assert s.recv(4096) == b"READY=1\nSTATUS=2 models; 0 ready"


def test_abstract_namespace(listener: tuple[str, socket.socket]) -> None:
    address, s = listener
    n = Notifier({"NOTIFY_SOCKET": address})
    assert n.stopping()
    assert s.recv(4096) == b"STOPPING=1"
    assert not n.stopping()  # once


def test_status_is_sent_only_when_it_changes_and_stays_on_one_line(
    listener: tuple[str, socket.socket],
) -> None:
    address, s = listener
    n = Notifier({"NOTIFY_SOCKET": address})
    assert n.status("a")
    assert not n.status("a")
    assert n.status("b\nsecond line")
    assert s.recv(4096) == b"STATUS=a"
    assert s.recv(4096) == b"STATUS=b"


def test_reloading_carries_a_monotonic_timestamp(listener: tuple[str, socket.socket]) -> None:
    address, s = listener
    n = Notifier({"NOTIFY_SOCKET": address})
    before = time.monotonic()
    assert n.reloading()
    after = time.monotonic()
    m = re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=(\d+)", s.recv(4096))
    assert m is not None
    # Microseconds of CLOCK_MONOTONIC (what time.monotonic reads on Linux).
    assert before <= int(m.group(1)) / 1e6 <= after


def test_outside_systemd_or_with_nobody_listening_nothing_is_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not Notifier({}).enabled
    assert not Notifier({}).ready()
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    with caplog.at_level(logging.WARNING):
        assert not gone.ready()
        assert not gone.status("x")
    assert len([r for r in caplog.records if "cannot notify systemd" in r.message]) == 1


# ---- the daemon ------------------------------------------------------------------


class FakeSlurm:
    """Lists ``jobs`` and no nodes, or fails every call when ``down``; nothing else exists."""

    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.jobs: list[Job] = []
        self.calls = 0

    async def list_jobs(self, name_prefix: str = "") -> list[Job]:
        self.calls += 1
        if self.down:
            raise SlurmUnavailable("command not found", command=["squeue"])
        return list(self.jobs)

    async def list_nodes(self) -> list[NodeInfo]:
        self.calls += 1
        if self.down:
            raise SlurmUnavailable("command not found", command=["sinfo"])
        return []

    async def check(self) -> None:
        if self.down:
            raise SlurmUnavailable("command not found", command=["scontrol"])

    async def close(self) -> None:
        pass


def pending_job(model: str) -> Job:
    return Job(
        job_id="77",
        name=job_name(PREFIX, model, "0a1b2c3d"),
        state=JobState.PENDING,
        reason="Priority",
        partition="llm",
        user="llmgw",
        comment="",
        nodes=(),
        submit_time=datetime.now(),
        start_time=None,
        time_limit_s=3600,
        end_time=None,
        restarts=0,
        components=(JobComponent(0, "77", JobState.PENDING, (), 1, "gres:gpu:1"),),
    )


MODELS = {
    "models": [
        {
            "name": "m",
            "engine": {"kind": "command", "command": ["true", "{port}"]},
            "resources": {"gpus": 1, "partition": "llm", "time_limit": "1h"},
            "scaling": {"min": 0, "max": 1},
        }
    ]
}


def write_config(tmp_path: Path) -> Path:
    gw, internal = free_port(), free_port()
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(MODELS))
    (tmp_path / "server.yaml").write_text(
        yaml.safe_dump(
            {
                "slurm": {"job_prefix": PREFIX, "partition": "llm"},
                "listen": {"gateway": f"127.0.0.1:{gw}", "internal": f"127.0.0.1:{internal}"},
                "state_dir": str(tmp_path / "state"),
                "reconcile": {"interval": "0.1s"},
            }
        )
    )
    return tmp_path / "server.yaml"


def build(tmp_path: Path, address: str, fake: FakeSlurm) -> daemon.Daemon:
    path = write_config(tmp_path)
    server = load_server_config(path)
    os.environ["NOTIFY_SOCKET"] = address
    try:
        d = daemon.build(server, path)
    finally:
        os.environ.pop("NOTIFY_SOCKET", None)
    d.reconciler.backend = fake  # type: ignore[assignment]
    return d


async def test_ready_comes_after_the_listeners_and_a_failed_first_pass(
    tmp_path: Path, listener: tuple[str, socket.socket]
) -> None:
    address, s = listener
    d = build(tmp_path, address, FakeSlurm(down=True))
    assert "NOTIFY_SOCKET" not in os.environ
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.serve(d, stop))
    try:
        msg = await recv(s)
        assert (
            msg
            == "READY=1\nSTATUS=1 model; 0 ready; Slurm not answering: squeue: command not found"
        )
        assert d.reconciler.passes == 0 and d.reconciler.last_pass_error
        # Ready means serving: the gateway answers now, not later.
        port = d.server.listen.gateway.port
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/healthz") as resp,
        ):
            assert resp.status == 200
    finally:
        stop.set()
        await task
    assert await recv(s) == "STOPPING=1"


async def test_status_follows_the_passes_and_sighup_reloads_between_reloading_and_ready(
    tmp_path: Path, listener: tuple[str, socket.socket]
) -> None:
    address, s = listener
    fake = FakeSlurm()
    d = build(tmp_path, address, fake)
    task = asyncio.create_task(daemon.serve(d))
    try:
        assert await recv(s) == "READY=1\nSTATUS=1 model; 0 ready"
        assert d.reconciler.passes == 1
        # Passes that change nothing send nothing; the next datagram is the change.
        # Someone waits for m, so its queued job is kept (not cancelled as surplus).
        fake.jobs = [pending_job("m")]
        d.reconciler.want("m")
        assert await recv(s) == "STATUS=1 model; 0 ready; 1 starting"

        (tmp_path / "models.yaml").write_text("models: [{name: BAD}]\n")
        os.kill(os.getpid(), signal.SIGHUP)
        assert re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=\d+", await recv(s))
        assert await recv(s) == (
            "READY=1\nSTATUS=1 model; 0 ready; 1 starting; last catalog reload refused (see the log)"
        )

        two = {"models": [*MODELS["models"], {**MODELS["models"][0], "name": "n"}]}
        (tmp_path / "models.yaml").write_text(yaml.safe_dump(two))
        os.kill(os.getpid(), signal.SIGHUP)
        assert (await recv(s)).startswith("RELOADING=1\n")
        assert await recv(s) == "READY=1\nSTATUS=2 models; 0 ready; 1 starting"

        os.kill(os.getpid(), signal.SIGTERM)
        assert await recv(s) == "STOPPING=1"
        await asyncio.wait_for(task, 30)
    finally:
        if not task.done():
            task.cancel()
    # The handlers are gone with the daemon: SIGTERM is the default again.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


async def test_a_reload_before_ready_does_not_claim_readiness(
    tmp_path: Path, listener: tuple[str, socket.socket]
) -> None:
    address, s = listener
    d = build(tmp_path, address, FakeSlurm())
    assert d.reload() is None
    d.notifier.ready("x")
    assert await recv(s) == "READY=1\nSTATUS=x"  # the reload sent nothing before it


# ---- log lines -------------------------------------------------------------------


def record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("llmgw_slurm.x", level, __file__, 1, msg, None, None)


def test_log_lines_have_a_timestamp_outside_systemd_and_none_under_it() -> None:
    plain = log_handler(io.StringIO(), {}).format(record(logging.INFO, "hello"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO llmgw_slurm.x: hello", plain)
    for env in ({"INVOCATION_ID": "abc"}, {"JOURNAL_STREAM": "8:12345"}):
        h = log_handler(io.StringIO(), env)
        assert h.format(record(logging.INFO, "hello")) == "INFO llmgw_slurm.x: hello"


def test_log_lines_carry_the_syslog_priority_when_stderr_is_the_journal(tmp_path: Path) -> None:
    with open(tmp_path / "stream", "w") as f:
        st = os.fstat(f.fileno())
        h = log_handler(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert h.format(record(logging.WARNING, "careful")) == "<4>WARNING llmgw_slurm.x: careful"
        assert h.format(record(logging.ERROR, "bad")) == "<3>ERROR llmgw_slurm.x: bad"
        assert h.format(record(logging.INFO, "fine")).startswith("<6>")
        assert h.format(record(logging.DEBUG, "fine")).startswith("<7>")


def test_llmgw_admin_serve_as_systemd_runs_it(
    tmp_path: Path, listener: tuple[str, socket.socket]
) -> None:
    """The real command in its own process, with the environment systemd gives a service.

    PATH holds no Slurm commands, so every pass fails honestly, as with a
    slurmctld that is down: the daemon must still become ready.
    """
    address, s = listener
    s.setblocking(True)
    s.settimeout(60)
    server_yaml = write_config(tmp_path)
    top = Path(__file__).resolve().parents[2]
    env = {
        "PATH": str(Path(sys.executable).parent),
        "PYTHONPATH": str(top),
        "NOTIFY_SOCKET": address,
        "INVOCATION_ID": "0123456789abcdef0123456789abcdef",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from llmgw_slurm.cli.admin import main; main()",
            "serve",
            "--server",
            str(server_yaml),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = s.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=1 model; 0 ready; Slurm not answering: "), ready
        proc.send_signal(signal.SIGHUP)
        assert s.recv(4096).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        assert s.recv(4096) == ready.encode()
        proc.send_signal(signal.SIGTERM)
        assert s.recv(4096) == b"STOPPING=1"
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = err.splitlines()
    assert any(line.startswith("INFO llmgw_slurm.daemon: serving: gateway ") for line in lines), err
    assert any(line.startswith("INFO llmgw_slurm.daemon: catalog reloaded") for line in lines), err
    # No line starts with a date: the journal stamps them.
    assert not [line for line in lines if re.match(r"\d{4}-\d\d-\d\d", line)], err
