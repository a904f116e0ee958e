"""The rest backend where it differs from the others: tokens, outages, OpenAPI versions.

Against the 25.11 cluster's slurmrestd, and against slurmrestd processes of
the test's own (the same binary, on a port of their own, as the cluster's is
started) that it stops, or starts with older OpenAPI versions only, without
disturbing the cluster's. Skipped, with the reason, where the cluster runs no
slurmrestd (the 22.05 cluster); with LLMGW_TEST_SLURM_BACKEND=rest that fails.

Each case says what a site would see: a clear error or warning, and the
daemon carrying on, without submitting any job twice, once the cause is gone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.slurm import JobSpec, JobState, SlurmUnavailable, make_backend
from llmgw_slurm.slurm.rest import RestBackend
from tests.ports import free_port
from tests.slurm.conftest import eventually, need_backend, rest_options
from tests.slurm.harness import Harness, running, tiny_model


@pytest.fixture(autouse=True)
def _rest_here() -> None:
    need_backend("rest")


# ------------------------------------------------------------------ helpers


class Restd:
    """A slurmrestd of the test's own, started as scripts/dev-cluster starts the cluster's."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, versions: str = "") -> None:
        """``versions``: the data_parser plugins to load (``v0.0.42``), or every one."""
        argv = ["slurmrestd", "-a", "rest_auth/jwt", "-s", "openapi/slurmctld,openapi/slurmdbd"]
        argv += ["-d", versions] if versions else []
        argv += ["-u", "llmgw-restd", "-g", "llmgw-restd", f"127.0.0.1:{self.port}"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, "SLURM_JWT": "daemon"},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "slurmrestd did not listen within 30 s"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def restd(tmp_path: Path) -> Iterator[Restd]:
    r = Restd(tmp_path / "slurmrestd.log")
    yield r
    r.stop()


def scontrol_token(lifespan: int) -> str:
    """What a site's timer writes to the token file: ``scontrol token`` for this user."""
    out = subprocess.run(
        ["scontrol", "token", f"lifespan={lifespan}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("SLURM_JWT="), out
    return out


def foreign_token(user: str) -> str:
    """A well-formed token for ``user``, signed with a key slurmctld does not have."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(b'{"alg":"HS256","typ":"JWT"}')
    now = int(time.time())
    body = b64(json.dumps({"exp": now + 3600, "iat": now, "sun": user}).encode())
    sig = hmac.new(os.urandom(32), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"SLURM_JWT={head}.{body}.{b64(sig)}\n"


def write_private(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def script(*lines: str, directives: tuple[str, ...] = ()) -> str:
    opts = [f"#SBATCH {d}" for d in (*directives, "--output=/dev/null")]
    return "\n".join(["#!/bin/bash", *opts, *lines]) + "\n"


@contextlib.asynccontextmanager
async def rest_backend(**opts: Any) -> AsyncIterator[RestBackend]:
    b = make_backend("rest", timeout=60, **{**rest_options(), **opts})
    assert isinstance(b, RestBackend)
    try:
        yield b
    finally:
        await b.close()


async def cancel_all(prefix: str) -> None:
    async with rest_backend() as b:
        for j in await b.list_jobs(prefix):
            await b.cancel(j.job_id)


# ------------------------------------------------------------------ versions


@pytest.mark.parametrize("version", ["v0.0.42", "v0.0.43"])
async def test_older_versions_speak_the_same_contract(version: str, prefix: str) -> None:
    # The contract tests run on v0.0.44; the fields read are the same in the older
    # two, and this shows it on each call the daemon makes.
    async with rest_backend(version=version) as b:
        try:
            await b.check()
            het = await b.submit(
                JobSpec(
                    name=prefix + "het.00000001",
                    script=script(
                        "sleep 120",
                        directives=(
                            "--partition=llm",
                            "--gres=gpu:a100:1",
                            "--time=10",
                            "hetjob",
                            "--partition=llm",
                            "--gres=gpu:a100:1",
                        ),
                    ),
                    comment=f"version={version}",
                )
            )

            async def running_het() -> Any:
                jobs = [j for j in await b.list_jobs(prefix) if j.job_id == het]
                return jobs if jobs and jobs[0].state is JobState.RUNNING else None

            (job,) = await eventually(running_het, f"the het job to run ({version})")
            assert len(job.components) == 2 and job.comment == f"version={version}"
            assert job.end_time is not None and job.start_time is not None
            assert job.end_time - job.start_time == timedelta(minutes=10)
            nodes = await b.list_nodes()
            assert sum(n.gpus_total("a100") - n.gpus_free("a100") for n in nodes) >= 2
            await b.cancel(het)
            await b.cancel(het)  # already gone: no error

            async def recorded() -> Any:
                since = datetime.now() - timedelta(hours=1)
                recs = await b.accounting(since, name_prefix=prefix)
                done = [r for r in recs if r.state is JobState.CANCELLED]
                return done if len(done) == 2 else None

            records = await eventually(recorded, "accounting to hold both components")
            assert {r.job_id for r in records} == {f"{het}+0", f"{het}+1"}
            assert {r.comment for r in records} == {f"version={version}"}
        finally:
            await cancel_all(prefix)


async def test_a_server_without_the_version_is_refused_at_start_naming_its_own(
    restd: Restd, tmp_path: Path, prefix: str
) -> None:
    restd.start(versions="v0.0.42")
    async with rest_backend(url=restd.url) as b:
        with pytest.raises(ConfigError) as err:
            await b.check()
    message = str(err.value)
    assert "slurm.rest.version" in message
    assert "does not offer OpenAPI v0.0.44; it offers v0.0.42" in message
    assert "set slurm.rest.version to v0.0.42" in message
    # The daemon stops with it before it opens a port or submits anything.
    h = Harness(tmp_path / "daemon", prefix, backend="rest")
    h.write([tiny_model("m", scaling={"min": 1, "max": 1})])
    point_at(h, restd.url)
    with pytest.raises(ConfigError, match=r"it offers v0\.0\.42"):
        await h.start()
    await h.stop()
    assert h.jobs() == []


def point_at(h: Harness, url: str, **auth: str) -> None:
    """Make ``h``'s daemon use the rest backend at ``url`` (auth: token_file or jwt_key)."""
    server = yaml.safe_load(h.server_yaml.read_text())
    rest = {"url": url, **(auth or {"jwt_key": rest_options()["jwt_key"]})}
    server["slurm"] = {**server["slurm"], "backend": "rest", "rest": rest}
    h.server_yaml.write_text(yaml.safe_dump(server, sort_keys=False))


# -------------------------------------------------------------------- tokens


async def test_an_expired_token_is_named_and_not_sent_until_the_file_is_renewed(
    tmp_path: Path, prefix: str
) -> None:
    token_file = tmp_path / "slurm.jwt"
    write_private(token_file, scontrol_token(lifespan=2))
    async with rest_backend(jwt_key=None, token_file=token_file) as b:
        await b.check()
        await asyncio.sleep(3)
        before = b.calls
        with pytest.raises(SlurmUnavailable) as err:
            await b.list_jobs(prefix)
        assert "expired at" in err.value.message and "scontrol token" in err.value.message
        assert b.calls == before  # nothing sent with a token known to be dead
        write_private(token_file, scontrol_token(lifespan=600))
        assert await b.list_jobs(prefix) == []


async def test_a_wrong_token_is_refused_once_clearly_and_not_in_a_storm(
    tmp_path: Path, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = tmp_path / "slurm.jwt"
    wrong = foreign_token(os.environ.get("USER") or "root")
    write_private(token_file, wrong)
    async with rest_backend(jwt_key=None, token_file=token_file) as b:
        with caplog.at_level(logging.DEBUG):
            with pytest.raises(SlurmUnavailable) as err:
                await b.list_jobs(prefix)
            assert "token refused (HTTP 511" in err.value.message
            assert f"token_file {token_file}" in err.value.message
            sent = b.calls
            for _ in range(5):
                with pytest.raises(SlurmUnavailable, match="refused"):
                    await b.list_jobs(prefix)
            assert b.calls == sent  # held back: a pass after a pass sends nothing
        secret = wrong.removeprefix("SLURM_JWT=").strip()
        assert secret not in caplog.text and secret not in str(err.value)
        assert caplog.text.count("token refused") == 1
        # Renewed: the file is read again at the next call, which goes through.
        write_private(token_file, scontrol_token(lifespan=600))
        assert await b.list_jobs(prefix) == []


async def wait_ready(h: Harness, model: str) -> str:
    async def ready() -> str | None:
        for r in h.rec.replicas.values():
            if r.model == model and r.state().value == "ready":
                return str(r.job_id)
        return None

    return await eventually(ready, f"{model} to be ready", timeout=180)


async def chat(h: Harness, model: str) -> str:
    async with openai.AsyncOpenAI(
        base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        r = await c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
    return str(r.choices[0].message.content)


async def pass_error(h: Harness, *words: str) -> str:
    async def shows() -> str | None:
        err = h.rec.last_pass_error
        return err if all(w in err for w in words) else None

    return await eventually(shows, f"a pass to fail with {words}", timeout=120)


async def passes_again(h: Harness) -> None:
    start = h.rec.passes

    async def answered() -> bool:
        return h.rec.passes > start + 1 and not h.rec.last_pass_error

    await eventually(answered, "the passes to succeed again", timeout=120)


async def test_a_daemon_on_a_bad_token_warns_and_recovers_without_a_second_job(
    tmp_path: Path, prefix: str
) -> None:
    token_file = tmp_path / "slurm.jwt"
    write_private(token_file, scontrol_token(lifespan=600))
    models = [tiny_model("kept", scaling={"min": 1, "max": 1, "idle_timeout": "1h"})]
    configure = lambda h: point_at(h, rest_options()["url"], token_file=str(token_file))  # noqa: E731
    async with running(tmp_path, prefix, models, configure=configure) as h:
        job_id = await wait_ready(h, "kept")
        write_private(token_file, foreign_token(os.environ.get("USER") or "root"))
        await pass_error(h, "token refused", str(token_file))
        write_private(token_file, scontrol_token(lifespan=2))
        await asyncio.sleep(3)
        await pass_error(h, "expired at", str(token_file))
        # Meanwhile the ready replica serves: the gateway does not need Slurm.
        assert await chat(h, "kept")
        write_private(token_file, scontrol_token(lifespan=600))
        await passes_again(h)
        assert [j[0] for j in h.jobs()] == [job_id]
        assert len(h.decisions("submit", "kept")) == 1


async def test_slurmrestd_down_a_minute_then_too_old_then_back(
    restd: Restd, tmp_path: Path, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    restd.start()
    models = [
        tiny_model("kept", scaling={"min": 1, "max": 1, "idle_timeout": "1h"}),
        tiny_model("cold"),
    ]
    async with running(
        tmp_path,
        prefix,
        models,
        router={"hold_timeout": "4m"},
        configure=lambda h: point_at(h, restd.url),
    ) as h:
        job_id = await wait_ready(h, "kept")
        restd.stop()
        with caplog.at_level(logging.WARNING):
            await pass_error(h, "did not answer")
            # A request for a model with no replica is held, not failed, while
            # Slurm cannot be asked; nothing can be submitted for it yet.
            held = asyncio.create_task(chat(h, "cold"))
            await asyncio.sleep(60)
        assert "Slurm did not answer, nothing done" in caplog.text
        assert not held.done() and not h.decisions("submit", "cold")
        assert await chat(h, "kept")  # the ready replica serves throughout

        # Back, but a release that offers only an older OpenAPI version.
        restd.start(versions="v0.0.42")
        await pass_error(h, "does not offer OpenAPI v0.0.44; it offers v0.0.42")
        assert not h.decisions("submit", "cold")
        restd.stop()
        restd.start()
        await passes_again(h)
        assert await held  # the held request is answered once the replica starts
        names = sorted(j[1].rsplit(".", 1)[0] for j in h.jobs())
        assert names == [prefix + "cold", prefix + "kept"]
        assert job_id in {j[0] for j in h.jobs()}
        assert len(h.decisions("submit", "kept")) == 1
        assert len(h.decisions("submit", "cold")) == 1
