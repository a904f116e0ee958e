"""The shared database's schema, as numbered migrations, and the check a daemon makes at start.

``llmgw-admin db migrate`` applies the migrations the database lacks, in
order, each in its own transaction with its row in ``llmgw_schema``; two
admins migrating at once take turns (a transaction-level advisory lock), so
running it twice, or on two login nodes at once, does nothing the second
time. A database migrated by a newer llmgw-slurm (a version this code does
not know) is refused, never touched: an older daemon could misread what a
newer one writes. A daemon does not migrate by itself: it starts only on the
schema it was written for, and says what to run otherwise.

Every table is prefixed ``llmgw_``, so the service can share a database with
others. What each holds is described in docs/operations.md ("Two login
nodes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from llmgw_slurm.base.errors import SchemaError

__all__ = ["LATEST", "MIGRATIONS", "Migration", "check_schema", "migrate", "schema_version"]

# pg_advisory_xact_lock's key for migrations: "llmgw" in ASCII, as a number.
_MIGRATE_LOCK = 0x6C6C6D6777


@dataclass(frozen=True)
class Migration:
    version: int
    what: str
    sql: str


_V1 = """
CREATE SEQUENCE llmgw_change_seq;

-- The daemons' shared secrets: the key replica secrets and engine keys derive
-- from, and the gateway's client identity the engines let in (auth/secrets.py, auth/tls.py).
CREATE TABLE llmgw_secrets (
    name text PRIMARY KEY,
    value bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- API keys (auth/keys.py): hashes only.
CREATE TABLE llmgw_keys (
    key_id text PRIMARY KEY,
    user_name text NOT NULL,
    project text NOT NULL DEFAULT '',
    sha256 text NOT NULL,
    created double precision NOT NULL,
    revoked double precision,
    seq bigint NOT NULL DEFAULT nextval('llmgw_change_seq')
);
CREATE INDEX llmgw_keys_user ON llmgw_keys (user_name);
CREATE INDEX llmgw_keys_seq ON llmgw_keys (seq);

-- Per-request usage (accounting/usage.py). (origin, seq) names a record once: a
-- batch replayed from a daemon's spool after a lost answer is not counted twice.
CREATE TABLE llmgw_usage (
    origin text NOT NULL,
    seq bigint NOT NULL,
    ts double precision NOT NULL,
    key_id text NOT NULL,
    user_name text NOT NULL,
    project text NOT NULL,
    model text NOT NULL,
    endpoint text NOT NULL,
    prompt_tokens bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    total_tokens bigint NOT NULL,
    -- A batch is one record of all its requests: requests counts them.
    requests bigint NOT NULL DEFAULT 1,
    PRIMARY KEY (origin, seq)
);
CREATE INDEX llmgw_usage_key_ts ON llmgw_usage (key_id, ts);
CREATE INDEX llmgw_usage_ts ON llmgw_usage (ts);

-- Tokens spent per user and account per UTC day and month: what budgets count,
-- kept beside the usage (same transaction) so no gateway sums the usage table.
CREATE TABLE llmgw_spend (
    kind text NOT NULL,
    name text NOT NULL,
    period text NOT NULL,
    tokens bigint NOT NULL,
    seq bigint NOT NULL DEFAULT nextval('llmgw_change_seq'),
    PRIMARY KEY (kind, name, period)
);
CREATE INDEX llmgw_spend_seq ON llmgw_spend (seq);

-- Tokens each gateway's requests in flight hold per user and account (their
-- reservations): the other gateways count them against the same budgets.
CREATE TABLE llmgw_holds (
    daemon text NOT NULL,
    kind text NOT NULL,
    name text NOT NULL,
    tokens bigint NOT NULL,
    PRIMARY KEY (daemon, kind, name)
);

-- Accounts' own budgets (llmgw-admin quota).
CREATE TABLE llmgw_budgets (
    account text PRIMARY KEY,
    tokens_per_day bigint,
    tokens_per_month bigint
);

-- Batch API records (batch/store.py); the files' bytes stay on the shared filesystem.
CREATE TABLE llmgw_files (
    id text PRIMARY KEY,
    owner text NOT NULL,
    record jsonb NOT NULL,
    deleted boolean NOT NULL DEFAULT false,
    seq bigint NOT NULL DEFAULT nextval('llmgw_change_seq')
);
CREATE INDEX llmgw_files_seq ON llmgw_files (seq);
CREATE TABLE llmgw_batches (
    id text PRIMARY KEY,
    owner text NOT NULL,
    record jsonb NOT NULL,
    seq bigint NOT NULL DEFAULT nextval('llmgw_change_seq')
);
CREATE INDEX llmgw_batches_seq ON llmgw_batches (seq);

-- Which replica run holds each stored response (router/surface.py's ResponseHomes).
CREATE TABLE llmgw_responses (
    id text PRIMARY KEY,
    model text NOT NULL,
    replica_id text NOT NULL,
    epoch integer NOT NULL,
    owner text NOT NULL,
    counted boolean NOT NULL,
    gone boolean NOT NULL DEFAULT false,
    created double precision NOT NULL,
    seq bigint NOT NULL DEFAULT nextval('llmgw_change_seq')
);
CREATE INDEX llmgw_responses_seq ON llmgw_responses (seq);
CREATE INDEX llmgw_responses_created ON llmgw_responses (created);

-- The reconciler's lease: one holder, an epoch each time it changes hands.
CREATE TABLE llmgw_lease (
    name text PRIMARY KEY,
    holder text,
    epoch bigint NOT NULL DEFAULT 0,
    acquired_at timestamptz,
    renewed_at timestamptz,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO llmgw_lease (name) VALUES ('reconciler');

-- Every Slurm action a leader takes, written (under its lease) before the
-- command runs: a new leader waits out those of an earlier epoch still open.
CREATE TABLE llmgw_actions (
    id bigserial PRIMARY KEY,
    epoch bigint NOT NULL,
    holder text NOT NULL,
    kind text NOT NULL,
    model text NOT NULL DEFAULT '',
    replica_id text NOT NULL DEFAULT '',
    target text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    deadline timestamptz NOT NULL,
    outcome text,
    finished_at timestamptz
);
CREATE INDEX llmgw_actions_open ON llmgw_actions (id) WHERE finished_at IS NULL;

-- The daemons that share the database, for status.
CREATE TABLE llmgw_daemons (
    name text PRIMARY KEY,
    host text NOT NULL,
    pid integer NOT NULL,
    gateway_url text NOT NULL,
    internal_url text NOT NULL,
    version text NOT NULL,
    started_at timestamptz NOT NULL,
    last_seen timestamptz NOT NULL,
    stopped_at timestamptz
);

-- The replica directory: what the leader's passes and the agents' reports know
-- of each replica beyond Slurm's listing (reconciler/replicas.py), field by field.
CREATE TABLE llmgw_replicas (
    replica_id text PRIMARY KEY,
    model text NOT NULL,
    data jsonb NOT NULL,
    gone boolean NOT NULL DEFAULT false,
    seq bigint NOT NULL DEFAULT nextval('llmgw_change_seq')
);
CREATE INDEX llmgw_replicas_seq ON llmgw_replicas (seq);

-- Each gateway's requests in flight and last use per replica (load-based scaling,
-- idleness), and its held requests per model (on-demand starts, who evicts first).
CREATE TABLE llmgw_load (
    daemon text NOT NULL,
    replica_id text NOT NULL,
    in_flight integer NOT NULL,
    last_used double precision,
    PRIMARY KEY (daemon, replica_id)
);
CREATE TABLE llmgw_demand (
    daemon text NOT NULL,
    model text NOT NULL,
    wanted_at double precision,
    held_since double precision,
    PRIMARY KEY (daemon, model)
);

-- The leader's last node listing (sinfo), for every daemon's status page.
CREATE TABLE llmgw_nodes (
    id integer PRIMARY KEY CHECK (id = 1),
    listed_at double precision NOT NULL,
    nodes jsonb NOT NULL
);

-- The recent decisions the status page shows.
CREATE TABLE llmgw_decisions (
    id bigserial PRIMARY KEY,
    at double precision NOT NULL,
    action text NOT NULL,
    model text NOT NULL,
    replica_id text NOT NULL,
    reason text NOT NULL,
    pass_id text NOT NULL,
    daemon text NOT NULL
);
"""

MIGRATIONS: tuple[Migration, ...] = (Migration(1, "shared state for several daemons", _V1),)
LATEST = MIGRATIONS[-1].version


def schema_version(conn: psycopg.Connection[Any]) -> int:
    """The highest migration applied; 0 when the database has none."""
    row = conn.execute("SELECT to_regclass('llmgw_schema') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute("SELECT coalesce(max(version), 0) FROM llmgw_schema").fetchone()
    return int(row[0]) if row else 0


def _too_new(found: int) -> SchemaError:
    return SchemaError(
        f"the database's schema is version {found}, newer than this llmgw-slurm knows "
        f"({LATEST}): a newer llmgw-slurm migrated it; run that version here too"
    )


def migrate(conn: psycopg.Connection[Any], by: str) -> tuple[int, list[Migration]]:
    """Apply the migrations the database lacks; (the version before, those applied).

    ``conn`` must be in autocommit mode: each migration is its own transaction.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS llmgw_schema ("
            " version integer PRIMARY KEY,"
            " what text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now(),"
            " applied_by text NOT NULL)"
        )
    before = schema_version(conn)
    if before > LATEST:
        raise _too_new(before)
    applied = []
    for m in MIGRATIONS:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))
            # Read again under the lock: another admin may have applied it meanwhile.
            if schema_version(conn) >= m.version:
                continue
            conn.execute(m.sql.encode())
            conn.execute(
                "INSERT INTO llmgw_schema (version, what, applied_by) VALUES (%s, %s, %s)",
                (m.version, m.what, by),
            )
        applied.append(m)
    return before, applied


def check_schema(conn: psycopg.Connection[Any]) -> int:
    """The schema version, when it is the one this code was written for; else SchemaError."""
    found = schema_version(conn)
    if found > LATEST:
        raise _too_new(found)
    if found < LATEST:
        state = "has no llmgw-slurm schema" if found == 0 else f"has schema version {found}"
        raise SchemaError(
            f"the database {state}; this llmgw-slurm needs version {LATEST}: "
            "run `llmgw-admin db migrate --server server.yaml` once (from any login node)"
        )
    return found
