"""LLMGW_REPLICA_SPEC read through the catalog's own loader, and the job environment."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest

from llmgw_slurm.agent.runner import job_context_from_env, replica_spec
from llmgw_slurm.base.errors import ConfigError, ConfigErrors
from llmgw_slurm.catalog import read_replica_spec
from tests.agent_support import gateway_identity

GATEWAY = gateway_identity(Path(tempfile.mkdtemp(prefix="llmgw-test-gateway-")))


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "llama-8b",
        "engine": {
            "kind": "vllm",
            "args": ["--dtype", "bfloat16"],
            "env": {},
            "health_path": "/health",
        },
        "weights": {"method": "copy", "source": "/shared/models/llama-8b"},
        "resources": {"nodes": 2, "gpus": 4, "cpus": 4, "time_limit": "1-00:00:00"},
        "scaling": {"min": 0, "max": 1},
        "aliases": ["meta-llama/Llama-3.1-8B-Instruct"],
        "description": "",
    }
    base.update(over)
    return base


def test_full_spec_parses() -> None:
    s = replica_spec(json.dumps(spec()))
    assert s.name == "llama-8b"
    assert s.engine.kind == "vllm" and s.engine.args == ("--dtype", "bfloat16")
    assert s.engine.health_path == "/health"
    assert s.weights is not None and s.weights.method == "copy"
    assert s.resources.nodes == 2 and s.resources.gpus == 4


def test_method_defaults_follow_the_source() -> None:
    hf = replica_spec(json.dumps(spec(weights={"source": "hf:org/tiny@v1.2"})))
    assert hf.weights is not None and hf.weights.method == "hf"
    assert hf.weights.hf_repo == "org/tiny" and hf.weights.hf_revision == "v1.2"
    local = replica_spec(json.dumps(spec(weights={"source": "/m/tiny"})))
    assert local.weights is not None and local.weights.method == "none"
    assert local.weights.hf_repo is None


def test_command_engine_may_bring_its_own_model() -> None:
    text = json.dumps(
        spec(engine={"kind": "command", "command": ["serve", "{port}"]}, weights=None)
    )
    assert replica_spec(text).weights is None


def test_catalog_to_spec_shape_without_optional_keys() -> None:
    # Model.to_spec drops keys whose value is None.
    text = json.dumps(
        {
            "name": "tiny",
            "engine": {"kind": "sglang"},
            "weights": {"source": "/m", "method": "none"},
        }
    )
    s = replica_spec(text)
    assert s.engine.apptainer_image is None and s.engine.ready_timeout is None
    assert s.resources.nodes == 1


def test_keys_from_a_newer_daemon_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    # Version skew: a daemon upgraded while jobs queued writes keys this agent
    # does not know; it validated them, so the agent runs what it understands.
    text = json.dumps(
        spec(
            engine={"kind": "vllm", "argz": [], "future_option": 1},
            weights={"source": "/x", "revision": "v1"},
            placement={"spread": True},
        )
    )
    model, ignored = read_replica_spec(text)
    assert model.engine.kind == "vllm" and model.engine.args == ()
    assert sorted(ignored) == [
        "engine.argz",
        "engine.future_option",
        "placement",
        "weights.revision",
    ]
    with caplog.at_level(logging.WARNING):
        replica_spec(text)
    assert "ignoring keys unknown to this agent" in caplog.text
    assert "engine.future_option" in caplog.text


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"name": "Llama 8B"}, "name", "1-48 characters"),
        ({"engine": {"kind": "tgi"}}, "engine.kind", "vllm, sglang, command"),
        ({"engine": {"kind": "command"}}, "engine.command", "needs a command"),
        ({"engine": {"kind": "vllm", "command": ["x"]}}, "engine.command", "only kind 'command'"),
        ({"engine": {"kind": "vllm", "args": "--x"}}, "engine.args", "list"),
        (
            {"engine": {"kind": "vllm", "env": {"A B": "x"}}},
            "engine.env.A B",
            "environment variable",
        ),
        (
            {"engine": {"kind": "vllm", "env": {"LLMGW_REPLICA_SECRET": "x"}}},
            "engine.env.LLMGW_REPLICA_SECRET",
            "reserved",
        ),
        ({"engine": {"kind": "vllm", "health_path": "health"}}, "engine.health_path", "'/'"),
        ({"engine": {"kind": "vllm", "ready_timeout": 0}}, "engine.ready_timeout", "more than 0"),
        ({"weights": None}, "weights", "needs weights"),
        ({"weights": {"method": "rsync", "source": "/x"}}, "weights.method", "copy, hf, none"),
        ({"weights": {"method": "copy", "source": "rel/x"}}, "weights.source", "absolute"),
        ({"weights": {"method": "hf", "source": "/abs"}}, "weights.method", "hf:ORG/NAME"),
        ({"weights": {"source": "hf:a/b@x y"}}, "weights.source", "hf:ORG/NAME"),
        ({"weights": {"source": "hf:a/b", "method": "copy"}}, "weights.method", "local folder"),
        ({"engine": {"kind": "vllm", "tls": "yes"}}, "engine.tls", "true or false"),
        ({"resources": {"nodes": 0}}, "resources.nodes", "at least 1"),
    ],
)
def test_bad_specs_name_the_field(over: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigErrors) as info:
        replica_spec(json.dumps(spec(**over)))
    errors = info.value.errors
    assert [e.field for e in errors] == [field], [str(e) for e in errors]
    assert words in str(errors[0])
    assert str(errors[0]).startswith("LLMGW_REPLICA_SPEC")


@pytest.mark.parametrize("text", [None, "", "{not json", "[1]"])
def test_missing_or_broken_spec(text: str | None) -> None:
    with pytest.raises(ConfigError, match="LLMGW_REPLICA_SPEC"):
        replica_spec(text)


def env(**over: str) -> dict[str, str]:
    base = {
        "LLMGW_REPLICA_ID": "0123abcd",
        "LLMGW_MODEL": "llama-8b",
        "LLMGW_DAEMON_URL": "http://login1:8080",
        "LLMGW_REPLICA_SECRET": "s3cret",
        "LLMGW_ENGINE_API_KEY": "k3y",
        "LLMGW_REPLICA_SPEC": json.dumps(spec()),
        "LLMGW_GATEWAY_CERT": GATEWAY.cert_pem,
    }
    base.update(over)
    return base


def test_job_context() -> None:
    ctx = job_context_from_env(env())
    assert ctx.replica_id == "0123abcd" and ctx.engine_api_key == "k3y"
    assert ctx.spec.name == "llama-8b"
    assert ctx.gateway_cert == GATEWAY.cert_pem


def test_a_tls_engine_needs_the_gateway_certificate() -> None:
    with pytest.raises(ConfigError, match=r"^LLMGW_GATEWAY_CERT: not set, and the model's engine"):
        job_context_from_env(env(LLMGW_GATEWAY_CERT=""))
    with pytest.raises(ConfigError, match=r"^LLMGW_GATEWAY_CERT: expected exactly one PEM"):
        job_context_from_env(env(LLMGW_GATEWAY_CERT="not a certificate"))
    # A plain-HTTP engine (engine.tls: false) has no use for it.
    plain = spec()
    plain["engine"]["tls"] = False
    ctx = job_context_from_env(env(LLMGW_GATEWAY_CERT="", LLMGW_REPLICA_SPEC=json.dumps(plain)))
    assert ctx.spec.engine.tls is False and ctx.gateway_cert == ""


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
