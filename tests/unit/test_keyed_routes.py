"""With keys on, every gateway route that changes state takes a key (issue 13, item 5)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from _cli_support import RunningDaemon, run_daemon
from click.testing import CliRunner

from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.cli.researcher import main


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[RunningDaemon, str]]:
    keys_file = tmp_path / "keys.json"
    new = add_key(keys_file, "alice")
    yield from ((rd, new.key) for rd in run_daemon(tmp_path, keys_file=keys_file))


def request(rd: RunningDaemon, method: str, path: str, auth: str | None) -> tuple[int, object]:
    u = urlsplit(rd.url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=10)
    conn.request(method, path, headers={"Authorization": auth} if auth else {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, json.loads(body) if body else None


@pytest.mark.parametrize("auth", [None, "Bearer ", "Bearer llmgw-00000000-nope", "Basic abc"])
def test_up_without_a_valid_key_is_401_and_starts_nothing(
    keyed: tuple[RunningDaemon, str], auth: str | None
) -> None:
    rd, _ = keyed
    status, body = request(rd, "POST", "/api/v1/models/tiny/up", auth)
    assert status == 401
    assert isinstance(body, dict) and body["error"]["code"] == "invalid_api_key"
    assert rd.call(lambda: rd.rec.directory.wanted_at().get("tiny")) is None


def test_up_with_a_key_starts_the_model(keyed: tuple[RunningDaemon, str]) -> None:
    rd, key = keyed
    status, _ = request(rd, "POST", "/api/v1/models/tiny/up", f"Bearer {key}")
    assert status == 200
    assert rd.call(lambda: rd.rec.directory.wanted_at().get("tiny")) is not None


def test_llmgw_up_sends_the_key(keyed: tuple[RunningDaemon, str]) -> None:
    rd, key = keyed
    rd.add_replica("tiny", "0000aaaa", "ready")
    res = CliRunner().invoke(main, ["--url", rd.url, "--key", key, "up", "tiny"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["--url", rd.url, "up", "tiny"])
    assert res.exit_code == 1 and "the daemon refused the start: no valid API key" in res.output


def test_every_other_route_that_changes_state_is_keyed_or_behind_the_admin_token(
    keyed: tuple[RunningDaemon, str],
) -> None:
    # The audit as a test: a new POST route on the gateway must be added here.
    gateway_posts = sorted(
        (r.resource.canonical, r.method)
        for r in rd_routes(keyed[0])
        if r.method not in ("GET", "HEAD", "OPTIONS")
    )
    assert gateway_posts == [
        ("/api/v1/models/{model}/up", "POST"),
        ("/detokenize", "POST"),
        ("/rerank", "POST"),
        ("/tokenize", "POST"),
        ("/v1/audio/transcriptions", "POST"),
        ("/v1/audio/translations", "POST"),
        ("/v1/batches", "POST"),
        ("/v1/batches/{batch_id}", "DELETE"),
        ("/v1/batches/{batch_id}/cancel", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/v1/completions", "POST"),
        ("/v1/embeddings", "POST"),
        ("/v1/files", "POST"),
        ("/v1/files/{file_id}", "DELETE"),
        ("/v1/rerank", "POST"),
        ("/v1/responses", "POST"),
        ("/v1/responses/{response_id}", "DELETE"),
        ("/v1/responses/{response_id}/cancel", "POST"),
        ("/v1/score", "POST"),
    ]
    rd = keyed[0]
    for path, method in gateway_posts:
        filled = (
            path.replace("{model}", "tiny").replace("{batch_id}", "b").replace("{file_id}", "f")
        )
        filled = filled.replace("{response_id}", "resp_x")
        status, _ = request(rd, method, filled, None)
        assert status == 401, path


def rd_routes(rd: RunningDaemon) -> list:  # type: ignore[type-arg]
    return [r for r in rd.d.gateway.router.routes() if r.resource is not None]
