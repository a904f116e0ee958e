"""agent.yaml (llmgw_slurm.config.AgentConfig) to the agent's settings, and CLI overrides."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from llmgw_slurm.agent.main import build_settings

AGENT_YAML = """\
weights:
  cache_dir: {cache}
  method: copy
  allow_download: true
engines:
  vllm:
    python: /opt/engines/vllm/bin/python
    env: {{VLLM_NO_USAGE_STATS: "1"}}
  sglang:
    executable: /opt/engines/sglang/bin/sglang
apptainer:
  binary: singularity
  binds: [/shared/models:/shared/models:ro]
readiness:
  poll_interval: 3s
  timeout: 20m
heartbeat_interval: 30s
port_range: 21000-21999
log_dir: {logs}
daemon_url: http://login1:8001
bind_host: 10.0.0.5
advertise_host: gpu01.ib
report_timeout: 4s
drain:
  timeout: 90s
  poll_interval: 1s
  grace: 5s
  stop_grace: 15s
rendezvous:
  dir: {rdzv}
  timeout: 5m
"""


def test_agent_yaml_maps_onto_settings(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        AGENT_YAML.format(cache=tmp_path / "cache", logs=tmp_path / "logs", rdzv=tmp_path / "rdzv")
    )
    s, daemon_url = build_settings(path, {})
    assert daemon_url == "http://login1:8001"
    assert s.fetch.cache_dir == tmp_path / "cache"
    assert s.fetch.method == "copy" and s.fetch.allow_hf is True
    assert s.runtime("vllm").python == "/opt/engines/vllm/bin/python"
    assert dict(s.runtime("vllm").env) == {"VLLM_NO_USAGE_STATS": "1"}
    assert s.runtime("sglang").executable == "/opt/engines/sglang/bin/sglang"
    assert s.runtime("command").python is None
    assert s.apptainer == "singularity"
    assert s.apptainer_binds == ("/shared/models:/shared/models:ro",)
    assert s.ready_poll_s == 3 and s.ready_timeout_s == 1200
    assert s.heartbeat_interval_s == 30 and s.port_range == (21000, 21999)
    assert s.log_dir == tmp_path / "logs"
    assert s.bind_host == "10.0.0.5" and s.advertise_host == "gpu01.ib"
    assert s.report_timeout_s == 4
    assert (s.drain_timeout_s, s.drain_poll_s, s.drain_grace_s, s.stop_grace_s) == (90, 1, 5, 15)
    assert s.rendezvous_dir == tmp_path / "rdzv" and s.rendezvous_timeout_s == 300
    # Options override the file.
    s2, _ = build_settings(
        path, {"allow_hf": False, "port_range": (22000, 22010), "heartbeat_interval_s": None}
    )
    assert s2.fetch.allow_hf is False and s2.port_range == (22000, 22010)
    assert s2.heartbeat_interval_s == 30


def test_defaults_of_an_empty_agent_yaml(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("{}\n")
    s, url = build_settings(path, {})
    assert url is None
    assert s.fetch.method == "auto" and s.fetch.allow_hf is False and s.fetch.verify == "size"
    assert s.rendezvous_dir is None and s.bind_host == "0.0.0.0"


def test_bad_agent_yaml_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("port_range: 30000-20000\n")
    with pytest.raises(click.ClickException) as info:
        build_settings(path, {})
    assert "agent.yaml" in info.value.message and "port_range" in info.value.message


def test_catalog_spec_round_trips_into_the_agent() -> None:
    # What the daemon sends (Model.to_spec_json) is what the agent reads: the same type.
    import json

    from llmgw_slurm.agent.runner import replica_spec
    from llmgw_slurm.catalog import read_replica_spec

    entry = {
        "name": "llama-8b",
        "aliases": ["meta-llama/Llama-3.1-8B-Instruct"],
        "engine": {
            "kind": "vllm",
            "args": ["--max-model-len", "8192"],
            "apptainer_image": "/images/vllm.sif",
            "env": {"A": "1"},
            "ready_timeout": 1200,
        },
        "weights": {"source": "hf:meta-llama/Llama-3.1-8B-Instruct@main"},
        "resources": {"gpus": 4, "nodes": 2, "time_limit": "1-00:00:00", "memory": "64G"},
        "scaling": {"min": 1, "max": 2},
    }
    model, ignored = read_replica_spec(json.dumps(entry))
    assert ignored == []
    spec = replica_spec(model.to_spec_json())
    assert spec == model
    assert spec.name == "llama-8b" and spec.resources.nodes == 2 and spec.resources.gpus == 4
    assert spec.engine.kind == "vllm" and spec.engine.args == ("--max-model-len", "8192")
    assert spec.engine.apptainer_image == "/images/vllm.sif"
    assert dict(spec.engine.env) == {"A": "1"} and spec.engine.ready_timeout == 1200
    assert spec.weights is not None and spec.weights.method == "hf"
    assert spec.weights.hf_repo == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.weights.hf_revision == "main"
    command = {"name": "cmd", "engine": {"kind": "command", "command": ["serve", "{port}"]}}
    model, _ = read_replica_spec(json.dumps(command))
    assert replica_spec(model.to_spec_json()).weights is None


def test_options_alone_need_a_cache_dir(tmp_path: Path) -> None:
    with pytest.raises(click.UsageError, match="--cache-dir"):
        build_settings(None, {"verify": "sha256"})
    s, url = build_settings(
        None,
        {
            "cache_dir": tmp_path,
            "verify": "sha256",
            "fetch": False,
            "rendezvous_dir": tmp_path / "r",
        },
    )
    assert url is None and s.fetch.verify == "sha256" and s.fetch.enabled is False
    assert s.rendezvous_dir == tmp_path / "r"
