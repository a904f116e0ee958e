"""From ``database:`` in server.yaml to libpq's connection settings, and connections made of them.

Why psycopg 3 (and its pool) rather than asyncpg: psycopg is libpq, so a
site's connection settings mean what they mean to ``psql`` and to its DBA:
a ``pg_service.conf`` service name, ``~/.pgpass``, every ``sslmode`` with
``sslrootcert``/``sslcert``/``sslkey``, several hosts with
``target_session_attrs=read-write`` (how a client follows a Patroni or
managed-service failover), TCP keepalives and ``tcp_user_timeout``. asyncpg
reimplements the protocol and reads none of pg_service.conf, nor all of
libpq's options. psycopg also has both a synchronous and an asynchronous
connection on one type system: the daemon's event loop uses the
asynchronous one, the admin CLI and the stores' writers the synchronous one
in worker threads. Its cost is a few microseconds more per query than
asyncpg's, and no query runs on a request's path (docs/operations.md).

The password never sits in a connection string that could be logged: it is
read from ``password_file`` (refused unless only its owner can read it, as
libpq refuses such a ``.pgpass``) and given to libpq apart.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo as pgconninfo

from llmgw_slurm.base.errors import ConfigError, DatabaseError
from llmgw_slurm.config import DatabaseConfig

__all__ = [
    "Conninfo",
    "aconnect",
    "connect",
    "daemon_name",
    "database_error",
    "make_conninfo",
    "read_password",
]

# Keepalives and a user timeout, so that a server gone without a word (a cable
# pulled, a node dead) is noticed in seconds, not after the kernel's two hours:
# the lease and the notifications depend on it.
_LIVENESS = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "1",
    "keepalives_count": "3",
    "tcp_user_timeout": "5000",
}

_DEFAULTED = frozenset((*_LIVENESS, "connect_timeout", "application_name"))


@dataclass(frozen=True)
class Conninfo:
    """A libpq connection string without its password, the password, and how to name
    the server in a message (the DSN or service as configured, never the password)."""

    conninfo: str
    password: str | None
    where: str

    def kwargs(self) -> dict[str, Any]:
        return {"password": self.password} if self.password is not None else {}


def read_password(path: Path) -> str:
    """The first line of ``path``; refused unless it is a file only its owner may read."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            line = f.readline()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the password file: {exc.strerror}", field="database.password_file"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text", field="database.password_file") from None
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
        raise ConfigError(
            f"{path} may be read by others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}",
            field="database.password_file",
        )
    password = line.rstrip("\r\n")
    if not password:
        raise ConfigError(f"{path} is empty", field="database.password_file")
    return password


def make_conninfo(cfg: DatabaseConfig, name: str) -> Conninfo:
    """libpq's settings for ``cfg``; raises ConfigError on a DSN that libpq cannot read
    or one that holds a password."""
    base = cfg.dsn or ""
    where = f"dsn {cfg.dsn!r}" if cfg.dsn else f"service {cfg.service!r}"
    try:
        given = pgconninfo.conninfo_to_dict(base)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"libpq cannot read it: {exc}", field="database.dsn") from None
    if "password" in given:
        # server.yaml is often readable by every user of the login node.
        raise ConfigError(
            "the DSN holds a password; put it in a file of its own (database.password_file)",
            field="database.dsn",
        )
    extra: dict[str, Any] = dict(_LIVENESS)
    extra["connect_timeout"] = str(max(2, int(cfg.connect_timeout)))
    extra["application_name"] = f"llmgw-slurm {name}"[:63]
    if cfg.service:
        extra["service"] = cfg.service
    tls = cfg.tls
    for key, value in (
        ("sslmode", tls.mode),
        ("sslrootcert", tls.root_cert),
        ("sslcert", tls.cert),
        ("sslkey", tls.key),
    ):
        if value is not None:
            extra[key] = str(value)
    for key in _DEFAULTED.intersection(given):
        # The DSN's own setting wins over these defaults (database.tls wins over the DSN).
        extra.pop(key, None)
    password = read_password(cfg.password_file) if cfg.password_file is not None else None
    return Conninfo(pgconninfo.make_conninfo(base, **extra), password, where)


def database_error(info: Conninfo, exc: BaseException, doing: str = "connecting") -> DatabaseError:
    """A DatabaseError that says which server, what was being done, and libpq's words."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, psycopg.Error) and not isinstance(exc, psycopg.OperationalError):
        # The server answered: a statement's error, not a way in.
        return DatabaseError(f"database ({info.where}): {doing} failed: {text}")
    return DatabaseError(
        f"database ({info.where}): {doing} failed: {text}; check database: in server.yaml, "
        "that the server runs and lets this host in (pg_hba.conf), and the password file"
    )


def connect(info: Conninfo, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A synchronous connection (for the admin CLI and worker threads)."""
    try:
        return psycopg.connect(info.conninfo, autocommit=autocommit, **info.kwargs())
    except psycopg.Error as exc:
        raise database_error(info, exc) from None


async def aconnect(info: Conninfo, *, autocommit: bool = True) -> psycopg.AsyncConnection[Any]:
    """An asynchronous connection (for the daemon's event loop)."""
    try:
        return await psycopg.AsyncConnection.connect(
            info.conninfo, autocommit=autocommit, **info.kwargs()
        )
    except psycopg.Error as exc:
        raise database_error(info, exc) from None


def daemon_name(cfg: DatabaseConfig, gateway_port: int) -> str:
    """This daemon's name among those sharing the database: ``database.name``, else
    ``HOST:GATEWAY_PORT``."""
    return cfg.name or f"{socket.gethostname()}:{gateway_port}"
