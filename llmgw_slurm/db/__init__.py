"""Several daemons on one PostgreSQL (``database:`` in server.yaml).

Each daemon keeps its state in memory as before; this package keeps it in
step with the database, behind the interfaces the stores already have:
:mod:`~llmgw_slurm.db.connect` and :mod:`~llmgw_slurm.db.schema` (libpq
settings, migrations), :mod:`~llmgw_slurm.db.hub` (the pool, the daemon's
row, ``LISTEN``), :mod:`~llmgw_slurm.db.lease` (the reconciler's fenced
lease), :mod:`~llmgw_slurm.db.replicas` (the shared replica directory),
:mod:`~llmgw_slurm.db.keys`, :mod:`~llmgw_slurm.db.usage`,
:mod:`~llmgw_slurm.db.quota`, :mod:`~llmgw_slurm.db.batches`,
:mod:`~llmgw_slurm.db.responses` and :mod:`~llmgw_slurm.db.secrets` (the
stores), :mod:`~llmgw_slurm.db.importer` (``llmgw-admin db import``),
:mod:`~llmgw_slurm.db.metrics`, and :mod:`~llmgw_slurm.db.setup`, what
``daemon.build`` wires in. Nothing below it imports it, and the daemon and
the CLIs import it only with a ``database:`` block (psycopg is needed only then).

May import: base, slurm, config, auth, accounting, router, reconciler, batch.
"""
