"""LLMGW_REPLICA_SPEC parsing and the job environment."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw_slurm.agent.runner import job_context_from_env
from llmgw_slurm.agent.spec import parse_replica_spec
from llmgw_slurm.errors import ConfigError


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "llama-8b",
        "engine": {"type": "vllm", "args": ["--dtype", "bfloat16"]},
        "weights": {"method": "copy", "source": "/shared/models/llama-8b"},
        "resources": {"nodes": 2, "gpus": 4},
        "min": 0,  # the daemon's business: ignored here
    }
    base.update(over)
    return base


def test_full_spec_parses() -> None:
    s = parse_replica_spec(json.dumps(spec()))
    assert s.name == "llama-8b" and s.served_name == "llama-8b"
    assert s.engine.type == "vllm" and s.engine.args == ("--dtype", "bfloat16")
    assert s.engine.health_path == "/health"
    assert s.weights.method == "copy" and s.nodes == 2 and s.gpus == 4


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"name": "Llama 8B"}, "name", "not a model name"),
        ({"engine": {"type": "tgi"}}, "engine.type", "valid: vllm, sglang, custom"),
        ({"engine": {"type": "vllm", "argz": []}}, "engine", "unknown key(s) argz"),
        ({"engine": {"type": "custom"}}, "engine.command", "needs a command"),
        ({"engine": {"type": "vllm", "command": ["x"]}}, "engine.command", "only a custom"),
        ({"engine": {"type": "vllm", "args": "--x"}}, "engine.args", "list of strings"),
        ({"engine": {"type": "vllm", "env": {"A B": "x"}}}, "engine.env", "not an environment"),
        ({"engine": {"type": "vllm", "health_path": "health"}}, "engine.health_path", "URL path"),
        ({"weights": {"method": "rsync", "source": "/x"}}, "weights.method", "valid: path"),
        ({"weights": {"method": "copy", "source": "rel/x"}}, "weights.source", "absolute"),
        ({"weights": {"method": "hf", "source": "/abs"}}, "weights.source", "org/name"),
        ({"weights": {"method": "hf", "source": "a/b", "revision": "x y"}}, "weights.revision",
         "branch"),
        ({"resources": {"nodes": 0}}, "resources.nodes", ">= 1"),
    ],
)
def test_bad_specs_name_the_field(over: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_replica_spec(json.dumps(spec(**over)))
    assert info.value.field == field
    assert words in str(info.value)
    assert str(info.value).startswith("LLMGW_REPLICA_SPEC")


@pytest.mark.parametrize("text", [None, "", "{not json", "[1]"])
def test_missing_or_broken_spec(text: str | None) -> None:
    with pytest.raises(ConfigError, match="LLMGW_REPLICA_SPEC"):
        parse_replica_spec(text)


def env(**over: str) -> dict[str, str]:
    base = {
        "LLMGW_REPLICA_ID": "0123abcd",
        "LLMGW_MODEL": "llama-8b",
        "LLMGW_DAEMON_URL": "http://login1:8080",
        "LLMGW_REPLICA_SECRET": "s3cret",
        "LLMGW_ENGINE_API_KEY": "k3y",
        "LLMGW_REPLICA_SPEC": json.dumps(spec()),
    }
    base.update(over)
    return base


def test_job_context() -> None:
    ctx = job_context_from_env(env())
    assert ctx.replica_id == "0123abcd" and ctx.engine_api_key == "k3y"


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"LLMGW_REPLICA_SECRET": ""}, "LLMGW_REPLICA_SECRET"),
        ({"LLMGW_REPLICA_ID": "XYZ"}, "LLMGW_REPLICA_ID"),
        ({"LLMGW_DAEMON_URL": "login1:8080"}, "LLMGW_DAEMON_URL"),
        ({"LLMGW_MODEL": "other"}, "LLMGW_REPLICA_SPEC"),
    ],
)
def test_bad_job_env(over: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        job_context_from_env(env(**over))
    assert info.value.field == field
