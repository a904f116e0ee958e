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

import pytest
from aiohttp import web

from llmgw_slurm.munge import LOGIN_PAYLOAD
from llmgw_slurm.router.keys import KeyRing
from llmgw_slurm.router.login import LoginSettings, add_login_routes
from llmgw_slurm.slurm.cli import CliBackend
from tests.hostile_user import INTRUDER, HostileUser, world_dir

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
