"""Command-line entry points: ``llmgw`` (researchers) and ``llmgw-admin`` (admins)."""
