"""``llmgw-admin audit --by user|account``: GPU hours by whom the jobs served.

sacct gives the jobs (as for the audit by period); the usage store in
``state_dir/usage.sqlite3`` gives the tokens that online replicas' hours are
apportioned by (:mod:`llmgw_slurm.accounting.audit_owner` has the rule). So run it as the
daemon's user, on the daemon's host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime

import click

from llmgw_slurm.accounting.audit_owner import OwnerKind, OwnerRow, by_owner, owner_totals
from llmgw_slurm.accounting.usage import UsageQueries
from llmgw_slurm.cli.common import print_json, table
from llmgw_slurm.slurm.types import AccountingRecord

__all__ = ["owner_audit"]


def owner_audit(
    records: Sequence[AccountingRecord],
    *,
    prefix: str,
    usage: UsageQueries,
    window: tuple[datetime, datetime, datetime],
    kind: OwnerKind,
    header: Mapping[str, str],
    as_json: bool,
    chart: bool,
    color: bool,
) -> None:
    """Print the rows (table, JSON or chart); ``window`` is (since, until, now)."""
    t0, t1, now = window

    def tokens_in(model: str, a: datetime, b: datetime) -> Mapping[str, int]:
        return usage.tokens_by(kind, model, a.timestamp(), b.timestamp())

    rows = by_owner(records, prefix, t0, t1, now, kind, tokens_in)
    if as_json:
        print_json(
            {
                **header,
                "by": kind,
                # Online replicas are shared: their hours are split by token share.
                "online_apportioned_by": "tokens served by the model during the job's run",
                "rows": [_row_json(r) for r in rows],
                "totals": owner_totals(rows),
            }
        )
        return
    click.echo(
        f"jobs of {header['user']} named {prefix}* from {t0:%Y-%m-%d %H:%M} to "
        f"{t1:%Y-%m-%d %H:%M}, by {kind}"
    )
    if not rows:
        click.echo("no jobs")
        return
    if chart:
        from llmgw_slurm.cli import charts

        tot = sorted(owner_totals(rows).items(), key=lambda kv: -kv[1])
        lines = charts.bar_chart(
            [(o, h, f"{h:.2f} h") for o, h in tot],
            cols=charts.width(),
            color=color,
            title=f"GPU hours by {kind} (online replicas apportioned by tokens)",
        )
        click.echo("\n".join(lines))
        return
    head = (kind.upper(), "MODEL", "BATCH JOBS", "BATCH GPU H", "ONLINE GPU H (APPORTIONED)")
    body = [
        (r.owner, r.model, r.batch_jobs, f"{r.batch_gpu_hours:.2f}",
         f"{r.online_gpu_hours_apportioned:.2f}", f"{r.gpu_hours:.2f}")
        for r in rows
    ]  # fmt: skip
    click.echo(table((*head, "GPU H"), body))
    click.echo(
        "online replicas are shared: their GPU hours are apportioned by each "
        f"{kind}'s share of the tokens the model served while the job ran; "
        "(idle): hours with no tokens served"
    )


def _row_json(r: OwnerRow) -> dict[str, object]:
    return {**dataclasses.asdict(r), "gpu_hours": r.gpu_hours}
