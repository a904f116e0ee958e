"""``llmgw``: what a researcher runs to find, start and try models."""

from __future__ import annotations

import click

from llmgw_slurm import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw")
def main() -> None:
    """Use the site's LLMs through the llmgw-slurm gateway."""
