"""Helpers for tests and benchmarks: a deterministic OpenAI-compatible engine."""
