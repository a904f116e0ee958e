"""Traces: what a pass, a replica's start and a request did, and when.

- :mod:`~llmgw_slurm.tracing.otel`: OpenTelemetry set-up for the daemon and
  the agent (``tracing:`` in server.yaml and agent.yaml), and the
  trace-context carriers a job's environment and the weights cache hold;
- :mod:`~llmgw_slurm.tracing.store`: the daemon's recent spans, kept in
  memory and bounded, so that no collector is needed to read them;
- :mod:`~llmgw_slurm.tracing.waterfall`: a replica's start from them, where
  the seconds between the pass and serving went.

The routes that take agents' spans in and show waterfalls are
:mod:`llmgw_slurm.api.traces`. This package's own import loads nothing (the
agent loads OpenTelemetry only when tracing is on).

May import: base, config.
"""
