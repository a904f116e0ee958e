"""Munge credentials: the cluster's own proof of who a local user is.

Every host of a Slurm cluster runs munged with the site's shared key; any
process may ask it for a credential that names its uid and gid, and any
host's munged can decode it. ``llmgw login`` makes one (``munge``) and the
daemon decodes it (``unmunge``), so a user gets a key without an admin.

Why the command-line tools and not libmunge through ctypes: a login is rare
(once per user per key), a process costs a few milliseconds, and the tools
are installed wherever munged is; no C binding to keep in step.

What a credential proves, and what the daemon adds:

- munged refuses a credential it decoded before (``EMUNGE_CRED_REPLAYED``)
  and one past its time to live (``EMUNGE_CRED_EXPIRED``); a credential
  whose bytes were changed, or made with another key, fails its MAC.
- The payload must be :data:`LOGIN_PAYLOAD`: a credential the user made for
  something else (and handed to another service, which could replay it to
  the daemon within its TTL) is not a login.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from llmgw_slurm.base.errors import LlmgwError
from llmgw_slurm.base.subprocs import communicate

__all__ = [
    "LOGIN_PAYLOAD",
    "MungeError",
    "MungeIdentity",
    "MungeRefused",
    "decode",
    "encode",
]

LOGIN_PAYLOAD = "llmgw-login v1"
# Seconds a login credential is valid: long enough for a slow network, short
# enough that one caught in flight is soon worth nothing.
LOGIN_TTL = 60
_TIMEOUT = 10.0
# unmunge's exit status is munge's error number (munge.h).
_EXPIRED = 15
_REWOUND = 16
_REPLAYED = 17
# munged's own trouble (EMUNGE_SNAFU, _NO_MEMORY, _SOCKET, _TIMEOUT): not the credential's fault.
_DAEMON_FAULTS = frozenset({1, 5, 6, 7})


class MungeError(LlmgwError):
    """munge itself failed: not installed, munged down, no answer."""


class MungeRefused(LlmgwError):
    """The credential proves nothing: ``reason`` says why (for the 401's code)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason  # "replayed", "expired", "invalid", "wrong_payload"


@dataclass(frozen=True)
class MungeIdentity:
    """What a decoded credential proves."""

    uid: int
    gid: int
    host: str  # the address the credential was made on, as munged reports it


async def _run(argv: list[str], stdin: bytes | None) -> tuple[int, str, str]:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise MungeError(
            f"cannot run {argv[0]}: {exc.strerror}; is munge installed (the package "
            "that runs munged on every host of a Slurm cluster)?"
        ) from None
    try:
        out, err = await asyncio.wait_for(communicate(proc, stdin), _TIMEOUT)
    except (TimeoutError, asyncio.CancelledError):
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _socket_args(socket: Path | None) -> list[str]:
    return [f"--socket={socket}"] if socket is not None else []


async def encode(socket: Path | None = None, *, ttl: int = LOGIN_TTL) -> str:
    """A fresh login credential for the calling process's uid."""
    argv = ["munge", "--string", LOGIN_PAYLOAD, f"--ttl={ttl}", *_socket_args(socket)]
    try:
        rc, out, err = await _run(argv, None)  # the payload is on the command line
    except TimeoutError:
        raise MungeError(
            f"munge did not answer within {_TIMEOUT:g} s; is munged running?"
        ) from None
    if rc != 0:
        raise MungeError(
            f"munge failed: {err.strip() or f'exit {rc}'} (is munged running"
            + (f" with its socket at {socket}" if socket else "")
            + "? LLMGW_MUNGE_SOCKET names another socket)"
        )
    return out.strip()


def _parse(out: str) -> tuple[dict[str, str], str]:
    head, _, payload = out.partition("\n\n")
    meta = {}
    for line in head.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            meta[name.strip()] = value.strip()
    return meta, payload


async def decode(credential: str, socket: Path | None = None) -> MungeIdentity:
    """The identity a login credential proves; MungeRefused if it proves none."""
    if not credential.startswith("MUNGE:") or len(credential) > 4096 or "\n" in credential:
        raise MungeRefused("invalid", "that is not a munge credential")
    argv = ["unmunge", "--numeric", *_socket_args(socket)]
    try:
        rc, out, err = await _run(argv, credential.encode() + b"\n")
    except TimeoutError:
        raise MungeError(
            f"unmunge did not answer within {_TIMEOUT:g} s; is munged running?"
        ) from None
    if rc == _REPLAYED:
        raise MungeRefused(
            "replayed", "that munge credential was used before; run `llmgw login` again"
        )
    if rc in (_EXPIRED, _REWOUND):
        raise MungeRefused(
            "expired",
            "that munge credential has expired (or the clocks of the two hosts differ); "
            "run `llmgw login` again",
        )
    if rc in _DAEMON_FAULTS:
        raise MungeError(f"unmunge failed (is munged running?): {err.strip() or f'exit {rc}'}")
    meta, payload = _parse(out)
    if rc != 0 or meta.get("STATUS") != "0":
        raise MungeRefused(
            "invalid", "that munge credential is not valid (made with another key, or changed)"
        )
    if payload != LOGIN_PAYLOAD:
        raise MungeRefused("wrong_payload", "that munge credential was not made by `llmgw login`")
    try:
        return MungeIdentity(int(meta["UID"]), int(meta["GID"]), meta.get("ENCODE_HOST", ""))
    except (KeyError, ValueError):
        raise MungeError(f"unmunge's answer has no numeric UID and GID: {out[:200]!r}") from None


def socket_from_env() -> Path | None:
    """``LLMGW_MUNGE_SOCKET``: munged's socket when it is not at munge's default place."""
    value = os.environ.get("LLMGW_MUNGE_SOCKET")
    return Path(value) if value else None
