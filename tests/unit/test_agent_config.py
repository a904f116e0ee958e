"""agent.yaml (llmgw_slurm.config.AgentConfig) as the agent takes it, and CLI overrides."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from llmgw_slurm.agent.main import build_config
from llmgw_slurm.config import PortRange

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
    s = build_config(path, {})
    assert s.daemon_url == "http://login1:8001"
    assert s.weights.cache_dir == tmp_path / "cache"
    assert s.weights.method == "copy" and s.weights.allow_download is True
    assert s.engines.of("vllm").python == "/opt/engines/vllm/bin/python"
    assert dict(s.engines.of("vllm").env) == {"VLLM_NO_USAGE_STATS": "1"}
    assert s.engines.of("sglang").executable == "/opt/engines/sglang/bin/sglang"
    assert s.engines.of("command").python is None
    assert s.apptainer.binary == "singularity"
    assert s.apptainer.binds == ("/shared/models:/shared/models:ro",)
    assert s.readiness.poll_interval == 3 and s.readiness.timeout == 1200
    assert s.heartbeat_interval == 30 and s.port_range.bounds == (21000, 21999)
    assert s.log_dir == tmp_path / "logs"
    assert s.bind_host == "10.0.0.5" and s.advertise_host == "gpu01.ib"
    assert s.report_timeout == 4
    d = s.drain
    assert (d.timeout, d.poll_interval, d.grace, d.stop_grace) == (90, 1, 5, 15)
    assert s.rendezvous.dir == tmp_path / "rdzv" and s.rendezvous.timeout == 300
    # Options override the file.
    s2 = build_config(
        path,
        {"allow_hf": False, "port_range": PortRange(22000, 22010), "heartbeat_interval_s": None},
    )
    assert s2.weights.allow_download is False and s2.port_range.bounds == (22000, 22010)
    assert s2.heartbeat_interval == 30


def test_defaults_of_an_empty_agent_yaml(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("{}\n")
    s = build_config(path, {})
    assert s.daemon_url is None
    w = s.weights
    assert w.method == "auto" and w.allow_download is False and w.verify == "size"
    assert s.rendezvous.dir is None and s.bind_host == "0.0.0.0"


def test_bad_agent_yaml_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("port_range: 30000-20000\n")
    with pytest.raises(click.ClickException) as info:
        build_config(path, {})
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
        build_config(None, {"verify": "sha256"})
    s = build_config(
        None,
        {
            "cache_dir": tmp_path,
            "verify": "sha256",
            "fetch": False,
            "rendezvous_dir": tmp_path / "r",
        },
    )
    assert s.daemon_url is None and s.weights.verify == "sha256" and s.weights.fetch is False
    assert s.rendezvous.dir == tmp_path / "r"


def test_agent_yaml_sets_what_only_options_and_code_could_before(tmp_path: Path) -> None:
    # The knobs the agent had only as command-line options or built-in values
    # (--no-fetch, --python, the hf command, the engine output kept) are
    # agent.yaml's now, with the same defaults.
    import sys

    path = tmp_path / "agent.yaml"
    path.write_text("{}\n")
    s = build_config(path, {})
    assert s.weights.fetch is True and s.weights.hf_command == ("hf",)
    assert s.python is None and s.interpreter == sys.executable and s.log_tail_lines == 40
    path.write_text(
        "weights: {fetch: false, hf_command: [/opt/hf/bin/hf, --quiet]}\n"
        "python: /opt/py/bin/python3\n"
        "log_tail_lines: 5\n"
    )
    s = build_config(path, {})
    assert s.weights.fetch is False and s.weights.hf_command == ("/opt/hf/bin/hf", "--quiet")
    assert s.interpreter == "/opt/py/bin/python3" and s.log_tail_lines == 5
    # The options win over the file, as every other option does.
    s = build_config(path, {"fetch": True, "python": "/usr/bin/python3"})
    assert s.weights.fetch is True and s.interpreter == "/usr/bin/python3"
    path.write_text("log_tail_lines: 0\n")
    with pytest.raises(click.ClickException, match="log_tail_lines"):
        build_config(path, {})
