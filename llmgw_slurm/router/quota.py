"""Quotas: requests and tokens per minute per key, token budgets per user and account.

Limits come from ``quotas:`` in server.yaml; an account's own budgets, set
with ``llmgw-admin quota``, from a small JSON file (:class:`AccountBudgets`)
that the gateway rereads when it changes, as it does the key file.

How it is counted, and why:

- A request is counted when it is let in; its tokens when the engine reports
  them (the usage the gateway records anyway). So a request is refused only
  once a limit is already reached: an answer in flight, a stream included,
  is never cut for crossing a budget, and the next request is refused.
- Per-minute limits are fixed windows (the minute of the clock), in memory:
  a restart forgets them, which costs at most one extra minute's worth.
- Day and month budgets (UTC calendar) start, at start-up, from the usage
  store's totals, so a restart does not hand out a fresh budget.

Every answer to a request with a valid key carries OpenAI's rate-limit
headers: ``x-ratelimit-{limit,remaining,reset}-requests`` (the per-minute
request limit) and ``-tokens`` (whichever token limit has least left);
a refusal is a 429 in OpenAI's error shape with ``Retry-After``. For a
request sent to a model they tell the limits as they stood when it was let
in, itself counted but not yet its tokens (as OpenAI's, worked out on
admission; a stream's head could tell no more, and so the gateway works
them out while the engine works, not between the engine's answer and the
client); for any other answer, as the limits stand as it is sent.
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
from typing import Any, NamedTuple

from aiohttp import web

from llmgw_slurm.config import QuotaConfig, ServerConfig
from llmgw_slurm.errors import ConfigError, LlmgwError
from llmgw_slurm.fsutil import atomic_write, locked
from llmgw_slurm.router.keys import KeyRecord, request_key
from llmgw_slurm.router.usage import token_totals

__all__ = [
    "QUOTA_HEADERS",
    "AccountBudget",
    "AccountBudgets",
    "QuotaBook",
    "add_quota_headers",
    "budgets_path",
    "format_reset",
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


class _Limit(NamedTuple):
    """One limit as the headers and a refusal tell it (a tuple: made per request)."""

    # (what, per, whose): ("tokens", "day", "account climate"); words only for a refusal.
    what: tuple[str, str, str]
    limit: int
    used: int
    reset: float  # seconds

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.used)


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
    name: str  # the user's or the account's
    limit: int
    what: tuple[str, str, str]  # as _Limit's


# (whose, span, the QuotaConfig field): the budgets, in the order refusals name them.
_BUDGETS = tuple(
    (kind, span, f"{kind}_tokens_per_{span}")
    for kind in ("user", "account")
    for span in ("day", "month")
)


class QuotaBook:
    """Counts what each key, user and account used, and says when a limit is reached."""

    def __init__(
        self,
        config: QuotaConfig,
        budgets: AccountBudgets | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.budgets = budgets
        self._clock = clock
        self._minute: dict[str, tuple[int, int, int]] = {}  # key id -> (minute, requests, tokens)
        self._periods = {(kind, span): _Period(span) for kind, span, _ in _BUDGETS}
        self._server_budgets = [
            (kind, span, self._periods[(kind, span)], getattr(config, name))
            for kind, span, name in _BUDGETS
        ]
        self._rules_from: dict[str, AccountBudget] | None = None
        self._rules_of: dict[str, tuple[_Rule, ...]] = {}

    def load(self, usage_db: Path) -> None:
        """Start the day and month budgets from the usage store (after a restart)."""
        now = self._clock()
        for span in ("day", "month"):
            self._periods[("user", span)].at(now)
            since = self._periods[("user", span)].start
            totals = token_totals(usage_db, since)
            for kind, pick in (("user", 0), ("account", 1)):
                used = self._periods[(kind, span)].at(now)
                for names, tokens in totals.items():
                    if names[pick]:
                        used[names[pick]] = used.get(names[pick], 0) + tokens

    def spent(self, key: KeyRecord, tokens: int) -> None:
        """A request of ``key`` used ``tokens`` (called as its usage is recorded)."""
        now = self._clock()
        minute = int(now // 60)
        m, reqs, toks = self._minute.get(key.key_id, (minute, 0, 0))
        if m == minute:
            self._minute[key.key_id] = (minute, reqs, toks + tokens)
        for (kind, _), period in self._periods.items():
            name = key.user if kind == "user" else key.project
            if name:
                used = period.at(now)
                used[name] = used.get(name, 0) + tokens

    def _rules(self, key: KeyRecord) -> tuple[_Rule, ...]:
        """The day and month budgets that apply to ``key``: worked out once a key
        (and again when the budgets file changes), not once a request."""
        budgets = self.budgets.budgets if self.budgets is not None else None
        if budgets is not self._rules_from:
            self._rules_from, self._rules_of = budgets, {}
        rules = self._rules_of.get(key.key_id)
        if rules is None:
            if len(self._rules_of) > 100_000:
                self._rules_of = {}
            rules = self._rules_of[key.key_id] = self._make_rules(key, budgets)
        return rules

    def _make_rules(
        self, key: KeyRecord, budgets: dict[str, AccountBudget] | None
    ) -> tuple[_Rule, ...]:
        own = budgets.get(key.project) if budgets is not None and key.project else None
        rules = []
        for kind, span, period, server_limit in self._server_budgets:
            name = key.user if kind == "user" else key.project
            limit: int | None = server_limit
            if kind == "account" and own is not None:
                limit = own.tokens_per_day if span == "day" else own.tokens_per_month
            if limit is not None and name:
                rules.append(_Rule(period, name, limit, ("tokens", span, kind + " " + name)))
        return tuple(rules)

    def _minute_counts(self, key: KeyRecord, now: float) -> tuple[int, int]:
        """The requests and tokens ``key`` has used in the clock's minute."""
        m, reqs, toks = self._minute.get(key.key_id, (-1, 0, 0))
        return (reqs, toks) if m == int(now // 60) else (0, 0)

    def _limits(self, key: KeyRecord, now: float) -> tuple[_Limit | None, list[_Limit]]:
        """The request limit and every token limit that applies to ``key`` now."""
        cfg = self.config
        reqs, toks = self._minute_counts(key, now)
        to_minute = 60.0 - (now % 60)
        req = None
        if cfg.requests_per_minute is not None:
            req = _Limit(_MINUTE_REQUESTS, cfg.requests_per_minute, reqs, to_minute)
        tokens = []
        if cfg.tokens_per_minute is not None:
            tokens.append(_Limit(_MINUTE_TOKENS, cfg.tokens_per_minute, toks, to_minute))
        for rule in self._rules(key):
            used = rule.period.at(now).get(rule.name, 0)
            tokens.append(_Limit(rule.what, rule.limit, used, rule.period.end - now))
        return req, tokens

    def _tightest(self, key: KeyRecord, now: float, toks: int) -> _Limit | None:
        """The token limit with least left (of two, the later reset), as the headers
        tell it; what :meth:`_limits` would give, without a limit for each rule."""
        best: _Limit | None = None
        if self.config.tokens_per_minute is not None:
            best = _Limit(_MINUTE_TOKENS, self.config.tokens_per_minute, toks, 60.0 - (now % 60))
        for rule in self._rules(key):
            used = rule.period.at(now).get(rule.name, 0)
            reset = rule.period.end - now
            if best is None or (max(0, rule.limit - used), -reset) < (best.remaining, -best.reset):
                best = _Limit(rule.what, rule.limit, used, reset)
        return best

    def headers(self, key: KeyRecord) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for ``key`` as things stand (the budgets
        file as :meth:`admit` last read it: one stat a request is enough)."""
        now = self._clock()
        reqs, toks = self._minute_counts(key, now)
        rpm = self.config.requests_per_minute
        req = None if rpm is None else _Limit(_MINUTE_REQUESTS, rpm, reqs, 60.0 - (now % 60))
        return _headers(req, self._tightest(key, now, toks))

    def admit(self, key: KeyRecord) -> web.Response | None:
        """Count a request of ``key``, or the 429 that says which limit it reached."""
        if self.budgets is not None:
            self.budgets.refresh()
        now = self._clock()
        reqs, toks = self._minute_counts(key, now)
        rpm = self.config.requests_per_minute
        tight = self._tightest(key, now, toks)
        if (rpm is not None and rpm <= reqs) or (tight is not None and tight.remaining == 0):
            return self._refusal(key, now)
        minute = int(now // 60)
        self._minute[key.key_id] = (minute, reqs + 1, toks)
        if len(self._minute) > 100_000:
            # Keys idle for a minute or more hold nothing worth keeping.
            self._minute = {k: v for k, v in self._minute.items() if v[0] == minute}
        return None

    def _refusal(self, key: KeyRecord, now: float) -> web.Response:
        """The 429 for a key over a limit: the one that resets last, every limit
        in the headers. (Rare, so every limit is worked out in full here.)"""
        req, tokens = self._limits(key, now)
        over = [t for t in tokens if t.limit <= t.used]
        if req is not None and req.limit <= req.used:
            over.insert(0, req)
        return _refusal(key, max(over, key=lambda t: t.reset), _headers(req, _least_left(tokens)))


def _least_left(tokens: list[_Limit]) -> _Limit | None:
    """The token limit the headers tell: least left, and of two, the later reset
    (QuotaBook._tightest finds the same one without a list)."""
    return min(tokens, key=lambda t: (t.remaining, -t.reset)) if tokens else None


def _headers(req: _Limit | None, tight: _Limit | None) -> dict[str, str]:
    """The x-ratelimit-* headers: the request limit's, and the tightest token limit's."""
    out: dict[str, str] = {}
    if req is not None:
        # Remaining after this request: the request itself was counted on admission.
        out["x-ratelimit-limit-requests"] = str(req.limit)
        out["x-ratelimit-remaining-requests"] = str(req.remaining)
        out["x-ratelimit-reset-requests"] = format_reset(req.reset)
    if tight is not None:
        out["x-ratelimit-limit-tokens"] = str(tight.limit)
        out["x-ratelimit-remaining-tokens"] = str(tight.remaining)
        out["x-ratelimit-reset-tokens"] = format_reset(tight.reset)
    return out


def _refusal(key: KeyRecord, over: _Limit, headers: Mapping[str, str]) -> web.Response:
    what, per, whose = over.what
    budget = per != "minute"
    words = f"{what} per {per}" + (f" of {whose}" if whose else "")
    message = (
        f"Rate limit reached for key {key.key_id} on {words}: limit {over.limit}, "
        f"used {over.used}. Try again in {format_reset(over.reset)}."
    )
    body: dict[str, Any] = {
        "error": {
            "message": message,
            "type": "insufficient_quota" if budget else what,
            "param": None,
            "code": "insufficient_quota" if budget else "rate_limit_exceeded",
        }
    }
    retry = str(max(1, int(over.reset + 0.999)))
    return web.json_response(body, status=429, headers={**headers, "Retry-After": retry})


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


def quota_book(server: ServerConfig, usage_db: Path) -> QuotaBook:
    """The daemon's quota book, its budgets started from the usage store.

    Made whenever keys are on, limits or not: an account budget that
    ``llmgw-admin quota`` sets later holds from the next request.
    """
    book = QuotaBook(server.quotas, AccountBudgets(budgets_path(server)))
    book.load(usage_db)
    return book
