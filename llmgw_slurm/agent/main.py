"""``llmgw-agent``: runs inside a replica's (or model job's) Slurm job.

    llmgw-agent --config agent.yaml run      # a replica: weights, engine, serve, drain
    llmgw-agent --config agent.yaml fetch    # a model job: weights into the cache only

The model spec and secrets come from the job environment (LLMGW_*), set by
the daemon at submission; the options here override agent.yaml.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from llmgw_slurm.agent.runner import Agent, job_context_from_env
from llmgw_slurm.agent.settings import AgentSettings, FetchSettings
from llmgw_slurm.agent.spec import parse_replica_spec
from llmgw_slurm.agent.weights import ensure_weights
from llmgw_slurm.errors import LlmgwError

__all__ = ["main"]

log = logging.getLogger("llmgw_slurm.agent")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s llmgw-agent %(levelname)s %(name)s: %(message)s",
    )


def _port_range(text: str) -> tuple[int, int]:
    try:
        lo_s, hi_s = text.split("-", 1)
        lo, hi = int(lo_s), int(hi_s)
    except ValueError as err:
        raise click.BadParameter(f"{text!r}: expected LOW-HIGH, e.g. 20000-29999") from err
    if not 0 < lo <= hi <= 65535:
        raise click.BadParameter(f"{text!r}: expected 1 <= LOW <= HIGH <= 65535")
    return lo, hi


def settings_from_config(path: Path | None, overrides: dict[str, Any]) -> AgentSettings:
    """AgentSettings from agent.yaml, then the command-line overrides.

    Loading agent.yaml belongs to llmgw_slurm.config (AgentConfig); until it
    is wired here, every setting comes from the options.
    """
    if path is not None:
        raise click.ClickException(
            f"--config {path}: reading agent.yaml is not wired into llmgw-agent yet; "
            "pass --cache-dir and --shared-dir (and other options) instead"
        )
    cache_dir = overrides.pop("cache_dir")
    shared_dir = overrides.pop("shared_dir")
    if cache_dir is None or shared_dir is None:
        raise click.UsageError("--cache-dir and --shared-dir are needed without --config")
    fetch = FetchSettings(
        cache_dir=cache_dir,
        enabled=overrides.pop("fetch"),
        allow_hf=overrides.pop("allow_hf"),
        verify=overrides.pop("verify"),
    )
    kwargs = {k: v for k, v in overrides.items() if v is not None}
    return AgentSettings(fetch=fetch, shared_dir=shared_dir, **kwargs)


@click.group()
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="agent.yaml")
@click.option("--cache-dir", type=click.Path(path_type=Path), help="Shared weights cache.")
@click.option("--shared-dir", type=click.Path(path_type=Path),
              help="A directory every node of a job sees (rendezvous files).")
@click.option("--fetch/--no-fetch", default=True, show_default=True,
              help="Fetch missing weights (off: they must be in the cache).")
@click.option("--allow-hf/--no-allow-hf", default=False, show_default=True,
              help="Allow `hf download` from this node.")
@click.option("--verify", type=click.Choice(["size", "sha256"]), default="size",
              show_default=True, help="How cached weights are checked at start.")
@click.option("--python", default=None, help="Interpreter of the engine (default: this one).")
@click.option("--bind-host", default=None, help="Address the engine listens on.")
@click.option("--advertise-host", default=None, help="Host name reported to the daemon.")
@click.option("--port-range", default=None, help="Engine ports, LOW-HIGH.")
@click.option("--ready-timeout", "ready_timeout_s", type=float, default=None)
@click.option("--ready-poll", "ready_poll_s", type=float, default=None)
@click.option("--heartbeat-interval", "heartbeat_interval_s", type=float, default=None)
@click.option("--drain-timeout", "drain_timeout_s", type=float, default=None)
@click.option("--drain-poll", "drain_poll_s", type=float, default=None)
@click.option("--drain-grace", "drain_grace_s", type=float, default=None)
@click.option("--stop-grace", "stop_grace_s", type=float, default=None)
@click.option("--report-timeout", "report_timeout_s", type=float, default=None,
              help="Per report, and for the last reports at exit.")
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_context
def main(ctx: click.Context, /, config_path: Path | None, log_level: str, port_range: str | None,
         **options: Any) -> None:
    """The llmgw job agent."""
    _setup_logging(log_level)
    if port_range is not None:
        options["port_range"] = _port_range(port_range)
    ctx.obj = (config_path, options)


def _settings(ctx: click.Context) -> AgentSettings:
    config_path, options = ctx.obj
    try:
        return settings_from_config(config_path, dict(options))
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err


@main.command()
@click.pass_context
def run(ctx: click.Context) -> None:
    """Run a replica: weights, rendezvous, engine, readiness, serve until drained."""
    settings = _settings(ctx)
    env = dict(os.environ)
    try:
        job = job_context_from_env(env)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err
    code = asyncio.run(Agent(settings, job, env).run())
    sys.exit(code)


@main.command()
@click.pass_context
def fetch(ctx: click.Context) -> None:
    """Fetch the weights of LLMGW_REPLICA_SPEC's model into the cache, and exit."""
    settings = _settings(ctx)
    try:
        spec = parse_replica_spec(os.environ.get("LLMGW_REPLICA_SPEC"))
        t0 = time.monotonic()
        result = ensure_weights(spec.name, spec.weights, settings.fetch)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err
    what = "fetched" if result.fetched else "already there"
    click.echo(f"{spec.name}: {result.path} ({what}, {time.monotonic() - t0:.1f}s)")


if __name__ == "__main__":
    main()
