"""The state directory is the daemon's alone whatever the umask; a folder others may write is refused."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_slurm.accounting.usage import UsageRecord, UsageStore
from llmgw_slurm.auth.private import private_dir, public_dir, trusted_owner, write_atomic
from llmgw_slurm.auth.secrets import load_or_create_server_key
from llmgw_slurm.base.errors import UnsafePathError


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


async def test_state_dir_and_every_file_in_it_are_private_under_umask_022(
    tmp_path: Path, loose_umask: None
) -> None:
    state = tmp_path / "state"
    private_dir(state)
    load_or_create_server_key(state / "server.key")
    store = UsageStore(state / "usage.sqlite3")
    store.start()
    store.record(UsageRecord(1.0, "k", "u", "p", "m", "chat/completions", 1, 2, 3))
    await store.flush()
    files = sorted(p.name for p in state.iterdir())
    assert {"server.key", "usage.sqlite3", "usage.sqlite3-wal", "usage.sqlite3-shm"} <= set(files)
    assert mode(state) == 0o700
    assert {f: mode(state / f) for f in files} == {f: 0o600 for f in files}
    await store.close()


def test_an_existing_loose_state_dir_is_tightened(tmp_path: Path, loose_umask: None) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "usage.sqlite3").write_text("")
    (state / "usage.sqlite3").chmod(0o644)
    (state / "logs").mkdir(mode=0o755)
    private_dir(state)
    assert (mode(state), mode(state / "usage.sqlite3"), mode(state / "logs")) == (
        0o700,
        0o600,
        0o700,
    )


@pytest.mark.parametrize("bits", [0o770, 0o757, 0o1777])
def test_a_state_dir_others_may_write_is_refused_with_the_fix(tmp_path: Path, bits: int) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(bits)
    with pytest.raises(UnsafePathError) as err:
        private_dir(state)
    msg = str(err.value)
    assert str(state) in msg and "written by other users" in msg and f"chmod 700 {state}" in msg
    assert mode(state) == bits & 0o7777  # left as found: an admin looks first


def test_a_state_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root to give a folder to another user")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 4242, 4242)
    with pytest.raises(UnsafePathError) as err:
        private_dir(state)
    assert str(state) in str(err.value) and "belongs to another user" in str(err.value)


def test_the_runtime_dir_is_readable_by_all_and_writable_by_the_daemon_only(
    tmp_path: Path, loose_umask: None
) -> None:
    run = tmp_path / "run"
    os.umask(0o077)
    public_dir(run)
    assert mode(run) == 0o755
    run.chmod(0o777)
    with pytest.raises(UnsafePathError):
        public_dir(run)


def test_write_atomic_sets_the_mode_whatever_the_umask(tmp_path: Path, loose_umask: None) -> None:
    p = tmp_path / "f"
    write_atomic(p, b"one")
    write_atomic(p, b"two", 0o644)
    assert (p.read_bytes(), mode(p)) == (b"two", 0o644)
    assert [x.name for x in tmp_path.iterdir()] == ["f"]


def test_trusted_owner_names_the_first_loose_link(tmp_path: Path) -> None:
    d = tmp_path / "a"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    f = d / "daemon.json"
    f.write_text("{}")
    f.chmod(0o644)
    # tmp_path's own parents are root's and tight (pytest makes them 0700).
    assert trusted_owner(f, os.geteuid()) is None
    d.chmod(0o777)
    assert trusted_owner(f, os.geteuid()) == f"{d} may be written by other users (mode 0777)"
    d.chmod(0o755)
    os.chown(f, 4242, 4242)
    assert trusted_owner(f, os.geteuid()) == f"{f} belongs to uid 4242"
    assert trusted_owner(f, 4242) is None
