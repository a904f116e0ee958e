"""Self-service keys: ``llmgw login`` with a munge credential, and a user's own keys.

Routes, on the gateway app:

- ``POST /api/v1/login`` ``{"credential": "MUNGE:...", "account": "A"}``: the
  daemon decodes the credential with munged, takes the uid it proves, and
  makes a key for that Unix user, charged to Slurm account ``A`` (which the
  user must have an association with in slurmdbd) or to the user's default
  account. The key is in the answer once and stored hashed.
- ``GET /api/v1/keys``: the caller's own keys (by the key presented).
- ``DELETE /api/v1/keys/{key_id}``: revoke one of the caller's own keys; any
  other id (another user's, or none) is the same 404.

Why the account check happens at login and not per request: an association
rarely changes, and sacctmgr costs tens of milliseconds; a key names its
account, so a user who loses the association keeps a key until it is revoked.

Login attempts are limited per user, the one the credential proves, not per
client address: every user of a login node connects from 127.0.0.1, and a
limit per address let one user's burst lock every other user out for a
minute. So the credential is decoded first (at most ``_DECODING`` at once:
each is an ``unmunge`` process), then the user's attempts are counted; a
credential that proves nobody is refused by munged and counts for no one.
A user holds at most ``max_keys_per_user`` keys, counting those revoked
within ``revoked_key_window``: revoking and logging in again does not make
keys (and key-file records) without end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pwd
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw_slurm.auth import munge
from llmgw_slurm.auth.keys import KeyFile, KeyRecord, KeyStore, NewKey, TooManyKeys
from llmgw_slurm.base.errors import ConfigError, DatabaseError, LlmgwError, SlurmError
from llmgw_slurm.config import ServerConfig
from llmgw_slurm.slurm.cli import CliBackend
from llmgw_slurm.slurm.types import Associations

__all__ = [
    "LOGIN_KEY",
    "LoginRoutes",
    "LoginSettings",
    "RateLimit",
    "add_login_routes",
    "login_settings",
    "sacctmgr_associations",
]

_log = logging.getLogger(__name__)

AssociationLookup = Callable[[str], Awaitable[Associations]]
KeyLookup = Callable[[str], "KeyRecord | None"]


@dataclass(frozen=True)
class LoginSettings:
    keys_file: Path
    munge_socket: Path | None = None
    # Active keys one user may hold: every login makes one, and a script that
    # logs in in a loop must not grow the key file without end.
    max_keys_per_user: int = 16
    # Login attempts per user (as munge proves them) per minute.
    attempts_per_minute: int = 10
    # Seconds a revoked key still counts against max_keys_per_user.
    revoked_key_window: float = 3600.0
    # Where keys are kept: None, keys_file (the shared database's store otherwise).
    store: KeyStore | None = None
    # Told of each key made or revoked here (the shared database's copy learns it at once).
    learned: Callable[[KeyRecord], None] | None = None


# Credentials decoded at once: each is an unmunge process, and a flood of garbage
# must not spawn one per connection.
_DECODING = 8


class RateLimit:
    """At most ``per_minute`` events per name (a user's uid) in any 60 s (a sliding log)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._seen: dict[str, list[float]] = {}

    def retry_after(self, host: str) -> int:
        """0 and count the attempt if it may go on; otherwise the seconds to wait."""
        now = self._clock()
        recent = [t for t in self._seen.get(host, []) if now - t < 60.0]
        if len(recent) >= self.per_minute:
            self._seen[host] = recent
            return max(1, int(60.0 - (now - recent[0])) + 1)
        recent.append(now)
        self._seen[host] = recent
        if len(self._seen) > 10_000:
            # Forget names with no recent attempt, so that many cannot grow
            # this without bound.
            self._seen = {h: ts for h, ts in self._seen.items() if now - ts[-1] < 60.0}
        return 0


def _error(
    status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> web.Response:
    type_ = "authentication_error" if status == 401 else "invalid_request_error"
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _key_json(rec: KeyRecord, current: str) -> dict[str, Any]:
    return {
        "key_id": rec.key_id,
        "user": rec.user,
        "account": rec.project,
        "created": rec.created,
        "revoked": rec.revoked,
        "current": rec.key_id == current,
    }


async def _read_login(request: web.Request) -> tuple[str, str] | web.Response:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("credential"), str):
        return _error(400, 'send {"credential": "MUNGE:...", "account": "..."}', "bad_request")
    account = body.get("account") or ""
    if not isinstance(account, str):
        return _error(400, "account must be a string", "bad_request")
    return body["credential"], account


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


async def _charge_to(user: str, wanted: str, associations: AssociationLookup) -> str | web.Response:
    """The account the key is charged to, or the 403 that says why not."""
    try:
        assoc = await associations(user)
    except SlurmError as exc:
        _log.warning("login: cannot read the associations of %s: %s", user, exc)
        return _error(
            503, "the daemon cannot read Slurm's associations now; try again", "slurm_unavailable"
        )
    account = wanted or assoc.default
    if not account:
        return _error(
            403,
            f"user {user} has no Slurm account (no association in slurmdbd); ask the admin "
            "to add one (sacctmgr add user ...)",
            "no_association",
        )
    if account not in assoc.accounts:
        valid = ", ".join(sorted(assoc.accounts)) or "none"
        return _error(
            403,
            f"user {user} has no association with Slurm account {account!r}; yours: {valid}",
            "no_association",
        )
    return account


class LoginRoutes:
    """The login and keys handlers; ``app[LOGIN_KEY]`` on the gateway app."""

    def __init__(
        self, settings: LoginSettings, lookup: KeyLookup, associations: AssociationLookup
    ) -> None:
        self.settings = settings
        self.lookup = lookup
        self.associations = associations
        self.limit = RateLimit(settings.attempts_per_minute)
        self._decoding = asyncio.Semaphore(_DECODING)

    async def login(self, request: web.Request) -> web.Response:
        host = request.remote or "?"
        read = await _read_login(request)
        if isinstance(read, web.Response):
            return read
        credential, wanted = read
        who = await self._decode(credential, host)
        if isinstance(who, web.Response):
            return who
        wait = self.limit.retry_after(str(who.uid))
        if wait:
            _log.warning("login: too many attempts by uid %d (from %s)", who.uid, host)
            return _error(
                429,
                f"too many logins by your user (uid {who.uid}); try again in {wait} s",
                "rate_limited",
                {"Retry-After": str(wait)},
            )
        user = await asyncio.to_thread(_user_name, who.uid)
        if user is None:
            return _error(
                403, f"uid {who.uid} has no user name on the daemon's host", "unknown_uid"
            )
        account = await _charge_to(user, wanted, self.associations)
        if isinstance(account, web.Response):
            return account
        new = await self._issue(user, account)
        if isinstance(new, web.Response):
            return new
        _log.info(
            "login: user %s (uid %d, account %s) from %s got key %s",
            user,
            who.uid,
            account,
            host,
            new.record.key_id,
        )
        return web.json_response(
            {"key": new.key, "key_id": new.record.key_id, "user": user, "account": account}
        )

    async def _decode(self, credential: str, host: str) -> munge.MungeIdentity | web.Response:
        """Who the credential proves, or the answer for one that proves nobody."""
        try:
            async with self._decoding:
                return await munge.decode(credential, self.settings.munge_socket)
        except munge.MungeRefused as exc:
            _log.warning("login refused from %s: %s", host, exc.reason)
            return _error(401, str(exc), f"munge_{exc.reason}")
        except munge.MungeError as exc:
            _log.error("login: %s", exc)
            return _error(
                503, "the daemon cannot decode munge credentials now", "munge_unavailable"
            )

    async def _issue(self, user: str, account: str) -> NewKey | web.Response:
        """A new key for ``user``, or why none could be made."""
        try:
            new = await asyncio.to_thread(
                functools.partial(
                    self.store.add,
                    user,
                    account,
                    limit=self.settings.max_keys_per_user,
                    revoked_within=self.settings.revoked_key_window,
                )
            )
        except TooManyKeys as exc:
            return _error(409, str(exc), "too_many_keys")
        except ConfigError as exc:
            _log.error("login: the key file is broken: %s", exc)
        except DatabaseError as exc:
            # A new login needs the database; keys already made keep working.
            _log.error("login: cannot store the key: %s", exc)
        except LlmgwError as exc:
            return _error(403, str(exc), "invalid_user")
        except OSError as exc:
            _log.error("login: cannot write %s: %s", self.settings.keys_file, exc)
        else:
            self._learned(new.record)
            return new
        return _error(503, "the daemon cannot store keys now; try again", "keys_unavailable")

    @property
    def store(self) -> KeyStore:
        return self.settings.store or KeyFile(self.settings.keys_file)

    def _learned(self, rec: KeyRecord) -> None:
        if self.settings.learned is not None:
            self.settings.learned(rec)

    def _caller(self, request: web.Request) -> KeyRecord | web.Response:
        token = _bearer(request)
        rec = self.lookup(token) if token else None
        if rec is None:
            return _error(
                401,
                "no valid API key: run `llmgw login`, or send 'Authorization: Bearer <key>'",
                "invalid_api_key",
            )
        return rec

    async def keys(self, request: web.Request) -> web.Response:
        rec = self._caller(request)
        if isinstance(rec, web.Response):
            return rec
        try:
            mine = [r for r in await asyncio.to_thread(self.store.list) if r.user == rec.user]
        except DatabaseError as exc:
            _log.error("keys: cannot read the keys: %s", exc)
            return _error(503, "the daemon cannot read keys now; try again", "keys_unavailable")
        return web.json_response(
            {"user": rec.user, "keys": [_key_json(r, rec.key_id) for r in mine]}
        )

    async def revoke(self, request: web.Request) -> web.Response:
        rec = self._caller(request)
        if isinstance(rec, web.Response):
            return rec
        key_id = request.match_info["key_id"]
        try:
            done = await asyncio.to_thread(self.store.revoke_own, key_id, rec.user)
        except DatabaseError as exc:
            _log.error("keys: cannot revoke %s: %s", key_id, exc)
            return _error(503, "the daemon cannot revoke keys now; try again", "keys_unavailable")
        if done is not None:
            self._learned(done)
        if done is None:
            return _error(
                404, f"you have no key with id {key_id!r} (llmgw keys lists yours)", "no_such_key"
            )
        _log.info("keys: user %s revoked key %s", rec.user, key_id)
        return web.json_response(_key_json(done, rec.key_id))


LOGIN_KEY = web.AppKey("llmgw.login", LoginRoutes)


def add_login_routes(
    app: web.Application,
    settings: LoginSettings,
    lookup: KeyLookup,
    associations: AssociationLookup,
) -> None:
    """``/api/v1/login`` and ``/api/v1/keys`` on the gateway app.

    ``lookup``: the gateway's key check (``KeyRing.lookup``); ``associations``:
    a user's Slurm associations (``CliBackend.associations``).
    """
    routes = LoginRoutes(settings, lookup, associations)
    app[LOGIN_KEY] = routes
    app.router.add_post("/api/v1/login", routes.login)
    app.router.add_get("/api/v1/keys", routes.keys)
    app.router.add_delete("/api/v1/keys/{key_id}", routes.revoke)


def login_settings(server: ServerConfig) -> LoginSettings:
    """The login routes' settings from server.yaml (``login:``, ``router.keys_file``)."""
    assert server.router.keys_file is not None, "login needs keys (checked when loading)"
    cfg = server.login
    return LoginSettings(
        keys_file=server.router.keys_file,
        munge_socket=cfg.munge_socket,
        max_keys_per_user=cfg.max_keys_per_user,
        attempts_per_minute=cfg.attempts_per_minute,
        revoked_key_window=cfg.revoked_key_window,
    )


def sacctmgr_associations(server: ServerConfig) -> AssociationLookup:
    """Associations from slurmdbd through sacctmgr, whichever backend runs jobs."""
    return CliBackend(timeout=server.slurm.command_timeout).associations
