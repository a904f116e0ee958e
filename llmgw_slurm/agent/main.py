"""``llmgw-agent``: runs inside a replica's (or model job's) Slurm job.

    llmgw-agent --config agent.yaml run      # a replica: weights, engine, serve, drain
    llmgw-agent --config agent.yaml fetch    # a model job: weights into the cache only
    llmgw-agent --config agent.yaml batch    # a Batch API job: engine, the batch's requests

The model spec and secrets come from the job environment (LLMGW_*), set by
the daemon at submission; the options here override agent.yaml. Without
--config, --cache-dir is needed and everything else has its default.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from llmgw_slurm.agent.batch import BatchAgent, batch_job_from_env
from llmgw_slurm.agent.runner import Agent, JobContext, job_context_from_env, replica_spec
from llmgw_slurm.agent.weights import ensure_weights, trace_marker_path
from llmgw_slurm.base.errors import LlmgwError
from llmgw_slurm.config import (
    AgentConfig,
    AgentWeightsConfig,
    PortRange,
    TracingConfig,
    load_agent_config,
)

__all__ = ["OPTIONS", "build_config", "job_environment", "main"]

log = logging.getLogger("llmgw_slurm.agent")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s llmgw-agent %(levelname)s %(name)s: %(message)s",
    )


def _port_range(text: str) -> PortRange:
    try:
        lo_s, hi_s = text.split("-", 1)
        lo, hi = int(lo_s), int(hi_s)
    except ValueError as err:
        raise click.BadParameter(f"{text!r}: expected LOW-HIGH, e.g. 20000-29999") from err
    if not 0 < lo <= hi <= 65535:
        raise click.BadParameter(f"{text!r}: expected 1 <= LOW <= HIGH <= 65535")
    return PortRange(lo, hi)


def _load_config(path: Path) -> AgentConfig:
    try:
        return load_agent_config(path)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err


def _setup_tracing(path: Path | None, local: Any = None) -> Any:
    """agent.yaml's ``tracing:`` block; returns the TracerProvider, or None when off.

    ``local``: a span processor that gets the spans whatever the block says
    (the export to the daemon, :func:`_to_daemon`). Imported lazily, like the
    config module: an agent without a config file (or with tracing off) never
    loads the OTLP exporter.
    """
    if path is None and local is None:
        return None
    try:
        tracing = importlib.import_module("llmgw_slurm.tracing.otel")
        cfg = load_agent_config(path).tracing if path is not None else TracingConfig()
        return tracing.setup_tracing(cfg, "llmgw-agent", local=local)
    except ImportError as err:
        log.warning("tracing: not available in this agent (%s); running without", err)
        return None
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err


def _to_daemon(job: JobContext, env: Mapping[str, str]) -> Any:
    """The processor that sends a replica's spans to its daemon; None when the job
    carries no trace context (the daemon keeps no traces, nor exports any)."""
    if not env.get("TRACEPARENT"):
        return None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from llmgw_slurm.agent.spansend import DaemonSpanExporter
    from llmgw_slurm.tracing.otel import RateLimitedExporter

    exporter = DaemonSpanExporter(job.daemon_url, job.replica_id, job.replica_secret)
    return BatchSpanProcessor(RateLimitedExporter(exporter))


def _shutdown_tracing(provider: Any) -> None:
    if provider is not None:
        # The job is ending: the last spans leave now or never.
        provider.shutdown()


# Each command-line option and where it lands in agent.yaml's type: (block, field),
# the block "" for a field of AgentConfig itself.
OPTIONS: dict[str, tuple[str, str]] = {
    "cache_dir": ("weights", "cache_dir"),
    "fetch": ("weights", "fetch"),
    "allow_hf": ("weights", "allow_download"),
    "weights_method": ("weights", "method"),
    "verify": ("weights", "verify"),
    "rendezvous_dir": ("rendezvous", "dir"),
    "python": ("", "python"),
    "bind_host": ("", "bind_host"),
    "advertise_host": ("", "advertise_host"),
    "port_range": ("", "port_range"),
    "ready_timeout_s": ("readiness", "timeout"),
    "ready_poll_s": ("readiness", "poll_interval"),
    "heartbeat_interval_s": ("", "heartbeat_interval"),
    "drain_timeout_s": ("drain", "timeout"),
    "drain_poll_s": ("drain", "poll_interval"),
    "drain_grace_s": ("drain", "grace"),
    "stop_grace_s": ("drain", "stop_grace"),
    "report_timeout_s": ("", "report_timeout"),
}


def build_config(path: Path | None, options: dict[str, Any]) -> AgentConfig:
    """agent.yaml (if given), then the command-line options that were set over it."""
    opts = {k: v for k, v in options.items() if v is not None}
    if path is not None:
        cfg = _load_config(path)
    elif "cache_dir" in opts:
        cfg = AgentConfig()
    else:
        raise click.UsageError("give --config agent.yaml, or at least --cache-dir")
    blocks: dict[str, dict[str, Any]] = {}
    for name, value in opts.items():
        block, key = OPTIONS[name]
        blocks.setdefault(block, {})[key] = value
    top = blocks.pop("", {})
    for block, values in blocks.items():
        top[block] = dataclasses.replace(getattr(cfg, block), **values)
    return dataclasses.replace(cfg, **top)


@click.group()
@click.option(
    "--config", "config_path", type=click.Path(path_type=Path), default=None, help="agent.yaml"
)
@click.option("--cache-dir", type=click.Path(path_type=Path), help="Shared weights cache.")
@click.option(
    "--rendezvous-dir",
    type=click.Path(path_type=Path),
    help="A directory every node of a job sees (multi-node port files).",
)
@click.option(
    "--fetch/--no-fetch",
    default=None,
    help="Fetch missing weights (off: they must be in the cache). Default on.",
)
@click.option(
    "--allow-hf/--no-allow-hf",
    default=None,
    help="Allow `hf download` from this node (agent.yaml weights.allow_download).",
)
@click.option(
    "--weights-method",
    type=click.Choice(["auto", "copy", "hf", "none"]),
    default=None,
    help="Force a weights method (agent.yaml weights.method).",
)
@click.option(
    "--verify",
    type=click.Choice(["size", "sha256"]),
    default=None,
    help="How cached weights are checked at start. Default size.",
)
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
@click.option(
    "--report-timeout",
    "report_timeout_s",
    type=float,
    default=None,
    help="Per report, and for the last reports at exit.",
)
@click.option("--log-level", default="INFO", show_default=True)
@click.pass_context
def main(
    ctx: click.Context,
    /,
    config_path: Path | None,
    log_level: str,
    port_range: str | None,
    **options: Any,
) -> None:
    """The llmgw job agent."""
    _setup_logging(log_level)
    if port_range is not None:
        options["port_range"] = _port_range(port_range)
    ctx.obj = (config_path, options)


def _config(ctx: click.Context) -> AgentConfig:
    config_path, options = ctx.obj
    return build_config(config_path, dict(options))


def job_environment(environ: Mapping[str, str], daemon_url: str | None) -> dict[str, str]:
    """The job's environment, with agent.yaml's daemon_url where the job has no
    LLMGW_DAEMON_URL: the daemon's own value wins (it knows where it listens)."""
    env = dict(environ)
    if daemon_url and not env.get("LLMGW_DAEMON_URL"):
        env["LLMGW_DAEMON_URL"] = daemon_url
    return env


@main.command()
@click.pass_context
def run(ctx: click.Context) -> None:
    """Run a replica: weights, rendezvous, engine, readiness, serve until drained."""
    config = _config(ctx)
    env = job_environment(os.environ, config.daemon_url)
    try:
        job = job_context_from_env(env)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err
    provider = _setup_tracing(ctx.obj[0], _to_daemon(job, env))
    flush = provider.force_flush if provider is not None else None
    try:
        code = asyncio.run(Agent(config, job, env, flush=flush).run())
    finally:
        _shutdown_tracing(provider)
    sys.exit(code)


@main.command()
@click.pass_context
def batch(ctx: click.Context) -> None:
    """Run a Batch API batch: weights, engine, readiness, then the batch's requests."""
    config = _config(ctx)
    env = job_environment(os.environ, config.daemon_url)
    try:
        job, work = batch_job_from_env(env)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err
    provider = _setup_tracing(ctx.obj[0])
    flush = provider.force_flush if provider is not None else None
    try:
        code = asyncio.run(BatchAgent(work, config, job, env, flush=flush).run())
    finally:
        _shutdown_tracing(provider)
    sys.exit(code)


@main.command()
@click.pass_context
def fetch(ctx: click.Context) -> None:
    """Fetch the weights of LLMGW_REPLICA_SPEC's model into the cache, and exit."""
    config = _config(ctx)
    provider = _setup_tracing(ctx.obj[0])
    try:
        result, spec, elapsed = _traced_fetch(config.weights)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err
    finally:
        _shutdown_tracing(provider)
    what = "fetched" if result.fetched else "already there"
    where = result.model_path or "(no weights)"
    click.echo(f"{spec.name}: {where} ({what}, {elapsed:.1f}s)")


@main.command()
@click.option("--kind", type=click.Choice(["venv", "apptainer"]), required=True)
@click.option("--target", required=True, help="The venv directory, or the image file.")
@click.option("--python", "venv_python", default=sys.executable, show_default=True)
@click.option("--package", "packages", multiple=True, help="A pip requirement (repeatable).")
@click.option("--pip-arg", "pip_args", multiple=True, help="A pip option (repeatable).")
@click.option("--system-site-packages", is_flag=True)
@click.option("--image-uri", default="")
@click.option("--apptainer", default="apptainer", show_default=True)
@click.pass_context
def install(
    ctx: click.Context,
    /,
    kind: str,
    target: str,
    venv_python: str,
    packages: tuple[str, ...],
    pip_args: tuple[str, ...],
    system_site_packages: bool,
    image_uri: str,
    apptainer: str,
) -> None:
    """Install an engine (a venv with pip, or an Apptainer image), once, and exit."""
    from llmgw_slurm.agent.install import InstallRequest, install_engine

    req = InstallRequest(
        kind=kind,
        target=Path(target),
        python=venv_python,
        packages=packages,
        pip_args=pip_args,
        system_site_packages=system_site_packages,
        image_uri=image_uri,
        apptainer=apptainer,
    )
    provider = _setup_tracing(ctx.obj[0])
    try:
        result = install_engine(req)
    except LlmgwError as err:
        raise click.ClickException(str(err)) from err
    finally:
        _shutdown_tracing(provider)
    if result.installed:
        click.echo(f"llmgw: installed {target} ({result.seconds:.1f}s)")
    else:
        click.echo(f"llmgw: {target} already installed")


def _traced_fetch(weights: AgentWeightsConfig) -> tuple[Any, Any, float]:
    """A model job: its own trace (or the one in TRACEPARENT), a span per step.

    When it fetched, its trace context is left beside the weights in the
    cache, so that a replica start that uses them links to this trace.
    """
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    from llmgw_slurm.tracing.otel import extract_env, write_trace_marker

    tracer = trace.get_tracer("llmgw_slurm")
    attrs = {"llmgw.job_id": os.environ.get("SLURM_JOB_ID", "")}
    with tracer.start_as_current_span(
        "llmgw.model_job", context=extract_env(os.environ), attributes=attrs
    ) as root:
        try:
            with tracer.start_as_current_span("llmgw.model_job.spec"):
                spec = replica_spec(os.environ.get("LLMGW_REPLICA_SPEC"))
            root.set_attribute("llmgw.model", spec.name)
            t0 = time.monotonic()
            with tracer.start_as_current_span("llmgw.model_job.weights") as span:
                result = ensure_weights(spec.name, spec.weights, weights)
                span.set_attribute("llmgw.weights.fetched", result.fetched)
                span.set_attribute("llmgw.weights.bytes", result.bytes)
                span.set_attribute("llmgw.weights.method", result.method)
            elapsed = time.monotonic() - t0
        except LlmgwError as err:
            root.set_status(Status(StatusCode.ERROR, str(err)[:500]))
            raise
        path = trace_marker_path(weights.cache_dir, spec.name, spec.weights)
        if result.fetched and path is not None:
            write_trace_marker(path, root.get_span_context())
    return result, spec, elapsed


if __name__ == "__main__":
    main()
