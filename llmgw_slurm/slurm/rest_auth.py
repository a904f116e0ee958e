"""Where the rest backend's JWTs come from, as sites hand them to a service.

slurmrestd with ``rest_auth/jwt`` passes each request's token on to
slurmctld and slurmdbd, which check it against ``AuthAltParameters=jwt_key``
(HS256). Two sources:

- :class:`TokenFile`: a token somebody else renews, in a file the daemon
  re-reads whenever it changes: what ``scontrol token username=U
  lifespan=N`` prints (``SLURM_JWT=...``), written there by a timer or a
  secrets agent before the last one expires. The daemon cannot renew it:
  it warns once a token is close to its end and nothing has replaced it, and
  refuses to send one that has expired (with what to do in the message).
- :class:`SigningKey`: the HS256 key itself (the file slurm.conf names).
  The daemon mints its own tokens for its one user, each ``lifespan`` long,
  and a new one when a fifth of the lifespan is left, so a token in use
  never expires. Whoever holds this key can act as any user, root
  included: it must be readable by the daemon's user only.

A token is never logged, never put on a command line, and never in an
exception: :class:`Token` keeps it out of its repr. A token that slurmrestd
refused is not sent again for :data:`REFUSED_HOLD` seconds unless the source
has a new one (a file rewritten, a key rotated): a pass after a pass must not
become a storm of refused requests at slurmctld.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from llmgw_slurm.base.errors import ConfigError, SlurmUnavailable, UnsafePathError

log = logging.getLogger(__name__)

# How long a refused token is held back (seconds) when its source has no other.
REFUSED_HOLD = 30.0
# TokenFile: warn when less than this much of a token's life is left (seconds),
# or a fifth of its lifespan when that is known and longer.
EXPIRY_WARNING = 300.0

Clock = Callable[[], float]


@dataclass(frozen=True)
class Token:
    """A JWT and what its claims say; ``text`` is never shown."""

    text: str = field(repr=False)
    user: str
    expires: float | None  # Unix time (the "exp" claim); None without one
    issued: float | None = None  # the "iat" claim
    where: str = ""  # "token_file /etc/llmgw/slurm.jwt": for messages

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    def left(self, now: float) -> float | None:
        return None if self.expires is None else self.expires - now


class TokenSource(Protocol):
    """What the rest backend asks of a token source."""

    @property
    def user(self) -> str:
        """The Slurm user the tokens act as (the listing's filter)."""

    def current(self) -> Token:
        """A token to send now. Raises SlurmUnavailable when there is none fit to send."""

    def refused(self, token: Token) -> Token | None:
        """slurmrestd refused ``token``: another to try once, or None when there is none."""


def _when(ts: float | None) -> str:
    return "never" if ts is None else datetime.fromtimestamp(ts).isoformat(timespec="seconds")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def claims(text: str) -> dict[str, Any]:
    """The payload of a JWT, unverified (slurmctld verifies it; we only read exp and sun)."""
    parts = text.split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT (three dot-separated parts)")
    try:
        payload = json.loads(_unb64(parts[1]))
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"its payload is not base64url JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise ValueError("its payload is not a JSON object")
    return payload


def _number(payload: dict[str, Any], name: str) -> float | None:
    value = payload.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_private(path: Path, what: str) -> os.stat_result:
    """``path``'s stat, refusing a file other users may read or change.

    slurmctld refuses a jwt_key others can read for the same reason: whoever
    reads a token acts as its user until it expires; whoever reads the key, as
    anyone.
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise UnsafePathError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a file")
    if st.st_mode & (stat.S_IRWXO | stat.S_IWGRP):
        raise UnsafePathError(
            f"{what} {path} may be read or changed by other users "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}, and replace what "
            "it held if others could read it"
        )
    return st


class TokenFile:
    """A token renewed by somebody else, read again whenever the file changes."""

    def __init__(self, path: Path, *, user: str | None = None, clock: Clock = time.time) -> None:
        self.path = path
        self._clock = clock
        self._seen: tuple[int, int, int] | None = None
        self._token: Token | None = None
        self._warned: Token | None = None
        self._refused_at: dict[str, float] = {}
        self._user = user
        try:
            # Read now: a missing or unreadable file is a mistake to show at start.
            self._user = self._read().user
        except SlurmUnavailable as exc:
            raise ConfigError(exc.message, field="slurm.rest.token_file") from None

    @property
    def user(self) -> str:
        assert self._user is not None
        return self._user

    def _read(self) -> Token:
        where = f"token_file {self.path}"
        try:
            st = check_private(self.path, "token_file")
            raw = self.path.read_text(encoding="utf-8", errors="replace")
        except (UnsafePathError, OSError) as exc:
            raise SlurmUnavailable(str(exc), command=["slurmrestd"]) from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._token is not None and key == self._seen:
            return self._token
        text = _token_text(raw)
        try:
            payload = claims(text)
        except ValueError as exc:
            raise SlurmUnavailable(
                f"{where} does not hold a JWT: {exc}; write what `scontrol token "
                "username=USER lifespan=SECONDS` prints (SLURM_JWT=...) there",
                command=["slurmrestd"],
            ) from None
        user = str(payload.get("sun") or payload.get("username") or self._user or "")
        if not user:
            raise SlurmUnavailable(
                f"{where}: the token names no user (no sun or username claim), "
                "and slurm.rest.user is not set",
                command=["slurmrestd"],
            )
        if self._user and user != self._user:
            # Jobs would be submitted as one user and listed as another's: every
            # replica would look gone.
            raise SlurmUnavailable(
                f"{where} holds a token for user {user}, but the service runs as "
                f"{self._user}: write a token for {self._user} there",
                command=["slurmrestd"],
            )
        self._seen = key
        self._token = Token(
            text, user, _number(payload, "exp"), _number(payload, "iat"), where=where
        )
        return self._token

    def current(self) -> Token:
        token = self._read()
        now = self._clock()
        if token.expired(now):
            raise SlurmUnavailable(
                f"the token in {self.path} expired at {_when(token.expires)}: renew it "
                "(scontrol token username=USER lifespan=SECONDS, written to that file); "
                "the daemon reads the file again at every call",
                command=["slurmrestd"],
            )
        held = self._refused_at.get(token.text)
        if held is not None and now - held < REFUSED_HOLD:
            raise _refused_error(token)
        self._warn_if_ending(token, now)
        return token

    def _warn_if_ending(self, token: Token, now: float) -> None:
        left = token.left(now)
        if left is None or token is self._warned:
            return
        lifespan = token.expires - token.issued if token.issued and token.expires else 0.0
        if left < max(EXPIRY_WARNING, lifespan / 5):
            self._warned = token
            log.warning(
                "the token in %s expires at %s (in %.0f s) and has not been replaced yet",
                self.path,
                _when(token.expires),
                left,
            )

    def refused(self, token: Token) -> Token | None:
        self._refused_at = {token.text: self._clock()}
        try:
            again = self._read()
        except SlurmUnavailable:
            return None
        return None if again.text == token.text else again


class SigningKey:
    """auth/jwt's HS256 key: tokens for one user, minted here and renewed in time."""

    def __init__(
        self, path: Path, *, user: str, lifespan: float = 3600.0, clock: Clock = time.time
    ) -> None:
        if lifespan < 60:
            raise ConfigError(
                f"{lifespan:g}s is under a minute; slurmctld checks tokens to the second",
                field="slurm.rest.token_lifespan",
            )
        self.path = path
        self._user = user
        self.lifespan = lifespan
        self._clock = clock
        self._key_seen: tuple[int, int, int] | None = None
        self._key = b""
        self._token: Token | None = None
        self.minted = 0
        self._refused_at: float | None = None
        try:
            self._load_key()
        except SlurmUnavailable as exc:
            raise ConfigError(exc.message, field="slurm.rest.jwt_key") from None

    @property
    def user(self) -> str:
        return self._user

    def _load_key(self) -> bool:
        """Read the key when the file changed (rotated); True when it did."""
        try:
            st = check_private(self.path, "jwt_key")
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._key_seen:
                return False
            data = self.path.read_bytes()
        except (UnsafePathError, OSError) as exc:
            raise SlurmUnavailable(str(exc), command=["slurmrestd"]) from None
        if not data:
            raise SlurmUnavailable(f"jwt_key {self.path} is empty", command=["slurmrestd"])
        self._key, self._key_seen = data, key
        return True

    def _mint(self, now: float) -> Token:
        issued = int(now)
        expires = issued + int(self.lifespan)
        header = _b64(b'{"alg":"HS256","typ":"JWT"}')
        body = _b64(json.dumps({"exp": expires, "iat": issued, "sun": self._user}).encode())
        signature = hmac.new(self._key, f"{header}.{body}".encode(), hashlib.sha256).digest()
        self.minted += 1
        log.info("minted a Slurm token for %s, valid until %s", self._user, _when(expires))
        return Token(
            f"{header}.{body}.{_b64(signature)}",
            self._user,
            float(expires),
            float(issued),
            where=f"a token signed with jwt_key {self.path}",
        )

    def current(self) -> Token:
        now = self._clock()
        rotated = self._load_key()
        token = self._token
        if token is not None and not rotated:
            left = token.left(now)
            if self._refused_at is not None and now - self._refused_at < REFUSED_HOLD:
                raise _refused_error(token)
            # A fifth of the lifespan left: a new one now, well before slurmctld's check fails.
            if left is not None and left > self.lifespan / 5:
                return token
        self._refused_at = None
        self._token = self._mint(now)
        return self._token

    def refused(self, token: Token) -> Token | None:
        now = self._clock()
        try:
            rotated = self._load_key()
        except SlurmUnavailable:
            rotated = False
        if rotated:
            self._token = self._mint(now)
            return self._token
        # The same key signs the same claims: minting again would be refused again.
        self._refused_at = now
        return None


def _token_text(raw: str) -> str:
    """The token in a file: the last line that is not blank, without ``export`` and
    ``SLURM_JWT=`` (``scontrol token`` prints ``SLURM_JWT=...``)."""
    lines = [ln.strip() for ln in raw.splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    text = text.removeprefix("export ").strip()
    if text.startswith("SLURM_JWT="):
        text = text[len("SLURM_JWT=") :]
    return text.strip().strip("'\"")


def _refused_error(token: Token) -> SlurmUnavailable:
    return SlurmUnavailable(
        f"slurmrestd refused {token.where} for user {token.user} (expires "
        f"{_when(token.expires)}); not sent again for {REFUSED_HOLD:g} s unless it is "
        "replaced: check that slurmctld's AuthAltParameters=jwt_key is the key the token "
        "was signed with and that the user exists there",
        command=["slurmrestd"],
    )
