"""Gateway API keys: the admin's add/list/revoke, hashing at rest, and lookups."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from llmgw_slurm.auth import keys as keys_module
from llmgw_slurm.auth.keys import KeyRing, add_key, list_keys, revoke_key
from llmgw_slurm.base.errors import ConfigError, LlmgwError


def test_add_stores_only_a_hash_in_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    new = add_key(path, "alice", "proj")
    text = path.read_text()
    assert new.key not in text
    # Not rsplit("-"): the secret is URL-safe base64, which has dashes of its own.
    secret = new.key.removeprefix(f"llmgw-{new.record.key_id}-")
    assert len(secret) >= 32
    assert secret not in text
    assert new.record.sha256 in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert new.key.startswith(f"llmgw-{new.record.key_id}-")


def test_list_and_revoke(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    a = add_key(path, "alice")
    b = add_key(path, "bob", "p")
    assert [r.user for r in list_keys(path)] == ["alice", "bob"]
    revoked = revoke_key(path, a.record.key_id)
    assert revoked.revoked is not None and not revoked.active
    # Revoking twice is not an error and keeps the first time.
    assert revoke_key(path, a.record.key_id).revoked == revoked.revoked
    by_user = {r.user: r for r in list_keys(path)}
    assert not by_user["alice"].active and by_user["bob"].active
    with pytest.raises(LlmgwError, match=b.record.key_id):
        revoke_key(path, "ffffffff")


def test_bad_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LlmgwError, match="user name"):
        add_key(tmp_path / "k.json", "alice; rm -rf /")
    with pytest.raises(LlmgwError, match="project name"):
        add_key(tmp_path / "k.json", "alice", "a b")


def test_lookup_accepts_only_active_exact_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    a = add_key(path, "alice")
    ring = KeyRing(path)
    rec = ring.lookup(a.key)
    assert rec is not None and rec.user == "alice"
    # Right id, wrong secret; a malformed key; an unknown id.
    forged = a.key[:-1] + ("A" if a.key[-1] != "A" else "B")
    assert ring.lookup(forged) is None
    assert ring.lookup("sk-whatever") is None
    assert ring.lookup("llmgw-00000000-" + "x" * 43) is None
    # A revocation by the admin CLI is seen without a restart.
    revoke_key(path, a.record.key_id)
    assert ring.lookup(a.key) is None
    b = add_key(path, "bob")
    assert ring.lookup(b.key) is not None


def test_missing_file_means_no_valid_key(tmp_path: Path) -> None:
    ring = KeyRing(tmp_path / "absent.json")
    assert ring.lookup("llmgw-00000000-" + "x" * 43) is None


def test_broken_file_is_a_config_error_at_start(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"version": 1, "keys": [{"user": "x"}]}')
    with pytest.raises(ConfigError, match=r"keys\[0\]"):
        KeyRing(path)
    path.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        list_keys(path)
    path.write_bytes(b'{"version": 1, "keys": [], "x": "\xff"}')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 33\)"):
        list_keys(path)


def test_broken_file_later_keeps_the_loaded_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    a = add_key(path, "alice")
    ring = KeyRing(path)
    path.write_text(json.dumps({"version": 1, "keys": "oops"}) + "   ")
    assert ring.lookup(a.key) is not None


def test_a_key_checked_once_is_remembered_by_a_keyed_hash_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys.json"
    a = add_key(path, "alice")
    ring = KeyRing(path)
    assert ring.lookup(a.key) is not None
    # Seen again, the key is not hashed with sha256 again.
    hashed: list[str] = []
    real_hash = keys_module._hash
    monkeypatch.setattr(keys_module, "_hash", lambda k: hashed.append(k) or real_hash(k))
    rec = ring.lookup(a.key)
    assert rec is not None and rec.user == "alice" and hashed == []
    # Nothing the ring holds is the key, nor its secret.
    secret = a.key.removeprefix(f"llmgw-{a.record.key_id}-")
    held = repr({name: getattr(ring, name) for name in vars(ring)})
    assert a.key not in held and secret not in held
    # The same id with another secret still goes through the full check, and fails.
    forged = a.key[:-1] + ("A" if a.key[-1] != "A" else "B")
    assert ring.lookup(forged) is None and hashed == [forged]
    # A revocation changes the file: what the ring remembered goes with it.
    revoke_key(path, a.record.key_id)
    assert ring.lookup(a.key) is None
