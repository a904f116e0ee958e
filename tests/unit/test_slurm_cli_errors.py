"""The command-line backend's failure paths: missing, hanging, failing and babbling commands.

These stand in stub executables for Slurm's tools on purpose: a real Slurm
cannot be made to hang or print nonsense on demand. The happy paths run against
the real cluster in tests/slurm.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmgw_slurm.errors import SlurmError, SlurmParseError, SlurmUnavailable
from llmgw_slurm.slurm import JobSpec
from llmgw_slurm.slurm.cli import CliBackend


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


async def test_garbage_listing_yields_no_jobs_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stub(tmp_path, "squeue", 'echo "slurm_load_jobs: something odd"')
    backend = CliBackend(bin_dir=str(tmp_path))
    assert await backend.list_jobs() == []
    assert "skipping a line" in caplog.text


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
