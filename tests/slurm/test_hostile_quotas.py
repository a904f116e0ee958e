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

import pytest
import yaml

from llmgw_slurm.router.keys import add_key
from llmgw_slurm.router.usage import query_usage
from tests.hostile_user import INTRUDER, HostileUser, world_dir
from tests.slurm.harness import Harness, running, tiny_model


@pytest.fixture
def top() -> Iterator[Path]:
    """A folder the other users may traverse (pytest's tmp_path is root's, 0700)."""
    with world_dir() as d:
        yield d


# N requests at once from one process of the user's, each in a thread of its own:
# argv url, key, N, then a JSON body template ("{i}" becomes the request's number).
# Prints, per request, [status, usage's total_tokens or the error's code].
AT_ONCE = r"""
import json, sys, threading, urllib.request, urllib.error
url, key, n, template = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
out = [None] * n
def one(i):
    body = template.replace("{i}", str(i)).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
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
