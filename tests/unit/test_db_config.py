"""database: in server.yaml, and the libpq settings made of it (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmgw_slurm.base.errors import ConfigError
from llmgw_slurm.config import DatabaseConfig, load_server_config
from llmgw_slurm.db.connect import make_conninfo, read_password

SITE = Path(__file__).resolve().parents[2] / "site-config"


def _server(tmp_path: Path, database: dict[str, object]) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "s"), "database": database}))
    return path


def test_the_two_login_nodes_example_loads_onto_the_site_server_yaml(tmp_path: Path) -> None:
    server = yaml.safe_load((SITE / "server.yaml").read_text())
    server.update(yaml.safe_load((SITE / "two-login-nodes" / "server-database.yaml").read_text()))
    for key in ("models", "agent_config"):
        server[key] = str(SITE / Path(server.get(key, f"{key}.yaml")).name)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server))
    db = load_server_config(path).database
    assert db is not None and db.service == "llmgw" and db.tls.mode == "verify-full"


def test_one_of_dsn_or_service_and_a_deadline_inside_the_lease(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="set one of dsn"):
        load_server_config(_server(tmp_path, {"dsn": "host=x", "service": "y"}))
    with pytest.raises(ConfigError, match="set one of dsn"):
        load_server_config(_server(tmp_path, {"name": "a"}))
    with pytest.raises(ConfigError, match="before its lease can run out elsewhere"):
        load_server_config(_server(tmp_path, {"dsn": "host=x", "lease_deadline": "4s"}))


def test_a_password_in_the_dsn_is_refused(tmp_path: Path) -> None:
    cfg = DatabaseConfig(dsn="postgresql://llmgw:secret@db1/llmgw")
    with pytest.raises(ConfigError, match="password_file"):
        make_conninfo(cfg, "a")


def test_a_password_file_others_may_read_is_refused(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_password(pw)
    pw.chmod(0o600)
    assert read_password(pw) == "s3cret"


def test_the_conninfo_has_liveness_and_tls_and_never_the_password(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o600)
    cfg = load_server_config(
        _server(
            tmp_path,
            {
                "dsn": "host=db1 dbname=llmgw user=llmgw keepalives_idle=9",
                "password_file": str(pw),
                "tls": {"mode": "verify-full", "root_cert": str(tmp_path / "ca.pem")},
            },
        )
    ).database
    assert cfg is not None
    info = make_conninfo(cfg, "login1")
    assert "s3cret" not in info.conninfo and info.password == "s3cret"
    assert "sslmode=verify-full" in info.conninfo
    assert f"sslrootcert={tmp_path / 'ca.pem'}" in info.conninfo
    # The DSN's own keepalive setting wins over the default; the others are added.
    assert "keepalives_idle=9" in info.conninfo and "tcp_user_timeout=5000" in info.conninfo
    assert "application_name='llmgw-slurm login1'" in info.conninfo
    assert info.where == "dsn 'host=db1 dbname=llmgw user=llmgw keepalives_idle=9'"
