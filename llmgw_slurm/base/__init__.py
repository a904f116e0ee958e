"""Foundations: what every layer uses, knowing nothing of models, Slurm or HTTP.

- :mod:`~llmgw_slurm.base.errors`: every error raised on purpose, the
  hierarchy drawn once;
- :mod:`~llmgw_slurm.base.durations`: the one duration parser and formatter
  (config values, ``--since``, Slurm's time syntax);
- :mod:`~llmgw_slurm.base.fsutil`: the one atomic write and the one lock;
- :mod:`~llmgw_slurm.base.yamlsrc`: YAML that remembers where each value was
  written, and :mod:`~llmgw_slurm.base.schema`: frozen dataclasses as the
  schema of a YAML file, every error with its file and line;
- :mod:`~llmgw_slurm.base.subprocs`: feeding a child process its input;
- :mod:`~llmgw_slurm.base.sdnotify`: systemd's notification protocol, socket
  activation and log lines.

This package's own import loads nothing.

May import: nothing (the standard library and PyYAML only).
"""
