"""Quotas: requests and tokens per minute per key, token budgets per user and account.

Limits come from ``quotas:`` in server.yaml; an account's own budgets, set
with ``llmgw-admin quota``, from a small JSON file (:class:`AccountBudgets`)
that the gateway rereads when it changes, as it does the key file.

How it is counted, and why:

- A request is let in only if the most it may spend fits every token limit
  that applies (its :class:`Ask`: its prompt, estimated at 4 bytes of text a
  token as OpenAI's own estimate is, plus the most its answer may hold:
  ``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens`` times
  ``n``, else the model's ``context_length``, else ``quotas.default_max_tokens``).
  That much is *held* (a :class:`Reservation`) from admission until the answer
  ends, beside what was spent; then it settles to the engine's real count, or,
  when no count ever comes (the engine failed; the client left and the answer
  was cut past the drain bound), it is released. Each reservation ends
  exactly once. So requests in flight at once cannot pass a limit together:
  before, a dozen concurrent requests were all let in under a nearly spent
  limit, each spending up to its ``max_tokens``.
- A request whose own maximum is more than a whole limit can never be let in:
  its 429 says so and what to change (OpenAI's "Request too large").
- Per-minute limits are fixed windows (the minute of the clock), in memory:
  a restart forgets them, which costs at most one extra minute's worth. An
  answer's tokens count in the minute it ends; tokens held count against
  every window while their request is in flight.
- Day and month budgets (UTC calendar) start, at start-up, from the usage
  store's totals, so a restart does not hand out a fresh budget.
- Batches count against the day and month budgets, not the per-minute limits
  (as OpenAI's batches, which have a pool of their own): a batch holds its
  whole input's maximum from its creation to its end (batch/service.py).

Every answer to a request with a valid key carries OpenAI's rate-limit
headers: ``x-ratelimit-{limit,remaining,reset}-requests`` (the per-minute
request limit) and ``-tokens`` (whichever token limit has least left, tokens
held included); a refusal is a 429 in OpenAI's error shape with
``Retry-After``. For a request sent to a model they tell the limits as they
stood when it was let in, itself counted but not yet its tokens (as
OpenAI's, worked out on admission: a stream's head could tell no more); for
any other answer, as the limits stand as it is sent.

The book's state lives behind :meth:`QuotaBook.reserve`, :class:`Reservation`
and :meth:`QuotaBook.spent`: nothing outside reads or writes its counts.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from aiohttp import web

from llmgw_slurm.accounting.usage import UsageQueries
from llmgw_slurm.auth.keys import request_key
from llmgw_slurm.base.errors import ConfigError, LlmgwError
from llmgw_slurm.base.fsutil import atomic_write, locked
from llmgw_slurm.config import QuotaConfig, ServerConfig

__all__ = [
    "NOTHING",
    "QUOTA_HEADERS",
    "AccountBudget",
    "AccountBudgets",
    "Ask",
    "Payer",
    "QuotaBook",
    "Refusal",
    "Reservation",
    "add_quota_headers",
    "ask_of",
    "budgets_path",
    "format_reset",
    "prompt_estimate",
    "quota_book",
    "set_account_budget",
]

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class AccountBudget:
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None


def _load_budgets(path: Path) -> dict[str, AccountBudget]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read it: {e}", file=str(path)) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e.msg})", file=str(path), line=e.lineno) from None
    accounts = data.get("accounts") if isinstance(data, dict) else None
    if data.get("version") != _FORMAT_VERSION or not isinstance(accounts, dict):
        raise ConfigError(
            f'expected {{"version": {_FORMAT_VERSION}, "accounts": {{...}}}}', file=str(path)
        )
    out = {}
    for name, raw in accounts.items():
        if not isinstance(raw, dict) or not all(
            isinstance(raw.get(k), (int, type(None)))
            for k in ("tokens_per_day", "tokens_per_month")
        ):
            raise ConfigError(
                "an account's budget is {tokens_per_day: int|null, tokens_per_month: int|null}",
                file=str(path),
                field=f"accounts.{name}",
            )
        out[str(name)] = AccountBudget(raw.get("tokens_per_day"), raw.get("tokens_per_month"))
    return out


def set_account_budget(path: Path, account: str, budget: AccountBudget) -> None:
    """Set (or, with both None, remove) ``account``'s own budgets in the file."""
    with locked(path.with_name(path.name + ".lock"), mode=0o600):
        budgets = _load_budgets(path)
        if budget.tokens_per_day is None and budget.tokens_per_month is None:
            budgets.pop(account, None)
        else:
            budgets[account] = budget
        data = {
            "version": _FORMAT_VERSION,
            "accounts": {
                a: {"tokens_per_day": b.tokens_per_day, "tokens_per_month": b.tokens_per_month}
                for a, b in sorted(budgets.items())
            },
        }
        atomic_write(path, json.dumps(data, indent=2) + "\n", mode=0o600)


class Budgets(Protocol):
    """The accounts' own budgets as the book reads them: :class:`AccountBudgets` (the
    file) or the shared database's copy (llmgw_slurm.db.quota)."""

    budgets: dict[str, AccountBudget]

    def refresh(self) -> None: ...


# One day or month budget of a key, as the book asks the other gateways about it:
# (kind, name, span, the span's start, limit).
Budget = tuple[str, str, str, float, int]


class OtherGateways(Protocol):
    """What the other gateways on one database spent and hold (llmgw_slurm.db.quota):
    the book adds it to its own, so a day's budget is one budget whichever gateway
    a request comes through."""

    def used(self, kind: str, name: str, span: str, start: float) -> int:
        """Tokens ``kind`` ("user", "account") ``name`` spent through other gateways in
        the ``span`` ("day", "month") that began at ``start``."""
        ...

    def held(self, kind: str, name: str) -> int:
        """Tokens the other gateways' requests in flight hold for ``kind`` ``name``
        (with what they may let in without asking: their allowances)."""
        ...

    def covers(self, kind: str, name: str) -> bool:
        """Whether the others were told of room for what this gateway holds for
        ``kind`` ``name`` now."""
        ...

    async def agree(self, budgets: list[Budget]) -> bool | None:
        """Room asked for on ``budgets``: True
        (agreed), False (none), None (no word: go on what was last read)."""
        ...


class AccountBudgets:
    """The budgets file as the gateway sees it: reread when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fspath = os.fspath(path)
        self._stamp: tuple[int, int] | None = None
        self.budgets: dict[str, AccountBudget] = {}
        self.refresh()

    def refresh(self) -> None:
        # Once a request: os.stat on the path's string (pathlib's stat costs
        # several times the call on a cold CPU), and a missing file, the usual
        # case, checked without raising (an exception costs as much again).
        # No stamp: the file was missing or broken, and the budgets are {}.
        if self._stamp is None and not os.access(self._fspath, os.F_OK):
            return
        try:
            st = os.stat(self._fspath)
        except FileNotFoundError:
            self._stamp, self.budgets = None, {}
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            # Running, a broken file keeps the budgets in force (as the key file);
            # the admin CLI never writes one.
            with contextlib.suppress(LlmgwError):
                self.budgets, self._stamp = _load_budgets(self.path), stamp


def format_reset(seconds: float) -> str:
    """OpenAI's form of a reset time: ``59s``, ``6m0s``, ``3h2m1s``."""
    s = max(0, int(seconds + 0.999))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    return f"{m}m{sec}s" if m else f"{sec}s"


def _day_start(now: float) -> float:
    return float(calendar.timegm((*time.gmtime(now)[:3], 0, 0, 0)))


def _month_start(now: float) -> float:
    t = time.gmtime(now)
    return float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


def _next_month(now: float) -> float:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


class Payer(Protocol):
    """Whose tokens: a key's id, its user and its Slurm account (a KeyRecord, or a
    batch's creator)."""

    @property
    def key_id(self) -> str: ...

    @property
    def user(self) -> str: ...

    @property
    def project(self) -> str: ...


class Ask(NamedTuple):
    """The most one request may spend, worked out from its body before it is let in."""

    prompt: int  # its prompt, estimated
    answer: int  # the most its answer may hold, all choices together
    # Whether the answer's bound is the request's own max_tokens (else the
    # model's context length or the default): a refusal says what to change.
    own: bool = True

    @property
    def tokens(self) -> int:
        return self.prompt + self.answer


NOTHING = Ask(0, 0)

# The endpoints whose answer is generated text, and the fields that bound it
# (the first one set wins: chat's max_completion_tokens replaced max_tokens).
_ANSWER_FIELDS = {
    "chat/completions": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


def _count(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def prompt_estimate(body: Mapping[str, Any]) -> int:
    """A request's prompt in tokens, estimated as OpenAI's rate limiter does: 4 bytes
    of its text a token (every string in the body but the model's name and inline
    files, which are counted when the answer ends), and a token per number in
    a list (a prompt of token ids)."""
    size = 0
    numbers = 0
    # A stack, not recursion: a body nests as deep as json.loads lets it.
    stack: list[Any] = [v for k, v in body.items() if k != "model"]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.startswith("data:"):
                size += len(v) if v.isascii() else len(v.encode("utf-8", "replace"))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            for x in v:
                if isinstance(x, (int, float)):
                    numbers += 1
                else:
                    stack.append(x)
    return (size + 3) // 4 + numbers


def ask_of(body: Mapping[str, Any], endpoint: str, context: int | None, default_answer: int) -> Ask:
    """The most a request to ``endpoint`` with ``body`` may spend, on a model whose
    context (prompt and answer together) is ``context`` tokens (None: unknown)."""
    prompt = prompt_estimate(body)
    fields = _ANSWER_FIELDS.get(endpoint)
    if fields is None:
        return Ask(prompt, 0)  # embeddings, rerank, score, tokenize: no answer text
    choices = max(1, _count(body.get("n")) or 1, _count(body.get("best_of")) or 1)
    most = next((m for f in fields if (m := _count(body.get(f))) is not None), None)
    own = most is not None
    if most is None:
        most = context if context is not None else default_answer
    if context is not None:
        # Prompt and answer together never pass the context: with an estimate
        # of the prompt above the real one, the whole still bounds the request.
        most = min(most, max(0, context - prompt))
    return Ask(prompt, most * choices, own)


class _Limit(NamedTuple):
    """One limit as the headers and a refusal tell it (a tuple: made per request)."""

    # (what, per, whose): ("tokens", "day", "account climate"); words only for a refusal.
    what: tuple[str, str, str]
    limit: int
    used: int
    reset: float  # seconds
    held: int  # by requests in flight
    # What is left, worked out once (read several times a request: a property
    # was a sixth of the book's time).
    remaining: int


def _limit(
    what: tuple[str, str, str], limit: int, used: int, reset: float, held: int = 0
) -> _Limit:
    return _Limit(what, limit, used, reset, held, max(0, limit - used - held))


# The per-minute limits, in _Limit.what's words.
_MINUTE_REQUESTS = ("requests", "minute", "")
_MINUTE_TOKENS = ("tokens", "minute", "")


class _Period:
    """Token counts per name within one calendar period (a UTC day or month).

    The period's bounds are worked out only when the clock leaves them (the
    calendar arithmetic costs more than the rest of a request's check).
    """

    def __init__(self, span: str) -> None:
        self.span = span
        self.start = self.end = 0.0
        self.used: dict[str, int] = {}

    def at(self, now: float) -> dict[str, int]:
        if not self.start <= now < self.end:
            if self.span == "day":
                start, end = _day_start(now), _day_start(now) + 86400.0
            else:
                start, end = _month_start(now), _next_month(now)
            if start != self.start:
                self.used = {}
            self.start, self.end = start, end
        return self.used


class _Rule(NamedTuple):
    """A day or month budget that applies to one key: whose counts, how many."""

    period: _Period
    whose: tuple[str, str]  # ("user", name) or ("account", name): where its holds are
    limit: int
    what: tuple[str, str, str]  # as _Limit's


# (whose, span, the QuotaConfig field): the budgets, in the order refusals name them.
_BUDGETS = tuple(
    (kind, span, f"{kind}_tokens_per_{span}")
    for kind in ("user", "account")
    for span in ("day", "month")
)


class Refusal(NamedTuple):
    """A request the quotas turn away: OpenAI's 429, saying which limit and what to do."""

    message: str
    type: str
    code: str
    retry_after: int
    headers: Mapping[str, str]

    def response(self) -> web.Response:
        body = {
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.code}
        }
        headers = {**self.headers, "Retry-After": str(self.retry_after)}
        return web.json_response(body, status=429, headers=headers)


class Reservation:
    """The tokens one request holds from its admission to its end.

    It ends once: :meth:`settle` with the real count, or :meth:`release` when
    no count will come; whichever comes first counts, later calls do nothing.
    ``headers``: the rate-limit headers of its answer, as the limits stood
    when it was let in.
    """

    __slots__ = ("_book", "_holds", "_open", "headers", "per_minute", "tokens", "who")

    def __init__(
        self,
        book: QuotaBook,
        who: Payer,
        tokens: int,
        holds: tuple[tuple[str, str], ...],
        headers: Mapping[str, str],
        per_minute: bool,
    ) -> None:
        self._book = book
        self.who = who
        self.tokens = tokens
        self._holds = holds
        self.headers = headers
        self.per_minute = per_minute
        self._open = True

    @property
    def ended(self) -> bool:
        return not self._open

    def settle(self, actual: int) -> None:
        """The request's answer ended having used ``actual`` tokens."""
        if self._open:
            self._open = False
            self._book._unhold(self._holds, self.tokens)
            self._book.spent(self.who, actual, per_minute=self.per_minute)

    def release(self) -> None:
        """The request ended without a count (never sent, failed, or cut): nothing spent."""
        if self._open:
            self._open = False
            self._book._unhold(self._holds, self.tokens)


class QuotaBook:
    """Counts what each key, user and account used and holds, and lets a request in
    only if what it may spend fits.

    The whole interface: :meth:`reserve` (and :meth:`hold`), the
    :class:`Reservation` it returns, :meth:`spent`, :meth:`headers` and
    :meth:`load`; the counts behind them are the book's own.
    """

    def __init__(
        self,
        config: QuotaConfig,
        budgets: Budgets | None = None,
        clock: Callable[[], float] = time.time,
        others: OtherGateways | None = None,
    ) -> None:
        self.config = config
        self.budgets = budgets
        # Several gateways on one database: their spend and holds count here too.
        self.others = others
        self._clock = clock
        self._minute: dict[str, tuple[int, int, int]] = {}  # key id -> (minute, requests, tokens)
        # Tokens held by requests in flight: ("key", id), ("user", name), ("account", name).
        self._held: dict[tuple[str, str], int] = {}
        self._periods = {(kind, span): _Period(span) for kind, span, _ in _BUDGETS}
        self._server_budgets = [
            (kind, span, self._periods[(kind, span)], getattr(config, name))
            for kind, span, name in _BUDGETS
        ]
        self._rules_from: dict[str, AccountBudget] | None = None
        self._rules_of: dict[tuple[str, str, str], tuple[_Rule, ...]] = {}

    def load(self, usage: UsageQueries) -> None:
        """Start the day and month budgets from the usage store (after a restart)."""
        now = self._clock()
        for span in ("day", "month"):
            self._periods[("user", span)].at(now)
            since = self._periods[("user", span)].start
            totals = usage.totals(since)
            for kind, pick in (("user", 0), ("account", 1)):
                used = self._periods[(kind, span)].at(now)
                for names, tokens in totals.items():
                    if names[pick]:
                        used[names[pick]] = used.get(names[pick], 0) + tokens

    # ---- the interface ------------------------------------------------------------------

    def reserve(
        self, who: Payer, ask: Ask = NOTHING, *, per_minute: bool = True
    ) -> Reservation | Refusal:
        """Let a request of ``who`` in, holding ``ask.tokens`` until its
        :class:`Reservation` ends; or the :class:`Refusal` naming the limit it
        does not fit. ``per_minute`` False (a batch): the day and month
        budgets only, and not counted as a request."""
        if self.budgets is not None:
            self.budgets.refresh()
        now = self._clock()
        reqs, toks = self._minute_counts(who, now) if per_minute else (0, 0)
        req = self._request_limit(reqs, now) if per_minute else None
        limits = self._token_limits(who, now, toks, per_minute)
        tokens = ask.tokens
        over = [t for t in self._sure(limits, who, now, toks, per_minute)
                if t.remaining == 0 or tokens > t.remaining]
        if req is not None and req.limit <= req.used:
            over.insert(0, req)
        if over:
            return _refusal(who, ask, over, _headers(req, _least_left(limits)))
        if per_minute:
            minute = int(now // 60)
            self._minute[who.key_id] = (minute, reqs + 1, toks)
            if len(self._minute) > 100_000:
                # Keys idle for a minute or more hold nothing worth keeping.
                self._minute = {k: v for k, v in self._minute.items() if v[0] == minute}
            if req is not None:
                req = _limit(req.what, req.limit, reqs + 1, req.reset)
        # Itself counted, its tokens not yet: what its answer's headers tell.
        headers = _headers(req, _least_left(limits))
        return self.hold(who, tokens, per_minute=per_minute, headers=headers)

    def _sure(
        self, limits: list[_Limit], who: Payer, now: float, toks: int, per_minute: bool
    ) -> list[_Limit]:
        """The limits a refusal may rest on. With other gateways, their figures as
        last read are old, and an allowance (or the database, asked) decides
        whether theirs leave room (:meth:`agreed`): only this gateway's own count."""
        if self.others is None:
            return limits
        return self._token_limits(who, now, toks, per_minute, others=False)

    def hold(
        self,
        who: Payer,
        tokens: int,
        *,
        per_minute: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Reservation:
        """Hold ``tokens`` for ``who`` without asking whether they fit: a batch's
        reservation taken again after a restart."""
        holds: tuple[tuple[str, str], ...] = ()
        if tokens:
            names = [("user", who.user), ("account", who.project)]
            if per_minute:
                names.insert(0, ("key", who.key_id))
            holds = tuple((kind, name) for kind, name in names if name)
            for h in holds:
                self._held[h] = self._held.get(h, 0) + tokens
        return Reservation(self, who, tokens, holds, headers or {}, per_minute)

    def spent(self, who: Payer, tokens: int, *, per_minute: bool = True) -> None:
        """``who`` used ``tokens`` that no reservation held (or its settlement):
        counted in the minute (unless ``per_minute`` is False), day and month."""
        now = self._clock()
        if per_minute:
            minute = int(now // 60)
            m, reqs, toks = self._minute.get(who.key_id, (minute, 0, 0))
            # An answer that ends in a later minute than its key's last
            # request counts in the minute it ends.
            self._minute[who.key_id] = (minute, reqs, toks + tokens) if m == minute else (
                minute, 0, tokens
            )  # fmt: skip
        for (kind, _), period in self._periods.items():
            name = who.user if kind == "user" else who.project
            if name:
                used = period.at(now)
                used[name] = used.get(name, 0) + tokens

    def agreed(self, res: Reservation) -> bool:
        """Whether ``res`` is within what the other gateways were told this one may
        hold (always, without them); when not, :meth:`agree` asks them."""
        others = self.others
        if others is None or not res.tokens:
            return True
        return all(others.covers(*rule.whose) for rule in self._rules(res.who))

    async def agree(self, res: Reservation, ask: Ask) -> Reservation | Refusal:
        """``res`` once the other gateways agree there is room for it (a request near
        its budget's end: llmgw_slurm/db/quota.py), or released and refused."""
        assert self.others is not None
        now = self._clock()
        budgets: list[Budget] = []
        for rule in self._rules(res.who):
            rule.period.at(now)  # a new day or month starts here
            budgets.append((*rule.whose, rule.period.span, rule.period.start, rule.limit))
        if await self.others.agree(budgets) is not False:
            return res
        res.release()
        self._uncount(res)
        limits = self._token_limits(res.who, self._clock(), 0, False)
        over = [t for t in limits if t.remaining == 0 or ask.tokens > t.remaining] or limits
        return _refusal(res.who, ask, over, self.headers(res.who))

    def headers(self, who: Payer) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for ``who`` as things stand (the budgets
        file as :meth:`reserve` last read it: one stat a request is enough)."""
        now = self._clock()
        reqs, toks = self._minute_counts(who, now)
        limits = self._token_limits(who, now, toks, True)
        return _headers(self._request_limit(reqs, now), _least_left(limits))

    # ---- the counts -----------------------------------------------------------------

    def _uncount(self, res: Reservation) -> None:
        """A request let in, then refused: not one of its key's requests this minute."""
        if not res.per_minute:
            return
        m, reqs, toks = self._minute.get(res.who.key_id, (-1, 0, 0))
        if m == int(self._clock() // 60) and reqs > 0:
            self._minute[res.who.key_id] = (m, reqs - 1, toks)

    def _unhold(self, holds: tuple[tuple[str, str], ...], tokens: int) -> None:
        for h in holds:
            left = self._held.get(h, 0) - tokens
            if left > 0:
                self._held[h] = left
            else:
                self._held.pop(h, None)

    def _rules(self, key: Payer) -> tuple[_Rule, ...]:
        """The day and month budgets that apply to ``key``: worked out once a key
        (and again when the budgets file changes), not once a request."""
        budgets = self.budgets.budgets if self.budgets is not None else None
        if budgets is not self._rules_from:
            self._rules_from, self._rules_of = budgets, {}
        whose = (key.key_id, key.user, key.project)
        rules = self._rules_of.get(whose)
        if rules is None:
            if len(self._rules_of) > 100_000:
                self._rules_of = {}
            rules = self._rules_of[whose] = self._make_rules(key, budgets)
        return rules

    def _make_rules(
        self, key: Payer, budgets: dict[str, AccountBudget] | None
    ) -> tuple[_Rule, ...]:
        own = budgets.get(key.project) if budgets is not None and key.project else None
        rules = []
        for kind, span, period, server_limit in self._server_budgets:
            name = key.user if kind == "user" else key.project
            limit: int | None = server_limit
            if kind == "account" and own is not None:
                limit = own.tokens_per_day if span == "day" else own.tokens_per_month
            if limit is not None and name:
                what = ("tokens", span, kind + " " + name)
                rules.append(_Rule(period, (kind, name), limit, what))
        return tuple(rules)

    def _minute_counts(self, key: Payer, now: float) -> tuple[int, int]:
        """The requests and tokens ``key`` has used in the clock's minute."""
        m, reqs, toks = self._minute.get(key.key_id, (-1, 0, 0))
        return (reqs, toks) if m == int(now // 60) else (0, 0)

    def _request_limit(self, reqs: int, now: float) -> _Limit | None:
        rpm = self.config.requests_per_minute
        return None if rpm is None else _limit(_MINUTE_REQUESTS, rpm, reqs, 60.0 - (now % 60))

    def _token_limits(
        self, key: Payer, now: float, toks: int, per_minute: bool, others: bool = True
    ) -> list[_Limit]:
        """Every token limit that applies to ``key`` now, with what is held against it
        (``others``: through the other gateways too, as last read)."""
        out = []
        tpm = self.config.tokens_per_minute
        if per_minute and tpm is not None:
            held = self._held.get(("key", key.key_id), 0)
            out.append(_limit(_MINUTE_TOKENS, tpm, toks, 60.0 - (now % 60), held))
        for rule in self._rules(key):
            used = rule.period.at(now).get(rule.whose[1], 0)
            held = self._held.get(rule.whose, 0)
            if others and self.others is not None:
                kind, name = rule.whose
                used += self.others.used(kind, name, rule.period.span, rule.period.start)
                held += self.others.held(kind, name)
            out.append(_limit(rule.what, rule.limit, used, rule.period.end - now, held))
        return out

    def holding(self) -> dict[tuple[str, str], int]:
        """What this gateway's requests in flight hold per user and account (shared with
        the other gateways on one database)."""
        return {h: n for h, n in self._held.items() if h[0] != "key"}

    def holding_of(self, kind: str, name: str) -> int:
        """What this gateway's requests in flight hold for one user or account."""
        return self._held.get((kind, name), 0)

    def spent_of(self, kind: str, name: str, span: str) -> tuple[float, int]:
        """The start of the current ``span`` and what ``kind`` ``name`` spent in it."""
        period = self._periods[(kind, span)]
        used = period.at(self._clock()).get(name, 0)
        return period.start, used

    def spent_in(self, kind: str, span: str) -> tuple[float, dict[str, int]]:
        """The start of the current ``span`` and what ``kind`` names spent through this
        book in it (a copy)."""
        period = self._periods[(kind, span)]
        used = dict(period.at(self._clock()))
        return period.start, used


# Seconds a refusal for tokens held by the key's own requests in flight asks to
# wait: they end in seconds, not at the limit's reset.
_HELD_RETRY = 5


def _least_left(tokens: list[_Limit]) -> _Limit | None:
    """The token limit the headers tell: least left, and of two, the later reset."""
    return min(tokens, key=lambda t: (t.remaining, -t.reset)) if tokens else None


def _headers(req: _Limit | None, tight: _Limit | None) -> dict[str, str]:
    """The x-ratelimit-* headers: the request limit's, and the tightest token limit's."""
    out: dict[str, str] = {}
    if req is not None:
        out["x-ratelimit-limit-requests"] = str(req.limit)
        out["x-ratelimit-remaining-requests"] = str(req.remaining)
        out["x-ratelimit-reset-requests"] = format_reset(req.reset)
    if tight is not None:
        out["x-ratelimit-limit-tokens"] = str(tight.limit)
        out["x-ratelimit-remaining-tokens"] = str(tight.remaining)
        out["x-ratelimit-reset-tokens"] = format_reset(tight.reset)
    return out


def _words(t: _Limit) -> str:
    what, per, whose = t.what
    return f"{what} per {per}" + (f" of {whose}" if whose else "")


def _asked(ask: Ask) -> str:
    """What a request may spend, in words, with what bounds its answer."""
    if not ask.answer:
        return f"{ask.tokens} tokens (its input, estimated)"
    bound = "max_tokens" if ask.own else "no max_tokens: the model's limit"
    return f"{ask.tokens} tokens (about {ask.prompt} for its prompt, {ask.answer} by {bound})"


def _refusal(who: Payer, ask: Ask, over: list[_Limit], headers: Mapping[str, str]) -> Refusal:
    """The 429 for a request that does not fit: a limit it can never fit first, then
    one only the requests in flight fill, then the one that resets last."""
    never = [t for t in over if t.what[0] == "tokens" and ask.tokens > t.limit]
    if never:
        t = min(never, key=lambda t: t.limit)
        fix = "Lower max_tokens or the prompt." if ask.own else "Set max_tokens."
        message = (
            f"Request too large for key {who.key_id} on {_words(t)}: it may use up to "
            f"{_asked(ask)}, more than the whole limit of {t.limit}. {fix}"
        )
        return _refused(t, message, max(1, int(t.reset + 0.999)), headers)
    t = max(over, key=lambda t: t.reset)
    if t.what[0] == "tokens" and t.limit - t.used >= max(1, ask.tokens):
        message = (
            f"Rate limit reached for key {who.key_id} on {_words(t)}: limit {t.limit}, "
            f"used {t.used}, and {t.held} held by your requests in flight; this one may use "
            f"up to {_asked(ask)}. Try again when they end, or lower max_tokens."
        )
        return _refused(t, message, min(_HELD_RETRY, max(1, int(t.reset + 0.999))), headers)
    message = (
        f"Rate limit reached for key {who.key_id} on {_words(t)}: limit {t.limit}, "
        f"used {t.used}. Try again in {format_reset(t.reset)}."
    )
    return _refused(t, message, max(1, int(t.reset + 0.999)), headers)


def _refused(t: _Limit, message: str, retry: int, headers: Mapping[str, str]) -> Refusal:
    budget = t.what[1] != "minute"
    return Refusal(
        message,
        "insufficient_quota" if budget else t.what[0],
        "insufficient_quota" if budget else "rate_limit_exceeded",
        retry,
        headers,
    )


# The rate-limit headers of a request let in to a model, as they stood then.
QUOTA_HEADERS = web.RequestKey("llmgw.quota_headers", dict[str, str])


def add_quota_headers(app: web.Application, book: QuotaBook) -> None:
    """Put the rate-limit headers on every answer to a request with a valid key."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        key = request_key(request)
        if key is not None:
            response.headers.update(request.get(QUOTA_HEADERS) or book.headers(key))

    app.on_response_prepare.append(on_prepare)


def budgets_path(server: ServerConfig) -> Path:
    """Where ``llmgw-admin quota`` keeps the accounts' own budgets."""
    return Path(server.state_dir) / "quotas.json"


def quota_book(
    server: ServerConfig,
    usage: UsageQueries,
    *,
    budgets: Budgets | None = None,
    others: OtherGateways | None = None,
) -> QuotaBook:
    """The daemon's quota book, its budgets started from the usage store.

    Made whenever keys are on, limits or not: an account budget that
    ``llmgw-admin quota`` sets later holds from the next request. With ``others``
    (several gateways on one database) it starts from nothing of its own: what
    was spent before is the others' to tell.
    """
    budgets = budgets if budgets is not None else AccountBudgets(budgets_path(server))
    book = QuotaBook(server.quotas, budgets, others=others)
    if others is None:
        book.load(usage)
    return book
