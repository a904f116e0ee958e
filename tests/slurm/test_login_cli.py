"""``llmgw login``, ``keys`` and ``logout`` run by other Unix users with the ``llmgw`` CLI
itself, their own code's ``openai`` client, and the audit that charges them (issue 18).

The users (t18alice, t18bob, llmgw-intruder: see test_login.py) run the
system's Python on a world-readable copy of this tree and its dependencies
(:mod:`tests.user_site`: the runner's own interpreter is in a folder only root
may read), with their own HOME, so the config file, its mode and the munge
credential are theirs. One daemon for the module (login on, a replica of
``phys`` always up, batches on): each test goes on from the state the ones
before it left, as a site's day does.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
import yaml

from llmgw_slurm.accounting.usage import usage_by
from tests.hostile_user import INTRUDER, HostileUser, world_dir
from tests.slurm.conftest import eventually
from tests.slurm.harness import Harness, running, tiny_model
from tests.slurm.test_batch import lines
from tests.slurm.test_login import ALICE, BOB, associations, munge_socket  # noqa: F401
from tests.user_site import TOP, UserSite, user_site

pytestmark = pytest.mark.asyncio(loop_scope="module")

# A researcher's own code: the official client, the key from their config file.
CHAT = """
import json, sys, openai, yaml, os
url, max_tokens, words = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path = os.path.expanduser("~/.config/llmgw/config.yaml")
key = sys.argv[4] if len(sys.argv) > 4 else yaml.safe_load(open(path))["api_key"]
c = openai.OpenAI(api_key=key, base_url=url + "/v1", max_retries=0)
try:
    r = c.chat.completions.create(model="phys", max_tokens=max_tokens,
        messages=[{"role": "user", "content": " ".join(["w"] * words)}])
    print(json.dumps({"status": 200, "tokens": r.usage.total_tokens}))
except openai.APIStatusError as e:
    print(json.dumps({"status": e.status_code, "code": e.code}))
"""


@dataclass(frozen=True)
class Site:
    h: Harness
    users: UserSite
    top: Path


def home_of(site: Site, user: HostileUser) -> Path:
    return site.top / "home" / user.name


async def llmgw(site: Site, user: HostileUser, *args: str) -> subprocess.CompletedProcess[str]:
    """``llmgw ARGS`` as ``user``, from their own home (their config file is there).

    In a thread: the daemon answering it runs on this event loop."""
    env = {
        **site.users.env(),
        "HOME": str(home_of(site, user)),
        "LLMGW_URL": site.h.url,
        "LLMGW_DAEMON_INFO": str(site.top / "run" / "daemon.json"),
        "LLMGW_MUNGE_SOCKET": str(munge_socket()),
    }
    return await asyncio.to_thread(user.run, [site.users.llmgw, *args], env=env, timeout=120)


async def keys_of(site: Site, user: HostileUser) -> list[dict[str, Any]]:
    r = await llmgw(site, user, "keys", "--json")
    assert r.returncode == 0, r.stderr
    keys: list[dict[str, Any]] = json.loads(r.stdout)["keys"]
    return keys


def config_key(site: Site, user: HostileUser) -> str | None:
    cfg = yaml.safe_load((home_of(site, user) / ".config" / "llmgw" / "config.yaml").read_text())
    key = cfg.get("api_key")
    return str(key) if key is not None else None


async def chat_as(
    site: Site, user: HostileUser, max_tokens: int, words: int, key: str = ""
) -> dict[str, Any]:
    env = {**site.users.env(), "HOME": str(home_of(site, user))}
    args = [site.h.url, str(max_tokens), str(words), *([key] if key else [])]
    r = await asyncio.to_thread(user.python, CHAT, *args, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def with_login_and_batches(top: Path) -> Any:
    def configure(h: Harness) -> None:
        server = yaml.safe_load(h.server_yaml.read_text())
        server["login"] = {
            "enabled": True,
            "munge_socket": str(munge_socket()),
            "attempts_per_minute": 100,
        }
        # Where researchers' CLIs read daemon.json (as /run/llmgw-slurm in production):
        # state_dir is the daemon's alone.
        server["runtime_dir"] = str(top / "run")
        # Batches as Slurm jobs of their own, not rides on phys's warm replica
        # (batch.warm, tests/slurm/test_batch_warm.py): the audit below charges a
        # batch job to its user by the job's comment in sacct.
        server["batch"] = {
            "partition": "llm",
            "concurrency": 2,
            "poll_interval": "1s",
            "warm": False,
        }
        h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))

    return configure


@pytest.fixture(scope="module")
def users() -> Iterator[UserSite]:
    with user_site() as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def site(associations: None, users: UserSite, slurm_conf: str) -> AsyncIterator[Site]:  # noqa: F811
    prefix = f"llmgwtest-{os.urandom(3).hex()}."
    with world_dir() as top:
        for u in (ALICE, BOB, INTRUDER):
            home = top / "home" / u.name
            home.mkdir(parents=True)
            shutil.chown(home, u.uid, u.gid)
            home.chmod(0o700)
        phys = tiny_model("phys", scaling={"min": 1, "max": 1})
        async with running(
            top,
            prefix,
            [phys],
            router={"keys_file": str(top / "keys.json")},
            configure=with_login_and_batches(top),
        ) as h:
            yield Site(h, users, top)


async def test_login_keys_and_logout_with_the_cli_as_each_user(site: Site) -> None:
    r = await llmgw(site, ALICE, "login")
    assert r.returncode == 0, r.stderr
    assert "Logged in as t18alice (Slurm account t18phys)" in r.stdout
    cfg = home_of(site, ALICE) / ".config" / "llmgw" / "config.yaml"
    st = cfg.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (ALICE.uid, 0o600)
    first = config_key(site, ALICE)
    assert first is not None

    r = await llmgw(site, ALICE, "login", "--account", "t18chem")
    assert r.returncode == 0 and "(Slurm account t18chem)" in r.stdout, r.stderr
    r = await llmgw(site, BOB, "login", "--account", "t18phys")
    assert r.returncode == 1
    assert "no association with Slurm account 't18phys'; yours: t18chem" in r.stderr
    r = await llmgw(site, INTRUDER, "login")
    assert r.returncode == 1 and "has no Slurm account" in r.stderr
    r = await llmgw(site, BOB, "login")
    assert r.returncode == 0 and "(Slurm account t18chem)" in r.stdout, r.stderr

    alice_keys = await keys_of(site, ALICE)
    assert sorted(k["account"] for k in alice_keys) == ["t18chem", "t18phys"]
    (bobs,) = await keys_of(site, BOB)  # his only: none of alice's
    first_id = next(k["key_id"] for k in alice_keys if k["account"] == "t18phys")
    r = await llmgw(site, BOB, "keys", "revoke", first_id)
    assert r.returncode == 1 and f"you have no key with id {first_id!r}" in r.stderr
    # Bob cannot take her key from her config either (0600 in her 0700 home).
    r = await asyncio.to_thread(BOB.run, ["cat", str(cfg)])
    assert r.returncode != 0 and "Permission denied" in r.stderr

    r = await llmgw(site, ALICE, "keys", "revoke", first_id)
    assert r.returncode == 0, r.stderr
    assert (await chat_as(site, ALICE, 1, 1, key=first))["status"] == 401
    second = config_key(site, ALICE)
    r = await llmgw(site, ALICE, "logout")
    assert r.returncode == 0 and "revoked and removed" in r.stdout, r.stderr
    assert config_key(site, ALICE) is None
    assert second is not None and (await chat_as(site, ALICE, 1, 1, key=second))["status"] == 401
    r = await llmgw(site, ALICE, "keys")
    assert r.returncode == 1 and "run `llmgw login` first" in r.stderr
    assert [k["key_id"] for k in await keys_of(site, BOB)] == [bobs["key_id"]]


def sacct_batch(prefix: str, batch_id: str) -> tuple[str, str]:
    """(job id, comment) of the batch's job as slurmdbd keeps it; ("", "") before it does."""
    r = subprocess.run(
        ["sacct", "-n", "-P", "-X", "--name", f"{prefix}_batch.{batch_id}", "-o", "JobID,Comment"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job_id, _, comment = (r.stdout.strip().splitlines() or [""])[0].partition("|")
    return job_id, comment


def sacct_elapsed(prefix: str, batch_id: str) -> int:
    """Seconds the batch's job ran (one GPU: its GPU seconds), as slurmdbd keeps them."""
    r = subprocess.run(
        ["sacct", "-n", "-P", "-X", "--name", f"{prefix}_batch.{batch_id}", "-o", "ElapsedRaw"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return sum(int(x) for x in r.stdout.split())


async def audit(site: Site, by: str) -> dict[str, Any]:
    r = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "from llmgw_slurm.cli.admin import main; main()",
         "audit", "--by", by, "--json", "--since", "1d", "--server", str(site.h.server_yaml)],
        capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "PYTHONPATH": str(TOP)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


async def test_the_openai_client_as_each_user_and_the_audit_that_charges_them(
    site: Site,
) -> None:
    h = site.h
    for u in (ALICE, BOB):
        r = await llmgw(site, u, "login")
        assert r.returncode == 0, r.stderr

    async def ready() -> bool:
        return bool(h.rec.endpoints("phys"))

    await eventually(ready, "phys to serve", timeout=120)
    a = await chat_as(site, ALICE, 16, 40)
    b = await chat_as(site, BOB, 4, 10)
    assert a["status"] == b["status"] == 200, (a, b)
    assert a["tokens"] > b["tokens"]

    # Alice's batch, from her key: its own job, charged to her by its comment.
    key = config_key(site, ALICE)
    c = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=key, max_retries=0, timeout=60)
    f = await c.files.create(file=("in.jsonl", io.BytesIO(lines("phys", 2))), purpose="batch")
    batch = await c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    async def done() -> Any:
        got = await c.batches.retrieve(batch.id)
        return got if got.status in ("completed", "failed") else None

    finished = await eventually(done, "the batch to finish", timeout=120)
    assert finished.status == "completed", finished
    await c.close()
    async def commented() -> tuple[str, str] | None:
        # None, not ("", ""): a non-empty tuple is true, and eventually() would stop.
        got = await asyncio.to_thread(sacct_batch, h.prefix, batch.id)
        return got if "user=" in got[1] else None

    _, comment = await eventually(commented, "sacct to keep the batch job's comment", timeout=30)
    assert comment.endswith(f"model=phys gpus=1 user={ALICE.name} account=t18phys"), comment

    async def recorded() -> bool:
        rows = usage_by(h.folder / "state" / "usage.sqlite3", "user")
        return {ALICE.name, BOB.name} <= {r["user"] for r in rows}

    await eventually(recorded, "the usage store to hold both users' requests", timeout=10)
    by_user = {(r["owner"], r["model"]): r for r in (await audit(site, "user"))["rows"]}
    alice, bob = by_user[(ALICE.name, "phys")], by_user[(BOB.name, "phys")]
    # Her batch's GPU hours are its run's (a run under a second is 0 in sacct).
    assert alice["batch_jobs"] == 1
    assert alice["batch_gpu_hours"] == round(sacct_elapsed(h.prefix, batch.id) / 3600, 4)
    assert bob["batch_jobs"] == 0 and bob["batch_gpu_hours"] == 0
    # The replica's hours split by tokens: alice asked for more.
    assert alice["online_gpu_hours_apportioned"] > bob["online_gpu_hours_apportioned"] > 0
    by_account = {r["owner"] for r in (await audit(site, "account"))["rows"]}
    assert {"t18phys", "t18chem"} <= by_account
