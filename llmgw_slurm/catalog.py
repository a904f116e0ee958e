"""The model catalog (``models.yaml``): what models exist and how to run them.

Shape of the file::

    defaults:            # optional; merged under every model (the model wins per key)
      resources: {partition: gpu, time_limit: 4:00:00}
      scaling: {idle_timeout: 30m}
    models:
      - name: llama-8b
        aliases: [meta-llama/Llama-3.1-8B-Instruct]
        engine: {kind: vllm, args: [--max-model-len, "8192"]}
        weights: {source: hf:meta-llama/Llama-3.1-8B-Instruct}
        resources: {gpus: 1, gpu_type: a100}
        scaling: {min: 0, max: 2}

Every field, with its default and the reason for it, is documented on the
dataclasses below and in ``docs/configuration.md``. :func:`load_catalog`
reports every problem of the file at once, each with file, line and field
path (``models[2].resources.gpus``).

The daemon hands each replica job its model entry as JSON
(:meth:`Model.to_spec`, ``LLMGW_REPLICA_SPEC``); the agent reads it back with
:func:`read_replica_spec`, which validates exactly as the file loader does
(unknown keys aside: see there).
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from llmgw_slurm.base import schema
from llmgw_slurm.base.errors import ConfigError, ConfigErrors
from llmgw_slurm.base.schema import Ctx, FrozenMap, Invalid, rule
from llmgw_slurm.base.yamlsrc import (
    YEntry,
    YMap,
    YNode,
    YScalar,
    YSeq,
    describe,
    from_plain,
    load_yaml,
)

__all__ = [
    "CLUSTER_NAME_RE",
    "ENDPOINTS",
    "MODEL_NAME_RE",
    "PLACEHOLDERS",
    "SPEC_ENV",
    "Catalog",
    "EngineSpec",
    "Model",
    "Resources",
    "Routing",
    "Scaling",
    "TimeLimit",
    "WeightsSpec",
    "load_catalog",
    "parse_catalog",
    "read_replica_spec",
]

MODEL_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,47}")
_NAME_HELP = (
    "1-48 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
)
# Aliases are what clients send as "model": HF ids ("org/Name") included, but
# nothing a log line, a header or a shell could trip on.
_ALIAS_RE = r"[^\s\x00-\x1f\x7f]{1,200}"
_ALIAS_HELP = "1-200 characters without whitespace or control characters"
_ENV_NAME_RE = r"[A-Za-z_][A-Za-z0-9_]*"
_ENV_HELP = "an environment variable name (letters, digits, '_', not starting with a digit)"
# Slurm names (partition, account, qos, gres type) stay within this set on
# every site we know; anything else is more likely a typo or an injection.
_SLURM_NAME_RE = r"[A-Za-z0-9_.+-]{1,64}"
_SLURM_NAME_HELP = "a Slurm name: letters, digits, '_', '.', '+', '-'"
_PARTITION_RE = r"[A-Za-z0-9_.+-]{1,64}(,[A-Za-z0-9_.+-]{1,64})*"
# A cluster's name in server.yaml's clusters: it ends its replicas' job names
# (PREFIX MODEL.ID-NAME), so no '.' (model and replica id are read from the last '.').
CLUSTER_NAME_RE = r"[a-z0-9][a-z0-9_-]{0,31}"
_CLUSTER_HELP = "a cluster name from server.yaml's clusters (lowercase letters, digits, '_', '-')"
# Constraint expressions: features joined by & | , with [ ] ( ) and *counts.
_CONSTRAINT_RE = r"[A-Za-z0-9_.:&|,\[\]()*!-]{1,200}"
_HF_RE = re.compile(
    r"hf:(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{0,99}))?"
)

PLACEHOLDERS = (
    "host",
    "port",
    "model_path",
    "api_key",
    "served_name",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "tls_certfile",
    "tls_keyfile",
    "tls_ca_certs",
)
"""Placeholders a ``command`` engine may use in ``command`` and ``args`` (the agent
fills them: llmgw_slurm/agent/engine.py; the multi-node ones are torchrun's)."""

EngineKind = Literal["vllm", "sglang", "command"]
WeightsMethod = Literal["copy", "hf", "none"]
# Why a replica of a model is started (plan.py), for scaling.evict_for.
EvictFor = Literal["held", "min", "renewal", "load"]
# The API endpoints the gateway routes (their paths: llmgw_slurm/router/surface.py).
EndpointName = Literal[
    "chat/completions",
    "completions",
    "embeddings",
    "responses",
    "rerank",
    "score",
    "tokenize",
    "detokenize",
    "audio/transcriptions",
    "audio/translations",
]
ENDPOINTS: tuple[EndpointName, ...] = get_args(EndpointName)
# What a model serves when its entry does not say: vLLM serves every one of
# them (a model that cannot do one, a chat model asked to rerank, gets vLLM's
# own error); for the others only what every OpenAI-compatible server has.
_DEFAULT_ENDPOINTS: Mapping[str, tuple[EndpointName, ...]] = {
    "vllm": ENDPOINTS,
    "sglang": ("chat/completions", "completions", "embeddings"),
    "command": ("chat/completions", "completions", "embeddings"),
}
RoutingPolicy = Literal["least_outstanding", "prefix"]
ScaleOn = Literal["in_flight", "engine_waiting"]


def _reserved_env(name: str) -> bool:
    # The daemon's own variables carry the replica's secrets and identity; a
    # catalog entry must not be able to overwrite them.
    return name.startswith("LLMGW_") or name in ("TRACEPARENT", "TRACESTATE")


def _placeholder_problems(argv: tuple[str, ...], what: str) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    valid = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
    for i, arg in enumerate(argv):
        try:
            parts = list(string.Formatter().parse(arg))
        except ValueError as err:
            problems.append(
                (f"{what}[{i}]", f"{arg!r}: {err}; write {{{{ and }}}} for literal braces")
            )
            continue
        for _lit, name, spec, conv in parts:
            if name is None:
                continue
            if name not in PLACEHOLDERS:
                problems.append(
                    (
                        f"{what}[{i}]",
                        f"{arg!r}: unknown placeholder {{{name}}}; valid: {valid}"
                        " (write {{ and }} for literal braces)",
                    )
                )
            elif spec or conv:
                problems.append(
                    (
                        f"{what}[{i}]",
                        f"{arg!r}: placeholder {{{name}}} takes no format or conversion",
                    )
                )
    return problems


@dataclass(frozen=True)
class TimeLimit:
    """A Slurm time limit, as whole seconds and as the string sbatch gets."""

    seconds: int
    slurm: str

    @classmethod
    def from_seconds(cls, seconds: int) -> TimeLimit:
        days, rest = divmod(seconds, 86400)
        h, rest = divmod(rest, 3600)
        m, s = divmod(rest, 60)
        text = f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h}:{m:02d}:{s:02d}"
        return cls(seconds, text)

    def __str__(self) -> str:
        return self.slurm


_TL_HELP = "a Slurm time limit like 4:00:00, 1-00:00:00, 90m, 4h or 1d"


def _parse_time_limit(node: YNode, ctx: Ctx) -> TimeLimit:
    if not isinstance(node, YScalar) or isinstance(node.value, bool) or node.value is None:
        raise Invalid(f"expected {_TL_HELP}; got {describe(node)}")
    text = node.text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        # Slurm reads a bare number as minutes, every other duration here as
        # seconds: refuse to guess.
        raise Invalid(
            f"{text!r} is ambiguous (Slurm reads minutes, other durations here read "
            f"seconds); write {text}m or {text}s, or H:MM:SS"
        )
    try:
        secs = schema.parse_duration(node, ctx)
    except Invalid:
        raise Invalid(f"cannot read {text!r}; expected {_TL_HELP}") from None
    if secs < 60:
        raise Invalid(f"{text!r} is under a minute; Slurm's time limits count whole minutes")
    return TimeLimit.from_seconds(math.ceil(secs))


# ASCII only: Python's \d takes any script's digits and IGNORECASE takes the Kelvin
# sign for K; both loaded, and then no #SBATCH --mem line could hold them.
_MEM_RE = re.compile(r"(\d+)([KMGT]?)B?", re.IGNORECASE | re.ASCII)
_MEM_HELP = "Slurm memory like 64G, 512M, 1T or a number of megabytes (0 = all of the node)"


def _parse_memory(node: YNode, ctx: Ctx) -> str:
    if not isinstance(node, YScalar) or isinstance(node.value, bool) or node.value is None:
        raise Invalid(f"expected {_MEM_HELP}; got {describe(node)}")
    m = _MEM_RE.fullmatch(node.text.strip())
    if not m:
        raise Invalid(f"cannot read {node.text!r}; expected {_MEM_HELP}")
    return m.group(1) + m.group(2).upper()


@dataclass(frozen=True)
class EngineSpec:
    """How to start the engine that serves the model."""

    # Required. vllm and sglang are started by the agent with the right host,
    # port, API key and model path; `command` runs `command` as given.
    kind: EngineKind
    # Default (): extra arguments for the engine, passed as separate argv items
    # (never through a shell). For vllm/sglang they are verbatim (JSON with
    # braces is fine); for `command` they may use the placeholders.
    args: tuple[str, ...] = ()
    # Default (): required for kind `command`, refused otherwise. Placeholders
    # {host} {port} {model_path} {api_key} {served_name} are filled in by the
    # agent; any other {name} is an error, caught here rather than in a job.
    command: tuple[str, ...] = ()
    # Default None (run on the node directly): an Apptainer image (a .sif path
    # or docker://...) to run the engine in.
    apptainer_image: str | None = field(
        default=None, metadata=rule(pattern=r"\S{1,500}", pattern_help="an image path or URI")
    )
    # Default {}: extra environment for the engine. Names starting with LLMGW_
    # and TRACEPARENT/TRACESTATE are refused: they carry the replica's identity.
    env: Mapping[str, str] = field(
        default_factory=FrozenMap, metadata=rule(key_pattern=_ENV_NAME_RE, key_help=_ENV_HELP)
    )
    # Default /health: what vLLM and SGLang answer on once the model is loaded.
    health_path: str = field(
        default="/health",
        metadata=rule(pattern=r"/[^\s\x00-\x1f]*", pattern_help="a path starting with '/'"),
    )
    # Default None: use the agent's readiness.timeout (site-wide, 15m).
    # Set it for models that load slowly (large weights on a shared FS).
    ready_timeout: float | None = field(
        default=None, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default true: the engine serves TLS with a certificate its agent makes for
    # this replica, and accepts only the gateway's client certificate (and the
    # agent's): other users of the node reach none of its paths, and a listener
    # that takes its port gets no request (docs/operations.md, Security). vllm
    # and sglang are given the flags; a `command` engine must serve https with
    # {tls_certfile} {tls_keyfile} and require client certificates signed as in
    # {tls_ca_certs} (also in LLMGW_TLS_CERTFILE, _KEYFILE, _CA_CERTS).
    # false: plain HTTP, for an engine that cannot; its port is then checked to
    # belong to the job's user before the agent sends it anything.
    tls: bool = True

    def schema_problems(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.kind == "command":
            if not self.command:
                out.append(
                    (
                        "command",
                        "kind 'command' needs a command list, e.g. [python, "
                        "-m, my.server, --port, '{port}']",
                    )
                )
            out += _placeholder_problems(self.command, "command")
            out += _placeholder_problems(self.args, "args")
        elif self.command:
            out.append(
                (
                    "command",
                    f"only kind 'command' takes a command; kind {self.kind!r} "
                    "is started by the agent (use args for extra flags)",
                )
            )
        for name in self.env:
            if _reserved_env(name):
                out.append(
                    (
                        f"env.{name}",
                        f"{name} is reserved for llmgw (it carries the replica's "
                        "identity or trace); choose another name",
                    )
                )
        return out


@dataclass(frozen=True)
class WeightsSpec:
    """Where the weights come from and how the agent gets them onto the node."""

    # Required: an absolute local path (a folder on a shared filesystem), or
    # hf:ORG/NAME[@revision] for a Hugging Face repository.
    source: str = field(
        metadata=rule(
            pattern=r"(/[^\x00-\x1f]*)|(hf:.*)",
            pattern_help="an absolute path, or hf:ORG/NAME[@revision]",
        )
    )
    # Default: hf for hf: sources, none for local paths. copy = stage a local
    # folder into the node's cache (costs a copy, saves the shared FS from
    # every engine reading it at once); hf = fetch the repo into the cache;
    # none = use the source in place.
    method: WeightsMethod = "none"

    @classmethod
    def schema_fill_defaults(cls, values: dict[str, Any]) -> None:
        if "method" not in values:
            values["method"] = "hf" if str(values.get("source", "")).startswith("hf:") else "none"

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.source.startswith("hf:"):
            if not _HF_RE.fullmatch(self.source):
                return [("source", f"{self.source!r} is not hf:ORG/NAME or hf:ORG/NAME@revision")]
            if self.method == "copy":
                return [
                    (
                        "method",
                        "copy stages a local folder; an hf: source uses method hf "
                        "(or none to let the engine resolve it)",
                    )
                ]
        elif self.method == "hf":
            return [
                ("method", "method hf needs an hf:ORG/NAME source; a local path uses copy or none")
            ]
        return []

    @property
    def is_hf(self) -> bool:
        return self.source.startswith("hf:")

    @property
    def hf_repo(self) -> str | None:
        """``ORG/NAME`` of an hf: source, else None."""
        m = _HF_RE.fullmatch(self.source)
        return m.group("repo") if m else None

    @property
    def hf_revision(self) -> str | None:
        """The ``@revision`` of an hf: source, None when absent (the default branch)."""
        m = _HF_RE.fullmatch(self.source)
        return m.group("rev") if m else None


@dataclass(frozen=True)
class Resources:
    """What one replica asks Slurm for. Per node: a multi-node replica asks for
    ``nodes`` components of this size (a heterogeneous job)."""

    # Default 1: an LLM engine needs a GPU; the CPU test engine says 0.
    gpus: int = field(default=1, metadata=rule(ge=0, le=64))
    # Default None (any GPU): a gres type, as in --gres=gpu:TYPE:N.
    gpu_type: str | None = field(
        default=None, metadata=rule(pattern=_SLURM_NAME_RE, pattern_help=_SLURM_NAME_HELP)
    )
    # Default 1. More than 1 makes a heterogeneous job, one component per node.
    nodes: int = field(default=1, metadata=rule(ge=1, le=256))
    # Default 4 per node: the engine's tokenizer, scheduler and HTTP threads;
    # Slurm's own default of 1 CPU starves them.
    cpus: int = field(default=4, metadata=rule(ge=1, le=4096))
    # Default None (the partition's DefMemPerCPU/DefMemPerNode): Slurm syntax
    # (64G, 512M; a bare number is megabytes; 0 means all of the node's memory).
    memory: str | None = field(default=None, metadata=rule(parse=_parse_memory))
    # Default None: the server's slurm.partition, else Slurm's default partition.
    # A comma list lets Slurm pick the first partition that fits.
    partition: str | None = field(
        default=None, metadata=rule(pattern=_PARTITION_RE, pattern_help=_SLURM_NAME_HELP)
    )
    # Default None: the server's slurm.account, else the user's default account.
    account: str | None = field(
        default=None, metadata=rule(pattern=_SLURM_NAME_RE, pattern_help=_SLURM_NAME_HELP)
    )
    # Default None: the server's slurm.qos, else the association's default QOS.
    qos: str | None = field(
        default=None, metadata=rule(pattern=_SLURM_NAME_RE, pattern_help=_SLURM_NAME_HELP)
    )
    # Default None (the partition's DefaultTime; the daemon reads the real limit
    # from squeue for renewal). Slurm syntax (4:00:00, 1-00:00:00) or 90m/4h/1d.
    time_limit: TimeLimit | None = field(default=None, metadata=rule(parse=_parse_time_limit))
    # Default None: a Slurm --constraint expression over node features.
    constraint: str | None = field(
        default=None,
        metadata=rule(
            pattern=_CONSTRAINT_RE,
            pattern_help="a Slurm constraint: feature names joined by & | , with [] () *N",
        ),
    )
    # Default (): any cluster of server.yaml's clusters: where it fits. Otherwise only
    # these (their names in server.yaml), e.g. the ones whose file systems hold its
    # weights; checked against server.yaml when the daemon loads the catalog.
    clusters: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=CLUSTER_NAME_RE, pattern_help=_CLUSTER_HELP)
    )

    def schema_problems(self) -> list[tuple[str, str]]:
        twice = sorted({c for c in self.clusters if self.clusters.count(c) > 1})
        if twice:
            return [("clusters", f"clusters names {', '.join(twice)} more than once")]
        return []

    def may_run_on(self, cluster: str) -> bool:
        """May a replica run on ``cluster`` (a name in server.yaml's clusters)?"""
        return not self.clusters or cluster in self.clusters

    @property
    def memory_mb(self) -> int | None:
        """``memory`` in megabytes (0 = all of the node), None when unset."""
        if self.memory is None:
            return None
        m = _MEM_RE.fullmatch(self.memory)
        assert m is not None  # validated on load
        factor = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
        return math.ceil(int(m.group(1)) * factor)

    @property
    def gres(self) -> str | None:
        """The ``--gres`` value for one node (``gpu:a100:2``), None when no GPUs."""
        if self.gpus == 0:
            return None
        return f"gpu:{self.gpu_type}:{self.gpus}" if self.gpu_type else f"gpu:{self.gpus}"

    def with_slurm_defaults(
        self, *, partition: str | None, account: str | None, qos: str | None
    ) -> Resources:
        """These resources with the server's slurm defaults filled in where unset."""
        return replace(
            self,
            partition=self.partition or partition,
            account=self.account or account,
            qos=self.qos or qos,
        )


@dataclass(frozen=True)
class Scaling:
    """How many replicas, and when to add or remove them."""

    # Default 0 (on demand): a model nobody uses gives its GPUs back. min >= 1
    # is a promise: those replicas stay up and are never evicted.
    min: int = field(default=0, metadata=rule(ge=0, le=1000))
    # Default 1: more replicas cost GPUs; raise it for busy models.
    max: int = field(default=1, metadata=rule(ge=1, le=1000))
    # Default 30m: a replica idle this long is stopped (down to min). Shorter
    # frees GPUs sooner but makes users wait for cold starts more often.
    idle_timeout: float = field(default=1800.0, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default 16: in-flight requests per replica above which another replica is
    # started (up to max). Engines batch well, so one replica takes many.
    target_inflight: int = field(default=16, metadata=rule(ge=1))
    # Default in_flight: scale up on the gateway's count of requests in flight
    # (target_inflight). engine_waiting: on the requests the engines themselves
    # queue (vLLM's vllm:num_requests_waiting, read from each ready replica's
    # /metrics every pass), one more replica per target_waiting of them. The
    # engine knows when its batch or KV cache is full, which no fixed
    # target_inflight does; but the reading is a pass old, and the engine
    # queues only once it is saturated, so latency has risen by then.
    scale_on: ScaleOn = "in_flight"
    # Default 4: with scale_on engine_waiting, requests waiting in the engines'
    # queues (summed over the model's replicas) per replica to add.
    target_waiting: int = field(default=4, metadata=rule(ge=1))
    # Default None: the server's router.hold_timeout (5m). How long a request
    # waits for this model to have a ready replica before a 503 with
    # Retry-After. Set it for models whose queue wait plus load is longer than
    # the server's (a 70B model); a longer hold also keeps a pending job wanted
    # (not cancelled as "nobody waiting") while requests may still be held.
    hold_timeout: float | None = field(
        default=None, metadata=rule(gt=0, parse=schema.parse_duration)
    )
    # Default None: the server's scaling.max_wait (2m). How long this model's oldest
    # held request waits before a replica of another on-demand model that has
    # held its GPUs past its slice may be drained for it (server.yaml's
    # scaling.fair_share). Longer for a model whose users can wait (a batch-like
    # model), shorter for an interactive one; a start of this model that may not
    # evict (evict_for without held) drains nothing either.
    max_wait: float | None = field(default=None, metadata=rule(gt=0, parse=schema.parse_duration))
    # Default [held]: which starts of this model may evict an idle replica of
    # another model when it fits nowhere. `held`: an on-demand start a held
    # request waits for; `min`: a scale-up to min; `renewal`: a replacement
    # before the time limit; `load`: a scale-up for requests in flight. The
    # others queue in Slurm like any job. [] never evicts.
    evict_for: tuple[EvictFor, ...] = ("held",)

    def schema_problems(self) -> list[tuple[str, str]]:
        if self.min > self.max:
            return [("min", f"min ({self.min}) is more than max ({self.max})")]
        twice = sorted({w for w in self.evict_for if self.evict_for.count(w) > 1})
        if twice:
            return [("evict_for", f"evict_for names {', '.join(twice)} more than once")]
        return []

    @property
    def on_demand(self) -> bool:
        """True when the model starts on request and may be evicted (min 0)."""
        return self.min == 0


_UNIX_NAME_RE = r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}"
_UNIX_NAME_HELP = "a user or group name: letters, digits, '_', '.', '@', '-'"


@dataclass(frozen=True)
class Access:
    """Who may use a model (``access:``): anyone listed under any of the three.

    Checked against the gateway key's user (the Unix user for keys from
    ``llmgw login``), that user's Unix groups on the daemon's host, and the
    key's Slurm account. No ``access`` block: everyone with a key.
    """

    # Default (): Unix users, by name.
    users: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=_UNIX_NAME_RE, pattern_help=_UNIX_NAME_HELP)
    )
    # Default (): Unix groups, by name (primary or supplementary).
    groups: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=_UNIX_NAME_RE, pattern_help=_UNIX_NAME_HELP)
    )
    # Default (): Slurm accounts, by name (the account a key is charged to).
    accounts: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=_SLURM_NAME_RE, pattern_help=_SLURM_NAME_HELP)
    )

    def schema_problems(self) -> list[tuple[str, str]]:
        if not (self.users or self.groups or self.accounts):
            return [
                (
                    "users",
                    "an access block that names nobody lets nobody in; list users, groups "
                    "or accounts, or leave access out for everyone",
                )
            ]
        return []


@dataclass(frozen=True)
class Routing:
    """How the gateway chooses among a model's ready replicas (docs/configuration.md)."""

    # Default least_outstanding: the replica with the fewest requests in
    # flight. prefix: requests whose prompts begin alike go to the same
    # replica (consistent hashing with bounded loads, router/balance.py), so
    # that its prefix cache answers the shared part; a long shared system
    # prompt is then computed once per replica, not once per request.
    policy: RoutingPolicy = "least_outstanding"
    # Default 2048: how many characters of the prompt (the messages in order,
    # or the prompt text) make the key. Long enough to cover a shared system
    # prompt, short enough that one conversation's turns share it.
    prefix_chars: int = field(default=2048, metadata=rule(ge=1, le=1_000_000))
    # Default 2: no replica takes more than this times the mean load (plus
    # one); a prefix whose replica is full goes on to the next one on the ring.
    # Nearer 1 spreads load more evenly and reuses caches less: at 1.25, two
    # replicas (a model's usual count where GPUs are scarce) shared every
    # prefix in bench/prefix_routing.py, at 2 each stayed on one.
    load_factor: float = field(default=2.0, metadata=rule(ge=1.0, le=100.0))
    # Default 1: no replica holds more than this times the mean number of
    # active prefixes (rounded up); a prefix whose replica is full lives on
    # the next one on the ring. 1 splits the prefixes, and so what fills the
    # engines' caches, as evenly as they go; higher moves fewer prefixes when
    # prefixes come and go or replicas join, and leaves more of the split to
    # chance (docs/configuration.md).
    key_factor: float = field(default=1.0, metadata=rule(ge=1.0, le=100.0))


@dataclass(frozen=True)
class Model:
    """One catalog entry."""

    # Required: the name clients use and the job name carries (llmgw.NAME.ID).
    name: str = field(metadata=rule(pattern=MODEL_NAME_RE.pattern, pattern_help=_NAME_HELP))
    # Required: how to run it.
    engine: EngineSpec
    # Default (): other names clients may use (e.g. the HF id). Unique across
    # the catalog and distinct from every model name.
    aliases: tuple[str, ...] = field(
        default=(), metadata=rule(pattern=_ALIAS_RE, pattern_help=_ALIAS_HELP)
    )
    # Default "": shown by `llmgw models`.
    description: str = ""
    # Default None: required for vllm/sglang (they need a model to load); a
    # command engine may bring its own.
    weights: WeightsSpec | None = None
    # Default: see Resources (1 GPU, 1 node, 4 CPUs, partition defaults).
    resources: Resources = field(default_factory=Resources)
    # Default: see Scaling (on demand, at most 1 replica, 30m idle timeout).
    scaling: Scaling = field(default_factory=Scaling)
    # Default None: the engine kind's (vllm: all of ENDPOINTS; sglang and
    # command: chat/completions, completions, embeddings). A request for
    # another endpoint gets a 400 naming the model and the endpoint, before
    # any replica is started for it.
    endpoints: tuple[EndpointName, ...] | None = None
    # Default: least outstanding requests (see Routing).
    routing: Routing = field(default_factory=Routing)
    # Default None: everyone with a key may use it. See Access.
    access: Access | None = None
    # Default None: what the engine's arguments say (vLLM's --max-model-len,
    # SGLang's --context-length), else unknown. The most tokens one request may
    # hold, prompt and answer: with token quotas, what a request that sets no
    # max_tokens reserves (unknown: quotas.default_max_tokens, which the answer
    # may pass). It must match what the engine is started with.
    context_length: int | None = field(default=None, metadata=rule(ge=1))

    def schema_problems(self) -> list[tuple[str, str]]:
        given = _engine_context(self.engine)
        if given is not None and self.context_length not in (None, given):
            return [
                (
                    "context_length",
                    f"context_length {self.context_length} differs from the engine's "
                    f"{_CONTEXT_FLAGS[self.engine.kind]} {given}; give one of them",
                )
            ]
        eps = self.endpoints or ()
        twice = sorted({e for e in eps if eps.count(e) > 1})
        if twice:
            return [("endpoints", f"endpoints names {', '.join(twice)} more than once")]
        if self.engine.kind != "command" and self.weights is None:
            return [
                (
                    "weights",
                    f"a {self.engine.kind} engine needs weights: "
                    "{source: /path/to/model} or {source: hf:ORG/NAME}",
                )
            ]
        return []

    @property
    def served_endpoints(self) -> tuple[EndpointName, ...]:
        """The endpoints this model serves: its own list, else its engine kind's."""
        if self.endpoints is not None:
            return self.endpoints
        return _DEFAULT_ENDPOINTS[self.engine.kind]

    @property
    def multi_node(self) -> bool:
        return self.resources.nodes > 1

    @property
    def stores_responses(self) -> bool | None:
        """Whether the engine keeps ``/v1/responses`` answers for ``GET`` (and
        ``previous_response_id``, ``background``): vLLM only when started with
        VLLM_ENABLE_RESPONSES_API_STORE=1 (in ``engine.env``); None: not known."""
        if self.engine.kind != "vllm":
            return None
        value = self.engine.env.get(RESPONSES_STORE_ENV, "0").strip()
        return value.isdigit() and int(value) != 0

    @property
    def context_tokens(self) -> int | None:
        """The most tokens one request may hold: ``context_length``, else the
        engine's own flag for it, else None (unknown)."""
        return self.context_length or _engine_context(self.engine)

    def to_spec(self) -> dict[str, Any]:
        """Plain JSON-able data of this entry (the LLMGW_REPLICA_SPEC payload).

        Read back with :func:`read_replica_spec`; durations are seconds and the
        time limit its Slurm string.
        """
        data = asdict(self)
        tl = self.resources.time_limit
        data["resources"]["time_limit"] = tl.slurm if tl is not None else None
        return _drop_none(data)

    def to_spec_json(self) -> str:
        return json.dumps(self.to_spec(), sort_keys=True, separators=(",", ":"))


# vLLM keeps /v1/responses answers (for GET, previous_response_id, background)
# only with this set to a non-zero number in its environment.
RESPONSES_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"

# The engine flag that sets its context length, per engine kind.
_CONTEXT_FLAGS = {"vllm": "--max-model-len", "sglang": "--context-length", "command": ""}


def _engine_context(engine: EngineSpec) -> int | None:
    """The context length the engine's args give it (``--flag N`` or ``--flag=N``)."""
    flag = _CONTEXT_FLAGS[engine.kind]
    if not flag:
        return None
    args = engine.args
    for i, a in enumerate(args):
        value = a[len(flag) + 1 :] if a.startswith(flag + "=") else None
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        if value is not None and value.strip().isdigit() and int(value) > 0:
            return int(value)
    return None


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _drop_none(v) if isinstance(v, dict) and k != "env" else v
        for k, v in data.items()
        if v is not None
    }


@dataclass(frozen=True)
class Catalog:
    """All models of a catalog file, in file order."""

    models: tuple[Model, ...]
    # The file it was loaded from (None when built in code).
    file: str | None = None

    def resolve(self, name_or_alias: str) -> Model | None:
        """The model with this name or alias; None when there is none.

        Names win over aliases (the loader refuses an alias equal to a name, so
        this only matters for catalogs built in code).
        """
        for m in self.models:
            if m.name == name_or_alias:
                return m
        for m in self.models:
            if name_or_alias in m.aliases:
                return m
        return None

    def get(self, name: str) -> Model | None:
        """The model with exactly this name (aliases not considered)."""
        for m in self.models:
            if m.name == name:
                return m
        return None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    @property
    def aliases(self) -> Mapping[str, str]:
        """Alias -> model name."""
        return {a: m.name for m in self.models for a in m.aliases}

    def __iter__(self) -> Iterator[Model]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def __contains__(self, name_or_alias: object) -> bool:
        return isinstance(name_or_alias, str) and self.resolve(name_or_alias) is not None


_MERGEABLE = ("engine", "weights", "resources", "scaling", "routing", "access")
_TOP_KEYS = ("defaults", "models")


def _merge(base: YMap, over: YMap, base_path: str) -> YMap:
    """``over`` with ``base``'s keys added where ``over`` lacks them; nested
    mappings merge key by key, lists and scalars are replaced whole."""
    entries = list(over.entries)
    index = {e.key: i for i, e in enumerate(entries)}
    for b in base.entries:
        origin = b.origin or base_path
        if b.key not in index:
            entries.append(YEntry(b.key, b.key_line, b.value, origin=origin))
            continue
        mine = entries[index[b.key]]
        if isinstance(mine.value, YMap) and isinstance(b.value, YMap):
            sub = _merge(b.value, mine.value, schema.join(origin, b.key))
            entries[index[b.key]] = YEntry(mine.key, mine.key_line, sub, mine.origin)
    return YMap(tuple(entries), over.line)


def _build_catalog(root: YNode, ctx: Ctx, clusters: Sequence[str] | None = None) -> Catalog | None:
    if not isinstance(root, YMap):
        ctx.add(
            f"expected a mapping with keys defaults, models; got {describe(root)}", root.line, ""
        )
        return None
    for e in root.entries:
        if e.key not in _TOP_KEYS:
            ctx.add(schema.unknown_key_message(e.key, list(_TOP_KEYS)), e.key_line, e.key)
    defaults = YMap((), None)
    d_entry = root.get("defaults")
    if d_entry is not None and not schema.is_null(d_entry.value):
        if not isinstance(d_entry.value, YMap):
            ctx.add(
                f"expected a mapping with keys {', '.join((*_MERGEABLE, 'description'))}; "
                f"got {describe(d_entry.value)}",
                d_entry.value.line,
                "defaults",
            )
        else:
            defaults = d_entry.value
            for e in defaults.entries:
                allowed = (*_MERGEABLE, "description")
                if e.key not in allowed:
                    ctx.add(
                        schema.unknown_key_message(e.key, list(allowed))
                        + "; name and aliases belong to each model",
                        e.key_line,
                        f"defaults.{e.key}",
                    )
                elif e.key in _MERGEABLE and not (
                    isinstance(e.value, YMap) or schema.is_null(e.value)
                ):
                    ctx.add(
                        f"expected a mapping; got {describe(e.value)}",
                        e.value.line,
                        f"defaults.{e.key}",
                    )
            defaults = YMap(
                tuple(
                    e
                    for e in defaults.entries
                    if e.key in (*_MERGEABLE, "description") and not schema.is_null(e.value)
                ),
                defaults.line,
            )
    m_entry = root.get("models")
    if m_entry is None:
        ctx.add("missing required key 'models' (a list of model entries)", root.line, "models")
        return None
    items = m_entry.value
    if schema.is_null(items):
        return Catalog((), ctx.file)
    if not isinstance(items, YSeq):
        ctx.add(
            f"expected a list of model entries (each starting with '- name: ...'); "
            f"got {describe(items)}",
            items.line,
            "models",
        )
        return None
    models: list[Model] = []
    seen: dict[str, tuple[str, int | None]] = {}  # name or alias -> (what, line)
    for i, item in enumerate(items.items):
        path = f"models[{i}]"
        if isinstance(item, YMap) and defaults.entries:
            item = _merge(defaults, item, "defaults")
        model = schema.build(Model, item, path, ctx, line=items.line)
        # Uniqueness is checked on the names as written, so a clash is reported
        # even when something else in the same entry is wrong.
        if isinstance(item, YMap) and not _unique(item, i, path, seen, ctx):
            continue
        if isinstance(model, Model):
            if clusters is not None and isinstance(item, YMap):
                _check_clusters(model, item, path, clusters, ctx)
            models.append(model)
    return Catalog(tuple(models), ctx.file)


def _check_clusters(model: Model, item: YMap, path: str, known: Sequence[str], ctx: Ctx) -> None:
    """Record each name in the model's resources.clusters that server.yaml does not list."""
    res = item.get("resources")
    entry = res.value.get("clusters") if res is not None and isinstance(res.value, YMap) else None
    # Where the list was written: the model's own resources, or the defaults' (origin).
    res_path = schema.join(res.origin or path, "resources") if res is not None else path
    where = schema.join(entry.origin or res_path, "clusters") if entry else ""
    items = entry.value.items if entry is not None and isinstance(entry.value, YSeq) else ()
    for j, name in enumerate(model.resources.clusters):
        if name in known:
            continue
        line = items[j].line if j < len(items) else (entry.key_line if entry else item.line)
        valid = ", ".join(known) if any(known) else "none: server.yaml has no clusters: block"
        ctx.add(f"no cluster {name!r} in server.yaml (clusters: {valid})", line, f"{where}[{j}]")


def _text_of(node: YNode | None) -> str | None:
    if isinstance(node, YScalar) and isinstance(node.value, str):
        return node.value
    return None


def _unique(
    item: YMap, i: int, path: str, seen: dict[str, tuple[str, int | None]], ctx: Ctx
) -> bool:
    """Record this entry's name and aliases in ``seen``; False (errors added) on a clash."""
    ok = True
    name_entry = item.get("name")
    name = _text_of(name_entry.value) if name_entry else None
    if name_entry is not None and name is not None:
        if name in seen:
            what, line = seen[name]
            ctx.add(
                f"{name!r} is already used as {what} (line {line}); "
                "names and aliases must be unique",
                name_entry.key_line,
                f"{path}.name",
            )
            ok = False
        else:
            seen[name] = (f"the name of {path}", name_entry.key_line)
    alias_entry = item.get("aliases")
    if alias_entry is None or not isinstance(alias_entry.value, YSeq):
        return ok
    for j, node in enumerate(alias_entry.value.items):
        alias = _text_of(node)
        if alias is None:
            continue
        if alias in seen:
            what, line = seen[alias]
            ctx.add(
                f"alias {alias!r} is already used as {what} (line {line}); "
                "names and aliases must be unique",
                node.line,
                f"{path}.aliases[{j}]",
            )
            ok = False
        else:
            seen[alias] = (f"an alias of {path} ({name or '?'})", node.line)
    return ok


def parse_catalog(
    root: YNode | None, file: str | None = None, clusters: Sequence[str] | None = None
) -> Catalog:
    """Build a Catalog from a parsed tree; raises ConfigErrors with every problem.

    ``clusters``: the names of server.yaml's clusters, which models' resources.clusters
    must be among (None: not checked, as for a job's spec).
    """
    ctx = Ctx(file)
    if root is None:
        raise ConfigErrors(
            [
                ConfigError(
                    "file is empty; a catalog is a mapping with 'models:' (a list of models) "
                    "and optional 'defaults:'",
                    file=file,
                )
            ]
        )
    catalog = _build_catalog(root, ctx, clusters)
    ctx.raise_if_errors()
    assert catalog is not None
    return catalog


def load_catalog(path: str | Path, clusters: Sequence[str] | None = None) -> Catalog:
    """Load ``models.yaml``; raises ConfigError(s) naming every problem with file:line:field.

    ``clusters``: server.yaml's cluster names (``ServerConfig.cluster_names``), to check
    the models' resources.clusters against; None does not check them.
    """
    return parse_catalog(load_yaml(path), str(path), clusters)


SPEC_ENV = "LLMGW_REPLICA_SPEC"


def read_replica_spec(text: str | None) -> tuple[Model, list[str]]:
    """The model entry a job got in ``LLMGW_REPLICA_SPEC`` (:meth:`Model.to_spec` as JSON).

    Validated exactly as the file loader validates, except that keys this
    version does not know are skipped and returned (dotted paths), not refused:
    the daemon that wrote the spec may be newer than the agent reading it (an
    upgrade while jobs queue), and it validated its catalog already.
    """
    if not text:
        raise ConfigError(
            "not set: the daemon passes the model spec in the job environment "
            "(was this job submitted by llmgw?)",
            file=SPEC_ENV,
        )
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"not valid JSON: {err}", file=SPEC_ENV) from None
    if not isinstance(data, Mapping):
        raise ConfigError("expected a JSON object (a model entry)", file=SPEC_ENV)
    try:
        tree = from_plain(data)
    except TypeError as err:
        raise ConfigError(str(err), file=SPEC_ENV) from None
    ctx = Ctx(SPEC_ENV, ignore_unknown=True)
    model = schema.build(Model, tree, "", ctx, line=None)
    ctx.raise_if_errors()
    assert isinstance(model, Model)
    return model, ctx.ignored
