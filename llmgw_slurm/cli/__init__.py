"""Command-line entry points: ``llmgw`` (researchers) and ``llmgw-admin`` (admins).

:mod:`~llmgw_slurm.cli.researcher` and :mod:`~llmgw_slurm.cli.admin` are the
console scripts; the other modules are their groups of commands and what
they share (:mod:`~llmgw_slurm.cli.common`, :mod:`~llmgw_slurm.cli.settings`).
The top layer: nothing imports it.

May import: base, slurm, catalog, sbatch, config, auth, tracing, accounting, router,
reconciler, batch, db, daemon.
"""
