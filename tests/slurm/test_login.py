"""``llmgw login`` on the dev cluster (issue 18): the cluster's munged, slurmdbd's
associations, and real other Unix users making their own credentials.

The users (t18alice, t18bob; llmgw-intruder, whom slurmdbd does not know) run
``munge`` as themselves and post with the system's Python, so the uid the
daemon sees is the kernel's, not the test's say-so. Only the login routes run
(no reconciler, no jobs): what is tested is munge and sacctmgr, which are real.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web

from llmgw_slurm.auth.keys import KeyRing, add_key
from llmgw_slurm.auth.login import LoginSettings, add_login_routes
from llmgw_slurm.auth.munge import LOGIN_PAYLOAD
from llmgw_slurm.slurm.cli import CliBackend
from tests.hostile_user import INTRUDER, HostileUser, world_dir
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, running, tiny_model

ALICE, BOB = HostileUser("t18alice"), HostileUser("t18bob")
ACCOUNTS = ("t18phys", "t18chem")

# A user's side of a login: a credential from munged as themselves, then a POST.
LOGIN = """
import json, subprocess, sys, urllib.request, urllib.error
url, sock, account, cred = sys.argv[1:5]
if not cred:
    cred = subprocess.run(["munge", "--socket=" + sock, "--string", %r],
                          capture_output=True, text=True, check=True).stdout.strip()
body = {"credential": cred}
if account:
    body["account"] = account
req = urllib.request.Request(url + "/api/v1/login", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req) as r:
        print(json.dumps({"status": r.status, "body": json.load(r), "cred": cred}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": json.load(e), "cred": cred}))
""" % (LOGIN_PAYLOAD,)  # noqa: UP031


def munge_socket() -> Path:
    # The dev cluster's munged: AuthInfo=socket=... in its slurm.conf.
    conf = Path(os.environ.get("SLURM_CONF", "/work/main/.dev-cluster/etc/slurm.conf"))
    for line in conf.read_text().splitlines():
        if line.startswith("AuthInfo=socket="):
            return Path(line.split("=", 2)[2].strip())
    pytest.fail(f"{conf} names no munge socket (AuthInfo=socket=...)")


def sacctmgr(*args: str) -> None:
    r = subprocess.run(
        ["sacctmgr", "--immediate", *args], capture_output=True, text=True, check=False
    )
    # "Nothing new added" / "Nothing deleted" are fine: the state is as wanted.
    assert r.returncode == 0 or "Nothing" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.fixture(scope="module")
def associations() -> Iterator[None]:
    for u in (ALICE, BOB, INTRUDER):
        u.ensure()
    for acct in ACCOUNTS:
        sacctmgr("add", "account", acct, "description=issue 18 tests", "organization=t18")
    sacctmgr("add", "user", ALICE.name, "account=t18phys,t18chem", "defaultaccount=t18phys")
    sacctmgr("add", "user", BOB.name, "account=t18chem", "defaultaccount=t18chem")
    try:
        yield
    finally:
        for u in (ALICE, BOB):
            sacctmgr("delete", "user", u.name)
        for acct in ACCOUNTS:
            sacctmgr("delete", "account", acct)


@pytest.fixture
def top() -> Iterator[Path]:
    """A folder the other users may traverse (pytest's tmp_path is root's, 0700)."""
    with world_dir() as d:
        yield d


@pytest.fixture
async def gateway(associations: None) -> AsyncIterator[tuple[str, KeyRing]]:
    with world_dir() as top:
        keys = KeyRing(top / "keys.json")
        app = web.Application()
        settings = LoginSettings(top / "keys.json", munge_socket(), attempts_per_minute=100)
        add_login_routes(app, settings, keys.lookup, CliBackend().associations)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            yield f"http://127.0.0.1:{port}", keys
        finally:
            await runner.cleanup()


async def login(
    user: HostileUser, url: str, account: str = "", cred: str = ""
) -> tuple[int, dict[str, Any], str]:
    argv = [str(munge_socket()), account, cred]
    r = await asyncio.to_thread(user.python, LOGIN, url, *argv)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out["status"], out["body"], out["cred"]


async def test_a_user_gets_a_key_for_themselves_and_their_default_account(
    gateway: tuple[str, KeyRing],
) -> None:
    url, keys = gateway
    status, body, _ = await login(ALICE, url)
    assert status == 200, body
    assert (body["user"], body["account"]) == (ALICE.name, "t18phys")
    rec = keys.lookup(body["key"])
    assert rec is not None and (rec.user, rec.project) == (ALICE.name, "t18phys")


async def test_an_account_needs_an_association_in_slurmdbd(
    gateway: tuple[str, KeyRing],
) -> None:
    url, _ = gateway
    status, body, _ = await login(ALICE, url, "t18chem")
    assert status == 200 and body["account"] == "t18chem"
    status, body, _ = await login(BOB, url, "t18phys")
    assert status == 403 and body["error"]["code"] == "no_association"
    assert "t18chem" in body["error"]["message"]
    status, body, _ = await login(INTRUDER, url)
    assert status == 403 and body["error"]["code"] == "no_association"


async def test_another_users_credential_replayed_is_refused(
    gateway: tuple[str, KeyRing],
) -> None:
    url, _ = gateway
    status, _, cred = await login(ALICE, url)
    assert status == 200
    # Bob caught Alice's credential (it is no secret once sent): munged saw it already.
    status, body, _ = await login(BOB, url, cred=cred)
    assert status == 401 and body["error"]["code"] == "munge_replayed"


async def test_a_forged_credential_is_refused(gateway: tuple[str, KeyRing]) -> None:
    url, _ = gateway
    # Bob makes his own credential and rewrites the uid inside it: the MAC fails.
    r = await asyncio.to_thread(
        BOB.run, ["munge", f"--socket={munge_socket()}", "--string", LOGIN_PAYLOAD]
    )
    cred = r.stdout.strip()
    i = len(cred) // 2
    forged = cred[:i] + ("A" if cred[i] != "A" else "B") + cred[i + 1 :]
    status, body, _ = await login(BOB, url, cred=forged)
    assert status == 401 and body["error"]["code"] == "munge_invalid"


async def test_an_expired_credential_is_refused(gateway: tuple[str, KeyRing]) -> None:
    url, _ = gateway
    r = await asyncio.to_thread(
        BOB.run, ["munge", f"--socket={munge_socket()}", "--string", LOGIN_PAYLOAD, "--ttl=1"]
    )
    assert r.returncode == 0, r.stderr
    # munge's shortest time to live is a second: no way around waiting it out.
    await asyncio.sleep(2.1)
    status, body, _ = await login(BOB, url, cred=r.stdout.strip())
    assert status == 401 and body["error"]["code"] == "munge_expired"
    assert "expired" in body["error"]["message"]


# ---- the whole story on a real daemon: login, access, quotas, a restart ---------------

GROUP = "t18grp"


@pytest.fixture(scope="module")
def bob_in_group(associations: None) -> Iterator[None]:
    subprocess.run(["groupadd", "-f", GROUP], check=True)
    subprocess.run(["usermod", "-a", "-G", GROUP, BOB.name], check=True)
    try:
        yield
    finally:
        subprocess.run(["groupdel", GROUP], check=False)


def with_login_and_quotas(h: Harness) -> None:
    server = yaml.safe_load(h.server_yaml.read_text())
    server["login"] = {"enabled": True, "munge_socket": str(munge_socket())}
    server["quotas"] = {"requests_per_minute": 50, "user_tokens_per_day": 40}
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))


async def test_login_access_and_budgets_through_a_daemon_with_the_openai_client(
    top: Path, prefix: str, bob_in_group: None
) -> None:
    keys_file = top / "keys.json"
    outsider = add_key(keys_file, INTRUDER.name, "t18none").key
    models = [
        tiny_model(
            "phys",
            scaling={"min": 1, "max": 1},
            access={"accounts": ["t18phys"], "groups": [GROUP]},
        ),
        tiny_model("secret", access={"users": ["t18nobody"]}),
    ]
    async with running(
        top, prefix, models, router={"keys_file": str(keys_file)}, configure=with_login_and_quotas
    ) as h:
        status, alice, _ = await login(ALICE, h.url)  # account t18phys
        assert status == 200, alice
        status, bob, _ = await login(BOB, h.url)  # account t18chem, group t18grp
        assert status == 200, bob

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(api_key=key, base_url=h.url + "/v1", max_retries=0)

        a, b, o = client(alice["key"]), client(bob["key"]), client(outsider)
        assert {m.id for m in (await a.models.list()).data} == {"phys"}  # by account
        assert {m.id for m in (await b.models.list()).data} == {"phys"}  # by group
        assert {m.id for m in (await o.models.list()).data} == set()
        for model in ("phys", "secret", "no-such-model"):
            with pytest.raises(openai.NotFoundError) as e:
                await o.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1
                )
            assert e.value.code == "model_not_found"

        async def ready() -> bool:
            return bool(h.rec.endpoints("phys"))

        await eventually(ready, "phys to serve", timeout=120)
        raw = await a.chat.completions.with_raw_response.create(
            model="phys",
            messages=[{"role": "user", "content": " ".join(["w"] * 30)}],
            max_tokens=16,
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "50"
        assert raw.headers["x-ratelimit-limit-tokens"] == "40"
        with pytest.raises(openai.RateLimitError) as e:  # 30 + 16 tokens > 40
            await a.chat.completions.create(
                model="phys", messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
        assert e.value.code == "insufficient_quota"
        assert int(e.value.response.headers["retry-after"]) > 0
        assert e.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
        # Bob's budget is his own.
        await b.chat.completions.create(
            model="phys", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        await h.stop()
        await h.start()  # the budget comes back from the usage store
        with pytest.raises(openai.RateLimitError):
            await a.chat.completions.create(
                model="phys", messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
        for c in (a, b, o):
            await c.close()


# A user's side of a request with their key: method, path, and the status and body back.
REQUEST = """
import json, sys, urllib.request, urllib.error
url, method, key = sys.argv[1:4]
req = urllib.request.Request(url, method=method, headers={"Authorization": "Bearer " + key})
try:
    with urllib.request.urlopen(req) as r:
        print(json.dumps({"status": r.status, "body": json.load(r)}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": json.load(e)}))
"""


async def request_as(user: HostileUser, url: str, method: str, key: str) -> tuple[int, Any]:
    r = await asyncio.to_thread(user.python, REQUEST, url, method, key)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out["status"], out["body"]


async def test_a_user_can_neither_see_nor_revoke_another_users_keys(
    gateway: tuple[str, KeyRing],
) -> None:
    url, keys = gateway
    _, alice, _ = await login(ALICE, url)
    _, bob, _ = await login(BOB, url)
    status, body = await request_as(BOB, f"{url}/api/v1/keys", "GET", bob["key"])
    assert status == 200 and {k["user"] for k in body["keys"]} == {BOB.name}
    status, body = await request_as(
        BOB, f"{url}/api/v1/keys/{alice['key_id']}", "DELETE", bob["key"]
    )
    assert status == 404 and body["error"]["code"] == "no_such_key"
    assert keys.lookup(alice["key"]) is not None
    status, _ = await request_as(
        ALICE, f"{url}/api/v1/keys/{alice['key_id']}", "DELETE", alice["key"]
    )
    assert status == 200 and keys.lookup(alice["key"]) is None
