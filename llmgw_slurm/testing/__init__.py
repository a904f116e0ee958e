"""Helpers for tests and benchmarks: a deterministic OpenAI-compatible engine.

:mod:`~llmgw_slurm.testing.engine` serves what a catalog's ``command``
engine would, on the CPU, in the Slurm tests and the benchmarks. Nothing in
the package imports it.

May import: agent.
"""
