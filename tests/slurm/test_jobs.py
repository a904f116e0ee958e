"""Model jobs and engine installs on the one-machine cluster, seen by a running daemon.

`llmgw-admin fetch` / `install-engine` run as the real command (a subprocess,
with this checkout on PYTHONPATH so that the jobs import it too), submit
through the Slurm adapter, and are followed with --wait; the daemon of the
harness, with the same job prefix, shows them in its status from its own
listing and never takes them for replicas.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tests.slurm.conftest import TOP, eventually
from tests.slurm.harness import Harness, running, tiny_model


async def admin(*args: str) -> tuple[int, str, str]:
    # This checkout first; the rest kept (with LLMGW_TEST_SLURM_BACKEND=pyslurm, pyslurm's folder).
    path = [str(TOP), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from llmgw_slurm.cli.admin import main; main()",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def status_jobs(h: Harness) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"{h.url}/api/v1/status") as resp:
        assert resp.status == 200
        body = await resp.json()
    jobs: list[dict[str, Any]] = body["jobs"]
    return jobs


async def ended_job(h: Harness, kind: str) -> dict[str, Any] | None:
    for j in await status_jobs(h):
        if j["kind"] == kind and j["ended_at"] is not None:
            return j
    return None


def weights_folder(tmp_path: Path) -> Path:
    src = tmp_path / "src-weights"
    src.mkdir()
    (src / "config.json").write_text('{"hidden_size": 64}')
    (src / "model.safetensors").write_bytes(os.urandom(4096))
    return src


async def test_fetch_job_copies_weights_into_the_cache_and_shows_completed(
    tmp_path: Path, prefix: str
) -> None:
    src = weights_folder(tmp_path)
    model = tiny_model("fetched", weights={"source": str(src), "method": "copy"})
    async with running(tmp_path, prefix, [model]) as h:
        rc, out, err = await admin("fetch", "fetched", "--server", str(h.server_yaml), "--wait")
        assert rc == 0, out + err
        # The job id alone on stdout (as sbatch --parsable), its states on stderr.
        assert out.strip().isdigit(), out
        assert "COMPLETED" in err and "fetched: " in err and "(fetched," in err, err
        (copy,) = (h.folder / "weights" / "models").iterdir()
        assert (copy / "config.json").read_text() == '{"hidden_size": 64}'
        assert (copy / ".llmgw-manifest.json").exists()
        job = await eventually(lambda: ended_job(h, "fetch"), "the fetch job in status", 90)
        assert job["state"] == "COMPLETED" and job["target"] == "fetched", job
        assert job["name"].startswith(f"{prefix}_job.fetch.fetched."), job
        assert "(fetched," in job["message"], job
        # Never taken for a replica: nothing adopted, nothing reaped.
        assert not h.rec.replicas
        assert not [d for d in h.rec.decisions if d.action in ("adopt", "reap")]
        rc, text, err = await admin("status", "--server", str(h.server_yaml))
        assert rc == 0, err
        assert job["job_id"] in text and "COMPLETED" in text, text


async def install_bare_venv(h: Harness, target: Path) -> str:
    """``llmgw-admin install-engine`` of a venv that sees this interpreter's packages
    (the project among them), waited for; what it said on stderr (its states)."""
    rc, out, err = await admin(
        "install-engine",
        "venv",
        str(target),
        "--system-site-packages",
        "--server",
        str(h.server_yaml),
        "--wait",
    )
    assert rc == 0, out + err
    assert out.strip().isdigit(), out
    return err


async def test_engine_install_venv_completes(tmp_path: Path, prefix: str) -> None:
    target = tmp_path / "engines" / "bare-1.0"
    async with running(tmp_path, prefix, [tiny_model("unused")]) as h:
        out = await install_bare_venv(h, target)
        assert "COMPLETED" in out and f"installed {target}" in out, out
        assert (target / ".llmgw-installed").exists() and (target / "bin" / "python").exists()
        assert "include-system-site-packages = true" in (target / "pyvenv.cfg").read_text()
        job = await eventually(lambda: ended_job(h, "install"), "the install in status", 90)
        assert job["state"] == "COMPLETED" and job["target"] == str(target), job
        assert not h.rec.replicas


async def test_failed_fetch_ends_failed_with_its_cause(tmp_path: Path, prefix: str) -> None:
    missing = tmp_path / "no-such-weights"
    model = tiny_model("lost", weights={"source": str(missing), "method": "copy"})
    async with running(tmp_path, prefix, [model]) as h:
        rc, out, err = await admin("fetch", "lost", "--server", str(h.server_yaml), "--wait")
        assert rc == 1, out + err
        assert "FAILED" in err, err
        assert f"copy source {missing} does not exist" in err, err
        job = await eventually(lambda: ended_job(h, "fetch"), "the fetch job in status", 90)
        assert job["state"] == "FAILED", job
        assert f"copy source {missing} does not exist" in job["message"], job
        rc, text, _ = await admin("status", "--server", str(h.server_yaml))
        assert "FAILED" in text and "does not exist" in text, text
