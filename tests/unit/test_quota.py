"""Quotas (issue 18, item 4): per-minute limits per key, day and month budgets per
user and account, OpenAI's 429 and x-ratelimit-* headers."""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
from _router_support import engine, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_slurm.config import QuotaConfig, load_server_config
from llmgw_slurm.errors import ConfigError
from llmgw_slurm.router import (
    Endpoint,
    KeyRing,
    ModelInfo,
    StaticDirectory,
    UsageRecord,
    UsageStore,
    add_key,
    create_app,
)
from llmgw_slurm.router.keys import KeyRecord
from llmgw_slurm.router.quota import (
    AccountBudget,
    AccountBudgets,
    QuotaBook,
    _headers,
    _least_left,
    format_reset,
    set_account_budget,
)

# 2026-12-03 10:00:30 UTC: 30 s into a minute, 10 h into a day.
T0 = float(calendar.timegm((2026, 12, 3, 10, 0, 30)))


def key(user: str = "alice", account: str = "t18phys", key_id: str = "0000000a") -> KeyRecord:
    return KeyRecord(key_id, user, account, "0" * 64, 0.0)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_reset_times_read_as_openais() -> None:
    assert [format_reset(s) for s in (0, 0.2, 59, 60, 361, 3 * 3600 + 121)] == [
        "0s",
        "1s",
        "59s",
        "1m0s",
        "6m1s",
        "3h2m1s",
    ]


def test_requests_per_minute_per_key_in_fixed_windows() -> None:
    clock = Clock()
    book = QuotaBook(QuotaConfig(requests_per_minute=2), clock=clock)
    a, b = key(key_id="0000000a"), key(key_id="0000000b")
    assert book.admit(a) is None and book.admit(a) is None
    refused = book.admit(a)
    assert refused is not None and refused.status == 429
    assert refused.headers["Retry-After"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"] == "30s"
    body = json.loads(refused.text or "")
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    assert book.admit(b) is None  # another key has its own
    clock.now += 30
    assert book.admit(a) is None


def test_tokens_per_minute_count_what_was_spent() -> None:
    clock = Clock()
    book = QuotaBook(QuotaConfig(tokens_per_minute=100), clock=clock)
    k = key()
    assert book.admit(k) is None
    book.spent(k, 60)
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "40"
    assert book.admit(k) is None  # not yet over: the answer in flight is not cut
    book.spent(k, 60)
    refused = book.admit(k)
    assert refused is not None
    assert json.loads(refused.text or "")["error"]["type"] == "tokens"
    clock.now += 60
    assert book.admit(k) is None


def test_budgets_per_user_and_account_per_day_and_month() -> None:
    clock = Clock()
    book = QuotaBook(
        QuotaConfig(user_tokens_per_day=100, account_tokens_per_month=150), clock=clock
    )
    alice, bob = key("alice", "t18phys"), key("bob", "t18phys", "0000000b")
    book.spent(alice, 100)
    refused = book.admit(alice)
    assert refused is not None
    body = json.loads(refused.text or "")["error"]
    assert body["code"] == "insufficient_quota"
    assert "tokens per day of user alice: limit 100, used 100" in body["message"]
    # 14 h to midnight UTC.
    assert refused.headers["Retry-After"] == str(14 * 3600 - 30)
    assert book.admit(bob) is None
    book.spent(bob, 50)
    refused = book.admit(bob)  # the account's month is used up, by both
    assert refused is not None and "tokens per month of account t18phys" in (refused.text or "")
    clock.now += 14 * 3600  # the next day: alice's day budget is back, the month's is not
    refused = book.admit(alice)
    assert refused is not None and "per month" in (refused.text or "")


_LIMIT = st.one_of(st.none(), st.integers(1, 300))
# Seconds between requests: within a minute, or past an hour, a day, a month.
_GAP = st.one_of(st.integers(0, 120), st.sampled_from([3600, 86400, 29 * 86400]))


@settings(max_examples=300, deadline=None)
@given(
    limits=st.tuples(*[_LIMIT] * 6),
    own=st.one_of(st.none(), st.tuples(_LIMIT, _LIMIT)),
    spends=st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 120), _GAP)),
)
def test_admission_and_headers_tell_every_limit_as_the_full_count_does(
    tmp_path_factory: pytest.TempPathFactory,
    limits: tuple[int | None, ...],
    own: tuple[int | None, int | None] | None,
    spends: list[tuple[str, int, int]],
) -> None:
    """The per-request path (one pass, a key's budgets worked out once) against
    every limit worked out in full: the same refusals, the same headers."""
    path = tmp_path_factory.mktemp("q") / "quotas.json"
    if own is not None:
        set_account_budget(path, "t18phys", AccountBudget(*own))
    clock = Clock()
    book = QuotaBook(QuotaConfig(*limits), AccountBudgets(path), clock=clock)
    keys = {
        "a": key("alice", "t18phys", "0000000a"),
        "b": key("bob", "t18phys", "0000000b"),
        "c": key("carol", "", "0000000c"),
    }
    for who, tokens, seconds in spends:
        k = keys[who]
        clock.now += seconds
        req, token_limits = book._limits(k, clock.now)
        full = _headers(req, _least_left(token_limits))
        over = any(t.limit <= t.used for t in token_limits) or (
            req is not None and req.limit <= req.used
        )
        assert book.headers(k) == full
        refused = book.admit(k)
        assert (refused is not None) == over
        if refused is not None:
            assert {h: refused.headers[h] for h in full} == full
        else:
            book.spent(k, tokens)


def test_an_accounts_own_budget_overrides_the_servers(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    budgets = AccountBudgets(path)
    book = QuotaBook(QuotaConfig(account_tokens_per_day=10), budgets, clock=Clock())
    k = key()
    book.spent(k, 10)
    assert book.admit(k) is not None
    set_account_budget(path, "t18phys", AccountBudget(tokens_per_day=1000))
    assert book.admit(k) is None
    assert book.headers(k)["x-ratelimit-limit-tokens"] == "1000"
    set_account_budget(path, "t18phys", AccountBudget())
    assert book.admit(k) is not None
    assert json.loads(path.read_text()) == {"version": 1, "accounts": {}}


def test_budgets_follow_the_file_as_it_comes_goes_and_breaks(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    book = QuotaBook(QuotaConfig(account_tokens_per_day=10), AccountBudgets(path), clock=Clock())
    k = key()
    book.spent(k, 10)
    assert book.admit(k) is not None  # no file yet: the server's budget
    path.write_text('{"version": 1, "accounts": {"t18phys": {"tokens_per_day": 50}}')
    assert book.admit(k) is not None  # a broken file, never read: still the server's
    path.unlink()
    set_account_budget(path, "t18phys", AccountBudget(tokens_per_day=50))
    assert book.admit(k) is None
    path.write_text("{nope")  # broken once read: the budgets read last stay
    assert book.admit(k) is None
    path.unlink()
    assert book.admit(k) is not None


def test_a_broken_budgets_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    path.write_text('{"version": 1, "accounts": {"a": {"tokens_per_day": "many"}}}')
    with pytest.raises(ConfigError, match=r"quotas.json.*accounts\.a"):
        set_account_budget(path, "b", AccountBudget(5))


def test_budgets_start_from_the_usage_store(tmp_path: Path) -> None:
    db = tmp_path / "usage.sqlite3"
    store = UsageStore(db)
    day = T0 - 3600  # today
    last_month = float(calendar.timegm((2026, 11, 30, 12, 0, 0)))
    for ts, user, tokens in (
        (day, "alice", 70),
        (T0 - 2 * 86400, "alice", 20),
        (last_month, "alice", 999),
    ):
        store._write(
            [UsageRecord(ts, "0000000a", user, "t18phys", "m", "completions", tokens, 0, tokens)]
        )
    book = QuotaBook(
        QuotaConfig(user_tokens_per_day=100, account_tokens_per_month=100), clock=Clock()
    )
    book.load(db)
    # Day: 70 used; month (account): 70 + 20 used, the older month not counted.
    headers = book.headers(key())
    assert headers["x-ratelimit-remaining-tokens"] == "10"
    assert headers["x-ratelimit-limit-tokens"] == "100"


def test_quotas_need_keys(tmp_path: Path) -> None:
    (tmp_path / "server.yaml").write_text("state_dir: s\nquotas:\n  requests_per_minute: 5\n")
    with pytest.raises(ConfigError) as e:
        load_server_config(tmp_path / "server.yaml")
    assert "server.yaml:3: quotas:" in str(e.value) and "router.keys_file" in str(e.value)


# ---- through the gateway, with the openai client ------------------------------------


@asynccontextmanager
async def gateway(tmp_path: Path, cfg: QuotaConfig) -> AsyncIterator[tuple[str, str, QuotaBook]]:
    keyfile = tmp_path / "keys.json"
    k = add_key(keyfile, "alice", "t18phys").key
    directory = StaticDirectory([ModelInfo("tiny")])
    book = QuotaBook(cfg)
    app = create_app(directory, keys=KeyRing(keyfile), quota=book)
    async with engine("tiny", key="k0") as eurl, serve(app) as url:
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k0"))
        yield url, k, book


async def test_every_answer_has_the_headers_and_a_429_has_retry_after(tmp_path: Path) -> None:
    cfg = QuotaConfig(requests_per_minute=2, user_tokens_per_day=10_000)
    async with gateway(tmp_path, cfg) as (url, k, _):
        c = openai.AsyncOpenAI(api_key=k, base_url=url + "/v1", max_retries=0)
        raw = await c.completions.with_raw_response.create(model="tiny", prompt="a b", max_tokens=3)
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == "1"
        assert raw.headers["x-ratelimit-limit-tokens"] == "10000"
        # A stream: the headers come before the first byte.
        async with c.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
        ) as s:
            assert s.headers["x-ratelimit-remaining-requests"] == "0"
            async for _ in s.iter_lines():
                pass
        with pytest.raises(openai.RateLimitError) as e:
            await c.completions.create(model="tiny", prompt="a", max_tokens=1)
        assert e.value.response.headers["retry-after"]
        assert e.value.code == "rate_limit_exceeded"
        # Also the answers that are not completions (the model list).
        async with aiohttp.ClientSession() as s2:
            r = await s2.get(url + "/v1/models", headers={"Authorization": f"Bearer {k}"})
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
        await c.close()


# A client's trace context sends a request down aiohttp's path; without one,
# the fast lane serves it.
TRACED = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.mark.parametrize("path", ["lane", "aiohttp"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_headers_tell_the_limits_as_they_stood_when_the_request_was_let_in(
    tmp_path: Path, path: str, stream: bool
) -> None:
    # Itself counted, its tokens not yet (as OpenAI's): the same on both
    # paths, streamed or not; the next request's tell them.
    cfg = QuotaConfig(requests_per_minute=100, tokens_per_minute=10_000)
    async with gateway(tmp_path, cfg) as (url, k, _):
        c = openai.AsyncOpenAI(
            api_key=k, base_url=url + "/v1", max_retries=0,
            default_headers=TRACED if path == "aiohttp" else {},
        )  # fmt: skip
        seen = []
        for _ in range(2):
            async with c.chat.completions.with_streaming_response.create(
                model="tiny", messages=[{"role": "user", "content": "a b c"}], max_tokens=4,
                stream=stream, stream_options={"include_usage": True} if stream else None,
            ) as r:  # fmt: skip
                lines = [line async for line in r.iter_lines() if line]
            usage = [json.loads(x.removeprefix("data: ")) for x in lines if "usage" in x][-1]
            seen.append((r.headers, usage["usage"]["total_tokens"]))
            # aiohttp names itself in Server; the lane does not.
            assert ("Server" in r.headers) == (path == "aiohttp"), r.headers
        await c.close()
    (first, used), (second, _) = seen
    assert (first["x-ratelimit-remaining-requests"], first["x-ratelimit-remaining-tokens"]) == (
        "99",
        "10000",
    )
    assert second["x-ratelimit-remaining-requests"] == "98"
    assert second["x-ratelimit-remaining-tokens"] == str(10_000 - used)


async def test_a_stream_that_crosses_the_budget_is_finished_and_the_next_refused(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path, QuotaConfig(user_tokens_per_day=5)) as (url, k, _):
        c = openai.AsyncOpenAI(api_key=k, base_url=url + "/v1", max_retries=0)
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "one two three four"}],
            max_tokens=8,
            stream=True,
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text  # the whole answer came, past the budget
        with pytest.raises(openai.RateLimitError) as e:
            await c.completions.create(model="tiny", prompt="a", max_tokens=1)
        assert e.value.code == "insufficient_quota"
        await c.close()


# ---- llmgw-admin quota ---------------------------------------------------------------


def test_admin_quota_set_list_unset(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmgw_slurm.cli.admin import main as admin

    server = tmp_path / "server.yaml"
    server.write_text(
        f"state_dir: {tmp_path / 'state'}\nrouter: {{keys_file: {tmp_path / 'keys.json'}}}\n"
        "quotas: {account_tokens_per_day: 1000}\n"
    )
    (tmp_path / "state").mkdir()

    def run(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(admin, [*args, "--server", str(server)])
        return res.exit_code, res.output

    code, out = run("quota", "set", "t18phys", "--tokens-per-day", "5000")
    assert code == 0 and "account t18phys: 5000 tokens per day" in out
    code, out = run("quota", "list", "--json")
    data = json.loads(out)
    assert data["accounts"] == {"t18phys": {"tokens_per_day": 5000, "tokens_per_month": None}}
    assert data["server"]["account_tokens_per_day"] == 1000
    code, out = run("quota", "list")
    assert code == 0 and "t18phys" in out and "account_tokens_per_day" in out
    assert run("quota", "set", "t18phys")[0] == 2
    code, out = run("quota", "set", "bad name!", "--tokens-per-day", "1")
    assert code == 2 and "not a Slurm account name" in out
    assert run("quota", "unset", "t18phys")[0] == 0
    assert json.loads(run("quota", "list", "--json")[1])["accounts"] == {}


def test_admin_usage_by_user_account_key_and_model(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from llmgw_slurm.cli.admin import main as admin

    server = tmp_path / "server.yaml"
    server.write_text(f"state_dir: {tmp_path / 'state'}\n")
    store = UsageStore(tmp_path / "state" / "usage.sqlite3")
    now = calendar.timegm(time.gmtime())
    rows = [
        ("0000000a", "alice", "t18phys", "m1", 10),
        ("0000000b", "alice", "t18chem", "m2", 5),
        ("0000000c", "bob", "t18phys", "m1", 1),
        ("00000000", "old", "t18phys", "m1", 1000),
    ]
    for key_id, user, account, model, tokens in rows:
        ts = now - 100 if user != "old" else now - 90 * 86400
        store._write(
            [UsageRecord(ts, key_id, user, account, model, "completions", tokens, 1, tokens + 1)]
        )

    def usage(by: str) -> list[dict[str, object]]:
        res = CliRunner().invoke(admin, ["usage", "--by", by, "--json", "--server", str(server)])
        assert res.exit_code == 0, res.output
        return [{k: r[k] for k in (by, "requests", "total_tokens")} for r in json.loads(res.output)]

    assert usage("user") == [
        {"user": "alice", "requests": 2, "total_tokens": 17},
        {"user": "bob", "requests": 1, "total_tokens": 2},
    ]
    assert usage("account") == [
        {"account": "t18phys", "requests": 2, "total_tokens": 13},
        {"account": "t18chem", "requests": 1, "total_tokens": 6},
    ]
    assert [r["key"] for r in usage("key")] == ["0000000a", "0000000b", "0000000c"]
    res = CliRunner().invoke(admin, ["usage", "--by", "account", "--server", str(server)])
    assert res.exit_code == 0 and "t18phys" in res.output and "TOTAL TOKENS" in res.output
