"""Where the admin CLI finds the state it reads: the daemon's state directory, or the
shared database when server.yaml has a ``database:`` block (psycopg imported only then)."""

from __future__ import annotations

from pathlib import Path

from llmgw_slurm.accounting.usage import SqliteUsage, UsageQueries
from llmgw_slurm.config import ServerConfig

__all__ = ["usage_queries"]


def usage_queries(server: ServerConfig) -> UsageQueries:
    """The usage store's queries: ``state_dir/usage.sqlite3``, or the shared database's."""
    if server.database is not None:
        from llmgw_slurm.db.connect import make_conninfo
        from llmgw_slurm.db.usage import PgUsage

        return PgUsage(make_conninfo(server.database, "llmgw-admin"))
    return SqliteUsage(Path(server.state_dir) / "usage.sqlite3")
