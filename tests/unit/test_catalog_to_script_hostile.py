"""From catalog, server config and admin options to every batch script, with hostile values.

hypothesis writes a models.yaml and a server.yaml whose every string that can
reach a script may hold shell syntax: partition, account, qos, constraint, GPU
type, memory, the state and agent-config paths, the interpreter path, the
model's name, aliases, engine arguments and environment, weights source and
image; for an engine install also the options ``llmgw-admin install-engine``
passes on (target, packages, pip arguments, image URI, apptainer binary, time
limit). Each template is covered:

- ``replica.sbatch.j2`` (one node) and ``replica-hetjob.sbatch.j2`` (several),
  through :class:`~llmgw_slurm.reconciler.jobs.JobBuilder`;
- ``model-job.sbatch.j2`` and ``engine-install.sbatch.j2``, through
  :class:`~llmgw_slurm.reconciler.svcjobs.ServiceJobBuilder`.

Each case either fails to load with a ConfigError that says file:line, is
refused at rendering with a TemplateError, or renders a script that passes
``bash -n`` and, run in a sandbox, executes exactly what the template says:
bash's own trace lists every command the script ran (builtins included), stub
commands on PATH (srun, hostname, date, python, pip, apptainer, llmgw-agent)
and at the interpreter's path record their argv and environment, and each
hostile value arrives as exactly one argument or environment value.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from llmgw_slurm import catalog as catalog_mod
from llmgw_slurm import sbatch as sbatch_mod
from llmgw_slurm.base.errors import ConfigError, TemplateError
from llmgw_slurm.catalog import Model, load_catalog, read_replica_spec
from llmgw_slurm.config import ServerConfig, load_server_config
from llmgw_slurm.reconciler.jobs import JobBuilder
from llmgw_slurm.reconciler.svcjobs import ServiceJobBuilder
from llmgw_slurm.slurm.types import JobSpec

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


def _taken(pattern: str | re.Pattern[str]) -> st.SearchStrategy[str]:
    """What a field's own validator takes (drawn from its own pattern), hostile-looking
    where it can be: the values that get through must then reach the shell safely."""
    fits = [e for e in _EVIL if re.fullmatch(pattern, e)]
    taken = st.from_regex(pattern, fullmatch=True)
    return st.sampled_from(fits) | taken if fits else taken


def _line(exclude: str = "") -> st.SearchStrategy[str]:
    """Text on one line, shell syntax and any script welcome."""
    no = "\n\r\x00\x01" + exclude
    return st.sampled_from([e for e in _EVIL if not set(e) & set(no)]) | st.text(
        st.characters(exclude_categories=("Cs",), exclude_characters=no), max_size=20
    )


# Free text that travels only in the environment (engine args and env, aliases,
# descriptions): anything but NUL, which no environment value can hold, and \x01,
# the sandbox's trace marker.
_free = st.sampled_from(_EVIL) | st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00\x01"), max_size=20
)
# Slurm's own time syntax, which --time passes through as written.
_time = _taken(sbatch_mod._TIME).filter(lambda t: len(t) < 40)

_STUB = r"""#!/bin/bash
# A sandbox stub: appends its argv and the environment values named in
# STUB_ENV_KEYS to STUB_LOG, NUL-separated and counted, and does nothing else.
rec=("$0" "$@")
envs=()
for k in ${STUB_ENV_KEYS-}; do
    if [[ -v $k ]]; then envs+=("$k=${!k}"); fi
done
{
    printf '%s\0' "${#rec[@]}" "${rec[@]}" "${#envs[@]}"
    if (( ${#envs[@]} )); then printf '%s\0' "${envs[@]}"; fi
} >>"$STUB_LOG"
"""
# Read by the job's bash before the script (and by nothing else): bash traces
# every command it runs, builtins and command substitutions included, one
# \x01 per level of nesting in front.
_BASH_ENV = r"""if [[ $0 == "$SANDBOX_SCRIPT" ]]; then
    PS4=$'\x01'
    exec {BASH_XTRACEFD}>>"$SANDBOX_TRACE"
    set -x
fi
"""
_STUB_NAMES = ("srun", "hostname", "date", "python", "python3", "pip", "apptainer", "llmgw-agent")
# What every template's body runs besides its last command: the preamble.
_PREAMBLE_TRACE = ["set", "hostname", "date", "echo"]
_PREAMBLE_CALLS = [["hostname"], ["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"]]
_SBATCH_LINE = re.compile(r"#SBATCH --[a-z-]+(=[^\s'\"\\#$]+)?|#SBATCH hetjob")
_AGENT = ["-m", "llmgw_slurm.agent.main"]
# Found before PATH is narrowed to the stubs.
_BASH = shutil.which("bash") or "/bin/bash"


@dataclass
class Ran:
    """What a script did in the sandbox."""

    trace: list[str]  # the first word of every command bash ran, in order
    calls: list[list[str]]  # argv of every stub run, the stub's name (or path) first
    envs: list[dict[str, str]]  # the recorded environment of each call


def _sandbox(top: Path, text: str, *, env: Mapping[str, str] = {}, exe: str = "") -> Ran:
    """Check ``text`` with ``bash -n``, then run it with stubs for every command and
    the interpreter at ``exe``; fails if it made a PWNED file anywhere."""
    script = top / "job.sh"
    script.write_text(text)
    proc = subprocess.run([_BASH, "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    stubs = top / "stubs"
    stubs.mkdir()
    for name in _STUB_NAMES:
        (stubs / name).write_text(_STUB)
        (stubs / name).chmod(0o755)
    if exe:
        Path(exe).parent.mkdir(parents=True, exist_ok=True)
        Path(exe).write_text(_STUB)
        Path(exe).chmod(0o755)
    (top / "bash_env").write_text(_BASH_ENV)
    log, trace = top / "argv.bin", top / "trace.txt"
    proc = subprocess.run(
        [_BASH, str(script)],
        cwd=top,
        env={
            **env,
            "PATH": str(stubs),
            "HOME": str(top),
            "BASH_ENV": str(top / "bash_env"),
            "SANDBOX_SCRIPT": str(script),
            "SANDBOX_TRACE": str(trace),
            "STUB_LOG": str(log),
            "STUB_ENV_KEYS": " ".join(env),
        },
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(p.name == "PWNED" for p in top.rglob("*")), "a hostile value was executed"
    fields = log.read_bytes().decode(errors="surrogateescape").split("\0") if log.exists() else []
    calls, envs = [], []
    while len(fields) > 1:
        n = int(fields.pop(0))
        argv, fields = fields[:n], fields[n:]
        if argv[0].startswith(f"{stubs}/"):
            argv[0] = argv[0][len(f"{stubs}/") :]
        m = int(fields.pop(0))
        calls.append(argv)
        envs.append(dict(kv.split("=", 1) for kv in fields[:m]))
        fields = fields[m:]
    lines = trace.read_text(errors="surrogateescape").split("\n") if trace.exists() else []
    words = [ln.lstrip("\x01").split(" ", 1)[0] for ln in lines if ln.startswith("\x01")]
    return Ran(words, calls, envs)


def _check_script(text: str, job_names: int = 1) -> None:
    """#SBATCH lines hold only checked values, and the job has exactly one name."""
    # split("\n"), not splitlines(): bash and sbatch end a line at \n only.
    for line in text.split("\n"):
        if line.startswith("#SBATCH"):
            assert _SBATCH_LINE.fullmatch(line), line
    assert text.count("#SBATCH --job-name=") == job_names


def _assert_ran(ran: Ran, last: list[str], env: Mapping[str, str] = {}) -> None:
    """The preamble, then one exec of ``last``, its argv and environment as given."""
    assert ran.trace == [*_PREAMBLE_TRACE, "exec"], ran.trace
    assert ran.calls == [*_PREAMBLE_CALLS, last], ran.calls
    assert ran.envs[-1] == dict(env)


# --- catalog and server config ------------------------------------------------------


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _safe_leaf(leaf: str | None, default: str) -> str:
    leaf = (leaf or "").replace("/", "_").replace("\0", "")
    return default if leaf in ("", ".", "..") else leaf


@dataclass
class Loaded:
    cfg: ServerConfig
    model: Model
    python: str
    agent: str


def _load(top: Path, model: dict[str, Any], v: dict[str, Any]) -> Loaded | None:
    """Write and load models.yaml and server.yaml (``v``: the drawn server values);
    None when a ConfigError refused them."""
    slurm = _server(v)
    state_leaf, agent_leaf, python_leaf = v["state_leaf"], v["agent_leaf"], v["python_leaf"]
    models = top / "models.yaml"
    server = top / "server.yaml"
    models.write_text(yaml.safe_dump({"models": [model]}))
    state = top / "state" / _safe_leaf(state_leaf, "state")
    agent = top / "agent" / _safe_leaf(agent_leaf, "agent.yaml")
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
        (loaded,) = load_catalog(cfg.models).models
    except ConfigError as exc:
        # A refusal says where: file:line.
        assert re.search(r"\.yaml(:\d+)?", str(exc)), str(exc)
        event("refused at load")
        return None
    python = str(top / "bin" / _safe_leaf(python_leaf, "python"))
    return Loaded(cfg, loaded, python, str(agent))


def _render(build: Callable[[], JobSpec], *, may_refuse: bool) -> JobSpec | None:
    """The job, or None when rendering refused it. ``may_refuse`` False: every value
    came through the config checks, so a refusal now would be one that `llmgw-admin
    config check` never reported, and each start of the model would fail."""
    try:
        return build()
    except TemplateError as exc:
        # Refused at rendering (a value no #SBATCH line can hold): nothing ran.
        assert may_refuse, f"config check took it, rendering refused it: {exc}"
        event("refused at rendering")
        return None
    except OSError as exc:
        # A state path the file system will not take: nothing ran either.
        assert str(exc)
        event("refused by the file system")
        return None


def _odd_python(python: str) -> bool:
    """An interpreter path no script line can hold (rendering refuses it)."""
    return any(c in python for c in "\n\r")


def _cases(
    valid: Mapping[str, Any],
    taken: Mapping[str, st.SearchStrategy[Any]],
    bad: Mapping[str, st.SearchStrategy[Any]] = {},
) -> st.SearchStrategy[dict[str, Any]]:
    """Every field plainly valid or a value its validator takes, all at once; and up to
    two fields hostile text, most of it refused (a value that one check refuses must
    not hide one that another lets through)."""
    base = st.fixed_dictionaries({k: st.just(v) | taken[k] for k, v in valid.items()})
    hostile = st.lists(st.sampled_from(sorted(taken)), max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: bad.get(k, _word) for k in keys})
    )
    return st.builds(lambda b, h: {**b, **h}, base, hostile)


_SERVER_VALID: dict[str, Any] = {
    "server_partition": None,
    "server_account": None,
    "server_qos": None,
    "job_prefix": "llmgwh.",
    "state_leaf": "state",
    "agent_leaf": "agent.yaml",
    "python_leaf": "python",
}
_SERVER_TAKEN: dict[str, st.SearchStrategy[Any]] = {
    "server_partition": _taken(catalog_mod._PARTITION_RE),
    "server_account": _taken(catalog_mod._SLURM_NAME_RE),
    "server_qos": _taken(catalog_mod._SLURM_NAME_RE),
    "job_prefix": _taken(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}"),
    "state_leaf": _taken(r"[A-Za-z0-9_.,%+=@:-]{1,20}"),
    "agent_leaf": _taken(r"[A-Za-z0-9_.,%+=@:-]{1,20}"),
    # The interpreter is the daemon's own (sys.executable), not configured: any name.
    "python_leaf": _line(exclude="/"),
}

# What a catalog entry may hold that reaches a job only in its environment
# (LLMGW_REPLICA_SPEC): drawn every time, hostile or not.
_extras = st.fixed_dictionaries(
    {
        "aliases": st.lists(_taken(catalog_mod._ALIAS_RE), max_size=2, unique=True),
        "args": st.lists(_free, max_size=3),
        "env": st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True), _free),
        "source": st.sampled_from(["/w/m", "hf:org/name"])
        | st.builds("/{}".format, _taken(r"[^\x00-\x1f]{0,30}")),
        "image": st.none() | _taken(r"\S{1,40}"),
        "description": _free,
    }
)
_NO_EXTRAS: dict[str, Any] = {
    "aliases": [],
    "args": [],
    "env": {},
    "source": "/w/m",
    "image": None,
    "description": "",
}


def _model_entry(name: str, extras: Mapping[str, Any], resources: dict[str, Any]) -> dict[str, Any]:
    return _drop_none(
        {
            "name": name,
            "aliases": extras["aliases"],
            "description": extras["description"],
            "engine": _drop_none(
                {
                    "kind": "vllm",
                    "args": extras["args"],
                    "env": extras["env"],
                    "apptainer_image": extras["image"],
                }
            ),
            "weights": {"source": extras["source"]},
            "resources": resources,
        }
    )


def _server(v: Mapping[str, Any]) -> dict[str, Any]:
    return _drop_none(
        {
            "partition": v["server_partition"],
            "account": v["server_account"],
            "qos": v["server_qos"],
            "job_prefix": v["job_prefix"],
        }
    )


def _assert_spec_arrived(ran: Ran, spec: JobSpec, model: Model, extras: Mapping[str, Any]) -> None:
    """Every catalog value of the model arrived, intact, in the job's environment."""
    assert ran.envs[-1] == dict(spec.env)
    back, ignored = read_replica_spec(ran.envs[-1]["LLMGW_REPLICA_SPEC"])
    assert back == model and ignored == []
    assert list(back.aliases) == extras["aliases"]
    assert list(back.engine.args) == extras["args"]
    assert dict(back.engine.env) == extras["env"]
    assert back.weights is not None and back.weights.source == extras["source"]
    assert back.engine.apptainer_image == extras["image"]


def _settings(examples: int) -> settings:
    # Modest counts: each rendered case runs bash and a few stubs (~20 ms). No explain
    # phase: it reruns a failing case hundreds of times, minutes of bash.
    return settings(
        max_examples=examples,
        phases=[p for p in Phase if p is not Phase.explain],
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# --- replicas: replica.sbatch.j2 (one node) and replica-hetjob.sbatch.j2 ------------

_REPLICA_VALID: dict[str, Any] = {
    **_SERVER_VALID,
    "partition": "llm",
    "account": None,
    "qos": None,
    "constraint": None,
    "gpu_type": "a100",
    "memory": "8G",
    "time_limit": "1h",
    "model_name": "m",
}
_REPLICA_TAKEN: dict[str, st.SearchStrategy[Any]] = {
    **_SERVER_TAKEN,
    "partition": _taken(catalog_mod._PARTITION_RE),
    "account": _taken(catalog_mod._SLURM_NAME_RE),
    "qos": _taken(catalog_mod._SLURM_NAME_RE),
    "constraint": _taken(catalog_mod._CONSTRAINT_RE),
    "gpu_type": _taken(catalog_mod._SLURM_NAME_RE),
    "memory": _taken(catalog_mod._MEM_RE).filter(lambda m: len(m) < 12),
    "time_limit": _time | _taken(r"[1-9][0-9]{0,3}[smhd]"),
    "model_name": _taken(catalog_mod.MODEL_NAME_RE),
}


@pytest.mark.parametrize("nodes", [1, 3], ids=["replica", "replica-hetjob"])
@_settings(80)
@given(
    case=_cases(_REPLICA_VALID, _REPLICA_TAKEN),
    extras=_extras,
    cpus=st.integers(1, 64),
)
def test_no_catalog_or_config_value_reaches_a_replica_shell_unquoted(
    nodes: int, case: dict[str, Any], extras: dict[str, Any], cpus: int
) -> None:
    v = case
    with tempfile.TemporaryDirectory() as d:
        top = Path(d)
        resources = {
            "gpus": 1,
            "nodes": nodes,
            "cpus": cpus,
            "partition": v["partition"],
            "account": v["account"],
            "qos": v["qos"],
            "constraint": v["constraint"],
            "gpu_type": v["gpu_type"],
            "memory": v["memory"],
            "time_limit": v["time_limit"],
        }
        loaded = _load(top, _model_entry(v["model_name"], extras, _drop_none(resources)), v)
        if loaded is None:
            return
        builder = JobBuilder(
            loaded.cfg, b"k" * 64, "http://127.0.0.1:1", "certificate", python=loaded.python
        )
        spec = _render(
            lambda: builder.spec(loaded.model, "0a1b2c3d"), may_refuse=_odd_python(loaded.python)
        )
        if spec is None:
            return
        event("rendered and run")
        _check_script(spec.script, job_names=nodes)
        assert spec.script.count("#SBATCH hetjob") == nodes - 1
        ran = _sandbox(top, spec.script, env=spec.env)
        if nodes == 1:
            srun = ["srun", "--ntasks=1", "--nodes=1"]
        else:
            srun = ["srun", f"--het-group=0-{nodes - 1}", "--ntasks-per-node=1"]
        srun += ["--kill-on-bad-exit=1", f"--cpus-per-task={cpus}"]
        _assert_ran(
            ran,
            [*srun, loaded.python, *_AGENT, "--config", loaded.agent, "run"],
            spec.env,
        )
        _assert_spec_arrived(ran, spec, loaded.model, extras)


# --- model job: model-job.sbatch.j2 -------------------------------------------------

_FETCH_VALID: dict[str, Any] = {**_SERVER_VALID, "model_name": "m", "time": None}
_FETCH_TAKEN: dict[str, st.SearchStrategy[Any]] = {
    **_SERVER_TAKEN,
    "model_name": _taken(catalog_mod.MODEL_NAME_RE),
    "time": _time,  # llmgw-admin fetch --time
}


@_settings(80)
@given(case=_cases(_FETCH_VALID, _FETCH_TAKEN), extras=_extras, allow_download=st.booleans())
def test_no_catalog_or_config_value_reaches_a_model_job_shell_unquoted(
    case: dict[str, Any], extras: dict[str, Any], allow_download: bool
) -> None:
    v = case
    with tempfile.TemporaryDirectory() as d:
        top = Path(d)
        loaded = _load(top, _model_entry(v["model_name"], extras, {"gpus": 1}), v)
        if loaded is None:
            return
        builder = ServiceJobBuilder(loaded.cfg, python=loaded.python)
        spec = _render(
            lambda: builder.fetch(loaded.model, time=v["time"], allow_download=allow_download),
            # --time is checked at rendering.
            may_refuse=_odd_python(loaded.python) or v["time"] is not None,
        )
        if spec is None:
            return
        event("rendered and run")
        _check_script(spec.script)
        ran = _sandbox(top, spec.script, env=spec.env, exe=loaded.python)
        allow = ["--allow-hf"] if allow_download else []
        _assert_ran(
            ran,
            [loaded.python, *_AGENT, "--config", loaded.agent, *allow, "fetch"],
            spec.env,
        )
        _assert_spec_arrived(ran, spec, loaded.model, extras)
        assert ran.envs[-1]["LLMGW_MODEL"] == loaded.model.name


# --- engine install: engine-install.sbatch.j2 ---------------------------------------

_INSTALL_VALID: dict[str, Any] = {
    **_SERVER_VALID,
    "kind": "venv",
    "target": "/opt/engines/vllm",
    "packages": ["vllm==0.6.3"],
    "pip_args": [],
    "image_uri": "docker://vllm/vllm:v0.6.3",
    "apptainer": "apptainer",
    "time": None,
}
# What llmgw-admin install-engine passes on from its command line.
_INSTALL_TAKEN: dict[str, st.SearchStrategy[Any]] = {
    **_SERVER_TAKEN,
    "target": _taken(r"/[A-Za-z0-9_.,%+/=@:-]{1,30}"),
    "packages": st.lists(_taken(sbatch_mod._REQUIREMENT), max_size=3),
    "pip_args": st.lists(_line(), max_size=3),
    "image_uri": _taken(sbatch_mod._IMAGE_URI),
    "apptainer": _line().filter(bool),
    "time": _time,
}
_INSTALL_BAD: dict[str, st.SearchStrategy[Any]] = {
    "target": _word | st.builds("/{}".format, _free),
    "packages": st.lists(_word, min_size=1, max_size=2),
    "pip_args": st.lists(_word, min_size=1, max_size=2),
}


@pytest.mark.parametrize("kind", ["venv", "apptainer"])
@_settings(60)
@given(data=st.data(), system_site_packages=st.booleans())
def test_no_admin_option_or_config_value_reaches_an_engine_install_shell_unquoted(
    kind: str, data: st.DataObject, system_site_packages: bool
) -> None:
    v = data.draw(
        _cases(
            {**_INSTALL_VALID, "kind": kind},
            {**_INSTALL_TAKEN, "kind": st.just(kind)},
            _INSTALL_BAD,
        ),
        label="case",
    )
    venv = v["kind"] == "venv"
    with tempfile.TemporaryDirectory() as d:
        top = Path(d)
        loaded = _load(top, _model_entry("m", _NO_EXTRAS, {"gpus": 1}), v)
        if loaded is None:
            return
        builder = ServiceJobBuilder(loaded.cfg, python=loaded.python)
        # llmgw-admin install-engine sends venv options only with venv, the image only
        # with apptainer (it refuses the others with a usage error).
        spec = _render(
            lambda: builder.install(
                v["kind"],
                v["target"],
                packages=v["packages"] if venv else (),
                pip_args=v["pip_args"] if venv else (),
                system_site_packages=system_site_packages and venv,
                image_uri="" if venv else v["image_uri"],
                apptainer=v["apptainer"],
                time=v["time"],
            ),
            # The command line's options are checked at rendering.
            may_refuse=True,
        )
        if spec is None:
            return
        event("rendered and run")
        _check_script(spec.script)
        ran = _sandbox(top, spec.script, env=spec.env, exe=loaded.python)
        last = [loaded.python, *_AGENT, "--config", loaded.agent, "install"]
        last += ["--kind", v["kind"], "--target", v["target"]]
        if venv:
            last += ["--python", loaded.python]
            last += ["--system-site-packages"] if system_site_packages else []
            last += [f"--pip-arg={a}" for a in v["pip_args"]]
            last += [f"--package={r}" for r in v["packages"]]
        else:
            last += ["--apptainer", v["apptainer"], "--image-uri", v["image_uri"]]
        _assert_ran(ran, last, spec.env)


# --- the sandbox itself -------------------------------------------------------------


def test_the_sandbox_catches_an_unquoted_value(tmp_path: Path) -> None:
    """The checks above can fail: a script that runs a value unquoted is caught, by
    the PWNED file, by bash's trace (a builtin ran), or by the stubs' record."""
    (tmp_path / "job.sh").write_text('v="x; touch PWNED"\neval "echo $v"\n')
    subprocess.run(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env={"PATH": os.defpath})
    assert (tmp_path / "PWNED").exists()

    preamble = 'set -euo pipefail\necho "$(hostname) $(date -u +%Y-%m-%dT%H:%M:%SZ)"\n'
    for i, (body, caught) in enumerate(
        (
            ("exec srun a\n", None),
            ("exec srun a $(>PWNED)\n", "a hostile value was executed"),  # the file
            ("exec srun a $(: sneaky)\n", "'echo', ':', 'exec'"),  # the trace: a builtin
            ("exec srun a $(srun b)\n", "'echo', 'srun', 'exec'"),  # the trace: a command
            ("exec srun 'a b'\n", "['srun', 'a b']"),  # the record: one argument, not two
        )
    ):
        top = tmp_path / str(i)
        top.mkdir()
        try:
            _assert_ran(_sandbox(top, preamble + body), ["srun", "a"])
        except AssertionError as exc:
            assert caught is not None and caught in str(exc), (body, str(exc))
        else:
            assert caught is None, f"not caught: {body!r}"


def test_the_sandbox_records_argv_and_environment_exactly(tmp_path: Path) -> None:
    values = ["", "a b", "x\ny", "'\"$(touch PWNED)`", "=", "\u202e", "-"]
    exe = str(tmp_path / "bin" / "py thon $x")
    text = (
        'set -euo pipefail\necho "$(hostname) $(date -u +%Y-%m-%dT%H:%M:%SZ)"\n'
        f"exec {shlex.join([exe, *values])}\n"
    )
    env = {"K1": "v\n=w", "K2": "$(touch PWNED)"}
    _assert_ran(_sandbox(tmp_path, text, env=env, exe=exe), [exe, *values], env)


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
