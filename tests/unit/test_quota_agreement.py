"""A request its gateway's allowance does not cover waits for the other gateways'
word (llmgw_slurm/db/quota.py, issue 34's bound): refused with the budget's 429,
let in when the word is yes or when no word comes, and released when its client
leaves while it waits. The database side is the ha level's
(tests/ha/test_shared_state.py); here the book and the gateway's path around it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest
from _router_support import engine, eventually, serve

from llmgw_slurm.accounting.quota import Ask, Budget, QuotaBook, Refusal, Reservation
from llmgw_slurm.auth.keys import KeyRecord, KeyRing, add_key
from llmgw_slurm.config import QuotaConfig
from llmgw_slurm.router import Endpoint, ModelInfo, StaticDirectory, create_app

BUDGET = 1000


class Others:
    """The other gateways as the book sees them: nothing spent or held, no
    allowance, and ``word`` to every question (after ``gate`` opens)."""

    def __init__(self, word: bool | None) -> None:
        self.word = word
        self.gate = asyncio.Event()
        self.gate.set()
        self.asked: list[list[Budget]] = []
        self.covered: set[tuple[str, str]] = set()

    def used(self, kind: str, name: str, span: str, start: float) -> int:
        assert kind in ("user", "account") and span in ("day", "month"), (kind, span)
        return 0

    def held(self, kind: str, name: str) -> int:
        assert kind in ("user", "account"), kind
        return 0

    def covers(self, kind: str, name: str) -> bool:
        assert kind in ("user", "account"), kind
        return (kind, name) in self.covered

    async def agree(self, budgets: list[Budget]) -> bool | None:
        for kind, _, span, start, limit in budgets:
            assert kind in ("user", "account") and span in ("day", "month"), budgets
            assert start > 0 and limit == BUDGET, budgets
        self.asked.append(budgets)
        await self.gate.wait()
        return self.word


def alice() -> KeyRecord:
    return KeyRecord("0000000a", "alice", "t18phys", "0" * 64, 0.0)


def test_a_reservation_the_allowance_covers_needs_no_word() -> None:
    others = Others(False)
    book = QuotaBook(QuotaConfig(user_tokens_per_day=BUDGET), others=others)
    got = book.reserve(alice(), Ask(10, 20))
    assert isinstance(got, Reservation) and not book.agreed(got)
    others.covered.add(("user", "alice"))
    assert book.agreed(got)
    # No budget, nothing to agree on: a book without budgets never asks.
    plain = QuotaBook(QuotaConfig(requests_per_minute=10), others=others)
    free = plain.reserve(alice(), Ask(10, 20))
    assert isinstance(free, Reservation) and plain.agreed(free)


class Stale(Others):
    """Other gateways whose figures, as last read, fill the budget: old news."""

    def used(self, kind: str, name: str, span: str, start: float) -> int:
        super().used(kind, name, span, start)
        return BUDGET


async def test_old_news_of_the_others_refuses_nothing_the_database_would_let_in() -> None:
    others = Stale(True)
    book = QuotaBook(QuotaConfig(user_tokens_per_day=BUDGET), others=others)
    # The headers tell the budget as last read ...
    assert book.headers(alice())["x-ratelimit-remaining-tokens"] == "0"
    # ... but the allowance, or the database asked, decides: in.
    got = book.reserve(alice(), Ask(10, 20))
    assert isinstance(got, Reservation) and not book.agreed(got)
    assert await book.agree(got, Ask(10, 20)) is got
    # What this gateway alone spent is sure: over it, refused without asking.
    book.spent(alice(), BUDGET - 40)
    asked = len(others.asked)
    no = book.reserve(alice(), Ask(10, 20))
    assert isinstance(no, Refusal) and no.code == "insufficient_quota"
    assert len(others.asked) == asked


async def test_no_room_refuses_releases_and_does_not_count_the_request() -> None:
    others = Others(False)
    cfg = QuotaConfig(requests_per_minute=5, user_tokens_per_day=BUDGET)
    book = QuotaBook(cfg, others=others)
    got = book.reserve(alice(), Ask(10, 20))
    assert isinstance(got, Reservation)
    assert book.headers(alice())["x-ratelimit-remaining-requests"] == "4"
    no = await book.agree(got, Ask(10, 20))
    assert isinstance(no, Refusal) and no.code == "insufficient_quota"
    assert "user alice" in no.message and f"limit {BUDGET}" in no.message
    assert got.ended and book.holding() == {}
    assert book.headers(alice())["x-ratelimit-remaining-requests"] == "5"
    [asked] = others.asked
    assert sorted((k, n, s) for k, n, s, _, _ in asked) == [("user", "alice", "day")]


async def test_no_word_lets_the_request_in_on_what_was_last_read() -> None:
    book = QuotaBook(QuotaConfig(user_tokens_per_day=BUDGET), others=Others(None))
    got = book.reserve(alice(), Ask(10, 20))
    assert isinstance(got, Reservation)
    assert await book.agree(got, Ask(10, 20)) is got and not got.ended
    assert book.holding() == {("user", "alice"): 30, ("account", "t18phys"): 30}


@asynccontextmanager
async def gateway(tmp_path: Path, others: Others) -> AsyncIterator[tuple[str, str, QuotaBook]]:
    keyfile = tmp_path / "keys.json"
    k = add_key(keyfile, "alice", "t18phys").key
    directory = StaticDirectory([ModelInfo("tiny")])
    book = QuotaBook(QuotaConfig(user_tokens_per_day=BUDGET), others=others)
    app = create_app(directory, keys=KeyRing(keyfile), quota=book)
    async with engine("tiny", key="k0") as eurl, serve(app) as url:
        directory.add_endpoint("tiny", Endpoint("r0", eurl, "k0"))
        yield url, k, book


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_through_the_gateway_a_no_is_the_budgets_429(tmp_path: Path, stream: bool) -> None:
    async with gateway(tmp_path, Others(False)) as (url, k, book):
        c = openai.AsyncOpenAI(api_key=k, base_url=url + "/v1", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                stream=stream,
            )  # fmt: skip
        assert e.value.code == "insufficient_quota"
        assert e.value.response.headers["retry-after"]
        assert e.value.response.headers["x-ratelimit-limit-tokens"] == str(BUDGET)
        assert book.holding() == {}
        await c.close()


async def test_through_the_gateway_a_yes_or_no_word_is_answered(tmp_path: Path) -> None:
    for word in (True, None):
        async with gateway(tmp_path / str(word), Others(word)) as (url, k, book):
            c = openai.AsyncOpenAI(api_key=k, base_url=url + "/v1", max_retries=0)
            got = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
            assert got.choices[0].message.content and got.usage is not None
            used = book.spent_of("user", "alice", "day")[1]
            assert used == got.usage.total_tokens and book.holding() == {}
            await c.close()


async def test_a_client_that_leaves_while_the_word_is_awaited_holds_nothing(
    tmp_path: Path,
) -> None:
    others = Others(True)
    others.gate.clear()
    async with gateway(tmp_path, others) as (url, k, book):
        c = openai.AsyncOpenAI(api_key=k, base_url=url + "/v1", max_retries=0)
        call = asyncio.create_task(
            c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
        )

        def asked() -> bool:
            return bool(others.asked) and book.holding() != {}

        await eventually(asked, "the request to wait for the word, holding its tokens")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

        def released() -> bool:
            return book.holding() == {}

        await eventually(released, "the left request's tokens to be released")
        others.gate.set()
        await c.close()


class Broken(Others):
    """Other gateways whose question fails with a bug (not a database error)."""

    async def agree(self, budgets: list[Budget]) -> bool | None:
        self.asked.append(budgets)
        if len(self.asked) == 1:
            raise RuntimeError("a bug in the question")
        return True


async def test_a_bug_while_asking_is_a_500_and_the_next_request_is_answered(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path, Broken(True)) as (url, k, book):
        # A time limit only so that a request never answered fails the test.
        c = openai.AsyncOpenAI(api_key=k, base_url=url + "/v1", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError):
            await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
        assert book.holding() == {}
        got = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert got.choices[0].message.content
        await c.close()
