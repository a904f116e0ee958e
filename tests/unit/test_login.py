"""``llmgw login``: munge credentials decoded by a real munged, keys per user and account."""

from __future__ import annotations

import asyncio
import json
import logging
import pwd
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _cli_support import RunningDaemon, run_daemon
from click.testing import CliRunner

from llmgw_slurm.auth import munge
from llmgw_slurm.auth.keys import list_keys
from llmgw_slurm.auth.login import LOGIN_KEY, RateLimit
from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.cli.researcher import main
from llmgw_slurm.config import load_server_config
from llmgw_slurm.slurm.types import Associations
from tests.hostile_user import INTRUDER
from tests.munge_support import encode, munged

ROOT = pwd.getpwuid(0).pw_name


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with munged() as s:
        yield s


def decode(cred: str, sock: Path) -> munge.MungeIdentity:
    return asyncio.run(munge.decode(cred, sock))


# ---- decoding -------------------------------------------------------------------------


def test_a_login_credential_proves_its_uid(sock: Path) -> None:
    who = decode(encode(sock, munge.LOGIN_PAYLOAD, uid=INTRUDER.uid), sock)
    assert (who.uid, who.gid) == (INTRUDER.uid, INTRUDER.gid)


def test_the_clis_own_credential_decodes(sock: Path) -> None:
    cred = asyncio.run(munge.encode(sock))
    assert decode(cred, sock).uid == 0


def test_a_replayed_credential_is_refused(sock: Path) -> None:
    cred = encode(sock, munge.LOGIN_PAYLOAD)
    decode(cred, sock)
    with pytest.raises(munge.MungeRefused) as e:
        decode(cred, sock)
    assert e.value.reason == "replayed" and "used before" in str(e.value)


def test_an_expired_credential_is_refused(sock: Path) -> None:
    cred = encode(sock, munge.LOGIN_PAYLOAD, ttl=1)
    # munge's smallest time to live is a second: no way around waiting it out.
    time.sleep(2.1)
    with pytest.raises(munge.MungeRefused) as e:
        decode(cred, sock)
    assert e.value.reason == "expired"


def test_a_credential_made_with_another_key_is_refused(sock: Path, tmp_path: Path) -> None:
    with munged() as other:
        forged = encode(other, munge.LOGIN_PAYLOAD, uid=0)
    with pytest.raises(munge.MungeRefused) as e:
        decode(forged, sock)
    assert e.value.reason == "invalid"


def test_a_changed_credential_is_refused(sock: Path) -> None:
    cred = encode(sock, munge.LOGIN_PAYLOAD)
    i = len(cred) // 2
    changed = cred[:i] + ("A" if cred[i] != "A" else "B") + cred[i + 1 :]
    with pytest.raises(munge.MungeRefused) as e:
        decode(changed, sock)
    assert e.value.reason == "invalid"


@pytest.mark.parametrize("payload", [None, "something else"])
def test_a_credential_made_for_something_else_is_refused(sock: Path, payload: str | None) -> None:
    with pytest.raises(munge.MungeRefused) as e:
        decode(encode(sock, payload), sock)
    assert e.value.reason == "wrong_payload"


@pytest.mark.parametrize("text", ["", "hello", "MUNGE:" + "A" * 5000, "MUNGE:a\nb"])
def test_what_is_no_credential_is_refused(sock: Path, text: str) -> None:
    with pytest.raises(munge.MungeRefused) as e:
        decode(text, sock)
    assert e.value.reason == "invalid"


def test_munged_away_is_the_daemons_trouble_not_the_users(tmp_path: Path) -> None:
    with pytest.raises(munge.MungeError, match="munged"):
        decode("MUNGE:AAAA:", tmp_path / "no.socket")
    with pytest.raises(munge.MungeError, match="munged"):
        asyncio.run(munge.encode(tmp_path / "no.socket"))


def test_rate_limit_per_user_slides() -> None:
    now = [1000.0]
    limit = RateLimit(2, clock=lambda: now[0])
    assert limit.retry_after("1001") == 0 and limit.retry_after("1001") == 0
    assert limit.retry_after("1001") > 0
    assert limit.retry_after("1002") == 0  # another user has their own allowance
    now[0] += 61
    assert limit.retry_after("a") == 0


# ---- the daemon's routes --------------------------------------------------------------


class FakeSlurmdbd:
    def __init__(self, table: dict[str, tuple[str, set[str]]]) -> None:
        self.table = table

    async def __call__(self, user: str) -> Associations:
        default, accounts = self.table.get(user, ("", set()))
        return Associations(user, frozenset(accounts), default)


@pytest.fixture(scope="module")
def rd(tmp_path_factory: pytest.TempPathFactory, sock: Path) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("daemon")
    # Revoked keys count for nothing here: each test revokes the keys it made.
    extra = (
        f"login: {{enabled: true, munge_socket: {sock}, max_keys_per_user: 3,"
        " revoked_key_window: 0s}\n"
    )
    for d in run_daemon(tmp, keys_file=tmp / "keys.json", extra=extra):
        d.d.gateway[LOGIN_KEY].associations = FakeSlurmdbd(
            {
                INTRUDER.name: ("t18phys", {"t18phys", "t18chem"}),
                ROOT: ("t18root", {"t18root"}),
            }
        )
        yield d


def call(
    rd: RunningDaemon, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[int, Any, dict[str, str]]:
    async def go() -> tuple[int, Any, dict[str, str]]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, rd.url + path, json=body, headers=headers) as r,
        ):
            return r.status, await r.json(), dict(r.headers)

    return asyncio.run(go())


def call_text(rd: RunningDaemon, path: str) -> tuple[int, str, dict[str, str]]:
    async def go() -> tuple[int, str, dict[str, str]]:
        async with aiohttp.ClientSession() as s, s.get(rd.url + path) as r:
            return r.status, await r.text(), dict(r.headers)

    return asyncio.run(go())


def login(rd: RunningDaemon, sock: Path, uid: int, account: str | None = None) -> tuple[int, Any]:
    body = {"credential": encode(sock, munge.LOGIN_PAYLOAD, uid=uid)}
    if account is not None:
        body["account"] = account
    status, data, _ = call(rd, "POST", "/api/v1/login", body)
    return status, data


@pytest.fixture(autouse=True)
def fresh(rd: RunningDaemon) -> Iterator[None]:
    routes = rd.d.gateway[LOGIN_KEY]
    routes.limit = RateLimit(1000)
    yield
    # Each test starts with no login keys, so the per-user cap is the test's own.
    for rec in list_keys(routes.settings.keys_file):
        if rec.active:
            from llmgw_slurm.auth.keys import revoke_key

            revoke_key(routes.settings.keys_file, rec.key_id)


def test_login_gives_a_key_for_the_proven_user_and_default_account(
    rd: RunningDaemon, sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    status, data = login(rd, sock, INTRUDER.uid)
    assert status == 200, data
    assert (data["user"], data["account"]) == (INTRUDER.name, "t18phys")
    status, models, _ = call(rd, "GET", "/v1/models", key=data["key"])
    assert status == 200 and models["object"] == "list"
    # Stored hashed: the key itself is nowhere in the file.
    keys_file = rd.d.gateway[LOGIN_KEY].settings.keys_file
    assert data["key"] not in keys_file.read_text()
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    # The log names the key by its id, never the key; the metrics do not name it.
    assert f"got key {data['key_id']}" in caplog.text
    secret = data["key"].split("-", 2)[2]  # llmgw-ID-SECRET; the secret may hold "-"
    assert secret not in caplog.text
    status, metrics, _ = call_text(rd, "/metrics")
    assert status == 200 and secret not in metrics and data["key_id"] not in metrics


def test_login_with_an_associated_account(rd: RunningDaemon, sock: Path) -> None:
    status, data = login(rd, sock, INTRUDER.uid, "t18chem")
    assert status == 200 and data["account"] == "t18chem"


def test_login_with_an_account_the_user_has_no_association_with(
    rd: RunningDaemon, sock: Path
) -> None:
    status, data = login(rd, sock, INTRUDER.uid, "t18root")
    assert status == 403 and data["error"]["code"] == "no_association"
    assert "t18chem, t18phys" in data["error"]["message"]


def test_login_of_a_user_slurm_does_not_know(rd: RunningDaemon, sock: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    status, data = login(rd, sock, nobody)
    assert status == 403 and data["error"]["code"] == "no_association"


def test_replayed_and_forged_logins_get_401(rd: RunningDaemon, sock: Path, tmp_path: Path) -> None:
    cred = encode(sock, munge.LOGIN_PAYLOAD, uid=INTRUDER.uid)
    assert call(rd, "POST", "/api/v1/login", {"credential": cred})[0] == 200
    status, data, _ = call(rd, "POST", "/api/v1/login", {"credential": cred})
    assert status == 401 and data["error"]["code"] == "munge_replayed"
    with munged() as other:
        forged = encode(other, munge.LOGIN_PAYLOAD, uid=0)
    status, data, _ = call(rd, "POST", "/api/v1/login", {"credential": forged})
    assert status == 401 and data["error"]["code"] == "munge_invalid"
    status, data, _ = call(rd, "POST", "/api/v1/login", {"account": "x"})
    assert status == 400 and "credential" in data["error"]["message"]


def test_login_attempts_are_limited_per_user_not_per_address(rd: RunningDaemon, sock: Path) -> None:
    # Every local user connects from 127.0.0.1: one user's burst used to lock
    # out every other user for a minute.
    rd.d.gateway[LOGIN_KEY].limit = RateLimit(2)
    for _ in range(2):
        assert login(rd, sock, INTRUDER.uid)[0] == 200
    status, data = login(rd, sock, INTRUDER.uid)
    assert status == 429 and data["error"]["code"] == "rate_limited"
    assert f"uid {INTRUDER.uid}" in data["error"]["message"]
    assert login(rd, sock, 0)[0] == 200  # another user, the same address
    # A credential that proves nobody counts for nobody: no 429, whoever sends it.
    for _ in range(3):
        assert call(rd, "POST", "/api/v1/login", {"credential": "MUNGE:junk:"})[0] == 401


def test_a_user_has_at_most_max_keys(rd: RunningDaemon, sock: Path) -> None:
    for _ in range(3):
        assert login(rd, sock, INTRUDER.uid)[0] == 200
    status, data = login(rd, sock, INTRUDER.uid)
    assert status == 409 and "llmgw keys revoke" in data["error"]["message"]


def test_keys_revoked_within_the_window_still_count(tmp_path: Path) -> None:
    from llmgw_slurm.auth.keys import TooManyKeys, add_key, revoke_key

    path = tmp_path / "keys.json"
    first = add_key(path, "ann", limit=2, revoked_within=3600)
    add_key(path, "ann", limit=2, revoked_within=3600)
    add_key(path, "bob", limit=2, revoked_within=3600)  # bob's count is his own
    revoke_key(path, first.record.key_id)
    # One active and one revoked a moment ago: still two.
    with pytest.raises(
        TooManyKeys, match=r"revoked 1 within the last 60 min.*try again in 3[56]\d\d s"
    ):
        add_key(path, "ann", limit=2, revoked_within=3600)
    add_key(path, "ann", limit=2, revoked_within=0)  # outside the window: counts no more


def test_a_user_sees_and_revokes_only_their_own_keys(rd: RunningDaemon, sock: Path) -> None:
    mine = login(rd, sock, INTRUDER.uid)[1]
    mine2 = login(rd, sock, INTRUDER.uid)[1]
    theirs = login(rd, sock, 0)[1]
    status, data, _ = call(rd, "GET", "/api/v1/keys", key=mine["key"])
    assert status == 200
    listed = {k["key_id"]: k for k in data["keys"] if k["revoked"] is None}
    assert set(listed) == {mine["key_id"], mine2["key_id"]}
    assert listed[mine["key_id"]]["current"] and not listed[mine2["key_id"]]["current"]
    # Another user's key id and an id nobody has get the same answer.
    for key_id in (theirs["key_id"], "00000000"):
        status, data, _ = call(rd, "DELETE", f"/api/v1/keys/{key_id}", key=mine["key"])
        assert status == 404 and data["error"]["code"] == "no_such_key"
    assert call(rd, "GET", "/v1/models", key=theirs["key"])[0] == 200
    status, _, _ = call(rd, "DELETE", f"/api/v1/keys/{mine2['key_id']}", key=mine["key"])
    assert status == 200
    assert call(rd, "GET", "/v1/models", key=mine2["key"])[0] == 401
    assert call(rd, "GET", "/api/v1/keys", key=mine2["key"])[0] == 401


def test_login_needs_keys_file(tmp_path: Path) -> None:
    (tmp_path / "server.yaml").write_text("state_dir: s\nlogin:\n  enabled: true\n")
    with pytest.raises(ConfigError) as e:
        load_server_config(tmp_path / "server.yaml")
    assert "server.yaml:3" in str(e.value) and "router.keys_file" in str(e.value)


# ---- the CLI --------------------------------------------------------------------------


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sock: Path) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LLMGW_MUNGE_SOCKET", str(sock))
    monkeypatch.delenv("LLMGW_URL", raising=False)
    monkeypatch.delenv("LLMGW_API_KEY", raising=False)
    return tmp_path / "xdg" / "llmgw" / "config.yaml"


def llmgw(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


def test_cli_login_keys_logout(rd: RunningDaemon, xdg: Path) -> None:
    code, out = llmgw("--url", rd.url, "login")
    assert code == 0, out
    assert f"Logged in as {ROOT} (Slurm account t18root)" in out
    assert stat.S_IMODE(xdg.stat().st_mode) == 0o600
    saved = xdg.read_text()
    assert "api_key: llmgw-" in saved and rd.url in saved
    assert "llmgw-" not in out.replace(str(xdg), "")  # the key is not printed
    code, out = llmgw("keys", "--json")
    assert code == 0, out
    (row,) = [k for k in json.loads(out)["keys"] if k["current"]]
    code, out = llmgw("keys")
    assert code == 0 and row["key_id"] in out and "(this one)" in out
    code, out = llmgw("logout")
    assert code == 0 and f"Key {row['key_id']} revoked and removed" in out
    assert "api_key" not in xdg.read_text()
    code, out = llmgw("keys")
    assert code == 1 and "llmgw login" in out


def test_cli_login_with_an_account_it_may_not_use(rd: RunningDaemon, xdg: Path) -> None:
    code, out = llmgw("--url", rd.url, "login", "--account", "t18phys")
    assert code == 1 and "no association" in out and not xdg.exists()


def test_cli_sends_no_credential_to_a_server_that_is_not_proven(
    rd: RunningDaemon, xdg: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[object] = []

    async def spy(*a: object, **k: object) -> str:
        made.append(a)
        return "MUNGE:x"

    monkeypatch.setattr(munge, "encode", spy)
    # A gateway that offers login, whose port's owner cannot be checked against the
    # daemon's daemon.json: its status is read (nothing secret), no credential is made.
    monkeypatch.setenv("LLMGW_DAEMON_INFO", str(tmp_path / "elsewhere" / "daemon.json"))
    code, out = llmgw("--url", rd.url, "login")
    assert code == 1 and "refusing to send your munge credential" in out and not made
    code, out = llmgw("--url", "http://192.0.2.1:8000", "login")
    assert code == 1 and "cannot reach the llmgw daemon" in out and not made


def test_cli_revoke_needs_a_key_id(xdg: Path) -> None:
    code, out = llmgw("--key", "llmgw-00000000-" + "x" * 43, "keys", "revoke", "nope")
    assert code == 2 and "8 hex digits" in out


def test_usage_by_key_user_and_account(rd: RunningDaemon, xdg: Path) -> None:
    from llmgw_slurm.accounting.usage import UsageRecord
    from llmgw_slurm.auth.keys import add_key
    from llmgw_slurm.router.gateway import GATEWAY_KEY

    keys_file = rd.d.gateway[LOGIN_KEY].settings.keys_file
    a1 = add_key(keys_file, "t18ann", "t18acct")
    a2 = add_key(keys_file, "t18ann", "t18other")
    b = add_key(keys_file, "t18ben", "t18acct")
    store = rd.d.gateway[GATEWAY_KEY].usage
    assert store is not None
    now = time.time()
    for k, tokens in ((a1, 10), (a2, 20), (b, 40)):
        rec = k.record
        row = UsageRecord(
            now, rec.key_id, rec.user, rec.project, "tiny", "completions", tokens, 0, tokens
        )
        rd.call(lambda row=row: store.record(row))

    def total(by: str) -> int:
        code, out = llmgw("--url", rd.url, "--key", a1.key, "usage", "--by", by, "--json")
        assert code == 0, out
        return sum(m["total_tokens"] for m in json.loads(out)["models"])

    assert (total("key"), total("user"), total("account")) == (10, 30, 50)
    code, out = llmgw("--url", rd.url, "--key", a1.key, "usage", "--by", "account")
    assert code == 0 and "account t18acct (every key charged to it)" in out


def test_status_up_and_the_page_hide_models_a_key_may_not_use(
    rd: RunningDaemon, xdg: Path, tmp_path: Path
) -> None:
    from _cli_support import MODELS_YAML

    from llmgw_slurm.auth.keys import add_key
    from llmgw_slurm.catalog import load_catalog

    keys_file = rd.d.gateway[LOGIN_KEY].settings.keys_file
    ann, ben = add_key(keys_file, "t18ann").key, add_key(keys_file, "t18ben").key
    p = tmp_path / "models.yaml"
    p.write_text(
        MODELS_YAML.replace(
            "  - name: big-model\n", "  - name: big-model\n    access: {users: [t18ann]}\n"
        )
    )
    old = rd.rec.catalog
    rd.call(lambda: rd.rec.set_catalog(load_catalog(p)))
    try:
        names = {}
        for who, key in (("ann", ann), ("ben", ben), ("nobody", None)):
            status, data, _ = call(rd, "GET", "/api/v1/status", key=key)
            assert status == 200
            names[who] = {m["name"] for m in data["models"]}
        assert names == {"ann": {"tiny", "big-model"}, "ben": {"tiny"}, "nobody": {"tiny"}}
        status, data, _ = call(rd, "POST", "/api/v1/models/big-model/up", key=ben)
        assert status == 404 and "big-model" not in data["error"]["message"].split("known:")[1]
        assert call(rd, "POST", "/api/v1/models/big-model/up", key=ann)[0] == 200
        status, page, _ = call_text(rd, "/")
        assert status == 200 and "big-model" not in page and "tiny" in page
        # The charts' numbers leave it out too (its hour's series would name it).
        for key, shown in ((ben, False), (None, False), (ann, True)):
            status, charts, _ = call(rd, "GET", "/api/v1/charts", key=key)
            assert status == 200 and ("big-model" in charts["history"]["models"]) is shown
        code, out = llmgw("--url", rd.url, "--key", ann, "models")
        assert code == 0 and "big-model" in out
        code, out = llmgw("--url", rd.url, "--key", ben, "models")
        assert code == 0 and "big-model" not in out
    finally:
        rd.call(lambda: rd.rec.set_catalog(old))


def test_munged_slurmdbd_or_the_key_file_away_is_503_not_a_traceback(
    rd: RunningDaemon, sock: Path, tmp_path: Path
) -> None:
    import dataclasses

    from llmgw_slurm.base.errors import SlurmUnavailable

    routes = rd.d.gateway[LOGIN_KEY]
    settings, lookup = routes.settings, routes.associations

    async def down(user: str) -> Associations:
        raise SlurmUnavailable("no answer within 30s", command=["sacctmgr"])

    try:
        routes.settings = dataclasses.replace(settings, munge_socket=tmp_path / "none.socket")
        status, data = login(rd, sock, INTRUDER.uid)
        assert status == 503 and data["error"]["code"] == "munge_unavailable"
        routes.settings = settings
        routes.associations = down
        status, data = login(rd, sock, INTRUDER.uid)
        assert status == 503 and data["error"]["code"] == "slurm_unavailable"
        routes.associations = lookup
        # A folder where the key file should be: it cannot be written.
        routes.settings = dataclasses.replace(settings, keys_file=tmp_path)
        status, data = login(rd, sock, INTRUDER.uid)
        assert status == 503 and data["error"]["code"] == "keys_unavailable"
    finally:
        routes.settings, routes.associations = settings, lookup
