"""``llmgw-admin usage``: token usage by user, Slurm account, key or model.

Read from the daemon's usage store (``state_dir/usage.sqlite3``), so run it
as the daemon's user. Keys from ``llmgw login`` are charged to the Slurm
account they name; an admin's key to its ``--account``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from llmgw_slurm.accounting.usage import USAGE_GROUPS
from llmgw_slurm.cli.common import (
    friendly_errors,
    iso_time,
    parse_when,
    print_json,
    table,
    token_totals,
)
from llmgw_slurm.cli.stores import usage_queries
from llmgw_slurm.config import ServerConfig

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def usage_command(
    server_option: Decorator, load_server: Callable[[Path], ServerConfig]
) -> click.Command:
    """The ``usage`` command, with llmgw-admin's own ``--server`` option and loader."""

    @click.command()
    @click.option("--by", type=click.Choice(list(USAGE_GROUPS)), default="user", show_default=True)
    @click.option(
        "--since", default="30d", show_default=True, help="30m, 12h, 7d, 2w ago, or a date."
    )
    @click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
    @server_option
    @friendly_errors
    def usage(by: str, since: str, as_json: bool, server_path: Path) -> None:
        """Requests and tokens by user, account, key or model.

        Through the gateway, online and batch (a batch counts each of its
        requests), with totals. --json gives since (ISO 8601), by, rows (one
        per user, account, key or model) and totals.

        \b
        Examples:
          llmgw-admin usage --since 7d
          llmgw-admin usage --by account --json | jq -r '.rows[] | "\\(.account) \\(.total_tokens)"'
          llmgw-admin usage --by model --json | jq .totals
        """
        t0 = parse_when(since, time.time())
        rows = usage_queries(load_server(server_path)).by(by, t0)
        total = token_totals(rows)
        if as_json:
            print_json({"since": iso_time(t0), "by": by, "rows": rows, "totals": total})
            return
        click.echo(f"Usage through the gateway since {since} ({iso_time(t0)}), by {by}:")
        if not rows:
            click.echo("no requests")
            return
        cols = (by, "requests", "prompt_tokens", "completion_tokens", "total_tokens")
        click.echo(
            table(
                [c.upper().replace("_", " ") for c in cols],
                [[r[c] if r[c] != "" else "-" for c in cols] for r in rows]
                + [["total", *(total[c] for c in cols[1:])]],
            )
        )

    return usage
