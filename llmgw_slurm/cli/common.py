"""Shared pieces of both command-line tools: running coroutines, tables, errors."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar

import click

from llmgw_slurm.errors import LlmgwError

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


def print_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain left-aligned table that keeps within the terminal's width.

    The widest column is trimmed (with an ellipsis) when the table would not
    fit, so an 80-column terminal gets whole rows rather than wrapped ones.
    """
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    limit = shutil.get_terminal_size((80, 24)).columns
    while sum(widths) + 2 * (len(widths) - 1) > limit and max(widths) > 8:
        widest = widths.index(max(widths))
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
