"""Another user of the cluster against the daemon (issue 13, items 2, 5 and 6).

The other user is a real second Unix account (tests/hostile_user.py) and the
daemon a real one on the dev cluster (the harness's, in this process), so the
kernel's permission checks and socket owners are what is tested.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_slurm.accounting.usage import UsageRecord, query_usage
from llmgw_slurm.auth.keys import add_key
from llmgw_slurm.router import GATEWAY_KEY
from tests.hostile_user import INTRUDER, squatting, world_dir
from tests.slurm.conftest import TOP, eventually
from tests.slurm.harness import Harness, tiny_model


@pytest.fixture
def top() -> Iterator[Path]:
    """A folder the intruder may traverse (pytest's tmp_path is root's, 0700)."""
    with world_dir() as d:
        yield d


@pytest.fixture
def loose_umask() -> Iterator[None]:
    # A daemon started by hand from a login shell.
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def keyed_harness(top: Path, prefix: str) -> tuple[Harness, str]:
    h = Harness(top / "daemon", prefix)
    keys_file = top / "keys.json"
    h.router = {"keys_file": str(keys_file)}
    h.write([tiny_model("tiny")])
    return h, add_key(keys_file, "alice").key


async def cli(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        f"from llmgw_slurm.cli.{module} import main; main()",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(TOP), **(env or {})},
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_squatting_the_daemons_ports_while_it_is_down_gets_no_key_token_or_prompt(
    top: Path, prefix: str
) -> None:
    h, key = keyed_harness(top, prefix)
    await h.start()
    assert h.d is not None
    info = h.d.server.effective_runtime_dir() / "daemon.json"
    env = {"LLMGW_DAEMON_INFO": str(info), "XDG_CONFIG_HOME": str(top / "xdg")}
    token = (top / "daemon" / "state" / "admin.token").read_text().strip()
    try:
        # Against the daemon itself both CLIs work.
        code, out = await cli("researcher", "--url", h.url, "--key", key, "usage", env=env)
        assert code == 0, out
        code, out = await cli("admin", "reload", "--server", str(h.server_yaml))
        assert code == 0, out
        left_behind = info.read_bytes()
    finally:
        await h.stop()
    # A restart: the daemon is down, and another user takes both of its ports.
    with squatting(INTRUDER, h.gateway_port, h.internal_port) as (gw, internal):
        for crashed in (False, True):
            if crashed:
                # A daemon killed with -9 leaves its daemon.json behind.
                info.write_bytes(left_behind)
            for args in (
                ["chat", "tiny", "my secret prompt"],
                ["usage"],
                ["up", "tiny"],
            ):
                code, out = await cli("researcher", "--url", h.url, "--key", key, *args, env=env)
                assert code == 1, (crashed, args, out)
                assert "Traceback" not in out
                if args[0] != "up":  # up reads the (public) status first
                    assert "refusing to send your API key" in out, out
                    if crashed:
                        assert f"held by uid {INTRUDER.uid}" in out, out
                    else:
                        assert "does not exist: is the daemon running?" in out, out
            code, out = await cli("admin", "reload", "--server", str(h.server_yaml))
            assert code == 1 and "refusing to send the admin token" in out, out
            assert f"held by uid {INTRUDER.uid}" in out, out
        heard = gw.heard() + internal.heard()
    for secret in (key, token, "my secret prompt"):
        assert secret not in heard, heard


async def test_another_user_can_neither_read_nor_lock_the_state_files(
    top: Path, prefix: str, loose_umask: None
) -> None:
    h, _ = keyed_harness(top, prefix)
    await h.start()
    try:
        assert h.d is not None
        store = h.d.gateway[GATEWAY_KEY].usage
        assert store is not None
        rec = UsageRecord(time.time(), "k1", "alice", "", "tiny", "chat/completions", 3, 5, 8)
        store.record(rec)
        await store.flush()
        state = top / "daemon" / "state"
        names = sorted(p.name for p in state.iterdir())
        assert {"server.key", "admin.token", "usage.sqlite3-shm", "usage.sqlite3-wal"} <= set(names)
        # Everything the intruder did: list, read, open read-only with
        # SQLite, and take a read lock on -shm (which stopped every usage write).
        probe = r"""
import fcntl, os, sqlite3, sys
state = sys.argv[1]
def attempt(what, fn):
    try:
        fn(); print(what, "ok")
    except (OSError, sqlite3.Error) as e:
        print(what, "denied", type(e).__name__)
attempt("list", lambda: os.listdir(state))
for name in ("server.key", "admin.token", "usage.sqlite3", "usage.sqlite3-wal"):
    attempt("read " + name, lambda: open(os.path.join(state, name), "rb").read())
attempt("sqlite", lambda: sqlite3.connect(
    "file:" + os.path.join(state, "usage.sqlite3") + "?mode=ro", uri=True
).execute("select count(*) from usage").fetchall())
def lock():
    fd = os.open(os.path.join(state, "usage.sqlite3-shm"), os.O_RDONLY)
    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
attempt("lock shm", lock)
"""
        r = await asyncio.to_thread(INTRUDER.python, probe, str(state))
        lines = r.stdout.splitlines()
        assert len(lines) == 7, r.stdout + r.stderr
        assert [ln for ln in lines if " ok" in ln] == [], r.stdout
        assert all(
            "denied PermissionError" in ln or "denied OperationalError" in ln for ln in lines
        )
        assert oct(state.stat().st_mode & 0o777) == "0o700"
        # And the daemon still writes.
        store.record(rec)
        await store.flush()
        assert query_usage(store.path, key_id="k1")[0].requests == 2
    finally:
        await h.stop()


async def test_up_without_a_key_is_401_and_starts_nothing(top: Path, prefix: str) -> None:
    h, key = keyed_harness(top, prefix)
    await h.start()
    try:
        post = r"""
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], data=b"", method="POST")
if len(sys.argv) > 2:
    req.add_header("Authorization", "Bearer " + sys.argv[2])
try:
    print(urllib.request.urlopen(req, timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
"""
        url = f"{h.url}/api/v1/models/tiny/up"
        # The intruder, without a key and with a made-up one.
        for extra in ((), ("llmgw-00000000-" + "x" * 43,)):
            r = await asyncio.to_thread(INTRUDER.python, post, url, *extra)
            assert r.stdout.strip() == "401", r.stdout + r.stderr
        passes = h.rec.passes

        async def two_more_passes() -> bool:
            return bool(h.rec.passes >= passes + 2)

        await eventually(two_more_passes, "two reconcile passes")
        assert h.jobs() == [] and h.rec.directory.wanted_at().get("tiny") is None
        # A key holder starts it.
        r = await asyncio.to_thread(INTRUDER.python, post, url, key)
        assert r.stdout.strip() == "200", r.stdout + r.stderr

        async def submitted() -> bool:
            return bool(h.jobs())

        await eventually(submitted, "the start of tiny", timeout=60)
    finally:
        await h.stop()
        ids = [j[0] for j in h.jobs()]
        if ids:
            import subprocess

            subprocess.run(["scancel", *ids], check=False)
