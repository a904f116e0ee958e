"""Quotas (issue 18, item 4): per-minute limits per key, day and month budgets per
user and account, OpenAI's 429 and x-ratelimit-* headers."""

from __future__ import annotations

import asyncio
import calendar
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from _router_support import engine, eventually, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_slurm.accounting.quota import (
    NOTHING,
    AccountBudget,
    AccountBudgets,
    Ask,
    QuotaBook,
    Refusal,
    Reservation,
    ask_of,
    format_reset,
    prompt_estimate,
    set_account_budget,
)
from llmgw_slurm.accounting.usage import SqliteUsage, UsageRecord, UsageStore
from llmgw_slurm.auth.keys import KeyRecord, KeyRing, add_key
from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.config import QuotaConfig, load_server_config
from llmgw_slurm.router import (
    GATEWAY_KEY,
    Endpoint,
    Gateway,
    ModelInfo,
    RouterConfig,
    StaticDirectory,
    create_app,
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


def admitted(book: QuotaBook, k: KeyRecord, ask: Ask = NOTHING) -> Reservation:
    got = book.reserve(k, ask)
    assert isinstance(got, Reservation), got
    return got


def refused(book: QuotaBook, k: KeyRecord, ask: Ask = NOTHING) -> Refusal:
    got = book.reserve(k, ask)
    assert isinstance(got, Refusal), got
    return got


def test_requests_per_minute_per_key_in_fixed_windows() -> None:
    clock = Clock()
    book = QuotaBook(QuotaConfig(requests_per_minute=2), clock=clock)
    a, b = key(key_id="0000000a"), key(key_id="0000000b")
    admitted(book, a)
    assert admitted(book, a).headers["x-ratelimit-remaining-requests"] == "0"
    no = refused(book, a).response()
    assert no.status == 429
    assert no.headers["Retry-After"] == "30"
    assert no.headers["x-ratelimit-remaining-requests"] == "0"
    assert no.headers["x-ratelimit-reset-requests"] == "30s"
    body = json.loads(no.text or "")
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    admitted(book, b)  # another key has its own
    clock.now += 30
    admitted(book, a)


def test_a_request_is_let_in_only_if_its_maximum_fits_and_holds_it_until_it_ends() -> None:
    clock = Clock()
    book = QuotaBook(QuotaConfig(tokens_per_minute=100), clock=clock)
    k = key()
    first = admitted(book, k, Ask(10, 50))
    assert first.headers["x-ratelimit-remaining-tokens"] == "100"  # as it was let in
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "40"  # 60 held
    # 40 left while the first is in flight: a second of 60 waits for it.
    no = refused(book, k, Ask(10, 50))
    assert no.retry_after == 5 and "60 held by your requests in flight" in no.message
    assert no.code == "rate_limit_exceeded"
    first.settle(25)
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "75"
    second = admitted(book, k, Ask(10, 50))
    second.release()  # ended with no count: nothing spent
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "75"
    clock.now += 60
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "100"


def test_a_reservation_ends_exactly_once() -> None:
    book = QuotaBook(QuotaConfig(user_tokens_per_day=1000), clock=Clock())
    k = key()
    r = admitted(book, k, Ask(100, 100))
    r.settle(30)
    r.settle(30)
    r.release()
    assert r.ended
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "970"
    r2 = admitted(book, k, Ask(100, 100))
    r2.release()
    r2.settle(500)  # too late: it ended
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "970"


def test_a_request_larger_than_a_whole_limit_is_refused_with_what_to_change() -> None:
    book = QuotaBook(QuotaConfig(tokens_per_minute=2000, user_tokens_per_day=10**6), clock=Clock())
    k = key()
    no = refused(book, k, Ask(20, 4000))
    assert no.message.startswith("Request too large for key 0000000a on tokens per minute")
    assert "4020 tokens (about 20 for its prompt, 4000 by max_tokens)" in no.message
    assert no.message.endswith("Lower max_tokens or the prompt.")
    no = refused(book, k, Ask(20, 32000, own=False))
    assert "no max_tokens: the model's limit" in no.message
    assert no.message.endswith("Set max_tokens.")


def test_budgets_per_user_and_account_per_day_and_month() -> None:
    clock = Clock()
    book = QuotaBook(
        QuotaConfig(user_tokens_per_day=100, account_tokens_per_month=150), clock=clock
    )
    alice, bob = key("alice", "t18phys"), key("bob", "t18phys", "0000000b")
    admitted(book, alice, Ask(0, 100)).settle(100)
    no = refused(book, alice)
    assert no.code == "insufficient_quota"
    assert "tokens per day of user alice: limit 100, used 100" in no.message
    # 14 h to midnight UTC.
    assert no.retry_after == 14 * 3600 - 30
    admitted(book, bob, Ask(0, 50)).settle(50)
    # The account's month is used up, by both.
    assert "tokens per month of account t18phys" in refused(book, bob).message
    clock.now += 14 * 3600  # the next day: alice's day budget is back, the month's is not
    assert "per month" in refused(book, alice).message


def test_tokens_held_over_midnight_still_count_the_next_day() -> None:
    clock = Clock()
    book = QuotaBook(QuotaConfig(user_tokens_per_day=100), clock=clock)
    k = key()
    long = admitted(book, k, Ask(0, 90))
    clock.now += 14 * 3600  # a new day: nothing used yet, 90 still held
    refused(book, k, Ask(0, 20))
    long.settle(90)  # counted in the day it ended
    assert book.headers(k)["x-ratelimit-remaining-tokens"] == "10"


def test_a_batch_counts_against_budgets_not_per_minute_limits() -> None:
    book = QuotaBook(
        QuotaConfig(requests_per_minute=1, tokens_per_minute=10, user_tokens_per_day=1000),
        clock=Clock(),
    )
    k = key()
    admitted(book, k)  # the key's one request this minute
    batch = book.reserve(k, Ask(0, 900), per_minute=False)
    assert isinstance(batch, Reservation)
    assert isinstance(book.reserve(k, Ask(0, 200), per_minute=False), Refusal)
    batch.settle(300)
    assert isinstance(book.reserve(k, Ask(0, 700), per_minute=False), Reservation)


# A request of the model below: (key, prompt, answer) asked, and the fraction of it used.
_REQUEST = st.tuples(
    st.sampled_from("abc"), st.integers(0, 200), st.integers(0, 900), st.floats(0, 1)
)


@settings(max_examples=300, deadline=None)
@given(
    limits=st.tuples(*[st.one_of(st.none(), st.integers(1, 3000))] * 6),
    steps=st.lists(st.tuples(_REQUEST, st.sampled_from(["hold", "settle", "release", "wait"]))),
)
def test_no_mix_of_requests_in_flight_passes_any_limit(
    limits: tuple[int | None, ...], steps: list[tuple[tuple[str, int, int, float], str]]
) -> None:
    """Whatever requests are let in, in flight together or not, and however each
    ends (settled at most at what it asked, or released), no limit is passed, and
    once all have ended nothing is held."""
    clock = Clock()
    book = QuotaBook(QuotaConfig(*limits), clock=clock)
    keys = {
        "a": key("alice", "t18phys", "0000000a"),
        "b": key("bob", "t18phys", "0000000b"),
        "c": key("carol", "", "0000000c"),
    }
    spent = {"minute": {}, "user": {}, "account": {}}  # type: dict[str, dict[str, int]]
    flying: list[tuple[Reservation, int]] = []
    for (who, prompt, answer, used), action in steps:
        k = keys[who]
        if action == "wait":
            clock.now += 61  # a new minute (the day and month as they were)
            spent["minute"] = {}
            continue
        if action != "hold" and flying:
            r, most = flying.pop(0)
            actual = round(most * used)
            if action == "settle":
                r.settle(actual)
                spent["minute"][r.who.key_id] = spent["minute"].get(r.who.key_id, 0) + actual
                for kind, name in (("user", r.who.user), ("account", r.who.project)):
                    spent[kind][name] = spent[kind].get(name, 0) + actual
            else:
                r.release()
            continue
        got = book.reserve(k, Ask(prompt, answer))
        if isinstance(got, Reservation):
            flying.append((got, prompt + answer))
    _, tpm, upd, upm, apd, apm = limits
    for n in spent["minute"].values():
        assert tpm is None or n <= tpm
    for name, n in spent["user"].items():
        assert all(lim is None or n <= lim for lim in (upd, upm)), name
    for name, n in spent["account"].items():
        assert not name or all(lim is None or n <= lim for lim in (apd, apm)), name
    for r, _ in flying:
        r.release()
    for k in keys.values():
        h = book.headers(k)
        if "x-ratelimit-limit-tokens" in h:
            used_now = int(h["x-ratelimit-limit-tokens"]) - int(h["x-ratelimit-remaining-tokens"])
            assert used_now >= 0  # nothing held: only what was spent


def test_an_accounts_own_budget_overrides_the_servers(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    budgets = AccountBudgets(path)
    book = QuotaBook(QuotaConfig(account_tokens_per_day=10), budgets, clock=Clock())
    k = key()
    book.spent(k, 10)
    refused(book, k)
    set_account_budget(path, "t18phys", AccountBudget(tokens_per_day=1000))
    admitted(book, k)
    assert book.headers(k)["x-ratelimit-limit-tokens"] == "1000"
    set_account_budget(path, "t18phys", AccountBudget())
    refused(book, k)
    assert json.loads(path.read_text()) == {"version": 1, "accounts": {}}


def test_budgets_follow_the_file_as_it_comes_goes_and_breaks(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    book = QuotaBook(QuotaConfig(account_tokens_per_day=10), AccountBudgets(path), clock=Clock())
    k = key()
    book.spent(k, 10)
    refused(book, k)  # no file yet: the server's budget
    path.write_text('{"version": 1, "accounts": {"t18phys": {"tokens_per_day": 50}}')
    refused(book, k)  # a broken file, never read: still the server's
    path.unlink()
    set_account_budget(path, "t18phys", AccountBudget(tokens_per_day=50))
    admitted(book, k)
    path.write_text("{nope")  # broken once read: the budgets read last stay
    admitted(book, k)
    path.unlink()
    refused(book, k)


def test_a_broken_budgets_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    path.write_text('{"version": 1, "accounts": {"a": {"tokens_per_day": "many"}}}')
    with pytest.raises(ConfigError, match=r"quotas.json.*accounts\.a"):
        set_account_budget(path, "b", AccountBudget(5))


# ---- what a request may spend ------------------------------------------------------


def test_the_prompt_is_estimated_at_four_bytes_a_token_inline_files_aside() -> None:
    chat = {
        "model": "a-very-long-model-name",
        "messages": [
            {"role": "user", "content": "x" * 40},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "data:" + "A" * 10**6}}],
            },
        ],
    }
    # "user" twice, 40 x, the type "image_url": 8 + 40 + 9 = 57 bytes, 15 tokens.
    assert prompt_estimate(chat) == 15
    assert prompt_estimate({"model": "m", "prompt": [1, 2, 3, 4]}) == 4  # token ids
    assert prompt_estimate({"input": "é" * 4}) == 2  # 8 bytes of UTF-8
    deep: object = "abcd"
    for _ in range(100_000):
        deep = [deep]
    assert prompt_estimate({"input": deep}) == 1  # no recursion to exhaust


def test_what_a_request_may_spend_by_endpoint_and_model() -> None:
    def ask(
        body: dict[str, object], endpoint: str = "chat/completions", ctx: int | None = None
    ) -> Ask:
        return ask_of({"model": "m", "prompt": "", **body}, endpoint, ctx, 4096)

    assert ask({"max_tokens": 300}) == Ask(0, 300)
    assert ask({"max_tokens": 300, "max_completion_tokens": 200}) == Ask(0, 200)
    assert ask({"max_tokens": 300, "n": 3}) == Ask(0, 900)
    assert ask({"max_tokens": 16, "best_of": 4, "prompt": "abcde"}, "completions") == Ask(2, 64)
    assert ask({"max_output_tokens": 50}, "responses") == Ask(0, 50)
    assert ask({}) == Ask(0, 4096, own=False)  # no context known: the default
    assert ask({}, ctx=8192) == Ask(0, 8192, own=False)
    assert ask({"max_tokens": 10**6, "prompt": "abcd"}, ctx=8192) == Ask(1, 8191)
    assert ask({"max_tokens": None}) == Ask(0, 4096, own=False)
    assert ask({"input": "x" * 400}, "embeddings") == Ask(100, 0)
    assert ask({"max_tokens": True}) == Ask(0, 4096, own=False)  # not a count


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
    book.load(SqliteUsage(db))
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


@dataclass
class Gw:
    url: str
    key: str
    book: QuotaBook
    directory: StaticDirectory
    engine_url: str
    gateway: Gateway

    def ready(self) -> None:
        self.directory.add_endpoint("tiny", Endpoint("r0", self.engine_url, "k0"))

    def client(self, traced: bool = False) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            api_key=self.key, base_url=self.url + "/v1", max_retries=0,
            default_headers=TRACED if traced else {},
        )  # fmt: skip

    def left(self) -> int:
        """Tokens left on the tightest limit, what is held included."""
        return int(self.book.headers(key_of(self))["x-ratelimit-remaining-tokens"])


def key_of(g: Gw) -> KeyRecord:
    rec = g.gateway.keys.lookup(g.key) if g.gateway.keys is not None else None
    assert rec is not None
    return rec


@asynccontextmanager
async def gateway(
    tmp_path: Path,
    cfg: QuotaConfig,
    *,
    ready: bool = True,
    token_delay: float = 0.0,
    router: RouterConfig | None = None,
) -> AsyncIterator[Gw]:
    keyfile = tmp_path / "keys.json"
    k = add_key(keyfile, "alice", "t18phys").key
    directory = StaticDirectory([ModelInfo("tiny")])
    book = QuotaBook(cfg)
    app = create_app(directory, router, keys=KeyRing(keyfile), quota=book)
    async with engine("tiny", key="k0", token_delay=token_delay) as eurl, serve(app) as url:
        g = Gw(url, k, book, directory, eurl, app[GATEWAY_KEY])
        if ready:
            g.ready()
        yield g


async def test_every_answer_has_the_headers_and_a_429_has_retry_after(tmp_path: Path) -> None:
    cfg = QuotaConfig(requests_per_minute=2, user_tokens_per_day=10_000)
    async with gateway(tmp_path, cfg) as g:
        url, k, c = g.url, g.key, g.client()
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


# A client's trace context gives a request a span; the path is the same.
TRACED = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.mark.parametrize("path", ["untraced", "traced"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_headers_tell_the_limits_as_they_stood_when_the_request_was_let_in(
    tmp_path: Path, path: str, stream: bool
) -> None:
    # Itself counted, its tokens not yet (as OpenAI's): the same traced or
    # not, streamed or not; the next request's tell them.
    cfg = QuotaConfig(requests_per_minute=100, tokens_per_minute=10_000)
    async with gateway(tmp_path, cfg) as g:
        c = g.client(traced=path == "traced")
        seen = []
        for _ in range(2):
            async with c.chat.completions.with_streaming_response.create(
                model="tiny", messages=[{"role": "user", "content": "a b c"}], max_tokens=4,
                stream=stream, stream_options={"include_usage": True} if stream else None,
            ) as r:  # fmt: skip
                lines = [line async for line in r.iter_lines() if line]
            usage = [json.loads(x.removeprefix("data: ")) for x in lines if "usage" in x][-1]
            seen.append((r.headers, usage["usage"]["total_tokens"]))
            # The request path's own server answered, traced or not (aiohttp's
            # would name itself in Server).
            assert "Server" not in r.headers, r.headers
        await c.close()
    (first, used), (second, _) = seen
    assert (first["x-ratelimit-remaining-requests"], first["x-ratelimit-remaining-tokens"]) == (
        "99",
        "10000",
    )
    assert second["x-ratelimit-remaining-requests"] == "98"
    assert second["x-ratelimit-remaining-tokens"] == str(10_000 - used)


async def twelve_at_once(c: openai.AsyncOpenAI, stream: bool) -> list[int | BaseException]:
    """Twelve requests of 300 tokens at most each: the tokens each used, or its error."""

    async def one(i: int) -> int:
        msgs: Any = [{"role": "user", "content": f"w{i}"}]
        if not stream:
            r = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=300)
            assert r.usage is not None
            return r.usage.total_tokens
        s = await c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=300, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        used = [ch.usage.total_tokens async for ch in s if ch.usage is not None]
        return used[-1]

    return await asyncio.gather(*(one(i) for i in range(12)), return_exceptions=True)


def served_within(got: list[int | BaseException], limit: int) -> int:
    served = [n for n in got if isinstance(n, int)]
    refused = [e for e in got if not isinstance(e, int)]
    assert all(isinstance(e, openai.RateLimitError) for e in refused), refused
    assert served and refused
    assert sum(served) <= limit, (served, limit)
    return sum(served)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_twelve_requests_held_for_a_cold_start_serve_at_most_the_limit(
    tmp_path: Path, stream: bool
) -> None:
    # All twelve are let in (or not) before any answer: before reservations all
    # were, and spent 12 x 301 against 2,000.
    async with gateway(tmp_path, QuotaConfig(tokens_per_minute=2000), ready=False) as g:
        c = g.client()
        work = asyncio.ensure_future(twelve_at_once(c, stream))
        await eventually(lambda: g.gateway.held.get("tiny", 0) == 6, "six requests let in and held")
        g.ready()
        got = await work
        # Each holds 302 (2 for "user w0", 300 by max_tokens) and uses 301.
        assert served_within(got, 2000) == 6 * 301
        assert g.left() == 2000 - 6 * 301  # settled: nothing held any more
        await c.close()


@pytest.mark.parametrize("path", ["untraced", "traced"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_twelve_requests_at_once_on_a_ready_model_serve_at_most_the_limit(
    tmp_path: Path, path: str, stream: bool
) -> None:
    cfg = QuotaConfig(tokens_per_minute=2000)
    async with gateway(tmp_path, cfg, token_delay=0.002) as g:
        c = g.client(traced=path == "traced")
        served_within(await twelve_at_once(c, stream), 2000)
        await c.close()


@pytest.mark.parametrize("path", ["untraced", "traced"])
async def test_every_ending_of_a_stream_frees_or_settles_what_it_held(
    tmp_path: Path, path: str
) -> None:
    router = RouterConfig(drain_after_disconnect=0)  # a client gone: the answer cut at once
    async with gateway(
        tmp_path, QuotaConfig(tokens_per_minute=10_000), token_delay=0.01, router=router
    ) as g:
        c = g.client(traced=path == "traced")
        msgs: Any = [{"role": "user", "content": "a b"}]
        # The engine fails mid-answer: no count comes, nothing is spent.
        s = await c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=50, stream=True,
            extra_body={"test_abort_after": 3},
        )  # fmt: skip
        with pytest.raises(openai.APIError):
            async for _ in s:
                pass
        await eventually(lambda: g.left() == 10_000, "the failed stream's hold released")
        # The client goes after two events: cut, released.
        s = await c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=500, stream=True
        )
        seen = 0
        async for _ in s:
            seen += 1
            if seen == 2:
                break
        await s.close()
        await eventually(lambda: g.left() == 10_000, "the abandoned stream's hold released")
        # A whole stream: settled to its count.
        s = await c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        used = [ch.usage.total_tokens async for ch in s if ch.usage is not None][-1]
        assert g.left() == 10_000 - used
        await c.close()


async def test_a_client_gone_mid_stream_is_charged_what_the_drain_counts(tmp_path: Path) -> None:
    async with gateway(tmp_path, QuotaConfig(tokens_per_minute=10_000), token_delay=0.01) as g:
        c = g.client(traced=True)
        s = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=40, stream=True
        )
        async for _ in s:
            break
        await s.close()
        # Held until the drain reads the engine's usage (1 + 40), then settled to it.
        await eventually(lambda: g.left() == 10_000 - 41, "the drained stream settled")
        await c.close()


async def test_requests_that_end_before_the_engine_free_what_they_held(tmp_path: Path) -> None:
    router = RouterConfig(hold_timeout=0.2, retry_after=1)
    async with gateway(
        tmp_path, QuotaConfig(user_tokens_per_day=10_000), ready=False, router=router
    ) as g:
        c = g.client()
        with pytest.raises(openai.InternalServerError):  # 503: no replica in time
            await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=100
            )
        assert g.left() == 10_000
        g.ready()
        async with aiohttp.ClientSession() as s:  # 400 after it was let in
            body = {"model": "tiny", "prompt": "a", "max_tokens": 100, "stream": "yes"}
            r = await s.post(
                g.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {g.key}"}
            )
            assert r.status == 400
        assert g.left() == 10_000
        r2 = await c.completions.create(model="tiny", prompt="a b", max_tokens=3)
        assert r2.usage is not None and g.left() == 10_000 - r2.usage.total_tokens
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
        rows = json.loads(res.output)["rows"]
        return [{k: r[k] for k in (by, "requests", "total_tokens")} for r in rows]

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


async def test_a_request_that_could_not_be_sent_frees_what_it_held(tmp_path: Path) -> None:
    async with gateway(tmp_path, QuotaConfig(tokens_per_minute=10_000)) as g:
        c = g.client()
        await c.completions.create(model="tiny", prompt="a", max_tokens=1)  # a kept connection
        spent = 10_000 - g.left()

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("a bug in sending")

        g.gateway.pool.kept = broken  # type: ignore[method-assign]
        with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
            await c.completions.create(model="tiny", prompt="a", max_tokens=100)
        assert g.left() == 10_000 - spent  # nothing held for it any more
        await c.close()
