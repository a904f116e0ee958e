"""Another user of the cluster against quotas, shares and metrics (issue 33, items 4-6).

The other user is a real second Unix account (tests/hostile_user.py) running the
system's Python, the daemon a real one on the dev cluster (the harness's, in
this process): requests come from that user's own processes, as they would
from a researcher who wants more than their share.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from llmgw_slurm.accounting.usage import query_usage
from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.auth.munge import LOGIN_PAYLOAD
from llmgw_slurm.router import GATEWAY_KEY
from tests.hostile_user import INTRUDER, HostileUser, world_dir
from tests.slurm.conftest import eventually
from tests.slurm.harness import TINY_ENGINE, Harness, running, tiny_model
from tests.slurm.test_login import ALICE, associations, login, munge_socket

__all__ = ["associations"]  # a fixture of test_login's, used here too


@pytest.fixture
def top() -> Iterator[Path]:
    """A folder the other users may traverse (pytest's tmp_path is root's, 0700)."""
    with world_dir() as d:
        yield d


# N requests at once from one process of the user's, each in a thread of its own:
# argv url, keys (comma-separated, used in turn), N, then a JSON body template
# ("{i}" becomes the request's number). Prints, per request, [status, usage's
# total_tokens or the error's code].
AT_ONCE = r"""
import json, sys, threading, urllib.request, urllib.error
url, keys, n, template = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4]
out = [None] * n
def one(i):
    body = template.replace("{i}", str(i)).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "Authorization": "Bearer " + keys[i % len(keys)], "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out[i] = [r.status, json.load(r)["usage"]["total_tokens"]]
    except urllib.error.HTTPError as e:
        out[i] = [e.code, json.load(e)["error"]["code"]]
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""


async def at_once(user: HostileUser, url: str, key: str, n: int, body: dict[str, Any]) -> Any:
    template = json.dumps(body).replace('"@i"', '"w{i}"')
    r = await asyncio.to_thread(user.python, AT_ONCE, url, key, str(n), template, timeout=400)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def with_server(**sections: Any) -> Callable[[Harness], None]:
    """A harness ``configure`` that sets server.yaml's ``sections``."""

    def configure(h: Harness) -> None:
        server = yaml.safe_load(h.server_yaml.read_text())
        server.update(sections)
        h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))

    return configure


async def test_twelve_requests_at_once_get_no_more_tokens_than_the_per_minute_limit(
    top: Path, prefix: str
) -> None:
    # Twelve requests of at most 300 tokens each, sent together by another user
    # with one key to a cold model: before reservations all twelve were let in
    # while it started (nothing was spent yet) and used 12 x 301 = 3,612 tokens
    # of a 2,000-token minute.
    keys_file = top / "keys.json"
    key = add_key(keys_file, INTRUDER.name, "t33acct").key
    body = {"model": "tiny", "messages": [{"role": "user", "content": "@i"}], "max_tokens": 300}
    async with running(
        top, prefix, [tiny_model("tiny")], router={"keys_file": str(keys_file)},
        configure=with_server(quotas={"tokens_per_minute": 2000}),
    ) as h:  # fmt: skip
        got = await at_once(INTRUDER, h.url, key, 12, body)
    served = [tokens for status, tokens in got if status == 200]
    refused = [code for status, code in got if status != 200]
    assert served, got
    assert sum(served) <= 2000, got
    assert refused and set(refused) == {"rate_limit_exceeded"}, got


# Upload argv[3] as a batch input file, make a batch of it, and wait for its end
# (or, past 4 minutes, give up waiting); prints the batch as the API last gave it.
BATCH = r"""
import json, sys, time, uuid, urllib.request, urllib.error
url, key, path = sys.argv[1:4]
def call(method, p, data=None, ctype="application/json"):
    req = urllib.request.Request(url + p, data=data, method=method,
        headers={"Authorization": "Bearer " + key, "Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
b = "llmgw" + uuid.uuid4().hex
head = ('--%s\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--%s\r\n'
        'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        'Content-Type: application/jsonl\r\n\r\n' % (b, b)).encode()
status, f = call("POST", "/v1/files", head + open(path, "rb").read() + b"\r\n--%s--\r\n" % b.encode(),
                 "multipart/form-data; boundary=" + b)
assert status == 200, (status, f)
ask = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "1h"}
status, batch = call("POST", "/v1/batches", json.dumps(ask).encode())
assert status == 200, (status, batch)
deadline = time.time() + 240
while batch["status"] in ("validating", "in_progress", "finalizing", "cancelling"):
    if time.time() > deadline:
        break
    time.sleep(1)
    status, batch = call("GET", "/v1/batches/" + batch["id"])
print(json.dumps(batch))
"""


def batch_lines(n: int, max_tokens: int) -> bytes:
    out = []
    for i in range(n):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"w{i}"}]}
        body["max_tokens"] = max_tokens
        out.append(
            {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return "".join(json.dumps(o) + "\n" for o in out).encode()


async def run_batch(user: HostileUser, url: str, key: str, top: Path, data: bytes) -> Any:
    path = top / f"in-{len(list(top.glob('in-*')))}.jsonl"
    path.write_bytes(data)
    path.chmod(0o644)
    r = await asyncio.to_thread(user.python, BATCH, url, key, str(path), timeout=400)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


async def test_a_batch_past_the_daily_budget_is_refused_and_the_budget_holds(
    top: Path, prefix: str
) -> None:
    # Before: a key's batches never entered its budgets; ten requests of 300
    # tokens ran against a 2,000-token day and used 3,010.
    keys_file = top / "keys.json"
    key = add_key(keys_file, INTRUDER.name, "t33acct").key
    configure = with_server(
        quotas={"user_tokens_per_day": 2000},
        batch={"partition": "llm", "concurrency": 2, "poll_interval": "1s"},
    )
    async with running(
        top, prefix, [tiny_model("tiny")], router={"keys_file": str(keys_file)},
        configure=configure,
    ) as h:  # fmt: skip
        big = await run_batch(INTRUDER, h.url, key, top, batch_lines(10, 300))
        assert big["status"] == "failed", big
        assert [e["code"] for e in big["errors"]["data"]] == ["insufficient_quota"], big
        assert h.jobs() == []  # nothing ran
        fits = await run_batch(INTRUDER, h.url, key, top, batch_lines(5, 300))
        assert fits["status"] == "completed", fits
        assert fits["request_counts"]["completed"] == 5
        # What is left of the day (2,000 - 5 x 301) is less than another such batch.
        again = await run_batch(INTRUDER, h.url, key, top, batch_lines(2, 300))
        assert again["status"] == "failed", again
        body = {"model": "tiny", "messages": [{"role": "user", "content": "@i"}], "max_tokens": 600}
        (online,) = await at_once(INTRUDER, h.url, key, 1, body)
        assert online == [429, "insufficient_quota"]
    # The usage store, once the daemon has written all of it.
    usage = query_usage(top / "daemon" / "state" / "usage.sqlite3", user=INTRUDER.name)
    spent = sum(u.total_tokens for u in usage)
    assert spent == 5 * 301, usage


async def test_one_user_with_many_keys_cannot_take_more_than_a_users_share_of_the_queue(
    top: Path, prefix: str
) -> None:
    # A model that stays cold for the test's length: every request waits. Before,
    # another user with four keys (as llmgw login hands out) held a key's share
    # with each, 4 x 2 = the whole queue of 8, and everyone else got 429.
    cold = tiny_model(
        "cold",
        engine={"kind": "command", "command": [*TINY_ENGINE, "--ready-after", "600"],
                "ready_timeout": "15m"},
    )  # fmt: skip
    keys_file = top / "keys.json"
    theirs = [add_key(keys_file, INTRUDER.name, "t33acct").key for _ in range(4)]
    alice = add_key(keys_file, "t33alice", "t33other").key
    router = {"keys_file": str(keys_file), "max_held": 8, "hold_timeout": "20s"}
    body = {"model": "cold", "messages": [{"role": "user", "content": "@i"}], "max_tokens": 5}
    async with running(top, prefix, [cold], router=router) as h:
        gw = h.d.gateway[GATEWAY_KEY] if h.d is not None else None
        assert gw is not None
        burst = asyncio.ensure_future(at_once(INTRUDER, h.url, ",".join(theirs), 12, body))
        await eventually(
            lambda: _true(gw.held.get("cold", 0) >= 2 or burst.done()), "their held requests"
        )
        mine = asyncio.ensure_future(_post(h.url, alice, body))
        await eventually(lambda: _true(gw.held.get("cold", 0) == 3 or mine.done()), "mine held")
        assert not mine.done(), mine.result()  # waiting, not refused
        got = await burst
        mine.cancel()
    refused = [code for status, code in got if status == 429]
    assert len(refused) == 10, got  # a user's share is 2: 2 held, 10 refused
    assert set(refused) <= {"too_many_held_requests_for_user", "too_many_held_requests_for_key"}
    assert "too_many_held_requests_for_user" in refused, got


async def _true(value: bool) -> bool:
    return value


async def _post(url: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    data = json.dumps(body).replace('"@i"', '"mine"')
    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with s.post(url + "/v1/chat/completions", data=data, headers=headers) as r:
            return r.status, await r.json()


# One user's logins in a burst, each with a fresh credential of their own:
# argv url, munge socket, N. Prints each answer's status.
LOGINS = r"""
import json, subprocess, sys, urllib.request, urllib.error
url, sock, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = []
for _ in range(n):
    cred = subprocess.run(["munge", "--socket=" + sock, "--string", %r],
                          capture_output=True, text=True, check=True).stdout.strip()
    req = urllib.request.Request(url + "/api/v1/login", data=json.dumps({"credential": cred}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            out.append(r.status)
    except urllib.error.HTTPError as e:
        out.append(e.code)
print(json.dumps(out))
""" % (LOGIN_PAYLOAD,)  # noqa: UP031


async def test_one_users_login_burst_does_not_lock_out_another_user(
    top: Path, prefix: str, associations: None
) -> None:
    # Every local user is 127.0.0.1: before, a limit per address let the other
    # user's burst lock alice out of llmgw login for a minute.
    keys_file = top / "keys.json"
    login_cfg = {"enabled": True, "munge_socket": str(munge_socket()), "attempts_per_minute": 3}
    async with running(
        top, prefix, [tiny_model("tiny")], router={"keys_file": str(keys_file)},
        configure=with_server(login=login_cfg),
    ) as h:  # fmt: skip
        r = await asyncio.to_thread(
            INTRUDER.python, LOGINS, h.url, str(munge_socket()), "5", timeout=120
        )
        assert r.returncode == 0, r.stderr
        # Slurm does not know them (403), and past 3 a minute they are refused (429).
        assert json.loads(r.stdout) == [403, 403, 403, 429, 429]
        status, body, _ = await login(ALICE, h.url)
    assert status == 200, body
    assert body["user"] == ALICE.name


# GET argv[1] with an optional bearer argv[2]; prints the status and the body.
GET = r"""
import json, sys, urllib.request, urllib.error
url, token = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
req = urllib.request.Request(url, headers={"Authorization": "Bearer " + token} if token else {})
try:
    with urllib.request.urlopen(req) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
"""


async def test_metrics_without_the_admin_token_name_no_restricted_model(
    top: Path, prefix: str
) -> None:
    # Before: /metrics answered anyone with every model's series, restricted or not.
    keys_file = top / "keys.json"
    owner = add_key(keys_file, "t33owner", "t33acct").key
    models = [
        tiny_model("open-one"),
        tiny_model("t33secret", scaling={"min": 1, "max": 1}, access={"users": ["t33owner"]}),
    ]
    async with running(top, prefix, models, router={"keys_file": str(keys_file)}) as h:
        await eventually(
            lambda: _true(bool(h.rec.endpoints("t33secret"))), "t33secret to serve", 120
        )
        status, _ = await _post(
            h.url, owner, {"model": "t33secret", "messages": [{"role": "user", "content": "x"}]}
        )
        assert status == 200
        admin = (top / "daemon" / "state" / "admin.token").read_text().strip()
        seen = {}
        for who, token in (
            ("no key", ""),
            ("a wrong token", "llmgw-admin-guess"),
            ("admin", admin),
        ):
            r = await asyncio.to_thread(INTRUDER.python, GET, h.url + "/metrics", token)
            assert r.returncode == 0, r.stderr
            seen[who] = json.loads(r.stdout)
    for who in ("no key", "a wrong token"):
        status, text = seen[who]
        assert status == 200 and "t33secret" not in text, who
        assert "llmgw_heap_untrimmed_bytes" in text  # what names no model is still there
    status, text = seen["admin"]
    assert 'llmgw_requests_total{model="t33secret",status="200"} 1.0' in text
