"""From catalog and server config to the batch script, with hostile values everywhere.

hypothesis writes a models.yaml and a server.yaml whose every string that can
reach the replica script (partition, account, qos, constraint, GPU type,
memory, the state and agent-config paths, the interpreter path) may hold shell
syntax. Each pair either fails to load with a ConfigError that says file:line,
is refused at rendering with a TemplateError, or renders a script that passes
``bash -n`` and, run with a stub ``srun`` that records its argv, executes
nothing but that one srun with the hostile values as literal arguments.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmgw_slurm.catalog import load_catalog
from llmgw_slurm.config import load_server_config
from llmgw_slurm.errors import ConfigError, TemplateError
from llmgw_slurm.reconciler.jobs import JobBuilder

_EVIL = [
    "x'; touch PWNED; echo '",
    '"$(touch PWNED)"',
    "`touch PWNED`",
    "a\nb; touch PWNED",
    "$HOME;touch PWNED &",
    "\\'\\\"",
    "a b",
    "#SBATCH --wrap=touch PWNED",
    "a\n#SBATCH --wrap=touch PWNED",
    "--wrap=touch PWNED",
    "${IFS}touch${IFS}PWNED",
    "a|touch PWNED",
    "a>PWNED",
    "$(</etc/passwd)",
    "\u202etouch PWNED",
]
_word = st.sampled_from(_EVIL) | st.text(
    alphabet=st.sampled_from(list("ab01-_.:/ $`'\"\\;|&()<>{}*?!#~\n\t=,")), max_size=20
)
_maybe = st.none() | _word

_STUB = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""
_SBATCH_LINE = re.compile(r"#SBATCH --[a-z-]+(=[^\s'\"\\#$]+)?")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


_VALID: dict[str, str | None] = {
    "partition": "llm",
    "account": None,
    "qos": None,
    "constraint": None,
    "gpu_type": "a100",
    "memory": "8G",
    "server_partition": None,
    "state_leaf": "state",
    "agent_leaf": "agent.yaml",
    "python_leaf": "python",
}


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(hostile=st.dictionaries(st.sampled_from(sorted(_VALID)), _word, min_size=1, max_size=3))
def test_no_catalog_or_config_value_reaches_a_shell_unquoted(hostile: dict[str, str]) -> None:
    # A few fields hostile at a time, the rest valid: a value that one check refuses
    # must not hide one that another lets through.
    v = {**_VALID, **hostile}
    with tempfile.TemporaryDirectory() as d:
        _check(
            Path(d),
            resources=_drop_none(
                {
                    "gpus": 1,
                    "partition": v["partition"],
                    "account": v["account"],
                    "qos": v["qos"],
                    "constraint": v["constraint"],
                    "gpu_type": v["gpu_type"],
                    "memory": v["memory"],
                    "time_limit": "1h",
                }
            ),
            slurm=_drop_none({"partition": v["server_partition"], "job_prefix": "llmgwh."}),
            state_leaf=v["state_leaf"] or "state",
            agent_leaf=v["agent_leaf"] or "agent.yaml",
            python_leaf=v["python_leaf"] or "python",
        )


def _check(
    top: Path,
    *,
    resources: dict[str, Any],
    slurm: dict[str, Any],
    state_leaf: str,
    agent_leaf: str,
    python_leaf: str,
) -> None:
    models = top / "models.yaml"
    server = top / "server.yaml"
    models.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "m",
                        "engine": {"kind": "command", "command": ["true", "{port}"]},
                        "resources": resources,
                    }
                ]
            }
        )
    )
    state = top / "state" / state_leaf.replace("/", "_").replace("\0", "")
    agent = top / "agent" / agent_leaf.replace("/", "_").replace("\0", "")
    server.write_text(
        yaml.safe_dump(
            {
                "slurm": slurm,
                "state_dir": str(state),
                "models": str(models),
                "agent_config": str(agent),
            }
        )
    )
    try:
        cfg = load_server_config(server)
        (model,) = load_catalog(cfg.models).models
    except ConfigError as exc:
        # A refusal says where: file:line.
        assert re.search(r"\.yaml(:\d+)?", str(exc)), str(exc)
        event("refused at load")
        return
    python = str(top / "bin" / python_leaf.replace("/", "_").replace("\0", ""))
    try:
        spec = JobBuilder(cfg, b"k" * 64, "http://127.0.0.1:1", python=python).spec(
            model, "0a1b2c3d"
        )
    except (TemplateError, OSError) as exc:
        # Refused at rendering (a value no #SBATCH line can hold), or a state path
        # the file system will not take: either way nothing ran.
        assert str(exc)
        event("refused at rendering")
        return
    event("rendered and run")
    text = spec.script
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert _SBATCH_LINE.fullmatch(line), line
    assert text.count("#SBATCH --job-name=") == 1
    script = top / "job.sh"
    script.write_text(text)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bin_dir = top / "stubs"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(_STUB.format(python=sys.executable))
    srun.chmod(0o755)
    log = top / "argv.jsonl"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STUB_LOG": str(log),
        "HOME": str(top),
    }
    proc = subprocess.run(
        ["bash", str(script)], cwd=top, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(p.name == "PWNED" for p in top.rglob("*")), "a hostile value was executed"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 1, calls
    argv = calls[0]
    assert argv[0] == "srun"
    i = argv.index(python)
    assert argv[i + 1 :] == ["-m", "llmgw_slurm.agent.main", "--config", str(agent), "run"]


def test_the_sandbox_catches_an_unquoted_value(tmp_path: Path) -> None:
    """The check above can fail: a script that runs a value unquoted is caught."""
    (tmp_path / "job.sh").write_text('v="x; touch PWNED"\neval "echo $v"\n')
    subprocess.run(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env={"PATH": os.defpath})
    assert (tmp_path / "PWNED").exists()


def test_a_state_dir_or_agent_config_no_job_script_can_hold_is_a_config_error(
    tmp_path: Path,
) -> None:
    """Found by the test above: such a server.yaml loaded, and then every replica
    submission failed at rendering, with nothing said at `llmgw-admin config check`."""
    for key, value in (
        ("state_dir", str(tmp_path / "my state")),
        ("state_dir", str(tmp_path / "s$HOME")),
        ("agent_config", str(tmp_path / "agent $(x).yaml")),
    ):
        server = tmp_path / "server.yaml"
        server.write_text(yaml.safe_dump({key: value}))
        try:
            load_server_config(server)
        except ConfigError as exc:
            assert key in str(exc) and "server.yaml" in str(exc), str(exc)
        else:
            raise AssertionError(f"{key}: {value!r} was taken")
