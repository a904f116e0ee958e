"""The rest backend's pure parts: job descriptions, answers, token sources, its config.

The backend against a real slurmrestd is tests/slurm/test_adapter.py (the
contract) and tests/slurm/test_rest.py (tokens, outages, versions).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from llmgw_slurm.base.errors import ConfigError, ConfigErrors, SlurmError, SlurmUnavailable
from llmgw_slurm.config import load_server_config
from llmgw_slurm.slurm import JobSpec, JobState, make_backend
from llmgw_slurm.slurm.rest import RestBackend
from llmgw_slurm.slurm.rest_auth import REFUSED_HOLD, SigningKey, TokenFile, claims
from llmgw_slurm.slurm.rest_parse import (
    accounting_from_rest,
    alloc_tres,
    group_jobs,
    job_from_components,
    job_state,
    node_from_rest,
    number,
)
from llmgw_slurm.slurm.rest_submit import megabytes, submit_body

# ------------------------------------------------------------------ submissions


def body(script: str, **spec: Any) -> dict[str, Any]:
    return submit_body(
        JobSpec(name=spec.pop("name", "llmgw.m.0000abcd"), script=script, **spec),
        {"PATH": "/usr/bin", "HOME": "/home/svc", "SECRET_OF_DAEMON": "x"},
        "/srv/llmgw",
    )


def test_a_scripts_options_become_the_fields_sbatch_would_set() -> None:
    script = "\n".join(
        [
            "#!/bin/bash",
            "#SBATCH --partition=llm -N 1 --ntasks=1 --gres=gpu:a100:2",
            "#SBATCH -t 1:30 --cpus-per-task=4 --mem=2G --requeue --hold",
            "#SBATCH --output=/tmp/o --error=/tmp/e --open-mode=append",
            "#SBATCH --signal=B:USR1@120 --constraint=nvlink --array=0-3",
            "echo run",
            "#SBATCH --qos=after-the-first-command-is-not-read",
        ]
    )
    job = body(script)["job"]
    assert job == {
        "partition": "llm",
        "nodes": "1",
        "tasks": 1,
        "tres_per_node": "gres/gpu:a100:2",
        # 1 minute 30 seconds: sbatch rounds up to whole minutes.
        "time_limit": {"set": True, "infinite": False, "number": 2},
        "cpus_per_task": 4,
        "memory_per_node": {"set": True, "infinite": False, "number": 2048},
        "requeue": True,
        "hold": True,
        "standard_output": "/tmp/o",
        "standard_error": "/tmp/e",
        "open_mode": ["APPEND"],
        "kill_warning_signal": "10",
        "kill_warning_delay": {"set": True, "infinite": False, "number": 120},
        "kill_warning_flags": ["BATCH_JOB"],
        "constraints": "nvlink",
        "array": "0-3",
        "current_working_directory": "/srv/llmgw",
        "name": "llmgw.m.0000abcd",
        "environment": ["PATH=/usr/bin", "HOME=/home/svc", "SECRET_OF_DAEMON=x"],
        "script": script,
    }


def test_a_heterogeneous_script_is_one_description_per_component() -> None:
    script = (
        "#!/bin/bash\n#SBATCH -p llm -N 1 --gres=gpu:a100:1 --output=/dev/null\n"
        "#SBATCH hetjob\n#SBATCH -p llm-big -N 2 --gpus=2\nsrun --het-group=0,1 true\n"
    )
    out = body(script, comment="model=m", workdir="/work", env={"LLMGW_SECRET": "s"})
    assert "job" not in out
    first, second = out["jobs"]
    assert (first["partition"], second["partition"]) == ("llm", "llm-big")
    assert second["tres_per_job"] == "gres/gpu:2" and second["nodes"] == "2"
    # The script once, on the first; the spec's name, comment, work dir and
    # environment on each, as sbatch's command-line options apply to each component.
    assert first["script"] == script and "script" not in second
    for comp in (first, second):
        assert comp["name"] == "llmgw.m.0000abcd"
        assert comp["comment"] == "model=m"
        assert comp["current_working_directory"] == "/work"
        assert "LLMGW_SECRET=s" in comp["environment"]


def test_the_spec_wins_over_the_script_and_unset_env_is_left_out() -> None:
    job = body(
        "#!/bin/sh\n#SBATCH --job-name=other --comment=old --chdir=/old\n",
        comment="new",
        workdir="/new",
        env={"PATH": "/ours"},
        unset_env=("SECRET_OF_DAEMON",),
    )["job"]
    assert (job["name"], job["comment"], job["current_working_directory"]) == (
        "llmgw.m.0000abcd",
        "new",
        "/new",
    )
    assert job["environment"] == ["PATH=/ours", "HOME=/home/svc"]
    # Without a spec work dir, the script's --chdir holds.
    assert body("#!/bin/sh\n#SBATCH --chdir=/old\n")["job"]["current_working_directory"] == "/old"


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ("--time=UNLIMITED", "time_limit", {"set": True, "infinite": True, "number": 0}),
        ("--time=1-02:00:00", "time_limit", {"set": True, "infinite": False, "number": 1560}),
        ("--mem-per-cpu=512K", "memory_per_cpu", {"set": True, "infinite": False, "number": 1}),
        ("--mem-per-gpu=a100:4G", "memory_per_tres", "gres/gpu:a100:4096"),
        ("--cpus-per-gpu=8", "cpus_per_tres", "gres/gpu:8"),
        ("--gres=gpu:2,nic:1", "tres_per_node", "gres/gpu:2,gres/nic:1"),
        ("--exclusive", "shared", ["none"]),
        ("-s", "shared", ["oversubscribe"]),
        ("--no-requeue", "requeue", False),
        ("--signal=USR2", "kill_warning_delay", {"set": True, "infinite": False, "number": 60}),
        ("--mail-type=end,fail", "mail_type", ["END", "FAIL"]),
        ("--tmp=1G", "temporary_disk_per_node", 1024),
        ("-wgpunode1", "required_nodes", "gpunode1"),
    ],
)
def test_one_option(line: str, field: str, value: object) -> None:
    assert body(f"#!/bin/sh\n#SBATCH {line}\n")["job"][field] == value


def test_gres_none_asks_for_no_gres() -> None:
    assert "tres_per_node" not in body("#!/bin/sh\n#SBATCH --gres=none\n")["job"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("#SBATCH --export=NONE", "'--export=NONE' is not one it can pass on"),
        ("#SBATCH --exclusive=user", "'--exclusive=user' is not one it can pass on"),
        ("#SBATCH --cpus-per-task=four", "--cpus-per-task=four: wants a number, got 'four'"),
        ("#SBATCH --mem=lots", "'lots' is not a size like 500M"),
        ("#SBATCH --time=1:99", "seconds must be under 60"),
        ("#SBATCH --partition", "has no value"),
        ("#SBATCH llm", "unexpected #SBATCH word 'llm'"),
        ("#SBATCH --signal=X:USR1@60", "is not [{R|B}:]SIG[@SECONDS]"),
        ("#SBATCH --signal=NOPE", "unknown signal 'NOPE'"),
    ],
)
def test_what_cannot_be_passed_on_is_refused_by_name(line: str, says: str) -> None:
    with pytest.raises(SlurmError) as err:
        body(f"#!/bin/sh\n{line}\n")
    assert says in err.value.message
    assert "the rest backend reads these #SBATCH options" in err.value.message


def test_megabytes_round_kilobytes_up_as_sbatch_does() -> None:
    assert [megabytes(v) for v in ("500", "500M", "1025K", "2g", "1T")] == [
        500,
        500,
        2,
        2048,
        1024 * 1024,
    ]


# ------------------------------------------------------------------- answers


def nv(n: int) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": n}


UNSET = {"set": False, "infinite": False, "number": 0}
NOW = int(datetime(2026, 12, 5, 9, 0).timestamp())


def rest_job(**over: Any) -> dict[str, Any]:
    j: dict[str, Any] = {
        "job_id": 41,
        "name": "llmgw.m.0000abcd",
        "user_name": "svc",
        "job_state": ["RUNNING"],
        "state_reason": "None",
        "partition": "llm",
        "comment": "model=m",
        "nodes": "gpunode[3-4]",
        "node_count": nv(2),
        "tres_per_node": "gres/gpu:a100:2",
        "time_limit": nv(10),
        "submit_time": nv(NOW - 60),
        "start_time": nv(NOW),
        "end_time": nv(NOW + 600),
        "restart_cnt": 0,
        "het_job_id": nv(0),
        "het_job_offset": nv(0),
        "array_job_id": nv(0),
    }
    j.update(over)
    return j


def test_numbers_with_flags() -> None:
    assert [number(nv(5)), number(UNSET), number({"set": True, "infinite": True}), number(7)] == [
        5,
        None,
        None,
        7,
    ]


@pytest.mark.parametrize(
    ("states", "state"),
    [
        (["RUNNING"], JobState.RUNNING),
        (["RUNNING", "COMPLETING"], JobState.COMPLETING),
        (["PENDING", "REQUEUED"], JobState.PENDING),
        (["CANCELLED"], JobState.CANCELLED),
        (["RUNNING", "CONFIGURING"], JobState.CONFIGURING),
        ([], JobState.UNKNOWN),
    ],
)
def test_a_state_list_reads_as_squeues_long_state(states: list[str], state: JobState) -> None:
    assert job_state(states) is state


def test_a_running_job() -> None:
    job = job_from_components("41", [rest_job()])
    assert job.state is JobState.RUNNING and job.reason == ""
    assert job.nodes == ("gpunode3", "gpunode4") and job.time_limit_s == 600
    assert job.start_time == datetime.fromtimestamp(NOW)
    assert job.end_time == datetime.fromtimestamp(NOW + 600)
    assert job.components[0].tres_per_node == "gres/gpu:a100:2"
    assert job.array_job_id == ""


def test_no_end_without_a_limit_and_none_while_pending() -> None:
    # Slurm fills start + a year for a job without a limit; squeue prints NONE.
    unlimited = rest_job(time_limit={"set": False, "infinite": True, "number": 0})
    unlimited["end_time"] = nv(NOW + 365 * 86400)
    assert job_from_components("41", [unlimited]).end_time is None
    pending = job_from_components("41", [rest_job(job_state=["PENDING"], nodes="")])
    assert (pending.start_time, pending.end_time, pending.nodes) == (None, None, ())


def test_heterogeneous_components_fold_into_one_job() -> None:
    head = rest_job(job_id=50, het_job_id=nv(50), het_job_offset=nv(0), nodes="gpunode1")
    tail = rest_job(job_id=51, het_job_id=nv(50), het_job_offset=nv(1), nodes="gpunode2")
    groups = group_jobs([tail, head, rest_job(user_name="other")], "svc", "llmgw.")
    assert list(groups) == ["50"]
    job = job_from_components("50", groups["50"])
    assert [c.offset for c in job.components] == [0, 1]
    assert job.components[0].job_id == "50" and job.nodes == ("gpunode1", "gpunode2")


def test_an_arrays_tasks_name_the_array_except_its_own_id() -> None:
    assert job_from_components("5", [rest_job(job_id=5, array_job_id=nv(4))]).array_job_id == "4"
    assert job_from_components("4", [rest_job(job_id=4, array_job_id=nv(4))]).array_job_id == ""


def test_nodes_in_sinfos_words() -> None:
    node = node_from_rest(
        {
            "name": "gpunode3",
            "state": ["MIXED", "DRAIN"],
            "partitions": ["research", "llm"],
            "cpus": 16,
            "alloc_cpus": 1,
            "real_memory": 32000,
            "alloc_memory": 500,
            "gres": "gpu:a100:4",
            "gres_used": "gpu:a100:2(IDX:0-1)",
            "features": ["nvlink"],
            "address": "127.0.10.3",
            "reason": "maintenance",
        }
    )
    assert node.state == "draining" and not node.usable
    assert (node.gpus_total("a100"), node.gpus_free("a100")) == (4, 2)
    assert (node.features, node.memory_alloc_mb) == (("nvlink",), 500)
    idle = node_from_rest({"name": "n", "state": ["IDLE", "NOT_RESPONDING"], "gres": ""})
    assert idle.state == "idle*" and idle.gpus == ()


def dbjob(**over: Any) -> dict[str, Any]:
    j: dict[str, Any] = {
        "job_id": 9,
        "name": "llmgw.m.0000abcd",
        "user": "svc",
        "account": "ai",
        "partition": "llm",
        "state": {"current": ["PREEMPTED"], "reason": "None"},
        "exit_code": {"return_code": nv(0), "signal": {"id": nv(15)}},
        "comment": {"administrator": "", "job": "model=m", "system": ""},
        "time": {"submission": NOW - 60, "start": NOW, "end": NOW + 30, "elapsed": 30},
        "allocation_nodes": 1,
        "het": {"job_id": 0, "job_offset": UNSET},
        "array": {"job_id": 0, "task_id": UNSET},
        "tres": {
            "allocated": [
                {"type": "cpu", "name": "", "count": 1},
                {"type": "mem", "name": "", "count": 500},
                {"type": "energy", "name": "", "count": -2},
                {"type": "gres", "name": "gpu", "count": 2},
            ]
        },
    }
    j.update(over)
    return j


def test_accounting_reads_like_sacct() -> None:
    rec = accounting_from_rest(dbjob())
    assert (rec.job_id, rec.state, rec.exit_code, rec.comment) == (
        "9",
        JobState.PREEMPTED,
        "0:15",
        "model=m",
    )
    assert (rec.alloc_tres, rec.gpus, rec.elapsed_s) == ("cpu=1,gres/gpu=2,mem=500M", 2, 30)
    assert rec.end == datetime.fromtimestamp(NOW + 30)
    het = accounting_from_rest(dbjob(het={"job_id": 7, "job_offset": nv(1)}))
    task = accounting_from_rest(dbjob(array={"job_id": 4, "task_id": nv(2)}))
    assert (het.job_id, task.job_id) == ("7+1", "4_2")


def test_alloc_tres_leaves_out_what_was_not_gathered() -> None:
    assert alloc_tres([{"type": "energy", "name": "", "count": -2}]) == ""


# ------------------------------------------------------------------------ tokens


def jwt(payload: dict[str, Any], key: bytes = b"k") -> str:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(b'{"alg":"HS256","typ":"JWT"}')
    body_ = b64(json.dumps(payload).encode())
    sig = hmac.new(key, f"{head}.{body_}".encode(), hashlib.sha256).digest()
    return f"{head}.{body_}.{b64(sig)}"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def private(path: Path, text: str | bytes) -> Path:
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    path.chmod(0o600)
    return path


def test_a_token_file_is_read_as_scontrol_token_writes_it_and_again_when_it_changes(
    tmp_path: Path,
) -> None:
    clock = Clock(NOW)
    first = jwt({"sun": "svc", "exp": NOW + 3600, "iat": NOW})
    f = private(tmp_path / "jwt", f"SLURM_JWT={first}\n")
    src = TokenFile(f, clock=clock)
    assert src.user == "svc" and src.current().text == first
    second = jwt({"sun": "svc", "exp": NOW + 7200, "iat": NOW + 10})
    f.write_text(f"export SLURM_JWT={second}\n")
    assert src.current().text == second


def test_an_expired_token_is_not_sent_and_the_error_says_what_to_do(tmp_path: Path) -> None:
    clock = Clock(NOW)
    f = private(tmp_path / "jwt", jwt({"sun": "svc", "exp": NOW + 60, "iat": NOW - 3540}))
    src = TokenFile(f, clock=clock)
    clock.t = NOW + 61
    with pytest.raises(SlurmUnavailable) as err:
        src.current()
    assert "expired at" in err.value.message and "scontrol token" in err.value.message


def test_a_token_near_its_end_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(NOW)
    token = jwt({"sun": "svc", "exp": NOW + 3600, "iat": NOW})
    src = TokenFile(private(tmp_path / "jwt", token), clock=clock)
    src.current()
    assert "expires at" not in caplog.text
    clock.t = NOW + 3600 - 700  # a fifth of an hour is 720 s
    with caplog.at_level(logging.WARNING):
        src.current()
        src.current()
    assert caplog.text.count("has not been replaced yet") == 1
    assert token not in caplog.text


def test_a_token_for_another_user_or_an_open_file_is_refused_at_start(tmp_path: Path) -> None:
    f = private(tmp_path / "jwt", jwt({"sun": "alice", "exp": NOW + 60}))
    with pytest.raises(ConfigError, match="token for user alice, but the service runs as svc"):
        TokenFile(f, user="svc", clock=Clock(NOW))
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="may be read or changed by other users"):
        TokenFile(f, clock=Clock(NOW))
    with pytest.raises(ConfigError, match="does not hold a JWT"):
        TokenFile(private(tmp_path / "junk", "hello\n"), clock=Clock(NOW))


def test_a_refused_token_is_held_back_until_the_file_has_another(tmp_path: Path) -> None:
    clock = Clock(NOW)
    f = private(tmp_path / "jwt", jwt({"sun": "svc", "exp": NOW + 3600}))
    src = TokenFile(f, clock=clock)
    bad = src.current()
    assert src.refused(bad) is None
    with pytest.raises(SlurmUnavailable, match="refused"):
        src.current()  # no request with it: no retry storm
    clock.t += REFUSED_HOLD + 1
    assert src.current() is bad  # the hold is over: maybe slurmctld's key was fixed
    src.refused(bad)
    good = jwt({"sun": "svc", "exp": NOW + 7200})
    f.write_text(good)
    assert src.current().text == good


def test_a_signing_key_mints_hs256_tokens_and_renews_them_in_time(tmp_path: Path) -> None:
    key = private(tmp_path / "jwt_hs256.key", os.urandom(32))
    clock = Clock(NOW)
    src = SigningKey(key, user="svc", lifespan=3600, clock=clock)
    token = src.current()
    head, payload, sig = token.text.split(".")
    want = hmac.new(key.read_bytes(), f"{head}.{payload}".encode(), hashlib.sha256).digest()
    assert base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4)) == want
    assert claims(token.text) == {"exp": NOW + 3600, "iat": NOW, "sun": "svc"}
    assert "text" not in repr(token) and token.text not in repr(token)
    clock.t = NOW + 3600 * 4 / 5 - 1
    assert src.current() is token
    clock.t = NOW + 3600 * 4 / 5 + 1  # a fifth left: a new one before slurmctld says no
    renewed = src.current()
    assert renewed is not token and renewed.expires == clock.t // 1 + 3600
    assert src.minted == 2


def test_a_refused_minted_token_waits_for_a_rotated_key(tmp_path: Path) -> None:
    key = private(tmp_path / "k", b"old-key")
    clock = Clock(NOW)
    src = SigningKey(key, user="svc", clock=clock)
    token = src.current()
    assert src.refused(token) is None  # the same key signs the same refusal
    with pytest.raises(SlurmUnavailable, match="refused"):
        src.current()
    key.write_bytes(b"new-key-longer")
    key.chmod(0o600)
    again = src.refused(token)
    assert again is not None and again.text != token.text


def test_a_signing_key_others_may_read_is_refused(tmp_path: Path) -> None:
    key = private(tmp_path / "k", b"secret")
    key.chmod(0o640)  # group may read: allowed, as slurmctld allows it
    SigningKey(key, user="svc")
    key.chmod(0o604)
    with pytest.raises(ConfigError, match="chmod 600"):
        SigningKey(key, user="svc")


# ------------------------------------------------------------------------ config


def test_the_backends_own_settings_are_checked(tmp_path: Path) -> None:
    key = private(tmp_path / "k", b"secret")
    with pytest.raises(ConfigError, match="set one of token_file"):
        RestBackend(url="http://h:6820")
    with pytest.raises(ConfigError, match="set one of token_file"):
        RestBackend(url="http://h:6820", token_file=key, jwt_key=key)
    with pytest.raises(ConfigError, match=r"expected http\(s\)://HOST:PORT"):
        RestBackend(url="h:6820", jwt_key=key)
    with pytest.raises(ConfigError, match=r"valid: v0.0.42, v0.0.43, v0.0.44"):
        RestBackend(url="http://h:6820", jwt_key=key, version="v0.0.40")
    with pytest.raises(ConfigError, match="rest backend"):
        make_backend("rest", jwt_key=key)  # no url


def test_server_yaml_needs_a_url_and_one_token_source_for_rest(tmp_path: Path) -> None:
    f = tmp_path / "server.yaml"
    f.write_text("slurm:\n  backend: rest\n")
    with pytest.raises(ConfigErrors) as err:
        load_server_config(f)
    text = str(err.value)
    assert "slurm.rest.url: backend rest needs slurmrestd's url" in text
    assert "slurm.rest: backend rest needs token_file or jwt_key" in text
    f.write_text(
        "slurm:\n  backend: rest\n  rest:\n    url: http://h:6820\n"
        "    token_file: a\n    jwt_key: b\n    version: v0.0.41\n"
    )
    with pytest.raises(ConfigErrors) as err:
        load_server_config(f)
    assert "expected one of: v0.0.42, v0.0.43, v0.0.44" in str(err.value)


def test_server_yaml_rest_block_becomes_the_backends_options(tmp_path: Path) -> None:
    key = private(tmp_path / "k", b"secret")
    f = tmp_path / "server.yaml"
    f.write_text(
        "slurm:\n  backend: rest\n  command_timeout: 20s\n  rest:\n"
        "    url: http://h:6820\n    jwt_key: k\n    user: svc\n    token_lifespan: 30m\n"
    )
    slurm = load_server_config(f).slurm
    b = make_backend(slurm.backend, **slurm.backend_options())
    assert isinstance(b, RestBackend)
    assert (b.url, b.version, b.user, b.timeout) == ("http://h:6820", "v0.0.44", "svc", 20.0)
    assert slurm.rest.jwt_key == key and slurm.rest.token_lifespan == 1800
    # Two backends in one process hold nothing in common (one per cluster).
    other = make_backend(slurm.backend, **slurm.backend_options(timeout=5))
    assert other is not b and other.timeout == 5.0 and b.timeout == 20.0
