"""Shared pieces of both command-line tools: running coroutines, tables, errors."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import ssl as ssl_
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import click

from llmgw_slurm.base.durations import parse_since
from llmgw_slurm.base.errors import LlmgwError

P = ParamSpec("P")
R = TypeVar("R")


def friendly_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn the project's own errors into click's one-line ``Error: ...`` and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except LlmgwError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def run(coro: Coroutine[Any, Any, R]) -> R:
    return asyncio.run(coro)


def iso_time(ts: float) -> str:
    """A Unix time as ISO 8601 with the local offset, as every ``--json`` prints times."""
    from datetime import datetime

    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def token_totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The requests and tokens of usage rows, summed (both CLIs' ``usage``)."""
    return {
        k: sum(int(r.get(k) or 0) for r in rows)
        for k in ("requests", "prompt_tokens", "completion_tokens", "total_tokens")
    }


def print_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], free_text: int | None = None
) -> str:
    """A plain left-aligned table that keeps within the terminal's width.

    The widest column is trimmed (with an ellipsis) when the table would not
    fit, so an 80-column terminal gets whole rows rather than wrapped ones;
    column ``free_text`` (a description) first, so the others stay whole.
    """
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    limit = shutil.get_terminal_size((80, 24)).columns
    while sum(widths) + 2 * (len(widths) - 1) > limit and max(widths) > 8:
        widest = widths.index(max(widths))
        if free_text is not None and widths[free_text] > 12:
            widest = free_text
        widths[widest] -= 1
    lines = []
    for row in cells:
        out = []
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                cell = cell[: widths[i] - 1] + "…"
            out.append(cell.ljust(widths[i]))
        lines.append("  ".join(out).rstrip())
    return "\n".join(lines)


# ---- talking to the daemon ---------------------------------------------------------


class DaemonReply:
    """One answer from the daemon: status code and the decoded JSON body."""

    def __init__(self, status: int, data: Any) -> None:
        self.status = status
        self.data = data

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def error_message(self) -> str:
        """The ``error.message`` of an error body, or a short description of the answer."""
        if isinstance(self.data, dict):
            err = self.data.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            if isinstance(err, str):
                return err
        return f"HTTP {self.status}"


async def call_daemon(
    method: str,
    base_url: str,
    path: str,
    *,
    token: str | None = None,
    body: object = None,
    params: Mapping[str, str] | None = None,
    timeout: float = 15.0,
    what: str = "the llmgw daemon",
    ssl: ssl_.SSLContext | bool | None = None,
    hint: str = "",
) -> DaemonReply:
    """One request to the daemon; an unreachable daemon is a ClickException saying where
    (and ``hint``: where that address came from, what to set).

    ``ssl``: how to verify an https server (None: the system's CAs; False: not at all). The caller
    checks, before it passes a ``token``, that the server is the daemon
    (:mod:`llmgw_slurm.auth.identity`).
    """
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = base_url.rstrip("/") + path
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.request(
                method,
                url,
                json=body,
                headers=headers,
                params=params,
                ssl=ssl if ssl is not None else True,
            ) as resp,
        ):
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        reason = _unreachable_reason(exc, timeout)
        raise click.ClickException(f"cannot reach {what} at {base_url}: {reason}{hint}") from None
    try:
        data = json.loads(text) if text else None
    except json.JSONDecodeError:
        raise click.ClickException(
            f"{base_url} answered {status} with something that is not JSON; "
            f"is it the llmgw daemon? ({text[:80]!r})"
        ) from None
    return DaemonReply(status, data)


def _unreachable_reason(exc: BaseException, timeout: float) -> str:
    """Why a connection failed, in words (aiohttp's own text names its internals:
    "Cannot connect to host h:p ssl:default [Connect call failed ...]")."""
    import aiohttp

    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"its certificate is not trusted ({exc.certificate_error})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        if isinstance(err, ConnectionRefusedError):
            return "connection refused (nothing listens there)"
        return (err.strerror or str(err) or type(err).__name__).rstrip(".").lower()
    return str(exc) or type(exc).__name__


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """``; did you mean 'x'?`` for a near miss among ``known``, else ""."""
    import difflib

    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_model(name: str, known: Sequence[str], also: Sequence[str] = ()) -> str:
    """How every command says a model is not in the catalog: the near name (among the
    names and ``also``, their aliases) first, then the known names."""
    return (
        f"unknown model {name!r}{did_you_mean(name, [*known, *also])} "
        f"(known: {', '.join(known) or 'none'})"
    )


def parse_when(text: str, now: float) -> float:
    """A ``--since``/``--until`` value as a Unix timestamp (:func:`durations.parse_since`),
    or click's usage error (exit 2) naming the valid forms."""
    try:
        return parse_since(text, now)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
