"""Fixtures for the ha level: a real PostgreSQL (scripts/dev-postgres up) and a fresh
database of its own for each test.

``LLMGW_TEST_PG_DSN`` and ``LLMGW_TEST_PG_PASSWORD_FILE`` name the server
(``eval "$(scripts/dev-postgres env)"``, which scripts/test ha does); without
them every test of this level fails, saying so: the level exists to run them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo as pgconninfo

from llmgw_slurm.config import DatabaseConfig
from llmgw_slurm.db.connect import Conninfo, connect, make_conninfo
from llmgw_slurm.db.schema import migrate


@dataclass(frozen=True)
class PgDatabase:
    """One test's own database: its DSN, password file and connection settings."""

    dsn: str
    password_file: Path
    name: str

    def config(self, **over: Any) -> DatabaseConfig:
        return DatabaseConfig(**{"dsn": self.dsn, "password_file": self.password_file, **over})

    def info(self, name: str = "test") -> Conninfo:
        return make_conninfo(self.config(), name)

    def connect(self) -> psycopg.Connection[Any]:
        return connect(self.info())

    def server_yaml_block(self, name: str, **over: Any) -> dict[str, Any]:
        return {"dsn": self.dsn, "password_file": str(self.password_file), "name": name, **over}


def _server() -> tuple[str, Path]:
    dsn = os.environ.get("LLMGW_TEST_PG_DSN", "")
    pw = os.environ.get("LLMGW_TEST_PG_PASSWORD_FILE", "")
    if not dsn or not pw:
        pytest.fail(
            "the ha level needs PostgreSQL: scripts/dev-postgres up, then "
            'eval "$(scripts/dev-postgres env)" (scripts/test ha does both)'
        )
    return dsn, Path(pw)


@contextlib.contextmanager
def fresh_database(*, migrated: bool = True) -> Iterator[PgDatabase]:
    """A database made for the caller and dropped after it."""
    dsn, pw = _server()
    name = "llmgw_t_" + secrets.token_hex(4)
    admin = connect(make_conninfo(DatabaseConfig(dsn=dsn, password_file=pw), "tests"))
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        db = PgDatabase(pgconninfo.make_conninfo(dsn, dbname=name), pw, name)
        if migrated:
            with contextlib.closing(db.connect()) as conn:
                migrate(conn, "tests")
        yield db
    finally:
        with contextlib.suppress(psycopg.Error):
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def pgdb() -> Iterator[PgDatabase]:
    with fresh_database() as db:
        yield db


@pytest.fixture
def empty_pgdb() -> Iterator[PgDatabase]:
    with fresh_database(migrated=False) as db:
        yield db
