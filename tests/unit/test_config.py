"""server.yaml, agent.yaml, the shared tracing block, and check_files."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import typing
from pathlib import Path

import pytest

from llmgw_slurm.base.errors import ConfigError, ConfigErrors
from llmgw_slurm.catalog import Model, TimeLimit
from llmgw_slurm.config import (
    AgentConfig,
    EngineRuntime,
    HostPort,
    PortRange,
    RendezvousConfig,
    ServerConfig,
    TracingConfig,
    check_files,
    load_agent_config,
    load_server_config,
)

SITE = Path(__file__).resolve().parents[2] / "site-config"


def write(tmp_path: Path, text: str, name: str = "server.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def server_errors(tmp_path: Path, text: str) -> list[str]:
    p = write(tmp_path, text)
    with pytest.raises(ConfigErrors) as info:
        load_server_config(p)
    return [str(e).replace(str(p), "F") for e in info.value.errors]


def agent_errors(tmp_path: Path, text: str) -> list[str]:
    p = write(tmp_path, text, "agent.yaml")
    with pytest.raises(ConfigErrors) as info:
        load_agent_config(p)
    return [str(e).replace(str(p), "F") for e in info.value.errors]


# ------------------------------------------------------------------- server


def test_site_server_config_loads() -> None:
    cfg = load_server_config(SITE / "server.yaml")
    assert cfg.slurm.partition == "gpu" and cfg.slurm.backend == "cli"
    assert cfg.listen.gateway == HostPort("127.0.0.1", 8000)
    assert cfg.listen.internal == HostPort("0.0.0.0", 8001)
    assert cfg.router.max_body_bytes == 16 * 1024 * 1024
    assert cfg.tracing.resource_attributes == {"deployment.environment": "production"}
    assert cfg.state_dir == Path("/var/lib/llmgw-slurm")


def test_empty_mapping_gives_every_default(tmp_path: Path) -> None:
    cfg = load_server_config(write(tmp_path, "{}\n"))
    assert cfg.slurm == ServerConfig().slurm
    assert cfg.reconcile == ServerConfig().reconcile
    assert cfg.router == ServerConfig().router
    assert cfg.tracing == TracingConfig()
    assert cfg.slurm.job_prefix == "llmgw."
    assert (cfg.slurm.command_timeout, cfg.slurm.poll_interval) == (30.0, 5.0)
    assert cfg.reconcile.interval == 10.0 and cfg.reconcile.max_pending_time == 3600.0
    r = cfg.reconcile.restart
    assert (r.initial_backoff, r.max_backoff, r.give_up_after_failures) == (30.0, 1800.0, 5)
    # A replica stopped for another model (eviction, fair share) served 2 minutes at
    # least; one that ends within 10 minutes of serving is a failed start: apart.
    assert (cfg.reconcile.min_lifetime, r.healthy_after) == (120.0, 600.0)
    assert cfg.router.hold_timeout == 300.0 and cfg.router.retry_once is True
    assert cfg.router.keys_file is None and cfg.templates_dir is None
    assert cfg.tracing.enabled is False and cfg.tracing.protocol == "http/protobuf"
    # Default paths are next to the file, whatever folder we run in.
    assert cfg.models == tmp_path / "models.yaml"
    assert cfg.agent_config == tmp_path / "agent.yaml"
    assert cfg.state_dir == Path("~/.local/state/llmgw-slurm").expanduser()


def test_null_blocks_are_defaults_but_null_values_are_refused(tmp_path: Path) -> None:
    cfg = load_server_config(write(tmp_path, "tracing:\nrouter:\n"))
    assert cfg.tracing == TracingConfig()
    assert server_errors(tmp_path, "state_dir:\n") == [
        "F:1: state_dir: expected a path, got nothing (null); remove the key for the default"
    ]
    cfg = load_server_config(write(tmp_path, "reconcile: {max_pending_time: null}\n"))
    assert cfg.reconcile.max_pending_time is None


def test_nodes_max_age_is_a_duration_and_zero_is_every_pass(tmp_path: Path) -> None:
    assert load_server_config(write(tmp_path, "{}\n")).reconcile.nodes_max_age == 60.0
    cfg = load_server_config(write(tmp_path, "reconcile: {nodes_max_age: 2m}\n"))
    assert cfg.reconcile.nodes_max_age == 120.0
    cfg = load_server_config(write(tmp_path, "reconcile: {nodes_max_age: 0}\n"))
    assert cfg.reconcile.nodes_max_age == 0.0
    errors = server_errors(tmp_path, "reconcile: {nodes_max_age: -5}\n")
    assert len(errors) == 1 and errors[0].startswith("F:1: reconcile.nodes_max_age: ")


def test_unknown_user_in_a_path(tmp_path: Path) -> None:
    assert server_errors(tmp_path, "state_dir: ~no-such-user-llmgw/x\n") == [
        "F:1: state_dir: cannot expand '~no-such-user-llmgw/x': no such user or no home directory"
    ]


def test_relative_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    text = """\
    models: cat/models.yaml
    agent_config: /shared/agent.yaml
    templates_dir: ../templates
    state_dir: ~/state
    router: {keys_file: keys.txt}
    """
    cfg = load_server_config(write(sub, text))
    assert cfg.models == sub / "cat/models.yaml"
    assert cfg.agent_config == Path("/shared/agent.yaml")
    assert cfg.templates_dir == sub / "../templates"
    assert cfg.state_dir == Path("~/state").expanduser()
    assert cfg.router.keys_file == sub / "keys.txt"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.0.0.0:80", HostPort("0.0.0.0", 80)),
        ("login1.cluster:8000", HostPort("login1.cluster", 8000)),
        ("'[::1]:9000'", HostPort("::1", 9000)),
        ("localhost:0", HostPort("localhost", 0)),
    ],
)
def test_host_port(tmp_path: Path, text: str, expected: HostPort) -> None:
    cfg = load_server_config(write(tmp_path, f"listen: {{gateway: {text}, internal: h:1}}\n"))
    assert cfg.listen.gateway == expected
    assert str(expected) in ("0.0.0.0:80", "login1.cluster:8000", "[::1]:9000", "localhost:0")


def test_bad_host_ports_and_urls(tmp_path: Path) -> None:
    text = """\
    listen:
      gateway: 8000
      internal: "host:99999"
      daemon_url: ftp://x
    """
    assert server_errors(tmp_path, text) == [
        "F:2: listen.gateway: expected HOST:PORT, e.g. 127.0.0.1:8000, 0.0.0.0:8001 or "
        "[::1]:8000; got the integer 8000",
        "F:3: listen.internal: port 99999 is out of range 0-65535",
        "F:4: listen.daemon_url: 'ftp://x' is not valid: expected an http:// or https:// URL, "
        "e.g. http://login1:8001",
    ]
    text = "listen: {gateway: 'a:1', internal: 'b:1', daemon_url: 'ftp://x'}\n"
    assert server_errors(tmp_path, text) == [
        "F:1: listen.daemon_url: 'ftp://x' is not valid: expected an http:// or https:// URL, "
        "e.g. http://login1:8001",
    ]
    text = "listen: {gateway: 'a:1', internal: 'b:1'}\n"
    assert server_errors(tmp_path, text) == [
        "F:1: listen.internal: the gateway already uses port 1"
    ]


def test_advertised_daemon_url() -> None:
    cfg = ServerConfig()
    assert cfg.listen.advertised_daemon_url("login1") == "http://login1:8001"
    cfg = load_server_config(SITE / "server.yaml")
    assert cfg.listen.advertised_daemon_url("x") == "http://x:8001"


def test_server_errors_are_all_reported_with_suggestions(tmp_path: Path) -> None:
    text = """\
    slurm:
      backend: slurmrestd
      partiton: gpu
      job_prefix: "my jobs"
      command_timeout: fast
    reconcile:
      restart: {initial_backoff: 1h, max_backoff: 10m, give_up_after_failures: 0, healthy_after: 0}
    router:
      max_body_bytes: 12 parsecs
      retry_once: "yes"
    gatway: 1
    """
    assert server_errors(tmp_path, text) == [
        "F:2: slurm.backend: expected one of: cli, pyslurm, rest; got the string 'slurmrestd'",
        "F:3: slurm.partiton: unknown key 'partiton'; did you mean 'partition'? (valid keys: "
        "account, backend, command_timeout, job_prefix, partition, poll_interval, qos, "
        "reservation, rest)",
        "F:4: slurm.job_prefix: 'my jobs' is not valid: expected 1-32 characters: letters, "
        "digits, '.', '_', '-'",
        "F:5: slurm.command_timeout: cannot read 'fast' as a duration; expected a duration "
        "like 30s, 15m, 4h, 1d, 2w, 1h30m, 4:00:00, or a number of seconds",
        "F:7: reconcile.restart.give_up_after_failures: must be at least 1; got 0",
        "F:7: reconcile.restart.healthy_after: must be more than 0; got 0",
        "F:9: router.max_body_bytes: cannot read '12 parsecs' as a size; expected a size in "
        "bytes, or with a unit: 512K, 16M, 16MiB, 1G",
        "F:10: router.retry_once: expected true or false, got the string 'yes'",
        "F:11: gatway: unknown key 'gatway' (valid keys: admin_group, admin_socket, "
        "agent_config, batch, clusters, connections, database, listen, login, models, quotas, "
        "reconcile, router, runtime_dir, scaling, slurm, state_dir, templates_dir, tls, tracing)",
    ]
    text = "reconcile: {restart: {initial_backoff: 1h, max_backoff: 10m}}\n"
    assert server_errors(tmp_path, text) == [
        "F:1: reconcile.restart.initial_backoff: initial_backoff (3600s) is more than "
        "max_backoff (600s)"
    ]
    text = "router: {max_held: 2000}\n"
    assert server_errors(tmp_path, text) == [
        "F:1: router.max_held_total: max_held_total (1024) is less than max_held (2000), "
        "the cap of one model"
    ]


def test_fair_share_is_on_by_default_and_each_setting_is_read_and_checked(tmp_path: Path) -> None:
    cfg = load_server_config(write(tmp_path, "state_dir: /tmp/x\n"))
    assert (cfg.scaling.fair_share, cfg.scaling.max_wait, cfg.scaling.min_slice) == (
        True,
        120.0,
        120.0,
    )
    text = "scaling: {fair_share: false, max_wait: 5m, min_slice: 1h}\n"
    cfg = load_server_config(write(tmp_path, text))
    assert (cfg.scaling.fair_share, cfg.scaling.max_wait, cfg.scaling.min_slice) == (
        False,
        300.0,
        3600.0,
    )
    assert server_errors(tmp_path, "scaling: {max_wait: 0, min_slice: soon, fair: 1}\n") == [
        "F:1: scaling.fair: unknown key 'fair' (valid keys: fair_share, max_wait, min_slice)",
        "F:1: scaling.max_wait: must be more than 0; got 0",
        "F:1: scaling.min_slice: cannot read 'soon' as a duration; expected a duration like "
        "30s, 15m, 4h, 1d, 2w, 1h30m, 4:00:00, or a number of seconds",
    ]


@pytest.mark.parametrize(
    ("text", "size"), [("1048576", 1048576), ("512K", 524288), ("16MiB", 16777216), ("1g", 2**30)]
)
def test_sizes(tmp_path: Path, text: str, size: int) -> None:
    cfg = load_server_config(write(tmp_path, f"router: {{max_body_bytes: {text}}}\n"))
    assert cfg.router.max_body_bytes == size


def test_empty_and_non_mapping_server_files(tmp_path: Path) -> None:
    p = write(tmp_path, "")
    with pytest.raises(ConfigError) as info:
        load_server_config(p)
    assert str(info.value) == (
        f"{p}: file is empty; a server config is a mapping with keys: slurm, clusters, listen, "
        "connections, state_dir, models, agent_config, templates_dir, reconcile, router, scaling, "
        "tracing, batch, tls, runtime_dir, admin_socket, admin_group, login, quotas, database"
    )
    assert server_errors(tmp_path, "- a\n") == [
        "F:1: expected a mapping with keys slurm, clusters, listen, connections, state_dir, models, "
        "agent_config, templates_dir, reconcile, router, scaling, tracing, batch, tls, runtime_dir, "
        "admin_socket, admin_group, login, quotas, database; got a list"
    ]


# -------------------------------------------------------------------- tracing


def test_tracing_block_is_the_same_in_both_files(tmp_path: Path) -> None:
    block = """\
    tracing:
      enabled: true
      service_name: gw
      endpoint: https://otel.example:4318/v1
      protocol: grpc
      headers: {Authorization: Bearer abc, x-team: hpc}
      sampling_ratio: 0.25
      resource_attributes: {deployment.environment: test}
    """
    server = load_server_config(write(tmp_path, block))
    agent = load_agent_config(write(tmp_path, block, "agent.yaml"))
    assert server.tracing == agent.tracing
    t = server.tracing
    assert t.enabled and t.service_name == "gw" and t.protocol == "grpc"
    assert t.headers == {"Authorization": "Bearer abc", "x-team": "hpc"}
    assert t.sampling_ratio == 0.25 and t.endpoint == "https://otel.example:4318/v1"


def test_tracing_errors(tmp_path: Path) -> None:
    text = """\
    tracing:
      enabled: 1
      protocol: http
      sampling_ratio: 1.5
      headers: {"bad header": x}
      endpont: http://x
    """
    expected = [
        "F:2: tracing.enabled: expected true or false, got the integer 1",
        "F:3: tracing.protocol: expected one of: http/protobuf, grpc; got the string 'http'",
        "F:4: tracing.sampling_ratio: must be at most 1; got 1.5",
        "F:5: tracing.headers.bad header: 'bad header' is not a valid name: expected a header name",
        "F:6: tracing.endpont: unknown key 'endpont'; did you mean 'endpoint'? (valid keys: "
        "enabled, endpoint, headers, keep_spans, protocol, resource_attributes, "
        "sampling_ratio, service_name)",
    ]
    assert server_errors(tmp_path, text) == expected
    assert agent_errors(tmp_path, text) == expected
    assert server_errors(tmp_path, "tracing: {endpoint: 'localhost:4318'}\n") == [
        "F:1: tracing.endpoint: 'localhost:4318' is not valid: expected an http:// or https:// "
        "URL, e.g. http://login1:8001"
    ]


# ---------------------------------------------------------------------- agent


def test_site_agent_config_loads() -> None:
    cfg = load_agent_config(SITE / "agent.yaml")
    assert cfg.engines.vllm.python == "/opt/engines/vllm/bin/python"
    assert cfg.engines.vllm.env == {"VLLM_NO_USAGE_STATS": "1"}
    assert cfg.apptainer.binds == ("/shared/models:/shared/models:ro",)
    assert cfg.port_range == PortRange(20000, 29999)
    assert cfg.readiness.timeout == 900.0


def test_agent_defaults(tmp_path: Path) -> None:
    cfg = load_agent_config(write(tmp_path, "{}\n", "agent.yaml"))
    assert cfg == AgentConfig()
    assert cfg.daemon_url is None and cfg.log_dir is None
    assert cfg.weights.cache_dir == Path("/tmp/llmgw-weights")
    assert (cfg.weights.method, cfg.weights.allow_download) == ("auto", False)
    assert cfg.engines.sglang == EngineRuntime()
    assert cfg.apptainer.binary == "apptainer" and cfg.apptainer.binds == ()
    assert (cfg.readiness.poll_interval, cfg.readiness.timeout) == (2.0, 900.0)
    assert cfg.heartbeat_interval == 15.0
    assert 20000 in cfg.port_range and 30000 not in cfg.port_range
    assert str(cfg.port_range) == "20000-29999"
    assert (cfg.weights.verify, cfg.weights.lock_timeout) == ("size", 21600.0)
    assert (cfg.bind_host, cfg.advertise_host, cfg.report_timeout) == ("0.0.0.0", None, 10.0)
    d = cfg.drain
    assert (d.timeout, d.poll_interval, d.grace, d.stop_grace) == (120.0, 2.0, 10.0, 20.0)
    assert (cfg.rendezvous.dir, cfg.rendezvous.timeout) == (None, 600.0)


def test_agent_job_knobs(tmp_path: Path) -> None:
    text = """\
    weights: {verify: sha256, lock_timeout: 1h}
    advertise_host: node1.ib
    drain: {timeout: 5m, stop_grace: 1m}
    rendezvous: {dir: rdv, timeout: 90s}
    """
    cfg = load_agent_config(write(tmp_path, text, "agent.yaml"))
    assert (cfg.weights.verify, cfg.weights.lock_timeout) == ("sha256", 3600.0)
    assert cfg.advertise_host == "node1.ib"
    assert (cfg.drain.timeout, cfg.drain.stop_grace, cfg.drain.grace) == (300.0, 60.0, 10.0)
    assert cfg.rendezvous == RendezvousConfig(dir=tmp_path / "rdv", timeout=90.0)
    text = """\
    weights: {verify: md5}
    bind_host: "0.0.0.0; rm -rf /"
    drain: {stoop_grace: 1s}
    """
    assert agent_errors(tmp_path, text) == [
        "F:1: weights.verify: expected one of: size, sha256; got the string 'md5'",
        "F:2: bind_host: '0.0.0.0; rm -rf /' is not valid: expected an address or host name",
        "F:3: drain.stoop_grace: unknown key 'stoop_grace'; did you mean 'stop_grace'? (valid "
        "keys: grace, poll_interval, stop_grace, timeout)",
    ]


def test_daemon_url_from_environment_wins() -> None:
    from llmgw_slurm.agent.main import job_environment

    env = job_environment({"LLMGW_DAEMON_URL": "http://env:2", "X": "1"}, "http://file:1")
    assert env == {"LLMGW_DAEMON_URL": "http://env:2", "X": "1"}
    assert job_environment({}, "http://file:1") == {"LLMGW_DAEMON_URL": "http://file:1"}
    assert job_environment({}, None) == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("'21000-21009'", PortRange(21000, 21009)), ("[21000, 21000]", PortRange(21000, 21000))],
)
def test_port_range_forms(tmp_path: Path, text: str, expected: PortRange) -> None:
    cfg = load_agent_config(write(tmp_path, f"port_range: {text}\n", "agent.yaml"))
    assert cfg.port_range == expected


def test_agent_errors(tmp_path: Path) -> None:
    text = """\
    daemon_url: login1:8001
    weights: {method: rsync, allow_download: maybe}
    engines:
      vllm: {python: /a/python, executable: /a/vllm}
      command: {python: /b/python}
      tgi: {}
    apptainer: {binds: ["/a:/b:ro", "relative:/x", "/a,/b"]}
    port_range: 30000-20000
    readiness: {timeout: -5}
    log_dir: [logs]
    """
    assert agent_errors(tmp_path, text) == [
        "F:1: daemon_url: 'login1:8001' is not valid: expected an http:// or https:// URL, "
        "e.g. http://login1:8001",
        "F:2: weights.method: expected one of: auto, copy, hf, none; got the string 'rsync'",
        "F:2: weights.allow_download: expected true or false, got the string 'maybe'",
        "F:4: engines.vllm.executable: set python or executable, not both",
        "F:6: engines.tgi: unknown key 'tgi' (valid keys: command, sglang, vllm)",
        "F:7: apptainer.binds[1]: 'relative:/x' is not valid: expected SRC[:DST][:ro|rw] with "
        "absolute paths, no commas",
        "F:7: apptainer.binds[2]: '/a,/b' is not valid: expected SRC[:DST][:ro|rw] with "
        "absolute paths, no commas",
        "F:8: port_range: 30000-20000 is not valid: expected a port range like 20000-29999 "
        "(or [20000, 29999]) within 1024-65535, first <= last",
        "F:9: readiness.timeout: a duration must be zero or more; got '-5'",
        "F:10: log_dir: expected a path, got a list",
    ]
    # The command engine's check runs once the block itself is valid.
    text = "engines:\n  command: {python: /b/python}\n"
    assert agent_errors(tmp_path, text) == [
        "F:2: engines.command: a command engine's program comes from the catalog; only env "
        "applies here"
    ]


# --------------------------------------------------------------- check_files


def test_check_files_site_config_is_clean() -> None:
    assert (
        check_files(
            models=SITE / "models.yaml", server=SITE / "server.yaml", agent=SITE / "agent.yaml"
        )
        == []
    )
    assert check_files() == []


def test_check_files_collects_every_file_s_errors(tmp_path: Path) -> None:
    models = write(tmp_path, "models: 3\n", "models.yaml")
    server = write(tmp_path, "slurm: {qos: [a]}\nrouter: {max_held: -1}\n")
    errs = check_files(models=models, server=server, agent=tmp_path / "missing.yaml")
    assert [(e.file, e.line, e.field) for e in errs] == [
        (str(models), 1, "models"),
        (str(server), 1, "slurm.qos"),
        (str(server), 2, "router.max_held"),
        (str(tmp_path / "missing.yaml"), None, ""),
    ]
    assert str(errs[-1]) == f"{tmp_path / 'missing.yaml'}: file not found"
    assert check_files(agent=server) != []  # a server file is not an agent file


# ----------------------------------------------------------------------- docs


def _schema_fields(cls: type, seen: set[type]) -> set[str]:
    """Every field name of ``cls`` and of the dataclasses it nests."""
    if cls in seen:
        return set()
    seen.add(cls)
    names: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        names.add(f.name)
        for tp in (hints[f.name], *typing.get_args(hints[f.name])):
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                names |= _schema_fields(tp, seen)
    return names


def test_docs_name_every_field() -> None:
    doc = (SITE.parent / "docs" / "configuration.md").read_text()
    seen: set[type] = {HostPort, PortRange, TimeLimit}  # values, not blocks
    names = set()
    for cls in (ServerConfig, AgentConfig, Model):
        names |= _schema_fields(cls, seen)
    missing = sorted(n for n in names if not re.search(rf"`([\w.]+\.)?{n}`", doc))
    assert missing == []
