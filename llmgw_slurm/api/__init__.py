"""The daemon's own HTTP API beyond the OpenAI one, and what the operator sees.

- :mod:`~llmgw_slurm.api.routes`: ``/api/v1/status`` and ``/api/v1/usage``
  (what the CLIs read), the status page at ``/``, and the admin routes
  (drain, stop, reload, jobs) behind the admin token or the admin socket;
- :mod:`~llmgw_slurm.api.status_page`: that page, one HTML document rendered
  from ``templates/status.html.j2``;
- :mod:`~llmgw_slurm.api.charts`: what the page's charts show and
  ``/api/v1/charts`` with the same numbers, drawn by
  :mod:`~llmgw_slurm.api.svgcharts` as inline SVG, from
  :mod:`~llmgw_slurm.api.history` (the last hour per model, sampled from the
  gateway's metrics), the GPU hours of ``sacct`` and the trace store;
- :mod:`~llmgw_slurm.api.traces`: agents' spans in, a replica start's
  waterfall out.

The OpenAI routes are :mod:`llmgw_slurm.router`'s; login and a user's keys
are :mod:`llmgw_slurm.auth.login`'s; files and batches are
:mod:`llmgw_slurm.batch`'s. :mod:`llmgw_slurm.daemon` wires all of them onto
its listeners. This package's own import loads nothing.

May import: base, slurm, catalog, config, auth, tracing, accounting, router, reconciler.
"""
