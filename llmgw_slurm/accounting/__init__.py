"""What was spent, and what may still be.

- :mod:`~llmgw_slurm.accounting.usage`: each request's tokens per key, user,
  account and model (SQLite in the state directory, written in batches off
  the request path), and the queries over them;
- :mod:`~llmgw_slurm.accounting.quota`: requests and tokens per minute,
  token budgets per day and month, each request's maximum held from
  admission until it settles (:class:`~llmgw_slurm.accounting.quota.QuotaBook`);
- :mod:`~llmgw_slurm.accounting.audit`: GPU use of the service's jobs per
  model and period, from ``sacct``;
- :mod:`~llmgw_slurm.accounting.audit_owner`: those GPU hours by the user or
  Slurm account they served.

The gateway (:mod:`llmgw_slurm.router`) reserves, settles and records here;
``db/`` keeps usage and budgets in PostgreSQL behind the same interfaces.
This package's own import loads nothing.

May import: base, guard, slurm, catalog, config, auth.
"""
