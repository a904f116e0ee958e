"""The command-line backend's failure paths: missing, hanging, failing and babbling commands.

These stand in stub executables for Slurm's tools on purpose: a real Slurm
cannot be made to hang or print nonsense on demand. The happy paths run against
the real cluster in tests/slurm.
"""

from __future__ import annotations

import asyncio
import os
import stat
from datetime import datetime
from pathlib import Path

import pytest

from llmgw_slurm.base.errors import SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm import JobSpec
from llmgw_slurm.slurm.cli import CliBackend

DATA = Path(__file__).parent / "data"


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


async def test_missing_command_names_it(tmp_path: Path) -> None:
    backend = CliBackend(bin_dir=str(tmp_path))
    with pytest.raises(SlurmUnavailable) as err:
        await backend.list_jobs()
    assert "squeue" in str(err.value)
    assert "not found" in str(err.value)


async def test_hanging_command_times_out(tmp_path: Path) -> None:
    stub(tmp_path, "sinfo", "exec sleep 30")
    backend = CliBackend(bin_dir=str(tmp_path), timeout=0.5)
    with pytest.raises(SlurmUnavailable, match=r"sinfo: no answer within 0.5s"):
        await backend.list_nodes()


async def test_a_command_whose_caller_gave_up_is_killed_and_reaped(tmp_path: Path) -> None:
    stub(tmp_path, "sinfo", f"echo $$ > {tmp_path}/pid; exec sleep 30")
    backend = CliBackend(bin_dir=str(tmp_path))
    call = asyncio.create_task(backend.list_nodes())
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().strip():
        await asyncio.sleep(0.01)
    pid = int((tmp_path / "pid").read_text())
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Gone, not a zombie: waited for before the cancellation went on.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_failure_carries_command_exit_code_and_stderr(tmp_path: Path) -> None:
    stub(tmp_path, "sbatch", 'echo "sbatch: error: Invalid partition name specified" >&2; exit 1')
    backend = CliBackend(bin_dir=str(tmp_path))
    with pytest.raises(SlurmError) as err:
        await backend.submit(JobSpec(name="llmgw.m.00000000", script="#!/bin/sh\ntrue\n"))
    e = err.value
    assert e.returncode == 1
    assert "Invalid partition" in e.stderr
    assert e.command[0].endswith("sbatch")
    assert "Invalid partition name specified" in str(e)


async def test_unexpected_sbatch_output_is_a_parse_error_not_a_traceback(tmp_path: Path) -> None:
    stub(tmp_path, "sbatch", 'echo "Submitted batch job soon"')
    backend = CliBackend(bin_dir=str(tmp_path))
    with pytest.raises(SlurmParseError, match="expected a job id"):
        await backend.submit(JobSpec(name="llmgw.m.00000000", script="#!/bin/sh\ntrue\n"))


@pytest.mark.parametrize("command", ["squeue", "sinfo", "sacct"])
async def test_an_answer_with_no_line_in_the_asked_format_is_an_error_not_an_empty_list(
    tmp_path: Path, command: str
) -> None:
    # A site wrapper's banner, a changed Slurm: taken as "no jobs", the reconciler
    # would think every replica gone and submit new ones (duplicates).
    stub(tmp_path, command, 'echo "slurm_load_jobs: something odd"; echo; echo "and more"')
    backend = CliBackend(bin_dir=str(tmp_path))
    calls = {
        "squeue": lambda: backend.list_jobs("llmgw."),
        "sinfo": backend.list_nodes,
        "sacct": lambda: backend.accounting(datetime(2026, 1, 1)),
    }
    with pytest.raises(SlurmParseError) as err:
        await calls[command]()
    assert str(err.value).startswith(f"{command}: none of its 2 line(s) is in the format asked for")
    assert "'slurm_load_jobs: something odd'" in str(err.value)


async def test_a_banner_before_the_rows_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = (DATA / "squeue.txt").read_text()
    (tmp_path / "rows").write_text("Welcome to the cluster\n" + rows)
    stub(tmp_path, "squeue", f"cat {tmp_path / 'rows'}")
    jobs = await CliBackend(bin_dir=str(tmp_path)).list_jobs()
    assert sorted(j.job_id for j in jobs) == ["10", "12", "9"]
    assert "skipping a line with 1 fields" in caplog.text


async def test_a_job_of_the_prefix_that_cannot_be_read_fails_the_listing(tmp_path: Path) -> None:
    # Skipped, it would look like a job that ended: reaped, replaced, duplicated.
    rows = (DATA / "squeue.txt").read_text().replace("2026-12-02T16:48:54", "yesterday", 1)
    (tmp_path / "rows").write_text(rows)
    stub(tmp_path, "squeue", f"cat {tmp_path / 'rows'}")
    backend = CliBackend(bin_dir=str(tmp_path))
    with pytest.raises(SlurmParseError, match=r"cannot read job 12: .*not guessing its state"):
        await backend.list_jobs("llmgw.pend.")
    # Another prefix's jobs are not its business: that row is dropped unread.
    assert [j.job_id for j in await backend.list_jobs("llmgw.m1.")] == ["9"]


async def test_commands_get_no_input_variables_and_iso_times(tmp_path: Path) -> None:
    # SQUEUE_STATES would hide replicas, SCANCEL_SIGNAL turn a cancel into a signal,
    # SBATCH_EXPORT=NONE strip the job of its secrets, SLURM_TIME_FORMAT break every time.
    for name in ("squeue", "scancel", "sbatch"):
        stub(tmp_path, name, f"env > {tmp_path}/{name}.env; cat > /dev/null; echo 7")
    backend = CliBackend(
        bin_dir=str(tmp_path),
        env={
            "PATH": "/usr/bin:/bin",
            "SLURM_CONF": "/etc/slurm/x.conf",
            "SQUEUE_STATES": "PENDING",
            "SCANCEL_SIGNAL": "USR1",
            "SBATCH_EXPORT": "NONE",
            "SLURM_TIME_FORMAT": "relative",
            "SACCT_FORMAT": "JobID",
        },
    )
    with pytest.raises(SlurmParseError):
        await backend.list_jobs()
    await backend.cancel("7")
    await backend.submit(
        JobSpec(name="llmgw.m.00000000", script="#!/bin/sh\ntrue\n", env={"LLMGW_X": "1"})
    )
    for name in ("squeue", "scancel", "sbatch"):
        env = dict(
            line.split("=", 1) for line in (tmp_path / f"{name}.env").read_text().splitlines()
        )
        assert env["SLURM_TIME_FORMAT"] == "standard", name
        assert env["SLURM_CONF"] == "/etc/slurm/x.conf", name
        assert not {"SQUEUE_STATES", "SCANCEL_SIGNAL", "SBATCH_EXPORT", "SACCT_FORMAT"} & set(env)
    sbatch_env = (tmp_path / "sbatch.env").read_text()
    assert "LLMGW_X=1" in sbatch_env  # the job's own variables still reach it


async def test_cancel_of_a_finished_job_is_not_an_error(tmp_path: Path) -> None:
    stub(
        tmp_path,
        "scancel",
        'echo "scancel: error: Kill job error on job id 5: Job/step already completing or completed" >&2; exit 1',
    )
    backend = CliBackend(bin_dir=str(tmp_path))
    await backend.cancel("5")
    assert backend.call_counts["scancel"] == 1


async def test_submit_passes_env_not_argv_and_script_on_stdin(tmp_path: Path) -> None:
    record = tmp_path / "record"
    stub(
        tmp_path,
        "sbatch",
        f'printf "%s\\n" "$@" > {record}.argv; cat > {record}.stdin; '
        f'printf "%s" "$LLMGW_REPLICA_SECRET" > {record}.env; echo 42',
    )
    backend = CliBackend(bin_dir=str(tmp_path))
    hostile = "llmgw.it's $(rm -rf /); `x`"
    job_id = await backend.submit(
        JobSpec(
            name=hostile,
            script="#!/bin/sh\necho hi\n",
            env={"LLMGW_REPLICA_SECRET": "s3cret"},
            comment="a b|c",
        )
    )
    assert job_id == "42"
    argv = Path(f"{record}.argv").read_text().splitlines()
    assert f"--job-name={hostile}" in argv
    assert "--comment=a b|c" in argv
    assert not any("s3cret" in a for a in argv)
    assert Path(f"{record}.env").read_text() == "s3cret"
    assert Path(f"{record}.stdin").read_text() == "#!/bin/sh\necho hi\n"


def test_already_gone_is_one_rule_for_every_backend() -> None:
    from llmgw_slurm.slurm.types import already_gone

    # scancel's stderr, slurm_strerror's words (pyslurm), slurmrestd's codes or words.
    assert already_gone("5", "scancel: error: Kill job error on job id 5: Invalid job id specified")
    assert already_gone("5", "Job/step already completing or completed")
    assert already_gone("5", "slurm error 2021", 2021) and already_gone("5", "", 2017)
    assert already_gone("5", "Job 5 does not exist")
    assert not already_gone("5", "Access/permission denied", 1)
    assert not already_gone("5", "Unable to contact slurm controller (connect failure)")
