"""``llmgw-admin db``: the shared database of several daemons (``database:`` in server.yaml).

- ``db migrate``: bring the schema to this llmgw-slurm's version (idempotent;
  refuses a newer schema);
- ``db status``: the schema, the lease (who leads, its epoch, since when) and
  every daemon with its last contact;
- ``db import STATE_DIR``: an embedded daemon's state (keys, usage, budgets,
  batches, files' records, the daemon's secrets) into the database.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from llmgw_slurm.cli.common import friendly_errors, print_json, table
from llmgw_slurm.config import ServerConfig

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _database(server: ServerConfig) -> Any:
    """The server's database connection settings (psycopg imported only here)."""
    from llmgw_slurm.db.connect import make_conninfo

    if server.database is None:
        raise click.ClickException(
            "server.yaml has no database: block: this daemon keeps its state in its state "
            'directory (docs/operations.md, "Two login nodes", says how to share it)'
        )
    return make_conninfo(server.database, "llmgw-admin")


def _ago(t: float | None, now: float) -> str:
    return "-" if t is None else f"{max(0.0, now - t):.1f}s ago"


def db_group(server_option: Decorator, load_server: Callable[[Path], ServerConfig]) -> click.Group:
    """The ``db`` group, with llmgw-admin's own ``--server`` option and loader."""

    @click.group()
    def db() -> None:
        """Set up and inspect the shared database.

        Several daemons (two login nodes) share one PostgreSQL database, named
        by database: in server.yaml (docs/operations.md, "Two login nodes").

        \b
        Examples:
          llmgw-admin db migrate
          llmgw-admin db status --json | jq -r .lease.holder
          llmgw-admin db import /var/lib/llmgw
        """

    _add_migrate(db, server_option, load_server)
    _add_status(db, server_option, load_server)
    _add_import(db, server_option, load_server)
    return db


def _add_migrate(
    db: click.Group, server_option: Decorator, load_server: Callable[[Path], ServerConfig]
) -> None:
    """``llmgw-admin db migrate``."""

    @db.command("migrate")
    @server_option
    @friendly_errors
    def db_migrate(server_path: Path) -> None:
        """Bring the database's schema to this version.

        Safe to run again, or on two login nodes at once; it refuses a schema
        newer than this llmgw-slurm.

        \b
        Example:
          llmgw-admin db migrate --server /etc/llmgw/server.yaml
        """
        from llmgw_slurm.db.connect import connect
        from llmgw_slurm.db.schema import LATEST, migrate

        info = _database(load_server(server_path))
        with contextlib.closing(connect(info)) as conn:
            before, applied = migrate(conn, "llmgw-admin db migrate")
        if not applied:
            click.echo(f"schema already at version {LATEST}: nothing to do")
            return
        for m in applied:
            click.echo(f"applied migration {m.version}: {m.what}")
        click.echo(f"schema at version {LATEST} (was {before or 'empty'})")


def _add_status(
    db: click.Group, server_option: Decorator, load_server: Callable[[Path], ServerConfig]
) -> None:
    """``llmgw-admin db status``."""

    @db.command("status")
    @server_option
    @click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")
    @friendly_errors
    def db_status(server_path: Path, as_json: bool) -> None:
        """Show the schema, the leader and every daemon.

        Who holds the reconciler's lease (its epoch, since when) and each
        daemon's last contact with the database.

        \b
        Examples:
          llmgw-admin db status
          llmgw-admin db status --json | jq '.daemons[] | .name'
        """
        out = _status(_database(load_server(server_path)))
        if as_json:
            print_json(out)
        else:
            _print_status(out)


def _add_import(
    db: click.Group, server_option: Decorator, load_server: Callable[[Path], ServerConfig]
) -> None:
    """``llmgw-admin db import``."""

    @db.command("import")
    @click.argument("state_dir", type=click.Path(file_okay=False, path_type=Path))
    @server_option
    @click.option(
        "--keys-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="The old keys file (default: router.keys_file of server.yaml).",
    )
    @click.option(
        "--batch-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="The old batch.directory (default: batch.directory of server.yaml, else "
        "STATE_DIR/batch).",
    )
    @friendly_errors
    def db_import(
        state_dir: Path, server_path: Path, keys_file: Path | None, batch_dir: Path | None
    ) -> None:
        """Move an embedded daemon's STATE_DIR into the database.

        Keys, usage, account budgets, batches and files' records, and its
        secrets (so its running replicas keep reporting). Safe to run again:
        nothing is counted twice.

        \b
        Example:
          llmgw-admin db import /var/lib/llmgw --keys-file /etc/llmgw/keys.json
        """
        from llmgw_slurm.db.connect import connect
        from llmgw_slurm.db.importer import import_state

        server = load_server(server_path)
        info = _database(server)
        keys = keys_file or server.router.keys_file
        with contextlib.closing(connect(info)) as conn:
            folder = batch_dir or server.batch.directory or state_dir / "batch"
            counts = import_state(conn, state_dir, keys, folder)
        for what, n in counts.items():
            click.echo(f"{what}: {n}")


def _print_status(out: dict[str, Any]) -> None:
    now = out["now"]
    lease = out["lease"]
    click.echo(f"schema version {out['schema']}")
    live = lease["expires"] is not None and lease["expires"] > now
    who = lease["holder"] or "none"
    if lease["holder"]:
        who += f", epoch {lease['epoch']}, since {_ago(lease['since'], now)}"
        who += "" if live else " (lease expired)"
    click.echo(f"leader: {who}")
    rows = [
        (
            d["name"],
            d["host"],
            str(d["pid"]),
            d["version"],
            _ago(d["last_seen"], now),
            "stopped" if d["stopped_at"] else "",
        )
        for d in out["daemons"]
    ]
    click.echo(table(("daemon", "host", "pid", "version", "last contact", ""), rows))


def _status(info: Any) -> dict[str, Any]:
    from llmgw_slurm.db.connect import connect
    from llmgw_slurm.db.schema import schema_version

    with contextlib.closing(connect(info)) as conn:
        version = schema_version(conn)
        out: dict[str, Any] = {"schema": version, "now": time.time(), "daemons": []}
        lease = None
        if version:
            lease = conn.execute(
                "SELECT holder, epoch, extract(epoch FROM acquired_at),"
                " extract(epoch FROM expires_at), extract(epoch FROM now())"
                " FROM llmgw_lease WHERE name = 'reconciler'"
            ).fetchone()
            rows = conn.execute(
                "SELECT name, host, pid, version, extract(epoch FROM last_seen),"
                " extract(epoch FROM stopped_at) FROM llmgw_daemons ORDER BY name"
            ).fetchall()
            out["daemons"] = [
                {
                    "name": r[0],
                    "host": r[1],
                    "pid": r[2],
                    "version": r[3],
                    "last_seen": float(r[4]),
                    "stopped_at": float(r[5]) if r[5] is not None else None,
                }
                for r in rows
            ]
        if lease is not None:
            # The database's clock: lease times are compared with it, not this host's.
            out["now"] = float(lease[4])
        out["lease"] = {
            "holder": (lease[0] or "") if lease else "",
            "epoch": int(lease[1]) if lease else 0,
            "since": float(lease[2]) if lease and lease[2] is not None else None,
            "expires": float(lease[3]) if lease and lease[3] is not None else None,
        }
    return out
