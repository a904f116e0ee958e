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
"""


def test_agent_yaml_maps_onto_settings(tmp_path: Path) -> None:
    pytest.importorskip("llmgw_slurm.config")
    path = tmp_path / "agent.yaml"
    path.write_text(AGENT_YAML.format(cache=tmp_path / "cache", logs=tmp_path / "logs"))
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
    # Options override the file.
    s2, _ = build_settings(path, {"allow_hf": False, "port_range": (22000, 22010),
                                  "heartbeat_interval_s": None})
    assert s2.fetch.allow_hf is False and s2.port_range == (22000, 22010)
    assert s2.heartbeat_interval_s == 30


def test_bad_agent_yaml_is_one_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("llmgw_slurm.config")
    path = tmp_path / "agent.yaml"
    path.write_text("port_range: 30000-20000\n")
    with pytest.raises(click.ClickException) as info:
        build_settings(path, {})
    assert "agent.yaml" in info.value.message and "port_range" in info.value.message


def test_options_alone_need_a_cache_dir(tmp_path: Path) -> None:
    with pytest.raises(click.UsageError, match="--cache-dir"):
        build_settings(None, {"verify": "sha256"})
    s, url = build_settings(None, {"cache_dir": tmp_path, "verify": "sha256", "fetch": False,
                                   "rendezvous_dir": tmp_path / "r"})
    assert url is None and s.fetch.verify == "sha256" and s.fetch.enabled is False
    assert s.rendezvous_dir == tmp_path / "r"
