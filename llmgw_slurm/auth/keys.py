"""Gateway API keys: a JSON file the admin manages, hashed at rest.

A key looks like ``llmgw-<id>-<secret>``: ``id`` is 8 hex characters that name
the key in listings, usage records and revocations (it is not secret), and
``secret`` is 32 random bytes (URL-safe base64). The file keeps only
``sha256(key)``.

Why a plain sha256 and not a slow password hash (scrypt, argon2): the key
has 256 bits of entropy from ``secrets``, so a stolen file cannot be brute-forced
whatever the hash costs; slow hashing protects low-entropy passwords, and here
it would only add its cost to every request.

Checking is constant time in the secret: the id picks the record, and the
hash of the presented key is compared with ``hmac.compare_digest``. An unknown
id is compared against a dummy hash so that it takes the same path.

The file (mode 0600) is rewritten atomically under an exclusive lock, so that
two admin commands at once do not lose a key; the gateway rereads it when its
modification time or size changes, so a revocation takes effect on the next
request without a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from llmgw_slurm.base.errors import ConfigError, LlmgwError
from llmgw_slurm.base.fsutil import atomic_write, locked

__all__ = [
    "REQUEST_KEY",
    "KeyFile",
    "KeyRecord",
    "KeyRing",
    "KeyStore",
    "NewKey",
    "TooManyKeys",
    "add_key",
    "check_name",
    "list_keys",
    "revoke_key",
    "revoke_own_key",
]

_KEY_RE = re.compile(r"^llmgw-([0-9a-f]{8})-([A-Za-z0-9_-]{43})$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_DUMMY_HASH = hashlib.sha256(b"llmgw-no-such-key").hexdigest()
_FORMAT_VERSION = 1
# Keys whose check KeyRing remembers; past it, it starts again (a site has far fewer).
_MAX_CHECKED = 10_000


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key as stored: never the key itself."""

    key_id: str
    user: str
    project: str
    sha256: str
    created: float
    revoked: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked is None


@dataclass(frozen=True, slots=True)
class NewKey:
    """A freshly made key: ``key`` is shown to the admin once and stored nowhere."""

    record: KeyRecord
    key: str


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _load(path: Path) -> dict[str, KeyRecord]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read it: {e.strerror}", file=str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start})", file=str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e.msg})", file=str(path), line=e.lineno) from None
    if not isinstance(data, dict) or data.get("version") != _FORMAT_VERSION:
        raise ConfigError(
            f'expected a JSON object with "version": {_FORMAT_VERSION} and "keys"',
            file=str(path),
        )
    keys = data.get("keys")
    if not isinstance(keys, list):
        raise ConfigError('"keys" must be a list', file=str(path), field="keys")
    out: dict[str, KeyRecord] = {}
    for i, raw in enumerate(keys):
        try:
            rec = KeyRecord(
                key_id=str(raw["key_id"]),
                user=str(raw["user"]),
                project=str(raw.get("project", "")),
                sha256=str(raw["sha256"]),
                created=float(raw["created"]),
                revoked=None if raw.get("revoked") is None else float(raw["revoked"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"a key record needs key_id, user, sha256 and created ({e})",
                file=str(path),
                field=f"keys[{i}]",
            ) from None
        if not re.fullmatch(r"[0-9a-f]{64}", rec.sha256):
            raise ConfigError(
                "sha256 must be 64 lowercase hex characters", file=str(path), field=f"keys[{i}]"
            )
        out[rec.key_id] = rec
    return out


def _write(path: Path, records: dict[str, KeyRecord]) -> None:
    data: dict[str, Any] = {
        "version": _FORMAT_VERSION,
        "keys": [asdict(r) for r in records.values()],
    }
    atomic_write(path, json.dumps(data, indent=2) + "\n", mode=0o600)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Two admins adding keys at once must not lose one of them.
    with locked(path.with_name(path.name + ".lock"), mode=0o600):
        yield


def check_name(what: str, value: str) -> None:
    """Raise LlmgwError unless ``value`` is a valid user or project name."""
    if not _NAME_RE.match(value):
        raise LlmgwError(
            f"{what} name {value!r} is not valid: use 1-64 letters, digits, '.', '_', "
            "'@' or '-', starting with a letter or digit"
        )


class TooManyKeys(LlmgwError):
    """The user holds the most active keys one user may (``llmgw login``'s cap)."""


def add_key(
    path: Path,
    user: str,
    project: str = "",
    *,
    limit: int | None = None,
    revoked_within: float = 0.0,
) -> NewKey:
    """Make a key for ``user`` (and ``project``), store its hash, return the key once.

    ``limit``: refuse (TooManyKeys) when ``user`` already has this many keys,
    counting the active ones and those revoked within the last
    ``revoked_within`` seconds.
    """
    check_names(user, project)
    with _locked(path):
        records = _load(path)
        if limit is not None:
            check_limit(
                [r for r in records.values() if r.user == user], user, limit, revoked_within
            )
        new = new_key(user, project, records)
        records[new.record.key_id] = new.record
        _write(path, records)
    return new


def check_limit(
    mine: Sequence[KeyRecord], user: str, limit: int, window: float, now: float | None = None
) -> None:
    """Raise TooManyKeys if ``user``, whose keys are ``mine``, holds ``limit`` keys,
    active or revoked within ``window`` seconds of ``now`` (a revoked key counts
    for a while: revoking and logging in again must not hand out keys without end)."""
    now = time.time() if now is None else now
    active = sum(1 for r in mine if r.active)
    recent = sorted(
        r.revoked for r in mine if r.revoked is not None and now - r.revoked < window
    )
    if active + len(recent) < limit:
        return
    if active >= limit:
        after = f" and after {window / 60:g} min has passed (a revoked key counts until then)"
        raise TooManyKeys(
            f"user {user} has {active} active keys, the most one user may; revoke one first "
            f"(llmgw keys revoke ID){after if window > 0 else ''}"
        )
    wait = int(recent[active + len(recent) - limit] + window - now) + 1
    raise TooManyKeys(
        f"user {user} has {active} active keys and revoked {len(recent)} within the last "
        f"{window / 60:g} min, together the most one user may; try again in {wait} s"
    )


def list_keys(path: Path) -> list[KeyRecord]:
    """Every key in the file, revoked ones included, oldest first."""
    return sorted(_load(path).values(), key=lambda r: r.created)


def revoke_key(path: Path, key_id: str) -> KeyRecord:
    """Revoke a key by its id; revoking a revoked key is not an error."""
    with _locked(path):
        records = _load(path)
        rec = records.get(key_id)
        if rec is None:
            known = ", ".join(sorted(records)) or "none"
            raise LlmgwError(f"no key with id {key_id!r} in {path} (known ids: {known})")
        if rec.revoked is None:
            rec = KeyRecord(rec.key_id, rec.user, rec.project, rec.sha256, rec.created, time.time())
            records[key_id] = rec
            _write(path, records)
    return rec


def revoke_own_key(path: Path, key_id: str, user: str) -> KeyRecord | None:
    """Revoke ``user``'s key ``key_id``; None when ``user`` has no such key.

    Another user's key and an unknown id give the same None, so that nobody
    learns which ids exist.
    """
    with _locked(path):
        records = _load(path)
        rec = records.get(key_id)
        if rec is None or rec.user != user:
            return None
        if rec.revoked is None:
            rec = KeyRecord(rec.key_id, rec.user, rec.project, rec.sha256, rec.created, time.time())
            records[key_id] = rec
            _write(path, records)
    return rec


class KeyStore(Protocol):
    """Where keys are kept: :class:`KeyFile` (the keys file) or the shared database
    (llmgw_slurm.db.keys). The same rules either way: ids unique, a user's keys
    capped by ``limit`` (those revoked within ``revoked_within`` seconds counted),
    revocation by id, a user's own revocation as the same None for another user's
    key as for an unknown one."""

    def add(
        self,
        user: str,
        project: str = "",
        *,
        limit: int | None = None,
        revoked_within: float = 0.0,
    ) -> NewKey: ...

    def list(self) -> list[KeyRecord]: ...

    def revoke(self, key_id: str) -> KeyRecord: ...

    def revoke_own(self, key_id: str, user: str) -> KeyRecord | None: ...


@dataclass(frozen=True)
class KeyFile:
    """:class:`KeyStore` on the keys file (router.keys_file)."""

    path: Path

    def add(
        self,
        user: str,
        project: str = "",
        *,
        limit: int | None = None,
        revoked_within: float = 0.0,
    ) -> NewKey:
        return add_key(self.path, user, project, limit=limit, revoked_within=revoked_within)

    def list(self) -> list[KeyRecord]:
        return list_keys(self.path)

    def revoke(self, key_id: str) -> KeyRecord:
        return revoke_key(self.path, key_id)

    def revoke_own(self, key_id: str, user: str) -> KeyRecord | None:
        return revoke_own_key(self.path, key_id, user)


def check_names(user: str, project: str) -> None:
    for what, value in (("user", user), ("project", project)):
        if value or what == "user":
            check_name(what, value)


def new_key(user: str, project: str, taken: Container[str]) -> NewKey:
    """A fresh key for ``user`` whose id is not in ``taken``, and its record."""
    check_names(user, project)
    key_id = secrets.token_hex(4)
    while key_id in taken:
        key_id = secrets.token_hex(4)
    key = f"llmgw-{key_id}-{secrets.token_urlsafe(32)}"
    return NewKey(KeyRecord(key_id, user, project, _hash(key), time.time()), key)


class KeyRing:
    """The gateway's view of the keys: the key file, reread when it changes; or, with
    ``path`` None, the records the shared database's copy gives it (:meth:`update`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fspath = os.fspath(path) if path is not None else ""
        self._stamp: tuple[int, int] | None = None
        self._records: dict[str, KeyRecord] = {}
        # The keys checked since the file last changed, by a hash keyed with a
        # secret of this process: a key seen again costs a BLAKE2 and a dict
        # lookup instead of the id's regex and OpenSSL's sha256, a few tens of
        # microseconds a request on a cold CPU. The presented keys themselves
        # are never kept; a record is dropped with the file's every change, so a
        # revocation still holds from the next request.
        self._mac_key = secrets.token_bytes(32)
        self._checked: dict[bytes, KeyRecord] = {}
        # Called on a well-formed key whose id is unknown (the shared database's copy
        # reads the table again then; a key made elsewhere works from the next request).
        self.on_unknown: Callable[[], None] | None = None
        self._reload()

    def update(self, records: dict[str, KeyRecord]) -> None:
        """Take ``records`` as the keys (the shared database's copy); checks kept of
        keys since changed are dropped, so a revocation holds from the next request."""
        self._records, self._checked = records, {}

    @property
    def records(self) -> dict[str, KeyRecord]:
        return self._records

    def _reload(self) -> None:
        if self.path is None:
            return
        try:
            # os.stat on the path's string: pathlib's stat costs several times
            # the call itself on a cold CPU, and this runs once a request.
            st = os.stat(self._fspath)
        except FileNotFoundError:
            # No file yet: no key is valid. Keys are on, so nobody gets in
            # until the admin adds a key, which is the safe reading.
            self._stamp, self._records, self._checked = None, {}, {}
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            # A broken file raises ConfigError at start-up; once running,
            # the keys already loaded stay in force rather than locking
            # everyone out (the admin CLI never writes a broken file).
            try:
                records = _load(self.path)
            except ConfigError:
                if self._stamp is None and not self._records:
                    raise
                return
            self._records, self._stamp, self._checked = records, stamp, {}

    def lookup(self, key: str) -> KeyRecord | None:
        """The active record for a presented key, or None."""
        self._reload()
        mac = hashlib.blake2b(key.encode(), key=self._mac_key, digest_size=16).digest()
        rec = self._checked.get(mac)
        if rec is not None:
            return rec
        m = _KEY_RE.match(key)
        rec = self._records.get(m.group(1)) if m else None
        if m and rec is None and self.on_unknown is not None:
            # A key made a moment ago on another login node: have the copy read now.
            self.on_unknown()
        expected = rec.sha256 if rec is not None else _DUMMY_HASH
        ok = hmac.compare_digest(_hash(key), expected)
        if not ok or rec is None or not rec.active:
            return None
        if len(self._checked) >= _MAX_CHECKED:
            self._checked = {}
        self._checked[mac] = rec
        return rec


# Where the gateway leaves the key it let a request in with, for other routes on
# its app (the Batch API, quotas' headers): here, below the gateway, so that they
# need not import it.
REQUEST_KEY = web.RequestKey("llmgw.key", KeyRecord)


def request_key(request: web.Request) -> KeyRecord | None:
    """The key a request was let in with: ``.user`` (the Unix user) and ``.project``
    (the Slurm account); None without keys, or before the gateway checked it."""
    return request.get(REQUEST_KEY)
