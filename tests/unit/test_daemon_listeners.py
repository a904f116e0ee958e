"""The daemon's ways in: systemd's sockets (socket activation), TLS on the gateway,
and daemon.json published while it serves and withdrawn when it stops."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from _cli_support import RunningDaemon, free_port, run_daemon, write_config
from click.testing import CliRunner

from llmgw_slurm import daemon
from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.cli.admin import main as admin_main
from llmgw_slurm.cli.researcher import main as llmgw_main
from llmgw_slurm.config import load_server_config


def held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


async def test_the_daemon_serves_on_the_sockets_systemd_holds(tmp_path: Path) -> None:
    gw, internal = held_port(), held_port()
    path = write_config(tmp_path, gw.getsockname()[1], internal.getsockname()[1], None)
    d = daemon.build(load_server_config(path), path)
    # One .socket unit with two ListenStream=: both carry the unit's name, told
    # apart by port. Binding the ports itself would fail: they are taken.
    lst = await daemon.open_listeners(
        d, inherited=[("llmgw-slurm.socket", internal), ("llmgw-slurm.socket", gw)]
    )
    info_path = d.server.effective_runtime_dir() / "daemon.json"
    try:
        async with aiohttp.ClientSession() as http:
            for s in (gw, internal):
                async with http.get(f"http://127.0.0.1:{s.getsockname()[1]}/healthz") as r:
                    assert r.status == 200
        info = json.loads(info_path.read_text())
        assert (info["gateway_port"], info["internal_port"], info["tls"]) == (
            gw.getsockname()[1],
            internal.getsockname()[1],
            False,
        )
        assert d.server.effective_admin_socket().is_socket()
    finally:
        await lst.close()
        await d.reconciler.close()
    assert not info_path.exists() and not d.server.effective_admin_socket().exists()


def make_cert(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "gw.crt", folder / "gw.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_daemon(tmp_path: Path) -> Iterator[tuple[RunningDaemon, Path, str]]:
    cert, key = make_cert(tmp_path)
    keys_file = tmp_path / "keys.json"
    k = add_key(keys_file, "alice").key
    extra = f"tls: {{cert: {cert}, key: {key}}}\n"
    for rd in run_daemon(tmp_path, keys_file=keys_file, extra=extra):
        yield rd, cert, k


def test_over_https_the_certificate_is_the_proof(
    tls_daemon: tuple[RunningDaemon, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rd, cert, key = tls_daemon
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert rd.url.startswith("https://")
    # No daemon.json is needed for https: the certificate proves who answers.
    monkeypatch.setenv("LLMGW_DAEMON_INFO", str(tmp_path / "none.json"))
    res = CliRunner().invoke(
        llmgw_main, ["--url", rd.url, "--key", key, "--ca-file", str(cert), "usage", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["user"] == "alice"
    # Without the CA the self-signed certificate is not trusted: nothing is sent.
    res = CliRunner().invoke(llmgw_main, ["--url", rd.url, "--key", key, "usage"])
    assert res.exit_code == 1 and "certificate verify failed" in res.output, res.output
    res = CliRunner().invoke(
        llmgw_main, ["--url", rd.url, "--ca-file", str(tmp_path / "nope.pem"), "models"]
    )
    assert res.exit_code == 1 and "cannot load the CA file" in res.output
    # The admin's status reads the local https gateway.
    res = CliRunner().invoke(admin_main, ["status", "--server", str(rd.server_path)])
    port = rd.d.server.listen.gateway.port
    assert res.exit_code == 0 and f"daemon https://127.0.0.1:{port} " in res.output, res.output


def test_tls_needs_both_files_and_a_bad_pair_is_refused_with_the_fix(tmp_path: Path) -> None:
    cert, _ = make_cert(tmp_path)
    path = write_config(tmp_path, free_port(), free_port(), None, f"tls: {{cert: {cert}}}\n")
    with pytest.raises(Exception, match="set both cert and key"):
        load_server_config(path)
    path = write_config(
        tmp_path, free_port(), free_port(), None, f"tls: {{cert: {cert}, key: {cert}}}\n"
    )
    d = daemon.build(load_server_config(path), path)
    with pytest.raises(Exception, match="tls: cannot load the certificate"):
        daemon._tls_context(d.server)
