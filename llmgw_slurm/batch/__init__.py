"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``), run as Slurm jobs.

- :mod:`model`: the file and batch objects, the state machine, the input check (pure);
- :mod:`store`: files and batch records on disk, each owned by one identity;
- :mod:`results`: the result files a batch's jobs append to (resume, repair);
- :mod:`jobs`: a batch's Slurm job (through ``sbatch.render_batch``);
- :mod:`warm`: a batch's ride on its model's warm replicas, through
  :mod:`seam` (admission by slots below online requests, and the forward);
- :mod:`service`: create, cancel, the jobs' reports, and the poll that finishes batches;
- :mod:`routes`: the HTTP routes on the gateway and the internal port;
- :mod:`setup`: all of it on the daemon's apps.

This package's own import loads nothing: the job side imports :mod:`results` alone.

The job side is ``llmgw-agent batch`` (:mod:`llmgw_slurm.agent.batch`).
It sees the reconciler only through :mod:`setup` and the report route.

May import: base, guard, slurm, catalog, sbatch, config, auth, accounting, router, reconciler.
"""
