"""The batch scripts: recorded output, strict #SBATCH values, hostile values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from llmgw_slurm.base.errors import TemplateError
from llmgw_slurm.catalog import Model, Resources, read_replica_spec
from llmgw_slurm.config import SlurmConfig
from llmgw_slurm.sbatch import (
    EngineInstallParams,
    HetComponent,
    HetReplicaParams,
    JobOptions,
    ModelJobParams,
    ReplicaParams,
    render_batch,
    render_engine_install,
    render_model_job,
    render_replica,
    render_replica_hetjob,
    replica_script,
    time_limit_seconds,
)

EXPECTED = Path(__file__).parent / "expected"

JOB = JobOptions(
    job_name="llmgw.llama-8b.0123abcd",
    time="1-00:00:00",
    output="/var/log/llmgw/%x-%j.out",
    python="/opt/llmgw/bin/python",
    partition="gpu",
    account="ai",
    qos="service",
)
AGENT_CONFIG = "/etc/llmgw/agent.yaml"


def assert_matches_record(name: str, text: str) -> None:
    path = EXPECTED / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        pytest.fail(f"{path} was missing and has been recorded: check it, commit it, rerun")
    assert text == path.read_text(), (
        f"rendered script differs from {path}; delete the record if this change is intended "
        "(the next run records the new text)"
    )


def bash_n(text: str, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(text)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- recorded output ------------------------------------------------------------------


def test_replica_matches_record(tmp_path: Path) -> None:
    params = ReplicaParams(
        JOB,
        Resources(gpus=2, gpu_type="a100", cpus=8, memory="64G", constraint="ib&a100"),
        AGENT_CONFIG,
        signal_before_s=300,
    )
    text = render_replica(params)
    assert_matches_record("replica.sbatch", text)
    bash_n(text, tmp_path)


def test_replica_minimal_matches_record(tmp_path: Path) -> None:
    job = JobOptions(
        job_name="llmgw.tiny.00000001",
        time="30",
        output="/tmp/o.out",
        python="python3",
        error="/tmp/e.err",
    )
    text = render_replica(ReplicaParams(job, Resources(gpus=0), "/etc/a.yaml", requeue=False))
    assert_matches_record("replica-minimal.sbatch", text)
    bash_n(text, tmp_path)


def test_hetjob_matches_record(tmp_path: Path) -> None:
    params = HetReplicaParams(
        JOB,
        [
            HetComponent(1, Resources(gpus=4, cpus=16)),
            HetComponent(2, Resources(gpus=4, cpus=16), partition="gpu2"),
        ],
        AGENT_CONFIG,
    )
    text = render_replica_hetjob(params)
    assert_matches_record("replica-hetjob.sbatch", text)
    bash_n(text, tmp_path)


def test_batch_job_matches_record(tmp_path: Path) -> None:
    job = replace(JOB, job_name="llmgw._batch.batch_0123456789abcdef01234567", qos="preempt")
    params = ReplicaParams(job, Resources(gpus=1, gpu_type="a100", cpus=4), AGENT_CONFIG, 120)
    text = render_batch(params)
    assert_matches_record("batch.sbatch", text)
    bash_n(text, tmp_path)



def test_a_sharded_batch_is_a_job_array_and_a_template_without_one_is_refused(
    tmp_path: Path,
) -> None:
    job = replace(JOB, job_name="llmgw._batch.batch_0123456789abcdef01234567")
    params = ReplicaParams(job, Resources(gpus=1), AGENT_CONFIG, 120)
    one, three = render_batch(params), render_batch(params, shards=3)
    assert "--array" not in one
    assert [x for x in three.splitlines() if x.startswith("#SBATCH --array")] == [
        "#SBATCH --array=0-2"
    ]
    bash_n(three, tmp_path)
    for bad in (0, 1001, True):
        with pytest.raises(TemplateError, match="shards"):
            render_batch(params, shards=bad)
    # A site's own template from before shards: refused, not run as one shard.
    (tmp_path / "batch.sbatch.j2").write_text("#!/bin/bash\n#SBATCH --job-name=x\necho\n")
    with pytest.raises(TemplateError, match="--array"):
        render_batch(params, tmp_path, shards=2)
    assert render_batch(params, tmp_path).startswith("#!/bin/bash")


def test_model_job_matches_record(tmp_path: Path) -> None:
    text = render_model_job(ModelJobParams(JOB, AGENT_CONFIG, Resources(gpus=0, cpus=4)))
    assert_matches_record("model-job.sbatch", text)
    bash_n(text, tmp_path)
    allowed = render_model_job(ModelJobParams(JOB, AGENT_CONFIG, allow_download=True))
    assert allowed.rstrip().endswith(f"--config {AGENT_CONFIG} --allow-hf fetch")


def test_engine_install_matches_records(tmp_path: Path) -> None:
    venv = EngineInstallParams(
        JOB,
        "venv",
        "/opt/engines/vllm-0.6.3",
        packages=["vllm==0.6.3"],
        pip_args=["--index-url", "https://pypi.example.invalid/simple"],
    )
    image = EngineInstallParams(
        JOB,
        "apptainer",
        "/opt/engines/vllm-0.6.3.sif",
        image_uri="docker://vllm/vllm-openai:v0.6.3",
    )
    for name, params in (
        ("engine-install-venv.sbatch", venv),
        ("engine-install-apptainer.sbatch", image),
    ):
        text = render_engine_install(params)
        assert_matches_record(name, text)
        bash_n(text, tmp_path)


def test_hetjob_has_one_srun_over_every_component() -> None:
    comps = [HetComponent(1, Resources(gpus=1))] + [HetComponent(1, Resources(gpus=1))] * 3
    text = render_replica_hetjob(HetReplicaParams(JOB, comps, AGENT_CONFIG))
    assert text.count("#SBATCH hetjob") == 3
    sruns = [line for line in text.splitlines() if "srun" in line and not line.startswith("#")]
    assert len(sruns) == 1 and "--het-group=0-3" in sruns[0]
    # Job-wide options appear once, in component 0, before the first separator.
    head = text.split("#SBATCH hetjob")[0]
    for opt in ("--signal=B:USR1@300", "--requeue", "--output=", "--open-mode=append"):
        assert opt in head
        assert text.count(opt) == 1


# --- refusals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job_name", "llmgw.x y"),
        ("job_name", "llmgw.x\n#SBATCH --uid=0"),
        ("job_name", "llmgw.'x'"),
        ("time", "1 day"),
        ("time", "01:00:00\n"),
        ("partition", "gpu --uid=0"),
        ("partition", "gpu\n#SBATCH --x"),
        ("account", "a$(id)"),
        ("qos", "q`id`"),
        ("output", "/var/log/my logs/x.out"),
        ("output", "relative/x.out"),
        ("output", "/var/log/x'.out"),
        ("error", "/tmp/$(id)"),
        ("workdir", "/tmp/a;b"),
        ("python", "/opt/py\nthon"),
    ],
)
def test_bad_job_values_are_refused(field: str, value: str) -> None:
    job = replace(JOB, **{field: value})
    with pytest.raises(TemplateError, match=field):
        render_replica(ReplicaParams(job, Resources(gpus=0), AGENT_CONFIG))


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        (Resources(gpus=-1), "gpus"),
        (Resources(gpus=1, gpu_type="a100 x"), "gpu_type"),
        (Resources(gpus=1, gpu_type="a100:2"), "gpu_type"),
        (Resources(gpus=0, memory="64 G"), "mem"),
        (Resources(gpus=0, memory="lots"), "mem"),
        (Resources(gpus=0, memory="\u0661\u0662G"), "mem"),  # \\d takes any script's digits
        (Resources(gpus=0, cpus=0), "cpus"),
        (Resources(gpus=0, constraint="a100 ib"), "constraint"),
        (Resources(gpus=0, constraint="a$(id)"), "constraint"),
    ],
)
def test_bad_resources_are_refused(resources: Resources, field: str) -> None:
    with pytest.raises(TemplateError, match=field):
        render_replica(ReplicaParams(JOB, resources, AGENT_CONFIG))


@pytest.mark.parametrize("path", ["etc/agent.yaml", "/etc/a b.yaml", "/etc/'a'.yaml", "/e/$(x)"])
def test_bad_agent_config_is_refused(path: str) -> None:
    with pytest.raises(TemplateError, match="agent_config"):
        render_replica(ReplicaParams(JOB, Resources(gpus=0), path))


def test_signal_lead_must_fit_slurm() -> None:
    with pytest.raises(TemplateError, match="signal_before_s"):
        render_replica(ReplicaParams(JOB, Resources(gpus=0), AGENT_CONFIG, signal_before_s=0))
    with pytest.raises(TemplateError, match="signal_before_s"):
        render_replica(ReplicaParams(JOB, Resources(gpus=0), AGENT_CONFIG, signal_before_s=70000))


def test_hetjob_needs_two_components_and_one_cpu_count() -> None:
    with pytest.raises(TemplateError, match="components"):
        render_replica_hetjob(HetReplicaParams(JOB, [HetComponent(2)], AGENT_CONFIG))
    mixed = [HetComponent(1, Resources(gpus=0, cpus=4)), HetComponent(1, Resources(gpus=0, cpus=1))]
    with pytest.raises(TemplateError, match="cpus differs"):
        render_replica_hetjob(HetReplicaParams(JOB, mixed, AGENT_CONFIG))


@pytest.mark.parametrize("req", ["vllm; rm -rf /", "vllm==0.6 $(id)", "-e .", "`id`"])
def test_bad_packages_are_refused(req: str) -> None:
    with pytest.raises(TemplateError, match="packages"):
        render_engine_install(EngineInstallParams(JOB, "venv", "/opt/e", packages=[req]))


def test_bad_image_uri_and_kind_are_refused() -> None:
    with pytest.raises(TemplateError, match="image_uri"):
        render_engine_install(
            EngineInstallParams(JOB, "apptainer", "/opt/e.sif", image_uri="docker://x;id")
        )
    with pytest.raises(TemplateError, match="kind"):
        render_engine_install(EngineInstallParams(JOB, "conda", "/opt/e"))


# --- site templates ---------------------------------------------------------------


def test_site_dir_overrides_one_template(tmp_path: Path) -> None:
    (tmp_path / "replica.sbatch.j2").write_text(
        "#!/bin/bash\n#SBATCH --job-name={{ job.job_name | sb }}\n"
        "exec site-runner {{ job.python | q }}\n"
    )
    text = render_replica(
        ReplicaParams(JOB, Resources(gpus=0), AGENT_CONFIG), template_dir=tmp_path
    )
    assert "exec site-runner /opt/llmgw/bin/python" in text
    # The others still come from the defaults.
    model = render_model_job(ModelJobParams(JOB, AGENT_CONFIG), template_dir=tmp_path)
    assert "fetch" in model


def test_site_template_cannot_put_unchecked_value_on_sbatch_line(tmp_path: Path) -> None:
    (tmp_path / "replica.sbatch.j2").write_text(
        "#!/bin/bash\n#SBATCH --comment={{ job.python | sb }}\n"
    )
    job = replace(JOB, python="/opt/my python/bin/python")
    with pytest.raises(TemplateError, match="#SBATCH"):
        render_replica(ReplicaParams(job, Resources(gpus=0), AGENT_CONFIG), template_dir=tmp_path)


def test_site_template_with_undefined_name_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "replica.sbatch.j2").write_text("#!/bin/bash\necho {{ job.no_such_thing | q }}\n")
    with pytest.raises(TemplateError, match="no_such_thing"):
        render_replica(ReplicaParams(JOB, Resources(gpus=0), AGENT_CONFIG), template_dir=tmp_path)


# --- hostile values that are quoted, not refused -------------------------------------

HOSTILE = [
    "/opt/x'; touch PWNED; echo '/python",
    '/opt/"$(touch PWNED)"/python',
    "/opt/`touch PWNED`/python",
    "/opt/a\nb; touch PWNED/python",
    "/opt/$HOME;touch PWNED &/python",
    "/opt/\\'\\\"/python",
]

_STUB = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
args = sys.argv[1:]
if args[:2] == ["-m", "llmgw_slurm.agent.main"]:
    # The agent itself runs for real, with this stub as the interpreter it builds from.
    os.execv(sys.executable, [sys.executable, *args])
if args[:2] == ["-m", "venv"]:
    target = args[-1]
    os.makedirs(os.path.join(target, "bin"))
    os.symlink(os.path.abspath(sys.argv[0]), os.path.join(target, "bin", "python"))
"""


def _run_with_stubs(text: str, tmp_path: Path, stubs: list[str]) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in stubs:
        stub = bin_dir / name
        stub.write_text(_STUB.format(python=sys.executable))
        stub.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(text)
    log = tmp_path / "argv.jsonl"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STUB_LOG=str(log))
    proc = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "PWNED").exists(), "a hostile value was executed"
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_python_path_is_one_literal_argument(hostile: str, tmp_path: Path) -> None:
    # The stub stands in for the hostile path: the script must hand the whole
    # string to srun as one argument, never run it through a shell.
    job = replace(JOB, python=hostile)
    if "\n" in hostile:
        # A newline in an interpreter path is refused rather than quoted.
        with pytest.raises(TemplateError, match="python"):
            render_replica(ReplicaParams(job, Resources(gpus=0), AGENT_CONFIG))
        return
    text = render_replica(ReplicaParams(job, Resources(gpus=0, cpus=2), AGENT_CONFIG))
    bash_n(text, tmp_path)
    calls = _run_with_stubs(text, tmp_path, ["srun"])
    assert len(calls) == 1
    argv = calls[0]
    assert argv[0] == "srun"
    i = argv.index(hostile)
    assert argv[i + 1 :] == ["-m", "llmgw_slurm.agent.main", "--config", AGENT_CONFIG, "run"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_values_in_hetjob_and_model_job(hostile: str, tmp_path: Path) -> None:
    job = replace(JOB, python=hostile)
    if "\n" in hostile:
        with pytest.raises(TemplateError, match="python"):
            render_model_job(ModelJobParams(job, AGENT_CONFIG))
        return
    het = render_replica_hetjob(
        HetReplicaParams(job, [HetComponent(1), HetComponent(1)], AGENT_CONFIG)
    )
    calls = _run_with_stubs(het, tmp_path, ["srun"])
    assert hostile in calls[0] and calls[0][-1] == "run"
    model = render_model_job(ModelJobParams(job, AGENT_CONFIG))
    bash_n(model, tmp_path)
    # exec of the hostile path itself: it does not exist, so bash fails to
    # exec it; what matters is that nothing in it ran.
    script = tmp_path / "model.sh"
    script.write_text(model)
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_pip_args_and_target_are_literal(hostile: str, tmp_path: Path) -> None:
    target = tmp_path / "venv"
    params = EngineInstallParams(
        replace(JOB, python="python"),
        "venv",
        str(target),
        packages=["vllm==0.6.3"],
        pip_args=["--index-url", hostile.replace("\n", " ")],
    )
    text = render_engine_install(params)
    bash_n(text, tmp_path)
    calls = _run_with_stubs(text, tmp_path, ["python"])
    install = [c for c in calls if c[1:4] == ["-m", "pip", "install"] and "vllm==0.6.3" in c]
    assert install == [
        [
            "python",
            "-m",
            "pip",
            "install",
            "--index-url",
            hostile.replace("\n", " "),
            "--",
            "vllm==0.6.3",
        ]
    ]
    assert (target / ".llmgw-installed").exists()


def test_engine_install_twice_installs_once(tmp_path: Path) -> None:
    target = tmp_path / "venv"
    params = EngineInstallParams(
        replace(JOB, python="python"), "venv", str(target), packages=["vllm==0.6.3"]
    )
    text = render_engine_install(params)
    first = _run_with_stubs(text, tmp_path, ["python"])
    (tmp_path / "argv.jsonl").unlink()
    (tmp_path / "argv.jsonl").touch()
    second = _run_with_stubs(text, tmp_path, ["python"])
    assert any(c[1:3] == ["-m", "venv"] for c in first)
    # The second job runs the agent, which finds the install complete and runs nothing.
    assert [c[1:3] for c in second] == [["-m", "llmgw_slurm.agent.main"]]


@pytest.mark.parametrize(
    ("time", "seconds"),
    [
        ("30", 1800),
        ("1:30", 90),
        ("01:00:00", 3600),
        ("2-0", 172800),
        ("1-02:03:04", 93784),
        ("1-2:30", 95400),
    ],
)
def test_time_limit_seconds(time: str, seconds: int) -> None:
    assert time_limit_seconds(time) == seconds


def test_signal_lead_must_be_less_than_the_time_limit() -> None:
    # A 5-minute job warned 300 s ahead would be told to drain as it starts.
    with pytest.raises(TemplateError, match="not less than the time limit"):
        render_replica(
            ReplicaParams(
                replace(JOB, time="5"), Resources(gpus=0), AGENT_CONFIG, signal_before_s=300
            )
        )
    render_replica(
        ReplicaParams(replace(JOB, time="6"), Resources(gpus=0), AGENT_CONFIG, signal_before_s=300)
    )


@pytest.mark.parametrize("time", ["\u0661\u0660", "\uff11:00:00"])
def test_a_time_in_other_digits_is_refused_as_a_time(time: str) -> None:
    with pytest.raises(TemplateError, match=r"^time:"):
        render_replica(ReplicaParams(replace(JOB, time=time), Resources(gpus=0), AGENT_CONFIG))


def test_partition_list_and_no_time_limit() -> None:
    job = replace(JOB, partition="gpu,gpu-big", time=None, account="proj+x")
    text = render_replica(
        ReplicaParams(job, Resources(gpus=0, constraint="a100&!slow"), AGENT_CONFIG)
    )
    assert "#SBATCH --partition=gpu,gpu-big\n" in text
    assert "#SBATCH --account=proj+x\n" in text
    assert "#SBATCH --constraint=a100&!slow\n" in text
    assert "--time" not in text


def test_a_constraint_with_parentheses_renders() -> None:
    """Slurm groups features with ( ), and the catalog and the constraint check took
    them, but the last check before an #SBATCH line did not: such a model loaded,
    passed `config check`, and every start of it failed at rendering."""
    for constraint in ("(a100&ib)|h100", "[(knl&snc4&flat)*4&haswell*1]"):
        text = render_replica(
            ReplicaParams(JOB, Resources(gpus=0, constraint=constraint), AGENT_CONFIG)
        )
        assert f"#SBATCH --constraint={constraint}\n" in text
        text = replica_script(
            _model(constraint=constraint), job_name="j", python="/p", agent_config="/a", output="/o"
        )
        assert f"#SBATCH --constraint={constraint}\n" in text


# --- from a catalog model -----------------------------------------------------------


def _model(**resources: object) -> Model:
    entry = {
        "name": "llama-8b",
        "engine": {"kind": "vllm"},
        "weights": {"source": "/m"},
        "resources": resources,
    }
    model, ignored = read_replica_spec(json.dumps(entry))
    assert ignored == []
    return model


def test_replica_script_from_a_single_node_model() -> None:
    model = _model(gpus=2, gpu_type="a100", cpus=8, memory="64g", time_limit="4h", constraint="ib")
    text = replica_script(
        model,
        job_name="llmgw.llama-8b.0123abcd",
        python="/opt/llmgw/bin/python",
        agent_config=AGENT_CONFIG,
        output="/var/log/llmgw/%x-%j.out",
        slurm=SlurmConfig(partition="llm", account="ai"),
    )
    for line in (
        "--job-name=llmgw.llama-8b.0123abcd",
        "--time=4:00:00",
        "--partition=llm",
        "--account=ai",
        "--gres=gpu:a100:2",
        "--cpus-per-task=8",
        "--mem=64G",
        "--constraint=ib",
        "--signal=B:USR1@300",
        "--requeue",
    ):
        assert f"#SBATCH {line}\n" in text
    assert "--qos" not in text and "hetjob" not in text


def test_replica_script_from_a_multi_node_model() -> None:
    model = _model(gpus=4, nodes=3, partition="big", time_limit="5m")
    text = replica_script(
        model,
        job_name="llmgw.llama-8b.0123abcd",
        python="python3",
        agent_config=AGENT_CONFIG,
        output="/tmp/o.out",
        slurm=SlurmConfig(partition="llm"),
    )
    assert text.count("#SBATCH hetjob") == 2
    assert text.count("#SBATCH --partition=big\n") == 3  # the model's wins
    assert "--het-group=0-2" in text
    # A 5-minute job is warned at half its limit, not at once.
    assert "#SBATCH --signal=B:USR1@150\n" in text


def test_the_servers_reservation_goes_on_every_kind_of_job() -> None:
    """slurm.reservation: every job of the service runs in it (the Slurm tests isolate
    their GPU counts this way), each component of a heterogeneous job too."""
    slurm = SlurmConfig(partition="llm", reservation="llm-service")
    for nodes in (1, 3):
        text = replica_script(
            _model(gpus=1, nodes=nodes),
            job_name="llmgw.m.0123abcd",
            python="python3",
            agent_config=AGENT_CONFIG,
            output="/tmp/o.out",
            slurm=slurm,
        )
        assert text.count("#SBATCH --reservation=llm-service\n") == nodes
    job = replace(JOB, reservation="llm-service")
    assert "#SBATCH --reservation=llm-service\n" in render_batch(
        ReplicaParams(job, Resources(gpus=1), AGENT_CONFIG)
    )
    assert "--reservation" not in render_batch(ReplicaParams(JOB, Resources(gpus=1), AGENT_CONFIG))
    with pytest.raises(TemplateError, match="reservation"):
        render_batch(ReplicaParams(replace(JOB, reservation="a b"), Resources(), AGENT_CONFIG))


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_values_in_a_batch_job_are_literal(hostile: str, tmp_path: Path) -> None:
    if "\n" in hostile:
        with pytest.raises(TemplateError, match="python"):
            render_batch(ReplicaParams(replace(JOB, python=hostile), Resources(), AGENT_CONFIG))
        return
    text = render_batch(
        ReplicaParams(replace(JOB, python=hostile), Resources(gpus=0, cpus=2), AGENT_CONFIG)
    )
    calls = _run_with_stubs(text, tmp_path, ["srun"])
    argv = calls[0]
    i = argv.index(hostile)
    assert argv[i + 1 :] == ["-m", "llmgw_slurm.agent.main", "--config", AGENT_CONFIG, "batch"]
