"""``llmgw-admin quota``: one Slurm account's own token budgets.

They go to ``state_dir/quotas.json`` (mode 0600), which the gateway rereads
when it changes: a budget holds from the next request, no reload needed.
Run it as the daemon's user (who owns state_dir).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from llmgw_slurm.accounting.quota import (
    AccountBudget,
    AccountBudgets,
    budgets_path,
    set_account_budget,
)
from llmgw_slurm.cli.common import friendly_errors, print_json, table
from llmgw_slurm.config import ServerConfig

_ACCOUNT_RE = re.compile(r"[A-Za-z0-9_.+-]{1,64}")


def _account(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not _ACCOUNT_RE.fullmatch(value):
        raise click.BadParameter(
            f"{value!r} is not a Slurm account name (letters, digits, '_', '.', '+', '-')"
        )
    return value


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def quota_group(
    server_option: Decorator, load_server: Callable[[Path], ServerConfig]
) -> click.Group:
    """The ``quota`` group, with llmgw-admin's own ``--server`` option and loader."""

    @click.group()
    def quota() -> None:
        """Set and list Slurm accounts' token budgets.

        An account's own budgets, beside quotas: in server.yaml.

        \b
        Examples:
          llmgw-admin quota set proj42 --tokens-per-day 2000000
          llmgw-admin quota list --json | jq .accounts
        """

    @quota.command("set")
    @click.argument("account", callback=_account)
    @click.option("--tokens-per-day", type=click.IntRange(min=1), help="Tokens per UTC day.")
    @click.option("--tokens-per-month", type=click.IntRange(min=1), help="Tokens per UTC month.")
    @server_option
    @friendly_errors
    def quota_set(
        account: str, tokens_per_day: int | None, tokens_per_month: int | None, server_path: Path
    ) -> None:
        """Give ACCOUNT token budgets of its own.

        Over every key charged to it. They replace the account_tokens_per_* of
        server.yaml for this account; one left out is unlimited for it.

        \b
        Example:
          llmgw-admin quota set proj42 --tokens-per-day 2000000 --tokens-per-month 40000000
        """
        if tokens_per_day is None and tokens_per_month is None:
            raise click.UsageError("give --tokens-per-day, --tokens-per-month or both")
        where = _set(
            load_server(server_path), account, AccountBudget(tokens_per_day, tokens_per_month)
        )
        click.echo(f"account {account}: {_describe(tokens_per_day, tokens_per_month)} ({where})")

    @quota.command("unset")
    @click.argument("account", callback=_account)
    @server_option
    @friendly_errors
    def quota_unset(account: str, server_path: Path) -> None:
        """Remove ACCOUNT's own budgets.

        server.yaml's apply to it again.

        \b
        Example:
          llmgw-admin quota unset proj42
        """
        where = _set(load_server(server_path), account, AccountBudget())
        click.echo(f"account {account}: the budgets of server.yaml apply ({where})")

    @quota.command("list")
    @server_option
    @click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
    @friendly_errors
    def quota_list(server_path: Path, as_json: bool) -> None:
        """List the server's quotas and accounts' budgets.

        \b
        Examples:
          llmgw-admin quota list
          llmgw-admin quota list --json | jq '.accounts | keys'
        """
        _print_quotas(load_server(server_path), as_json)

    return quota


def _print_quotas(server: ServerConfig, as_json: bool) -> None:
    budgets = _budgets(server)
    q = server.quotas
    if as_json:
        print_json(
            {
                "server": {f: getattr(q, f) for f in q.__dataclass_fields__},
                "accounts": {
                    n: {
                        "tokens_per_day": b.tokens_per_day,
                        "tokens_per_month": b.tokens_per_month,
                    }
                    for n, b in sorted(budgets.items())
                },
            }
        )
        return
    rows = [(f, getattr(q, f) or "-") for f in q.__dataclass_fields__]
    click.echo(table(("SERVER QUOTA", "LIMIT"), rows))
    if budgets:
        click.echo()
        acc_rows = [
            (n, b.tokens_per_day or "-", b.tokens_per_month or "-")
            for n, b in sorted(budgets.items())
        ]
        click.echo(table(("ACCOUNT", "TOKENS/DAY", "TOKENS/MONTH"), acc_rows))


def _set(server: ServerConfig, account: str, budget: AccountBudget) -> str:
    """Set ``account``'s budgets where the daemons read them; where that is."""
    if server.database is not None:
        from llmgw_slurm.db.connect import make_conninfo
        from llmgw_slurm.db.quota import set_budget

        set_budget(make_conninfo(server.database, "llmgw-admin"), account, budget)
        return "the shared database"
    path = budgets_path(server)
    set_account_budget(path, account, budget)
    return str(path)


def _budgets(server: ServerConfig) -> dict[str, AccountBudget]:
    if server.database is not None:
        from llmgw_slurm.db.connect import make_conninfo
        from llmgw_slurm.db.quota import budgets_of

        return budgets_of(make_conninfo(server.database, "llmgw-admin"))
    return AccountBudgets(budgets_path(server)).budgets


def _describe(day: int | None, month: int | None) -> str:
    return ", ".join(
        f"{v} tokens per {span}" for v, span in ((day, "day"), (month, "month")) if v is not None
    )
