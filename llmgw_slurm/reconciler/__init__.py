"""The reconciler: keeps each catalog model at the right number of replicas.

:class:`~llmgw_slurm.reconciler.core.Reconciler` builds the parts over one
replica table (:mod:`~llmgw_slurm.reconciler.replicas`): the router's
directory (:mod:`~llmgw_slurm.reconciler.directory`), the agents' reports
(:mod:`~llmgw_slurm.reconciler.reports`, :mod:`~llmgw_slurm.reconciler.intake`,
:mod:`~llmgw_slurm.reconciler.probes`, :mod:`~llmgw_slurm.reconciler.reportroute`),
the pass loop (:mod:`~llmgw_slurm.reconciler.core`) with its pure plan
(:mod:`~llmgw_slurm.reconciler.plan`), the jobs it submits
(:mod:`~llmgw_slurm.reconciler.jobs`, and :mod:`~llmgw_slurm.reconciler.svcjobs`
for model jobs and engine installs), the clusters
(:mod:`~llmgw_slurm.reconciler.clusters`), the fence
(:mod:`~llmgw_slurm.reconciler.fence`), admin requests
(:mod:`~llmgw_slurm.reconciler.admin`), status
(:mod:`~llmgw_slurm.reconciler.status`) and spans
(:mod:`~llmgw_slurm.reconciler.spans`). docs/architecture.md, "Inside the
reconciler", draws them.

Of the gateway it knows the directory protocol's value types alone: the
router sees the reconciler only as a ``ModelDirectory``.

May import: base, guard, slurm, catalog, sbatch, config, auth, tracing, router.directory.
"""
