"""Several clusters without Slurm: server.yaml's clusters, models' resources.clusters,
job names that carry the cluster, and how the command-line backend reaches a cluster
(SLURM_CONF, -M, sbatch --test-only), with stub commands standing in for Slurm's.

The same, against two real clusters, is tests/clusters.
"""

from __future__ import annotations

import stat
import textwrap
from datetime import datetime
from pathlib import Path

import pytest

from llmgw_slurm.base.errors import ConfigError, ConfigErrors, SlurmError
from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.config import check_files, load_server_config
from llmgw_slurm.reconciler.jobs import JobBuilder, job_name, parse_job_ident, parse_job_name
from llmgw_slurm.slurm import JobSpec, StartEstimator, make_backends
from llmgw_slurm.slurm.cli import CliBackend


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


def messages(exc: ConfigError) -> list[str]:
    errs = exc.errors if isinstance(exc, ConfigErrors) else [exc]
    return [str(e).split("/")[-1] for e in errs]


# ---- server.yaml -------------------------------------------------------------------


def test_one_cluster_as_today_needs_no_clusters_block(tmp_path: Path) -> None:
    cfg = load_server_config(write(tmp_path, "s.yaml", "slurm: {partition: llm}\n"))
    assert cfg.clusters == ()
    (only,) = cfg.cluster_list
    assert (only.name, only.label, only.partition, only.backend) == ("", "default", "llm", "cli")
    assert only.slurm_conf is None and cfg.cluster_names == ()


def test_clusters_take_the_slurm_blocks_defaults_and_their_own(tmp_path: Path) -> None:
    cfg = load_server_config(
        write(
            tmp_path,
            "s.yaml",
            """\
            slurm: {partition: llm, account: svc, qos: normal}
            clusters:
              - name: a100
                slurm_conf: etc/a.conf
              - name: h100
                multi_cluster: llmgwdev2
                partition: llm-h100
                bin_dir: /opt/slurm-25.11/bin
            """,
        )
    )
    a, h = cfg.cluster_list
    assert (a.name, a.partition, a.account, a.qos) == ("a100", "llm", "svc", "normal")
    # Relative to server.yaml's folder, as every path in it.
    assert a.slurm_conf == tmp_path / "etc" / "a.conf"
    assert (h.partition, h.multi_cluster, str(h.bin_dir)) == (
        "llm-h100",
        "llmgwdev2",
        "/opt/slurm-25.11/bin",
    )
    assert cfg.cluster_names == ("a100", "h100")


def test_cluster_mistakes_are_reported_with_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "s.yaml",
        """\
        slurm: {backend: pyslurm}
        clusters:
          - name: a100
          - name: A.100
          - name: a100
          - name: b
            backend: pyslurm
            slurm_conf: /etc/b.conf
          - nmae: c
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_server_config(path)
    got = messages(err.value)
    assert got == [
        "s.yaml:4: clusters[1].name: 'A.100' is not valid: expected 1-32 characters: "
        "lowercase letters, digits, '_', '-', starting with one of the first two",
        "s.yaml:8: clusters[3].slurm_conf: the pyslurm backend reads the daemon's own "
        "SLURM_CONF (libslurm loads one configuration per process) and has no -M: drop "
        "slurm_conf, or use backend cli",
        "s.yaml:9: clusters[4].nmae: unknown key 'nmae'; did you mean 'name'? (valid keys: "
        "account, backend, bin_dir, multi_cluster, name, partition, qos, reservation, rest, slurm_conf)",
        "s.yaml:9: clusters[4].name: missing required key 'name'",
    ]
    path = write(
        tmp_path,
        "t.yaml",
        """\
        slurm: {backend: pyslurm}
        clusters:
          - name: a
          - name: a
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_server_config(path)
    assert messages(err.value) == [
        "t.yaml:4: clusters[1]: cluster name 'a' is already clusters[0]'s",
        "t.yaml:4: clusters[1]: only one cluster can use the pyslurm backend (libslurm loads "
        "one configuration per process); use backend cli for the others",
    ]


# ---- models.yaml's resources.clusters -----------------------------------------------


CATALOG = """\
defaults:
  resources: {clusters: [a100]}
models:
  - name: m
    engine: {kind: vllm}
    weights: {source: /w}
  - name: n
    engine: {kind: vllm}
    weights: {source: /w}
    resources:
      clusters: [h100, l40s]
"""


def test_a_models_clusters_must_be_server_yamls(tmp_path: Path) -> None:
    models = write(tmp_path, "models.yaml", CATALOG)
    cat = load_catalog(models, ("a100", "h100", "l40s"))
    assert [m.resources.clusters for m in cat] == [("a100",), ("h100", "l40s")]
    with pytest.raises(ConfigError) as err:
        load_catalog(models, ("a100", "h100"))
    assert messages(err.value) == [
        "models.yaml:11: models[1].resources.clusters[1]: no cluster 'l40s' in server.yaml "
        "(clusters: a100, h100)"
    ]


def test_a_models_clusters_without_server_clusters_is_an_error_from_its_defaults_line(
    tmp_path: Path,
) -> None:
    models = write(tmp_path, "models.yaml", CATALOG.replace("[h100, l40s]", "[a100]"))
    with pytest.raises(ConfigError) as err:
        load_catalog(models, ())
    assert messages(err.value) == [
        "models.yaml:2: defaults.resources.clusters[0]: no cluster 'a100' in server.yaml "
        "(clusters: none: server.yaml has no clusters: block)",
        "models.yaml:11: models[1].resources.clusters[0]: no cluster 'a100' in server.yaml "
        "(clusters: none: server.yaml has no clusters: block)",
    ]
    # Not checked where no server.yaml is at hand (a job reading its spec back).
    assert [m.resources.clusters for m in load_catalog(models)] == [("a100",), ("a100",)]


def test_config_check_checks_the_models_clusters_against_the_server(tmp_path: Path) -> None:
    models = write(tmp_path, "models.yaml", CATALOG)
    server = write(tmp_path, "server.yaml", "clusters: [{name: a100}, {name: h100}]\n")
    errs = check_files(models=models, server=server)
    assert [str(e).split("/")[-1] for e in errs] == [
        "models.yaml:11: models[1].resources.clusters[1]: no cluster 'l40s' in server.yaml "
        "(clusters: a100, h100)"
    ]


# ---- job names -----------------------------------------------------------------------


def test_job_names_carry_the_cluster_and_read_back() -> None:
    name = job_name("llmgw.", "llama-3.1-8b", "0a1b2c3d", "h100")
    assert name == "llmgw.llama-3.1-8b.0a1b2c3d-h100"
    assert parse_job_ident("llmgw.", name) == ("llama-3.1-8b", "0a1b2c3d", "h100")
    assert parse_job_name("llmgw.", name) == ("llama-3.1-8b", "0a1b2c3d")
    # A name from before clusters, or of one cluster: no cluster.
    assert parse_job_ident("llmgw.", "llmgw.m.0a1b2c3d") == ("m", "0a1b2c3d", "")
    for bad in ("llmgw.m.0a1b2c3d-", "llmgw.m.0a1b2c3d-H100", "llmgw.m.0a1b2c3-h100"):
        assert parse_job_ident("llmgw.", bad) is None, bad


def test_a_replicas_job_on_a_cluster_has_its_name_and_defaults(tmp_path: Path) -> None:
    server = load_server_config(
        write(
            tmp_path,
            "s.yaml",
            f"""\
            slurm: {{partition: llm, job_prefix: "t."}}
            state_dir: {tmp_path / "state"}
            clusters:
              - name: a
              - name: b
                partition: llm-b
                account: acct-b
            """,
        )
    )
    write(tmp_path, "models.yaml", CATALOG.replace("[h100, l40s]", "[b]").replace("a100", "a"))
    m = load_catalog(tmp_path / "models.yaml")
    jobs = JobBuilder(server, b"k" * 64, "http://x:1", "cert")
    spec = jobs.spec(m.models[1], "0a1b2c3d", cluster=server.cluster_list[1])
    assert spec.name == "t.n.0a1b2c3d-b"
    assert "#SBATCH --partition=llm-b" in spec.script
    assert "#SBATCH --account=acct-b" in spec.script
    assert spec.comment.endswith(" cluster=b")
    first = jobs.spec(m.models[0], "0a1b2c3e")  # the first cluster by default
    assert first.name == "t.m.0a1b2c3e-a" and "#SBATCH --partition=llm" in first.script


# ---- reaching a cluster -----------------------------------------------------------------


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


async def test_each_cluster_is_reached_by_its_own_slurm_conf_or_its_m(tmp_path: Path) -> None:
    # Each stub prints how it was called: its SLURM_CONF and its arguments.
    for cmd in ("squeue", "scancel", "sacct"):
        stub(tmp_path, cmd, f'echo "$SLURM_CONF $*" >> {tmp_path}/calls')
    server = load_server_config(
        write(
            tmp_path,
            "s.yaml",
            f"""\
            clusters:
              - {{name: a, slurm_conf: /etc/a.conf, bin_dir: {tmp_path}}}
              - {{name: b, slurm_conf: /etc/a.conf, multi_cluster: llmgwb, bin_dir: {tmp_path}}}
            """,
        )
    )
    backends = make_backends(server.cluster_list, 10.0)
    assert backends["a"] is not backends["b"]
    await backends["a"].list_jobs("x.")
    await backends["b"].list_jobs("x.")
    await backends["b"].cancel("7")
    await backends["b"].accounting(datetime(2026, 1, 1))
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("/etc/a.conf --noheader ")
    assert calls[1].startswith("/etc/a.conf --clusters=llmgwb --noheader ")
    assert calls[2] == "/etc/a.conf --clusters=llmgwb 7"
    assert calls[3].startswith("/etc/a.conf --clusters=llmgwb --allocations ")


async def test_will_start_reads_sbatch_test_only(tmp_path: Path) -> None:
    stub(
        tmp_path,
        "sbatch",
        f'cat > /dev/null; echo "$*" > {tmp_path}/argv; '
        "echo 'sbatch: Job 12 to start at 2026-12-05T10:30:00 using 1 processors on nodes "
        "gpunode13 in partition llm' >&2",
    )
    backend = CliBackend(bin_dir=str(tmp_path), cluster="llmgwb")
    assert isinstance(backend, StartEstimator)
    spec = JobSpec(name="t.m.0a1b2c3d-b", script="#!/bin/sh\ntrue\n")
    assert await backend.will_start(spec) == datetime(2026, 12, 5, 10, 30)
    assert (tmp_path / "argv").read_text().split() == [
        "--clusters=llmgwb",
        "--test-only",
        "--job-name=t.m.0a1b2c3d-b",
    ]
    # A cluster that could never run it: Slurm's refusal, as a SlurmError.
    stub(
        tmp_path,
        "sbatch",
        "cat > /dev/null; echo 'sbatch: error: Batch job submission failed: Requested node "
        "configuration is not available' >&2; exit 1",
    )
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        await backend.will_start(spec)
