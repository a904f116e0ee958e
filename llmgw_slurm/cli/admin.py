"""``llmgw-admin``: what an HPC admin runs (the daemon, status, audits, keys)."""

from __future__ import annotations

import dataclasses
import getpass
import logging
import os
import re
import ssl
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import click

from llmgw_slurm import __version__
from llmgw_slurm.accounting.audit import AuditRow, Period
from llmgw_slurm.accounting.audit_owner import OwnerKind
from llmgw_slurm.base.durations import format_duration
from llmgw_slurm.base.errors import SlurmError
from llmgw_slurm.cli.common import (
    DaemonReply,
    call_daemon,
    friendly_errors,
    parse_when,
    print_json,
    run,
    table,
    unknown_model,
)
from llmgw_slurm.cli.settings import base_url
from llmgw_slurm.config import ClusterConfig, HostPort, ServerConfig
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import AccountingRecord, NodeInfo, SlurmBackend

DEFAULT_SERVER = "/etc/llmgw-slurm/server.yaml"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-admin")
def main() -> None:
    """Run and operate the llmgw-slurm gateway.

    \b
    Most commands read the daemon's server.yaml: --server, or env
    LLMGW_SERVER_CONFIG (default /etc/llmgw-slurm/server.yaml).
    Scripts: --json on every command that prints data; ids alone on
    stdout; exit 0 ok, 1 failed, 2 usage error, 130 Ctrl-C.

    \b
    Examples:
      export LLMGW_SERVER_CONFIG=/etc/llmgw-slurm/server.yaml
      llmgw-admin status
      llmgw-admin drain --node gpunode3 --reason maintenance
      llmgw-admin usage --by account --since 7d --json | jq .totals
    """


def _gpu_text(node: NodeInfo) -> str:
    if not node.gpus:
        return "-"
    return ",".join(f"{g.type or 'gpu'}:{g.free}/{g.total}" for g in node.gpus)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for sinfo.",
)
@friendly_errors
def nodes(as_json: bool, timeout: float) -> None:
    """List the nodes with free/total GPUs per type.

    One sinfo call; reads SLURM_CONF as Slurm's own commands do.

    \b
    Examples:
      llmgw-admin nodes
      llmgw-admin nodes --json | jq -r '.[] | select(.gpus_free > 0) | .name'
    """
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
    default=DEFAULT_SERVER,
    show_default=True,
    help="server.yaml (env LLMGW_SERVER_CONFIG).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@friendly_errors
def serve(server_path: Path, log_level: str) -> None:
    """Run the daemon (under systemd: llmgw-slurm.service).

    The reconciler, the gateway and the internal API in one process; SIGHUP
    reloads the catalog.

    \b
    Example:
      llmgw-admin serve --server /etc/llmgw-slurm/server.yaml --log-level DEBUG
    """
    from llmgw_slurm import daemon
    from llmgw_slurm.base.sdnotify import log_handler
    from llmgw_slurm.config import load_server_config

    # Without a timestamp under systemd: the journal stamps each line itself.
    logging.basicConfig(level=log_level.upper(), handlers=[log_handler(sys.stderr)])
    server = load_server_config(server_path)
    d = daemon.build(server, server_path)
    daemon.run(d)


@main.group()
def config() -> None:
    """Check the configuration files.

    \b
    Example:
      llmgw-admin config check
    """


@config.command("check")
@click.option("--models", type=click.Path(dir_okay=False, path_type=Path), help="models.yaml")
@click.option(
    "--server",
    type=click.Path(dir_okay=False, path_type=Path),
    help="server.yaml (env LLMGW_SERVER_CONFIG; with no file given, that or "
    f"{DEFAULT_SERVER})",
)
@click.option("--agent", type=click.Path(dir_okay=False, path_type=Path), help="agent.yaml")
def config_check(models: Path | None, server: Path | None, agent: Path | None) -> None:
    """Validate config files; start nothing, ask no Slurm.

    Every problem of every file is reported, each as file:line: field: message.
    With --server alone, the models and agent files it names are checked too.
    With no file given: the server.yaml every other command reads
    (LLMGW_SERVER_CONFIG, else the default), and the files it names.

    \b
    Examples:
      llmgw-admin config check
      llmgw-admin config check --models new-models.yaml
    """
    from llmgw_slurm.base.errors import ConfigError
    from llmgw_slurm.config import check_files, load_server_config

    if models is None and server is None and agent is None:
        server = _default_server_path()
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


# ---- the running daemon: status, drain, stop, reload ---------------------------------

_server_option = click.option(
    "--server",
    "server_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_SERVER_CONFIG",
    default=DEFAULT_SERVER,
    show_default=True,
    help="The daemon's server.yaml (env LLMGW_SERVER_CONFIG).",
)


def _default_server_path() -> Path:
    """The server.yaml of the commands that take ``--server``, when none is given."""
    import os

    path = Path(os.environ.get("LLMGW_SERVER_CONFIG") or DEFAULT_SERVER)
    if not path.exists():
        raise click.UsageError(
            f"no file to check: {path} does not exist; give --server, --models or --agent "
            "(or set LLMGW_SERVER_CONFIG)"
        )
    return path


def _load_server(path: Path) -> ServerConfig:
    from llmgw_slurm.config import load_server_config

    if not path.exists():
        raise click.ClickException(
            f"{path} does not exist: give the daemon's server.yaml with --server "
            "(or LLMGW_SERVER_CONFIG)"
        )
    return load_server_config(path)


def _local_url(hp: HostPort) -> str:
    # A wildcard listener is reached on loopback from the daemon's own host.
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(hp.host, hp.host)  # noqa: S104
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{hp.port}"


def _token_path(server: ServerConfig) -> Path:
    return Path(server.state_dir).expanduser() / "admin.token"


def _admin_token(server: ServerConfig) -> str:
    from llmgw_slurm.auth.secrets import read_admin_token

    path = _token_path(server)
    try:
        token = read_admin_token(path)
    except FileNotFoundError:
        raise click.ClickException(
            f"no admin token at {path}: has the daemon run with this server.yaml?"
        ) from None
    except PermissionError:
        raise click.ClickException(
            f"cannot read {path} (permission denied): run this as the daemon's user, "
            "e.g. sudo -u llmgw llmgw-admin ..."
        ) from None
    if not token:
        raise click.ClickException(f"{path} is empty: run llmgw-admin token rotate")
    return token


def _daemon_uid(server: ServerConfig) -> int:
    """The daemon's uid: the owner of its state directory (another user's folder is refused)."""
    path = Path(server.state_dir).expanduser()
    try:
        return path.stat().st_uid
    except OSError as exc:
        raise click.ClickException(
            f"cannot look at state_dir {path} ({exc.strerror}): has the daemon run with "
            "this server.yaml?"
        ) from None


def _admin_sockets(server: ServerConfig) -> list[Path]:
    from llmgw_slurm.auth.identity import DEFAULT_INFO

    paths = [server.effective_admin_socket()]
    if server.runtime_dir is None and server.admin_socket is None:
        # Under the shipped unit the daemon's runtime_dir is systemd's RuntimeDirectory,
        # which this process is not told.
        paths.append(DEFAULT_INFO.parent / "admin.sock")
    return paths


def _admin_call(server: ServerConfig, action: str, body: object = None) -> DaemonReply:
    reply = _admin_request(server, action, body)
    if not reply.ok:
        raise click.ClickException(reply.error_message())
    return reply


def _admin_request(server: ServerConfig, action: str, body: object = None) -> DaemonReply:
    """One admin API call; an error answer is returned, except a refused token or caller.

    Over the admin socket when there is one, else the internal port. Either
    way the server proves it is the daemon before anything is sent: the
    socket's peer uid, or (over TCP, with the token) the uid that owns the
    listening port on this host.
    """
    import stat as stat_

    from llmgw_slurm.auth.identity import check_listener
    from llmgw_slurm.base.errors import UnverifiedServerError

    uid = _daemon_uid(server)
    payload = body if body is not None else {}
    for path in _admin_sockets(server):
        try:
            is_socket = stat_.S_ISSOCK(path.stat().st_mode)
        except OSError:
            continue
        if is_socket:
            return _refused(unix_call(path, f"/internal/v1/admin/{action}", payload, uid), path)
    url = _local_url(server.listen.internal)
    port = server.listen.internal.port
    try:
        if server.listen.internal.host not in ("0.0.0.0", "", "::", "127.0.0.1", "::1"):  # noqa: S104
            raise UnverifiedServerError(
                f"the internal port listens on {server.listen.internal.host}, not on this "
                "host's loopback, where its owner could be checked"
            )
        check_listener(port, uid)
    except UnverifiedServerError as exc:
        raise click.ClickException(
            f"refusing to send the admin token to {url}: {exc}. The admin socket "
            f"({_admin_sockets(server)[0]}) is not there either: is the daemon running?"
        ) from None
    reply: DaemonReply = run(
        call_daemon(
            "POST",
            url,
            f"/internal/v1/admin/{action}",
            token=_admin_token(server),
            body=payload,
            timeout=60.0,
            what="the llmgw daemon's internal API",
        )
    )
    if reply.status == 401:
        raise click.ClickException(
            f"the daemon at {url} refused the admin token: is it running with this "
            "server.yaml and state_dir? (a rotated token is read from state_dir/admin.token)"
        )
    return _refused(reply, url)


def _refused(reply: DaemonReply, where: object) -> DaemonReply:
    if reply.status == 403:
        raise click.ClickException(f"{where}: {reply.error_message()}")
    return reply


def unix_call(path: Path, url_path: str, body: object, uid: int) -> DaemonReply:
    """POST ``body`` to the daemon over its admin socket, once its peer is known to be ``uid``."""
    import http.client
    import json

    from llmgw_slurm.auth.identity import connect_unix, peer_credentials

    try:
        sock = connect_unix(path, timeout=60.0)
    except OSError as exc:
        raise click.ClickException(
            f"cannot reach the llmgw daemon at {path}: {exc.strerror or exc}"
        ) from None
    try:
        pid, peer, _ = peer_credentials(sock)
        if peer not in (0, uid):
            raise click.ClickException(
                f"refusing to talk to {path}: it is served by uid {peer} (pid {pid}), not by "
                f"the daemon's user (uid {uid}, the owner of state_dir)"
            )
        conn = http.client.HTTPConnection("llmgw-daemon")
        conn.sock = sock  # connected and checked: http.client does not connect again
        data = json.dumps(body).encode()
        try:
            conn.request("POST", url_path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            raise click.ClickException(
                f"the llmgw daemon at {path} did not answer: {exc}"
            ) from None
        try:
            return DaemonReply(resp.status, json.loads(text) if text else None)
        except ValueError:
            raise click.ClickException(
                f"{path} answered {resp.status} with something not JSON"
            ) from None
    finally:
        sock.close()


@main.command()
@_server_option
@click.option(
    "--url",
    envvar="LLMGW_URL",
    metavar="URL",
    help="The gateway to ask instead of the one server.yaml names (env LLMGW_URL; "
    "used when neither --server nor LLMGW_SERVER_CONFIG is given).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's status JSON.")
@click.option("--decisions", default=15, show_default=True, help="How many recent decisions.")
@click.pass_context
@friendly_errors
def status(
    ctx: click.Context, server_path: Path, url: str | None, as_json: bool, decisions: int
) -> None:
    """Show models, replicas, jobs, nodes and decisions.

    Recent decisions come with their reasons (where Slurm ran each job
    included). The status API needs no admin token: with LLMGW_URL set (as a
    researcher has it), no server.yaml is needed. --json: the daemon's status
    as it serves it (models with state, ready_replicas and reason apart).

    \b
    Examples:
      llmgw-admin status
      llmgw-admin status --json | jq -r '.models[] | "\\(.name) \\(.state)"'
      llmgw-admin status --json | jq '.decisions[-5:]'
    """
    server: ServerConfig | None = None
    explicit = ctx.get_parameter_source("server_path") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    )
    if url and not explicit:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(
                f"{url!r} must start with http:// or https://", param_hint="'--url' / LLMGW_URL"
            )
        url = base_url(url)
    else:
        server = _load_server(server_path)
        url = _local_url(server.listen.gateway)
        if server.tls.enabled:
            url = "https" + url[len("http") :]
    reply: DaemonReply = run(call_daemon("GET", url, "/api/v1/status", ssl=_proven(url, server)))
    if not reply.ok or not isinstance(reply.data, dict):
        raise click.ClickException(f"{url}: status request failed: {reply.error_message()}")
    st: dict[str, Any] = reply.data
    if as_json:
        print_json(st)
        return
    click.echo(f"daemon {url} · version {st.get('version', '?')} · {st.get('passes')} passes")
    if st.get("last_pass_error"):
        click.echo(f"WARNING: the last pass could not ask Slurm: {st['last_pass_error']}")
    now = float(st.get("now") or time.time())
    if st.get("peers"):
        _print_peers(st["peers"], now)
    models = st.get("models") or []
    _print_clusters(st.get("clusters") or [])
    _print_models(models)
    _print_replicas(models)
    _print_service_jobs(st.get("jobs") or [])
    _print_nodes(st.get("nodes") or [], st.get("nodes_listed_at"), now)
    _print_decisions((st.get("decisions") or [])[-decisions:] if decisions > 0 else [], now)


def _proven(url: str, server: ServerConfig | None) -> ssl.SSLContext | None:
    """How to reach ``url`` so that only the daemon can answer (the ``ssl`` of
    call_daemon); a ClickException, saying why and what to do, when nothing can prove it.

    While the daemon is down anyone may listen on its port, and a status shown
    from there would be theirs. As ``llmgw`` checks before it sends a key: over
    https the certificate (server.yaml's own, pinned, when this runs on the
    daemon's host: it names the login node, not 127.0.0.1; else the system's CAs
    or LLMGW_CA_FILE); over plain http only a loopback port, whose owner must
    be the daemon's uid in daemon.json (llmgw_slurm/auth/identity.py).
    """
    from llmgw_slurm.auth.identity import DEFAULT_INFO, verify_url
    from llmgw_slurm.base.errors import UnverifiedServerError

    if url.startswith("https://"):
        if server is not None and server.tls.cert is not None:
            try:
                ctx = ssl.create_default_context(cafile=str(server.tls.cert))
            except (OSError, ssl.SSLError) as exc:
                raise click.ClickException(
                    f"cannot read the gateway's certificate {server.tls.cert} to check "
                    f"{url} with: {exc}"
                ) from None
            ctx.check_hostname = False  # pinned: this very certificate, whatever its name
            return ctx
        ca_file = os.environ.get("LLMGW_CA_FILE")
        return ssl.create_default_context(cafile=ca_file) if ca_file else None
    info = Path(os.environ.get("LLMGW_DAEMON_INFO") or DEFAULT_INFO)
    if server is not None and not os.environ.get("LLMGW_DAEMON_INFO"):
        mine = server.effective_runtime_dir() / "daemon.json"
        info = mine if mine.exists() else info
    try:
        verify_url(url, info, "the status request")
    except UnverifiedServerError as exc:
        raise click.ClickException(
            f"{exc}. Not showing a status that may not be the daemon's."
        ) from None
    return None
def _print_clusters(clusters: list[dict[str, Any]]) -> None:
    """Each cluster's health, GPUs and replicas; nothing for one cluster without a name
    (its health is the daemon's: the warning above)."""
    if not any(c.get("name") for c in clusters):
        return
    click.echo()
    click.echo(
        table(
            ("CLUSTER", "HEALTH", "GPUS FREE/TOTAL", "REPLICAS"),
            [
                (
                    c.get("name"),
                    c.get("health_text") or c.get("health"),
                    f"{c.get('gpus_free')}/{c.get('gpus_total')}",
                    ", ".join(f"{n} {k}" for k, n in sorted((c.get("replicas") or {}).items()))
                    or "-",
                )
                for c in clusters
            ],
        )
    )


def _print_peers(c: dict[str, Any], now: float) -> None:
    """Several daemons on one database: who leads (epoch, since when), every daemon's
    last contact with the database."""
    since = c.get("leader_since")
    ago = f", since {_age(now - since)} ago" if isinstance(since, int | float) else ""
    leader = c.get("leader") or "none"
    click.echo(f"leader: {leader} (epoch {c.get('epoch')}{ago}); this daemon: {c.get('this')}")
    if c.get("last_error"):
        click.echo(f"WARNING: the database: {c['last_error']}")
    rows = []
    for d in c.get("daemons") or []:
        seen = d.get("last_seen")
        state = "stopped" if d.get("stopped_at") else ("leads" if d["name"] == leader else "")
        rows.append(
            (
                d["name"],
                d.get("host", ""),
                d.get("gateway_url", ""),
                _age(now - seen) + " ago" if isinstance(seen, int | float) else "-",
                state,
            )
        )
    if rows:
        click.echo(table(("DAEMON", "HOST", "GATEWAY", "DATABASE CONTACT", ""), rows))
    click.echo()


def _age(seconds: float) -> str:
    s = max(0.0, seconds)
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _print_models(models: list[dict[str, Any]]) -> None:
    click.echo()
    click.echo(
        table(
            ("MODEL", "STATE", "GPUS", "MIN-MAX", "REPLICAS"),
            [
                (
                    m.get("name"),
                    m.get("state_text") or m.get("state"),
                    m.get("gpus"),
                    f"{m.get('min')}-{m.get('max')}",
                    len(m.get("replicas") or []),
                )
                for m in models
            ],
        )
    )
    for m in models:
        if m.get("note"):
            click.echo(f"  {m['name']}: {m['note']}")


def _print_replicas(models: list[dict[str, Any]]) -> None:
    reps = [(m, r) for m in models for r in (m.get("replicas") or [])]
    click.echo()
    if not reps:
        click.echo("no replicas")
        return
    named = any(r.get("cluster") for _, r in reps)
    click.echo(
        table(
            ("REPLICA", "MODEL", "JOB", "STATE", "NODES", "STEP / REASON", "IDLE"),
            [
                (
                    r.get("id"),
                    m.get("name"),
                    f"{r.get('job_id')}@{r.get('cluster')}" if named else r.get("job_id"),
                    r.get("state"),
                    ",".join(r.get("nodes") or []) or "-",
                    r.get("reason") if r.get("state") == "pending" else r.get("step") or "-",
                    "-" if r.get("idle_s") is None else format_duration(float(r["idle_s"])),
                )
                for m, r in reps
            ],
        )
    )


def _print_nodes(nodes: list[dict[str, Any]], listed: object, now: float) -> None:
    if not nodes:
        return
    click.echo()
    if isinstance(listed, int | float):
        counted = any(n.get("gpus_placed_since_listing") for n in nodes)
        click.echo(
            f"nodes as Slurm listed them {format_duration(now - listed)} ago"
            + (", GPUs of the replicas started since counted in:" if counted else ":")
        )
    click.echo(
        table(
            ("NODE", "STATE", "PARTITIONS", "GPUS FREE/TOTAL"),
            [
                (
                    f"{n.get('cluster')}:{n.get('name')}" if n.get("cluster") else n.get("name"),
                    n.get("state"),
                    ",".join(n.get("partitions") or []),
                    f"{n.get('gpus_free')}/{n.get('gpus_total')}",
                )
                for n in nodes
            ],
        )
    )


def _print_decisions(ds: list[dict[str, Any]], now: float) -> None:
    if not ds:
        return
    click.echo("\nrecent decisions (newest last):")
    # Lines, not a table: a reason quotes Slurm and is worth reading whole.
    for d in ds:
        ago = format_duration(now - float(d.get("at") or now))
        rid = f" {d['replica']}" if d.get("replica") else ""
        click.echo(f"{ago:>7} ago  {d.get('action')} {d.get('model')}{rid}: {d.get('reason')}")


def _print_service_jobs(jobs: list[dict[str, Any]]) -> None:
    """Model jobs and engine installs: queued, running, and those that ended within the hour."""
    if not jobs:
        return
    click.echo()
    click.echo(
        table(
            ("JOB", "KIND", "TARGET", "STATE", "ELAPSED", "REASON"),
            [
                (
                    j.get("job_id"),
                    j.get("kind"),
                    j.get("target"),
                    j.get("state"),
                    "-" if j.get("elapsed_s") is None else format_duration(float(j["elapsed_s"])),
                    j.get("reason") if j.get("reason") not in (None, "", "None") else "-",
                )
                for j in jobs
            ],
        )
    )
    # Lines, not a column: the last line of a job's log is its cause, worth reading whole.
    for j in jobs:
        if j.get("ended_at") and j.get("message"):
            click.echo(
                f"  job {j.get('job_id')} ({j.get('kind')} {j.get('target')}): {j['message']}"
            )


def _target_body(target: str | None, node: str | None, reason: str | None) -> dict[str, str]:
    if bool(target) == bool(node):
        raise click.UsageError("give a REPLICA or MODEL, or --node NODE (one of them)")
    return {"target": target or "", "node": node or "", "reason": reason or ""}


def _said(what: str, target: str | None, node: str | None, ids: list[str]) -> str:
    where = f"node {node}" if node else str(target)
    if not ids:
        return f"nothing to {what} on {where}: no live replica there"
    doing = {"stop": "stopping"}.get(what, what + "ing")
    return f"{doing} {len(ids)} replica(s) of {where}: {', '.join(ids)}"


_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def _said_json(what: str, target: str | None, node: str | None, ids: list[str]) -> None:
    print_json({"action": what, "target": target, "node": node, "replicas": ids})


@main.command()
@click.argument("target", required=False, metavar="REPLICA|MODEL")
@click.option("--node", help="Drain every replica on this node.")
@click.option("--reason", help="Recorded with the decision.")
@_server_option
@_json_option
@friendly_errors
def drain(
    target: str | None, node: str | None, reason: str | None, server_path: Path, as_json: bool
) -> None:
    """Stop routing to replicas; cancel each once idle.

    Each replica gets no new requests and is cancelled once its requests
    finish. A model whose min is above what is left gets new replicas: a
    drain moves replicas (off a node, say), it does not take a model down.

    \b
    Examples:
      llmgw-admin drain tiny
      llmgw-admin drain --node gpunode3 --reason "maintenance 12:00"
      llmgw-admin drain tiny --json | jq -r '.replicas[]'
    """
    body = _target_body(target, node, reason)
    reply = _admin_call(_load_server(server_path), "drain", body)
    ids = list(reply.data.get("replicas") or [])
    if as_json:
        _said_json("drain", target, node, ids)
        return
    click.echo(_said("drain", target, node, ids))


@main.command()
@click.argument("target", required=False, metavar="REPLICA|MODEL")
@click.option("--node", help="Stop every replica on this node.")
@click.option("--reason", help="Recorded with the decision.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask: requests in flight fail.")
@_server_option
@_json_option
@friendly_errors
def stop(
    target: str | None,
    node: str | None,
    reason: str | None,
    yes: bool,
    server_path: Path,
    as_json: bool,
) -> None:
    """Cancel replicas now (scancel); `drain` is gentler.

    Requests in flight fail. It asks first, on a terminal; from a script
    (standard input not a terminal) give --yes.

    \b
    Examples:
      llmgw-admin stop tiny
      llmgw-admin stop --node gpunode3 --yes --reason "node failing"
    """
    body = _target_body(target, node, reason)
    server = _load_server(server_path)
    if not yes:
        # Checked before asking: a typo is told at once, not after a "yes".
        ids = _stop_preview(server, body)
        if ids == []:
            if as_json:
                _said_json("stop", target, node, ids)
            else:
                click.echo(_said("stop", target, node, ids))
            return
        _confirm_stop(target, node, ids)
    reply = _admin_call(server, "stop", body)
    ids = list(reply.data.get("replicas") or [])
    if as_json:
        _said_json("stop", target, node, ids)
        return
    click.echo(_said("stop", target, node, ids))


def _confirm_stop(target: str | None, node: str | None, ids: list[str] | None) -> None:
    """Ask; no answer (standard input at its end: a script, ``</dev/null``) and a "no"
    both stop nothing, and say that --yes is how a script stops without asking."""
    which = f" ({', '.join(ids)})" if ids else ""
    what = f"the replicas of {target or 'node ' + str(node)}{which}"
    try:
        yes = click.confirm(f"Cancel {what} now, in-flight requests failing?")
    except click.Abort:
        raise click.ClickException(
            f"nothing stopped: no answer to the question on standard input; add --yes "
            f"to cancel {what} without asking"
        ) from None
    if not yes:
        raise click.ClickException("nothing stopped (add --yes to skip the question)")


def _stop_preview(server: ServerConfig, body: dict[str, str]) -> list[str] | None:
    """The replicas a stop would cancel; None when the daemon is too old to say.

    Raises ClickException for a target or node the daemon does not know.
    """
    reply = _admin_request(server, "stop-preview", body)
    err = reply.data.get("error") if isinstance(reply.data, dict) else None
    if reply.status == 404 and not (isinstance(err, dict) and err.get("code") == "not_found"):
        # A daemon older than the route: ask without the list, as before (the
        # stop itself then refuses an unknown target).
        return None
    if not reply.ok:
        raise click.ClickException(reply.error_message())
    return [str(x) for x in reply.data.get("replicas") or []]


@main.command()
@_server_option
@_json_option
@friendly_errors
def reload(server_path: Path, as_json: bool) -> None:
    """Re-read the catalog (models.yaml).

    A bad catalog is refused (with every problem, exit 1) and the running one
    kept; running replicas go on.

    \b
    Examples:
      llmgw-admin config check && llmgw-admin reload
      llmgw-admin reload --json | jq -r '.models[]'
    """
    reply = _admin_call(_load_server(server_path), "reload")
    names = list(reply.data.get("models") or [])
    if as_json:
        print_json({"models": names})
        return
    click.echo(f"catalog reloaded: {len(names)} model(s): {', '.join(names)}")


@main.group()
def token() -> None:
    """Rotate the internal port's admin token.

    The token is state_dir/admin.token.

    \b
    Example:
      sudo -u llmgw llmgw-admin token rotate
    """


@token.command("rotate")
@_server_option
@friendly_errors
def token_rotate(server_path: Path) -> None:
    """Replace the admin token; the old one is refused.

    The daemon reads the token file at every admin call over TCP, so this
    works whether it runs or not. llmgw-admin itself uses the admin socket
    when there is one, which needs no token.

    \b
    Example:
      sudo -u llmgw llmgw-admin token rotate
    """
    from llmgw_slurm.auth.secrets import rotate_admin_token

    server = _load_server(server_path)
    path = _token_path(server)
    if not path.parent.is_dir():
        raise click.ClickException(
            f"state_dir {path.parent} does not exist: has the daemon run with this server.yaml?"
        )
    try:
        rotate_admin_token(path)
    except PermissionError:
        raise click.ClickException(
            f"cannot write {path} (permission denied): run this as the daemon's user, "
            "e.g. sudo -u llmgw llmgw-admin token rotate"
        ) from None
    click.echo(f"admin token rotated ({path}): the old one is refused from now on")


# ---- audit ---------------------------------------------------------------------------

_DBD_DOWN = re.compile(
    r"slurmdbd|persist(ent)? conn|talking to the database|accounting_storage|"
    r"Connection refused|Unable to contact",
    re.IGNORECASE,
)


def _service_user(server: ServerConfig) -> str:
    # The daemon's user owns its state directory; the jobs are that user's.
    import pwd

    try:
        uid = Path(server.state_dir).expanduser().stat().st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError):
        return getpass.getuser()


@main.command()
@_server_option
@click.option("--since", default="30d", show_default=True, help="30m, 12h, 30d, 2w ago, or a date.")
@click.option("--until", "until_", default="now", show_default=True, help="Date, or now.")
@click.option(
    "--by",
    type=click.Choice(["day", "week", "month", "user", "account"]),
    default="day",
    show_default=True,
    help="A period (rows per model and period), or user/account (rows per user or Slurm "
    "account and model: batch jobs by their comment, online replicas apportioned by tokens).",
)
@click.option(
    "--user",
    help="Whose jobs (default: the owner of state_dir, i.e. the daemon's user). Other users' "
    "jobs with the same name prefix are not the service's and are left out.",
)
@click.option("--csv", "as_csv", is_flag=True, help="CSV for spreadsheets.")
@click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
@click.option("--chart", is_flag=True, help="Bar charts: GPU hours by model and by period.")
@click.option("--no-color", is_flag=True, help="Plain text (also when NO_COLOR is set).")
@friendly_errors
def audit(
    server_path: Path,
    since: str,
    until_: str,
    by: Period | OwnerKind,
    user: str | None,
    as_csv: bool,
    as_json: bool,
    chart: bool = False,
    no_color: bool = False,
) -> None:
    """GPU hours, jobs and failures per model, from sacct.

    Per model and period (day, week, month), or by user or Slurm account
    (batch jobs by their owner, online replicas apportioned by tokens).
    Counts failures, time-outs and preemptions too.

    \b
    Examples:
      llmgw-admin audit --since 7d
      llmgw-admin audit --by month --csv > gpu-hours.csv
      llmgw-admin audit --by account --json | jq .totals
    """
    from llmgw_slurm.accounting import audit as auditmod
    from llmgw_slurm.slurm import make_backends

    if as_csv and as_json:
        raise click.UsageError("--csv and --json exclude each other")
    server = _load_server(server_path)
    now_ts = time.time()
    now = datetime.fromtimestamp(now_ts)
    t0 = datetime.fromtimestamp(parse_when(since, now_ts))
    t1 = datetime.fromtimestamp(parse_when(until_, now_ts))
    if t0 >= t1:
        raise click.UsageError(f"--since ({t0:%Y-%m-%d %H:%M}) must be before --until")
    who = user or _service_user(server)
    # Every cluster's accounting (each its own sacct, or its -M through a shared slurmdbd).
    backends = make_backends(server.cluster_list, max(server.slurm.command_timeout, 60))
    prefix = server.slurm.job_prefix
    recs = _accounting(backends, t0, t1, prefix)
    recs = [r for r in recs if r.user == who]
    if by in ("user", "account"):
        _owner_audit(server, recs, (t0, t1, now), by, who, as_csv, as_json, chart, no_color)
        return
    assert by in ("day", "week", "month")
    rows = auditmod.aggregate(recs, prefix, t0, t1, by, now)
    if as_json:
        print_json(
            {
                "since": t0.isoformat(timespec="seconds"),
                "until": t1.isoformat(timespec="seconds"),
                "by": by,
                "user": who,
                "job_prefix": prefix,
                "rows": [dataclasses.asdict(r) for r in rows],
                "totals": auditmod.totals(rows),
            }
        )
        return
    if as_csv:
        click.echo(auditmod.to_csv(rows), nl=False)
        return
    click.echo(
        f"jobs of {who} named {prefix}* from {t0:%Y-%m-%d %H:%M} to {t1:%Y-%m-%d %H:%M}, by {by}"
    )
    if not rows:
        click.echo("no jobs")
        return
    if chart:
        from llmgw_slurm.cli import charts

        lines = charts.audit_chart(
            rows, by=by, cols=charts.width(), color=charts.use_color(no_color)
        )
        click.echo("\n".join(lines))
        return
    _print_audit(rows, auditmod.totals(rows))


def _owner_audit(
    server: ServerConfig,
    recs: Sequence[AccountingRecord],
    window: tuple[datetime, datetime, datetime],
    by: OwnerKind,
    who: str,
    as_csv: bool,
    as_json: bool,
    chart: bool,
    no_color: bool,
) -> None:
    from llmgw_slurm.cli import charts
    from llmgw_slurm.cli.admin_audit_owner import owner_audit
    from llmgw_slurm.cli.stores import usage_queries

    if as_csv:
        raise click.UsageError("--csv is for --by day|week|month; use --json with --by " + by)
    owner_audit(
        recs,
        prefix=server.slurm.job_prefix,
        usage=usage_queries(server),
        window=window,
        kind=by,
        header={
            "since": window[0].isoformat(timespec="seconds"),
            "until": window[1].isoformat(timespec="seconds"),
            "user": who,
            "job_prefix": server.slurm.job_prefix,
        },
        as_json=as_json,
        chart=chart,
        color=charts.use_color(no_color),
    )


def _accounting(
    backends: Mapping[str, SlurmBackend], t0: datetime, t1: datetime, prefix: str
) -> list[AccountingRecord]:
    """sacct's records of jobs named PREFIX* on every cluster, every user's; a clear error
    when a slurmdbd is down."""
    from llmgw_slurm.slurm import accounting_of

    try:
        # All users, then only the service's: a name prefix alone can be copied by anyone.
        # Every run of a requeued job: a preempted run's GPU hours and its preemption.
        return run(
            accounting_of(backends, t0, t1, name_prefix=prefix, all_users=True, duplicates=True)
        )
    except SlurmError as exc:
        detail = (exc.stderr.strip().splitlines() or [str(exc)])[-1]
        if _DBD_DOWN.search(exc.stderr or ""):
            raise click.ClickException(
                f"cannot reach accounting (slurmdbd): {detail} "
                "(sacct needs slurmdbd up and AccountingStorageType=accounting_storage/slurmdbd)"
            ) from None
        raise click.ClickException(f"sacct failed: {exc}") from None


def _print_audit(rows: Sequence[AuditRow], tot: Mapping[str, Any]) -> None:
    # A CLUSTER column only where there are named clusters.
    named = any(r.cluster for r in rows)
    head = ("PERIOD", "MODEL", *(("CLUSTER",) if named else ()))
    body = [
        (
            r.period,
            r.model,
            *((r.cluster,) if named else ()),
            r.jobs,
            f"{r.gpu_hours:.2f}",
            r.failed,
            r.timeout,
            r.preempted,
        )
        for r in rows
    ]
    total = (
        "total",
        "",
        *(("",) if named else ()),
        tot["jobs"],
        f"{tot['gpu_hours']:.2f}",
        tot["failed"],
        tot["timeout"],
        tot["preempted"],
    )
    click.echo(
        table((*head, "JOBS", "GPU HOURS", "FAILED", "TIMEOUT", "PREEMPTED"), [*body, total])
    )


# ---- keys ----------------------------------------------------------------------------


@main.group()
def keys() -> None:
    """Add, list and revoke gateway API keys.

    The keys live in router.keys_file of server.yaml (hashes only), or in the
    shared database with server.yaml's database: block (two login nodes).

    \b
    Examples:
      llmgw-admin keys add alice --account proj42
      llmgw-admin keys list --json | jq -r '.[] | select(.active) | .key_id'
      llmgw-admin keys revoke 0a1b2c3d
    """


_keys_file_option = click.option(
    "--keys-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The key file (default: router.keys_file of --server).",
)


def _key_store(
    server_path: Path, keys_file: Path | None, *, adding: bool = False, create: bool = False
) -> Any:
    """Where the keys are: the file given, else the shared database (database: in
    server.yaml), else router.keys_file. A key file must exist, but for ``adding`` to
    router.keys_file (or with ``create``): a mistyped path is an error, not "no keys"."""
    from llmgw_slurm.auth.keys import KeyFile

    if keys_file is None:
        server = _load_server(server_path)
        if server.database is not None:
            from llmgw_slurm.db.connect import make_conninfo
            from llmgw_slurm.db.keys import PgKeyStore

            return PgKeyStore(make_conninfo(server.database, "llmgw-admin"))
    if adding:
        return KeyFile(_new_keys_file(server_path, keys_file, create))
    return KeyFile(_existing_keys_file(server_path, keys_file))


def _server_keys_file(server_path: Path) -> Path:
    server = _load_server(server_path)
    if server.router.keys_file is None:
        raise click.ClickException(
            f"{server_path} has no router.keys_file: keys are off (anyone who reaches the "
            "gateway may use it); set router.keys_file to turn them on"
        )
    return Path(server.router.keys_file)


def _existing_keys_file(server_path: Path, keys_file: Path | None) -> Path:
    """The key file to read: a path that does not exist is a typo, not "no keys"."""
    path = keys_file if keys_file is not None else _server_keys_file(server_path)
    if not path.exists():
        where = "--keys-file" if keys_file is not None else f"router.keys_file of {server_path}"
        raise click.ClickException(
            f"no key file at {path} (from {where}): check the path; "
            "`llmgw-admin keys add` makes the server's first key there"
        )
    return path


def _new_keys_file(server_path: Path, keys_file: Path | None, create: bool) -> Path:
    """The key file to add to. It is made only where the daemon reads keys (router.keys_file)
    or with --create: a mistyped --keys-file must not start a file the gateway never reads."""
    path = keys_file if keys_file is not None else _server_keys_file(server_path)
    if path.exists():
        return path
    if not path.parent.is_dir():
        raise click.ClickException(f"cannot make {path}: the folder {path.parent} does not exist")
    if keys_file is not None and not create:
        raise click.ClickException(
            f"{path} does not exist: a typo? Give the daemon's router.keys_file, or add "
            "--create to start a new key file there"
        )
    click.echo(f"note: {path} did not exist; made it (mode 0600)", err=True)
    return path


def _valid_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from llmgw_slurm.auth.keys import check_name
    from llmgw_slurm.base.errors import LlmgwError

    if value or param.name == "user":
        try:
            check_name(str(param.name), str(value))
        except LlmgwError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def _account_of(account: str | None, project: str | None) -> str:
    if project is not None:
        click.echo(
            "note: --project is deprecated: it is the Slurm account; use --account", err=True
        )
        if account is not None and account != project:
            raise click.UsageError("--project (deprecated) and --account disagree; give --account")
    return account or project or ""


def _key_json(r: Any) -> dict[str, Any]:
    """A key record for --json: the account under its name (the file says project)."""
    d = dataclasses.asdict(r)
    d["account"] = d.pop("project")
    return d | {"active": r.active}


@keys.command("add")
@click.argument("user", callback=_valid_name)
@click.option(
    "--account", callback=_valid_name, help="The Slurm account its usage is charged to."
)
@click.option("--project", callback=_valid_name, hidden=True, help="Deprecated: --account.")
@_server_option
@_keys_file_option
@click.option("--create", is_flag=True, help="Make --keys-file if it does not exist.")
@_json_option
@friendly_errors
def keys_add(
    user: str,
    account: str | None,
    project: str | None,
    server_path: Path,
    keys_file: Path | None,
    create: bool,
    as_json: bool,
) -> None:
    """Make a key for USER; shown once.

    Only its hash is stored. Standard output gets the key alone (or, with
    --json, the record with the key), for a script to hand on.

    \b
    Examples:
      llmgw-admin keys add alice --account proj42
      KEY=$(llmgw-admin keys add alice)
      llmgw-admin keys add alice --json | jq -r .key
    """
    account = _account_of(account, project)
    new = _key_store(server_path, keys_file, adding=True, create=create).add(user, account)
    if as_json:
        print_json(_key_json(new.record) | {"key": new.key})
        return
    click.echo(
        f"key {new.record.key_id} for {user}" + (f" (account {account})" if account else ""),
        err=True,
    )
    click.echo(new.key)
    click.echo(
        "Shown once: the file keeps only its hash. Give it to the user, who sets "
        "LLMGW_API_KEY or api_key in ~/.config/llmgw/config.yaml.",
        err=True,
    )


@keys.command("list")
@_server_option
@_keys_file_option
@_json_option
@friendly_errors
def keys_list(server_path: Path, keys_file: Path | None, as_json: bool) -> None:
    """List every key (never the key itself).

    Id, user, account, created, revoked.

    \b
    Examples:
      llmgw-admin keys list
      llmgw-admin keys list --json | jq -r '.[] | select(.user == "alice") | .key_id'
    """
    recs = _key_store(server_path, keys_file).list()
    if as_json:
        print_json([_key_json(r) for r in recs])
        return
    if not recs:
        click.echo("no keys")
        return

    def day(ts: float | None) -> str:
        return "-" if ts is None else datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")

    click.echo(
        table(
            ("ID", "USER", "ACCOUNT", "CREATED", "REVOKED"),
            [(r.key_id, r.user, r.project or "-", day(r.created), day(r.revoked)) for r in recs],
        )
    )


@keys.command("revoke")
@click.argument("key_id")
@_server_option
@_keys_file_option
@friendly_errors
def keys_revoke(key_id: str, server_path: Path, keys_file: Path | None) -> None:
    """Revoke a key by its id.

    The gateway refuses it from the next request on.

    \b
    Example:
      llmgw-admin keys revoke 0a1b2c3d
    """
    rec = _key_store(server_path, keys_file).revoke(key_id)
    click.echo(f"key {rec.key_id} of {rec.user} revoked")


# ---- reviewing what would be submitted -----------------------------------------------

_MASKED = ("LLMGW_REPLICA_SECRET", "LLMGW_ENGINE_API_KEY")


def _resolve(catalog: Any, name: str) -> Any:
    """The catalog's model ``name`` (or alias); the unknown-model error as llmgw words it."""
    m = catalog.resolve(name)
    if m is None:
        aliases = [a for x in catalog.models for a in x.aliases]
        raise click.ClickException(unknown_model(name, list(catalog.names), also=aliases))
    return m


@main.command()
@click.argument("model")
@_server_option
@friendly_errors
def script(model: str, server_path: Path) -> None:
    """Print the sbatch a replica of MODEL would get.

    The sbatch command, its environment and the batch script. Nothing is
    submitted and Slurm is not asked. Secrets are masked; the replica id is a
    placeholder (each real replica gets its own).

    \b
    Example:
      llmgw-admin script tiny | less
    """
    import shlex
    import socket

    from llmgw_slurm.catalog import load_catalog
    from llmgw_slurm.reconciler.jobs import JobBuilder

    server = _load_server(server_path)
    catalog = load_catalog(server.models)
    m = _resolve(catalog, model)
    # The secrets derived from the key are masked below, so the real key is not read.
    key = b"0" * 64
    url = server.listen.advertised_daemon_url(socket.getfqdn())
    cert = "<the gateway's client certificate, from the state directory>"
    spec = JobBuilder(server, key, url, cert).spec(m, "0123abcd")
    click.echo("# sbatch command (the script goes on its standard input)")
    click.echo(
        shlex.join(["sbatch", "--parsable", f"--job-name={spec.name}", f"--comment={spec.comment}"])
    )
    click.echo("\n# added to the sbatch process's environment (exported to the job)")
    for k, v in sorted(spec.env.items()):
        shown = "***" if k in _MASKED else v
        click.echo(f"{k}={shlex.quote(shown)}")
    click.echo("\n# the batch script")
    click.echo(spec.script, nl=False)


# ---- model jobs and engine installs --------------------------------------------------

_wait_option = click.option(
    "--wait",
    is_flag=True,
    help="Follow the job to its end, printing its state; exit 1 unless it completes.",
)
_time_option = click.option(
    "--time",
    "time_limit",
    help="Slurm time limit (minutes, HH:MM:SS, D-HH:MM:SS); default the partition's.",
)


def _cluster_of(server: ServerConfig, name: str | None) -> ClusterConfig:
    """server.yaml's cluster ``name`` (default: the first); a usage error naming the others."""
    clusters = server.cluster_list
    if not name:
        return clusters[0]
    for c in clusters:
        if c.name == name:
            return c
    names = ", ".join(c.name for c in clusters if c.name) or "none: server.yaml has no clusters:"
    raise click.BadParameter(f"no cluster {name!r}; clusters: {names}", param_hint="'--cluster'")


_cluster_option = click.option(
    "--cluster",
    "cluster_name",
    metavar="NAME",
    help="The cluster (server.yaml's clusters) to run the job on; default the first. Each "
    "cluster has its own file systems: run it on each that needs it.",
)


def _svc_backend(server: ServerConfig, cluster: ClusterConfig | None = None) -> Any:
    from llmgw_slurm.slurm import make_backends

    where = cluster or server.cluster_list[0]
    return make_backends([where], max(server.slurm.command_timeout, 30))[where.name]


def _submit_service_job(
    server: ServerConfig,
    spec: Any,
    wait: bool,
    poll: float,
    as_json: bool = False,
    cluster: ClusterConfig | None = None,
) -> None:
    """Submit; the job id alone on standard output (as sbatch --parsable), the rest on
    standard error."""
    from llmgw_slurm.reconciler.svcjobs import job_log_path

    backend = _svc_backend(server, cluster)
    job_id: str = run(backend.submit(spec))
    log_path = job_log_path(server, spec.name, job_id)
    on = f" on cluster {cluster.name}" if cluster is not None and cluster.name else ""
    if as_json:
        out = {"job_id": job_id, "name": spec.name, "log": str(log_path)}
        if cluster is not None and cluster.name:
            out["cluster"] = cluster.name
        print_json(out)
    else:
        click.echo(job_id)
    click.echo(f"submitted job {job_id}{on} ({spec.name}); log: {log_path}", err=True)
    # The daemon lists the job in its next pass anyway; told now, it also shows
    # one that ends before that pass. Not running is fine: the job runs regardless.
    target = next((w[7:] for w in spec.comment.split() if w.startswith("target=")), "")
    try:
        body = {"job_id": job_id, "name": spec.name, "target": target}
        if cluster is not None and cluster.name:
            body["cluster"] = cluster.name
        _admin_call(server, "jobs", body)
    except click.ClickException as exc:
        click.echo(f"note: the daemon was not told ({exc.message})", err=True)
    if wait:
        run(_follow(server, backend, spec.name, job_id, poll))


async def _follow(server: ServerConfig, backend: Any, name: str, job_id: str, poll: float) -> None:
    """Print each state the job passes through; its final state comes from accounting.

    One ``squeue -u`` per poll (this user's jobs, the cheap listing), not a
    query per job; the daemon, if it runs, sees the same job in its own pass.
    """
    import asyncio

    from llmgw_slurm.base.errors import SlurmError
    from llmgw_slurm.reconciler.svcjobs import job_log_path, last_log_line
    from llmgw_slurm.slurm.types import JobState

    t0 = time.monotonic()
    last = ""
    submitted = datetime.now() - timedelta(minutes=5)
    final: JobState | None = None
    exit_code = ""
    while final is None:
        jobs = [j for j in await backend.list_jobs(name) if j.job_id == job_id]
        if jobs and not jobs[0].state.is_finished:
            j = jobs[0]
            where = f" on {','.join(j.nodes)}" if j.nodes else ""
            shown = f"{j.state.value}{where}" + (
                f" ({j.reason})" if j.reason and j.reason != "None" else ""
            )
            if shown != last:
                click.echo(f"{format_duration(time.monotonic() - t0):>6}  {shown}", err=True)
                last = shown
            await asyncio.sleep(poll)
            continue
        # Out of the listing: accounting has the end (slurmdbd may lag a moment).
        for _ in range(10):
            try:
                recs = await backend.accounting(submitted, name_prefix=name)
            except SlurmError as exc:
                raise click.ClickException(
                    f"job {job_id} left the queue; its final state is unknown: sacct failed: {exc}"
                ) from None
            rec = next((r for r in recs if r.job_id == job_id), None)
            if rec is not None and rec.state.is_finished:
                final, exit_code = rec.state, rec.exit_code
                break
            await asyncio.sleep(1.0)
        else:
            raise click.ClickException(
                f"job {job_id} left the queue but accounting has no end for it yet; "
                f"see {job_log_path(server, name, job_id)}"
            )
    line = last_log_line(job_log_path(server, name, job_id))
    click.echo(
        f"{format_duration(time.monotonic() - t0):>6}  {final.value}"
        + (f" (exit {exit_code})" if exit_code not in ("", "0:0") else ""),
        err=True,
    )
    if final is not JobState.COMPLETED:
        raise click.ClickException(f"job {job_id} {final.value}: {line or 'no output'}")
    if line:
        click.echo(line, err=True)


@main.command()
@click.argument("model")
@_server_option
@_time_option
@click.option(
    "--allow-download", is_flag=True, help="This job may download (hf) even if agent.yaml says no."
)
@_wait_option
@click.option("--poll", default=2.0, show_default=True, help="Seconds between looks with --wait.")
@_json_option
@_cluster_option
@friendly_errors
def fetch(
    model: str,
    server_path: Path,
    time_limit: str | None,
    allow_download: bool,
    wait: bool,
    poll: float,
    as_json: bool,
    cluster_name: str | None = None,
) -> None:
    """Fetch MODEL's weights in a Slurm job, ahead of use.

    Into the agent's cache (agent.yaml's weights.cache_dir, shared by the
    nodes). Run it as the daemon's user: the job is the service's, shown in
    `llmgw-admin status`. Standard output gets the job id alone; with --wait,
    its states go to standard error and the exit is 0 only if it completes.

    \b
    Examples:
      llmgw-admin fetch llama-8b --wait
      JOB=$(llmgw-admin fetch llama-8b --time 2:00:00)
    """
    from llmgw_slurm.catalog import load_catalog
    from llmgw_slurm.reconciler.svcjobs import ServiceJobBuilder

    server = _load_server(server_path)
    cluster = _cluster_of(server, cluster_name)
    catalog = load_catalog(server.models)
    m = _resolve(catalog, model)
    builder = ServiceJobBuilder(server, cluster=cluster)
    spec = builder.fetch(m, time=time_limit, allow_download=allow_download)
    _submit_service_job(server, spec, wait, poll, as_json, cluster)


@main.command("install-engine")
@click.argument("kind", type=click.Choice(["venv", "apptainer"]))
@click.argument("target")
@click.option("--package", "packages", multiple=True, help="A pip requirement (venv; repeatable).")
@click.option(
    "--pip-arg",
    "pip_args",
    multiple=True,
    help="An option for pip, e.g. --index-url=URL (repeatable).",
)
@click.option(
    "--system-site-packages", is_flag=True, help="The venv sees the interpreter's packages."
)
@click.option(
    "--image",
    "image_uri",
    default="",
    help="What to pull (apptainer), e.g. docker://vllm/vllm-openai:v0.6.3.",
)
@click.option("--apptainer", "apptainer_bin", default="apptainer", show_default=True)
@_server_option
@_time_option
@_wait_option
@click.option("--poll", default=2.0, show_default=True, help="Seconds between looks with --wait.")
@_json_option
@_cluster_option
@friendly_errors
def install_engine(
    kind: str,
    target: str,
    packages: tuple[str, ...],
    pip_args: tuple[str, ...],
    system_site_packages: bool,
    image_uri: str,
    apptainer_bin: str,
    server_path: Path,
    time_limit: str | None,
    wait: bool,
    poll: float,
    as_json: bool,
    cluster_name: str | None = None,
) -> None:
    """Install an engine at TARGET in a Slurm job.

    A venv, or an Apptainer image. TARGET is an absolute path the compute
    nodes see. Installing twice is safe: a lock serialises installs of one
    target, and a finished one is kept. Standard output gets the job id alone.

    \b
    Examples:
      llmgw-admin install-engine venv /opt/engines/vllm-0.6.3 --package vllm==0.6.3
      llmgw-admin install-engine apptainer /opt/images/vllm.sif \\
          --image docker://vllm/vllm-openai:v0.6.3 --wait
    """
    from llmgw_slurm.reconciler.svcjobs import ServiceJobBuilder

    if kind == "venv" and image_uri:
        raise click.UsageError("--image is for apptainer; a venv takes --package")
    if kind == "apptainer" and (packages or pip_args or system_site_packages):
        raise click.UsageError("--package/--pip-arg/--system-site-packages are for venv")
    if kind == "apptainer" and not image_uri:
        raise click.UsageError("apptainer needs --image URI")
    server = _load_server(server_path)
    cluster = _cluster_of(server, cluster_name)
    spec = ServiceJobBuilder(server, cluster=cluster).install(
        kind,
        target,
        packages=packages,
        pip_args=pip_args,
        system_site_packages=system_site_packages,
        image_uri=image_uri,
        apptainer=apptainer_bin,
        time=time_limit,
    )
    _submit_service_job(server, spec, wait, poll, as_json, cluster)


@main.command("trace")
@click.argument("target", metavar="MODEL|REPLICA|TRACE_ID")
@click.option("--json", "as_json", is_flag=True, help="The waterfall and its spans as JSON.")
@click.option("--no-color", is_flag=True, help="Plain text (also when NO_COLOR is set).")
@_server_option
@friendly_errors
def trace_cmd(target: str, as_json: bool, no_color: bool, server_path: Path) -> None:
    """Draw a replica's start as a waterfall.

    The pass, Slurm's queue, each agent step, serving: from the daemon's own
    recent traces (no collector needed), the newest start of MODEL or
    REPLICA, or the trace TRACE_ID.

    \b
    Examples:
      llmgw-admin trace tiny
      llmgw-admin trace tiny --json | jq '.spans | length'
    """
    from llmgw_slurm.cli import charts

    reply = _admin_call(_load_server(server_path), "trace", {"target": target})
    if as_json:
        print_json({k: reply.data[k] for k in ("waterfall", "spans", "store") if k in reply.data})
        return
    lines = charts.waterfall_lines(
        reply.data["waterfall"], cols=charts.width(), color=charts.use_color(no_color)
    )
    click.echo("\n".join(lines))


# quota and usage: in their own modules.
from llmgw_slurm.cli.admin_db import db_group  # noqa: E402
from llmgw_slurm.cli.admin_quota import quota_group  # noqa: E402
from llmgw_slurm.cli.admin_usage import usage_command  # noqa: E402

main.add_command(db_group(_server_option, _load_server))
main.add_command(quota_group(_server_option, _load_server))
main.add_command(usage_command(_server_option, _load_server))
