"""Mutual TLS between the gateway and its engines (llmgw_slurm/auth/tls.py), with real handshakes."""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw_slurm.agent.engine import check_port_owner
from llmgw_slurm.agent.errors import EngineError
from llmgw_slurm.agent.portowner import port_owner
from llmgw_slurm.auth.tls import (
    PEMError,
    PinnedContexts,
    check_certificate,
    client_context,
    engine_address_problem,
    fingerprint,
    load_or_create_identity,
    make_engine_tls,
    make_identity,
)
from tests.unit._router_support import free_port, serve_engine


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_the_gateway_identity_is_private_and_kept_across_restarts(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path / "state")
    assert _mode(first.key_file) == 0o600 and _mode(first.cert_file) == 0o600
    # A restarted daemon presents the same certificate: replicas it started accept only that.
    assert load_or_create_identity(tmp_path / "state") == first
    # A damaged certificate is replaced, not trusted.
    first.cert_file.write_text("garbage")
    again = load_or_create_identity(tmp_path / "state")
    assert again.cert_pem != first.cert_pem
    check_certificate(again.cert_pem)


def test_an_engines_files_are_in_a_directory_only_its_user_can_enter(tmp_path: Path) -> None:
    gateway = make_identity(tmp_path, "gw", "gw", 1)
    tls = make_engine_tls(gateway.cert_pem, "0a1b2c3d", parent=tmp_path)
    assert _mode(tls.directory) == 0o700
    for f in (tls.identity.key_file, tls.identity.cert_file, tls.ca_file):
        assert f.parent == tls.directory and _mode(f) == 0o600
    # The engine accepts the gateway and its own agent, nobody else.
    accepted = tls.ca_file.read_text()
    assert gateway.cert_pem.strip() in accepted and tls.identity.cert_pem.strip() in accepted
    assert accepted.count("BEGIN CERTIFICATE") == 2


@pytest.mark.parametrize(
    ("pem", "error"),
    [
        ("", "exactly one PEM certificate"),
        ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "not a certificate"),
        ("x" * 9000, "at most 8192"),
    ],
)
def test_what_is_not_one_certificate_is_refused(pem: str, error: str) -> None:
    with pytest.raises(PEMError, match=error):
        check_certificate(pem)


def test_two_certificates_are_not_one(tmp_path: Path) -> None:
    a = make_identity(tmp_path, "a", "a", 1)
    b = make_identity(tmp_path, "b", "b", 1)
    with pytest.raises(PEMError, match="exactly one"):
        check_certificate(a.cert_pem + b.cert_pem)
    assert fingerprint(a.cert_pem) != fingerprint(b.cert_pem)


def test_reported_addresses_the_daemon_takes(tmp_path: Path) -> None:
    cert = make_identity(tmp_path, "e", "e", 1).cert_pem
    assert engine_address_problem("https://n1:20001", cert, True) == ""
    assert "without its certificate" in engine_address_problem("https://n1:20001", None, True)
    assert "without its certificate" in engine_address_problem("https://n1:20001", 7, True)
    assert "certificate" in engine_address_problem("https://n1:20001", "junk", True)
    # Plain HTTP only where the catalog turned TLS off for the model.
    assert "plain-http" in engine_address_problem("http://n1:20001", None, True)
    assert engine_address_problem("http://n1:20001", None, False) == ""
    assert "not an http(s) URL" in engine_address_problem("ftp://n1", None, False)


SEEN = web.AppKey("seen", list[str | None])


async def _hello(request: web.Request) -> web.Response:
    request.app[SEEN].append(request.headers.get("Authorization"))
    return web.Response(text="hello")


def _app() -> web.Application:
    app = web.Application()
    app[SEEN] = []
    app.router.add_get("/{tail:.*}", _hello)
    return app


async def test_the_gateway_reaches_its_engine_and_only_its_engine(tmp_path: Path) -> None:
    gateway = make_identity(tmp_path, "gw", "gw", 1)
    contexts = PinnedContexts(gateway)
    real, squatter = _app(), _app()
    async with (
        serve_engine(real, gateway) as (url, cert),
        serve_engine(squatter, gateway) as (squat_url, _squat_cert),
        aiohttp.ClientSession() as s,
    ):
        ctx = contexts.get(cert)
        assert contexts.get(cert) is ctx  # built once per replica, not per request
        async with s.get(f"{url}/v1/models", ssl=ctx, headers={"Authorization": "k"}) as r:
            assert r.status == 200
        # A server with another key at the address the agent named (a squatter that
        # took the port): the handshake fails before the request, or its key, is sent.
        with pytest.raises(aiohttp.ClientSSLError):
            async with s.get(f"{squat_url}/v1/models", ssl=ctx, headers={"Authorization": "k"}):
                pass
    assert real[SEEN] == ["k"]
    assert squatter[SEEN] == []


async def test_an_engine_lets_in_no_client_without_the_gateways_certificate(
    tmp_path: Path,
) -> None:
    gateway = make_identity(tmp_path, "gw", "gw", 1)
    stranger = make_identity(tmp_path, "stranger", "stranger", 1)
    app = _app()
    async with serve_engine(app, gateway) as (url, cert), aiohttp.ClientSession() as s:
        # Other users of the node: a certificate of their own, none at all, or no TLS.
        theirs = client_context(cert, stranger.cert_file, stranger.key_file)
        none = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        none.check_hostname, none.verify_mode = False, ssl.CERT_NONE
        for path in ("/v1/models", "/invocations", "/tokenize", "/metrics", "/health"):
            for ctx in (theirs, none):
                with pytest.raises(aiohttp.ClientError):
                    async with s.get(f"{url}{path}", ssl=ctx) as r:
                        await r.read()
            with pytest.raises(aiohttp.ClientError):
                async with s.get(f"{url.replace('https:', 'http:')}{path}") as r:
                    await r.read()
        # The gateway's own certificate is let in, on every path.
        ours = client_context(cert, gateway.cert_file, gateway.key_file)
        async with s.get(f"{url}/invocations", ssl=ours) as r:
            assert r.status == 200
    assert app[SEEN] == [None]


def test_listeners_are_read_from_the_kernels_socket_table(tmp_path: Path) -> None:
    table = [
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid",
        # sl local rem st tx:rx tr:when retr uid timeout inode
        "0: 0100007F:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001 0 1 1",
        "1: 00000000:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1002 0 2 1",
        # Established, not listening: not an owner of the port.
        "2: 0100007F:4E21 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1003 0 3 1",
        "3: 0100007F:4E22 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1004 0 4 1",
        "garbage line",
    ]
    (tmp_path / "tcp").write_text("\n".join(table) + "\n")
    assert port_owner(0x4E21, tmp_path) == {1001, 1002}
    assert port_owner(0x4E22, tmp_path) == {1004}
    assert port_owner(1, tmp_path) == set()


async def test_a_real_listener_is_owned_by_this_process_user() -> None:
    port = free_port()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        assert port_owner(port) == {os.getuid()}
    finally:
        server.close()
        await server.wait_closed()
    assert port_owner(port) == set()
    assert port_owner(port, Path("/nonexistent")) is None


def test_a_port_held_by_another_user_is_never_polled() -> None:
    assert check_port_owner(20001, 1000, {1000}) is True
    assert check_port_owner(20001, 1000, set()) is False  # not listening yet
    assert check_port_owner(20001, 1000, None) is True  # no table: TLS alone protects
    with pytest.raises(EngineError, match="port 20001 on this node is held by uid 0, not"):
        check_port_owner(20001, 1000, {0, 1000})
