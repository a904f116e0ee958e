"""``llmgw-admin``: what an HPC admin runs (the daemon, status, audits, keys)."""

from __future__ import annotations

import dataclasses

import click

from llmgw_slurm import __version__
from llmgw_slurm.cli.common import friendly_errors, print_json, run, table
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import NodeInfo


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-admin")
def main() -> None:
    """Run and operate the llmgw-slurm gateway."""


def _gpu_text(node: NodeInfo) -> str:
    if not node.gpus:
        return "-"
    return ",".join(f"{g.type or 'gpu'}:{g.free}/{g.total}" for g in node.gpus)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for sinfo.")
@friendly_errors
def nodes(as_json: bool, timeout: float) -> None:
    """The cluster's nodes with free/total GPUs per type (one sinfo call)."""
    found = run(CliBackend(timeout=timeout).list_nodes())
    if as_json:
        print_json(
            [
                dataclasses.asdict(n) | {"gpus_free": n.gpus_free(), "usable": n.usable}
                for n in found
            ]
        )
        return
    rows = [
        (
            n.name,
            n.state,
            ",".join(sorted(n.partitions)),
            _gpu_text(n),
            f"{n.cpus_total - n.cpus_alloc}/{n.cpus_total}",
            f"{n.memory_mb // 1024}G",
        )
        for n in found
    ]
    click.echo(table(("NODE", "STATE", "PARTITIONS", "GPUS FREE/TOTAL", "CPUS", "MEM"), rows))
    free = sum(n.gpus_free() for n in found if n.usable)
    total = sum(n.gpus_total() for n in found)
    click.echo(f"\n{len(found)} nodes, {free} of {total} GPUs free")
