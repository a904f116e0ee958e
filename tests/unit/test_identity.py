"""Telling the daemon from another user who holds its port (issue 13, item 2).

The squatters here are real processes of a second Unix user
(tests/hostile_user.py), so the kernel's own records are what is checked.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_support import RunningDaemon, free_port, run_daemon
from click.testing import CliRunner

from llmgw_slurm.auth.identity import (
    DaemonInfo,
    check_listener,
    listening_uids,
    publish,
    read_info,
    verify_url,
)
from llmgw_slurm.base.errors import UnverifiedServerError
from llmgw_slurm.cli.admin import main as admin_main
from llmgw_slurm.cli.admin import unix_call
from llmgw_slurm.cli.researcher import main as llmgw_main
from tests.hostile_user import INTRUDER, Squatter, world_dir


@pytest.fixture
def rd(tmp_path: Path) -> Iterator[RunningDaemon]:
    yield from run_daemon(tmp_path)


def squat(target: str) -> Squatter:
    return Squatter(INTRUDER, target)


def heard(sq: Squatter) -> str:
    return sq.heard()


# ---- the kernel's listeners ----------------------------------------------------------


def test_listening_uids_reads_ipv4_and_ipv6_listeners_only(tmp_path: Path) -> None:
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    (tmp_path / "tcp").write_text(
        head
        + "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001 0 1\n"
        + "   1: 0100007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1002 0 2\n"
        + "   2: 00000000:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0 0 3\n"
    )
    (tmp_path / "tcp6").write_text(
        head + "   0: 00000000000000000000000000000000:1F40 "
        "00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000"
        "  1003 0 4\n"
    )
    assert listening_uids(8000, tmp_path) == [1001, 1003]
    assert listening_uids(8001, tmp_path) == [0]
    assert listening_uids(8002, tmp_path) == []


def test_a_port_another_user_holds_is_refused_naming_the_uid() -> None:
    port = free_port()
    with pytest.raises(UnverifiedServerError, match=f"nothing listens on port {port}"):
        check_listener(port, os.geteuid())
    p = squat(str(port))
    try:
        with pytest.raises(UnverifiedServerError) as err:
            check_listener(port, os.geteuid())
        assert f"port {port} is held by uid {INTRUDER.uid}, not by the daemon" in str(err.value)
        # Its own check: the intruder's port is the intruder's.
        check_listener(port, INTRUDER.uid)
    finally:
        heard(p)


# ---- daemon.json -----------------------------------------------------------------------


def info(port: int, uid: int | None = None) -> DaemonInfo:
    uid = os.geteuid() if uid is None else uid
    return DaemonInfo(uid, os.getpid(), port, port + 1, False, "/nonexistent/admin.sock")


def test_daemon_json_is_trusted_only_where_nobody_else_could_have_written_it() -> None:
    with world_dir() as d:
        run = d / "run"
        run.mkdir(mode=0o755)
        path = publish(run, info(8000))
        assert oct(path.stat().st_mode & 0o777) == "0o644"
        assert read_info(path) == info(8000)
        # Another user's file naming the daemon's uid: a forgery.
        os.chown(path, INTRUDER.uid, INTRUDER.gid)
        with pytest.raises(UnverifiedServerError, match=f"belongs to uid {INTRUDER.uid}"):
            read_info(path)
        os.chown(path, 0, 0)
        # A folder others may write: the file could have been swapped.
        run.chmod(0o777)
        with pytest.raises(UnverifiedServerError, match="may be written by other users"):
            read_info(path)
        run.chmod(0o755)
        # The intruder's own file, in the intruder's own folder, claiming root: refused.
        fake = d / "fake"
        fake.mkdir()
        os.chown(fake, INTRUDER.uid, INTRUDER.gid)
        (fake / "daemon.json").write_text(json.dumps(info(8000, 0).__dict__))
        with pytest.raises(UnverifiedServerError):
            read_info(fake / "daemon.json")


def test_verify_url_refuses_plain_http_elsewhere_and_unverifiable_loopback(tmp_path: Path) -> None:
    verify_url("https://login1.example.org:8000", tmp_path / "none", "your API key")
    with pytest.raises(UnverifiedServerError) as err:
        verify_url("http://login1.example.org:8000", tmp_path / "none", "your API key")
    msg = str(err.value)
    assert msg.startswith("refusing to send your API key to http://login1.example.org:8000")
    assert "Use https://" in msg and "http://127.0.0.1:8000" in msg
    with pytest.raises(UnverifiedServerError, match="does not exist: is the daemon running"):
        verify_url("http://127.0.0.1:8000", tmp_path / "none", "your API key")
    path = publish(tmp_path, info(8000))
    with pytest.raises(UnverifiedServerError, match="listens on ports 8000 and 8001, not 9"):
        verify_url("http://[::1]:9", path, "x")


# ---- the CLIs against a squatter ------------------------------------------------------


def test_llmgw_sends_no_key_or_prompt_to_a_squatter_on_a_stale_daemon_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon crashed (its daemon.json left behind) and another user took its port.
    port = free_port()
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("LLMGW_DAEMON_INFO", str(publish(run, info(port))))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    p = squat(str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        for args in (["chat", "tiny", "secret prompt"], ["usage"], ["up", "tiny"]):
            res = CliRunner().invoke(llmgw_main, ["--url", url, "--key", "llmgw-KEY", *args])
            assert res.exit_code == 1, (args, res.output)
            if args[0] != "up":  # up first reads the (public) status
                assert f"port {port} is held by uid {INTRUDER.uid}" in res.output, res.output
    finally:
        got = heard(p)
    assert "llmgw-KEY" not in got and "secret prompt" not in got


def test_llmgw_admin_talks_over_the_socket_and_refuses_one_another_user_serves(
    rd: RunningDaemon,
) -> None:
    srv = ["--server", str(rd.server_path)]
    res = CliRunner().invoke(admin_main, ["reload", *srv])
    assert res.exit_code == 0, res.output
    with world_dir() as d:
        (d / "mine").mkdir()
        os.chown(d / "mine", INTRUDER.uid, INTRUDER.gid)
        path = d / "mine" / "admin.sock"
        p = squat(str(path))
        try:
            with pytest.raises(Exception) as err:
                unix_call(path, "/internal/v1/admin/reload", {"secret": "x"}, os.geteuid())
            assert f"served by uid {INTRUDER.uid}" in str(err.value)
        finally:
            got = heard(p)
        # Connected, checked, and not one byte sent.
        assert got.strip() in ("", "b''"), got


def test_the_admin_socket_refuses_other_users_by_their_credentials(tmp_path: Path) -> None:
    code = (
        "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
        "s.sendall(b'POST /internal/v1/admin/reload HTTP/1.1\\r\\nHost: x\\r\\n"
        "Content-Length: 2\\r\\nConnection: close\\r\\n\\r\\n{}');"
        "print(s.recv(65536).decode())"
    )
    # The runtime folder where the intruder can reach it, as /run/llmgw-slurm is.
    with world_dir() as d:
        for rd in run_daemon(tmp_path, runtime_dir=d / "run"):
            sock = rd.d.server.effective_admin_socket()
            assert sock.parent == d / "run" and (sock.parent.stat().st_mode & 0o777) == 0o755
            r = INTRUDER.python(code, str(sock))
            assert r.stdout.startswith("HTTP/1.1 403"), r.stdout + r.stderr
            assert f"uid {INTRUDER.uid} may not administer this daemon" in r.stdout
            # Its own user is let in.
            res = CliRunner().invoke(admin_main, ["reload", "--server", str(rd.server_path)])
            assert res.exit_code == 0, res.output


# ---- the admin token ---------------------------------------------------------------------


def test_token_rotate_refuses_the_old_token_at_once(rd: RunningDaemon) -> None:
    import http.client

    state = Path(rd.d.server.state_dir)
    old = (state / "admin.token").read_text().strip()
    port = rd.d.server.listen.internal.port

    def status(token: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request(
            "POST", "/internal/v1/admin/reload", b"{}", {"Authorization": f"Bearer {token}"}
        )
        s = conn.getresponse().status
        conn.close()
        return s

    assert status(old) == 200
    res = CliRunner().invoke(admin_main, ["token", "rotate", "--server", str(rd.server_path)])
    assert res.exit_code == 0 and "the old one is refused from now on" in res.output
    new = (state / "admin.token").read_text().strip()
    assert new != old and (state / "admin.token").stat().st_mode & 0o777 == 0o600
    assert (status(old), status(new)) == (401, 200)
    # Without the socket llmgw-admin falls back to the port, with the new token.
    rd.d.server.effective_admin_socket().unlink()
    res = CliRunner().invoke(admin_main, ["reload", "--server", str(rd.server_path)])
    assert res.exit_code == 0, res.output


def test_sd_listen_fds_hands_over_systemds_sockets() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    code = (
        "import json, os; from llmgw_slurm.base.sdnotify import listen_fds;"
        "got = listen_fds(); print(json.dumps([[n, s.getsockname()[1], s.get_inheritable()]"
        " for n, s in got] + ['LISTEN_FDS' in os.environ]))"
    )
    fd = s.fileno()

    def to_fd3() -> None:
        os.dup2(fd, 3)

    # $$ is the shell's pid, which exec keeps: LISTEN_PID names the process that reads it.
    out = subprocess.run(
        ["sh", "-c", f'LISTEN_PID=$$ exec {sys.executable} -c "$0"', code],
        env={**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "gateway"},
        # 3 kept too: subprocess closes what is not listed after preexec_fn ran.
        pass_fds=(fd, 3),
        preexec_fn=to_fd3,
        capture_output=True,
        text=True,
        check=False,
    )
    s.close()
    assert out.stdout.startswith("["), out.stderr
    assert json.loads(out.stdout) == [["gateway", port, False], False]
    # Meant for another process: not taken.
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "LISTEN_FDS": "1", "LISTEN_PID": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert json.loads(out.stdout) == [False], out.stderr
