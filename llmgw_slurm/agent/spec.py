"""The model spec an agent receives in ``LLMGW_REPLICA_SPEC``.

The daemon serialises the catalog's model entry as JSON into the job's
environment. The agent reads the parts it acts on (``engine``, ``weights``,
``resources``) and leaves the rest (scaling, aliases, ...) to the daemon:
unknown top-level keys are ignored, but unknown keys inside the parts the
agent acts on are refused, because a misspelt engine option silently ignored
is a replica that starts wrong.

Shape (every key but ``name`` optional unless said)::

    {"name": "llama-8b",
     "served_name": "llama-8b",                 # default: name
     "engine": {"type": "vllm"|"sglang"|"custom",
                "args": ["--dtype", "bfloat16"], # extra engine arguments
                "command": ["prog", "--port", "{port}"],  # custom only, required there
                "env": {"K": "V"},
                "python": "/opt/engines/vllm-0.6/bin/python",  # default: the agent's
                "image": "/opt/images/vllm.sif",  # run inside `apptainer exec --nv`
                "health_path": "/health",
                "metrics_path": "/metrics",
                "ready_timeout_s": 1800},
     "weights": {"method": "path"|"copy"|"hf",   # default: path
                 "source": "/shared/models/llama-8b" | "org/repo",
                 "revision": "main"},             # hf only
     "resources": {"nodes": 1, "gpus": 1}}
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw_slurm.errors import ConfigError

__all__ = [
    "ENGINE_TYPES",
    "WEIGHT_METHODS",
    "EngineSpec",
    "ReplicaSpec",
    "WeightsSpec",
    "parse_replica_spec",
]

ENGINE_TYPES = ("vllm", "sglang", "custom")
WEIGHT_METHODS = ("path", "copy", "hf")
_MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,47}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WHERE = "LLMGW_REPLICA_SPEC"


@dataclass(frozen=True)
class EngineSpec:
    type: str
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    python: str | None = None
    image: str | None = None
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    ready_timeout_s: float | None = None


@dataclass(frozen=True)
class WeightsSpec:
    method: str = "path"
    source: str = ""
    revision: str | None = None


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    served_name: str
    engine: EngineSpec
    weights: WeightsSpec
    nodes: int = 1
    gpus: int = 0


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
        "type", "args", "command", "env", "python", "image",
        "health_path", "metrics_path", "ready_timeout_s", "version",
    )
    obj = _obj(raw, "engine", allowed)
    etype = obj.get("type")
    if etype not in ENGINE_TYPES:
        raise _err("engine.type", f"{etype!r} is not an engine; valid: {', '.join(ENGINE_TYPES)}")
    command = _str_list(obj.get("command", []), "engine.command")
    if etype == "custom" and not command:
        raise _err("engine.command", "a custom engine needs a command (a list of arguments)")
    if etype != "custom" and command:
        raise _err("engine.command", f"only a custom engine takes a command, not {etype}")
    env_raw = obj.get("env", {})
    if not isinstance(env_raw, dict):
        raise _err("engine.env", "expected an object of NAME: value")
    env: dict[str, str] = {}
    for k, v in env_raw.items():
        if not isinstance(k, str) or not _ENV_NAME.fullmatch(k):
            raise _err("engine.env", f"{k!r} is not an environment variable name")
        env[k] = _str(v, f"engine.env.{k}", empty=True)
    timeout = obj.get("ready_timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise _err("engine.ready_timeout_s", f"expected a positive number, got {timeout!r}")
    return EngineSpec(
        type=etype,
        args=_str_list(obj.get("args", []), "engine.args"),
        command=command,
        env=env,
        python=_str(obj["python"], "engine.python") if obj.get("python") is not None else None,
        image=_str(obj["image"], "engine.image") if obj.get("image") is not None else None,
        health_path=_path_in_url(obj.get("health_path", "/health"), "engine.health_path"),
        metrics_path=_path_in_url(obj.get("metrics_path", "/metrics"), "engine.metrics_path"),
        ready_timeout_s=float(timeout) if timeout is not None else None,
    )


def _weights(raw: Any) -> WeightsSpec:
    obj = _obj(raw, "weights", ("method", "source", "revision"))
    method = obj.get("method", "path")
    if method not in WEIGHT_METHODS:
        raise _err(
            "weights.method", f"{method!r} is not a method; valid: {', '.join(WEIGHT_METHODS)}"
        )
    source = _str(obj.get("source"), "weights.source")
    revision = obj.get("revision")
    if method in ("path", "copy") and not source.startswith("/"):
        raise _err("weights.source", f"method {method} needs an absolute path, got {source!r}")
    if method == "hf" and not _HF_REPO.fullmatch(source):
        raise _err(
            "weights.source", f"method hf needs a repository id like org/name, got {source!r}"
        )
    if revision is not None:
        if method != "hf":
            raise _err("weights.revision", f"only method hf takes a revision, not {method}")
        if not isinstance(revision, str) or not _REVISION.fullmatch(revision):
            raise _err("weights.revision", f"expected a branch, tag or commit, got {revision!r}")
    return WeightsSpec(method=method, source=source, revision=revision)


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
    served = _str(raw.get("served_name", name), "served_name")
    resources = _obj(raw.get("resources", {}), "resources", ("nodes", "gpus", "gpu_type",
                                                             "cpus_per_task", "mem",
                                                             "constraint", "time"))
    return ReplicaSpec(
        name=name,
        served_name=served,
        engine=_engine(raw.get("engine")),
        weights=_weights(raw.get("weights")),
        nodes=_int(resources.get("nodes", 1), "resources.nodes", 1),
        gpus=_int(resources.get("gpus", 0), "resources.gpus", 0),
    )
