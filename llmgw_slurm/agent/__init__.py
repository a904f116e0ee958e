"""The job side: what runs inside a replica's Slurm job (``llmgw-agent``).

- :mod:`~llmgw_slurm.agent.main`: the ``llmgw-agent`` command (``run``,
  ``fetch``, ``batch``, ``install``), run by the job scripts as
  ``python -m llmgw_slurm.agent.main``; it reads agent.yaml into
  :class:`llmgw_slurm.config.AgentConfig`, lays the command-line options
  over it, and hands that one type to the pieces below;
- :mod:`~llmgw_slurm.agent.runner`: a replica's steps (weights, rendezvous,
  engine, readiness, reports, drain), with :mod:`~llmgw_slurm.agent.weights`,
  :mod:`~llmgw_slurm.agent.rendezvous`, :mod:`~llmgw_slurm.agent.engine`,
  :mod:`~llmgw_slurm.agent.report` (signed reports, signed answers),
  :mod:`~llmgw_slurm.agent.portowner`, :mod:`~llmgw_slurm.agent.headwatch`
  and :mod:`~llmgw_slurm.agent.spansend`;
- :mod:`~llmgw_slurm.agent.batch`: a Batch API job's requests;
- :mod:`~llmgw_slurm.agent.install`: an engine install job.

It sees the daemon only over HTTP: of the daemon's side it imports the batch
result files alone.

May import: base, slurm, catalog, config, auth, tracing, batch.results.
"""

from llmgw_slurm.agent.errors import AgentError, EngineError, RendezvousError, WeightsError

__all__ = [
    "AgentError",
    "EngineError",
    "RendezvousError",
    "WeightsError",
]
