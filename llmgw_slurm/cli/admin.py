"""``llmgw-admin``: what an HPC admin runs (the daemon, status, audits, keys)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

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


@main.command()
@click.option(
    "--server",
    "server_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_SERVER_CONFIG",
    default="/etc/llmgw-slurm/server.yaml",
    show_default=True,
    help="server.yaml (env LLMGW_SERVER_CONFIG).",
)
@click.option("--log-level", default="INFO", show_default=True)
@friendly_errors
def serve(server_path: Path, log_level: str) -> None:
    """Run the daemon: reconciler, gateway and internal API (SIGHUP reloads the catalog)."""
    from llmgw_slurm import daemon
    from llmgw_slurm.config import load_server_config

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = load_server_config(server_path)
    d = daemon.build(server, server_path)
    run(daemon.serve(d))


@main.group()
def config() -> None:
    """Configuration files."""


@config.command("check")
@click.option("--models", type=click.Path(dir_okay=False, path_type=Path), help="models.yaml")
@click.option("--server", type=click.Path(dir_okay=False, path_type=Path), help="server.yaml")
@click.option("--agent", type=click.Path(dir_okay=False, path_type=Path), help="agent.yaml")
def config_check(models: Path | None, server: Path | None, agent: Path | None) -> None:
    """Validate config files without starting anything or touching Slurm.

    Every problem of every file is reported, each as file:line: field: message.
    With --server alone, the models and agent files it names are checked too.
    """
    from llmgw_slurm.config import check_files, load_server_config
    from llmgw_slurm.errors import ConfigError

    if models is None and server is None and agent is None:
        raise click.UsageError("give at least one of --models, --server, --agent")
    errors = check_files(models=models, server=server, agent=agent)
    if server is not None and not errors:
        try:
            cfg = load_server_config(server)
        except ConfigError as exc:  # pragma: no cover - check_files saw it already
            errors.append(exc)
        else:
            errors += check_files(
                models=cfg.models if models is None else None,
                agent=cfg.agent_config if agent is None else None,
            )
    for e in errors:
        click.echo(str(e), err=True)
    if errors:
        click.echo(f"{len(errors)} error(s)", err=True)
        sys.exit(1)
    click.echo("ok: " + ", ".join(str(p) for p in (models, server, agent) if p is not None))
