"""Security on the real cluster: no secret where other users can look, keys enforced.

Every user of a shared cluster can run squeue, scontrol show job and sacct on
everyone's jobs, and ps on every node. None of what they see may hold the
replica secret, the engine key, a gateway key, the admin token or the server key.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import subprocess
from pathlib import Path

import aiohttp
import openai

from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.auth.secrets import (
    engine_api_key,
    load_or_create_server_key,
    read_admin_token,
    replica_secret,
)
from llmgw_slurm.auth.tls import load_or_create_identity
from tests.agent_support import as_gateway
from tests.faults.support import record, with_router
from tests.slurm.conftest import eventually
from tests.slurm.harness import TOP, Harness, tiny_model


def _run(*argv: str) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    return p.stdout + p.stderr


def _cmdlines() -> str:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return "\n".join(out)


async def test_no_secret_is_visible_to_other_users_and_every_key_is_enforced(
    tmp_path: Path, prefix: str
) -> None:
    h = Harness(tmp_path / "daemon", prefix)
    h.write([tiny_model("sec", scaling={"min": 1, "max": 1})])
    keys_file = tmp_path / "keys.json"
    with_router(h, keys_file=str(keys_file))
    gateway_key = add_key(keys_file, "alice").key
    await h.start()
    try:

        async def ready() -> list[str]:
            return [r.replica_id for r in h.rec.replicas.values() if r.state().value == "ready"]

        (rid,) = await eventually(ready, "ready", timeout=120)
        rep = h.rec.replicas[rid]
        server_key = load_or_create_server_key(h.folder / "state" / "server.key")
        secrets = {
            "replica secret": replica_secret(server_key, rid),
            "engine key": engine_api_key(server_key, rid),
            "gateway key": gateway_key,
            "admin token": read_admin_token(h.folder / "state" / "admin.token"),
            "server key": server_key.decode(),
        }
        # The gateway: without its key 401, with it an answer.
        async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="wrong", max_retries=0) as c:
            try:
                await c.models.list()
                raise AssertionError("the gateway took a wrong key")
            except openai.AuthenticationError:
                pass
        async with openai.AsyncOpenAI(
            base_url=h.url + "/v1", api_key=gateway_key, max_retries=0
        ) as c:
            r = await c.chat.completions.create(
                model="sec", messages=[{"role": "user", "content": "secret test"}], max_tokens=3
            )
            assert r.choices[0].message.content
        # The engine itself, reached directly (as any user on the node could): no
        # TLS handshake without the gateway's client certificate, on any path; and
        # with that certificate (were its key ever to leak), 401 without the engine key.
        refused = 0
        async with aiohttp.ClientSession() as s:
            for path in ("/v1/models", "/health", "/metrics", "/invocations"):
                try:
                    async with s.get(rep.base_url + path, ssl=False) as resp:
                        raise AssertionError(
                            f"{path}: answered {resp.status} without a certificate"
                        )
                except aiohttp.ClientError:
                    refused += 1
        gateway = load_or_create_identity(h.folder / "state")
        async with as_gateway(gateway, rep.engine_cert) as s:
            for auth in (None, "Bearer wrong", f"Bearer {gateway_key}", "Bearer "):
                headers = {"Authorization": auth} if auth else {}
                async with s.get(rep.base_url + "/v1/models", headers=headers) as resp:
                    assert resp.status == 401, auth
                async with s.post(
                    rep.base_url + "/v1/chat/completions",
                    json={"model": "sec", "messages": [{"role": "user", "content": "x"}]},
                    headers=headers,
                ) as resp:
                    assert resp.status == 401, auth
                refused += 2
        secrets["gateway client key"] = gateway.key_file.read_text().strip()

        async def in_accounting() -> str:
            out = _run("sacct", "-j", rep.job_id, "--format=ALL", "-P", "--noheader")
            return out if rep.job_id in out else ""

        views = {
            "squeue": _run("squeue", "--all", "-o", "%all"),
            "scontrol show job": _run("scontrol", "show", "job", "-dd", rep.job_id),
            "the batch script": _run("scontrol", "write", "batch_script", rep.job_id, "-"),
            "sacct": await eventually(in_accounting, "the job in accounting", timeout=60),
            "ps -eo args": _run("ps", "-eo", "args"),
            "/proc/*/cmdline": _cmdlines(),
            "job logs": "\n".join(
                p.read_text(errors="replace") for p in (h.folder / "state").rglob("*.out")
            ),
            "keys file": keys_file.read_text(),
        }
        assert "llmgw_slurm.testing.engine" in views["ps -eo args"]  # the engine is there
        assert rep.job_id in views["squeue"] and "#!/bin/bash" in views["the batch script"]
        leaks = [
            f"{what} in {where}"
            for where, text in views.items()
            for what, value in secrets.items()
            if value in text
        ]
        assert leaks == []
    finally:
        await h.stop()
        ids = [j[0] for j in h.jobs()]
        if ids:
            subprocess.run(["scancel", *ids], check=False)
    # The documented setup runs the daemon as an unprivileged user.
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(TOP / "site-config" / "llmgw-slurm.service")
    assert unit["Service"]["User"] not in ("", "root")
    record(
        "security: secrets in cluster views",
        views_checked=len(views),
        secrets_checked=len(secrets),
        leaks=len(leaks),
        engine_refusals=refused,
        notes="views: " + ", ".join(views),
    )
