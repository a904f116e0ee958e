"""The daemon's ``server.yaml``, the agent's ``agent.yaml`` and their shared ``tracing:`` block.

Each file maps onto one frozen dataclass tree; a field's name is its YAML
key, its default is the default (with the reason in the comment above it),
and its ``rule(...)`` the validation. :func:`load_server_config` and
:func:`load_agent_config` report every problem of a file at once
(:class:`~llmgw_slurm.base.errors.ConfigErrors`), each naming file, line and
dotted field path. :func:`check_files` validates any subset of the three
files (catalog included) without touching Slurm; ``llmgw-admin config
check`` uses it.

Relative paths in a file are relative to that file's folder, and ``~`` is
expanded, so a config works the same whatever folder the daemon starts in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from llmgw_slurm.base import schema
from llmgw_slurm.base.errors import ConfigError, ConfigErrors, TemplateError
from llmgw_slurm.base.schema import Ctx, FrozenMap, Invalid, rule
from llmgw_slurm.base.yamlsrc import YNode, YScalar, YSeq, describe
from llmgw_slurm.catalog import CLUSTER_NAME_RE, load_catalog
from llmgw_slurm.sbatch import check_job_path

__all__ = [
    "AgentConfig",
    "AgentWeightsConfig",
    "ApptainerConfig",
    "BatchConfig",
    "ClusterConfig",
    "ConnectionsConfig",
    "DatabaseConfig",
    "DatabaseTlsConfig",
    "DrainConfig",
    "EngineRuntime",
    "EnginesConfig",
    "HostPort",
    "ListenConfig",
    "PortRange",
    "ReadinessConfig",
    "ReconcileConfig",
    "RendezvousConfig",
    "RestartConfig",
    "RouterConfig",
    "ServerConfig",
    "SiteScaling",
    "SlurmConfig",
    "SlurmRestConfig",
    "TlsConfig",
    "TracingConfig",
    "check_files",
    "load_agent_config",
    "load_server_config",
]

_ENV_NAME_RE = r"[A-Za-z_][A-Za-z0-9_]*"
_ENV_HELP = "an environment variable name (letters, digits, '_', not starting with a digit)"
_SLURM_NAME_RE = r"[A-Za-z0-9_.+-]{1,64}"
_SLURM_NAME_HELP = "a Slurm name: letters, digits, '_', '.', '+', '-'"


def _slurm_name() -> Any:
    """An optional Slurm name (an account, a QOS, a reservation): None by default."""
    return field(default=None, metadata=rule(pattern=_SLURM_NAME_RE, pattern_help=_SLURM_NAME_HELP))


def _slurm_names() -> Any:
    """An optional Slurm name or comma list of them (partitions): None by default."""
    pattern = rf"{_SLURM_NAME_RE}(,{_SLURM_NAME_RE})*"
    return field(default=None, metadata=rule(pattern=pattern, pattern_help=_SLURM_NAME_HELP))


_URL_HELP = "an http:// or https:// URL, e.g. http://login1:8001"


def _parse_url(node: YNode, ctx: Ctx) -> str:
    text = schema.scalar_text(node).strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as err:
        raise Invalid(f"{text!r} is not a valid URL ({err}); expected {_URL_HELP}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or " " in text:
        raise Invalid(f"{text!r} is not valid: expected {_URL_HELP}")
    return text


_URL = rule(parse=_parse_url)


# --------------------------------------------------------------------- tracing


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry export; the same block in server.yaml and agent.yaml."""

    # Default false: no exporter, no-op spans, and jobs get no TRACEPARENT.
    # Tracing is opt-in because it needs a collector to send to.
    enabled: bool = False
    # Default None: each process names itself (the daemon "llmgw-daemon", the
    # agent "llmgw-agent"), so one trace shows which side did what.
    service_name: str | None = field(
        default=None, metadata=rule(pattern=r"\S{1,200}", pattern_help="a name without spaces")
    )
    # Default None: the exporter's own default (OTEL_EXPORTER_OTLP_ENDPOINT,
    # else localhost). Set it when the collector is elsewhere.
    endpoint: str | None = field(default=None, metadata=_URL)
    # Default http/protobuf: the exporter installed with llmgw-slurm. grpc
    # needs opentelemetry-exporter-otlp-proto-grpc installed as well.
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    # Default {}: sent with every export (e.g. an API key for a hosted backend).
    headers: Mapping[str, str] = field(
        default_factory=FrozenMap,
        metadata=rule(key_pattern=r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,200}", key_help="a header name"),
    )
    # Default 1.0 (every trace): the daemon makes few traces (one per reconcile
    # pass that acts, one per replica start); lower it on very busy gateways.
    sampling_ratio: float = field(default=1.0, metadata=rule(ge=0, le=1))
    # Default {}: extra resource attributes (deployment.environment, cluster name...).
    resource_attributes: Mapping[str, str] = field(
        default_factory=FrozenMap,
        metadata=rule(key_pattern=r"[^\s\x00-\x1f]{1,200}", key_help="a name without spaces"),
    )
    # Default 20000: the daemon keeps this many recent spans in memory (its own
    # and its agents'), for llmgw-admin trace and the status page's start
    # waterfalls, with or without a collector; 0 keeps none (and, with enabled
    # false, jobs get no TRACEPARENT). Ignored in agent.yaml.
    keep_spans: int = field(default=20_000, metadata=rule(ge=0, le=1_000_000))


# ---------------------------------------------------------------------- server


@dataclass(frozen=True)
class HostPort:
    """An address to listen on."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_HOSTPORT_HELP = "HOST:PORT, e.g. 127.0.0.1:8000, 0.0.0.0:8001 or [::1]:8000"


def _parse_hostport(node: YNode, ctx: Ctx) -> HostPort:
    if not isinstance(node, YScalar) or not isinstance(node.value, str):
        raise Invalid(f"expected {_HOSTPORT_HELP}; got {describe(node)}")
    text = node.value.strip()
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})", text) or re.fullmatch(
        r"([A-Za-z0-9.-]+):(\d{1,5})", text
    )
    if not m:
        raise Invalid(f"cannot read {text!r}; expected {_HOSTPORT_HELP}")
    port = int(m.group(2))
    if port > 65535:
        raise Invalid(f"port {port} is out of range 0-65535")
    return HostPort(m.group(1), port)


@dataclass(frozen=True)
class SlurmRestConfig:
    """slurmrestd, for ``backend: rest`` (docs/slurm-backends.md)."""

    # Required with backend rest: slurmrestd's address, http(s)://HOST:PORT.
    url: str | None = field(default=None, metadata=_URL)
    # Default v0.0.44 (Slurm 25.11 to 27.11): the OpenAPI version spoken,
    # checked against the server at start. v0.0.43 for 25.05 to 27.05,
    # v0.0.42 for 24.11 to 26.11.
    version: Literal["v0.0.42", "v0.0.43", "v0.0.44"] = "v0.0.44"
    # A JWT someone else renews (what `scontrol token username=USER
    # lifespan=SECONDS` prints, rewritten by a timer), read again whenever
    # the file changes; mode 0600. Set this or jwt_key.
    token_file: Path | None = None
    # auth/jwt's HS256 key (slurm.conf's AuthAltParameters=jwt_key): the
    # daemon mints its own tokens and renews them. It can act as any user:
    # only the daemon's user may read it. Set this or token_file.
    jwt_key: Path | None = None
    # Default None: the token's user (token_file), else the daemon's user.
    # The Slurm user the service's jobs run as and are listed for.
    user: str | None = field(
        default=None,
        metadata=rule(pattern=r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}", pattern_help="a user name"),
    )
    # Default 1h: how long a token minted with jwt_key lives; a new one is
    # minted when a fifth of it is left.
    token_lifespan: float = field(default=3600.0, metadata=rule(ge=60, parse=schema.parse_duration))
    # Default None: the system's certificate authorities, for an https url.
    ca_file: Path | None = None

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.token_file is not None and self.jwt_key is not None:
            return [("jwt_key", "set token_file or jwt_key, not both")]
        return []

    def options(self) -> dict[str, Any]:
        """The rest backend's keyword arguments (besides its timeout)."""
        return {
            "url": self.url,
            "version": self.version,
            "token_file": self.token_file,
            "jwt_key": self.jwt_key,
            "user": self.user,
            "token_lifespan": self.token_lifespan,
            "ca_file": self.ca_file,
        }


@dataclass(frozen=True)
class SlurmConfig:
    """How the daemon talks to Slurm, and site defaults for job requests."""

    # Default cli: sbatch/squeue/scancel work on every Slurm from 22.05 on;
    # pyslurm builds against one Slurm release only and cannot submit hetjobs;
    # rest talks to slurmrestd over HTTP (no Slurm on the daemon's host).
    backend: Literal["cli", "pyslurm", "rest"] = "cli"
    # For backend rest: slurmrestd's address and the token (SlurmRestConfig).
    rest: SlurmRestConfig = field(default_factory=SlurmRestConfig)
    # Default None (Slurm's default partition): used for models that do not
    # set resources.partition.
    partition: str | None = _slurm_names()
    # Default None (the submitting user's default account).
    account: str | None = _slurm_name()
    # Default None (the association's default QOS).
    qos: str | None = _slurm_name()
    # Default None (no reservation): every job of the service (replicas, batches,
    # model jobs, engine installs) runs in this Slurm reservation (sbatch
    # --reservation). The plan counts free GPUs on every node of a model's
    # partitions, so the reservation should cover those nodes (docs/configuration.md).
    reservation: str | None = _slurm_name()
    # Default "llmgw.": job names are PREFIX + model + "." + replica id; the
    # daemon adopts every job of its user with this prefix, so two daemons
    # under one user need different prefixes.
    job_prefix: str = field(
        default="llmgw.",
        metadata=rule(
            pattern=r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}",
            pattern_help="1-32 characters: letters, digits, '.', '_', '-'",
        ),
    )
    # Default 30s: slurmctld under load can take many seconds to answer; past
    # this a command counts as failed (Slurm unavailable) and is retried.
    command_timeout: float = field(default=30.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 5s: one squeue for all of the daemon's jobs per poll; cheap, but
    # every user's squeue shares slurmctld.
    poll_interval: float = field(default=5.0, metadata=rule(gt=0, parse=schema.parse_duration))

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.backend != "rest":
            return []
        out: list[tuple[str, str]] = []
        if self.rest.url is None:
            out.append(("rest.url", "backend rest needs slurmrestd's url (http://HOST:PORT)"))
        if self.rest.token_file is None and self.rest.jwt_key is None:
            out.append(("rest", "backend rest needs token_file or jwt_key"))
        return out

    def backend_options(self, timeout: float | None = None) -> dict[str, Any]:
        """The keyword arguments of ``make_backend(self.backend, ...)``: one place
        that turns this block into a backend's options."""
        opts: dict[str, Any] = {"timeout": self.command_timeout if timeout is None else timeout}
        if self.backend == "rest":
            opts.update(self.rest.options())
        return opts


_CLUSTER_NAME_HELP = (
    "1-32 characters: lowercase letters, digits, '_', '-', starting with one of the first two"
)


@dataclass(frozen=True)
class ClusterConfig:
    """One Slurm cluster in ``clusters:``: how the daemon reaches it, and its job defaults.

    Every field but ``name`` defaults to the ``slurm:`` block's value (filled in
    when server.yaml is loaded), so a site lists only what differs per cluster.
    """

    # Required: the cluster's name to llmgw (job names end with -NAME; a model's
    # resources.clusters, status and audit name it). Need not be Slurm's ClusterName.
    name: str = field(metadata=rule(pattern=CLUSTER_NAME_RE, pattern_help=_CLUSTER_NAME_HELP))
    # Default None: the daemon's own SLURM_CONF (or Slurm's default path). The cluster's
    # slurm.conf as its clients use it (a copy on the login node, or a configless
    # stub naming its controller): its commands run with SLURM_CONF set to it.
    slurm_conf: Path | None = None
    # Default None: no -M. Slurm's ClusterName of a cluster that shares slurmdbd with
    # the one slurm_conf reaches (Slurm's multi-cluster mode): its commands run with
    # -M NAME. Every command then goes through slurmdbd to find the controller, so a
    # slurmdbd outage stops the daemon's view of this cluster: prefer slurm_conf.
    multi_cluster: str | None = _slurm_name()
    # Default None: slurm.backend. Each cluster has a backend of its own.
    backend: Literal["cli", "pyslurm", "rest"] | None = None
    # Default None: slurm.rest. For backend rest: this cluster's slurmrestd and token.
    rest: SlurmRestConfig | None = None
    # Default None: the commands on PATH. The folder of this cluster's sbatch, squeue,
    # ... (a cluster on another Slurm release needs its own).
    bin_dir: Path | None = None
    # Default None: slurm.partition. The partition (or comma list) for models that name none.
    partition: str | None = _slurm_names()
    # Default None: slurm.account.
    account: str | None = _slurm_name()
    # Default None: slurm.qos.
    qos: str | None = _slurm_name()
    # Default None: slurm.reservation. Reservations are a cluster's own.
    reservation: str | None = _slurm_name()

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.backend == "rest" and (self.slurm_conf or self.multi_cluster or self.bin_dir):
            given = [k for k in ("slurm_conf", "multi_cluster", "bin_dir") if getattr(self, k)]
            key = given[0]
            return [
                (
                    key,
                    "the rest backend reaches its cluster through slurmrestd (rest.url), not "
                    f"Slurm's commands: drop {key}, or use backend cli",
                )
            ]
        if self.backend == "pyslurm" and (self.slurm_conf or self.multi_cluster):
            key = "slurm_conf" if self.slurm_conf else "multi_cluster"
            return [
                (
                    key,
                    "the pyslurm backend reads the daemon's own SLURM_CONF (libslurm loads one "
                    f"configuration per process) and has no -M: drop {key}, or use backend cli",
                )
            ]
        return []

    @property
    def label(self) -> str:
        """Its name, or "default" for the one cluster of a server.yaml without ``clusters:``."""
        return self.name or "default"


@dataclass(frozen=True)
class ListenConfig:
    """Where the daemon listens, and how agents reach it."""

    # Default 127.0.0.1:8000: the OpenAI-compatible gateway. Only this host by
    # default; open it (0.0.0.0:8000) deliberately, with keys_file set.
    gateway: HostPort = field(
        default=HostPort("127.0.0.1", 8000),
        metadata=rule(parse=_parse_hostport),
    )
    # Default 0.0.0.0:8001: the internal API (agent registration, CLI status).
    # Agents run on compute nodes, so it must be reachable from them; every
    # agent call is authenticated with its replica's secret.
    internal: HostPort = field(
        default=HostPort("0.0.0.0", 8001),  # noqa: S104 - compute nodes must reach it
        metadata=rule(parse=_parse_hostport),
    )
    # Default None: http://<this host's FQDN>:<internal port>. Set it when
    # agents must use another name or a proxy to reach the daemon.
    daemon_url: str | None = field(default=None, metadata=_URL)

    def schema_problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.gateway.port != 0 and self.gateway.port == self.internal.port:
            out.append(("internal", f"the gateway already uses port {self.gateway.port}"))
        return out

    def advertised_daemon_url(self, hostname: str) -> str:
        """``daemon_url`` if set, else ``http://HOSTNAME:<internal port>``."""
        if self.daemon_url:
            return self.daemon_url.rstrip("/")
        return f"http://{hostname}:{self.internal.port}"


@dataclass(frozen=True)
class ConnectionsConfig:
    """``connections:``: how many connections each port takes, from whom, for how long.

    Every connection holds a file descriptor, and so does every Slurm command
    the daemon runs: unbounded, a flood of idle connections made the next
    ``squeue`` fail (EMFILE). The daemon raises its open-files limit to the
    hard limit at start and shares it out (docs/operations.md, Security).
    """

    # Default 256: connections one peer may hold on each port at once; past it
    # a new one is closed at once. A peer is a local user (its uid, which the
    # kernel tells for connections from this host: every local user is
    # 127.0.0.1) or a remote address.
    per_peer: int = field(default=256, metadata=rule(ge=1))
    # Default 10s: a connection that has not sent a whole request head this long
    # after it was accepted (or its TLS handshake began) is closed: an idle or
    # trickling client holds nothing for long. Clients send the head at once.
    head_timeout: float = field(default=10.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 512: open files never given to connections: Slurm commands' pipes,
    # the state files, engine connections. Half the limit at most.
    reserve_fds: int = field(default=512, metadata=rule(ge=64))
    # Default None: from the open-files limit (half of what the reserve leaves,
    # after the internal port's eighth: each request may hold a second
    # descriptor to its engine). Connections the gateway port holds at once;
    # past it the daemon stops accepting until one closes.
    max_gateway: int | None = field(default=None, metadata=rule(ge=16))
    # Default None: an eighth of what the reserve leaves. The same for the
    # internal port (agents' reports), apart from the gateway's so that a
    # flood there never stops a report.
    max_internal: int | None = field(default=None, metadata=rule(ge=16))


@dataclass(frozen=True)
class RestartConfig:
    """Backoff for replicas that failed, were preempted or lost their node."""

    # Default 30s: long enough for a transient node problem to clear, short
    # enough that a preempted replica comes back quickly.
    initial_backoff: float = field(default=30.0, metadata=rule(parse=schema.parse_duration))
    # Default 30m: the backoff doubles per failure up to this.
    max_backoff: float = field(default=1800.0, metadata=rule(parse=schema.parse_duration))
    # Default 5: after this many failed starts in a row the model is marked
    # failed and not retried until its config changes or an admin resets it;
    # a broken model must not keep a queue slot and GPUs busy.
    give_up_after_failures: int = field(default=5, metadata=rule(ge=1))
    # Default 10m: a replica that ends sooner after becoming ready is a failed
    # start (an engine that dies at its first requests is a crash loop, not a
    # start that worked), and one that has served this long clears its model's
    # failed starts. Apart from min_lifetime, a hold-down for other models.
    healthy_after: float = field(default=600.0, metadata=rule(gt=0, parse=schema.parse_duration))

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.initial_backoff > self.max_backoff:
            return [
                (
                    "initial_backoff",
                    f"initial_backoff ({self.initial_backoff:g}s) is more than max_backoff "
                    f"({self.max_backoff:g}s)",
                )
            ]
        return []


@dataclass(frozen=True)
class ReconcileConfig:
    """The reconcile loop's timing and its eviction/renewal rules."""

    # Default 10s: how often a pass runs (also after any agent report).
    interval: float = field(default=10.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 1m: the longest a pass plans with an earlier pass's node listing (one
    # sinfo); a pass about to place or evict lists the nodes afresh whatever its age.
    # Bounds how old status's node view and a queued model's note can be. 0: every pass.
    nodes_max_age: float = field(default=60.0, metadata=rule(ge=0, parse=schema.parse_duration))
    # Default 5m: a replica idle less than this is never evicted for another
    # model; a pause in a user's work must not cost them a cold start.
    eviction_grace: float = field(default=300.0, metadata=rule(parse=schema.parse_duration))
    # Default 2m: no replica is stopped for another model (evicted, or drained
    # for fair share) before it has served this long after becoming ready, so
    # two models that fit one at a time cannot take turns each pass. Eviction
    # also waits for eviction_grace of idleness; fair share for max_wait and
    # scaling.min_slice.
    min_lifetime: float = field(default=120.0, metadata=rule(parse=schema.parse_duration))
    # Default 30m: a replacement is started this long before a replica's time
    # limit; it must cover queue wait plus engine start.
    renewal_margin: float = field(default=1800.0, metadata=rule(parse=schema.parse_duration))
    # Default 2m: how long a draining replica may finish in-flight requests
    # before it is cancelled; long generations are cut after this.
    drain_timeout: float = field(default=120.0, metadata=rule(parse=schema.parse_duration))
    # Default 1h: a job pending longer is cancelled (with Slurm's reason) and, if
    # still needed, submitted again; not counted as a failed start. null waits forever.
    max_pending_time: float | None = field(
        default=3600.0, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default 2m: with several clusters, one whose controller has not answered for this
    # long is down: its replicas that are not serving are replaced on the other
    # clusters (and cancelled when it answers again, if still not needed). Slurm's own
    # SlurmctldTimeout (120 s by default) is how long a backup controller takes over;
    # shorter would replace replicas that a failover keeps.
    cluster_down_after: float = field(
        default=120.0, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default: see RestartConfig.
    restart: RestartConfig = field(default_factory=RestartConfig)


@dataclass(frozen=True)
class SiteScaling:
    """``scaling:``: how on-demand models share GPUs that are all taken (the fair-share
    rule, reconciler/plan.py's rule 4); a model's ``scaling.max_wait`` overrides the wait."""

    # Default true: a model whose held requests have waited max_wait may have a
    # replica of another on-demand model that has held its GPUs past its slice
    # drained for it (in-flight requests finish). false: a busy on-demand model
    # keeps its GPUs for as long as it stays busy, and the others' requests
    # wait for it to go idle.
    fair_share: bool = True
    # Default 2m: how long a model's oldest held request waits before fair share
    # may drain another model for it. Under router.hold_timeout (5m), so that
    # the drain and a start fit in the hold: the held request is answered, not
    # turned away with a 503.
    max_wait: float = field(default=120.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 2m: a turn on the GPUs; a replica is never drained for fair share
    # before it has served this long (nor before reconcile.min_lifetime). Each
    # turn costs the next model a start: longer slices spend less GPU time
    # loading and make a model that waits behind a busy one wait longer (10m
    # made the worst model's p95 wait 654 s on bench/eviction_site.py's peak
    # hours, 2m 245 s, for a fifth more GPU time loading).
    min_slice: float = field(default=120.0, metadata=rule(gt=0, parse=schema.parse_duration))


@dataclass(frozen=True)
class RouterConfig:
    """The OpenAI-compatible front end (the gateway takes this very object)."""

    # Default 5m: how long a request waits for its model to start before a 503
    # with Retry-After, unless the model sets its own. Shorter than the OpenAI
    # client's 10 min timeout, so the client sees our answer, not its own timeout.
    hold_timeout: float = field(default=300.0, metadata=rule(parse=schema.parse_duration))
    # Default 256: held requests of one model beyond this get 429; each holds a
    # connection (a coroutine each, but unbounded holding lets one runaway
    # client fill memory).
    max_held: int = field(default=256, metadata=rule(ge=0))
    # Default 1024: the same cap over all models together.
    max_held_total: int = field(default=1024, metadata=rule(ge=0))
    # Default None: a quarter of max_held (at least 1). Held requests of one
    # model per gateway key; beyond it that key gets 429, so that one key
    # cannot fill a cold model's queue. Applies only with keys_file set.
    max_held_per_key: int | None = field(default=None, metadata=rule(ge=1))
    # Default None: max_held_per_key. Held requests of one model per user, over all
    # their keys: one key each from `llmgw login` must not multiply a user's share.
    max_held_per_user: int | None = field(default=None, metadata=rule(ge=1))
    # Default None: half of max_held (at least 1). Held requests of one model per
    # Slurm account (the keys' account), over all its users: one group cannot
    # fill a cold model's queue and leave others no room.
    max_held_per_account: int | None = field(default=None, metadata=rule(ge=1))
    # Default 16M: request bodies beyond this get 413 (most before they are
    # read); a 128k-token prompt is about 0.5 MiB of text and a few base64
    # images fit too, and a runaway client cannot fill the login node's memory.
    max_body_bytes: int = field(
        default=16 * 1024 * 1024, metadata=rule(ge=1024, parse=schema.parse_size)
    )
    # Default 1G: multipart uploads (/v1/audio/*) beyond this get 413. They are
    # streamed to the engine as they arrive, never held whole, so this bounds
    # what one client can make an engine take, not the gateway's memory.
    max_upload_bytes: int = field(
        default=1024 * 1024 * 1024, metadata=rule(ge=1024, parse=schema.parse_size)
    )
    # Default 1m: the longest wait for a request body once its headers are in;
    # a client that trickles or stalls its body (slow loris) gets a 408 instead
    # of holding a connection and a handler forever. 16 MiB over a slow link fits.
    body_timeout: float = field(default=60.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 30 (seconds): the Retry-After of a 503 after the hold deadline.
    retry_after: int = field(default=30, metadata=rule(ge=0))
    # Default 5s: connecting to an engine on the cluster network takes
    # milliseconds; a node that does not answer in 5 s is treated as down.
    connect_timeout: float = field(default=5.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 10m: the longest silence between two chunks from an engine (a long
    # prompt's prefill on a busy engine can take minutes before the first token).
    read_timeout: float = field(default=600.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 0.5s: how often a held request checks whether its client went
    # away, when the server does not cancel handlers itself (the daemon does).
    disconnect_poll: float = field(default=0.5, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default None: no API keys, anyone who can reach the gateway may use it.
    # Otherwise the keys file `llmgw-admin keys` writes (versioned JSON with
    # one hashed record per key; see docs/configuration.md).
    keys_file: Path | None = None
    # Default true: a request whose replica could not be connected to (nothing
    # was sent to the client yet) is retried once on another replica, or held
    # for the replica's next run when it was the only one; never after a byte
    # was streamed. false: such a request gets 502 at once.
    retry_once: bool = True
    # Default 30s: a streaming client that goes away leaves the gateway reading
    # the engine's answer on to its end, for at most this long, so that the
    # usage chunk vLLM sends after the last token is counted (tokens the engine
    # made are tokens someone used). Past it the engine's connection is cut,
    # which stops the generation, and that answer's usage goes uncounted. 0: cut at once.
    drain_after_disconnect: float = field(
        default=30.0, metadata=rule(ge=0, parse=schema.parse_duration)
    )
    # Default 4M: the same bound in bytes of the answer read after the client left.
    drain_after_disconnect_bytes: int = field(
        default=4 * 1024 * 1024, metadata=rule(ge=0, parse=schema.parse_size)
    )
    # Default sampled: with tracing on, a request gets a span only when its client
    # sent a sampled traceparent, or when it is held for a cold start. "all" gives
    # every request a span, which costs the gateway up to a third of its throughput.
    trace_requests: Literal["sampled", "all"] = "sampled"
    # Default None: only the daemon's admin token sees every series of /metrics.
    # A file holding a token for the Prometheus scraper (read as it changes), so
    # that the scraper needs no admin token. Without either, /metrics leaves out
    # the series of models the caller may not use (access rules), as /v1/models.
    metrics_token_file: Path | None = None
    # Ignored: every OpenAI request takes the one request path (router/server.py);
    # kept so that a server.yaml that sets it (the fast lane's switch, before
    # that path) still loads.
    fast_lane: bool = True

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.max_held_total < self.max_held:
            return [
                (
                    "max_held_total",
                    f"max_held_total ({self.max_held_total}) is less than max_held "
                    f"({self.max_held}), the cap of one model",
                )
            ]
        return []


@dataclass(frozen=True)
class LoginConfig:
    """``login:``: self-service keys with ``llmgw login`` (munge), see docs/operations.md."""

    # Default false: only the admin hands out keys. true: any user of the
    # cluster gets a key for themselves with `llmgw login` (needs router.keys_file).
    enabled: bool = False
    # Default None: munge's own default socket. munged's socket on the daemon's host.
    munge_socket: Path | None = None
    # Default 16: keys one user may hold (active, or revoked within
    # revoked_key_window); a login past it is refused.
    max_keys_per_user: int = field(default=16, metadata=rule(ge=1))
    # Default 10: login attempts per user (the one the munge credential proves)
    # per minute; more get 429. Not per address: every local user is 127.0.0.1.
    attempts_per_minute: int = field(default=10, metadata=rule(ge=1))
    # Default 1h: a revoked key still counts against max_keys_per_user this long,
    # so revoking and logging in again does not make keys without end (each one a
    # record in the key file).
    revoked_key_window: float = field(
        default=3600.0, metadata=rule(ge=0, parse=schema.parse_duration)
    )


@dataclass(frozen=True)
class QuotaConfig:
    """``quotas:``: limits per key, and token budgets per user and per Slurm account.

    Every limit defaults to None (no limit). Budgets count total tokens (prompt
    and completion) in the calendar day and month (UTC), from the usage store,
    so they survive a restart; per-minute limits start afresh. Per-account
    budgets set with ``llmgw-admin quota`` override the account ones here.
    """

    requests_per_minute: int | None = field(default=None, metadata=rule(ge=1))
    tokens_per_minute: int | None = field(default=None, metadata=rule(ge=1))
    user_tokens_per_day: int | None = field(default=None, metadata=rule(ge=1))
    user_tokens_per_month: int | None = field(default=None, metadata=rule(ge=1))
    account_tokens_per_day: int | None = field(default=None, metadata=rule(ge=1))
    account_tokens_per_month: int | None = field(default=None, metadata=rule(ge=1))
    # Default 4096: what a request that sets no max_tokens reserves for its answer
    # on a model whose context length is unknown (no context_length in the
    # catalog, nor the engine's flag for it). Its answer may pass it: give
    # models their context_length and every request's maximum is known.
    default_max_tokens: int = field(default=4096, metadata=rule(ge=1))

    @property
    def any(self) -> bool:
        """Whether any limit is set."""
        return any(
            v is not None
            for v in (
                self.requests_per_minute,
                self.tokens_per_minute,
                self.user_tokens_per_day,
                self.user_tokens_per_month,
                self.account_tokens_per_day,
                self.account_tokens_per_month,
            )
        )


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the gateway port (``tls: {cert, key}``)."""

    # Default None: plain http. A PEM certificate (chain) the researchers' CLIs
    # and clients verify: over https a key goes only to whoever holds the key
    # file, even to a client on another host or while the daemon restarts.
    cert: Path | None = None
    # Default None: the certificate's private key (PEM), readable by the daemon's user only.
    key: Path | None = None

    def schema_problems(self) -> list[tuple[str, str]]:
        if (self.cert is None) != (self.key is None):
            return [("key" if self.key is None else "cert", "set both cert and key, or neither")]
        return []

    @property
    def enabled(self) -> bool:
        return self.cert is not None and self.key is not None


@dataclass(frozen=True)
class BatchConfig:
    """The OpenAI Batch API (``/v1/files``, ``/v1/batches``): where files live, how jobs run."""

    # Default None: state_dir/batch. Uploaded files, outputs and batch records; the
    # batch jobs read and write it on the compute nodes, so on a site it must be on a
    # shared filesystem the daemon's user owns.
    directory: Path | None = None
    # Default None: slurm.partition. Batches wait for capacity, so a site usually
    # sends them to its preemptible partition.
    partition: str | None = _slurm_names()
    # Default None: slurm.qos. The QOS of batch jobs (a low-priority, preemptible one).
    qos: str | None = _slurm_name()
    # Default 4h: a batch job's time limit; a batch that needs longer resumes in a
    # new job where the last one stopped.
    time_limit: float = field(default=4 * 3600.0, metadata=rule(ge=60, parse=schema.parse_duration))
    # Default 200M: OpenAI's limit for one batch input file.
    max_file_bytes: int = field(
        default=200 * 1024 * 1024, metadata=rule(ge=1, parse=schema.parse_size)
    )
    # Default 50000: OpenAI's limit of requests in one batch.
    max_requests: int = field(default=50_000, metadata=rule(ge=1))
    # Default 24h: the longest completion_window a batch may ask for (OpenAI offers only 24h).
    max_completion_window: float = field(
        default=24 * 3600.0, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default 16: requests a batch job keeps in flight to its engine; the engine's
    # own scheduler batches them, more only lengthens its queue.
    concurrency: int = field(default=16, metadata=rule(ge=1, le=4096))
    # Default auto: a vllm model's batches run through vLLM's offline runner
    # (run_batch: the model loaded once, no server, no port; its answers arrive at
    # its end), other engines' through their server. server: always the server,
    # whose answers are kept as they come (a preempted job loses none).
    runner: Literal["auto", "server"] = "auto"
    # Default 5s: how often the daemon lists batch jobs (one squeue for all of them).
    poll_interval: float = field(default=5.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 10: batches one user may have unfinished (validating, in progress,
    # cancelling) at once; one more is refused with 429. Each holds a job in the
    # queue, and one user's thousand batches would crowd out everyone else's.
    max_active_per_user: int = field(default=10, metadata=rule(ge=1))
    # Default 0: a batch runs as one job. N: a batch of more than N requests is
    # split into shards of about N, run as the tasks of one Slurm job array (each
    # a node of its own, each resumed on its own after a preemption): more GPUs
    # at once, and shorter jobs that fit a preemptible partition's gaps.
    shard_lines: int = field(default=0, metadata=rule(ge=0))
    # Default 16: the most shards (array tasks) one batch is split into; past it
    # the shards hold more than shard_lines each.
    max_shards: int = field(default=16, metadata=rule(ge=1, le=1000))
    # Default true: a batch whose model has ready replicas with room rides them
    # first, below online requests (docs/batch.md), and only what would not finish
    # in its completion window goes to a Slurm job. A replica that is up has paid
    # for its model's load; a batch job pays it again. false: every batch is a job.
    warm: bool = True
    # Default 0: a replica online requests use takes no batch request; batches ride
    # idle replicas. Above 0: the share of each replica's concurrency (its model's
    # scaling.target_inflight) that batch requests may take while online requests
    # use it, fewer as they rise (batch and online together within
    # target_inflight). Higher finishes a batch sooner, and costs online requests
    # more of the engine: each request in flight lengthens every step (on vLLM's
    # CPU build an eighth made online requests 1.5-1.7 times slower, p50 and p99;
    # docs/performance.md). An online request that begins on a replica with more
    # batch requests than this (lent by warm_idle_share) calls the newest back.
    warm_share: float = field(default=0.0, metadata=rule(ge=0, le=1))
    # Default 1: the share of a replica no online request has used for
    # warm_idle_after. An idle replica's GPUs are held anyway, so a batch may have
    # all of it; an online request that comes then calls back those past
    # warm_share (what they had made is lost; they are sent again later).
    warm_idle_share: float = field(default=1.0, metadata=rule(gt=0, le=1))
    # Default 2s: how long a replica has had no online request before it is idle
    # (a busy client's next request comes within milliseconds of its last answer).
    warm_idle_after: float = field(default=2.0, metadata=rule(ge=0, parse=schema.parse_duration))
    # Default 1h: a riding batch goes to a Slurm job once, at its pace over the
    # last minute, it would end later than this before its deadline (the job's
    # queue wait and start need the time).
    warm_margin: float = field(default=3600.0, metadata=rule(ge=0, parse=schema.parse_duration))


@dataclass(frozen=True)
class DatabaseTlsConfig:
    """``database.tls``: TLS to PostgreSQL, as libpq's sslmode and its files."""

    # Default None: the DSN's or the service's own sslmode, else libpq's (prefer).
    # A site's server across a network wants verify-full (the server's name checked
    # against its certificate, signed by root_cert).
    mode: Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"] | None = None
    # Default None: libpq's (~/.postgresql/root.crt). The CA that signed the server's certificate.
    root_cert: Path | None = None
    # Default None: no client certificate. With key: log in by certificate
    # (pg_hba.conf's cert method), or present one besides the password.
    cert: Path | None = None
    # Default None: the client certificate's private key (readable by the daemon's user only).
    key: Path | None = None

    def schema_problems(self) -> list[tuple[str, str]]:
        if (self.cert is None) != (self.key is None):
            return [("key" if self.key is None else "cert", "set both cert and key, or neither")]
        return []


@dataclass(frozen=True)
class DatabaseConfig:
    """``database:``: the PostgreSQL server that several daemons share (docs/operations.md,
    "Two login nodes"). Absent: one daemon, its state in state_dir (SQLite and files)."""

    # A libpq connection string ("host=db1 port=5432 dbname=llmgw user=llmgw") or URI
    # (postgresql://llmgw@db1/llmgw); no password in it: password_file. Several hosts
    # ("host=db1,db2 target_session_attrs=read-write") follow a failover.
    dsn: str | None = field(
        default=None, metadata=rule(pattern=r"[^\x00-\x1f]{1,2000}", pattern_help="one line")
    )
    # Or a service name from pg_service.conf (PGSERVICEFILE, ~/.pg_service.conf), where
    # a DBA keeps the connection's settings.
    service: str | None = field(
        default=None,
        metadata=rule(pattern=r"[A-Za-z0-9_.-]{1,64}", pattern_help="a pg_service.conf name"),
    )
    # Default None: libpq's own (PGPASSWORD, ~/.pgpass, or no password). A file whose
    # first line is the password, readable by the daemon's user only.
    password_file: Path | None = None
    # Default: see DatabaseTlsConfig.
    tls: DatabaseTlsConfig = field(default_factory=DatabaseTlsConfig)
    # Default 5s: a connection attempt that takes longer has failed (libpq's
    # connect_timeout, whole seconds, at least 2).
    connect_timeout: float = field(default=5.0, metadata=rule(ge=2, parse=schema.parse_duration))
    # Default 4: connections the daemon keeps for its stores (one more listens for
    # notifications, one holds the lease).
    pool_size: int = field(default=4, metadata=rule(ge=1, le=64))
    # Default None: HOST:GATEWAY_PORT. This daemon's name in status and logs; unique
    # among the daemons that share the database.
    name: str | None = field(
        default=None,
        metadata=rule(pattern=r"[A-Za-z0-9_.:@-]{1,100}", pattern_help="letters, digits, '_.:@-'"),
    )
    # Default 3s: how long the reconciler's lease runs unrenewed before another
    # daemon may take it: a leader's death is noticed within this.
    lease_duration: float = field(default=3.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 0.5s: how often the leader renews it, and the others try to take it.
    lease_renew: float = field(default=0.5, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 2s: a leader that has not renewed for this long (its own monotonic
    # clock) stops acting, before its lease can run out elsewhere.
    lease_deadline: float = field(default=2.0, metadata=rule(gt=0, parse=schema.parse_duration))

    def schema_problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if (self.dsn is None) == (self.service is None):
            out.append(("dsn", "set one of dsn (a connection string) or service (pg_service.conf)"))
        if not self.lease_renew < self.lease_deadline < self.lease_duration:
            out.append(
                (
                    "lease_deadline",
                    f"need lease_renew ({self.lease_renew:g}s) < lease_deadline "
                    f"({self.lease_deadline:g}s) < lease_duration ({self.lease_duration:g}s): "
                    "a leader must stop acting before its lease can run out elsewhere",
                )
            )
        return out


@dataclass(frozen=True)
class ServerConfig:
    """``server.yaml``: the daemon's settings."""

    # Default: see SlurmConfig.
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    # Default (): one cluster, the one Slurm's commands reach from the daemon's
    # environment (SLURM_CONF), with the slurm: block's defaults. Otherwise every
    # cluster replicas may run on, in the site's order of preference (the first one
    # where a replica fits now takes it); see ClusterConfig and docs/operations.md.
    clusters: tuple[ClusterConfig, ...] = ()
    # Default: see ListenConfig.
    listen: ListenConfig = field(default_factory=ListenConfig)
    # Default: see ConnectionsConfig.
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)
    # Default ~/.local/state/llmgw-slurm: the daemon's own small state (last
    # use per model, failure counts); Slurm keeps the rest.
    state_dir: Path = Path("~/.local/state/llmgw-slurm")
    # Default models.yaml next to server.yaml.
    models: Path = Path("models.yaml")
    # Default agent.yaml next to server.yaml: the path handed to every job, so
    # it must be readable on the compute nodes (a shared filesystem).
    agent_config: Path = Path("agent.yaml")
    # Default None: the sbatch templates shipped with llmgw-slurm. A folder
    # with templates of the same names overrides them (site-specific modules).
    templates_dir: Path | None = None
    # Default: see ReconcileConfig.
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    # Default: see RouterConfig.
    router: RouterConfig = field(default_factory=RouterConfig)
    # Default: fair share on, see SiteScaling.
    scaling: SiteScaling = field(default_factory=SiteScaling)
    # Default: tracing off, see TracingConfig.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Default: see BatchConfig.
    batch: BatchConfig = field(default_factory=BatchConfig)
    # Default: plain http on the gateway, see TlsConfig.
    tls: TlsConfig = field(default_factory=TlsConfig)
    # Default None: $RUNTIME_DIRECTORY (the unit's RuntimeDirectory=, i.e.
    # /run/llmgw-slurm), else state_dir/run. Where the daemon publishes
    # daemon.json (its uid and ports, for the CLIs to check who holds a port)
    # and the admin socket; made 0755, owned by the daemon's user.
    runtime_dir: Path | None = None
    # Default None: runtime_dir/admin.sock. llmgw-admin's way in: the daemon
    # takes a call on it from root, its own user or admin_group, by the
    # caller's kernel-checked credentials, with no token to steal.
    admin_socket: Path | None = None
    # Default None: only root and the daemon's user may use the admin socket.
    # A group whose members may too.
    admin_group: str | None = field(
        default=None,
        metadata=rule(pattern=r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", pattern_help="a group name"),
    )
    # Default: off, see LoginConfig.
    login: LoginConfig = field(default_factory=LoginConfig)
    # Default: no limits, see QuotaConfig.
    quotas: QuotaConfig = field(default_factory=QuotaConfig)
    # Default None: one daemon, its state in state_dir (SQLite, files). Set: several
    # daemons share their state in PostgreSQL, see DatabaseConfig.
    database: DatabaseConfig | None = None

    @property
    def batch_directory(self) -> Path:
        """``batch.directory``, else ``state_dir/batch``."""
        return Path(self.batch.directory or Path(self.state_dir) / "batch")

    def effective_runtime_dir(self, environ: Mapping[str, str] | None = None) -> Path:
        """``runtime_dir``, else ``$RUNTIME_DIRECTORY`` (systemd), else ``state_dir/run``."""
        env = os.environ if environ is None else environ
        if self.runtime_dir is not None:
            return Path(self.runtime_dir)
        # systemd may list several folders, separated by ':'; the unit sets one.
        given = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
        return Path(given) if given else Path(self.state_dir) / "run"

    def effective_admin_socket(self, environ: Mapping[str, str] | None = None) -> Path:
        if self.admin_socket is not None:
            return Path(self.admin_socket)
        return self.effective_runtime_dir(environ) / "admin.sock"

    @property
    def cluster_list(self) -> tuple[ClusterConfig, ...]:
        """``clusters``, each with the slurm: block's defaults filled in; without a
        ``clusters:`` block, the one cluster of today (name "")."""
        given = self.clusters or (ClusterConfig(name=""),)
        s = self.slurm
        return tuple(
            dataclasses.replace(
                c,
                backend=c.backend or s.backend,
                rest=c.rest or s.rest,
                partition=c.partition or s.partition,
                account=c.account or s.account,
                qos=c.qos or s.qos,
                reservation=c.reservation or s.reservation,
            )
            for c in given
        )

    @property
    def cluster_names(self) -> tuple[str, ...]:
        """The names a model's resources.clusters may give (none without ``clusters:``)."""
        return tuple(c.name for c in self.clusters)

    def _cluster_problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        seen: dict[str, int] = {}
        pyslurm = [
            i for i, c in enumerate(self.clusters) if (c.backend or self.slurm.backend) == "pyslurm"
        ]
        for i, c in enumerate(self.clusters):
            if c.name in seen:
                out.append(
                    (
                        f"clusters[{i}]",
                        f"cluster name {c.name!r} is already clusters[{seen[c.name]}]'s",
                    )
                )
            seen.setdefault(c.name, i)
        if len(pyslurm) > 1:
            out.append(
                (
                    f"clusters[{pyslurm[1]}]",
                    "only one cluster can use the pyslurm backend (libslurm loads one "
                    "configuration per process); use backend cli for the others",
                )
            )
        return out

    def schema_problems(self) -> list[tuple[str, str]]:
        out = self._cluster_problems()
        if self.login.enabled and self.router.keys_file is None:
            out.append(
                (
                    "login.enabled",
                    "login needs API keys: set router.keys_file (the file the keys go to)",
                )
            )
        if self.quotas.any and self.router.keys_file is None:
            out.append(
                (
                    "quotas",
                    "quotas are per key, user and account, which only keys tell apart: "
                    "set router.keys_file",
                )
            )
        return out


# ----------------------------------------------------------------------- agent


@dataclass(frozen=True)
class PortRange:
    """Ports the agent may give the engine (inclusive)."""

    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    @property
    def bounds(self) -> tuple[int, int]:
        return (self.first, self.last)


_PORTS_HELP = "a port range like 20000-29999 (or [20000, 29999]) within 1024-65535"


def _parse_port_range(node: YNode, ctx: Ctx) -> PortRange:
    first: int | None = None
    last: int | None = None
    if isinstance(node, YScalar) and isinstance(node.value, str):
        m = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", node.value)
        if m:
            first, last = int(m.group(1)), int(m.group(2))
    elif isinstance(node, YSeq) and len(node.items) == 2:
        a, b = (i.value if isinstance(i, YScalar) else None for i in node.items)
        if type(a) is int and type(b) is int:
            first, last = a, b
    if first is None or last is None:
        raise Invalid(f"expected {_PORTS_HELP}; got {describe(node)}")
    if not 1024 <= first <= last <= 65535:
        raise Invalid(f"{first}-{last} is not valid: expected {_PORTS_HELP}, first <= last")
    return PortRange(first, last)


@dataclass(frozen=True)
class AgentWeightsConfig:
    """Where and how the agent stages weights on the node."""

    # Default /tmp/llmgw-weights: node-local disk, so engines read weights
    # locally instead of all at once from the shared FS. Point it at a larger
    # local scratch where /tmp is small.
    cache_dir: Path = Path("/tmp/llmgw-weights")  # noqa: S108 - node-local cache, by design
    # Default auto: each model's weights.method from the catalog. copy/hf/none
    # force one method site-wide (none: the shared FS is fast enough).
    method: Literal["auto", "copy", "hf", "none"] = "auto"
    # Default false: compute nodes often have no internet, and a hundred jobs
    # downloading at once hit rate limits; hf sources are then taken from the
    # cache only (pre-fetch them with a model job).
    allow_download: bool = False
    # Default size: cached weights are checked by file sizes at every start
    # (cheap); sha256 reads every byte, minutes for a large model.
    verify: Literal["size", "sha256"] = "size"
    # Default 6h: another job may be fetching the same model into the cache;
    # wait this long for its lock before failing the start.
    lock_timeout: float = field(
        default=6 * 3600.0, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default true: weights missing from the cache are fetched. False (the
    # agent's --no-fetch): they must be there already, put there by a model
    # job, and a start whose weights are missing fails at once.
    fetch: bool = True
    # Default [hf]: the Hugging Face CLI (found on PATH) that `hf:` sources are
    # downloaded with; a site's own path or wrapper (its words, one per item).
    hf_command: tuple[str, ...] = field(
        default=("hf",), metadata=rule(pattern=r"[^\x00-\x1f]+", pattern_help="a word")
    )


@dataclass(frozen=True)
class EngineRuntime:
    """How to run one engine kind on this site."""

    # Default None: the agent's own interpreter. A Python interpreter whose
    # environment has the engine (the agent runs `PYTHON -m <engine server>`).
    python: str | None = field(
        default=None, metadata=rule(pattern=r"[^\s\x00-\x1f]+", pattern_help="a path")
    )
    # Default None: an executable to run instead (e.g. /opt/vllm/bin/vllm);
    # exclusive with python.
    executable: str | None = field(
        default=None, metadata=rule(pattern=r"[^\s\x00-\x1f]+", pattern_help="a path")
    )
    # Default {}: extra environment for every engine of this kind (a model's
    # engine.env wins on a clash).
    env: Mapping[str, str] = field(
        default_factory=FrozenMap, metadata=rule(key_pattern=_ENV_NAME_RE, key_help=_ENV_HELP)
    )

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.python and self.executable:
            return [("executable", "set python or executable, not both")]
        return []


@dataclass(frozen=True)
class EnginesConfig:
    """Per engine kind runtime settings."""

    vllm: EngineRuntime = field(default_factory=EngineRuntime)
    sglang: EngineRuntime = field(default_factory=EngineRuntime)
    # For kind command only env applies (the catalog gives the command).
    command: EngineRuntime = field(default_factory=EngineRuntime)

    def of(self, kind: str) -> EngineRuntime:
        """The runtime of engine ``kind`` (``vllm``, ``sglang``, ``command``)."""
        runtime = getattr(self, kind, None)
        return runtime if isinstance(runtime, EngineRuntime) else EngineRuntime()

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.command.python or self.command.executable:
            return [
                (
                    "command",
                    "a command engine's program comes from the catalog; only env applies here",
                )
            ]
        return []


_BIND_RE = r"/[^,\s\x00-\x1f:]*(:/[^,\s\x00-\x1f:]*)?(:(ro|rw))?"


@dataclass(frozen=True)
class ApptainerConfig:
    """How to run engines of models that set engine.apptainer_image."""

    # Default "apptainer" (found on PATH); older sites may need "singularity".
    binary: str = field(
        default="apptainer", metadata=rule(pattern=r"[^\s\x00-\x1f]+", pattern_help="a path")
    )
    # Default (): extra --bind mounts (SRC[:DST][:ro|rw]); the weights cache
    # and model path are bound by the agent itself.
    binds: tuple[str, ...] = field(
        default=(),
        metadata=rule(
            pattern=_BIND_RE, pattern_help="SRC[:DST][:ro|rw] with absolute paths, no commas"
        ),
    )


@dataclass(frozen=True)
class ReadinessConfig:
    """How the agent waits for the engine to answer."""

    # Default 2s: the health check is cheap, and a ready replica should serve
    # as soon as possible.
    poll_interval: float = field(default=2.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 15m: the deadline for models without engine.ready_timeout. Large
    # weights from a shared FS take minutes; past this the start has failed.
    timeout: float = field(default=900.0, metadata=rule(gt=0, parse=schema.parse_duration))


@dataclass(frozen=True)
class DrainConfig:
    """How the agent stops its engine (on --signal before the time limit, or SIGTERM)."""

    # Default 2m: in-flight requests may finish for this long; it fits within
    # the --signal lead the sbatch templates ask for.
    timeout: float = field(default=120.0, metadata=rule(parse=schema.parse_duration))
    # Default 2s: how often the engine's in-flight count is read while draining.
    poll_interval: float = field(default=2.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 10s: waited instead when the engine exposes no request metric.
    grace: float = field(default=10.0, metadata=rule(parse=schema.parse_duration))
    # Default 20s: between SIGTERM and SIGKILL of the engine; vLLM stops in a
    # few seconds.
    stop_grace: float = field(default=20.0, metadata=rule(parse=schema.parse_duration))


@dataclass(frozen=True)
class RendezvousConfig:
    """How the nodes of a multi-node replica find their head."""

    # Default None: the head's port is derived from the job id. A folder every
    # node of a job sees lets the head pick any free port and publish it there.
    dir: Path | None = None
    # Default 10m: workers wait this long for the head.
    timeout: float = field(default=600.0, metadata=rule(gt=0, parse=schema.parse_duration))


@dataclass(frozen=True)
class AgentConfig:
    """``agent.yaml``: settings of the agent that runs inside every replica job.

    The one type the agent takes (:func:`llmgw_slurm.agent.main.build_config`
    lays its command-line options over it); each default is here, once.
    """

    # Default None: LLMGW_DAEMON_URL from the job environment, which wins over
    # this anyway (the daemon knows where it listens).
    daemon_url: str | None = field(default=None, metadata=_URL)
    # Default: see AgentWeightsConfig.
    weights: AgentWeightsConfig = field(default_factory=AgentWeightsConfig)
    # Default: every engine run with the agent's own interpreter.
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    # Default: see ApptainerConfig.
    apptainer: ApptainerConfig = field(default_factory=ApptainerConfig)
    # Default: see ReadinessConfig.
    readiness: ReadinessConfig = field(default_factory=ReadinessConfig)
    # Default 15s: how often a ready replica reports. The daemon treats a
    # replica silent for several intervals as lost.
    heartbeat_interval: float = field(
        default=15.0, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default 20000-29999: engines bind a free port from this range; it keeps
    # clear of the well-known ports and of the OS's ephemeral range.
    port_range: PortRange = field(
        default=PortRange(20000, 29999), metadata=rule(parse=_parse_port_range)
    )
    # Default None: engine output goes to the job's output file. A folder here
    # gets one log file per replica and node.
    log_dir: Path | None = None
    # Default 0.0.0.0: the engine listens on every interface, because the
    # daemon reaches it across the network (its API key keeps others out).
    bind_host: str = field(
        default="0.0.0.0",  # noqa: S104 - the daemon calls the engine from the login node
        metadata=rule(pattern=r"[A-Za-z0-9.:-]{1,255}", pattern_help="an address or host name"),
    )
    # Default None: the node's host name as Slurm knows it; set it when the
    # login node reaches compute nodes under another name.
    advertise_host: str | None = field(
        default=None,
        metadata=rule(pattern=r"[A-Za-z0-9.:-]{1,255}", pattern_help="an address or host name"),
    )
    # Default 10s: a report to the daemon that takes longer counts as failed
    # (and is retried); the engine keeps serving meanwhile.
    report_timeout: float = field(default=10.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default: see DrainConfig.
    drain: DrainConfig = field(default_factory=DrainConfig)
    # Default: see RendezvousConfig.
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    # Default: tracing off, see TracingConfig.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Default None: the agent's own interpreter (the agent's --python), for
    # engine kinds whose engines.KIND.python names none.
    python: str | None = field(
        default=None, metadata=rule(pattern=r"[^\s\x00-\x1f]+", pattern_help="a path")
    )
    # Default 40: the last lines of an engine's output kept, to say why it
    # failed in the failure report and the agent's log.
    log_tail_lines: int = field(default=40, metadata=rule(ge=1, le=10_000))

    @property
    def interpreter(self) -> str:
        """The interpreter of an engine kind that names none: ``python``, else the agent's."""
        return self.python or sys.executable


# --------------------------------------------------------------------- loading


def _absolute(value: Path, base: Path, file: str, key: str) -> Path:
    # Given values were made absolute while reading; defaults are made
    # absolute here, against the file's folder.
    try:
        p = value.expanduser()
    except RuntimeError:
        raise ConfigError(
            f"the default {value} needs a home directory and there is none; set {key}",
            file=file,
            field=key,
        ) from None
    return p if p.is_absolute() else base / p


def load_server_config(path: str | Path) -> ServerConfig:
    """Load ``server.yaml``; raises ConfigError(s) naming every problem with file:line:field."""
    cfg = schema.load_file(ServerConfig, path, "server config")
    assert isinstance(cfg, ServerConfig)
    base, file = Path(path).absolute().parent, str(path)
    cfg = dataclasses.replace(
        cfg,
        state_dir=_absolute(cfg.state_dir, base, file, "state_dir"),
        models=_absolute(cfg.models, base, file, "models"),
        agent_config=_absolute(cfg.agent_config, base, file, "agent_config"),
    )
    if cfg.batch.directory is not None:
        batch_dir = _absolute(cfg.batch.directory, base, file, "batch.directory")
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, directory=batch_dir))
    # Both reach every replica's batch script (the job log goes under state_dir on an
    # #SBATCH line; agent_config on the agent's command line): a path no script can
    # hold would let the daemon start and then fail every submission.
    errors = []
    for key, value in (
        ("state_dir", cfg.state_dir),
        ("agent_config", cfg.agent_config),
        ("batch.directory", cfg.batch_directory),
    ):
        try:
            check_job_path(str(value), key)
        except TemplateError as exc:
            errors.append(ConfigError(str(exc), file=file, field=key))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
    return cfg


def load_agent_config(path: str | Path) -> AgentConfig:
    """Load ``agent.yaml``; raises ConfigError(s) naming every problem with file:line:field."""
    cfg = schema.load_file(AgentConfig, path, "agent config")
    assert isinstance(cfg, AgentConfig)
    return cfg


def check_files(
    *,
    models: str | Path | None = None,
    server: str | Path | None = None,
    agent: str | Path | None = None,
) -> list[ConfigError]:
    """Every problem in the given files (any subset), without touching Slurm.

    An empty list means they all load. Each error names its file; the list
    is in the order models, server, agent.
    """
    names: Sequence[str] | None = None
    if server is not None and models is not None:
        # The models' resources.clusters are checked against the server's clusters.
        with contextlib.suppress(ConfigError):
            names = load_server_config(server).cluster_names
    loaders: list[tuple[str | Path | None, Any]] = [
        (models, lambda p: load_catalog(p, names)),
        (server, load_server_config),
        (agent, load_agent_config),
    ]
    errors: list[ConfigError] = []
    for path, loader in loaders:
        if path is None:
            continue
        try:
            loader(path)
        except ConfigErrors as err:
            errors.extend(err.errors)
        except ConfigError as err:
            errors.append(err)
    return errors
