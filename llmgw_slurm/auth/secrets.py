"""Per-replica secrets, derived so that a restarted daemon can re-derive them.

A cluster's users see each other's job names, comments and command lines, so
nothing here ever goes there: the replica secret travels in the job's
environment (set on the sbatch process), and the daemon keeps only its own
server key, from which every replica secret follows.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets as _secrets
from pathlib import Path

from llmgw_slurm.base.fsutil import atomic_write

__all__ = [
    "REPLY_HEADER",
    "REPORT_SCHEME",
    "AdminToken",
    "batch_secret",
    "constant_time_equal",
    "engine_api_key",
    "load_or_create_server_key",
    "parse_report_auth",
    "read_admin_token",
    "replica_secret",
    "reply_signature",
    "report_signature",
    "rotate_admin_token",
    "sign_report",
]

# The Authorization scheme of an agent's report: the replica secret signs the
# report and never travels, so that whoever reads the cluster network (the
# internal API is plain HTTP) learns nothing that lets them report as the replica.
REPORT_SCHEME = "LLMGW-HMAC"
# The header of the daemon's answer to a signed report: an HMAC, with the same
# secret, of the answer bound to the report it answers. The agent acts on an
# answer (drain, stop, a batch cancelled) only when it checks: while the daemon
# is down anyone may listen on its port, and anyone on the network path may
# rewrite a plain-HTTP answer.
REPLY_HEADER = "X-Llmgw-Reply-Sig"
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _derive(server_key: bytes, purpose: str, replica_id: str) -> str:
    msg = f"{purpose}\0{replica_id}".encode()
    return hmac.new(server_key, msg, hashlib.sha256).hexdigest()


def replica_secret(server_key: bytes, replica_id: str) -> str:
    """The secret an agent presents to prove it runs replica ``replica_id``."""
    return _derive(server_key, "replica", replica_id)


def batch_secret(server_key: bytes, batch_id: str) -> str:
    """The secret a Batch API job signs its progress reports with (as a replica's agent does)."""
    return _derive(server_key, "batch", batch_id)


def engine_api_key(server_key: bytes, replica_id: str) -> str:
    """The API key the replica's engine is started with.

    Distinct from the replica secret: the engine key is sent with every proxied
    request, and a leak of it must not let anyone register as the replica.
    """
    return _derive(server_key, "engine", replica_id)


class AdminToken:
    """The bearer token of the admin routes on the internal port, in ``state_dir/admin.token``.

    Stored, not derived from the server key, so that it can be rotated
    (``llmgw-admin token rotate`` replaces the file) without touching the
    replicas' secrets. The daemon looks at the file's identity at every check
    and re-reads it when it changed: the old token is refused from the next
    call on, with or without a restart. Only the daemon's user and root can
    read the file (the state directory is 0700).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._value = ""

    def ensure(self) -> None:
        """Create the token file on first start."""
        if not self.path.exists():
            rotate_admin_token(self.path)

    def current(self) -> str:
        """The token now in the file ("" when there is none: then nothing matches)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return ""
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._value = read_admin_token(self.path)
            self._stamp = stamp
        return self._value

    def matches(self, presented: str) -> bool:
        token = self.current()
        return bool(token) and constant_time_equal(presented, token)


def read_admin_token(path: Path) -> str:
    """The admin token in ``path`` (FileNotFoundError/PermissionError for the caller to explain)."""
    return path.read_text().strip()


def rotate_admin_token(path: Path) -> None:
    """Write a new random admin token to ``path`` (0600), replacing the old one whole."""
    atomic_write(path, f"llmgw-admin-{_secrets.token_urlsafe(32)}\n", mode=0o600)


def report_signature(secret: str, replica_id: str, ts: int, nonce: str, body: bytes) -> str:
    """HMAC-SHA256 of one report: its time, its nonce, the replica and the exact body bytes."""
    msg = f"{ts}\n{nonce}\n{replica_id}\n".encode() + body
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def reply_signature(secret: str, replica_id: str, nonce: str, status: int, body: bytes) -> str:
    """HMAC-SHA256 of the daemon's answer to the report signed with ``nonce``.

    The report's nonce is fresh per attempt, so an answer cannot be replayed
    to another report, nor one replica's answer passed off as another's.
    """
    msg = f"reply\n{replica_id}\n{nonce}\n{status}\n".encode() + body
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def sign_report(secret: str, replica_id: str, ts: int, body: bytes, nonce: str = "") -> str:
    """The Authorization header value of a signed report (a fresh nonce unless given).

    The nonce makes each attempt unique: a retry of a report whose answer was
    lost must not look like a replay of the first attempt.
    """
    nonce = nonce or _secrets.token_hex(8)
    sig = report_signature(secret, replica_id, ts, nonce, body)
    return f"{REPORT_SCHEME} ts={ts},nonce={nonce},sig={sig}"


def parse_report_auth(header: str) -> tuple[int, str, str] | None:
    """``(ts, nonce, sig)`` of a signed report's Authorization header; None if malformed."""
    scheme, _, params = header.partition(" ")
    if scheme != REPORT_SCHEME:
        return None
    fields = dict(p.partition("=")[::2] for p in params.split(","))
    ts, nonce, sig = fields.get("ts", ""), fields.get("nonce", ""), fields.get("sig", "")
    if not (ts.isdigit() and len(ts) <= 12 and _HEX16.fullmatch(nonce) and _HEX64.fullmatch(sig)):
        return None
    return int(ts), nonce, sig


def constant_time_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def load_or_create_server_key(path: Path) -> bytes:
    """Read the daemon's key, creating it (mode 0600) on first start.

    Losing this file orphans running replicas' secrets: they can no longer
    register after a daemon restart, so it lives with the daemon's state.
    """
    try:
        data = path.read_bytes().strip()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = _secrets.token_hex(32).encode()
    atomic_write(path, key + b"\n", mode=0o600)
    return key
