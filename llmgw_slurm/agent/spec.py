"""The model spec an agent receives in ``LLMGW_REPLICA_SPEC``.

The daemon serialises the catalog's model entry (``catalog.Model.to_spec``)
as JSON into the job's environment. The agent reads the parts it acts on
(``engine``, ``weights``, ``resources.nodes/gpus``) and leaves the rest
(scaling, aliases, ...) to the daemon: unknown keys outside ``engine`` and
``weights`` are ignored, unknown keys inside them are refused, because a
misspelt engine option silently ignored is a replica that starts wrong.

Shape (as the catalog writes it; absent means default)::

    {"name": "llama-8b",
     "engine": {"kind": "vllm"|"sglang"|"command",
                "args": ["--dtype", "bfloat16"],
                "command": ["prog", "--port", "{port}"],   # kind command only
                "apptainer_image": "/images/vllm.sif",     # run in `apptainer exec --nv`
                "env": {"K": "V"},
                "health_path": "/health",
                "ready_timeout": 1800.0},
     "weights": {"source": "/shared/models/x" | "hf:ORG/NAME[@REV]",
                 "method": "copy"|"hf"|"none"},   # default: hf for hf:, else none
     "resources": {"nodes": 1, "gpus": 1, ...}}
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw_slurm.errors import ConfigError

__all__ = [
    "ENGINE_KINDS",
    "WEIGHT_METHODS",
    "EngineSpec",
    "ReplicaSpec",
    "WeightsSpec",
    "parse_replica_spec",
]

ENGINE_KINDS = ("vllm", "sglang", "command")
WEIGHT_METHODS = ("copy", "hf", "none")
_MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,47}$")
_HF_SOURCE = re.compile(
    r"^hf:(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{0,99}))?$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WHERE = "LLMGW_REPLICA_SPEC"


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    apptainer_image: str | None = None
    health_path: str = "/health"
    ready_timeout_s: float | None = None
    tls: bool = True
    # Not in the catalog: where vLLM and SGLang report their request gauges.
    metrics_path: str = "/metrics"


@dataclass(frozen=True)
class WeightsSpec:
    """``source`` an absolute path or ``hf:ORG/NAME[@REV]``; ``method`` copy, hf or none."""

    source: str
    method: str = "none"

    @property
    def hf_repo(self) -> str | None:
        m = _HF_SOURCE.fullmatch(self.source)
        return m.group("repo") if m else None

    @property
    def hf_revision(self) -> str | None:
        m = _HF_SOURCE.fullmatch(self.source)
        return m.group("rev") if m else None


@dataclass(frozen=True)
class ReplicaSpec:
    """``weights`` None: a command engine that brings its own model."""

    name: str
    engine: EngineSpec
    weights: WeightsSpec | None
    nodes: int = 1
    gpus: int = 0

    @property
    def served_name(self) -> str:
        # The router resolves aliases to the model name before forwarding.
        return self.name


def _err(field_: str, message: str) -> ConfigError:
    return ConfigError(message, file=_WHERE, field=field_)


def _obj(value: Any, field_: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _err(field_, f"expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise _err(field_, f"unknown key(s) {', '.join(unknown)}; valid: {', '.join(allowed)}")
    return value


def _str(value: Any, field_: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise _err(field_, f"expected a non-empty string, got {value!r}")
    if "\0" in value:
        raise _err(field_, "NUL byte in a string")
    return value


def _str_list(value: Any, field_: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _err(field_, f"expected a list of strings, got {type(value).__name__}")
    return tuple(_str(v, f"{field_}[{i}]", empty=True) for i, v in enumerate(value))


def _int(value: Any, field_: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _err(field_, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _path_in_url(value: Any, field_: str) -> str:
    text = _str(value, field_)
    if not text.startswith("/") or any(c.isspace() for c in text):
        raise _err(field_, f"expected a URL path like /health, got {text!r}")
    return text


def _engine(raw: Any) -> EngineSpec:
    allowed = (
        "kind",
        "args",
        "command",
        "env",
        "apptainer_image",
        "health_path",
        "ready_timeout",
        "tls",
    )
    obj = _obj(raw, "engine", allowed)
    kind = obj.get("kind")
    if kind not in ENGINE_KINDS:
        raise _err("engine.kind", f"{kind!r} is not an engine; valid: {', '.join(ENGINE_KINDS)}")
    command = _str_list(obj.get("command", []), "engine.command")
    if kind == "command" and not command:
        raise _err("engine.command", "kind command needs a command (a list of arguments)")
    if kind != "command" and command:
        raise _err("engine.command", f"only kind command takes a command, not {kind}")
    env_raw = obj.get("env", {})
    if not isinstance(env_raw, dict):
        raise _err("engine.env", "expected an object of NAME: value")
    env: dict[str, str] = {}
    for k, v in env_raw.items():
        if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
            raise _err("engine.env", f"{k!r} is not an environment variable name")
        if k.startswith("LLMGW_") or k in ("TRACEPARENT", "TRACESTATE"):
            raise _err(f"engine.env.{k}", "reserved for llmgw (replica identity or trace)")
        env[k] = _str(v, f"engine.env.{k}", empty=True)
    timeout = obj.get("ready_timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise _err("engine.ready_timeout", f"expected a positive number, got {timeout!r}")
    image = obj.get("apptainer_image")
    tls = obj.get("tls", True)
    if not isinstance(tls, bool):
        raise _err("engine.tls", f"expected true or false, got {tls!r}")
    return EngineSpec(
        kind=kind,
        args=_str_list(obj.get("args", []), "engine.args"),
        command=command,
        env=env,
        apptainer_image=_str(image, "engine.apptainer_image") if image is not None else None,
        health_path=_path_in_url(obj.get("health_path", "/health"), "engine.health_path"),
        ready_timeout_s=float(timeout) if timeout is not None else None,
        tls=tls,
    )


def _weights(raw: Any) -> WeightsSpec | None:
    if raw is None:
        return None
    obj = _obj(raw, "weights", ("source", "method"))
    source = _str(obj.get("source"), "weights.source")
    is_hf = source.startswith("hf:")
    method = obj.get("method", "hf" if is_hf else "none")
    if method not in WEIGHT_METHODS:
        raise _err(
            "weights.method", f"{method!r} is not a method; valid: {', '.join(WEIGHT_METHODS)}"
        )
    if is_hf:
        if not _HF_SOURCE.fullmatch(source):
            raise _err("weights.source", f"{source!r} is not hf:ORG/NAME or hf:ORG/NAME@revision")
        if method == "copy":
            raise _err("weights.method", "copy stages a local folder; an hf: source uses hf")
    else:
        if not source.startswith("/"):
            raise _err(
                "weights.source", f"expected an absolute path or hf:ORG/NAME, got {source!r}"
            )
        if method == "hf":
            raise _err("weights.method", "method hf needs an hf:ORG/NAME source")
    return WeightsSpec(source=source, method=method)


def parse_replica_spec(text: str | None) -> ReplicaSpec:
    """Parse ``LLMGW_REPLICA_SPEC``; raises ConfigError naming the bad field."""
    if not text:
        raise ConfigError(
            "not set: the daemon passes the model spec in the job environment "
            "(was this job submitted by llmgw?)",
            file=_WHERE,
        )
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"not valid JSON: {err}", file=_WHERE) from err
    if not isinstance(raw, dict):
        raise _err("", f"expected a JSON object, got {type(raw).__name__}")
    name = _str(raw.get("name"), "name")
    if not _MODEL_NAME.fullmatch(name):
        raise _err("name", f"{name!r} is not a model name; valid: ^[a-z0-9][a-z0-9._-]{{0,47}}$")
    resources = raw.get("resources", {})
    if not isinstance(resources, dict):
        raise _err("resources", "expected an object")
    engine = _engine(raw.get("engine"))
    weights = _weights(raw.get("weights"))
    if weights is None and engine.kind != "command":
        raise _err("weights", f"a {engine.kind} engine needs weights")
    return ReplicaSpec(
        name=name,
        engine=engine,
        weights=weights,
        nodes=_int(resources.get("nodes", 1), "resources.nodes", 1),
        gpus=_int(resources.get("gpus", 0), "resources.gpus", 0),
    )
