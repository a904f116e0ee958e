"""The schema's migrations (llmgw-admin db migrate) and the check a daemon makes at start."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from llmgw_slurm.base.errors import SchemaError
from llmgw_slurm.cli.admin import main as admin
from llmgw_slurm.db.connect import connect
from llmgw_slurm.db.schema import LATEST, check_schema, migrate, schema_version
from llmgw_slurm.db.setup import check_database
from tests.ha.conftest import PgDatabase

pytestmark = pytest.mark.ha


def _server_yaml(tmp_path: Path, db: PgDatabase) -> Path:
    path = tmp_path / "server.yaml"
    cfg = {"state_dir": str(tmp_path / "state"), "database": db.server_yaml_block("admin")}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_migrate_twice_applies_once_and_a_daemon_starts_only_on_the_latest(
    empty_pgdb: PgDatabase, tmp_path: Path
) -> None:
    info = empty_pgdb.info()
    with pytest.raises(SchemaError, match="llmgw-admin db migrate"):
        check_database(info)
    server = _server_yaml(tmp_path, empty_pgdb)
    first = CliRunner().invoke(admin, ["db", "migrate", "--server", str(server)])
    assert first.exit_code == 0, first.output
    assert f"schema at version {LATEST} (was empty)" in first.output
    second = CliRunner().invoke(admin, ["db", "migrate", "--server", str(server)])
    assert second.exit_code == 0, second.output
    assert "nothing to do" in second.output
    assert check_database(info)[1] == LATEST
    with contextlib.closing(empty_pgdb.connect()) as conn:
        rows = conn.execute("SELECT version, applied_by FROM llmgw_schema").fetchall()
    assert rows == [(1, "llmgw-admin db migrate")]


def test_two_admins_migrating_at_once_take_turns(empty_pgdb: PgDatabase) -> None:
    applied: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with contextlib.closing(connect(empty_pgdb.info())) as conn:
                applied.append(len(migrate(conn, "racer")[1]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(applied) == [0, 0, 0, len([1])]
    with contextlib.closing(empty_pgdb.connect()) as conn:
        assert schema_version(conn) == LATEST


def test_a_newer_schema_is_refused_and_left_alone(pgdb: PgDatabase, tmp_path: Path) -> None:
    with contextlib.closing(pgdb.connect()) as conn:
        conn.execute(
            "INSERT INTO llmgw_schema (version, what, applied_by) VALUES (%s, 'future', 'x')",
            (LATEST + 1,),
        )
        with pytest.raises(SchemaError, match=f"version {LATEST + 1}, newer"):
            check_schema(conn)
    result = CliRunner().invoke(
        admin, ["db", "migrate", "--server", str(_server_yaml(tmp_path, pgdb))]
    )
    assert result.exit_code == 1
    assert f"version {LATEST + 1}, newer than this llmgw-slurm knows ({LATEST})" in result.output
    assert "Traceback" not in result.output
    with contextlib.closing(pgdb.connect()) as conn:
        assert schema_version(conn) == LATEST + 1


def test_an_unreachable_server_is_named_without_its_password(
    pgdb: PgDatabase, tmp_path: Path
) -> None:
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "database": {**pgdb.server_yaml_block("x"), "dsn": "host=127.0.0.1 port=1 dbname=x"},
    }
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(admin, ["db", "status", "--server", str(path)])
    assert result.exit_code == 1
    assert "database (dsn 'host=127.0.0.1 port=1 dbname=x'): connecting failed" in result.output
    assert pgdb.password_file.read_text().strip() not in result.output
